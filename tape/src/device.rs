//! Where a tensor's storage lives.

/// A compute device. Only [`Device::Cpu`] is implemented; asking for CUDA returns
/// [`Error::UnsupportedDevice`](crate::Error::UnsupportedDevice) until the CUDA backend lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, computed with ndarray.
    #[default]
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}
