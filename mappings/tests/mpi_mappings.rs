//! A subset of the mapping tests over the MPI backend. Run it as
//! `mpirun -n 4 target/debug/deps/mpi_mappings-*` (built with `--features mpi`); `cargo
//! test --features mpi` runs it as a single rank. Every rank runs the same deterministic
//! cases; rank 0 prints the summary and the exit status says whether all passed.

use std::sync::Arc;

use anyhow::{ensure, Result};
use ferrotron_comm_core::mpi::MpiWorld;
use ferrotron_comm_core::Communicator;
use ferrotron_mappings::{
    all_gather_from_region, all_gather_variable, all_to_all, copy_to_region, gather_from_region,
    reduce_from_region, reduce_scatter_to_region, scatter_to_region, split_sizes, Error,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{Parameter, Tape, Tensor};

type Group = Arc<dyn Communicator>;

/// The sum of the world ranks of `group`'s members.
fn rank_sum(group: &Group) -> f64 {
    group.world_ranks().iter().sum::<usize>() as f64
}

/// Seed 002's reduce, gather and copy checks, on any group.
fn seed_checks(group: &Group, world_rank: usize) -> Result<()> {
    let me = world_rank as f64;
    let x = Tensor::from_vec(vec![me], &[1])?;
    ensure!(reduce_from_region(&x, group)?.to_vec()? == vec![rank_sum(group)]);

    let members: Vec<f64> = group.world_ranks().iter().map(|&r| r as f64).collect();
    ensure!(gather_from_region(&x, group, 0, None)?.to_vec()? == members);

    let p = Parameter::new("x", x.clone());
    let tape = Tape::new();
    copy_to_region(&tape.watch(&p)?, group)?
        .scale(me)?
        .sum()?
        .backward()?;
    ensure!(p.grad().map(|g| g.to_vec()).transpose()? == Some(vec![rank_sum(group)]));

    // reduce_from_region of rank·x, loss 2·result: gradient 2·rank.
    let p = Parameter::new("x", x);
    let tape = Tape::new();
    let loss = reduce_from_region(&tape.watch(&p)?.scale(me)?, group)?.scale(2.0)?;
    let squares: f64 = members.iter().map(|r| r * r).sum();
    ensure!(loss.item()? == 2.0 * squares);
    loss.sum()?.backward()?;
    ensure!(p.grad().map(|g| g.to_vec()).transpose()? == Some(vec![2.0 * me]));
    Ok(())
}

/// Rank `r` holds `r + 1` columns of a `[2, r + 1]` tensor; the gather along dim 1 joins
/// them, and backward gives each rank its columns' gradient (summed over ranks with
/// `all_gather_from_region`).
fn uneven_gathers(group: &Group) -> Result<()> {
    let (rank, n) = (group.rank(), group.size());
    let widths: Vec<usize> = (0..n).map(|r| r + 1).collect();
    let total: usize = widths.iter().sum();
    let column = |r: usize, c: usize, row: usize| (100 * row + 10 * r + c) as f64;
    let mine: Vec<f64> = (0..2)
        .flat_map(|row| (0..widths[rank]).map(move |c| column(rank, c, row)))
        .collect();
    let expected: Vec<f64> = (0..2)
        .flat_map(|row| (0..n).flat_map(move |r| (0..r + 1).map(move |c| column(r, c, row))))
        .collect();

    let p = Parameter::new("x", Tensor::from_vec(mine, &[2, widths[rank]])?);
    let tape = Tape::new();
    let (all, sizes) = all_gather_variable(&tape.watch(&p)?, group, 1, None, false)?;
    ensure!(sizes == widths && all.shape() == [2, total]);
    ensure!(all.to_vec()? == expected, "variable gather values");
    all.scale(3.0)?.sum()?.backward()?;
    ensure!(p.grad().map(|g| g.to_vec()).transpose()? == Some(vec![3.0; 2 * widths[rank]]));

    let p = Parameter::new(
        "x",
        Tensor::from_vec(vec![1.0; 2 * widths[rank]], &[2, widths[rank]])?,
    );
    let tape = Tape::new();
    let all = all_gather_from_region(&tape.watch(&p)?, group, 1, Some(&widths))?;
    all.scale(rank as f64 + 1.0)?.sum()?.backward()?;
    let summed_weights = (n * (n + 1) / 2) as f64;
    ensure!(
        p.grad().map(|g| g.to_vec()).transpose()? == Some(vec![summed_weights; 2 * widths[rank]])
    );
    Ok(())
}

/// Scatter then gather along an uneven dim is the identity; reduce-scatter sums.
fn uneven_scatter_and_reduce_scatter(group: &Group) -> Result<()> {
    let (rank, n) = (group.rank(), group.size());
    let len = 2 * n + 1;
    let whole: Vec<f64> = (0..3 * len).map(|v| v as f64).collect();
    let x = Tensor::from_vec(whole.clone(), &[3, len])?;
    let mine = scatter_to_region(&x, group, 1, None)?;
    ensure!(gather_from_region(&mine, group, 1, None)?.to_vec()? == whole);

    let sizes = split_sizes(len, n)?;
    let reduced = reduce_scatter_to_region(&x, group, 1, None)?;
    ensure!(reduced.shape() == [3, sizes[rank]]);
    let start: usize = sizes[..rank].iter().sum();
    let expected: Vec<f64> = (0..3)
        .flat_map(|row| {
            (start..start + sizes[rank]).map(move |c| n as f64 * (row * len + c) as f64)
        })
        .collect();
    ensure!(reduced.to_vec()? == expected);
    Ok(())
}

/// An all-to-all from a sequence split to a heads split and back.
fn all_to_all_round_trip(group: &Group) -> Result<()> {
    let (rank, n) = (group.rank(), group.size());
    let heads = 2 * n;
    let data: Vec<f64> = (0..heads).map(|h| (rank * heads + h) as f64).collect();
    let x = Tensor::from_vec(data.clone(), &[1, heads])?;
    let swapped = all_to_all(&x, group, 1, 0, None)?;
    ensure!(swapped.shape() == [n, 2]);
    let expected: Vec<f64> = (0..n)
        .flat_map(|s| (0..2).map(move |h| (s * heads + 2 * rank + h) as f64))
        .collect();
    ensure!(swapped.to_vec()? == expected);
    ensure!(all_to_all(&swapped, group, 0, 1, None)?.to_vec()? == data);
    Ok(())
}

/// Disagreeing shapes are an error on every rank.
fn shape_mismatch_is_reported(group: &Group) -> Result<()> {
    if group.size() < 2 {
        return Ok(());
    }
    let x = Tensor::<f64>::zeros(&[2, 1 + group.rank()]);
    let result = gather_from_region(&x, group, 0, None);
    ensure!(
        matches!(result, Err(Error::ShapeMismatch { .. })),
        "{result:?}"
    );
    Ok(())
}

fn main() -> Result<()> {
    let mpi = MpiWorld::init()?;
    let world: Group = Arc::new(mpi.world()?);
    let world_rank = world.rank();
    let tp = if world.size().is_multiple_of(2) { 2 } else { 1 };
    let layout = RankLayout::builder(world.size()).tp(tp).build()?;
    let state = ParallelState::new(world.clone(), layout)?;
    let tp_group = state.tp().clone();

    let mut results: Vec<(String, Result<()>)> = Vec::new();
    for (name, group) in [("world", &world), ("tp", &tp_group)] {
        results.push((
            format!("seed 002 checks over {name}"),
            seed_checks(group, world_rank),
        ));
        results.push((format!("uneven gathers over {name}"), uneven_gathers(group)));
        results.push((
            format!("uneven scatter and reduce-scatter over {name}"),
            uneven_scatter_and_reduce_scatter(group),
        ));
        results.push((
            format!("all_to_all round trip over {name}"),
            all_to_all_round_trip(group),
        ));
        results.push((
            format!("shape mismatch over {name}"),
            shape_mismatch_is_reported(group),
        ));
    }
    world.barrier()?;

    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    for (name, outcome) in &results {
        if let Err(e) = outcome {
            eprintln!("rank {world_rank}: {name} FAILED: {e:#}");
        }
    }
    if world_rank == 0 {
        println!("mpi_mappings on {} ranks", world.size());
        println!("{} passed, {} failed", results.len() - failed, failed);
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
