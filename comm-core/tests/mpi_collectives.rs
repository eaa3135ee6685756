//! The collective suite over the MPI backend as users get it: `MpiWorld::init()` with no
//! environment variable, so the cross-rank signature check runs by default. Run it as
//! `mpirun -n 4 target/debug/deps/mpi_collectives-*`; `cargo test` runs it as a single
//! rank. Every rank runs the same deterministic cases; rank 0 prints the summary.

mod support;

use anyhow::{ensure, Context};
use ferrotron_comm_core::mpi::{MpiWorld, CHECK_ENV};
use ferrotron_comm_core::{
    AsyncOp, Buffer, CallSignature, Communicator, CommunicatorExt, DType, Element, Error, OpKind,
    P2p, ReduceOp,
};
use support::{data, offsets, reduced};

fn collectives<T: Element>(
    comm: &dyn Communicator,
    op: ReduceOp,
    len: usize,
) -> anyhow::Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let mut buf = data::<T>(r, len, 0);
    comm.all_reduce_slice(&mut buf, op)?;
    let inputs: Vec<Vec<T>> = (0..n).map(|q| data(q, len, 0)).collect();
    ensure!(buf == reduced(op, &inputs), "all_reduce {op} differs");

    let root = len % n;
    let mut buf = if r == root {
        data::<T>(r, len, 1)
    } else {
        vec![T::default(); len]
    };
    comm.broadcast_slice(&mut buf, root)?;
    ensure!(buf == data::<T>(root, len, 1), "broadcast differs");

    let gathered = comm.all_gather_vec(&data::<T>(r, len, 2))?;
    ensure!(
        gathered
            == (0..n)
                .flat_map(|q| data::<T>(q, len, 2))
                .collect::<Vec<_>>()
    );

    let counts: Vec<usize> = (0..n).map(|q| (len + q * 3) % 11).collect();
    let gathered = comm.all_gather_v_vec(&data::<T>(r, counts[r], 3), &counts)?;
    let expect: Vec<T> = (0..n).flat_map(|q| data::<T>(q, counts[q], 3)).collect();
    ensure!(gathered == expect, "all_gather_v differs");

    let total: usize = counts.iter().sum();
    let inputs: Vec<Vec<T>> = (0..n).map(|q| data(q, total, 5)).collect();
    let mine = comm.reduce_scatter_v_vec(&inputs[r], &counts, op)?;
    let start = offsets(&counts)[r];
    ensure!(
        mine == reduced(op, &inputs)[start..start + counts[r]],
        "reduce_scatter_v differs"
    );

    let chunk = len.max(1);
    let inputs: Vec<Vec<T>> = (0..n).map(|q| data(q, chunk * n, 4)).collect();
    let mine = comm.reduce_scatter_vec(&inputs[r], op)?;
    ensure!(
        mine == reduced(op, &inputs)[r * chunk..(r + 1) * chunk],
        "reduce_scatter differs"
    );

    let matrix = |s: usize, d: usize| (s * 5 + d * 3 + len) % 7;
    let sends: Vec<usize> = (0..n).map(|d| matrix(r, d)).collect();
    let recvs: Vec<usize> = (0..n).map(|s| matrix(s, r)).collect();
    let out = comm.all_to_all_v_vec(&data::<T>(r, sends.iter().sum(), 6), &sends, &recvs)?;
    let expect: Vec<T> = (0..n)
        .flat_map(|s| {
            let their: Vec<usize> = (0..n).map(|d| matrix(s, d)).collect();
            let at = offsets(&their)[r];
            data::<T>(s, their.iter().sum(), 6)[at..at + their[r]].to_vec()
        })
        .collect();
    ensure!(out == expect, "all_to_all_v differs");

    if n > 1 {
        // Sends are rendezvous (MPI_Ssend), so even ranks send first around the ring.
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mut got = vec![T::default(); len];
        if r % 2 == 0 {
            comm.send_slice(&data::<T>(r, len, 7), next)?;
            comm.recv_slice(&mut got, prev)?;
        } else {
            comm.recv_slice(&mut got, prev)?;
            comm.send_slice(&data::<T>(r, len, 7), next)?;
        }
        ensure!(got == data::<T>(prev, len, 7), "send/recv differs");
    }
    Ok(())
}

