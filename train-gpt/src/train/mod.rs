//! One rank's training loop: tensor parallelism inside the model, data parallelism through
//! DDP over the data-parallel group, AdamW on a learning-rate schedule, a held-out
//! validation loss, exact resume, and text sampling at the end.

use crate::data::Corpus;
use crate::memory::{self, Phase};
use crate::model::{Gpt, GptConfig};
use crate::report::{Progress, StepsProfile};
use anyhow::Result;
use ferrotron_comm_core::Communicator;
use ferrotron_ddp::{DdpConfig, DistributedDataParallel};
use ferrotron_layers::{GradScalerConfig, Module, RngTracker, TensorParallel};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{LrDecay, LrSchedule, Transfers};
use std::path::PathBuf;
use std::sync::Arc;

mod feeding;
mod measures;
mod optimizer;
mod sampling;
mod saving;
mod stage;
mod trainer;
mod weights;

use feeding::*;
use measures::*;
use optimizer::*;
use sampling::*;
use saving::*;
use stage::*;
use trainer::*;
use weights::*;

/// Text the trained model continues, one sample each.
const PROMPTS: &[&str] = &["The tensor", "Each rank ", "pub fn new"];
/// Tokens generated per prompt (bytes, with the byte vocabulary).
const SAMPLE_TOKENS: usize = 80;
/// Sampling temperature: below 1 for readable text, above 0 so it does not loop.
const TEMPERATURE: f32 = 0.8;

#[derive(Debug, Clone)]
pub struct TrainConfig {
    pub model: GptConfig,
    pub tp: usize,
    /// Pipeline stages; the layers are split evenly over `pp × chunks` parts.
    pub pp: usize,
    /// Context-parallel size: each rank holds two chunks of every sequence.
    pub cp: usize,
    /// Expert-parallel size: the experts are divided among this many data-parallel ranks.
    pub ep: usize,
    /// How each step drives its microbatches through the stages.
    pub pipeline: ferrotron_pipeline::Schedule,
    /// Microbatches per step: each data-parallel rank's rows, split evenly.
    pub microbatches: usize,
    /// Record the last step's timeline (returned in [`RankResult::timeline`]).
    pub trace: bool,
    pub sequence_parallel: bool,
    /// Where parameters and activations live.
    pub device: ferrotron_tape::Device,
    /// Rows of the batch each data-parallel rank trains on.
    pub batch: usize,
    /// The step to end at (counted from the start of the run, resumed steps included).
    pub steps: usize,
    pub seed: u64,
    pub schedule: Schedule,
    /// The global gradient norm to clip to, if any.
    pub clip_grad: Option<f64>,
    /// Shard AdamW's state over the data-parallel group (ZeRO-1/2) instead of keeping
    /// all of it on every rank.
    pub distributed_optimizer: bool,
    /// Start each gradient bucket's reduction as soon as its gradients are ready
    /// (`DdpConfig::overlap_grad_reduce`), rather than after backward.
    pub overlap_grad_reduce: bool,
    /// Gather the distributed optimizer's parameters as the next forward reads them
    /// (`DistributedOptimizer::with_overlap_param_gather`).
    pub overlap_param_gather: bool,
    /// Post pipeline receives one exchange ahead (`PipelineConfig::overlap_p2p`).
    pub overlap_p2p: bool,
    /// Gradients per bucket (f32 main gradients), if not the DDP's default caps.
    pub bucket_elements: Option<usize>,
    /// The parameters' storage format: f32, or bf16 / f16 with f32 master weights and
    /// f32 main gradients.
    pub precision: ferrotron_tape::DType,
    /// AdamW's decoupled weight decay, applied as Megatron groups parameters (none for
    /// biases and 1-D parameters).
    pub weight_decay: f64,
    /// Dynamic loss scaling (fp16), if any.
    pub loss_scaler: Option<GradScalerConfig>,
    /// The step (counted from 1) at which the last rank's gradients are made to
    /// overflow, to test the loss scaling.
    pub inject_grad_overflow: Option<usize>,
    /// A call that fails at a given rank and step, to test failure handling
    /// (`FERROTRON_FAIL_COLLECTIVE`, local backend).
    pub fail_collective: Option<crate::faults::FailCollective>,
    /// Validation loss every this many steps (and after the last one); 0 turns it off.
    pub eval_interval: usize,
    /// Global batches of held-out windows each validation runs.
    pub eval_batches: usize,
    /// The checkpoint to continue (a step directory, or a directory that is one).
    pub resume: Option<PathBuf>,
    /// A Hugging Face GPT-2 directory whose weights the run starts from.
    pub init_from: Option<PathBuf>,
    /// Where checkpoints go: one directory per save under it.
    pub save: Option<PathBuf>,
    /// Save every this many steps as well as at the end (`--save-interval`).
    pub save_interval: Option<usize>,
    /// Keep only the newest this many checkpoints (`--save-keep`).
    pub save_keep: Option<usize>,
    /// Write checkpoints in the background while training goes on (`--async-save`).
    pub async_save: bool,
    /// Blocks recomputed in backward instead of keeping their activations.
    pub recompute: Option<crate::model::Recompute>,
    /// Set once a stop signal arrived: the ranks agree on it after each step, save and
    /// end (SIGTERM, SIGINT).
    pub stop: Option<&'static std::sync::atomic::AtomicBool>,
    pub sample: bool,
    /// Compare the two stages' copies of a tied embedding bit for bit after every step
    /// (reported in [`RankResult::tied_copies`]).
    pub check_tied: bool,
    /// Record a per-kernel profile of the steps after the first (reported in
    /// [`RankResult::profile`]).
    pub profile: bool,
    /// Positions whose input is this token (the end of a document) take no loss:
    /// Megatron's `--eod-mask-loss`.
    pub eod_mask: Option<u32>,
    /// Positions count from 0 again after this token (the end of a document):
    /// Megatron's `--reset-position-ids`.
    pub reset_positions: Option<u32>,
    /// For `--check`'s one-rank reference: the batch is this many data-parallel ranks'
    /// rows, and microbatch m takes each one's m-th share (as the run under check splits
    /// them), not a contiguous slice. 1 otherwise.
    pub rows_from_ranks: usize,
}

