//! The reduction kernels: compiled once per process by NVRTC, loaded once per device
//! (the device layer's module cache).

use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use cudarc::driver::CudaStream;

const SOURCE: &str = include_str!("reduce.cu");

/// NVRTC's name for the module.
const MODULE: &str = "ferrotron_reduce.cu";

/// Queues `out[i] = op over r of input[r * count + i]` for `rows` contiguous rows.
///
/// # Safety
/// `input` must be valid device memory for `rows * count` elements of `dtype` and `out`
/// for `count`, both on the stream's device, until the stream is synchronized.
pub(crate) unsafe fn reduce_rows(
    stream: &CudaStream,
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
    let ordinal = stream.context().ordinal();
    let module = ferrotron_device::Module::cuda(ordinal, MODULE, || SOURCE.into(), None)?;
    let function = module.function(&format!("reduce_{}", dtype.name()))?;
    // The codes reduce.cu switches on.
    let op_code: i32 = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Prod => 4,
    };
    let (count_arg, rows) = (count as u64, rows as i32);
    // SAFETY: argument types match `reduce_<dtype>` in reduce.cu (out, in, count, rows,
    // op); the caller guarantees the memory.
    unsafe { function.launch_on(stream, count, &[&out, &input, &count_arg, &rows, &op_code]) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{require, Library};
    use super::*;

    /// Compiling needs only libnvrtc, not a GPU: CI machines without it skip; a machine
    /// with the toolkit (or `pip download nvidia-cuda-nvrtc-cu12`) checks every kernel.
    #[test]
    fn reduction_kernels_compile_for_every_dtype() {
        if let Err(reason) = require(Library::Nvrtc, "this test") {
            println!("skipped: {reason}");
            return;
        }
        let ptx =
            super::super::compile(MODULE, || SOURCE.into(), None).expect("reduce.cu compiles");
        let text = ptx.to_src();
        for dtype in DType::ALL {
            let entry = format!(".entry reduce_{}", dtype.name());
            assert!(text.contains(&entry), "PTX lacks {entry}");
        }
    }
}
