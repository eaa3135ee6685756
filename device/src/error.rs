//! What can go wrong with a device.

use crate::place::Device;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every way a device operation can fail, with what to do about it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A CUDA library could not be loaded (libraries are found at run time).
    #[error(
        "{library} could not be loaded, and {purpose} needs it: install it, or add the \
         directory that holds it to LD_LIBRARY_PATH (e.g. \
         `export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH`){hint}"
    )]
    LibraryMissing {
        /// The library's file name, as searched for.
        library: &'static str,
        /// What needed it.
        purpose: &'static str,
        /// Library-specific advice (may be empty).
        hint: &'static str,
    },

    /// The CUDA driver is loaded but there is no device with the requested ordinal.
    #[error(
        "no CUDA device {requested}: the driver reports {available} device(s); check \
         `nvidia-smi` and CUDA_VISIBLE_DEVICES"
    )]
    NoDevice {
        /// The ordinal asked for.
        requested: usize,
        /// How many devices the driver reports.
        available: usize,
    },

    /// A CUDA driver or NVRTC call failed; `message` is CUDA's own.
    #[error("CUDA {call} failed: {message}")]
    Driver {
        /// The call (or step) that failed.
        call: String,
        /// CUDA's error name and description.
        message: String,
    },

    /// The device cannot do this: the host has no streams, or CUDA is not built in.
    #[error(
        "{op}: not supported on {device}{}",
        if matches!(device, Device::Cuda(_)) {
            "; build with the `cuda` feature"
        } else {
            ""
        }
    )]
    Unsupported {
        /// What was asked for.
        op: &'static str,
        /// The device it was asked of.
        device: Device,
    },

    /// An allocation of `bytes` bytes failed.
    #[error("{device}: out of memory allocating {bytes} bytes")]
    OutOfMemory {
        /// Where.
        device: Device,
        /// How much.
        bytes: usize,
    },

    /// Two accesses to emulated memory, at least one a write, that nothing orders: on a
    /// GPU the later could run before the earlier finishes (the emulated device's
    /// ordering checker; see `Access`).
    #[error(
        "unordered accesses to emulated {memory}: {later} is not ordered after {earlier}; \
         make the later call's stream wait for an event recorded after the earlier call \
         (`Stream::record`, `Stream::wait`), or have the host wait for it before it \
         touches the memory"
    )]
    Unordered {
        /// The allocation: its kind, number and size.
        memory: String,
        /// The earlier call, its stream (or the host) and the bytes it touched.
        earlier: String,
        /// The later call, likewise.
        later: String,
    },

    /// An argument that cannot be right: a stream of another device, an event of a
    /// stream on another device, a copy past an allocation's end.
    #[error("{op}: {reason}")]
    Invalid {
        /// The operation that refused it.
        op: &'static str,
        /// What is wrong, and what to pass instead.
        reason: String,
    },
}
