//! [`GradScaler`]: dynamic loss scaling for f16 training (PyTorch's `GradScaler`,
//! Megatron's `DynamicGradScaler` without hysteresis).
//!
//! f16 spans only 2^-24 to 65504, so a loss is multiplied by a large scale before
//! backward to keep small activation gradients from flushing to zero, and the gradients
//! are divided by it before the optimizer sees them. When the scale is too large some
//! gradient overflows: the step is skipped and the scale lowered; after a run of finite
//! steps it is raised again.

use std::sync::Arc;

use comm_core::{Communicator, CommunicatorExt, ReduceOp};
use tape::Tensor;

use crate::{Error, Result, ShardedParameter, TensorParallel};

/// Settings of [`GradScaler`]; the defaults are PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The scale of the first step.
    pub init_scale: f64,
    /// What the scale is multiplied by after `growth_interval` finite steps in a row.
    pub growth_factor: f64,
    /// What the scale is multiplied by after a step with non-finite gradients.
    pub backoff_factor: f64,
    /// Finite steps in a row before the scale grows.
    pub growth_interval: u32,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// What a [`GradScaler`] carries from step to step, for checkpoints.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerState {
    /// The current loss scale.
    pub scale: f64,
    /// Finite steps since the scale last changed.
    pub growth_tracker: u32,
}

/// Dynamic loss scaling: scales the loss before backward, unscales the gradients
/// afterwards (finding whether any rank's overflowed), and adjusts the scale.
///
/// A training step with it, on every rank of the model (tensor- and pipeline-parallel
/// ranks alike):
/// 1. `backward` of [`scale_loss`](Self::scale_loss)`(&loss)` (DDP's, or the tape's);
/// 2. [`unscale_grads`](Self::unscale_grads) (or ddp's
///    `DistributedOptimizer::unscale_grads`, whose gradients live in its shards): `false`
///    on every rank when some gradient anywhere is not finite;
/// 3. when it returned `true`, clip and step; else skip the step;
/// 4. [`update`](Self::update) with what step 2 returned.
///
/// ```
/// use layers::{GradScaler, GradScalerConfig};
///
/// let mut scaler = GradScaler::new(GradScalerConfig { growth_interval: 2, ..Default::default() })?;
/// assert_eq!(scaler.scale(), 65536.0);
/// scaler.update(false); // an overflow: skip the step, halve the scale
/// assert_eq!(scaler.scale(), 32768.0);
/// scaler.update(true);
/// scaler.update(true); // two finite steps in a row: double it
/// assert_eq!(scaler.scale(), 65536.0);
/// # Ok::<(), layers::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct GradScaler {
    config: GradScalerConfig,
    state: GradScalerState,
}

const OP: &str = "GradScaler";

impl GradScaler {
    /// A scaler starting at `config.init_scale`. Every factor must be finite, the scale
    /// positive and representable in f32, growth above 1, backoff in (0, 1), and the
    /// interval at least 1.
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        let invalid = |what: String| Err(Error::config(OP, what));
        let c = config;
        if !(c.init_scale > 0.0 && (c.init_scale as f32).is_finite()) {
            return invalid(format!(
                "init_scale must be positive and finite in f32 (the loss is scaled in f32), \
                 got {}",
                c.init_scale
            ));
        }
        if !(c.growth_factor > 1.0 && c.growth_factor.is_finite()) {
            return invalid(format!(
                "growth_factor must be finite and above 1, got {}",
                c.growth_factor
            ));
        }
        if !(c.backoff_factor > 0.0 && c.backoff_factor < 1.0) {
            return invalid(format!(
                "backoff_factor must lie in (0, 1), got {}",
                c.backoff_factor
            ));
        }
        if c.growth_interval == 0 {
            return invalid("growth_interval must be at least 1 step".into());
        }
        Ok(GradScaler {
            config,
            state: GradScalerState {
                scale: c.init_scale,
                growth_tracker: 0,
            },
        })
    }

    /// The current loss scale.
    pub fn scale(&self) -> f64 {
        self.state.scale
    }

    /// `loss` times the scale: run backward from this instead of `loss`.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss.scale(self.state.scale)?)
    }

    /// Divides every gradient of `params` by the scale, unless some rank of the model
    /// holds a non-finite one: then nothing changes and every rank gets `false` (skip
    /// the step). Collective over the tensor-parallel group and each of `other_groups`
    /// (the pipeline group); after DDP's reduction data-parallel replicas hold the same
    /// gradients, so the data-parallel group is not one of them.
    pub fn unscale_grads(
        &self,
        params: &[ShardedParameter],
        tp: &TensorParallel,
        other_groups: &[&Arc<dyn Communicator>],
    ) -> Result<bool> {
        let mut grads = Vec::with_capacity(params.len());
        let mut finite = true;
        for sharded in params {
            if let Some(grad) = sharded.param.try_grad()? {
                // x·0 is NaN for an infinite or NaN x and 0 otherwise: its sum flags
                // exactly the non-finite elements (a plain sum could overflow), and only
                // a scalar leaves the device.
                finite &= grad.scale(0.0)?.sum()?.item()?.is_finite();
                grads.push((&sharded.param, grad));
            }
        }
        let groups: Vec<&Arc<dyn Communicator>> = std::iter::once(tp.group())
            .chain(other_groups.iter().copied())
            .collect();
        if !all_finite(finite, &groups)? {
            return Ok(false);
        }
        let inverse = 1.0 / self.state.scale;
        for (param, grad) in grads {
            param.set_grad(Some(grad.scale(inverse)?))?;
        }
        Ok(true)
    }

    /// Moves to the next step: backs off after non-finite gradients (`finite` false),
    /// grows after `growth_interval` finite steps in a row (unless the grown scale would
    /// overflow f32).
    pub fn update(&mut self, finite: bool) {
        let state = &mut self.state;
        if !finite {
            state.scale *= self.config.backoff_factor;
            state.growth_tracker = 0;
            return;
        }
        state.growth_tracker += 1;
        if state.growth_tracker >= self.config.growth_interval {
            let grown = state.scale * self.config.growth_factor;
            if (grown as f32).is_finite() {
                state.scale = grown;
            }
            state.growth_tracker = 0;
        }
    }

    /// What the next steps depend on.
    pub fn state(&self) -> GradScalerState {
        self.state
    }

    /// Continues from a saved [`state`](Self::state); a scale that is not positive and
    /// finite in f32 is an error.
    pub fn load_state(&mut self, state: GradScalerState) -> Result<()> {
        if !(state.scale > 0.0 && (state.scale as f32).is_finite()) {
            return Err(Error::config(
                OP,
                format!(
                    "a saved loss scale must be positive and finite, got {}",
                    state.scale
                ),
            ));
        }
        self.state = state;
        Ok(())
    }
}

/// Whether `finite` holds on every rank of every group (each collective in turn).
pub fn all_finite(finite: bool, groups: &[&Arc<dyn Communicator>]) -> Result<bool> {
    let mut overflowed = [if finite { 0.0f64 } else { 1.0 }];
    for group in groups {
        group.all_reduce_slice(&mut overflowed, ReduceOp::Max)?;
    }
    Ok(overflowed[0] == 0.0)
}
