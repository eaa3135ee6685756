//! Layer normalisation over the last dimension, with a fused backward.

use ndarray::ArrayD;

use super::common_device;
use crate::gpu::ops::PointwiseWrite;
use crate::gpu::row_ops as device;
use crate::gpu::{GpuArray, Stored};
use crate::precision::{promoted, written};
use crate::tape::{record, record_tensor};
use crate::threads::for_row_blocks;
use crate::{Device, Element, Error, Result, Tensor};

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
        let present: Vec<&Tensor<T>> = std::iter::once(self).chain(weight).chain(bias).collect();
        if let Some(on) = common_device(OP, &present)?.filter(|&d| d != Device::Cpu) {
            return self.layer_norm_on_device(on, weight, bias, eps);
        }
        let rows = self.numel().checked_div(width).unwrap_or(0);
        let computed = self.cpu(OP)?;
        let input = computed.as_standard_layout();
        let x = contiguous(OP, &input, &shape)?;
        let weight_values = weight.map(|w| contiguous_owned(OP, w)).transpose()?;
        let bias_values = bias.map(|b| contiguous_owned(OP, b)).transpose()?;

        // One pass per row: statistics, then the normalised row and the affine output.
        let eps = T::from_f64(eps);
        let count = T::from_f64(width as f64);
        let mut out = vec![T::zero(); x.len()];
        // Each row's mean and 1/std.
        let mut stats = vec![[T::zero(); 2]; rows];
        let w = width.max(1);
        for_row_blocks(&mut out, w, &mut stats, 1, |first, out, stats| {
            let rows = x[first * w..].chunks_exact(w);
            for ((row, out_row), [mean, rstd]) in rows.zip(out.chunks_exact_mut(w)).zip(stats) {
                *mean = lane_sum(row, |x| x) / count;
                let var = lane_sum(row, |x| (x - *mean) * (x - *mean)) / count;
                *rstd = T::one() / (var + eps).sqrt();
                normalize(row, *mean, *rstd, out_row);
                if let Some(w) = &weight_values {
                    out_row.iter_mut().zip(w).for_each(|(o, &w)| *o *= w);
                }
                if let Some(b) = &bias_values {
                    out_row.iter_mut().zip(b).for_each(|(o, &b)| *o += b);
                }
            }
        });
        let (means, inv_std): (Vec<T>, Vec<T>) = stats.into_iter().map(|[m, r]| (m, r)).unzip();
        let out = ArrayD::from_shape_vec(shape.clone(), out)
            .map_err(|e| Error::shape(OP, &[&shape], e.to_string()))?;

        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let (has_weight, has_bias) = (weight.is_some(), bias.is_some());
        record(OP, &inputs, out.into_shared(), || {
            // The input and each row's statistics, not the normalized rows: a 16-bit
            // input stays 16-bit, and an f32 one is the caller's own array.
            let kept = self.detach();
            Box::new(move |grad: ArrayD<T>, needs: &[bool]| {
                let grad = grad.as_standard_layout();
                let g = contiguous(OP, &grad, &shape)?;
                let input = kept.cpu(OP)?;
                let input = input.as_standard_layout();
                let x = contiguous(OP, &input, &shape)?;
                let mut normalized = vec![T::zero(); x.len()];
                let w = width.max(1);
                let mut none: [(); 0] = [];
                for_row_blocks(&mut normalized, w, &mut none, 1, |first, block, _| {
                    let rows = x[first * w..].chunks_exact(w);
                    let stats = means[first..].iter().zip(&inv_std[first..]);
                    for ((row, x_hat), (&mean, &rstd)) in
                        rows.zip(block.chunks_exact_mut(w)).zip(stats)
                    {
                        normalize(row, mean, rstd, x_hat);
                    }
                });
                let saved = Saved {
                    normalized: &normalized,
                    inv_std: &inv_std,
                    weight: weight_values.as_deref(),
                    width,
                };
                // Inputs are [x, weight?, bias?].
                let need_weight = has_weight && needs[1];
                let need_bias = has_bias && needs[1 + usize::from(has_weight)];
                let backward = saved.backward(g, needs[0], need_weight, need_bias);
                let as_array = |values: Option<Vec<T>>, shape: &[usize]| {
                    values
                        .map(|v| ArrayD::from_shape_vec(shape.to_vec(), v))
                        .transpose()
                        .map_err(|e| Error::shape(OP, &[shape], e.to_string()))
                };
                let mut grads = vec![as_array(backward.input, &shape)?];
                if has_weight {
                    grads.push(as_array(backward.weight, &[width])?);
                }
                if has_bias {
                    grads.push(as_array(backward.bias, &[width])?);
                }
                Ok(grads)
            })
        })
    }
}

