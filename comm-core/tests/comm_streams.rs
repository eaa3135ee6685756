//! Collectives over device memory run on the rank's communication stream of the group,
//! as NCCL's do: a call returns once queued, before the device has run it (the ranks meet
//! on the host, as the host collectives do, but nothing waits for the device), the
//! buffers' stream waits for a non-blocking collective only when the `Work` is waited
//! for, and the emulated device's ordering checker sees the collective's accesses as the
//! communication stream's.

use std::sync::mpsc;

use ferrotron_comm_core::{
    run_local, AsyncOp, BufMut, BufRef, Buffer, Communicator, DType, Device, LentMemory, ReduceOp,
};
use ferrotron_device::{host_waits, timeline, DeviceMemory, Stream};

const LEN: usize = 4096;

/// Device memory lent whole to a collective, as tape lends a gradient bucket.
#[derive(Debug)]
struct Lent(DeviceMemory);

impl LentMemory for Lent {
    fn view(&self) -> BufRef<'_> {
        BufRef::device(&self.0, 0, LEN, DType::F32).expect("sized for LEN f32s")
    }
    fn view_mut(&mut self) -> BufMut<'_> {
        BufMut::device(&mut self.0, 0, LEN, DType::F32).expect("sized for LEN f32s")
    }
}

/// `LEN` f32s of `value` on `stream`.
fn filled(stream: &Stream, value: f32) -> ferrotron_device::Result<DeviceMemory> {
    let memory = stream.alloc(4 * LEN)?;
    let bytes: Vec<u8> = (0..LEN).flat_map(|_| value.to_ne_bytes()).collect();
    // SAFETY: the allocation holds `4 * LEN` bytes.
    unsafe { stream.upload(memory.ptr(), &bytes)? };
    Ok(memory)
}

/// `LEN` f32s of `value` on `stream`, lent.
fn lent(stream: &Stream, value: f32) -> ferrotron_device::Result<Buffer> {
    Ok(Buffer::lent(Box::new(Lent(filled(stream, value)?))))
}

