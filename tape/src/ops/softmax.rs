//! Softmax and log-softmax along the last dimension, computed stably (max subtracted).

use ndarray::{ArrayD, Axis, Zip};

use super::on_device;
use crate::gpu::row_ops::{self as device, SoftmaxKind};
use crate::tape::{record, record_tensor};
use crate::{Element, Error, Result, Tensor};

fn last_axis<T: Element>(op: &'static str, tensor: &Tensor<T>) -> Result<Axis> {
    match tensor.ndim() {
        0 => Err(Error::shape(
            op,
            &[tensor.shape()],
            "needs at least one dimension",
        )),
        n => Ok(Axis(n - 1)),
    }
}

impl<T: Element> Tensor<T> {
    /// `op` of kind `kind` on a device, recorded with its backward; `None` for CPU tensors.
    fn softmax_on_device(&self, op: &'static str, kind: SoftmaxKind) -> Result<Option<Tensor<T>>> {
        let Some([x]) = on_device(op, [self])? else {
            return Ok(None);
        };
        let y = device::softmax(x, kind)?;
        record_tensor(op, &[self], Tensor::from_gpu(y.clone()), || {
            Box::new(move |grad: Tensor<T>, _: &[bool]| {
                let grad = grad.device_array(op, y.device())?;
                let dx = device::softmax_backward(grad, &y, kind)?;
                Ok(vec![Some(Tensor::from_gpu(dx))])
            })
        })
        .map(Some)
    }

    /// Softmax along the last dimension.
    pub fn softmax(&self) -> Result<Tensor<T>> {
        let axis = last_axis("softmax", self)?;
        if let Some(out) = self.softmax_on_device("softmax", SoftmaxKind::Softmax)? {
            return Ok(out);
        }
        let mut out = self.cpu("softmax")?.as_standard_layout().into_owned();
        for mut lane in out.lanes_mut(axis) {
            let max = lane.fold(T::neg_infinity(), |m, &x| m.max(x));
            lane.mapv_inplace(|x| (x - max).exp());
            let total = lane.sum();
            lane.mapv_inplace(|x| x / total);
        }
        let out = out.into_shared();
        record("softmax", &[self], out.clone(), || {
            Box::new(move |mut grad: ArrayD<T>, _: &[bool]| {
                // dx = y ⊙ (g − Σ g⊙y) per row.
                Zip::from(grad.lanes_mut(axis))
                    .and(out.lanes(axis))
                    .for_each(|mut g, y| {
                        let dot = Zip::from(&g)
                            .and(&y)
                            .fold(T::zero(), |acc, &g, &y| acc + g * y);
                        Zip::from(&mut g)
                            .and(&y)
                            .for_each(|g, &y| *g = y * (*g - dot));
                    });
                Ok(vec![Some(grad)])
            })
        })
    }

    /// Log-softmax along the last dimension.
    pub fn log_softmax(&self) -> Result<Tensor<T>> {
        let axis = last_axis("log_softmax", self)?;
        if let Some(out) = self.softmax_on_device("log_softmax", SoftmaxKind::LogSoftmax)? {
            return Ok(out);
        }
        let mut out = self.cpu("log_softmax")?.as_standard_layout().into_owned();
        for mut lane in out.lanes_mut(axis) {
            let max = lane.fold(T::neg_infinity(), |m, &x| m.max(x));
            let log_total = lane.fold(T::zero(), |acc, &x| acc + (x - max).exp()).ln() + max;
            lane.mapv_inplace(|x| x - log_total);
        }
        let out = out.into_shared();
        record("log_softmax", &[self], out.clone(), || {
            Box::new(move |mut grad: ArrayD<T>, _: &[bool]| {
                // dx = g − softmax ⊙ Σ g per row, with softmax = exp(out).
                Zip::from(grad.lanes_mut(axis))
                    .and(out.lanes(axis))
                    .for_each(|mut g, y| {
                        let total = g.sum();
                        Zip::from(&mut g)
                            .and(&y)
                            .for_each(|g, &y| *g -= y.exp() * total);
                    });
                Ok(vec![Some(grad)])
            })
        })
    }
}
