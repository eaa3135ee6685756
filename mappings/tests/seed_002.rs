//! The 8-rank mappings test of seed 002 (Megatron-DeepSpeed `mpu/mappings.py`), with its
//! spelled-out values: TP = 2 and PP = 2, so the TP groups are [0,1] [2,3] [4,5] [6,7];
//! every rank starts from the tensor `[global_rank]` unless said otherwise.

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_mappings::{
    copy_to_region, gather_from_region, reduce_from_region, scatter_to_region,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{Parameter, Tape, Tensor};

/// Runs `check` on 8 local ranks with the seed's layout; `check` gets the global rank and
/// the rank's TP group.
fn on_eight_ranks<R: Send>(
    check: impl Fn(usize, &Arc<dyn Communicator>) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let layout = RankLayout::builder(8).tp(2).pp(2).build()?;
    Ok(run_local(8, |comm| -> Result<R> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        check(state.rank(), state.tp())
    })?)
}

fn own_rank(rank: usize) -> Result<Tensor> {
    Ok(Tensor::from_vec(vec![rank as f32], &[1])?)
}

#[test]
fn tp_groups_are_the_seeds() -> Result<()> {
    let groups = on_eight_ranks(|_, tp| Ok(tp.world_ranks().to_vec()))?;
    for (rank, group) in groups.iter().enumerate() {
        assert_eq!(group, &vec![rank / 2 * 2, rank / 2 * 2 + 1]);
    }
    Ok(())
}

#[test]
fn reduce_sums_each_tp_group() -> Result<()> {
    let sums = on_eight_ranks(|rank, tp| Ok(reduce_from_region(&own_rank(rank)?, tp)?.to_vec()?))?;
    let expected = [1.0, 1.0, 5.0, 5.0, 9.0, 9.0, 13.0, 13.0];
    for (rank, sum) in sums.iter().enumerate() {
        assert_eq!(sum, &vec![expected[rank]], "rank {rank}");
    }
    Ok(())
}

#[test]
fn gather_along_the_last_dim_joins_each_tp_group() -> Result<()> {
    let gathered = on_eight_ranks(|rank, tp| {
        let x = own_rank(rank)?;
        Ok(gather_from_region(&x, tp, x.ndim() - 1, None)?.to_vec()?)
    })?;
    for (rank, g) in gathered.iter().enumerate() {
        let first = (rank / 2 * 2) as f32;
        assert_eq!(g, &vec![first, first + 1.0], "rank {rank}");
    }
    Ok(())
}

#[test]
fn split_keeps_the_tp_rank_s_element() -> Result<()> {
    let parts = on_eight_ranks(|_, tp| {
        let x = Tensor::from_vec(vec![0.0f32, 1.0], &[2])?;
        Ok(scatter_to_region(&x, tp, 0, None)?.to_vec()?)
    })?;
    for (rank, p) in parts.iter().enumerate() {
        assert_eq!(p, &vec![(rank % 2) as f32], "rank {rank}");
    }
    Ok(())
}

#[test]
fn copy_to_region_sums_the_gradient_over_the_tp_group() -> Result<()> {
    let grads = on_eight_ranks(|rank, tp| {
        let x = Parameter::new("x", own_rank(rank)?);
        let tape = Tape::new();
        // No copy: loss = rank · x, so the gradient is the rank.
        tape.watch(&x)?.scale(rank as f64)?.sum()?.backward()?;
        let plain = x.take_grad().map(|g| g.to_vec()).transpose()?;
        // With the copy the forward is the same, but backward all-reduces the gradient.
        copy_to_region(&tape.watch(&x)?, tp)?
            .scale(rank as f64)?
            .sum()?
            .backward()?;
        let copied = x.grad().map(|g| g.to_vec()).transpose()?;
        Ok((plain, copied))
    })?;
    let group_sums = [1.0, 1.0, 5.0, 5.0, 9.0, 9.0, 13.0, 13.0];
    for (rank, (plain, copied)) in grads.iter().enumerate() {
        assert_eq!(plain, &Some(vec![rank as f32]), "rank {rank}");
        assert_eq!(copied, &Some(vec![group_sums[rank]]), "rank {rank}");
    }
    Ok(())
}

#[test]
fn reduce_from_region_gives_the_seed_s_losses_and_gradients() -> Result<()> {
    let results = on_eight_ranks(|rank, tp| {
        let x = Parameter::new("x", own_rank(rank)?);
        let tape = Tape::new();
        let reduced = reduce_from_region(&tape.watch(&x)?.scale(rank as f64)?, tp)?;
        let loss = reduced.scale(2.0)?;
        let value = loss.item()?;
        loss.sum()?.backward()?;
        Ok((value, x.grad().map(|g| g.to_vec()).transpose()?))
    })?;
    // Group [6, 7]: loss = 2·(6·6 + 7·7) = 170; gradients 2·6 = 12 and 2·7 = 14.
    let losses = [2.0, 2.0, 26.0, 26.0, 82.0, 82.0, 170.0, 170.0];
    for (rank, (loss, grad)) in results.iter().enumerate() {
        assert_eq!(*loss, losses[rank], "rank {rank}");
        assert_eq!(grad, &Some(vec![2.0 * rank as f32]), "rank {rank}");
    }
    Ok(())
}

#[test]
fn scatter_to_region_gathers_the_gradient() -> Result<()> {
    let grads = on_eight_ranks(|rank, tp| {
        let x = Parameter::new("x", Tensor::from_vec(vec![1.0f32, 2.0], &[2])?);
        let tape = Tape::new();
        let mine = scatter_to_region(&tape.watch(&x)?, tp, 0, None)?;
        assert_eq!(mine.to_vec()?, vec![1.0 + (rank % 2) as f32]);
        mine.scale(rank as f64)?.sum()?.backward()?;
        Ok(x.grad().map(|g| g.to_vec()).transpose()?)
    })?;
    for (rank, grad) in grads.iter().enumerate() {
        let even = (rank / 2 * 2) as f32;
        assert_eq!(grad, &Some(vec![even, even + 1.0]), "rank {rank}");
    }
    Ok(())
}

#[test]
fn gather_from_region_keeps_the_own_gradient() -> Result<()> {
    let results = on_eight_ranks(|rank, tp| {
        let x = Parameter::new("x", own_rank(rank)?);
        let tape = Tape::new();
        let gathered = gather_from_region(&tape.watch(&x)?, tp, 0, None)?;
        let values = gathered.to_vec()?;
        gathered.scale(rank as f64)?.sum()?.backward()?;
        Ok((values, x.grad().map(|g| g.to_vec()).transpose()?))
    })?;
    for (rank, (values, grad)) in results.iter().enumerate() {
        let even = (rank / 2 * 2) as f32;
        assert_eq!(values, &vec![even, even + 1.0], "rank {rank}");
        assert_eq!(grad, &Some(vec![rank as f32]), "rank {rank}");
    }
    Ok(())
}
