//! Data feeding: each data-parallel rank's rows of the global batches, cut into
//! microbatches, and the held-out loss.

use crate::data::{Corpus, DistributedSampler, Split};
use anyhow::Result;
use ferrotron_parallel_state::ParallelState;

use super::*;

/// This data-parallel rank's sampler: its rows of every global batch.
pub(super) fn sampler(
    corpus: &Corpus,
    config: &TrainConfig,
    state: &ParallelState,
) -> DistributedSampler {
    let sampler = DistributedSampler::new(
        corpus.training_windows(config.model.seq),
        config.seed,
        config.batch,
        state.dp_rank(),
        state.dp_size(),
    );
    match corpus.shuffled() {
        true => sampler,
        false => sampler.in_order(),
    }
}

/// One microbatch, sequence-first (`[seq, rows]` flattened): the input ids, their
/// next-token labels, and each token's position when not simply its index.
#[derive(Clone)]
pub(super) struct Microbatch {
    pub(super) ids: Vec<usize>,
    pub(super) labels: Vec<i64>,
    pub(super) positions: Option<Vec<usize>>,
}

/// This data-parallel rank's rows `starts` of a global batch of `split`, split into the
/// configured microbatches.
pub(super) fn microbatches(
    corpus: &Corpus,
    split: Split,
    starts: &[usize],
    config: &TrainConfig,
) -> Result<Vec<Microbatch>> {
    let seq = config.model.seq;
    let starts = by_microbatch(starts, config.rows_from_ranks, config.microbatches);
    let (inputs, mut targets) = corpus.rows(split, &starts, seq)?;
    if let Some(eod) = config.eod_mask {
        crate::data::mask_after_eod(&inputs, &mut targets, eod);
    }
    let positions =
        (config.reset_positions).map(|eod| crate::data::reset_positions(&inputs, seq, eod));
    let per = starts.len() / config.microbatches * seq;
    Ok((0..config.microbatches)
        .map(|m| {
            let part = m * per..(m + 1) * per;
            Microbatch {
                ids: sequence_first(&inputs[part.clone()], seq),
                labels: sequence_first(&targets[part.clone()], seq),
                positions: (positions.as_ref()).map(|p| sequence_first(&p[part], seq)),
            }
        })
        .collect())
}

/// The mean loss over the held-out windows: `eval_batches` global batches, each
/// data-parallel rank evaluating its rows of each, the token mean taken over all of them.
pub(super) fn validation_loss(chunks: &mut Chunks<'_>, corpus: &Corpus) -> Result<f32> {
    let config = chunks.config;
    let (dp_rank, dp_size) = (chunks.state.dp_rank(), chunks.state.dp_size());
    let global_batch = config.batch * dp_size;
    let starts = corpus.validation_starts(config.model.seq, global_batch * config.eval_batches);
    let mut total = 0.0;
    for batch in starts.chunks(global_batch) {
        let rows = &batch[dp_rank * config.batch..(dp_rank + 1) * config.batch];
        let microbatches = microbatches(corpus, Split::Validation, rows, config)?;
        total += chunks.loss(&microbatches, Pass::Evaluate, false)?.0;
    }
    Ok(total / config.eval_batches as f32)
}

/// `starts`, `ranks` ranks' rows one after the other, reordered so that each of
/// `microbatches` contiguous slices holds every rank's share of that microbatch.
pub(super) fn by_microbatch(starts: &[usize], ranks: usize, microbatches: usize) -> Vec<usize> {
    let per_rank = starts.len() / ranks.max(1);
    let share = per_rank / microbatches.max(1);
    (0..microbatches)
        .flat_map(|m| {
            (0..ranks).flat_map(move |r| {
                let first = r * per_rank + m * share;
                starts[first..first + share].iter().copied()
            })
        })
        .collect()
}

/// Row-major `[rows, seq]` to sequence-first `[seq, rows]`.
pub(super) fn sequence_first<T: Copy>(rows: &[T], seq: usize) -> Vec<T> {
    let batch = rows.len() / seq;
    (0..seq)
        .flat_map(|s| (0..batch).map(move |b| rows[b * seq + s]))
        .collect()
}
