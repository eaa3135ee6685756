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
    /// Converts from `f64`, rounding to the nearest representable value.
    fn from_f64(value: f64) -> Self;
    /// Widens (or keeps) the value as `f64`.
    fn into_f64(self) -> f64;
    /// The error function, needed by exact GELU.
    fn erf(self) -> Self;
}

impl Element for f32 {
    fn from_f64(value: f64) -> Self {
        value as f32
    }
    fn into_f64(self) -> f64 {
        f64::from(self)
    }
    fn erf(self) -> Self {
        libm::erff(self)
    }
}

impl Element for f64 {
    fn from_f64(value: f64) -> Self {
        value
    }
    fn into_f64(self) -> f64 {
        self
    }
    fn erf(self) -> Self {
        libm::erf(self)
    }
}
