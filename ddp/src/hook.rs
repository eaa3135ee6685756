//! Comm hooks: how a bucket's gradients are reduced across the data-parallel group.
//!
//! A hook has two halves, mirroring PyTorch's `register_comm_hook` future chain:
//! * [`CommHook::start`] runs inside backward, the moment a bucket is ready: it starts a
//!   non-blocking reduction of the bucket's flat buffer and returns its [`Work`];
//! * [`CommHook::after_reduce`] runs in [`finish`](crate::DistributedDataParallel::finish)
//!   once that reduction has completed, before the parameters read the averages, and
//!   may run further (blocking) collectives on the reduced bucket.
//!
//! [`CommHook::wire_dtype`] fixes the dtype buckets are sent in. Buckets are always the
//! gradients' own f32 storage; an f32 hook gets a lease of it and reduces it in place,
//! while a 16-bit hook gets a rounded copy made on the bucket's device when it launches,
//! whose average `finish` widens back into the bucket (PyTorch's compression hooks cast
//! the same way). On a CUDA device `after_reduce` sees device memory, so a hook that
//! reads the bucket on the host ([`ReducedBucket::all_reduce_range`]) works only with
//! host or emulated parameters.
//!
//! Built-in hooks: [`AllReduceAvg`] (the default) and [`CompressedAllReduce`] (bf16 or
//! fp16). A hook is only the data-parallel reduction; the model-parallel reductions of
//! [`NamedGroupReduction`](crate::NamedGroupReduction) run after all buckets, outside
//! any hook.

use ferrotron_comm_core::{AsyncOp, Buffer, Communicator, DType, ReduceOp, Work};

use crate::bucket::BucketParam;
use crate::error::Result;

/// How a bucket is reduced across the data-parallel group. Implementations must issue
/// the same collectives on every rank for the same bucket.
///
/// Hooks run while the `DistributedDataParallel` that owns them is busy with a step, so
/// they must not call its methods (they would wait for themselves); a
/// [`SyncProgress`](crate::SyncProgress) handle is safe to read.
pub trait CommHook: Send + Sync {
    /// Short name for messages.
    fn name(&self) -> &str;

    /// The dtype buckets are stored and sent in: f32, bf16 or f16.
    fn wire_dtype(&self) -> DType {
        DType::F32
    }

    /// Starts reducing `bucket` (in [`wire_dtype`](Self::wire_dtype)) over `dp`; the
    /// [`Work`] gives back the bucket holding the data-parallel *average*.
    fn start(&self, dp: &dyn Communicator, bucket: Buffer) -> ferrotron_comm_core::Result<Work>;

    /// Whether [`start_reduce_scatter`](Self::start_reduce_scatter) is this hook's
    /// reduction too, so that it can serve a
    /// [`DistributedOptimizer`](crate::DistributedOptimizer); DDP refuses other hooks
    /// under [`DdpConfig::use_distributed_optimizer`](crate::DdpConfig::use_distributed_optimizer).
    fn supports_sharding(&self) -> bool {
        false
    }

    /// Starts the distributed optimizer's reduction of `bucket` (in
    /// [`wire_dtype`](Self::wire_dtype), a length the group size divides) into `shard`
    /// (`1/size` of it, in the same dtype and kind of memory): the [`Work`] gives back
    /// `shard` holding this rank's contiguous `1/size` of the data-parallel *average*.
    fn start_reduce_scatter(
        &self,
        dp: &dyn Communicator,
        bucket: Buffer,
        shard: Buffer,
    ) -> ferrotron_comm_core::Result<Work> {
        dp.start(AsyncOp::ReduceScatterInto {
            input: bucket,
            output: shard,
            op: ReduceOp::Avg,
        })
    }

    /// Post-processes a bucket after its reduction completed and before the parameters
    /// read its averages. Runs on every rank in bucket order.
    fn after_reduce(&self, bucket: &mut ReducedBucket<'_>) -> Result<()> {
        let _ = bucket;
        Ok(())
    }
}

/// A bucket whose data-parallel reduction has completed, as
/// [`CommHook::after_reduce`] sees it.
pub struct ReducedBucket<'a> {
    pub(crate) index: usize,
    pub(crate) params: &'a [BucketParam],
    pub(crate) buffer: &'a mut Buffer,
}

impl ReducedBucket<'_> {
    /// The bucket's index (its launch order).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Where each parameter's gradient lies in [`buffer`](Self::buffer).
    pub fn params(&self) -> &[BucketParam] {
        self.params
    }

    /// The reduced gradients, in the hook's wire dtype.
    pub fn buffer(&mut self) -> &mut Buffer {
        self.buffer
    }

    /// All-reduces the elements `range` of the buffer in place over `comm` (blocking).
    pub fn all_reduce_range(
        &mut self,
        comm: &dyn Communicator,
        range: std::ops::Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        crate::bucket::all_reduce_range(comm, self.buffer, range, op)
    }
}

/// The default hook: a non-blocking f32 all-reduce with [`ReduceOp::Avg`].
#[derive(Clone, Copy, Debug, Default)]
pub struct AllReduceAvg;

impl CommHook for AllReduceAvg {
    fn name(&self) -> &str {
        "allreduce-avg"
    }

    fn supports_sharding(&self) -> bool {
        true
    }

    fn start(&self, dp: &dyn Communicator, bucket: Buffer) -> ferrotron_comm_core::Result<Work> {
        dp.start(AsyncOp::AllReduce {
            buf: bucket,
            op: ReduceOp::Avg,
        })
    }
}

/// Gradient compression, like PyTorch's `bf16_compress_hook` / `fp16_compress_hook`:
/// each bucket is sent as a copy rounded to 16-bit floats, made on its device, the
/// all-reduce averages them (comm-core reduces 16-bit floats in f32 and rounds once), and
/// the result is widened back into the f32 bucket.
///
/// Each gradient element is rounded twice (into the bucket, and the average), so expect
/// a relative error of about 2⁻⁸ (bf16) or 2⁻¹¹ (fp16) per element. fp16 saturates to
/// infinity above 65504; use bf16 for gradients that large.
#[derive(Clone, Copy, Debug)]
pub struct CompressedAllReduce {
    dtype: DType,
}

impl CompressedAllReduce {
    /// bfloat16 compression: f32's range, 8 bits of mantissa.
    pub fn bf16() -> Self {
        CompressedAllReduce { dtype: DType::BF16 }
    }

    /// IEEE half-precision compression: 11 bits of mantissa, range ±65504.
    pub fn fp16() -> Self {
        CompressedAllReduce { dtype: DType::F16 }
    }
}

impl CommHook for CompressedAllReduce {
    fn name(&self) -> &str {
        match self.dtype {
            DType::BF16 => "bf16-compress",
            _ => "fp16-compress",
        }
    }

    fn wire_dtype(&self) -> DType {
        self.dtype
    }

    fn supports_sharding(&self) -> bool {
        true
    }

    fn start(&self, dp: &dyn Communicator, bucket: Buffer) -> ferrotron_comm_core::Result<Work> {
        AllReduceAvg.start(dp, bucket)
    }
}
