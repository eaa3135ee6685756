//! Times one forward + backward step of a pre-norm transformer block (hidden 512, 8
//! heads, sequence 128, batch 8, loss = sum of the output) on `--tp` rank threads of the
//! local backend, one thread each unless `--threads N`; prints the median milliseconds per
//! step over the timed steps.
//!
//! `cargo run --release -p ferrotron-layers --example bench_block -- --tp 2 --json`; add
//! `--device cuda:0` (build with `--features tape/cuda`) to run every rank's block on a
//! GPU (activations between ranks go through host memory, see `mappings`); `--bf16` to
//! keep parameters and activations in bf16 (products accumulate in f32).

// Training steps allocate and free many large arrays: mimalloc, told to keep freed pages,
// hands them to the next step without page faults (see the performance chapter).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Keeps the memory a step frees for the next step instead of returning it to the OS.
fn keep_freed_memory() {
    // `mi_option_purge_delay` is 15 in the mimalloc v2 sources libmimalloc-sys builds
    // (between its `mi_option_eager_commit_delay` and `mi_option_use_numa_nodes`); -1: never.
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: sets a plain integer option; mimalloc reads options atomically.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, -1) }
}

use std::sync::Arc;
use std::time::Instant;

use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_layers::{
    BlockConfig, MasterInit, Module, RngTracker, TensorParallel, TransformerBlock,
};
use ferrotron_tape::{synchronize, DType, Device, Generator, Tape, Tensor};

const HIDDEN: usize = 512;
const HEADS: usize = 8;
const SEQ: usize = 128;
const BATCH: usize = 8;

struct Args {
    tp: usize,
    device: Device,
    json: bool,
    warmup: usize,
    steps: usize,
    threads: usize,
    dtype: DType,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        tp: 1,
        device: Device::Cpu,
        json: false,
        warmup: 2,
        steps: 10,
        threads: 1,
        dtype: DType::F32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{name} needs a positive integer"))
        };
        match flag.as_str() {
            "--tp" => args.tp = number("--tp")?,
            "--warmup" => args.warmup = number("--warmup")?,
            "--steps" => args.steps = number("--steps")?.max(1),
            "--threads" => args.threads = number("--threads")?,
            "--json" => args.json = true,
            "--bf16" => args.dtype = DType::BF16,
            "--device" => {
                let text = it.next().unwrap_or_default();
                args.device = text.parse().map_err(|e| format!("--device: {e}"))?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other}; use --tp T [--device D] [--json] [--warmup N] [--steps N] [--threads N] [--bf16]"
                ))
            }
        }
    }
    Ok(args)
}

fn main() {
    keep_freed_memory();
    if let Err(error) = run() {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let device = args.device;
    let input = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut Generator::new(0))
        .to_dtype(args.dtype)?
        .to_device(device)?;
    let times = run_local(args.tp, |comm| -> ferrotron_layers::Result<Vec<f64>> {
        ferrotron_tape::set_num_threads(args.threads)?;
        let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>);
        let block = TransformerBlock::new(
            &tp,
            "block",
            &BlockConfig::new(HIDDEN, HEADS),
            &MasterInit::new(0, 0.02),
        )?;
        for p in block.parameters() {
            let value = p.param.value()?.to_dtype(args.dtype)?;
            p.param.set_value(value.to_device(device)?)?;
        }
        let mut rng = RngTracker::new(0, tp.rank());
        let mut times = Vec::new();
        for step in 0..args.warmup + args.steps {
            for p in block.parameters() {
                p.param.zero_grad();
            }
            // Align the ranks so each step is timed from a common start.
            tp.group().barrier()?;
            let start = Instant::now();
            let tape = Tape::new();
            block.forward(&tape, &input, &mut rng)?.sum()?.backward()?;
            synchronize(device)?;
            tp.group().barrier()?;
            if step >= args.warmup {
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(times)
    })?;
    let mut rank0 = times.into_iter().next().unwrap_or_default();
    rank0.sort_by(f64::total_cmp);
    let median = rank0.get(rank0.len() / 2).copied().unwrap_or(f64::NAN);
    if args.json {
        println!(
            "{{\"bench\":\"block_step\",\"impl\":\"ferrotron\",\"device\":\"{device}\",\"dtype\":\"{:?}\",\"tp\":{},\"ms_per_step\":{median:.3}}}",
            args.dtype, args.tp
        );
    } else {
        println!(
            "block step (hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, batch {BATCH}, {:?}), tp {}: {median:.3} ms (median of {})",
            args.dtype,
            args.tp,
            rank0.len()
        );
    }
    Ok(())
}
