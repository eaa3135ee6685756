//! Failure semantics of the local backend: mismatched calls, lost peers and timeouts are
//! typed errors on every rank, promptly, never hangs or wrong numbers.

use ferrotron_comm_core::{
    run_local, CallSignature, Communicator, CommunicatorExt, DType, Error, LocalLauncher, OpKind,
    ReduceOp,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Far below the default 300 s timeout: proves a failure was detected, not waited out.
const PROMPT: Duration = Duration::from_secs(5);

/// Runs `f` on `n` ranks and returns every rank's own error (panicking if one succeeded).
fn errors_of<F>(n: usize, f: F) -> Vec<Error>
where
    F: Fn(ferrotron_comm_core::LocalCommunicator) -> ferrotron_comm_core::Result<()> + Sync,
{
    LocalLauncher::new(n)
        .unwrap()
        .run_each(f)
        .into_iter()
        .map(|r| match r {
            Err((_, Error::RankFailed { source, .. })) => *source.downcast::<Error>().unwrap(),
            other => panic!("expected a failure, got {:?}", other.map(|_| ())),
        })
        .collect()
}

fn mismatch_calls(err: &Error) -> &[CallSignature] {
    match err {
        Error::Mismatch { group, seq, calls } => {
            assert_eq!(group, "world");
            assert_eq!(*seq, 1, "the first call matched; the second is #1");
            calls
        }
        other => panic!("expected Mismatch, got {other}"),
    }
}

#[test]
fn mismatched_op_is_reported_on_every_rank() {
    let errors = errors_of(2, |comm| {
        comm.barrier()?;
        let mut x = [1.0f32; 4];
        if comm.rank() == 0 {
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)
        } else {
            comm.broadcast_slice(&mut x, 0)
        }
    });
    for err in &errors {
        let calls = mismatch_calls(err);
        assert_eq!(calls[0].op, OpKind::AllReduce);
        assert_eq!(calls[1].op, OpKind::Broadcast);
        assert_eq!(calls[1].root, Some(0));
        assert!(err.to_string().contains("rank 1: broadcast"), "{err}");
    }
}

#[test]
fn mismatched_dtype_count_and_root_name_each_rank_arguments() {
    let errors = errors_of(3, |comm| {
        comm.barrier()?;
        match comm.rank() {
            0 => comm.all_reduce_slice(&mut [0f32; 4], ReduceOp::Sum),
            1 => comm.all_reduce_slice(&mut [0f64; 4], ReduceOp::Sum),
            _ => comm.all_reduce_slice(&mut [0f32; 5], ReduceOp::Sum),
        }
    });
    for err in &errors {
        let calls = mismatch_calls(err);
        let described: Vec<_> = calls.iter().map(|c| (c.rank, c.dtype, c.count)).collect();
        assert_eq!(
            described,
            vec![
                (0, Some(DType::F32), 4),
                (1, Some(DType::F64), 4),
                (2, Some(DType::F32), 5)
            ]
        );
    }

    let errors = errors_of(2, |comm| {
        comm.barrier()?;
        comm.broadcast_slice(&mut [0i64; 2], comm.rank())
    });
    for err in &errors {
        let roots: Vec<_> = mismatch_calls(err).iter().map(|c| c.root).collect();
        assert_eq!(roots, vec![Some(0), Some(1)]);
    }
}

#[test]
fn a_group_stays_usable_after_a_mismatch() {
    let sums = run_local(2, |comm| {
        let wrong = comm.all_reduce_slice(&mut vec![1u8; 1 + comm.rank()], ReduceOp::Sum);
        assert!(matches!(wrong, Err(Error::Mismatch { seq: 0, .. })));
        let mut x = [comm.rank() as i32 + 1];
        comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
        Ok::<_, Error>(x[0])
    })
    .unwrap();
    assert_eq!(sums, vec![3, 3]);
}

