//! Indexing ops: embedding lookup, masked fill, dropout.

use ndarray::{ArrayD, Axis, IxDyn, Zip};

use super::pointwise_inputs;
use super::shape::{moved_on_device, Movement};
use crate::gpu::ops::{PointwiseInput, PointwiseWrite};
use crate::gpu::shape_ops as device;
use crate::gpu::{GpuArray, Stored};
use crate::precision::written;
use crate::random::Generator;
use crate::tape::{record, record_stored, record_tensor};
use crate::{Device, Element, Error, Result, Tensor};

impl<T: Element> Tensor<T> {
    /// Rows of this `[vocab, hidden]` table picked by `ids` (laid out with `ids_shape`);
    /// the result has shape `ids_shape + [hidden]`, in the table's storage format (rows
    /// of a 16-bit table are copied as they are, the table never widened). Backward
    /// scatter-adds into the table.
    pub fn embedding(&self, ids: &[usize], ids_shape: &[usize]) -> Result<Tensor<T>> {
        const OP: &str = "embedding";
        if self.ndim() != 2 {
            return Err(Error::shape(
                OP,
                &[self.shape()],
                "the table must be 2-D [vocab, hidden]",
            ));
        }
        if ids.len() != ids_shape.iter().product::<usize>() {
            return Err(Error::shape(
                OP,
                &[&[ids.len()], ids_shape],
                "ids do not fill ids_shape",
            ));
        }
        let (vocab, hidden) = (self.shape()[0], self.shape()[1]);
        if let Some(&bad) = ids.iter().find(|&&id| id >= vocab) {
            return Err(Error::invalid(
                OP,
                format!("id {bad} out of range for vocabulary {vocab}"),
            ));
        }
        let mut out_shape = ids_shape.to_vec();
        out_shape.push(hidden);
        let on = self.device();
        if on != Device::Cpu {
            let ids = ids
                .iter()
                .map(|&id| i64::try_from(id))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| Error::invalid(OP, format!("ids must fit an i64: {e}")))?;
            let ids = GpuArray::from_host(OP, on, &ids, &[ids.len()])?;
            let lookup = Lookup {
                ids: &ids,
                shape: &out_shape,
            };
            let out = moved_on_device(OP, &[self], &lookup)?
                .ok_or(Error::UnsupportedDevice { op: OP, device: on })?;
            let (device, table_shape) = (on, self.shape().to_vec());
            return record_tensor(OP, &[self], out, || {
                Box::new(move |grad: Tensor<T>, _: &[bool]| {
                    let grad = grad.device_input(OP, device)?;
                    let table_grad = device::embedding_backward(device, grad, &ids, &table_shape)?;
                    Ok(vec![Some(Tensor::from_gpu(table_grad))])
                })
            });
        }
        let out = match self
            .half()
            .and_then(|table| table.cpu_rows(ids, &out_shape))
        {
            Some(rows) => Tensor::from_half(rows),
            None => {
                let rows = self.cpu(OP)?.select(Axis(0), ids);
                Tensor::from_shared(super::reshape_owned(OP, rows, &out_shape)?.into_shared())
            }
        };
        let table_shape = IxDyn(self.shape());
        record_stored(OP, &[self], out, || {
            let ids = ids.to_vec();
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                let hidden = table_shape[1];
                let grad = super::reshape_owned(OP, grad, &[ids.len(), hidden])?;
                let mut table_grad = ArrayD::zeros(table_shape);
                for (&id, row) in ids.iter().zip(grad.outer_iter()) {
                    let mut target = table_grad.index_axis_mut(Axis(0), id);
                    target += &row;
                }
                Ok(vec![Some(table_grad)])
            })
        })
    }

    /// Replaces elements where `mask` is true by `value` (e.g. −∞ above the diagonal for a
    /// causal mask). `mask` must broadcast to this tensor's shape.
    pub fn masked_fill(&self, mask: &ArrayD<bool>, value: T) -> Result<Tensor<T>> {
        const OP: &str = "masked_fill";
        let broadcast = mask.broadcast(IxDyn(self.shape())).ok_or_else(|| {
            Error::shape(
                OP,
                &[self.shape(), mask.shape()],
                "mask does not broadcast to the input",
            )
        })?;
        if let Some([x]) = pointwise_inputs(OP, [self])? {
            // The mask travels in its own shape (a causal mask is [s, s], the scores
            // [b, heads, s, s]) and the kernel broadcasts it.
            let device = self.device();
            let fill: Vec<u8> = mask.iter().map(|&masked| u8::from(masked)).collect();
            let fill = GpuArray::from_host(OP, device, &fill, mask.shape())?;
            let kernel = MaskedFill {
                x,
                mask: &fill,
                value: value.into_f64(),
            };
            let out = written(OP, device, self.shape(), self.dtype(), &kernel)?;
            let format = self.grad_format();
            return record_tensor(OP, &[self], out, || {
                Box::new(move |grad: Tensor<T>, _: &[bool]| {
                    let x = grad.device_input(OP, device)?;
                    let (mask, value) = (&fill, 0.0);
                    let kernel = MaskedFill { x, mask, value };
                    Ok(vec![Some(written(OP, device, x.shape, format, &kernel)?)])
                })
            });
        }
        let input = self.cpu(OP)?;
        let mask = broadcast.to_owned();
        let out = Zip::from(&input)
            .and(&mask)
            .map_collect(|&x, &masked| if masked { value } else { x });
        record(OP, &[self], out.into_shared(), || {
            Box::new(move |mut grad: ArrayD<T>, _: &[bool]| {
                Zip::from(&mut grad).and(&mask).for_each(|g, &masked| {
                    if masked {
                        *g = T::zero();
                    }
                });
                Ok(vec![Some(grad)])
            })
        })
    }

    /// Zeroes each element with probability `p` and scales the rest by `1/(1−p)`, drawing
    /// the mask from `generator`. Call it only in training; `p = 0` returns the input.
    pub fn dropout(&self, p: f64, generator: &mut Generator) -> Result<Tensor<T>> {
        const OP: &str = "dropout";
        let Some(scale) = dropout_scale::<T>(OP, p)? else {
            return Ok(self.clone());
        };
        let keep_scale = T::from_f64(scale);
        if let Some([x]) = pointwise_inputs(OP, [self])? {
            let device = self.device();
            let keep = keep_mask(OP, device, self.shape(), p, generator)?;
            let kernel = Dropout {
                x,
                keep: &keep,
                scale,
            };
            let out = written(OP, device, self.shape(), self.dtype(), &kernel)?;
            let format = self.grad_format();
            return record_tensor(OP, &[self], out, || {
                Box::new(move |grad: Tensor<T>, _: &[bool]| {
                    let x = grad.device_input(OP, device)?;
                    let kernel = Dropout {
                        x,
                        keep: &keep,
                        scale,
                    };
                    Ok(vec![Some(written(OP, device, x.shape, format, &kernel)?)])
                })
            });
        }
        let input = self.cpu(OP)?;
        let mask = ArrayD::from_shape_simple_fn(IxDyn(input.shape()), || {
            if generator.uniform() < p {
                T::zero()
            } else {
                keep_scale
            }
        });
        let out = Zip::from(&input).and(&mask).map_collect(|&x, &m| x * m);
        record(OP, &[self], out.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| Ok(vec![Some(grad * &mask)]))
        })
    }
}

