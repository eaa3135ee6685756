//! Layer normalisation over the last dimension, with a fused backward.

use ndarray::{Array1, Array2, ArrayD, Axis, Ix2, Zip};

use super::{on_device, reshape_owned};
use crate::gpu::row_ops as device;
use crate::gpu::GpuArray;
use crate::tape::{record, record_tensor};
use crate::{Element, Error, Result, Tensor};

const OP: &str = "layer_norm";

impl<T: Element> Tensor<T> {
    /// `(x − mean) / √(var + eps) · weight + bias` over the last dimension (biased variance,
    /// as PyTorch). `weight` and `bias` have the last dimension's size; either may be absent.
    pub fn layer_norm(
        &self,
        weight: Option<&Tensor<T>>,
        bias: Option<&Tensor<T>>,
        eps: f64,
    ) -> Result<Tensor<T>> {
        let shape = self.shape().to_vec();
        let Some(&width) = shape.last() else {
            return Err(Error::shape(OP, &[&shape], "needs at least one dimension"));
        };
        for affine in [weight, bias].into_iter().flatten() {
            if affine.shape() != [width] {
                return Err(Error::shape(
                    OP,
                    &[&shape, affine.shape()],
                    format!("weight and bias must have shape [{width}]"),
                ));
            }
        }
        // A missing weight or bias stands in as `self`, so only present ones can mismatch.
        let present = [self, weight.unwrap_or(self), bias.unwrap_or(self)];
        if let Some(arrays) = on_device(OP, present)? {
            return self.layer_norm_on_device(arrays, weight, bias, eps);
        }
        let rows = self.numel().checked_div(width).unwrap_or(0);
        let input = reshape_owned(OP, self.cpu(OP)?.to_owned(), &[rows, width])?;
        let input = input
            .into_dimensionality::<Ix2>()
            .map_err(|e| Error::shape(OP, &[&shape], e.to_string()))?;
        let weight_values = weight.map(|w| w.cpu(OP)).transpose()?.cloned();
        let bias_values = bias.map(|b| b.cpu(OP)).transpose()?.cloned();

        let eps = T::from_f64(eps);
        let count = T::from_f64(width as f64);
        let mut normalized = input;
        let mut inv_std = Array1::zeros(rows);
        for (mut row, rstd) in normalized.outer_iter_mut().zip(inv_std.iter_mut()) {
            let mean = row.sum() / count;
            let var = row.fold(T::zero(), |acc, &x| acc + (x - mean) * (x - mean)) / count;
            *rstd = T::one() / (var + eps).sqrt();
            let r = *rstd;
            row.mapv_inplace(|x| (x - mean) * r);
        }
        let mut out = normalized.clone();
        if let Some(w) = &weight_values {
            Zip::from(out.rows_mut()).for_each(|mut row| row *= w);
        }
        if let Some(b) = &bias_values {
            Zip::from(out.rows_mut()).for_each(|mut row| row += b);
        }
        let out = reshape_owned(OP, out.into_dyn(), &shape)?;

        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let (has_weight, has_bias) = (weight.is_some(), bias.is_some());
        record(OP, &inputs, out.into_shared(), || {
            Box::new(move |grad: ArrayD<T>, needs: &[bool]| {
                let grad = reshape_owned(OP, grad, &[rows, width])?
                    .into_dimensionality::<Ix2>()
                    .map_err(|e| Error::shape(OP, &[&shape], e.to_string()))?;
                let mut grads = Vec::with_capacity(3);
                grads.push(needs[0].then(|| {
                    input_grad(&grad, &normalized, &inv_std, weight_values.as_ref(), count)
                        .into_dyn()
                }));
                let mut next = 1;
                if has_weight {
                    grads.push(
                        needs[next].then(|| (&grad * &normalized).sum_axis(Axis(0)).into_dyn()),
                    );
                    next += 1;
                }
                if has_bias {
                    grads.push(needs[next].then(|| grad.sum_axis(Axis(0)).into_dyn()));
                }
                if let Some(Some(g)) = grads.first_mut() {
                    *g = reshape_owned(OP, std::mem::take(g), &shape)?;
                }
                Ok(grads)
            })
        })
    }
}

impl<T: Element> Tensor<T> {
    /// Layer norm on a device: `arrays` are the device arrays of this tensor, `weight` and
    /// `bias` (this tensor's again where those are absent).
    fn layer_norm_on_device(
        &self,
        arrays: [&GpuArray<T>; 3],
        weight: Option<&Tensor<T>>,
        bias: Option<&Tensor<T>>,
        eps: f64,
    ) -> Result<Tensor<T>> {
        let [x, weight_array, bias_array] = arrays;
        let weight_array = weight.map(|_| weight_array);
        let bias_array = bias.map(|_| bias_array);
        let (out, saved) = device::layer_norm(x, weight_array, bias_array, eps)?;
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let weight = weight_array.cloned();
        let has_bias = bias.is_some();
        record_tensor(OP, &inputs, Tensor::from_gpu(out), || {
            Box::new(move |grad: Tensor<T>, needs: &[bool]| {
                let grad = grad.device_array(OP, saved.x.device())?;
                let dx = needs[0]
                    .then(|| device::layer_norm_input_grad(grad, &saved, weight.as_ref()))
                    .transpose()?;
                // Inputs are [x, weight?, bias?].
                let need_weight = weight.is_some() && needs[1];
                let need_bias = has_bias && needs[1 + usize::from(weight.is_some())];
                let (dweight, dbias) =
                    device::layer_norm_affine_grads(grad, &saved, need_weight, need_bias)?;
                let mut grads = vec![dx.map(Tensor::from_gpu)];
                if weight.is_some() {
                    grads.push(dweight.map(Tensor::from_gpu));
                }
                if has_bias {
                    grads.push(dbias.map(Tensor::from_gpu));
                }
                Ok(grads)
            })
        })
    }
}

/// dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ ⊙ x̂)) with ĝ = g ⊙ weight, row by row.
fn input_grad<T: Element>(
    grad: &Array2<T>,
    normalized: &Array2<T>,
    inv_std: &Array1<T>,
    weight: Option<&ndarray::ArcArray<T, ndarray::IxDyn>>,
    count: T,
) -> Array2<T> {
    let mut out = grad.clone();
    if let Some(w) = weight {
        Zip::from(out.rows_mut()).for_each(|mut row| row *= w);
    }
    Zip::from(out.rows_mut())
        .and(normalized.rows())
        .and(inv_std)
        .for_each(|mut g_hat, x_hat, &rstd| {
            let mean_g = g_hat.sum() / count;
            let mean_gx = Zip::from(&g_hat)
                .and(&x_hat)
                .fold(T::zero(), |acc, &g, &x| acc + g * x)
                / count;
            Zip::from(&mut g_hat)
                .and(&x_hat)
                .for_each(|g, &x| *g = rstd * (*g - mean_g - x * mean_gx));
        });
    out
}
