//! The per-step state machine behind the grad-ready hooks (PyTorch's `Reducer`).
//!
//! One step goes through three phases:
//! 1. **Backward** — each parameter's hook marks it ready (its gradient already is in
//!    its bucket's slot, or a copying bucket takes a copy). When the *next bucket in launch order* has all its parameters
//!    ready, its reduction starts (and so does every following bucket that is already
//!    complete). Launching strictly in bucket order keeps the collectives in the same
//!    order on every rank, even when gradients complete in a different order.
//! 2. **Finish** — parameters that got no gradient are either filled with zeros
//!    (`find_unused_parameters`) or reported; the remaining buckets start; each bucket is
//!    waited for in order and post-processed by the comm hook (a copying bucket is then
//!    written back). Then the extra model-parallel reductions run on the averaged
//!    gradients, one per named group (see
//!    [`NamedGroupReduction`](crate::NamedGroupReduction)).
//! 3. **Reset** — ready flags are cleared for the next step. Any failure also resets, so
//!    one bad step never leaves the next one waiting for a bucket that cannot fire.
//!
//! **Gradients as bucket views** (plain DDP with f32 buckets, PyTorch's
//! `gradient_as_bucket_view`, Megatron's `main_grad`): each bucket is flat storage on its
//! parameters' device, and every parameter's gradient is a view into it, so backward
//! accumulates straight into the bucket and the hook only marks the parameter ready. A
//! bucket's all-reduce runs on a lease of its storage, in place; `finish` waits for it
//! and the averaged gradients are already where the parameters read them: no copy in,
//! no copy out, no host round trip on a device.
//!
//! With a 16-bit comm hook each hook copies its gradient into a host bucket instead.
//! That storage is allocated once and travels into each non-blocking all-reduce and back
//! out of [`Work::wait`]; a bucket whose storage was lost with a failed operation (or
//! consumed by a reduce-scatter) gets a fresh allocation on its next use.
//!
//! **Sharded** (for the distributed optimizer), buckets are reduce-scattered into this
//! rank's shard, flat storage of `1/dp` of the bucket on the parameters' device (a
//! copying hook also drops the parameter's copy of the gradient, and its shard is
//! widened into that storage), and `finish` keeps the shards for the optimizer instead of
//! writing gradients back. On a device, the reduce-scatter runs from one lease to the
//! other: no gradient passes through the host. Marked parameters are *deferred*: their
//! hooks do nothing, and `finish` first sums their whole gradients over their groups,
//! then readies (or copies) them in their last buckets.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use comm_core::{Buffer, Communicator, CommunicatorExt, DType, ReduceOp, Work};
use tape::{Device, FlatStorage, FlatView, Parameter, Tensor};

use crate::bucket::{self, BucketInfo};
use crate::error::{Error, Result};
use crate::hook::{CommHook, ReducedBucket};
use crate::named::GroupReduction;

pub(crate) struct Reducer {
    dp: Arc<dyn Communicator>,
    hook: Arc<dyn CommHook>,
    wire_dtype: DType,
    params: Vec<Parameter>,
    buckets: Arc<Vec<BucketInfo>>,
    /// (bucket index, position within the bucket) of every parameter, by registration
    /// index.
    slot_of: Vec<(usize, usize)>,
    state: Vec<BucketState>,
    ready: Vec<bool>,
    /// The next bucket to launch; all earlier ones are in flight or done.
    next_launch: usize,
    /// `next_launch`, published for [`SyncProgress`](crate::SyncProgress), which must not
    /// lock the reducer: it is read from hooks that may run while the reducer is locked.
    started: Arc<AtomicUsize>,
    pub(crate) sync_enabled: bool,
    overlap: bool,
    find_unused: bool,
    /// Run after every bucket is reduced, in order (sharded: before the deferred buckets
    /// start).
    extra_reductions: Vec<GroupReduction>,
    /// Sharded: which parameters wait for `finish` (by registration index).
    deferred: Option<Vec<bool>>,
    /// Sharded: what the last `finish` produced, until the optimizer takes it.
    reduced: Option<ReducedShards>,
    /// Per bucket, the flat storage its parameters' gradients are views of (f32
    /// buckets); `None`: gradients are copied into host buckets.
    grad_buffers: Option<Vec<FlatStorage>>,
    /// Per bucket, the device its parameters live on (sharded: where its shard goes).
    devices: Vec<Device>,
}

/// The outcome of a sharded step: per bucket, this rank's shard of the averaged
/// gradients, which parameters some rank had a gradient for, and the factor a clip asked
/// the update to multiply them by.
pub(crate) struct ReducedShards {
    pub(crate) shards: Vec<FlatStorage>,
    pub(crate) used: Vec<bool>,
    pub(crate) scale: f32,
}

