//! Reductions: sum and mean (over everything or one dimension) and max along a dimension.

use ndarray::{ArrayD, Axis, IxDyn, Zip};

use super::{check_dim, pointwise_inputs};
use crate::gpu::ops as device;
use crate::gpu::GpuArray;
use crate::tape::{record, record_tensor};
use crate::{Element, Result, Tensor};

impl<T: Element> Tensor<T> {
    /// Sum of all elements, as a 0-d tensor.
    pub fn sum(&self) -> Result<Tensor<T>> {
        self.reduce_all("sum", T::one())
    }

    /// Mean of all elements, as a 0-d tensor.
    pub fn mean(&self) -> Result<Tensor<T>> {
        let count = T::from_f64(self.numel() as f64);
        self.reduce_all("mean", T::one() / count)
    }

    fn reduce_all(&self, op: &'static str, factor: T) -> Result<Tensor<T>> {
        if pointwise_inputs(op, [self])?.is_some() {
            let flat = self.reshape(&[self.numel()])?;
            return flat.reduce_dim(op, 0, false, factor);
        }
        let input = self.cpu(op)?;
        let total = ArrayD::from_elem(IxDyn(&[]), input.sum() * factor);
        let shape = input.raw_dim();
        record(op, &[self], total.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                let value = grad.iter().next().copied().unwrap_or_else(T::zero) * factor;
                Ok(vec![Some(ArrayD::from_elem(shape, value))])
            })
        })
    }

    /// Sum along `dim`; `keepdim` keeps it as a size-1 dimension.
    pub fn sum_dim(&self, dim: usize, keepdim: bool) -> Result<Tensor<T>> {
        self.reduce_dim("sum_dim", dim, keepdim, T::one())
    }

    /// Mean along `dim`; `keepdim` keeps it as a size-1 dimension.
    pub fn mean_dim(&self, dim: usize, keepdim: bool) -> Result<Tensor<T>> {
        check_dim("mean_dim", dim, self.shape())?;
        let count = T::from_f64(self.shape()[dim] as f64);
        self.reduce_dim("mean_dim", dim, keepdim, T::one() / count)
    }

    fn reduce_dim(
        &self,
        op: &'static str,
        dim: usize,
        keepdim: bool,
        factor: T,
    ) -> Result<Tensor<T>> {
        check_dim(op, dim, self.shape())?;
        if let Some([x]) = pointwise_inputs(op, [self])? {
            // A 16-bit input is read as stored: no widened copy.
            let out = device::sum_dim_stored(self.device(), x, dim, factor.into_f64())?;
            return self.record_reduction(op, dim, keepdim, out, factor.into_f64(), None);
        }
        let input = self.cpu(op)?;
        let mut out = input.sum_axis(Axis(dim));
        if factor != T::one() {
            out.mapv_inplace(|x| x * factor);
        }
        if keepdim {
            out = out.insert_axis(Axis(dim));
        }
        let shape = input.raw_dim();
        record(op, &[self], out.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                let grad = if keepdim {
                    grad
                } else {
                    grad.insert_axis(Axis(dim))
                };
                let mut full = ArrayD::zeros(shape);
                Zip::from(&mut full)
                    .and_broadcast(&grad)
                    .for_each(|x, &g| *x = g * factor);
                Ok(vec![Some(full)])
            })
        })
    }

    /// Maximum along `dim`. The gradient goes to the first maximal element of each lane.
    pub fn max_dim(&self, dim: usize, keepdim: bool) -> Result<Tensor<T>> {
        check_dim("max_dim", dim, self.shape())?;
        if self.shape()[dim] == 0 {
            return Err(crate::Error::shape(
                "max_dim",
                &[self.shape()],
                format!("dimension {dim} is empty"),
            ));
        }
        if let Some([x]) = pointwise_inputs("max_dim", [self])? {
            let (out, argmax) = device::max_dim(self.device(), x, dim)?;
            return self.record_reduction("max_dim", dim, keepdim, out, 1.0, Some(argmax));
        }
        let input = self.cpu("max_dim")?;
        let argmax = Zip::from(input.lanes(Axis(dim))).map_collect(|lane| {
            let mut best = 0;
            for (i, &x) in lane.iter().enumerate() {
                // A NaN compares as greater, so NaN maxima propagate as in PyTorch.
                let greater = x.partial_cmp(&lane[best]).is_none_or(|o| o.is_gt());
                if greater && !lane[best].is_nan() {
                    best = i;
                }
            }
            best
        });
        let mut out = Zip::from(input.lanes(Axis(dim)))
            .and(&argmax)
            .map_collect(|lane, &i| lane[i]);
        if keepdim {
            out = out.insert_axis(Axis(dim));
        }
        let shape = input.raw_dim();
        record("max_dim", &[self], out.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                let grad = if keepdim {
                    grad.index_axis_move(Axis(dim), 0)
                } else {
                    grad
                };
                let mut full = ArrayD::zeros(shape);
                Zip::from(full.lanes_mut(Axis(dim)))
                    .and(&argmax)
                    .and(&grad)
                    .for_each(|mut lane, &i, &g| lane[i] = g);
                Ok(vec![Some(full)])
            })
        })
    }
}

impl<T: Element> Tensor<T> {
    /// Records a device reduction over `dim` of this tensor whose result (without the
    /// dimension) is `out`; the backward spreads the gradient back (times `scale`, or to
    /// `argmax`).
    fn record_reduction(
        &self,
        op: &'static str,
        dim: usize,
        keepdim: bool,
        out: GpuArray<T>,
        scale: f64,
        argmax: Option<GpuArray<i64>>,
    ) -> Result<Tensor<T>> {
        let reduced_shape = out.shape().to_vec();
        let input_shape = self.shape().to_vec();
        let out = if keepdim {
            let mut shape = input_shape.clone();
            shape[dim] = 1;
            out.reshaped(&shape)
        } else {
            out
        };
        let device = self.device();
        record_tensor(op, &[self], Tensor::from_gpu(out), || {
            Box::new(move |grad: Tensor<T>, _: &[bool]| {
                let grad = grad.device_array(op, device)?.reshaped(&reduced_shape);
                let dx =
                    device::reduce_dim_backward(&grad, &input_shape, dim, scale, argmax.as_ref())?;
                Ok(vec![Some(Tensor::from_gpu(dx))])
            })
        })
    }
}
