//! One rank's training loop: tensor parallelism inside the model, data parallelism through
//! DDP over the data-parallel group, AdamW on a learning-rate schedule, a held-out
//! validation loss, exact resume, and text sampling at the end.

use crate::checkpoint::{self, TrainerState};
use crate::data::{Corpus, DistributedSampler, Split};
use crate::memory::{self, Phase};
use crate::model::{Gpt, GptConfig, RankModel, Tokens};
use crate::report::{Progress, StepsProfile};
use anyhow::{bail, Context, Result};
use ferrotron_comm_core::{Communicator, CommunicatorExt};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel, DistributedOptimizer};
use ferrotron_layers::{
    GradNorm, GradScaler, GradScalerConfig, Module, RngTracker, ShardedParameter, Sharding,
    TensorParallel,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{
    AdamW, AdamWConfig, DType, Generator, LrDecay, LrSchedule, MixedPrecision, Optimizer,
    ParamOptions, Parameter, Tape, Tensor, Transfers,
};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

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
    let layout = RankLayout::builder(world.size())
        .tp(config.tp)
        .pp(config.pp)
        .cp(config.cp)
        .ep(config.ep)
        .build()?;
    let state = ParallelState::new(world.clone(), layout)?;
    let tp = TensorParallel::from_state(&state).with_sequence_parallel(config.sequence_parallel);
    let global_batch = config.batch * state.dp_size();
    let validation = match config.eval_interval {
        0 => 0,
        _ => global_batch * config.eval_batches,
    };
    corpus.prepare(config.model.seq, global_batch, config.steps, validation)?;
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
        let value = sharded.param.value().to_device(config.device)?;
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
    // On a GPU the rank's tensors, buckets and optimizer state are device memory, which
    // the host allocator does not see: the peak is the device memory its thread held.
    let (peak_bytes, peak_phases) = match config.device {
        ferrotron_tape::Device::Cuda(_) => {
            let held = ferrotron_tape::device_memory(config.device).peak as usize;
            (held, [0; crate::memory::PHASES.len()])
        }
        _ => (
            memory::peak(world.rank()),
            memory::peak_by_phase(world.rank()),
        ),
    };
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

/// Text the trained model writes after each of [`PROMPTS`].
fn samples(chunks: &mut Chunks<'_>, corpus: &Corpus) -> Result<Vec<String>> {
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

/// The experts' parameters of a rank's chunks, or all the others: what one writer of a
/// checkpoint saves.
struct ModelShare<'a> {
    models: &'a [Gpt],
    experts: bool,
}

impl Module for ModelShare<'_> {
    fn parameters(&self) -> Vec<ShardedParameter> {
        (self.models.iter())
            .flat_map(Module::parameters)
            .filter(|p| p.expert == self.experts)
            .collect()
    }
}

impl ModelShare<'_> {
    /// This share's parameters among the optimizer's `all`, and their entries of `state`.
    fn optimizer_state(
        &self,
        all: &[Parameter],
        state: &ferrotron_tape::OptimizerState,
    ) -> (Vec<Parameter>, ferrotron_tape::OptimizerState) {
        let mine: std::collections::HashSet<_> =
            self.parameters().iter().map(|p| p.param.id()).collect();
        let (params, entries) = (all.iter().zip(&state.params))
            .filter(|(p, _)| mine.contains(&p.id()))
            .map(|(p, e)| (p.clone(), e.clone()))
            .unzip();
        (
            params,
            ferrotron_tape::OptimizerState {
                steps: state.steps,
                params: entries,
            },
        )
    }
}

/// Reads a checkpoint's trainer state, checks that this run can continue it, and loads
/// this rank's weights from it (re-cut from the saved tensor-parallel size).
fn load_weights(
    models: &[Gpt],
    dir: &std::path::Path,
    state: &ParallelState,
    config: &TrainConfig,
) -> Result<TrainerState> {
    let saved = TrainerState::read(dir)?;
    let global_batch = config.batch * state.dp_size();
    saved.check_compatible(&config.model, global_batch, config.steps)?;
    // Every saved stage's directory: at another pipeline layout a chunk's blocks may come
    // from any of them (blocks are named by their index in the whole model).
    let dirs = saved.stage_dirs(dir);
    let full = checkpoint::read_stages(&dirs, saved.tp)?;
    // Before the output layer lost its bias (as Megatron's has none), untied runs saved
    // one; dropping it would change the model they continue.
    anyhow::ensure!(
        !full.contains_key("head.bias"),
        "{}: its untied output layer has a bias, which the demo's no longer has (Megatron's \
         has none); continue it with the version that saved it, or start afresh",
        dir.display()
    );
    for model in models {
        model.load(&full, dir)?;
    }
    Ok(saved)
}

/// `state`, whose entries follow `module`'s parameters, with its entries in the order of
/// `params` (the same parameters, as an optimizer lists them).
fn in_order_of(
    module: &dyn Module,
    params: &[Parameter],
    state: ferrotron_tape::OptimizerState,
) -> Result<ferrotron_tape::OptimizerState> {
    let mut entries: std::collections::HashMap<_, _> = (module.parameters().into_iter())
        .map(|p| p.param.id())
        .zip(state.params)
        .collect();
    let params = params
        .iter()
        .map(|p| {
            entries
                .remove(&p.id())
                .with_context(|| format!("the checkpoint's optimizer state lacks '{}'", p.name()))
        })
        .collect::<Result<_>>()?;
    Ok(ferrotron_tape::OptimizerState {
        steps: state.steps,
        params,
    })
}

