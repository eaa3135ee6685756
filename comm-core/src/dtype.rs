//! Element types, reduction operators and the reduction kernels every backend shares.

use half::{bf16, f16};
use std::fmt;

/// The element type of a buffer taking part in a collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// 16-bit IEEE float (`half::f16`); reduced in f32 and rounded once.
    F16,
    /// bfloat16 (`half::bf16`); reduced in f32 and rounded once.
    BF16,
    /// 32-bit signed integer; arithmetic wraps on overflow.
    I32,
    /// 64-bit signed integer; arithmetic wraps on overflow.
    I64,
    /// 8-bit unsigned integer; arithmetic wraps on overflow.
    U8,
}

impl DType {
    /// Every supported element type, in a fixed order (handy for tests and benchmarks).
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
    ];

    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether this is a floating-point type (the types `ReduceOp::Avg` is defined for).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// Lower-case name as used on the command line (`f32`, `bf16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Parses a name produced by [`DType::name`].
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How a reduction combines the ranks' values.
///
/// `Avg` is defined for floating-point types only: averaging integers would need a
/// rounding rule that no caller agrees on, so backends reject it with
/// [`Error::Unsupported`](crate::Error::Unsupported). Use `Sum` and divide instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the group size (floating-point types only).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
    /// Element-wise product.
    Prod,
}

impl ReduceOp {
    /// Every operator, in a fixed order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Avg,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Prod,
    ];

    /// Lower-case name (`sum`, `avg`, ...).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Prod => "prod",
        }
    }

    /// Whether `dtype` supports this operator.
    pub fn supports(self, dtype: DType) -> bool {
        self != ReduceOp::Avg || dtype.is_float()
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that can travel through a collective.
///
/// Implemented for `f32`, `f64`, `half::f16`, `half::bf16`, `i32`, `i64` and `u8`; the
/// trait is sealed because the backends' kernels are written for exactly these types.
pub trait Element:
    sealed::Sealed + Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;
    /// The type reductions accumulate in (f32 for the 16-bit floats).
    #[doc(hidden)]
    type Acc: Accumulator;
    #[doc(hidden)]
    fn to_acc(self) -> Self::Acc;
    #[doc(hidden)]
    fn from_acc(acc: Self::Acc) -> Self;
    /// Converts from f64 (used by tests and benchmarks to fill buffers).
    fn from_f64(value: f64) -> Self;
    /// Converts to f64 (used by tests and benchmarks to check results).
    fn to_f64(self) -> f64;
}

/// Arithmetic of the accumulation type. Integer arithmetic wraps instead of panicking,
/// so that user data can never make a collective panic.
#[doc(hidden)]
pub trait Accumulator: Copy + Send + Sync + 'static {
    const ZERO: Self;
    fn add(self, other: Self) -> Self;
    fn mul(self, other: Self) -> Self;
    fn max(self, other: Self) -> Self;
    fn min(self, other: Self) -> Self;
    /// Divides by the group size; only called for float accumulators.
    fn div_count(self, count: usize) -> Self;
}

macro_rules! float_accumulator {
    ($t:ty) => {
        impl Accumulator for $t {
            const ZERO: Self = 0 as $t;
            #[inline(always)]
            fn add(self, other: Self) -> Self {
                self + other
            }
            #[inline(always)]
            fn mul(self, other: Self) -> Self {
                self * other
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                if other > self {
                    other
                } else {
                    self
                }
            }
            #[inline(always)]
            fn min(self, other: Self) -> Self {
                if other < self {
                    other
                } else {
                    self
                }
            }
            #[inline(always)]
            fn div_count(self, count: usize) -> Self {
                self / count as $t
            }
        }
    };
}
float_accumulator!(f32);
float_accumulator!(f64);

macro_rules! int_accumulator {
    ($t:ty) => {
        impl Accumulator for $t {
            const ZERO: Self = 0 as $t;
            #[inline(always)]
            fn add(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            #[inline(always)]
            fn mul(self, other: Self) -> Self {
                self.wrapping_mul(other)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                Ord::max(self, other)
            }
            #[inline(always)]
            fn min(self, other: Self) -> Self {
                Ord::min(self, other)
            }
            #[inline(always)]
            fn div_count(self, _count: usize) -> Self {
                unreachable!("Avg on integers is rejected before any kernel runs")
            }
        }
    };
}
int_accumulator!(i32);
int_accumulator!(i64);
int_accumulator!(u8);

macro_rules! element_identity {
    ($t:ty, $tag:ident) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$tag;
            type Acc = $t;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(acc: $t) -> $t {
                acc
            }
            fn from_f64(value: f64) -> Self {
                value as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    };
}
element_identity!(f32, F32);
element_identity!(f64, F64);
element_identity!(i32, I32);
element_identity!(i64, I64);
element_identity!(u8, U8);

macro_rules! element_half {
    ($t:ty, $tag:ident) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$tag;
            type Acc = f32;
            #[inline(always)]
            fn to_acc(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn from_acc(acc: f32) -> $t {
                <$t>::from_f32(acc)
            }
            fn from_f64(value: f64) -> Self {
                <$t>::from_f64(value)
            }
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
        }
    };
}
element_half!(f16, F16);
element_half!(bf16, BF16);

/// Calls `$body` with the type alias `$t` bound to the Rust type of `$dtype`.
#[macro_export]
#[doc(hidden)]
macro_rules! with_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::F16 => {
                type $t = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = $crate::half::bf16;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
        }
    };
}