#[test]
fn a_panicking_rank_makes_peers_fail_with_peer_lost() {
    let start = Instant::now();
    let outcomes = LocalLauncher::new(3).unwrap().run_each(|comm| {
        if comm.rank() == 2 {
            panic!("boom in rank 2");
        }
        comm.all_reduce_slice(&mut [1.0f32; 1 << 16], ReduceOp::Sum)
    });
    assert!(start.elapsed() < PROMPT);
    for outcome in &outcomes[..2] {
        match outcome {
            Err((_, Error::RankFailed { source, .. })) => match source.downcast_ref::<Error>() {
                Some(Error::PeerLost {
                    rank: 2,
                    world_rank: 2,
                    op: OpKind::AllReduce,
                    seq: 0,
                    group,
                    ..
                }) => assert_eq!(group, "world"),
                other => panic!("expected PeerLost from rank 2, got {other:?}"),
            },
            _ => panic!("expected failure"),
        }
    }
    // The launcher reports the root cause, not its consequences.
    let err = run_local(3, |comm| {
        if comm.rank() == 2 {
            panic!("boom in rank 2");
        }
        comm.barrier()
    })
    .unwrap_err();
    match err {
        Error::RankFailed {
            rank: 2, source, ..
        } => {
            assert!(source.to_string().contains("boom in rank 2"))
        }
        other => panic!("expected rank 2's panic, got {other}"),
    }
}

#[test]
fn the_root_cause_is_found_whatever_error_type_peers_wrap_their_loss_in() {
    // Rank 2 leaves first and fails only later, so its peers' failures happen first; they
    // also hide the PeerLost inside a foreign error type. The launcher must still blame 2.
    let err = run_local(
        3,
        |comm| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
            if comm.rank() == 2 {
                drop(comm);
                std::thread::sleep(Duration::from_millis(50));
                return Err("rank 2's own failure".into());
            }
            comm.barrier()
                .map_err(|e| format!("wrapped by the application: {e}").into())
        },
    )
    .unwrap_err();
    match err {
        Error::RankFailed {
            rank: 2, source, ..
        } => {
            assert!(source.to_string().contains("rank 2's own failure"))
        }
        other => panic!("expected rank 2 as the root cause, got {other}"),
    }
}

#[test]
fn ranks_that_finish_and_leave_are_not_mistaken_for_lost_peers() {
    // Each rank leaves (dropping its communicator) right after its last collective while
    // slower ranks may still be waiting in it; that is a normal finish, not a lost peer.
    for round in 0..200 {
        run_local(8, |comm| {
            if comm.rank() == round % 8 {
                std::thread::yield_now();
            }
            comm.all_gather_vec(&[comm.rank() as u8]).map(drop)
        })
        .unwrap_or_else(|e| panic!("round {round}: {e}"));
    }
}

#[test]
fn a_rank_that_returns_early_is_a_lost_peer() {
    let start = Instant::now();
    let err = run_local(2, |comm| {
        if comm.rank() == 1 {
            return Ok(());
        }
        comm.barrier()?;
        comm.all_reduce_slice(&mut [0.0f64; 3], ReduceOp::Max)
    })
    .unwrap_err();
    assert!(start.elapsed() < PROMPT);
    assert!(
        matches!(err.root_cause(), Error::PeerLost { rank: 1, .. }),
        "{err}"
    );
}

/// The review's example end to end: rank 0 hands a clone of its communicator to a thread
/// that runs a large all-reduce, and returns an error before that thread even starts.
/// The clone can still take part, so rank 1 waits for it instead of calling it lost and
/// returning while the clone uses (and writes into) rank 1's buffer.
#[test]
fn a_clone_of_a_failed_ranks_communicator_still_takes_part_in_its_calls() {
    const LEN: usize = 1 << 15; // 128 KiB of f32: the direct path
    let clone_result = std::sync::Mutex::new(None);
    let outcomes = std::thread::scope(|scope| {
        LocalLauncher::new(2).unwrap().run_each(|comm| {
            if comm.rank() == 1 {
                let mut x = vec![1.0f32; LEN];
                comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
                return Ok(x);
            }
            let clone = std::sync::Arc::new(comm);
            let result = &clone_result;
            scope.spawn(move || {
                // Late enough that rank 0's closure has long returned.
                std::thread::sleep(Duration::from_millis(50));
                let mut x = vec![2.0f32; LEN];
                let outcome = clone.all_reduce_slice(&mut x, ReduceOp::Sum).map(|()| x);
                *result.lock().unwrap() = Some(outcome);
            });
            Err(Error::Config("rank 0 gives up".into()))
        })
    });
    let clone = clone_result.into_inner().unwrap().expect("the clone ran");
    let rank1 = outcomes[1].as_ref().map_err(|(_, e)| e.to_string());
    for (who, result) in [
        ("rank 1", rank1),
        ("the clone", clone.as_ref().map_err(|e| e.to_string())),
    ] {
        let x = result.unwrap_or_else(|e| panic!("{who}: {e}"));
        assert!(x.iter().all(|&v| v == 3.0), "{who} got a wrong sum");
    }
    assert!(matches!(
        &outcomes[0],
        Err((_, Error::RankFailed { rank: 0, .. }))
    ));
}

