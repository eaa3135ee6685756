//! [`DistributedOptimizer`]: optimizer state sharded over the data-parallel group
//! (ZeRO-1/2; Megatron-Core's distributed optimizer) on top of DDP's buckets.
//!
//! Each bucket's buffer is split into `dp` equal shards; rank `r` owns shard `r` of every
//! bucket. A parameter may straddle two shards: each owner updates its own piece. DDP
//! reduce-scatters the buckets (so each rank receives only its shard of the averaged
//! gradient) and keeps no gradient in the parameters; the optimizer keeps moments only
//! for its shard, updates its pieces of the parameters with the same per-element update
//! as [`tape::AdamW`] and [`tape::Sgd`], and all-gathers the updated values bucket by
//! bucket into every rank's parameters.

use std::sync::Arc;

use comm_core::{AsyncOp, Buffer, Communicator, CommunicatorExt, ReduceOp};
use parking_lot::Mutex;
use tape::{
    AdamWConfig, AdamWUpdate, LrSchedule, Optimizer, OptimizerState, ParamOptions, ParamState,
    Parameter, SgdConfig, SgdUpdate, Tensor,
};

use crate::bucket::{self, BucketInfo};
use crate::error::{Error, Result};
use crate::reducer::Reducer;
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
    /// The parameter's registration index.
    param: usize,
    /// The piece's elements within the parameter (flattened, row-major).
    within_param: std::ops::Range<usize>,
    /// Where the piece starts in the shard.
    shard_offset: usize,
}

/// An optimizer whose state is split over the data-parallel group: each rank keeps the
/// moments of `1/dp` of every bucket, so AdamW's state costs `8/dp` bytes per parameter
/// per rank instead of 8.
///
/// Build the [`DistributedDataParallel`] with
/// [`use_distributed_optimizer`](crate::DdpConfig::use_distributed_optimizer); after its
/// [`backward`](DistributedDataParallel::backward), [`step`](Self::step) updates this
/// rank's shards and all-gathers the parameters, so every rank ends the step with the
/// parameters plain DDP and a replicated optimizer would have given.
/// ```
/// use comm_core::run_local;
/// use ddp::{DdpConfig, DistributedDataParallel, DistributedOptimizer};
/// use std::sync::Arc;
/// use tape::{AdamWConfig, Parameter, Tape, Tensor};
///
/// let weights = run_local(2, |comm| -> ddp::Result<Vec<f32>> {
///     let w = Parameter::new("w", Tensor::ones(&[3, 2]));
///     let config = DdpConfig { use_distributed_optimizer: true, ..DdpConfig::default() };
///     let ddp = DistributedDataParallel::new(vec![w.clone()], Arc::new(comm), config)?;
///     let mut adamw = DistributedOptimizer::adamw(&ddp, AdamWConfig::default())?;
///     let tape = Tape::new();
///     let loss = tape.watch(&w).sum()?;
///     ddp.backward(&loss)?; // each rank receives its shard of the averaged gradient
///     adamw.step()?; // updates its shard, then all-gathers the parameters
///     // Each rank holds the moments of its 64 elements of the 128-element bucket.
///     assert_eq!(adamw.state_bytes(), 2 * 64 * 4);
///     Ok(w.value().to_vec()?)
/// })?;
/// // AdamW's first step moves every weight by lr against the gradient's sign (and decays).
/// let expected = 1.0 * (1.0 - 1e-3 * 1e-2) - 1e-3;
/// assert!(weights[0].iter().all(|w| (w - expected).abs() < 1e-7));
/// assert_eq!(weights[0], weights[1]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DistributedOptimizer {
    reducer: Arc<Mutex<Reducer>>,
    dp: Arc<dyn Communicator>,
    params: Vec<Parameter>,
    buckets: Vec<BucketInfo>,
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
    buffers: Vec<Vec<Vec<f32>>>,
}

impl DistributedOptimizer {
    /// AdamW over `ddp`'s parameters, as [`tape::AdamW`] with `config`.
    pub fn adamw(ddp: &DistributedDataParallel, config: AdamWConfig) -> Result<Self> {
        DistributedOptimizer::new(ddp, Rule::AdamW(config))
    }

    /// SGD (momentum, weight decay, Nesterov) over `ddp`'s parameters, as [`tape::Sgd`]
    /// with `config`.
    pub fn sgd(ddp: &DistributedDataParallel, config: SgdConfig) -> Result<Self> {
        DistributedOptimizer::new(ddp, Rule::Sgd(config))
    }

