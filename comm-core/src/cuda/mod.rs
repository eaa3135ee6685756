//! CUDA support (feature `cuda`): finding the libraries at run time, opening devices, and
//! the device-memory primitives the backends use (copies, staging through host memory,
//! reduction kernels).
//!
//! Every CUDA library is loaded when first needed, never linked: the workspace builds and
//! runs on machines without a GPU or toolkit. cudarc panics when a library it needs is
//! missing, so each entry point here checks presence first and returns
//! [`Error::LibraryMissing`] naming the library and how to make it findable.
//!
//! ```no_run
//! use comm_core::cuda;
//! # fn main() -> comm_core::Result<()> {
//! let ctx = cuda::context(0)?; // typed error without a driver or device
//! let stream = ctx.default_stream();
//! let x = stream.clone_htod(&[1.0f32, 2.0, 3.0]).map_err(cuda::driver_error("clone_htod"))?;
//! let view = comm_core::BufRef::cuda(&x, &stream)?;
//! assert_eq!(view.memory(), comm_core::Device::Cuda(0));
//! # Ok(())
//! # }
//! ```

mod kernels;

pub use kernels::compile;
pub(crate) use kernels::reduce_rows;

use crate::buffer::{BufMut, BufRef, Buffer};
use crate::error::{Error, Result};
use cudarc::driver::{result::DriverError, CudaContext, CudaStream};
use std::sync::{Arc, OnceLock};

/// The version of cudarc this crate speaks, so that callers build slices and streams of
/// the same types.
pub use cudarc;

/// A CUDA library that ferrotron loads at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Library {
    /// The driver API (`libcuda.so`), installed with the NVIDIA driver.
    Driver,
    /// The run-time compiler (`libnvrtc.so`), for the reduction kernels.
    Nvrtc,
    /// NCCL (`libnccl.so`), for the `nccl` backend.
    Nccl,
    /// cuBLAS (`libcublas.so`), for tape's matrix products on CUDA tensors.
    Cublas,
}

impl Library {
    /// The file name cudarc searches for.
    pub fn file_name(self) -> &'static str {
        match self {
            Library::Driver => "libcuda.so",
            Library::Nvrtc => "libnvrtc.so",
            Library::Nccl => "libnccl.so",
            Library::Cublas => "libcublas.so",
        }
    }

    fn hint(self) -> &'static str {
        match self {
            Library::Driver => {
                "; libcuda.so comes with the NVIDIA driver, not the toolkit, and only a \
                 machine with an NVIDIA GPU has it"
            }
            Library::Nvrtc => {
                "; it ships with the CUDA toolkit (lib64/) or the `nvidia-cuda-nvrtc` Python \
                 packages; names other than libnvrtc.so and libnvrtc.so.12 (e.g. CUDA 13's \
                 libnvrtc.so.13) need a `libnvrtc.so` symlink in a directory on LD_LIBRARY_PATH"
            }
            Library::Nccl => {
                "; a pip-installed NCCL (`nvidia-nccl-cu12`/`-cu13`) has only libnccl.so.2: \
                 put a directory holding a `libnccl.so` symlink to it on LD_LIBRARY_PATH"
            }
            Library::Cublas => {
                "; it ships with the CUDA toolkit (lib64/) or the `nvidia-cublas` Python \
                 packages; CUDA 13's libcublas.so.13 needs a `libcublas.so` symlink in a \
                 directory on LD_LIBRARY_PATH"
            }
        }
    }

    fn present(self) -> bool {
        static PRESENT: [OnceLock<bool>; 4] = [const { OnceLock::new() }; 4];
        let (slot, probe): (usize, unsafe fn() -> bool) = match self {
            Library::Driver => (0, cudarc::driver::sys::is_culib_present),
            Library::Nvrtc => (1, cudarc::nvrtc::sys::is_culib_present),
            Library::Nccl => (2, cudarc::nccl::sys::is_culib_present),
            Library::Cublas => (3, cudarc::cublas::sys::is_culib_present),
        };
        // SAFETY: the probes only try to dlopen the library's candidate names.
        *PRESENT[slot].get_or_init(|| unsafe { probe() })
    }
}

/// Checks that `library` can be loaded; `purpose` says what needs it in the error.
pub fn require(library: Library, purpose: &'static str) -> Result<()> {
    if library.present() {
        Ok(())
    } else {
        Err(Error::LibraryMissing {
            library: library.file_name(),
            purpose,
            hint: library.hint(),
        })
    }
}

/// Number of CUDA devices the driver reports; an error when the driver cannot be loaded.
pub fn device_count() -> Result<usize> {
    require(Library::Driver, "counting CUDA devices")?;
    let count = CudaContext::device_count().map_err(driver_error("cuDeviceGetCount"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// The (primary) context of device `ordinal`, after checking the driver and the ordinal.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    let available = device_count()?;
    if ordinal >= available {
        return Err(Error::NoDevice {
            requested: ordinal,
            available,
        });
    }
    let context = CudaContext::new(ordinal).map_err(driver_error("cuDevicePrimaryCtxRetain"))?;
    keep_pool_memory(&context)?;
    Ok(context)
}

/// Makes the device's default memory pool keep freed memory: with the default release
/// threshold (0) it returns memory to the OS at every synchronize, and every device
/// collective synchronizes, so each scratch allocation would be mapped afresh.
fn keep_pool_memory(context: &CudaContext) -> Result<()> {
    use cudarc::driver::{result, sys};
    let mut threshold = u64::MAX;
    // SAFETY: the default pool of a live device; the attribute takes a u64.
    unsafe {
        let pool = result::device::get_default_mem_pool(context.cu_device())
            .map_err(driver_error("cuDeviceGetDefaultMemPool"))?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .map_err(driver_error("cuMemPoolSetAttribute"))
    }
}

/// Why GPU work cannot run here (no driver, no device), or `None` when device 0 is
/// usable. GPU tests print `skipped: <reason>` and pass when this is `Some`.
pub fn unavailable_reason() -> Option<String> {
    context(0).err().map(|e| e.to_string())
}

/// Turns a failed driver call into [`Error::Cuda`] naming the call.
pub fn driver_error(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        call: call.to_string(),
        message: describe(&e),
    }
}

fn describe(e: &DriverError) -> String {
    match (e.error_name(), e.error_string()) {
        (Ok(name), Ok(text)) => format!("{}: {}", name.to_string_lossy(), text.to_string_lossy()),
        _ => format!("{:?}", e.0),
    }
}

/// Makes the stream's context current on this thread (raw driver calls need it).
pub(crate) fn bind(stream: &CudaStream) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(driver_error("cuCtxSetCurrent"))
}

