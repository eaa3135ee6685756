//! Every collective of the local backend against a sequential reference: random dtypes,
//! reduction operators, counts (zero, uneven, and above the small-message threshold),
//! 1–8 ranks and roots.

mod support;

use anyhow::ensure;
use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, DType, Element, ReduceOp};
use proptest::prelude::*;
use support::{data, offsets, reduced};

#[derive(Clone, Debug)]
struct Case {
    ranks: usize,
    dtype: DType,
    op: ReduceOp,
    len: usize,
    root: usize,
    counts: Vec<usize>,
    /// `matrix[s][d]`: elements rank s sends to rank d in all_to_all_v.
    matrix: Vec<Vec<usize>>,
}

/// Lengths that cover empty, tiny, odd and larger-than-staging (> 64 KiB) messages.
fn length() -> impl Strategy<Value = usize> {
    prop_oneof![4 => 0usize..40, 1 => 9_000usize..20_000]
}

fn case() -> impl Strategy<Value = Case> {
    (
        1usize..=8,
        0..DType::ALL.len(),
        0..ReduceOp::ALL.len(),
        length(),
    )
        .prop_flat_map(|(ranks, d, o, len)| {
            let dtype = DType::ALL[d];
            let op = match ReduceOp::ALL[o] {
                ReduceOp::Avg if !dtype.is_float() => ReduceOp::Sum,
                op => op,
            };
            (
                Just((ranks, dtype, op, len)),
                0..ranks,
                prop::collection::vec(length(), ranks),
                prop::collection::vec(prop::collection::vec(0usize..12, ranks), ranks),
            )
        })
        .prop_map(|((ranks, dtype, op, len), root, counts, matrix)| Case {
            ranks,
            dtype,
            op,
            len,
            root,
            counts,
            matrix,
        })
}

fn check_case<T: Element>(case: &Case) -> ferrotron_comm_core::Result<Vec<()>> {
    let n = case.ranks;
    run_local(n, |comm| -> anyhow::Result<()> {
        let r = comm.rank();
        let op = case.op;

        let mut buf = data::<T>(r, case.len, 0);
        comm.all_reduce_slice(&mut buf, op)?;
        let inputs: Vec<Vec<T>> = (0..n).map(|q| data(q, case.len, 0)).collect();
        ensure!(buf == reduced(op, &inputs), "all_reduce {op} differs");

        let mut buf = if r == case.root {
            data::<T>(r, case.len, 1)
        } else {
            vec![T::default(); case.len]
        };
        comm.broadcast_slice(&mut buf, case.root)?;
        ensure!(
            buf == data::<T>(case.root, case.len, 1),
            "broadcast differs"
        );

        let gathered = comm.all_gather_vec(&data::<T>(r, case.len, 2))?;
        let expect: Vec<T> = (0..n).flat_map(|q| data::<T>(q, case.len, 2)).collect();
        ensure!(gathered == expect, "all_gather differs");

        let gathered = comm.all_gather_v_vec(&data::<T>(r, case.counts[r], 3), &case.counts)?;
        let expect: Vec<T> = (0..n)
            .flat_map(|q| data::<T>(q, case.counts[q], 3))
            .collect();
        ensure!(gathered == expect, "all_gather_v differs");

        let chunk = case.len.div_ceil(n.max(1)).max(1);
        let inputs: Vec<Vec<T>> = (0..n).map(|q| data(q, chunk * n, 4)).collect();
        let mine = comm.reduce_scatter_vec(&inputs[r], op)?;
        ensure!(
            mine == reduced(op, &inputs)[r * chunk..(r + 1) * chunk],
            "reduce_scatter differs"
        );

        let total: usize = case.counts.iter().sum();
        let inputs: Vec<Vec<T>> = (0..n).map(|q| data(q, total, 5)).collect();
        let mine = comm.reduce_scatter_v_vec(&inputs[r], &case.counts, op)?;
        let start = offsets(&case.counts)[r];
        ensure!(
            mine == reduced(op, &inputs)[start..start + case.counts[r]],
            "reduce_scatter_v differs"
        );

        let sends: Vec<usize> = case.matrix[r].clone();
        let recvs: Vec<usize> = (0..n).map(|s| case.matrix[s][r]).collect();
        let input = data::<T>(r, sends.iter().sum(), 6);
        let output = comm.all_to_all_v_vec(&input, &sends, &recvs)?;
        let expect: Vec<T> = (0..n)
            .flat_map(|s| {
                let theirs = data::<T>(s, case.matrix[s].iter().sum(), 6);
                let at = offsets(&case.matrix[s])[r];
                theirs[at..at + case.matrix[s][r]].to_vec()
            })
            .collect();
        ensure!(output == expect, "all_to_all_v differs");

        // Point-to-point around a ring; sends are rendezvous, so even ranks send first.
        if n > 1 {
            let next = (r + 1) % n;
            let prev = (r + n - 1) % n;
            let mut got = vec![T::default(); case.len];
            if r % 2 == 0 {
                comm.send_slice(&data::<T>(r, case.len, 7), next)?;
                comm.recv_slice(&mut got, prev)?;
            } else {
                comm.recv_slice(&mut got, prev)?;
                comm.send_slice(&data::<T>(r, case.len, 7), next)?;
            }
            ensure!(got == data::<T>(prev, case.len, 7), "send/recv differs");
        }

        comm.barrier()?;
        Ok(())
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn collectives_match_sequential_reference(case in case()) {
        let result = ferrotron_comm_core::with_dtype!(case.dtype, T => check_case::<T>(&case));
        prop_assert!(result.is_ok(), "{case:?}: {}", result.unwrap_err());
    }
}

#[test]
fn every_rank_of_a_large_all_reduce_gets_identical_bits() {
    // Floating-point sums depend on order; every rank must still see the same bits.
    let len = 100_003;
    let results = run_local(3, |comm| {
        let mut v: Vec<f32> = (0..len)
            .map(|i| ((i * 31 + comm.rank() * 17) % 97) as f32 * 0.1)
            .collect();
        comm.all_reduce_slice(&mut v, ReduceOp::Sum)?;
        Ok::<_, ferrotron_comm_core::Error>(v)
    })
    .unwrap();
    assert!(results.iter().all(|r| r == &results[0]));
}
