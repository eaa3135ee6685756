//! Device memory: a [`DeviceMemory`] is an allocation made in a stream's order and freed
//! in that order when its owner drops it, addressed by `u64` as the driver does. tape's
//! tensors hold their memory this way and lend it to collectives as comm-core's views of
//! a `DeviceMemory`; comm-core's scratch memory comes from the same stream-ordered pool
//! (through `cuda::alloc`). Views of cudarc slices (for callers who hold cudarc's), and
//! the NCCL backend's own small buffers, are still cudarc's. Copies between host and
//! device, and within a device, are queued on a stream.

use std::alloc::Layout;

use crate::checker::{self, Access};
use crate::counters::count_transfer;
use crate::error::{Error, Result};
use crate::stream::Stream;
use crate::Device;

/// Device memory allocated on a stream and freed on it when dropped.
///
/// On CUDA it comes from the device's stream-ordered pool (`cuMemAllocAsync`; the pool
/// keeps freed memory for the next allocation instead of returning it at every
/// synchronize). On the emulated device it is host memory aligned to 16 bytes, allocated
/// anew each time, so a counting allocator sees every allocation, and freed once the
/// work queued before the free has run.
pub struct DeviceMemory {
    ptr: u64,
    bytes: usize,
    stream: Stream,
    /// Another stream of the device to free it on ([`free_on`](Self::free_on)).
    free_on: Option<Stream>,
    /// The allocating thread's count of device memory, given back on drop.
    holder: std::sync::Arc<crate::counters::Holder>,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("device", &self.stream.device())
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// The byte every fresh emulated allocation is filled with.
pub(crate) const UNWRITTEN: u8 = 0xff;

/// The host layout of an emulated allocation of `bytes`; `None` past `isize::MAX`.
fn emulated_layout(bytes: usize) -> Option<Layout> {
    // 16-byte alignment: enough for f64 and i64, like cudaMalloc's (stronger) guarantee.
    Layout::from_size_align(bytes.max(16), 16).ok()
}

impl DeviceMemory {
    /// The first byte's device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The stream it was allocated on, which frees it.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device it lives on.
    pub fn device(&self) -> Device {
        self.stream.device()
    }

    /// Frees the memory in `stream`'s order instead of its own (`cuMemFreeAsync` on
    /// another stream of the device): work queued on `stream` before this call may still
    /// use it. On the emulated device the checker reports a free that other work is not
    /// ordered before, and the memory is leaked.
    ///
    /// A receiver frees a message this way: the sender's stream then never waits for the
    /// receiver, whose stream may be waiting for what the sender has yet to queue.
    ///
    /// A stream of another device is an error, and the memory is then leaked, not freed:
    /// work queued on `stream` may still use it, and no stream of its own device is
    /// ordered after that work.
    ///
    /// # Safety
    /// Every use of the memory on other streams (its own included) must be ordered before
    /// the work queued on `stream` now (`stream` waited for an event recorded after it):
    /// on a GPU the memory may be reused as soon as `stream` reaches the free.
    pub unsafe fn free_on(mut self, stream: &Stream) -> Result<()> {
        if stream.device() != self.device() {
            let reason = format!(
                "memory of {} cannot be freed on a stream of {}; it is leaked",
                self.device(),
                stream.device()
            );
            self.leak();
            return Err(Error::Invalid {
                op: "DeviceMemory::free_on",
                reason,
            });
        }
        self.free_on = Some(stream.clone());
        Ok(())
    }

    /// Gives the memory up without freeing it (it stays allocated until the process
    /// ends): for memory that work no stream is ordered after may still use.
    pub fn leak(self) {
        self.holder.sub(self.bytes);
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: each owned field is read out once and dropped; `this` is never used or
        // dropped again, so the allocation itself is never freed.
        unsafe {
            drop(std::ptr::read(&this.stream));
            drop(std::ptr::read(&this.free_on));
            drop(std::ptr::read(&this.holder));
        }
    }

