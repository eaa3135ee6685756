//! Softmax and log-softmax along the last dimension, computed stably (max subtracted),
//! and attention's causal softmax with its scale and upper-triangular mask fused in.

use ndarray::{ArrayD, ArrayView1, Axis};

use super::pointwise_inputs;
use crate::gpu::ops::{PointwiseInput, PointwiseWrite};
use crate::gpu::row_ops::{self as device, SoftmaxKind, SoftmaxRows};
use crate::gpu::{GpuArray, Stored};
use crate::precision::written;
use crate::tape::{record_reading_output, record_tensor_reading_output};
use crate::{Element, Error, Result, Tensor};

impl<T: Element> Tensor<T> {
    /// Softmax along the last dimension.
    pub fn softmax(&self) -> Result<Tensor<T>> {
        self.softmax_rows("softmax", SoftmaxRows::plain(SoftmaxKind::Softmax))
    }

    /// Log-softmax along the last dimension (stable `x − max − log Σ exp(x − max)`).
    pub fn log_softmax(&self) -> Result<Tensor<T>> {
        self.softmax_rows("log_softmax", SoftmaxRows::plain(SoftmaxKind::LogSoftmax))
    }

    /// Causal attention's softmax in one pass (Megatron's
    /// `scaled_upper_triang_masked_softmax`): the softmax over the last dimension of
    /// `scale · self`, where row `i` of each `[n, n]` matrix in the last two dimensions
    /// sees only columns `j ≤ i` and is 0 beyond. It equals
    /// `self.scale(scale)?.masked_fill(&causal_mask(n), −∞)?.softmax()` without the
    /// scaled copy or a mask in memory (on a device, nothing uploaded).
    ///
    /// ```
    /// use ferrotron_tape::Tensor;
    ///
    /// let scores = Tensor::<f64>::from_vec(vec![1.0, 9.0, 2.0, 2.0], &[2, 2])?;
    /// let probs = scores.causal_softmax(0.5)?.to_vec()?;
    /// assert_eq!(probs, vec![1.0, 0.0, 0.5, 0.5]);
    /// # Ok::<(), ferrotron_tape::Error>(())
    /// ```
    pub fn causal_softmax(&self, scale: f64) -> Result<Tensor<T>> {
        const OP: &str = "causal_softmax";
        match self.shape() {
            [.., rows, columns] if rows == columns => self.softmax_rows(
                OP,
                SoftmaxRows {
                    kind: SoftmaxKind::Softmax,
                    scale,
                    causal: true,
                },
            ),
            shape => Err(Error::shape(
                OP,
                &[shape],
                "needs square matrices in its last two dimensions ([..., n, n])",
            )),
        }
    }

    fn softmax_rows(&self, op: &'static str, how: SoftmaxRows) -> Result<Tensor<T>> {
        if self.ndim() == 0 {
            return Err(Error::shape(
                op,
                &[self.shape()],
                "needs at least one dimension",
            ));
        }
        if let Some([x]) = pointwise_inputs(op, [self])? {
            let on = self.device();
            let y = written(
                op,
                on,
                self.shape(),
                self.dtype(),
                &SoftmaxKernel { x, how },
            )?;
            let format = self.grad_format();
            return record_tensor_reading_output(op, &[self], y, |kept| {
                Box::new(move |grad: Tensor<T>, _: &[bool]| {
                    let y = kept.device_input(op, on)?;
                    let grad = grad.device_input(op, on)?;
                    let kernel = device::SoftmaxBackward { grad, y, how };
                    Ok(vec![Some(written(op, on, y.shape, format, &kernel)?)])
                })
            });
        }
        let out = softmax_on_cpu(op, &self.cpu(op)?, how)?;
        record_reading_output(op, &[self], out, |kept| {
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                let out = kept.cpu(op)?;
                let mut grad = if grad.is_standard_layout() {
                    grad
                } else {
                    grad.as_standard_layout().into_owned()
                };
                let width = grad.shape().last().copied().unwrap_or(0);
                let y = out.as_slice().ok_or_else(|| {
                    Error::shape(op, &[out.shape()], "internal: the output is not row-major")
                })?;
                for_each_row(op, &mut grad, how, |g, r| {
                    softmax_row_backward(g, &y[r * width..r * width + g.len()], how)
                })?;
                Ok(vec![Some(grad)])
            })
        })
    }
}

