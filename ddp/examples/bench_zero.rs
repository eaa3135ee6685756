//! Memory and step time of the distributed optimizer against plain DDP with a replicated
//! AdamW, on the local backend.
//!
//! Model: `bench_ddp`'s 8 × (Linear(1024, 1024) + relu), batch 32 per rank, bucket cap
//! 4 MiB, AdamW, 5 steps each way from the same parameters and data. A step is forward,
//! backward with the gradient sync, and the optimizer step; `step_ms_*` is rank 0's
//! median over steps 2–5 (the first allocates the state), with a barrier before each.
//!
//! Bytes per parameter per rank are measured, not computed: a counting allocator tracks
//! the bytes live in the process; after the last step (every rank past a barrier) rank 0
//! reads them, subtracts what was live before the ranks started, and divides by
//! `dp × parameters`. That is parameters, gradients, buckets and optimizer state (plus
//! each rank's 128 KiB input).
//!
//! `max_param_diff` is the largest absolute difference between the two runs' parameters
//! after the steps.
//!
//! With `--precision bf16` or `fp16` the parameters are stored in 16 bits and trained
//! through f32 master weights: replicated (`ferrotron_tape::MixedPrecision`) under plain DDP, this
//! rank's shard of them under the distributed optimizer. Gradients stay f32.
//!
//! ```text
//! cargo run --release -p ferrotron-ddp --example bench_zero -- --dp 4 --json
//! cargo run --release -p ferrotron-ddp --example bench_zero -- --dp 4 --precision bf16 --json
//! ```

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel, DistributedOptimizer};
use ferrotron_tape::{
    AdamW, AdamWConfig, DType, Generator, MixedPrecision, Optimizer, Parameter, Tape, Tensor,
};

mod support;

use support::{json_number, loss, median, model, BATCH, BUCKET_CAP_BYTES, WIDTH};

/// mimalloc (as ferrotron's binaries use, keeping freed pages), counting the bytes live.
struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
static INNER: mimalloc::MiMalloc = mimalloc::MiMalloc;

// SAFETY: every call forwards to mimalloc with the caller's arguments; the counter only
// observes sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { INNER.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LIVE_BYTES.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { INNER.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { INNER.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE_BYTES.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { INNER.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const STEPS: usize = 5;

#[derive(Parser)]
#[command(about = "Distributed optimizer vs plain DDP: memory and step time (local backend)")]
struct Args {
    /// Data-parallel ranks (threads).
    #[arg(long, default_value_t = 2)]
    dp: usize,
    /// How parameters are stored: fp32, or bf16 / fp16 with f32 master weights.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    precision: Precision,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

impl Precision {
    fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        }
    }
}

/// What one way of training measured on rank 0.
struct Run {
    bytes_per_param: f64,
    step_ms: f64,
    params: Vec<Vec<f32>>,
}

fn train(dp: usize, zero: bool, dtype: DType) -> Result<Run> {
    let baseline = LIVE_BYTES.load(Ordering::SeqCst);
    let mut per_rank = run_local(dp, |comm| -> Result<Option<Run>> {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let params = model(1);
        let config = DdpConfig {
            bucket_cap_bytes: BUCKET_CAP_BYTES,
            use_distributed_optimizer: zero,
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(params.clone(), comm.clone(), config)?;
        let adamw = AdamWConfig::default();
        let mut optimizer: Box<dyn Optimizer> = match (zero, dtype) {
            (true, DType::F32) => Box::new(DistributedOptimizer::adamw([&ddp], adamw)?),
            (true, dtype) => {
                Box::new(DistributedOptimizer::adamw([&ddp], adamw)?.store_params_as(dtype)?)
            }
            (false, DType::F32) => Box::new(AdamW::new(params.clone(), adamw)?),
            (false, dtype) => Box::new(MixedPrecision::new(&params, dtype, |masters| {
                AdamW::new(masters, adamw)
            })?),
        };
        let x = Tensor::randn(
            &[BATCH, WIDTH],
            1.0,
            &mut Generator::new(10 + comm.rank() as u64),
        );
        let tape = Tape::new();
        let mut times = Vec::with_capacity(STEPS);
        for _ in 0..STEPS {
            optimizer.zero_grad();
            comm.barrier()?;
            let start = Instant::now();
            ddp.backward(&loss(&tape, &params, &x)?)?;
            optimizer.step()?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        comm.barrier()?;
        let live = LIVE_BYTES.load(Ordering::SeqCst) - baseline;
        comm.barrier()?;
        if comm.rank() != 0 {
            return Ok(None);
        }
        let numel: usize = params.iter().map(Parameter::numel).sum();
        Ok(Some(Run {
            bytes_per_param: live as f64 / (dp * numel) as f64,
            step_ms: median(times[1..].to_vec()),
            params: params
                .iter()
                .map(|p| p.value()?.to_vec())
                .collect::<ferrotron_tape::Result<_>>()?,
        }))
    })?;
    per_rank
        .swap_remove(0)
        .ok_or_else(|| anyhow::anyhow!("rank 0 reported nothing"))
}

/// Tells mimalloc never to return freed pages to the system, so that a step's large
/// arrays reuse memory that is already mapped (as `train_gpt` does).
fn keep_freed_memory() {
    // `mi_option_purge_delay` is 15 in the mimalloc v2 sources libmimalloc-sys builds.
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: sets a plain integer option; mimalloc reads options atomically.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, -1) }
}

fn main() -> Result<()> {
    keep_freed_memory();
    let args = Args::parse();
    anyhow::ensure!(args.dp >= 1, "--dp must be at least 1");
    let dtype = args.precision.dtype();
    let ddp = train(args.dp, false, dtype)?;
    let zero = train(args.dp, true, dtype)?;
    let max_param_diff = ddp
        .params
        .iter()
        .flatten()
        .zip(zero.params.iter().flatten())
        .map(|(a, b)| f64::from((a - b).abs()))
        .fold(0.0, f64::max);
    let params: usize = ddp.params.iter().map(Vec::len).sum();
    if args.json {
        // Written by hand: the key order is part of the interface; max_param_diff in
        // scientific notation, as it lies far below four decimals.
        println!(
            "{{\"bench\":\"zero\",\"dp\":{},\"params\":{params},\"bytes_per_param_ddp\":{},\"bytes_per_param_zero\":{},\"step_ms_ddp\":{},\"step_ms_zero\":{},\"max_param_diff\":{max_param_diff:e}}}",
            args.dp,
            json_number(ddp.bytes_per_param),
            json_number(zero.bytes_per_param),
            json_number(ddp.step_ms),
            json_number(zero.step_ms),
        );
    } else {
        println!(
            "Distributed optimizer vs plain DDP + AdamW, DP {} (local backend), {params} \
             {dtype} parameters, median of steps 2-{STEPS}",
            args.dp
        );
        println!("{:<24} {:>16} {:>10}", "", "bytes/param/rank", "step ms");
        println!(
            "{:<24} {:>16.2} {:>10.2}",
            "plain DDP", ddp.bytes_per_param, ddp.step_ms
        );
        println!(
            "{:<24} {:>16.2} {:>10.2}",
            "distributed optimizer", zero.bytes_per_param, zero.step_ms
        );
        println!("largest parameter difference: {max_param_diff:e}");
    }
    Ok(())
}
