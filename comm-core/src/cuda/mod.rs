//! CUDA support (feature `cuda`) for the backends, on top of the device layer (the
//! `device` crate, which finds the libraries at run time, opens each device once, compiles
//! and loads kernels, and owns copies, allocations and host waits): its calls with this
//! crate's errors, staging through host memory for MPI, and scratch memory.
//!
//! Every CUDA library is loaded when first needed, never linked: the workspace builds and
//! runs on machines without a GPU or toolkit. A missing library is
//! [`Error::LibraryMissing`], naming it and how to make it findable.
//!
//! ```no_run
//! use ferrotron_comm_core::cuda;
//! # fn main() -> ferrotron_comm_core::Result<()> {
//! let ctx = cuda::context(0)?; // typed error without a driver or device
//! let stream = ctx.default_stream();
//! let x = stream.clone_htod(&[1.0f32, 2.0, 3.0]).map_err(cuda::driver_error("clone_htod"))?;
//! let view = ferrotron_comm_core::BufRef::cuda(&x, &stream)?;
//! assert_eq!(view.memory(), ferrotron_comm_core::Device::Cuda(0));
//! # Ok(())
//! # }
//! ```

#[cfg(feature = "mpi")]
use crate::buffer::{BufMut, BufRef, Buffer};
use crate::error::{Error, Result};
use cudarc::driver::{result::DriverError, CudaStream};

/// The device layer's CUDA plumbing, which this module builds on: the version of cudarc
/// spoken, the libraries, and why GPU work cannot run here.
pub use ferrotron_device::cuda::{cudarc, unavailable_reason, Library};

/// Checks that `library` can be loaded; `purpose` says what needs it in the error
/// (the device layer's check, as this crate's error).
pub fn require(library: Library, purpose: &'static str) -> Result<()> {
    Ok(ferrotron_device::cuda::require(library, purpose)?)
}

/// Number of CUDA devices the driver reports; an error when the driver cannot be loaded.
pub fn device_count() -> Result<usize> {
    Ok(ferrotron_device::cuda::device_count()?)
}

/// The (primary) context of device `ordinal`, one per device per process (see
/// [`ferrotron_device::cuda::context`]).
pub fn context(ordinal: usize) -> Result<std::sync::Arc<cudarc::driver::CudaContext>> {
    Ok(ferrotron_device::cuda::context(ordinal)?)
}

/// PTX of `source`, compiled once per process (see [`ferrotron_device::cuda::compile`]).
pub fn compile(
    name: &'static str,
    source: impl FnOnce() -> String,
    arch: Option<&'static str>,
) -> Result<cudarc::nvrtc::Ptx> {
    Ok(ferrotron_device::cuda::compile(name, source, arch)?)
}

/// Turns a failed driver call into [`Error::Cuda`] naming the call.
pub fn driver_error(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::from(ferrotron_device::cuda::driver_error(call)(e))
}

/// Makes the stream's context current on this thread (raw driver calls need it).
pub(crate) fn bind(stream: &CudaStream) -> Result<()> {
    Ok(ferrotron_device::cuda::bind(stream)?)
}

/// Waits for everything queued on `stream` (a host wait, counted by the device layer).
pub(crate) fn synchronize(stream: &CudaStream) -> Result<()> {
    Ok(ferrotron_device::cuda::synchronize(stream)?)
}

/// Queues a copy of `bytes` bytes between any two device addresses (same device, another
/// device, or pinned host memory: unified addressing infers the direction).
pub(crate) fn copy_async(dst: u64, src: u64, bytes: usize, stream: &CudaStream) -> Result<()> {
    // SAFETY: callers pass addresses valid for `bytes` bytes until the stream is synchronized.
    Ok(unsafe { ferrotron_device::cuda::copy(stream, dst, src, bytes) }?)
}

/// Runs a host implementation of an in-place operation on a device view: copy to host,
/// run `op`, copy back. How host-only backends (MPI) accept device buffers.
#[cfg(feature = "mpi")]
pub(crate) fn staged_inout(
    mut view: BufMut<'_>,
    op: impl FnOnce(BufMut<'_>) -> Result<()>,
) -> Result<()> {
    let mut host = view.as_ref().to_host()?;
    op(host.as_buf_mut())?;
    view.copy_from_host(&host)
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
        Some(_) => Some(input.to_host()?),
        None => None,
    };
    let input = staged_input.as_ref().map_or(input, Buffer::as_buf_ref);
    match output.cuda_stream() {
        Some(_) => {
            let mut host = Buffer::zeros(output.dtype(), output.len());
            op(input, host.as_buf_mut())?;
            output.copy_from_host(&host)
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
        let ptr = unsafe { ferrotron_device::cuda::alloc(stream, bytes) }?;
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
        let _ = unsafe { ferrotron_device::cuda::free(self.stream, self.ptr) };
    }
}
