//! How much of the gradient all-reduce DDP hides behind backward, on the local backend.
//!
//! Model: 8 × (Linear(1024, 1024) + relu), batch 32 per rank, loss = mean of the output,
//! bucket cap 4 MiB. Three ways to run a step (forward + backward, and the sync where
//! named), median over the timed steps, measured on rank 0 with a barrier before each:
//! * `backward` — no gradient sync at all;
//! * `backward_then_sync` — DDP with `overlap_grad_reduce = false`: every bucket starts
//!   after backward;
//! * `overlapped` — DDP as normally used: buckets start from inside backward.
//!
//! `hidden_fraction = (backward_then_sync − overlapped) / (backward_then_sync − backward)`,
//! the share of the sync time that overlap hides (0 when sync costs nothing measurable).
//!
//! ```text
//! cargo run --release -p ddp --example bench_ddp -- --ranks 2 --json
//! ```

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use comm_core::{run_local, Communicator};
use ddp::{DdpConfig, DistributedDataParallel};
use tape::{Generator, Parameter, Tape, Tensor};

mod support;

use support::{json_number, loss, median, model, BATCH, BUCKET_CAP_BYTES, LAYERS, WIDTH};

#[derive(Parser)]
#[command(about = "DDP backward/all-reduce overlap benchmark (local backend)")]
struct Args {
    /// Data-parallel ranks (threads).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Timed steps per mode (at least 10).
    #[arg(long, default_value_t = 12)]
    steps: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Backward,
    BackwardThenSync,
    Overlapped,
}

const MODES: [Mode; 3] = [Mode::Backward, Mode::BackwardThenSync, Mode::Overlapped];

/// Step times (ms) of one mode on this rank, after two warm-up steps.
fn time_mode(comm: &Arc<dyn Communicator>, mode: Mode, steps: usize) -> Result<Vec<f64>> {
    let params = model(1);
    let ddp = match mode {
        Mode::Backward => None,
        Mode::BackwardThenSync | Mode::Overlapped => Some(DistributedDataParallel::new(
            params.clone(),
            comm.clone(),
            DdpConfig {
                bucket_cap_bytes: BUCKET_CAP_BYTES,
                overlap_grad_reduce: mode == Mode::Overlapped,
                ..DdpConfig::default()
            },
        )?),
    };
    let mut rng = Generator::new(10 + comm.rank() as u64);
    let x = Tensor::randn(&[BATCH, WIDTH], 1.0, &mut rng);
    let tape = Tape::new();
    let mut times = Vec::with_capacity(steps);
    for step in 0..steps + 2 {
        params.iter().for_each(Parameter::zero_grad);
        comm.barrier()?;
        let start = Instant::now();
        let loss = loss(&tape, &params, &x)?;
        match &ddp {
            Some(ddp) => ddp.backward(&loss)?,
            None => loss.backward()?,
        }
        if step >= 2 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(times)
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.ranks >= 1, "--ranks must be at least 1");
    let steps = args.steps.max(10);
    let per_rank = run_local(args.ranks, |comm| -> Result<Vec<f64>> {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        MODES
            .iter()
            .map(|&mode| Ok(median(time_mode(&comm, mode, steps)?)))
            .collect()
    })?;
    let [backward, then_sync, overlapped] = [per_rank[0][0], per_rank[0][1], per_rank[0][2]];
    let sync_cost = then_sync - backward;
    let hidden_fraction = if sync_cost > 0.0 {
        (then_sync - overlapped) / sync_cost
    } else {
        0.0
    };
    if args.json {
        // Written by hand: the key order is part of the interface.
        println!(
            "{{\"bench\":\"ddp\",\"ranks\":{},\"backward_ms\":{},\"backward_then_sync_ms\":{},\"overlapped_ms\":{},\"hidden_fraction\":{}}}",
            args.ranks,
            json_number(backward),
            json_number(then_sync),
            json_number(overlapped),
            json_number(hidden_fraction),
        );
    } else {
        println!(
            "DDP overlap, {} ranks (local backend), {LAYERS} × Linear({WIDTH}, {WIDTH}) + relu, \
             batch {BATCH}/rank, bucket cap 4 MiB, median of {steps} steps",
            args.ranks
        );
        println!("{:<28} {:>10}", "step", "ms");
        println!("{:<28} {:>10.2}", "forward + backward", backward);
        println!("{:<28} {:>10.2}", "  + sync after backward", then_sync);
        println!("{:<28} {:>10.2}", "  + sync overlapped", overlapped);
        println!(
            "{:<28} {:>9.0}%",
            "sync time hidden",
            hidden_fraction * 100.0
        );
    }
    Ok(())
}
