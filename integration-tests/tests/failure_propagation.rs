//! DESIGN.md invariant 4 end to end: a rank that fails (returns an error, or panics)
//! before backward in a TP = 2 × DP = 2 training step (`layers` model, `ddp` over the DP
//! group, extra reductions over `"tp"`) makes every other rank's training step return
//! a typed error — `ferrotron_comm_core::Error::PeerLost` or `Broken`, found through the `layers` /
//! `ddp` / `mappings` / `tape` error chains — well under 5 s (the collective timeout is
//! set to 30 s, so only the lost-peer detection can be that fast), and the launcher
//! reports the failing rank's own error as the root cause.
//!
//! The survivors return their errors as their own code wraps them (`layers` / `ddp`
//! errors around the comm error): the launcher must still name the failing rank.

mod support;

use std::fmt;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use ferrotron_comm_core::{Communicator, LocalLauncher};
use support::{comm_error, train_rank, Arch, BoxError, Opt, Setup};

/// The error the failing rank returns.
#[derive(Debug)]
struct Injected {
    rank: usize,
    step: usize,
}

impl fmt::Display for Injected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "injected failure on rank {} at step {}",
            self.rank, self.step
        )
    }
}

impl std::error::Error for Injected {}

#[derive(Clone, Copy, Debug)]
enum Failure {
    Error,
    Panic,
}

/// How a surviving rank's run ended.
#[derive(Debug)]
struct Survivor {
    rank: usize,
    /// From the injected failure to this rank's error.
    elapsed: Duration,
    /// The `ferrotron_comm_core::Error` variant behind the error, if any.
    comm: Option<String>,
    message: String,
}

const LIMIT: Duration = Duration::from_secs(5);

/// Trains `setup` on 4 ranks; `failing_rank` fails at `failing_step`, after forward and
/// before backward. Returns the launcher's error and the other ranks' outcomes.
fn run_with_failure(
    setup: &Setup,
    failing_rank: usize,
    failing_step: usize,
    failure: Failure,
) -> (ferrotron_comm_core::Error, Vec<Survivor>) {
    let failed_at = OnceLock::<Instant>::new();
    let survivors = Mutex::new(Vec::new());
    let before_backward = |rank: usize, step: usize| -> Result<(), BoxError> {
        if rank == failing_rank && step == failing_step {
            failed_at.get_or_init(Instant::now);
            match failure {
                Failure::Error => return Err(Box::new(Injected { rank, step })),
                Failure::Panic => panic!("injected panic on rank {rank} at step {step}"),
            }
        }
        Ok(())
    };
    let result = LocalLauncher::new(setup.tp * setup.dp)
        .expect("launcher")
        .timeout(Duration::from_secs(30))
        .run(|comm| {
            let rank = comm.rank();
            let outcome = train_rank(comm, setup, &before_backward);
            if let Err(error) = &outcome {
                if rank != failing_rank {
                    let elapsed = failed_at
                        .get()
                        .map(Instant::elapsed)
                        .expect("a peer failed before the injected failure");
                    let comm = comm_error(&**error).map(|c| match c {
                        ferrotron_comm_core::Error::PeerLost { .. } => "PeerLost".to_string(),
                        ferrotron_comm_core::Error::Broken { .. } => "Broken".to_string(),
                        other => format!("{other:?}"),
                    });
                    survivors.lock().unwrap().push(Survivor {
                        rank,
                        elapsed,
                        comm,
                        message: error.to_string(),
                    });
                }
            }
            outcome
        });
    let error = match result {
        Ok(_) => panic!("training succeeded although rank {failing_rank} failed"),
        Err(error) => error,
    };
    let mut survivors = survivors.into_inner().unwrap();
    survivors.sort_by_key(|s| s.rank);
    (error, survivors)
}

fn check(setup: &Setup, failing_rank: usize, failure: Failure) {
    let failing_step = 1;
    let (error, survivors) = run_with_failure(setup, failing_rank, failing_step, failure);

    // Every other rank failed, with a lost peer or a broken group, quickly.
    assert_eq!(
        survivors.iter().map(|s| s.rank).collect::<Vec<_>>(),
        (0..4).filter(|&r| r != failing_rank).collect::<Vec<_>>(),
        "every other rank must fail: {survivors:#?}"
    );
    for s in &survivors {
        eprintln!(
            "rank {} failed {:?} after the injected {failure:?}: {:?}",
            s.rank, s.elapsed, s.comm
        );
        assert!(
            matches!(s.comm.as_deref(), Some("PeerLost" | "Broken")),
            "rank {}: expected PeerLost or Broken behind the error, got {:?}: {}",
            s.rank,
            s.comm,
            s.message
        );
        assert!(
            s.elapsed < LIMIT,
            "rank {} took {:?} to notice the failure",
            s.rank,
            s.elapsed
        );
    }

    // The launcher names the failing rank and its own error as the root cause.
    match &error {
        ferrotron_comm_core::Error::RankFailed { rank, source, .. } => {
            assert_eq!(*rank, failing_rank, "root cause: {error}");
            match failure {
                Failure::Error => {
                    let injected = source
                        .downcast_ref::<Injected>()
                        .unwrap_or_else(|| panic!("root cause is not the injected error: {error}"));
                    assert_eq!((injected.rank, injected.step), (failing_rank, failing_step));
                }
                Failure::Panic => assert!(
                    source.to_string().contains("injected panic"),
                    "root cause: {error}"
                ),
            }
        }
        other => panic!("expected RankFailed, got {other:?}"),
    }
    assert!(
        comm_error(&error).is_none(),
        "the root cause must be the injected failure, not a consequence: {error}"
    );
}

#[test]
fn erroring_rank_before_backward_fails_every_peer_quickly() {
    let setup = Setup::new(Arch::Mlp, 2, 2, Opt::Sgd, 3);
    check(&setup, 3, Failure::Error);
}

#[test]
fn panicking_rank_before_backward_fails_every_peer_quickly() {
    let setup = Setup {
        sequence_parallel: true,
        ..Setup::new(Arch::Blocks(1), 2, 2, Opt::AdamW, 3)
    };
    check(&setup, 0, Failure::Panic);
}
