//! One rank's training loop: tensor parallelism inside the model, data parallelism through
//! DDP over the data-parallel group, AdamW, and text sampling at the end.

use crate::data::Corpus;
use crate::model::{Gpt, GptConfig};
use crate::report::Progress;
use anyhow::Result;
use comm_core::{Communicator, CommunicatorExt, ReduceOp};
use ddp::{DdpConfig, DistributedDataParallel, NamedGroupReduction};
use layers::{Module, RngTracker, TensorParallel};
use parallel_state::{ParallelState, RankLayout};
use std::path::PathBuf;
use std::sync::Arc;
use tape::{AdamW, AdamWConfig, Generator, Optimizer, Tape};

/// Text the trained model continues, one sample each.
const PROMPTS: &[&str] = &["The tensor", "Each rank ", "pub fn new"];
/// Bytes generated per prompt.
const SAMPLE_BYTES: usize = 80;
/// Sampling temperature: below 1 for readable text, above 0 so it does not loop.
const TEMPERATURE: f32 = 0.8;

#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub model: GptConfig,
    pub tp: usize,
    pub sequence_parallel: bool,
    /// Where parameters and activations live.
    pub device: tape::Device,
    /// Rows of the batch each data-parallel rank trains on.
    pub batch: usize,
    pub steps: usize,
    pub seed: u64,
    pub lr: f64,
    pub resume: Option<PathBuf>,
    pub save: Option<PathBuf>,
    pub sample: bool,
}

/// What a rank brings back: the global mean loss of every step, and sampled text.
pub struct RankResult {
    pub losses: Vec<f32>,
    pub samples: Vec<String>,
}

/// Trains on every rank of `world` (tensor-parallel size `config.tp`, the rest data
/// parallel). World rank 0 reports to `progress`.
pub fn train_rank(
    world: Arc<dyn Communicator>,
    config: &TrainConfig,
    corpus: &Corpus,
    progress: Option<&Progress>,
) -> Result<RankResult> {
    let layout = RankLayout::builder(world.size()).tp(config.tp).build()?;
    let state = ParallelState::new(world, layout)?;
    let tp = TensorParallel::from_state(&state).with_sequence_parallel(config.sequence_parallel);
    let model = Gpt::new(&tp, config.model, config.seed)?;
    if let Some(dir) = &config.resume {
        model.load(dir)?;
    }
    for sharded in model.parameters() {
        let value = sharded.param.value().to_device(config.device)?;
        sharded.param.set_value(value)?;
    }

    // DDP averages every gradient over "dp"; parameters that saw only this rank's part of
    // the sequence (sequence parallelism) are also summed over "tp" by the hook.
    let params = model.parameters();
    let mut hook = NamedGroupReduction::new();
    for sharded in &params {
        if let Some(group) = sharded.grad_reduce_group {
            hook.mark(&state, &sharded.param, &[group])?;
        }
    }
    let params: Vec<_> = params.into_iter().map(|p| p.param).collect();
    let ddp = DistributedDataParallel::new(
        params.clone(),
        state.dp().clone(),
        DdpConfig {
            comm_hook: Arc::new(hook),
            ..DdpConfig::default()
        },
    )?;
    let mut optimizer = AdamW::new(
        params,
        AdamWConfig {
            lr: config.lr,
            ..AdamWConfig::default()
        },
    );
    // No dropout is configured, so the streams are never drawn from; the blocks still
    // take a tracker, seeded as Megatron seeds it.
    let mut rng = RngTracker::new(config.seed, tp.rank());

    let (dp_rank, dp_size) = (state.dp_rank(), state.dp_size());
    let seq = config.model.seq;
    let mut losses = Vec::with_capacity(config.steps);
    for step in 0..config.steps {
        let (inputs, targets) = corpus.batch(config.seed, step, config.batch * dp_size, seq);
        // This rank's rows of the global batch, transposed to the layers' [seq, batch].
        let rows = dp_rank * config.batch..(dp_rank + 1) * config.batch;
        let ids = sequence_first(&inputs[rows.start * seq..rows.end * seq], seq);
        let labels = sequence_first(&targets[rows.start * seq..rows.end * seq], seq);

        optimizer.set_lr(learning_rate(config.lr, step, config.steps));
        optimizer.zero_grad();
        let tape = Tape::new();
        let logits = model.forward(&tape, &ids, seq, config.batch, &mut rng)?;
        let loss = model.loss(&logits, &labels)?;
        ddp.backward(&loss)?;
        optimizer.step()?;

        // Every rank's mean is over the same number of rows, so their average over the
        // data-parallel group is the mean over the global batch.
        let mut global = [loss.item()?];
        state.dp().all_reduce_slice(&mut global, ReduceOp::Avg)?;
        losses.push(global[0]);
        if let Some(progress) = progress {
            progress.step(step + 1, global[0]);
        }
    }
    if let Some(progress) = progress {
        progress.finish();
    }

    // Data-parallel replicas are identical: one of them writes the tensor-parallel shards.
    if let (Some(dir), 0) = (&config.save, dp_rank) {
        model.save(dir)?;
    }
    let mut samples = Vec::new();
    if config.sample {
        let mut generator = Generator::new(config.seed);
        for prompt in PROMPTS {
            let text = generate(&model, prompt.as_bytes(), &mut generator, &mut rng)?;
            samples.push(String::from_utf8_lossy(&text).into_owned());
        }
    }
    Ok(RankResult { losses, samples })
}

