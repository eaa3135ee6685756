//! Deterministic test data and the sequential reference every backend is checked against.
#![allow(dead_code)] // each test binary uses a different subset

use ferrotron_comm_core::{reduce_slices, DType, Element, ReduceOp};

/// Small integers, exact in every dtype (bf16 included) under every reduction we test.
pub fn value<T: Element>(rank: usize, index: usize, salt: usize) -> T {
    let v = ((rank * 7 + index * 3 + salt) % 5) as f64;
    T::from_f64(if T::DTYPE == DType::U8 { v } else { v - 2.0 })
}

pub fn data<T: Element>(rank: usize, len: usize, salt: usize) -> Vec<T> {
    (0..len).map(|i| value(rank, i, salt)).collect()
}

/// What a reduction over `inputs` (one per rank, combined in rank order) must give.
pub fn reduced<T: Element>(op: ReduceOp, inputs: &[Vec<T>]) -> Vec<T> {
    let refs: Vec<&[T]> = inputs.iter().map(|v| v.as_slice()).collect();
    let mut out = vec![T::default(); inputs[0].len()];
    reduce_slices(op, &refs, &mut out).expect("valid reference inputs");
    out
}

pub fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut acc = 0;
    counts
        .iter()
        .map(|c| {
            let start = acc;
            acc += c;
            start
        })
        .collect()
}