/// Starts from a GPT-2 directory's weights: this rank keeps its part of each. A mixture
/// of experts is upcycled from the dense MLP in its place, as Megatron's
/// `--moe-use-upcycling` does: every expert starts as a copy of it and the router keeps
/// its fresh draw, so that with the softmax after the top-k (weights adding up to 1) and
/// no token dropped the model computes what the dense one did.
fn load_pretrained(models: &[Gpt], dir: &std::path::Path, config: &TrainConfig) -> Result<()> {
    let (_, weights) = crate::hf::import(dir)?;
    let mut tensors = crate::hf::tensors(weights, config.model.vocab)?;
    if let (Some((moe, _)), Some(bias)) = (config.model.moe, tensors.get("block0.mlp.fc1.bias")) {
        anyhow::ensure!(
            bias.shape() == [moe.ffn_hidden],
            "upcycling copies each block's MLP into its experts: pass --moe-ffn-hidden-size {} \
             (the checkpoint's MLP width) or leave it out",
            bias.numel()
        );
    }
    let mut full: BTreeMap<String, (Sharding, Tensor)> = BTreeMap::new();
    for p in models.iter().flat_map(Module::parameters) {
        let name = p.param.name().to_string();
        let tensor = match upcycled_from(&name) {
            Some(Upcycled::Router) => p.param.value(),
            Some(Upcycled::Expert(dense)) => match tensors.get(&dense) {
                Some(tensor) => tensor.clone(),
                None => continue, // the load reports it missing
            },
            None => match tensors.remove(&name) {
                Some(tensor) => tensor,
                None => continue,
            },
        };
        full.insert(name, (p.sharding, tensor));
    }
    for model in models {
        model.load(&full, dir)?;
    }
    Ok(())
}

/// Where a mixture of experts' parameter starts when a dense checkpoint is upcycled.
enum Upcycled {
    /// The router keeps its initial values (the checkpoint has none).
    Router,
    /// An expert's tensor copies the dense MLP's of that name.
    Expert(String),
}

/// `blockN.mlp.experts.E.rest` starts from `blockN.mlp.rest`; `blockN.mlp.router.weight`
/// from nothing; any other name from itself (`None`).
fn upcycled_from(name: &str) -> Option<Upcycled> {
    if name.ends_with(".mlp.router.weight") {
        return Some(Upcycled::Router);
    }
    let (block, rest) = name.split_once(".mlp.experts.")?;
    let (_, tensor) = rest.split_once('.')?;
    Some(Upcycled::Expert(format!("{block}.mlp.{tensor}")))
}

/// Whether a stop signal reached any rank: every rank asks after every step, so all of
/// them stop after the same one (a rank that saw the signal later still stops with the
/// rest). One small all-reduce of host memory a step when a signal is watched.
fn stop_agreed(chunks: &Chunks<'_>) -> Result<bool> {
    let Some(flag) = chunks.config.stop else {
        return Ok(false);
    };
    let mut seen = [u8::from(flag.load(std::sync::atomic::Ordering::Relaxed))];
    let world = chunks.state.world();
    world.all_reduce(
        ferrotron_comm_core::BufMut::from(&mut seen[..]),
        ferrotron_comm_core::ReduceOp::Max,
    )?;
    Ok(seen[0] == 1)
}

/// Starts the checkpoint of the steps so far under `root`, in a partial directory: each
/// stage's weights, optimizer state and random streams are copied to host memory now and
/// written by this thread, or with `--async-save` by a background one while training
/// goes on. [`PendingSave::finish`] completes it.
fn save(
    root: &std::path::Path,
    chunks: &mut Chunks<'_>,
    optimizer: &mut TrainOptimizer,
    scaler: Option<&GradScaler>,
    history: &History,
) -> Result<PendingSave> {
    let (state, config) = (chunks.state, chunks.config);
    let world = state.world();
    let step = history.losses.len();
    if world.rank() == 0 {
        checkpoint::prepare_save(root, step)?;
    }
    world.barrier()?;
    let dir = &checkpoint::partial_dir(root, step);
    let tp = chunks.models[0].tp();
    // Every data-parallel rank takes the optimizer state (sharded, that gathers it); the
    // replicas are identical, so one of them writes each stage's shards.
    let optimizer_state = optimizer.as_dyn().state()?;
    let mut files = Vec::new();
    let mut rng = None;
    let stage = checkpoint::stage_dir(dir, state.pp_rank(), config.pp);
    let (rank, size) = (tp.rank(), tp.size());
    // Context-parallel ranks hold the same weights too; experts are the same on the ranks
    // of an expert-data-parallel group, and differ by expert-parallel rank.
    let has_experts = config.model.moe.is_some();
    let writers = [
        (
            state.dp_rank() == 0 && state.cp_rank() == 0,
            false,
            stage.clone(),
        ),
        (
            has_experts && state.expert_coordinates().dp == 0,
            true,
            checkpoint::experts_dir(&stage, state.ep_rank(), state.ep_size()),
        ),
    ];
    for (_, experts, dir) in writers.into_iter().filter(|w| w.0) {
        let part = ModelShare {
            models: chunks.models,
            experts,
        };
        let (params, optimizer_part) =
            part.optimizer_state(optimizer.model_params(), &optimizer_state);
        files.push(ferrotron_layers::checkpoint::snapshot_shard(
            &part, &dir, rank, size,
        )?);
        files.push(ferrotron_layers::checkpoint::snapshot_optimizer_state(
            &part,
            &params,
            &optimizer_part,
            &dir,
            rank,
            size,
        )?);
        if !experts {
            rng = Some(checkpoint::rng_file(&dir, chunks.rngs, rank, size)?);
        }
    }
    let write = move || -> Result<()> {
        if rng.is_some() {
            crate::faults::point("before the shards", step);
        }
        for file in files {
            file.write()?;
        }
        if let Some((path, text)) = rng {
            checkpoint::write_atomically(&path, &text)?;
            crate::faults::point("after the shards", step);
        }
        Ok(())
    };
    let writer = match config.async_save {
        true => Some(std::thread::spawn(write)),
        false => {
            write()?;
            None
        }
    };
    let trainer_state = (world.rank() == 0).then(|| TrainerState {
        format: checkpoint::FORMAT,
        tp: tp.size(),
        pp: config.pp,
        chunks: config.pipeline.chunks(),
        model: config.model,
        global_batch: config.batch * state.dp_size(),
        losses: history.losses.clone(),
        validation: history.validation.clone(),
        loss_scaler: scaler.map(GradScaler::state),
    });
    Ok(PendingSave {
        root: root.to_path_buf(),
        step,
        writer,
        trainer_state,
    })
}

