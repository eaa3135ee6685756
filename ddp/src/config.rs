//! [`DdpConfig`]: bucket sizes, unused-parameter handling, overlap, the comm hook and the
//! extra model-parallel reductions.

use std::fmt;
use std::sync::Arc;

use crate::hook::{AllReduceAvg, CommHook};
use crate::named::NamedGroupReduction;

/// Cap of every bucket after the first, in bytes of f32 gradient (PyTorch's
/// `bucket_cap_mb = 25`).
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 << 20;

/// Cap of the first bucket, in bytes of f32 gradient (PyTorch's 1 MiB
/// `first_bucket_bytes`): small, so the first all-reduce starts early in backward.
pub const DEFAULT_FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Settings of [`DistributedDataParallel`](crate::DistributedDataParallel); start from
/// `DdpConfig::default()` and override fields.
#[derive(Clone)]
pub struct DdpConfig {
    /// Byte cap of every bucket after the first ([`DEFAULT_BUCKET_CAP_BYTES`]).
    pub bucket_cap_bytes: usize,
    /// Byte cap of the first bucket ([`DEFAULT_FIRST_BUCKET_BYTES`]).
    pub first_bucket_bytes: usize,
    /// Treat parameters that got no gradient in a backward pass as ready with zero
    /// gradients (at `finish`), instead of failing with
    /// [`Error::UnusedParameters`](crate::Error::UnusedParameters). Costs one small extra
    /// all-reduce per step, which tells parameters unused on *every* rank (they keep no
    /// gradient) from those unused on some ranks only (they get the average); experts'
    /// DDPs skip it, since every expert gets a gradient.
    pub find_unused_parameters: bool,
    /// Start each bucket's all-reduce from inside backward as soon as it is complete
    /// (Megatron's `overlap_grad_reduce`). With `false`, every bucket starts in
    /// `finish`, after backward: useful to measure what the overlap saves.
    pub overlap_grad_reduce: bool,
    /// How buckets are reduced over the data-parallel group ([`AllReduceAvg`] by
    /// default).
    pub comm_hook: Arc<dyn CommHook>,
    /// Parameters whose gradients are also summed over named model-parallel groups at the
    /// end of [`finish`](crate::DistributedDataParallel::finish) (none by default).
    /// [`DistributedDataParallel::for_model`](crate::DistributedDataParallel::for_model)
    /// adds the model's own marks to these: a parameter is reduced over the union of the
    /// groups either marks it with.
    pub extra_reductions: NamedGroupReduction,
    /// Reduce-scatter buckets instead of all-reducing them, for a
    /// [`DistributedOptimizer`](crate::DistributedOptimizer) (Megatron's
    /// `use_distributed_optimizer`): after [`finish`](crate::DistributedDataParallel::finish)
    /// each rank holds the averaged gradient of its own shard of every bucket, inside the
    /// DDP, and the parameters hold no gradient. Marked parameters are summed over their
    /// groups on the whole gradient, before the data-parallel reduction, and sit in
    /// buckets of their own at the end so that the others still start during backward.
    pub use_distributed_optimizer: bool,
}

impl Default for DdpConfig {
    fn default() -> Self {
        DdpConfig {
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            first_bucket_bytes: DEFAULT_FIRST_BUCKET_BYTES,
            find_unused_parameters: false,
            overlap_grad_reduce: true,
            comm_hook: Arc::new(AllReduceAvg),
            extra_reductions: NamedGroupReduction::new(),
            use_distributed_optimizer: false,
        }
    }
}

impl fmt::Debug for DdpConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DdpConfig")
            .field("bucket_cap_bytes", &self.bucket_cap_bytes)
            .field("first_bucket_bytes", &self.first_bucket_bytes)
            .field("find_unused_parameters", &self.find_unused_parameters)
            .field("overlap_grad_reduce", &self.overlap_grad_reduce)
            .field("comm_hook", &self.comm_hook.name())
            .field("extra_reductions", &self.extra_reductions)
            .field("use_distributed_optimizer", &self.use_distributed_optimizer)
            .finish()
    }
}
