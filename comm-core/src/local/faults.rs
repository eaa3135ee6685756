//! Injected failures of the local backend's calls, for tests of what a training stack
//! does when a collective fails: a [`FaultInjector`] given to a world
//! ([`LocalLauncher::fault_injector`](super::LocalLauncher::fault_injector)) makes the
//! next call of a chosen rank in a chosen group fail as a broken link fails it. The
//! call returns [`Error::Injected`](crate::Error::Injected) on that rank, the group
//! breaks, and the peers' calls in it fail with a lost peer naming that rank, as they do
//! when a rank really fails. Where it fails is where a real failure would leave the most
//! behind: a call on the host before any rank touches another's memory; a call on a
//! communication stream after this rank's moves are queued there; a send or receive
//! before its message moves.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::OpKind;

/// Failures armed for a local world's calls. Clones share what is armed: arm them
/// from the ranks' code (a training loop, at the step it wants to fail).
///
/// ```
/// use ferrotron_comm_core::{Communicator, CommunicatorExt, Error, FaultInjector};
/// use ferrotron_comm_core::{LocalLauncher, ReduceOp};
///
/// let faults = FaultInjector::new();
/// let outcomes = LocalLauncher::new(2)?
///     .fault_injector(faults.clone())
///     .run_each(|comm| {
///         let mut x = [1.0f32];
///         comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
///         if comm.rank() == 1 {
///             faults.arm(1, Some("world"), None);
///         }
///         comm.barrier()?;
///         comm.all_reduce_slice(&mut x, ReduceOp::Sum)
///     });
/// // Rank 1's second all-reduce failed; rank 0's lost its peer.
/// assert!(outcomes.iter().all(Result::is_err));
/// # Ok::<(), Error>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct FaultInjector(Arc<Mutex<Vec<Fault>>>);

/// One armed failure.
#[derive(Clone, Debug)]
struct Fault {
    world_rank: usize,
    group: Option<String>,
    op: Option<OpKind>,
}

impl FaultInjector {
    /// An injector with nothing armed.
    pub fn new() -> FaultInjector {
        FaultInjector::default()
    }

    /// Makes the next call of world rank `world_rank` in the group named `group` (any
    /// group when `None`) that is an `op` (any call, collective or point-to-point, when
    /// `None`) fail, once. Calls of a group of one rank, which move nothing, never fail.
    pub fn arm(&self, world_rank: usize, group: Option<&str>, op: Option<OpKind>) {
        self.0.lock().push(Fault {
            world_rank,
            group: group.map(str::to_string),
            op,
        });
    }

    /// Failures armed that no call has met yet.
    pub fn armed(&self) -> usize {
        self.0.lock().len()
    }

    /// Whether this call of `world_rank` in `group` fails: the first armed failure it
    /// matches is spent on it.
    pub(crate) fn fire(&self, world_rank: usize, group: &str, op: OpKind) -> bool {
        let mut armed = self.0.lock();
        let matching = armed.iter().position(|f| {
            f.world_rank == world_rank
                && f.group.as_deref().is_none_or(|g| g == group)
                && f.op.is_none_or(|o| o == op)
        });
        matching.map(|at| armed.remove(at)).is_some()
    }
}