/// A save whose files are being written, in this thread or a background one.
struct PendingSave {
    root: PathBuf,
    step: usize,
    writer: Option<std::thread::JoinHandle<Result<()>>>,
    /// World rank 0's: written last, once every rank's files are there.
    trainer_state: Option<TrainerState>,
}

impl PendingSave {
    /// Waits for this rank's files; once every rank's are written, world rank 0 writes
    /// the trainer state, renames the checkpoint into place and marks it the latest.
    /// Returns its directory.
    fn finish(self, world: &Arc<dyn Communicator>, keep: Option<usize>) -> Result<PathBuf> {
        let (root, step) = (&self.root, self.step);
        if let Some(writer) = self.writer {
            writer
                .join()
                .map_err(|_| anyhow::anyhow!("the checkpoint writer of step {step} panicked"))??;
        }
        world.barrier()?;
        if let Some(state) = self.trainer_state {
            crate::faults::point("before the trainer state", step);
            state.write(&checkpoint::partial_dir(root, step))?;
            checkpoint::commit_save(root, step, keep)?;
        }
        world.barrier()?;
        Ok(checkpoint::step_dir(root, step))
    }
}

/// What the steps so far produced.
#[derive(Default)]
struct History {
    losses: Vec<f32>,
    validation: Vec<(usize, f32)>,
    grad_norms: Vec<(usize, f64)>,
    tied_copies: Option<TiedCopies>,
    /// The last step's pipeline timeline, when tracing.
    timeline: Vec<ferrotron_pipeline::Span>,
    /// The last step's device streams on the modelled timeline, when tracing (emulated).
    streams: ferrotron_tape::timeline::Timeline,
    /// The checkpoints this run wrote.
    saved: Vec<PathBuf>,
    /// The step a stop signal ended the run after.
    stopped: Option<usize>,
    /// How long training stood still for saves (all of a save, or with `--async-save`
    /// its copy to host memory and the wait for the previous one).
    save_wait: std::time::Duration,
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

/// The per-step machinery of one rank: the optimizer, the loss scaler, the sampler.
struct Trainer<'a> {
    optimizer: TrainOptimizer,
    scaler: Option<GradScaler>,
    sampler: DistributedSampler,
    /// This rank's parameters, as clipping and unscaling take them.
    params: Vec<ShardedParameter>,
    /// This rank's copy of a tied embedding another stage also holds.
    tied_copy: Option<Parameter>,
    progress: Option<&'a Progress>,
    /// The save still being written (`--async-save`).
    pending_save: Option<PendingSave>,
}

impl<'a> Trainer<'a> {
    fn new(
        optimizer: TrainOptimizer,
        chunks: &Chunks<'_>,
        corpus: &Corpus,
        progress: Option<&'a Progress>,
    ) -> Result<Self> {
        let (config, state) = (chunks.config, chunks.state);
        Ok(Trainer {
            optimizer,
            scaler: config.loss_scaler.map(GradScaler::new).transpose()?,
            sampler: sampler(corpus, config, state),
            params: chunks.models.iter().flat_map(Module::parameters).collect(),
            tied_copy: chunks.models.iter().find_map(Gpt::tied_copy),
            progress,
            pending_save: None,
        })
    }

    /// Continues where the checkpoint in `dir` stopped: the optimizer state, every
    /// chunk's random streams, the loss scale and the curves so far (the weights are
    /// already loaded).
    fn resume(
        &mut self,
        dir: &std::path::Path,
        saved: &TrainerState,
        chunks: &mut Chunks<'_>,
        history: &mut History,
    ) -> Result<()> {
        let (state, config) = (chunks.state, chunks.config);
        let tp = chunks.models[0].tp();
        let rank_model = RankModel(chunks.models);
        let dirs = saved.stage_dirs(dir);
        let dirs: Vec<&std::path::Path> = dirs.iter().map(PathBuf::as_path).collect();
        let optimizer_state = ferrotron_layers::checkpoint::load_optimizer_state_across(
            &rank_model,
            &dirs,
            saved.tp,
            tp.rank(),
            tp.size(),
        )?;
        // Listed in the model's order; the distributed optimizer lists experts last.
        let optimizer_state =
            in_order_of(&rank_model, self.optimizer.model_params(), optimizer_state)?;
        self.optimizer.as_dyn().load_state(&optimizer_state)?;
        // Random streams belong to a chunk of one layout: restored only at the saved one.
        if (saved.pp, saved.chunks) == (config.pp, config.pipeline.chunks()) {
            let dir = checkpoint::stage_dir(dir, state.pp_rank(), config.pp);
            checkpoint::restore_rng(&dir, saved, chunks.rngs, tp.rank(), tp.size())?;
        }
        if let (Some(scaler), Some(state)) = (&mut self.scaler, saved.loss_scaler) {
            scaler.load_state(state)?;
        }
        history.losses.extend_from_slice(&saved.losses);
        history.validation.extend_from_slice(&saved.validation);
        Ok(())
    }

