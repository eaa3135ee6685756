//! Properties of every valid layout: families partition the ranks, TP and DP groups
//! are orthogonal, coordinates round-trip, and per-rank queries match enumeration.

use ferrotron_parallel_state::{Axis, Error, GroupKind, Order, RankLayout};
use proptest::prelude::*;
use std::collections::HashSet;

/// Small valid-looking configurations; ones Megatron rejects are skipped.
fn layouts() -> impl Strategy<Value = RankLayout> {
    (
        1usize..=4,
        1usize..=3,
        1usize..=3,
        1usize..=4,
        prop_oneof![Just(1usize), Just(2)],
        0usize..=5,
        Just(Axis::ALL.to_vec()).prop_shuffle(),
    )
        .prop_filter_map(
            "Megatron rejects the expert layout",
            |(tp, cp, pp, dp, ep, offset, axes)| {
                let order: Order = axes
                    .iter()
                    .map(|a| a.token())
                    .collect::<Vec<_>>()
                    .join("-")
                    .parse()
                    .ok()?;
                match RankLayout::builder(tp * cp * pp * dp)
                    .tp(tp)
                    .cp(cp)
                    .pp(pp)
                    .ep(ep)
                    .order(order)
                    .rank_offset(offset)
                    .build()
                {
                    Ok(layout) => Some(layout),
                    Err(Error::NotDivisible { .. } | Error::ExpertMismatch { .. }) => None,
                    Err(other) => panic!("unexpected error {other}"),
                }
            },
        )
}

fn ranks(layout: &RankLayout) -> std::ops::Range<usize> {
    layout.rank_offset()..layout.rank_offset() + layout.world_size()
}

proptest! {
    #[test]
    fn families_partition_the_ranks(layout in layouts()) {
        for kind in GroupKind::ALL {
            let groups = layout.groups(kind);
            let mut seen = HashSet::new();
            for group in &groups {
                prop_assert!(group.windows(2).all(|w| w[0] < w[1]), "{kind} group {group:?} not ascending");
                prop_assert_eq!(group.len(), groups[0].len());
                for &rank in group {
                    prop_assert!(ranks(&layout).contains(&rank));
                    prop_assert!(seen.insert(rank), "{} appears twice in {}", rank, kind);
                }
            }
            if kind.covers_every_rank() {
                prop_assert_eq!(seen.len(), layout.world_size(), "{} misses ranks", kind);
            }
        }
    }

    #[test]
    fn tp_and_dp_groups_share_at_most_one_rank(layout in layouts()) {
        let dp: Vec<HashSet<usize>> = layout
            .groups(GroupKind::Dp)
            .into_iter()
            .map(|g| g.into_iter().collect())
            .collect();
        for tp in layout.groups(GroupKind::Tp) {
            for d in &dp {
                prop_assert!(tp.iter().filter(|r| d.contains(r)).count() <= 1);
            }
        }
    }

    #[test]
    fn coordinates_round_trip(layout in layouts()) {
        for rank in ranks(&layout) {
            let c = layout.coordinates(rank)?;
            prop_assert_eq!(layout.rank_of(c)?, rank);
            // Coordinates are positions in the single-axis groups.
            prop_assert_eq!(layout.membership(GroupKind::Tp, rank)?.map(|m| m.position), Some(c.tp));
            prop_assert_eq!(layout.membership(GroupKind::Cp, rank)?.map(|m| m.position), Some(c.cp));
            prop_assert_eq!(layout.membership(GroupKind::Dp, rank)?.map(|m| m.position), Some(c.dp));
            prop_assert_eq!(layout.membership(GroupKind::Pp, rank)?.map(|m| m.position), Some(c.pp));
            prop_assert_eq!(layout.previous_pipeline_rank(layout.next_pipeline_rank(rank)?)?, rank);
        }
    }

    #[test]
    fn per_rank_queries_match_enumeration(layout in layouts()) {
        for kind in GroupKind::ALL {
            let groups = layout.groups(kind);
            prop_assert_eq!(groups.len(), layout.group_count(kind));
            for rank in ranks(&layout) {
                let expected = groups.iter().position(|g| g.contains(&rank));
                let membership = layout.membership(kind, rank)?;
                prop_assert_eq!(membership.map(|m| m.group), expected);
                if let Some(m) = membership {
                    prop_assert_eq!(groups[m.group][m.position], rank);
                    prop_assert_eq!(m.size, groups[m.group].len());
                    prop_assert_eq!(layout.group_of(kind, rank)?, Some(groups[m.group].clone()));
                } else {
                    prop_assert_eq!(layout.group_of(kind, rank)?, None);
                }
            }
        }
    }
}
