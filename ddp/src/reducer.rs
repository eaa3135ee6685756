//! The per-step state machine behind the grad-ready hooks (PyTorch's `Reducer`).
//!
//! One step goes through three phases:
//! 1. **Backward** — each parameter's hook marks it ready (its gradient already is in
//!    its bucket's slot). When the *next bucket in launch order* has all its parameters
//!    ready, its reduction starts (and so does every following bucket that is already
//!    complete). Launching strictly in bucket order keeps the collectives in the same
//!    order on every rank, even when gradients complete in a different order.
//! 2. **Finish** — parameters that got no gradient are either filled with zeros
//!    (`find_unused_parameters`) or reported; the remaining buckets start; each bucket is
//!    waited for in order and post-processed by the comm hook. Then the extra model-parallel reductions run on the averaged
//!    gradients, one per named group (see
//!    [`NamedGroupReduction`](crate::NamedGroupReduction)).
//! 3. **Reset** — ready flags are cleared for the next step. Any failure also resets, so
//!    one bad step never leaves the next one waiting for a bucket that cannot fire.
//!
//! **Gradients as bucket views** (PyTorch's `gradient_as_bucket_view`, Megatron's
//! `main_grad`): each bucket is f32 flat storage on its parameters' device, and every
//! parameter's gradient is a view into it, so backward accumulates straight into the
//! bucket and the hook only marks the parameter ready. A bucket's all-reduce runs on a
//! lease of its storage, in place; `finish` waits for it and the averaged gradients are
//! already where the parameters read them: no copy in, no copy out, no host round trip
//! on a device.
//!
//! A 16-bit comm hook (PyTorch's `bf16_compress_hook`) sends a rounded copy instead: at
//! launch the bucket is narrowed into a fresh 16-bit tensor on its device, which the
//! collective runs on, and `finish` widens the average back into the bucket. The copy
//! lives only while its bucket is in flight. A custom hook that hands back a buffer other
//! than the lease it was given has that buffer's contents copied in the same way.
//!
//! **Sharded** (for the distributed optimizer), buckets are reduce-scattered into this
//! rank's shard, flat storage of `1/dp` of the bucket on the parameters' device (16-bit:
//! into a 16-bit copy that `finish` widens into it), and `finish` keeps the shards for
//! the optimizer instead of writing gradients back. On a device, the reduce-scatter runs
//! from one lease to the other: no gradient passes through the host. Marked parameters
//! are *deferred*: their hooks do nothing, and `finish` first sums their whole gradients
//! over their groups, then readies them in their last buckets.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ferrotron_comm_core::{Buffer, Communicator, CommunicatorExt, DType, ReduceOp, Work};
use ferrotron_tape::{Device, FlatStorage, FlatView, Parameter};

