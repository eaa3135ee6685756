//! `split` with MPI_Comm_split semantics: colours, key ordering, opting out, nesting, and
//! sub-groups that work independently and concurrently.

use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, Error, ReduceOp};
use proptest::prelude::*;

#[test]
fn key_orders_members_and_none_opts_out() {
    let results = run_local(
        6,
        |comm| -> anyhow::Result<Option<(usize, usize, Vec<usize>)>> {
            let r = comm.rank();
            // Rank 5 opts out; the rest split by parity, ordered by descending rank.
            let color = (r != 5).then_some((r % 2) as u32);
            let sub = comm.split(color, (10 - r) as u32, "parity")?;
            Ok(sub.map(|s| (s.rank(), s.size(), s.world_ranks().to_vec())))
        },
    )
    .unwrap();
    assert_eq!(results[0], Some((2, 3, vec![4, 2, 0])));
    assert_eq!(results[4], Some((0, 3, vec![4, 2, 0])));
    assert_eq!(results[1], Some((1, 2, vec![3, 1])));
    assert_eq!(results[5], None);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Nested splits: each level's all-reduce of world ranks equals the sum over the
    /// members predicted from the colours.
    #[test]
    fn nested_splits_reduce_over_the_predicted_members(
        n in 1usize..=8,
        outer in 1u32..4,
        inner in 1u32..3,
    ) {
        let results = run_local(n, |comm| -> anyhow::Result<(i64, i64)> {
            let r = comm.rank();
            let a = comm.split(Some(r as u32 % outer), 0, "outer")?.expect("member");
            let mut sum = [r as i64];
            a.all_reduce_slice(&mut sum, ReduceOp::Sum)?;
            let b = a.split(Some(a.rank() as u32 % inner), 0, "inner")?.expect("member");
            let mut inner_sum = [r as i64];
            b.all_reduce_slice(&mut inner_sum, ReduceOp::Sum)?;
            Ok((sum[0], inner_sum[0]))
        });
        let results = results.map_err(|e| TestCaseError::fail(e.to_string()))?;
        for (r, (sum, inner_sum)) in results.into_iter().enumerate() {
            let outer_members: Vec<usize> =
                (0..n).filter(|q| q % outer as usize == r % outer as usize).collect();
            prop_assert_eq!(sum, outer_members.iter().sum::<usize>() as i64);
            let pos = outer_members.iter().position(|&q| q == r).unwrap();
            let inner_members: Vec<usize> = outer_members
                .iter()
                .enumerate()
                .filter(|(i, _)| i % inner as usize == pos % inner as usize)
                .map(|(_, &q)| q)
                .collect();
            prop_assert_eq!(inner_sum, inner_members.iter().sum::<usize>() as i64);
        }
    }
}

#[test]
fn sibling_groups_run_collectives_concurrently_from_threads() {
    // Each rank drives two disjoint-role groups from two threads at once; neither group
    // sees the other's traffic.
    let results = run_local(4, |comm| -> anyhow::Result<(f64, f64)> {
        let r = comm.rank();
        let rows = comm.split(Some(r as u32 / 2), 0, "rows")?.expect("member");
        let cols = comm.split(Some(r as u32 % 2), 0, "cols")?.expect("member");
        std::thread::scope(|s| {
            let a = s.spawn(|| {
                let mut x = vec![r as f64; 50_000];
                for _ in 0..20 {
                    rows.all_reduce_slice(&mut x, ReduceOp::Max)?;
                }
                Ok::<_, Error>(x[0])
            });
            let b = s.spawn(|| {
                let mut y = [r as f64];
                for _ in 0..200 {
                    y[0] = r as f64;
                    cols.all_reduce_slice(&mut y, ReduceOp::Sum)?;
                }
                Ok::<_, Error>(y[0])
            });
            Ok((a.join().unwrap()?, b.join().unwrap()?))
        })
    })
    .unwrap();
    assert_eq!(
        results,
        vec![(1.0, 2.0), (1.0, 4.0), (3.0, 2.0), (3.0, 4.0)]
    );
}

#[test]
fn a_rank_that_fails_is_lost_in_its_sub_groups_too() {
    // Rank 3 dies; unwinding drops its sub-communicator, so rank 1, waiting in a sub-group
    // with rank 3, fails instead of waiting for the timeout.
    let err = run_local(4, |comm| {
        let pairs = comm
            .split(Some(comm.rank() as u32 % 2), 0, "pairs")?
            .expect("member");
        if comm.rank() == 3 {
            panic!("rank 3 fails");
        }
        pairs.barrier()
    })
    .unwrap_err();
    assert!(matches!(err, Error::RankFailed { rank: 3, .. }), "{err}");
}

#[test]
fn a_sub_communicator_keeps_its_rank_alive_in_the_sub_group() {
    // Rank 0 fails and drops its world communicator, but a thread still holds its
    // sub-communicator and runs a call on it: that call must complete, not be refused
    // because rank 0's closure returned.
    let sub_result = std::sync::Mutex::new(None);
    let outcomes = std::thread::scope(|scope| {
        ferrotron_comm_core::LocalLauncher::new(2)
            .unwrap()
            .run_each(|comm| {
                let pair = comm.split(Some(0), 0, "pair")?.expect("member");
                if comm.rank() == 1 {
                    let mut x = vec![1.0f32; 1 << 15];
                    pair.all_reduce_slice(&mut x, ReduceOp::Sum)?;
                    return Ok(x[0]);
                }
                let result = &sub_result;
                scope.spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    let mut x = vec![2.0f32; 1 << 15];
                    *result.lock().unwrap() = Some(pair.all_reduce_slice(&mut x, ReduceOp::Sum));
                });
                Err(Error::Config("rank 0 gives up".into()))
            })
    });
    let rank1 = outcomes[1].as_ref().map_err(|(_, e)| e.to_string());
    assert_eq!(rank1, Ok(&3.0));
    let sub = sub_result.into_inner().unwrap().expect("the thread ran");
    assert!(sub.is_ok(), "{sub:?}");
}
