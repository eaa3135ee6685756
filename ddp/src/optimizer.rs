//! [`DistributedOptimizer`]: optimizer state sharded over the data-parallel group
//! (ZeRO-1/2; Megatron-Core's distributed optimizer) on top of DDP's buckets.
//!
//! Each bucket's buffer is split into `dp` equal shards; rank `r` owns shard `r` of every
//! bucket (`dp` being the size of the bucket's DDP's group: the data-parallel group, or
//! for experts the expert-data-parallel one). A parameter may straddle two shards: each owner updates its own piece. DDP
//! reduce-scatters the buckets (so each rank receives only its shard of the averaged
//! gradient) and keeps no gradient in the parameters; the optimizer keeps moments only
//! for its shard, updates its pieces of the parameters with the same per-element update
//! as [`ferrotron_tape::AdamW`] and [`ferrotron_tape::Sgd`], and all-gathers the updated values bucket by
//! bucket into every rank's parameters (non-blocking: a bucket's gather runs while the
//! next bucket is updated). Parameters stored as bf16 or f16 are updated
//! through f32 master weights, of which each rank too keeps only its shard.
//!
//! Shards, moments and masters are flat storage on the parameters' device, and the
//! update runs there (tape's kernels on a device): gradients and parameters never pass
//! through the host; only the norm and finiteness checks bring scalars back.

use std::collections::HashMap;
use std::sync::Arc;

use ferrotron_comm_core::{AsyncOp, Communicator, CommunicatorExt, DType, ReduceOp, Work};
use ferrotron_layers::{GradNorm, GradScaler, LocalSquares, ShardedParameter, TensorParallel};
use ferrotron_tape::{
    AdamWConfig, AdamWUpdate, Device, FlatStorage, FlatView, LrSchedule, Optimizer, OptimizerState,
    ParamId, ParamOptions, ParamState, Parameter, PendingValue, SgdConfig, SgdUpdate, Tensor,
    MASTER_BUFFER,
};
use parking_lot::Mutex;

use crate::bucket::BucketInfo;
use crate::error::{Error, Result};
use crate::reducer::{bucket_device, Reducer};
use crate::DistributedDataParallel;

/// The update rule applied to each shard.
#[derive(Debug, Clone, Copy)]
enum Rule {
    AdamW(AdamWConfig),
    Sgd(SgdConfig),
}

impl Rule {
    /// Names of the per-element buffers the rule keeps, as in PyTorch's optimizer state.
    fn buffer_names(&self) -> &'static [&'static str] {
        match self {
            Rule::AdamW(_) => &["exp_avg", "exp_avg_sq"],
            Rule::Sgd(config) if config.momentum != 0.0 => &["momentum_buffer"],
            Rule::Sgd(_) => &[],
        }
    }

    fn base_lr(&self) -> f64 {
        match self {
            Rule::AdamW(config) => config.lr,
            Rule::Sgd(config) => config.lr,
        }
    }
}

/// The part of one parameter that lies in this rank's shard of its bucket.
#[derive(Debug, Clone)]
struct Piece {
    /// The parameter's index among the optimizer's parameters.
    param: usize,
    /// The piece's elements within the parameter (flattened, row-major).
    within_param: std::ops::Range<usize>,
    /// Where the piece starts in the shard.
    shard_offset: usize,
}

impl Piece {
    /// The piece's elements in `storage`, a shard-sized flat storage.
    fn view(&self, storage: &FlatStorage) -> Result<FlatView> {
        Ok(FlatView::new(
            storage,
            self.shard_offset,
            &[self.within_param.len()],
        )?)
    }
}

/// Whether `param` is stored in 16 bits (and so trained through master weights).
fn is_16_bit(param: &Parameter) -> bool {
    param.dtype() != DType::F32
}

/// One bucket of one of the wrapped DDPs.
#[derive(Debug, Clone)]
struct Bucket {
    /// Which DDP (position in the constructor's list).
    ddp: usize,
    /// Which of the optimizer's groups its DDP reduces over (its shards are cut by it).
    group: usize,
    /// That group's size.
    dp: usize,
    /// The optimizer's index of that DDP's first parameter: its slot indices are offset
    /// by it.
    first_param: usize,
    info: BucketInfo,
    /// Where its parameters, and so its shards, live.
    device: Device,
}

impl Bucket {
    fn shard_len(&self) -> usize {
        self.info.padded_numel / self.dp.max(1)
    }

    /// Flat storage of one shard's length on the bucket's device.
    fn shard_storage(&self) -> Result<FlatStorage> {
        Ok(FlatStorage::zeros(self.device, self.shard_len())?)
    }

    /// The parts of its parameters in this rank's shard of `group`.
    fn pieces(&self, group: &Arc<dyn Communicator>) -> Vec<Piece> {
        let shard = self.info.shard_range(group.rank(), group.size());
        (self.info.params.iter())
            .filter_map(|slot| {
                let start = slot.offset.max(shard.start);
                let end = (slot.offset + slot.numel).min(shard.end);
                (start < end).then(|| Piece {
                    param: self.first_param + slot.index,
                    within_param: start - slot.offset..end - slot.offset,
                    shard_offset: start - shard.start,
                })
            })
            .collect()
    }
}

/// A group the wrapped DDPs reduce over: the data-parallel one, or the experts'
/// expert-data-parallel one. Sums over the model (the gradient norm, the overflow check)
/// add up each group's shards over it, and experts' then over the expert-parallel group,
/// whose ranks hold other experts.
struct Group {
    comm: Arc<dyn Communicator>,
    expert_parallel: Option<Arc<dyn Communicator>>,
}

