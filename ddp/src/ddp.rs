//! [`DistributedDataParallel`]: construction (checks, broadcast, bucket layout, hook
//! registration) and the per-step entry points (`finish`, `backward`, `no_sync`).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use ferrotron_comm_core::{Communicator, DType};
use ferrotron_layers::Module;
use ferrotron_parallel_state::ParallelState;
use ferrotron_tape::{Parameter, Tensor};
use parking_lot::Mutex;

use crate::bucket::{self, BucketInfo, BucketParam, GRAD_ELEMENT_BYTES};
use crate::config::DdpConfig;
use crate::error::{Error, Result};
use crate::init;
use crate::reducer::{Reducer, ReducerOptions};

/// Data-parallel training over a model's parameters: gradients are averaged across the
/// data-parallel group in buckets whose all-reduces overlap backward.
///
/// Construction is collective over the data-parallel communicator: it checks that every
/// rank holds the same parameter shapes, broadcasts DP rank 0's values, lays out the
/// buckets and registers a grad-ready hook on every parameter. Each training step is
/// then `backward` followed by [`finish`](Self::finish) (or
/// [`DistributedDataParallel::backward`], which does both), after which every parameter
/// holds the averaged gradient.
///
/// Dropping the value disables its hooks (they stay registered on the parameters but do
/// nothing).
pub struct DistributedDataParallel {
    reducer: Arc<Mutex<Reducer>>,
    /// The reducer's published launch count, so that [`progress`](Self::progress) takes
    /// no lock either.
    buckets_started: Arc<AtomicUsize>,
    params: Vec<Parameter>,
    buckets: Arc<Vec<BucketInfo>>,
    dp: Arc<dyn Communicator>,
    wire_dtype: DType,
    /// For experts' parameters ([`for_experts`](Self::for_experts)), the group whose
    /// ranks hold other experts.
    expert_parallel: Option<Arc<dyn Communicator>>,
}

/// What sets experts' DDP apart: the expert-parallel group, and the factor that turns
/// the average over the expert-data-parallel group into Megatron's expert gradient.
struct Experts {
    ep: Arc<dyn Communicator>,
    grad_scale: f32,
}

impl DistributedDataParallel {
    /// Wraps `params` (in registration order, i.e. the order the model creates and uses
    /// them in forward) for data-parallel training over `dp`. Collective over `dp`.
    ///
    /// Every parameter marked in [`DdpConfig::extra_reductions`] must be among `params`
    /// ([`Error::InvalidMark`] otherwise).
    pub fn new(
        params: Vec<Parameter>,
        dp: Arc<dyn Communicator>,
        config: DdpConfig,
    ) -> Result<DistributedDataParallel> {
        DistributedDataParallel::build(params, dp, config, None)
    }

    fn build(
        params: Vec<Parameter>,
        dp: Arc<dyn Communicator>,
        config: DdpConfig,
        experts: Option<Experts>,
    ) -> Result<DistributedDataParallel> {
        validate(&params, &config)?;
        let extra_reductions = config.extra_reductions.resolve(&params)?;
        init::verify_shapes(dp.as_ref(), &params)?;
        let sharding = config.use_distributed_optimizer.then(|| {
            let mut marked = vec![false; params.len()];
            for reduction in &extra_reductions {
                for &index in reduction.members() {
                    marked[index] = true;
                }
            }
            Sharding {
                dp: dp.size(),
                marked,
            }
        });
        let buckets = Arc::new(layout(&params, &config, sharding.as_ref()));
        if dp.size() > 1 {
            init::broadcast_from_rank0(dp.as_ref(), &params, &buckets)?;
        }
        let wire_dtype = config.comm_hook.wire_dtype();
        let reducer = Reducer::new(
            dp.clone(),
            params.clone(),
            buckets.clone(),
            ReducerOptions {
                hook: config.comm_hook,
                overlap: config.overlap_grad_reduce,
                find_unused: config.find_unused_parameters,
                extra_reductions,
                deferred: sharding.map(|s| s.marked),
                grad_scale: experts.as_ref().map_or(1.0, |e| e.grad_scale),
                unused_as_zero: experts.is_some(),
            },
        )?;
        let buckets_started = reducer.started_counter().clone();
        let reducer = Arc::new(Mutex::new(reducer));
        for (index, param) in params.iter().enumerate() {
            let reducer: Weak<Mutex<Reducer>> = Arc::downgrade(&reducer);
            param.register_grad_hook(move |_| {
                let Some(reducer) = reducer.upgrade() else {
                    return Ok(());
                };
                let outcome = reducer.lock().on_grad_ready(index);
                outcome.map_err(|e| ferrotron_tape::Error::custom("ddp grad-ready hook", e))
            });
        }
        Ok(DistributedDataParallel {
            reducer,
            buckets_started,
            params,
            buckets,
            dp,
            wire_dtype,
            expert_parallel: experts.map(|e| e.ep),
        })
    }

