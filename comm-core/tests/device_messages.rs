//! Point-to-point messages between views of device memory (`BufRef::device`) stay on
//! the device: the local backend copies them on the streams, with no host transfer and no
//! host wait (the sender's copy into the message on its buffer's stream, the transfer
//! into the receiver's memory on the group's communication stream, as NCCL's transfers
//! run on its own), and orders the receiver's streams after the sender's copy (which the
//! emulated device's ordering checker verifies).

use ferrotron_comm_core::{
    inject_missing_receive_wait, run_local, BufMut, BufRef, Communicator, DType, Device, Error, P2p,
};
use ferrotron_device::{host_waits, timeline, transfers, DeviceMemory, Role, Stream};

const LEN: usize = 64;

/// `LEN` f32s of `value` in emulated memory allocated on `stream`.
fn filled(stream: &Stream, value: f32) -> ferrotron_device::Result<DeviceMemory> {
    let memory = stream.alloc(4 * LEN)?;
    let bytes: Vec<u8> = (0..LEN).flat_map(|_| value.to_ne_bytes()).collect();
    // SAFETY: the allocation holds `4 * LEN` bytes.
    unsafe { stream.upload(memory.ptr(), &bytes)? };
    Ok(memory)
}

fn read(memory: &DeviceMemory) -> ferrotron_device::Result<Vec<f32>> {
    let mut bytes = vec![0u8; 4 * LEN];
    // SAFETY: as in `filled`.
    unsafe { memory.stream().download(&mut bytes, memory.ptr())? };
    Ok(bytes
        .chunks(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect())
}

/// Rank 0 sends its memory to rank 1 and receives rank 1's, each rank on a stream of its
/// own (as ranks on separate GPUs are), through `exchange`. Returns what it received, the
/// bytes moved between host and device, the host waits, and the calls the group's
/// communication stream ran.
fn swap(comm: &dyn Communicator) -> ferrotron_comm_core::Result<(Vec<f32>, u64, u64, usize)> {
    let rank = comm.rank();
    let stream = Stream::new(Device::Emulated)?;
    let mine = filled(&stream, rank as f32 + 1.0)?;
    let mut theirs = filled(&stream, 0.0)?;
    stream.synchronize()?;
    let (moved, waited) = (transfers(Device::Emulated), host_waits(Device::Emulated));
    timeline::start_calls();
    let result = {
        let send = BufRef::device(&mine, 0, LEN, DType::F32)?;
        let recv = BufMut::device(&mut theirs, 0, LEN, DType::F32)?;
        comm.exchange(&mut [
            P2p::Send {
                buf: send,
                peer: 1 - rank,
            },
            P2p::Recv {
                buf: recv,
                peer: 1 - rank,
            },
        ])
    };
    let on_comm = (timeline::finish().intervals.iter())
        .filter(|call| call.role == Role::Communication && &*call.label == comm.name())
        .count();
    result?;
    let moved = transfers(Device::Emulated) - moved;
    let waits = host_waits(Device::Emulated) - waited;
    Ok((
        read(&theirs)?,
        moved.to_device_bytes + moved.to_host_bytes,
        waits,
        on_comm,
    ))
}

#[test]
fn device_messages_stay_on_the_device_and_the_host_does_not_wait() {
    let results = run_local(2, |comm| swap(&comm)).unwrap();
    for (rank, (received, bytes, waits, on_comm)) in results.into_iter().enumerate() {
        assert_eq!(received, vec![(2 - rank) as f32; LEN], "rank {rank}");
        assert_eq!(
            (bytes, waits),
            (0, 0),
            "rank {rank}: bytes moved, host waits"
        );
        // The receive's copy out of the message; the send's copy into it runs on the
        // buffer's stream.
        assert_eq!(
            on_comm, 1,
            "rank {rank}: copies on the communication stream"
        );
    }
}

/// The receive's stream wait for the sender's copy, left out on purpose: the checker
/// reports the receive, naming the sender's copy on its stream.
/// Rank 0 sends its memory to rank 1 (one way, so nothing else orders the two streams),
/// rank 1 leaving out the receive's stream wait when `skip_wait`.
fn send_one_way(comm: &dyn Communicator, skip_wait: bool) -> ferrotron_comm_core::Result<Vec<f32>> {
    let stream = Stream::new(Device::Emulated)?;
    let mut memory = filled(&stream, comm.rank() as f32 + 1.0)?;
    if comm.rank() == 0 {
        comm.send(BufRef::device(&memory, 0, LEN, DType::F32)?, 1)?;
        return read(&memory).map_err(Into::into);
    }
    inject_missing_receive_wait(skip_wait);
    let received = comm.recv(BufMut::device(&mut memory, 0, LEN, DType::F32)?, 0);
    inject_missing_receive_wait(false);
    received?;
    read(&memory).map_err(Into::into)
}

/// The receive's stream wait for the sender's copy, left out on purpose: the checker
/// reports the receive, naming the sender's copy on its stream.
#[test]
fn a_receive_without_its_stream_wait_is_reported() {
    let received = run_local(2, |comm| send_one_way(&comm, false)).unwrap();
    assert_eq!(received[1], vec![1.0; LEN], "with the wait");
    let report = std::sync::Mutex::new(None);
    let outcome = run_local(2, |comm| match send_one_way(&comm, true) {
        Err(Error::Unordered(error)) => {
            *report.lock().unwrap() = Some((comm.rank(), error.to_string()));
            Ok(())
        }
        other => other.map(drop),
    });
    // The message's free on the receiving rank's stream, after the unordered copy, is
    // unordered too (and the memory leaked): that stream reports it when the rank ends.
    match outcome {
        Err(Error::RankFailed {
            rank: 1, source, ..
        }) => assert!(
            matches!(source.downcast_ref::<Error>(), Some(Error::Unordered(_))),
            "{source}"
        ),
        other => panic!("rank 1's streams report its free: {other:?}"),
    }
    let (rank, message) = report
        .lock()
        .unwrap()
        .take()
        .expect("the receive is reported");
    assert_eq!(
        rank, 1,
        "only the receive is reported, not the sender's free"
    );
    for part in [
        "`copy` on emulated stream",
        "writing bytes 0..256",
        "reading bytes 0..256",
    ] {
        assert!(message.contains(part), "{message}");
    }
}
