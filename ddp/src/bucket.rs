//! Bucket layout: which parameters share one all-reduce, and where each gradient sits
//! in its bucket's flat buffer.
//!
//! Parameters are visited in *reverse* registration order, because backward produces
//! the gradients of the last layers first: bucket 0 fills with the parameters whose
//! gradients are ready earliest and can start communicating while backward is still
//! busy with the first layers. A parameter joins the current bucket while the bucket
//! stays within its byte cap; the first bucket has a smaller cap (1 MiB by default) so
//! that communication starts as early as possible, the others a larger one (25 MiB).
//! A single parameter larger than the cap gets a bucket of its own, and so does a
//! parameter that another pipeline stage holds a copy of (a tied embedding, marked for
//! the `"embedding"` group): alone in its bucket it sits at offset 0 in a buffer of its
//! own size on both stages, so every collective adds its elements in the same order
//! there (a ring algorithm's order depends on an element's position in the buffer), and
//! the copies stay bit-identical. The assignment depends only on the parameter sizes,
//! those marks and the caps, so it is identical on every rank of the data-parallel
//! group; ranks of a tensor-parallel group may differ (uneven shards).
//!
//! Caps are measured in bytes of f32 gradient, whatever dtype a comm hook sends, so
//! that switching on compression does not change which collectives run.

use ferrotron_comm_core::{Buffer, DType};
use ferrotron_tape::ParamId;
use half::{bf16, f16};

use crate::error::{Error, Result};

/// Bytes of one gradient element (gradients are f32).
pub(crate) const GRAD_ELEMENT_BYTES: usize = std::mem::size_of::<f32>();

/// Splits parameters (given by element count, in registration order) into buckets of
/// registration indices: reverse order, first bucket capped at `first_cap_bytes`, the
/// rest at `cap_bytes`; each parameter flagged in `alone` in a bucket of its own, where
/// it falls in that order.
pub(crate) fn assign(
    numels: &[usize],
    alone: &[bool],
    first_cap_bytes: usize,
    cap_bytes: usize,
) -> Vec<Vec<usize>> {
    let mut buckets: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_bytes = 0usize;
    for index in (0..numels.len()).rev() {
        if alone.get(index).copied().unwrap_or(false) {
            if !current.is_empty() {
                buckets.push(std::mem::take(&mut current));
                current_bytes = 0;
            }
            buckets.push(vec![index]);
            continue;
        }
        let bytes = numels[index].saturating_mul(GRAD_ELEMENT_BYTES);
        let cap = if buckets.is_empty() {
            first_cap_bytes
        } else {
            cap_bytes
        };
        if !current.is_empty() && current_bytes.saturating_add(bytes) > cap {
            buckets.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(index);
        current_bytes = current_bytes.saturating_add(bytes);
    }
    if !current.is_empty() {
        buckets.push(current);
    }
    buckets
}

/// Where one parameter's gradient lives inside its bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketParam {
    /// Position of the parameter in the list given to DDP (registration order).
    pub index: usize,
    /// The parameter's identity.
    pub id: ParamId,
    /// The parameter's name.
    pub name: String,
    /// Its shape.
    pub shape: Vec<usize>,
    /// First element of its gradient in the bucket's buffer.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
}

impl BucketParam {
    /// The element range of this gradient in its bucket's buffer.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// One bucket: a contiguous segment of the flat gradient buffer that is all-reduced as
/// one collective.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketInfo {
    /// Launch order: bucket `i` always starts its all-reduce before bucket `i + 1`.
    pub index: usize,
    /// Its parameters, in the order their gradients are laid out (reverse registration).
    pub params: Vec<BucketParam>,
    /// First element of this bucket in the flat (per-dtype) gradient index space.
    pub flat_offset: usize,
    /// Number of gradient elements.
    pub numel: usize,
    /// Elements of the bucket's buffer: `numel`, padded with zeros under the distributed
    /// optimizer to a multiple of [`SHARD_ALIGNMENT`] × the data-parallel size, so that
    /// every rank's shard has the same length and starts on a cache line.
    pub padded_numel: usize,
}

/// Elements every shard of a bucket is a multiple of under the distributed optimizer.
pub const SHARD_ALIGNMENT: usize = 64;

