//! Pointwise loops over contiguous memory, compiled twice on x86-64: for the baseline
//! instruction set the crate is built for, and for AVX2, chosen at run time. Rust never
//! fuses or reorders float arithmetic on its own, so both give the same bits; AVX2 only
//! makes the loops twice as wide (tanh-GELU: ~2× faster than the SSE2 build).

use ndarray::{ArcArray, ArrayD, IxDyn, Zip};

use crate::Element;

/// `f` of every element, as a new array.
pub(crate) fn map<T: Element>(input: &ArcArray<T, IxDyn>, f: impl Fn(T) -> T + Sync) -> ArrayD<T> {
    let mut out = input.to_owned();
    match out.as_slice_memory_order_mut() {
        Some(values) => each(values, |x, _| f(x), None),
        None => out.mapv_inplace(f),
    }
    out
}

/// `target[i] = f(target[i], other[i])` over arrays of one shape.
pub(crate) fn update_with<T: Element>(
    target: &mut ArrayD<T>,
    other: &ArcArray<T, IxDyn>,
    f: impl Fn(T, T) -> T + Sync,
) {
    let same_layout = target.strides() == other.strides();
    match (
        target.as_slice_memory_order_mut(),
        other.as_slice_memory_order(),
    ) {
        (Some(values), Some(others)) if same_layout => each(values, f, Some(others)),
        _ => Zip::from(target).and(other).for_each(|t, &o| *t = f(*t, o)),
    }
}

/// `values[i] = f(values[i], others[i])` (`others` absent: zero), on the widest vectors
/// the CPU has and, for large arrays, on the calling thread's threads.
fn each<T: Element>(values: &mut [T], f: impl Fn(T, T) -> T + Sync, others: Option<&[T]>) {
    // Blocks of 64 elements as "rows": each element is computed alone, so the split does
    // not change a bit.
    const ROW: usize = 64;
    let mut none: [(); 0] = [];
    crate::threads::for_row_blocks(values, ROW, &mut none, 1, |first, block, _| {
        let others = others.map(|o| &o[first * ROW..first * ROW + block.len()]);
        each_on_one_thread(block, &f, others)
    });
}

fn each_on_one_thread<T: Element>(values: &mut [T], f: impl Fn(T, T) -> T, others: Option<&[T]>) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has the one feature `each_avx2` is compiled for.
        return unsafe { each_avx2(values, f, others) };
    }
    each_portable(values, f, others)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn each_avx2<T: Element>(values: &mut [T], f: impl Fn(T, T) -> T, others: Option<&[T]>) {
    each_portable(values, f, others)
}

#[inline(always)]
fn each_portable<T: Element>(values: &mut [T], f: impl Fn(T, T) -> T, others: Option<&[T]>) {
    match others {
        Some(others) => {
            for (v, &o) in values.iter_mut().zip(others) {
                *v = f(*v, o);
            }
        }
        None => {
            for v in values {
                *v = f(*v, T::zero());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{each, each_portable};
    use crate::Element;

    #[test]
    fn the_vector_build_gives_the_portable_builds_bits() {
        let inputs: Vec<f32> = (0..10_007).map(|i| (i as f32 - 5_000.0) * 2.7e-3).collect();
        let scale: Vec<f32> = inputs.iter().map(|x| 1.0 + x * x).collect();
        let f = |x: f32, s: f32| s * x.tanh_vectorizable() / (1.0 + x.abs());
        let (mut dispatched, mut portable) = (inputs.clone(), inputs.clone());
        each(&mut dispatched, f, Some(&scale));
        each_portable(&mut portable, f, Some(&scale));
        assert!(dispatched
            .iter()
            .zip(&portable)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        let (mut dispatched, mut portable) = (inputs.clone(), inputs);
        each(&mut dispatched, |x, _| x.tanh_vectorizable(), None);
        each_portable(&mut portable, |x, _| x.tanh_vectorizable(), None);
        assert!(dispatched
            .iter()
            .zip(&portable)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
