//! Device memory on the emulated device: allocations returned when dropped, copies in
//! both directions and within the device, and the transfer counters.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicIsize, Ordering};

use ferrotron_device::{host_waits, transfers, Device, Stream};

/// Counts what the host allocator hands out (emulated memory is host memory): per thread
/// where tests running beside each other must not count each other's.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

/// Allocations of at least 4 KiB this thread has made so far: buffers, not the bookkeeping
/// of the ordering checker and of the streams' queues.
fn allocations() -> usize {
    ALLOCATIONS.with(Cell::get)
}

/// Live bytes in allocations of exactly [`MARKED`] bytes, over all threads (one test
/// frees on a thread of its own), and only one test allocates that size.
static MARKED_LIVE: AtomicIsize = AtomicIsize::new(0);
const MARKED: usize = (1 << 20) + 48;

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.size() == MARKED {
            MARKED_LIVE.fetch_add(layout.size() as isize, Ordering::SeqCst);
        }
        if layout.size() >= 4096 {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() == MARKED {
            MARKED_LIVE.fetch_sub(layout.size() as isize, Ordering::SeqCst);
        }
        // SAFETY: as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn an_allocation_is_returned_in_its_streams_order_when_its_memory_is_dropped(
) -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let large = || MARKED_LIVE.load(Ordering::SeqCst);
    let before = large();
    let memory = stream.alloc(MARKED)?;
    assert_eq!(large() - before, MARKED as isize);
    assert_eq!(
        (memory.bytes(), memory.device()),
        (MARKED, Device::Emulated)
    );
    assert!(memory.stream().same_as(&stream));
    // Freed in the stream's order: not while a call queued before the free (which could
    // still read the memory) has not run...
    let (open, gate) = std::sync::mpsc::channel::<()>();
    stream.queue_host("hold", &[], move || {
        let _ = gate.recv();
    })?;
    let freeing = std::thread::spawn(move || drop(memory));
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(large() - before, MARKED as isize);
    // ...and all of it once the stream has run.
    drop(open);
    freeing.join().expect("the free does not panic");
    stream.synchronize()?;
    assert_eq!(large(), before);
    Ok(())
}

#[test]
fn copies_in_both_directions_and_within_the_device() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let (a, b) = (stream.alloc(8)?, stream.alloc(8)?);
    let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
    let (moved, waited) = (transfers(Device::Emulated), host_waits(Device::Emulated));
    let mut back = [0u8; 8];
    // SAFETY: both allocations hold 8 bytes.
    unsafe {
        stream.upload(a.ptr(), &data)?;
        stream.copy(b.ptr(), a.ptr(), 8)?;
        stream.download(&mut back, b.ptr())?;
    }
    assert_eq!(back, data);
    let moved = transfers(Device::Emulated) - moved;
    assert_eq!(
        (moved.to_device_copies, moved.to_device_bytes),
        (1, 8),
        "one upload"
    );
    assert_eq!((moved.to_host_copies, moved.to_host_bytes), (1, 8));
    // The upload and the download each waited; the device-to-device copy did not.
    assert_eq!(host_waits(Device::Emulated) - waited, 2);
    Ok(())
}

#[test]
fn an_allocation_of_zero_bytes_has_a_valid_address() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let memory = stream.alloc(0)?;
    assert_ne!(memory.ptr(), 0);
    assert_eq!(memory.bytes(), 0);
    Ok(())
}

