//! Shape ops: reshape, transpose/permute (strided views, no copy, on the CPU), narrow,
//! concat, split.

use ndarray::{ArrayD, Axis, IxDyn, Slice};

use super::{all_on_device, check_dim, reshape_owned};
use half::{bf16, f16};

use crate::gpu::shape_ops as device;
use crate::gpu::{GpuArray, Stored};
use crate::precision::{written, HalfFloat, Packed};
use crate::tape::{record_as, record_cpu_as, Recorded};
use crate::{DType, Element, Error, Result, Tensor};

impl<T: Element> Tensor<T> {
    /// The same elements (row-major order) with a new shape of equal size: the same
    /// memory in the same storage format, except for a CPU tensor in another memory
    /// order (a transposed view), which is copied.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor<T>> {
        const OP: &str = "reshape";
        if shape.iter().product::<usize>() != self.numel() {
            return Err(Error::shape(
                OP,
                &[self.shape(), shape],
                "element counts differ",
            ));
        }
        let from = self.shape().to_vec();
        if let Some(out) = self.memory_range(0, shape) {
            return record_as(Recorded::View, OP, &[self], out, || {
                Box::new(move |grad: Tensor<T>, _: &[bool]| Ok(vec![Some(grad.reshape(&from)?)]))
            });
        }
        let out = reshape_owned(OP, self.cpu(OP)?.to_owned(), shape)?;
        record_cpu_as(Recorded::View, OP, &[self], out.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                Ok(vec![Some(reshape_owned(OP, grad, &from)?)])
            })
        })
    }

    /// Swaps dimensions `dim0` and `dim1` (a view on the CPU; a copy on a device, whose
    /// arrays are always contiguous).
    pub fn transpose(&self, dim0: usize, dim1: usize) -> Result<Tensor<T>> {
        check_dim("transpose", dim0, self.shape())?;
        check_dim("transpose", dim1, self.shape())?;
        let mut order: Vec<usize> = (0..self.ndim()).collect();
        order.swap(dim0, dim1);
        self.permute_op("transpose", &order)
    }

    /// Reorders dimensions: output dimension `i` is input dimension `order[i]`.
    pub fn permute(&self, order: &[usize]) -> Result<Tensor<T>> {
        self.permute_op("permute", order)
    }

    fn permute_op(&self, op: &'static str, order: &[usize]) -> Result<Tensor<T>> {
        let mut seen = vec![false; self.ndim()];
        let valid = order.len() == self.ndim()
            && order
                .iter()
                .all(|&d| d < seen.len() && !std::mem::replace(&mut seen[d], true));
        if !valid {
            return Err(Error::shape(
                op,
                &[self.shape(), order],
                "the order must be a permutation of the dimensions",
            ));
        }
        let mut inverse = vec![0; order.len()];
        for (i, &d) in order.iter().enumerate() {
            inverse[d] = i;
        }
        if let Some(out) = moved_on_device(op, &[self], &Permute(op, order))? {
            let device = self.device();
            return record_as(Recorded::View, op, &[self], out, || {
                Box::new(move |grad: Tensor<T>, _: &[bool]| {
                    // The gradient's elements moved as stored.
                    let moved = moved_on_device(op, &[&grad], &Permute(op, &inverse))?;
                    Ok(vec![Some(
                        moved.ok_or(Error::UnsupportedDevice { op, device })?,
                    )])
                })
            });
        }
        let out = self.cpu(op)?.clone().permuted_axes(IxDyn(order));
        record_cpu_as(Recorded::View, op, &[self], out, || {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                Ok(vec![Some(grad.permuted_axes(IxDyn(&inverse)))])
            })
        })
    }

    /// Elements `start..start + len` along `dim`: a view of the memory in the same
    /// storage format where they are contiguous (dimensions before `dim` of size 1, as
    /// for a flat buffer's pieces), and on the CPU also otherwise (except 16-bit storage
    /// in another memory order, which is copied); a copy otherwise on a device.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor<T>> {
        const OP: &str = "narrow";
        check_dim(OP, dim, self.shape())?;
        let shape = self.shape().to_vec();
        let size = shape[dim];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::shape(
                OP,
                &[self.shape()],
                format!("range {start}..{start}+{len} exceeds dimension {dim} of size {size}"),
            ));
        }
        let mut out_shape = shape.clone();
        out_shape[dim] = len;
        let contiguous = shape[..dim].iter().all(|&d| d == 1);
        let inner: usize = shape[dim + 1..].iter().product();
        let view = contiguous
            .then(|| self.memory_range(start * inner, &out_shape))
            .flatten();
        let narrowed = Narrow { dim, start, len };
        let out = match view {
            Some(view) => view,
            None => match moved_on_device(OP, &[self], &narrowed)? {
                Some(out) => out,
                None => {
                    let mut out = self.cpu(OP)?;
                    out.slice_axis_inplace(Axis(dim), Slice::from(start..start + len));
                    Tensor::from_shared(out)
                }
            },
        };
        let on = self.device();
        record_as(Recorded::View, OP, &[self], out, || {
            Box::new(move |grad: Tensor<T>, _: &[bool]| {
                let full = match on {
                    crate::Device::Cpu => {
                        let mut full = ArrayD::zeros(IxDyn(&shape));
                        full.slice_axis_mut(Axis(dim), Slice::from(start..start + len))
                            .assign(&grad.cpu(OP)?);
                        Tensor::from_array(full)
                    }
                    _ => {
                        let grad_input = grad.device_input(OP, on)?;
                        let kernel = device::NarrowBackward {
                            grad: grad_input,
                            dim,
                            start,
                        };
                        written(OP, on, &shape, grad.dtype(), &kernel)?
                    }
                };
                Ok(vec![Some(full)])
            })
        })
    }

    /// Joins tensors along `dim`; all other dimensions must agree.
    pub fn concat(tensors: &[&Tensor<T>], dim: usize) -> Result<Tensor<T>> {
        const OP: &str = "concat";
        let shapes: Vec<&[usize]> = tensors.iter().map(|t| t.shape()).collect();
        let Some(first) = shapes.first() else {
            return Err(Error::invalid(OP, "needs at least one tensor"));
        };
        check_dim(OP, dim, first)?;
        let compatible = shapes.iter().all(|s| {
            s.len() == first.len()
                && s.iter()
                    .zip(first.iter())
                    .enumerate()
                    .all(|(d, (a, b))| d == dim || a == b)
        });
        if !compatible {
            return Err(Error::shape(
                OP,
                &shapes,
                format!("all dimensions except {dim} must match"),
            ));
        }
        let sizes: Vec<usize> = shapes.iter().map(|s| s[dim]).collect();
        if let Some(out) = moved_on_device(OP, tensors, &Concat(dim))? {
            let device = out.device();
            return record_as(Recorded::View, OP, tensors, out, || {
                Box::new(move |grad: Tensor<T>, needs: &[bool]| {
                    let mut start = 0;
                    sizes
                        .iter()
                        .zip(needs)
                        .map(|(&size, &need)| {
                            let len = size;
                            let narrowed = Narrow { dim, start, len };
                            // Each part's gradient moved as stored.
                            let part = need
                                .then(|| moved_on_device(OP, &[&grad], &narrowed))
                                .transpose()?
                                .flatten();
                            start += size;
                            match (need, part) {
                                (true, None) => Err(Error::UnsupportedDevice { op: OP, device }),
                                (_, part) => Ok(part),
                            }
                        })
                        .collect()
                })
            });
        }
        let arrays = tensors
            .iter()
            .map(|t| t.cpu(OP))
            .collect::<Result<Vec<_>>>()?;
        let views: Vec<_> = arrays.iter().map(|a| a.view()).collect();
        let out = ndarray::concatenate(Axis(dim), &views)
            .map_err(|e| Error::shape(OP, &shapes, e.to_string()))?;
        record_cpu_as(Recorded::View, OP, tensors, out.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, needs: &[bool]| {
                let mut start = 0;
                Ok(sizes
                    .iter()
                    .zip(needs)
                    .map(|(&size, &need)| {
                        let part = need.then(|| {
                            grad.slice_axis(Axis(dim), Slice::from(start..start + size))
                                .to_owned()
                        });
                        start += size;
                        part
                    })
                    .collect())
            })
        })
    }

    /// Splits along `dim` into pieces of the given sizes, which must add up to the dimension.
    pub fn split(&self, sizes: &[usize], dim: usize) -> Result<Vec<Tensor<T>>> {
        check_dim("split", dim, self.shape())?;
        if sizes.iter().sum::<usize>() != self.shape()[dim] {
            return Err(Error::shape(
                "split",
                &[self.shape(), sizes],
                format!("sizes must add up to dimension {dim}"),
            ));
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&size| {
                let part = self.narrow(dim, start, size);
                start += size;
                part
            })
            .collect()
    }

    /// Splits along `dim` into `parts` equal pieces; the dimension must divide evenly.
    pub fn chunk(&self, parts: usize, dim: usize) -> Result<Vec<Tensor<T>>> {
        check_dim("chunk", dim, self.shape())?;
        let size = self.shape()[dim];
        if parts == 0 || !size.is_multiple_of(parts) {
            return Err(Error::shape(
                "chunk",
                &[self.shape()],
                format!("dimension {dim} of size {size} does not split into {parts} equal parts"),
            ));
        }
        self.split(&vec![size / parts; parts], dim)
    }
}

