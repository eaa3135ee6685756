//! DP equivalence: DP = n with per-rank batch b trains to the same parameters as one rank
//! with batch n·b (5 steps of SGD with momentum and of AdamW, relative 1e-5).

mod support;

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::run_local;
use support::{max_relative_error, small_buckets, train_ddp, train_single, Opt};

const ROWS: usize = 4;
const STEPS: usize = 5;

fn check(ranks: usize, kind: Opt) -> Result<()> {
    let expected = train_single(kind, ranks, ROWS, STEPS)?;
    let per_rank = run_local(ranks, |comm| {
        train_ddp(Arc::new(comm), kind, ROWS, STEPS, small_buckets())
    })?;
    for (rank, got) in per_rank.iter().enumerate() {
        let error = max_relative_error(got, &expected);
        assert!(
            error <= 1e-5,
            "DP={ranks} {kind:?} rank {rank}: relative error {error}"
        );
        assert_eq!(got, &per_rank[0], "ranks must hold identical parameters");
    }
    Ok(())
}

#[test]
fn dp2_sgd_matches_one_rank_on_the_whole_batch() -> Result<()> {
    check(2, Opt::Sgd)
}

#[test]
fn dp2_adamw_matches_one_rank_on_the_whole_batch() -> Result<()> {
    check(2, Opt::AdamW)
}

#[test]
fn dp4_sgd_matches_one_rank_on_the_whole_batch() -> Result<()> {
    check(4, Opt::Sgd)
}

#[test]
fn dp4_adamw_matches_one_rank_on_the_whole_batch() -> Result<()> {
    check(4, Opt::AdamW)
}

#[test]
fn default_buckets_give_the_same_result() -> Result<()> {
    let expected = train_single(Opt::AdamW, 2, ROWS, STEPS)?;
    let per_rank = run_local(2, |comm| {
        train_ddp(
            Arc::new(comm),
            Opt::AdamW,
            ROWS,
            STEPS,
            ferrotron_ddp::DdpConfig::default(),
        )
    })?;
    assert!(max_relative_error(&per_rank[1], &expected) <= 1e-5);
    Ok(())
}
