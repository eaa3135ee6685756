//! The crate's error type: every failure on user input is one of these, never a panic.

use crate::Device;

/// Result alias used by every fallible function in this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong, naming the operation and the shapes involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Operand shapes do not fit the operation.
    #[error("{op}: incompatible shapes {shapes:?}: {reason}")]
    Shape {
        /// Operation that rejected the shapes.
        op: &'static str,
        /// Shapes of the operands, in argument order.
        shapes: Vec<Vec<usize>>,
        /// Why they do not fit.
        reason: String,
    },
    /// A non-shape argument is out of range (dimension index, probability, label, ...).
    #[error("{op}: invalid argument: {reason}")]
    InvalidArgument {
        /// Operation that rejected the argument.
        op: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The operation is not implemented on this device, or the device is not built in.
    #[error(
        "{op}: not supported on device {device}; move the tensors with \
         to_device(Device::Cpu), or for CUDA build with the `cuda` feature"
    )]
    UnsupportedDevice {
        /// Operation that was asked for.
        op: &'static str,
        /// Device it was asked for on.
        device: Device,
    },
    /// Flat storage (a gradient bucket) was accessed while a collective holds it.
    #[error(
        "{op}: {} lies in flat storage (a gradient bucket) lent to a collective in flight; \
         wait for it (DDP's finish) before reading or writing these gradients",
        parameter.as_ref().map_or("the view".to_string(), |p| format!("the gradient of '{p}'"))
    )]
    Leased {
        /// Operation that was refused.
        op: &'static str,
        /// The parameter whose gradient it is, when known.
        parameter: Option<String>,
    },
    /// Operands of one op live on different devices.
    #[error("{op}: operands are on {first} and {second}; move them to one device with to_device")]
    DeviceMismatch {
        /// Operation that mixed the devices.
        op: &'static str,
        /// Device of the first operand.
        first: Device,
        /// Device of the other operand.
        second: Device,
    },
    /// A device could not be opened or failed (missing library, no GPU, CUDA error).
    #[error("{op} on {device}: {message}")]
    Device {
        /// What was being done.
        op: &'static str,
        /// The device.
        device: Device,
        /// The library's or driver's own message, and what to do.
        message: String,
    },
    /// Operands were recorded on two different tapes.
    #[error("{op}: operands belong to different tapes; each model/thread must use one tape")]
    TapeMismatch {
        /// Operation that mixed the tapes.
        op: &'static str,
    },
    /// A tensor's graph was already consumed by `backward` (or the tape was cleared).
    #[error("{op}: the tensor's graph was already consumed by backward or cleared")]
    StaleGraph {
        /// Operation that used the stale tensor.
        op: &'static str,
    },
    /// `backward` was called on a tensor that does not require grad.
    #[error("backward: the tensor is not recorded on any tape (no parameter reached it, or it was made under no_grad)")]
    NotRecorded,
    /// A finite-difference check found an analytic gradient that disagrees.
    #[error("gradcheck: input {input} element {index}: analytic {analytic} vs numeric {numeric}")]
    GradCheck {
        /// Index of the input whose gradient is wrong.
        input: usize,
        /// Flat (row-major) index of the element.
        index: usize,
        /// Gradient computed by backward.
        analytic: f64,
        /// Gradient computed by central differences.
        numeric: f64,
    },
    /// A user-defined op, or a grad-ready hook, failed.
    #[error("{op}: {source}")]
    Custom {
        /// Name of the custom op or hook that failed.
        op: String,
        /// The op's own error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    pub(crate) fn shape(op: &'static str, shapes: &[&[usize]], reason: impl Into<String>) -> Self {
        Error::Shape {
            op,
            shapes: shapes.iter().map(|s| s.to_vec()).collect(),
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            reason: reason.into(),
        }
    }

    /// A failure of the device layer while doing `op` on `device`: what the device could
    /// not do, or the driver's own message.
    pub(crate) fn on_device(
        op: &'static str,
        device: Device,
    ) -> impl Fn(ferrotron_device::Error) -> Self {
        move |error| match error {
            ferrotron_device::Error::Unsupported { .. } => Error::UnsupportedDevice { op, device },
            other => Error::Device {
                op,
                device,
                message: other.to_string(),
            },
        }
    }

    /// Wraps any error from user code (a custom op, a hook) so it can travel out of `backward`.
    pub fn custom(
        op: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Error::Custom {
            op: op.into(),
            source: source.into(),
        }
    }
}
