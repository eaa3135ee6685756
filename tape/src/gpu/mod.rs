//! Device tensors (feature `cuda`): storage, the two backends that run the kernels, and
//! the device versions of the ops.
//!
//! One kernel source (`kernels/*.cu`) serves two backends:
//! - [`Device::Cuda`]: compiled at run time by NVRTC, GEMMs through cuBLAS, on one stream
//!   per device (so all work on a device is ordered without events);
//! - [`Device::Emulated`]: the same kernels compiled as C by the build script and run
//!   sequentially on the host, with a reference column-major GEMM. It exercises every line
//!   of the device path except the CUDA calls themselves, which is how this code is tested
//!   on machines without a GPU, and a way to debug device code on a laptop.
//!
//! Kernels follow one rule that makes the emulation faithful: each is a loop over
//! independent indices (no shared memory, no block synchronisation), and iterations only
//! interact through atomic adds.

pub(crate) use array::GpuArray;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use crate::{Device, Element, Error, Result};

/// The argument block of every kernel; layout shared with `kernels/common.h`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct KernelArgs {
    pub p: [u64; 8],
    pub i: [i64; 32],
    pub f: [f64; 8],
}

/// Most dimensions a kernel's shape arguments can describe.
pub(crate) const MAX_DIMS: usize = 8;

// SAFETY: a #[repr(C)] struct of integers and floats, which is exactly what every kernel
// takes by value (`kernels/common.h`).
unsafe impl ferrotron_device::KernelArg for KernelArgs {}

pub(crate) use ferrotron_device::profile::Cost;

/// The cost of a launch that reads `read` bytes and writes `written` (what a device
/// profile counts).
pub(crate) fn moves(read: usize, written: usize) -> Cost {
    Cost {
        read: read as u64,
        written: written as u64,
        flops: 0,
    }
}

/// Bytes of `n` elements stored in `format` by a kernel computing in `T` (0: `T` itself,
/// 1 and 2: 16-bit).
pub(crate) fn stored_bytes<T>(n: usize, format: i64) -> usize {
    n * match format {
        0 => std::mem::size_of::<T>(),
        _ => 2,
    }
}

/// A host build of one kernel: it reads a [`KernelArgs`] through the pointer.
pub(crate) type HostKernel = ferrotron_device::HostKernel;

/// A kernel by name, with its host builds for f32 and f64.
pub(crate) struct Kernel {
    pub name: &'static str,
    pub host: HostBuilds,
}

/// A kernel's host builds: a loop over independent indices, or a cooperative kernel run
/// thread by thread over a grid of blocks (`ferrotron_device::blocks`).
pub(crate) enum HostBuilds {
    Indices([HostKernel; 2]),
    Blocks([ferrotron_device::BlockKernel; 2]),
    /// A cooperative kernel built in f32 only (16-bit operands, f32 accumulators).
    BlocksF32(ferrotron_device::BlockKernel),
}

impl Kernel {
    /// Whether the kernel writes through address slot `slot` of its [`KernelArgs`]: the
    /// first (the output) always; the others only where a kernel has several outputs
    /// (read from `kernels/*.cu`).
    pub(crate) fn writes(&self, slot: usize) -> bool {
        let more: &[usize] = match self.name {
            "reduce_dim" | "sgd_step" => &[2],
            "adamw_step" => &[2, 3, 4],
            "cross_entropy_rows" => &[1],
            "layer_norm_rows" => &[4, 5],
            "layer_norm_affine_backward" | "attention_forward" | "attention_backward_kv" => &[1],
            name if name.starts_with("attention_tc_forward_")
                || name.starts_with("attention_tc_backward_kv_") =>
            {
                &[1]
            }
            _ => &[],
        };
        slot == 0 || more.contains(&slot)
    }

    /// The precisions the kernel is built in.
    #[cfg(all(test, feature = "cuda"))] // read by the NVRTC test
    pub(crate) fn precisions(&self) -> &'static [Precision] {
        match self.host {
            HostBuilds::BlocksF32(_) => &[Precision::F32],
            _ => &[Precision::F32, Precision::F64],
        }
    }
}

