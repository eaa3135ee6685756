//! A collective self-test of [`ParallelState`] on any backend.

use crate::error::{Error, Result};
use crate::layout::{GroupKind, RankLayout};
use crate::state::ParallelState;
use ferrotron_comm_core::{Communicator, CommunicatorExt, ReduceOp};
use std::sync::Arc;

/// Builds a [`ParallelState`] for `layout` over `world` and checks every group this
/// rank belongs to: its members are the ranks the layout predicts, and an all-reduce of
/// the world rank gives their sum. Returns the number of groups checked on this rank.
///
/// A collective call: every rank of `world` runs it. All ranks issue the same
/// all-reduces even when one finds a mismatch, so a wrong group is reported as an
/// [`Error::GroupCheck`], never a hang. Backend tests (local threads, `mpirun -n 4`)
/// call this with their own world communicator.
///
/// ```
/// use ferrotron_comm_core::{run_local, Communicator};
/// use ferrotron_parallel_state::{check_group_sums, RankLayout};
/// use std::sync::Arc;
///
/// let layout = RankLayout::builder(4).tp(2).build()?;
/// let checked = run_local(4, |comm| check_group_sums(Arc::new(comm), &layout))?;
/// assert!(checked.iter().all(|&n| n >= 10));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_group_sums(world: Arc<dyn Communicator>, layout: &RankLayout) -> Result<usize> {
    let state = ParallelState::new(world.clone(), layout.clone())?;
    let rank = world.rank();
    let mut first_mismatch = None;
    let mut checked = 0;
    for kind in GroupKind::ALL {
        let Some(comm) = state.group(kind) else {
            continue;
        };
        let members = layout.group_of(kind, rank)?.unwrap_or_default();
        // The communicator reports ranks of the root world, which `world` may be part of.
        let expected_world_ranks: Vec<Option<usize>> = members
            .iter()
            .map(|&r| world.world_ranks().get(r).copied())
            .collect();
        let actual_world_ranks: Vec<Option<usize>> =
            comm.world_ranks().iter().map(|&r| Some(r)).collect();
        let mut sum = [rank as f64];
        comm.all_reduce_slice(&mut sum, ReduceOp::Sum)?;
        let expected_sum: usize = members.iter().sum();
        let mismatch = if expected_world_ranks != actual_world_ranks {
            Some((
                format!("members {members:?}"),
                format!("members {:?} (world ranks)", comm.world_ranks()),
            ))
        } else if sum[0] != expected_sum as f64 {
            Some((format!("rank sum {expected_sum}"), format!("{}", sum[0])))
        } else {
            None
        };
        if let (None, Some((expected, actual))) = (&first_mismatch, mismatch) {
            first_mismatch = Some(Error::GroupCheck {
                group: kind.name().to_string(),
                rank,
                expected,
                actual,
            });
        }
        checked += 1;
    }
    match first_mismatch {
        Some(error) => Err(error),
        None => Ok(checked),
    }
}
