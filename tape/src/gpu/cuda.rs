//! [`Device::Cuda`]: NVRTC-compiled kernels and stream-ordered memory from the device
//! layer, GEMMs through cuBLAS, all on the backend's stream (one per device, or one per rank
//! thread).

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::sys as cublas_sys;
use parking_lot::Mutex;

use super::{allow_tf32, Backend, Gemm, GemmFormat, Kernel, Precision};
use crate::{Device, Error, Result};

fn failure(device: Device, op: &'static str) -> impl Fn(String) -> Error {
    move |message| Error::Device {
        op,
        device,
        message,
    }
}

/// The kernels' CUDA source: the kernel language, tape's argument blocks, then every
/// kernel file once per precision.
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
        file!("attention.cu"),
        file!("optim.cu"),
    ]
    .join("\n");
    // The tensor-core kernels: f32 only, once per head dimension.
    let tensor_cores = [64, 128]
        .map(|d| {
            format!(
                "#define TC_D {d}\n#define TC_TAG _d{d}\n{}\n#undef TC_D\n#undef TC_TAG\n",
                file!("attention_tc.cu")
            )
        })
        .join("\n");
    [
        ferrotron_device::kernels::CUDA_PRELUDE,
        file!("common.h"),
        file!("precision_f32.h"),
        &bodies,
        &tensor_cores,
        file!("precision_end.h"),
        file!("precision_f64.h"),
        &bodies,
        file!("precision_end.h"),
    ]
    .join("\n")
}

/// NVRTC's name for the kernels' module.
const MODULE: &str = "ferrotron_tape.cu";

/// A cuBLAS handle bound to the backend's stream.
struct Blas(cublas_sys::cublasHandle_t);

// SAFETY: the handle is only used under the backend's `blas` mutex.
unsafe impl Send for Blas {}

pub(crate) struct CudaBackend {
    device: Device,
    stream: ferrotron_device::Stream,
    module: Arc<ferrotron_device::Module>,
    /// Kernels built for compute capability 8.0 or newer: `mma.m16n8k16` with 16-bit
    /// inputs.
    tensor_cores: bool,
    functions: Mutex<HashMap<(&'static str, Precision), ferrotron_device::Function>>,
    blas: Mutex<Blas>,
}

impl CudaBackend {
    /// The device of `stream` (a CUDA stream), its work queued there.
    pub(crate) fn new(stream: ferrotron_device::Stream) -> Result<CudaBackend> {
        let device = stream.device();
        let Device::Cuda(ordinal) = device else {
            return Err(Error::UnsupportedDevice {
                op: "open device",
                device,
            });
        };
        let fail = |op| failure(device, op);
        let open = Error::on_device("open device", device);
        let context = ferrotron_device::cuda::context(ordinal).map_err(&open)?;
        let (major, minor) = context
            .compute_capability()
            .map_err(|e| fail("query compute capability")(format!("{e}")))?;
        let arch = ferrotron_device::kernels::architecture(major, minor);
        let module = ferrotron_device::Module::cuda(ordinal, MODULE, source, Some(arch))
            .map_err(Error::on_device("load kernels", device))?;
        ferrotron_device::cuda::require(
            ferrotron_device::cuda::Library::Cublas,
            "matrix products on CUDA tensors",
        )
        .map_err(&open)?;
        let handle = cudarc::cublas::result::create_handle()
            .map_err(|e| fail("create cuBLAS handle")(format!("{e:?}")))?;
        let cu_stream = stream.cuda().map(|s| s.cu_stream());
        // SAFETY: a fresh handle and a live stream of the same context.
        unsafe {
            cudarc::cublas::result::set_stream(
                handle,
                cu_stream.unwrap_or(std::ptr::null_mut()) as _,
            )
        }
        .map_err(|e| fail("cublasSetStream")(format!("{e:?}")))?;
        Ok(CudaBackend {
            device,
            stream,
            module,
            tensor_cores: ferrotron_device::kernels::runs_tensor_core_mma(arch),
            functions: Mutex::new(HashMap::new()),
            blas: Mutex::new(Blas(handle)),
        })
    }

    fn fail(&self, op: &'static str) -> impl Fn(String) -> Error {
        failure(self.device, op)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // SAFETY: created in `new`, used by nobody else. A failure leaves nothing to do.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(self.blas.get_mut().0) };
    }
}

impl Backend for CudaBackend {
    fn stream(&self) -> &ferrotron_device::Stream {
        &self.stream
    }

    fn tensor_cores(&self) -> bool {
        self.tensor_cores
    }

    fn function(
        &self,
        kernel: &Kernel,
        precision: Precision,
    ) -> Result<ferrotron_device::Function> {
        let mut functions = self.functions.lock();
        if let Some(function) = functions.get(&(kernel.name, precision)) {
            return Ok(function.clone());
        }
        let name = format!("{}_{}", kernel.name, precision.suffix());
        let function =
            (self.module.function(&name)).map_err(Error::on_device("load kernel", self.device))?;
        functions.insert((kernel.name, precision), function.clone());
        Ok(function)
    }

    unsafe fn gemm(&self, g: &Gemm) -> Result<()> {
        self.stream
            .bind()
            .map_err(Error::on_device("cublasGemmStridedBatched", self.device))?;
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
        if let Err(reason) =
            ferrotron_device::cuda::require(ferrotron_device::cuda::Library::Nvrtc, "this test")
        {
            println!("skipped: {reason}");
            return;
        }
        // The fallback architecture and Hopper's (the GPU machines').
        for (major, minor) in [(7, 5), (9, 0)] {
            let ptx = ferrotron_device::cuda::compile(
                MODULE,
                source,
                Some(ferrotron_device::kernels::architecture(major, minor)),
            )
            .expect("the kernels compile")
            .to_src();
            for kernel in super::super::KERNEL_LISTS
                .iter()
                .flat_map(|list| list.iter())
            {
                for &precision in kernel.precisions() {
                    let entry = format!(".entry {}_{}", kernel.name, precision.suffix());
                    assert!(ptx.contains(&entry), "PTX lacks {entry}");
                }
            }
        }
    }
}