    /// Frees emulated memory in `stream`'s order (see [`Drop`]).
    fn free_emulated(&self, stream: &Stream) {
        // Checked as a write in the stream's order; an unordered free is the stream's next
        // error, and its memory is leaked: another stream's work may still use it.
        let ordered = checker::freed(stream.agent(), self.ptr);
        let worker = stream.emulated_worker();
        let on_worker = worker.is_some_and(|w| w.is_current());
        // Another thread's own stream (a message it sent us), or a stream that did not
        // allocate it (a message we received): freed in that stream's order by its worker,
        // without a host wait, which could wait for that rank's half of a collective this
        // thread has yet to queue. (Not from the stream's own worker, which frees at once.)
        let queued = stream.owned_elsewhere() || !stream.same_as(&self.stream);
        if let (true, false, true, Some(layout)) =
            (ordered, on_worker, queued, emulated_layout(self.bytes))
        {
            let ptr = self.ptr as usize;
            // SAFETY (of the closure's call): allocated by `Stream::alloc` with this layout;
            // the worker runs it after the work queued before, which may use it, and
            // nothing after can name it.
            let free = move || unsafe { std::alloc::dealloc(ptr as *mut u8, layout) };
            stream.queue_unchecked(crate::counters::bookkeeping(|| Box::new(free)));
            return;
        }
        // Returned to the host once the stream's queued work (which may still use it) has
        // run: the host allocator then sees memory come and go in the program's order, as
        // a GPU's stream-ordered pool hands it out. The wait is not counted
        // (`cuMemFreeAsync` does not wait). Freed by a call the stream runs (memory a
        // queued closure owned), everything before that call has run and nothing after it
        // can name the memory: it goes at once. Else leaked. `alloc` succeeded with this
        // size, so its layout exists.
        let settled = ordered && (on_worker || worker.is_some_and(|w| w.drain().is_ok()));
        if let (true, Some(layout)) = (settled, emulated_layout(self.bytes)) {
            // SAFETY: allocated by `Stream::alloc` with the same layout; this was its only
            // owner, and the work that used it has run.
            unsafe { std::alloc::dealloc(self.ptr as *mut u8, layout) }
        }
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        self.holder.sub(self.bytes);
        let other = self.free_on.take();
        let stream = other.as_ref().unwrap_or(&self.stream);
        match stream.device() {
            Device::Emulated => self.free_emulated(stream),
            #[cfg(feature = "cuda")]
            _ => {
                if let (Ok(()), Some(cuda)) = (stream.bind(), stream.cuda()) {
                    // SAFETY: allocated on this device's pool; work that used it was queued
                    // on this stream or ordered before it. A failure means the context is
                    // already broken, which the next call reports.
                    let _ =
                        unsafe { cudarc::driver::result::free_async(self.ptr, cuda.cu_stream()) };
                }
            }
            #[cfg(not(feature = "cuda"))]
            _ => {}
        }
    }
}

impl Stream {
    /// `bytes` bytes of device memory (at least one, so the address is valid), allocated
    /// in this stream's order: work queued here after the call may use it.
    pub fn alloc(&self, bytes: usize) -> Result<DeviceMemory> {
        let out_of_memory = || Error::OutOfMemory {
            device: self.device(),
            bytes,
        };
        let ptr = match self.device() {
            Device::Emulated => {
                let layout = emulated_layout(bytes).ok_or_else(out_of_memory)?;
                // SAFETY: the layout has a non-zero size.
                let ptr = unsafe { std::alloc::alloc(layout) };
                if ptr.is_null() {
                    return Err(out_of_memory());
                }
                // Filled with NaNs (all ones: a NaN in every float format, -1 in every
                // signed integer): a read of memory nothing wrote then shows in results,
                // as compute-sanitizer's initcheck shows it on a GPU, instead of passing
                // on the zeros a fresh page happens to hold.
                // SAFETY: the allocation holds `layout.size()` bytes.
                unsafe { ptr.write_bytes(UNWRITTEN, layout.size()) };
                checker::allocated(self.agent(), "device memory", ptr as u64, bytes);
                ptr as u64
            }
            #[cfg(feature = "cuda")]
            _ => {
                // SAFETY: the allocation is owned by the returned memory, freed on drop.
                unsafe { crate::cuda::alloc(self.cuda_stream("alloc")?, bytes)? }
            }
            #[cfg(not(feature = "cuda"))]
            device => {
                return Err(Error::Unsupported {
                    op: "alloc",
                    device,
                })
            }
        };
        let holder = crate::counters::holder(self.device());
        holder.add(bytes);
        Ok(DeviceMemory {
            ptr,
            bytes,
            stream: self.clone(),
            free_on: None,
            holder,
        })
    }