    fn new(ddp: &DistributedDataParallel, rule: Rule) -> Result<Self> {
        if !ddp.is_sharded() {
            return Err(Error::Config(
                "the distributed optimizer needs a DistributedDataParallel built with \
                 use_distributed_optimizer = true (its buckets must be reduce-scattered)"
                    .into(),
            ));
        }
        let dp = ddp.communicator().clone();
        let (rank, size) = (dp.rank(), dp.size());
        let buckets = ddp.buckets().to_vec();
        let pieces: Vec<Vec<Piece>> = buckets
            .iter()
            .map(|info| {
                let shard = info.shard_range(rank, size);
                info.params
                    .iter()
                    .filter_map(|slot| {
                        let start = slot.offset.max(shard.start);
                        let end = (slot.offset + slot.numel).min(shard.end);
                        (start < end).then(|| Piece {
                            param: slot.index,
                            within_param: start - slot.offset..end - slot.offset,
                            shard_offset: start - shard.start,
                        })
                    })
                    .collect()
            })
            .collect();
        // The state is allocated here, not at the first step, so that what a rank holds
        // is fixed from the start.
        let buffers = buckets
            .iter()
            .map(|info| {
                let len = info.shard_range(rank, size).len();
                rule.buffer_names().iter().map(|_| vec![0.0; len]).collect()
            })
            .collect();
        let params = ddp.parameters().to_vec();
        Ok(DistributedOptimizer {
            reducer: ddp.reducer().clone(),
            dp,
            options: vec![ParamOptions::default(); params.len()],
            updates: vec![0; params.len()],
            params,
            buckets,
            rule,
            schedule: None,
            steps: 0,
            pieces,
            buffers,
        })
    }

    /// Takes each step's learning rate from `schedule` instead of the config's.
    pub fn with_schedule(mut self, schedule: LrSchedule) -> Self {
        self.schedule = Some(schedule);
        self
    }

    /// Scales the learning rate and weight decay of each parameter by `options(param)`,
    /// e.g. [`ParamOptions::no_decay_for_vectors`].
    pub fn with_param_options(mut self, options: impl Fn(&Parameter) -> ParamOptions) -> Self {
        self.options = self.params.iter().map(options).collect();
        self
    }

    /// Bytes of optimizer state this rank holds: its shard of every buffer of the rule
    /// (AdamW: two moments; SGD: the momentum buffer, if any).
    pub fn state_bytes(&self) -> usize {
        self.buffers
            .iter()
            .flatten()
            .map(|buffer| buffer.capacity() * std::mem::size_of::<f32>())
            .sum()
    }

    /// The learning rate the next step uses.
    pub fn next_lr(&self) -> f64 {
        self.schedule
            .map_or(self.rule.base_lr(), |s| s.lr(self.steps + 1))
    }

    /// Updates this rank's shard of every parameter from the reduced gradients of the
    /// last [`backward`](DistributedDataParallel::backward), then all-gathers the
    /// parameters. Collective over the data-parallel group. Parameters that no rank had
    /// a gradient for are not updated.
    pub fn step(&mut self) -> Result<()> {
        let reduced = self.reducer.lock().take_reduced().ok_or_else(|| {
            Error::Config(
                "no reduced gradients to step with: run DistributedDataParallel::backward \
                 (or finish) with gradient sync on before each step"
                    .into(),
            )
        })?;
        let lr = self.next_lr();
        self.steps += 1;
        let mut gathers = Vec::with_capacity(self.buckets.len());
        for ((index, info), mut shard) in self.buckets.iter().enumerate().zip(reduced.shards) {
            let shard_len = info.padded_numel / self.dp.size().max(1);
            let widened;
            let grads = match shard.as_buf_ref().as_host_slice::<f32>() {
                Some(grads) => grads,
                None => {
                    widened = bucket::read_f32(&mut shard, 0..shard_len)?;
                    &widened
                }
            };
            let mut values = vec![0.0f32; shard_len];
            for piece in &self.pieces[index] {
                let range = piece.shard_offset..piece.shard_offset + piece.within_param.len();
                let param = &self.params[piece.param];
                let piece_values = param
                    .value()
                    .reshape(&[param.numel()])?
                    .narrow(0, piece.within_param.start, piece.within_param.len())?
                    .to_vec()?;
                values[range.clone()].copy_from_slice(&piece_values);
                if !reduced.used[piece.param] {
                    continue;
                }
                let first = self.updates[piece.param] == 0;
                self.updates[piece.param] += 1;
                let options = self.options[piece.param];
                let buffers = &mut self.buffers[index];
                let (values, grads) = (&mut values[range.clone()], &grads[range.clone()]);
                match self.rule {
                    Rule::AdamW(config) => {
                        let update = AdamWUpdate::new(
                            &AdamWConfig { lr, ..config },
                            options,
                            self.updates[piece.param],
                        );
                        let [m, v] = buffers.as_mut_slice() else {
                            unreachable!("AdamW keeps two buffers");
                        };
                        update.apply(values, grads, &mut m[range.clone()], &mut v[range])?;
                    }
                    Rule::Sgd(config) => {
                        let update = SgdUpdate::new(&SgdConfig { lr, ..config }, options);
                        let momentum = match buffers.first_mut() {
                            Some(buffer) => &mut buffer[range],
                            None => &mut [],
                        };
                        update.apply(values, grads, momentum, first)?;
                    }
                }
            }
            gathers.push(self.dp.start(AsyncOp::AllGather {
                input: Buffer::from_vec(values),
            })?);
        }
        for (info, work) in self.buckets.iter().zip(gathers) {
            let gathered = work.wait()?;
            let values = gathered
                .as_buf_ref()
                .as_host_slice::<f32>()
                .ok_or_else(|| Error::Config("an all-gathered bucket is not host f32".into()))?;
            for slot in info.params.iter().filter(|slot| reduced.used[slot.index]) {
                let param = &self.params[slot.index];
                let device = param.value().device();
                let value = Tensor::from_vec(values[slot.range()].to_vec(), &slot.shape)?;
                param.set_value(value.to_device(device)?)?;
            }
            self.reducer.lock().return_storage(info.index, gathered);
        }
        Ok(())
    }