    /// The steps from where `history` ends to `--steps`, with the validation loss when
    /// due; returns the host↔device copies and host waits of a step, averaged over the
    /// steps after the first (which also uploads the model's first use of each constant).
    fn train(
        &mut self,
        chunks: &mut Chunks<'_>,
        corpus: &Corpus,
        history: &mut History,
    ) -> Result<Steady> {
        let config = chunks.config;
        let first_step = history.losses.len();
        let (mut steady_transfers, mut waits) = (Vec::new(), Vec::new());
        let mut timeline = ferrotron_tape::timeline::Timeline::default();
        let mut makespans = Vec::new();
        let mut profile = (config.profile && config.device != ferrotron_tape::Device::Cpu)
            .then(StepsProfile::default);
        for step in first_step..config.steps {
            let steady = step > first_step || config.steps == first_step + 1;
            let before = ferrotron_tape::transfers(config.device);
            let waits_before = ferrotron_tape::host_waits(config.device);
            let recording = profile.as_mut().filter(|_| steady);
            if recording.is_some() {
                ferrotron_tape::profile::start(config.device);
            }
            match (steady, config.trace) {
                (true, true) => ferrotron_tape::timeline::start_calls(),
                (true, false) => ferrotron_tape::timeline::start(),
                (false, _) => {}
            }
            let started = std::time::Instant::now();
            self.step(chunks, corpus, step, history)?;
            let wall = started.elapsed();
            if steady {
                let streams = ferrotron_tape::timeline::finish();
                if config.trace {
                    history.streams = streams.clone();
                }
                makespans.extend(streams.makespan());
                timeline.extend(streams);
            }
            // Read before the profile's own wait for its last timing event.
            if steady {
                steady_transfers.push(ferrotron_tape::transfers(config.device) - before);
                waits.push(ferrotron_tape::host_waits(config.device) - waits_before);
            }
            if let Some(recording) = recording {
                recording.add(&ferrotron_tape::profile::finish()?, wall);
            }
            // `--check`'s own reads of the tied copies, outside the step's counts.
            if config.check_tied {
                self.compare_tied_copies(chunks.state, step, history)?;
            }
            let done = step + 1;
            crate::faults::kill_point(chunks.state.world().rank(), done);
            let stop = stop_agreed(chunks)?;
            let interval = config.eval_interval;
            if interval > 0 && (done % interval == 0 || done == config.steps) && !stop {
                let _passes = memory::enter(Phase::Passes);
                let loss = validation_loss(chunks, corpus)?;
                history.validation.push((done, loss));
            }
            let every = config.save_interval.unwrap_or(0);
            let due = done == config.steps || stop || (every > 0 && done % every == 0);
            if let (Some(root), true) = (&config.save, due) {
                let started = std::time::Instant::now();
                let _saving = memory::enter(Phase::Checkpoint);
                // One save in flight at a time: the previous one completes first.
                self.finish_save(chunks, history)?;
                let pending = save(
                    root,
                    chunks,
                    &mut self.optimizer,
                    self.scaler.as_ref(),
                    history,
                )?;
                self.pending_save = Some(pending);
                if !config.async_save {
                    self.finish_save(chunks, history)?;
                }
                history.save_wait += started.elapsed();
            }
            if stop {
                history.stopped = Some(done);
                break;
            }
        }
        self.finish_save(chunks, history)?;
        if let Some(progress) = self.progress {
            progress.finish();
        }
        Ok(Steady {
            transfers: mean(&steady_transfers),
            host_waits: waits.iter().sum::<u64>() as f64 / waits.len().max(1) as f64,
            profile,
            hidden: Hidden::of(&timeline),
            modelled_step: (!makespans.is_empty())
                .then(|| makespans.iter().sum::<f64>() / makespans.len() as f64),
        })
    }

    /// Completes the save in flight, if any, recording its directory.
    fn finish_save(&mut self, chunks: &Chunks<'_>, history: &mut History) -> Result<()> {
        if let Some(pending) = self.pending_save.take() {
            let saved = pending.finish(chunks.state.world(), chunks.config.save_keep)?;
            history.saved.push(saved);
        }
        Ok(())
    }

    /// One training step (0-based `step`): forward and backward of every microbatch,
    /// gradient sync, unscaling and clipping, the update.
    fn step(
        &mut self,
        chunks: &mut Chunks<'_>,
        corpus: &Corpus,
        step: usize,
        history: &mut History,
    ) -> Result<()> {
        let (config, state) = (chunks.config, chunks.state);
        self.optimizer.as_dyn().zero_grad();
        let reading = memory::enter(Phase::Data);
        let microbatches = microbatches(corpus, Split::Train, &self.sampler.starts(step), config)?;
        drop(reading);
        let trace = config.trace && step + 1 == config.steps;
        chunks.loss_scale = self.scaler.as_ref().map_or(1.0, GradScaler::scale);
        let tp = chunks.models[0].tp();
        let last_rank = state.pp_rank() + 1 == config.pp
            && tp.rank() + 1 == tp.size()
            && state.dp_rank() + 1 == state.dp_size();
        if config.inject_grad_overflow == Some(step + 1) && last_rank {
            chunks.loss_scale = f64::INFINITY;
        }
        let passes = memory::enter(Phase::Passes);
        // Routing counts of this step's training pass only.
        chunks
            .models
            .iter()
            .flat_map(Gpt::experts)
            .for_each(|moe| drop(moe.take_stats()));
        let (step_loss, spans) = chunks.loss(&microbatches, Pass::Train, trace)?;
        drop(passes);
        let routing = expert_routing(chunks)?;
        let _optimizer = memory::enter(Phase::Optimizer);
        history.timeline = spans;
        // Every rank holds the same global mean, so all of them stop here together.
        if !step_loss.is_finite() {
            bail!(
                "step {}: the loss is {} (step {} had {}): training diverged; lower --lr \
                 (now {}), lengthen --lr-warmup-steps (now {}) or clip with --clip-grad",
                step + 1,
                step_loss,
                step,
                history
                    .losses
                    .last()
                    .map_or("none".into(), |l: &f32| l.to_string()),
                config.schedule.lr,
                config.schedule.warmup_steps
            );
        }
        let unscaled = match &self.scaler {
            Some(scaler) => {
                self.optimizer
                    .unscale_grads(scaler, &self.params, tp, &[state.pp()])?
            }
            None => true,
        };
        let finite = unscaled && self.clip(chunks, step, history)?;
        if finite {
            self.optimizer.as_dyn().step()?;
        }
        self.update_scaler(unscaled, step);
        history.losses.push(step_loss);
        if let Some(progress) = self.progress {
            progress.step(step + 1, step_loss);
            if let Some(line) = routing {
                progress.note(&line);
            }
        }
        Ok(())
    }