fn split_and_async(world: &dyn Communicator) -> anyhow::Result<()> {
    let r = world.rank();
    let half = world
        .split(Some((r % 2) as u32), r as u32, "parity")?
        .context("member")?;
    let mut sum = [r as i64];
    half.all_reduce_slice(&mut sum, ReduceOp::Sum)?;
    let expect: usize = (0..world.size()).filter(|q| q % 2 == r % 2).sum();
    ensure!(sum[0] == expect as i64, "split group sum");
    ensure!(half.world_ranks().iter().all(|w| w % 2 == r % 2));
    ensure!(
        world.split(None, 0, "nobody")?.is_none(),
        "opt-out gets None"
    );

    let works: Vec<_> = (0..4)
        .map(|i| world.all_reduce_async(vec![i as f32 + r as f32; 1000 * i + 1], ReduceOp::Max))
        .collect::<Result<_, _>>()?;
    let gather = world.start(AsyncOp::AllGather {
        input: Buffer::from_vec(vec![r as u8]),
    })?;
    for (i, w) in works.into_iter().enumerate() {
        let v = w.wait()?.into_vec::<f32>()?;
        ensure!(
            v.iter().all(|&x| x == i as f32 + (world.size() - 1) as f32),
            "async {i}"
        );
    }
    let ranks: Vec<u8> = (0..world.size() as u8).collect();
    ensure!(gather.wait()?.into_vec::<u8>()? == ranks, "async gather");
    Ok(())
}

/// Runs one call that disagrees across ranks and checks that this rank got `Mismatch`
/// naming the group, a sequence number every rank agrees on, and every rank's own
/// arguments (`expect(sig)` for each rank's decoded signature); then that the group is
/// still usable.
fn expect_mismatch(
    world: &dyn Communicator,
    kind: &str,
    call: impl FnOnce() -> ferrotron_comm_core::Result<()>,
    expect: impl Fn(&CallSignature) -> bool,
) -> anyhow::Result<()> {
    let (group, seq, calls) = match call() {
        Err(Error::Mismatch { group, seq, calls }) => (group, seq, calls),
        other => anyhow::bail!("{kind}: expected Mismatch, got {other:?}"),
    };
    ensure!(group == "world", "{kind}: group {group:?}");
    ensure!(calls.len() == world.size(), "{kind}: {calls:?}");
    for (rank, sig) in calls.iter().enumerate() {
        ensure!(
            sig.rank == rank && expect(sig),
            "{kind}: rank {rank}'s call is {sig}"
        );
    }
    let seqs = world.all_gather_vec(&[seq as i64])?;
    ensure!(
        seqs.iter().all(|&s| s == seq as i64),
        "{kind}: ranks report calls {seqs:?}"
    );
    // The check leaves the communicator usable.
    let mut x = [1i32];
    world.all_reduce_slice(&mut x, ReduceOp::Sum)?;
    ensure!(
        x[0] == world.size() as i32,
        "{kind}: sum after the mismatch"
    );
    Ok(())
}

/// Each kind of disagreement (count, op, dtype, root) is `Mismatch` on every rank.
fn mismatch_is_detected(world: &dyn Communicator) -> anyhow::Result<()> {
    let (r, n) = (world.rank(), world.size());
    if n < 2 {
        return Ok(());
    }
    let last = n - 1;
    // Count: rank 1 passes a buffer too large to ride the check's exchange, the others
    // one small enough: the exchange has one size whatever the call, so it still pairs.
    let count = |rank: usize| if rank == 1 { 1000 } else { 4 };
    expect_mismatch(
        world,
        "count",
        || world.all_reduce_slice(&mut vec![0f32; count(r)], ReduceOp::Sum),
        |c| c.op == OpKind::AllReduce && c.count == count(c.rank),
    )?;
    // Op: the last rank calls a barrier while the others broadcast.
    expect_mismatch(
        world,
        "op",
        || {
            if r == last {
                world.barrier()
            } else {
                world.broadcast_slice(&mut [0i32; 3], 0)
            }
        },
        |c| {
            c.op == if c.rank == last {
                OpKind::Barrier
            } else {
                OpKind::Broadcast
            }
        },
    )?;
    // Dtype: odd ranks all-gather f64, even ranks f32, same element count.
    let dtype = |rank: usize| {
        if rank % 2 == 1 {
            DType::F64
        } else {
            DType::F32
        }
    };
    expect_mismatch(
        world,
        "dtype",
        || match dtype(r) {
            DType::F64 => world.all_gather_vec(&[r as f64; 3]).map(drop),
            _ => world.all_gather_vec(&[r as f32; 3]).map(drop),
        },
        |c| c.op == OpKind::AllGather && c.dtype == Some(dtype(c.rank)) && c.count == 3,
    )?;
    // Root: the last rank names itself as the root, the others rank 0.
    let root = |rank: usize| if rank == last { last } else { 0 };
    expect_mismatch(
        world,
        "root",
        || world.broadcast_slice(&mut [r as u8; 5], root(r)),
        |c| c.op == OpKind::Broadcast && c.root == Some(root(c.rank)),
    )?;
    Ok(())
}

