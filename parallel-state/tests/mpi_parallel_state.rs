//! ParallelState over the MPI backend: for every layout the world size allows, an
//! all-reduce of the world rank in every group equals the sum the layout predicts.
//! Run as `mpirun -n 4 target/debug/deps/mpi_parallel_state-*` (a single rank under
//! `cargo test`).

use ferrotron_comm_core::mpi::MpiWorld;
use ferrotron_comm_core::Communicator;
use ferrotron_parallel_state::{check_group_sums, Order, RankLayout};
use std::sync::Arc;

fn main() -> anyhow::Result<()> {
    let mpi = MpiWorld::init()?;
    let world: Arc<dyn Communicator> = Arc::new(mpi.world()?);
    let n = world.size();
    let mut passed = 0;
    let mut failed = 0;
    // Every (tp, pp, cp) whose product divides the world, in both a default and a
    // non-default order.
    for tp in (1..=n).filter(|t| n.is_multiple_of(*t)) {
        for pp in (1..=n / tp).filter(|p| (n / tp).is_multiple_of(*p)) {
            for cp in (1..=n / (tp * pp)).filter(|c| (n / (tp * pp)).is_multiple_of(*c)) {
                for order in ["tp-cp-ep-dp-pp", "tp-pp-dp-cp"] {
                    let layout = order
                        .parse::<Order>()
                        .and_then(|o| RankLayout::builder(n).tp(tp).pp(pp).cp(cp).order(o).build());
                    // Orders Megatron itself rejects (see parallel-state's docs) are skipped
                    // identically on every rank.
                    let Ok(layout) = layout else { continue };
                    match check_group_sums(world.clone(), &layout) {
                        Ok(_) => passed += 1,
                        Err(e) => {
                            failed += 1;
                            eprintln!(
                                "rank {}: tp={tp} pp={pp} cp={cp} {order}: {e}",
                                world.rank()
                            );
                        }
                    }
                }
            }
        }
    }
    if world.rank() == 0 {
        println!("mpi_parallel_state on {n} ranks");
        println!("{passed} passed, {failed} failed");
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