    /// Clips to `--clip-grad`, recording the norm: `false` (skip the step on every
    /// rank) when it is not finite.
    fn clip(&mut self, chunks: &Chunks<'_>, step: usize, history: &mut History) -> Result<bool> {
        let Some(max_norm) = chunks.config.clip_grad else {
            return Ok(true);
        };
        let tp = chunks.models[0].tp();
        let groups = [chunks.state.pp()];
        let norm = self
            .optimizer
            .clip_grad_norm(&self.params, tp, &groups, max_norm)?;
        history.grad_norms.push((step + 1, norm.norm));
        if let (false, Some(progress)) = (norm.is_finite(), self.progress) {
            progress.note(&format!(
                "step {}: the gradient norm is {}; step skipped on every rank",
                step + 1,
                norm.norm
            ));
        }
        Ok(norm.is_finite())
    }

    /// Moves fp16's loss scale after a step that was (`unscaled`) or was not skipped.
    fn update_scaler(&mut self, unscaled: bool, step: usize) {
        let Some(scaler) = &mut self.scaler else {
            return;
        };
        let before = scaler.scale();
        scaler.update(unscaled);
        if let (false, Some(progress)) = (unscaled, self.progress) {
            progress.note(&format!(
                "step {}: gradients overflowed at loss scale {}; step skipped on every \
                 rank, loss scale now {}",
                step + 1,
                readable(before),
                readable(scaler.scale())
            ));
        }
    }

    /// Compares this rank's copy of the tied embedding with the other stage's, bit by
    /// bit, over the embedding group (the ranks of the first and last stage).
    fn compare_tied_copies(
        &self,
        state: &ParallelState,
        step: usize,
        history: &mut History,
    ) -> Result<()> {
        let (Some(copy), Some(group)) = (&self.tied_copy, state.embedding()) else {
            return Ok(());
        };
        let value = copy.value().to_dtype(DType::F32)?.to_vec()?;
        let all: Vec<f32> = group.all_gather_vec(&value)?;
        let (first, last) = all.split_at(value.len());
        let differing = (first.iter().zip(last))
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let record = history.tied_copies.get_or_insert_with(TiedCopies::default);
        record.steps += 1;
        if differing > 0 && record.first_difference.is_none() {
            record.first_difference = Some((step + 1, differing));
        }
        Ok(())
    }
}

/// A loss scale as a person reads it: whole below 10^15, else in scientific notation.
fn readable(scale: f64) -> String {
    if scale < 1e15 {
        scale.to_string()
    } else {
        format!("{scale:e}")
    }
}

/// The line the run starts with about memory: bytes per parameter on this rank for the
/// parameters, their (f32) main gradients, master weights and AdamW's moments.
fn model_state_line(state: &ModelState, dp_size: usize) -> String {
    let ModelState {
        parameters: count,
        values,
        grads,
        masters,
        moments,
    } = *state;
    let count = count.max(1) as f64;
    let per = |bytes: usize| bytes as f64 / count;
    format!(
        "model state per rank: {:.2} bytes per parameter (parameters {:.2}, gradients {:.2}, \
         master weights {:.2}, AdamW moments {:.2}; data-parallel size {dp_size})",
        per(values + grads + masters + moments),
        per(values),
        per(grads),
        per(masters),
        per(moments)
    )
}

/// What a rank's model state takes: its parameters and the bytes of their values,
/// gradient buckets, f32 master weights and AdamW moments.
#[derive(Debug, Clone, Copy, Default)]
pub struct ModelState {
    pub parameters: usize,
    pub values: usize,
    pub grads: usize,
    pub masters: usize,
    pub moments: usize,
}

impl ModelState {
    fn of(models: &[Gpt], ddps: &[DistributedDataParallel], optimizer: &TrainOptimizer) -> Self {
        let params: Vec<Parameter> = models
            .iter()
            .flat_map(Module::parameters)
            .map(|sharded| sharded.param)
            .collect();
        let (masters, moments) = optimizer.state_bytes();
        ModelState {
            parameters: params.iter().map(Parameter::numel).sum(),
            values: params.iter().map(|p| p.value().nbytes()).sum(),
            grads: ddps.iter().map(DistributedDataParallel::buffer_bytes).sum(),
            masters,
            moments,
        }
    }

    /// The bytes in all.
    pub fn total(&self) -> usize {
        self.values + self.grads + self.masters + self.moments
    }
}

/// AdamW kept whole on every data-parallel rank (on the parameters, or on f32 master
/// copies of 16-bit ones), or sharded over them.
enum TrainOptimizer {
    Replicated(AdamW),
    Mixed(MixedPrecision<AdamW>),
    Distributed(DistributedOptimizer),
}

impl TrainOptimizer {
    /// AdamW on the schedule over the parameters of `ddps`, weight decay grouped as
    /// Megatron groups it, in the form `config` asks for.
    fn new(ddps: &[DistributedDataParallel], models: &[Gpt], config: &TrainConfig) -> Result<Self> {
        let schedule = config.schedule.build()?;
        let adamw = AdamWConfig {
            lr: config.schedule.lr,
            weight_decay: config.weight_decay,
            ..AdamWConfig::default()
        };
        let groups = ParamOptions::megatron_groups;
        // In the model's order, as checkpoints list them (experts' among the rest).
        let parameters: Vec<Parameter> = (models.iter())
            .flat_map(Module::parameters)
            .map(|p| p.param)
            .collect();
        Ok(match (config.distributed_optimizer, config.precision) {
            (true, precision) => {
                let sharded = DistributedOptimizer::adamw(ddps, adamw)?
                    .with_schedule(schedule)
                    .with_param_options(groups)
                    .with_overlap_param_gather(config.overlap_param_gather);
                TrainOptimizer::Distributed(match precision {
                    DType::F32 => sharded,
                    _ => sharded.store_params_as(precision)?,
                })
            }
            (false, DType::F32) => TrainOptimizer::Replicated(
                AdamW::new(parameters, adamw)
                    .with_schedule(schedule)
                    .with_param_options(groups),
            ),
            (false, precision) => {
                TrainOptimizer::Mixed(MixedPrecision::new(&parameters, precision, |masters| {
                    AdamW::new(masters, adamw)
                        .with_schedule(schedule)
                        .with_param_options(groups)
                })?)
            }
        })
    }