/// Declares kernels compiled into the emulator and names them for NVRTC; `$list` names
/// them all (the NVRTC test checks each one compiled).
macro_rules! kernels {
    ($list:ident: $($constant:ident = $name:literal : $f32:ident, $f64:ident;)*) => {
        // The C builds take `const KernelArgs*`; any pointer passes alike.
        extern "C" {
            $(fn $f32(args: *const std::ffi::c_void); fn $f64(args: *const std::ffi::c_void);)*
        }
        $(pub(crate) const $constant: Kernel = Kernel {
            name: $name,
            host: $crate::gpu::HostBuilds::Indices([$f32, $f64]),
        };)*
        pub(crate) const $list: &[&Kernel] = &[$(&$constant),*];
    };
}

/// [`kernels!`] for cooperative kernels, whose C builds also take the emulated thread.
macro_rules! block_kernels {
    ($list:ident: $($constant:ident = $name:literal : $f32:ident, $f64:ident;)*) => {
        extern "C" {
            $(
                fn $f32(args: *const std::ffi::c_void, thread: *mut ferrotron_device::Thread);
                fn $f64(args: *const std::ffi::c_void, thread: *mut ferrotron_device::Thread);
            )*
        }
        $(pub(crate) const $constant: Kernel = Kernel {
            name: $name,
            host: $crate::gpu::HostBuilds::Blocks([$f32, $f64]),
        };)*
        pub(crate) const $list: &[&Kernel] = &[$(&$constant),*];
    };
}

/// [`block_kernels!`] for cooperative kernels built in f32 only.
macro_rules! f32_block_kernels {
    ($list:ident: $($constant:ident = $name:literal : $f32:ident;)*) => {
        extern "C" {
            $(fn $f32(args: *const std::ffi::c_void, thread: *mut ferrotron_device::Thread);)*
        }
        $(pub(crate) const $constant: Kernel = Kernel {
            name: $name,
            host: $crate::gpu::HostBuilds::BlocksF32($f32),
        };)*
        pub(crate) const $list: &[&Kernel] = &[$(&$constant),*];
    };
}

kernels! {
    MATH_KERNELS:
    FILL = "fill": fill_f32, fill_f64;
    BINARY = "binary": binary_f32, binary_f64;
    UNARY = "unary": unary_f32, unary_f64;
    UNARY_BACKWARD = "unary_backward": unary_backward_f32, unary_backward_f64;
    REDUCE_DIM = "reduce_dim": reduce_dim_f32, reduce_dim_f64;
    EXPAND_DIM = "expand_dim": expand_dim_f32, expand_dim_f64;
    MAX_BACKWARD = "max_backward": max_backward_f32, max_backward_f64;
    CONVERT_HALF = "convert_half": convert_half_f32, convert_half_f64;
}

mod array;
pub(crate) mod attention_ops;
#[cfg(feature = "cuda")]
mod cuda;
mod emulator;
pub(crate) mod ops;
pub(crate) mod optim_ops;
pub(crate) mod row_ops;
pub(crate) mod shape_ops;

/// Every kernel, by family (the NVRTC test checks that each one compiled).
#[allow(dead_code)] // read by the NVRTC test
pub(crate) const KERNEL_LISTS: [&[&Kernel]; 7] = [
    MATH_KERNELS,
    attention_ops::ATTENTION_KERNELS,
    attention_ops::TENSOR_CORE_KERNELS,
    shape_ops::SHAPE_KERNELS,
    row_ops::ROW_KERNELS,
    row_ops::COLUMN_KERNELS,
    optim_ops::OPTIM_KERNELS,
];

/// Which build of a kernel (and which GEMM) an element type uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Precision {
    F32,
    F64,
}

impl Precision {
    pub(crate) fn of<T: Element>() -> Precision {
        if std::mem::size_of::<T>() == 4 {
            Precision::F32
        } else {
            Precision::F64
        }
    }

    fn index(self) -> usize {
        match self {
            Precision::F32 => 0,
            Precision::F64 => 1,
        }
    }

    /// The build's name suffix (NVRTC's kernel names, profiles' lines).
    pub(crate) fn suffix(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F64 => "f64",
        }
    }
}

