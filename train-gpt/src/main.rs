//! Trains a small byte-level GPT with tensor parallelism (ferrotron's `layers`) and data
//! parallelism (`ddp`), by default TP = 2 × DP = 2 as four rank threads on the CPU:
//!
//! ```text
//! cargo run --release -p ferrotron-train-gpt
//! cargo run --release -p ferrotron-train-gpt -- --check     # also TP = DP = 1, compare
//! cargo run --release -p ferrotron-train-gpt -- --data my.txt --steps 300
//! cargo run --release -p ferrotron-train-gpt -- --steps 100 --save ckpt
//! cargo run --release -p ferrotron-train-gpt -- --steps 200 --resume ckpt
//! cargo build --release -p ferrotron-train-gpt --features mpi
//! mpirun -n 4 target/release/train-gpt --backend mpi
//! cargo run --release -p ferrotron-train-gpt -- --backend nccl --device cuda:0
//! ```
//!
//! Model: vocabulary-parallel token embedding + learned position embedding → `--layers`
//! pre-norm transformer blocks → final layer norm → column-parallel head (logits stay
//! divided over the vocabulary) → vocabulary-parallel cross-entropy. Every rank builds
//! its part from the same seeded master weights, and each data-parallel rank reads only its
//! rows of the same global batches, so any TP × DP layout follows the one-rank run up to
//! f32 rounding; `--check` measures that.
//!
//! Output: a progress bar on stderr (plain lines on stdout when stderr is not a terminal),
//! the loss curve as `loss.csv` (and the held-out validation loss as `validation.csv`)
//! and both as `loss.svg` in `--out` (default `target/train_gpt`, relative to the current
//! directory), and a few lines sampled from the trained model. `--save` writes a
//! checkpoint that `--resume` continues exactly: the same TP × DP layout reproduces the
//! uninterrupted run's losses bit for bit.

mod checkpoint;
mod data;
mod faults;
mod hf;
mod memory;
mod model;
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
mod placement;
mod plan;
mod report;
mod stop;
mod train;

// Training steps allocate and free many large arrays: mimalloc, told to keep freed pages,
// hands them to the next step without page faults (see the performance chapter); each
// allocation is counted against its rank for `measured peak per rank`.
#[global_allocator]
static ALLOCATOR: memory::Counting = memory::Counting;

/// Keeps the memory a step frees for the next step instead of returning it to the OS.
fn keep_freed_memory() {
    // `mi_option_purge_delay` is 15 in the mimalloc v2 sources libmimalloc-sys builds
    // (between its `mi_option_eager_commit_delay` and `mi_option_use_numa_nodes`); -1: never.
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: sets a plain integer option; mimalloc reads options atomically.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, -1) }
}

use anyhow::{bail, ensure, Result};
use clap::{Parser, ValueEnum};
use data::Corpus;
use ferrotron_comm_core::{run_local, Communicator, DualCommunicator};
use ferrotron_tape::{LrDecay, WsdAnneal};
use model::GptConfig;
use report::Progress;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use train::{train_rank, Hidden, RankResult, Schedule, TrainConfig};

