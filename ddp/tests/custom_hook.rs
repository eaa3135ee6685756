//! A custom comm hook's second half: `after_reduce` sees each reduced bucket and can run
//! further collectives on parts of it, whose results become the gradients.

use anyhow::Result;
use ferrotron_comm_core::{run_local, AsyncOp, Buffer, Communicator, ReduceOp, Work};
use ferrotron_ddp::{CommHook, DdpConfig, DistributedDataParallel, ReducedBucket};
use ferrotron_tape::{Parameter, Tape, Tensor};
use std::sync::Arc;

const RANKS: usize = 3;
const LEN: usize = 8;

/// The default average, then a sum over the group of the bucket's first half: the first
/// half of the gradient ends as `RANKS ×` the average (the sum), the rest as the average.
struct SumFirstHalf {
    group: Arc<dyn Communicator>,
}

impl CommHook for SumFirstHalf {
    fn name(&self) -> &str {
        "sum-first-half"
    }

    fn start(&self, dp: &dyn Communicator, bucket: Buffer) -> ferrotron_comm_core::Result<Work> {
        dp.start(AsyncOp::AllReduce {
            buf: bucket,
            op: ReduceOp::Avg,
        })
    }

    fn after_reduce(&self, bucket: &mut ReducedBucket<'_>) -> ferrotron_ddp::Result<()> {
        let half = bucket.params()[0].range().len() / 2;
        bucket.all_reduce_range(self.group.as_ref(), 0..half, ReduceOp::Sum)
    }
}

#[test]
fn after_reduce_collectives_on_a_range_reach_the_gradients() -> Result<()> {
    let grads = run_local(RANKS, |comm| -> Result<Vec<f32>> {
        let comm: Arc<dyn Communicator> = Arc::new(comm);
        let w = Parameter::new("w", Tensor::zeros(&[LEN]));
        let config = DdpConfig {
            comm_hook: Arc::new(SumFirstHalf {
                group: comm.clone(),
            }),
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(vec![w.clone()], comm.clone(), config)?;
        // Rank r's gradient is r + 1 everywhere.
        let seed = Tensor::full(&[LEN], (comm.rank() + 1) as f32);
        ddp.backward(&Tape::new().watch(&w)?.mul(&seed)?.sum()?)?;
        Ok(w.grad().expect("a gradient").to_vec()?)
    })?;
    let average = (1..=RANKS).sum::<usize>() as f32 / RANKS as f32;
    for grad in grads {
        let (first, rest) = grad.split_at(LEN / 2);
        assert!(
            first
                .iter()
                .all(|&g| (g - average * RANKS as f32).abs() < 1e-5),
            "{grad:?}"
        );
        assert!(rest.iter().all(|&g| (g - average).abs() < 1e-6), "{grad:?}");
    }
    Ok(())
}
