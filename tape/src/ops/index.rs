//! Indexing ops: embedding lookup, masked fill, dropout.

use ndarray::{ArrayD, Axis, IxDyn, Zip};

use super::on_device;
use crate::gpu::shape_ops as device;
use crate::gpu::GpuArray;
use crate::random::Generator;
use crate::tape::{record, record_tensor};
use crate::{Element, Error, Result, Tensor};

impl<T: Element> Tensor<T> {
    /// Rows of this `[vocab, hidden]` table picked by `ids` (laid out with `ids_shape`);
    /// the result has shape `ids_shape + [hidden]`. Backward scatter-adds into the table.
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
        if let Some([table]) = on_device(OP, [self])? {
            let ids = ids
                .iter()
                .map(|&id| i64::try_from(id))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| Error::invalid(OP, format!("ids must fit an i64: {e}")))?;
            let ids = GpuArray::from_host(OP, table.device(), &ids, &[ids.len()])?;
            let out = device::embedding(&table, &ids, &out_shape)?;
            let (device, table_shape) = (table.device(), table.shape().to_vec());
            return record_tensor(OP, &[self], Tensor::from_gpu(out), || {
                Box::new(move |grad: Tensor<T>, _: &[bool]| {
                    let grad = grad.device_array(OP, device)?;
                    let table_grad = device::embedding_backward(&grad, &ids, &table_shape)?;
                    Ok(vec![Some(Tensor::from_gpu(table_grad))])
                })
            });
        }
        let table = self.cpu(OP)?;
        let rows = table.select(Axis(0), ids);
        let out = super::reshape_owned(OP, rows, &out_shape)?;
        record(OP, &[self], out.into_shared(), || {
            let ids = ids.to_vec();
            let table_shape = table.raw_dim();
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
        if let Some([x]) = on_device(OP, [self])? {
            // The mask travels in its own shape (a causal mask is [s, s], the scores
            // [b, heads, s, s]) and the kernel broadcasts it.
            let fill: Vec<u8> = mask.iter().map(|&masked| u8::from(masked)).collect();
            let fill = GpuArray::from_host(OP, x.device(), &fill, mask.shape())?;
            let out = device::masked_fill(&x, &fill, value.into_f64())?;
            let device = x.device();
            return record_tensor(OP, &[self], Tensor::from_gpu(out), || {
                Box::new(move |grad: Tensor<T>, _: &[bool]| {
                    let grad = grad.device_array(OP, device)?;
                    let grad = device::masked_fill(&grad, &fill, 0.0)?;
                    Ok(vec![Some(Tensor::from_gpu(grad))])
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
        if !(0.0..=1.0).contains(&p) {
            return Err(Error::invalid(
                OP,
                format!("probability {p} is not in [0, 1]"),
            ));
        }
        if p == 0.0 {
            return Ok(self.clone());
        }
        let keep_scale = if p < 1.0 {
            T::from_f64(1.0 / (1.0 - p))
        } else {
            T::zero()
        };
        if let Some([x]) = on_device(OP, [self])? {
            // The CPU path's draws in the same (row-major) order: a seed gives one mask on
            // every device.
            let keep: Vec<u8> = (0..x.len())
                .map(|_| u8::from(generator.uniform() >= p))
                .collect();
            let keep = GpuArray::from_host(OP, x.device(), &keep, x.shape())?;
            let scale = keep_scale.into_f64();
            let out = device::dropout(&x, &keep, scale)?;
            let device = x.device();
            return record_tensor(OP, &[self], Tensor::from_gpu(out), || {
                Box::new(move |grad: Tensor<T>, _: &[bool]| {
                    let grad = grad.device_array(OP, device)?;
                    Ok(vec![Some(Tensor::from_gpu(device::dropout(
                        &grad, &keep, scale,
                    )?))])
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

/// A `[n, n]` mask that is true above the diagonal: future positions for causal attention.
pub fn causal_mask(n: usize) -> ArrayD<bool> {
    ArrayD::from_shape_fn(IxDyn(&[n, n]), |index| index[1] > index[0])
}