/// `--attention`: the attention core's kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Attention {
    /// `unfused` on CUDA, where ferrotron's fused kernel (on CUDA cores, in f32) is still
    /// several times slower than the products on cuBLAS; `fused` on the CPU and the
    /// emulated device.
    Auto,
    /// FlashAttention-2's scheme: no sequence² tensor kept.
    Fused,
    /// Scores, softmax, dropout and products as separate passes (the reference).
    Unfused,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RecomputeGranularity {
    /// Whole transformer blocks.
    Full,
    /// The attention core of every block (scores, softmax, dropout).
    Selective,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RecomputeMethod {
    Uniform,
    Block,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Backend {
    /// Ranks are threads of this process.
    Local,
    /// One process per rank under mpirun (needs `--features mpi`).
    Mpi,
    /// NCCL between CUDA devices (`--device cuda:N`; ranks take devices N, N+1, ... in
    /// turn, several ranks per device need NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1).
    /// Ranks are threads of this process, or one process per rank under mpirun (with
    /// `--features mpi`); host-side calls go over those threads or MPI.
    Nccl,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Precision {
    /// Everything in f32.
    Fp32,
    /// bf16 parameters and activations; f32 master weights, gradients and loss.
    Bf16,
    /// f16 parameters and activations; f32 master weights, gradients and loss.
    Fp16,
}

impl Precision {
    fn dtype(self) -> ferrotron_tape::DType {
        match self {
            Precision::Fp32 => ferrotron_tape::DType::F32,
            Precision::Bf16 => ferrotron_tape::DType::BF16,
            Precision::Fp16 => ferrotron_tape::DType::F16,
        }
    }
}

#[derive(Parser, Debug)]
#[command(
    about = "Train a GPT with tensor, pipeline, context, data and expert parallelism, checked against one rank"
)]
struct Args {
    /// Tensor-parallel size; must divide --heads.
    #[arg(long, default_value_t = 2)]
    tp: usize,
    /// Data-parallel size [default: 2 with the local backend, world / (tp · pp) under
    /// mpirun].
    #[arg(long)]
    dp: Option<usize>,
    /// Pipeline stages; must divide --layers (times --virtual-stages).
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Context-parallel size: attention runs as a ring over --cp ranks, each holding two
    /// chunks of every sequence (Megatron's balanced split); --seq must divide by 2 × cp.
    #[arg(long, default_value_t = 1)]
    cp: usize,
    /// Experts in each mixture-of-experts MLP (0: dense MLPs).
    #[arg(long, default_value_t = 0)]
    num_experts: usize,
    /// Expert-parallel size: the experts are divided among this many of the data- (times
    /// context-) parallel ranks, which send each other their tokens.
    #[arg(long, default_value_t = 1)]
    expert_parallel: usize,
    /// Experts each token goes to.
    #[arg(long, default_value_t = 2)]
    moe_top_k: usize,
    /// Keep at most ceil(tokens × top-k / experts × F) of a rank's tokens per expert, those
    /// with the highest router weights [default: keep every token].
    #[arg(long)]
    moe_capacity_factor: Option<f64>,
    /// Softmax over every expert before the top-k choice (the weights then need not add up
    /// to 1).
    #[arg(long)]
    moe_router_pre_softmax: bool,
    /// The load-balancing loss's coefficient (Switch/GShard form).
    #[arg(long, default_value_t = 0.0)]
    moe_aux_loss_coeff: f64,
    /// The router z-loss's coefficient.
    #[arg(long, default_value_t = 0.0)]
    moe_z_loss_coeff: f64,
    /// A mixture of experts in every N-th block from the first (1: every block, 2: every
    /// other).
    #[arg(long, default_value_t = 1)]
    moe_layer_freq: usize,
    /// Each expert's inner width [default: 4 × --hidden].
    #[arg(long)]
    moe_ffn_hidden_size: Option<usize>,
    /// The inner width of a shared expert beside the routed ones in each mixture of
    /// experts, which every token goes through (DeepSeek's shared experts).
    #[arg(long)]
    moe_shared_expert_intermediate_size: Option<usize>,
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = PipelineSchedule::OneFOneB)]
    schedule: PipelineSchedule,
    /// Model chunks per pipeline stage (the interleaved schedule).
    #[arg(long, default_value_t = 1)]
    virtual_stages: usize,
    /// Microbatches per step; must divide --batch.
    #[arg(long, default_value_t = 1)]
    microbatches: usize,
    /// Write the last step's pipeline timeline as Chrome trace JSON (local backend); on
    /// the emulated device also each stage rank's device streams, a track per stream, on
    /// the modelled timeline.
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Print world rank 0's kernels per step (launches, bytes, achieved GB/s and
    /// TFLOP/s; time on CUDA), over the steps after the first (needs --device).
    #[arg(long)]
    profile: bool,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Model width; must be divisible by --heads.
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Key/value heads, each shared by --heads / G query heads (grouped-query
    /// attention, Megatron's flag); must divide --heads, and --tp must divide it. Without
    /// it every head has its own key and value.
    #[arg(long, value_name = "G", value_parser = clap::value_parser!(u64).range(1..))]
    num_query_groups: Option<u64>,
    /// The attention core's kernel: `fused` (FlashAttention-2's scheme, no sequence²
    /// tensor kept), `unfused` (separate passes, the reference) or `auto` (the faster
    /// of the two on the device).
    #[arg(long, value_enum, default_value_t = Attention::Auto)]
    attention: Attention,
    /// Context length in bytes.
    #[arg(long, default_value_t = 64)]
    seq: usize,
    /// Give the output layer its own weight instead of the token embedding's table
    /// (Megatron's flag; tied by default, as Megatron's GPT).
    #[arg(long)]
    untie_embeddings_and_output_weights: bool,
    /// Dropout probability on each residual branch, in training (Megatron's
    /// --hidden-dropout).
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    hidden_dropout: f64,
    /// Dropout probability on the attention probabilities, in training.
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    attention_dropout: f64,
    /// Sequences per data-parallel rank per step (global batch = batch · dp).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// The step to stop at; a resumed run counts the saved steps too.
    #[arg(long, default_value_t = 500)]
    steps: usize,
    /// Seed of the master weights, the batches and the sampling.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Peak AdamW learning rate.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Learning rate at the end of the decay [default: a tenth of --lr].
    #[arg(long)]
    min_lr: Option<f64>,
    /// Steps of linear warm-up from --lr-warmup-init to --lr. As in Megatron, update k
    /// takes the rate at position k − 1: the first runs at --lr-warmup-init, and update
    /// --lr-warmup-steps + 1 at --lr.
    #[arg(long, default_value_t = 100)]
    lr_warmup_steps: u64,
    /// The learning rate the warm-up starts from.
    #[arg(long, default_value_t = 0.0, value_name = "LR")]
    lr_warmup_init: f64,
    /// The schedule position (updates applied, warm-up included) at which the decay
    /// reaches --min-lr: update --lr-decay-steps + 1 is the first at it. Fixed rather
    /// than derived from --steps, so that a run cut short and resumed follows the same
    /// schedule as an uninterrupted one.
    #[arg(long, default_value_t = 500)]
    lr_decay_steps: u64,
    /// Shape of the decay after the warm-up.
    #[arg(long, alias = "lr-decay-style", value_enum, default_value_t = Decay::Cosine)]
    lr_decay: Decay,
    /// With --lr-decay wsd: the final steps before --lr-decay-steps over which the rate
    /// anneals from --lr to --min-lr (it stays at --lr before them).
    #[arg(long, value_name = "STEPS")]
    lr_wsd_decay_steps: Option<u64>,
    /// With --lr-decay wsd: the anneal's shape.
    #[arg(long, value_enum, default_value_t = WsdStyle::Exponential)]
    lr_wsd_decay_style: WsdStyle,
    /// AdamW's decoupled weight decay; as in Megatron, biases and 1-D parameters (norms)
    /// are not decayed.
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Scale the gradients down when their global L2 norm exceeds this (Megatron's
    /// --clip-grad, whose default this is); 0 turns clipping off. A step whose gradient
    /// norm is not finite is skipped.
    #[arg(long, value_name = "NORM", default_value_t = 1.0)]
    clip_grad: f64,
    /// Shard AdamW's moments over the data-parallel ranks (Megatron's distributed
    /// optimizer, ZeRO-1/2): gradients are reduce-scattered, each rank updates its shard
    /// and the parameters are all-gathered. Same results; checkpoints load either way.
    #[arg(long)]
    use_distributed_optimizer: bool,
    /// Start each gradient bucket's reduction only after backward instead of as soon as
    /// its last gradient is ready (Megatron without --overlap-grad-reduce): to compare
    /// what the overlap hides.
    #[arg(long)]
    no_overlap_grad_reduce: bool,
    /// With --use-distributed-optimizer: all-gather each bucket's updated parameters in
    /// the order the next forward reads them and set them when first read, so the gathers
    /// run beside the step's end and that forward (Megatron's --overlap-param-gather).
    /// Same results.
    #[arg(long)]
    overlap_param_gather: bool,
    /// Post each pipeline exchange's receives when the previous exchange ends, so that
    /// received activations and gradients are copied beside the compute before them
    /// (Megatron's --overlap-p2p-comm). Same results; not with --backend nccl.
    #[arg(long)]
    overlap_p2p_comm: bool,
    /// Gradients per data-parallel bucket (Megatron's --ddp-bucket-size): smaller buckets
    /// start their reductions earlier in backward. Default: PyTorch's caps (1 MiB for the
    /// first bucket, 25 MiB for the others).
    #[arg(long, value_name = "ELEMENTS", value_parser = clap::value_parser!(u64).range(1..))]
    ddp_bucket_size: Option<u64>,
    /// Storage format of parameters and activations. Ops compute in f32 and round their
    /// results; the loss, gradients, master weights and AdamW stay f32 (Megatron's
    /// --bf16 / --fp16 with f32 main gradients).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    precision: Precision,
    /// With --precision fp16, the loss scale of the first step (PyTorch's GradScaler
    /// default). A step whose gradients overflow is skipped on every rank and halves
    /// the scale.
    #[arg(long, value_name = "SCALE")]
    initial_loss_scale: Option<f64>,
    /// With --precision fp16, the finite steps in a row after which the loss scale
    /// doubles.
    #[arg(long, value_name = "STEPS")]
    loss_scale_window: Option<u32>,
    /// Fault injection for testing fp16 loss scaling (as Megatron's error injection):
    /// at this step the last rank (of the last pipeline stage) multiplies its loss by
    /// infinity before backward, so its gradients overflow; every rank must skip the
    /// step and halve the scale.
    #[arg(long, value_name = "STEP")]
    inject_grad_overflow: Option<usize>,
    /// Validation loss on the held-out tenth of the data every this many steps and after
    /// the last one; 0 turns it off.
    #[arg(long, default_value_t = 50)]
    eval_interval: usize,
    /// Global batches of held-out text each validation reads.
    #[arg(long, default_value_t = 2)]
    eval_batches: usize,
    /// Split activations outside the tensor-parallel regions along the sequence
    /// (Megatron's sequence parallelism); needs --seq >= --tp.
    #[arg(long)]
    sequence_parallel: bool,
    /// Communication backend.
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    backend: Backend,
    /// Threads per rank for CPU matrix products [default: this machine's cores divided
    /// among its ranks, so ranks × threads never exceed the cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Where tensors live and compute: cpu, cuda:N (the first device for `--backend nccl`),
    /// or emulated (the CUDA code path run on the host; slow, for checking).
    #[arg(long, default_value = "cpu")]
    device: ferrotron_tape::Device,
    /// Save checkpoints under this directory, each in its own `step_NNNNNNN` (at the end,
    /// every --save-interval steps, and when a SIGTERM or SIGINT stops the run): the
    /// weights and the AdamW state (safetensors, one file per tensor-parallel rank), the
    /// random streams, the step, data position and loss history. A save is written
    /// under a temporary name, flushed and renamed into place, and only then does the
    /// `latest` marker name it.
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    /// Also save every this many steps.
    #[arg(long, value_name = "N", requires = "save", value_parser = clap::value_parser!(u64).range(1..))]
    save_interval: Option<u64>,
    /// Recompute activations in backward instead of keeping them, with the same dropout
    /// masks (Megatron's --recompute-granularity): `full` whole blocks, as
    /// --recompute-method says; `selective` each block's attention core.
    #[arg(long, value_enum)]
    recompute_granularity: Option<RecomputeGranularity>,
    /// `uniform`: the blocks of each model chunk in groups of --recompute-num-layers,
    /// each group recomputed; `block`: only the first --recompute-num-layers blocks of
    /// each chunk, one by one.
    #[arg(long, value_enum, requires = "recompute_granularity")]
    recompute_method: Option<RecomputeMethod>,
    /// Blocks per group (uniform) or blocks recomputed per chunk (block).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    recompute_num_layers: u64,
    /// Write each checkpoint in the background: the state is copied to host memory at
    /// the step and written while training goes on; a save completes (and becomes the
    /// latest) when the next one starts or the run ends.
    #[arg(long, requires = "save")]
    async_save: bool,
    /// Keep only the newest this many checkpoints under --save (all by default).
    #[arg(long, value_name = "K", requires = "save", value_parser = clap::value_parser!(u64).range(1..))]
    save_keep: Option<u64>,
    /// Continue a run saved with --save, up to --steps: a checkpoint directory, a --save
    /// directory (its newest complete checkpoint), or `auto` (the newest under --save,
    /// or a fresh start when there is none: a job script can simply be re-submitted).
    /// Weights, optimizer state, schedule position, random streams and data position are
    /// restored. Any --tp, --pp, --virtual-stages and data-parallel size works (layers
    /// and shards are re-cut); the global batch (--batch × data-parallel size) and the
    /// model sizes must be the saved ones.
    #[arg(long, value_name = "DIR|auto")]
    resume: Option<PathBuf>,
    /// Start from the weights of this Hugging Face GPT-2 directory (config.json and
    /// model.safetensors, as `export-hf` writes them), cut to this run's layout; its sizes
    /// must be the run's --layers, --hidden, --heads and --seq.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    init_from: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
    /// Train on this text file instead of the built-in documentation corpus.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Train on Megatron-LM indexed datasets: a prefix (PREFIX.idx and PREFIX.bin, as
    /// preprocess_data.py or `preprocess` writes them), or weights and prefixes in pairs
    /// to blend them (0.3 a 0.7 b). Needs --tokenizer.
    #[arg(long, num_args = 1.., value_name = "[WEIGHT] PREFIX", conflicts_with = "data", requires = "tokenizer")]
    data_path: Option<Vec<String>>,
    /// With --data-path: the training, validation and test weights that cut each
    /// dataset's sequences (Megatron's --split).
    #[arg(long, default_value = "969,30,1")]
    split: String,
    /// The Hugging Face tokenizer.json of --data-path's tokens: it sets the vocabulary
    /// (padded to a multiple of 128 × TP) and writes the samples.
    #[arg(long, value_name = "FILE", requires = "data_path")]
    tokenizer: Option<PathBuf>,
    /// Leave out of the loss every position whose input is the end-of-document token
    /// (Megatron's --eod-mask-loss: no prediction from one document into the next);
    /// needs --tokenizer.
    #[arg(long, requires = "tokenizer")]
    eod_mask_loss: bool,
    /// Count positions from 0 again after every end-of-document token (Megatron's
    /// --reset-position-ids; attention still spans the whole window); needs --tokenizer.
    #[arg(long, requires = "tokenizer")]
    reset_position_ids: bool,
    /// The end-of-document token's text, for --eod-mask-loss and --reset-position-ids.
    #[arg(long, default_value = "<|endoftext|>")]
    eod_token: String,
    /// Predict the peak memory per rank of each pipeline stage for these flags, by
    /// category, and exit without training.
    #[arg(long)]
    plan: bool,
    /// With --plan: list the layouts of --world ranks that fit this much memory per rank
    /// (e.g. 80GiB), with the bytes each sends per step, instead of planning this one.
    #[arg(long, value_name = "BYTES", requires = "plan", requires = "world")]
    fit: Option<ferrotron_planner::Bytes>,
    /// With --fit: ranks in all (TP × PP × DP).
    #[arg(long, requires = "fit")]
    world: Option<usize>,
    /// With --fit: sequences per step over all data-parallel ranks, the same for every
    /// layout (default: --batch × 2, the batch of the default DP 2).
    #[arg(long, requires = "fit")]
    global_batch_size: Option<usize>,
    /// With --fit: sequences per microbatch.
    #[arg(long, requires = "fit", default_value_t = 1)]
    micro_batch_size: usize,
    /// With --fit: the largest tensor-parallel size to consider (TP stays inside a node).
    #[arg(long, requires = "fit", default_value_t = 8)]
    max_tp: usize,
    /// Directory for loss.csv and loss.svg.
    #[arg(long, value_name = "DIR", default_value = "target/train_gpt")]
    out: PathBuf,
    /// Also train with TP = 1, DP = 1 on one rank (same seed, same global batches) and
    /// print the largest per-step loss difference as the last line.
    #[arg(long)]
    check: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum PipelineSchedule {
    /// Every forward, then every backward.
    Gpipe,
    /// One forward, one backward (Megatron's default).
    #[value(name = "1f1b")]
    OneFOneB,
    /// 1F1B over --virtual-stages chunks per stage.
    Interleaved,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Decay {
    Constant,
    Linear,
    Cosine,
    /// --lr · √(warm-up / position) after the warm-up, never below --min-lr, and
    /// --min-lr after --lr-decay-steps.
    InverseSquareRoot,
    /// Warmup-stable-decay: --lr until the last --lr-wsd-decay-steps, then an anneal.
    #[value(alias = "WSD")]
    Wsd,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum WsdStyle {
    Linear,
    Cosine,
    Exponential,
    #[value(alias = "minus_sqrt")]
    MinusSqrt,
}

/// What else the binary does besides training.
#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Write a checkpoint as a Hugging Face GPT-2 directory (config.json and
    /// model.safetensors) that transformers.GPT2LMHeadModel.from_pretrained loads.
    ExportHf {
        /// A --save directory (its newest checkpoint) or one checkpoint in it.
        #[arg(long, value_name = "CHECKPOINT")]
        from: PathBuf,
        /// The directory to write.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
    /// Print a checkpoint's next-token logits after a prompt of token ids, computed on
    /// one rank (what an export must reproduce).
    Logits {
        /// A --save directory (its newest checkpoint) or one checkpoint in it.
        #[arg(long, value_name = "CHECKPOINT")]
        from: PathBuf,
        /// Token ids, separated by commas.
        #[arg(long, value_delimiter = ',', required = true)]
        ids: Vec<usize>,
    },
}

fn main() -> ExitCode {
    keep_freed_memory();
    let mut args = Args::parse();
    let done = match &args.command {
        Some(Command::ExportHf { from, out }) => hf::export(from, out),
        Some(Command::Logits { from, ids }) => hf::logits(from, ids).map(|logits| {
            println!(
                "logits: {}",
                serde_json::to_string(&logits).unwrap_or_default()
            )
        }),
        None => resolve_resume(&mut args).and_then(|more| match more {
            true => run(&args),
            false => Ok(()),
        }),
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {}", describe(&error));
            ExitCode::FAILURE
        }
    }
}

/// The cause chain on one line, without a backtrace. A rank's failure already quotes its
/// cause, which is then not repeated.
fn describe(error: &anyhow::Error) -> String {
    let mut message = error.to_string();
    for cause in error.chain().skip(1) {
        let cause = cause.to_string();
        if !message.contains(&cause) {
            message = format!("{message}: {cause}");
        }
    }
    message
}

/// Turns `--resume DIR` into the checkpoint it names (DIR itself, the one its `latest`
/// marker names, or its newest complete `step_*`), and `--resume auto` into the newest
/// checkpoint under `--save`, or none (a fresh start) when there is none yet. Returns
/// whether there is anything to train: with `auto`, a run already saved at `--steps` is
/// complete (a requeued job reruns its command, and exits normally, as Megatron's does).
fn resolve_resume(args: &mut Args) -> Result<bool> {
    let Some(dir) = args.resume.take() else {
        return Ok(true);
    };
    if dir.as_os_str() == "auto" {
        let Some(save) = &args.save else {
            bail!("--resume auto continues the run saved under --save DIR; pass --save too");
        };
        args.resume = checkpoint::newest(save)?;
        let Some(newest) = &args.resume else {
            println!("no checkpoint under {} yet: starting fresh", save.display());
            return Ok(true);
        };
        let done = checkpoint::TrainerState::read(newest)?.losses.len();
        if done >= args.steps {
            println!(
                "the run is complete: {} is at step {done} of --steps {}; nothing to train",
                newest.display(),
                args.steps
            );
            return Ok(false);
        }
        return Ok(true);
    }
    match checkpoint::newest(&dir)? {
        Some(found) => args.resume = Some(found),
        None => bail!(
            "{} holds no complete checkpoint (no trainer_state.json, no `latest` marker, no \
             complete step_* directory); pass a directory written by --save",
            dir.display()
        ),
    }
    Ok(true)
}

fn run(args: &Args) -> Result<()> {
    let corpus = match (&args.data, &args.data_path, &args.tokenizer) {
        (_, Some(words), Some(tokenizer)) => Corpus::megatron(
            ferrotron_datasets::parse_blend(words)?,
            ferrotron_datasets::parse_split(&args.split)?,
            args.seed,
            data::Vocabulary::from_file(tokenizer)?,
        )?,
        (Some(path), _, _) => Corpus::from_file(path, args.seq)?,
        _ => Corpus::builtin(),
    };
    corpus.check_window(args.seq)?;
    if args.plan {
        return plan(args, &corpus);
    }
    let devices = match args.backend {
        Backend::Nccl => Some(nccl_devices(args)?),
        _ => None,
    };
    // A device that cannot be opened fails here, naming the missing driver or library.
    // Opening one makes a context on it, so a process opens only its own: under a
    // launcher, the one its local rank takes (not every process on --device's).
    let own = match (&devices, under_mpirun(), placement::from_environment()) {
        (Some(devices), true, Some(placement)) => {
            ferrotron_tape::Device::Cuda(placement.device_of(devices))
        }
        _ => args.device,
    };
    if own != ferrotron_tape::Device::Cpu {
        ferrotron_tape::Tensor::<f32>::zeros(&[1]).to_device(own)?;
    }
    match (args.backend, devices) {
        (Backend::Mpi, _) => run_mpi_backend(args, &corpus, None),
        (_, Some(devices)) if under_mpirun() => run_mpi_backend(args, &corpus, Some(devices)),
        (_, devices) => run_local_backend(args, &corpus, devices),
    }
}

/// `--plan`: the flags as the planner's model and layout (or search, with `--fit`).
fn plan(args: &Args, corpus: &Corpus) -> Result<()> {
    ensure!(
        args.cp == 1,
        "--plan does not model context parallelism yet; plan with --cp 1"
    );
    // What experts hold depends on how the router spreads the tokens (dropless), so a
    // dense plan would be wrong, not merely rough.
    ensure!(
        args.num_experts == 0,
        "--plan does not model a mixture of experts yet; plan the dense model (without \
         --num-experts) and measure the mixture by training it"
    );
    ensure!(
        !matches!(args.device, ferrotron_tape::Device::Cuda(_)),
        "--plan predicts host memory (and the emulated device's, which is host memory); \
         CUDA memory is not modelled yet: plan with --device cpu or --device emulated"
    );
    let Some(budget) = args.fit else {
        let dp = planned_dp(args)?;
        validate(args, dp, &corpus.vocabulary)?;
        return Ok(plan::print_layout(
            &planned_model(args, corpus),
            &planned_layout(args, dp, corpus),
        )?);
    };
    let search = ferrotron_planner::Search {
        world: args.world.unwrap_or(0),
        budget: budget.0,
        global_batch: match args.global_batch_size {
            Some(global) => global,
            None => args.batch * planned_dp(args)?,
        },
        micro_batch: args.micro_batch_size,
        max_tp: args.max_tp,
        element: args.precision.dtype().size_in_bytes(),
        target: planned_target(args),
        corpus_bytes: corpus.len(),
    };
    Ok(plan::print_fit(&planned_model(args, corpus), &search)?)
}

/// Under a launcher the world size sets DP, which the plan cannot see before MPI starts.
fn planned_dp(args: &Args) -> Result<usize> {
    Ok(match (args.dp, under_mpirun()) {
        (Some(dp), _) => dp,
        (None, false) => 2,
        (None, true) => bail!("--plan under a launcher: pass --dp, as the world would set it"),
    })
}

/// Whether the attention core runs fused (`--attention`, `auto` resolved for the device).
fn fused_attention(args: &Args) -> bool {
    match args.attention {
        Attention::Auto => !matches!(args.device, ferrotron_tape::Device::Cuda(_)),
        Attention::Fused => true,
        Attention::Unfused => false,
    }
}

fn planned_model(args: &Args, corpus: &Corpus) -> ferrotron_planner::Model {
    ferrotron_planner::Model {
        layers: args.layers,
        hidden: args.hidden,
        heads: args.heads,
        query_groups: query_groups(args),
        fused_attention: fused_attention(args),
        ffn: 4 * args.hidden,
        vocab: corpus.vocabulary.padded(args.tp),
        seq: args.seq,
        tied: !args.untie_embeddings_and_output_weights,
        hidden_dropout: args.hidden_dropout > 0.0,
        attention_dropout: args.attention_dropout > 0.0,
    }
}

fn planned_target(args: &Args) -> ferrotron_planner::Target {
    match args.device {
        ferrotron_tape::Device::Cpu => ferrotron_planner::Target::Cpu,
        _ => ferrotron_planner::Target::Device,
    }
}

fn planned_layout(args: &Args, dp: usize, corpus: &Corpus) -> ferrotron_planner::Layout {
    let layers = args.recompute_num_layers as usize;
    let recompute = match (args.recompute_granularity, args.recompute_method) {
        (Some(RecomputeGranularity::Selective), _) => ferrotron_planner::Recompute::Selective,
        (Some(RecomputeGranularity::Full), Some(RecomputeMethod::Block)) => {
            ferrotron_planner::Recompute::Block { layers }
        }
        (Some(RecomputeGranularity::Full), _) => ferrotron_planner::Recompute::Uniform { layers },
        (None, _) => ferrotron_planner::Recompute::None,
    };
    ferrotron_planner::Layout {
        tp: args.tp,
        pp: args.pp,
        dp,
        schedule: pipeline_schedule(args),
        microbatches: args.microbatches,
        batch: args.batch,
        element: args.precision.dtype().size_in_bytes(),
        distributed_optimizer: args.use_distributed_optimizer,
        sequence_parallel: args.sequence_parallel,
        recompute,
        target: planned_target(args),
        corpus_bytes: corpus.len(),
    }
}

/// The CUDA devices `--backend nccl` gives its ranks in turn: `--device cuda:N` and the
/// ones after it. Fails before any rank starts when NCCL or the devices are missing.
#[cfg(feature = "cuda")]
fn nccl_devices(args: &Args) -> Result<std::ops::Range<usize>> {
    use ferrotron_comm_core::cuda::{self, Library};
    let ferrotron_tape::Device::Cuda(first) = args.device else {
        bail!(
            "--backend nccl moves CUDA memory, but --device is {}; pass --device cuda:N",
            args.device
        );
    };
    cuda::require(Library::Nccl, "--backend nccl")?;
    let count = cuda::device_count()?;
    ensure!(
        first < count,
        "--device cuda:{first}, but this machine has {count} CUDA device(s)"
    );
    Ok(first..count)
}

#[cfg(not(feature = "cuda"))]
fn nccl_devices(_: &Args) -> Result<std::ops::Range<usize>> {
    bail!(
        "--backend nccl: this binary was built without CUDA (libcuda, libnccl); build it \
         with `cargo build --release -p ferrotron-train-gpt --features cuda`"
    )
}

/// A rank's world, the same world as a dual communicator when it is one, and its device.
type Connected = (
    Arc<dyn Communicator>,
    Option<Arc<DualCommunicator>>,
    ferrotron_tape::Device,
);

/// This rank's world communicator and the device it computes on: `comm` itself on the
/// CPU; on a device a dual communicator over `comm` for host memory whose groups open a
/// device communicator when first used (with `devices`, NCCL on the rank's device, the
/// node's in turn by local rank), returned twice so the launcher can say what it opened.
fn connect(
    comm: Arc<dyn Communicator>,
    device: ferrotron_tape::Device,
    devices: Option<std::ops::Range<usize>>,
    placement: placement::Placement,
) -> Result<Connected> {
    let (world, device) = match devices {
        None if device == ferrotron_tape::Device::Cpu => return Ok((comm, None, device)),
        // Each group's device calls on a split of its own, opened when first used: what
        // the emulated device runs where NCCL would open a communicator.
        None => (
            DualCommunicator::opening(comm.clone(), comm, DualCommunicator::split_opener())?,
            device,
        ),
        Some(devices) => {
            let ordinal = placement.device_of(&devices);
            (
                nccl_world(comm, ordinal)?,
                ferrotron_tape::Device::Cuda(ordinal),
            )
        }
    };
    let world = Arc::new(world);
    Ok((world.clone(), Some(world), device))
}

/// The world over NCCL on device `ordinal`, each group's NCCL communicator opened when
/// first used (none for a group of one rank).
#[cfg(feature = "cuda")]
fn nccl_world(comm: Arc<dyn Communicator>, ordinal: usize) -> Result<DualCommunicator> {
    let nccl = ferrotron_comm_core::NcclCommunicator::new(comm.clone(), ordinal)?;
    let opener = nccl.opener();
    Ok(DualCommunicator::opening(comm, Arc::new(nccl), opener)?)
}

#[cfg(not(feature = "cuda"))]
fn nccl_world(_: Arc<dyn Communicator>, _: usize) -> Result<DualCommunicator> {
    unreachable!("nccl_devices refuses --backend nccl without the cuda feature")
}

/// The progress report of a run of `ranks` ranks training `model` on `dp` data-parallel
/// ranks' batches.
fn progress(
    label: &'static str,
    args: &Args,
    model: &GptConfig,
    dp: usize,
    ranks: usize,
) -> Progress {
    let tokens = args.batch * dp * args.seq;
    let flops_per_rank = model.flops_per_token() * tokens as f64 / ranks as f64;
    Progress::new(label, args.steps, tokens, flops_per_rank)
}

/// TP × DP rank threads in this process, over NCCL on `devices` when given.
fn run_local_backend(
    args: &Args,
    corpus: &Corpus,
    devices: Option<std::ops::Range<usize>>,
) -> Result<()> {
    let dp = args.dp.unwrap_or(2);
    validate(args, dp, &corpus.vocabulary)?;
    let config = training_config(args, &corpus.vocabulary);
    let world = args.tp * args.pp * args.cp * dp;
    if let Some(devices) = &devices {
        let shared = std::env::var("NCCL_MULTI_RANK_GPU_ENABLE").is_ok_and(|v| v.trim() == "1");
        ensure!(
            world <= devices.len() || shared,
            "--backend nccl: {world} ranks on {} CUDA device(s) put several ranks on one GPU, \
             which NCCL allows only from 2.30 and with NCCL_MULTI_RANK_GPU_ENABLE=1; set it, \
             or use fewer ranks",
            devices.len()
        );
    }
    announce(args, corpus, dp);
    let progress = progress("train", args, &config.model, dp, world);
    let mut results = run_local(world, |comm| {
        // Unset, tape already divides the cores among this world's rank threads.
        if let Some(threads) = args.threads {
            ferrotron_tape::set_num_threads(threads)?;
        }
        let rank = comm.rank();
        // Every rank thread is on this node.
        let placement = placement::Placement {
            local_rank: rank,
            local_size: comm.size(),
        };
        let (world, dual, device) =
            connect(Arc::new(comm), config.device, devices.clone(), placement)?;
        let config = TrainConfig {
            device,
            ..config.clone()
        };
        let progress = (rank == 0).then_some(&progress);
        let mut result = train_rank(world, &config, corpus, progress)?;
        result.device_groups = dual.map(|dual| dual.opened());
        Ok::<_, anyhow::Error>(result)
    })?;
    if let Some(path) = &args.trace {
        // The first tensor- and data-parallel replica's stages, in pipeline order.
        let mut stages: Vec<_> = results
            .iter()
            .filter(|r| r.coordinates.1 == 0 && r.coordinates.2 == 0 && r.coordinates.3 == 0)
            .map(|r| (r.coordinates.0, r.timeline.clone(), r.streams.clone()))
            .collect();
        stages.sort_by_key(|s| s.0);
        let (timelines, streams): (Vec<_>, Vec<_>) =
            stages.into_iter().map(|(_, t, s)| (t, s)).unzip();
        let trace = ferrotron_pipeline::chrome_trace_with_streams(&timelines, &streams);
        std::fs::write(path, trace)?;
        println!("pipeline timeline of the last step: {}", path.display());
    }
    let busiest = busiest_rank(results.iter().map(step_costs));
    let peak = busiest[5] as usize;
    let state = (results.iter().map(|r| busiest_model_state(r, peak)))
        .reduce(|most, s| most.into_iter().zip(s).map(|(m, s)| m.max(s)).collect())
        .unwrap_or_default();
    let stages = (results.iter().map(|r| stage_memory(r, args.pp)))
        .fold(vec![0.0f64; 2 * args.pp], |most, s| {
            most.into_iter().zip(s).map(|(m, s)| m.max(s)).collect()
        });
    let mut result = results.swap_remove(0);
    set_step_costs(&mut result, busiest);
    set_model_state(&mut result, &state);
    set_stage_memory(&mut result, &stages);
    finish(args, corpus, dp, result)
}

/// The groups whose communication the overlap figure names, in the order it names them.
fn overlap_groups() -> impl Iterator<Item = &'static str> {
    ferrotron_parallel_state::GroupKind::ALL
        .into_iter()
        .map(|kind| kind.name())
        .chain(["world"])
}

/// A rank's transfers and host waits per step, its peak memory, its modelled step time,
/// and the share of its communication left exposed, in all and of each of
/// [`overlap_groups`] (-1: none), as numbers to take the largest of.
fn step_costs(result: &RankResult) -> Vec<f64> {
    let t = result.transfers_per_step;
    let hidden = result.communication_hidden.as_ref();
    let exposed = |share: Option<f64>| share.map_or(-1.0, |hidden| 1.0 - hidden);
    let by_group = overlap_groups().map(|name| {
        let groups = hidden.map(|h| h.by_group.as_slice()).unwrap_or_default();
        exposed(
            groups
                .iter()
                .find(|(g, _)| g == name)
                .map(|(_, share)| *share),
        )
    });
    [
        t.to_device_bytes as f64,
        t.to_device_copies as f64,
        t.to_host_bytes as f64,
        t.to_host_copies as f64,
        result.host_waits_per_step,
        result.peak_bytes as f64,
        result.modelled_step.unwrap_or(-1.0),
        exposed(hidden.map(|h| h.all)),
    ]
    .into_iter()
    .chain(by_group)
    .collect()
}

/// The model state and the peak's phases of the rank with the largest peak, given that
/// peak (the ranks that reach it report theirs, the others zeros, and the largest of
/// each figure is kept).
fn busiest_model_state(result: &RankResult, peak: usize) -> Vec<f64> {
    let s = result.model_state;
    let state = [s.values, s.grads, s.masters, s.moments];
    let mine = state.iter().chain(&result.peak_phases).map(|&b| b as f64);
    match result.peak_bytes == peak {
        true => mine.collect(),
        false => vec![0.0; state.len() + result.peak_phases.len()],
    }
}

/// This rank's peak and model state in its pipeline stage's slots (the others zero), as
/// numbers to take the largest of over the ranks: `pp` peaks, then `pp` model states.
fn stage_memory(result: &RankResult, pp: usize) -> Vec<f64> {
    let mut slots = vec![0.0; 2 * pp];
    let stage = result.coordinates.0;
    slots[stage] = result.peak_bytes as f64;
    slots[pp + stage] = result.model_state.total() as f64;
    slots
}

fn set_stage_memory(result: &mut RankResult, slots: &[f64]) {
    let pp = slots.len() / 2;
    result.stage_peaks = (0..pp)
        .map(|s| [slots[s] as usize, slots[pp + s] as usize])
        .collect();
}

fn set_model_state(result: &mut RankResult, figures: &[f64]) {
    let [values, grads, masters, moments] = [0, 1, 2, 3].map(|i| figures[i] as usize);
    result.model_state.values = values;
    result.model_state.grads = grads;
    result.model_state.masters = masters;
    result.model_state.moments = moments;
    for (phase, &bytes) in result.peak_phases.iter_mut().zip(&figures[4..]) {
        *phase = bytes as usize;
    }
}

/// The largest of each figure over the ranks: the report shows the busiest rank's (the
/// last pipeline stage reads the loss, the first uploads the batch).
fn busiest_rank(costs: impl Iterator<Item = Vec<f64>>) -> Vec<f64> {
    costs
        .reduce(|most, c| most.into_iter().zip(c).map(|(m, c)| m.max(c)).collect())
        .unwrap_or_default()
}

fn set_step_costs(result: &mut RankResult, costs: Vec<f64>) {
    let [to_device, to_device_copies, to_host, to_host_copies, waits, peak, step, exposed] =
        std::array::from_fn(|i| costs.get(i).copied().unwrap_or(-1.0));
    // The rank that hides the least speaks for the run, for each group too.
    let hidden = |exposed: f64| (exposed >= 0.0).then_some(1.0 - exposed);
    result.modelled_step = (step >= 0.0).then_some(step);
    let by_group = (overlap_groups().zip(costs.iter().skip(8)))
        .filter_map(|(name, &exposed)| Some((name.to_string(), hidden(exposed)?)))
        .collect();
    result.communication_hidden = hidden(exposed).map(|all| Hidden { all, by_group });
    result.peak_bytes = peak as usize;
    result.transfers_per_step = ferrotron_tape::Transfers {
        to_device_bytes: to_device as u64,
        to_device_copies: to_device_copies as u64,
        to_host_bytes: to_host as u64,
        to_host_copies: to_host_copies as u64,
    };
    result.host_waits_per_step = waits;
}

#[cfg(feature = "mpi")]
fn run_mpi_backend(
    args: &Args,
    corpus: &Corpus,
    devices: Option<std::ops::Range<usize>>,
) -> Result<()> {
    let mpi = ferrotron_comm_core::mpi::MpiWorld::init()?;
    let world: Arc<dyn Communicator> = Arc::new(mpi.world()?);
    let size = world.size();
    // Ranks of one model replica: tensor- times pipeline- times context-parallel.
    let mp = args.tp * args.pp * args.cp;
    if size == 1 && mp * args.dp.unwrap_or(1) > 1 {
        let ranks = mp * args.dp.unwrap_or(2);
        bail!(
            "--backend mpi found 1 process, but --tp {} × --pp {} needs {ranks}; start one \
             process per rank with `mpirun -n {ranks} {} --backend mpi ...`{}",
            args.tp,
            args.pp,
            std::env::args()
                .next()
                .unwrap_or_else(|| "train-gpt".into()),
            if under_mpirun() {
                ""
            } else {
                " (this process was not started by mpirun)"
            }
        );
    }
    let dp = match args.dp {
        Some(dp) => dp,
        None if size.is_multiple_of(mp) => size / mp,
        None => bail!(
            "mpirun started {size} processes, which --tp {} × --pp {} × --cp {} does not \
             divide; valid --tp at --pp 1 and --cp 1: {}",
            args.tp,
            args.pp,
            args.cp,
            list(&valid_tp(size, query_groups(args)))
        ),
    };
    if mp * dp != size {
        let fix = if size.is_multiple_of(mp) {
            format!("pass --dp {}", size / mp)
        } else {
            format!(
                "pass a --tp among {}",
                list(&valid_tp(size, query_groups(args)))
            )
        };
        bail!(
            "--tp {} × --pp {} × --cp {} × --dp {dp} = {} ranks, but mpirun started {size}; \
             {fix}, or run mpirun -n {}",
            args.tp,
            args.pp,
            args.cp,
            mp * dp,
            mp * dp
        );
    }
    validate(args, dp, &corpus.vocabulary)?;
    // This node's processes as the launcher reports them (else assume all are here):
    // they share its cores and take its devices in turn.
    let placement = placement::from_environment().unwrap_or(placement::Placement {
        local_rank: world.rank(),
        local_size: size,
    });
    ferrotron_tape::set_num_threads(
        args.threads
            .unwrap_or_else(|| (ferrotron_tape::num_threads() / placement.local_size).max(1)),
    )?;
    let rank0 = world.rank() == 0;
    if rank0 {
        announce(args, corpus, dp);
    }
    let (world, dual, device) = connect(world, args.device, devices, placement)?;
    let config = TrainConfig {
        device,
        ..training_config(args, &corpus.vocabulary)
    };
    let progress = rank0.then(|| progress("train", args, &config.model, dp, size));
    let mut result = train_rank(world.clone(), &config, corpus, progress.as_ref())?;
    result.device_groups = dual.map(|dual| dual.opened());
    // The busiest rank's transfers and host waits, as the threads backend reports them.
    let mut costs = step_costs(&result);
    ferrotron_comm_core::CommunicatorExt::all_reduce_slice(
        &*world,
        &mut costs,
        ferrotron_comm_core::ReduceOp::Max,
    )?;
    let mut state = busiest_model_state(&result, costs[5] as usize);
    ferrotron_comm_core::CommunicatorExt::all_reduce_slice(
        &*world,
        &mut state,
        ferrotron_comm_core::ReduceOp::Max,
    )?;
    let mut stages = stage_memory(&result, args.pp);
    ferrotron_comm_core::CommunicatorExt::all_reduce_slice(
        &*world,
        &mut stages,
        ferrotron_comm_core::ReduceOp::Max,
    )?;
    set_step_costs(&mut result, costs);
    set_model_state(&mut result, &state);
    set_stage_memory(&mut result, &stages);
    if rank0 {
        finish(args, corpus, dp, result)?;
    }
    Ok(())
}

/// Whether a launcher (OpenMPI, MPICH/PMI, Slurm's PMIx) started this process.
fn under_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|name| std::env::var_os(name).is_some())
}

