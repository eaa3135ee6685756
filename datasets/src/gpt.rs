//! Megatron's GPT dataset: samples of `seq + 1` tokens cut from one split's sequences laid
//! end to end, over as many epochs as the requested samples need, with the sequences of
//! each epoch and then the samples shuffled by `RandomState(seed)` exactly as Megatron
//! shuffles them, so a run sees Megatron's samples in Megatron's order.

use crate::error::{Error, Result};
use crate::indexed::IndexedDataset;
use crate::random::RandomState;
use std::ops::Range;
use std::sync::Arc;

/// How samples are cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    /// Tokens a sample feeds the model; it holds one more, the last target.
    pub seq: usize,
    /// Megatron's `--seed` (1234 by default there).
    pub seed: u32,
}

/// One split of an indexed dataset as shuffled samples.
pub struct GptDataset {
    dataset: Arc<IndexedDataset>,
    /// Sequence ids, epoch after epoch, each epoch shuffled.
    documents: Vec<u32>,
    /// Where sample `i` starts: a position in `documents` and a token offset there.
    starts: Vec<(usize, usize)>,
    /// The order samples are served in.
    order: Vec<usize>,
    seq: usize,
}

impl GptDataset {
    /// At least `samples` samples (one epoch's worth when `None`) of the sequences
    /// `range` of `dataset`.
    pub fn new(
        dataset: Arc<IndexedDataset>,
        range: Range<usize>,
        samples: Option<usize>,
        config: GptConfig,
    ) -> Result<GptDataset> {
        let seq = config.seq;
        if seq == 0 || range.end > dataset.len() {
            return Err(Error::Invalid(format!(
                "{}: sequences {range:?} of {} with a sample length of {seq}",
                dataset.prefix().display(),
                dataset.len()
            )));
        }
        if range.end > u32::MAX as usize {
            return Err(Error::Invalid(format!(
                "{}: {} sequences; a GPT dataset indexes at most 2^32 (as Megatron's int32 \
                 document index does)",
                dataset.prefix().display(),
                range.end
            )));
        }
        let tokens: usize = range.clone().map(|i| dataset.length(i)).sum();
        if tokens <= seq {
            return Err(Error::Invalid(format!(
                "{}: sequences {range:?} hold {tokens} tokens, not one sample of {} \
                 (--seq {seq} and its target): use a larger split or a smaller --seq",
                dataset.prefix().display(),
                seq + 1
            )));
        }
        // The smallest number of epochs whose tokens give the samples and one extra token.
        let too_many = || {
            Error::Invalid(format!(
                "{samples:?} samples of {seq} tokens overflow this machine's integers"
            ))
        };
        let epochs = match samples {
            None => 1,
            Some(n) => (n.checked_mul(seq).and_then(|t| t.checked_add(1)))
                .ok_or_else(too_many)?
                .div_ceil(tokens)
                .max(1),
        };
        epochs.checked_mul(tokens).ok_or_else(too_many)?;
        let separate = separate_final_epoch(samples, epochs, tokens, seq);
        let mut random = RandomState::new(config.seed);
        let ids: Vec<u32> = range.map(|i| i as u32).collect();
        let documents = document_order(&ids, epochs, separate, &mut random);
        let count = (epochs * tokens - 1) / seq;
        let starts = sample_starts(&dataset, &documents, seq, count);
        let order = match separate {
            true => {
                let first = ((epochs - 1) * tokens - 1) / seq;
                let mut head: Vec<usize> = (0..first).collect();
                random.shuffle(&mut head);
                let mut tail: Vec<usize> = (first..count).collect();
                random.shuffle(&mut tail);
                head.extend(tail);
                head
            }
            false => {
                let mut all: Vec<usize> = (0..count).collect();
                random.shuffle(&mut all);
                all
            }
        };
        Ok(GptDataset {
            dataset,
            documents,
            starts,
            order,
            seq,
        })
    }

    /// Samples it serves.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether it serves none.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// Sample `i`: `seq + 1` tokens, the model's input and, shifted by one, its targets.
    pub fn sample(&self, i: usize) -> Result<Vec<u32>> {
        let j = *self.order.get(i).ok_or_else(|| {
            Error::Invalid(format!(
                "sample {i} of a dataset of {} samples",
                self.order.len()
            ))
        })?;
        let (mut position, mut offset) = self.starts[j];
        let mut tokens = Vec::with_capacity(self.seq + 1);
        while tokens.len() < self.seq + 1 {
            let id = self.documents[position] as usize;
            let take = (self.dataset.length(id) - offset).min(self.seq + 1 - tokens.len());
            self.dataset.read(id, offset, take, &mut tokens)?;
            position += 1;
            offset = 0;
        }
        Ok(tokens)
    }
}

/// Megatron shuffles the last epoch apart from the others when less than 80% of it is
/// needed, so that the samples it gives are not a biased handful of a whole shuffle.
fn separate_final_epoch(samples: Option<usize>, epochs: usize, tokens: usize, seq: usize) -> bool {
    let Some(samples) = samples else {
        return false;
    };
    if epochs == 1 {
        return false;
    }
    let before = ((epochs - 1) * tokens - 1) / seq;
    let last = samples.saturating_sub(before);
    let per_epoch = (tokens - 1) / seq;
    last < (0.80 * per_epoch as f64) as usize
}

fn document_order(
    ids: &[u32],
    epochs: usize,
    separate: bool,
    random: &mut RandomState,
) -> Vec<u32> {
    if separate {
        let mut head = document_order(ids, epochs - 1, false, random);
        head.extend(document_order(ids, 1, false, random));
        return head;
    }
    let mut order: Vec<u32> = (0..epochs).flat_map(|_| ids.iter().copied()).collect();
    random.shuffle(&mut order);
    order
}

/// Where each of `count` samples starts: sample `i` begins at token `i · seq` of the
/// sequences laid end to end (consecutive samples share one token, the target of the
/// one and the first input of the next).
fn sample_starts(
    dataset: &IndexedDataset,
    documents: &[u32],
    seq: usize,
    count: usize,
) -> Vec<(usize, usize)> {
    let mut starts = Vec::with_capacity(count + 1);
    let (mut position, mut begins) = (0usize, 0usize);
    for i in 0..=count {
        let at = i * seq;
        // Skip sequences that end at or before the sample's first token (empty ones too).
        while begins + dataset.length(documents[position] as usize) <= at
            && position + 1 < documents.len()
        {
            begins += dataset.length(documents[position] as usize);
            position += 1;
        }
        starts.push((position, at - begins));
    }
    starts
}
