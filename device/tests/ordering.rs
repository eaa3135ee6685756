//! The emulated device's ordering checker: accesses that a GPU could run out of order
//! are errors naming both calls, their streams and the memory; the same accesses ordered
//! by an event, by stream order or by a host wait pass.

use std::ffi::c_void;

use ferrotron_device::{host_access, Access, Device, Error, Function, KernelArg, Stream};

/// `dst[i] = src[i] + 1` over `len` f32s: a kernel's host build.
#[repr(C)]
#[derive(Clone, Copy)]
struct AddOne {
    dst: u64,
    src: u64,
    len: u64,
}

// SAFETY: a #[repr(C)] struct of scalars, read by `add_one` as such.
unsafe impl KernelArg for AddOne {}

unsafe extern "C" fn add_one(args: *const c_void) {
    // SAFETY: the launch passes an `AddOne` whose pointers hold `len` f32s each.
    unsafe {
        let args = &*args.cast::<AddOne>();
        for i in 0..args.len as usize {
            *(args.dst as *mut f32).add(i) = *(args.src as *const f32).add(i) + 1.0;
        }
    }
}

const LEN: usize = 4;
const BYTES: usize = 4 * LEN;

/// Runs `add_one` from `src` into `dst` on `stream`, declaring what it reads and writes.
fn add(stream: &Stream, dst: u64, src: u64) -> ferrotron_device::Result<()> {
    let args = AddOne {
        dst,
        src,
        len: LEN as u64,
    };
    let accesses = [Access::read(src, BYTES), Access::write(dst, BYTES)];
    // SAFETY: both addresses are allocations of `BYTES` bytes on the stream's device.
    unsafe {
        stream.launch(
            &Function::host("add_one", add_one),
            LEN,
            &[&args],
            &accesses,
        )
    }
}

fn two_streams() -> ferrotron_device::Result<(Stream, Stream)> {
    Ok((
        Stream::new(Device::Emulated)?,
        Stream::new(Device::Emulated)?,
    ))
}

fn unordered(result: ferrotron_device::Result<()>) -> String {
    match result {
        Err(error @ Error::Unordered { .. }) => error.to_string(),
        other => panic!("expected an unordered access, got {other:?}"),
    }
}

#[test]
fn a_kernel_reading_what_another_stream_writes_needs_an_event_wait() -> ferrotron_device::Result<()>
{
    let (producer, consumer) = two_streams()?;
    let (input, output) = (producer.alloc(BYTES)?, producer.alloc(BYTES)?);
    // `output` is allocated on the producer: the consumer may use it once it waited.
    consumer.wait(&producer.record()?)?;
    // SAFETY: `input` holds BYTES bytes.
    unsafe { producer.upload(input.ptr(), &[0; BYTES])? };
    add(&producer, input.ptr(), input.ptr())?;
    // The consumer reads what the producer's kernel wrote, without waiting for it.
    let message = unordered(add(&consumer, output.ptr(), input.ptr()));
    for part in [
        "`add_one` on emulated stream",
        "writing bytes 0..16",
        "reading bytes 0..16",
    ] {
        assert!(message.contains(part), "{message}");
    }
    // The same read after an event recorded behind the write: ordered.
    consumer.wait(&producer.record()?)?;
    add(&consumer, output.ptr(), input.ptr())?;
    Ok(())
}

#[test]
fn reads_never_conflict_and_one_stream_is_ordered_by_itself() -> ferrotron_device::Result<()> {
    let (first, second) = two_streams()?;
    let shared = first.alloc(BYTES)?;
    let (a, b) = (first.alloc(BYTES)?, first.alloc(BYTES)?);
    second.wait(&first.record()?)?;
    add(&first, a.ptr(), shared.ptr())?;
    add(&second, b.ptr(), shared.ptr())?; // two readers at once: fine
                                          // Overwriting what the other stream may still be reading is not.
    let message = unordered(add(&first, shared.ptr(), a.ptr()));
    assert!(message.contains("emulated device memory #"), "{message}");
    assert!(message.contains("reading bytes 0..16"), "{message}");
    Ok(())
}

#[test]
fn ordering_is_transitive_through_events_of_other_streams() -> ferrotron_device::Result<()> {
    let streams = [
        Stream::new(Device::Emulated)?,
        Stream::new(Device::Emulated)?,
        Stream::new(Device::Emulated)?,
    ];
    let memory = streams[0].alloc(BYTES)?;
    let other = streams[0].alloc(BYTES)?;
    add(&streams[0], memory.ptr(), other.ptr())?;
    // 0 → 1 → 2: the third stream waits only for the second, which waited for the first.
    streams[1].wait(&streams[0].record()?)?;
    streams[2].wait(&streams[1].record()?)?;
    add(&streams[2], other.ptr(), memory.ptr())?;
    Ok(())
}