/// Elements kernels read and write as stored: an element type (format 0, computed in by
/// its own build of a kernel), or a 16-bit float (format 1 bf16, 2 f16), which pointwise
/// kernels widen on load and round once on store, and shape kernels move as bits.
pub(crate) trait Stored: Copy + Default {
    const FORMAT: i64;
    /// The build a kernel that only moves or fills these elements runs: the element
    /// type's own, or for 16-bit ones the f32 build.
    fn build() -> Precision;
}

impl<T: Element> Stored for T {
    const FORMAT: i64 = 0;
    fn build() -> Precision {
        Precision::of::<T>()
    }
}

impl Stored for half::bf16 {
    const FORMAT: i64 = 1;
    fn build() -> Precision {
        Precision::F32
    }
}

impl Stored for half::f16 {
    const FORMAT: i64 = 2;
    fn build() -> Precision {
        Precision::F32
    }
}

/// A 16-bit float format as kernels and GEMMs see it: its code in `convert_half` and
/// its conversions to and from f32.
pub(crate) trait HalfFormat: ferrotron_comm_core::Element + Stored {
    /// `convert_half`'s kind for narrowing into this format (widening is this + 2).
    const KIND: i64;
    fn narrow(value: f32) -> Self;
    fn widen(self) -> f32;
}

impl HalfFormat for half::bf16 {
    const KIND: i64 = 0;
    fn narrow(value: f32) -> Self {
        half::bf16::from_f32(value)
    }
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

impl HalfFormat for half::f16 {
    const KIND: i64 = 1;
    fn narrow(value: f32) -> Self {
        half::f16::from_f32(value)
    }
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// The element format of a GEMM's A, B and C. Products of 16-bit matrices accumulate in
/// f32 (cuBLAS's `CUBLAS_COMPUTE_32F`) and round C once, or write it in f32; the others
/// accumulate in their own type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GemmFormat {
    F32,
    F64,
    Bf16,
    F16,
    /// bf16 A and B, f32 C: as Megatron's weight-gradient GEMM writes fp32 main
    /// gradients from bf16 operands.
    Bf16IntoF32,
    /// f16 A and B, f32 C.
    F16IntoF32,
}

impl GemmFormat {
    /// Bytes of an element of A and B, and of C.
    pub(crate) fn bytes(self) -> (usize, usize) {
        match self {
            GemmFormat::F32 => (4, 4),
            GemmFormat::F64 => (8, 8),
            GemmFormat::Bf16 | GemmFormat::F16 => (2, 2),
            GemmFormat::Bf16IntoF32 | GemmFormat::F16IntoF32 => (2, 4),
        }
    }

    /// Its name in profiles.
    pub(crate) fn name(self) -> &'static str {
        match self {
            GemmFormat::F32 => "f32",
            GemmFormat::F64 => "f64",
            GemmFormat::Bf16 => "bf16",
            GemmFormat::F16 => "f16",
            GemmFormat::Bf16IntoF32 => "bf16_into_f32",
            GemmFormat::F16IntoF32 => "f16_into_f32",
        }
    }

    pub(crate) fn of<T: Element>() -> GemmFormat {
        match Precision::of::<T>() {
            Precision::F32 => GemmFormat::F32,
            Precision::F64 => GemmFormat::F64,
        }
    }
}

/// A column-major, strided-batched GEMM (cuBLAS's convention):
/// `C_i = alpha · op(A_i) · op(B_i) + beta · C_i` for `batch` matrices.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    pub format: GemmFormat,
    pub transpose_a: bool,
    pub transpose_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f64,
    pub a: u64,
    pub lda: usize,
    pub stride_a: usize,
    pub b: u64,
    pub ldb: usize,
    pub stride_b: usize,
    pub beta: f64,
    pub c: u64,
    pub ldc: usize,
    pub stride_c: usize,
    pub batch: usize,
}