impl Group {
    /// The group itself, then the expert-parallel one if any.
    fn sum_over(&self) -> impl Iterator<Item = &Arc<dyn Communicator>> {
        std::iter::once(&self.comm).chain(&self.expert_parallel)
    }
}

/// Whether two handles name the same communicator object.
fn same_comm(a: &Arc<dyn Communicator>, b: &Arc<dyn Communicator>) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// The wrapped DDPs, flattened: their reducers, parameters and buckets in order, and the
/// distinct groups they reduce over.
struct Wrapped {
    reducers: Vec<Arc<Mutex<Reducer>>>,
    params: Vec<Parameter>,
    buckets: Vec<Bucket>,
    groups: Vec<Group>,
    /// Per parameter, its index in `groups`.
    param_group: Vec<usize>,
}

impl Wrapped {
    fn of(ddps: &[&DistributedDataParallel]) -> Result<Wrapped> {
        let mut wrapped = Wrapped {
            reducers: Vec::new(),
            params: Vec::new(),
            buckets: Vec::new(),
            groups: Vec::new(),
            param_group: Vec::new(),
        };
        for (index, ddp) in ddps.iter().enumerate() {
            let group = wrapped.group_of(index, ddp)?;
            let first_param = wrapped.params.len();
            for info in ddp.buckets() {
                wrapped.buckets.push(Bucket {
                    ddp: index,
                    group,
                    dp: ddp.communicator().size(),
                    first_param,
                    info: info.clone(),
                    device: bucket_device(ddp.parameters(), info)?,
                });
            }
            wrapped.params.extend_from_slice(ddp.parameters());
            wrapped.param_group.resize(wrapped.params.len(), group);
            wrapped.reducers.push(ddp.reducer().clone());
        }
        Ok(wrapped)
    }

    /// The index of DDP #`index`'s group, added if new: at most one for the model's
    /// parameters and one for experts'.
    fn group_of(&mut self, index: usize, ddp: &DistributedDataParallel) -> Result<usize> {
        let comm = ddp.communicator();
        let experts = ddp.expert_parallel().is_some();
        if let Some(group) = self.groups.iter().position(|g| same_comm(&g.comm, comm)) {
            // Experts' sums also run over the expert-parallel group; the model's do not.
            if self.groups[group].expert_parallel.is_some() != experts {
                return Err(Error::Config(format!(
                    "DDP #{index} reduces over the same communicator as an earlier DDP of the \
                     other kind (experts' and the model's parameters): build experts' DDP \
                     with for_experts over the expert-data-parallel group"
                )));
            }
            return Ok(group);
        }
        if let Some(other) = (self.groups.iter()).find(|g| g.expert_parallel.is_some() == experts) {
            return Err(Error::Config(format!(
                "DDP #{index} reduces over a group of {} (rank {}), an earlier one {} over {} \
                 (rank {}): the DDPs of one distributed optimizer must use the same \
                 data-parallel group (experts' DDPs, from for_experts, the same \
                 expert-data-parallel group)",
                comm.size(),
                comm.rank(),
                if experts {
                    "over experts"
                } else {
                    "of the model"
                },
                other.comm.size(),
                other.comm.rank()
            )));
        }
        self.groups.push(Group {
            comm: comm.clone(),
            expert_parallel: ddp.expert_parallel().cloned(),
        });
        Ok(self.groups.len() - 1)
    }
}

