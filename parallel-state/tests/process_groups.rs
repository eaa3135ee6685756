//! `ParallelState` over the local backend: group members and all-reduce sums match the
//! layout, named groups work, and several states coexist in one process.

use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, ReduceOp};
use ferrotron_parallel_state::{check_group_sums, Error, GroupKind, ParallelState, RankLayout};
use std::sync::Arc;

/// Sum of world ranks over this rank's group of `kind`.
fn group_sum(state: &ParallelState, kind: GroupKind) -> anyhow::Result<Option<f64>> {
    let Some(comm) = state.group(kind) else {
        return Ok(None);
    };
    let mut x = [state.rank() as f64];
    comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
    Ok(Some(x[0]))
}

#[test]
fn group_sums_match_the_layout_on_eight_ranks() -> anyhow::Result<()> {
    let layouts = [
        RankLayout::builder(8).tp(2).pp(2).build()?,
        RankLayout::builder(8).tp(2).cp(2).pp(2).build()?,
        RankLayout::builder(8).tp(2).ep(2).build()?,
        RankLayout::builder(8)
            .tp(2)
            .pp(2)
            .order("tp-pp-dp".parse()?)
            .build()?,
        RankLayout::builder(8).cp(4).build()?,
    ];
    for layout in &layouts {
        let checked = run_local(8, |comm| check_group_sums(Arc::new(comm), layout))?;
        // Every rank is in all 14 covering families, plus the embedding groups it holds.
        assert!(
            checked.iter().all(|&n| (14..=16).contains(&n)),
            "{checked:?}"
        );
    }
    Ok(())
}

#[test]
fn seed_002_tensor_parallel_sums() -> anyhow::Result<()> {
    let layout = RankLayout::builder(8).tp(2).pp(2).build()?;
    let sums = run_local(8, |comm| {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let all: Vec<Option<f64>> = GroupKind::ALL
            .iter()
            .map(|&kind| group_sum(&state, kind))
            .collect::<anyhow::Result<_>>()?;
        anyhow::Ok((state.tp_rank(), state.pp_rank(), state.dp_rank(), all))
    })?;
    let tp_sums: Vec<f64> = sums.iter().map(|s| s.3[0].unwrap_or(-1.0)).collect();
    assert_eq!(tp_sums, vec![1.0, 1.0, 5.0, 5.0, 9.0, 9.0, 13.0, 13.0]);
    // pp groups [r, r + 4]; dp groups [0,2] [1,3] [4,6] [5,7].
    let pp_sums: Vec<f64> = sums.iter().map(|s| s.3[1].unwrap_or(-1.0)).collect();
    assert_eq!(pp_sums, vec![4.0, 6.0, 8.0, 10.0, 4.0, 6.0, 8.0, 10.0]);
    let dp_sums: Vec<f64> = sums.iter().map(|s| s.3[2].unwrap_or(-1.0)).collect();
    assert_eq!(dp_sums, vec![2.0, 4.0, 2.0, 4.0, 10.0, 12.0, 10.0, 12.0]);
    let coordinates: Vec<(usize, usize, usize)> = sums.iter().map(|s| (s.0, s.1, s.2)).collect();
    assert_eq!(
        coordinates,
        vec![
            (0, 0, 0),
            (1, 0, 0),
            (0, 0, 1),
            (1, 0, 1),
            (0, 1, 0),
            (1, 1, 0),
            (0, 1, 1),
            (1, 1, 1)
        ]
    );
    Ok(())
}

#[test]
fn accessors_and_pipeline_neighbours() -> anyhow::Result<()> {
    let layout = RankLayout::builder(8).tp(2).pp(2).build()?;
    let views = run_local(8, |comm| {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        assert_eq!(state.tp().size(), state.tp_size());
        assert_eq!(state.dp().size(), state.dp_size());
        assert_eq!(state.pp().size(), state.pp_size());
        assert_eq!(state.cp().size(), state.cp_size());
        assert_eq!(state.ep().size(), state.ep_size());
        assert_eq!(state.tp().rank(), state.tp_rank());
        assert_eq!(state.pp().rank(), state.pp_rank());
        assert_eq!(state.model().size(), 4);
        assert_eq!(state.dp_cp().size(), 2);
        assert_eq!(state.tp_dp().size(), 4);
        assert_eq!(state.tp_cp().size(), 2);
        assert_eq!(state.tp_dp_cp().size(), 4);
        assert_eq!(state.expert_tp().size(), 2);
        assert_eq!(state.expert_tp_ep().size(), 2);
        assert_eq!(state.expert_tp_ep_pp().size(), 4);
        assert_eq!(state.expert_dp().size(), 2);
        assert_eq!(state.embedding().map(|c| c.size()), Some(2));
        assert_eq!(state.tp().name(), "tp");
        anyhow::Ok((
            state.is_first_stage(),
            state.is_last_stage(),
            state.next_pipeline_rank()?,
            state.previous_pipeline_rank()?,
            state.position_embedding().map(|c| c.world_ranks().to_vec()),
        ))
    })?;
    for (rank, (first, last, next, previous, position)) in views.into_iter().enumerate() {
        assert_eq!(first, rank < 4);
        assert_eq!(last, rank >= 4);
        assert_eq!(next, (rank + 4) % 8);
        assert_eq!(previous, (rank + 4) % 8);
        assert_eq!(position, (rank < 4).then(|| vec![rank]));
    }
    Ok(())
}