    /// The whole optimizer state, as [`tape::AdamW`] or [`tape::Sgd`] over the same
    /// parameters would report it: every rank all-gathers the shards (collective over the
    /// data-parallel group), so a checkpoint written from it loads at any data-parallel
    /// size, or into a replicated optimizer.
    pub fn state(&self) -> Result<OptimizerState> {
        let mut updates: Vec<f64> = self.updates.iter().map(|&u| f64::from(u)).collect();
        self.dp.all_reduce_slice(&mut updates, ReduceOp::Max)?;
        let names = self.rule.buffer_names();
        let mut params = vec![ParamState::default(); self.params.len()];
        for (info, buffers) in self.buckets.iter().zip(&self.buffers) {
            for (name, shard) in names.iter().zip(buffers) {
                let full: Vec<f32> = self.dp.all_gather_vec(shard)?;
                for slot in info.params.iter().filter(|slot| updates[slot.index] > 0.0) {
                    let buffer = Tensor::from_vec(full[slot.range()].to_vec(), &slot.shape)?;
                    params[slot.index].buffers.push((name.to_string(), buffer));
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
    /// rule): this rank keeps its shard of it. A state for other parameters (count,
    /// shapes or buffer names) is an error and changes nothing.
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
        let mut full = Vec::with_capacity(self.params.len());
        for (param, entry) in self.params.iter().zip(&state.params) {
            if entry.buffers.is_empty() {
                full.push(None);
                continue;
            }
            let found: Vec<&str> = entry.buffers.iter().map(|(n, _)| n.as_str()).collect();
            if found != names {
                return Err(Error::Config(format!(
                    "'{}' has optimizer buffers {found:?}; this optimizer keeps {names:?}",
                    param.name()
                )));
            }
            let mut values = Vec::with_capacity(names.len());
            for (_, buffer) in &entry.buffers {
                if buffer.shape() != param.shape() {
                    return Err(Error::Config(format!(
                        "an optimizer buffer of '{}' has shape {:?}, the parameter {:?}",
                        param.name(),
                        buffer.shape(),
                        param.shape()
                    )));
                }
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
                let range = piece.shard_offset..piece.shard_offset + piece.within_param.len();
                for (b, shard) in self.buffers[index].iter_mut().enumerate() {
                    match &full[piece.param] {
                        Some(values) => shard[range.clone()]
                            .copy_from_slice(&values[b][piece.within_param.clone()]),
                        None => shard[range.clone()].fill(0.0),
                    }
                }
            }
        }
        self.updates = updates;
        self.steps = state.steps;
        Ok(())
    }
}

/// The distributed optimizer behind the [`tape::Optimizer`] interface, so that training
/// loops and checkpoints written for a replicated optimizer take it unchanged; errors
/// come back wrapped in [`tape::Error::Custom`].
impl Optimizer for DistributedOptimizer {
    fn step(&mut self) -> tape::Result<()> {
        DistributedOptimizer::step(self)
            .map_err(|e| tape::Error::custom("DistributedOptimizer::step", e))
    }

    fn params(&self) -> &[Parameter] {
        &self.params
    }

    fn lr(&self) -> f64 {
        self.next_lr()
    }

    fn state(&self) -> tape::Result<OptimizerState> {
        DistributedOptimizer::state(self)
            .map_err(|e| tape::Error::custom("DistributedOptimizer::state", e))
    }

    fn load_state(&mut self, state: &OptimizerState) -> tape::Result<()> {
        DistributedOptimizer::load_state(self, state)
            .map_err(|e| tape::Error::custom("DistributedOptimizer::load_state", e))
    }
}

impl std::fmt::Debug for DistributedOptimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("rule", &self.rule)
            .field("group_size", &self.dp.size())
            .field("buckets", &self.buckets.len())
            .field("state_bytes", &self.state_bytes())
            .finish()
    }
}