/// A ring where every rank lists its send first (small and large messages, two per
/// pair so order shows), then a pair that disagrees on a length: `Mismatch` on the
/// receiver, every other transfer delivered, and the group usable afterwards.
fn exchanges(world: &dyn Communicator) -> anyhow::Result<()> {
    let (r, n) = (world.rank(), world.size());
    if n < 2 {
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for len in [3usize, 300_000] {
        let (a, b) = (data::<f32>(r, len, 1), data::<f32>(r, 2, 2));
        let (mut got_a, mut got_b) = (vec![0f32; len], vec![0f32; 2]);
        world.exchange(&mut [
            P2p::Send {
                buf: (&a).into(),
                peer: right,
            },
            P2p::Send {
                buf: (&b).into(),
                peer: right,
            },
            P2p::Recv {
                buf: (&mut got_a).into(),
                peer: left,
            },
            P2p::Recv {
                buf: (&mut got_b).into(),
                peer: left,
            },
        ])?;
        ensure!(
            got_a == data::<f32>(left, len, 1),
            "ring of {len}: first message"
        );
        ensure!(
            got_b == data::<f32>(left, 2, 2),
            "ring of {len}: second message"
        );
    }
    // Pairs (0, 1), (2, 3): rank 1 expects one element more than rank 0 sends.
    if r ^ 1 < n {
        let partner = r ^ 1;
        let sent = [r as i32; 4];
        let mut got = vec![0i32; if r == 1 { 5 } else { 4 }];
        let outcome = world.exchange(&mut [
            P2p::Send {
                buf: (&sent[..]).into(),
                peer: partner,
            },
            P2p::Recv {
                buf: (&mut got).into(),
                peer: partner,
            },
        ]);
        match (r, outcome) {
            // MPI tells the receiver, which still takes the message: the sender completes.
            (1, Err(Error::Mismatch { calls, .. })) => {
                ensure!(calls.len() == 2, "{calls:?}");
                ensure!((calls[0].rank, calls[0].op, calls[0].count) == (0, OpKind::Send, 4));
                ensure!((calls[1].rank, calls[1].op, calls[1].count) == (1, OpKind::Recv, 5));
            }
            (1, other) => anyhow::bail!("rank 1: expected Mismatch, got {other:?}"),
            (_, outcome) => {
                outcome?;
                ensure!(got == vec![partner as i32; 4], "pair of {r}: {got:?}");
            }
        }
    }
    // A send in one batch meets its receive in another: rank 0 sends, then receives, in
    // two batches; rank 1 does both in one.
    let mut back = [0i32; 3];
    match r {
        0 => {
            world.exchange(&mut [P2p::Send {
                buf: (&[7i32; 2][..]).into(),
                peer: 1,
            }])?;
            world.exchange(&mut [P2p::Recv {
                buf: (&mut back[..]).into(),
                peer: 1,
            }])?;
            ensure!(back == [9; 3], "across batches: {back:?}");
        }
        1 => {
            let mut got = [0i32; 2];
            world.exchange(&mut [
                P2p::Recv {
                    buf: (&mut got[..]).into(),
                    peer: 0,
                },
                P2p::Send {
                    buf: (&[9i32; 3][..]).into(),
                    peer: 0,
                },
            ])?;
            ensure!(got == [7; 2], "across batches: {got:?}");
        }
        _ => {}
    }
    // A plain receive of the wrong length fails on the receiver, which still takes the
    // message, so the sender's synchronous send returns instead of hanging.
    match r {
        0 => world.send_slice(&[1u8; 3], 1)?,
        1 => match world.recv_slice(&mut [0u8; 2], 0) {
            Err(Error::Mismatch { calls, .. }) => {
                ensure!(calls[0].count == 3 && calls[1].count == 2, "{calls:?}")
            }
            other => anyhow::bail!("a too-short receive: expected Mismatch, got {other:?}"),
        },
        _ => {}
    }
    let mut x = [1i32];
    world.all_reduce_slice(&mut x, ReduceOp::Sum)?;
    ensure!(x[0] == n as i32, "sum after the exchanges");
    Ok(())
}

/// Started sends and receives: a ring where each rank starts its send first and waits
/// in reverse order, a blocking receive behind a started one, and started receives of
/// the wrong length (shorter: `Mismatch`; longer: MPI's truncation error).
fn started_transfers(world: &dyn Communicator) -> anyhow::Result<()> {
    let (r, n) = (world.rank(), world.size());
    if n < 2 {
        return Ok(());
    }
    let (right, left) = ((r + 1) % n, (r + n - 1) % n);
    for len in [3usize, 300_000] {
        let sent = data::<f32>(r, len, 1);
        let send = world.isend((&sent).into(), right)?;
        let first = world.irecv(Buffer::zeros(DType::F32, len), left)?;
        let second = world.irecv(Buffer::zeros(DType::I64, 2), left)?;
        let small = world.isend((&[r as i64, 7][..]).into(), right)?;
        ensure!(
            second.wait()?.expect("a buffer").into_vec::<i64>()? == vec![left as i64, 7],
            "started ring of {len}: second message"
        );
        ensure!(
            first.wait()?.expect("a buffer").into_vec::<f32>()? == data::<f32>(left, len, 1),
            "started ring of {len}: first message"
        );
        send.wait()?;
        small.wait()?;
    }
    // A blocking receive takes the message after the one a started receive waits for.
    let third = world.irecv(Buffer::zeros(DType::U8, 1), left)?;
    let sends = [
        world.isend((&[r as u8][..]).into(), right)?,
        world.isend((&[r as u8 + 100][..]).into(), right)?,
    ];
    let mut fourth = [0u8];
    world.recv_slice(&mut fourth, left)?;
    ensure!(
        fourth == [left as u8 + 100],
        "blocking after started: {fourth:?}"
    );
    let third = third.wait()?.expect("a buffer").into_vec::<u8>()?;
    ensure!(
        third == vec![left as u8],
        "started before blocking: {third:?}"
    );
    for send in sends {
        send.wait()?;
    }
    // Rank 0 sends 4 then 2 elements; rank 1 starts receives of 5 and of 1.
    match r {
        0 => {
            world.isend((&[1i32; 4][..]).into(), 1)?.wait()?;
            world.isend((&[2i32; 2][..]).into(), 1)?.wait()?;
        }
        1 => {
            let longer = world.irecv(Buffer::zeros(DType::I32, 5), 0)?;
            let shorter = world.irecv(Buffer::zeros(DType::I32, 1), 0)?;
            match longer.wait() {
                Err(Error::Mismatch { calls, .. }) => ensure!(
                    calls[0].count == 4 && calls[1].count == 5,
                    "a longer started receive: {calls:?}"
                ),
                other => {
                    anyhow::bail!("a longer started receive: expected Mismatch, got {other:?}")
                }
            }
            match shorter.wait() {
                Err(Error::Mpi(message)) => ensure!(
                    message.to_lowercase().contains("truncat"),
                    "a shorter started receive: {message}"
                ),
                other => {
                    anyhow::bail!("a shorter started receive: expected truncation, got {other:?}")
                }
            }
        }
        _ => {}
    }
    let mut x = [1i32];
    world.all_reduce_slice(&mut x, ReduceOp::Sum)?;
    ensure!(x[0] == n as i32, "sum after the started transfers");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mpi = MpiWorld::init()?;
    // This binary tests the default: with the check switched off, its mismatch cases
    // would be undefined behaviour in MPI, not errors.
    anyhow::ensure!(
        mpi.checks_signatures(),
        "MpiWorld::init() runs without the signature check; unset {CHECK_ENV} (it is {:?})",
        std::env::var(CHECK_ENV).unwrap_or_default()
    );
    let world = mpi.world()?;
    let mut results: Vec<(String, anyhow::Result<()>)> = Vec::new();
    for dtype in DType::ALL {
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(dtype)) {
            // 256 f32 (1 KiB) and fewer ride the signature check's exchange at up to 7
            // ranks; 257 and 20,000 take MPI's own collectives.
            for len in [0usize, 7, 256, 257, 20_000] {
                let name = format!("collectives {dtype} {op} len={len}");
                let outcome =
                    ferrotron_comm_core::with_dtype!(dtype, T => collectives::<T>(&world, op, len));
                results.push((name, outcome));
            }
        }
    }
    results.push(("split and async".into(), split_and_async(&world)));
    results.push(("mismatch detection".into(), mismatch_is_detected(&world)));
    results.push(("exchanges".into(), exchanges(&world)));
    results.push(("started transfers".into(), started_transfers(&world)));
    world.barrier()?;

    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    for (name, outcome) in &results {
        if let Err(e) = outcome {
            eprintln!("rank {}: {name} FAILED: {e:#}", world.rank());
        }
    }
    if world.rank() == 0 {
        println!("mpi_collectives on {} ranks", world.size());
        println!("{} passed, {} failed", results.len() - failed, failed);
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
