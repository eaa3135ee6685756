//! Rank lists checked against Megatron-Core: its docstring example, the seed-002
//! setting, and hand-derived vectors for context parallelism, non-default orders and
//! expert parallelism.
//!
//! Derivation rule (Megatron's `RankGenerator`): with the order's axes a0, a1, … (missing
//! axes appended, size 1), rank = c0 + s0·(c1 + s1·(c2 + …)), the leftmost axis fastest.
//! A family fixes the axes it does not name; its groups are enumerated by those fixed
//! coordinates read the same way (leftmost fastest), and each group lists its ranks by
//! the named coordinates, leftmost fastest, which is ascending.

use ferrotron_parallel_state::{Coordinates, ExpertCoordinates, GroupKind, RankLayout, Stage};

type Groups = Vec<Vec<usize>>;

fn pairs(count: usize, step: usize) -> Groups {
    (0..count).map(|i| vec![i, i + step]).collect()
}

fn runs(count: usize, len: usize) -> Groups {
    (0..count)
        .map(|i| (i * len..(i + 1) * len).collect())
        .collect()
}

fn singletons(ranks: impl IntoIterator<Item = usize>) -> Groups {
    ranks.into_iter().map(|r| vec![r]).collect()
}

#[test]
fn megatron_docstring_16_ranks_tp2_pp4() -> anyhow::Result<()> {
    let layout = RankLayout::builder(16).tp(2).pp(4).build()?;
    assert_eq!(layout.dp(), 2);
    assert_eq!(layout.groups(GroupKind::Tp), runs(8, 2));
    assert_eq!(
        layout.groups(GroupKind::Pp),
        vec![
            vec![0, 4, 8, 12],
            vec![1, 5, 9, 13],
            vec![2, 6, 10, 14],
            vec![3, 7, 11, 15]
        ]
    );
    let dp = vec![
        vec![0, 2],
        vec![1, 3],
        vec![4, 6],
        vec![5, 7],
        vec![8, 10],
        vec![9, 11],
        vec![12, 14],
        vec![13, 15],
    ];
    assert_eq!(layout.groups(GroupKind::Dp), dp);
    // Without context parallelism dp-cp is dp, cp is every rank alone, tp-cp is tp.
    assert_eq!(layout.groups(GroupKind::DpCp), dp);
    assert_eq!(layout.groups(GroupKind::Cp), singletons(0..16));
    assert_eq!(layout.groups(GroupKind::TpCp), runs(8, 2));
    assert_eq!(
        layout.groups(GroupKind::TpPp),
        vec![
            vec![0, 1, 4, 5, 8, 9, 12, 13],
            vec![2, 3, 6, 7, 10, 11, 14, 15]
        ]
    );
    assert_eq!(layout.groups(GroupKind::TpDp), runs(4, 4));
    assert_eq!(layout.groups(GroupKind::Embedding), pairs(4, 12));
    assert_eq!(
        layout.groups(GroupKind::PositionEmbedding),
        singletons(0..4)
    );
    assert!(layout.is_first_stage(3)? && !layout.is_last_stage(3)?);
    assert!(layout.is_last_stage(14)?);
    assert_eq!(layout.next_pipeline_rank(5)?, 9);
    assert_eq!(layout.previous_pipeline_rank(5)?, 1);
    assert_eq!(layout.next_pipeline_rank(15)?, 3);
    assert_eq!(layout.previous_pipeline_rank(2)?, 14);
    Ok(())
}