#[cfg(not(feature = "mpi"))]
fn run_mpi_backend(_: &Args, _: &Corpus, _: Option<std::ops::Range<usize>>) -> Result<()> {
    bail!(
        "--backend mpi: this binary was built without MPI; build it with `cargo build \
         --release -p ferrotron-train-gpt --features mpi` and run it under `mpirun -n 4 \
         target/release/train-gpt --backend mpi`"
    )
}

/// Checks every flag before any rank starts, saying what would be valid.
fn validate(args: &Args, dp: usize, vocabulary: &data::Vocabulary) -> Result<()> {
    validate_model(args, dp, vocabulary)?;
    ensure!(
        !args.profile || args.device != ferrotron_tape::Device::Cpu,
        "--profile counts device kernels, and the CPU runs none: add --device emulated (launches \
         and bytes) or --device cuda:0 (and their time)"
    );
    ensure!(
        !(args.check && args.eod_mask_loss && args.num_experts > 0 && dp > 1),
        "--check cannot reproduce --eod-mask-loss with --num-experts at --dp {dp} on one \
         rank: the experts route each data-parallel rank's rows apart while the loss \
         weighs each microbatch over all ranks' tokens; check at --dp 1 or without one of \
         them"
    );
    ensure!(
        !(args.eod_mask_loss || args.reset_position_ids)
            || vocabulary.token_id(&args.eod_token).is_some(),
        "--eod-mask-loss and --reset-position-ids: the tokenizer has no token {:?} to end \
         documents with; pass the one the data was made with as --eod-token",
        args.eod_token
    );
    validate_recompute(args)?;
    validate_optimizer(args)?;
    validate_pipeline(args)?;
    if let Some(dir) = &args.init_from {
        let shape = hf::read_shape(dir)?;
        let theirs = (
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.positions,
            shape.vocab,
        );
        ensure!(
            theirs
                == (
                    args.layers,
                    args.hidden,
                    args.heads,
                    args.seq,
                    vocabulary.size()
                ),
            "{} is a GPT-2 of {} layers, width {}, {} heads, {} positions and {} tokens: pass \
             --layers {} --hidden {} --heads {} --seq {} (and the tokenizer it was trained with)",
            dir.display(),
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.positions,
            shape.vocab,
            shape.layers,
            shape.hidden,
            shape.heads,
            shape.positions
        );
        ensure!(
            shape.tied != args.untie_embeddings_and_output_weights,
            "{} has {} embeddings: {} --untie-embeddings-and-output-weights",
            dir.display(),
            if shape.tied { "tied" } else { "untied" },
            if shape.tied { "drop" } else { "pass" }
        );
    }
    if let Some(dir) = &args.resume {
        let saved = checkpoint::TrainerState::read(dir)?;
        let model = train_config(args, vocabulary).model;
        saved.check_compatible(&model, args.batch * dp, args.steps)?;
    }
    Ok(())
}

