//! Cross-entropy over logits and integer labels, fused (softmax and gradient in one pass).

use ndarray::{Array1, ArrayD, Ix2, IxDyn};

use super::{on_device, reshape_owned};
use crate::gpu::row_ops::{self as device, Targets};
use crate::gpu::GpuArray;
use crate::precision::written;
use crate::tape::{record_as, record_cpu_as, Recorded};
use crate::{Element, Error, Result, Tensor};

const OP: &str = "cross_entropy";

/// How per-example losses are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Mean over the examples whose label is not ignored.
    #[default]
    Mean,
    /// Sum over examples.
    Sum,
    /// One loss per example (ignored ones are 0), shaped like the logits without the last dim.
    None,
}

/// Options of [`Tensor::cross_entropy`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropyOptions {
    /// Examples with this label contribute no loss and no gradient (default `Some(-100)`).
    pub ignore_index: Option<i64>,
    /// Weight `ε` of the uniform distribution mixed into the target (default 0).
    pub label_smoothing: f64,
    /// How to combine the per-example losses.
    pub reduction: Reduction,
}

impl Default for CrossEntropyOptions {
    fn default() -> Self {
        CrossEntropyOptions {
            ignore_index: Some(-100),
            label_smoothing: 0.0,
            reduction: Reduction::Mean,
        }
    }
}

impl<T: Element> Tensor<T> {
    /// Cross-entropy of these logits `[..., classes]` against `labels` (one per row of the
    /// leading dimensions), as `torch.nn.functional.cross_entropy`. The loss is stored in
    /// `T` whatever the logits' format: 16-bit logits are read as stored and everything
    /// is computed in `T` (the numbers of casting them to f32 first, without the copy;
    /// PyTorch's autocast computes it in f32 too), and their gradient is kept in their
    /// format.
    pub fn cross_entropy(
        &self,
        labels: &[i64],
        options: &CrossEntropyOptions,
    ) -> Result<Tensor<T>> {
        let shape = self.shape().to_vec();
        let Some((&classes, lead)) = shape.split_last() else {
            return Err(Error::shape(OP, &[&shape], "logits need a class dimension"));
        };
        let rows: usize = lead.iter().product();
        if labels.len() != rows {
            return Err(Error::shape(
                OP,
                &[&shape, &[labels.len()]],
                format!("expected {rows} labels, one per row of the logits"),
            ));
        }
        let smoothing = options.label_smoothing;
        if !(0.0..=1.0).contains(&smoothing) {
            return Err(Error::invalid(
                OP,
                format!("label_smoothing {smoothing} is not in [0, 1]"),
            ));
        }
        let ignored = |label: i64| options.ignore_index == Some(label);
        if let Some(&bad) = labels
            .iter()
            .find(|&&l| !ignored(l) && (l < 0 || l as usize >= classes))
        {
            return Err(Error::invalid(
                OP,
                format!("label {bad} out of range for {classes} classes"),
            ));
        }
        if self.device() != crate::Device::Cpu {
            let counted = labels.iter().filter(|&&l| !ignored(l)).count();
            return self.cross_entropy_on_device(labels, lead, options, counted);
        }

        let logits = reshape_owned(OP, self.cpu(OP)?.into_owned(), &[rows, classes])?
            .into_dimensionality::<Ix2>()
            .map_err(|e| Error::shape(OP, &[&shape], e.to_string()))?;
        let (eps, class_count) = (T::from_f64(smoothing), T::from_f64(classes as f64));
        let mut log_norm = Array1::zeros(rows);
        let mut losses = Array1::zeros(rows);
        let mut counted = 0usize;
        for (((row, &label), lse), loss) in logits
            .outer_iter()
            .zip(labels)
            .zip(log_norm.iter_mut())
            .zip(losses.iter_mut())
        {
            let max = row.fold(T::neg_infinity(), |m, &x| m.max(x));
            *lse = row.fold(T::zero(), |acc, &x| acc + (x - max).exp()).ln() + max;
            if ignored(label) {
                continue;
            }
            counted += 1;
            let nll = *lse - row[label as usize];
            let smooth = *lse - row.sum() / class_count;
            *loss = (T::one() - eps) * nll + eps * smooth;
        }
        let out = match options.reduction {
            Reduction::None => reshape_owned(OP, losses.into_dyn(), lead)?,
            Reduction::Sum => ArrayD::from_elem(IxDyn(&[]), losses.sum()),
            Reduction::Mean => {
                ArrayD::from_elem(IxDyn(&[]), losses.sum() / T::from_f64(counted as f64))
            }
        };
        let reduction = options.reduction;
        record_cpu_as(Recorded::Loss, OP, &[self], out.into_shared(), || {
            let labels = labels.to_vec();
            let ignore_index = options.ignore_index;
            Box::new(move |grad: ArrayD<T>, _: &[bool]| {
                // d loss_i / d logit_c = softmax_c − (1−ε)·[c = label] − ε/C, times the
                // upstream gradient of loss_i.
                let upstream: Vec<T> = match reduction {
                    Reduction::None => grad.iter().copied().collect(),
                    Reduction::Sum | Reduction::Mean => {
                        let g = grad.iter().next().copied().unwrap_or_else(T::zero);
                        let g = if reduction == Reduction::Mean {
                            g / T::from_f64(counted as f64)
                        } else {
                            g
                        };
                        vec![g; rows]
                    }
                };
                let targets: Vec<RowTarget> = labels
                    .iter()
                    .map(|&label| match ignore_index == Some(label) {
                        true => RowTarget::Ignored,
                        false => RowTarget::Here(label as usize),
                    })
                    .collect();
                let mut logits = logits;
                let uniform = eps / class_count;
                grad_rows(
                    &mut logits,
                    log_norm.view(),
                    &targets,
                    &upstream,
                    eps,
                    uniform,
                );
                Ok(vec![Some(reshape_owned(OP, logits.into_dyn(), &shape)?)])
            })
        })
    }
}

