//! CUDA (feature `cuda`): finding the libraries at run time, one context per device per
//! process, and NVRTC compilation with a per-process cache.
//!
//! Every CUDA library is loaded when first needed, never linked: the workspace builds and
//! runs on machines without a GPU or toolkit. cudarc panics when a library it needs is
//! missing, so each entry point here checks presence first and returns
//! [`Error::LibraryMissing`] naming the library and how to make it findable.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result::DriverError, CudaContext, CudaStream};
use cudarc::nvrtc::Ptx;
use parking_lot::Mutex;

use crate::counters::{count_host_wait, count_transfer};
use crate::error::{Error, Result};
use crate::Device;

/// The version of cudarc this crate speaks, so that callers build slices, streams and
/// handles of the same types.
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

/// The (primary) context of device `ordinal`, after checking the driver and the ordinal:
/// one per device per process, opened on first use (with its memory pool told to keep
/// freed memory) and shared by every thread and world. The stated exception to "no global
/// state": a device has one primary context whoever asks.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    static CONTEXTS: OnceLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = OnceLock::new();
    let available = device_count()?;
    if ordinal >= available {
        return Err(Error::NoDevice {
            requested: ordinal,
            available,
        });
    }
    let mut contexts = CONTEXTS.get_or_init(Default::default).lock();
    if let Some(context) = contexts.get(&ordinal) {
        // Current on the calling thread, as a freshly retained one would be.
        context
            .bind_to_thread()
            .map_err(driver_error("cuCtxSetCurrent"))?;
        return Ok(context.clone());
    }
    let context = CudaContext::new(ordinal).map_err(driver_error("cuDevicePrimaryCtxRetain"))?;
    keep_pool_memory(&context)?;
    contexts.insert(ordinal, context.clone());
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

/// Turns a failed driver call into [`Error::Driver`] naming the call.
pub fn driver_error(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Driver {
        call: call.to_string(),
        message: describe(&e),
    }
}

/// A driver error as `NAME: description`.
pub(crate) fn describe(e: &DriverError) -> String {
    match (e.error_name(), e.error_string()) {
        (Ok(name), Ok(text)) => format!("{}: {}", name.to_string_lossy(), text.to_string_lossy()),
        _ => format!("{:?}", e.0),
    }
}

/// PTX for `source` named `name`, for the virtual architecture `arch` (NVRTC's default
/// when `None`), compiled by NVRTC on first use and kept for the process: compiling
/// takes seconds and every device of one architecture loads the same PTX. `source` is
/// called only on a miss. NVRTC's log on failure.
pub fn compile(
    name: &'static str,
    source: impl FnOnce() -> String,
    arch: Option<&'static str>,
) -> Result<Ptx> {
    type Compiled = std::result::Result<Ptx, String>;
    type Key = (&'static str, Option<&'static str>);
    static PTX: OnceLock<Mutex<HashMap<Key, Compiled>>> = OnceLock::new();
    require(Library::Nvrtc, "compiling the CUDA kernels")?;
    let mut cache = PTX.get_or_init(Default::default).lock();
    cache
        .entry((name, arch))
        .or_insert_with(|| {
            let options = cudarc::nvrtc::CompileOptions {
                name: Some(name.into()),
                arch,
                ..Default::default()
            };
            cudarc::nvrtc::compile_ptx_with_opts(source(), options).map_err(|e| match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => format!("{other:?}"),
            })
        })
        .clone()
        .map_err(|message| Error::Driver {
            call: format!("nvrtcCompileProgram ({name})"),
            message,
        })
}

/// Makes the stream's context current on this thread (raw driver calls need it).
pub fn bind(stream: &CudaStream) -> Result<()> {
    stream
        .context()
        .bind_to_thread()
        .map_err(driver_error("cuCtxSetCurrent"))
}

/// Blocks the host until everything queued on `stream` has run (counted in
/// [`host_waits`](crate::host_waits)).
pub fn synchronize(stream: &CudaStream) -> Result<()> {
    count_host_wait(device_of(stream));
    stream
        .synchronize()
        .map_err(driver_error("cuStreamSynchronize"))
}

/// Blocks the host until `event`, recorded on a stream of `device`, has completed, by
/// polling it (counted as one host wait): `between(waited, complete)` runs after every
/// poll and may end the wait with its error (a watchdog, a communication library's error
/// check). Polls back to back for the first millisecond, so short work ends without a
/// sleep, then every 50 µs.
pub fn wait_polling<E: From<Error>>(
    event: &cudarc::driver::CudaEvent,
    device: Device,
    mut between: impl FnMut(std::time::Duration, bool) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    const SPIN: std::time::Duration = std::time::Duration::from_millis(1);
    const INTERVAL: std::time::Duration = std::time::Duration::from_micros(50);
    count_host_wait(device);
    let started = std::time::Instant::now();
    loop {
        let complete = event
            .try_is_complete()
            .map_err(driver_error("cuEventQuery"))?;
        let waited = started.elapsed();
        between(waited, complete)?;
        if complete {
            return Ok(());
        }
        if waited < SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(INTERVAL);
        }
    }
}