/// `--recompute-method` goes with `full` recomputation, and `full` needs one.
fn validate_recompute(args: &Args) -> Result<()> {
    match (args.recompute_granularity, args.recompute_method) {
        (Some(RecomputeGranularity::Full), None) => bail!(
            "--recompute-granularity full needs --recompute-method: uniform (the blocks in \
             groups of --recompute-num-layers) or block (the first --recompute-num-layers \
             blocks of each model chunk)"
        ),
        (Some(RecomputeGranularity::Selective), Some(_)) => bail!(
            "--recompute-method applies to --recompute-granularity full; selective \
             recomputes every block's attention core: drop --recompute-method"
        ),
        _ => Ok(()),
    }
}

/// Key/value heads: `--num-query-groups`, else one per head.
fn query_groups(args: &Args) -> usize {
    args.num_query_groups.map_or(args.heads, |g| g as usize)
}

/// `--num-query-groups` against the heads and the tensor-parallel split.
fn validate_query_groups(args: &Args) -> Result<()> {
    let Some(groups) = args.num_query_groups.map(|g| g as usize) else {
        return Ok(());
    };
    ensure!(
        args.heads.is_multiple_of(groups),
        "--num-query-groups {groups} does not divide --heads {}; valid groups: {}",
        args.heads,
        list(&divisors(args.heads))
    );
    ensure!(
        groups.is_multiple_of(args.tp),
        "--num-query-groups {groups} cannot be divided among --tp {} ranks (each rank \
         holds whole groups); valid --tp: {}",
        args.tp,
        list(&divisors(groups))
    );
    Ok(())
}

