//! Page-locked ("pinned") host memory: copies between it and a device are queued on a
//! stream and the host goes on, where a copy from ordinary (pageable) memory must wait.
//! The memory remembers the copies still in flight: the host waits for them before it
//! touches the bytes or frees them, and a copy queued on another stream waits for them on
//! the device, so no safe call can race a copy.

use std::alloc::{GlobalAlloc, Layout, System};

use parking_lot::Mutex;

use crate::checker::{self, Access};
use crate::counters::count_transfer;
use crate::error::{Error, Result};
use crate::stream::{Event, Stream};
use crate::Device;

/// Host memory a device copies to and from without the host waiting.
///
/// On CUDA it is page-locked (`cuMemHostAlloc`), so the copy engine reads and writes it
/// directly; on the emulated device it is ordinary aligned host memory, which the
/// stream's worker copies from and into in the stream's order.
///
/// ```
/// use ferrotron_device::{host_waits, Device, PinnedMemory, Stream};
///
/// let stream = Stream::new(Device::Emulated)?;
/// let memory = stream.alloc(4)?;
/// let mut staging = PinnedMemory::new(Device::Emulated, 4)?;
/// staging.as_mut_slice()?.copy_from_slice(&[1, 2, 3, 4]);
/// let waits = host_waits(Device::Emulated);
/// // SAFETY: the allocation holds 4 bytes.
/// unsafe { stream.upload_pinned(memory.ptr(), &staging, 4)? }; // queued; no host wait
/// assert_eq!(host_waits(Device::Emulated), waits);
/// # Ok::<(), ferrotron_device::Error>(())
/// ```
pub struct PinnedMemory {
    ptr: *mut u8,
    bytes: usize,
    device: Device,
    /// Events after the copies queued from or into this memory that may not have run.
    in_flight: Mutex<Vec<Event>>,
}

// SAFETY: the memory is owned by this value alone; host access goes through `&`/`&mut`
// borrows after waiting for the device's copies, and the event list is behind a lock.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above; shared references only read the bytes or queue reads of them.
unsafe impl Sync for PinnedMemory {}

impl std::fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedMemory")
            .field("device", &self.device)
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// The layout of `bytes` (at least one) aligned to 16, as device allocations are.
fn layout(bytes: usize) -> Option<Layout> {
    Layout::from_size_align(bytes.max(1), 16).ok()
}