/// Elements reduced per tile: small enough that the accumulator tile stays in L1.
pub(crate) const TILE: usize = 2048;

/// Reduces `sources` element-wise and writes the result to every pointer in `outputs`,
/// combining in source order so that every rank computing the same reduction gets
/// bit-identical results.
///
/// # Safety
/// Every pointer in `sources` must be valid for reads of `len` elements and every one in
/// `outputs` for writes of `len` elements for the duration of the call; an output may
/// equal a source (each tile is read completely before it is written) but must not
/// partially overlap any of them.
pub(crate) unsafe fn reduce_raw<T: Element>(
    op: ReduceOp,
    sources: &[*const T],
    outputs: &[*mut T],
    len: usize,
) {
    debug_assert!(!sources.is_empty());
    let count = sources.len();
    let mut acc = [T::Acc::ZERO; TILE];
    let mut start = 0;
    while start < len {
        let n = TILE.min(len - start);
        let tile = &mut acc[..n];
        // SAFETY: the caller guarantees `len` readable elements behind every source.
        let first = unsafe { std::slice::from_raw_parts(sources[0].add(start), n) };
        for (a, &x) in tile.iter_mut().zip(first) {
            *a = x.to_acc();
        }
        for src in &sources[1..] {
            // SAFETY: as above.
            let s = unsafe { std::slice::from_raw_parts(src.add(start), n) };
            combine_tile::<T>(op, tile, s);
        }
        if op == ReduceOp::Avg {
            for a in tile.iter_mut() {
                *a = a.div_count(count);
            }
        }
        for out in outputs {
            // SAFETY: valid for `len` writes; this tile of every source was read above.
            let o = unsafe { std::slice::from_raw_parts_mut(out.add(start), n) };
            for (o, &a) in o.iter_mut().zip(tile.iter()) {
                *o = T::from_acc(a);
            }
        }
        start += n;
    }
}

#[inline(always)]
fn combine_tile<T: Element>(op: ReduceOp, acc: &mut [T::Acc], src: &[T]) {
    // One monomorphised loop per operator so that each one vectorises.
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, &x) in acc.iter_mut().zip(src) {
                *a = a.add(x.to_acc());
            }
        }
        ReduceOp::Prod => {
            for (a, &x) in acc.iter_mut().zip(src) {
                *a = a.mul(x.to_acc());
            }
        }
        ReduceOp::Max => {
            for (a, &x) in acc.iter_mut().zip(src) {
                *a = a.max(x.to_acc());
            }
        }
        ReduceOp::Min => {
            for (a, &x) in acc.iter_mut().zip(src) {
                *a = a.min(x.to_acc());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calls::reduce_slices;

    #[test]
    fn every_dtype_name_parses_back_and_nothing_else_does() {
        for dtype in DType::ALL {
            assert_eq!(DType::from_name(dtype.name()), Some(dtype));
        }
        assert_eq!(DType::from_name("float32"), None);
        assert_eq!(DType::from_name(""), None);
    }

    #[test]
    fn half_types_accumulate_in_f32_and_round_once() {
        // 2048 + 1 + 1 is not representable step by step in f16 (2049 rounds to 2048),
        // but the f32 accumulation gives 2050 exactly.
        let a = [f16::from_f32(2048.0)];
        let b = [f16::from_f32(1.0)];
        let c = [f16::from_f32(1.0)];
        let mut out = [f16::ZERO];
        reduce_slices(ReduceOp::Sum, &[&a, &b, &c], &mut out).unwrap();
        assert_eq!(out[0].to_f32(), 2050.0);
    }

    #[test]
    fn integer_sum_wraps_instead_of_panicking() {
        let mut out = [0u8];
        reduce_slices(ReduceOp::Sum, &[&[200u8], &[100u8]], &mut out).unwrap();
        assert_eq!(out[0], 44);
    }

    #[test]
    fn bad_reference_inputs_are_errors() {
        let mut out = [0i32; 2];
        assert!(matches!(
            reduce_slices(ReduceOp::Avg, &[&[1, 2]], &mut out),
            Err(crate::Error::Unsupported { .. })
        ));
        assert!(matches!(
            reduce_slices(ReduceOp::Sum, &[&[1]], &mut out),
            Err(crate::Error::InvalidBuffer { .. })
        ));
        assert!(reduce_slices::<i32>(ReduceOp::Sum, &[], &mut out).is_err());
    }

    #[test]
    fn every_op_on_long_input_crosses_tiles() {
        let n = TILE * 2 + 17;
        let a: Vec<f64> = (0..n).map(|i| i as f64).collect();
        let b: Vec<f64> = (0..n).map(|i| (n - i) as f64).collect();
        for op in ReduceOp::ALL {
            let mut out = vec![0.0; n];
            reduce_slices(op, &[&a, &b], &mut out).unwrap();
            for i in 0..n {
                let expect = match op {
                    ReduceOp::Sum => a[i] + b[i],
                    ReduceOp::Avg => (a[i] + b[i]) / 2.0,
                    ReduceOp::Max => a[i].max(b[i]),
                    ReduceOp::Min => a[i].min(b[i]),
                    ReduceOp::Prod => a[i] * b[i],
                };
                assert_eq!(out[i], expect, "op {op} at {i}");
            }
        }
    }
}