#[test]
fn named_groups_registry() -> anyhow::Result<()> {
    let layout = RankLayout::builder(8).tp(2).cp(2).build()?;
    let results = run_local(8, |comm| {
        let mut state = ParallelState::new(Arc::new(comm), layout.clone())?;
        state.add_group("shared-embedding", &[6, 1, 3])?;
        let names: Vec<String> = state.group_names().iter().map(|s| s.to_string()).collect();
        let tp_cp = state.size_named("tp-cp")?;
        let dp = state.group_named("dp")?.world_ranks().to_vec();
        let shared = match state.group_named("shared-embedding") {
            Ok(comm) => {
                let mut x = [state.rank() as f64];
                comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
                Some((comm.rank(), x[0]))
            }
            Err(Error::NotAMember { .. }) => None,
            Err(other) => return Err(other.into()),
        };
        let unknown = state.group_named("nope").err().map(|e| e.to_string());
        let duplicate = state.add_group("tp", &[0]).err().map(|e| e.to_string());
        let repeated = state
            .add_group("twice", &[1, 1])
            .err()
            .map(|e| e.to_string());
        let outside = state.add_group("far", &[8]).err().map(|e| e.to_string());
        anyhow::Ok((
            names, tp_cp, dp, shared, unknown, duplicate, repeated, outside,
        ))
    })?;
    for (rank, (names, tp_cp, dp, shared, unknown, duplicate, repeated, outside)) in
        results.into_iter().enumerate()
    {
        assert_eq!(names.len(), GroupKind::ALL.len() + 1);
        assert_eq!(names.last().map(String::as_str), Some("shared-embedding"));
        assert!(names.iter().any(|n| n == "tp-cp") && names.iter().any(|n| n == "dp"));
        assert_eq!(tp_cp, 4);
        assert_eq!(dp, vec![rank % 4, rank % 4 + 4]);
        // Group ranks follow the list order: 6 → 0, 1 → 1, 3 → 2.
        let expected = match rank {
            6 => Some((0, 10.0)),
            1 => Some((1, 10.0)),
            3 => Some((2, 10.0)),
            _ => None,
        };
        assert_eq!(shared, expected);
        assert!(unknown.is_some_and(|m| m.contains("shared-embedding") && m.contains("tp-cp")));
        assert!(duplicate.is_some_and(|m| m.contains("already exists")));
        assert!(repeated.is_some_and(|m| m.contains("listed twice")));
        assert!(outside.is_some_and(|m| m.contains("not in the world of 8")));
    }
    Ok(())
}

#[test]
fn two_states_coexist_in_one_world() -> anyhow::Result<()> {
    let narrow = RankLayout::builder(8).tp(2).build()?;
    let wide = RankLayout::builder(8).tp(4).pp(2).build()?;
    let sums = run_local(8, |comm| {
        let world: Arc<dyn Communicator> = Arc::new(comm);
        let a = ParallelState::new(world.clone(), narrow.clone())?;
        let b = ParallelState::new(world, wide.clone())?;
        // Interleave collectives on both states' groups.
        let mut x = [a.rank() as f64];
        a.tp().all_reduce_slice(&mut x, ReduceOp::Sum)?;
        let mut y = [b.rank() as f64];
        b.tp().all_reduce_slice(&mut y, ReduceOp::Sum)?;
        let mut z = [1.0f64];
        a.dp().all_reduce_slice(&mut z, ReduceOp::Sum)?;
        anyhow::Ok((x[0], y[0], z[0]))
    })?;
    for (rank, (narrow_tp, wide_tp, dp_size)) in sums.into_iter().enumerate() {
        let pair = rank / 2 * 2;
        let quad = rank / 4 * 4;
        assert_eq!(narrow_tp, (2 * pair + 1) as f64);
        assert_eq!(wide_tp, (4 * quad + 6) as f64);
        assert_eq!(dp_size, 4.0);
    }
    Ok(())
}

#[test]
fn two_worlds_run_side_by_side() -> anyhow::Result<()> {
    let layout = RankLayout::builder(4).tp(2).build()?;
    std::thread::scope(|scope| {
        let runs: Vec<_> = (0..2)
            .map(|_| scope.spawn(|| run_local(4, |comm| check_group_sums(Arc::new(comm), &layout))))
            .collect();
        for run in runs {
            let checked = run
                .join()
                .map_err(|_| anyhow::anyhow!("world panicked"))??;
            assert_eq!(checked.len(), 4);
        }
        anyhow::Ok(())
    })
}

#[test]
fn ranks_outside_an_offset_layout_are_told_so() -> anyhow::Result<()> {
    let layout = RankLayout::builder(4).tp(2).rank_offset(2).build()?;
    let outcomes = run_local(8, |comm| {
        anyhow::Ok(match ParallelState::new(Arc::new(comm), layout.clone()) {
            Ok(state) => Ok(state.tp().world_ranks().to_vec()),
            Err(error) => Err(error.to_string()),
        })
    })?;
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match rank {
            2 | 3 => assert_eq!(outcome, Ok(vec![2, 3])),
            4 | 5 => assert_eq!(outcome, Ok(vec![4, 5])),
            _ => assert!(outcome.is_err_and(|m| m.contains("covers ranks 2..=5"))),
        }
    }

    let too_small = run_local(4, |comm| {
        anyhow::Ok(
            ParallelState::new(Arc::new(comm), RankLayout::builder(8).build()?)
                .err()
                .map(|e| e.to_string()),
        )
    })?;
    assert!(too_small
        .iter()
        .all(|m| m.as_deref().is_some_and(|m| m.contains("needs 8"))));
    Ok(())
}