/// A shape op's data movement on device arrays of any element the kernels move.
pub(super) trait Movement {
    fn apply<E: Stored>(&self, parts: &[&GpuArray<E>]) -> Result<GpuArray<E>>;
}

/// `permute(op, order)`.
struct Permute<'a>(&'static str, &'a [usize]);

impl Movement for Permute<'_> {
    fn apply<E: Stored>(&self, parts: &[&GpuArray<E>]) -> Result<GpuArray<E>> {
        device::permute(self.0, parts[0], self.1)
    }
}

struct Narrow {
    dim: usize,
    start: usize,
    len: usize,
}

impl Movement for Narrow {
    fn apply<E: Stored>(&self, parts: &[&GpuArray<E>]) -> Result<GpuArray<E>> {
        device::narrow("narrow", parts[0], self.dim, self.start, self.len)
    }
}

/// `concat` along a dimension.
struct Concat(usize);

impl Movement for Concat {
    fn apply<E: Stored>(&self, parts: &[&GpuArray<E>]) -> Result<GpuArray<E>> {
        device::concat("concat", parts, self.0)
    }
}

/// `movement` of tensors on one device, in their storage format where they share a 16-bit
/// one (its bits moved, nothing widened); `None` for CPU tensors.
pub(super) fn moved_on_device<T: Element>(
    op: &'static str,
    tensors: &[&Tensor<T>],
    movement: &impl Movement,
) -> Result<Option<Tensor<T>>> {
    if let Some(out) = moved_16_bit(tensors, movement)? {
        return Ok(Some(out));
    }
    all_on_device(op, tensors)?
        .map(|parts| movement.apply(&parts.iter().collect::<Vec<_>>()))
        .transpose()
        .map(|out| out.map(Tensor::from_gpu))
}

/// `movement` of tensors stored in one 16-bit format on one device, in that format; `None`
/// for any other tensors.
fn moved_16_bit<T: Element>(
    tensors: &[&Tensor<T>],
    movement: &impl Movement,
) -> Result<Option<Tensor<T>>> {
    match tensors.first().map(|t| t.dtype()) {
        Some(DType::BF16) => moved_as::<bf16, T>(tensors, movement),
        Some(DType::F16) => moved_as::<f16, T>(tensors, movement),
        _ => Ok(None),
    }
}

fn moved_as<H: HalfFloat, T: Element>(
    tensors: &[&Tensor<T>],
    movement: &impl Movement,
) -> Result<Option<Tensor<T>>> {
    let Some(device) = tensors.first().map(|t| t.device()) else {
        return Ok(None);
    };
    let parts: Option<Vec<&GpuArray<H>>> = tensors
        .iter()
        .map(|t| match t.half().and_then(H::packed) {
            Some(Packed::Gpu(array)) if array.device() == device => Some(array),
            _ => None,
        })
        .collect();
    let Some(parts) = parts else {
        return Ok(None);
    };
    let moved = movement.apply(&parts)?;
    Ok(Some(Tensor::from_half(H::into_half(Packed::Gpu(moved)))))
}
