//! Learning-rate schedules, as Megatron-Core's `OptimizerParamScheduler`: a linear
//! warm-up from zero, then a constant, linear or cosine decay to a floor.

use crate::{Error, Result};

/// How the learning rate falls after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LrDecay {
    /// Stays at the peak.
    Constant,
    /// Falls linearly from the peak to the floor.
    Linear,
    /// Falls along half a cosine period from the peak to the floor.
    Cosine,
}

/// The learning rate of every optimizer step, given to an optimizer with
/// [`AdamW::with_schedule`](crate::AdamW::with_schedule) or
/// [`Sgd::with_schedule`](crate::Sgd::with_schedule). It depends on the step alone, so a
/// run resumed from a checkpoint (which keeps the step count) continues on the same curve.
///
/// ```
/// use tape::{LrDecay, LrSchedule};
///
/// // 10 warm-up steps to 1e-3, cosine decay to 1e-4 at step 100, 1e-4 after it.
/// let schedule = LrSchedule::new(1e-3, 1e-4, 10, 100, LrDecay::Cosine)?;
/// assert!((schedule.lr(5) - 5e-4).abs() < 1e-15);
/// assert_eq!(schedule.lr(10), 1e-3);
/// assert!((schedule.lr(55) - 5.5e-4).abs() < 1e-12);
/// assert_eq!(schedule.lr(100), 1e-4);
/// assert_eq!(schedule.lr(1000), 1e-4);
/// # Ok::<(), tape::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    max_lr: f64,
    min_lr: f64,
    warmup_steps: u64,
    decay_steps: u64,
    decay: LrDecay,
}

impl LrSchedule {
    /// Warms up linearly over `warmup_steps` (step `s` ≤ `warmup_steps` gets
    /// `max_lr · s / warmup_steps`), then decays to `min_lr` at step `decay_steps` and
    /// stays there. `decay_steps` counts from the first step, warm-up included, and must
    /// exceed `warmup_steps` unless the decay is [`LrDecay::Constant`].
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
        Ok(LrSchedule {
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

    /// The learning rate of optimizer step `step`, counted from 1.
    pub fn lr(&self, step: u64) -> f64 {
        if step <= self.warmup_steps {
            return self.max_lr * step as f64 / self.warmup_steps as f64;
        }
        let ratio = match self.decay {
            LrDecay::Constant => return self.max_lr,
            _ if step >= self.decay_steps => return self.min_lr,
            _ => (step - self.warmup_steps) as f64 / (self.decay_steps - self.warmup_steps) as f64,
        };
        let coefficient = match self.decay {
            LrDecay::Linear => 1.0 - ratio,
            _ => 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()),
        };
        self.min_lr + coefficient * (self.max_lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn megatron_curves() {
        let linear = LrSchedule::new(1.0, 0.0, 2, 6, LrDecay::Linear).unwrap();
        let values: Vec<f64> = (1..=7).map(|s| linear.lr(s)).collect();
        assert_eq!(values, [0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]);
        let cosine = LrSchedule::new(2.0, 1.0, 0, 4, LrDecay::Cosine).unwrap();
        let values: Vec<f64> = (1..=5).map(|s| cosine.lr(s)).collect();
        let expected = [1.0 + 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos()), 1.5];
        assert!((values[0] - expected[0]).abs() < 1e-15 && values[1] == expected[1]);
        assert_eq!(values[3..], [1.0, 1.0]);
        let constant = LrSchedule::new(3.0, 0.0, 3, 0, LrDecay::Constant).unwrap();
        assert_eq!(
            (constant.lr(3), constant.lr(4), constant.lr(1000)),
            (3.0, 3.0, 3.0)
        );
    }

    #[test]
    fn bad_settings_are_errors() {
        assert!(LrSchedule::new(0.0, 0.0, 0, 10, LrDecay::Cosine).is_err());
        assert!(LrSchedule::new(1.0, 2.0, 0, 10, LrDecay::Cosine).is_err());
        assert!(LrSchedule::new(1.0, 0.1, 10, 10, LrDecay::Linear).is_err());
        assert!(LrSchedule::new(f64::NAN, 0.1, 1, 10, LrDecay::Linear).is_err());
    }
}
