//! Megatron-LM's own estimate of the same figure (the theoretical memory footprint its
//! training loop reports, after Korthikanti et al. 2022, Table 2), restated here so that
//! a prediction can be set beside it. It assumes
//! 16-bit mixed precision with f32 gradients, counts no biases and no position
//! embeddings, and keeps the activations of Megatron's fused kernels (flash attention
//! keeps no scores, masks take a byte).

use crate::memory::{Layout, Model, Recompute};
use ferrotron_pipeline::Schedule;

/// Megatron's estimate for the most loaded rank (the first pipeline stage's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    /// Parameters of the most loaded shard × bytes per parameter (18, or 6 + 12/DP under
    /// the distributed optimizer).
    pub weights_and_optimizer: f64,
    /// Activations of the first stage's microbatches in flight.
    pub activations: f64,
    /// Parameters of the most loaded shard.
    pub parameters: f64,
}

impl Estimate {
    /// Bytes in all.
    pub fn total(&self) -> f64 {
        self.weights_and_optimizer + self.activations
    }
}

/// Megatron's estimate for `model` at `layout`. Pass the vocabulary as Megatron pads it
/// (to a multiple of 128 × TP) in `model` for a like-for-like figure.
pub fn estimate(model: &Model, layout: &Layout) -> Estimate {
    let (h, f, v) = (model.hidden as f64, model.ffn as f64, model.vocab as f64);
    let (t, pp, dp) = (layout.tp as f64, layout.pp as f64, layout.dp as f64);
    // Two layer norms with weight and bias, four h × h attention matrices, two MLP ones.
    let per_layer = 2.0 * h * (f + 2.0) + 4.0 * h * h;
    let blocks = model.layers as f64 * per_layer + 2.0 * h;
    let embedding = h * v;
    let mut parameters = (blocks / pp + embedding) / t;
    if !model.tied && layout.pp == 1 {
        parameters += embedding / t;
    }
    let per_parameter = match layout.distributed_optimizer {
        true => 6.0 + 12.0 / dp,
        false => 18.0,
    };
    Estimate {
        weights_and_optimizer: parameters * per_parameter,
        activations: activations(model, layout),
        parameters,
    }
}

fn activations(model: &Model, layout: &Layout) -> f64 {
    let (h, f, v) = (model.hidden as f64, model.ffn as f64, model.vocab as f64);
    let (t, pp) = (layout.tp as f64, layout.pp as f64);
    let micro = (layout.batch / layout.microbatches.max(1)) as f64;
    let (sb, sbh) = (model.seq as f64 * micro, model.seq as f64 * micro * h);
    // Its formula with sequence parallelism holds only with selective recomputation too;
    // otherwise it takes the one without.
    let with_sp = layout.sequence_parallel && layout.recompute == Recompute::Selective;
    let per_layer = match with_sp {
        true => sbh * (18.0 + 4.0 * f / h),
        false => sbh * (10.0 + 24.0 / t),
    };
    // The first stage holds pp microbatches of layers/pp blocks: every layer's worth once.
    let mut bytes = per_layer * model.layers as f64 + 8.0 * sb * pp + sbh * pp;
    match layout.schedule {
        Schedule::Interleaved { virtual_stages } => {
            bytes *= 1.0 + (pp - 1.0) / (pp * virtual_stages as f64);
        }
        _ if layout.pp > 1 => bytes *= (layout.microbatches as f64 / pp).min(1.0),
        _ => {}
    }
    if layout.pp == 1 {
        bytes += match with_sp {
            true => sbh * 4.0 * (1.0 + v / h),
            false => (sb * v / t + sbh) * 2.0,
        };
    }
    match with_sp {
        true => bytes / t,
        false => bytes * 1.05,
    }
}
