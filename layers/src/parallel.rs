//! The tensor-parallel context every layer is built with, and how a parameter is cut
//! across its ranks.

use std::sync::Arc;

use ferrotron_comm_core::Communicator;
use ferrotron_parallel_state::ParallelState;
use ferrotron_tape::{Parameter, Tensor};

use crate::error::{Error, Result};

/// Name of the group whose ranks must sum the gradients of
/// [sequence-parallel parameters](ShardedParameter::grad_reduce_group): the
/// tensor-parallel group, as `ParallelState` names it for DDP's extra reductions.
pub const TP_GROUP: &str = "tp";

/// Name of the group whose ranks hold copies of a word embedding tied to the output
/// layer across pipeline stages (the first and last stage of each pipeline, as
/// `ParallelState` names it): each copy's gradient must be summed over it, as
/// Megatron's `_allreduce_word_embedding_grads` does.
pub const EMBEDDING_GROUP: &str = "embedding";

/// The tensor-parallel group a layer runs on, whether activations outside the
/// tensor-parallel regions are split along the sequence (Megatron's sequence parallelism),
/// and the context-parallel group attention runs over, if any (each of its ranks holds
/// two chunks of the sequence: [`context_parallel_chunks`](crate::context_parallel_chunks)).
#[derive(Clone)]
pub struct TensorParallel {
    group: Arc<dyn Communicator>,
    sequence_parallel: bool,
    context: Option<Arc<dyn Communicator>>,
    experts: Option<ExpertParallel>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParallel")
            .field("group", &self.group.name())
            .field("rank", &self.rank())
            .field("size", &self.size())
            .field("sequence_parallel", &self.sequence_parallel)
            .field("context_parallel", &self.context_size())
            .finish()
    }
}

impl TensorParallel {
    /// Tensor parallelism over `group`, without sequence parallelism. A group of one rank
    /// gives the serial model.
    pub fn new(group: Arc<dyn Communicator>) -> Self {
        TensorParallel {
            group,
            sequence_parallel: false,
            context: None,
            experts: None,
        }
    }

    /// Tensor parallelism over the tensor-parallel group of `state`, with attention over
    /// its context-parallel group when that has more than one rank.
    pub fn from_state(state: &ParallelState) -> Self {
        Self::new(state.tp().clone())
            .with_context_parallel(state.cp().clone())
            .with_expert_parallel(ExpertParallel::from_state(state))
    }

    /// The same context with the groups a mixture of experts runs on (blocks built with
    /// [`TransformerBlock::with_experts`](crate::TransformerBlock::with_experts) need them).
    pub fn with_expert_parallel(mut self, experts: ExpertParallel) -> Self {
        self.experts = Some(experts);
        self
    }

    /// The groups a mixture of experts runs on, when given.
    pub fn expert_parallel(&self) -> Option<&ExpertParallel> {
        self.experts.as_ref()
    }

    /// The same context with attention run over `group` as a ring (a group of one rank:
    /// ordinary attention). Each rank's activations then hold its two chunks of the
    /// sequence.
    pub fn with_context_parallel(mut self, group: Arc<dyn Communicator>) -> Self {
        self.context = (group.size() > 1).then_some(group);
        self
    }

    /// The context-parallel group attention runs over, when it has more than one rank.
    pub fn context_parallel(&self) -> Option<&Arc<dyn Communicator>> {
        self.context.as_ref()
    }

    /// This rank's index in the context-parallel group (0 without one).
    pub fn context_rank(&self) -> usize {
        self.context.as_ref().map_or(0, |g| g.rank())
    }

    /// The context-parallel group's size (1 without one).
    pub fn context_size(&self) -> usize {
        self.context.as_ref().map_or(1, |g| g.size())
    }

    /// The same group with sequence parallelism switched on or off.
    pub fn with_sequence_parallel(mut self, sequence_parallel: bool) -> Self {
        self.sequence_parallel = sequence_parallel;
        self
    }