/// The model's and the batch's sizes against the tensor-parallel split.
fn validate_model(args: &Args, dp: usize, vocabulary: &data::Vocabulary) -> Result<()> {
    ensure!(args.tp >= 1, "--tp must be at least 1");
    ensure!(dp >= 1, "--dp must be at least 1");
    validate_context_parallel(args)?;
    validate_experts(args, dp)?;
    ensure!(args.heads >= 1, "--heads must be at least 1");
    ensure!(
        args.hidden.is_multiple_of(args.heads),
        "--hidden {} is not divisible by --heads {}; valid --heads for this width: {}",
        args.hidden,
        args.heads,
        list(&divisors(args.hidden))
    );
    ensure!(
        args.heads.is_multiple_of(args.tp),
        "--heads {} cannot be divided among --tp {} ranks; valid --tp for {} heads: {}",
        args.heads,
        args.tp,
        args.heads,
        list(&divisors(args.heads))
    );
    validate_query_groups(args)?;
    ensure!(
        args.tp <= vocabulary.size(),
        "--tp {} exceeds the {}-byte vocabulary it divides",
        args.tp,
        vocabulary.size()
    );
    ensure!(
        args.layers >= 1 && args.seq >= 1 && args.batch >= 1 && args.steps >= 1,
        "--layers, --seq, --batch and --steps must be at least 1"
    );
    ensure!(
        !args.sequence_parallel || args.seq >= args.tp,
        "--sequence-parallel splits the --seq {} positions among --tp {} ranks; pass \
         --seq >= {}",
        args.seq,
        args.tp,
        args.tp
    );
    for (flag, p) in [
        ("--hidden-dropout", args.hidden_dropout),
        ("--attention-dropout", args.attention_dropout),
    ] {
        ensure!(
            (0.0..1.0).contains(&p),
            "{flag} {p} is not a probability below 1"
        );
    }
    ensure!(args.eval_batches >= 1, "--eval-batches must be at least 1");
    Ok(())
}

