//! The flight recorder: a timeout or a lost peer says which rank stopped where.

use ferrotron_comm_core::{
    CallRecord, CallState, Communicator, CommunicatorExt, DType, Error, FlightRecord,
    LocalLauncher, OpKind, ReduceOp,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The comm-core error of every rank (each must have failed).
fn errors(outcomes: Vec<Result<(), (u64, Error)>>) -> Vec<Error> {
    outcomes
        .into_iter()
        .enumerate()
        .map(|(rank, outcome)| match outcome {
            Err((_, Error::RankFailed { source, .. })) => match source.downcast::<Error>() {
                Ok(err) => *err,
                Err(other) => panic!("rank {rank} failed with a foreign error: {other}"),
            },
            other => panic!("rank {rank} should have failed, got {other:?}"),
        })
        .collect()
}

fn last(history: &FlightRecord, rank: usize) -> CallRecord {
    *history
        .rank(rank)
        .unwrap_or_else(|| panic!("no history for rank {rank}: {history:?}"))
        .last()
        .unwrap_or_else(|| panic!("rank {rank} recorded no call: {history:?}"))
}

fn is_all_reduce(call: &CallRecord, seq: u64) -> bool {
    call.op == OpKind::AllReduce
        && call.seq == seq
        && call.dtype == Some(DType::F32)
        && call.count == 4
        && call.reduce == Some(ReduceOp::Sum)
}

/// Rank 2 of 3 does two all-reduces and then is busy elsewhere: its peers' third
/// all-reduce times out, and their errors show each rank's last calls.
#[test]
fn a_timeout_shows_the_rank_that_stopped_two_calls_early() {
    let peers_done = AtomicUsize::new(0);
    let outcomes = LocalLauncher::new(3)
        .unwrap()
        .timeout(Duration::from_millis(100))
        .run_each(|comm| {
            let mut x = [1.0f32; 4];
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            if comm.rank() == 2 {
                // Alive (not a lost peer) but never at the third call, until its peers
                // have given up on it.
                let deadline = Instant::now() + Duration::from_secs(10);
                while peers_done.load(Ordering::SeqCst) < 2 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                return Err(Error::Config("rank 2 stopped calling collectives".into()));
            }
            let third = comm.all_reduce_slice(&mut x, ReduceOp::Sum);
            peers_done.fetch_add(1, Ordering::SeqCst);
            third
        });
    let errors = errors(outcomes);
    for (rank, err) in errors.iter().enumerate().take(2) {
        let Error::Timeout {
            seq: 2,
            missing,
            history,
            ..
        } = err
        else {
            panic!("rank {rank}: expected a timeout of call #2, got {err}")
        };
        assert_eq!(missing, &vec![2]);
        assert_eq!(history.ranks.len(), 3, "{history:?}");
        // The waiting ranks are in their third call: this rank still waits in it; its
        // peer waits too, or has just timed out.
        let own = last(history, rank);
        assert!(is_all_reduce(&own, 2), "{own:?}");
        assert_eq!(own.state, CallState::Started);
        let peer = last(history, 1 - rank);
        assert!(is_all_reduce(&peer, 2), "{peer:?}");
        assert!(peer.state != CallState::Completed, "{peer:?}");
        // Rank 2 completed two all-reduces and nothing after.
        let stopped = &history.rank(2).unwrap().calls;
        assert_eq!(stopped.len(), 2, "{stopped:?}");
        for (seq, call) in stopped.iter().enumerate() {
            assert!(is_all_reduce(call, seq as u64), "{call:?}");
            assert_eq!(call.state, CallState::Completed);
        }
        assert_eq!(history.rank(2).unwrap().world_rank, 2);

        // The message summarises each rank's last call; rank 2 stands out.
        let message = err.to_string();
        assert!(
            message.contains("rank 2: all_reduce #1 (f32 × 4, sum): completed"),
            "{message}"
        );
        assert!(
            message.contains("all_reduce #2 (f32 × 4, sum): started"),
            "{message}"
        );
        // The full record: one line per rank.
        let full = history.to_string();
        assert_eq!(full.lines().count(), 3, "{full}");
        assert_eq!(
            full.lines().nth(2).unwrap(),
            "rank 2 (world rank 2), last 2 call(s): all_reduce #0 (f32 × 4, sum), \
             all_reduce #1 (f32 × 4, sum): completed",
            "{full}"
        );
    }
}

/// A rank that fails makes its peers' call fail with `PeerLost`, which carries every
/// rank's history, the lost rank's included.
#[test]
fn a_lost_peer_error_carries_every_ranks_history() {
    let outcomes = LocalLauncher::new(3)
        .unwrap()
        .timeout(Duration::from_secs(10))
        .run_each(|comm| {
            let mut x = [1.0f32; 4];
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            if comm.rank() == 2 {
                return Err(Error::Config("rank 2 gives up".into()));
            }
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)
        });
    let errors = errors(outcomes);
    for (rank, err) in errors.iter().enumerate().take(2) {
        let Error::PeerLost {
            rank: 2,
            seq: 1,
            history,
            ..
        } = err
        else {
            panic!("rank {rank}: expected rank 2 lost in call #1, got {err}")
        };
        let lost = &history.rank(2).unwrap().calls;
        assert_eq!(lost.len(), 1, "{lost:?}");
        assert!(is_all_reduce(&lost[0], 0) && lost[0].state == CallState::Completed);
        // This rank waits in call #1; its peer may not have left call #0 yet.
        let own = last(history, rank);
        assert!(is_all_reduce(&own, 1), "{own:?}");
        assert_eq!(own.state, CallState::Started);
        let peer = last(history, 1 - rank);
        assert!(
            is_all_reduce(&peer, 0) || is_all_reduce(&peer, 1),
            "{peer:?}"
        );
        // Ranks whose last calls match share a line ("ranks 0, 2: ..."), which depends
        // on how far rank 0 got: look for rank 2 in the list before the call.
        let message = err.to_string();
        let names_rank_2 = |line: &str| {
            let ranks = line.trim_start().split(": ").next().unwrap_or("");
            ranks
                .trim_start_matches("ranks ")
                .trim_start_matches("rank ")
                .split(", ")
                .any(|r| r == "2")
        };
        assert!(
            message.lines().any(|line| names_rank_2(line)
                && line.ends_with(": all_reduce #0 (f32 × 4, sum): completed")),
            "{message}"
        );
    }
}