struct BucketState {
    storage: Option<Buffer>,
    work: Option<Work>,
    pending: usize,
    /// Sharded: this step's shard of the reduced gradients, until `finish` hands it to
    /// the optimizer (made per step, so it lives only from backward to the step).
    shard: Option<FlatStorage>,
}

/// How a [`Reducer`] behaves; the parts of [`DdpConfig`](crate::DdpConfig) it needs.
pub(crate) struct ReducerOptions {
    pub(crate) hook: Arc<dyn CommHook>,
    pub(crate) overlap: bool,
    pub(crate) find_unused: bool,
    pub(crate) extra_reductions: Vec<GroupReduction>,
    /// `Some` to shard: the parameters whose reduction waits for `finish`.
    pub(crate) deferred: Option<Vec<bool>>,
}

impl Reducer {
    pub(crate) fn new(
        dp: Arc<dyn Communicator>,
        params: Vec<Parameter>,
        buckets: Arc<Vec<BucketInfo>>,
        options: ReducerOptions,
    ) -> Result<Reducer> {
        let wire_dtype = options.hook.wire_dtype();
        let devices = buckets
            .iter()
            .map(|info| bucket_device(&params, info))
            .collect::<Result<Vec<_>>>()?;
        let grad_buffers = (wire_dtype == DType::F32)
            .then(|| attach_bucket_views(&params, &buckets, &devices))
            .transpose()?;
        let mut slot_of = vec![(0, 0); params.len()];
        for info in buckets.iter() {
            for (position, param) in info.params.iter().enumerate() {
                slot_of[param.index] = (info.index, position);
            }
        }
        let state = buckets
            .iter()
            .map(|info| BucketState {
                storage: grad_buffers
                    .is_none()
                    .then(|| Buffer::zeros(wire_dtype, info.padded_numel)),
                work: None,
                pending: info.params.len(),
                shard: None,
            })
            .collect();
        Ok(Reducer {
            dp,
            hook: options.hook,
            wire_dtype,
            ready: vec![false; params.len()],
            params,
            buckets,
            slot_of,
            state,
            next_launch: 0,
            started: Arc::new(AtomicUsize::new(0)),
            sync_enabled: true,
            overlap: options.overlap,
            find_unused: options.find_unused,
            extra_reductions: options.extra_reductions,
            deferred: options.deferred,
            reduced: None,
            grad_buffers,
            devices,
        })
    }

    pub(crate) fn is_sharded(&self) -> bool {
        self.deferred.is_some()
    }

    /// The shards of the last sharded `finish`, once.
    pub(crate) fn take_reduced(&mut self) -> Option<ReducedShards> {
        self.reduced.take()
    }

    /// The shards of the last sharded `finish`, left in place (to clip them).
    pub(crate) fn reduced_mut(&mut self) -> Option<&mut ReducedShards> {
        self.reduced.as_mut()
    }

    fn is_deferred(&self, index: usize) -> bool {
        self.deferred
            .as_ref()
            .is_some_and(|deferred| deferred[index])
    }

    /// The count of buckets whose reduction has started in the current step, readable
    /// without the reducer's lock.
    pub(crate) fn started_counter(&self) -> &Arc<AtomicUsize> {
        &self.started
    }

    /// The grad-ready hook of parameter `index`.
    pub(crate) fn on_grad_ready(&mut self, index: usize, param: &Parameter) -> Result<()> {
        if !self.sync_enabled || self.is_deferred(index) {
            return Ok(());
        }
        let outcome = self.accept_gradient(index, param);
        if outcome.is_err() {
            self.reset_step();
        }
        outcome
    }

    fn accept_gradient(&mut self, index: usize, param: &Parameter) -> Result<()> {
        if self.ready.get(index).copied().unwrap_or(false) {
            return Err(Error::FinishNotCalled {
                name: self.params[index].name().to_string(),
            });
        }
        // A bucket view already holds the gradient.
        if self.grad_buffers.is_none() {
            self.copy_in(index, param.try_grad()?)?;
        }
        self.mark_ready(index);
        if self.overlap {
            self.launch_ready_buckets()?;
        }
        Ok(())
    }

