//! The cross-rank agreement rule on hand-made signatures: each clause of
//! [`signatures_agree`] that local validation normally makes unreachable still decides
//! on its own (mutation testing showed no other test would notice it gone).

use super::*;

fn sig(rank: usize, op: OpKind, count: usize) -> CallSignature {
    CallCheck {
        group: "g",
        rank,
        size: 2,
    }
    .data_signature(op, DType::F32, Device::Cpu, count)
}

fn with_counts(mut s: CallSignature, counts: &[usize], recv: Option<&[usize]>) -> CallSignature {
    s.counts = Some(counts.to_vec());
    s.recv_counts = recv.map(<[usize]>::to_vec);
    s
}

fn agree(sigs: &[CallSignature]) -> bool {
    signatures_agree(&sigs.iter().collect::<Vec<_>>())
}

#[test]
fn all_gather_v_needs_each_ranks_count_to_match_the_shared_list() {
    let good = [
        with_counts(sig(0, OpKind::AllGatherV, 2), &[2, 3], None),
        with_counts(sig(1, OpKind::AllGatherV, 3), &[2, 3], None),
    ];
    assert!(agree(&good));
    // Both ranks pass the same list, but rank 1 contributes 4 elements, not 3.
    let own_count_differs = [
        good[0].clone(),
        with_counts(sig(1, OpKind::AllGatherV, 4), &[2, 3], None),
    ];
    assert!(!agree(&own_count_differs));
}

#[test]
fn reduce_scatter_v_needs_each_input_to_hold_the_sum_of_the_counts() {
    let good = [
        with_counts(sig(0, OpKind::ReduceScatterV, 5), &[2, 3], None),
        with_counts(sig(1, OpKind::ReduceScatterV, 5), &[2, 3], None),
    ];
    assert!(agree(&good));
    let short_input = [
        good[0].clone(),
        with_counts(sig(1, OpKind::ReduceScatterV, 6), &[2, 3], None),
    ];
    assert!(!agree(&short_input));
}

#[test]
fn all_to_all_v_needs_every_send_to_match_its_receive() {
    // Rank 0 sends 1 to itself and 2 to rank 1; rank 1 sends 4 to rank 0 and 3 to itself.
    let rank0 = |recv: &[usize]| with_counts(sig(0, OpKind::AllToAllV, 3), &[1, 2], Some(recv));
    let rank1 = |recv: &[usize]| with_counts(sig(1, OpKind::AllToAllV, 7), &[4, 3], Some(recv));
    assert!(agree(&[rank0(&[1, 4]), rank1(&[2, 3])]));
    // Rank 1 expects 5 elements from rank 0, which sends 2.
    assert!(!agree(&[rank0(&[1, 4]), rank1(&[5, 3])]));
    // Rank 0 expects 1 element from rank 1, which sends 4.
    assert!(!agree(&[rank0(&[1, 1]), rank1(&[2, 3])]));
}

#[cfg(feature = "cuda")]
#[test]
fn device_memory_is_part_of_the_signature() {
    let check = CallCheck {
        group: "g",
        rank: 1,
        size: 2,
    };
    let device = Device::Cuda(1);
    let on_device = check.data_signature(OpKind::AllReduce, DType::F32, device, 4);
    assert_eq!(on_device.memory, device);
    assert!(!agree(&[sig(0, OpKind::AllReduce, 4), on_device]));
}
