//! Where memory lives and computation runs.

use std::fmt;

/// A device: where a buffer's elements live and where tensors compute (tape moves
/// tensors between devices with `Tensor::to_device`; operands of one op share a device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory (tape computes with ndarray).
    #[default]
    Cpu,
    /// A CUDA device by ordinal (needs the `cuda` feature, and at run time libcuda, and
    /// libnvrtc and libcublas for tape, libnccl for the `nccl` backend).
    Cuda(usize),
    /// The CUDA code path run on the host: the kernels compiled as C and executed
    /// sequentially, with a reference GEMM. For testing and debugging device code on a
    /// machine without a GPU; slow by design. Its memory is host memory that the local
    /// and MPI backends move as such, kept apart from `Cpu` so that a call mixing the two
    /// is caught as it would be on a real device.
    Emulated,
}

impl Device {
    /// Whether the host can read and write this device's memory directly (CPU and
    /// emulated).
    pub fn is_host_addressable(self) -> bool {
        matches!(self, Device::Cpu | Device::Emulated)
    }
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

/// Text that names no device (what [`Device`]'s `FromStr` refuses).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a device; use cpu, emulated, cuda or cuda:N")]
pub struct NotADevice {
    /// The text given.
    pub text: String,
}

impl std::str::FromStr for Device {
    type Err = NotADevice;

    /// `cpu`, `emulated`, `cuda` (device 0) or `cuda:N`, as printed by `Display`.
    fn from_str(text: &str) -> Result<Device, NotADevice> {
        match text {
            "cpu" => Ok(Device::Cpu),
            "emulated" => Ok(Device::Emulated),
            "cuda" => Ok(Device::Cuda(0)),
            _ => text
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| NotADevice {
                    text: text.to_string(),
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Device;

    #[test]
    fn devices_parse_as_they_print() {
        for device in [
            Device::Cpu,
            Device::Emulated,
            Device::Cuda(0),
            Device::Cuda(3),
        ] {
            assert_eq!(device.to_string().parse::<Device>().unwrap(), device);
        }
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        let error = "gpu".parse::<Device>().unwrap_err().to_string();
        assert!(
            error.contains("use cpu, emulated, cuda or cuda:N"),
            "{error}"
        );
        assert!("cuda:x".parse::<Device>().is_err());
    }
}
