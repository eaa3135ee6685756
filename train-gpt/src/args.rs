//! The demo's flags: what each one means, its default, and the values it takes. Their
//! refusals (combinations that cannot run) are `config`'s.

use clap::{Parser, ValueEnum};
use std::path::PathBuf;

/// `--attention`: the attention core's kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Attention {
    /// `fused` where it runs on tensor cores (bf16 or fp16, heads 64 or 128 wide, compute
    /// capability 8.0 or newer), on the CPU and on the emulated device; `unfused` on
    /// other CUDA runs, where the CUDA-core fused kernel is slower than the products on
    /// cuBLAS. The run's first lines say which.
    Auto,
    /// FlashAttention-2's scheme: no sequence² tensor kept.
    Fused,
    /// Scores, softmax, dropout and products as separate passes (the reference).
    Unfused,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum RecomputeGranularity {
    /// Whole transformer blocks.
    Full,
    /// The attention core of every block (scores, softmax, dropout).
    Selective,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum RecomputeMethod {
    Uniform,
    Block,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Backend {
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
pub(crate) enum Precision {
    /// Everything in f32.
    Fp32,
    /// bf16 parameters and activations; f32 master weights, gradients and loss.
    Bf16,
    /// f16 parameters and activations; f32 master weights, gradients and loss.
    Fp16,
}

impl Precision {
    pub(crate) fn dtype(self) -> ferrotron_tape::DType {
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
pub(crate) struct Args {
    /// Tensor-parallel size; must divide --heads.
    #[arg(long, default_value_t = 2)]
    pub(crate) tp: usize,
    /// Data-parallel size [default: 2 with the local backend, world / (tp · pp) under
    /// mpirun].
    #[arg(long)]
    pub(crate) dp: Option<usize>,
    /// Pipeline stages; must divide --layers (times --virtual-stages).
    #[arg(long, default_value_t = 1)]
    pub(crate) pp: usize,
    /// Context-parallel size: attention runs as a ring over --cp ranks, each holding two
    /// chunks of every sequence (Megatron's balanced split); --seq must divide by 2 × cp.
    #[arg(long, default_value_t = 1)]
    pub(crate) cp: usize,
    /// Experts in each mixture-of-experts MLP (0: dense MLPs).
    #[arg(long, default_value_t = 0)]
    pub(crate) num_experts: usize,
    /// Expert-parallel size: the experts are divided among this many of the data- (times
    /// context-) parallel ranks, which send each other their tokens.
    #[arg(long, default_value_t = 1)]
    pub(crate) expert_parallel: usize,
    /// Experts each token goes to.
    #[arg(long, default_value_t = 2)]
    pub(crate) moe_top_k: usize,
    /// Keep at most ceil(tokens × top-k / experts × F) of a rank's tokens per expert, those
    /// with the highest router weights [default: keep every token].
    #[arg(long)]
    pub(crate) moe_capacity_factor: Option<f64>,
    /// Softmax over every expert before the top-k choice (the weights then need not add up
    /// to 1).
    #[arg(long)]
    pub(crate) moe_router_pre_softmax: bool,
    /// The load-balancing loss's coefficient (Switch/GShard form).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) moe_aux_loss_coeff: f64,
    /// The router z-loss's coefficient.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) moe_z_loss_coeff: f64,
    /// A mixture of experts in every N-th block from the first (1: every block, 2: every
    /// other).
    #[arg(long, default_value_t = 1)]
    pub(crate) moe_layer_freq: usize,
    /// Each expert's inner width [default: 4 × --hidden].
    #[arg(long)]
    pub(crate) moe_ffn_hidden_size: Option<usize>,
    /// The inner width of a shared expert beside the routed ones in each mixture of
    /// experts, which every token goes through (DeepSeek's shared experts).
    #[arg(long)]
    pub(crate) moe_shared_expert_intermediate_size: Option<usize>,
    /// Pipeline schedule.
    #[arg(long, value_enum, default_value_t = PipelineSchedule::OneFOneB)]
    pub(crate) schedule: PipelineSchedule,
    /// Model chunks per pipeline stage (the interleaved schedule).
    #[arg(long, default_value_t = 1)]
    pub(crate) virtual_stages: usize,
    /// Microbatches per step; must divide --batch.
    #[arg(long, default_value_t = 1)]
    pub(crate) microbatches: usize,
    /// Write the last step's pipeline timeline as Chrome trace JSON (local backend); on
    /// the emulated device also each stage rank's device streams, a track per stream, on
    /// the modelled timeline.
    #[arg(long, value_name = "FILE")]
    pub(crate) trace: Option<PathBuf>,
    /// Print world rank 0's kernels per step (launches, bytes, achieved GB/s and
    /// TFLOP/s; time on CUDA), over the steps after the first (needs --device).
    #[arg(long)]
    pub(crate) profile: bool,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub(crate) layers: usize,
    /// Model width; must be divisible by --heads.
    #[arg(long, default_value_t = 64)]
    pub(crate) hidden: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub(crate) heads: usize,
    /// Key/value heads, each shared by --heads / G query heads (grouped-query
    /// attention, Megatron's flag); must divide --heads, and --tp must divide it. Without
    /// it every head has its own key and value.
    #[arg(long, value_name = "G", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) num_query_groups: Option<u64>,
    /// The attention core's kernel: `fused` (FlashAttention-2's scheme, no sequence²
    /// tensor kept), `unfused` (separate passes, the reference) or `auto` (the faster
    /// of the two on the device).
    #[arg(long, value_enum, default_value_t = Attention::Auto)]
    pub(crate) attention: Attention,
    /// Context length in bytes.
    #[arg(long, default_value_t = 64)]
    pub(crate) seq: usize,
    /// Give the output layer its own weight instead of the token embedding's table
    /// (Megatron's flag; tied by default, as Megatron's GPT).
    #[arg(long)]
    pub(crate) untie_embeddings_and_output_weights: bool,
    /// Dropout probability on each residual branch, in training (Megatron's
    /// --hidden-dropout).
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub(crate) hidden_dropout: f64,
    /// Dropout probability on the attention probabilities, in training.
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub(crate) attention_dropout: f64,
    /// Sequences per data-parallel rank per step (global batch = batch · dp).
    #[arg(long, default_value_t = 8)]
    pub(crate) batch: usize,
    /// The step to stop at; a resumed run counts the saved steps too.
    #[arg(long, default_value_t = 500)]
    pub(crate) steps: usize,
    /// Seed of the master weights, the batches and the sampling.
    #[arg(long, default_value_t = 1234)]
    pub(crate) seed: u64,
    /// Peak AdamW learning rate.
    #[arg(long, default_value_t = 2e-3)]
    pub(crate) lr: f64,
    /// Learning rate at the end of the decay [default: a tenth of --lr].
    #[arg(long)]
    pub(crate) min_lr: Option<f64>,
    /// Steps of linear warm-up from --lr-warmup-init to --lr. As in Megatron, update k
    /// takes the rate at position k − 1: the first runs at --lr-warmup-init, and update
    /// --lr-warmup-steps + 1 at --lr.
    #[arg(long, default_value_t = 100)]
    pub(crate) lr_warmup_steps: u64,
    /// The learning rate the warm-up starts from.
    #[arg(long, default_value_t = 0.0, value_name = "LR")]
    pub(crate) lr_warmup_init: f64,
    /// The schedule position (updates applied, warm-up included) at which the decay
    /// reaches --min-lr: update --lr-decay-steps + 1 is the first at it. Fixed rather
    /// than derived from --steps, so that a run cut short and resumed follows the same
    /// schedule as an uninterrupted one.
    #[arg(long, default_value_t = 500)]
    pub(crate) lr_decay_steps: u64,
    /// Shape of the decay after the warm-up.
    #[arg(long, alias = "lr-decay-style", value_enum, default_value_t = Decay::Cosine)]
    pub(crate) lr_decay: Decay,
    /// With --lr-decay wsd: the final steps before --lr-decay-steps over which the rate
    /// anneals from --lr to --min-lr (it stays at --lr before them).
    #[arg(long, value_name = "STEPS")]
    pub(crate) lr_wsd_decay_steps: Option<u64>,
    /// With --lr-decay wsd: the anneal's shape.
    #[arg(long, value_enum, default_value_t = WsdStyle::Exponential)]
    pub(crate) lr_wsd_decay_style: WsdStyle,
    /// AdamW's decoupled weight decay; as in Megatron, biases and 1-D parameters (norms)
    /// are not decayed.
    #[arg(long, default_value_t = 0.01)]
    pub(crate) weight_decay: f64,
    /// Scale the gradients down when their global L2 norm exceeds this (Megatron's
    /// --clip-grad, whose default this is); 0 turns clipping off. A step whose gradient
    /// norm is not finite is skipped.
    #[arg(long, value_name = "NORM", default_value_t = 1.0)]
    pub(crate) clip_grad: f64,
    /// Shard AdamW's moments over the data-parallel ranks (Megatron's distributed
    /// optimizer, ZeRO-1/2): gradients are reduce-scattered, each rank updates its shard
    /// and the parameters are all-gathered. Same results; checkpoints load either way.
    #[arg(long)]
    pub(crate) use_distributed_optimizer: bool,
    /// Start each gradient bucket's reduction only after backward instead of as soon as
    /// its last gradient is ready (Megatron without --overlap-grad-reduce): to compare
    /// what the overlap hides.
    #[arg(long)]
    pub(crate) no_overlap_grad_reduce: bool,
    /// With --use-distributed-optimizer: all-gather each bucket's updated parameters in
    /// the order the next forward reads them and set them when first read, so the gathers
    /// run beside the step's end and that forward (Megatron's --overlap-param-gather).
    /// Same results.
    #[arg(long)]
    pub(crate) overlap_param_gather: bool,
    /// Post each pipeline exchange's receives when the previous exchange ends, so that
    /// received activations and gradients are copied beside the compute before them
    /// (Megatron's --overlap-p2p-comm). Same results; the local backend only.
    #[arg(long)]
    pub(crate) overlap_p2p_comm: bool,
    /// Gradients per data-parallel bucket (Megatron's --ddp-bucket-size): smaller buckets
    /// start their reductions earlier in backward. Default: PyTorch's caps (1 MiB for the
    /// first bucket, 25 MiB for the others).
    #[arg(long, value_name = "ELEMENTS", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) ddp_bucket_size: Option<u64>,
    /// Storage format of parameters and activations. Ops compute in f32 and round their
    /// results; the loss, gradients, master weights and AdamW stay f32 (Megatron's
    /// --bf16 / --fp16 with f32 main gradients).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub(crate) precision: Precision,
    /// With --precision fp16, the loss scale of the first step (PyTorch's GradScaler
    /// default). A step whose gradients overflow is skipped on every rank and halves
    /// the scale.
    #[arg(long, value_name = "SCALE")]
    pub(crate) initial_loss_scale: Option<f64>,
    /// With --precision fp16, the finite steps in a row after which the loss scale
    /// doubles.
    #[arg(long, value_name = "STEPS")]
    pub(crate) loss_scale_window: Option<u32>,
    /// Fault injection for testing fp16 loss scaling (as Megatron's error injection):
    /// at this step the last rank (of the last pipeline stage) multiplies its loss by
    /// infinity before backward, so its gradients overflow; every rank must skip the
    /// step and halve the scale.
    #[arg(long, value_name = "STEP")]
    pub(crate) inject_grad_overflow: Option<usize>,
    /// Validation loss on the held-out tenth of the data every this many steps and after
    /// the last one; 0 turns it off.
    #[arg(long, default_value_t = 50)]
    pub(crate) eval_interval: usize,
    /// Global batches of held-out text each validation reads.
    #[arg(long, default_value_t = 2)]
    pub(crate) eval_batches: usize,
    /// Split activations outside the tensor-parallel regions along the sequence
    /// (Megatron's sequence parallelism); needs --seq >= --tp.
    #[arg(long)]
    pub(crate) sequence_parallel: bool,
    /// Communication backend.
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub(crate) backend: Backend,
    /// Threads per rank for CPU matrix products [default: this machine's cores divided
    /// among its ranks, so ranks × threads never exceed the cores].
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Where tensors live and compute: cpu, cuda:N (the first device for `--backend nccl`),
    /// or emulated (the CUDA code path run on the host; slow, for checking).
    #[arg(long, default_value = "cpu")]
    pub(crate) device: ferrotron_tape::Device,
    /// Save checkpoints under this directory, each in its own `step_NNNNNNN` (at the end,
    /// every --save-interval steps, and when a SIGTERM or SIGINT stops the run): the
    /// weights and the AdamW state (safetensors, one file per tensor-parallel rank), the
    /// random streams, the step, data position and loss history. A save is written
    /// under a temporary name, flushed and renamed into place, and only then does the
    /// `latest` marker name it.
    #[arg(long, value_name = "DIR")]
    pub(crate) save: Option<PathBuf>,
    /// Also save every this many steps.
    #[arg(long, value_name = "N", requires = "save", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) save_interval: Option<u64>,
    /// Recompute activations in backward instead of keeping them, with the same dropout
    /// masks (Megatron's --recompute-granularity): `full` whole blocks, as
    /// --recompute-method says; `selective` each block's attention core.
    #[arg(long, value_enum)]
    pub(crate) recompute_granularity: Option<RecomputeGranularity>,
    /// `uniform`: the blocks of each model chunk in groups of --recompute-num-layers,
    /// each group recomputed; `block`: only the first --recompute-num-layers blocks of
    /// each chunk, one by one.
    #[arg(long, value_enum, requires = "recompute_granularity")]
    pub(crate) recompute_method: Option<RecomputeMethod>,
    /// Blocks per group (uniform) or blocks recomputed per chunk (block).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) recompute_num_layers: u64,
    /// Write each checkpoint in the background: the state is copied to host memory at
    /// the step and written while training goes on; a save completes (and becomes the
    /// latest) when the next one starts or the run ends.
    #[arg(long, requires = "save")]
    pub(crate) async_save: bool,
    /// Keep only the newest this many checkpoints under --save (all by default).
    #[arg(long, value_name = "K", requires = "save", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) save_keep: Option<u64>,
    /// Continue a run saved with --save, up to --steps: a checkpoint directory, a --save
    /// directory (its newest complete checkpoint), or `auto` (the newest under --save,
    /// or a fresh start when there is none: a job script can simply be re-submitted).
    /// Weights, optimizer state, schedule position, random streams and data position are
    /// restored. Any --tp, --pp, --virtual-stages and data-parallel size works (layers
    /// and shards are re-cut); the global batch (--batch × data-parallel size) and the
    /// model sizes must be the saved ones.
    #[arg(long, value_name = "DIR|auto")]
    pub(crate) resume: Option<PathBuf>,
    /// Start from the weights of this Hugging Face GPT-2 directory (config.json and
    /// model.safetensors, as `export-hf` writes them), cut to this run's layout; its sizes
    /// must be the run's --layers, --hidden, --heads and --seq.
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub(crate) init_from: Option<PathBuf>,
    #[command(subcommand)]
    pub(crate) command: Option<Command>,
    /// Train on this text file instead of the built-in documentation corpus.
    #[arg(long, value_name = "FILE")]
    pub(crate) data: Option<PathBuf>,
    /// Train on Megatron-LM indexed datasets: a prefix (PREFIX.idx and PREFIX.bin, as
    /// preprocess_data.py or `preprocess` writes them), or weights and prefixes in pairs
    /// to blend them (0.3 a 0.7 b). Needs --tokenizer.
    #[arg(long, num_args = 1.., value_name = "[WEIGHT] PREFIX", conflicts_with = "data", requires = "tokenizer")]
    pub(crate) data_path: Option<Vec<String>>,
    /// With --data-path: the training, validation and test weights that cut each
    /// dataset's sequences (Megatron's --split).
    #[arg(long, default_value = "969,30,1")]
    pub(crate) split: String,
    /// The Hugging Face tokenizer.json of --data-path's tokens: it sets the vocabulary
    /// (padded to a multiple of 128 × TP) and writes the samples.
    #[arg(long, value_name = "FILE", requires = "data_path")]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Leave out of the loss every position whose input is the end-of-document token
    /// (Megatron's --eod-mask-loss: no prediction from one document into the next);
    /// needs --tokenizer.
    #[arg(long, requires = "tokenizer")]
    pub(crate) eod_mask_loss: bool,
    /// Count positions from 0 again after every end-of-document token (Megatron's
    /// --reset-position-ids; attention still spans the whole window); needs --tokenizer.
    #[arg(long, requires = "tokenizer")]
    pub(crate) reset_position_ids: bool,
    /// The end-of-document token's text, for --eod-mask-loss and --reset-position-ids.
    #[arg(long, default_value = "<|endoftext|>")]
    pub(crate) eod_token: String,
    /// Predict the peak memory per rank of each pipeline stage for these flags, by
    /// category, and exit without training.
    #[arg(long)]
    pub(crate) plan: bool,
    /// With --plan: list the layouts of --world ranks that fit this much memory per rank
    /// (e.g. 80GiB), with the bytes each sends per step, instead of planning this one.
    #[arg(long, value_name = "BYTES", requires = "plan", requires = "world")]
    pub(crate) fit: Option<ferrotron_planner::Bytes>,
    /// With --fit: ranks in all (TP × PP × DP).
    #[arg(long, requires = "fit")]
    pub(crate) world: Option<usize>,
    /// With --fit: sequences per step over all data-parallel ranks, the same for every
    /// layout (default: --batch × 2, the batch of the default DP 2).
    #[arg(long, requires = "fit")]
    pub(crate) global_batch_size: Option<usize>,
    /// With --fit: sequences per microbatch.
    #[arg(long, requires = "fit", default_value_t = 1)]
    pub(crate) micro_batch_size: usize,
    /// With --fit: the largest tensor-parallel size to consider (TP stays inside a node).
    #[arg(long, requires = "fit", default_value_t = 8)]
    pub(crate) max_tp: usize,
    /// Directory for loss.csv and loss.svg.
    #[arg(long, value_name = "DIR", default_value = "target/train_gpt")]
    pub(crate) out: PathBuf,
    /// Also train with TP = 1, DP = 1 on one rank (same seed, same global batches) and
    /// print the largest per-step loss difference as the last line.
    #[arg(long)]
    pub(crate) check: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum PipelineSchedule {
    /// Every forward, then every backward.
    Gpipe,
    /// One forward, one backward (Megatron's default).
    #[value(name = "1f1b")]
    OneFOneB,
    /// 1F1B over --virtual-stages chunks per stage.
    Interleaved,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Decay {
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
pub(crate) enum WsdStyle {
    Linear,
    Cosine,
    Exponential,
    #[value(alias = "minus_sqrt")]
    MinusSqrt,
}

/// What else the binary does besides training.
#[derive(clap::Subcommand, Debug)]
pub(crate) enum Command {
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