    /// The tensor-parallel group.
    pub fn group(&self) -> &Arc<dyn Communicator> {
        &self.group
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// Whether activations outside tensor-parallel regions are split along the sequence.
    pub fn sequence_parallel(&self) -> bool {
        self.sequence_parallel
    }

    /// This rank's `(start, len)` when `full_len` elements are divided among the group by
    /// [`ferrotron_mappings::split_sizes`] (balanced: parts differ by at most one).
    pub fn part(&self, full_len: usize) -> Result<(usize, usize)> {
        part_of(full_len, self.rank(), self.size())
    }
}

/// The groups a mixture of experts runs on: the expert-parallel group its experts are
/// divided among, and the tensor-parallel group inside each expert.
#[derive(Clone)]
pub struct ExpertParallel {
    pub(crate) ep: Arc<dyn Communicator>,
    pub(crate) expert_tp: Arc<dyn Communicator>,
}

impl ExpertParallel {
    /// Experts divided among `ep`, each split by tensor parallelism over `expert_tp` (a
    /// group of one rank: whole experts). Ranks of one `expert_tp` group must route the
    /// same tokens.
    pub fn new(ep: Arc<dyn Communicator>, expert_tp: Arc<dyn Communicator>) -> Self {
        ExpertParallel { ep, expert_tp }
    }

    /// The expert-parallel and expert-tensor-parallel groups of `state`.
    pub fn from_state(state: &ParallelState) -> Self {
        Self::new(state.ep().clone(), state.expert_tp().clone())
    }

    /// The expert-parallel group.
    pub fn group(&self) -> &Arc<dyn Communicator> {
        &self.ep
    }
}

/// Rank `rank`'s `(start, len)` of `full_len` elements split among `size` ranks by
/// [`ferrotron_mappings::split_sizes`].
pub fn part_of(full_len: usize, rank: usize, size: usize) -> Result<(usize, usize)> {
    let sizes = ferrotron_mappings::split_sizes(full_len, size)?;
    let start = sizes.iter().take(rank).sum();
    let len = sizes.get(rank).copied().ok_or_else(|| {
        Error::config(
            "part_of",
            format!("rank {rank} is not in a group of {size}"),
        )
    })?;
    Ok((start, len))
}

/// How a parameter's full (serial) tensor is divided among the tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Dimension `dim`, `full_len` long in the serial model, is divided by
    /// [`ferrotron_mappings::split_sizes`]; rank `r` holds part `r`.
    Split {
        /// The divided dimension.
        dim: usize,
        /// Its length in the full tensor.
        full_len: usize,
    },
}

impl Sharding {
    /// Rank `rank`'s part of the full tensor (of a group of `size`).
    pub fn shard(&self, full: &Tensor, rank: usize, size: usize) -> Result<Tensor> {
        match *self {
            Sharding::Replicated => Ok(full.detach()),
            Sharding::Split { dim, full_len } => {
                if full.shape().get(dim) != Some(&full_len) {
                    return Err(Error::shape(
                        "Sharding::shard",
                        full.shape(),
                        format!("dimension {dim} of length {full_len}"),
                    ));
                }
                let (start, len) = part_of(full_len, rank, size)?;
                let part = full.detach().narrow(dim, start, len)?;
                // An owned copy: a view would keep the whole master tensor alive.
                Ok(Tensor::from_vec(part.to_vec()?, part.shape())?)
            }
        }
    }

    /// The full tensor from every rank's part, in rank order (the inverse of
    /// [`shard`](Self::shard)). Replicated parameters take rank 0's copy.
    pub fn unshard(&self, parts: &[Tensor]) -> Result<Tensor> {
        let Some(first) = parts.first() else {
            return Err(Error::config("Sharding::unshard", "no parts given"));
        };
        match *self {
            Sharding::Replicated => Ok(first.detach()),
            Sharding::Split { dim, .. } => {
                let parts: Vec<&Tensor> = parts.iter().collect();
                Ok(Tensor::concat(&parts, dim)?.detach())
            }
        }
    }

    /// Text form used in checkpoint metadata: `replicated` or `split:<dim>:<full_len>`.
    pub fn encode(&self) -> String {
        match self {
            Sharding::Replicated => "replicated".to_string(),
            Sharding::Split { dim, full_len } => format!("split:{dim}:{full_len}"),
        }
    }

    /// Parses [`encode`](Self::encode)'s form.
    pub fn decode(text: &str) -> Option<Sharding> {
        if text == "replicated" {
            return Some(Sharding::Replicated);
        }
        let mut fields = text.strip_prefix("split:")?.split(':');
        let dim = fields.next()?.parse().ok()?;
        let full_len = fields.next()?.parse().ok()?;
        fields
            .next()
            .is_none()
            .then_some(Sharding::Split { dim, full_len })
    }
}