#[test]
fn seed_002_eight_ranks_tp2_pp2() -> anyhow::Result<()> {
    let layout = RankLayout::builder(8).tp(2).pp(2).build()?;
    assert_eq!(layout.groups(GroupKind::Tp), runs(4, 2));
    assert_eq!(layout.groups(GroupKind::Pp), pairs(4, 4));
    assert_eq!(
        layout.groups(GroupKind::Dp),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(layout.groups(GroupKind::Embedding), pairs(4, 4));
    // TP ranks of the seed's split test: even ranks hold shard 0, odd ranks shard 1.
    for rank in 0..8 {
        assert_eq!(layout.coordinates(rank)?.tp, rank % 2);
    }
    Ok(())
}

/// 16 ranks, tp 2, cp 2, pp 2 (dp 2), default order tp-cp-ep-dp-pp:
/// rank = tp + 2·cp + 4·dp + 8·pp.
#[test]
fn context_parallel_default_order() -> anyhow::Result<()> {
    let layout = RankLayout::builder(16).tp(2).cp(2).pp(2).build()?;
    assert_eq!(layout.dp(), 2);
    // tp: fixed (cp, dp, pp), index cp + 2dp + 4pp → consecutive pairs.
    assert_eq!(layout.groups(GroupKind::Tp), runs(8, 2));
    // cp: fixed (tp, dp, pp), index tp + 2dp + 4pp; members base + {0, 2}.
    let cp = vec![
        vec![0, 2],
        vec![1, 3],
        vec![4, 6],
        vec![5, 7],
        vec![8, 10],
        vec![9, 11],
        vec![12, 14],
        vec![13, 15],
    ];
    assert_eq!(layout.groups(GroupKind::Cp), cp);
    // dp: fixed (tp, cp, pp), index tp + 2cp + 4pp; members base + {0, 4}.
    let dp = vec![
        vec![0, 4],
        vec![1, 5],
        vec![2, 6],
        vec![3, 7],
        vec![8, 12],
        vec![9, 13],
        vec![10, 14],
        vec![11, 15],
    ];
    assert_eq!(layout.groups(GroupKind::Dp), dp);
    // dp-cp: fixed (tp, pp), index tp + 2pp; members base + {0, 2, 4, 6}.
    assert_eq!(
        layout.groups(GroupKind::DpCp),
        vec![
            vec![0, 2, 4, 6],
            vec![1, 3, 5, 7],
            vec![8, 10, 12, 14],
            vec![9, 11, 13, 15]
        ]
    );
    // pp: fixed (tp, cp, dp), index tp + 2cp + 4dp; members base + {0, 8}.
    assert_eq!(layout.groups(GroupKind::Pp), pairs(8, 8));
    // tp-pp: fixed (cp, dp), index cp + 2dp; members base + {0, 1, 8, 9}.
    assert_eq!(
        layout.groups(GroupKind::TpPp),
        vec![
            vec![0, 1, 8, 9],
            vec![2, 3, 10, 11],
            vec![4, 5, 12, 13],
            vec![6, 7, 14, 15]
        ]
    );
    // tp-cp: fixed (dp, pp), index dp + 2pp; members base + {0, 1, 2, 3}.
    assert_eq!(layout.groups(GroupKind::TpCp), runs(4, 4));
    // tp-dp: fixed (cp, pp), index cp + 2pp; members base + {0, 1, 4, 5}.
    assert_eq!(
        layout.groups(GroupKind::TpDp),
        vec![
            vec![0, 1, 4, 5],
            vec![2, 3, 6, 7],
            vec![8, 9, 12, 13],
            vec![10, 11, 14, 15]
        ]
    );
    assert_eq!(layout.groups(GroupKind::TpDpCp), runs(2, 8));
    // Two stages: first and last are the whole pipeline.
    assert_eq!(layout.groups(GroupKind::Embedding), pairs(8, 8));
    assert_eq!(
        layout.groups(GroupKind::PositionEmbedding),
        singletons(0..8)
    );
    // 13 = 1 + 2·0 + 4·1 + 8·1.
    assert_eq!(
        layout.coordinates(13)?,
        Coordinates {
            tp: 1,
            cp: 0,
            dp: 1,
            pp: 1
        }
    );
    // Expert layers fold cp into expert dp: expert grid tp 2 · ep 1 · dp 4 · pp 2.
    assert_eq!(layout.expert_dp(), 4);
    assert_eq!(
        layout.groups(GroupKind::ExpertDp),
        vec![
            vec![0, 2, 4, 6],
            vec![1, 3, 5, 7],
            vec![8, 10, 12, 14],
            vec![9, 11, 13, 15]
        ]
    );
    Ok(())
}

/// 12 ranks, tp 2, pp 3 (dp 2), order tp-pp-dp: rank = tp + 2·pp + 6·dp.
#[test]
fn non_default_order_tp_pp_dp() -> anyhow::Result<()> {
    let layout = RankLayout::builder(12)
        .tp(2)
        .pp(3)
        .order("tp-pp-dp".parse()?)
        .build()?;
    assert_eq!(layout.groups(GroupKind::Tp), runs(6, 2));
    // pp: fixed (tp, dp), index tp + 2dp; members base + {0, 2, 4}.
    assert_eq!(
        layout.groups(GroupKind::Pp),
        vec![vec![0, 2, 4], vec![1, 3, 5], vec![6, 8, 10], vec![7, 9, 11]]
    );
    // dp: fixed (tp, pp), index tp + 2pp; members base + {0, 6}.
    assert_eq!(layout.groups(GroupKind::Dp), pairs(6, 6));
    assert_eq!(layout.groups(GroupKind::TpPp), runs(2, 6));
    // tp-dp: fixed pp; members 2pp + {0, 1, 6, 7}.
    assert_eq!(
        layout.groups(GroupKind::TpDp),
        vec![vec![0, 1, 6, 7], vec![2, 3, 8, 9], vec![4, 5, 10, 11]]
    );
    assert_eq!(
        layout.groups(GroupKind::Embedding),
        vec![vec![0, 4], vec![1, 5], vec![6, 10], vec![7, 11]]
    );
    assert_eq!(
        layout.groups(GroupKind::PositionEmbedding),
        singletons([0, 1, 6, 7])
    );
    // 9 = 1 + 2·1 + 6·1.
    assert_eq!(
        layout.coordinates(9)?,
        Coordinates {
            tp: 1,
            cp: 0,
            dp: 1,
            pp: 1
        }
    );
    assert_eq!(layout.next_pipeline_rank(4)?, 0);
    assert_eq!(layout.previous_pipeline_rank(0)?, 4);
    Ok(())
}

/// 16 ranks, tp 2, cp 2, pp 2 (dp 2), order cp-dp-tp-pp: rank = cp + 2·dp + 4·tp + 8·pp.
#[test]
fn context_parallel_with_order_cp_dp_tp_pp() -> anyhow::Result<()> {
    let layout = RankLayout::builder(16)
        .tp(2)
        .cp(2)
        .pp(2)
        .order("cp-dp-tp-pp".parse()?)
        .build()?;
    // tp: fixed (cp, dp, pp), index cp + 2dp + 4pp; members base + {0, 4}.
    assert_eq!(
        layout.groups(GroupKind::Tp),
        vec![
            vec![0, 4],
            vec![1, 5],
            vec![2, 6],
            vec![3, 7],
            vec![8, 12],
            vec![9, 13],
            vec![10, 14],
            vec![11, 15]
        ]
    );
    // cp: fixed (dp, tp, pp); consecutive pairs.
    assert_eq!(layout.groups(GroupKind::Cp), runs(8, 2));
    // dp: fixed (cp, tp, pp), index cp + 2tp + 4pp; members base + {0, 2}.
    assert_eq!(
        layout.groups(GroupKind::Dp),
        vec![
            vec![0, 2],
            vec![1, 3],
            vec![4, 6],
            vec![5, 7],
            vec![8, 10],
            vec![9, 11],
            vec![12, 14],
            vec![13, 15]
        ]
    );
    // dp-cp: fixed (tp, pp); runs of four.
    assert_eq!(layout.groups(GroupKind::DpCp), runs(4, 4));
    // tp-cp: fixed (dp, pp), index dp + 2pp; members base + {0, 1, 4, 5}.
    assert_eq!(
        layout.groups(GroupKind::TpCp),
        vec![
            vec![0, 1, 4, 5],
            vec![2, 3, 6, 7],
            vec![8, 9, 12, 13],
            vec![10, 11, 14, 15]
        ]
    );
    assert_eq!(layout.groups(GroupKind::Pp), pairs(8, 8));
    // 6 = 0 + 2·1 + 4·1 + 8·0.
    assert_eq!(
        layout.coordinates(6)?,
        Coordinates {
            tp: 1,
            cp: 0,
            dp: 1,
            pp: 0
        }
    );
    Ok(())
}

/// 8 ranks, tp 2, ep 2, default order. Expert grid: tp 2 · ep 2 · expert dp 2 · pp 1,
/// rank = tp + 2·ep + 4·dp.
#[test]
fn expert_groups_from_the_second_generator() -> anyhow::Result<()> {
    let layout = RankLayout::builder(8).tp(2).ep(2).build()?;
    assert_eq!((layout.dp(), layout.expert_dp()), (4, 2));
    assert_eq!(
        layout.groups(GroupKind::Ep),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(layout.groups(GroupKind::ExpertTp), runs(4, 2));
    assert_eq!(layout.groups(GroupKind::ExpertTpEp), runs(2, 4));
    assert_eq!(layout.groups(GroupKind::ExpertTpEpPp), runs(2, 4));
    assert_eq!(layout.groups(GroupKind::ExpertDp), pairs(4, 4));
    // The dense dp group spans all four replicas: 0, 2, 4, 6.
    assert_eq!(layout.group_of(GroupKind::Dp, 4)?, Some(vec![0, 2, 4, 6]));
    assert_eq!(
        layout.expert_coordinates(7)?,
        ExpertCoordinates {
            tp: 1,
            ep: 1,
            dp: 1,
            pp: 0
        }
    );

    // Expert tp 1, ep 4: ep groups are runs of four, expert dp pairs them across.
    let layout = RankLayout::builder(8).ep(4).expert_tp(1).build()?;
    assert_eq!(layout.groups(GroupKind::Ep), runs(2, 4));
    assert_eq!(layout.groups(GroupKind::ExpertDp), pairs(4, 4));
    Ok(())
}

#[test]
fn custom_embedding_stages_and_rank_offset() -> anyhow::Result<()> {
    let layout = RankLayout::builder(8)
        .pp(4)
        .rank_offset(100)
        .embedding_stages([Stage::First, Stage::At(2), Stage::Last])
        .position_embedding_stages([Stage::Last])
        .build()?;
    // pp groups: [100, 102, 104, 106] and [101, 103, 105, 107].
    assert_eq!(
        layout.groups(GroupKind::Embedding),
        vec![vec![100, 104, 106], vec![101, 105, 107]]
    );
    assert_eq!(
        layout.groups(GroupKind::PositionEmbedding),
        vec![vec![106], vec![107]]
    );
    assert_eq!(layout.group_of(GroupKind::Embedding, 102)?, None);
    assert_eq!(layout.coordinates(103)?.pp, 1);

    let no_embeddings = RankLayout::builder(4).pp(2).embedding_stages([]).build()?;
    assert!(no_embeddings.groups(GroupKind::Embedding).is_empty());

    // One stage: first and last are the same rank, as in Megatron.
    let single = RankLayout::builder(2).tp(2).build()?;
    assert_eq!(single.groups(GroupKind::Embedding), singletons(0..2));
    Ok(())
}