/// Waits for everything queued on `stream`.
pub(crate) fn synchronize(stream: &CudaStream) -> Result<()> {
    stream
        .synchronize()
        .map_err(driver_error("cuStreamSynchronize"))
}

/// Queues a copy of `bytes` bytes between any two device addresses (same device, another
/// device, or pinned host memory: unified addressing infers the direction).
pub(crate) fn copy_async(dst: u64, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: callers pass addresses valid for `bytes` bytes until the stream is synchronized.
    unsafe { cudarc::driver::sys::cuMemcpyAsync(dst, src, bytes, stream.cu_stream()) }
        .result()
        .map_err(driver_error("cuMemcpyAsync"))
}

/// A host copy of a device view, taken after the work queued on its stream.
pub(crate) fn to_host(view: BufRef<'_>, stream: &CudaStream) -> Result<Buffer> {
    let mut host = Buffer::zeros(view.dtype(), view.len());
    bind(stream)?;
    let mut out = host.as_buf_mut();
    let dst = out.host_ptr_mut();
    // SAFETY: `view` is valid for `byte_len` bytes of device memory and `host` was sized
    // for them; the synchronous copy completes before we return.
    unsafe {
        cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
            dst.cast(),
            view.device_ptr(),
            view.byte_len(),
            stream.cu_stream(),
        )
    }
    .result()
    .map_err(driver_error("cuMemcpyDtoHAsync"))?;
    synchronize(stream)?;
    Ok(host)
}

/// Copies a host buffer of the same dtype and length into a device view and waits for it.
pub(crate) fn from_host(host: &Buffer, view: &mut BufMut<'_>, stream: &CudaStream) -> Result<()> {
    debug_assert_eq!((host.dtype(), host.len()), (view.dtype(), view.len()));
    bind(stream)?;
    let src = host.as_buf_ref();
    // SAFETY: both sides hold `byte_len` bytes; we synchronize before `host` can go away.
    unsafe {
        cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
            view.device_ptr(),
            src.host_ptr().cast(),
            src.byte_len(),
            stream.cu_stream(),
        )
    }
    .result()
    .map_err(driver_error("cuMemcpyHtoDAsync"))?;
    synchronize(stream)
}

/// Runs a host implementation of an in-place operation on a device view: copy to host,
/// run `op`, copy back. How host-only backends (MPI) accept device buffers.
#[cfg(feature = "mpi")]
pub(crate) fn staged_inout(
    mut view: BufMut<'_>,
    stream: &CudaStream,
    op: impl FnOnce(BufMut<'_>) -> Result<()>,
) -> Result<()> {
    let mut host = to_host(view.as_ref(), stream)?;
    op(host.as_buf_mut())?;
    from_host(&host, &mut view, stream)
}

/// Whether either side of a call is device memory (and so must be staged for MPI).
#[cfg(feature = "mpi")]
pub(crate) fn any_device(input: &BufRef<'_>, output: &BufMut<'_>) -> bool {
    input.cuda_stream().is_some() || output.cuda_stream().is_some()
}

/// Like [`staged_inout`] for operations with a separate input and output; either may be
/// host memory already (the backends reject mixed calls before staging).
#[cfg(feature = "mpi")]
pub(crate) fn staged(
    input: BufRef<'_>,
    mut output: BufMut<'_>,
    op: impl FnOnce(BufRef<'_>, BufMut<'_>) -> Result<()>,
) -> Result<()> {
    let staged_input = match input.cuda_stream() {
        Some(stream) => Some(to_host(input, stream)?),
        None => None,
    };
    let input = staged_input.as_ref().map_or(input, Buffer::as_buf_ref);
    match output.cuda_stream() {
        Some(stream) => {
            let mut host = Buffer::zeros(output.dtype(), output.len());
            op(input, host.as_buf_mut())?;
            from_host(&host, &mut output, stream)
        }
        None => op(input, output),
    }
}

/// Stream-ordered device memory for intermediate results, freed on the same stream.
pub(crate) struct Scratch<'a> {
    ptr: u64,
    stream: &'a CudaStream,
}

impl<'a> Scratch<'a> {
    /// `bytes` bytes on the stream's device (at least one, so the address is valid).
    pub(crate) fn new(stream: &'a CudaStream, bytes: usize) -> Result<Scratch<'a>> {
        // SAFETY: the stream is live for 'a; the memory is freed on it in `drop`.
        let ptr = unsafe { cudarc::driver::result::malloc_async(stream.cu_stream(), bytes.max(1)) }
            .map_err(driver_error("cuMemAllocAsync"))?;
        Ok(Scratch { ptr, stream })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for Scratch<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated on this stream; work using it was queued on it before.
        // A failure here means the context is already broken, which the next call reports.
        let _ = unsafe { cudarc::driver::result::free_async(self.ptr, self.stream.cu_stream()) };
    }
}
