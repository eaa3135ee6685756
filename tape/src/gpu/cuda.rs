//! [`Device::Cuda`] through cudarc: NVRTC-compiled kernels, cuBLAS GEMMs and stream-ordered
//! memory, all on one stream per device.

use std::collections::HashMap;
use std::sync::Arc;

use comm_core::cuda;
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::{CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use parking_lot::Mutex;

use super::{allow_tf32, Backend, Gemm, GemmFormat, Kernel, KernelArgs, Precision};
use crate::{Device, Error, Result};

// SAFETY: KernelArgs is a plain #[repr(C)] struct of integers and floats, which is
// exactly what the kernels take by value.
unsafe impl cudarc::driver::DeviceRepr for KernelArgs {}

/// A failure of comm-core's shared CUDA plumbing (library checks, contexts, NVRTC) as
/// this device's error.
fn shared(device: Device, op: &'static str) -> impl Fn(comm_core::Error) -> Error {
    move |e| Error::Device {
        op,
        device,
        message: e.to_string(),
    }
}

fn failure(device: Device, op: &'static str) -> impl Fn(String) -> Error {
    move |message| Error::Device {
        op,
        device,
        message,
    }
}

/// The kernels' CUDA source: the shared prelude, then every kernel file once per precision.
fn source() -> String {
    macro_rules! file {
        ($name:literal) => {
            include_str!(concat!("kernels/", $name))
        };
    }
    let bodies = [
        file!("elementwise.cu"),
        file!("reduce.cu"),
        file!("shape.cu"),
        file!("index.cu"),
        file!("rows.cu"),
        file!("optim.cu"),
    ]
    .join("\n");
    [
        file!("common.h"),
        file!("prelude_cuda.h"),
        file!("half.h"),
        file!("precision_f32.h"),
        &bodies,
        file!("precision_end.h"),
        file!("precision_f64.h"),
        &bodies,
        file!("precision_end.h"),
    ]
    .join("\n")
}

/// The NVRTC target for a device of compute capability `major.minor`: its own virtual
/// architecture where NVRTC knows it, else the oldest one CUDA 12 and 13 both support
/// (7.5; double-precision atomicAdd needs 6.0), which the driver JIT-compiles forward.
fn architecture(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, _) => "compute_90",
        _ => "compute_75",
    }
}

/// PTX of every kernel for `arch`, compiled once per process and architecture.
fn ptx(device: Device, arch: &'static str) -> Result<cudarc::nvrtc::Ptx> {
    cuda::compile("ferrotron_tape.cu", source, Some(arch))
        .map_err(shared(device, "compile kernels"))
}

/// A cuBLAS handle bound to the backend's stream.
struct Blas(cublas_sys::cublasHandle_t);

// SAFETY: the handle is only used under the backend's `blas` mutex.
unsafe impl Send for Blas {}

pub(crate) struct CudaBackend {
    device: Device,
    stream: Arc<CudaStream>,
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<(&'static str, Precision), CudaFunction>>,
    blas: Mutex<Blas>,
}

impl CudaBackend {
    pub(crate) fn new(ordinal: usize) -> Result<CudaBackend> {
        let device = Device::Cuda(ordinal);
        let fail = |op| failure(device, op);
        let context = cuda::context(ordinal).map_err(shared(device, "open device"))?;
        let stream = context
            .new_stream()
            .map_err(|e| fail("create stream")(format!("{e}")))?;
        let (major, minor) = context
            .compute_capability()
            .map_err(|e| fail("query compute capability")(format!("{e}")))?;
        let module = context
            .load_module(ptx(device, architecture(major, minor))?)
            .map_err(|e| fail("load kernels")(format!("{e}")))?;
        cuda::require(cuda::Library::Cublas, "matrix products on CUDA tensors")
            .map_err(shared(device, "open device"))?;
        let handle = cudarc::cublas::result::create_handle()
            .map_err(|e| fail("create cuBLAS handle")(format!("{e:?}")))?;
        // SAFETY: a fresh handle and a live stream of the same context.
        unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _) }
            .map_err(|e| fail("cublasSetStream")(format!("{e:?}")))?;
        Ok(CudaBackend {
            device,
            stream,
            module,
            functions: Mutex::new(HashMap::new()),
            blas: Mutex::new(Blas(handle)),
        })
    }

    fn fail(&self, op: &'static str) -> impl Fn(String) -> Error {
        failure(self.device, op)
    }

    fn bind(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.fail("cuCtxSetCurrent")(format!("{e}")))
    }

    fn function(&self, kernel: &Kernel, precision: Precision) -> Result<CudaFunction> {
        let mut functions = self.functions.lock();
        if let Some(function) = functions.get(&(kernel.name, precision)) {
            return Ok(function.clone());
        }
        let name = format!("{}_{}", kernel.name, precision.suffix());
        let function = self
            .module
            .load_function(&name)
            .map_err(|e| self.fail("cuModuleGetFunction")(format!("{name}: {e}")))?;
        functions.insert((kernel.name, precision), function.clone());
        Ok(function)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // SAFETY: created in `new`, used by nobody else. A failure leaves nothing to do.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.blas.get_mut().0) };
    }
}