    /// Wraps every parameter of `model` (in [`Module::parameters`] order) for
    /// data-parallel training over `state`'s data-parallel group (times its
    /// context-parallel group when that has more than one rank, as Megatron reduces
    /// dense gradients: [`ParallelState::dp_with_cp`]), with the extra
    /// model-parallel reductions the parameters ask for themselves: each parameter whose
    /// [`grad_reduce_group`](ferrotron_layers::ShardedParameter::grad_reduce_group) names a group
    /// (sequence-parallel layer norms and row-parallel biases: `"tp"`) is marked for it.
    /// Marks already in [`DdpConfig::extra_reductions`] are kept, so a parameter is
    /// summed over every group either source names (each once). Collective over the
    /// data-parallel group.
    pub fn for_model(
        model: &dyn Module,
        state: &ParallelState,
        config: DdpConfig,
    ) -> Result<DistributedDataParallel> {
        let mut config = config;
        let mut params = Vec::new();
        // Experts' parameters differ by expert-parallel rank: `for_experts` takes them.
        for sharded in model.parameters().into_iter().filter(|p| !p.expert) {
            if let Some(group) = sharded.grad_reduce_group {
                config
                    .extra_reductions
                    .mark(state, &sharded.param, &[group])?;
            }
            params.push(sharded.param);
        }
        DistributedDataParallel::new(params, state.dp_with_cp().clone(), config)
    }

    /// Wraps the experts' parameters of `model` (those marked
    /// [`expert`](ferrotron_layers::ShardedParameter::expert)) for data-parallel training
    /// over `state`'s expert-data-parallel group, the ranks holding the same experts;
    /// `None` when the model has no experts. [`for_model`](Self::for_model) leaves them
    /// out. After [`finish`](Self::finish) an expert's gradient is the sum over that
    /// group divided by the data-parallel size (times context parallelism), as Megatron
    /// scales it: each rank's expert gradient already gathers the tokens of its whole
    /// expert-parallel group. An expert that got no token in a step on any rank of the
    /// group gets a zero gradient, so that the optimizer steps it as Megatron's does
    /// (its moments decay). Collective over the expert-data-parallel group.
    ///
    /// With [`DdpConfig::use_distributed_optimizer`] the experts' optimizer state is
    /// sharded over the expert-data-parallel group: pass this DDP to the same
    /// [`DistributedOptimizer`](crate::DistributedOptimizer) as the dense ones.
    pub fn for_experts(
        model: &dyn Module,
        state: &ParallelState,
        config: DdpConfig,
    ) -> Result<Option<DistributedDataParallel>> {
        let params: Vec<Parameter> = (model.parameters().into_iter())
            .filter(|p| p.expert)
            .map(|p| p.param)
            .collect();
        if params.is_empty() {
            return Ok(None);
        }
        let group = state.expert_dp().clone();
        let experts = Experts {
            ep: state.ep().clone(),
            grad_scale: (group.size() as f64 / state.dp_with_cp().size() as f64) as f32,
        };
        // An expert the router sent no token this step has no gradient of its own.
        let config = DdpConfig {
            find_unused_parameters: true,
            ..config
        };
        DistributedDataParallel::build(params, group, config, Some(experts)).map(Some)
    }

    /// The parameters, in registration order.
    pub fn parameters(&self) -> &[Parameter] {
        &self.params
    }