#[test]
fn the_host_must_wait_before_it_touches_device_work() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let (a, b) = (stream.alloc(BYTES)?, stream.alloc(BYTES)?);
    add(&stream, a.ptr(), b.ptr())?;
    let read = [Access::read(a.ptr(), BYTES)];
    let message = unordered(host_access("host read", &read));
    assert!(message.contains("`host read` on host thread"), "{message}");
    // A host wait orders it; so does finding an event complete.
    stream.synchronize()?;
    host_access("host read", &read)?;
    add(&stream, a.ptr(), b.ptr())?;
    let done = stream.record()?;
    // The worker runs the kernel while the host goes on: poll until it has.
    while !done.is_complete()? {
        std::thread::yield_now();
    }
    host_access("host read", &read)?;
    // Work queued after a host write is ordered after it.
    host_access("host write", &[Access::write(b.ptr(), BYTES)])?;
    add(&stream, a.ptr(), b.ptr())?;
    Ok(())
}

#[test]
fn an_unordered_free_is_the_freeing_streams_next_error() -> ferrotron_device::Result<()> {
    let (owner, user) = two_streams()?;
    let memory = owner.alloc(BYTES)?;
    let scratch = user.alloc(BYTES)?;
    user.wait(&owner.record()?)?;
    add(&user, scratch.ptr(), memory.ptr())?;
    // Freed on its own stream while the other stream's read may still run.
    drop(memory);
    let message = unordered(owner.synchronize());
    assert!(message.contains("`free` on emulated stream"), "{message}");
    // Reported once; the same free after the owner waited for the user is fine.
    owner.synchronize()?;
    let memory = owner.alloc(BYTES)?;
    user.wait(&owner.record()?)?;
    add(&user, scratch.ptr(), memory.ptr())?;
    owner.wait(&user.record()?)?;
    drop(memory);
    owner.synchronize()?;
    Ok(())
}

/// A receiver frees what another stream made on its own stream, after its own use: the
/// owner's stream never waits for the user's. Freed before the user saw the owner's
/// writes, it is the user's error.
#[test]
fn memory_freed_on_another_stream_follows_that_streams_order() -> ferrotron_device::Result<()> {
    let (owner, user) = two_streams()?;
    let scratch = user.alloc(BYTES)?;
    let memory = owner.alloc(BYTES)?;
    user.wait(&owner.record()?)?;
    add(&user, scratch.ptr(), memory.ptr())?;
    // SAFETY: the user's read is the memory's last use, queued on the freeing stream.
    unsafe { memory.free_on(&user)? };
    owner.synchronize()?;
    user.synchronize()?;
    // The owner's later work is not the user's: freeing there without a wait is reported.
    let memory = owner.alloc(BYTES)?;
    add(&owner, memory.ptr(), memory.ptr())?;
    // SAFETY: not met, on purpose: the emulated device reports it and leaks the memory.
    unsafe { memory.free_on(&user)? };
    let message = unordered(user.synchronize());
    assert!(message.contains("`free` on emulated stream"), "{message}");
    Ok(())
}

#[test]
fn memory_is_used_on_another_stream_only_after_its_allocation() -> ferrotron_device::Result<()> {
    let (owner, user) = two_streams()?;
    let (memory, scratch) = (owner.alloc(BYTES)?, user.alloc(BYTES)?);
    let message = unordered(add(&user, scratch.ptr(), memory.ptr()));
    assert!(message.contains("`alloc`"), "{message}");
    Ok(())
}

#[test]
fn an_access_past_the_allocation_is_refused() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let memory = stream.alloc(BYTES)?;
    let error = stream
        .declare("read too far", &[Access::read(memory.ptr() + 8, BYTES)])
        .unwrap_err();
    assert!(error.to_string().contains("is past the end of"), "{error}");
    Ok(())
}

/// A data-parallel bucket as a GPU runs it: the compute stream fills it, the
/// communication stream reduces it in place after an event, and the compute stream uses
/// the result after the collective's event. Dropping either wait is reported.
#[test]
fn a_bucket_reduction_without_its_waits_is_reported() -> ferrotron_device::Result<()> {
    let (compute, comm) = two_streams()?;
    let (bucket, weights) = (compute.alloc(BYTES)?, compute.alloc(BYTES)?);
    let reduce = |wait_before: bool| -> ferrotron_device::Result<()> {
        add(&compute, bucket.ptr(), weights.ptr())?; // backward writes the gradients
        if wait_before {
            comm.wait(&compute.record()?)?;
        }
        comm.declare("all_reduce", &[Access::write(bucket.ptr(), BYTES)])
    };
    let update = |wait_after: bool| -> ferrotron_device::Result<()> {
        if wait_after {
            compute.wait(&comm.record()?)?;
        }
        add(&compute, weights.ptr(), bucket.ptr()) // the optimizer reads the average
    };
    reduce(true)?;
    update(true)?;
    assert!(unordered(reduce(false)).contains("`all_reduce`"));
    compute.wait(&comm.record()?)?;
    reduce(true)?;
    assert!(unordered(update(false)).contains("`all_reduce`"));
    Ok(())
}
