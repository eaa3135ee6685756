//! The local backend's reduction kernel over device memory (`kernels/reduce.cu`), written
//! in the device crate's kernel language: NVRTC compiles it for a GPU (once per process,
//! loaded once per device), and the build script compiles the same source as C for the
//! emulated device, so the emulated device runs the GPU's arithmetic.

use ferrotron_device::{Access, Arg, Device, Function, KernelArg, Stream};

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// The kernel source, after the kernel language's prelude on CUDA.
#[cfg(feature = "cuda")]
const SOURCE: &str = include_str!("kernels/reduce.cu");

/// NVRTC's name for the module.
#[cfg(feature = "cuda")]
const MODULE: &str = "ferrotron_comm_reduce.cu";

/// Most rows one launch reduces (`REDUCE_ROWS` in reduce.cu).
pub(crate) const REDUCE_ROWS: usize = 60;

/// The argument block of the reduction (`ReduceArgs` in reduce.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct ReduceArgs {
    out: u64,
    count: u64,
    rows: i64,
    op: i64,
    row: [u64; REDUCE_ROWS],
}

// SAFETY: a #[repr(C)] struct of 8-byte integers, laid out as reduce.cu's `ReduceArgs`.
unsafe impl KernelArg for ReduceArgs {}

type HostKernel = unsafe extern "C" fn(*const std::ffi::c_void);

extern "C" {
    fn ferrotron_reduce_f32(args: *const std::ffi::c_void);
    fn ferrotron_reduce_f64(args: *const std::ffi::c_void);
    fn ferrotron_reduce_i32(args: *const std::ffi::c_void);
    fn ferrotron_reduce_i64(args: *const std::ffi::c_void);
    fn ferrotron_reduce_u8(args: *const std::ffi::c_void);
    fn ferrotron_reduce_f16(args: *const std::ffi::c_void);
    fn ferrotron_reduce_bf16(args: *const std::ffi::c_void);
}

/// The kernel's name for `dtype`, and its host build.
fn kernel(dtype: DType) -> (&'static str, HostKernel) {
    match dtype {
        DType::F32 => ("ferrotron_reduce_f32", ferrotron_reduce_f32),
        DType::F64 => ("ferrotron_reduce_f64", ferrotron_reduce_f64),
        DType::I32 => ("ferrotron_reduce_i32", ferrotron_reduce_i32),
        DType::I64 => ("ferrotron_reduce_i64", ferrotron_reduce_i64),
        DType::U8 => ("ferrotron_reduce_u8", ferrotron_reduce_u8),
        DType::F16 => ("ferrotron_reduce_f16", ferrotron_reduce_f16),
        DType::BF16 => ("ferrotron_reduce_bf16", ferrotron_reduce_bf16),
    }
}

/// The reduction of `dtype` for `device`: its host build on the emulated device (named
/// `as_name` there, for the ordering checker's reports), the NVRTC module's function on a
/// GPU.
fn function(device: Device, dtype: DType, as_name: &'static str) -> Result<Function> {
    match device {
        Device::Emulated => Ok(Function::host(as_name, kernel(dtype).1)),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            let module = ferrotron_device::kernels::cuda_module(ordinal, MODULE, || SOURCE.into())?;
            Ok(module.function(kernel(dtype).0)?)
        }
        other => Err(Error::Config(format!(
            "the local backend reduces device memory on a GPU or the emulated device, not {other}"
        ))),
    }
}

/// The kernel's argument: `out[i] = op over r of rows[r][i]`.
fn arguments(op: ReduceOp, out: u64, rows: &[u64], count: usize) -> Result<ReduceArgs> {
    if rows.is_empty() || rows.len() > REDUCE_ROWS {
        return Err(Error::Config(format!(
            "the local backend reduces device memory of 1 to {REDUCE_ROWS} ranks in one \
             call, not {}: use a group of fewer ranks, or NCCL",
            rows.len()
        )));
    }
    let mut row = [0u64; REDUCE_ROWS];
    row[..rows.len()].copy_from_slice(rows);
    // The codes reduce.cu switches on.
    let op = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Prod => 4,
    };
    Ok(ReduceArgs {
        out,
        count: count as u64,
        rows: rows.len() as i64,
        op,
        row,
    })
}

/// Queues `out[i] = op over r of rows[r][i]` (`count` elements of `dtype` each) on
/// `stream`, combining in row order, as part of the collective `call` (what the ordering
/// checker names it). `out` may be one of the rows (each element is read before it is
/// written), never part of one.
///
/// # Safety
/// Every row and `out` must be memory `stream`'s device can address, valid for `count`
/// elements until the kernel has run.
pub(crate) unsafe fn reduce(
    stream: &Stream,
    call: &'static str,
    op: ReduceOp,
    dtype: DType,
    out: u64,
    rows: &[u64],
    count: usize,
) -> Result<()> {
    let args = arguments(op, out, rows, count)?;
    let function = function(stream.device(), dtype, call)?;
    let bytes = count * dtype.size_in_bytes();
    // `out` may be a row: its write covers the read.
    let mut accesses: Vec<Access> = (rows.iter())
        .filter(|&&row| row != out)
        .map(|&row| Access::read(row, bytes))
        .collect();
    accesses.push(Access::write(out, bytes));
    let args: [&dyn Arg; 1] = [&args];
    // SAFETY: the argument is the kernel's; the caller guarantees the memory.
    Ok(unsafe { stream.launch(&function, count, &args, &accesses) }?)
}

/// [`reduce`] on a stream held as cudarc's, over `rows` contiguous rows from `input`.
///
/// # Safety
/// `input` must be valid device memory for `rows * count` elements of `dtype` and `out`
/// for `count`, both on the stream's device, until the stream has run the kernel.
#[cfg(feature = "cuda")]
pub(crate) unsafe fn reduce_rows(
    stream: &cudarc::driver::CudaStream,
    op: ReduceOp,
    dtype: DType,
    out: u64,
    input: u64,
    count: usize,
    rows: usize,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let row_bytes = (count * dtype.size_in_bytes()) as u64;
    let rows: Vec<u64> = (0..rows as u64).map(|r| input + r * row_bytes).collect();
    let args = arguments(op, out, &rows, count)?;
    let (name, _) = kernel(dtype);
    let function = function(Device::Cuda(stream.context().ordinal()), dtype, name)?;
    // SAFETY: the argument is the kernel's; the caller guarantees the memory.
    unsafe { function.launch_on(stream, count, &[&args]) }?;
    Ok(())
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use crate::cuda::{require, Library};

    /// Compiling needs only libnvrtc, not a GPU: CI machines without it skip; a machine
    /// with the toolkit (or `pip download nvidia-cuda-nvrtc-cu12`) checks every kernel.
    #[test]
    fn reduction_kernels_compile_for_every_dtype() {
        if let Err(reason) = require(Library::Nvrtc, "this test") {
            println!("skipped: {reason}");
            return;
        }
        let source = || [ferrotron_device::kernels::CUDA_PRELUDE, SOURCE].concat();
        // The fallback architecture and Hopper's (the GPU machines').
        for arch in ["compute_75", "compute_90"] {
            let ptx = crate::cuda::compile(MODULE, source, Some(arch)).expect("reduce.cu compiles");
            let text = ptx.to_src();
            for dtype in DType::ALL {
                let entry = format!(".entry {}", kernel(dtype).0);
                assert!(text.contains(&entry), "PTX lacks {entry} for {arch}");
            }
        }
    }
}