    /// The data-parallel communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.dp
    }

    /// The expert-parallel group, for a DDP over experts
    /// ([`for_experts`](Self::for_experts)): its ranks hold other parameters, so sums
    /// over the model (a gradient norm, an overflow check) also run over it.
    pub fn expert_parallel(&self) -> Option<&Arc<dyn Communicator>> {
        self.expert_parallel.as_ref()
    }

    /// The buckets, in launch order.
    pub fn buckets(&self) -> &[BucketInfo] {
        &self.buckets
    }

    /// Bytes of the parameters' f32 gradients.
    pub fn gradient_bytes(&self) -> usize {
        self.buckets.iter().map(BucketInfo::grad_bytes).sum()
    }

    /// Bytes of the bucket buffers: exactly [`gradient_bytes`](Self::gradient_bytes) (plus
    /// the shard padding under the distributed optimizer), since the buckets are the
    /// gradients' own f32 storage. A 16-bit comm hook's rounded copy of a bucket exists
    /// only while that bucket is in flight.
    pub fn buffer_bytes(&self) -> usize {
        self.buckets.iter().map(|b| b.padded_numel).sum::<usize>() * GRAD_ELEMENT_BYTES
    }

    /// Whether buckets are reduce-scattered for a
    /// [`DistributedOptimizer`](crate::DistributedOptimizer)
    /// ([`DdpConfig::use_distributed_optimizer`]).
    pub fn is_sharded(&self) -> bool {
        self.reducer.lock().is_sharded()
    }

    /// The reducer, for the distributed optimizer that consumes its reduced shards.
    pub(crate) fn reducer(&self) -> &Arc<Mutex<Reducer>> {
        &self.reducer
    }

    /// Waits for every bucket of this step (starting those that have not started yet)
    /// and leaves the averaged gradients in the parameters, then sums the gradients
    /// marked in [`DdpConfig::extra_reductions`] over their groups. A no-op inside
    /// [`no_sync`](Self::no_sync).
    ///
    /// Parameters that got no gradient are zeros in their buckets with
    /// `find_unused_parameters`; parameters unused on *every* rank end with no gradient
    /// (but experts' from [`for_experts`](Self::for_experts), which end with a zero one).
    /// Without that flag they make this an [`Error::UnusedParameters`] naming them. Any
    /// error resets the step, so the next one starts clean.
    pub fn finish(&self) -> Result<()> {
        self.reducer.lock().finish()
    }

    /// `loss.backward()` followed by [`finish`](Self::finish); a hook's error comes back
    /// as this crate's error.
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        match loss.backward() {
            Ok(()) => self.finish(),
            // Backward reached a gradient whose bucket is still being reduced: the last
            // step was never finished.
            Err(ferrotron_tape::Error::Leased {
                parameter: Some(name),
                ..
            }) => {
                self.reducer.lock().reset_step();
                Err(Error::FinishNotCalled { name })
            }
            Err(other) => Err(Error::from_backward(other)),
        }
    }

    /// Turns gradient sync off until the guard drops, for gradient accumulation: run
    /// every micro-batch but the last inside it, and the last one outside. Gradients
    /// accumulate in the parameters; the last backward's hooks see the accumulated
    /// gradient and reduce it once.
    pub fn no_sync(&self) -> NoSync<'_> {
        let mut reducer = self.reducer.lock();
        let previous = reducer.sync_enabled;
        reducer.sync_enabled = false;
        NoSync {
            ddp: self,
            previous,
        }
    }

    /// Turns gradient sync on or off until the next call, for a caller that cannot hold
    /// a [`no_sync`](Self::no_sync) guard across its backward passes: a pipeline schedule
    /// turns it on only for each chunk's last microbatch (Megatron's `no_sync_func`).
    pub fn set_sync_enabled(&self, enabled: bool) {
        self.reducer.lock().sync_enabled = enabled;
    }

    /// Whether backward passes currently synchronise gradients.
    pub fn is_sync_enabled(&self) -> bool {
        self.reducer.lock().sync_enabled
    }

    /// A handle that reports how far the current step's communication has got; it can
    /// be moved into hooks and custom ops.
    pub fn progress(&self) -> SyncProgress {
        SyncProgress {
            started: Arc::downgrade(&self.buckets_started),
            total: self.buckets.len(),
        }
    }
}

impl fmt::Debug for DistributedDataParallel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistributedDataParallel")
            .field("group", &self.dp.name())
            .field("group_size", &self.dp.size())
            .field("params", &self.params.len())
            .field("buckets", &self.buckets.len())
            .field("wire_dtype", &self.wire_dtype)
            .finish()
    }
}

/// Guard returned by [`DistributedDataParallel::no_sync`]; restores the previous mode
/// when dropped.
#[must_use = "sync is re-enabled as soon as the guard is dropped"]
pub struct NoSync<'a> {
    ddp: &'a DistributedDataParallel,
    previous: bool,
}

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        self.ddp.reducer.lock().sync_enabled = self.previous;
    }
}

/// How many buckets of the current step have started their all-reduce
/// (from [`DistributedDataParallel::progress`]).
///
/// It reads a counter the reducer publishes, never the reducer's lock, so it may be
/// called from anywhere, a [`CommHook`](crate::CommHook) running inside a step included.
#[derive(Clone)]
pub struct SyncProgress {
    started: Weak<AtomicUsize>,
    total: usize,
}

