//! The emulated device runs each stream's calls on a worker thread, as a GPU runs them
//! behind the host: the host returns from a call before it has run, host waits block until
//! it has, a stream waiting for another's event holds its own worker and not the host, and
//! a call that panics breaks the stream with an error instead of hanging the host. (Frees
//! in the stream's order: `memory.rs`, which counts allocations.)

use std::sync::mpsc;
use std::time::Duration;

use ferrotron_device::{host_waits, Access, Device, Error, Stream};

/// Queues a call on `stream` that holds its worker until the returned sender is dropped
/// or sent to.
fn hold(stream: &Stream) -> ferrotron_device::Result<mpsc::Sender<()>> {
    let (open, gate) = mpsc::channel::<()>();
    stream.queue_host("hold", &[], move || {
        let _ = gate.recv();
    })?;
    Ok(open)
}

/// Queues a copy of 4 bytes from `src` to `dst` on `stream`.
fn copy(stream: &Stream, dst: u64, src: u64) -> ferrotron_device::Result<()> {
    // SAFETY: every caller passes 4-byte allocations alive until the stream has run.
    unsafe { stream.copy(dst, src, 4) }
}

fn read(stream: &Stream, memory: u64) -> ferrotron_device::Result<[u8; 4]> {
    let mut back = [0u8; 4];
    // SAFETY: a 4-byte allocation.
    unsafe { stream.download(&mut back, memory)? };
    Ok(back)
}

#[test]
fn the_host_runs_ahead_of_a_stream_and_waits_for_it_only_when_asked() -> ferrotron_device::Result<()>
{
    let stream = Stream::new(Device::Emulated)?;
    let (a, b) = (stream.alloc(4)?, stream.alloc(4)?);
    // SAFETY: both hold 4 bytes.
    unsafe {
        stream.upload(a.ptr(), &[1, 2, 3, 4])?;
        stream.upload(b.ptr(), &[0; 4])?;
    }
    let open = hold(&stream)?;
    copy(&stream, b.ptr(), a.ptr())?;
    let copied = stream.record()?;
    // The copy is queued behind the held call: the host got here without it.
    std::thread::sleep(Duration::from_millis(20));
    assert!(!copied.is_complete()?);
    drop(open);
    let waits = host_waits(Device::Emulated);
    copied.synchronize()?;
    assert!(copied.is_complete()?);
    assert_eq!(host_waits(Device::Emulated), waits + 1);
    assert_eq!(read(&stream, b.ptr())?, [1, 2, 3, 4]);
    Ok(())
}

#[test]
fn a_stream_waiting_for_an_event_holds_its_worker_not_the_host() -> ferrotron_device::Result<()> {
    let (first, second) = (
        Stream::new(Device::Emulated)?,
        Stream::new(Device::Emulated)?,
    );
    let (a, b) = (first.alloc(4)?, first.alloc(4)?);
    // SAFETY: both hold 4 bytes.
    unsafe {
        first.upload(a.ptr(), &[0; 4])?;
        first.upload(b.ptr(), &[0; 4])?;
    }
    let open = hold(&first)?;
    // A write of `a` on the first stream, behind the held call...
    let source = [9u8, 8, 7, 6];
    let dst = a.ptr() as usize;
    first.queue_host("write", &[Access::write(a.ptr(), 4)], move || {
        // SAFETY: `a` holds 4 bytes and outlives the streams' work (synchronized below).
        unsafe { std::ptr::copy_nonoverlapping(source.as_ptr(), dst as *mut u8, 4) }
    })?;
    // ...and a copy of it on the second stream, which waits on the device for it.
    second.wait(&first.record()?)?;
    copy(&second, b.ptr(), a.ptr())?;
    let done = second.record()?;
    std::thread::sleep(Duration::from_millis(20));
    assert!(!done.is_complete()?, "the second stream ran past its wait");
    drop(open);
    done.synchronize()?;
    assert_eq!(read(&second, b.ptr())?, source);
    first.synchronize()?;
    Ok(())
}

#[test]
fn a_call_that_panics_breaks_the_stream_instead_of_hanging_the_host() -> ferrotron_device::Result<()>
{
    let stream = Stream::new(Device::Emulated)?;
    stream.queue_host("panics", &[], || panic!("a host build failed"))?;
    let error = stream.synchronize().unwrap_err();
    assert!(
        matches!(&error, Error::Driver { message, .. } if message.contains("a host build failed")),
        "{error}"
    );
    // Every later wait says so too.
    assert!(stream.record()?.synchronize().is_err());
    Ok(())
}

#[test]
fn memory_a_queued_call_owns_is_freed_there_and_a_call_cannot_wait_for_its_own_stream(
) -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let memory = stream.alloc(4)?;
    let (said, heard) = mpsc::channel();
    let same = stream.clone();
    stream.queue_host("owns", &[], move || {
        // Freed on the stream's own worker: at once, not by waiting for itself.
        drop(memory);
        // Waiting for its own stream would never end: an error instead.
        let waited = same.record().and_then(|event| event.synchronize());
        let _ = said.send(waited.is_err());
    })?;
    let refused = heard
        .recv_timeout(Duration::from_secs(10))
        .expect("the queued call finished instead of waiting for itself");
    assert!(refused);
    stream.synchronize()
}

#[test]
fn a_stream_waiting_for_a_broken_stream_breaks_too() -> ferrotron_device::Result<()> {
    let (first, second) = (
        Stream::new(Device::Emulated)?,
        Stream::new(Device::Emulated)?,
    );
    first.queue_host("panics", &[], || panic!("a host build failed"))?;
    // Queued behind the panic: dropped unrun.
    let (ran, _) = (
        std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)),
        (),
    );
    let flag = ran.clone();
    first.queue_host("after", &[], move || {
        flag.store(true, std::sync::atomic::Ordering::SeqCst)
    })?;
    second.wait(&first.record()?)?;
    assert!(first.synchronize().is_err());
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    let error = second.synchronize().unwrap_err();
    assert!(error.to_string().contains("a host build failed"), "{error}");
    Ok(())
}
