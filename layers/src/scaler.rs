//! [`GradScaler`]: dynamic loss scaling for f16 training (PyTorch's `GradScaler`,
//! Megatron's `DynamicGradScaler` without hysteresis).
//!
//! f16 spans only 2^-24 to 65504, so a loss is multiplied by a large scale before
//! backward to keep small activation gradients from flushing to zero, and the gradients
//! are divided by it before the optimizer sees them. When the scale is too large some
//! gradient overflows: the step is skipped and the scale lowered; after a run of finite
//! steps it is raised again.

use std::cell::Cell;
use std::sync::Arc;

use ferrotron_comm_core::{Communicator, CommunicatorExt, ReduceOp};
use ferrotron_tape::Tensor;

use crate::{Error, Result, ShardedParameter, TensorParallel};

/// Settings of [`GradScaler`]; the defaults are PyTorch's, and Megatron's floor.
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
    /// The scale never backs off below this (Megatron's `min_loss_scale`): a model whose
    /// gradients overflow even there skips every step rather than scale them to nothing.
    pub min_scale: f64,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
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
/// use ferrotron_layers::{GradScaler, GradScalerConfig};
///
/// let mut scaler = GradScaler::new(GradScalerConfig { growth_interval: 2, ..Default::default() })?;
/// assert_eq!(scaler.scale(), 65536.0);
/// scaler.update(false); // an overflow: skip the step, halve the scale
/// assert_eq!(scaler.scale(), 32768.0);
/// scaler.update(true);
/// scaler.update(true); // two finite steps in a row: double it
/// assert_eq!(scaler.scale(), 65536.0);
/// # Ok::<(), ferrotron_layers::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct GradScaler {
    config: GradScalerConfig,
    state: GradScalerState,
    /// Whether this step's gradients were divided already (until [`update`](Self::update)).
    unscaled: Cell<bool>,
}

const OP: &str = "GradScaler";

impl GradScaler {
    /// A scaler starting at `config.init_scale`. The scales must be normal f32 numbers
    /// (the loss is scaled in f32) with `min_scale <= init_scale`, growth finite and above
    /// 1, backoff in (0, 1), and the interval at least 1 step.
    pub fn new(config: GradScalerConfig) -> Result<Self> {
        let invalid = |what: String| Err(Error::config(OP, what));
        let c = config;
        for (name, scale) in [("init_scale", c.init_scale), ("min_scale", c.min_scale)] {
            if !usable(scale) {
                return invalid(format!(
                    "{name} must be a positive, normal f32 number (the loss is scaled in f32), \
                     got {scale}"
                ));
            }
        }
        if c.init_scale < c.min_scale {
            return invalid(format!(
                "init_scale {} lies below min_scale {}",
                c.init_scale, c.min_scale
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
            unscaled: Cell::new(false),
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
    /// then holds a non-finite one: then nothing changes and every rank gets `false`
    /// (skip the step). Collective over the tensor-parallel group and each of
    /// `other_groups` (the pipeline group); after DDP's reduction data-parallel replicas
    /// hold the same gradients, so the data-parallel group is not one of them. Once per
    /// step: a second call before [`update`](Self::update) is an error on every rank.
    pub fn unscale_grads(
        &self,
        params: &[ShardedParameter],
        tp: &TensorParallel,
        other_groups: &[&Arc<dyn Communicator>],
    ) -> Result<bool> {
        self.begin_unscale()?;
        let inverse = 1.0 / self.state.scale;
        let mut divided = Vec::with_capacity(params.len());
        // x·0 is NaN for an infinite or NaN x and 0 otherwise: the sum of those flags
        // exactly the non-finite elements (a plain sum could overflow). The flags add up
        // on the gradients' device, so one scalar leaves it (one per device met).
        let mut finite = true;
        let mut flags: Option<Tensor> = None;
        for sharded in params {
            if let Some(grad) = sharded.param.try_grad()? {
                let grad = grad.scale(inverse)?;
                let flag = grad.scale(0.0)?.sum()?;
                flags = Some(match flags {
                    Some(sum) if sum.device() == flag.device() => sum.add(&flag)?,
                    Some(sum) => {
                        finite &= sum.item()?.is_finite();
                        flag
                    }
                    None => flag,
                });
                divided.push((&sharded.param, grad));
            }
        }
        if let Some(sum) = flags {
            finite &= sum.item()?.is_finite();
        }
        // Experts differ by expert-parallel rank: an overflow in one is news to the group.
        let experts = params
            .iter()
            .any(|p| p.expert)
            .then(|| tp.expert_parallel().map(|e| e.group()))
            .flatten();
        let groups: Vec<&Arc<dyn Communicator>> = (experts.into_iter())
            .chain(std::iter::once(tp.group()))
            .chain(other_groups.iter().copied())
            .collect();
        if !all_finite(finite, &groups)? {
            return Ok(false);
        }
        for (param, grad) in divided {
            param.set_grad(Some(grad))?;
        }
        Ok(true)
    }

    /// Marks this step's gradients as divided; an error if they were already (the
    /// distributed optimizer's `unscale_grads` calls it too). Every rank of a step makes
    /// the same calls, so every rank gets the same answer.
    pub fn begin_unscale(&self) -> Result<()> {
        if self.unscaled.replace(true) {
            return Err(Error::config(
                OP,
                "the gradients of this step were unscaled already; call unscale_grads once \
                 per step, then update",
            ));
        }
        Ok(())
    }

    /// Moves to the next step: backs off after non-finite gradients (`finite` false), down
    /// to `min_scale`, and grows after `growth_interval` finite steps in a row (unless the
    /// grown scale would overflow f32).
    pub fn update(&mut self, finite: bool) {
        self.unscaled.set(false);
        let state = &mut self.state;
        if !finite {
            state.scale = (state.scale * self.config.backoff_factor).max(self.config.min_scale);
            state.growth_tracker = 0;
            return;
        }
        state.growth_tracker = state.growth_tracker.saturating_add(1);
        if state.growth_tracker >= self.config.growth_interval {
            let grown = state.scale * self.config.growth_factor;
            if usable(grown) {
                state.scale = grown;
            }
            state.growth_tracker = 0;
        }
    }

    /// What the next steps depend on.
    pub fn state(&self) -> GradScalerState {
        self.state
    }

    /// Continues from a saved [`state`](Self::state); a scale that is not a normal f32
    /// number at least `min_scale` is an error.
    pub fn load_state(&mut self, state: GradScalerState) -> Result<()> {
        if !(usable(state.scale) && state.scale >= self.config.min_scale) {
            return Err(Error::config(
                OP,
                format!(
                    "a saved loss scale must be a normal f32 number of at least min_scale {}, \
                     got {}",
                    self.config.min_scale, state.scale
                ),
            ));
        }
        self.state = state;
        Ok(())
    }
}

/// Whether `scale` and its inverse are positive, normal f32 numbers.
fn usable(scale: f64) -> bool {
    let (scale, inverse) = (scale as f32, (1.0 / scale) as f32);
    scale.is_sign_positive() && scale.is_normal() && inverse.is_normal()
}

/// Whether `finite` holds on every rank of every group (each collective in turn).
pub fn all_finite(finite: bool, groups: &[&Arc<dyn Communicator>]) -> Result<bool> {
    let mut overflowed = [if finite { 0.0f64 } else { 1.0 }];
    for group in groups {
        group.all_reduce_slice(&mut overflowed, ReduceOp::Max)?;
    }
    Ok(overflowed[0] == 0.0)
}
