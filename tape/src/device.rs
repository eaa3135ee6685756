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

impl std::str::FromStr for Device {
    type Err = crate::Error;

    /// `cpu`, `emulated`, `cuda` (device 0) or `cuda:N`, as printed by `Display`.
    fn from_str(text: &str) -> crate::Result<Device> {
        let invalid = || crate::Error::InvalidArgument {
            op: "Device::from_str",
            reason: format!("{text:?} is not a device; use cpu, emulated, cuda or cuda:N"),
        };
        match text {
            "cpu" => Ok(Device::Cpu),
            "emulated" => Ok(Device::Emulated),
            "cuda" => Ok(Device::Cuda(0)),
            _ => text
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(invalid),
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
        assert!("gpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
    }
}
