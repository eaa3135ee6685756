//! Global gradient-norm clipping over a tensor- (and pipeline-) parallel model: Megatron's
//! `clip_grad_norm_fp32`.

use std::sync::Arc;

use ferrotron_comm_core::{Communicator, CommunicatorExt, ReduceOp};

use ferrotron_tape::Tensor;

use crate::{Error, Result, ShardedParameter, TensorParallel};

const OP: &str = "clip_grad_norm";

/// What [`clip_grad_norm`] found and did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradNorm {
    /// The L2 norm of all gradients of the whole model, before clipping; NaN or infinite
    /// when a gradient holds such a value somewhere.
    pub norm: f64,
    /// Whether the gradients were scaled down to the maximum norm.
    pub clipped: bool,
    /// The factor the gradients were multiplied by: `max_norm / (norm + 1e-6)` when
    /// clipped, else 1.
    pub scale: f64,
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
/// `params` are this rank's parameters, every one of which is scaled; the norm sums the
/// squares of those that [count](ShardedParameter::counts_in_model_sums) over the
/// tensor-parallel group, counting [`Sharding::Replicated`](crate::Sharding) parameters
/// once, and then over each of `other_groups` (the pipeline group, whose stages hold
/// different parameters; a stage's copy of a weight that another stage also holds, such
/// as a tied output embedding, is marked [`shared_copy`](ShardedParameter::shared_copy)
/// and counted by the other stage only). Experts' parameters
/// ([`expert`](ShardedParameter::expert)) differ by expert-parallel rank: their squares
/// are summed over the context's expert-parallel group first. Data-parallel replicas hold
/// the same gradients after DDP's reduction, so the data-parallel group is not one of
/// them. Gradients that are absent count as zero,
/// but when no rank holds any gradient the call is an error: backward has not run, or
/// the gradients live elsewhere (ddp's distributed optimizer keeps them in its shards
/// and clips them itself). Every rank of those groups must call it with its parameters
/// in the same order; they all get the same [`GradNorm`].
pub fn clip_grad_norm(
    params: &[ShardedParameter],
    tp: &TensorParallel,
    other_groups: &[&Arc<dyn Communicator>],
    max_norm: f64,
) -> Result<GradNorm> {
    check_max_norm(max_norm)?;
    // Each sum of squares stays where its gradient is, added up there: one read of each
    // total, not a host wait per gradient.
    let (mut local, mut experts) = (DeviceSquares::default(), DeviceSquares::default());
    for sharded in params {
        if !sharded.counts_in_model_sums(tp.rank()) {
            continue;
        }
        if let Some(grad) = sharded.param.try_grad()? {
            let squares = grad.mul(&grad)?.sum()?;
            match sharded.expert {
                true => experts.add(squares)?,
                false => local.add(squares)?,
            }
        }
    }
    let (mut local, experts) = (local.read()?, experts.read()?);
    // Each expert-parallel rank holds other experts: their squares add up over the group
    // first, and then count like this rank's own.
    if params.iter().any(|p| p.expert) {
        let group = tp.expert_parallel().map(|e| e.group()).ok_or_else(|| {
            Error::config(
                OP,
                "experts' gradients need the expert-parallel group: build the context with \
                 TensorParallel::from_state or with_expert_parallel",
            )
        })?;
        let mut totals = [experts.sum, experts.gradients as f64];
        group.all_reduce_slice(&mut totals, ReduceOp::Sum)?;
        local.sum += totals[0];
        local.gradients += totals[1] as usize;
    }
    let groups: Vec<&Arc<dyn Communicator>> = std::iter::once(tp.group())
        .chain(other_groups.iter().copied())
        .collect();
    let norm = reduce_grad_norm(local, &groups, max_norm)?;
    if norm.clipped {
        for sharded in params {
            if let Some(grad) = sharded.param.try_grad()? {
                sharded.param.set_grad(Some(grad.scale(norm.scale)?))?;
            }
        }
    }
    Ok(norm)
}

/// This rank's share of a gradient norm: the sum of its squared gradient elements, and
/// how many gradients contributed to it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LocalSquares {
    /// The sum of the squares of the elements counted on this rank.
    pub sum: f64,
    /// The gradients (or pieces of gradients) they came from.
    pub gradients: usize,
}

impl LocalSquares {
    /// Counts one more gradient whose squared elements sum to `sum`.
    pub fn add(&mut self, sum: f64) {
        self.sum += sum;
        self.gradients += 1;
    }
}

/// [`LocalSquares`] whose device sums are still tensors: added up where they are (in
/// f32, as Megatron's fp32 norm), read once; host sums add up in f64 as they come.
#[derive(Default)]
struct DeviceSquares {
    host: f64,
    sums: Vec<Tensor>,
    gradients: usize,
}

impl DeviceSquares {
    fn add(&mut self, sum: Tensor) -> Result<()> {
        self.gradients += 1;
        if sum.device() == ferrotron_tape::Device::Cpu {
            // Reading a host value waits for nothing.
            self.host += f64::from(sum.item()?);
            return Ok(());
        }
        // Sums on one device add there; another device's starts its own.
        match self.sums.iter_mut().find(|s| s.device() == sum.device()) {
            Some(total) => *total = total.add(&sum)?,
            None => self.sums.push(sum),
        }
        Ok(())
    }

    fn read(self) -> Result<LocalSquares> {
        let mut sum = self.host;
        for total in self.sums {
            sum += f64::from(total.item()?);
        }
        Ok(LocalSquares {
            sum,
            gradients: self.gradients,
        })
    }
}

/// The model's gradient norm from every rank's [`LocalSquares`]: summed over each of
/// `groups` in turn (collective over each), then whether and by what to scale to stay
/// within `max_norm`, with Megatron's epsilon (`max_norm / (norm + 1e-6)`, so a norm at
/// the limit is scaled by just under 1). The building block of [`clip_grad_norm`] for
/// gradients held elsewhere than in the parameters, such as ddp's distributed-optimizer
/// shards. Scales nothing itself.
pub fn reduce_grad_norm(
    local: LocalSquares,
    groups: &[&Arc<dyn Communicator>],
    max_norm: f64,
) -> Result<GradNorm> {
    check_max_norm(max_norm)?;
    // The count travels with the sum so that every rank sees the same total.
    let mut totals = [local.sum, local.gradients as f64];
    for group in groups {
        group.all_reduce_slice(&mut totals, ReduceOp::Sum)?;
    }
    if totals[1] == 0.0 {
        return Err(Error::config(
            OP,
            "no rank holds a gradient: run backward before clipping (under ddp's \
             distributed optimizer the gradients are in its shards: clip with \
             DistributedOptimizer::clip_grad_norm)",
        ));
    }
    let norm = totals[0].sqrt();
    let coefficient = max_norm / (norm + 1e-6);
    let clipped = norm.is_finite() && coefficient < 1.0;
    Ok(GradNorm {
        norm,
        clipped,
        scale: if clipped { coefficient } else { 1.0 },
    })
}

fn check_max_norm(max_norm: f64) -> Result<()> {
    if max_norm.is_finite() && max_norm > 0.0 {
        Ok(())
    } else {
        Err(Error::config(
            OP,
            format!("max_norm must be a positive finite number, got {max_norm}"),
        ))
    }
}
