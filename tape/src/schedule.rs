//! Learning-rate schedules, as Megatron-Core's `OptimizerParamScheduler`: a linear
//! warm-up from an initial rate, then a constant, linear, cosine, inverse-square-root or
//! warmup-stable-decay (WSD) curve down to a floor.
//!
//! The curve is read at the number of updates already applied: the first update uses
//! position 0, the k-th position k − 1. That is where Megatron's scheduler stands (it is
//! stepped to 0 when made and after each successful update) and where PyTorch's
//! `LambdaLR` stands (it evaluates its lambda at 0 before the first `step`).

use crate::{Error, Result};

/// How the learning rate falls after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LrDecay {
    /// Stays at the peak.
    Constant,
    /// Falls linearly from the peak to the floor at `decay_steps`.
    Linear,
    /// Falls along half a cosine period from the peak to the floor at `decay_steps`.
    Cosine,
    /// `peak · √(max(warmup, 1) / max(position, 1))`, never below the floor, and the floor
    /// after `decay_steps` (Megatron's `inverse-square-root`).
    InverseSquareRoot,
    /// Warmup-stable-decay: the peak until the last `anneal_steps` positions before
    /// `decay_steps`, then down to the floor along `style` (Megatron's `WSD` with
    /// `--lr-wsd-decay-steps` and `--lr-wsd-decay-style`).
    Wsd {
        /// Positions the final anneal lasts; at least 1, at most `decay_steps − warmup_steps`.
        anneal_steps: u64,
        /// The anneal's shape.
        style: WsdAnneal,
    },
}

/// The shape of a [`LrDecay::Wsd`] anneal over its fraction `r` ∈ [0, 1] (the factor of
/// `peak − floor` above the floor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WsdAnneal {
    /// `1 − r`.
    Linear,
    /// `(1 + cos(π r)) / 2`.
    Cosine,
    /// `2 · 0.5^r − 1` (Megatron's default for WSD).
    Exponential,
    /// `1 − √r`.
    MinusSqrt,
}

impl WsdAnneal {
    fn coefficient(self, ratio: f64) -> f64 {
        match self {
            WsdAnneal::Linear => 1.0 - ratio,
            WsdAnneal::Cosine => cosine(ratio),
            WsdAnneal::Exponential => 2.0 * 0.5f64.powf(ratio) - 1.0,
            WsdAnneal::MinusSqrt => 1.0 - ratio.sqrt(),
        }
    }
}

/// The learning rate of every optimizer update, given to an optimizer with
/// [`AdamW::with_schedule`](crate::AdamW::with_schedule) or
/// [`Sgd::with_schedule`](crate::Sgd::with_schedule). It depends on the update count
/// alone, so a run resumed from a checkpoint (which keeps the count) continues on the
/// same curve. Updates an optimizer skips (a non-finite gradient, say) do not move it,
/// as in Megatron.
///
/// ```
/// use ferrotron_tape::{LrDecay, LrSchedule};
///
/// // 10 warm-up positions to 1e-3, cosine decay to 1e-4 at position 100.
/// let schedule = LrSchedule::new(1e-3, 1e-4, 10, 100, LrDecay::Cosine)?;
/// assert_eq!(schedule.lr(0), 0.0); // the first update: warm-up starts at init_lr = 0
/// assert!((schedule.lr(5) - 5e-4).abs() < 1e-15);
/// assert_eq!(schedule.lr(10), 1e-3); // the 11th update runs at the peak
/// assert!((schedule.lr(55) - 5.5e-4).abs() < 1e-12);
/// assert_eq!(schedule.lr(100), 1e-4);
/// assert_eq!(schedule.lr(1000), 1e-4);
///
/// // Megatron's --lr-warmup-init: the warm-up starts from 1e-4 instead.
/// let from = schedule.with_init_lr(1e-4)?;
/// assert_eq!(from.lr(0), 1e-4);
/// # Ok::<(), ferrotron_tape::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    init_lr: f64,
    max_lr: f64,
    min_lr: f64,
    warmup_steps: u64,
    decay_steps: u64,
    decay: LrDecay,
}

