//! Ranks that disagree about a collective fail loudly under MPI, with no setting needed:
//! rank 1 passes a longer buffer to an all-reduce than the other ranks, and every rank
//! prints the `Mismatch` error and exits with status 1 instead of hanging.
//!
//! ```sh
//! cargo build -p ferrotron-comm-core --features mpi --example mismatch
//! mpirun -n 2 target/debug/examples/mismatch
//! ```

use ferrotron_comm_core::mpi::{MpiWorld, CHECK_ENV};
use ferrotron_comm_core::{Communicator, CommunicatorExt, Error, ReduceOp};
use std::process::exit;

fn main() {
    let mpi = MpiWorld::init().unwrap_or_else(|e| {
        eprintln!("{e}");
        exit(2)
    });
    // The ranks compare their check settings here: one that differs is an error on all.
    let world = match mpi.world() {
        Ok(world) => world,
        Err(e) => {
            eprintln!("{e}");
            drop(mpi);
            exit(2)
        }
    };
    if !mpi.checks_signatures() {
        // Without the check, MPI gets an all-reduce of different lengths: undefined
        // behaviour (a hang, a truncation error or corrupted memory), not a demonstration.
        eprintln!("{CHECK_ENV} turns the signature check off; unset it to run this example");
        drop(world);
        drop(mpi);
        exit(2);
    }
    let (rank, size) = (world.rank(), world.size());
    let mut values = vec![1.0f32; if rank == 1 { 5 } else { 4 }];
    let outcome = world.all_reduce_slice(&mut values, ReduceOp::Sum);
    match &outcome {
        Err(e @ Error::Mismatch { .. }) => eprintln!("rank {rank} of {size}: Mismatch: {e}"),
        Err(e) => eprintln!("rank {rank} of {size}: {e}"),
        Ok(()) => println!(
            "rank {rank} of {size}: the all-reduce ran (one rank alone agrees with itself)"
        ),
    }
    // mpirun ends the whole job at the first non-zero exit: every rank reports before any
    // exits. The failed call left the group usable, so the barrier is safe.
    let _ = world.barrier();
    drop(world);
    drop(mpi); // MPI_Finalize
    exit(if outcome.is_err() { 1 } else { 0 });
}