/// The `LEN` f32s of `memory`, after its stream's work.
fn download(memory: &DeviceMemory) -> Vec<f32> {
    let mut bytes = vec![0u8; 4 * LEN];
    // SAFETY: every allocation here holds `4 * LEN` bytes.
    unsafe { memory.stream().download(&mut bytes, memory.ptr()) }.expect("download");
    bytes
        .chunks(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect()
}

fn read(buffer: Buffer) -> Vec<f32> {
    let lent = buffer.into_lent().expect("lent memory comes back");
    let memory = &(lent as Box<dyn std::any::Any>)
        .downcast::<Lent>()
        .expect("our own memory")
        .0;
    download(memory)
}

/// Each rank's sum of 1 and 2, and the host waits it counted: none.
fn assert_summed_without_host_waits(results: Vec<(Vec<f32>, u64)>) {
    for (rank, (sum, waited)) in results.into_iter().enumerate() {
        assert!(
            sum.iter().all(|&x| x == 3.0),
            "rank {rank}: {:?}",
            &sum[..4]
        );
        assert_eq!(waited, 0, "rank {rank} waited on the host");
    }
}

/// Holds `stream` until the returned sender is used (or dropped): a call queued after
/// the hold cannot have run while it lasts.
fn hold(stream: &Stream) -> ferrotron_device::Result<mpsc::Sender<()>> {
    let (release, held) = mpsc::channel::<()>();
    stream.queue_host("hold", &[], move || {
        let _ = held.recv();
    })?;
    Ok(release)
}

#[test]
fn start_returns_before_the_device_runs_it_and_the_host_never_waits() {
    // Each rank's buffer stream is held until its `start` has returned: a `start` that
    // waited for the collective to run would never return.
    let sums = run_local(2, |comm| -> anyhow::Result<(Vec<f32>, u64)> {
        let stream = Stream::new(Device::Emulated)?;
        let buf = lent(&stream, comm.rank() as f32 + 1.0)?;
        stream.synchronize()?;
        let waits = host_waits(Device::Emulated);
        let release = hold(&stream)?;
        let work = comm.start(AsyncOp::AllReduce {
            buf,
            op: ReduceOp::Sum,
        })?;
        release.send(())?;
        let buf = work.wait()?;
        let waited = host_waits(Device::Emulated) - waits;
        Ok((read(buf), waited))
    })
    .unwrap();
    assert_summed_without_host_waits(sums);
}

#[test]
fn reading_a_buffer_before_its_collective_is_waited_for_is_an_ordering_error() {
    run_local(2, |comm| -> anyhow::Result<()> {
        let stream = Stream::new(Device::Emulated)?;
        let buf = lent(&stream, 1.0)?;
        // The emulated device's memory is host memory: its first element's address.
        let address = (buf.as_buf_ref().as_host_slice::<f32>())
            .map(|s| s.as_ptr() as u64)
            .expect("emulated memory is host memory");
        let scratch = stream.alloc(4 * LEN)?;
        let work = comm.start(AsyncOp::AllReduce {
            buf,
            op: ReduceOp::Sum,
        })?;
        // The buffer's own stream reads it while the communication stream may still be
        // writing it: nothing orders the two.
        // SAFETY: both ranges hold `4 * LEN` bytes and stay allocated until the end.
        let early = unsafe { stream.copy(scratch.ptr(), address, 4 * LEN) };
        let error = early
            .expect_err("an unordered read must be reported")
            .to_string();
        assert!(
            error.contains("unordered") && error.contains("all_reduce"),
            "{error}"
        );
        // Waiting for the work orders the stream after the collective.
        let buf = work.wait()?;
        // SAFETY: as above.
        unsafe { stream.copy(scratch.ptr(), address, 4 * LEN) }?;
        assert!(read(buf).iter().all(|&x| x == 2.0));
        Ok(())
    })
    .unwrap();
}

/// A blocking collective over device memory is queued as NCCL queues one, with its
/// buffer's stream waiting for it at once: it returns before the device has run it, the
/// host waits for nothing, and the stream's work before and after it is ordered around it
/// only by the waits between the streams (without them, the checker names the call).
#[test]
fn a_blocking_collective_is_queued_between_its_streams_work() {
    let results = run_local(2, |comm| -> anyhow::Result<(Vec<f32>, u64)> {
        let stream = Stream::new(Device::Emulated)?;
        let source = filled(&stream, comm.rank() as f32 + 1.0)?;
        let (mut reduced, result) = (stream.alloc(4 * LEN)?, stream.alloc(4 * LEN)?);
        let waits = host_waits(Device::Emulated);
        let release = hold(&stream)?;
        // Written by the stream, reduced on the communication stream, read by the stream.
        // SAFETY: every allocation holds `4 * LEN` bytes and outlives the stream's work.
        unsafe { stream.copy(reduced.ptr(), source.ptr(), 4 * LEN)? };
        let view = BufMut::device(&mut reduced, 0, LEN, DType::F32)?;
        let queued = comm.all_reduce(view, ReduceOp::Sum);
        // Also when the call failed: the stream must not be held forever.
        release.send(())?;
        queued?;
        // SAFETY: as above.
        unsafe { stream.copy(result.ptr(), reduced.ptr(), 4 * LEN)? };
        let waited = host_waits(Device::Emulated) - waits;
        Ok((download(&result), waited))
    })
    .unwrap();
    assert_summed_without_host_waits(results);
}

/// `LEN` zeros that a copy queued on `stream` writes (an upload would be ordered by the
/// host, hiding a missing stream wait from the checker), lent.
fn written_on(stream: &Stream) -> ferrotron_device::Result<Buffer> {
    let zeros = filled(stream, 0.0)?;
    let memory = stream.alloc(4 * LEN)?;
    // SAFETY: both allocations hold `4 * LEN` bytes.
    unsafe { stream.copy(memory.ptr(), zeros.ptr(), 4 * LEN)? };
    Ok(Buffer::lent(Box::new(Lent(memory))))
}

/// Rank 0 sends `LEN` ones to rank 1, which receives them into memory of its stream
/// either posted ahead (`irecv` before a long kernel on that stream, waited for after)
/// or when needed (`recv` after the kernel). Returns rank 1's values and the share of its
/// communication stream's time that the kernel covers on the modelled timeline.
fn receive_around_a_kernel(
    comm: &dyn Communicator,
    posted_ahead: bool,
) -> ferrotron_comm_core::Result<(Vec<f32>, Option<f64>)> {
    let stream = Stream::new(Device::Emulated)?;
    if comm.rank() == 0 {
        let ones = filled(&stream, 1.0)?;
        comm.send(BufRef::device(&ones, 0, LEN, DType::F32)?, 1)?;
        return Ok((download(&ones), None));
    }
    let mut landing = written_on(&stream)?;
    timeline::start();
    let posted = posted_ahead.then(|| comm.irecv(landing, 0)).transpose()?;
    // Work that does not touch the landing memory: a kernel of a modelled millisecond.
    let scratch = stream.alloc(8)?;
    timeline::charge_kernel(0, 600_000_000_000);
    // SAFETY: both halves lie in the 8-byte allocation.
    unsafe { stream.copy(scratch.ptr(), scratch.ptr() + 4, 4)? };
    let received = match posted {
        Some(work) => work.wait()?.expect("a receive gives its buffer back"),
        None => {
            landing = written_on(&stream)?;
            comm.recv(landing.as_buf_mut(), 0)?;
            landing
        }
    };
    let covered = timeline::finish().hidden_fraction();
    Ok((read(received), covered))
}

/// A receive posted ahead lands as soon as its memory's stream has run what came before
/// the post and the sender's copy is made, beside the work queued after the post; one
/// made when needed waits for that work. Either way the stream reads it only after it
/// landed (the checker would name the read otherwise).
#[test]
fn a_receive_posted_ahead_lands_beside_the_work_queued_after_it() {
    for (posted_ahead, covered) in [(true, 1.0), (false, 0.0)] {
        let results = run_local(2, |comm| receive_around_a_kernel(&comm, posted_ahead)).unwrap();
        assert_eq!(results[1].0, vec![1.0; LEN], "posted ahead: {posted_ahead}");
        assert_eq!(results[1].1, Some(covered), "posted ahead: {posted_ahead}");
    }
}
