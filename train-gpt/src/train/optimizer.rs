//! The optimizer a rank steps: AdamW over its replicas' parameters, or the distributed
//! optimizer over its shards, and the model state's bytes.

use crate::model::Gpt;
use anyhow::Result;
use ferrotron_comm_core::Communicator;
use ferrotron_ddp::{DistributedDataParallel, DistributedOptimizer};
use ferrotron_layers::{GradNorm, GradScaler, Module, ShardedParameter, TensorParallel};
use ferrotron_tape::{
    AdamW, AdamWConfig, DType, MixedPrecision, Optimizer, ParamOptions, Parameter,
};
use std::sync::Arc;

use super::*;

/// A loss scale as a person reads it: whole below 10^15, else in scientific notation.
pub(super) fn readable(scale: f64) -> String {
    if scale < 1e15 {
        scale.to_string()
    } else {
        format!("{scale:e}")
    }
}

/// The line the run starts with about memory: bytes per parameter on this rank for the
/// parameters, their (f32) main gradients, master weights and AdamW's moments.
pub(super) fn model_state_line(state: &ModelState, dp_size: usize) -> String {
    let ModelState {
        parameters: count,
        values,
        grads,
        masters,
        moments,
    } = *state;
    let count = count.max(1) as f64;
    let per = |bytes: usize| bytes as f64 / count;
    format!(
        "model state per rank: {:.2} bytes per parameter (parameters {:.2}, gradients {:.2}, \
         master weights {:.2}, AdamW moments {:.2}; data-parallel size {dp_size})",
        per(values + grads + masters + moments),
        per(values),
        per(grads),
        per(masters),
        per(moments)
    )
}

/// What a rank's model state takes: its parameters and the bytes of their values,
/// gradient buckets, f32 master weights and AdamW moments.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelState {
    pub parameters: usize,
    pub values: usize,
    pub grads: usize,
    pub masters: usize,
    pub moments: usize,
}

impl ModelState {
    pub(super) fn of(
        models: &[Gpt],
        ddps: &[DistributedDataParallel],
        optimizer: &TrainOptimizer,
    ) -> Self {
        let params: Vec<Parameter> = models
            .iter()
            .flat_map(Module::parameters)
            .map(|sharded| sharded.param)
            .collect();
        let (masters, moments) = optimizer.state_bytes();
        ModelState {
            parameters: params.iter().map(Parameter::numel).sum(),
            values: (params.iter())
                .map(|p| p.numel() * p.dtype().size_in_bytes())
                .sum(),
            grads: ddps.iter().map(DistributedDataParallel::buffer_bytes).sum(),
            masters,
            moments,
        }
    }

    /// The bytes in all.
    pub fn total(&self) -> usize {
        self.values + self.grads + self.masters + self.moments
    }
}

/// AdamW kept whole on every data-parallel rank (on the parameters, or on f32 master
/// copies of 16-bit ones), or sharded over them.
pub(super) enum TrainOptimizer {
    Replicated(AdamW),
    Mixed(MixedPrecision<AdamW>),
    Distributed(DistributedOptimizer),
}

impl TrainOptimizer {
    /// AdamW on the schedule over the parameters of `ddps`, weight decay grouped as
    /// Megatron groups it, in the form `config` asks for.
    pub(super) fn new(
        ddps: &[DistributedDataParallel],
        models: &[Gpt],
        config: &TrainConfig,
    ) -> Result<Self> {
        let schedule = config.schedule.build()?;
        let adamw = AdamWConfig {
            lr: config.schedule.lr,
            weight_decay: config.weight_decay,
            ..AdamWConfig::default()
        };
        let groups = ParamOptions::megatron_groups;
        // In the model's order, as checkpoints list them (experts' among the rest).
        let parameters: Vec<Parameter> = (models.iter())
            .flat_map(Module::parameters)
            .map(|p| p.param)
            .collect();
        Ok(match (config.distributed_optimizer, config.precision) {
            (true, precision) => {
                let sharded = DistributedOptimizer::adamw(ddps, adamw)?
                    .with_schedule(schedule)
                    .with_param_options(groups)
                    .with_overlap_param_gather(config.overlap_param_gather);
                TrainOptimizer::Distributed(match precision {
                    DType::F32 => sharded,
                    _ => sharded.store_params_as(precision)?,
                })
            }
            (false, DType::F32) => TrainOptimizer::Replicated(
                AdamW::new(parameters, adamw)?
                    .with_schedule(schedule)
                    .with_param_options(groups),
            ),
            (false, precision) => {
                TrainOptimizer::Mixed(MixedPrecision::new(&parameters, precision, |masters| {
                    Ok(AdamW::new(masters, adamw)?
                        .with_schedule(schedule)
                        .with_param_options(groups))
                })?)
            }
        })
    }

    pub(super) fn as_dyn(&mut self) -> &mut dyn Optimizer {
        match self {
            TrainOptimizer::Replicated(adamw) => adamw,
            TrainOptimizer::Mixed(adamw) => adamw,
            TrainOptimizer::Distributed(adamw) => adamw,
        }
    }

    /// The model's parameters the optimizer's state entries belong to (what a
    /// checkpoint names them by).
    pub(super) fn model_params(&self) -> &[Parameter] {
        match self {
            TrainOptimizer::Replicated(adamw) => adamw.params(),
            TrainOptimizer::Mixed(adamw) => adamw.model_params(),
            TrainOptimizer::Distributed(adamw) => adamw.params(),
        }
    }

    /// Bytes of f32 master weights and of optimizer state this rank holds.
    pub(super) fn state_bytes(&self) -> (usize, usize) {
        let moments = |params: &[Parameter]| 8 * params.iter().map(Parameter::numel).sum::<usize>();
        match self {
            TrainOptimizer::Replicated(adamw) => (0, moments(adamw.params())),
            TrainOptimizer::Mixed(adamw) => (
                4 * adamw.params().iter().map(Parameter::numel).sum::<usize>(),
                moments(adamw.params()),
            ),
            TrainOptimizer::Distributed(adamw) => (
                adamw.master_bytes(),
                adamw.state_bytes() - adamw.master_bytes(),
            ),
        }
    }

    /// Divides the gradients the next step uses by the loss scale: `false` on every rank
    /// when some rank's overflowed (skip the step).
    pub(super) fn unscale_grads(
        &mut self,
        scaler: &GradScaler,
        params: &[ShardedParameter],
        tp: &TensorParallel,
        other_groups: &[&Arc<dyn Communicator>],
    ) -> Result<bool> {
        Ok(match self {
            TrainOptimizer::Replicated(_) | TrainOptimizer::Mixed(_) => {
                scaler.unscale_grads(params, tp, other_groups)?
            }
            TrainOptimizer::Distributed(adamw) => adamw.unscale_grads(scaler, tp, other_groups)?,
        })
    }

    /// Clips the gradients the next step uses: the parameters' (replicated) or the
    /// reduced shards' (distributed).
    pub(super) fn clip_grad_norm(
        &mut self,
        params: &[ShardedParameter],
        tp: &TensorParallel,
        other_groups: &[&Arc<dyn Communicator>],
        max_norm: f64,
    ) -> Result<GradNorm> {
        Ok(match self {
            TrainOptimizer::Replicated(_) | TrainOptimizer::Mixed(_) => {
                ferrotron_layers::clip_grad_norm(params, tp, other_groups, max_norm)?
            }
            TrainOptimizer::Distributed(adamw) => {
                adamw.clip_grad_norm(params, tp, other_groups, max_norm)?
            }
        })
    }
}