/// What runs a device's work: its stream (memory, copies and launches, from the device
/// layer), each kernel's build for it, and GEMMs.
///
/// Addresses are plain `u64`s of [`ferrotron_device::DeviceMemory`] that arrays hold; the `unsafe`
/// method requires them to be live allocations of this backend's device, large enough for
/// the access.
pub(crate) trait Backend: Send + Sync {
    /// The stream all of the device's tensor work is queued on, in submission order.
    fn stream(&self) -> &ferrotron_device::Stream;
    fn device(&self) -> Device {
        self.stream().device()
    }
    /// `kernel`'s `precision` build for this device.
    fn function(&self, kernel: &Kernel, precision: Precision)
        -> Result<ferrotron_device::Function>;
    unsafe fn gemm(&self, gemm: &Gemm) -> Result<()>;
    /// Whether the device runs warp-level matrix instructions with 16-bit inputs
    /// (`mma.m16n8k16`: compute capability 8.0 and newer; the emulated device).
    fn tensor_cores(&self) -> bool;
}

/// Whether `device` runs tape's tensor-core kernels (false for the CPU, or a device
/// that cannot be opened: the caller's other path says why).
pub(crate) fn tensor_cores(device: Device) -> bool {
    device != Device::Cpu && backend("tensor cores", device).is_ok_and(|b| b.tensor_cores())
}

/// Waits until all work queued on `device` has finished (like
/// `torch.cuda.synchronize`); for timing, since device ops return once queued. A no-op on
/// the CPU.
pub fn synchronize(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        _ => (backend("synchronize", device)?.stream().synchronize())
            .map_err(Error::on_device("synchronize", device)),
    }
}

/// The backend of `device` for this thread: on a thread with streams of its own (a rank
/// thread, [`ferrotron_device::use_own_streams`]) one made for it on its own stream, else
/// the one every other thread shares; created on first use.
pub(crate) fn backend(op: &'static str, device: Device) -> Result<Arc<dyn Backend>> {
    type Backends = HashMap<Device, Arc<dyn Backend>>;
    static SHARED: OnceLock<Mutex<Backends>> = OnceLock::new();
    thread_local! {
        static OWN: std::cell::RefCell<Backends> = Default::default();
    }
    if device == Device::Cpu {
        return Err(Error::UnsupportedDevice { op, device });
    }
    let on_device = |e| Error::on_device("open device", device)(e);
    if ferrotron_device::own_streams() {
        if let Some(backend) = OWN.with_borrow(|own| own.get(&device).cloned()) {
            return Ok(backend);
        }
        let stream =
            ferrotron_device::own_stream(device, ferrotron_device::Role::Compute, "compute")
                .map_err(on_device)?;
        let backend = new_backend(op, stream)?;
        OWN.with_borrow_mut(|own| own.insert(device, backend.clone()));
        return Ok(backend);
    }
    let mut shared = SHARED.get_or_init(Default::default).lock();
    if let Some(backend) = shared.get(&device) {
        return Ok(backend.clone());
    }
    let stream = ferrotron_device::Stream::new(device).map_err(on_device)?;
    let backend = new_backend(op, stream)?;
    shared.insert(device, backend.clone());
    Ok(backend)
}

/// A backend whose work goes on `stream`.
fn new_backend(op: &'static str, stream: ferrotron_device::Stream) -> Result<Arc<dyn Backend>> {
    Ok(match stream.device() {
        Device::Emulated => Arc::new(emulator::Emulator::new(stream)),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => Arc::new(cuda::CudaBackend::new(stream)?),
        device => return Err(Error::UnsupportedDevice { op, device }),
    })
}

/// Whether cuBLAS may use TF32 tensor cores for f32 GEMMs (off by default, as
/// `torch.backends.cuda.matmul.allow_tf32`). TF32 keeps f32's range with a 10-bit
/// mantissa: several times faster on Ampere and later, with ~1e-3 relative error.
pub fn set_allow_tf32(allow: bool) {
    ALLOW_TF32.store(allow, std::sync::atomic::Ordering::Relaxed);
}

/// The current TF32 setting; see [`set_allow_tf32`].
pub fn allow_tf32() -> bool {
    ALLOW_TF32.load(std::sync::atomic::Ordering::Relaxed)
}

static ALLOW_TF32: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