/// The softmax rows of `x` on the CPU, row-major.
fn softmax_on_cpu<T: Element>(
    op: &'static str,
    x: &ndarray::ArcArray<T, ndarray::IxDyn>,
    how: SoftmaxRows,
) -> Result<ndarray::ArcArray<T, ndarray::IxDyn>> {
    let mut out = x.as_standard_layout().into_owned();
    for_each_row(op, &mut out, how, |row, _| softmax_row(row, how))?;
    Ok(out.into_shared())
}

/// Runs `f` on the columns each row of a row-major `array` sees (all of them, or for a
/// causal softmax those up to the row's position in its matrix), with the row's index;
/// the columns it does not see are zeroed.
fn for_each_row<T: Element>(
    op: &'static str,
    array: &mut ArrayD<T>,
    how: SoftmaxRows,
    f: impl Fn(&mut [T], usize) + Sync,
) -> Result<()> {
    let axis = Axis(array.ndim() - 1);
    let width = array.len_of(axis);
    let shape = array.shape().to_vec();
    let Some(values) = array.as_slice_mut() else {
        return Err(Error::shape(
            op,
            &[&shape],
            "internal: the rows are not row-major",
        ));
    };
    // Rows are independent: blocks of them may run on the calling thread's threads.
    let mut none: [(); 0] = [];
    crate::threads::for_row_blocks(values, width, &mut none, 1, |first, block, _| {
        for (i, row) in block.chunks_exact_mut(width.max(1)).enumerate() {
            let r = first + i;
            let seen = if how.causal { r % width + 1 } else { width };
            f(&mut row[..seen], r);
            row[seen..].fill(T::zero());
        }
    });
    Ok(())
}

/// `row ← softmax(scale · row)` (or its log form), in place.
fn softmax_row<T: Element>(row: &mut [T], how: SoftmaxRows) {
    let scale = T::from_f64(how.scale);
    row.iter_mut().for_each(|x| *x *= scale);
    let max = row.iter().fold(T::neg_infinity(), |m, &x| m.max(x));
    match how.kind {
        SoftmaxKind::Softmax => {
            row.iter_mut().for_each(|x| *x = (*x - max).exp());
            let total = ArrayView1::from(&*row).sum();
            row.iter_mut().for_each(|x| *x /= total);
        }
        SoftmaxKind::LogSoftmax => {
            let log_total = row
                .iter()
                .fold(T::zero(), |acc, &x| acc + (x - max).exp())
                .ln()
                + max;
            row.iter_mut().for_each(|x| *x -= log_total);
        }
    }
}

/// `g ← d(loss)/d(x)` from `g = d(loss)/d(y)` and the forward's output `y` of one row:
/// softmax `scale · y ⊙ (g − Σ g⊙y)`, log-softmax `scale · (g − exp(y) · Σ g)`.
fn softmax_row_backward<T: Element>(g: &mut [T], y: &[T], how: SoftmaxRows) {
    let scale = T::from_f64(how.scale);
    match how.kind {
        SoftmaxKind::Softmax => {
            let dot = g.iter().zip(y).fold(T::zero(), |acc, (&g, &y)| acc + g * y);
            g.iter_mut()
                .zip(y)
                .for_each(|(g, &y)| *g = y * (*g - dot) * scale);
        }
        SoftmaxKind::LogSoftmax => {
            let total = ArrayView1::from(&*g).sum();
            g.iter_mut()
                .zip(y)
                .for_each(|(g, &y)| *g = (*g - y.exp() * total) * scale);
        }
    }
}

/// `softmax_rows` as a kernel writing any storage format.
pub(crate) struct SoftmaxKernel<'a> {
    pub x: PointwiseInput<'a>,
    pub how: SoftmaxRows,
}

impl PointwiseWrite for SoftmaxKernel<'_> {
    fn write<T: Element, O: Stored>(&self, out: &GpuArray<O>) -> Result<()> {
        device::softmax_stored::<T, O>(out, self.x, self.how)
    }
}