/// Context parallelism: two equal chunks of every sequence per rank, and no attention
/// dropout (the ring keeps no probabilities to draw a mask over).
fn validate_context_parallel(args: &Args) -> Result<()> {
    ensure!(args.cp >= 1, "--cp must be at least 1");
    if args.cp == 1 {
        return Ok(());
    }
    ensure!(
        args.seq.is_multiple_of(2 * args.cp),
        "--cp {} gives each rank two equal chunks of every sequence, so --seq {} must be a \
         multiple of {}; pass --seq {}",
        args.cp,
        args.seq,
        2 * args.cp,
        (args.seq / (2 * args.cp)).max(1) * 2 * args.cp
    );
    ensure!(
        args.attention_dropout == 0.0,
        "--attention-dropout {} with --cp {}: the ring attention keeps no probabilities to draw \
         a dropout mask over; pass --attention-dropout 0",
        args.attention_dropout,
        args.cp
    );
    ensure!(
        !args.sequence_parallel || args.seq / args.cp >= args.tp,
        "--sequence-parallel splits each context-parallel rank's {} positions among --tp {} \
         ranks; pass --seq >= {}",
        args.seq / args.cp,
        args.tp,
        args.tp * args.cp
    );
    Ok(())
}

/// The mixture of experts: experts the expert-parallel size divides, expert-parallel
/// ranks within the data-parallel ones, and routing settings in range.
fn validate_experts(args: &Args, dp: usize) -> Result<()> {
    if args.num_experts == 0 {
        ensure!(
            args.expert_parallel == 1,
            "--expert-parallel {} needs experts: pass --num-experts",
            args.expert_parallel
        );
        ensure!(
            args.moe_shared_expert_intermediate_size.is_none(),
            "--moe-shared-expert-intermediate-size needs experts: pass --num-experts"
        );
        return Ok(());
    }
    let (experts, ep) = (args.num_experts, args.expert_parallel);
    ensure!(ep >= 1, "--expert-parallel must be at least 1");
    ensure!(
        experts.is_multiple_of(ep),
        "--num-experts {experts} cannot be divided among --expert-parallel {ep} ranks; valid \
         --expert-parallel: {}",
        list(&divisors(experts))
    );
    ensure!(
        (dp * args.cp).is_multiple_of(ep),
        "--expert-parallel {ep} groups ranks of the --dp {dp} × --cp {} data-parallel ones; \
         pass an --expert-parallel that divides {}",
        args.cp,
        dp * args.cp
    );
    ensure!(
        (1..=experts).contains(&args.moe_top_k),
        "--moe-top-k {} must be between 1 and --num-experts {experts}",
        args.moe_top_k
    );
    ensure!(
        args.moe_capacity_factor
            .is_none_or(|f| f.is_finite() && f > 0.0),
        "--moe-capacity-factor must be positive"
    );
    ensure!(
        args.moe_layer_freq >= 1,
        "--moe-layer-freq must be at least 1"
    );
    ensure!(
        args.moe_ffn_hidden_size != Some(0),
        "--moe-ffn-hidden-size must be at least 1"
    );
    ensure!(
        args.moe_shared_expert_intermediate_size != Some(0),
        "--moe-shared-expert-intermediate-size must be at least 1"
    );
    ensure!(
        args.init_from.is_none() || args.moe_shared_expert_intermediate_size.is_none(),
        "--init-from upcycles the dense MLP into routed experts only: a shared expert would \
         start from nothing and change the model's function; drop \
         --moe-shared-expert-intermediate-size or --init-from"
    );
    Ok(())
}

/// The schedule, AdamW and the loss scaling.
fn validate_optimizer(args: &Args) -> Result<()> {
    ensure!(
        args.lr > 0.0 && args.lr.is_finite(),
        "--lr must be positive"
    );
    ensure!(
        (args.lr_decay == Decay::Wsd) == args.lr_wsd_decay_steps.is_some(),
        "--lr-decay wsd needs --lr-wsd-decay-steps (the anneal's length), and \
         --lr-wsd-decay-steps needs --lr-decay wsd"
    );
    schedule(args).build()?;
    ensure!(
        args.weight_decay >= 0.0 && args.weight_decay.is_finite(),
        "--weight-decay must be a finite number ≥ 0"
    );
    ensure!(
        args.clip_grad >= 0.0 && args.clip_grad.is_finite(),
        "--clip-grad must be a finite number ≥ 0 (0 turns clipping off)"
    );
    ensure!(
        matches!(args.precision, Precision::Fp16)
            || (args.initial_loss_scale.is_none()
                && args.loss_scale_window.is_none()
                && args.inject_grad_overflow.is_none()),
        "--initial-loss-scale, --loss-scale-window and --inject-grad-overflow are about the \
         loss scaling of --precision fp16 (bf16 has f32's range and f32 needs no scaling); \
         drop them or pass --precision fp16"
    );
    if let Some(scaler) = loss_scaler(args) {
        ferrotron_layers::GradScaler::new(scaler)?;
    }
    // A later step than --steps is allowed: a run cut short and resumed keeps its flags.
    ensure!(
        args.inject_grad_overflow != Some(0),
        "--inject-grad-overflow counts steps from 1"
    );
    Ok(())
}

/// The pipeline's split of the layers and the microbatches its schedule can run.
fn validate_pipeline(args: &Args) -> Result<()> {
    ensure!(args.pp >= 1, "--pp must be at least 1");
    ensure!(
        args.virtual_stages == 1 || args.schedule == PipelineSchedule::Interleaved,
        "--virtual-stages {} needs --schedule interleaved",
        args.virtual_stages
    );
    let parts = args.pp * pipeline_schedule(args).chunks();
    ensure!(
        parts >= 1 && args.layers.is_multiple_of(parts),
        "--layers {} cannot be split evenly over --pp {} × --virtual-stages {} = {parts} \
         parts; valid --pp × --virtual-stages: {}",
        args.layers,
        args.pp,
        args.virtual_stages,
        list(&divisors(args.layers))
    );
    ensure!(
        args.microbatches >= 1 && args.batch.is_multiple_of(args.microbatches),
        "--microbatches {} must divide --batch {}; valid: {}",
        args.microbatches,
        args.batch,
        list(&divisors(args.batch))
    );
    pipeline_schedule(args).validate(args.pp, args.microbatches)?;
    ensure!(
        !args.overlap_param_gather || args.use_distributed_optimizer,
        "--overlap-param-gather overlaps the distributed optimizer's parameter all-gather: \
         add --use-distributed-optimizer"
    );
    ensure!(
        !args.overlap_p2p_comm || args.backend != Backend::Nccl,
        "--overlap-p2p-comm posts pipeline receives ahead, which NCCL cannot do alone \
         without risking a deadlock: leave it out with --backend nccl"
    );
    ensure!(
        args.trace.is_none() || args.backend == Backend::Local,
        "--trace collects every stage's timeline in one process: use the local backend"
    );
    Ok(())
}

