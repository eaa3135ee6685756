//! How much of the gradient all-reduce DDP hides behind backward: on the local backend
//! (CPU, or device memory with `--device`), or over NCCL (`--backend nccl --device
//! cuda:0`, built with `--features cuda`; ranks take GPUs in turn).
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
//! cargo run --release -p ferrotron-ddp --example bench_ddp -- --ranks 2 --json
//! cargo run --release -p ferrotron-ddp --features cuda --example bench_ddp -- --backend nccl \
//!     --device cuda:0 --ranks 2 --json
//! ```

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::{Parser, ValueEnum};
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel};
use ferrotron_tape::{Device, Generator, Parameter, Tape, Tensor};

mod support;

use support::{json_number, loss, median, model, BATCH, BUCKET_CAP_BYTES, LAYERS, WIDTH};

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum Backend {
    /// Rank threads of this process.
    Local,
    /// NCCL between the ranks' GPUs (host calls over the rank threads).
    Nccl,
}

#[derive(Parser)]
#[command(about = "DDP backward/all-reduce overlap benchmark")]
struct Args {
    /// Data-parallel ranks (threads).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Where the model and its gradients live: cpu, emulated or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Communication backend.
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    backend: Backend,
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
fn time_mode(
    comm: &Arc<dyn Communicator>,
    device: Device,
    mode: Mode,
    steps: usize,
) -> Result<Vec<f64>> {
    let params = model(1)
        .into_iter()
        .map(|p| Ok(Parameter::new(p.name(), p.value()?.to_device(device)?)))
        .collect::<Result<Vec<_>>>()?;
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
    let x = Tensor::randn(&[BATCH, WIDTH], 1.0, &mut rng).to_device(device)?;
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
        // A device step ends when its kernels have.
        ferrotron_tape::synchronize(device)?;
        if step >= 2 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(times)
}

/// `comm` with its device calls over NCCL, on GPU `first + rank` modulo the GPUs from
/// `first` on, and that GPU.
#[cfg(feature = "cuda")]
fn over_nccl(
    comm: Arc<dyn Communicator>,
    first: Device,
    rank: usize,
) -> Result<(Arc<dyn Communicator>, Device)> {
    let Device::Cuda(first) = first else {
        anyhow::bail!("--backend nccl needs --device cuda:N");
    };
    let count = ferrotron_comm_core::cuda::device_count()?;
    anyhow::ensure!(
        first < count,
        "--device cuda:{first}, but there are {count} CUDA devices"
    );
    let ordinal = first + rank % (count - first);
    let nccl = ferrotron_comm_core::NcclCommunicator::new(comm.clone(), ordinal)?;
    let dual = ferrotron_comm_core::DualCommunicator::new(comm, Arc::new(nccl))?;
    Ok((Arc::new(dual), Device::Cuda(ordinal)))
}

#[cfg(not(feature = "cuda"))]
fn over_nccl(
    _: Arc<dyn Communicator>,
    _: Device,
    _: usize,
) -> Result<(Arc<dyn Communicator>, Device)> {
    anyhow::bail!("--backend nccl: build with `--features cuda`")
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(args.ranks >= 1, "--ranks must be at least 1");
    let steps = args.steps.max(10);
    let per_rank = run_local(args.ranks, |comm| -> Result<Vec<f64>> {
        let rank = comm.rank();
        let mut comm: Arc<dyn Communicator> = Arc::new(comm);
        let mut device = args.device;
        if args.backend == Backend::Nccl {
            (comm, device) = over_nccl(comm, args.device, rank)?;
        }
        MODES
            .iter()
            .map(|&mode| Ok(median(time_mode(&comm, device, mode, steps)?)))
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
            "DDP overlap, {} ranks ({} backend, {}), {LAYERS} × Linear({WIDTH}, {WIDTH}) + \
             relu, batch {BATCH}/rank, bucket cap 4 MiB, median of {steps} steps",
            args.ranks,
            match args.backend {
                Backend::Local => "local",
                Backend::Nccl => "nccl",
            },
            args.device
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