impl<T: Element> Tensor<T> {
    /// Layer norm on device `on`, every tensor read as stored (16-bit ones not widened).
    fn layer_norm_on_device(
        &self,
        on: Device,
        weight: Option<&Tensor<T>>,
        bias: Option<&Tensor<T>>,
        eps: f64,
    ) -> Result<Tensor<T>> {
        let width = self.shape().last().copied().unwrap_or(1);
        let rows = self.numel().checked_div(width).unwrap_or(0);
        let mean = GpuArray::<T>::uninit(OP, on, &[rows])?;
        let rstd = GpuArray::<T>::uninit(OP, on, &[rows])?;
        let mut inputs = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let kernel = LayerNormKernel {
            inputs: (
                self.device_input(OP, on)?,
                weight.map(|w| w.device_input(OP, on)).transpose()?,
                bias.map(|b| b.device_input(OP, on)).transpose()?,
            ),
            stats: (&mean, &rstd),
            eps,
        };
        let out = written(OP, on, self.shape(), promoted(&inputs), &kernel)?;
        let has_bias = bias.is_some();
        let format = self.grad_format();
        record_tensor(OP, &inputs, out, || {
            // A 16-bit input and weight are kept as themselves and read so.
            let input = self.detach();
            let weight = weight.map(Tensor::detach);
            Box::new(move |grad: Tensor<T>, needs: &[bool]| {
                let saved = device::LayerNormSaved {
                    x: input.device_input(OP, on)?,
                    mean: &mean,
                    rstd: &rstd,
                };
                let weight = weight
                    .as_ref()
                    .map(|w| w.device_input(OP, on))
                    .transpose()?;
                let grad = grad.device_input(OP, on)?;
                let dx = needs[0]
                    .then(|| {
                        let kernel = device::LayerNormInputGrad {
                            grad,
                            saved,
                            weight,
                        };
                        written(OP, on, saved.x.shape, format, &kernel)
                    })
                    .transpose()?;
                // Inputs are [x, weight?, bias?].
                let need_weight = weight.is_some() && needs[1];
                let need_bias = has_bias && needs[1 + usize::from(weight.is_some())];
                let (dweight, dbias) =
                    device::layer_norm_affine_grads(grad, saved, need_weight, need_bias)?;
                let mut grads = vec![dx];
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

/// `layer_norm_rows` as a kernel writing any storage format.
struct LayerNormKernel<'a, T> {
    inputs: device::LayerNormInputs<'a>,
    stats: (&'a GpuArray<T>, &'a GpuArray<T>),
    eps: f64,
}

impl<E: Element> PointwiseWrite for LayerNormKernel<'_, E> {
    // `written` computes in the tensor's element type, which is `E`, the statistics'.
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        device::layer_norm_stored::<E, O>(out, self.inputs, self.stats, self.eps)
    }
}

/// What layer norm's backward reads: the normalised input x̂ (rows × width, recomputed
/// from the kept input and statistics), each row's 1/√(var + eps) and the weight.
struct Saved<'a, T> {
    normalized: &'a [T],
    inv_std: &'a [T],
    weight: Option<&'a [T]>,
    width: usize,
}

/// Layer norm's gradients: input (rows × width), weight and bias (width each).
struct Gradients<T> {
    input: Option<Vec<T>>,
    weight: Option<Vec<T>>,
    bias: Option<Vec<T>>,
}

impl<T: Element> Saved<'_, T> {
    /// One pass per row: dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ ⊙ x̂)) with ĝ = g ⊙ weight,
    /// while the weight and bias gradients (Σ over rows of g ⊙ x̂ and of g) accumulate.
    fn backward(
        &self,
        grad: &[T],
        need_input: bool,
        need_weight: bool,
        need_bias: bool,
    ) -> Gradients<T> {
        let width = self.width.max(1);
        let count = T::from_f64(self.width as f64);
        let mut input = need_input.then(|| vec![T::zero(); grad.len()]);
        let mut weight = need_weight.then(|| vec![T::zero(); self.width]);
        let mut bias = need_bias.then(|| vec![T::zero(); self.width]);
        // The parameters' gradients sum over the rows in order, on one thread.
        let rows = grad
            .chunks_exact(width)
            .zip(self.normalized.chunks_exact(width));
        for (g, x_hat) in rows {
            if let Some(dw) = &mut weight {
                dw.iter_mut()
                    .zip(g)
                    .zip(x_hat)
                    .for_each(|((d, &g), &x)| *d += g * x);
            }
            if let Some(db) = &mut bias {
                db.iter_mut().zip(g).for_each(|(d, &g)| *d += g);
            }
        }
        // Each row's input gradient on its own.
        if let Some(dx) = &mut input {
            let mut none: [(); 0] = [];
            for_row_blocks(dx, width, &mut none, 1, |first, block, _| {
                let mut g_hat = vec![T::zero(); self.width];
                let rows = (grad[first * width..].chunks_exact(width))
                    .zip(self.normalized[first * width..].chunks_exact(width))
                    .zip(&self.inv_std[first..]);
                for (((g, x_hat), &rstd), dx) in rows.zip(block.chunks_exact_mut(width)) {
                    g_hat.copy_from_slice(g);
                    if let Some(w) = self.weight {
                        g_hat.iter_mut().zip(w).for_each(|(g, &w)| *g *= w);
                    }
                    let mean_g = lane_sum(&g_hat, |g| g) / count;
                    let mean_gx = lane_dot(&g_hat, x_hat) / count;
                    for ((d, &g), &x) in dx.iter_mut().zip(&g_hat).zip(x_hat) {
                        *d = rstd * (g - mean_g - x * mean_gx);
                    }
                }
            });
        }
        Gradients {
            input,
            weight,
            bias,
        }
    }
}

/// `(x − mean) · rstd` of one row, into `out`: the same arithmetic in forward and when
/// backward recomputes it.
fn normalize<T: Element>(row: &[T], mean: T, rstd: T, out: &mut [T]) {
    for (n, &v) in out.iter_mut().zip(row) {
        *n = (v - mean) * rstd;
    }
}

/// Σ f(xᵢ) in eight interleaved partial sums, so the loop vectorises (and rounds less
/// than one running sum).
fn lane_sum<T: Element>(values: &[T], f: impl Fn(T) -> T) -> T {
    let mut lanes = [T::zero(); 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks
        .remainder()
        .iter()
        .fold(T::zero(), |acc, &x| acc + f(x));
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f(x);
        }
    }
    lanes.iter().fold(rest, |acc, &lane| acc + lane)
}