impl PinnedMemory {
    /// `bytes` bytes of host memory, zeroed, for copies with `device` (the emulated device,
    /// or a CUDA device of the `cuda` feature).
    pub fn new(device: Device, bytes: usize) -> Result<PinnedMemory> {
        let ptr = match device {
            Device::Emulated => {
                let layout = layout(bytes).ok_or(Error::OutOfMemory { device, bytes })?;
                // From the system's allocator, not the program's: pinned memory is the
                // driver's on a GPU, outside what a program's allocator (or a rank's
                // count of memory) sees, and the staging pool keeps it for every thread.
                // SAFETY: the layout has a non-zero size.
                let ptr = unsafe { System.alloc_zeroed(layout) };
                if ptr.is_null() {
                    return Err(Error::OutOfMemory { device, bytes });
                }
                checker::allocated(None, "pinned memory", ptr as u64, bytes);
                ptr
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::alloc_pinned(ordinal, bytes)?,
            _ => {
                return Err(Error::Unsupported {
                    op: "PinnedMemory::new",
                    device,
                })
            }
        };
        Ok(PinnedMemory {
            ptr,
            bytes,
            device,
            in_flight: Mutex::new(Vec::new()),
        })
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device its copies go to and come from.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The bytes, once every copy into them has run (a counted host wait if one has not).
    pub fn as_slice(&mut self) -> Result<&[u8]> {
        self.settle()?;
        self.host_access("read pinned memory", false)?;
        // SAFETY: `bytes` bytes owned by `self`; no copy is in flight, and `&mut self`
        // keeps new ones from being queued while the slice lives.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) })
    }

    /// The bytes to write, once every copy from or into them has run.
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8]> {
        self.settle()?;
        self.host_access("write pinned memory", true)?;
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.bytes) })
    }

    /// Whether no copy from or into it is still in flight (never waits).
    pub fn is_idle(&self) -> Result<bool> {
        let mut in_flight = self.in_flight.lock();
        let mut idle = true;
        for event in in_flight.iter() {
            idle &= event.is_complete()?;
        }
        if idle {
            keep_last(&mut in_flight);
        }
        Ok(idle)
    }

    /// Waits for the copies still in flight.
    fn settle(&self) -> Result<()> {
        let mut in_flight = self.in_flight.lock();
        for event in in_flight.iter() {
            if !event.is_complete()? {
                event.synchronize()?;
            }
        }
        keep_last(&mut in_flight);
        Ok(())
    }

    /// Declares the host's access to the whole memory to the emulated device's checker
    /// (no-op on CUDA).
    fn host_access(&self, op: &'static str, write: bool) -> Result<()> {
        if self.device != Device::Emulated {
            return Ok(());
        }
        let ptr = self.ptr as u64;
        let access = if write {
            Access::write(ptr, self.bytes)
        } else {
            Access::read(ptr, self.bytes)
        };
        checker::host_access(op, &[access])
    }

    /// Makes `stream` wait, on the device, for the copies in flight on other streams, so
    /// a copy queued next cannot overlap them (a download into memory an upload on
    /// another stream still reads). The host does not wait.
    fn order_after(&self, stream: &Stream) -> Result<()> {
        for event in self.in_flight.lock().iter() {
            if !event.is_complete()? {
                stream.wait(event)?;
            }
        }
        Ok(())
    }

    /// Remembers a copy just queued on `stream`, forgetting those that have run. If its
    /// event cannot be recorded, waits for the stream instead, so the copy is never
    /// untracked, and reports the error.
    fn track(&self, stream: &Stream) -> Result<()> {
        let event = match stream.record() {
            Ok(event) => event,
            Err(error) => {
                stream.synchronize()?;
                return Err(error);
            }
        };
        let mut in_flight = self.in_flight.lock();
        in_flight.retain(|e| !e.is_complete().unwrap_or(false));
        in_flight.push(event);
        Ok(())
    }

    /// Refuses a copy of `bytes` that does not fit, or on another device's stream.
    fn check(&self, op: &'static str, stream: &Stream, bytes: usize) -> Result<()> {
        if bytes > self.bytes || stream.device() != self.device {
            return Err(Error::Invalid {
                op,
                reason: format!(
                    "{bytes} bytes on a stream of {} do not fit {} bytes of pinned memory \
                     for {}; copy at most its size, on a stream of its device",
                    stream.device(),
                    self.bytes,
                    self.device
                ),
            });
        }
        Ok(())
    }
}

/// Forgets completed copies but the last: a thread that takes the memory over from
/// another (the staging pool hands buffers between threads) finds that event complete
/// too, which is how the ordering checker learns that the copies it never saw are done.
fn keep_last(events: &mut Vec<Event>) {
    let done = events.len().saturating_sub(1);
    events.drain(..done);
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        // A copy may still read or write the memory: wait for it before freeing. On an
        // error the context is broken and its copies are gone with it.
        let _ = self.settle();
        match self.device {
            Device::Emulated => {
                // A copy nobody waited for (a bug) leaks the memory, and its stream's
                // next wait reports it.
                let ordered = checker::freed(None, self.ptr as u64);
                if let (true, Some(layout)) = (ordered, layout(self.bytes)) {
                    // SAFETY: allocated in `new` with this layout; this is its only owner.
                    unsafe { System.dealloc(self.ptr, layout) }
                }
            }
            #[cfg(feature = "cuda")]
            // The free needs a current context on this thread, which `context` binds.
            Device::Cuda(ordinal) if crate::cuda::context(ordinal).is_ok() => {
                // SAFETY: allocated by `cuMemHostAlloc`; no copy uses it any longer.
                let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
            }
            _ => {}
        }
    }
}

impl Stream {
    /// Queues a copy of the first `bytes` bytes of `src` to device address `dst`, after
    /// the work queued before it, and returns without waiting (counted as a transfer,
    /// not a host wait). `src` cannot be written or freed until the copy has run.
    ///
    /// # Safety
    /// `dst` must be device memory of this stream's device, valid for `bytes` bytes and
    /// not used by other work until the copy is done.
    pub unsafe fn upload_pinned(&self, dst: u64, src: &PinnedMemory, bytes: usize) -> Result<()> {
        src.check("upload_pinned", self, bytes)?;
        src.order_after(self)?;
        count_transfer(self.device(), bytes, true);
        // SAFETY: pinned memory is host memory mapped for the device (unified
        // addressing: a device copy reads it), valid for `bytes`; the caller guarantees
        // `dst`.
        unsafe { self.copy(dst, src.ptr as u64, bytes)? };
        src.track(self)
    }

