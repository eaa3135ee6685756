//! Cross-entropy over logits whose vocabulary dimension is divided among the
//! tensor-parallel ranks (Megatron-Core's `vocab_parallel_cross_entropy`), exact for every
//! tensor-parallel size, label smoothing included; and its per-token form, normalised by
//! the non-ignored tokens of the whole data-parallel batch (Megatron's
//! `calculate_per_token_loss`).

use std::sync::Arc;

use ferrotron_comm_core::{Communicator, CommunicatorExt, ReduceOp};
use ferrotron_tape::ndarray::{ArrayD, IxDyn};
use ferrotron_tape::{CrossEntropyOptions, CustomOp, Reduction, RowTarget, Tensor};

use crate::embedding::VocabRange;
use crate::error::{Error, Result};

const OP: &str = "vocab_parallel_cross_entropy";

/// Cross-entropy of `logits: [..., local vocab]`, this rank's [`VocabRange`] of a
/// `vocab_size` vocabulary, against `labels` (one global id per row, the same on every
/// rank), with the semantics of [`Tensor::cross_entropy`] on the gathered logits.
///
/// Forward takes one MAX all-reduce (for a stable log-sum-exp) and one SUM all-reduce
/// of three numbers per row (Σ exp, Σ logits, the target logit). Label smoothing divides
/// by the **global** vocabulary size (Megatron-Core divides by the local shard's, so its
/// smoothed loss changes with the tensor-parallel size). Backward is fused and local:
/// `softmax − (1−ε)·one-hot − ε/V`, scaled by the upstream gradient. A group of one
/// holds the whole vocabulary and needs none of this: there it is tape's fused
/// cross-entropy (one row kernel each way), which reads 16-bit logits as they are.
///
/// With [`Reduction::Mean`], rows whose label is the ignore index do not count; when no
/// row counts, the loss is 0 and so is its gradient (the sum over no rows), not 0/0.
/// Under data parallelism each rank's mean covers only its own tokens, so averaging it
/// over the ranks weights ranks with many ignored tokens too much; see
/// [`vocab_parallel_cross_entropy_per_token`].
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    labels: &[i64],
    group: &Arc<dyn Communicator>,
    vocab_size: usize,
    options: &CrossEntropyOptions,
) -> Result<Tensor> {
    let range = VocabRange::new(vocab_size, group.rank(), group.size())?;
    let shape = logits.shape().to_vec();
    if shape.last() != Some(&range.len()) {
        return Err(Error::shape(
            OP,
            &shape,
            format!(
                "[..., {}]: rank {}'s share of a vocabulary of {vocab_size}",
                range.len(),
                group.rank()
            ),
        ));
    }
    let rows = logits.numel() / range.len();
    if labels.len() != rows {
        return Err(Error::shape(
            OP,
            &shape,
            format!("one label per row; got {} labels", labels.len()),
        ));
    }
    if !(0.0..=1.0).contains(&options.label_smoothing) {
        return Err(Error::config(
            OP,
            format!(
                "label_smoothing {} is not in [0, 1]",
                options.label_smoothing
            ),
        ));
    }
    let ignored = |label: i64| options.ignore_index == Some(label);
    if let Some(&label) = labels
        .iter()
        .find(|&&l| !ignored(l) && (l < 0 || l as usize >= vocab_size))
    {
        return Err(Error::LabelOutOfRange {
            op: OP,
            label,
            vocab_size,
        });
    }
    // The whole vocabulary here: tape's fused loss, one row kernel each way, which reads
    // 16-bit logits as stored and computes in f32. Its mean over no counted row is
    // PyTorch's 0/0, not this function's 0.
    let counted = labels.iter().any(|&l| !ignored(l));
    if group.size() == 1 && (counted || options.reduction != Reduction::Mean) {
        return Ok(logits.cross_entropy(labels, options)?);
    }
    // bf16 or f16 logits: the loss is computed in f32 and the gradient flows back through
    // the cast (Megatron's `.float()` before its vocabulary-parallel cross-entropy).
    let logits = logits.to_dtype(ferrotron_tape::DType::F32)?;
    let targets = labels
        .iter()
        .map(|&l| (!ignored(l) && range.contains(l as usize)).then(|| l as usize - range.start))
        .collect();
    let op = VocabParallelCrossEntropy {
        group: group.clone(),
        vocab_size,
        targets,
        kept: labels.iter().map(|&l| !ignored(l)).collect(),
        options: *options,
        lead_shape: shape[..shape.len() - 1].to_vec(),
    };
    Tensor::apply(Arc::new(op), &[&logits]).map_err(unwrap_own_error)
}