/// The learning-rate schedule's settings (see [`LrSchedule::new`]).
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    pub lr: f64,
    pub min_lr: f64,
    /// Where the warm-up starts (Megatron's `--lr-warmup-init`).
    pub init_lr: f64,
    pub warmup_steps: u64,
    pub decay_steps: u64,
    pub decay: LrDecay,
}

impl Schedule {
    pub fn build(&self) -> ferrotron_tape::Result<LrSchedule> {
        LrSchedule::new(
            self.lr,
            self.min_lr,
            self.warmup_steps,
            self.decay_steps,
            self.decay,
        )?
        .with_init_lr(self.init_lr)
    }
}

/// What a rank brings back: the global mean loss of every step (resumed ones included),
/// the validation losses by step, and sampled text.
pub struct RankResult {
    pub losses: Vec<f32>,
    pub validation: Vec<(usize, f32)>,
    /// The global gradient norm (before clipping) of each step this run took, by step,
    /// when clipping.
    pub grad_norms: Vec<(usize, f64)>,
    /// How the tied embedding's copies compared, on ranks that hold one (with
    /// [`TrainConfig::check_tied`]).
    pub tied_copies: Option<TiedCopies>,
    pub samples: Vec<String>,
    /// Pipeline, tensor-parallel, data-parallel and context-parallel rank of this rank,
    /// and its timeline of the last step if tracing.
    pub coordinates: (usize, usize, usize, usize),
    pub timeline: Vec<ferrotron_pipeline::Span>,
    /// Its device streams' calls in the last step, on the emulated device's modelled
    /// timeline, if tracing.
    pub streams: ferrotron_tape::timeline::Timeline,
    /// Host↔device copies of a training step on this rank, averaged over the steps after
    /// the first (which also uploads the model's first use of each constant).
    pub transfers_per_step: Transfers,
    /// Times this rank's thread waited for its device in a step, over the same steps
    /// (NCCL's waits for its collectives included).
    pub host_waits_per_step: f64,
    /// This rank's kernels over the same steps, with `TrainConfig::profile` on a device.
    pub profile: Option<StepsProfile>,
    /// The share of this rank's communication-stream time that its compute streams
    /// overlap, on the emulated device's modelled timeline over the same steps (`None`
    /// elsewhere, or with no communication on a stream of its own).
    pub communication_hidden: Option<Hidden>,
    /// How long a step takes on this rank on the emulated device's modelled timeline, in
    /// seconds, over the same steps (from its first device call to its last; `None`
    /// elsewhere).
    pub modelled_step: Option<f64>,
    /// The groups whose device communicator this rank opened (in the order opened), on
    /// a device; set by the launcher, which made the world.
    pub device_groups: Option<Vec<String>>,
    /// The checkpoints this run wrote, oldest first.
    pub saved: Vec<PathBuf>,
    /// How long this rank's training stood still for them, in all.
    pub save_wait: std::time::Duration,
    /// The step a stop signal ended the run after (saved, when there is `--save`).
    pub stopped: Option<usize>,
    /// The most host memory this rank held at once, from building its model to the end
    /// of training (allocations its thread made; see `crate::memory`).
    pub peak_bytes: usize,
    /// What its model state takes, the known part of that peak.
    pub model_state: ModelState,
    /// That peak by what the rank was doing when it allocated, in
    /// [`crate::memory::PHASES`]' order.
    pub peak_phases: [usize; crate::memory::PHASES.len()],
    /// Each pipeline stage's largest peak and its ranks' largest model state, over the
    /// whole world; empty until the launcher gathers them.
    pub stage_peaks: Vec<[usize; 2]>,
}