/// A clone keeps a failed rank alive only until it is dropped; then peers fail promptly.
#[test]
fn dropping_the_last_clone_of_a_failed_ranks_communicator_releases_its_peers() {
    let hold = Duration::from_millis(100);
    let start = Instant::now();
    let rank1_failed_after = std::sync::OnceLock::new();
    let err = std::thread::scope(|scope| {
        run_local(2, |comm| {
            if comm.rank() == 1 {
                let result = comm.barrier();
                rank1_failed_after.get_or_init(|| start.elapsed());
                return result;
            }
            scope.spawn(move || {
                std::thread::sleep(hold);
                drop(comm);
            });
            Err(Error::Config("rank 0 gives up".into()))
        })
    })
    .unwrap_err();
    let waited = *rank1_failed_after.get().expect("rank 1 ran");
    assert!(
        waited >= hold,
        "rank 1 gave up on a live clone after {waited:?}"
    );
    assert!(
        waited < PROMPT,
        "rank 1 noticed the drop only after {waited:?}"
    );
    assert!(matches!(err, Error::RankFailed { rank: 0, .. }), "{err}");
}

#[test]
fn a_rank_that_errors_out_releases_its_peers() {
    let err = run_local(4, |comm| {
        if comm.rank() == 3 {
            return Err(Error::Config("rank 3 could not load its data".into()));
        }
        comm.barrier()
    })
    .unwrap_err();
    match err {
        Error::RankFailed {
            rank: 3, source, ..
        } => {
            assert!(source.to_string().contains("could not load"))
        }
        other => panic!("expected rank 3's own error, got {other}"),
    }
}

#[test]
fn a_short_timeout_names_the_ranks_that_never_arrived() {
    let timeout = Duration::from_millis(150);
    let outcomes = LocalLauncher::new(3)
        .unwrap()
        .timeout(timeout)
        .run_each(|comm| {
            if comm.rank() == 2 {
                // Alive but busy elsewhere: not a lost peer, so only the timeout fires.
                std::thread::sleep(Duration::from_millis(600));
                return comm.barrier();
            }
            comm.barrier()
        });
    for (rank, outcome) in outcomes.iter().enumerate() {
        let Err((_, Error::RankFailed { source, .. })) = outcome else {
            panic!("rank {rank} should have failed")
        };
        let err = source.downcast_ref::<Error>().unwrap();
        if rank < 2 {
            match err {
                Error::Timeout {
                    op: OpKind::Barrier,
                    seq: 0,
                    missing,
                    missing_world,
                    waited,
                    ..
                } => {
                    assert_eq!(missing, &vec![2]);
                    assert_eq!(missing_world, &vec![2]);
                    assert!(*waited >= timeout);
                }
                other => panic!("expected Timeout, got {other}"),
            }
        } else {
            // The late rank finds the group broken instead of hanging on it.
            assert!(matches!(err, Error::Broken { .. }), "{err}");
        }
    }
}

#[test]
fn wrong_buffer_sizes_are_rejected_before_communicating() {
    let errors = errors_of(2, |comm| {
        let mut out = vec![0f32; 3]; // must be 2 × 2
        comm.all_gather(
            ferrotron_comm_core::BufRef::from(&[1f32, 2.0][..]),
            ferrotron_comm_core::BufMut::from(&mut out),
        )
    });
    for err in errors {
        match err {
            Error::InvalidBuffer {
                op: OpKind::AllGather,
                detail,
                ..
            } => assert!(detail.contains("2 × 2 = 4"), "{detail}"),
            other => panic!("expected InvalidBuffer, got {other}"),
        }
    }
    let errors = errors_of(2, |comm| {
        comm.reduce_scatter_vec(&[1i32; 5], ReduceOp::Sum).map(drop)
    });
    assert!(errors.iter().all(|e| matches!(
        e,
        Error::InvalidBuffer {
            op: OpKind::ReduceScatter,
            ..
        }
    )));
    let errors = errors_of(2, |comm| comm.all_gather_v_vec(&[1u8], &[1]).map(drop));
    assert!(errors.iter().all(|e| matches!(
        e,
        Error::InvalidArgument {
            op: OpKind::AllGatherV,
            ..
        }
    )));
    let errors = errors_of(2, |comm| comm.broadcast_slice(&mut [1u8], 7));
    assert!(errors.iter().all(|e| matches!(
        e,
        Error::InvalidArgument {
            op: OpKind::Broadcast,
            ..
        }
    )));
}