/// One data-parallel rank's share of the per-token loss of the whole data-parallel batch;
/// see [`vocab_parallel_cross_entropy_per_token`].
#[derive(Debug, Clone)]
pub struct TokenLoss {
    /// `Σ(this rank's token losses) · dp_size / global_tokens` (0 when `global_tokens`
    /// is 0), differentiable: call `backward` on it, then let DDP average the gradients.
    pub loss: Tensor,
    /// Tokens whose label is not the ignore index, over the data-parallel group.
    pub global_tokens: usize,
    /// The loss over those tokens, `Σ token losses / global_tokens` (0 without tokens):
    /// the same on every rank, for reporting. A one-element tensor on the logits'
    /// device, so computing it reads nothing back; `item()` reads it (a host wait there).
    pub global_mean: Tensor,
}

/// Cross-entropy normalised by the non-ignored tokens of the whole data-parallel batch
/// (Megatron-Core's `calculate_per_token_loss`), for batches whose ranks ignore different
/// numbers of tokens (padding).
///
/// Arguments are those of [`vocab_parallel_cross_entropy`] plus the data-parallel group
/// `dp_group`, whose every rank must call this function (after the tensor-parallel
/// all-reduces, it all-reduces this rank's loss sum and token count over `dp_group`).
/// `options.reduction` must be [`Reduction::Mean`] (the default): the result is a mean,
/// over the global batch. The returned [`TokenLoss::loss`] is scaled so that
///
/// * its average over the data-parallel ranks is the mean loss of the global batch's
///   non-ignored tokens, and
/// * after DDP **averages** the gradients over `dp_group`, every parameter's gradient is
///   the gradient of that global mean, as one rank holding the whole batch would get.
///
/// Each call normalises by the tokens of its own global micro-batch: under gradient
/// accumulation, micro-batches are weighted equally, not by their token counts.
pub fn vocab_parallel_cross_entropy_per_token(
    logits: &Tensor,
    labels: &[i64],
    tp_group: &Arc<dyn Communicator>,
    vocab_size: usize,
    options: &CrossEntropyOptions,
    dp_group: &Arc<dyn Communicator>,
) -> Result<TokenLoss> {
    const OP: &str = "vocab_parallel_cross_entropy_per_token";
    if options.reduction != Reduction::Mean {
        return Err(Error::config(
            OP,
            format!(
                "reduction {:?}: the per-token loss is a mean over the global batch; use \
                 Reduction::Mean, or vocab_parallel_cross_entropy for other reductions",
                options.reduction
            ),
        ));
    }
    let sum_options = CrossEntropyOptions {
        reduction: Reduction::Sum,
        ..*options
    };
    let local_sum =
        vocab_parallel_cross_entropy(logits, labels, tp_group, vocab_size, &sum_options)?;
    let local_tokens = labels
        .iter()
        .filter(|&&l| options.ignore_index != Some(l))
        .count();
    // The token counts are the host's (f64 keeps them exact up to 2^53); the loss sum
    // stays on the logits' device, summed there over the group, so nothing waits here.
    let mut global_tokens = [local_tokens as f64];
    dp_group.all_reduce_slice(&mut global_tokens, ReduceOp::Sum)?;
    let global_tokens = global_tokens[0];
    let global_sum = local_sum.detach().updated_by(|view| {
        dp_group
            .all_reduce(view, ReduceOp::Sum)
            .map_err(Error::from)
    })?;
    // No token anywhere: every rank's sum is 0 and stays 0 with its gradient.
    let tokens = global_tokens.max(1.0);
    Ok(TokenLoss {
        loss: local_sum.scale(dp_group.size() as f64 / tokens)?,
        global_tokens: global_tokens as usize,
        global_mean: global_sum.scale(1.0 / tokens)?,
    })
}

/// Errors raised inside the op's forward come back wrapped by the tape.
fn unwrap_own_error(error: ferrotron_tape::Error) -> Error {
    match error {
        ferrotron_tape::Error::Custom { op, source } => match source.downcast::<Error>() {
            Ok(ours) => *ours,
            Err(source) => Error::Tape(ferrotron_tape::Error::Custom { op, source }),
        },
        other => Error::Tape(other),
    }
}

struct VocabParallelCrossEntropy {
    group: Arc<dyn Communicator>,
    vocab_size: usize,
    /// Per row: the label's column in this rank's shard, if it is here and not ignored.
    targets: Vec<Option<usize>>,
    /// Per row: whether the label is counted (not the ignore index).
    kept: Vec<bool>,
    options: CrossEntropyOptions,
    lead_shape: Vec<usize>,
}

impl VocabParallelCrossEntropy {
    /// The divisor of [`Reduction::Mean`]: the non-ignored rows, or 1 when there are
    /// none (their sum is 0, so the mean is 0 rather than 0/0).
    fn mean_divisor(&self) -> f32 {
        self.kept.iter().filter(|&&k| k).count().max(1) as f32
    }