    fn as_dyn(&mut self) -> &mut dyn Optimizer {
        match self {
            TrainOptimizer::Replicated(adamw) => adamw,
            TrainOptimizer::Mixed(adamw) => adamw,
            TrainOptimizer::Distributed(adamw) => adamw,
        }
    }

    /// The model's parameters the optimizer's state entries belong to (what a
    /// checkpoint names them by).
    fn model_params(&self) -> &[Parameter] {
        match self {
            TrainOptimizer::Replicated(adamw) => adamw.params(),
            TrainOptimizer::Mixed(adamw) => adamw.model_params(),
            TrainOptimizer::Distributed(adamw) => adamw.params(),
        }
    }

    /// Bytes of f32 master weights and of optimizer state this rank holds.
    fn state_bytes(&self) -> (usize, usize) {
        let moments = |params: &[Parameter]| 8 * params.iter().map(Parameter::numel).sum::<usize>();
        match self {
            TrainOptimizer::Replicated(adamw) => (0, moments(adamw.params())),
            TrainOptimizer::Mixed(adamw) => (
                4 * adamw.params().iter().map(Parameter::numel).sum::<usize>(),
                moments(adamw.params()),
            ),
            TrainOptimizer::Distributed(adamw) => (
                adamw.master_bytes(),
                adamw.state_bytes() - adamw.master_bytes(),
            ),
        }
    }

    /// Divides the gradients the next step uses by the loss scale: `false` on every rank
    /// when some rank's overflowed (skip the step).
    fn unscale_grads(
        &mut self,
        scaler: &GradScaler,
        params: &[ShardedParameter],
        tp: &TensorParallel,
        other_groups: &[&Arc<dyn Communicator>],
    ) -> Result<bool> {
        Ok(match self {
            TrainOptimizer::Replicated(_) | TrainOptimizer::Mixed(_) => {
                scaler.unscale_grads(params, tp, other_groups)?
            }
            TrainOptimizer::Distributed(adamw) => adamw.unscale_grads(scaler, tp, other_groups)?,
        })
    }

    /// Clips the gradients the next step uses: the parameters' (replicated) or the
    /// reduced shards' (distributed).
    fn clip_grad_norm(
        &mut self,
        params: &[ShardedParameter],
        tp: &TensorParallel,
        other_groups: &[&Arc<dyn Communicator>],
        max_norm: f64,
    ) -> Result<GradNorm> {
        Ok(match self {
            TrainOptimizer::Replicated(_) | TrainOptimizer::Mixed(_) => {
                ferrotron_layers::clip_grad_norm(params, tp, other_groups, max_norm)?
            }
            TrainOptimizer::Distributed(adamw) => {
                adamw.clip_grad_norm(params, tp, other_groups, max_norm)?
            }
        })
    }
}

/// This rank's chunks of the model with their DDPs and random streams, run as pipeline
/// stages over `state`'s pipeline group (one stage holding everything at `--pp 1`).
struct Chunks<'a> {
    models: &'a [Gpt],
    /// Every chunk's DDP, in chunk order, then the experts' DDPs.
    ddps: &'a [DistributedDataParallel],
    /// Where in `ddps` each chunk's experts' DDP is, if it has experts.
    expert_ddps: &'a [Option<usize>],
    rngs: &'a mut [RngTracker],
    state: &'a ParallelState,
    config: &'a TrainConfig,
    /// What training multiplies the loss by before backward (fp16's loss scale).
    loss_scale: f64,
}

/// What a pass through the stages is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Forward and backward; the last stage computes each microbatch's loss.
    Train,
    /// Forward only, with the loss.
    Evaluate,
    /// Forward only; the last stage gathers the logits at position `at`.
    Logits { at: usize },
}

