//! One rank's training loop: tensor parallelism inside the model, data parallelism through
//! DDP over the data-parallel group, AdamW on a learning-rate schedule, a held-out
//! validation loss, exact resume, and text sampling at the end.

use crate::checkpoint::{self, TrainerState};
use crate::data::{Corpus, DistributedSampler};
use crate::model::{Gpt, GptConfig};
use crate::report::Progress;
use anyhow::{bail, Result};
use comm_core::{Communicator, CommunicatorExt};
use ddp::{DdpConfig, DistributedDataParallel};
use layers::{Module, RngTracker, TensorParallel};
use parallel_state::{ParallelState, RankLayout};
use std::path::PathBuf;
use std::sync::Arc;
use tape::{AdamW, AdamWConfig, Generator, LrDecay, LrSchedule, Optimizer, Tape};

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
    /// Pipeline stages; the layers are split evenly over `pp × chunks` parts.
    pub pp: usize,
    /// How each step drives its microbatches through the stages.
    pub pipeline: pipeline::Schedule,
    /// Microbatches per step: each data-parallel rank's rows, split evenly.
    pub microbatches: usize,
    /// Record the last step's timeline (returned in [`RankResult::timeline`]).
    pub trace: bool,
    pub sequence_parallel: bool,
    /// Where parameters and activations live.
    pub device: tape::Device,
    /// Rows of the batch each data-parallel rank trains on.
    pub batch: usize,
    /// The step to end at (counted from the start of the run, resumed steps included).
    pub steps: usize,
    pub seed: u64,
    pub schedule: Schedule,
    /// Validation loss every this many steps (and after the last one); 0 turns it off.
    pub eval_interval: usize,
    /// Global batches of held-out windows each validation runs.
    pub eval_batches: usize,
    pub resume: Option<PathBuf>,
    pub save: Option<PathBuf>,
    pub sample: bool,
}

/// The learning-rate schedule's settings (see [`LrSchedule::new`]).
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub lr: f64,
    pub min_lr: f64,
    pub warmup_steps: u64,
    pub decay_steps: u64,
    pub decay: LrDecay,
}

/// What a rank brings back: the global mean loss of every step (resumed ones included),
/// the validation losses by step, and sampled text.
pub struct RankResult {
    pub losses: Vec<f32>,
    pub validation: Vec<(usize, f32)>,
    pub samples: Vec<String>,
    /// Pipeline rank, tensor-parallel rank and data-parallel rank of this rank, and its
    /// timeline of the last step if tracing.
    pub coordinates: (usize, usize, usize),
    pub timeline: Vec<pipeline::Span>,
}

