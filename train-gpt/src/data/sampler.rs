//! Which rows each data-parallel rank reads of every global batch, and the
//! per-document masks and positions Megatron derives from end-of-document tokens.

use ferrotron_tape::Generator;

/// Which training windows each data-parallel rank reads (a distributed sampler, as
/// Megatron's pretraining sampler): every epoch visits all windows of the training split
/// once in an order drawn from the seed and the epoch; step `s` takes the global batch of
/// samples `s · global_batch ..`, and each rank reads only its contiguous rows of it. The
/// samples depend on the step and the global batch alone, so any data-parallel size sees
/// the same global batches, and a resumed run continues where the saved one stopped.
pub struct DistributedSampler {
    windows: usize,
    /// Whether each epoch visits the windows in a shuffled order (or in order, for data
    /// that comes shuffled).
    shuffled: bool,
    seed: u64,
    global_batch: usize,
    rows: std::ops::Range<usize>,
    /// The permutation of the epoch last used, drawn once per epoch.
    epoch: Option<(usize, Vec<usize>)>,
}

impl DistributedSampler {
    /// The sampler of data-parallel rank `dp_rank`, which trains on `batch` rows of every
    /// global batch of `batch · dp_size`.
    pub fn new(windows: usize, seed: u64, batch: usize, dp_rank: usize, dp_size: usize) -> Self {
        DistributedSampler {
            windows,
            shuffled: true,
            seed,
            global_batch: batch * dp_size,
            rows: dp_rank * batch..(dp_rank + 1) * batch,
            epoch: None,
        }
    }

    /// The same sampler reading the windows in order, as Megatron's pretraining sampler
    /// reads its already shuffled datasets.
    pub fn in_order(self) -> Self {
        DistributedSampler {
            shuffled: false,
            ..self
        }
    }

    /// This rank's window starts for step `step` (counted from 0).
    pub fn starts(&mut self, step: usize) -> Vec<usize> {
        if !self.shuffled {
            let first = step * self.global_batch;
            return self
                .rows
                .clone()
                .map(|row| (first + row) % self.windows)
                .collect();
        }
        self.rows
            .clone()
            .map(|row| {
                let sample = step * self.global_batch + row;
                let (epoch, position) = (sample / self.windows, sample % self.windows);
                self.order(epoch)[position]
            })
            .collect()
    }

    fn order(&mut self, epoch: usize) -> &[usize] {
        if self.epoch.as_ref().map(|(e, _)| *e) != Some(epoch) {
            let mut generator =
                Generator::new(self.seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut order: Vec<usize> = (0..self.windows).collect();
            // Fisher–Yates.
            for i in (1..order.len()).rev() {
                let j = (generator.next_u64() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
            self.epoch = Some((epoch, order));
        }
        self.epoch.as_ref().map_or(&[], |(_, order)| order)
    }
}

/// The label ignored by the loss (the cross-entropy's default ignore index).
const IGNORED: i64 = -100;

/// Leaves out of the loss each position whose input is `eod`, as Megatron's
/// `--eod-mask-loss` masks by the input token: the model is not trained to predict a
/// document's first token from the previous one's end.
pub fn mask_after_eod(inputs: &[usize], targets: &mut [i64], eod: u32) {
    for (input, target) in inputs.iter().zip(targets) {
        if *input == eod as usize {
            *target = IGNORED;
        }
    }
}

/// Each row's positions (`inputs` row-major, `seq` per row) counted from 0 again after
/// every `eod`, as Megatron's `--reset-position-ids`: the end-of-document token keeps its
/// document's position, the next token starts at 0.
pub fn reset_positions(inputs: &[usize], seq: usize, eod: u32) -> Vec<usize> {
    let mut positions = Vec::with_capacity(inputs.len());
    for row in inputs.chunks(seq) {
        let mut start = 0;
        for (j, &token) in row.iter().enumerate() {
            positions.push(j - start);
            if token == eod as usize {
                start = j + 1;
            }
        }
    }
    positions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_read_disjoint_parts_of_the_same_global_batches() {
        let windows = 37;
        let mut serial = DistributedSampler::new(windows, 5, 6, 0, 1);
        let mut ranks: Vec<_> = (0..3)
            .map(|r| DistributedSampler::new(windows, 5, 2, r, 3))
            .collect();
        let mut seen = Vec::new();
        for step in 0..13 {
            let joined: Vec<usize> = ranks.iter_mut().flat_map(|r| r.starts(step)).collect();
            assert_eq!(joined, serial.starts(step), "step {step}");
            seen.extend(joined);
        }
        // The first epoch (37 samples) visits every window exactly once.
        let mut first: Vec<usize> = seen[..windows].to_vec();
        first.sort_unstable();
        assert_eq!(first, (0..windows).collect::<Vec<_>>());
        assert_ne!(
            seen[..windows],
            seen[windows..2 * windows],
            "epochs differ in order"
        );
    }

    #[test]
    fn eod_masking_goes_by_the_input_token_as_megatron_does() {
        let eod = 1;
        // Two documents: "5 6 <eod>" then "7 8"; the window's targets are the next ids.
        let inputs = [5, 6, 1, 7];
        let mut targets = [6, 1, 7, 8];
        mask_after_eod(&inputs, &mut targets, eod);
        // Predicting the end is trained; predicting the next document's first token
        // from the end is not.
        assert_eq!(targets, [6, 1, IGNORED, 8]);
    }

    #[test]
    fn positions_restart_after_each_end_of_document_as_megatron_resets_them() {
        let eod = 1;
        // Two rows of 5: a document ending mid-row, then two ends in a row and one last.
        let inputs = [5, 6, 1, 7, 8, 1, 1, 9, 3, 1];
        assert_eq!(
            reset_positions(&inputs, 5, eod),
            [0, 1, 2, 0, 1, 0, 0, 0, 1, 2]
        );
        // No end: the plain positions of each row.
        assert_eq!(reset_positions(&[4, 4, 4, 4], 2, eod), [0, 1, 0, 1]);
    }
}
