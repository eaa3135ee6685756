//! DDP over the MPI backend: DP = world size (4 under `mpirun -n 4`) trains to the same
//! parameters as the single-rank large-batch run, which every rank computes locally.
//!
//! ```text
//! cargo test -p ferrotron-ddp --features mpi --test mpi_ddp --no-run
//! mpirun -n 4 target/debug/deps/mpi_ddp-<hash>
//! ```
//! Rank 0 prints `N passed, M failed`; the exit status is non-zero on any failure.

mod support;

use std::sync::Arc;

use anyhow::ensure;
use ferrotron_comm_core::mpi::MpiWorld;
use ferrotron_comm_core::Communicator;
use ferrotron_ddp::DdpConfig;
use support::{max_relative_error, small_buckets, train_ddp, train_single, Opt};

const ROWS: usize = 4;
const STEPS: usize = 5;

fn equivalence(world: &Arc<dyn Communicator>, kind: Opt, config: DdpConfig) -> anyhow::Result<()> {
    let expected = train_single(kind, world.size(), ROWS, STEPS)?;
    let got = train_ddp(world.clone(), kind, ROWS, STEPS, config)?;
    let error = max_relative_error(&got, &expected);
    ensure!(error <= 1e-5, "relative error {error} > 1e-5");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mpi = MpiWorld::init()?;
    let world: Arc<dyn Communicator> = Arc::new(mpi.world()?);
    let no_overlap = DdpConfig {
        overlap_grad_reduce: false,
        ..small_buckets()
    };
    let results = vec![
        (
            "sgd, small buckets",
            equivalence(&world, Opt::Sgd, small_buckets()),
        ),
        (
            "adamw, small buckets",
            equivalence(&world, Opt::AdamW, small_buckets()),
        ),
        (
            "adamw, default buckets",
            equivalence(&world, Opt::AdamW, DdpConfig::default()),
        ),
        ("sgd, no overlap", equivalence(&world, Opt::Sgd, no_overlap)),
    ];
    world.barrier()?;
    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    for (name, outcome) in &results {
        if let Err(e) = outcome {
            eprintln!("rank {}: {name} FAILED: {e:#}", world.rank());
        }
    }
    if world.rank() == 0 {
        println!("mpi_ddp on {} ranks", world.size());
        println!("{} passed, {} failed", results.len() - failed, failed);
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
