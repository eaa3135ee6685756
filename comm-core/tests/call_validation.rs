//! A call's own arguments are checked before it communicates, on every rank: each length
//! rule on its own (a right input does not excuse a wrong output), dtypes within one call,
//! roots and peers inside the group. Mutation testing showed these were unpinned.

use std::time::Duration;

use ferrotron_comm_core::{BufMut, BufRef, Communicator, Error, LocalLauncher, OpKind, ReduceOp};

/// Every rank's error for `f`, which must fail on every rank. A short timeout: a check
/// that were missing would make a peer wait for a partner that never comes.
fn errors_of<F>(n: usize, f: F) -> Vec<Error>
where
    F: Fn(ferrotron_comm_core::LocalCommunicator) -> ferrotron_comm_core::Result<()> + Sync,
{
    LocalLauncher::new(n)
        .unwrap()
        .timeout(Duration::from_secs(1))
        .run_each(f)
        .into_iter()
        .map(|r| match r {
            Err((_, Error::RankFailed { source, .. })) => *source.downcast::<Error>().unwrap(),
            other => panic!("expected a failure, got {:?}", other.map(|_| ())),
        })
        .collect()
}

fn all_invalid_buffer(errors: &[Error], expected: OpKind) {
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, Error::InvalidBuffer { op, .. } if *op == expected)),
        "{errors:?}"
    );
}

#[test]
fn input_and_output_of_one_call_must_share_a_dtype() {
    let errors = errors_of(2, |comm| {
        let mut out = [0f64; 4];
        comm.all_gather(BufRef::from(&[1f32, 2.0][..]), BufMut::from(&mut out[..]))
    });
    for err in &errors {
        match err {
            Error::InvalidBuffer { detail, .. } => assert!(detail.contains("f32"), "{detail}"),
            other => panic!("expected InvalidBuffer, got {other}"),
        }
    }
}

#[test]
fn a_right_input_does_not_excuse_a_wrong_output_nor_the_reverse() {
    // all_gather_v with counts [1, 2]: rank r passes counts[r] elements, the output 3.
    for (input_extra, output_len) in [(0, 4), (1, 3)] {
        let errors = errors_of(2, |comm| {
            let input = vec![1f32; 1 + comm.rank() + input_extra];
            let mut out = vec![0f32; output_len];
            comm.all_gather_v(
                BufRef::from(&input[..]),
                BufMut::from(&mut out[..]),
                &[1, 2],
            )
        });
        all_invalid_buffer(&errors, OpKind::AllGatherV);
    }
    // reduce_scatter_v with counts [1, 2]: inputs of 3, rank r's output counts[r].
    for (input_len, output_extra) in [(3, 1), (4, 0)] {
        let errors = errors_of(2, |comm| {
            let input = vec![1f32; input_len];
            let mut out = vec![0f32; 1 + comm.rank() + output_extra];
            comm.reduce_scatter_v(
                BufRef::from(&input[..]),
                BufMut::from(&mut out[..]),
                &[1, 2],
                ReduceOp::Sum,
            )
        });
        all_invalid_buffer(&errors, OpKind::ReduceScatterV);
    }
    // all_to_all_v: one element to each rank and from each rank.
    for (input_len, output_len) in [(2, 3), (3, 2)] {
        let errors = errors_of(2, |comm| {
            let input = vec![1f32; input_len];
            let mut out = vec![0f32; output_len];
            comm.all_to_all_v(
                BufRef::from(&input[..]),
                &[1, 1],
                BufMut::from(&mut out[..]),
                &[1, 1],
            )
        });
        all_invalid_buffer(&errors, OpKind::AllToAllV);
    }
}

#[test]
fn a_root_or_peer_equal_to_the_group_size_is_not_a_rank() {
    let errors = errors_of(2, |comm| comm.broadcast(BufMut::from(&mut [1u8][..]), 2));
    assert!(
        errors
            .iter()
            .all(|e| matches!(e, Error::InvalidArgument { op: OpKind::Broadcast, detail, .. } if detail.contains("root 2"))),
        "{errors:?}"
    );
    let errors = errors_of(2, |comm| comm.send(BufRef::from(&[1u8][..]), 2));
    assert!(
        errors.iter().all(|e| matches!(
            e,
            Error::InvalidArgument {
                op: OpKind::Send,
                ..
            }
        )),
        "{errors:?}"
    );
}