impl<T: Element> Tensor<T> {
    /// Cross-entropy of these device logits (`[lead..., classes]`, read as stored) against
    /// `labels`, already validated, of which `counted` are not ignored.
    fn cross_entropy_on_device(
        &self,
        labels: &[i64],
        lead: &[usize],
        options: &CrossEntropyOptions,
        counted: usize,
    ) -> Result<Tensor<T>> {
        let on = self.device();
        let targets = Targets {
            labels: GpuArray::from_host(OP, on, labels, &[labels.len()])?,
            ignore_index: options.ignore_index,
            smoothing: options.label_smoothing,
            all_classes: 0,
        };
        let (losses, lse) = device::cross_entropy(on, self.device_input(OP, on)?, &targets)?;
        let reduction = options.reduction;
        let out = match reduction {
            Reduction::None => losses.reshaped(lead),
            Reduction::Sum => device::sum_losses(&losses, None)?,
            Reduction::Mean => device::sum_losses(&losses, Some(counted))?,
        };
        // The logits as stored, which backward reads so.
        let logits = self.detach();
        let format = self.grad_format();
        record_as(Recorded::Loss, OP, &[self], Tensor::from_gpu(out), || {
            Box::new(move |grad: Tensor<T>, _: &[bool]| {
                let upstream = grad.device_array(OP, on)?;
                // As on the CPU: a mean's upstream gradient is shared by the counted rows.
                let divisor = match reduction {
                    Reduction::Mean => counted as f64,
                    Reduction::Sum | Reduction::None => 1.0,
                };
                let kernel = device::CrossEntropyBackward {
                    upstream: &upstream,
                    per_row: reduction == Reduction::None,
                    divisor,
                    logits: logits.device_input(OP, on)?,
                    lse: &lse,
                    targets: &targets,
                };
                Ok(vec![Some(written(
                    OP,
                    on,
                    logits.shape(),
                    format,
                    &kernel,
                )?)])
            })
        })
    }
}

/// Where one row's target class is, for [`Tensor::cross_entropy_grad`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowTarget {
    /// The row does not count (its label is the ignore index): no gradient.
    Ignored,
    /// The row counts, and its target is this column of the logits.
    Here(usize),
    /// The row counts, and its target is a class in another shard of the logits.
    Elsewhere,
}