    /// Copies `src` from host memory to device address `dst` and waits for the copy, so
    /// `src` may change at once (a pageable copy: counted as a transfer and a host wait).
    ///
    /// # Safety
    /// `dst` must be device memory of this stream's device, valid for `src.len()` bytes
    /// and not used by other work until the copy is done.
    pub unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        match self.device() {
            Device::Emulated => {
                count_transfer(self.device(), src.len(), true);
                // Declaring waits for the work queued before, which may still use `dst`.
                self.declare("upload", &[Access::write(dst, src.len())])?;
                // SAFETY: the caller guarantees `dst`; emulated memory is host memory.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
                self.synchronize()
            }
            // SAFETY: as the caller guarantees.
            #[cfg(feature = "cuda")]
            _ => unsafe { crate::cuda::upload(self.cuda_stream("upload")?, dst, src) },
            #[cfg(not(feature = "cuda"))]
            device => Err(Error::Unsupported {
                op: "upload",
                device,
            }),
        }
    }

    /// Copies `dst.len()` bytes from device address `src` to host memory, after the work
    /// queued before it, and waits for them (counted as a transfer and a host wait).
    ///
    /// # Safety
    /// `src` must be device memory of this stream's device, valid for `dst.len()` bytes.
    pub unsafe fn download(&self, dst: &mut [u8], src: u64) -> Result<()> {
        match self.device() {
            Device::Emulated => {
                count_transfer(self.device(), dst.len(), false);
                // Declaring waits for the work queued before, which may still write `src`.
                self.declare("download", &[Access::read(src, dst.len())])?;
                // SAFETY: the caller guarantees `src`; emulated memory is host memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len())
                };
                self.synchronize()
            }
            // SAFETY: as the caller guarantees.
            #[cfg(feature = "cuda")]
            _ => unsafe { crate::cuda::download(self.cuda_stream("download")?, dst, src) },
            #[cfg(not(feature = "cuda"))]
            device => Err(Error::Unsupported {
                op: "download",
                device,
            }),
        }
    }

    /// Queues a copy of `bytes` bytes between two device addresses (of this device, of
    /// another, or of pinned host memory: unified addressing infers the direction). The
    /// ranges may overlap only on the emulated device.
    ///
    /// # Safety
    /// Both ranges must be valid for `bytes` bytes until the copy has run.
    pub unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        // SAFETY: as the caller guarantees.
        unsafe { self.copy_as("copy", dst, src, bytes) }
    }

    /// [`copy`](Self::copy), named `op` where the emulated device names its calls (the
    /// ordering checker's reports, the modelled timeline): a collective's moves by the
    /// collective.
    ///
    /// # Safety
    /// As [`copy`](Self::copy).
    pub unsafe fn copy_as(&self, op: &'static str, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        match self.device() {
            Device::Emulated => {
                let accesses = [Access::read(src, bytes), Access::write(dst, bytes)];
                let (src, dst) = (src as usize, dst as usize);
                self.queue_host(op, &accesses, move || {
                    // SAFETY: the caller guarantees both ranges until the copy has run;
                    // `copy` tolerates overlap.
                    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) }
                })
            }
            // SAFETY: as the caller guarantees.
            #[cfg(feature = "cuda")]
            _ => unsafe { crate::cuda::copy(self.cuda_stream("copy")?, dst, src, bytes) },
            #[cfg(not(feature = "cuda"))]
            device => Err(Error::Unsupported { op: "copy", device }),
        }
    }
}