/// The factor dropout with probability `p` scales kept elements by (`1/(1−p)` in `T`,
/// 0 for `p = 1`); `None` for `p = 0`, which drops nothing; an error outside [0, 1].
pub(crate) fn dropout_scale<T: Element>(op: &'static str, p: f64) -> Result<Option<f64>> {
    if !(0.0..=1.0).contains(&p) {
        return Err(Error::invalid(
            op,
            format!("probability {p} is not in [0, 1]"),
        ));
    }
    Ok(match p {
        0.0 => None,
        1.0 => Some(0.0),
        _ => Some(T::from_f64(1.0 / (1.0 - p)).into_f64()),
    })
}

/// Dropout's mask of `shape` on `device`: 1 where an element is kept, drawn from
/// `generator` in the CPU path's (row-major) order, so a seed gives one mask on every
/// device.
pub(crate) fn keep_mask(
    op: &'static str,
    device: crate::Device,
    shape: &[usize],
    p: f64,
    generator: &mut Generator,
) -> Result<GpuArray<u8>> {
    let numel = shape.iter().product::<usize>();
    let keep: Vec<u8> = (0..numel)
        .map(|_| u8::from(generator.uniform() >= p))
        .collect();
    GpuArray::from_host(op, device, &keep, shape)
}

/// `embedding`'s rows of a device table.
struct Lookup<'a> {
    ids: &'a GpuArray<i64>,
    shape: &'a [usize],
}

impl Movement for Lookup<'_> {
    fn apply<E: Stored>(&self, parts: &[&GpuArray<E>]) -> Result<GpuArray<E>> {
        device::embedding(parts[0], self.ids, self.shape)
    }
}

/// `masked_fill` as a pointwise kernel writing any storage format.
struct MaskedFill<'a> {
    x: PointwiseInput<'a>,
    mask: &'a GpuArray<u8>,
    value: f64,
}

impl PointwiseWrite for MaskedFill<'_> {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        device::masked_fill_stored::<T, O>(out, self.x, self.mask, self.value)
    }
}

/// `dropout` as a pointwise kernel writing any storage format.
pub(crate) struct Dropout<'a> {
    pub x: PointwiseInput<'a>,
    pub keep: &'a GpuArray<u8>,
    pub scale: f64,
}

impl PointwiseWrite for Dropout<'_> {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        device::dropout_stored::<T, O>(out, self.x, self.keep, self.scale)
    }
}

/// A `[n, n]` mask that is true above the diagonal: future positions for causal attention.
pub fn causal_mask(n: usize) -> ArrayD<bool> {
    ArrayD::from_shape_fn(IxDyn(&[n, n]), |index| index[1] > index[0])
}