fn train_config(args: &Args, vocabulary: &data::Vocabulary) -> TrainConfig {
    TrainConfig {
        model: GptConfig {
            vocab: vocabulary.padded(args.tp),
            valid_vocab: vocabulary.size(),
            layers: args.layers,
            hidden: args.hidden,
            heads: args.heads,
            query_groups: args.num_query_groups.map(|g| g as usize),
            attention: match fused_attention(args) {
                true => ferrotron_tape::AttentionKernel::Fused,
                false => ferrotron_tape::AttentionKernel::Unfused,
            },
            seq: args.seq,
            tied: !args.untie_embeddings_and_output_weights,
            attention_dropout: args.attention_dropout,
            hidden_dropout: args.hidden_dropout,
            recompute_attention_core: args.recompute_granularity
                == Some(RecomputeGranularity::Selective),
            moe: moe_config(args),
        },
        tp: args.tp,
        pp: args.pp,
        cp: args.cp,
        ep: args.expert_parallel,
        pipeline: pipeline_schedule(args),
        microbatches: args.microbatches,
        trace: args.trace.is_some(),
        sequence_parallel: args.sequence_parallel,
        device: args.device,
        batch: args.batch,
        steps: args.steps,
        seed: args.seed,
        schedule: schedule(args),
        clip_grad: (args.clip_grad > 0.0).then_some(args.clip_grad),
        distributed_optimizer: args.use_distributed_optimizer,
        overlap_grad_reduce: !args.no_overlap_grad_reduce,
        overlap_param_gather: args.overlap_param_gather,
        overlap_p2p: args.overlap_p2p_comm,
        bucket_elements: args.ddp_bucket_size.map(|n| n as usize),
        precision: args.precision.dtype(),
        weight_decay: args.weight_decay,
        loss_scaler: loss_scaler(args),
        inject_grad_overflow: args.inject_grad_overflow,
        eval_interval: args.eval_interval,
        eval_batches: args.eval_batches,
        resume: args.resume.clone(),
        init_from: args.init_from.clone(),
        save: args.save.clone(),
        save_interval: args.save_interval.map(|n| n as usize),
        save_keep: args.save_keep.map(|n| n as usize),
        async_save: args.async_save,
        recompute: recompute(args),
        // Installed where training starts (`training_config`), not while checking flags.
        stop: None,
        sample: true,
        check_tied: args.check,
        profile: args.profile,
        rows_from_ranks: 1,
        eod_mask: eod_id(args.eod_mask_loss, args, vocabulary),
        reset_positions: eod_id(args.reset_position_ids, args, vocabulary),
    }
}

/// The end-of-document token's id when `wanted` (`validate` has checked that the
/// tokenizer has it).
fn eod_id(wanted: bool, args: &Args, vocabulary: &data::Vocabulary) -> Option<u32> {
    wanted
        .then(|| vocabulary.token_id(&args.eod_token))
        .flatten()
}

/// The mixture of experts and how often a block has one, with --num-experts.
fn moe_config(args: &Args) -> Option<(ferrotron_layers::MoeConfig, usize)> {
    (args.num_experts > 0).then(|| {
        let config = ferrotron_layers::MoeConfig {
            softmax: match args.moe_router_pre_softmax {
                true => ferrotron_layers::RouterSoftmax::BeforeTopK,
                false => ferrotron_layers::RouterSoftmax::AfterTopK,
            },
            aux_loss_coeff: args.moe_aux_loss_coeff,
            z_loss_coeff: args.moe_z_loss_coeff,
            capacity_factor: args.moe_capacity_factor,
            shared_expert_ffn: args.moe_shared_expert_intermediate_size,
            ..ferrotron_layers::MoeConfig::new(
                args.num_experts,
                args.moe_top_k,
                args.moe_ffn_hidden_size.unwrap_or(4 * args.hidden),
            )
        };
        (config, args.moe_layer_freq)
    })
}

/// The run's configuration, with SIGTERM and SIGINT now asking it to stop after a step
/// (a signal before this point ends the program as usual).
fn training_config(args: &Args, vocabulary: &data::Vocabulary) -> TrainConfig {
    TrainConfig {
        stop: Some(stop::install()),
        ..train_config(args, vocabulary)
    }
}

/// The blocks `--recompute-granularity full` recomputes.
fn recompute(args: &Args) -> Option<model::Recompute> {
    let layers = args.recompute_num_layers as usize;
    if args.recompute_granularity != Some(RecomputeGranularity::Full) {
        return None;
    }
    Some(match args.recompute_method? {
        RecomputeMethod::Uniform => model::Recompute::Uniform(layers),
        RecomputeMethod::Block => model::Recompute::Block(layers),
    })
}

/// Dynamic loss scaling for fp16 (on by default there, as in PyTorch's AMP recipe and
/// Megatron's --fp16); `None` otherwise, where the flags are refused before training.
fn loss_scaler(args: &Args) -> Option<ferrotron_layers::GradScalerConfig> {
    let defaults = ferrotron_layers::GradScalerConfig::default();
    matches!(args.precision, Precision::Fp16).then(|| ferrotron_layers::GradScalerConfig {
        init_scale: args.initial_loss_scale.unwrap_or(defaults.init_scale),
        growth_interval: args.loss_scale_window.unwrap_or(defaults.growth_interval),
        ..defaults
    })
}

fn pipeline_schedule(args: &Args) -> ferrotron_pipeline::Schedule {
    match args.schedule {
        PipelineSchedule::Gpipe => ferrotron_pipeline::Schedule::GPipe,
        PipelineSchedule::OneFOneB => ferrotron_pipeline::Schedule::OneFOneB,
        PipelineSchedule::Interleaved => ferrotron_pipeline::Schedule::Interleaved {
            virtual_stages: args.virtual_stages,
        },
    }
}

fn schedule(args: &Args) -> Schedule {
    Schedule {
        lr: args.lr,
        min_lr: args.min_lr.unwrap_or(args.lr / 10.0),
        init_lr: args.lr_warmup_init,
        warmup_steps: args.lr_warmup_steps,
        decay_steps: args.lr_decay_steps,
        decay: match args.lr_decay {
            Decay::Constant => LrDecay::Constant,
            Decay::Linear => LrDecay::Linear,
            Decay::Cosine => LrDecay::Cosine,
            Decay::InverseSquareRoot => LrDecay::InverseSquareRoot,
            Decay::Wsd => LrDecay::Wsd {
                // Refused before training when missing; 0 only reaches the check.
                anneal_steps: args.lr_wsd_decay_steps.unwrap_or(0),
                style: match args.lr_wsd_decay_style {
                    WsdStyle::Linear => WsdAnneal::Linear,
                    WsdStyle::Cosine => WsdAnneal::Cosine,
                    WsdStyle::Exponential => WsdAnneal::Exponential,
                    WsdStyle::MinusSqrt => WsdAnneal::MinusSqrt,
                },
            },
        },
    }
}

fn announce(args: &Args, corpus: &Corpus, dp: usize) {
    println!(
        "GPT: {} layers, hidden {}, {} heads, context {} | TP {} × PP {}{} × DP {} = {} \
         ranks{}{}{} on the {} backend, {}{} | {} steps of {} sequences | data: {}",
        args.layers,
        args.hidden,
        args.heads,
        args.seq,
        args.tp,
        args.pp,
        match args.cp {
            1 => String::new(),
            cp => format!(" × CP {cp}"),
        },
        dp,
        args.tp * args.pp * args.cp * dp,
        if args.pp > 1 || args.microbatches > 1 {
            format!(
                ", {} schedule, {} microbatches{}",
                pipeline_schedule(args).name(),
                args.microbatches,
                if args.virtual_stages > 1 {
                    format!(", {} chunks per stage", args.virtual_stages)
                } else {
                    String::new()
                }
            )
        } else {
            String::new()
        },
        if args.sequence_parallel {
            " with sequence parallelism"
        } else {
            ""
        },
        if args.use_distributed_optimizer {
            ", AdamW sharded over DP"
        } else {
            ""
        },
        match args.backend {
            Backend::Local => "local",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        },
        args.device,
        match args.precision {
            Precision::Fp32 => "",
            Precision::Bf16 => ", bf16",
            Precision::Fp16 => ", fp16",
        },
        args.steps,
        args.batch * dp,
        corpus.describe()
    );
    if args.num_experts > 0 {
        println!(
            "mixture of experts: {} experts, top-{}, in {}, divided among {} expert-parallel \
             ranks, {}",
            args.num_experts,
            args.moe_top_k,
            match args.moe_layer_freq {
                1 => "every block".to_string(),
                n => format!("blocks 0, {n}, {}, …", 2 * n),
            },
            args.expert_parallel,
            match args.moe_capacity_factor {
                Some(f) => format!("capacity factor {f}"),
                None => "dropless".to_string(),
            } + &match args.moe_shared_expert_intermediate_size {
                Some(width) => format!(", a shared expert of width {width}"),
                None => String::new(),
            }
        );
    }
    if let Some(dir) = &args.resume {
        println!("resuming the run saved in {}", dir.display());
        let old = checkpoint::TrainerState::read(dir).is_ok_and(|s| s.format < 2);
        if old {
            println!(
                "note: this checkpoint predates Megatron's schedule position and weight-decay \
                 groups: the steps from here take the rate one position earlier and leave \
                 biases and norms undecayed, unlike the run that saved it"
            );
        }
    }
}

