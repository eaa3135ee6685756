//! Extra reductions over named model-parallel groups for marked parameters (Megatron's
//! `finalize_model_grads`, seed 003's `init_ddp_model_and_reduction_hooks`).
//!
//! Some parameters are replicated across a model-parallel group as well as across the
//! data-parallel one, and every replica computes only part of their gradient. After the
//! data-parallel average, such a parameter's gradient must also be *summed* over that
//! group. [`NamedGroupReduction`] records which parameters, with group names from
//! [`ParallelState`]'s registry:
//!
//! * **Sequence-parallel layer norms** (`_allreduce_layernorm_grads`): with sequence
//!   parallelism each TP rank normalises a slice of the sequence, so layer-norm weight
//!   and bias gradients are partial sums: `"tp"`.
//! * **Tied embeddings** (`_allreduce_word_embedding_grads`): the first and last pipeline
//!   stages each hold a copy of the word embedding; mark the copy on both stages with
//!   `"embedding"` so both receive the sum of the two gradients.
//! * **Context parallelism** (seed 003): parameters whose gradients are partial over
//!   `"cp"` or `"tp-cp"`.
//!
//! The reductions run at the end of
//! [`finish`](crate::DistributedDataParallel::finish), after every bucket has been
//! reduced, and never inside a bucket: bucket boundaries follow each
//! rank's own parameter sizes, which differ between the ranks of a tensor-parallel group
//! when shards are uneven, while a collective needs the same count on every member.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;

use ferrotron_comm_core::{Communicator, CommunicatorExt, ReduceOp};
use ferrotron_parallel_state::ParallelState;
use ferrotron_tape::{ParamId, Parameter, Tensor};

use crate::error::{Error, Result};

/// Which parameters' gradients DDP also sums over which named model-parallel groups,
/// after the data-parallel average. Hand it to DDP as
/// [`DdpConfig::extra_reductions`](crate::DdpConfig::extra_reductions);
/// [`DistributedDataParallel::for_model`](crate::DistributedDataParallel::for_model)
/// adds a `layers` model's own marks to it, which is all most models need.
///
/// In [`finish`](crate::DistributedDataParallel::finish), once the data-parallel average
/// is in every parameter, each group (in [`ParallelState::group_names`] order, whatever
/// order the marks were made in) gets one SUM all-reduce, in f32 whatever the comm hook's
/// wire dtype, on the gradients' device: its marked parameters' whole gradients in
/// registration order, coalesced (after a small host all-reduce of which of them have a
/// gradient on some rank).
/// Every member of a group must therefore mark parameters of the same shapes in the same
/// registration order. A marked parameter without a gradient takes part as zeros; it
/// receives the sum when some member had a gradient for it, and keeps no gradient when
/// none had.
///
/// ```
/// use ferrotron_comm_core::run_local;
/// use ferrotron_ddp::{DdpConfig, DistributedDataParallel, NamedGroupReduction};
/// use ferrotron_parallel_state::{ParallelState, RankLayout};
/// use std::sync::Arc;
/// use ferrotron_tape::{Parameter, Tape, Tensor};
///
/// // 4 ranks: TP = 2 × DP = 2. A sequence-parallel layer norm weight is marked "tp".
/// let layout = RankLayout::builder(4).tp(2).build()?;
/// let grads = run_local(4, |comm| -> ferrotron_ddp::Result<Vec<f32>> {
///     let state = ParallelState::new(Arc::new(comm), layout.clone())?;
///     let ln = Parameter::new("ln.weight", Tensor::ones(&[2]));
///     let mut marks = NamedGroupReduction::new();
///     marks.mark(&state, &ln, &["tp"])?;
///     let config = DdpConfig { extra_reductions: marks, ..DdpConfig::default() };
///     let ddp = DistributedDataParallel::new(vec![ln.clone()], state.dp().clone(), config)?;
///
///     // World rank r contributes a gradient of r + 1 to each element.
///     let tape = Tape::new();
///     let loss = tape.watch(&ln)?.scale(state.rank() as f64 + 1.0)?.sum()?;
///     ddp.backward(&loss)?;
///     Ok(ln.grad().map(|g| g.to_vec()).transpose()?.unwrap_or_default())
/// })?;
/// // DP groups {0, 2}, {1, 3} average: 2 and 3; the TP groups {0, 1}, {2, 3} then sum: 5.
/// assert!(grads.iter().all(|g| g == &vec![5.0, 5.0]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct NamedGroupReduction {
    /// Sorted by registry position.
    groups: Vec<MarkedGroup>,
}

#[derive(Clone)]
struct MarkedGroup {
    name: String,
    /// Position in the registry, which orders the reductions identically on every rank.
    registry_position: usize,
    comm: Arc<dyn Communicator>,
    /// The marked parameters, with their names for error messages.
    params: HashMap<ParamId, String>,
}

