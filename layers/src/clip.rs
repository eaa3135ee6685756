//! Global gradient-norm clipping over a tensor- (and pipeline-) parallel model: Megatron's
//! `clip_grad_norm_fp32`.

use std::sync::Arc;

use comm_core::{Communicator, CommunicatorExt, ReduceOp};

use crate::{Error, Result, ShardedParameter, Sharding, TensorParallel};

const OP: &str = "clip_grad_norm";

/// What [`clip_grad_norm`] found and did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradNorm {
    /// The L2 norm of all gradients of the whole model, before clipping; NaN or infinite
    /// when a gradient holds such a value somewhere.
    pub norm: f64,
    /// Whether the gradients were scaled down to the maximum norm.
    pub clipped: bool,
}

impl GradNorm {
    /// Whether the gradients are finite. When they are not, nothing was scaled: skip the
    /// optimizer step (every rank sees the same norm, so every rank skips it).
    pub fn is_finite(&self) -> bool {
        self.norm.is_finite()
    }
}

/// Scales every gradient by `max_norm / norm` when the L2 norm of all gradients of the
/// model exceeds `max_norm`, as PyTorch's `clip_grad_norm_` on the serial model would.
///
/// `params` are this rank's parameters; the norm sums their squares over the
/// tensor-parallel group, counting [`Sharding::Replicated`] parameters once (on tensor
/// rank 0), and then over each of `other_groups` (the pipeline group, whose stages hold
/// different parameters; leave out a stage's copy of a weight that another stage also
/// holds, such as a tied output embedding). Data-parallel replicas hold the same
/// gradients after DDP's reduction, so the data-parallel group is not one of them.
/// Gradients that are absent count as zero. Every rank of those groups must call it
/// with its parameters in the same order; they all get the same [`GradNorm`].
pub fn clip_grad_norm(
    params: &[ShardedParameter],
    tp: &TensorParallel,
    other_groups: &[&Arc<dyn Communicator>],
    max_norm: f64,
) -> Result<GradNorm> {
    if !(max_norm.is_finite() && max_norm > 0.0) {
        return Err(Error::config(
            OP,
            format!("max_norm must be a positive finite number, got {max_norm}"),
        ));
    }
    let mut squares = [0.0f64];
    for sharded in params {
        let counted = sharded.sharding != Sharding::Replicated || tp.rank() == 0;
        if let (true, Some(grad)) = (counted, sharded.param.grad()) {
            squares[0] += f64::from(grad.mul(&grad)?.sum()?.item()?);
        }
    }
    for group in std::iter::once(tp.group()).chain(other_groups.iter().copied()) {
        group.all_reduce_slice(&mut squares, ReduceOp::Sum)?;
    }
    let norm = squares[0].sqrt();
    // Megatron's epsilon: a norm just at the limit is left as it is.
    let coefficient = max_norm / (norm + 1e-6);
    let clipped = norm.is_finite() && coefficient < 1.0;
    if clipped {
        for sharded in params {
            if let Some(grad) = sharded.param.grad() {
                sharded.param.set_grad(Some(grad.scale(coefficient)?))?;
            }
        }
    }
    Ok(GradNorm { norm, clipped })
}