/// An optimizer whose state is split over the data-parallel group: each rank keeps the
/// moments of `1/dp` of every bucket, so AdamW's state costs `8/dp` bytes per parameter
/// per rank instead of 8.
///
/// Build each [`DistributedDataParallel`] with
/// [`use_distributed_optimizer`](crate::DdpConfig::use_distributed_optimizer) (one per
/// model chunk, as interleaved pipeline schedules have, or one for the whole model, and
/// one over each chunk's experts, [`for_experts`](DistributedDataParallel::for_experts),
/// whose state is split over the expert-data-parallel group instead);
/// after their [`backward`](DistributedDataParallel::backward),
/// [`clip_grad_norm`](Self::clip_grad_norm) optionally clips the reduced shards and
/// [`step`](Self::step) updates this rank's shards and all-gathers the parameters, so
/// every rank ends the step with the parameters plain DDP and a replicated optimizer
/// would have given.
/// ```
/// use ferrotron_comm_core::run_local;
/// use ferrotron_ddp::{DdpConfig, DistributedDataParallel, DistributedOptimizer};
/// use std::sync::Arc;
/// use ferrotron_tape::{AdamWConfig, Parameter, Tape, Tensor};
///
/// let weights = run_local(2, |comm| -> ferrotron_ddp::Result<Vec<f32>> {
///     let w = Parameter::new("w", Tensor::ones(&[3, 2]));
///     let config = DdpConfig { use_distributed_optimizer: true, ..DdpConfig::default() };
///     let ddp = DistributedDataParallel::new(vec![w.clone()], Arc::new(comm), config)?;
///     let mut adamw = DistributedOptimizer::adamw([&ddp], AdamWConfig::default())?;
///     let tape = Tape::new();
///     let loss = tape.watch(&w)?.sum()?;
///     ddp.backward(&loss)?; // each rank receives its shard of the averaged gradient
///     adamw.step()?; // updates its shard, then all-gathers the parameters
///     // Each rank holds the moments of its 64 elements of the 128-element bucket.
///     assert_eq!(adamw.state_bytes(), 2 * 64 * 4);
///     Ok(w.value()?.to_vec()?)
/// })?;
/// // AdamW's first step moves every weight by lr against the gradient's sign (and decays).
/// let expected = 1.0 * (1.0 - 1e-3 * 1e-2) - 1e-3;
/// assert!(weights[0].iter().all(|w| (w - expected).abs() < 1e-7));
/// assert_eq!(weights[0], weights[1]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DistributedOptimizer {
    /// The wrapped DDPs' reducers, which hold the reduced shards between backward and
    /// step.
    reducers: Vec<Arc<Mutex<Reducer>>>,
    /// The distinct groups the DDPs reduce over, in order of first use.
    groups: Vec<Group>,
    /// Per parameter, which of `groups` its DDP reduces over.
    param_group: Vec<usize>,
    params: Vec<Parameter>,
    /// Every bucket of every DDP, in order.
    buckets: Vec<Bucket>,
    rule: Rule,
    options: Vec<ParamOptions>,
    schedule: Option<LrSchedule>,
    /// Steps taken (the position on the schedule).
    steps: u64,
    /// Updates applied to each parameter (AdamW's bias correction; SGD's first step).
    /// Counted on the ranks that own a piece of it.
    updates: Vec<u32>,
    /// Per bucket, this rank's pieces of its parameters.
    pieces: Vec<Vec<Piece>>,
    /// Per bucket, the rule's buffers over this rank's shard.
    buffers: Vec<Vec<FlatStorage>>,
    /// Per bucket holding pieces of 16-bit parameters, the f32 master weights over this
    /// rank's shard (other pieces' elements are scratch).
    masters: Vec<Option<FlatStorage>>,
    /// Which parameters are trained through master weights (the same on every rank,
    /// whichever of them holds pieces of each).
    mastered: Vec<bool>,
    /// Why the last [`clip_grad_norm`](Self::clip_grad_norm) or
    /// [`unscale_grads`](Self::unscale_grads) dropped the gradients, until a step finds
    /// new ones (for the error that says why there is nothing to step with).
    dropped: Option<String>,
    /// Whether the parameters land when first read after a step
    /// ([`with_overlap_param_gather`](Self::with_overlap_param_gather)).
    overlap_param_gather: bool,
}