/// Trains on every rank of `world` (tensor-parallel size `config.tp`, the rest data
/// parallel). World rank 0 reports to `progress`.
pub fn train_rank(
    world: Arc<dyn Communicator>,
    config: &TrainConfig,
    corpus: &Corpus,
    progress: Option<&Progress>,
) -> Result<RankResult> {
    crate::memory::attribute_to_rank(world.rank());
    ferrotron_tape::reset_device_peak(config.device);
    let state = parallel_state(world.clone(), config, corpus)?;
    let tp = TensorParallel::from_state(&state).with_sequence_parallel(config.sequence_parallel);
    let building = memory::enter(Phase::Model);
    let models = build_chunks(&tp, &state, config)?;
    let saved = match &config.resume {
        Some(dir) => Some(load_weights(&models, dir, &state, config)?),
        None => None,
    };
    if let Some(dir) = &config.init_from {
        load_pretrained(&models, dir, config)?;
    }
    for sharded in models.iter().flat_map(Module::parameters) {
        let value = sharded.param.value()?.to_device(config.device)?;
        sharded.param.set_value(value)?;
    }
    let (ddps, expert_ddps) = build_ddps(&models, &state, config)?;
    let optimizer = TrainOptimizer::new(&ddps, &models, config)?;
    let model_state = ModelState::of(&models, &ddps, &optimizer);
    if let Some(progress) = progress {
        progress.note(&model_state_line(&model_state, state.dp_size()));
    }
    // Megatron seeds each pipeline stage apart; here each chunk (virtual stage) has its
    // own tracker.
    let mut rngs: Vec<RngTracker> = (0..models.len())
        .map(|c| RngTracker::for_pipeline_stage(config.seed, tp.rank(), virtual_stage(c, &state)))
        .collect();
    let mut chunks = Chunks {
        models: &models,
        ddps: &ddps,
        expert_ddps: &expert_ddps,
        rngs: &mut rngs,
        state: &state,
        config,
        loss_scale: 1.0,
    };
    let mut trainer = Trainer::new(optimizer, &chunks, corpus, progress)?;
    let mut history = History::default();
    if let (Some(dir), Some(saved)) = (&config.resume, &saved) {
        trainer.resume(dir, saved, &mut chunks, &mut history)?;
    }
    drop(building);
    let steady = trainer.train(&mut chunks, corpus, &mut history)?;
    let (peak_bytes, peak_phases) = peaks(world.rank(), config.device);
    let samples = match config.sample && history.stopped.is_none() {
        true => samples(&mut chunks, corpus)?,
        false => Vec::new(),
    };
    Ok(RankResult {
        losses: history.losses,
        validation: history.validation,
        grad_norms: history.grad_norms,
        tied_copies: history.tied_copies,
        samples,
        coordinates: (state.pp_rank(), tp.rank(), state.dp_rank(), state.cp_rank()),
        timeline: history.timeline,
        streams: history.streams,
        transfers_per_step: steady.transfers,
        host_waits_per_step: steady.host_waits,
        profile: steady.profile,
        communication_hidden: steady.hidden,
        modelled_step: steady.modelled_step,
        device_groups: None,
        saved: history.saved,
        save_wait: history.save_wait,
        peak_bytes,
        model_state,
        peak_phases,
        stage_peaks: Vec::new(),
        stopped: history.stopped,
    })
}

/// This rank's groups for the run's layout, with the data prepared for its global batch.
fn parallel_state(
    world: Arc<dyn Communicator>,
    config: &TrainConfig,
    corpus: &Corpus,
) -> Result<ParallelState> {
    let layout = RankLayout::builder(world.size())
        .tp(config.tp)
        .pp(config.pp)
        .cp(config.cp)
        .ep(config.ep)
        .build()?;
    let state = ParallelState::new(world, layout)?;
    let global_batch = config.batch * state.dp_size();
    let validation = match config.eval_interval {
        0 => 0,
        _ => global_batch * config.eval_batches,
    };
    corpus.prepare(config.model.seq, global_batch, config.steps, validation)?;
    Ok(state)
}

