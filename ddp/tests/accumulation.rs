//! `no_sync` gradient accumulation: 4 micro-batches per step, reduced once, train to the
//! same parameters as one rank on the whole batch.

mod support;

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::DistributedDataParallel;
use ferrotron_tape::Tape;
use support::{global_batch, loss, max_relative_error, mlp, optimizer, slice, small_buckets, Opt};

const RANKS: usize = 2;
const MICRO_BATCHES: usize = 4;
const ROWS: usize = 3;
const STEPS: usize = 3;

#[test]
fn four_micro_batches_equal_one_large_batch() -> Result<()> {
    let expected = support::train_single(Opt::Sgd, RANKS * MICRO_BATCHES, ROWS, STEPS)?;
    let per_rank = run_local(RANKS, |comm| -> Result<Vec<Vec<f32>>> {
        let rank = comm.rank();
        let params = mlp(100 + rank as u64);
        let ddp = DistributedDataParallel::new(params.clone(), Arc::new(comm), small_buckets())?;
        let progress = ddp.progress();
        let mut opt = optimizer(Opt::Sgd, params.clone())?;
        let tape = Tape::new();
        for step in 0..STEPS {
            let batch = global_batch(step, RANKS * MICRO_BATCHES * ROWS);
            opt.zero_grad();
            for micro in 0..MICRO_BATCHES {
                let (x, target) = slice(&batch, rank * MICRO_BATCHES + micro, ROWS)?;
                // Each micro-batch loss is 1/4 of its share, so the sum is the mean.
                let micro_loss = loss(&tape, &params, &x, &target)?.scale(0.25)?;
                if micro + 1 < MICRO_BATCHES {
                    let _accumulate = ddp.no_sync();
                    assert!(!ddp.is_sync_enabled());
                    ddp.backward(&micro_loss)?;
                    assert_eq!(
                        progress.buckets_started(),
                        0,
                        "no_sync must not communicate"
                    );
                } else {
                    assert!(ddp.is_sync_enabled());
                    ddp.backward(&micro_loss)?;
                }
            }
            opt.step()?;
        }
        Ok(support::values(&params)?)
    })?;
    for got in &per_rank {
        let error = max_relative_error(got, &expected);
        assert!(error <= 1e-5, "relative error {error}");
    }
    Ok(())
}
