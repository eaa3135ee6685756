//! Point-to-point transfers on the local backend, batched (`exchange`) and started
//! (`isend`/`irecv`): neighbours that both send first complete, messages keep their
//! order, and a receive that does not match its message fails both ranks of that pair
//! and nobody else, promptly.

use ferrotron_comm_core::{
    run_local, Buffer, Communicator, CommunicatorExt, DType, Error, LocalLauncher, OpKind, P2p,
};
use std::time::{Duration, Instant};

/// Every rank sends to its right neighbour and receives from its left, listing its send
/// first: with blocking rendezvous sends that order deadlocks; an exchange must not.
#[test]
fn a_ring_where_everyone_sends_first_completes() {
    // 1 KiB and 1 MiB per message: below and above the local backend's staging size.
    for len in [256usize, 1 << 18] {
        for n in [2usize, 3, 4] {
            let received = run_local(n, |comm| -> anyhow::Result<Vec<f32>> {
                let (r, n) = (comm.rank(), comm.size());
                let mine: Vec<f32> = (0..len).map(|i| (r * len + i) as f32).collect();
                let mut from_left = vec![0f32; len];
                comm.exchange(&mut [
                    P2p::Send {
                        buf: (&mine).into(),
                        peer: (r + 1) % n,
                    },
                    P2p::Recv {
                        buf: (&mut from_left).into(),
                        peer: (r + n - 1) % n,
                    },
                ])?;
                Ok(from_left)
            })
            .unwrap();
            for (r, got) in received.iter().enumerate() {
                let left = (r + n - 1) % n;
                let expected: Vec<f32> = (0..len).map(|i| (left * len + i) as f32).collect();
                assert_eq!(got, &expected, "rank {r} of {n}, {len} elements");
            }
        }
    }
}

/// Two messages to the same peer in one batch, then a plain send in the same direction:
/// they arrive in the order they were sent, into receives listed in that order.
#[test]
fn messages_between_a_pair_keep_their_order() {
    run_local(2, |comm| -> anyhow::Result<()> {
        let other = 1 - comm.rank();
        let (first, second) = ([comm.rank() as i64; 3], [10 + comm.rank() as i64; 5]);
        let (mut got_first, mut got_second) = ([0i64; 3], [0i64; 5]);
        comm.exchange(&mut [
            P2p::Recv {
                buf: (&mut got_first[..]).into(),
                peer: other,
            },
            P2p::Send {
                buf: (&first[..]).into(),
                peer: other,
            },
            P2p::Send {
                buf: (&second[..]).into(),
                peer: other,
            },
            P2p::Recv {
                buf: (&mut got_second[..]).into(),
                peer: other,
            },
        ])?;
        assert_eq!(got_first, [other as i64; 3]);
        assert_eq!(got_second, [10 + other as i64; 5]);
        // A plain send after the batch comes after its messages.
        if comm.rank() == 0 {
            comm.send_slice(&[7u8], 1)?;
        } else {
            let mut x = [0u8];
            comm.recv_slice(&mut x, 0)?;
            assert_eq!(x, [7]);
        }
        Ok(())
    })
    .unwrap();
}

/// Batches need not mirror each other: a send in one batch meets its receive in
/// another.
#[test]
fn a_send_meets_its_receive_in_another_batch() {
    run_local(2, |comm| -> anyhow::Result<()> {
        if comm.rank() == 0 {
            comm.exchange(&mut [P2p::Send {
                buf: (&[7i32; 2][..]).into(),
                peer: 1,
            }])?;
            let mut back = [0i32; 3];
            comm.exchange(&mut [P2p::Recv {
                buf: (&mut back[..]).into(),
                peer: 1,
            }])?;
            assert_eq!(back, [9; 3]);
        } else {
            let mut got = [0i32; 2];
            comm.exchange(&mut [
                P2p::Recv {
                    buf: (&mut got[..]).into(),
                    peer: 0,
                },
                P2p::Send {
                    buf: (&[9i32; 3][..]).into(),
                    peer: 0,
                },
            ])?;
            assert_eq!(got, [7; 2]);
        }
        Ok(())
    })
    .unwrap();
}

/// Ranks 0 and 1 disagree on a message's length, ranks 2 and 3 agree: the first pair
/// both get `Mismatch` naming the sender's send and the receiver's receive, within
/// seconds, and the second pair's exchange succeeds with the right numbers.
#[test]
fn a_mismatched_pair_fails_on_both_sides_and_only_there() {
    let started = Instant::now();
    let outcomes = LocalLauncher::new(4)
        .unwrap()
        .timeout(Duration::from_secs(60))
        .run_each(|comm| {
            let r = comm.rank();
            let partner = r ^ 1;
            let sent = [r as f32; 4];
            // Rank 1 expects five elements from rank 0.
            let mut got = vec![0f32; if r == 1 { 5 } else { 4 }];
            comm.exchange(&mut [
                P2p::Send {
                    buf: (&sent[..]).into(),
                    peer: partner,
                },
                P2p::Recv {
                    buf: (&mut got).into(),
                    peer: partner,
                },
            ])
            .map(|()| got)
        });
    assert!(started.elapsed() < Duration::from_secs(10));
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        match (rank, outcome) {
            (0 | 1, Err((_, Error::RankFailed { source, .. }))) => {
                let err = source.downcast::<Error>().unwrap();
                let Error::Mismatch { calls, .. } = *err else {
                    panic!("rank {rank}: expected Mismatch, got {err}")
                };
                assert_eq!(calls.len(), 2, "{calls:?}");
                let (send, recv) = (&calls[0], &calls[1]);
                assert_eq!((send.rank, send.op, send.count), (0, OpKind::Send, 4));
                assert_eq!((recv.rank, recv.op, recv.count), (1, OpKind::Recv, 5));
                assert_eq!(send.dtype, Some(DType::F32));
            }
            (2 | 3, Ok(got)) => assert_eq!(got, vec![(rank ^ 1) as f32; 4]),
            (rank, other) => panic!("rank {rank}: unexpected {:?}", other.map(|_| ())),
        }
    }
}