impl DistributedOptimizer {
    /// AdamW over the parameters of `ddps` (in that order), as [`ferrotron_tape::AdamW`] with
    /// `config`.
    pub fn adamw<'a>(
        ddps: impl IntoIterator<Item = &'a DistributedDataParallel>,
        config: AdamWConfig,
    ) -> Result<Self> {
        DistributedOptimizer::new(ddps, Rule::AdamW(config))
    }

    /// SGD (momentum, weight decay, Nesterov) over the parameters of `ddps` (in that
    /// order), as [`ferrotron_tape::Sgd`] with `config`.
    pub fn sgd<'a>(
        ddps: impl IntoIterator<Item = &'a DistributedDataParallel>,
        config: SgdConfig,
    ) -> Result<Self> {
        DistributedOptimizer::new(ddps, Rule::Sgd(config))
    }

    fn new<'a>(
        ddps: impl IntoIterator<Item = &'a DistributedDataParallel>,
        rule: Rule,
    ) -> Result<Self> {
        match &rule {
            Rule::AdamW(config) => config.validate()?,
            Rule::Sgd(config) => config.validate()?,
        }
        let ddps: Vec<&DistributedDataParallel> = ddps.into_iter().collect();
        if ddps.is_empty() {
            return Err(Error::Config(
                "the distributed optimizer needs at least one DistributedDataParallel".into(),
            ));
        };
        if ddps.iter().any(|ddp| !ddp.is_sharded()) {
            return Err(Error::Config(
                "the distributed optimizer needs DistributedDataParallel built with \
                 use_distributed_optimizer = true (its buckets must be reduce-scattered)"
                    .into(),
            ));
        }
        let Wrapped {
            reducers,
            params,
            buckets,
            groups,
            param_group,
        } = Wrapped::of(&ddps)?;
        let pieces = buckets
            .iter()
            .map(|bucket| bucket.pieces(&groups[bucket.group].comm))
            .collect();
        // The state is allocated here, not at the first step, so that what a rank holds
        // is fixed from the start.
        let buffers = buckets
            .iter()
            .map(|bucket| {
                (rule.buffer_names().iter())
                    .map(|_| bucket.shard_storage())
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let params_len = params.len();
        let masters = vec![None; buckets.len()];
        let mut optimizer = DistributedOptimizer {
            reducers,
            groups,
            param_group,
            options: vec![ParamOptions::default(); params.len()],
            updates: vec![0; params.len()],
            params,
            buckets,
            rule,
            schedule: None,
            steps: 0,
            pieces,
            buffers,
            masters,
            mastered: vec![false; params_len],
            dropped: None,
            overlap_param_gather: false,
        };
        let stored_16_bit: Vec<bool> = optimizer.params.iter().map(is_16_bit).collect();
        optimizer.read_masters(&stored_16_bit)?;
        Ok(optimizer)
    }

    /// Stores every parameter as `dtype` (bf16 or f16) and keeps f32 master weights of
    /// this rank's shard, taken from the values before rounding: 2 bytes per parameter
    /// for the values and `4/dp` for the masters (Megatron's `--bf16` with the
    /// distributed optimizer). Call it where [`ferrotron_tape::MixedPrecision`] would be built:
    /// once the values are final (after DDP's broadcast and a checkpoint's weights), as
    /// later changes to the parameters do not reach the masters.
    ///
    /// Parameters that are already 16-bit when the optimizer is built get masters of
    /// their (rounded) values without it.
    pub fn store_params_as(mut self, dtype: DType) -> Result<Self> {
        if !matches!(dtype, DType::BF16 | DType::F16) {
            return Err(Error::Config(format!(
                "store_params_as takes bf16 or f16 (parameters trained through f32 master \
                 weights), not {dtype}"
            )));
        }
        self.read_masters(&vec![true; self.params.len()])?;
        for param in &self.params {
            let value = param.value()?;
            if value.dtype() != dtype {
                param.set_value(value.to_dtype(dtype)?)?;
            }
        }
        Ok(self)
    }

    /// Trains the `selected` parameters through master weights: gives their pieces that
    /// have none yet the parameters' current values as f32.
    fn read_masters(&mut self, selected: &[bool]) -> Result<()> {
        for (index, pieces) in self.pieces.iter().enumerate() {
            for piece in pieces {
                if !selected[piece.param] || self.mastered[piece.param] {
                    continue;
                }
                let masters = match &mut self.masters[index] {
                    Some(masters) => masters,
                    empty => empty.insert(self.buckets[index].shard_storage()?),
                };
                self.params[piece.param]
                    .read_flat_into(piece.within_param.start, &piece.view(masters)?)?;
            }
        }
        for (mastered, &selected) in self.mastered.iter_mut().zip(selected) {
            *mastered |= selected;
        }
        Ok(())
    }

    /// Takes each step's learning rate from `schedule` instead of the config's.
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        self.schedule = Some(schedule);
        self
    }

    /// Scales the learning rate and weight decay of each parameter by `options(param)`,
    /// e.g. [`ParamOptions::megatron_groups`].
    pub fn with_param_options(mut self, options: impl Fn(&Parameter) -> ParamOptions) -> Self {
        self.options = self.params.iter().map(options).collect();
        self
    }

    /// Bytes of optimizer state this rank holds: its shard of every buffer of the rule
    /// (AdamW: two moments; SGD: the momentum buffer, if any) and of the master weights.
    pub fn state_bytes(&self) -> usize {
        let buffers: usize = self.buffers.iter().flatten().map(f32_bytes).sum();
        buffers + self.master_bytes()
    }

    /// Bytes of f32 master weights this rank holds (its shard of the buckets that hold
    /// 16-bit parameters).
    pub fn master_bytes(&self) -> usize {
        self.masters.iter().flatten().map(f32_bytes).sum()
    }

    /// The learning rate the next step uses.
    pub fn next_lr(&self) -> f64 {
        self.schedule
            .map_or(self.rule.base_lr(), |s| s.lr(self.steps))
    }

    /// Clips the reduced gradients of the last backward to a global L2 norm of
    /// `max_norm`, as [`ferrotron_layers::clip_grad_norm`] clips the gradients of plain DDP: the
    /// same norm (to rounding), the same scale, applied when [`step`](Self::step) updates
    /// with these gradients (a later backward's gradients are not scaled).
    ///
    /// `model` names the parameters whose gradients count, with their sharding, in the
    /// same order on every rank: this rank's model parameters (`Module::parameters` of
    /// each chunk). Each must be one of the optimizer's. Those that
    /// [count](ferrotron_layers::ShardedParameter::counts_in_model_sums) are summed (a stage's
    /// [`shared_copy`](ferrotron_layers::ShardedParameter::shared_copy) of a weight another stage
    /// holds is left out, a replicated parameter counted on tensor-parallel rank 0 only):
    /// every rank's shard squares over its DDP's group (the data-parallel group; for
    /// experts the expert-data-parallel one, then the expert-parallel one), then the
    /// tensor-parallel group, then each of `other_groups` (the pipeline group):
    /// collective over all of them. Every gradient of the optimizer is scaled.
    ///
    /// When the norm is not finite the gradients are dropped: skip the step on every
    /// rank (they all see the same norm); a [`step`](Self::step) before the next
    /// backward is an error that says so.
    pub fn clip_grad_norm(
        &mut self,
        model: &[ShardedParameter],
        tp: &TensorParallel,
        other_groups: &[&Arc<dyn Communicator>],
        max_norm: f64,
    ) -> Result<GradNorm> {
        let counted = self.counted(model, tp.rank())?;
        let mut per_group = vec![LocalSquares::default(); self.groups.len()];
        for (ddp, reducer) in self.reducers.iter().enumerate() {
            let mut reducer = reducer.lock();
            let reduced = reducer
                .reduced_mut()
                .ok_or_else(|| self.nothing_to_step_with())?;
            let buckets = self
                .buckets
                .iter()
                .enumerate()
                .filter(|(_, b)| b.ddp == ddp);
            let mut views = Vec::new();
            let mut group = 0;
            for ((index, bucket), shard) in buckets.zip(&reduced.shards) {
                group = bucket.group;
                for piece in &self.pieces[index] {
                    if counted[piece.param] && reduced.used[piece.param - bucket.first_param] {
                        views.push(piece.view(shard)?);
                    }
                }
            }
            // The gradients as the step will take them (unscaled, say).
            let scale = f64::from(reduced.scale);
            let local = &mut per_group[group];
            local.sum += FlatView::sum_of_squares(&views)? * scale * scale;
            local.gradients += views.len();
        }
        // Each group's ranks hold shards of its buckets, and experts' expert-parallel
        // ranks other experts: their squares add up over those first (collective over
        // each, in the same order on every rank), then count like the rest.
        let mut local = LocalSquares::default();
        for (group, squares) in self.groups.iter().zip(per_group) {
            let mut totals = [squares.sum, squares.gradients as f64];
            for comm in group.sum_over() {
                comm.all_reduce_slice(&mut totals, ReduceOp::Sum)?;
            }
            local.sum += totals[0];
            local.gradients += totals[1] as usize;
        }
        let groups: Vec<&Arc<dyn Communicator>> = std::iter::once(tp.group())
            .chain(other_groups.iter().copied())
            .collect();
        let norm = ferrotron_layers::reduce_grad_norm(local, &groups, max_norm)?;
        for reducer in &self.reducers {
            let mut reducer = reducer.lock();
            if !norm.is_finite() {
                reducer.take_reduced();
            } else if let Some(reduced) = reducer.reduced_mut() {
                // Kept with these gradients, so that it never applies to another step's.
                reduced.scale *= norm.scale as f32;
            }
        }
        self.dropped = (!norm.is_finite()).then(|| {
            format!(
                "clip_grad_norm found a gradient norm of {} and dropped them; skip the step \
                 when GradNorm::is_finite() is false",
                norm.norm
            )
        });
        Ok(norm)
    }

    /// Divides the reduced gradients of the last backward by `scaler`'s loss scale
    /// (applied when [`step`](Self::step) updates with them), unless some rank then holds
    /// a non-finite one: then every rank drops them and gets `false` (skip the step, then
    /// [`GradScaler::update`](ferrotron_layers::GradScaler::update) with it). Collective over the
    /// DDPs' groups (whose ranks hold different shards; for experts also the
    /// expert-parallel group), the tensor-parallel group and each of `other_groups` (the pipeline group). Once per step, as
    /// [`GradScaler::unscale_grads`](ferrotron_layers::GradScaler::unscale_grads).
    pub fn unscale_grads(
        &mut self,
        scaler: &GradScaler,
        tp: &TensorParallel,
        other_groups: &[&Arc<dyn Communicator>],
    ) -> Result<bool> {
        scaler.begin_unscale()?;
        let inverse = (1.0 / scaler.scale()) as f32;
        let mut finite = true;
        for reducer in &self.reducers {
            let mut reducer = reducer.lock();
            let reduced = reducer
                .reduced_mut()
                .ok_or_else(|| self.nothing_to_step_with())?;
            let shards = (reduced.shards.iter())
                .map(|shard| FlatView::new(shard, 0, &[shard.len()]))
                .collect::<ferrotron_tape::Result<Vec<_>>>()?;
            // Each element as the step will take it (with any factor pending).
            finite &= FlatView::all_finite_scaled(&shards, reduced.scale * inverse)?;
        }
        let groups: Vec<&Arc<dyn Communicator>> = (self.groups.iter())
            .flat_map(Group::sum_over)
            .chain([tp.group()])
            .chain(other_groups.iter().copied())
            .collect();
        let finite = ferrotron_layers::all_finite(finite, &groups)?;
        for reducer in &self.reducers {
            let mut reducer = reducer.lock();
            if !finite {
                reducer.take_reduced();
            } else if let Some(reduced) = reducer.reduced_mut() {
                reduced.scale *= inverse;
            }
        }
        self.dropped = (!finite).then(|| {
            format!(
                "unscale_grads found a non-finite gradient at loss scale {} and dropped them; \
                 skip the step when it returns false",
                scaler.scale()
            )
        });
        Ok(finite)
    }

    /// Which of the optimizer's parameters `model` counts in a norm on this tensor rank.
    fn counted(&self, model: &[ShardedParameter], tp_rank: usize) -> Result<Vec<bool>> {
        let index_of: HashMap<ParamId, usize> = self
            .params
            .iter()
            .enumerate()
            .map(|(index, param)| (param.id(), index))
            .collect();
        let mut counted = vec![false; self.params.len()];
        for sharded in model {
            let index = index_of.get(&sharded.param.id()).ok_or_else(|| {
                Error::Config(format!(
                    "'{}' is not one of the distributed optimizer's parameters: its gradient \
                     is not in the optimizer's shards; pass the parameters of the model the \
                     DDPs wrap",
                    sharded.param.name()
                ))
            })?;
            counted[*index] = sharded.counts_in_model_sums(tp_rank);
        }
        Ok(counted)
    }

    fn nothing_to_step_with(&self) -> Error {
        match &self.dropped {
            Some(reason) => Error::Config(format!(
                "no gradients to step with: {reason}, and run backward again"
            )),
            None => Error::Config(
                "no reduced gradients to step with: run DistributedDataParallel::backward \
                 (or finish) with gradient sync on before each step"
                    .into(),
            ),
        }
    }

    /// The format the bucket's parameters are stored in: their 16-bit format when they
    /// all share one, else f32.
    fn param_dtype(&self, bucket: &Bucket) -> DType {
        let mut dtypes = bucket
            .info
            .params
            .iter()
            .map(|slot| self.params[bucket.first_param + slot.index].dtype());
        let first = dtypes.next().unwrap_or(DType::F32);
        if dtypes.all(|dtype| dtype == first) {
            first
        } else {
            DType::F32
        }
    }

    /// Every DDP's reduced shards of the last backward, as one list over the buckets,
    /// with which parameters some rank had a gradient for and each DDP's clip factor.
    fn take_reduced(&mut self) -> Result<(Vec<FlatStorage>, Vec<bool>, Vec<f32>)> {
        let (mut shards, mut used, mut scales) = (Vec::new(), Vec::new(), Vec::new());
        for reducer in &self.reducers {
            let reduced = reducer
                .lock()
                .take_reduced()
                .ok_or_else(|| self.nothing_to_step_with())?;
            shards.extend(reduced.shards);
            used.extend(reduced.used);
            scales.push(reduced.scale);
        }
        self.dropped = None;
        Ok((shards, used, scales))
    }

    /// Updates this rank's shard of every parameter from the reduced gradients of the
    /// last [`backward`](DistributedDataParallel::backward) (clipped, if
    /// [`clip_grad_norm`](Self::clip_grad_norm) said so), then all-gathers the
    /// parameters. Collective over each DDP's group. Parameters that no rank had a
    /// gradient for are not updated (experts' DDPs give every expert one: a zero
    /// gradient when it got no token).
    ///
    /// Each bucket's all-gather starts as soon as its shard is updated and runs while the
    /// next bucket's shard is updated; its parameters are set once that next gather has
    /// started, so at most two buckets' gathered values are held at a time. With
    /// [`with_overlap_param_gather`](Self::with_overlap_param_gather) the buckets are
    /// updated and gathered in the order the forward reads them (the last bucket first),
    /// and each bucket's parameters are set when one of them is first read: its gather
    /// runs beside the later buckets' updates and the next forward up to that read.
    pub fn step(&mut self) -> Result<()> {
        for param in &self.params {
            // A gather of the last step that failed where it landed is reported here.
            param.settle()?;
        }
        let (shards, used, scales) = self.take_reduced()?;
        let lr = self.next_lr();
        self.steps += 1;
        if self.overlap_param_gather {
            // In the order the forward reads them (the buckets fill in backward's order).
            for (index, shard) in shards.iter().enumerate().rev() {
                let values = self.update_bucket(index, shard, &used, &scales, lr)?;
                let work = self.start_gather(&self.buckets[index], &values)?;
                let landing = self.landing(index, work);
                let pending = PendingValue::new(move || landing().map_err(tape_error));
                for slot in &self.buckets[index].info.params {
                    self.params[self.buckets[index].first_param + slot.index].set_pending(&pending);
                }
            }
            return Ok(());
        }
        let mut in_flight: Option<(usize, Work)> = None;
        for (index, shard) in shards.iter().enumerate() {
            let values = self.update_bucket(index, shard, &used, &scales, lr)?;
            let work = self.start_gather(&self.buckets[index], &values)?;
            if let Some((previous, work)) = in_flight.replace((index, work)) {
                self.landing(previous, work)()?;
            }
        }
        if let Some((last, work)) = in_flight {
            self.landing(last, work)()?;
        }
        Ok(())
    }

    /// Gathers each bucket's parameters in the order the next forward reads them, beside
    /// the step's end and that forward (Megatron's `--overlap-param-gather`): see
    /// [`step`](Self::step). The values are the same bits either way.
    pub fn with_overlap_param_gather(mut self, overlap: bool) -> Self {
        self.overlap_param_gather = overlap;
        self
    }

    /// Updates this rank's shard of bucket `index` from its reduced gradients `shard`
    /// (scaled by its DDP's clip factor); returns the updated values to gather.
    fn update_bucket(
        &mut self,
        index: usize,
        shard: &FlatStorage,
        used: &[bool],
        scales: &[f32],
        lr: f64,
    ) -> Result<FlatStorage> {
        let bucket = &self.buckets[index];
        let scale = scales[bucket.ddp];
        if scale != 1.0 {
            FlatView::new(shard, 0, &[shard.len()])?.scale(scale)?;
        }
        // The values the update starts from: the masters where the bucket has them,
        // the parameters' own for their other pieces.
        let values = match &self.masters[index] {
            Some(masters) => masters.clone(),
            None => bucket.shard_storage()?,
        };
        let buffers = &self.buffers[index];
        for piece in &self.pieces[index] {
            let piece_values = piece.view(&values)?;
            if !self.mastered[piece.param] {
                self.params[piece.param].read_flat_into(piece.within_param.start, &piece_values)?;
            }
            if !used[piece.param] {
                continue;
            }
            self.updates[piece.param] += 1;
            let (updates, options) = (self.updates[piece.param], self.options[piece.param]);
            let grads = piece.view(shard)?;
            match self.rule {
                Rule::AdamW(config) => {
                    let update = AdamWUpdate::new(&AdamWConfig { lr, ..config }, options, updates);
                    let [m, v] = buffers.as_slice() else {
                        unreachable!("AdamW keeps two buffers");
                    };
                    update.apply_views(&piece_values, &grads, &piece.view(m)?, &piece.view(v)?)?;
                }
                Rule::Sgd(config) => {
                    let update = SgdUpdate::new(&SgdConfig { lr, ..config }, options);
                    let momentum = buffers.first().map(|b| piece.view(b)).transpose()?;
                    update.apply_views(&piece_values, &grads, momentum.as_ref(), updates == 1)?;
                }
            }
        }
        Ok(values)
    }

    /// Starts all-gathering the bucket's updated shards (`values` on this rank) into a
    /// fresh tensor on the parameters' device. 16-bit parameters travel in their own
    /// format: half the bytes, and the same values as rounding on arrival.
    fn start_gather(&self, bucket: &Bucket, values: &FlatStorage) -> Result<Work> {
        let dtype = self.param_dtype(bucket);
        let input = match dtype {
            // The shard itself, lent: no copy.
            DType::F32 => values.lease()?,
            _ => FlatView::new(values, 0, &[values.len()])?
                .to_tensor_as(dtype)?
                .into_buffer()?,
        };
        let output =
            Tensor::<f32>::full_as(&[bucket.info.padded_numel], 0.0, dtype, bucket.device)?
                .into_buffer()?;
        let group = &self.groups[bucket.group].comm;
        Ok(group.start(AsyncOp::AllGatherInto { input, output })?)
    }

    /// What waits for bucket `index`'s all-gather `work` and sets its parameters: each
    /// becomes a view of the gathered bucket (no copy). Those no rank had a gradient for
    /// are set too, to the same values (their shard's, not updated), so that no
    /// parameter keeps an older bucket alive: each bucket's memory is freed by the next
    /// step's.
    fn landing(&self, index: usize, work: Work) -> impl FnOnce() -> Result<()> + Send + 'static {
        let bucket = &self.buckets[index];
        let slots: Vec<(Parameter, usize, usize, Vec<usize>)> = (bucket.info.params.iter())
            .map(|slot| {
                let param = self.params[bucket.first_param + slot.index].clone();
                (param, slot.offset, slot.numel, slot.shape.clone())
            })
            .collect();
        move || {
            let gathered = Tensor::<f32>::from_buffer(work.wait()?)?;
            for (param, offset, numel, shape) in slots {
                let value = gathered.narrow(0, offset, numel)?.reshape(&shape)?;
                let stored = param.dtype();
                param.set_value(match value.dtype() == stored {
                    true => value,
                    false => value.to_dtype(stored)?,
                })?;
            }
            Ok(())
        }
    }

    /// The whole optimizer state, as [`ferrotron_tape::AdamW`] or [`ferrotron_tape::Sgd`] over the same
    /// parameters would report it, with each 16-bit parameter's master weights as the
    /// buffer [`MASTER_BUFFER`] (as [`ferrotron_tape::MixedPrecision`] reports them): every rank
    /// all-gathers the shards (collective over each DDP's group), so a checkpoint
    /// written from it loads at any data-parallel size, or into a replicated optimizer.
    pub fn state(&self) -> Result<OptimizerState> {
        // Counted on the ranks that own a piece: the most over each parameter's group.
        let mut updates: Vec<f64> = self.updates.iter().map(|&u| f64::from(u)).collect();
        for (index, group) in self.groups.iter().enumerate() {
            let members: Vec<usize> = (0..updates.len())
                .filter(|&p| self.param_group[p] == index)
                .collect();
            let mut counts: Vec<f64> = members.iter().map(|&p| updates[p]).collect();
            group.comm.all_reduce_slice(&mut counts, ReduceOp::Max)?;
            for (&p, count) in members.iter().zip(counts) {
                updates[p] = count;
            }
        }
        let names = self.rule.buffer_names();
        let mut params = vec![ParamState::default(); self.params.len()];
        for (index, bucket) in self.buckets.iter().enumerate() {
            let group = &self.groups[bucket.group].comm;
            for (name, shard) in names.iter().zip(&self.buffers[index]) {
                let full: Vec<f32> = group.all_gather_vec(&host_values(shard)?)?;
                for slot in &bucket.info.params {
                    let param = bucket.first_param + slot.index;
                    if updates[param] > 0.0 {
                        let buffer = Tensor::from_vec(full[slot.range()].to_vec(), &slot.shape)?;
                        params[param].buffers.push((name.to_string(), buffer));
                    }
                }
            }
            if bucket
                .info
                .params
                .iter()
                .any(|slot| self.mastered[bucket.first_param + slot.index])
            {
                let shard = match &self.masters[index] {
                    Some(masters) => host_values(masters)?,
                    None => vec![0.0f32; bucket.shard_len()],
                };
                let full: Vec<f32> = group.all_gather_vec(&shard)?;
                for slot in &bucket.info.params {
                    let param = bucket.first_param + slot.index;
                    if self.mastered[param] {
                        let master = Tensor::from_vec(full[slot.range()].to_vec(), &slot.shape)?;
                        params[param]
                            .buffers
                            .push((MASTER_BUFFER.to_string(), master));
                    }
                }
            }
        }
        if let Rule::AdamW(_) = self.rule {
            for (param, &updates) in params.iter_mut().zip(&updates) {
                param.steps = updates as u64;
            }
        }
        Ok(OptimizerState {
            steps: self.steps,
            params,
        })
    }

    /// Restores a [`state`](Self::state) (or a replicated optimizer's, of the same
    /// rule, or a [`ferrotron_tape::MixedPrecision`]'s over it): this rank keeps its shard of it.
    /// Saved master weights of 16-bit parameters replace the masters and, rounded, the
    /// parameters. A state for other parameters (count, shapes or buffer names, master
    /// weights of an f32 parameter) is an error and changes nothing.
    pub fn load_state(&mut self, state: &OptimizerState) -> Result<()> {
        let names = self.rule.buffer_names();
        if state.params.len() != self.params.len() {
            return Err(Error::Config(format!(
                "the optimizer state holds {} parameters, this optimizer {}; restore it into \
                 an optimizer over the same parameters",
                state.params.len(),
                self.params.len()
            )));
        }
        let check_shape = |param: &Parameter, buffer: &Tensor| {
            if buffer.shape() == param.shape() {
                return Ok(());
            }
            Err(Error::Config(format!(
                "an optimizer buffer of '{}' has shape {:?}, the parameter {:?}",
                param.name(),
                buffer.shape(),
                param.shape()
            )))
        };
        let (mut full, mut masters) = (Vec::new(), Vec::new());
        for ((param, entry), &mastered) in self.params.iter().zip(&state.params).zip(&self.mastered)
        {
            let (saved_masters, buffers): (Vec<_>, Vec<_>) = entry
                .buffers
                .iter()
                .partition(|(name, _)| name == MASTER_BUFFER);
            let master = match saved_masters.as_slice() {
                [] => None,
                [(_, master)] if mastered => {
                    check_shape(param, master)?;
                    Some(master.to_vec()?)
                }
                [_] => {
                    return Err(Error::Config(format!(
                        "the state holds master weights for '{}', which this optimizer trains \
                         without: call store_params_as before restoring a 16-bit run",
                        param.name()
                    )))
                }
                _ => {
                    return Err(Error::Config(format!(
                        "the state holds {} master weights for '{}'",
                        saved_masters.len(),
                        param.name()
                    )))
                }
            };
            masters.push(master);
            if buffers.is_empty() {
                full.push(None);
                continue;
            }
            let found: Vec<&str> = buffers.iter().map(|(n, _)| n.as_str()).collect();
            if found != names {
                return Err(Error::Config(format!(
                    "'{}' has optimizer buffers {found:?}; this optimizer keeps {names:?}",
                    param.name()
                )));
            }
            let mut values = Vec::with_capacity(names.len());
            for (_, buffer) in buffers {
                check_shape(param, buffer)?;
                values.push(buffer.to_vec()?);
            }
            full.push(Some(values));
        }
        let updates = state
            .params
            .iter()
            .zip(&full)
            .map(|(entry, values)| match self.rule {
                Rule::AdamW(_) => u32::try_from(entry.steps)
                    .map_err(|_| Error::Config(format!("{} steps exceed u32", entry.steps))),
                Rule::Sgd(_) => Ok(u32::from(values.is_some())),
            })
            .collect::<Result<Vec<u32>>>()?;
        for (index, pieces) in self.pieces.iter().enumerate() {
            for piece in pieces {
                for (b, shard) in self.buffers[index].iter().enumerate() {
                    let view = piece.view(shard)?;
                    match &full[piece.param] {
                        Some(values) => upload(&view, &values[b][piece.within_param.clone()])?,
                        None => view.fill(0.0)?,
                    }
                }
                if let (Some(storage), Some(saved)) = (&self.masters[index], &masters[piece.param])
                {
                    upload(&piece.view(storage)?, &saved[piece.within_param.clone()])?;
                }
            }
        }
        for (param, saved) in self.params.iter().zip(masters) {
            if let Some(saved) = saved {
                let value = param.value()?;
                let restored = Tensor::from_vec(saved, value.shape())?
                    .to_device(value.device())?
                    .to_dtype(value.dtype())?;
                param.set_value(restored)?;
            }
        }
        self.updates = updates;
        self.steps = state.steps;
        Ok(())
    }
}

