//! Per-rank queries never materialise a family, so a million-rank layout is instant.

use ferrotron_parallel_state::{GroupKind, RankLayout};
use std::time::{Duration, Instant};

#[test]
fn million_rank_layout_answers_per_rank_queries_instantly() -> anyhow::Result<()> {
    let start = Instant::now();
    // 1,048,576 = tp 8 · cp 2 · pp 16 · dp 4096.
    let layout = RankLayout::builder(1 << 20).tp(8).cp(2).pp(16).build()?;
    assert_eq!(layout.dp(), 4096);
    let rank = 987_654;
    let c = layout.coordinates(rank)?;
    assert_eq!(layout.rank_of(c)?, rank);
    for kind in GroupKind::ALL {
        if let Some(group) = layout.group_of(kind, rank)? {
            assert!(group.contains(&rank), "{kind}");
            assert_eq!(
                group.len(),
                layout.membership(kind, rank)?.map_or(0, |m| m.size)
            );
        }
    }
    assert_eq!(
        layout.group_of(GroupKind::Tp, rank)?.map(|g| g.len()),
        Some(8)
    );
    assert_eq!(layout.group_count(GroupKind::Tp), 1 << 17);
    // Generous for a debug build on a loaded machine; the real cost is microseconds.
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    Ok(())
}

#[test]
fn enumerating_every_family_of_65536_ranks() -> anyhow::Result<()> {
    let layout = RankLayout::builder(1 << 16)
        .tp(8)
        .cp(2)
        .pp(8)
        .ep(4)
        .build()?;
    let total: usize = GroupKind::ALL
        .iter()
        .filter(|k| k.covers_every_rank())
        .map(|&kind| layout.groups(kind).iter().map(Vec::len).sum::<usize>())
        .sum();
    assert_eq!(total, 14 << 16);
    Ok(())
}
