//! Megatron's packed QKV layout, which both attention kernels read: its extents and the
//! device outputs their products fill.

use crate::gpu::GpuArray;
use crate::precision::Half;
use crate::{DType, Device, Element, Error, Result, Tensor};

/// The op's name in errors, whichever kernel runs.
pub(super) const OP: &str = "packed_attention";

/// The extents of packed attention: sequence, batch, query heads, query heads per
/// key/value group, head width.
#[derive(Clone, Copy, Debug)]
pub(super) struct Heads {
    pub s: usize,
    pub b: usize,
    pub n: usize,
    pub r: usize,
    pub d: usize,
}

impl Heads {
    /// The extents of packed `shape`, or a shape error.
    pub fn of(shape: &[usize]) -> Result<Heads> {
        match *shape {
            [s, b, g, parts, d] if parts >= 3 => Ok(Heads {
                s,
                b,
                n: g * (parts - 2),
                r: parts - 2,
                d,
            }),
            _ => Err(Error::shape(
                OP,
                &[shape],
                "needs packed queries, keys and values [sequence, batch, groups, \
                 queries per group + 2, head_dim]",
            )),
        }
    }

    /// Elements of the queries (and of the output).
    pub fn numel(&self) -> usize {
        self.s * self.b * self.n * self.d
    }
}

/// A device tensor of `shape` stored as `dtype` for a product to fill.
pub(super) fn product_output<T: Element>(
    device: Device,
    shape: &[usize],
    dtype: DType,
) -> Result<Tensor<T>> {
    if dtype == T::DTYPE {
        Ok(Tensor::from_gpu(GpuArray::uninit(OP, device, shape)?))
    } else {
        Ok(Tensor::from_half(Half::uninit_gpu(
            OP, dtype, shape, device,
        )?))
    }
}