/// Pinned copies are queued without a host wait and counted as transfers; the host waits
/// (if at all) only when it reads the bytes; copies that do not fit are refused.
#[test]
fn pinned_copies_queue_without_host_waits() -> ferrotron_device::Result<()> {
    use ferrotron_device::{host_waits, transfers, PinnedMemory};
    let stream = Stream::new(Device::Emulated)?;
    let memory = stream.alloc(8)?;
    let mut outgoing = PinnedMemory::new(Device::Emulated, 8)?;
    assert_eq!(outgoing.as_slice()?, &[0u8; 8]);
    outgoing
        .as_mut_slice()?
        .copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
    let mut incoming = PinnedMemory::new(Device::Emulated, 16)?;
    let (waits, moved) = (host_waits(Device::Emulated), transfers(Device::Emulated));
    // SAFETY: the allocation holds 8 bytes.
    unsafe {
        stream.upload_pinned(memory.ptr(), &outgoing, 8)?;
        stream.download_pinned(&mut incoming, memory.ptr(), 8)?;
    }
    assert_eq!(host_waits(Device::Emulated), waits);
    let copied = transfers(Device::Emulated) - moved;
    assert_eq!((copied.to_device_bytes, copied.to_host_bytes), (8, 8));
    assert_eq!(&incoming.as_slice()?[..8], &[1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(incoming.bytes(), 16);
    // SAFETY: refused before any copy.
    let error = unsafe { stream.upload_pinned(memory.ptr(), &outgoing, 9) }.unwrap_err();
    assert!(error.to_string().contains("do not fit 8 bytes"), "{error}");
    assert!(PinnedMemory::new(Device::Cpu, 8).is_err());
    Ok(())
}

/// A staged upload takes its copy of the source at once and queues the transfer without a
/// host wait; the data is there for work queued after it, and a staging buffer whose copy
/// has run is reused (the pool allocates nothing new then).
#[test]
fn staged_uploads_do_not_wait() -> ferrotron_device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let memory = stream.alloc(5000)?;
    // SAFETY: the allocation holds 5000 bytes. The first upload makes the pool's buffer.
    unsafe { stream.upload_staged(memory.ptr(), &[0u8; 5000])? };
    let (waits, moved) = (host_waits(Device::Emulated), transfers(Device::Emulated));
    for round in 0..40u8 {
        let mut source = vec![round; 5000];
        // SAFETY: as above.
        unsafe { stream.upload_staged(memory.ptr(), &source)? };
        // The caller's bytes are free at once: the staging copy was taken.
        source.fill(255);
    }
    assert_eq!(host_waits(Device::Emulated), waits);
    // A buffer still in flight is not reused, so the pool may have grown meanwhile (the
    // stream's worker runs behind the host); once the copies have run, every upload reuses
    // one: the only allocations are the sources.
    stream.synchronize()?;
    let made = allocations();
    for round in 0..40u8 {
        // SAFETY: as above.
        unsafe { stream.upload_staged(memory.ptr(), &vec![round; 5000])? };
        stream.synchronize()?;
    }
    // (The queued copies' few bytes of bookkeeping are freed by the worker, on its thread.)
    assert_eq!(allocations() - made, 40);
    let copied = transfers(Device::Emulated) - moved;
    assert_eq!(
        (copied.to_device_copies, copied.to_device_bytes),
        (80, 80 * 5000)
    );
    let mut back = vec![0u8; 5000];
    // SAFETY: as above.
    unsafe { stream.download(&mut back, memory.ptr())? };
    assert!(back.iter().all(|&b| b == 39));
    Ok(())
}

#[test]
fn device_memory_is_counted_against_the_thread_that_allocated_it() {
    use ferrotron_device::{device_memory, reset_device_peak, Device, Stream};
    let stream = Stream::new(Device::Emulated).unwrap();
    let before = device_memory(Device::Emulated);
    reset_device_peak(Device::Emulated);
    let a = stream.alloc(1000).unwrap();
    let b = stream.alloc(24).unwrap();
    let held = device_memory(Device::Emulated);
    assert_eq!(held.live - before.live, 1024);
    assert_eq!(held.peak - before.live, 1024);
    drop(b);
    // Freed on another thread, still given back to this one's count.
    std::thread::spawn(move || drop(a)).join().unwrap();
    let after = device_memory(Device::Emulated);
    assert_eq!(after.live, before.live);
    assert_eq!(after.peak - before.live, 1024, "the peak stays until reset");
    // Another thread's allocations are its own.
    std::thread::spawn(move || {
        let _c = stream.alloc(64).unwrap();
        assert_eq!(device_memory(Device::Emulated).live, 64);
    })
    .join()
    .unwrap();
    assert_eq!(device_memory(Device::Emulated).live, before.live);
    reset_device_peak(Device::Emulated);
    assert_eq!(device_memory(Device::Emulated).peak, before.live);
}