/// Row-major `[rows, seq]` to sequence-first `[seq, rows]`.
fn sequence_first<T: Copy>(rows: &[T], seq: usize) -> Vec<T> {
    let batch = rows.len() / seq;
    (0..seq)
        .flat_map(|s| (0..batch).map(move |b| rows[b * seq + s]))
        .collect()
}

/// A linear warm-up over a tenth of the steps (at least 20, at most half), then cosine
/// decay to a tenth of `peak`: a small model on a small corpus reaches a lower loss in few
/// steps than with a constant rate, and short runs do not start with loss spikes (which
/// would also amplify the f32 rounding differences `--check` measures).
fn learning_rate(peak: f64, step: usize, steps: usize) -> f64 {
    let warmup = (steps / 10).max(20.min(steps / 2)).max(1);
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (steps - warmup).max(1) as f64;
    peak * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()))
}

/// Continues `prompt` by [`SAMPLE_BYTES`] bytes. Every tensor-parallel rank gathers the
/// full last-position logits and draws from the same generator, so they agree on each byte.
fn generate(
    model: &Gpt,
    prompt: &[u8],
    generator: &mut Generator,
    rng: &mut RngTracker,
) -> Result<Vec<u8>> {
    let GptConfig { vocab, seq, .. } = model.config();
    let group = model.tp().group();
    let sizes = mappings::split_sizes(vocab, group.size())?;
    let mut text = prompt.to_vec();
    for _ in 0..SAMPLE_BYTES {
        let context = &text[text.len().saturating_sub(seq)..];
        let ids: Vec<usize> = context.iter().map(|&b| usize::from(b)).collect();
        let tape = Tape::new();
        let logits = tape.no_grad(|| -> Result<_> {
            let logits = model.forward(&tape, &ids, ids.len(), 1, rng)?;
            let last = logits.narrow(0, ids.len() - 1, 1)?;
            Ok(mappings::gather_from_region(&last, group, 2, Some(&sizes))?.to_vec()?)
        })?;
        text.push(sample(&logits, generator));
    }
    Ok(text)
}

/// Draws a byte from `softmax(logits / TEMPERATURE)`.
fn sample(logits: &[f32], generator: &mut Generator) -> u8 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&l| f64::from((l - max) / TEMPERATURE).exp())
        .collect();
    let mut threshold = generator.uniform() * weights.iter().sum::<f64>();
    for (byte, weight) in weights.iter().enumerate() {
        threshold -= weight;
        if threshold <= 0.0 {
            return byte as u8;
        }
    }
    (weights.len() - 1) as u8
}