/// Bytes of an f32 flat storage.
fn f32_bytes(storage: &FlatStorage) -> usize {
    storage.len() * std::mem::size_of::<f32>()
}

/// A storage's elements on the host (for a checkpoint).
fn host_values(storage: &FlatStorage) -> Result<Vec<f32>> {
    Ok(FlatView::new(storage, 0, &[storage.len()])?
        .to_tensor()?
        .to_vec()?)
}

/// Overwrites `view` with host `values` (from a checkpoint).
fn upload(view: &FlatView, values: &[f32]) -> Result<()> {
    let values = Tensor::from_vec(values.to_vec(), view.shape())?.to_device(view.device())?;
    Ok(view.copy_from(&values)?)
}

/// The distributed optimizer behind the [`ferrotron_tape::Optimizer`] interface, so that training
/// loops and checkpoints written for a replicated optimizer take it unchanged; errors
/// come back wrapped in [`ferrotron_tape::Error::Custom`].
impl Optimizer for DistributedOptimizer {
    fn step(&mut self) -> ferrotron_tape::Result<()> {
        DistributedOptimizer::step(self)
            .map_err(|e| ferrotron_tape::Error::custom("DistributedOptimizer::step", e))
    }

    fn params(&self) -> &[Parameter] {
        &self.params
    }

    fn lr(&self) -> f64 {
        self.next_lr()
    }

    fn state(&self) -> ferrotron_tape::Result<OptimizerState> {
        DistributedOptimizer::state(self)
            .map_err(|e| ferrotron_tape::Error::custom("DistributedOptimizer::state", e))
    }

    fn load_state(&mut self, state: &OptimizerState) -> ferrotron_tape::Result<()> {
        DistributedOptimizer::load_state(self, state)
            .map_err(|e| ferrotron_tape::Error::custom("DistributedOptimizer::load_state", e))
    }
}

impl std::fmt::Debug for DistributedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("rule", &self.rule)
            .field(
                "group_sizes",
                &self
                    .groups
                    .iter()
                    .map(|g| g.comm.size())
                    .collect::<Vec<_>>(),
            )
            .field("buckets", &self.buckets.len())
            .field("state_bytes", &self.state_bytes())
            .finish()
    }
}

/// A landing's error as the tape's parameters keep it (`PendingValue`): the tape's own
/// as it was, anything else wrapped.
fn tape_error(error: Error) -> ferrotron_tape::Error {
    match error {
        Error::Tape(error) => error,
        other => ferrotron_tape::Error::custom("DistributedOptimizer::step", other),
    }
}