/// The device a stream belongs to.
pub fn device_of(stream: &CudaStream) -> Device {
    Device::Cuda(stream.context().ordinal())
}

/// `bytes` bytes (at least one) from the device's stream-ordered pool, in `stream`'s
/// order.
///
/// # Safety
/// Free it with [`free`] on the same stream, once no work uses it.
pub unsafe fn alloc(stream: &CudaStream, bytes: usize) -> Result<u64> {
    bind(stream)?;
    // SAFETY: a stream-ordered allocation on a live stream.
    unsafe { cudarc::driver::result::malloc_async(stream.cu_stream(), bytes.max(1)) }.map_err(|e| {
        match e.0 {
            cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                device: device_of(stream),
                bytes,
            },
            _ => Error::Driver {
                call: "cuMemAllocAsync".into(),
                message: format!("{} ({bytes} bytes)", describe(&e)),
            },
        }
    })
}

/// Returns an [`alloc`]ation to the pool in `stream`'s order.
///
/// # Safety
/// `ptr` must come from [`alloc`] on this stream, and no work queued later may use it.
pub unsafe fn free(stream: &CudaStream, ptr: u64) -> Result<()> {
    bind(stream)?;
    // SAFETY: as the caller guarantees.
    unsafe { cudarc::driver::result::free_async(ptr, stream.cu_stream()) }
        .map_err(driver_error("cuMemFreeAsync"))
}

/// Copies host memory to device address `dst` on `stream` and waits for it (a pageable
/// copy: counted as a transfer and a host wait).
///
/// # Safety
/// `dst` must be device memory of the stream's device valid for `src.len()` bytes.
pub unsafe fn upload(stream: &CudaStream, dst: u64, src: &[u8]) -> Result<()> {
    count_transfer(device_of(stream), src.len(), true);
    bind(stream)?;
    // SAFETY: the caller guarantees `dst`; we wait before `src` can go away.
    unsafe {
        cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
            dst,
            src.as_ptr().cast(),
            src.len(),
            stream.cu_stream(),
        )
    }
    .result()
    .map_err(driver_error("cuMemcpyHtoDAsync"))?;
    synchronize(stream)
}

/// Copies device address `src` to host memory after the work queued on `stream`, and
/// waits for it (counted as a transfer and a host wait).
///
/// # Safety
/// `src` must be device memory of the stream's device valid for `dst.len()` bytes.
pub unsafe fn download(stream: &CudaStream, dst: &mut [u8], src: u64) -> Result<()> {
    count_transfer(device_of(stream), dst.len(), false);
    bind(stream)?;
    // SAFETY: the caller guarantees `src`; we wait before returning.
    unsafe {
        cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
            dst.as_mut_ptr().cast(),
            src,
            dst.len(),
            stream.cu_stream(),
        )
    }
    .result()
    .map_err(driver_error("cuMemcpyDtoHAsync"))?;
    synchronize(stream)
}

/// Queues a copy of `bytes` bytes between two device addresses (same device, another
/// device, or pinned host memory: unified addressing infers the direction).
///
/// # Safety
/// Both ranges must be valid for `bytes` bytes until the copy has run.
pub unsafe fn copy(stream: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    bind(stream)?;
    // SAFETY: the caller guarantees both ranges.
    unsafe { cudarc::driver::sys::cuMemcpyAsync(dst, src, bytes, stream.cu_stream()) }
        .result()
        .map_err(driver_error("cuMemcpyAsync"))
}

/// `bytes` bytes (at least one) of zeroed page-locked host memory, usable by every context
/// (`CU_MEMHOSTALLOC_PORTABLE`); free it with `cudarc`'s `free_host` once no copy uses it.
pub(crate) fn alloc_pinned(ordinal: usize, bytes: usize) -> Result<*mut u8> {
    const PORTABLE: std::ffi::c_uint = 1;
    context(ordinal)?
        .bind_to_thread()
        .map_err(driver_error("cuCtxSetCurrent"))?;
    // SAFETY: a plain allocation in the bound context.
    let ptr = unsafe { cudarc::driver::result::malloc_host(bytes.max(1), PORTABLE) }.map_err(
        |e| match e.0 {
            cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                device: Device::Cuda(ordinal),
                bytes,
            },
            _ => Error::Driver {
                call: "cuMemHostAlloc".into(),
                message: format!("{} ({bytes} bytes)", describe(&e)),
            },
        },
    )?;
    // SAFETY: `bytes.max(1)` writable bytes just allocated.
    unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes.max(1)) };
    Ok(ptr.cast())
}
