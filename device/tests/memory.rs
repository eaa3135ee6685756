//! Device memory on the emulated device: allocations returned when dropped, copies in
//! both directions and within the device, and the transfer counters.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use device::{host_waits, transfers, Device, Stream};

/// Live bytes the host allocator has handed out to this thread (emulated memory is host
/// memory), so that tests running beside each other do not count each other's.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn live() -> isize {
    LIVE.with(Cell::get)
}

/// Allocations of at least 1 KiB this thread has made so far: buffers, not the few bytes
/// an event's clock takes for the ordering checker.
fn allocations() -> usize {
    ALLOCATIONS.with(Cell::get)
}

// SAFETY: forwards to the system allocator, only counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.with(|live| live.set(live.get() + layout.size() as isize));
        if layout.size() >= 1024 {
            ALLOCATIONS.with(|n| n.set(n.get() + 1));
        }
        // SAFETY: as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.with(|live| live.set(live.get() - layout.size() as isize));
        // SAFETY: as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[test]
fn an_allocation_is_returned_when_its_memory_is_dropped() -> device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let before = live();
    let memory = stream.alloc(1 << 20)?;
    assert!(live() - before >= 1 << 20);
    assert_eq!(
        (memory.bytes(), memory.device()),
        (1 << 20, Device::Emulated)
    );
    assert!(memory.stream().same_as(&stream));
    drop(memory);
    // All of it, give or take the ordering checker's bookkeeping, which lives in maps
    // shared with other threads' tests.
    assert!((live() - before).abs() < 4096, "{} bytes", live() - before);
    Ok(())
}

#[test]
fn copies_in_both_directions_and_within_the_device() -> device::Result<()> {
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
fn an_allocation_of_zero_bytes_has_a_valid_address() -> device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let memory = stream.alloc(0)?;
    assert_ne!(memory.ptr(), 0);
    assert_eq!(memory.bytes(), 0);
    Ok(())
}

/// Pinned copies are queued without a host wait and counted as transfers; the host waits
/// (if at all) only when it reads the bytes; copies that do not fit are refused.
#[test]
fn pinned_copies_queue_without_host_waits() -> device::Result<()> {
    use device::{host_waits, transfers, PinnedMemory};
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
/// host wait; the data is there for work queued after it, and the staging buffer is reused
/// (the pool allocates nothing after the first upload).
#[test]
fn staged_uploads_do_not_wait() -> device::Result<()> {
    let stream = Stream::new(Device::Emulated)?;
    let memory = stream.alloc(5000)?;
    // SAFETY: the allocation holds 5000 bytes. The first upload makes the pool's buffer.
    unsafe { stream.upload_staged(memory.ptr(), &[0u8; 5000])? };
    let (waits, moved, before, made) = (
        host_waits(Device::Emulated),
        transfers(Device::Emulated),
        live(),
        allocations(),
    );
    for round in 0..40u8 {
        let mut source = vec![round; 5000];
        // SAFETY: as above.
        unsafe { stream.upload_staged(memory.ptr(), &source)? };
        // The caller's bytes are free at once: the staging copy was taken.
        source.fill(255);
    }
    assert_eq!(host_waits(Device::Emulated), waits);
    // Every later upload reused that buffer: the only allocations were the sources.
    assert_eq!((live(), allocations() - made), (before, 40));
    let copied = transfers(Device::Emulated) - moved;
    assert_eq!(
        (copied.to_device_copies, copied.to_device_bytes),
        (40, 40 * 5000)
    );
    let mut back = vec![0u8; 5000];
    // SAFETY: as above.
    unsafe { stream.download(&mut back, memory.ptr())? };
    assert!(back.iter().all(|&b| b == 39));
    Ok(())
}