    /// Copies a gradient (or zeros) into the parameter's slot of its bucket; sharded, the
    /// bucket becomes the gradient's only copy.
    fn copy_in(&mut self, index: usize, grad: Option<Tensor>) -> Result<()> {
        let (bucket_index, position) = self.slot_of[index];
        let info = &self.buckets[bucket_index];
        let range = info.params[position].range();
        let state = &mut self.state[info.index];
        let storage = state
            .storage
            .get_or_insert_with(|| Buffer::zeros(self.wire_dtype, info.padded_numel));
        match grad {
            Some(grad) => bucket::write_f32(storage, range.start, &grad.to_vec()?)?,
            None => bucket::zero(storage, range)?,
        }
        if self.deferred.is_some() {
            self.params[index].zero_grad();
        }
        Ok(())
    }

    fn mark_ready(&mut self, index: usize) {
        self.ready[index] = true;
        let state = &mut self.state[self.slot_of[index].0];
        state.pending = state.pending.saturating_sub(1);
    }

    /// Starts every complete bucket from `next_launch` on, stopping at the first
    /// incomplete one so that launch order is bucket order on every rank.
    fn launch_ready_buckets(&mut self) -> Result<()> {
        while let Some(state) = self.state.get_mut(self.next_launch) {
            if state.pending > 0 {
                break;
            }
            let numel = self.buckets[self.next_launch].padded_numel;
            let storage = match &self.grad_buffers {
                Some(buffers) => buffers[self.next_launch].lease()?,
                None => state
                    .storage
                    .take()
                    .unwrap_or_else(|| Buffer::zeros(self.wire_dtype, numel)),
            };
            state.work = Some(if self.deferred.is_some() {
                let shard_len = numel / self.dp.size().max(1);
                let shard = FlatStorage::zeros(self.devices[self.next_launch], shard_len)?;
                let output = match &self.grad_buffers {
                    Some(_) => shard.lease()?,
                    None => Buffer::zeros(self.wire_dtype, shard_len),
                };
                state.shard = Some(shard);
                self.hook
                    .start_reduce_scatter(self.dp.as_ref(), storage, output)?
            } else {
                self.hook.start(self.dp.as_ref(), storage)?
            });
            self.next_launch += 1;
            self.started.store(self.next_launch, Ordering::Release);
        }
        Ok(())
    }

    /// Ends the step: every bucket reduced, averaged gradients in the parameters.
    pub(crate) fn finish(&mut self) -> Result<()> {
        if !self.sync_enabled {
            return Ok(());
        }
        let outcome = self.finish_step();
        self.reset_step();
        outcome
    }