impl SyncProgress {
    /// Buckets whose reduction has started in the current step (0 once the
    /// `DistributedDataParallel` is dropped).
    pub fn buckets_started(&self) -> usize {
        self.started
            .upgrade()
            .map_or(0, |started| started.load(Ordering::Acquire))
    }

    /// Number of buckets.
    pub fn buckets_total(&self) -> usize {
        self.total
    }
}

fn validate(params: &[Parameter], config: &DdpConfig) -> Result<()> {
    if config.bucket_cap_bytes == 0 || config.first_bucket_bytes == 0 {
        return Err(Error::Config(format!(
            "bucket caps must be at least 1 byte (bucket_cap_bytes = {}, first_bucket_bytes = {})",
            config.bucket_cap_bytes, config.first_bucket_bytes
        )));
    }
    let wire = config.comm_hook.wire_dtype();
    if !bucket::is_wire_dtype(wire) {
        return Err(Error::Config(format!(
            "comm hook '{}' asks for {wire} buckets; use f32, bf16 or f16",
            config.comm_hook.name()
        )));
    }
    if config.use_distributed_optimizer && !config.comm_hook.supports_sharding() {
        return Err(Error::Config(format!(
            "comm hook '{}' cannot reduce-scatter buckets for the distributed optimizer; \
             use AllReduceAvg or CompressedAllReduce, or set use_distributed_optimizer = false",
            config.comm_hook.name()
        )));
    }
    let mut seen = HashMap::new();
    for (position, param) in params.iter().enumerate() {
        if let Some(first) = seen.insert(param.id(), position) {
            return Err(Error::DuplicateParameter {
                name: param.name().to_string(),
                first,
                second: position,
            });
        }
    }
    Ok(())
}

/// What the distributed optimizer's layout needs to know.
struct Sharding {
    /// Data-parallel size: every bucket is padded to a multiple of it.
    dp: usize,
    /// Parameters with extra model-parallel reductions, by registration index: they go in
    /// buckets of their own at the end, which start only in `finish`.
    marked: Vec<bool>,
}

fn layout(
    params: &[Parameter],
    config: &DdpConfig,
    sharding: Option<&Sharding>,
) -> Vec<BucketInfo> {
    let numels: Vec<usize> = params.iter().map(Parameter::numel).collect();
    // A weight another pipeline stage also holds (a tied embedding) is reduced alone.
    let alone: Vec<bool> = (params.iter())
        .map(|p| {
            (config.extra_reductions.groups_of(p)).contains(&ferrotron_layers::EMBEDDING_GROUP)
        })
        .collect();
    let assign = |members: Vec<usize>| {
        let sizes: Vec<usize> = members.iter().map(|&i| numels[i]).collect();
        let alone: Vec<bool> = members.iter().map(|&i| alone[i]).collect();
        let (first_cap, cap) = (config.first_bucket_bytes, config.bucket_cap_bytes);
        bucket::assign(&sizes, &alone, first_cap, cap)
            .into_iter()
            .map(|bucket| {
                bucket
                    .into_iter()
                    .map(|i| members[i])
                    .collect::<Vec<usize>>()
            })
            .collect::<Vec<_>>()
    };
    let groups = match sharding {
        None => assign((0..params.len()).collect()),
        Some(sharding) => {
            let (marked, unmarked): (Vec<usize>, Vec<usize>) =
                (0..params.len()).partition(|&i| sharding.marked[i]);
            let mut groups = assign(unmarked);
            groups.extend(assign(marked));
            groups
        }
    };
    let multiple = sharding.map_or(1, |s| s.dp * bucket::SHARD_ALIGNMENT);
    let mut flat_offset = 0;
    groups
        .into_iter()
        .enumerate()
        .map(|(index, members)| {
            let mut offset = 0;
            let params = members
                .into_iter()
                .map(|i| {
                    let param = &params[i];
                    let slot = BucketParam {
                        index: i,
                        id: param.id(),
                        name: param.name().to_string(),
                        shape: param.shape(),
                        offset,
                        numel: numels[i],
                    };
                    offset += numels[i];
                    slot
                })
                .collect();
            let padded_numel = offset.div_ceil(multiple) * multiple;
            let info = BucketInfo {
                index,
                params,
                flat_offset,
                numel: offset,
                padded_numel,
            };
            flat_offset += padded_numel;
            info
        })
        .collect()
}