/// On world rank 0 after training: the loss curve, the samples and, with --check, the
/// comparison against one rank. The comparison's line is the program's last.
fn finish(args: &Args, corpus: &Corpus, dp: usize, result: RankResult) -> Result<()> {
    // Training is over: a signal from here on (during --check, say) ends the program.
    stop::uninstall();
    let losses = &result.losses;
    println!(
        "loss: {:.4} at step 1 → {:.4} at step {}",
        losses[0],
        losses[losses.len() - 1],
        losses.len()
    );
    if let Some((step, loss)) = result.validation.last() {
        println!("validation loss: {loss:.4} at step {step}");
    }
    std::fs::create_dir_all(&args.out)?;
    let (csv, svg) = (args.out.join("loss.csv"), args.out.join("loss.svg"));
    let training: Vec<(usize, f32)> = (1..).zip(losses.iter().copied()).collect();
    report::write_csv(&csv, &training)?;
    let validation_csv = args.out.join("validation.csv");
    report::write_csv(&validation_csv, &result.validation)?;
    let title = format!("train-gpt: TP {} × DP {dp}, {}", args.tp, corpus.source);
    report::write_svg(&svg, &training, &result.validation, &title)?;
    println!(
        "loss curve: {}, {} and {}",
        csv.display(),
        validation_csv.display(),
        svg.display()
    );
    if let Some(dir) = result.saved.last() {
        let saves = result.saved.len();
        let wait = result.save_wait.as_secs_f64() * 1e3 / saves as f64;
        println!("checkpoint: {}", dir.display());
        println!("saves: {saves}, training waited {wait:.1} ms per save");
    }
    if let Some(step) = result.stopped {
        match result.saved.last() {
            Some(dir) => println!(
                "stopped by a signal after step {step}; --resume {} continues it",
                dir.display()
            ),
            None => println!("stopped by a signal after step {step}; nothing saved (no --save)"),
        }
        return Ok(());
    }
    println!("samples:");
    for sample in &result.samples {
        println!("  {sample:?}");
    }
    if let Some(profile) = &result.profile {
        print!("{}", report::profile_table(profile));
    }
    if args.device != ferrotron_tape::Device::Cpu {
        let moved = result.transfers_per_step;
        println!(
            "device transfers per step and rank: to device {} bytes, to host {} bytes",
            moved.to_device_bytes, moved.to_host_bytes
        );
        // A mean over the steps, to one decimal (whole numbers print without one).
        let waits = (result.host_waits_per_step * 10.0).round() / 10.0;
        println!("host waits per step and rank: {waits}");
    }
    if let Some(hidden) = &result.communication_hidden {
        // The emulated device's modelled timeline (see `ferrotron_device::timeline`).
        let groups: Vec<String> = (hidden.by_group.iter())
            .map(|(group, share)| format!("{group} {:.1}%", 100.0 * share))
            .collect();
        println!(
            "communication hidden behind compute: {:.1}% (by group: {})",
            100.0 * hidden.all,
            groups.join(", ")
        );
    }
    if let Some(groups) = &result.device_groups {
        // Opened when first used: NCCL communicators on a GPU, their stand-ins elsewhere.
        println!(
            "device communicators opened by rank 0: {} ({})",
            groups.len(),
            groups.join(", ")
        );
    }
    if let Some(step) = result.modelled_step {
        // The same timeline: each call timed at an H200's rates, the slowest rank's step.
        println!("modelled step time: {:.1} µs", step * 1e6);
    }
    let on_gpu = matches!(args.device, ferrotron_tape::Device::Cuda(_));
    println!(
        "measured peak per rank: {} bytes{}",
        result.peak_bytes,
        if on_gpu { " of device memory" } else { "" }
    );
    let s = result.model_state;
    println!(
        "  of which model state {} (parameters {}, gradients {}, master weights {}, AdamW \
         moments {}), activations and the rest {}",
        s.total(),
        s.values,
        s.grads,
        s.masters,
        s.moments,
        result.peak_bytes.saturating_sub(s.total())
    );
    // By phase only where the allocator sees it (host memory, the emulated device's).
    if !on_gpu {
        let phases: Vec<String> = (memory::PHASES.iter().zip(&result.peak_phases))
            .map(|(phase, bytes)| format!("{} {bytes}", phase.name()))
            .collect();
        println!("  held by what allocated it: {}", phases.join(", "));
    }
    if result.stage_peaks.len() > 1 {
        let stages: Vec<String> = (result.stage_peaks.iter().enumerate())
            .map(|(i, [peak, state])| format!("stage {i} {peak} bytes (model state {state})"))
            .collect();
        println!("measured peak per pipeline stage: {}", stages.join(", "));
    }
    if let Some(tied) = result.tied_copies {
        println!("{}", describe_tied_copies(&tied));
    }
    if args.check {
        compare_with_one_rank(args, corpus, dp, &result)?;
    }
    Ok(())
}

/// What `--check` found of the two stages' copies of the tied embedding.
fn describe_tied_copies(tied: &train::TiedCopies) -> String {
    match tied.first_difference {
        None => format!(
            "tied embedding copies: bit-identical on the first and last stage after each of \
             {} steps",
            tied.steps
        ),
        Some((step, elements)) => format!(
            "tied embedding copies: the first and last stage's differ in {elements} \
             elements after step {step}"
        ),
    }
}

/// Trains the same steps on one rank and prints how far this run's losses (and, when
/// clipping, gradient norms) are from its. The loss line comes first; the others say
/// how the differences grow.
fn compare_with_one_rank(
    args: &Args,
    corpus: &Corpus,
    dp: usize,
    result: &RankResult,
) -> Result<()> {
    let serial = check_run(args, corpus, dp)?;
    if args.hidden_dropout > 0.0 || args.attention_dropout > 0.0 {
        println!(
            "note: with dropout each layout draws other masks (per tensor-parallel rank and \
             pipeline stage, as Megatron), so the losses differ by more than rounding"
        );
    }
    let differences: Vec<f32> = (result.losses.iter().zip(&serial.losses))
        .map(|(a, b)| (a - b).abs())
        .collect();
    let largest_by = |steps: usize| {
        differences
            .iter()
            .take(steps)
            .fold(0.0f32, |m, &d| m.max(d))
    };
    // Display never uses an exponent, so this is a plain decimal number.
    println!("max loss difference: {}", largest_by(differences.len()));
    // Rounding differences grow as training amplifies them; show how fast.
    let growth: Vec<String> = [1, 10, 100]
        .into_iter()
        .filter(|&steps| steps < differences.len())
        .map(|steps| format!("{:.1e} by step {steps}", largest_by(steps)))
        .collect();
    if !growth.is_empty() {
        println!("largest difference {}", growth.join(", "));
    }
    // Where the runs part, so that a divergence is located, not only measured.
    match differences.iter().position(|&d| d > 1e-4) {
        Some(i) => println!("first step differing by more than 1e-4: {}", i + 1),
        None => println!("first step differing by more than 1e-4: none"),
    }
    let norms: Vec<f64> = (result.grad_norms.iter())
        .filter_map(|(step, norm)| {
            let (_, serial) = serial.grad_norms.iter().find(|(s, _)| s == step)?;
            Some((norm - serial).abs() / serial.abs().max(f64::MIN_POSITIVE))
        })
        .collect();
    if !norms.is_empty() {
        let largest = norms.iter().fold(0.0f64, |m, &d| m.max(d));
        println!("max relative gradient-norm difference: {largest}");
    }
    Ok(())
}

/// The same training on one rank: TP = 1, DP = 1, the whole global batch.
fn check_run(args: &Args, corpus: &Corpus, dp: usize) -> Result<RankResult> {
    println!("check: the same steps with TP 1 × DP 1 on one rank");
    let mut reference = train_config(args, &corpus.vocabulary);
    // One rank pads the vocabulary for TP 1; the padding is no token either way.
    reference.model.vocab = corpus.vocabulary.padded(1);
    reference.model.recompute_attention_core = false;
    let config = TrainConfig {
        tp: 1,
        pp: 1,
        cp: 1,
        ep: 1,
        pipeline: ferrotron_pipeline::Schedule::OneFOneB,
        // Experts route each data-parallel rank's microbatches by themselves (capacity
        // and load-balancing loss count its tokens): one rank runs them as microbatches
        // of their own, the same rows.
        //
        // Masked positions make microbatches' token counts differ, and the loss weighs
        // each microbatch alike (its mean over the data-parallel ranks' tokens): the
        // reference then runs microbatch m as all ranks' m-th rows together.
        microbatches: match (args.num_experts, args.eod_mask_loss) {
            (0, false) => 1,
            (0, true) => args.microbatches,
            _ => dp * args.microbatches,
        },
        rows_from_ranks: match (args.num_experts, args.eod_mask_loss) {
            (0, true) => dp,
            _ => 1,
        },
        trace: false,
        sequence_parallel: false,
        batch: args.batch * dp,
        // From the start, whatever the run under check resumed from: its losses include
        // the saved steps'.
        resume: None,
        init_from: args.init_from.clone(),
        save: None,
        save_interval: None,
        save_keep: None,
        async_save: false,
        // The reference keeps every activation: --check then also checks recomputation.
        recompute: None,
        stop: None,
        sample: false,
        eval_interval: 0,
        distributed_optimizer: false,
        check_tied: false,
        profile: false,
        ..reference
    };
    let progress = progress("check", args, &config.model, dp, 1);
    let mut results = run_local(1, |comm| {
        train_rank(Arc::new(comm), &config, corpus, Some(&progress))
    })?;
    Ok(results.swap_remove(0))
}

/// Tensor-parallel sizes that divide both the world and the key/value heads.
#[cfg(feature = "mpi")]
fn valid_tp(world: usize, heads: usize) -> Vec<usize> {
    divisors(world)
        .into_iter()
        .filter(|d| heads.is_multiple_of(*d))
        .collect()
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

fn list(values: &[usize]) -> String {
    values
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