/// The rank's peak memory, in all and by phase. On a GPU the rank's tensors, buckets and
/// optimizer state are device memory, which the host allocator does not see: the peak is
/// the device memory its thread held.
fn peaks(rank: usize, device: ferrotron_tape::Device) -> (usize, [usize; memory::PHASES.len()]) {
    match device {
        ferrotron_tape::Device::Cuda(_) => {
            let held = ferrotron_tape::device_memory(device).peak as usize;
            (held, [0; memory::PHASES.len()])
        }
        _ => (memory::peak(rank), memory::peak_by_phase(rank)),
    }
}

/// One DDP per chunk (a chunk's gradients are complete after its last backward), then one
/// for each chunk's experts, if it has any. Every gradient but the experts' is averaged
/// over "dp"; DDP reads from the model which parameters also need a sum over a
/// model-parallel group (sequence-parallel norms over "tp", the copies of a tied
/// embedding over "embedding"). Returns them with where each chunk's experts' DDP is.
fn build_ddps(
    models: &[Gpt],
    state: &ParallelState,
    config: &TrainConfig,
) -> Result<(Vec<DistributedDataParallel>, Vec<Option<usize>>)> {
    let defaults = DdpConfig::default();
    // Main gradients are f32, whatever the parameters' format.
    let cap = config.bucket_elements.map(|n| n.saturating_mul(4));
    let ddp_config = DdpConfig {
        use_distributed_optimizer: config.distributed_optimizer,
        overlap_grad_reduce: config.overlap_grad_reduce,
        bucket_cap_bytes: cap.unwrap_or(defaults.bucket_cap_bytes),
        first_bucket_bytes: cap.unwrap_or(defaults.first_bucket_bytes),
        ..defaults
    };
    let mut ddps = (models.iter())
        .map(|model| DistributedDataParallel::for_model(model, state, ddp_config.clone()))
        .collect::<ferrotron_ddp::Result<Vec<_>>>()?;
    let mut experts = Vec::with_capacity(models.len());
    for model in models {
        experts.push(
            match DistributedDataParallel::for_experts(model, state, ddp_config.clone())? {
                Some(ddp) => {
                    ddps.push(ddp);
                    Some(ddps.len() - 1)
                }
                None => None,
            },
        );
    }
    Ok((ddps, experts))
}

/// The virtual stage of this rank's chunk `chunk`: `chunk · pp + pp rank`.
fn virtual_stage(chunk: usize, state: &ParallelState) -> usize {
    chunk * state.pp_size() + state.pp_rank()
}

/// This rank's model chunks: chunk c holds virtual stage c·pp + pp rank's blocks.
fn build_chunks(
    tp: &TensorParallel,
    state: &ParallelState,
    config: &TrainConfig,
) -> Result<Vec<Gpt>> {
    let chunks = config.pipeline.chunks();
    let per_part = config.model.layers / (config.pp * chunks);
    (0..chunks)
        .map(|c| {
            let part = virtual_stage(c, state);
            let blocks = part * per_part..(part + 1) * per_part;
            Ok(Gpt::chunk(tp, config.model, config.seed, blocks)?.with_recompute(config.recompute))
        })
        .collect()
}

/// How the two copies of a tied embedding compared after each step (`--check` at more
/// than one pipeline stage).
#[derive(Debug, Clone, Copy, Default)]
pub struct TiedCopies {
    /// Steps after which they were compared.
    pub steps: usize,
    /// The first step after which they differed, and in how many elements.
    pub first_difference: Option<(usize, usize)>,
}

/// How much of a rank's communication-stream time its compute streams overlap.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Hidden {
    /// All of it.
    pub all: f64,
    /// Each group's traffic (each group has its own communication stream), by the
    /// group's name, in name order.
    pub by_group: Vec<(String, f64)>,
}

impl Hidden {
    /// What `timeline` says, if it has communication.
    fn of(timeline: &ferrotron_tape::timeline::Timeline) -> Option<Hidden> {
        let by_group = (timeline.hidden_by_label().into_iter())
            .map(|(group, share)| (group.to_string(), share))
            .collect();
        let all = timeline.hidden_fraction()?;
        Some(Hidden { all, by_group })
    }
}
