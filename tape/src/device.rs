//! Where a tensor's storage lives.

use std::fmt;

/// A compute device. Move tensors between devices with
/// [`Tensor::to_device`](crate::Tensor::to_device); operands of one op must share a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, computed with ndarray.
    #[default]
    Cpu,
    /// A CUDA device by ordinal (needs the `cuda` feature, and at run time libcuda,
    /// libnvrtc and libcublas).
    Cuda(usize),
    /// The CUDA code path run on the host: the same kernels compiled as C and executed
    /// sequentially, with a reference GEMM. For testing and debugging device code on a
    /// machine without a GPU; slow by design.
    Emulated,
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
            Device::Emulated => f.write_str("emulated"),
        }
    }
}
