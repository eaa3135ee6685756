//! Extra reductions in named groups for marked parameters (the comm hook of seed 003's
//! `init_ddp_model_and_reduction_hooks`).
//!
//! Some parameters are replicated across a model-parallel group as well as across the
//! data-parallel one, and every replica computes only part of their gradient. After the
//! data-parallel average, such a parameter's gradient must also be *summed* over that
//! group. [`NamedGroupReduction`] does this for parameters marked with group names from
//! [`ParallelState`]'s registry, after its inner hook's reduction:
//!
//! * **Sequence-parallel layer norms** (Megatron `finalize_model_grads`,
//!   `_allreduce_layernorm_grads`): with sequence parallelism each TP rank normalises a
//!   slice of the sequence, so layer-norm weight and bias gradients are partial sums;
//!   mark them with `"tp"`.
//! * **Tied embeddings** (`_allreduce_word_embedding_grads`): the first and last pipeline
//!   stages each hold a copy of the word embedding; mark the copy on both stages with
//!   `"embedding"` so both receive the sum of the two gradients.
//! * **Context parallelism** (seed 003): parameters whose gradients are partial over
//!   `"cp"` or `"tp-cp"`.
//!
//! Groups are processed in registry order ([`ParallelState::group_names`]), the same on
//! every rank whatever order the marks were made in. Within a bucket, marked parameters
//! that lie next to each other are reduced as one collective, in place in the bucket.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use comm_core::{Buffer, Communicator, DType, ReduceOp, Work};
use parallel_state::ParallelState;
use tape::{ParamId, Parameter};

use crate::error::{Error, Result};
use crate::hook::{AllReduceAvg, CommHook, ReducedBucket};

/// A comm hook that runs an inner hook (by default [`AllReduceAvg`]) and then sums the
/// gradients of marked parameters over named groups.
///
/// ```
/// use comm_core::run_local;
/// use ddp::{DdpConfig, DistributedDataParallel, NamedGroupReduction};
/// use parallel_state::{ParallelState, RankLayout};
/// use std::sync::Arc;
/// use tape::{Parameter, Tape, Tensor};
///
/// // 4 ranks: TP = 2 × DP = 2. A sequence-parallel layer norm weight is marked "tp".
/// let layout = RankLayout::builder(4).tp(2).build()?;
/// let grads = run_local(4, |comm| -> ddp::Result<Vec<f32>> {
///     let state = ParallelState::new(Arc::new(comm), layout.clone())?;
///     let ln = Parameter::new("ln.weight", Tensor::ones(&[2]));
///     let mut hook = NamedGroupReduction::new();
///     hook.mark(&state, &ln, &["tp"])?;
///     let config = DdpConfig { comm_hook: Arc::new(hook), ..DdpConfig::default() };
///     let ddp = DistributedDataParallel::new(vec![ln.clone()], state.dp().clone(), config)?;
///
///     // World rank r contributes a gradient of r + 1 to each element.
///     let tape = Tape::new();
///     let loss = tape.watch(&ln).scale(state.rank() as f64 + 1.0)?.sum()?;
///     ddp.backward(&loss)?;
///     Ok(ln.grad().map(|g| g.to_vec()).transpose()?.unwrap_or_default())
/// })?;
/// // DP groups {0, 2}, {1, 3} average: 2 and 3; the TP groups {0, 1}, {2, 3} then sum: 5.
/// assert!(grads.iter().all(|g| g == &vec![5.0, 5.0]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct NamedGroupReduction {
    inner: Arc<dyn CommHook>,
    groups: Vec<MarkedGroup>,
}

struct MarkedGroup {
    name: String,
    /// Position in the registry, which orders the reductions identically on every rank.
    registry_position: usize,
    comm: Arc<dyn Communicator>,
    params: HashSet<ParamId>,
}

impl NamedGroupReduction {
    /// Averages over the data-parallel group with [`AllReduceAvg`], then runs the
    /// extra reductions.
    pub fn new() -> Self {
        NamedGroupReduction::with_inner(Arc::new(AllReduceAvg))
    }

    /// Runs `inner` (e.g. a [`CompressedAllReduce`](crate::CompressedAllReduce)) for the
    /// data-parallel reduction, then the extra reductions, in `inner`'s wire dtype.
    pub fn with_inner(inner: Arc<dyn CommHook>) -> Self {
        NamedGroupReduction {
            inner,
            groups: Vec::new(),
        }
    }

    /// Marks `param` for an extra SUM all-reduce over each group in `groups` (names from
    /// `state`'s registry). Every rank holding `param` must mark it the same way; this
    /// rank must be a member of each group.
    pub fn mark(
        &mut self,
        state: &ParallelState,
        param: &Parameter,
        groups: &[&str],
    ) -> Result<()> {
        for &group in groups {
            if group == "dp" {
                return Err(Error::InvalidMark {
                    name: param.name().to_string(),
                    group: group.to_string(),
                    reason: "DDP already averages every gradient over the data-parallel group"
                        .into(),
                });
            }
            let comm = state.group_named(group)?;
            let registry_position = state
                .group_names()
                .iter()
                .position(|name| *name == group)
                .unwrap_or(usize::MAX);
            if !self.groups.iter().any(|g| g.name == group) {
                self.groups.push(MarkedGroup {
                    name: group.to_string(),
                    registry_position,
                    comm: comm.clone(),
                    params: HashSet::new(),
                });
                self.groups.sort_by_key(|g| g.registry_position);
            }
            if let Some(marked) = self.groups.iter_mut().find(|g| g.name == group) {
                marked.params.insert(param.id());
            }
        }
        Ok(())
    }

    /// The groups `param` is marked with, in the order their reductions run.
    pub fn groups_of(&self, param: &Parameter) -> Vec<&str> {
        self.groups
            .iter()
            .filter(|g| g.params.contains(&param.id()))
            .map(|g| g.name.as_str())
            .collect()
    }
}

impl Default for NamedGroupReduction {
    fn default() -> Self {
        NamedGroupReduction::new()
    }
}

impl fmt::Debug for NamedGroupReduction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NamedGroupReduction")
            .field("inner", &self.inner.name())
            .field(
                "groups",
                &self
                    .groups
                    .iter()
                    .map(|g| (g.name.as_str(), g.params.len()))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl CommHook for NamedGroupReduction {
    fn name(&self) -> &str {
        "named-group-reduction"
    }

    fn wire_dtype(&self) -> DType {
        self.inner.wire_dtype()
    }

    fn start(&self, dp: &dyn Communicator, bucket: Buffer) -> comm_core::Result<Work> {
        self.inner.start(dp, bucket)
    }

    fn after_reduce(&self, bucket: &mut ReducedBucket<'_>) -> Result<()> {
        self.inner.after_reduce(bucket)?;
        for group in &self.groups {
            if group.comm.size() < 2 {
                continue;
            }
            let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
            for param in bucket
                .params()
                .iter()
                .filter(|p| group.params.contains(&p.id))
            {
                match runs.last_mut() {
                    Some(run) if run.end == param.offset => run.end += param.numel,
                    _ => runs.push(param.range()),
                }
            }
            for run in runs {
                bucket.all_reduce_range(group.comm.as_ref(), run, ReduceOp::Sum)?;
            }
        }
        Ok(())
    }
}