/// A peer outside the group, or this rank itself, is an argument error before anything
/// is sent.
#[test]
fn bad_peers_are_rejected_up_front() {
    run_local(2, |comm| -> anyhow::Result<()> {
        let mut x = [0f32; 2];
        for peer in [2, comm.rank()] {
            let err = comm
                .exchange(&mut [P2p::Recv {
                    buf: (&mut x[..]).into(),
                    peer,
                }])
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidArgument {
                        op: OpKind::Recv,
                        ..
                    }
                ),
                "{err}"
            );
        }
        // The group is still usable.
        comm.barrier()?;
        Ok(())
    })
    .unwrap();
}

/// Non-blocking sends and receives: both neighbours start a send before their receive
/// and complete; receives from one source take messages in start order whichever is
/// waited on first, before a later blocking `recv`.
#[test]
fn isend_and_irecv_complete_in_any_wait_order() {
    // A wrong match would hang until the timeout: keep it short.
    let launcher = LocalLauncher::new(2)
        .unwrap()
        .timeout(Duration::from_secs(20));
    launcher
        .run(|comm| -> anyhow::Result<()> {
            let (r, other) = (comm.rank(), 1 - comm.rank());
            let big: Vec<f32> = (0..100_000).map(|i| (i + r) as f32).collect();
            let send = comm.isend((&big).into(), other)?;
            let first = comm.irecv(Buffer::zeros(DType::F32, big.len()), other)?;
            let small = comm.isend((&[r as i64; 3][..]).into(), other)?;
            let second = comm.irecv(Buffer::zeros(DType::I64, 3), other)?;
            // Waited in reverse: the second receive still gets the second message.
            let second = second.wait()?.expect("a buffer").into_vec::<i64>()?;
            assert_eq!(second, vec![other as i64; 3]);
            let first = first.wait()?.expect("a buffer").into_vec::<f32>()?;
            assert_eq!(first[1], (1 + other) as f32);
            assert!(send.wait()?.is_none() && small.wait()?.is_none());
            // A started receive is matched while its rank blocks elsewhere: both ranks start
            // one, then both send, which rendezvous sends could not do without it.
            let third = comm.irecv(Buffer::zeros(DType::U8, 1), other)?;
            comm.send_slice(&[r as u8 + 10], other)?;
            let third = third.wait()?.expect("a buffer").into_vec::<u8>()?;
            assert_eq!(third, vec![other as u8 + 10]);
            // A blocking receive takes messages after the started ones.
            let fourth = comm.irecv(Buffer::zeros(DType::U8, 2), other)?;
            let fifth = comm.isend((&[r as u8 + 20, r as u8 + 30][..]).into(), other)?;
            let sixth = comm.isend((&[r as u8 + 40][..]).into(), other)?;
            let mut last = [0u8];
            comm.recv_slice(&mut last, other)?;
            assert_eq!(last, [other as u8 + 40]);
            let fourth = fourth.wait()?.expect("a buffer").into_vec::<u8>()?;
            assert_eq!(fourth, vec![other as u8 + 20, other as u8 + 30]);
            fifth.wait()?;
            sixth.wait()?;
            Ok(())
        })
        .unwrap();
}

/// A started receive whose buffer does not match fails, and so does the sender's wait;
/// a handle dropped unwaited still completes its transfer.
#[test]
fn started_transfers_report_mismatches_and_complete_when_dropped() {
    let outcomes = LocalLauncher::new(2).unwrap().run_each(|comm| {
        if comm.rank() == 0 {
            drop(comm.isend((&[1i32; 2][..]).into(), 1)?);
            comm.isend((&[2i32; 4][..]).into(), 1)?.wait().map(drop)
        } else {
            let dropped = comm.irecv(Buffer::zeros(DType::I32, 2), 0)?;
            drop(dropped);
            comm.irecv(Buffer::zeros(DType::I32, 3), 0)?
                .wait()
                .map(drop)
        }
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let Err((_, Error::RankFailed { source, .. })) = outcome else {
            panic!("rank {rank}: expected a failure")
        };
        let err = source.downcast::<Error>().unwrap();
        assert!(matches!(*err, Error::Mismatch { .. }), "rank {rank}: {err}");
        assert!(err.to_string().contains("count=4") && err.to_string().contains("count=3"));
    }
}

/// An abandoned receive is withdrawn: the peer's next message is not matched to it (and
/// dropped, its sender told it was delivered) but waits for the rank's next receive.
#[test]
fn an_abandoned_receive_leaves_the_next_message_to_the_next_receive() {
    let launcher = LocalLauncher::new(2)
        .unwrap()
        .timeout(Duration::from_secs(10));
    let received = launcher
        .run(|comm| -> anyhow::Result<Vec<i32>> {
            if comm.rank() == 1 {
                comm.irecv(Buffer::zeros(DType::I32, 2), 0)?.abandon();
                comm.barrier()?;
                let mut next = [0i32; 2];
                comm.recv((&mut next[..]).into(), 0)?;
                Ok(next.to_vec())
            } else {
                comm.barrier()?;
                comm.send((&[5i32, 6][..]).into(), 1)?;
                Ok(Vec::new())
            }
        })
        .unwrap();
    assert_eq!(received[1], [5, 6]);
}
