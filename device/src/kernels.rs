//! The kernel language every ferrotron crate writes its kernels in: one source for the
//! CUDA build (NVRTC, with [`CUDA_PRELUDE`] in front) and the host build the emulated
//! device runs (a C compiler, with `#include "ferrotron_kernels.h"` from the directory a
//! build script reads from `DEP_FERROTRON_DEVICE_INCLUDE`). The rules that keep the
//! emulated run a faithful model of the GPU are in `include/ferrotron_types.h`.

/// What NVRTC compiles before a crate's kernels: the types, the CUDA flavour of the
/// macros (`KERNEL`, `FOR_EACH`, `BLOCK_KERNEL`, shuffles, products rounded on their
/// own), and the 16-bit conversions.
pub const CUDA_PRELUDE: &str = concat!(
    include_str!("../include/ferrotron_types.h"),
    "\n",
    include_str!("../include/ferrotron_prelude_cuda.h"),
    "\n",
    include_str!("../include/ferrotron_half.h"),
    "\n"
);

/// The NVRTC target for a device of compute capability `major.minor`: its own virtual
/// architecture for 8.0, 8.6, 8.9 and 9.x; for other 8.x devices 8.0's, and for 10.0 and
/// newer 9.0's (the driver JIT-compiles PTX forward, so they keep the tensor-core
/// instructions); else the oldest one CUDA 12 and 13 both support (7.5: the prelude's
/// `__grid_constant__` needs 7.0, double-precision atomicAdd 6.0).
pub fn architecture(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (8, _) => "compute_80",
        (m, _) if m >= 9 => "compute_90",
        _ => "compute_75",
    }
}

/// Whether kernels built for NVRTC target `architecture` (one [`architecture`] returns)
/// may run `mma.m16n8k16` with 16-bit inputs (the prelude's `MMA_16816`): compute
/// capability 8.0 or newer. It asks about the module's target, where the instructions
/// are compiled or trap, rather than the device's capability.
///
/// ```
/// use ferrotron_device::kernels::{architecture, runs_tensor_core_mma};
///
/// assert!(runs_tensor_core_mma(architecture(9, 0)));
/// assert!(!runs_tensor_core_mma(architecture(7, 5)));
/// // 8.7 and 12.0 get 8.0's and 9.0's PTX, compiled forward by the driver.
/// assert!(runs_tensor_core_mma(architecture(8, 7)));
/// assert!(runs_tensor_core_mma(architecture(12, 0)));
/// ```
pub fn runs_tensor_core_mma(architecture: &str) -> bool {
    matches!(
        architecture,
        "compute_80" | "compute_86" | "compute_89" | "compute_90"
    )
}

/// A crate's kernels `source` (without the prelude) for CUDA device `ordinal`: behind
/// [`CUDA_PRELUDE`], compiled by NVRTC for the device's [`architecture`] once per process
/// and loaded once per device ([`Module::cuda`](crate::Module::cuda)).
#[cfg(feature = "cuda")]
pub fn cuda_module(
    ordinal: usize,
    name: &'static str,
    source: impl FnOnce() -> String,
) -> crate::Result<std::sync::Arc<crate::Module>> {
    let context = crate::cuda::context(ordinal)?;
    let (major, minor) = context
        .compute_capability()
        .map_err(crate::cuda::driver_error("query compute capability"))?;
    let source = || [CUDA_PRELUDE, &source()].concat();
    crate::Module::cuda(ordinal, name, source, Some(architecture(major, minor)))
}