impl Chunks<'_> {
    /// The mean over `microbatches` of each one's global token-mean loss, on every rank
    /// (the last stage computes it, then broadcasts it over the pipeline group). Training
    /// also runs backward and averages the gradients over data parallelism; `trace`
    /// returns the pass's timeline.
    fn loss(
        &mut self,
        microbatches: &[Microbatch],
        pass: Pass,
        trace: bool,
    ) -> Result<(f32, Vec<ferrotron_pipeline::Span>)> {
        let seq = self.config.model.seq;
        let rows = microbatches[0].ids.len() / seq;
        let (results, timeline) = self.run(microbatches, (seq, rows), pass, trace)?;
        let mut loss = [results.iter().flatten().sum::<f32>() / results.len().max(1) as f32];
        self.state
            .pp()
            .broadcast_slice(&mut loss, self.config.pp - 1)?;
        Ok((loss[0], timeline))
    }

    /// The whole vocabulary's logits at the last position of one sequence `ids`, on the
    /// last stage's ranks (`None` on the others).
    fn last_logits(&mut self, ids: &[usize]) -> Result<Option<Vec<f32>>> {
        // Sequence parallelism gives every tensor-parallel rank at least one position:
        // a shorter context is padded at the end, which causal attention keeps from
        // changing the logits before it.
        let tp = self.models[0].tp();
        let len = if tp.context_size() > 1 {
            // Context parallelism cuts the whole context into each rank's two chunks.
            self.config.model.seq
        } else if tp.sequence_parallel() {
            ids.len().max(tp.size())
        } else {
            ids.len()
        };
        let mut padded = ids.to_vec();
        padded.resize(len, 0);
        let copies = self.config.pipeline.microbatch_multiple(self.config.pp);
        let microbatches = vec![
            Microbatch {
                ids: padded,
                labels: Vec::new(),
                positions: None,
            };
            copies
        ];
        let pass = Pass::Logits { at: ids.len() - 1 };
        let (mut results, _) = self.run(&microbatches, (len, 1), pass, false)?;
        Ok((!results.is_empty()).then(|| results.swap_remove(0)))
    }

    /// One pass over `microbatches` of `(len, rows)` tokens each: what the last stage
    /// produced for each (its loss, or its logits), and the timeline if `trace`.
    fn run(
        &mut self,
        microbatches: &[Microbatch],
        (len, rows): (usize, usize),
        pass: Pass,
        trace: bool,
    ) -> Result<(Vec<Vec<f32>>, Vec<ferrotron_pipeline::Span>)> {
        let tp = self.models[0].tp();
        // Under context parallelism each rank holds two chunks of every sequence.
        let sliced: Vec<Microbatch>;
        let (microbatches, len) = match tp.context_size() {
            1 => (microbatches, len),
            cp => {
                sliced = (microbatches.iter())
                    .map(|m| {
                        Ok(Microbatch {
                            ids: context_part(&m.ids, len, rows, tp)?,
                            labels: context_part(&m.labels, len, rows, tp)?,
                            positions: (m.positions.as_ref())
                                .map(|p| context_part(p, len, rows, tp))
                                .transpose()?,
                        })
                    })
                    .collect::<Result<_>>()?;
                (&sliced[..], len / cp)
            }
        };
        // Under sequence parallelism each rank passes on its part of the sequence.
        let local = if tp.sequence_parallel() {
            tp.part(len)?.1
        } else {
            len
        };
        let shape = [local, rows, self.config.model.hidden];
        let mut config = ferrotron_pipeline::PipelineConfig::new(
            self.config.pipeline,
            microbatches.len(),
            &shape,
        );
        config.forward_only = pass != Pass::Train;
        // The stages report the loss's global mean themselves.
        config.read_losses = false;
        config.device = self.config.device;
        config.dtype = self.config.precision;
        config.overlap_p2p = self.config.overlap_p2p;
        if trace {
            self.state.pp().barrier()?;
            config.trace_epoch = Some(std::time::Instant::now());
        }
        let pipe = ferrotron_pipeline::Pipeline::new(self.state.pp().clone(), config)?;
        // Each microbatch's auxiliary losses count as its share of the step, as its loss.
        let aux_scale = self.loss_scale / microbatches.len() as f64;
        for moe in self.models.iter().flat_map(Gpt::experts) {
            moe.set_aux_loss_scale(aux_scale);
        }
        let train = pass == Pass::Train;
        let mut stages: Vec<GptStage> = self
            .models
            .iter()
            .zip(self.ddps)
            .zip(self.expert_ddps)
            .zip(self.rngs.iter_mut())
            .map(|(((model, ddp), experts), rng)| GptStage {
                model,
                ddp: train.then_some(ddp),
                expert_ddp: experts.filter(|_| train).map(|i| &self.ddps[i]),
                rng,
                dp: self.state.dp_with_cp(),
                microbatches,
                len,
                pass,
                loss_scale: self.loss_scale,
                results: Vec::new(),
                means: Vec::new(),
            })
            .collect();
        let mut refs: Vec<&mut dyn ferrotron_pipeline::Stage> = stages
            .iter_mut()
            .map(|s| s as &mut dyn ferrotron_pipeline::Stage)
            .collect();
        let report = pipe.run(&mut refs)?;
        if pass == Pass::Train {
            for ddp in self.ddps {
                ddp.finish()?;
            }
        }
        let means: Vec<Tensor> = stages.iter_mut().flat_map(|s| s.means.drain(..)).collect();
        let mut results: Vec<Vec<f32>> = stages.into_iter().flat_map(|s| s.results).collect();
        if !means.is_empty() {
            // The step's losses in one read (one host wait), however many microbatches.
            let scalars = (means.iter())
                .map(|m| m.reshape(&[1]))
                .collect::<ferrotron_tape::Result<Vec<_>>>()?;
            let values = Tensor::concat(&scalars.iter().collect::<Vec<_>>(), 0)?.to_vec()?;
            results.extend(values.into_iter().map(|v| vec![v]));
        }
        Ok((results, report.timeline))
    }
}

/// One model chunk as a pipeline stage: the forward of a microbatch and, on the last
/// stage, what the pass is for.
struct GptStage<'a> {
    model: &'a Gpt,
    ddp: Option<&'a DistributedDataParallel>,
    expert_ddp: Option<&'a DistributedDataParallel>,
    rng: &'a mut RngTracker,
    dp: &'a Arc<dyn Communicator>,
    microbatches: &'a [Microbatch],
    len: usize,
    pass: Pass,
    /// What training multiplies the loss by before backward.
    loss_scale: f64,
    /// The last stage's logits of each microbatch.
    results: Vec<Vec<f32>>,
    /// The last stage's loss (its global mean) of each microbatch, on the device until
    /// the step ends.
    means: Vec<Tensor>,
}

impl ferrotron_pipeline::Stage for GptStage<'_> {
    fn forward(
        &mut self,
        tape: &Tape,
        microbatch: usize,
        input: Option<&ferrotron_tape::Tensor>,
    ) -> std::result::Result<ferrotron_tape::Tensor, Box<dyn std::error::Error + Send + Sync>> {
        let Microbatch {
            ids,
            labels,
            positions,
        } = &self.microbatches[microbatch];
        let rows = ids.len() / self.len;
        // Only training draws dropout masks.
        let rng = (self.pass == Pass::Train).then_some(&mut *self.rng);
        let tokens = Tokens {
            ids,
            positions: positions.as_deref(),
        };
        let output = self
            .model
            .forward_chunk(tape, tokens, input, self.len, rows, rng)?;
        if !self.model.is_last() {
            return Ok(output);
        }
        if let Pass::Logits { at } = self.pass {
            self.results.push(self.logits_at(&output, at)?);
            return Ok(output);
        }
        let loss = self.model.loss(&output, labels, self.dp)?;
        self.means.push(loss.global_mean);
        // The scaler's `scale_loss`, by its value: the stage holds the scale, not the
        // scaler (which the training loop updates between steps).
        if self.pass == Pass::Train && self.loss_scale != 1.0 {
            return Ok(loss.loss.scale(self.loss_scale)?);
        }
        Ok(loss.loss)
    }

    fn before_backward(&mut self, last: bool) {
        for ddp in self.ddp.iter().chain(&self.expert_ddp) {
            ddp.set_sync_enabled(last);
        }
    }
}

