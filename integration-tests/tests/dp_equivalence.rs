//! DESIGN.md invariant 2 (DP equivalence) with `layers`: DP = 4 (TP = 1) training a
//! 2-block transformer with `ddp` gives the same parameters after 3 AdamW steps as one
//! rank trained on the 4× batch, and the same loss at every step (relative 1e-5 under the
//! `layers` tests' rule).

mod support;

use support::{assert_matches_serial, train_parallel, train_serial, Arch, Opt, Setup};

#[test]
fn dp4_two_block_transformer_adamw_equals_one_rank_on_4x_batch() -> anyhow::Result<()> {
    let setup = Setup::new(Arch::Blocks(2), 1, 4, Opt::AdamW, 3);
    let ranks = train_parallel(&setup)?;
    let serial = train_serial(&setup)?;
    assert!(ranks.iter().all(|r| r.tp_rank == 0 && r.marked.is_empty()));
    assert_eq!(
        ranks.iter().map(|r| r.dp_rank).collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    assert_matches_serial("DP=4 2 blocks AdamW", &setup, &ranks, &serial);
    Ok(())
}