    fn forward_inner(&self, logits: &Tensor, saved: &mut Vec<Tensor>) -> Result<Tensor> {
        // Tape ops on the logits' device (nothing goes through host memory), not recorded:
        // this op's backward is its own.
        let rows = self.targets.len();
        let width = logits.shape().last().copied().unwrap_or(1);
        let x = logits.detach().reshape(&[rows, width])?;
        let all_reduce = |t: Tensor, op: ReduceOp| {
            t.updated_by(|buf| self.group.all_reduce(buf, op).map_err(Error::from))
        };
        let max = all_reduce(x.max_dim(1, false)?, ReduceOp::Max)?;
        // Per row: Σ exp(x − max), Σ x, and the target logit (0 on ranks without it), in
        // one SUM all-reduce.
        let sum_exp = x.sub(&max.reshape(&[rows, 1])?)?.exp()?.sum_dim(1, false)?;
        let sum_x = x.sum_dim(1, false)?;
        let flat_ids: Vec<usize> = (self.targets.iter().enumerate())
            .map(|(row, target)| row * width + target.unwrap_or(0))
            .collect();
        let elsewhere = row_mask(self.targets.iter().map(Option::is_none))?;
        let target = x
            .reshape(&[rows * width, 1])?
            .embedding(&flat_ids, &[rows])?
            .reshape(&[rows])?
            .masked_fill(&elsewhere, 0.0)?;
        let sums = all_reduce(
            Tensor::concat(&[&sum_exp, &sum_x, &target], 0)?,
            ReduceOp::Sum,
        )?;
        let part = |i: usize| sums.narrow(0, i * rows, rows);
        let lse = part(0)?.log()?.add(&max)?;
        let eps = self.options.label_smoothing;
        let mut losses = lse.sub(&part(2)?)?.scale(1.0 - eps)?;
        if eps > 0.0 {
            let smooth = lse.sub(&part(1)?.scale(1.0 / self.vocab_size as f64)?)?;
            losses = losses.add(&smooth.scale(eps)?)?;
        }
        let losses = losses.masked_fill(&row_mask(self.kept.iter().map(|&k| !k))?, 0.0)?;
        saved.push(logits.clone());
        saved.push(lse);
        Ok(match self.options.reduction {
            Reduction::None => losses.reshape(&self.lead_shape)?,
            Reduction::Sum => losses.sum()?,
            Reduction::Mean => losses.sum()?.scale(1.0 / f64::from(self.mean_divisor()))?,
        })
    }

    fn backward_inner(&self, grad_output: &Tensor, saved: &[Tensor]) -> Result<Tensor> {
        let [logits, log_norm] = saved else {
            return Err(Error::config(OP, "backward is missing its saved tensors"));
        };
        let rows = self.targets.len();
        let (upstream, divisor) = match self.options.reduction {
            Reduction::None => (grad_output.reshape(&[rows])?, 1.0),
            Reduction::Sum => (grad_output.clone(), 1.0),
            Reduction::Mean => (grad_output.clone(), f64::from(self.mean_divisor())),
        };
        let targets: Vec<RowTarget> = (self.targets.iter().zip(&self.kept))
            .map(|(&target, &kept)| match (kept, target) {
                (false, _) => RowTarget::Ignored,
                (true, Some(column)) => RowTarget::Here(column),
                (true, None) => RowTarget::Elsewhere,
            })
            .collect();
        let width = logits.shape().last().copied().unwrap_or(1);
        let grad = logits
            .detach()
            .reshape(&[rows, width])?
            .cross_entropy_grad(
                log_norm,
                &targets,
                &upstream.detach(),
                divisor,
                self.options.label_smoothing,
                self.vocab_size,
            )?;
        Ok(grad.reshape(logits.shape())?)
    }
}

/// A `[rows]` mask, true where `masked` says.
fn row_mask(masked: impl ExactSizeIterator<Item = bool>) -> Result<ArrayD<bool>> {
    let rows = masked.len();
    ArrayD::from_shape_vec(IxDyn(&[rows]), masked.collect())
        .map_err(|e| Error::shape(OP, &[rows], e.to_string()))
}

impl CustomOp for VocabParallelCrossEntropy {
    fn name(&self) -> &str {
        OP
    }

    fn forward(
        &self,
        inputs: &[Tensor],
        saved: &mut Vec<Tensor>,
    ) -> ferrotron_tape::Result<Tensor> {
        let logits = inputs
            .first()
            .ok_or_else(|| ferrotron_tape::Error::custom(OP, "takes one input, the logits"))?;
        self.forward_inner(logits, saved)
            .map_err(|e| ferrotron_tape::Error::custom(OP, e))
    }

    fn backward(
        &self,
        grad_output: &Tensor,
        saved: &[Tensor],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor>>> {
        let grad = self
            .backward_inner(grad_output, saved)
            .map_err(|e| ferrotron_tape::Error::custom(OP, e))?;
        Ok(vec![Some(grad)])
    }
}