impl<T: Element> Tensor<T> {
    /// The gradient of cross-entropy with respect to these logits `[rows, width]`, which
    /// may be one shard of the classes (vocabulary-parallel losses): given each row's
    /// log-sum-exp over all `classes` (`lse: [rows]`), where its target is, and its
    /// upstream gradient (`upstream`: `[rows]`, or one element for every row) divided by
    /// `divisor`, each counted row is `u · (softmax − ε/classes − (1 − ε)·[c = target])`
    /// with `ε = smoothing`, and an ignored row is 0. On the logits' device; not recorded
    /// on the tape (for a [`CustomOp`](crate::CustomOp)'s backward).
    ///
    /// ```
    /// use ferrotron_tape::{RowTarget, Tensor};
    ///
    /// // Two classes of four; the row's log-sum-exp over all four is ln 4 (all logits 0).
    /// let logits = Tensor::<f64>::zeros(&[1, 2]);
    /// let lse = Tensor::from_vec(vec![4f64.ln()], &[1])?;
    /// let grad = logits.cross_entropy_grad(&lse, &[RowTarget::Here(1)], &Tensor::scalar(1.0), 1.0, 0.0, 4)?;
    /// let g = grad.to_vec()?;
    /// assert!((g[0] - 0.25).abs() < 1e-12 && (g[1] + 0.75).abs() < 1e-12);
    /// # Ok::<(), ferrotron_tape::Error>(())
    /// ```
    pub fn cross_entropy_grad(
        &self,
        lse: &Tensor<T>,
        targets: &[RowTarget],
        upstream: &Tensor<T>,
        divisor: f64,
        smoothing: f64,
        classes: usize,
    ) -> Result<Tensor<T>> {
        const OP: &str = "cross_entropy_grad";
        let shape = self.shape().to_vec();
        let (rows, width) = match shape.as_slice() {
            [rows, width] => (*rows, *width),
            _ => return Err(Error::shape(OP, &[&shape], "logits must be [rows, width]")),
        };
        if targets.len() != rows || lse.shape() != [rows] {
            return Err(Error::shape(
                OP,
                &[&shape, lse.shape(), &[targets.len()]],
                "one log-sum-exp and one target per row",
            ));
        }
        if classes == 0 || classes < width {
            return Err(Error::invalid(
                OP,
                format!("{classes} classes cannot hold logits {width} wide; pass all the classes"),
            ));
        }
        let per_row = upstream.numel() != 1;
        if per_row && upstream.shape() != [rows] {
            return Err(Error::shape(
                OP,
                &[&shape, upstream.shape()],
                "the upstream gradient has one element per row, or one for all",
            ));
        }
        if let Some(&bad) = targets
            .iter()
            .find(|t| matches!(t, RowTarget::Here(c) if *c >= width))
        {
            return Err(Error::invalid(
                OP,
                format!("{bad:?} is outside the logits' {width} columns"),
            ));
        }
        if let Some([logits, lse, upstream]) = on_device(OP, [self, lse, upstream])? {
            const IGNORED: i64 = i64::MIN;
            let labels: Vec<i64> = targets
                .iter()
                .map(|t| match t {
                    RowTarget::Ignored => IGNORED,
                    RowTarget::Here(c) => *c as i64,
                    RowTarget::Elsewhere => -1,
                })
                .collect();
            let targets = Targets {
                labels: GpuArray::from_host(OP, logits.device(), &labels, &[rows])?,
                ignore_index: Some(IGNORED),
                smoothing,
                all_classes: classes,
            };
            let kernel = device::CrossEntropyBackward {
                upstream: &upstream,
                per_row,
                divisor,
                logits: (&logits).into(),
                lse: &lse,
                targets: &targets,
            };
            return written(OP, logits.device(), logits.shape(), T::DTYPE, &kernel);
        }
        let mut logits = self
            .cpu(OP)?
            .into_owned()
            .into_dimensionality::<Ix2>()
            .map_err(|e| Error::shape(OP, &[&shape], e.to_string()))?;
        let lse = lse.to_vec()?;
        let divisor = T::from_f64(divisor);
        let upstream: Vec<T> = match upstream.to_vec()? {
            all if per_row => all.into_iter().map(|u| u / divisor).collect(),
            one => vec![one[0] / divisor; rows],
        };
        let eps = T::from_f64(smoothing);
        let uniform = eps / T::from_f64(classes as f64);
        grad_rows(
            &mut logits,
            ndarray::ArrayView1::from(&lse),
            targets,
            &upstream,
            eps,
            uniform,
        );
        Ok(Tensor::from_array(logits.into_dyn()))
    }
}

/// Turns each row of `logits` into its cross-entropy gradient in place:
/// `u · (exp(x − lse) − uniform) − u · (1 − ε)` at the target, 0 for an ignored row.
fn grad_rows<T: Element>(
    logits: &mut ndarray::Array2<T>,
    lse: ndarray::ArrayView1<'_, T>,
    targets: &[RowTarget],
    upstream: &[T],
    eps: T,
    uniform: T,
) {
    for (((mut row, &target), &lse), &u) in logits
        .outer_iter_mut()
        .zip(targets)
        .zip(lse.iter())
        .zip(upstream)
    {
        if target == RowTarget::Ignored {
            row.fill(T::zero());
            continue;
        }
        row.mapv_inplace(|x| u * ((x - lse).exp() - uniform));
        if let RowTarget::Here(column) = target {
            row[column] -= u * (T::one() - eps);
        }
    }
}