impl BucketInfo {
    /// This data-parallel rank's shard of the bucket's buffer, as an element range, when
    /// the bucket is split over `dp` ranks.
    pub fn shard_range(&self, rank: usize, dp: usize) -> std::ops::Range<usize> {
        let shard = self.padded_numel / dp.max(1);
        rank * shard..(rank + 1) * shard
    }

    /// Size of the bucket's gradients in f32 bytes (what the byte caps measure).
    pub fn grad_bytes(&self) -> usize {
        self.numel * GRAD_ELEMENT_BYTES
    }
}

/// Whether buckets can be stored in `dtype`.
pub(crate) fn is_wire_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// Runs `$body` with `$slice` bound to the buffer's elements as a typed mutable slice.
macro_rules! with_wire_slice_mut {
    ($buffer:expr, $slice:ident => $body:expr) => {{
        let dtype = $buffer.dtype();
        let mut view = $buffer.as_buf_mut();
        match dtype {
            DType::F32 => match view.as_host_slice_mut::<f32>() {
                Some($slice) => $body,
                None => Err(not_host(dtype)),
            },
            DType::BF16 => match view.as_host_slice_mut::<bf16>() {
                Some($slice) => $body,
                None => Err(not_host(dtype)),
            },
            DType::F16 => match view.as_host_slice_mut::<f16>() {
                Some($slice) => $body,
                None => Err(not_host(dtype)),
            },
            other => Err(not_wire(other)),
        }
    }};
}

fn not_wire(dtype: DType) -> Error {
    Error::Config(format!(
        "a comm hook's wire dtype must be f32, bf16 or f16, not {dtype}"
    ))
}

fn not_host(dtype: DType) -> Error {
    Error::Config(format!(
        "bucket buffers of {dtype} must live in host memory"
    ))
}

fn out_of_range(range: &std::ops::Range<usize>, len: usize) -> Error {
    Error::Config(format!(
        "gradient range {range:?} lies outside its bucket of {len} elements"
    ))
}

/// Sums `range` of the buffer in place over `comm` (a blocking collective).
pub(crate) fn all_reduce_range(
    comm: &dyn ferrotron_comm_core::Communicator,
    buffer: &mut Buffer,
    range: std::ops::Range<usize>,
    op: ferrotron_comm_core::ReduceOp,
) -> Result<()> {
    fn reduce<T: ferrotron_comm_core::Element>(
        comm: &dyn ferrotron_comm_core::Communicator,
        slice: &mut [T],
        range: std::ops::Range<usize>,
        op: ferrotron_comm_core::ReduceOp,
    ) -> Result<()> {
        let len = slice.len();
        let part = slice
            .get_mut(range.clone())
            .ok_or_else(|| out_of_range(&range, len))?;
        comm.all_reduce(ferrotron_comm_core::BufMut::from(part), op)?;
        Ok(())
    }
    with_wire_slice_mut!(buffer, slice => reduce(comm, slice, range, op))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn reverse_order_small_first_bucket_and_cap() {
        // 6 parameters of 0.5 MiB each (131072 f32).
        let numels = vec![MIB / 8; 6];
        let buckets = assign(&numels, &[false; 6], MIB, 2 * MIB);
        assert_eq!(buckets, vec![vec![5, 4], vec![3, 2, 1, 0]]);
    }

    #[test]
    fn an_oversized_parameter_gets_its_own_bucket() {
        let numels = vec![10, 3 * MIB / 4, 10];
        let buckets = assign(&numels, &[false; 3], MIB, MIB);
        assert_eq!(buckets, vec![vec![2], vec![1], vec![0]]);
    }

    #[test]
    fn a_parameter_flagged_alone_gets_its_own_bucket_in_place() {
        let numels = vec![10; 5];
        let alone = [false, false, true, false, false];
        let buckets = assign(&numels, &alone, MIB, MIB);
        assert_eq!(buckets, vec![vec![4, 3], vec![2], vec![1, 0]]);
        // First or last in the walk: no empty bucket beside it.
        let buckets = assign(&numels, &[true, false, false, false, true], MIB, MIB);
        assert_eq!(buckets, vec![vec![4], vec![3, 2, 1], vec![0]]);
    }
}
