//! The byte-level training corpus: the project's own documentation by default, or any
//! text file, cut into deterministic (input, target) windows.

use anyhow::{bail, Context, Result};
use std::path::Path;
use tape::Generator;

/// Byte-level vocabulary: every byte value is a token.
pub const VOCAB: usize = 256;

/// The documentation that ships with the repository: always there, about 20 KB of
/// English and Rust, enough for a small model's loss to fall visibly in a minute.
const BUILTIN: &[&str] = &[
    include_str!("../../README.md"),
    include_str!("../../ARCHITECTURE.md"),
    include_str!("../../docs/src/getting-started.md"),
    include_str!("../../docs/src/comm-core.md"),
    include_str!("../../docs/src/troubleshooting.md"),
];

pub struct Corpus {
    bytes: Vec<u8>,
    /// Where the held-out split starts: the last tenth of the bytes.
    validation_start: usize,
    pub source: String,
}

/// Fraction of the corpus (its end) held out for the validation loss.
const VALIDATION_FRACTION: f64 = 0.1;

impl Corpus {
    pub fn builtin() -> Corpus {
        Corpus::new(
            BUILTIN.concat().into_bytes(),
            "built-in documentation corpus".into(),
        )
    }

    /// Reads `path`; it must hold more than one training window of text.
    pub fn from_file(path: &Path, window: usize) -> Result<Corpus> {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read the corpus file {}", path.display()))?;
        if bytes.is_empty() {
            bail!(
                "the corpus file {} is empty; pass a text file",
                path.display()
            );
        }
        if bytes.len() <= window {
            bail!(
                "the corpus file {} has {} bytes, but one training window needs {}; pass a \
                 longer file or a smaller --seq",
                path.display(),
                bytes.len(),
                window + 1
            );
        }
        Ok(Corpus::new(bytes, path.display().to_string()))
    }

    fn new(bytes: Vec<u8>, source: String) -> Corpus {
        let held_out = (bytes.len() as f64 * VALIDATION_FRACTION) as usize;
        Corpus {
            validation_start: bytes.len() - held_out,
            bytes,
            source,
        }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Checks that both splits hold at least one window of `seq` tokens and its targets.
    pub fn check_window(&self, seq: usize) -> Result<()> {
        let (train, validation) = (self.validation_start, self.len() - self.validation_start);
        if train.min(validation) <= seq {
            bail!(
                "the {} has {} bytes: {train} for training and {validation} held out for \
                 validation, and each split needs more than one window of --seq {seq}; pass \
                 a smaller --seq or a longer --data file",
                self.source,
                self.len()
            );
        }
        Ok(())
    }

    /// Window starts in the training split.
    pub fn training_windows(&self, seq: usize) -> usize {
        self.validation_start - seq
    }

    /// `count` windows spread evenly over the held-out split, the same in every run.
    pub fn validation_starts(&self, seq: usize, count: usize) -> Vec<usize> {
        let windows = self.len() - self.validation_start - seq;
        (0..count)
            .map(|k| self.validation_start + k * windows / count)
            .collect()
    }

    /// The windows starting at `starts`: `seq` input tokens each, row after row, and their
    /// next-token targets.
    pub fn rows(&self, starts: &[usize], seq: usize) -> (Vec<usize>, Vec<i64>) {
        let mut inputs = Vec::with_capacity(starts.len() * seq);
        let mut targets = Vec::with_capacity(starts.len() * seq);
        for &start in starts {
            let window = &self.bytes[start..start + seq + 1];
            inputs.extend(window[..seq].iter().map(|&b| b as usize));
            targets.extend(window[1..].iter().map(|&b| b as i64));
        }
        (inputs, targets)
    }
}

/// Which training windows each data-parallel rank reads (a distributed sampler, as
/// Megatron's pretraining sampler): every epoch visits all windows of the training split
/// once in an order drawn from the seed and the epoch; step `s` takes the global batch of
/// samples `s · global_batch ..`, and each rank reads only its contiguous rows of it. The
/// samples depend on the step and the global batch alone, so any data-parallel size sees
/// the same global batches, and a resumed run continues where the saved one stopped.
pub struct DistributedSampler {
    windows: usize,
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
            seed,
            global_batch: batch * dp_size,
            rows: dp_rank * batch..(dp_rank + 1) * batch,
            epoch: None,
        }
    }

    /// This rank's window starts for step `step` (counted from 0).
    pub fn starts(&mut self, step: usize) -> Vec<usize> {
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
}
