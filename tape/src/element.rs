//! Element types a [`Tensor`](crate::Tensor) can hold: `f32` for training, `f64` for grad checks.

use std::fmt::{Debug, Display};
use std::ops::{AddAssign, DivAssign, MulAssign, SubAssign};

use ndarray::{LinalgScalar, ScalarOperand};
use num_traits::Float;

/// A floating-point element type. Implemented for `f32` and `f64` only.
pub trait Element:
    Float
    + LinalgScalar
    + ScalarOperand
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Debug
    + Display
    + Default
    + Send
    + Sync
    + 'static
{
    /// The runtime tag of the type (what a full-precision tensor of it reports).
    const DTYPE: ferrotron_comm_core::DType;
    /// Converts from `f64`, rounding to the nearest representable value.
    fn from_f64(value: f64) -> Self;
    /// Widens (or keeps) the value as `f64`.
    fn into_f64(self) -> f64;
    /// The error function, needed by exact GELU.
    fn erf(self) -> Self;
    /// `tanh` without a branch or a library call, so that loops over it vectorise (f32:
    /// within 2 ulp of the exact value; f64: the standard library's, as grad checks need).
    fn tanh_vectorizable(self) -> Self;
}

impl Element for f32 {
    const DTYPE: ferrotron_comm_core::DType = ferrotron_comm_core::DType::F32;
    fn from_f64(value: f64) -> Self {
        value as f32
    }
    fn into_f64(self) -> f64 {
        f64::from(self)
    }
    fn erf(self) -> Self {
        libm::erff(self)
    }
    #[inline(always)]
    fn tanh_vectorizable(self) -> Self {
        tanh_f32(self)
    }
}

impl Element for f64 {
    const DTYPE: ferrotron_comm_core::DType = ferrotron_comm_core::DType::F64;
    fn from_f64(value: f64) -> Self {
        value
    }
    fn into_f64(self) -> f64 {
        self
    }
    fn erf(self) -> Self {
        libm::erf(self)
    }
    #[inline(always)]
    fn tanh_vectorizable(self) -> Self {
        self.tanh()
    }
}

/// tanh for f32 as two polynomial branches, both computed and one selected, so a loop of
/// calls compiles to vector code (glibc's `tanhf` is a scalar call into `expm1f` and took a
/// fifth of a CPU transformer block step in GELU). Below |x| = 0.625 an odd polynomial in
/// x (Cephes' minimax fit); above, `1 − 2 / (e^{2|x|} + 1)` with the exponential from a
/// range reduction by ln 2 and a degree-6 polynomial. Beyond |x| = 10, tanh rounds to ±1.
#[inline(always)]
fn tanh_f32(x: f32) -> f32 {
    let magnitude = x.abs();
    let z = x * x;
    // x · (1 + z·P(z)) rather than x + x·z·P(z): the product keeps the sign of −0.
    let near_zero = x
        * (1.0
            + ((((-5.704_988_7e-3 * z + 2.063_909e-2) * z - 5.373_971_6e-2) * z + 1.333_144_2e-1)
                * z
                - 3.333_328e-1)
                * z);
    let twice = 2.0 * if magnitude < 10.0 { magnitude } else { 10.0 };
    let far = 1.0 - 2.0 / (exp_nonnegative_f32(twice) + 1.0);
    let far = if x < 0.0 { -far } else { far };
    let value = if magnitude < 0.625 { near_zero } else { far };
    if x.is_nan() {
        x
    } else {
        value
    }
}

/// e^y for 0 ≤ y ≤ 20: y = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by a degree-6 polynomial,
/// 2^n by building the exponent bits (n ≤ 29, so no overflow or subnormals).
#[inline(always)]
fn exp_nonnegative_f32(y: f32) -> f32 {
    const LN2_HIGH: f32 = 0.693_359_4;
    const LN2_LOW: f32 = -2.121_944_4e-4;
    // Adding 1.5·2²³ rounds to the nearest integer and leaves it in the low mantissa bits:
    // n without a float-to-int conversion, which (saturating in Rust) keeps loops scalar.
    const ROUNDER: f32 = 12_582_912.0;
    let shifted = y * std::f32::consts::LOG2_E + ROUNDER;
    let n_float = shifted - ROUNDER;
    let n = shifted.to_bits().wrapping_sub(ROUNDER.to_bits());
    let r = y - n_float * LN2_HIGH - n_float * LN2_LOW;
    let polynomial =
        (((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
            + 1.666_666_5e-1)
            * r
            + 0.5)
            * r
            * r
            + r
            + 1.0;
    polynomial * f32::from_bits((n + 127) << 23)
}

#[cfg(test)]
mod tests {
    use super::tanh_f32;

    /// Distance in units in the last place between an f32 and the exact value.
    fn ulps(value: f32, exact: f64) -> f64 {
        let rounded = exact as f32;
        let ulp = f64::from(f32::from_bits(rounded.abs().to_bits() + 1) - rounded.abs());
        (f64::from(value) - exact).abs() / ulp
    }

    #[test]
    fn tanh_is_within_two_ulp_of_the_exact_value_everywhere() {
        let mut worst = (0.0f64, 0.0f32);
        // Every 64th f32 from 1e-30 up to 20 (both signs), about 17 million points.
        let (start, end) = (1e-30f32.to_bits(), 20.0f32.to_bits());
        for bits in (start..end).step_by(64) {
            for x in [f32::from_bits(bits), -f32::from_bits(bits)] {
                let error = ulps(tanh_f32(x), f64::from(x).tanh());
                if error > worst.0 {
                    worst = (error, x);
                }
            }
        }
        assert!(worst.0 <= 2.0, "{} ulp at x = {:e}", worst.0, worst.1);
    }

    #[test]
    fn tanh_keeps_the_special_values() {
        assert_eq!(tanh_f32(0.0).to_bits(), 0.0f32.to_bits());
        assert_eq!(tanh_f32(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh_f32(f32::INFINITY), 1.0);
        assert_eq!(tanh_f32(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh_f32(9.5), 1.0);
        assert!(tanh_f32(f32::NAN).is_nan());
        // Subnormals: tanh(x) = x.
        let tiny = f32::from_bits(1);
        assert_eq!(tanh_f32(tiny), tiny);
    }
}