impl NamedGroupReduction {
    /// No marks: DDP only averages over the data-parallel group.
    pub fn new() -> Self {
        Self::default()
    }

    /// Marks `param` for an extra SUM all-reduce over each group in `groups` (names from
    /// `state`'s registry). Every rank holding `param` must mark it the same way; this
    /// rank must be a member of each group. Marking a parameter twice for a group is the
    /// same as once.
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
            if !self.groups.iter().any(|g| g.name == group) {
                let registry_position = state
                    .group_names()
                    .iter()
                    .position(|name| *name == group)
                    .unwrap_or(usize::MAX);
                self.groups.push(MarkedGroup {
                    name: group.to_string(),
                    registry_position,
                    comm: comm.clone(),
                    params: HashMap::new(),
                });
                self.groups.sort_by_key(|g| g.registry_position);
            }
            if let Some(marked) = self.groups.iter_mut().find(|g| g.name == group) {
                marked.params.insert(param.id(), param.name().to_string());
            }
        }
        Ok(())
    }

    /// The groups `param` is marked with, in the order their reductions run.
    pub fn groups_of(&self, param: &Parameter) -> Vec<&str> {
        self.groups
            .iter()
            .filter(|g| g.params.contains_key(&param.id()))
            .map(|g| g.name.as_str())
            .collect()
    }

    /// The reductions to run over `params` (DDP's parameters, in registration order):
    /// each group's members as registration indices. Groups of one rank are left out.
    /// Fails on a mark for a parameter that is not in `params`.
    pub(crate) fn resolve(&self, params: &[Parameter]) -> Result<Vec<GroupReduction>> {
        let registered: HashSet<ParamId> = params.iter().map(Parameter::id).collect();
        let mut reductions = Vec::new();
        for group in &self.groups {
            let mut strangers: Vec<&String> = group
                .params
                .iter()
                .filter(|(id, _)| !registered.contains(id))
                .map(|(_, name)| name)
                .collect();
            strangers.sort();
            if let Some(name) = strangers.first() {
                return Err(Error::InvalidMark {
                    name: name.to_string(),
                    group: group.name.clone(),
                    reason: "it is not one of the parameters given to DistributedDataParallel"
                        .into(),
                });
            }
            if group.comm.size() < 2 {
                continue;
            }
            reductions.push(GroupReduction {
                comm: group.comm.clone(),
                members: (0..params.len())
                    .filter(|&i| group.params.contains_key(&params[i].id()))
                    .collect(),
            });
        }
        Ok(reductions)
    }
}

impl fmt::Debug for NamedGroupReduction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(
                self.groups
                    .iter()
                    .map(|g| (g.name.as_str(), g.params.len())),
            )
            .finish()
    }
}

/// One group's extra reduction, resolved against DDP's parameters.
pub(crate) struct GroupReduction {
    comm: Arc<dyn Communicator>,
    /// Registration indices of the marked parameters, ascending.
    members: Vec<usize>,
}

impl GroupReduction {
    /// Registration indices of the marked parameters, ascending.
    pub(crate) fn members(&self) -> &[usize] {
        &self.members
    }

    /// Sums the members' gradients over the group: first which members some rank has a
    /// gradient for (a parameter none has keeps none), then the gradients themselves in
    /// one f32 all-reduce on their device (no host round trip).
    pub(crate) fn run(&self, params: &[Parameter]) -> Result<()> {
        let Some(&first) = self.members.first() else {
            return Ok(());
        };
        let grads = (self.members.iter())
            .map(|&i| params[i].try_grad())
            .collect::<ferrotron_tape::Result<Vec<Option<Tensor>>>>()?;
        let mut flags: Vec<f32> = grads
            .iter()
            .map(|g| f32::from(u8::from(g.is_some())))
            .collect();
        self.comm.all_reduce_slice(&mut flags, ReduceOp::Sum)?;

        let device = params[first].device();
        let flat = (self.members.iter().zip(grads))
            .map(|(&i, grad)| {
                let numel = params[i].numel();
                match grad {
                    Some(grad) => grad.reshape(&[numel]),
                    None => Tensor::full_on(&[numel], 0.0, device),
                }
            })
            .collect::<ferrotron_tape::Result<Vec<Tensor>>>()?;
        let summed = Tensor::concat(&flat.iter().collect::<Vec<_>>(), 0)?.updated_by(|buf| {
            self.comm
                .all_reduce(buf, ReduceOp::Sum)
                .map_err(Error::from)
        })?;
        let mut offset = 0;
        for (&i, &flag) in self.members.iter().zip(&flags) {
            let param = &params[i];
            let numel = param.numel();
            if flag > 0.0 {
                param.set_grad(Some(
                    summed.narrow(0, offset, numel)?.reshape(&param.shape())?,
                ))?;
            }
            offset += numel;
        }
        Ok(())
    }
}
