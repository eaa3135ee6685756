//! Megatron's blends: `--data-path 0.3 a 0.7 b` draws 30% of the samples from `a` and 70%
//! from `b`, interleaved by a greedy rule that keeps every prefix of the samples as close
//! to those weights as it can.

use crate::error::{Error, Result};
use crate::gpt::GptDataset;
use std::path::PathBuf;

/// The datasets of a `--data-path` list and their normalized weights: `PREFIX`, or
/// `W1 PREFIX1 W2 PREFIX2 …`. A list of prefixes without weights weighs them equally.
pub fn parse_blend(words: &[String]) -> Result<Vec<(f64, PathBuf)>> {
    let weighted =
        words.len().is_multiple_of(2) && words.chunks(2).all(|p| p[0].parse::<f64>().is_ok());
    let pairs: Vec<(f64, PathBuf)> = match weighted && !words.is_empty() {
        true => words
            .chunks(2)
            // `weighted` parsed every first word of a pair.
            .map(|p| (p[0].parse().unwrap_or(0.0), PathBuf::from(p[1].trim())))
            .collect(),
        false => words
            .iter()
            .map(|w| (1.0, PathBuf::from(w.trim())))
            .collect(),
    };
    let sum: f64 = pairs.iter().map(|p| p.0).sum();
    if pairs.is_empty() || pairs.iter().any(|p| p.0 < 0.0 || !p.0.is_finite()) || sum <= 0.0 {
        return Err(Error::Invalid(format!(
            "--data-path {}: give one dataset prefix, or weights and prefixes in pairs \
             (0.3 a 0.7 b) with non-negative weights that do not all vanish",
            words.join(" ")
        )));
    }
    Ok(pairs.into_iter().map(|(w, p)| (w / sum, p)).collect())
}

/// The samples each dataset of a blend must give for `samples` in all: `ceil(samples ·
/// weight)`, and Megatron asks each dataset for half a percent more so that rounding
/// never runs one short.
pub fn component_samples(weights: &[f64], samples: usize) -> Vec<(usize, usize)> {
    weights
        .iter()
        .map(|&w| {
            let target = (samples as f64 * w).ceil() as usize;
            (target, (target as f64 * 1.005).ceil() as usize)
        })
        .collect()
}

/// For each of `size` samples, the dataset it comes from and its index there: the
/// dataset furthest behind its share (`weight · max(s, 1)` less what it gave), the first
/// of equals.
pub fn blending_indices(weights: &[f64], size: usize) -> Vec<(usize, usize)> {
    let mut given = vec![0usize; weights.len()];
    (0..size)
        .map(|s| {
            let x = s.max(1) as f64;
            let mut best = 0;
            let mut behind = weights[0] * x - given[0] as f64;
            for (k, &w) in weights.iter().enumerate().skip(1) {
                let error = w * x - given[k] as f64;
                if error > behind {
                    (best, behind) = (k, error);
                }
            }
            given[best] += 1;
            (best, given[best] - 1)
        })
        .collect()
}

/// Several GPT datasets served as one, in the blend's order.
pub struct Blend {
    datasets: Vec<GptDataset>,
    index: Vec<(usize, usize)>,
}

impl Blend {
    /// `datasets` (built for [`component_samples`]) blended by `weights` into `size`
    /// samples.
    pub fn new(datasets: Vec<GptDataset>, weights: &[f64], size: usize) -> Result<Blend> {
        let index = blending_indices(weights, size);
        for (k, dataset) in datasets.iter().enumerate() {
            let needed = index.iter().filter(|(d, _)| *d == k).count();
            if needed > dataset.len() {
                return Err(Error::Invalid(format!(
                    "blend component {k} gives {} samples but the blend needs {needed}",
                    dataset.len()
                )));
            }
        }
        Ok(Blend { datasets, index })
    }

    /// Samples it serves.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether it serves none.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Sample `i` and the dataset it came from.
    pub fn sample(&self, i: usize) -> Result<(usize, Vec<u32>)> {
        let &(dataset, j) = self.index.get(i).ok_or_else(|| {
            Error::Invalid(format!(
                "sample {i} of a blend of {} samples",
                self.index.len()
            ))
        })?;
        Ok((dataset, self.datasets[dataset].sample(j)?))
    }
}