impl GptStage<'_> {
    /// The whole vocabulary's logits at position `at` of the sequence, on every rank of
    /// the last stage: the context-parallel rank holding it gathers them over its
    /// tensor-parallel group and hands them to the others.
    fn logits_at(&self, output: &Tensor, at: usize) -> Result<Vec<f32>> {
        let tp = self.model.tp();
        let vocab = self.model.config().vocab;
        let sizes = ferrotron_mappings::split_sizes(vocab, tp.size())?;
        let (owner, local) = context_position(at, self.len * tp.context_size(), tp)?;
        let mut logits = vec![0.0; vocab];
        if owner == tp.context_rank() {
            let last = output.narrow(0, local, 1)?;
            let full = ferrotron_mappings::gather_from_region(&last, tp.group(), 2, Some(&sizes))?;
            logits = full.to_vec()?;
        }
        if let Some(group) = tp.context_parallel() {
            group.broadcast_slice(&mut logits, owner)?;
        }
        Ok(logits)
    }
}

/// This context-parallel rank's positions of sequence-first `values` (`len` positions of
/// `rows` each): its two chunks, in the order it holds them. Empty stays empty.
fn context_part<T: Copy>(
    values: &[T],
    len: usize,
    rows: usize,
    tp: &TensorParallel,
) -> Result<Vec<T>> {
    if values.is_empty() {
        return Ok(Vec::new());
    }
    let chunks =
        ferrotron_layers::context_parallel_chunks(len, tp.context_rank(), tp.context_size())?;
    Ok(chunks
        .iter()
        .flat_map(|&(start, c)| values[start * rows..(start + c) * rows].iter().copied())
        .collect())
}

/// Which context-parallel rank holds position `at` of a `len`-long sequence, and where
/// among its own positions.
fn context_position(at: usize, len: usize, tp: &TensorParallel) -> Result<(usize, usize)> {
    let cp = tp.context_size();
    if cp == 1 {
        return Ok((0, at));
    }
    let chunk = len / (2 * cp);
    let index = at / chunk;
    Ok(match index < cp {
        true => (index, at % chunk),
        false => (2 * cp - 1 - index, chunk + at % chunk),
    })
}

/// The step's routing over every mixture of experts of the model and every rank's
/// tokens, as a line: token slots per expert (summed over the layers) and the fraction
/// dropped. `None` for a dense model. Collective over the data- (and context-) parallel
/// and pipeline groups.
fn expert_routing(chunks: &Chunks<'_>) -> Result<Option<String>> {
    let Some((config, _)) = chunks.config.model.moe else {
        return Ok(None);
    };
    let mut counts = vec![0.0f64; config.num_experts + 1];
    for moe in chunks.models.iter().flat_map(Gpt::experts) {
        let stats = moe.take_stats();
        for (total, n) in counts.iter_mut().zip(&stats.tokens_per_expert) {
            *total += *n as f64;
        }
        counts[config.num_experts] += stats.dropped as f64;
    }
    let state = chunks.state;
    for group in [state.dp_with_cp(), state.pp()] {
        group.all_reduce_slice(&mut counts, ferrotron_comm_core::ReduceOp::Sum)?;
    }
    let (per_expert, dropped) = counts.split_at(config.num_experts);
    let slots: f64 = per_expert.iter().sum();
    let list: Vec<String> = per_expert.iter().map(|n| format!("{n:.0}")).collect();
    Ok(Some(format!(
        "  experts: token slots {} | dropped {:.1}%",
        list.join(" "),
        100.0 * dropped[0] / slots.max(1.0)
    )))
}

/// This data-parallel rank's sampler: its rows of every global batch.
fn sampler(corpus: &Corpus, config: &TrainConfig, state: &ParallelState) -> DistributedSampler {
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
struct Microbatch {
    ids: Vec<usize>,
    labels: Vec<i64>,
    positions: Option<Vec<usize>>,
}

/// This data-parallel rank's rows `starts` of a global batch of `split`, split into the
/// configured microbatches.
fn microbatches(
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
fn validation_loss(chunks: &mut Chunks<'_>, corpus: &Corpus) -> Result<f32> {
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
fn by_microbatch(starts: &[usize], ranks: usize, microbatches: usize) -> Vec<usize> {
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
fn sequence_first<T: Copy>(rows: &[T], seq: usize) -> Vec<T> {
    let batch = rows.len() / seq;
    (0..seq)
        .flat_map(|s| (0..batch).map(move |b| rows[b * seq + s]))
        .collect()
}

/// Continues `prompt` by [`SAMPLE_TOKENS`] tokens. The last stage's tensor-parallel ranks
/// gather the full last-position logits and draw from the same generator, so they agree
/// on each token, which they broadcast to the other stages.
fn generate(
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
fn sample(logits: &[f32], generator: &mut Generator) -> u32 {
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

/// What a step after the first costs in host↔device traffic, on average.
struct Steady {
    transfers: Transfers,
    host_waits: f64,
    profile: Option<StepsProfile>,
    /// What share of the communication the compute hid (modelled, emulated device).
    hidden: Option<Hidden>,
    /// A step's mean modelled time, seconds (emulated device).
    modelled_step: Option<f64>,
}

/// The mean of per-step transfer counts (none: zero).
fn mean(steps: &[Transfers]) -> Transfers {
    let n = steps.len().max(1) as u64;
    let total = steps.iter().fold(Transfers::default(), |sum, &t| sum + t);
    Transfers {
        to_device_bytes: total.to_device_bytes / n,
        to_device_copies: total.to_device_copies / n,
        to_host_bytes: total.to_host_bytes / n,
        to_host_copies: total.to_host_copies / n,
    }
}
