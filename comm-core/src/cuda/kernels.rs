//! The reduction kernels: compiled once per process by NVRTC, loaded once per device.

use super::{driver_error, require, Library};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

const SOURCE: &str = include_str!("reduce.cu");

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
        .map_err(|message| Error::Cuda {
            call: format!("nvrtcCompileProgram ({name})"),
            message,
        })
}

/// The PTX of `reduce.cu`.
fn ptx() -> Result<Ptx> {
    compile("ferrotron_reduce.cu", || SOURCE.into(), None)
}

fn module(stream: &CudaStream) -> Result<Arc<CudaModule>> {
    static MODULES: OnceLock<Mutex<HashMap<usize, Arc<CudaModule>>>> = OnceLock::new();
    let ctx = stream.context();
    let mut modules = MODULES.get_or_init(Default::default).lock();
    if let Some(module) = modules.get(&ctx.ordinal()) {
        return Ok(module.clone());
    }
    let module = ctx
        .load_module(ptx()?)
        .map_err(driver_error("cuModuleLoadData (reduce.cu)"))?;
    modules.insert(ctx.ordinal(), module.clone());
    Ok(module)
}

fn function(stream: &CudaStream, dtype: DType) -> Result<CudaFunction> {
    let name = format!("reduce_{}", dtype.name());
    module(stream)?
        .load_function(&name)
        .map_err(driver_error("cuModuleGetFunction"))
}

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
    let function = function(stream, dtype)?;
    // The codes reduce.cu switches on.
    let op_code: i32 = match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Prod => 4,
    };
    let (count, rows) = (count as u64, rows as i32);
    let threads = 256u32;
    let blocks = count.div_ceil(u64::from(threads)).min(65_535) as u32;
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&function);
    launch
        .arg(&out)
        .arg(&input)
        .arg(&count)
        .arg(&rows)
        .arg(&op_code);
    // SAFETY: argument types match `reduce_<dtype>` in reduce.cu; the caller guarantees
    // the memory.
    unsafe { launch.launch(config) }
        .map(drop)
        .map_err(driver_error("cuLaunchKernel (reduce)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiling needs only libnvrtc, not a GPU: CI machines without it skip; a machine
    /// with the toolkit (or `pip download nvidia-cuda-nvrtc-cu12`) checks every kernel.
    #[test]
    fn reduction_kernels_compile_for_every_dtype() {
        if let Err(reason) = require(Library::Nvrtc, "this test") {
            println!("skipped: {reason}");
            return;
        }
        let ptx = ptx().expect("reduce.cu compiles");
        let text = ptx.to_src();
        for dtype in DType::ALL {
            let entry = format!(".entry reduce_{}", dtype.name());
            assert!(text.contains(&entry), "PTX lacks {entry}");
        }
    }
}
