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
//!
//! # Where things are
//!
//! | module | concern |
//! |---|---|
//! | `args` | the flags, their defaults and values |
//! | `config` | refusals of flag combinations that cannot run; the `TrainConfig` they describe |
//! | `launch` | starting ranks (threads, MPI, NCCL) with their world communicator and device |
//! | `train` | one rank's run: model sharing, the optimizer, the step loop, pipeline stages, saving |
//! | `model` | the GPT, built from seeded master weights, and its tensor-parallel parts |
//! | `data` | the corpus, its batches and held-out text |
//! | `checkpoint`, `stop`, `faults` | checkpoint files, signals, injected crashes |
//! | `check` | `--check`: the same run on one rank, compared |
//! | `report`, `summary`, `memory` | progress, the run's first and last lines, measured memory |
//! | `plan`, `placement`, `hf` | `--plan`, devices per node, Hugging Face export |
//!
//! One run's path: `main` parses `args` and resolves `--resume`; `launch` validates the
//! flags (`config::validate`), starts the ranks and calls `train::train_rank` on each;
//! that builds the parallel state, the model chunks and their DDP, then runs the steps
//! (`Trainer::step`: forward and backward over microbatches, reduction, clipping, the
//! optimizer step, the loss scale), saving when due; `launch` gathers the ranks' figures
//! and `summary::finish` prints them, with `check` when asked.

mod args;
mod check;
mod checkpoint;
mod config;
mod data;
mod faults;
mod hf;
mod launch;
mod memory;
mod model;
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
mod placement;
mod plan;
mod report;
mod stop;
mod summary;
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
use args::{Args, Backend, Command, RecomputeGranularity, RecomputeMethod};
use clap::Parser;
use config::{fused_attention, pipeline_schedule, query_groups, validate};
use data::Corpus;
use launch::{nccl_devices, run_local_backend, run_mpi_backend, under_mpirun};
use std::process::ExitCode;

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