fn driver(result: cudarc::driver::sys::CUresult) -> std::result::Result<(), String> {
    result.result().map_err(|e| format!("{e}"))
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        self.device
    }

    fn cuda_stream(&self) -> Option<&CudaStream> {
        Some(&self.stream)
    }

    unsafe fn alloc(&self, bytes: usize) -> Result<u64> {
        self.bind()?;
        // SAFETY: stream-ordered allocation on our live stream.
        unsafe { cudarc::driver::result::malloc_async(self.stream.cu_stream(), bytes.max(1)) }
            .map_err(|e| self.fail("cuMemAllocAsync")(format!("{e} ({bytes} bytes)")))
    }

    unsafe fn free(&self, ptr: u64, _bytes: usize) {
        if self.bind().is_ok() {
            // SAFETY: allocated on this stream; later work on it cannot use the memory.
            // A failure means the context is already broken; the next call reports it.
            let _ = unsafe { cudarc::driver::result::free_async(ptr, self.stream.cu_stream()) };
        }
    }

    unsafe fn upload(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees `dst`; a pageable source is copied before the
        // call returns, and we synchronize anyway so `src` may go away at once.
        unsafe {
            driver(cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                dst,
                src.as_ptr().cast(),
                src.len(),
                self.stream.cu_stream(),
            ))
        }
        .and_then(|()| self.stream.synchronize().map_err(|e| format!("{e}")))
        .map_err(self.fail("upload"))
    }

    unsafe fn download(&self, dst: &mut [u8], src: u64) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees `src`; we wait for the copy before returning.
        unsafe {
            driver(cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr().cast(),
                src,
                dst.len(),
                self.stream.cu_stream(),
            ))
        }
        .and_then(|()| self.stream.synchronize().map_err(|e| format!("{e}")))
        .map_err(self.fail("download"))
    }

    unsafe fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees both ranges.
        unsafe {
            driver(cudarc::driver::sys::cuMemcpyAsync(
                dst,
                src,
                bytes,
                self.stream.cu_stream(),
            ))
        }
        .map_err(self.fail("cuMemcpyAsync"))
    }

    unsafe fn launch(
        &self,
        kernel: &Kernel,
        precision: Precision,
        items: usize,
        args: &KernelArgs,
    ) -> Result<()> {
        self.bind()?;
        let function = self.function(kernel, precision)?;
        let threads = 256u32;
        // Grid-stride loops: enough blocks to fill the device, never more than needed.
        let blocks = items.div_ceil(threads as usize).clamp(1, 65_535) as u32;
        let config = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(&function);
        launch.arg(args);
        // SAFETY: every kernel takes one KernelArgs by value; the caller guarantees the
        // addresses in it.
        unsafe { launch.launch(config) }
            .map(drop)
            .map_err(|e| self.fail("cuLaunchKernel")(format!("{}: {e}", kernel.name)))
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.stream
            .synchronize()
            .map_err(|e| self.fail("cuStreamSynchronize")(format!("{e}")))
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        self.bind()?;
        let blas = self.blas.lock();
        let op = |t| {
            if t {
                cublas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cublas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let dims = [g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.batch];
        let [m, n, k, lda, ldb, ldc, batch] = dims.map(|d| d as i32);
        if dims.iter().any(|&d| d > i32::MAX as usize) {
            return Err(self.fail("cublasGemmStridedBatched")(format!(
                "dimension too large for cuBLAS's 32-bit arguments: {dims:?}"
            )));
        }
        let (sa, sb, sc) = (g.stride_a as i64, g.stride_b as i64, g.stride_c as i64);
        // SAFETY: the caller guarantees the matrices' extents; the handle is ours (locked).
        let status = unsafe {
            match g.format {
                GemmFormat::F32 => {
                    let mode = if allow_tf32() {
                        cublas_sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
                    } else {
                        cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH
                    };
                    let status = cublas_sys::cublasSetMathMode(blas.0, mode);
                    if status != cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                        return Err(self.fail("cublasSetMathMode")(format!("{status:?}")));
                    }
                    let (alpha, beta) = (g.alpha as f32, g.beta as f32);
                    cudarc::cublas::result::sgemm_strided_batched(
                        blas.0,
                        op(g.transpose_a),
                        op(g.transpose_b),
                        m,
                        n,
                        k,
                        &alpha,
                        g.a as *const f32,
                        lda,
                        sa,
                        g.b as *const f32,
                        ldb,
                        sb,
                        &beta,
                        g.c as *mut f32,
                        ldc,
                        sc,
                        batch,
                    )
                }
                GemmFormat::Bf16
                | GemmFormat::F16
                | GemmFormat::Bf16IntoF32
                | GemmFormat::F16IntoF32 => {
                    use cublas_sys::cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F};
                    let (format, result) = match g.format {
                        GemmFormat::Bf16 => (CUDA_R_16BF, CUDA_R_16BF),
                        GemmFormat::F16 => (CUDA_R_16F, CUDA_R_16F),
                        GemmFormat::Bf16IntoF32 => (CUDA_R_16BF, CUDA_R_32F),
                        _ => (CUDA_R_16F, CUDA_R_32F),
                    };
                    // f32 scalars, as the f32 compute type asks.
                    let (alpha, beta) = (g.alpha as f32, g.beta as f32);
                    cudarc::cublas::result::gemm_strided_batched_ex(
                        blas.0,
                        op(g.transpose_a),
                        op(g.transpose_b),
                        m,
                        n,
                        k,
                        (&alpha as *const f32).cast(),
                        g.a as *const std::ffi::c_void,
                        format,
                        lda,
                        sa,
                        g.b as *const std::ffi::c_void,
                        format,
                        ldb,
                        sb,
                        (&beta as *const f32).cast(),
                        g.c as *mut std::ffi::c_void,
                        result,
                        ldc,
                        sc,
                        batch,
                        cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                GemmFormat::F64 => cudarc::cublas::result::dgemm_strided_batched(
                    blas.0,
                    op(g.transpose_a),
                    op(g.transpose_b),
                    m,
                    n,
                    k,
                    &g.alpha,
                    g.a as *const f64,
                    lda,
                    sa,
                    g.b as *const f64,
                    ldb,
                    sb,
                    &g.beta,
                    g.c as *mut f64,
                    ldc,
                    sc,
                    batch,
                ),
            }
        };
        status.map_err(|e| self.fail("cublasGemmStridedBatched")(format!("{e:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiling needs only libnvrtc, not a GPU: machines without it skip; a machine with
    /// the toolkit (or `pip download nvidia-cuda-nvrtc-cu12`) checks every kernel.
    #[test]
    fn every_kernel_compiles_with_nvrtc() {
        if let Err(reason) = cuda::require(cuda::Library::Nvrtc, "this test") {
            println!("skipped: {reason}");
            return;
        }
        // The fallback architecture and Hopper's (the GPU machines').
        for (major, minor) in [(7, 5), (9, 0)] {
            let ptx = ptx(Device::Cuda(0), architecture(major, minor))
                .expect("the kernels compile")
                .to_src();
            for kernel in super::super::KERNEL_LISTS
                .iter()
                .flat_map(|list| list.iter())
            {
                for precision in [Precision::F32, Precision::F64] {
                    let entry = format!(".entry {}_{}", kernel.name, precision.suffix());
                    assert!(ptx.contains(&entry), "PTX lacks {entry}");
                }
            }
        }
    }
}