use crate::bucket::BucketInfo;
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
    /// What the averaged gradients are multiplied by (1 but for experts').
    grad_scale: f32,
    /// Whether a parameter no rank had a gradient for gets a zero one (experts').
    unused_as_zero: bool,
    /// Per bucket, the f32 flat storage its parameters' gradients are views of.
    grad_buffers: Vec<FlatStorage>,
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
    /// What the averaged gradients are multiplied by: experts' average over their
    /// expert-data-parallel group rescaled to a data-parallel one (1 otherwise).
    pub(crate) grad_scale: f32,
    /// Whether a parameter no rank had a gradient for ends the step with a zero gradient
    /// (as Megatron's experts do, so that the optimizer steps them) rather than none
    /// (PyTorch's `find_unused_parameters`, so that optimizers skip them).
    pub(crate) unused_as_zero: bool,
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
        let grad_buffers = attach_bucket_views(&params, &buckets, &devices)?;
        let mut slot_of = vec![(0, 0); params.len()];
        for info in buckets.iter() {
            for (position, param) in info.params.iter().enumerate() {
                slot_of[param.index] = (info.index, position);
            }
        }
        let state = buckets
            .iter()
            .map(|info| BucketState {
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
            grad_scale: options.grad_scale,
            unused_as_zero: options.unused_as_zero,
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
    pub(crate) fn on_grad_ready(&mut self, index: usize) -> Result<()> {
        if !self.sync_enabled || self.is_deferred(index) {
            return Ok(());
        }
        let outcome = self.accept_gradient(index);
        if outcome.is_err() {
            self.reset_step();
        }
        outcome
    }

    fn accept_gradient(&mut self, index: usize) -> Result<()> {
        if self.ready.get(index).copied().unwrap_or(false) {
            return Err(Error::FinishNotCalled {
                name: self.params[index].name().to_string(),
            });
        }
        // The bucket view already holds the gradient.
        self.mark_ready(index);
        if self.overlap {
            self.launch_ready_buckets()?;
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
            let bucket = &self.grad_buffers[self.next_launch];
            let input = wire_buffer(bucket, self.wire_dtype)?;
            state.work = Some(if self.deferred.is_some() {
                let shard_len = bucket.len() / self.dp.size().max(1);
                let shard = FlatStorage::zeros(self.devices[self.next_launch], shard_len)?;
                let output = wire_buffer(&shard, self.wire_dtype)?;
                state.shard = Some(shard);
                self.hook
                    .start_reduce_scatter(self.dp.as_ref(), input, output)?
            } else {
                self.hook.start(self.dp.as_ref(), input)?
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
                if self.params[index].has_grad() {
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
                    // Zeros for this rank's share (a gradient is already in place).
                    if let Some(view) = param.main_grad() {
                        view.fill(0.0)?;
                    }
                }
                self.mark_ready(index);
            }
        }
        self.launch_ready_buckets()?;
        let globally_used = match self.unused_as_zero {
            true => vec![1; locally_used.len()],
            false => {
                if self.find_unused {
                    // Issued after every bucket on every rank, so the order stays the same.
                    self.dp.all_reduce_slice(&mut locally_used, ReduceOp::Max)?;
                }
                locally_used
            }
        };
        if self.deferred.is_some() {
            let mut shards = Vec::with_capacity(self.state.len());
            for (index, state) in self.state.iter_mut().enumerate() {
                let work = state.work.take().ok_or_else(|| never_started(index))?;
                let shard = state.shard.take().ok_or_else(|| never_started(index))?;
                shard.receive(work.wait()?)?;
                shards.push(shard);
            }
            self.reduced = Some(ReducedShards {
                shards,
                used: globally_used.iter().map(|&used| used > 0).collect(),
                // Applied by the optimizer's update with any clip factor: no extra pass.
                scale: self.grad_scale,
            });
            // The shards hold the result; the views still hold this rank's own sums.
            for param in &self.params {
                param.set_main_grad_written(false)?;
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
            // The averages are now in the parameters' views (unused on every rank: no
            // gradient, so optimizers skip it).
            self.grad_buffers[index].receive(buffer)?;
            if self.grad_scale != 1.0 {
                let storage = &self.grad_buffers[index];
                FlatView::new(storage, 0, &[storage.len()])?.scale(self.grad_scale)?;
            }
            for slot in &info.params {
                let used = globally_used[slot.index] > 0;
                self.params[slot.index].set_main_grad_written(used)?;
            }
        }
        for reduction in &self.extra_reductions {
            reduction.run(&self.params)?;
        }
        Ok(())
    }

    /// Forgets the current step: ready flags, launch position and any operation still in
    /// flight, which is waited for, since a lease keeps the parameters' gradients from
    /// the next backward until then (it finishes, or fails, on every rank: each rank
    /// launched it).
    pub(crate) fn reset_step(&mut self) {
        for state in &mut self.state {
            if let Some(work) = state.work.take() {
                let _ = work.wait();
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

/// What a collective runs on for `storage` in `wire` dtype: a lease of the storage itself
/// (f32), or a rounded 16-bit copy on its device.
fn wire_buffer(storage: &FlatStorage, wire: DType) -> Result<Buffer> {
    if wire == DType::F32 {
        return Ok(storage.lease()?);
    }
    let whole = FlatView::new(storage, 0, &[storage.len()])?;
    Ok(whole.to_tensor_as(wire)?.into_buffer()?)
}

fn never_started(index: usize) -> Error {
    Error::Config(format!("bucket {index} was never started in this step"))
}

/// The device every parameter of a bucket lives on (one, or an error).
pub(crate) fn bucket_device(params: &[Parameter], info: &BucketInfo) -> Result<Device> {
    let devices: Vec<_> = info
        .params
        .iter()
        .map(|slot| params[slot.index].device())
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