#[test]
fn averaging_integers_is_rejected() {
    let errors = errors_of(2, |comm| comm.all_reduce_slice(&mut [1i64], ReduceOp::Avg));
    for err in errors {
        assert!(matches!(
            err,
            Error::Unsupported {
                reduce: ReduceOp::Avg,
                dtype: DType::I64,
                ..
            }
        ));
    }
}

/// The sender fails too: it would otherwise go on as if its message had been used.
#[test]
fn a_receive_that_does_not_match_the_message_is_a_mismatch_on_both_ranks() {
    let errors = errors_of(2, |comm| {
        if comm.rank() == 0 {
            comm.send_slice(&[1.0f32, 2.0], 1)
        } else {
            comm.recv_slice(&mut [0.0f32; 3], 0)
        }
    });
    for (rank, err) in errors.iter().enumerate() {
        match err {
            Error::Mismatch { calls, .. } => {
                assert_eq!(
                    (calls[0].rank, calls[0].op, calls[0].count),
                    (0, OpKind::Send, 2)
                );
                assert_eq!(
                    (calls[1].rank, calls[1].op, calls[1].count),
                    (1, OpKind::Recv, 3)
                );
            }
            other => panic!("rank {rank}: expected Mismatch, got {other}"),
        }
    }
}

#[test]
fn two_ranks_sending_first_time_out_instead_of_hanging() {
    // Whichever rank times out first exits; the other may then see it as lost. The
    // launcher reports the root cause: a send that timed out waiting for its peer.
    let err = LocalLauncher::new(2)
        .unwrap()
        .timeout(Duration::from_millis(100))
        .run(|comm| {
            comm.send_slice(&[1u8], 1 - comm.rank())?;
            comm.recv_slice(&mut [0u8], 1 - comm.rank())
        })
        .unwrap_err();
    let Error::RankFailed { rank, .. } = &err else {
        panic!("expected a rank failure, got {err}")
    };
    match err.root_cause() {
        Error::Timeout {
            op: OpKind::Send,
            missing,
            ..
        } => assert_eq!(missing, &vec![1 - rank]),
        other => panic!("expected a send timeout, got {other}"),
    }
}

#[test]
fn a_receive_after_its_send_timed_out_fails_instead_of_taking_the_message() {
    // The timed-out send broke the group; its message must not surface as a success.
    let send_failed = AtomicBool::new(false);
    let outcomes = LocalLauncher::new(2)
        .unwrap()
        .timeout(Duration::from_millis(50))
        .run_each(|comm| {
            if comm.rank() == 0 {
                let sent = comm.send_slice(&[7u8], 1);
                send_failed.store(true, Ordering::SeqCst);
                sent
            } else {
                while !send_failed.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                comm.recv_slice(&mut [0u8], 0)
            }
        });
    let errors: Vec<Error> = outcomes
        .into_iter()
        .map(|r| r.expect_err("both ranks must fail").1)
        .collect();
    let (sender, receiver) = (errors[0].root_cause(), errors[1].root_cause());
    assert!(
        matches!(
            sender,
            Error::Timeout {
                op: OpKind::Send,
                ..
            }
        ),
        "{sender}"
    );
    assert!(matches!(receiver, Error::Broken { .. }), "{receiver}");
}

#[test]
fn sending_to_oneself_is_rejected() {
    let errors = errors_of(2, |comm| comm.send_slice(&[1u8], comm.rank()));
    for err in errors {
        match err {
            Error::InvalidArgument {
                op: OpKind::Send,
                detail,
                ..
            } => assert!(detail.contains("this rank"), "{detail}"),
            other => panic!("expected InvalidArgument, got {other}"),
        }
    }
}

#[test]
fn zero_ranks_is_a_configuration_error() {
    assert!(matches!(LocalLauncher::new(0), Err(Error::Config(_))));
}