impl LrSchedule {
    /// Warms up linearly over `warmup_steps` from 0 (see
    /// [`with_init_lr`](Self::with_init_lr)) to `max_lr`, reached at position
    /// `warmup_steps`; then decays to `min_lr` at position `decay_steps` and stays there.
    /// `decay_steps` counts from the first update, warm-up included, and must exceed
    /// `warmup_steps` unless the decay is [`LrDecay::Constant`].
    pub fn new(
        max_lr: f64,
        min_lr: f64,
        warmup_steps: u64,
        decay_steps: u64,
        decay: LrDecay,
    ) -> Result<Self> {
        const OP: &str = "LrSchedule::new";
        if !(max_lr.is_finite() && max_lr > 0.0) {
            return Err(Error::invalid(
                OP,
                format!("max_lr {max_lr} must be positive"),
            ));
        }
        if !(min_lr.is_finite() && (0.0..=max_lr).contains(&min_lr)) {
            return Err(Error::invalid(
                OP,
                format!("min_lr {min_lr} must lie in [0, max_lr = {max_lr}]"),
            ));
        }
        if decay != LrDecay::Constant && decay_steps <= warmup_steps {
            return Err(Error::invalid(
                OP,
                format!(
                    "decay_steps {decay_steps} must exceed warmup_steps {warmup_steps}; pass \
                     more decay steps or LrDecay::Constant"
                ),
            ));
        }
        if let LrDecay::Wsd { anneal_steps, .. } = decay {
            let room = decay_steps - warmup_steps;
            if !(1..=room).contains(&anneal_steps) {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "a WSD anneal of {anneal_steps} steps must be at least 1 and fit \
                         between the warm-up's end ({warmup_steps}) and decay_steps \
                         ({decay_steps}): at most {room}"
                    ),
                ));
            }
        }
        Ok(LrSchedule {
            init_lr: 0.0,
            max_lr,
            min_lr,
            warmup_steps,
            decay_steps,
            decay,
        })
    }

    /// A constant learning rate.
    pub fn constant(lr: f64) -> Result<Self> {
        LrSchedule::new(lr, lr, 0, 0, LrDecay::Constant)
    }

    /// The same schedule with its warm-up starting at `init_lr` (Megatron's
    /// `--lr-warmup-init`; 0 unless set), which must lie in `[0, max_lr]`.
    pub fn with_init_lr(mut self, init_lr: f64) -> Result<Self> {
        if !(init_lr.is_finite() && (0.0..=self.max_lr).contains(&init_lr)) {
            return Err(Error::invalid(
                "LrSchedule::with_init_lr",
                format!(
                    "init_lr {init_lr} must lie in [0, max_lr = {}]",
                    self.max_lr
                ),
            ));
        }
        self.init_lr = init_lr;
        Ok(self)
    }

    /// The learning rate at `position`: the number of updates already applied (0 for
    /// the first update, k − 1 for the k-th).
    pub fn lr(&self, position: u64) -> f64 {
        let (warmup, n) = (self.warmup_steps, position);
        if warmup > 0 && n <= warmup {
            let fraction = n as f64 / warmup as f64;
            return self.init_lr + (self.max_lr - self.init_lr) * fraction;
        }
        if self.decay == LrDecay::Constant {
            return self.max_lr;
        }
        if n > self.decay_steps {
            return self.min_lr;
        }
        let ratio = (n - warmup) as f64 / (self.decay_steps - warmup) as f64;
        let coefficient = match self.decay {
            LrDecay::Constant => 1.0,
            LrDecay::Linear => 1.0 - ratio,
            LrDecay::Cosine => cosine(ratio),
            LrDecay::InverseSquareRoot => {
                let lr = self.max_lr * (warmup.max(1) as f64 / n.max(1) as f64).sqrt();
                return lr.max(self.min_lr);
            }
            LrDecay::Wsd {
                anneal_steps,
                style,
            } => {
                let anneal_start = self.decay_steps - anneal_steps;
                if n <= anneal_start {
                    1.0
                } else {
                    style.coefficient((n - anneal_start) as f64 / anneal_steps as f64)
                }
            }
        };
        self.min_lr + coefficient * (self.max_lr - self.min_lr)
    }
}

/// Half a cosine period from 1 (at 0) to 0 (at 1).
fn cosine(ratio: f64) -> f64 {
    0.5 * (1.0 + (std::f64::consts::PI * ratio).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_errors() {
        assert!(LrSchedule::new(0.0, 0.0, 0, 10, LrDecay::Cosine).is_err());
        assert!(LrSchedule::new(1.0, 2.0, 0, 10, LrDecay::Cosine).is_err());
        assert!(LrSchedule::new(1.0, 0.1, 10, 10, LrDecay::Linear).is_err());
        assert!(LrSchedule::new(f64::NAN, 0.1, 1, 10, LrDecay::Linear).is_err());
        let wsd = |anneal_steps| LrDecay::Wsd {
            anneal_steps,
            style: WsdAnneal::Linear,
        };
        assert!(LrSchedule::new(1.0, 0.1, 2, 10, wsd(0)).is_err());
        assert!(LrSchedule::new(1.0, 0.1, 2, 10, wsd(9)).is_err());
        assert!(LrSchedule::new(1.0, 0.1, 2, 10, wsd(8)).is_ok());
        let schedule = LrSchedule::new(1.0, 0.1, 2, 10, LrDecay::Linear).unwrap();
        assert!(schedule.with_init_lr(1.5).is_err());
        assert!(schedule.with_init_lr(-0.1).is_err());
        assert!(schedule.with_init_lr(f64::INFINITY).is_err());
    }
}