/// Trains on every rank of `world` (tensor-parallel size `config.tp`, the rest data
/// parallel). World rank 0 reports to `progress`.
pub fn train_rank(
    world: Arc<dyn Communicator>,
    config: &TrainConfig,
    corpus: &Corpus,
    progress: Option<&Progress>,
) -> Result<RankResult> {
    let layout = RankLayout::builder(world.size())
        .tp(config.tp)
        .pp(config.pp)
        .build()?;
    let state = ParallelState::new(world.clone(), layout)?;
    let tp = TensorParallel::from_state(&state).with_sequence_parallel(config.sequence_parallel);
    // This rank's model chunks: chunk c holds virtual stage c·pp + pp rank's blocks.
    let chunks = config.pipeline.chunks();
    let per_part = config.model.layers / (config.pp * chunks);
    let models = (0..chunks)
        .map(|c| {
            let part = c * config.pp + state.pp_rank();
            Gpt::chunk(
                &tp,
                config.model,
                config.seed,
                part * per_part..(part + 1) * per_part,
            )
        })
        .collect::<Result<Vec<_>>>()?;
    // Without pipeline parallelism the one chunk is the whole model, which validation,
    // checkpoints and sampling use.
    let whole = (config.pp == 1).then(|| &models[0]);
    let (dp_rank, dp_size) = (state.dp_rank(), state.dp_size());
    let global_batch = config.batch * dp_size;
    let saved = match (&config.resume, whole) {
        (Some(dir), Some(model)) => {
            let saved = TrainerState::read(dir)?;
            saved.check_compatible(&config.model, global_batch, config.steps)?;
            model.load(dir, saved.tp)?;
            Some(saved)
        }
        (Some(_), None) => bail!("--resume does not support --pp > 1 yet"),
        (None, _) => None,
    };
    for sharded in models.iter().flat_map(Module::parameters) {
        let value = sharded.param.value().to_device(config.device)?;
        sharded.param.set_value(value)?;
    }

    // Every gradient is averaged over "dp"; DDP reads from the model which parameters
    // also need a sum over a model-parallel group (sequence-parallel norms over "tp").
    // One DDP per chunk: a chunk's gradients are complete after its last backward.
    let ddps = models
        .iter()
        .map(|model| DistributedDataParallel::for_model(model, &state, DdpConfig::default()))
        .collect::<ddp::Result<Vec<_>>>()?;
    let s = config.schedule;
    let schedule = LrSchedule::new(s.lr, s.min_lr, s.warmup_steps, s.decay_steps, s.decay)?;
    let adamw = AdamWConfig {
        lr: s.lr,
        ..AdamWConfig::default()
    };
    let parameters = ddps.iter().flat_map(|d| d.parameters().to_vec()).collect();
    let mut optimizer = AdamW::new(parameters, adamw).with_schedule(schedule);
    // No dropout is configured, so the streams are never drawn from; the blocks still
    // take a tracker, seeded as Megatron seeds it, and checkpoints keep the first's.
    let mut rngs: Vec<RngTracker> = (0..chunks)
        .map(|_| RngTracker::new(config.seed, tp.rank()))
        .collect();
    let (mut losses, mut validation) = (Vec::with_capacity(config.steps), Vec::new());
    if let (Some(dir), Some(saved)) = (&config.resume, &saved) {
        let model = &models[0];
        let state =
            layers::checkpoint::load_optimizer_state(model, dir, saved.tp, tp.rank(), tp.size())?;
        optimizer.load_state(&state)?;
        checkpoint::restore_rng(dir, saved, &mut rngs[0], tp.rank(), tp.size())?;
        losses.extend_from_slice(&saved.losses);
        validation.extend_from_slice(&saved.validation);
    }

    let seq = config.model.seq;
    let mut sampler = DistributedSampler::new(
        corpus.training_windows(seq),
        config.seed,
        config.batch,
        dp_rank,
        dp_size,
    );
    let shape = {
        let seq = if config.sequence_parallel {
            tp.part(seq)?.1
        } else {
            seq
        };
        [seq, config.batch / config.microbatches, config.model.hidden]
    };
    let mut timeline = Vec::new();
    for step in losses.len()..config.steps {
        // This rank's rows of the global batch, split into microbatches, each transposed
        // to the layers' [seq, batch].
        let (inputs, targets) = corpus.rows(&sampler.starts(step), seq);
        let rows = config.batch / config.microbatches;
        let microbatches: Vec<(Vec<usize>, Vec<i64>)> = inputs
            .chunks(rows * seq)
            .zip(targets.chunks(rows * seq))
            .map(|(i, t)| (sequence_first(i, seq), sequence_first(t, seq)))
            .collect();

        optimizer.zero_grad();
        let mut pipeline_config =
            pipeline::PipelineConfig::new(config.pipeline, config.microbatches, &shape);
        if config.trace && step + 1 == config.steps {
            state.pp().barrier()?;
            pipeline_config.trace_epoch = Some(std::time::Instant::now());
        }
        let pipe = pipeline::Pipeline::new(state.pp().clone(), pipeline_config)?;
        let mut stages: Vec<GptStage> = models
            .iter()
            .zip(&ddps)
            .zip(rngs.iter_mut())
            .map(|((model, ddp), rng)| GptStage {
                model,
                ddp,
                rng,
                dp: state.dp(),
                microbatches: &microbatches,
                seq,
                global_means: Vec::new(),
            })
            .collect();
        let mut refs: Vec<&mut dyn pipeline::Stage> = stages
            .iter_mut()
            .map(|s| s as &mut dyn pipeline::Stage)
            .collect();
        let report = pipe.run(&mut refs)?;
        timeline = report.timeline;
        for ddp in &ddps {
            ddp.finish()?;
        }
        // The last stage knows the step's loss (the mean over microbatches of each one's
        // global token mean); every stage learns it.
        let means: Vec<f32> = stages.iter().flat_map(|s| s.global_means.clone()).collect();
        let mut step_loss = [means.iter().sum::<f32>() / means.len().max(1) as f32];
        state.pp().broadcast_slice(&mut step_loss, config.pp - 1)?;
        let step_loss = step_loss[0];
        // Every rank holds the same global mean, so all of them stop here together.
        if !step_loss.is_finite() {
            bail!(
                "step {}: the loss is {} (step {} had {}): training diverged; lower --lr \
                 (now {}) or lengthen --lr-warmup-steps (now {})",
                step + 1,
                step_loss,
                step,
                losses.last().map_or("none".into(), |l: &f32| l.to_string()),
                config.schedule.lr,
                config.schedule.warmup_steps
            );
        }
        optimizer.step()?;
        losses.push(step_loss);
        if let Some(progress) = progress {
            progress.step(step + 1, step_loss);
        }
        let done = step + 1;
        let due =
            config.eval_interval > 0 && (done % config.eval_interval == 0 || done == config.steps);
        if let (true, Some(model)) = (due, whole) {
            let loss = validation_loss(model, &state, corpus, config, &mut rngs[0])?;
            validation.push((done, loss));
        }
    }
    if let Some(progress) = progress {
        progress.finish();
    }

    if let (Some(dir), Some(model)) = (&config.save, whole) {
        // Data-parallel replicas are identical: one of them writes the tensor-parallel
        // shards; world rank 0 writes the trainer state last, once every shard is there.
        if dp_rank == 0 {
            model.save(dir)?;
            layers::checkpoint::save_optimizer_shard(model, &optimizer, dir, tp.rank(), tp.size())?;
            checkpoint::save_rng(dir, &rngs[0], tp.rank(), tp.size())?;
        }
        world.barrier()?;
        if world.rank() == 0 {
            TrainerState {
                tp: tp.size(),
                model: config.model,
                global_batch,
                losses: losses.clone(),
                validation: validation.clone(),
            }
            .write(dir)?;
        }
        world.barrier()?;
    }
    let mut samples = Vec::new();
    if let (true, Some(model)) = (config.sample, whole) {
        let mut generator = Generator::new(config.seed);
        for prompt in PROMPTS {
            let text = generate(model, prompt.as_bytes(), &mut generator, &mut rngs[0])?;
            samples.push(String::from_utf8_lossy(&text).into_owned());
        }
    }
    Ok(RankResult {
        losses,
        validation,
        samples,
        coordinates: (state.pp_rank(), tp.rank(), dp_rank),
        timeline,
    })
}