    /// Queues a copy of `bytes` bytes from device address `src` into the start of `dst`,
    /// after the work queued before it, and returns without waiting (counted as a
    /// transfer); [`PinnedMemory::as_slice`] waits for it.
    ///
    /// # Safety
    /// `src` must be device memory of this stream's device, valid for `bytes` bytes.
    pub unsafe fn download_pinned(
        &self,
        dst: &mut PinnedMemory,
        src: u64,
        bytes: usize,
    ) -> Result<()> {
        dst.check("download_pinned", self, bytes)?;
        dst.order_after(self)?;
        count_transfer(self.device(), bytes, false);
        // SAFETY: as in `upload_pinned`, the other way.
        unsafe { self.copy(dst.ptr as u64, src, bytes)? };
        dst.track(self)
    }

    /// Copies `src` to device address `dst` through pinned staging memory and returns
    /// without waiting for the device (counted as a transfer, not a host wait): `src` is
    /// copied into a staging buffer at once, so the caller may change it as soon as this
    /// returns, and the buffer is reused only after its copy has run. Work queued on this
    /// stream afterwards sees the data. This is how a step uploads its batch.
    ///
    /// # Safety
    /// `dst` must be device memory of this stream's device, valid for `src.len()` bytes
    /// and not used by other streams until the copy is done.
    pub unsafe fn upload_staged(&self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let mut staging = take_staging(self.device(), src.len())?;
        staging.as_mut_slice()?[..src.len()].copy_from_slice(src);
        // SAFETY: the caller guarantees `dst`; the staging buffer holds `src.len()` bytes
        // and goes back to the pool with the copy's event, so nothing reuses it early.
        match unsafe { self.upload_pinned(dst, &staging, src.len()) } {
            Ok(()) => {
                give_back_staging(staging);
                Ok(())
            }
            Err(error) => {
                // A copy may have been queued and not followed: never reuse the buffer.
                std::mem::forget(staging);
                Err(error)
            }
        }
    }
}

/// Staging buffers no copy uses any longer, or whose copies are still in flight, by device:
/// one pool per process, as pinned memory is usable from every thread and stream.
static STAGING: Mutex<Vec<PinnedMemory>> = Mutex::new(Vec::new());

/// At most this many buffers wait in the pool; beyond it, idle ones are freed.
const STAGING_KEPT: usize = 32;

/// A staging buffer of `device` for at least `bytes` bytes whose copies have all run: one
/// from the pool, or a new one (a power of two of at least 4 KiB, so sizes that vary a
/// little reuse one buffer).
fn take_staging(device: Device, bytes: usize) -> Result<PinnedMemory> {
    {
        let mut pool = STAGING.lock();
        // The smallest that fits, so a large buffer is not tied up by small uploads.
        let mut found: Option<usize> = None;
        for (i, buffer) in pool.iter().enumerate() {
            let fits = buffer.device() == device && buffer.bytes() >= bytes;
            let smaller = found.is_none_or(|f| buffer.bytes() < pool[f].bytes());
            if fits && smaller && buffer.is_idle()? {
                found = Some(i);
            }
        }
        if let Some(i) = found {
            return Ok(pool.swap_remove(i));
        }
    }
    PinnedMemory::new(device, bytes.next_power_of_two().max(4096))
}

/// Returns a staging buffer to the pool, freeing idle ones past [`STAGING_KEPT`] (after
/// the pool's lock is released: freeing pinned memory can synchronize).
fn give_back_staging(buffer: PinnedMemory) {
    let mut freed = Vec::new();
    {
        let mut pool = STAGING.lock();
        pool.push(buffer);
        while pool.len() > STAGING_KEPT {
            let Some(i) = pool.iter().position(|b| b.is_idle().unwrap_or(false)) else {
                break;
            };
            freed.push(pool.swap_remove(i));
        }
    }
    drop(freed);
}