/// A rank's parameter with what checkpoints and gradient synchronisation need to know.
#[derive(Debug, Clone)]
pub struct ShardedParameter {
    /// This rank's part of the parameter; its name is unique within the model.
    pub param: Parameter,
    /// How the full parameter is divided among tensor-parallel ranks.
    pub sharding: Sharding,
    /// The group whose ranks must sum this parameter's gradient after backward, each
    /// holding only part of it (by DDP's extra reductions, which
    /// `DistributedDataParallel::for_model` derives from this field):
    /// * `Some(TP_GROUP)` for parameters used on sequence-split activations (layer norms
    ///   and row-parallel biases under sequence parallelism): each rank's gradient covers
    ///   only its part of the sequence (without DDP,
    ///   [`all_reduce_sequence_parallel_grads`] sums them);
    /// * `Some(EMBEDDING_GROUP)` for each stage's copy of a word embedding tied to the
    ///   output layer across pipeline stages: the first stage's gradient comes from the
    ///   lookup, the last stage's from the logits.
    pub grad_reduce_group: Option<&'static str>,
    /// Whether this is a copy of a weight that another pipeline stage also holds and
    /// counts: the last stage's copy of a word embedding tied to the output layer
    /// (Megatron's `shared` flag). Sums over the whole model, such as the gradient norm,
    /// leave it out so that the weight counts once; clipping still scales it, so that
    /// the copies stay equal.
    pub shared_copy: bool,
    /// Whether this belongs to one of a mixture of experts' experts: each
    /// expert-parallel rank holds different experts, so its gradient is reduced over the
    /// expert-data-parallel group (the ranks holding the same experts) rather than the
    /// data-parallel group, and sums over the model add it over the expert-parallel
    /// group too.
    pub expert: bool,
}

impl ShardedParameter {
    /// Whether this rank's copy repeats one that tensor-parallel rank 0 also holds
    /// ([`Sharding::Replicated`] on any other rank), so that sums over the model, such
    /// as the gradient norm, count it once (Megatron's
    /// `param_is_not_tensor_parallel_duplicate`, negated).
    pub fn is_tensor_parallel_duplicate(&self, tp_rank: usize) -> bool {
        self.sharding == Sharding::Replicated && tp_rank != 0
    }

    /// Whether sums over the whole model (the gradient norm) count this rank's copy on
    /// tensor-parallel rank `tp_rank`: neither a
    /// [tensor-parallel duplicate](Self::is_tensor_parallel_duplicate) nor a
    /// [`shared_copy`](Self::shared_copy).
    pub fn counts_in_model_sums(&self, tp_rank: usize) -> bool {
        !self.shared_copy && !self.is_tensor_parallel_duplicate(tp_rank)
    }
}

/// Anything made of sharded parameters.
pub trait Module {
    /// Every parameter, in a fixed order that is the same on every rank.
    fn parameters(&self) -> Vec<ShardedParameter>;
}

/// Sums, over the tensor-parallel group, the gradients of the parameters whose
/// [`grad_reduce_group`](ShardedParameter::grad_reduce_group) asks for it. Call it after
/// backward when DDP does not reduce them (DDP built with `for_model` does). Every rank
/// must call it; a parameter without a gradient contributes zeros. The sum runs on the
/// gradient's own memory as mappings' collectives do: no copy through the host on the
/// CPU or the emulated device.
pub fn all_reduce_sequence_parallel_grads(
    module: &dyn Module,
    group: &Arc<dyn Communicator>,
) -> Result<()> {
    use ferrotron_comm_core::ReduceOp;
    for sharded in module.parameters() {
        if sharded.grad_reduce_group.is_none() || group.size() == 1 {
            continue;
        }
        let param = &sharded.param;
        let grad = match param.try_grad()? {
            Some(grad) => grad,
            None => Tensor::full_on(&param.shape(), 0.0, param.device())?,
        };
        let summed = grad.updated_by(|buf| {
            group
                .all_reduce(buf, ReduceOp::Sum)
                .map_err(|e| ferrotron_tape::Error::custom("all_reduce_sequence_parallel_grads", e))
        })?;
        param.set_grad(Some(summed))?;
    }
    Ok(())
}