    fn finish_step(&mut self) -> Result<()> {
        // A failed step leaves no shards behind for the optimizer.
        self.reduced = None;
        if let Some(deferred) = self.deferred.clone() {
            // Sums over model-parallel groups are linear, so running them on the whole
            // gradients before the data-parallel average gives the same result.
            for reduction in &self.extra_reductions {
                reduction.run(&self.params)?;
            }
            for index in (0..self.params.len()).filter(|&i| deferred[i]) {
                let param = self.params[index].clone();
                if param.has_grad() {
                    if param.main_grad().is_none() {
                        self.copy_in(index, param.try_grad()?)?;
                    }
                    self.mark_ready(index);
                }
            }
        }
        let missing: Vec<usize> = (0..self.params.len()).filter(|&i| !self.ready[i]).collect();
        let mut locally_used = vec![1i32; self.params.len()];
        if !missing.is_empty() {
            if !self.find_unused {
                let mut buckets: Vec<usize> = missing.iter().map(|&i| self.slot_of[i].0).collect();
                buckets.sort_unstable();
                buckets.dedup();
                return Err(Error::UnusedParameters {
                    names: missing
                        .iter()
                        .map(|&i| self.params[i].name().to_string())
                        .collect(),
                    buckets,
                });
            }
            for index in missing {
                // A gradient accumulated under no_sync counts as used, hook or not.
                let param = &self.params[index];
                if !param.has_grad() {
                    locally_used[index] = 0;
                }
                match param.main_grad() {
                    // Zeros for this rank's share; a gradient is already in place.
                    Some(view) if locally_used[index] == 0 => view.fill(0.0)?,
                    Some(_) => {}
                    None => self.copy_in(index, param.try_grad()?)?,
                }
                self.mark_ready(index);
            }
        }
        self.launch_ready_buckets()?;
        if self.find_unused {
            // Issued after every bucket on every rank, so the order stays the same.
            self.dp.all_reduce_slice(&mut locally_used, ReduceOp::Max)?;
        }
        let globally_used = locally_used;
        if self.deferred.is_some() {
            let mut shards = Vec::with_capacity(self.state.len());
            for (index, state) in self.state.iter_mut().enumerate() {
                let work = state.work.take().ok_or_else(|| never_started(index))?;
                let shard = state.shard.take().ok_or_else(|| never_started(index))?;
                let mut reduced = work.wait()?;
                // The shard's own lease ends here. A copying bucket's shard (or what a
                // custom hook reduced elsewhere) is widened in.
                if !shard.is_leased() {
                    let len = reduced.len();
                    let values = bucket::read_f32(&mut reduced, 0..len)?;
                    let view = FlatView::new(&shard, 0, &[shard.len()])?;
                    view.copy_from(&Tensor::from_vec(values, &[len])?.to_device(view.device())?)?;
                }
                drop(reduced);
                shards.push(shard);
            }
            self.reduced = Some(ReducedShards {
                shards,
                used: globally_used.iter().map(|&used| used > 0).collect(),
                scale: 1.0,
            });
            if self.grad_buffers.is_some() {
                // The shards hold the result; the views still hold this rank's own sums.
                for param in &self.params {
                    param.set_main_grad_written(false)?;
                }
            }
            return Ok(());
        }
        for index in 0..self.buckets.len() {
            let work = self.state[index]
                .work
                .take()
                .ok_or_else(|| never_started(index))?;
            let mut buffer = work.wait()?;
            let info = &self.buckets[index];
            self.hook.after_reduce(&mut ReducedBucket {
                index,
                params: &info.params,
                buffer: &mut buffer,
            })?;
            if self.grad_buffers.is_some() {
                // Ends the lease: the averages are in the parameters' views.
                drop(buffer);
                for slot in &info.params {
                    let used = globally_used[slot.index] > 0;
                    self.params[slot.index].set_main_grad_written(used)?;
                }
                continue;
            }
            for slot in &info.params {
                let grad = if globally_used[slot.index] > 0 {
                    let values = bucket::read_f32(&mut buffer, slot.range())?;
                    // Buckets live in host memory; the gradient goes back to its parameter's
                    // device.
                    let device = self.params[slot.index].value().device();
                    Some(Tensor::from_vec(values, &slot.shape)?.to_device(device)?)
                } else {
                    // Unused on every rank: leave no gradient, so optimizers skip it.
                    None
                };
                self.params[slot.index].set_grad(grad)?;
            }
            self.state[index].storage = Some(buffer);
        }
        for reduction in &self.extra_reductions {
            reduction.run(&self.params)?;
        }
        Ok(())
    }

    /// Forgets the current step: ready flags, launch position and any operation still in
    /// flight. A copying bucket's operation completes in the background (the bucket is
    /// re-allocated when needed); a view bucket's is waited for, since its lease keeps
    /// the parameters' gradients from the next backward until then (it finishes, or
    /// fails, on every rank: each rank launched it).
    pub(crate) fn reset_step(&mut self) {
        if self.grad_buffers.is_some() {
            for state in &mut self.state {
                if let Some(work) = state.work.take() {
                    let _ = work.wait();
                }
            }
        }
        self.ready.fill(false);
        self.next_launch = 0;
        self.started.store(0, Ordering::Release);
        for (state, info) in self.state.iter_mut().zip(self.buckets.iter()) {
            state.work = None;
            state.pending = info.params.len();
            state.shard = None;
        }
    }
}

fn never_started(index: usize) -> Error {
    Error::Config(format!("bucket {index} was never started in this step"))
}

/// The device every parameter of a bucket lives on (one, or an error).
pub(crate) fn bucket_device(params: &[Parameter], info: &BucketInfo) -> Result<Device> {
    let devices: Vec<_> = info
        .params
        .iter()
        .map(|slot| params[slot.index].value().device())
        .collect();
    let device = devices.first().copied().unwrap_or_default();
    if let Some(other) = devices.iter().find(|&&d| d != device) {
        return Err(Error::Config(format!(
            "bucket {} holds parameters on {device} and on {other}; put every parameter \
             on one device before wrapping the model in DDP",
            info.index
        )));
    }
    Ok(device)
}

/// Lays each bucket out as flat storage on its parameters' device (`devices`, per bucket)
/// and makes every parameter's gradient a view into it.
fn attach_bucket_views(
    params: &[Parameter],
    buckets: &[BucketInfo],
    devices: &[Device],
) -> Result<Vec<FlatStorage>> {
    buckets
        .iter()
        .zip(devices)
        .map(|(info, &device)| {
            let storage = FlatStorage::zeros(device, info.padded_numel)?;
            for slot in &info.params {
                let view = FlatView::new(&storage, slot.offset, &slot.shape)?;
                params[slot.index].attach_main_grad(view)?;
            }
            Ok(storage)
        })
        .collect()
}