/// Σ aᵢ·bᵢ in eight interleaved partial sums.
fn lane_dot<T: Element>(a: &[T], b: &[T]) -> T {
    let mut lanes = [T::zero(); 8];
    let (chunks_a, chunks_b) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest = (chunks_a.remainder().iter().zip(chunks_b.remainder()))
        .fold(T::zero(), |acc, (&x, &y)| acc + x * y);
    for (ca, cb) in chunks_a.zip(chunks_b) {
        for ((lane, &x), &y) in lanes.iter_mut().zip(ca).zip(cb) {
            *lane += x * y;
        }
    }
    lanes.iter().fold(rest, |acc, &lane| acc + lane)
}

/// A standard-layout array's elements as one slice.
fn contiguous<'a, T: Element>(
    op: &'static str,
    array: &'a ndarray::CowArray<'_, T, ndarray::IxDyn>,
    shape: &[usize],
) -> Result<&'a [T]> {
    array
        .as_slice()
        .ok_or_else(|| Error::shape(op, &[shape], "array is not contiguous after relayout"))
}

/// A (weight or bias) tensor's elements, copied into a contiguous vector.
fn contiguous_owned<T: Element>(op: &'static str, tensor: &Tensor<T>) -> Result<Vec<T>> {
    Ok(tensor.cpu(op)?.iter().copied().collect())
}