/// With the recorder off, errors carry no history and say nothing about it.
#[test]
fn a_disabled_recorder_attaches_no_history() {
    let outcomes = LocalLauncher::new(2)
        .unwrap()
        .flight_recorder(0)
        .run_each(|comm| {
            let mut x = [1.0f32; 4];
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)?;
            assert!(comm.flight_record().is_empty());
            if comm.rank() == 1 {
                return Err(Error::Config("rank 1 gives up".into()));
            }
            comm.all_reduce_slice(&mut x, ReduceOp::Sum)
        });
    let errors = errors(outcomes);
    let Error::PeerLost { history, .. } = &errors[0] else {
        panic!("expected PeerLost, got {}", errors[0])
    };
    assert!(history.is_empty(), "{history:?}");
    assert!(
        !errors[0].to_string().contains("flight recorder"),
        "{}",
        errors[0]
    );
}

/// The ring keeps the last N calls, oldest first, each with its arguments and state, and
/// sub-groups keep their own.
#[test]
fn the_ring_keeps_only_the_last_n_calls() {
    let records = LocalLauncher::new(2)
        .unwrap()
        .flight_recorder(4)
        .run(|comm| {
            let mut x = [0i64; 3];
            for _ in 0..6 {
                comm.all_reduce_slice(&mut x, ReduceOp::Max)?;
            }
            comm.broadcast_slice(&mut x, 1)?;
            let peer = 1 - comm.rank();
            if comm.rank() == 0 {
                comm.send_slice(&[1u8; 5], peer)?;
            } else {
                comm.recv_slice(&mut [0u8; 5], peer)?;
            }
            comm.barrier()?;
            let alone = comm.split(Some(comm.rank() as u32), 0, "alone")?.unwrap();
            alone.all_gather_vec(&[1.5f64])?;
            // A one-rank all-reduce and broadcast move nothing, and are recorded too.
            alone.all_reduce_slice(&mut [1i32; 2], ReduceOp::Sum)?;
            alone.broadcast_slice(&mut [1i32; 2], 0)?;
            Ok::<_, Error>((comm.flight_record(), alone.flight_record()))
        })
        .unwrap();
    for (rank, (world, alone)) in records.iter().enumerate() {
        assert_eq!(world.ranks.len(), 2);
        let mine = &world.rank(rank).unwrap().calls;
        let seqs: Vec<(OpKind, u64)> = mine.iter().map(|c| (c.op, c.seq)).collect();
        let message = if rank == 0 {
            OpKind::Send
        } else {
            OpKind::Recv
        };
        assert_eq!(
            seqs,
            [
                (OpKind::Broadcast, 6),
                (message, 0),
                (OpKind::Barrier, 7),
                (OpKind::Split, 8),
            ],
            "{world}"
        );
        assert!(
            mine.iter().all(|c| c.state == CallState::Completed),
            "{world}"
        );
        assert_eq!(mine[0].root, Some(1));
        assert_eq!((mine[0].dtype, mine[0].count), (Some(DType::I64), 3));
        assert_eq!(mine[1].peer, Some(1 - rank));
        assert_eq!((mine[1].dtype, mine[1].count), (Some(DType::U8), 5));
        // The sub-group has its own recorder: one rank, its three calls.
        assert_eq!(alone.ranks.len(), 1);
        assert_eq!(alone.ranks[0].world_rank, rank);
        let calls = &alone.ranks[0].calls;
        let seqs: Vec<(OpKind, u64)> = calls.iter().map(|c| (c.op, c.seq)).collect();
        assert_eq!(
            seqs,
            [
                (OpKind::AllGather, 0),
                (OpKind::AllReduce, 1),
                (OpKind::Broadcast, 2)
            ],
            "{alone}"
        );
        assert_eq!(calls[0].dtype, Some(DType::F64));
        assert!(calls.iter().all(|c| c.state == CallState::Completed));
    }
}

/// A call that fails records `failed`; the next call goes on recording.
#[test]
fn a_failed_call_is_recorded_as_failed() {
    let records = LocalLauncher::new(2)
        .unwrap()
        .run(|comm| {
            // Rank 1 passes a longer buffer: a mismatch on both ranks.
            let mut x = vec![0.0f32; 2 + comm.rank()];
            let mismatch = comm.all_reduce_slice(&mut x, ReduceOp::Sum);
            assert!(
                matches!(mismatch, Err(Error::Mismatch { .. })),
                "{mismatch:?}"
            );
            Ok::<_, Error>(comm.flight_record())
        })
        .unwrap();
    for (rank, record) in records.iter().enumerate() {
        let call = last(record, rank);
        assert_eq!(
            (call.op, call.seq, call.count),
            (OpKind::AllReduce, 0, 2 + rank)
        );
        assert_eq!(call.state, CallState::Failed);
    }
}
