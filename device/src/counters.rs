//! Counts of what crosses between host and device, so that users and tests can see what
//! a training step moves (a device-resident step moves only its batch and loss) and how
//! often the host stops to wait for a device.
//!
//! Counted per thread, on the thread that asks: ranks run as threads by the local
//! backend, or as processes, each see their own. Counting is the only state here; nothing
//! reads it but [`transfers`] and [`host_waits`].

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::Device;

/// Host↔device copies one thread has asked for on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Transfers {
    /// Bytes copied from host memory to the device.
    pub to_device_bytes: u64,
    /// Copies from host memory to the device.
    pub to_device_copies: u64,
    /// Bytes copied from the device to host memory.
    pub to_host_bytes: u64,
    /// Copies from the device to host memory.
    pub to_host_copies: u64,
}

impl std::ops::Add for Transfers {
    type Output = Transfers;

    /// Both readings' copies together (two measured spans).
    fn add(self, other: Transfers) -> Transfers {
        Transfers {
            to_device_bytes: self.to_device_bytes + other.to_device_bytes,
            to_device_copies: self.to_device_copies + other.to_device_copies,
            to_host_bytes: self.to_host_bytes + other.to_host_bytes,
            to_host_copies: self.to_host_copies + other.to_host_copies,
        }
    }
}

impl std::ops::Sub for Transfers {
    type Output = Transfers;

    /// What was copied between two readings (`later - earlier`).
    fn sub(self, earlier: Transfers) -> Transfers {
        Transfers {
            to_device_bytes: self.to_device_bytes - earlier.to_device_bytes,
            to_device_copies: self.to_device_copies - earlier.to_device_copies,
            to_host_bytes: self.to_host_bytes - earlier.to_host_bytes,
            to_host_copies: self.to_host_copies - earlier.to_host_copies,
        }
    }
}

/// One device's counts on one thread.
#[derive(Clone, Copy, Default)]
struct Counts {
    transfers: Transfers,
    host_waits: u64,
}

thread_local! {
    static COUNTS: RefCell<HashMap<Device, Counts>> = RefCell::new(HashMap::new());
}

fn with_counts<R>(device: Device, f: impl FnOnce(&mut Counts) -> R) -> R {
    COUNTS.with(|counts| f(counts.borrow_mut().entry(device).or_default()))
}

/// The copies between host memory and `device` this thread has asked for so far
/// (tensors moved to and from the device, values read back, uploads an op stages).
/// Subtract two readings to measure a step.
///
/// ```
/// use ferrotron_device::{transfers, Device, Stream};
///
/// let stream = Stream::new(Device::Emulated)?;
/// let before = transfers(Device::Emulated);
/// let memory = stream.alloc(16)?;
/// // SAFETY: the allocation holds 16 bytes.
/// unsafe { stream.upload(memory.ptr(), &[0u8; 16])? };
/// let moved = transfers(Device::Emulated) - before;
/// assert_eq!((moved.to_device_copies, moved.to_device_bytes), (1, 16));
/// # Ok::<(), ferrotron_device::Error>(())
/// ```
pub fn transfers(device: Device) -> Transfers {
    with_counts(device, |counts| counts.transfers)
}

/// How many times this thread has blocked on `device` through this crate: a stream or
/// event synchronized or polled to completion (comm-core's NCCL backend waits for its
/// collectives so), or a copy the host had to wait for (a download, a pageable upload).
/// Subtract two readings to measure a step.
pub fn host_waits(device: Device) -> u64 {
    with_counts(device, |counts| counts.host_waits)
}

/// Counts a copy of `bytes` bytes to (`to_device`) or from `device`.
pub(crate) fn count_transfer(device: Device, bytes: usize, to_device: bool) {
    with_counts(device, |counts| {
        let transfers = &mut counts.transfers;
        if to_device {
            transfers.to_device_bytes += bytes as u64;
            transfers.to_device_copies += 1;
        } else {
            transfers.to_host_bytes += bytes as u64;
            transfers.to_host_copies += 1;
        }
    });
}

/// Device memory a thread holds: the bytes of its live [`DeviceMemory`](crate::DeviceMemory)
/// allocations and the most it held at once, whichever thread frees them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceHeld {
    /// Bytes allocated by this thread and not yet freed.
    pub live: u64,
    /// The most live at once since the thread's first allocation or [`reset_device_peak`].
    pub peak: u64,
}

/// One thread's live and peak bytes on one device, shared with its allocations, which
/// give their bytes back when dropped on any thread.
#[derive(Debug, Default)]
pub(crate) struct Holder {
    live: AtomicU64,
    peak: AtomicU64,
}

impl Holder {
    pub(crate) fn add(&self, bytes: usize) {
        let live = self.live.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(live, Ordering::Relaxed);
    }

    pub(crate) fn sub(&self, bytes: usize) {
        self.live.fetch_sub(bytes as u64, Ordering::Relaxed);
    }
}

thread_local! {
    static HOLDERS: RefCell<HashMap<Device, Arc<Holder>>> = RefCell::new(HashMap::new());
}

/// This thread's holder of `device`'s memory, for an allocation to count itself against.
pub(crate) fn holder(device: Device) -> Arc<Holder> {
    HOLDERS.with(|h| h.borrow_mut().entry(device).or_default().clone())
}

/// The device memory this thread has allocated on `device` and holds now, and the most
/// it held at once: tensors, gradient buckets and optimizer state (everything made
/// through [`Stream::alloc`](crate::Stream::alloc); not the driver's, cuBLAS's or NCCL's
/// own). On a GPU this is what a rank's thread holds of the device's memory.
pub fn device_memory(device: Device) -> DeviceHeld {
    let holder = holder(device);
    DeviceHeld {
        live: holder.live.load(Ordering::Relaxed),
        peak: holder.peak.load(Ordering::Relaxed),
    }
}

/// Starts a new peak of [`device_memory`] from what this thread holds now.
pub fn reset_device_peak(device: Device) {
    let holder = holder(device);
    holder
        .peak
        .store(holder.live.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Counts one time the host blocked on `device`.
pub(crate) fn count_host_wait(device: Device) {
    with_counts(device, |counts| counts.host_waits += 1);
}

thread_local! {
    /// How many [`bookkeeping`] calls this thread is inside.
    static BOOKKEEPING: Cell<u32> = const { Cell::new(0) };
}

/// Whether this thread is allocating for the device layer's own bookkeeping now: the
/// emulated device's queues of work, the kernel arguments and calls queued in them, and
/// its ordering checker's records. A GPU's driver keeps the like in memory of its own;
/// a program that counts its memory by thread (the demo's per-rank counts) leaves these
/// out, so its figures do not follow how far a stream's worker lags behind. Safe to call
/// from a global allocator (it reads a thread-local cell and allocates nothing).
pub fn allocating_bookkeeping() -> bool {
    BOOKKEEPING
        .try_with(|depth| depth.get() > 0)
        .unwrap_or(false)
}

/// Runs `f` as the device layer's bookkeeping ([`allocating_bookkeeping`]).
pub(crate) fn bookkeeping<R>(f: impl FnOnce() -> R) -> R {
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            let _ = BOOKKEEPING.try_with(|depth| depth.set(depth.get().saturating_sub(1)));
        }
    }
    let _ = BOOKKEEPING.try_with(|depth| depth.set(depth.get() + 1));
    let _scope = Scope;
    f()
}
