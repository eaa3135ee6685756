//! Differentiable operations, grouped by kind. Each op computes its output, and records on
//! the inputs' tape a backward closure holding only what the gradient needs.

mod attention;
pub mod custom;
mod elementwise;
mod flash;
mod index;
mod loss;
mod matmul;
mod norm;
mod packed;
mod pointwise;
mod reduce;
mod residual;
mod shape;
mod softmax;

pub use attention::{AttentionKernel, AttentionOptions};
pub use elementwise::Gelu;
pub use flash::{
    attention_block, attention_block_backward, fused_attention_dropout_mask, fused_attention_takes,
    tensor_core_attention_takes, AttentionBlock,
};
pub use index::causal_mask;
pub use loss::{CrossEntropyOptions, Reduction, RowTarget};
pub use matmul::{InputGradHook, PendingGrad};

use ndarray::{ArrayD, Axis, IxDyn};

use crate::gpu::ops::PointwiseInput;
use crate::gpu::GpuArray;
use crate::{Element, Error, Result, Tensor};

/// NumPy broadcasting of two shapes, or a shape error naming `op`.
pub(crate) fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let ndim = a.len().max(b.len());
    let mut out = vec![0; ndim];
    for (i, slot) in out.iter_mut().enumerate() {
        let da = if i + a.len() >= ndim {
            a[i + a.len() - ndim]
        } else {
            1
        };
        let db = if i + b.len() >= ndim {
            b[i + b.len() - ndim]
        } else {
            1
        };
        *slot = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(Error::shape(
                    op,
                    &[a, b],
                    format!("dimension {i} of the broadcast shape: {da} vs {db}"),
                ))
            }
        };
    }
    Ok(out)
}

/// Sums a broadcast gradient back down to the shape of the operand that was broadcast.
pub(crate) fn sum_to_shape<T: Element>(grad: ArrayD<T>, shape: &[usize]) -> ArrayD<T> {
    if grad.shape() == shape {
        return grad;
    }
    let mut grad = grad;
    while grad.ndim() > shape.len() {
        grad = grad.sum_axis(Axis(0));
    }
    for (axis, &size) in shape.iter().enumerate() {
        if size == 1 && grad.shape()[axis] != 1 {
            grad = grad.sum_axis(Axis(axis)).insert_axis(Axis(axis));
        }
    }
    grad
}

/// Checks that `dim` indexes a dimension of `shape`.
pub(crate) fn check_dim(op: &'static str, dim: usize, shape: &[usize]) -> Result<()> {
    if dim < shape.len() {
        Ok(())
    } else {
        Err(Error::shape(
            op,
            &[shape],
            format!(
                "dimension {dim} out of range for a {}-d tensor",
                shape.len()
            ),
        ))
    }
}

/// A row-major copy of `array` with the given shape (no copy when already row-major).
pub(crate) fn reshape_owned<T: Element>(
    op: &'static str,
    array: ArrayD<T>,
    shape: &[usize],
) -> Result<ArrayD<T>> {
    let standard = if array.is_standard_layout() {
        array
    } else {
        array.as_standard_layout().into_owned()
    };
    let from = standard.shape().to_vec();
    standard
        .into_shape_with_order(IxDyn(shape))
        .map_err(|e| Error::shape(op, &[&from, shape], e.to_string()))
}

/// The device arrays of `tensors` when they all live on one device (16-bit ones
/// widened), `None` when they are all CPU tensors, and an error when they are mixed.
pub(crate) fn on_device<T: Element, const N: usize>(
    op: &'static str,
    tensors: [&Tensor<T>; N],
) -> Result<Option<[GpuArray<T>; N]>> {
    let Some(arrays) = all_on_device(op, &tensors)? else {
        return Ok(None);
    };
    Ok(arrays.try_into().ok())
}

/// The tensors' device memory as pointwise kernels read it, 16-bit storage as stored (no
/// widened copy), if they are on a device (`None` on the CPU); an error for tensors on
/// different devices.
pub(crate) fn pointwise_inputs<'a, T: Element, const N: usize>(
    op: &'static str,
    tensors: [&'a Tensor<T>; N],
) -> Result<Option<[PointwiseInput<'a>; N]>> {
    if common_device(op, &tensors)?.is_none() {
        return Ok(None);
    }
    let inputs: Option<Vec<PointwiseInput<'a>>> =
        tensors.iter().map(|t| t.pointwise_input()).collect();
    Ok(inputs.and_then(|inputs| inputs.try_into().ok()))
}

/// The device all `tensors` are on (`None` for none); an error if they differ.
pub(crate) fn common_device<T: Element>(
    op: &'static str,
    tensors: &[&Tensor<T>],
) -> Result<Option<crate::Device>> {
    let Some(first) = tensors.first().map(|t| t.device()) else {
        return Ok(None);
    };
    match tensors.iter().find(|t| t.device() != first) {
        Some(other) => Err(Error::DeviceMismatch {
            op,
            first,
            second: other.device(),
        }),
        None => Ok(Some(first)),
    }
}

/// [`on_device`] for any number of tensors (`None` for none).
pub(crate) fn all_on_device<T: Element>(
    op: &'static str,
    tensors: &[&Tensor<T>],
) -> Result<Option<Vec<GpuArray<T>>>> {
    let Some(first) = common_device(op, tensors)? else {
        return Ok(None);
    };
    if first == crate::Device::Cpu {
        return Ok(None);
    }
    tensors
        .iter()
        .map(|&t| t.device_array(op, first))
        .collect::<Result<_>>()
        .map(Some)
}

/// Wraps device gradients as tensors for the tape.
pub(crate) fn device_grads<T: Element>(grads: Vec<Option<GpuArray<T>>>) -> Vec<Option<Tensor<T>>> {
    grads.into_iter().map(|g| g.map(Tensor::from_gpu)).collect()
}

impl<T: Element> Tensor<T> {
    /// This tensor's memory on `expected` as a pointwise kernel reads it (16-bit storage
    /// as stored), for a backward that reads what its op kept.
    pub(crate) fn device_input(
        &self,
        op: &'static str,
        expected: crate::Device,
    ) -> Result<PointwiseInput<'_>> {
        self.pointwise_input()
            .filter(|_| self.device() == expected)
            .ok_or(Error::DeviceMismatch {
                op,
                first: expected,
                second: self.device(),
            })
    }

    /// The device array of a gradient flowing into a device op's backward (16-bit
    /// storage widened).
    pub(crate) fn device_array(
        &self,
        op: &'static str,
        expected: crate::Device,
    ) -> Result<GpuArray<T>> {
        self.gpu(op)?
            .filter(|array| array.device() == expected)
            .ok_or(Error::DeviceMismatch {
                op,
                first: expected,
                second: self.device(),
            })
    }
}