/// One model chunk as a pipeline stage: the forward of a microbatch, and on the last
/// stage its per-token loss, whose global token mean it keeps for reporting.
struct GptStage<'a> {
    model: &'a Gpt,
    ddp: &'a DistributedDataParallel,
    rng: &'a mut RngTracker,
    dp: &'a Arc<dyn Communicator>,
    microbatches: &'a [(Vec<usize>, Vec<i64>)],
    seq: usize,
    global_means: Vec<f32>,
}

impl pipeline::Stage for GptStage<'_> {
    fn forward(
        &mut self,
        tape: &Tape,
        microbatch: usize,
        input: Option<&tape::Tensor>,
    ) -> std::result::Result<tape::Tensor, Box<dyn std::error::Error + Send + Sync>> {
        let (ids, labels) = &self.microbatches[microbatch];
        let rows = ids.len() / self.seq;
        let output = self
            .model
            .forward_chunk(tape, ids, input, self.seq, rows, self.rng)?;
        if !self.model.is_last() {
            return Ok(output);
        }
        let loss = self.model.loss(&output, labels, self.dp)?;
        self.global_means.push(loss.global_mean);
        Ok(loss.loss)
    }

    fn before_backward(&mut self, last: bool) {
        self.ddp.set_sync_enabled(last);
    }
}

/// The mean loss over the held-out windows: `eval_batches` global batches, each
/// data-parallel rank evaluating its rows of each, the token mean taken over all of them.
fn validation_loss(
    model: &Gpt,
    state: &ParallelState,
    corpus: &Corpus,
    config: &TrainConfig,
    rng: &mut RngTracker,
) -> Result<f32> {
    let seq = config.model.seq;
    let global_batch = config.batch * state.dp_size();
    let starts = corpus.validation_starts(seq, global_batch * config.eval_batches);
    let mut total = 0.0;
    for batch in starts.chunks(global_batch) {
        let rows = &batch[state.dp_rank() * config.batch..(state.dp_rank() + 1) * config.batch];
        let (inputs, targets) = corpus.rows(rows, seq);
        let (ids, labels) = (sequence_first(&inputs, seq), sequence_first(&targets, seq));
        let tape = Tape::new();
        total += tape.no_grad(|| -> Result<f32> {
            let logits = model.forward(&tape, &ids, seq, config.batch, rng)?;
            Ok(model.loss(&logits, &labels, state.dp())?.global_mean)
        })?;
    }
    Ok(total / config.eval_batches as f32)
}

/// Row-major `[rows, seq]` to sequence-first `[seq, rows]`.
fn sequence_first<T: Copy>(rows: &[T], seq: usize) -> Vec<T> {
    let batch = rows.len() / seq;
    (0..seq)
        .flat_map(|s| (0..batch).map(move |b| rows[b * seq + s]))
        .collect()
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
