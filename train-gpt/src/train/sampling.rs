//! Text sampled from the trained model at the end of a run.

use crate::data::Corpus;
use anyhow::Result;
use ferrotron_comm_core::CommunicatorExt;
use ferrotron_tape::Generator;

use super::*;

/// Text the trained model writes after each of [`PROMPTS`].
pub(super) fn samples(chunks: &mut Chunks<'_>, corpus: &Corpus) -> Result<Vec<String>> {
    let mut generator = Generator::new(chunks.config.seed);
    PROMPTS
        .iter()
        .map(|prompt| {
            let ids = corpus.vocabulary.encode(prompt)?;
            let text = generate(chunks, &ids, &mut generator)?;
            Ok(corpus.vocabulary.decode(&text))
        })
        .collect()
}

/// Continues `prompt` by [`SAMPLE_TOKENS`] tokens. The last stage's tensor-parallel ranks
/// gather the full last-position logits and draw from the same generator, so they agree
/// on each token, which they broadcast to the other stages.
pub(super) fn generate(
    chunks: &mut Chunks<'_>,
    prompt: &[u32],
    generator: &mut Generator,
) -> Result<Vec<u32>> {
    let (seq, vocab) = (chunks.config.model.seq, chunks.config.model.valid_vocab);
    let mut text = prompt.to_vec();
    for _ in 0..SAMPLE_TOKENS {
        let context = &text[text.len().saturating_sub(seq)..];
        let ids: Vec<usize> = context.iter().map(|&t| t as usize).collect();
        let mut token = [chunks
            .last_logits(&ids)?
            .map_or(0, |logits| i64::from(sample(&logits[..vocab], generator)))];
        chunks
            .state
            .pp()
            .broadcast_slice(&mut token, chunks.config.pp - 1)?;
        text.push(token[0] as u32);
    }
    Ok(text)
}

/// Draws a token from `softmax(logits / TEMPERATURE)`.
pub(super) fn sample(logits: &[f32], generator: &mut Generator) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| f64::from((l - max) / TEMPERATURE).exp())
        .collect();
    let mut threshold = generator.uniform() * weights.iter().sum::<f64>();
    for (token, weight) in weights.iter().enumerate() {
        threshold -= weight;
        if threshold <= 0.0 {
            return token as u32;
        }
    }
    (weights.len() - 1) as u32
}
