//! Megatron's `--split`: weights such as `969,30,1` cut a dataset's sequences into
//! training, validation and test ranges, in that order.

use crate::error::{Error, Result};
use std::ops::Range;

/// The three weights of `text` (`"969,30,1"`, `"98, 2"`; missing ones are 0), normalized
/// to sum to 1.
pub fn parse_split(text: &str) -> Result<[f64; 3]> {
    let invalid = || {
        Error::Invalid(format!(
            "--split {text:?}: give up to three non-negative weights for training, \
             validation and test, e.g. 969,30,1"
        ))
    };
    let mut weights = [0.0f64; 3];
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    if parts.len() > 3 {
        return Err(invalid());
    }
    for (weight, part) in weights.iter_mut().zip(&parts) {
        *weight = part.parse().map_err(|_| invalid())?;
        if !weight.is_finite() || *weight < 0.0 {
            return Err(invalid());
        }
    }
    let sum: f64 = weights.iter().sum();
    if sum <= 0.0 {
        return Err(invalid());
    }
    Ok(weights.map(|w| w / sum))
}

/// The sequence ranges of `sequences` that the normalized `weights` give, as Megatron
/// rounds them (half to even).
pub fn split_ranges(weights: [f64; 3], sequences: usize) -> [Range<usize>; 3] {
    let bounds = [
        0.0,
        weights[0],
        weights[0] + weights[1],
        weights[0] + weights[1] + weights[2],
    ];
    let at = |fraction: f64| (fraction * sequences as f64).round_ties_even() as usize;
    std::array::from_fn(|i| match bounds[i + 1] <= bounds[i] {
        true => at(bounds[i])..at(bounds[i]),
        false => at(bounds[i])..at(bounds[i + 1]).min(sequences),
    })
}
