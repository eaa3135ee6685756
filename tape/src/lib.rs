//! Reverse-mode automatic differentiation over n-d tensors, for ferrotron.
//!
//! * [`Tensor`]: an immutable, cheaply cloned n-d array (`f32` by default, `f64` for grad
//!   checks) on a [`Device`] (CPU, via ndarray, for now).
//! * [`Tape`]: a define-by-run record owned by one model or thread — there is no global
//!   tape, so many independent trainings can run in one process.
//! * [`Parameter`]: a trainable leaf with a gradient slot and grad-ready hooks, which fire
//!   the moment its gradient is complete while the rest of backward still runs.
//! * [`CustomOp`]: user-defined differentiable ops (e.g. collectives).
//! * [`Sgd`] and [`AdamW`] optimizers, and [`gradcheck()`].
//! * [`set_num_threads`]: how many threads a thread's matrix products use (default: the
//!   cores available, shared among local-backend rank threads).
//!
//! # Training a linear model
//! ```
//! use ferrotron_tape::{Generator, Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor};
//!
//! let mut rng = Generator::new(0);
//! let w = Parameter::new("w", Tensor::<f32>::randn(&[3, 1], 0.1, &mut rng));
//! let b = Parameter::new("b", Tensor::<f32>::zeros(&[1]));
//! let x = Tensor::from_vec(vec![1.0, 2.0, 3.0, 0.0, 1.0, 0.5], &[2, 3])?;
//! let target = Tensor::from_vec(vec![1.0, -1.0], &[2, 1])?;
//! let mut sgd = Sgd::new(vec![w.clone(), b.clone()], SgdConfig::new(0.05))?;
//!
//! let tape = Tape::new();
//! let mut losses = Vec::new();
//! for _ in 0..50 {
//!     // Each forward pass watches the parameters on the tape; backward consumes the record.
//!     let y = x.matmul(&tape.watch(&w)?)?.add(&tape.watch(&b)?)?;
//!     let diff = y.sub(&target)?;
//!     let loss = diff.mul(&diff)?.mean()?;
//!     losses.push(loss.item()?);
//!     sgd.zero_grad();
//!     loss.backward()?;
//!     sgd.step()?;
//! }
//! assert!(losses[49] < losses[0] / 4.0, "{losses:?}");
//! # Ok::<(), ferrotron_tape::Error>(())
//! ```
//!
//! # Grad-ready hooks
//! A hook sees the parameter as soon as its gradient for this pass is final:
//! ```
//! use parking_lot::Mutex;
//! use std::sync::Arc;
//! use ferrotron_tape::{Parameter, Tape, Tensor};
//!
//! let w = Parameter::new("w", Tensor::<f32>::ones(&[2]));
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! let log = seen.clone();
//! w.register_grad_hook(move |p| {
//!     if let Some(grad) = p.grad() {
//!         log.lock().push(grad.to_vec()?);
//!     }
//!     Ok(())
//! });
//! let tape = Tape::new();
//! tape.watch(&w)?.scale(3.0)?.sum()?.backward()?;
//! assert_eq!(*seen.lock(), vec![vec![3.0, 3.0]]);
//! # Ok::<(), ferrotron_tape::Error>(())
//! ```
//!
//! # Checking gradients
//! ```
//! use ferrotron_tape::{gradcheck, GradCheckOptions, Tensor};
//!
//! let x = Tensor::<f64>::from_vec(vec![0.5, -1.0, 2.0], &[3])?;
//! gradcheck(|xs| xs[0].tanh()?.mul(&xs[0]), &[x], &GradCheckOptions::default())?;
//! # Ok::<(), ferrotron_tape::Error>(())
//! ```
//!
//! # No gradient
//! [`Tape::no_grad`] runs a closure without recording (evaluation, optimizer-like updates);
//! [`Tensor::detach`] cuts one tensor off.
//!
//! # Cargo features
//! None is on by default.
//! * `cuda`: CUDA tensors (NVRTC kernels, cuBLAS GEMMs); libraries loaded at run time.
//!   Without it, `Device::Emulated` runs the same device code path on the host.
#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod element;
mod error;
mod flat;
mod gpu;
pub mod gradcheck;
mod lend;
mod mixed;
pub mod ops;
pub mod optim;
mod parameter;
mod precision;
mod random;
mod schedule;
mod tape;
mod tensor;
mod threads;

pub use element::Element;
pub use error::{Error, Result};
pub use ferrotron_comm_core::{DType, Device};
/// Host↔device copies and host waits per thread and device, counted by the device layer:
/// tensors' (`Tensor::to_device`, `to_vec`, `item`, uploads an op stages) and those
/// comm-core makes to stage device memory through the host (MPI, the local backend's
/// point-to-point mailbox).
pub use ferrotron_device::{
    device_memory, host_waits, profile, reset_device_peak, timeline, transfers, DeviceHeld,
    Transfers,
};
pub use flat::{FlatStorage, FlatView};
pub use gpu::attention_ops::with_cuda_core_attention;
pub use gpu::{allow_tf32, set_allow_tf32, synchronize};
pub use gradcheck::{gradcheck, GradCheckOptions};
pub use mixed::{MixedPrecision, MASTER_BUFFER};
pub use ndarray;
pub use ops::custom::CustomOp;
pub use ops::{
    attention_block, attention_block_backward, causal_mask, fused_attention_dropout_mask,
    fused_attention_takes, tensor_core_attention_takes, AttentionBlock, AttentionKernel,
    AttentionOptions, CrossEntropyOptions, Gelu, InputGradHook, PendingGrad, Reduction, RowTarget,
};
pub use optim::{
    AdamW, AdamWConfig, AdamWUpdate, Optimizer, OptimizerState, ParamOptions, ParamState, Sgd,
    SgdConfig, SgdUpdate,
};
pub use parameter::{GradHook, ParamId, Parameter, PendingValue};
pub use random::Generator;
pub use schedule::{LrDecay, LrSchedule, WsdAnneal};
pub use tape::{GradHandle, Tape};
pub use tensor::Tensor;
pub use threads::{num_threads, set_num_threads};
