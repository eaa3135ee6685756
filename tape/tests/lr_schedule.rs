//! Learning-rate schedules against closed forms written out here, at every position, and
//! optimizers that take the k-th update's rate from position k − 1 (Megatron's
//! `OptimizerParamScheduler`, PyTorch's `LambdaLR`).

use std::f64::consts::PI;

use ferrotron_tape::{
    AdamW, AdamWConfig, LrDecay, LrSchedule, Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor,
    WsdAnneal,
};

const INIT: f64 = 0.1;
const PEAK: f64 = 1.0;
const FLOOR: f64 = 0.2;
const WARMUP: u64 = 4;
const DECAY: u64 = 16;

/// Megatron's curve, piece by piece, for the settings above: the warm-up from `INIT`,
/// then `tail(n)` (the decay's own formula) until `DECAY`, then the floor.
fn reference(n: u64, tail: impl Fn(f64) -> f64) -> f64 {
    let n_f = n as f64;
    if n <= WARMUP {
        INIT + (PEAK - INIT) * n_f / WARMUP as f64
    } else if n <= DECAY {
        tail(n_f)
    } else {
        FLOOR
    }
}

/// Where the decay stands between the warm-up's end and `DECAY`, from 0 to 1.
fn progress(n: f64) -> f64 {
    (n - WARMUP as f64) / (DECAY - WARMUP) as f64
}

fn between(coefficient: f64) -> f64 {
    FLOOR + coefficient * (PEAK - FLOOR)
}

fn check(decay: LrDecay, expected: impl Fn(u64) -> f64) {
    let schedule = LrSchedule::new(PEAK, FLOOR, WARMUP, DECAY, decay)
        .and_then(|s| s.with_init_lr(INIT))
        .expect("valid settings");
    for n in 0..=DECAY + 5 {
        let (got, want) = (schedule.lr(n), expected(n));
        assert!(
            (got - want).abs() <= 1e-14,
            "{decay:?} at position {n}: {got}, expected {want}"
        );
    }
}

#[test]
fn warmup_then_constant() {
    check(LrDecay::Constant, |n| {
        if n <= WARMUP {
            reference(n, |_| unreachable!())
        } else {
            PEAK
        }
    });
}

#[test]
fn warmup_then_linear() {
    check(LrDecay::Linear, |n| {
        reference(n, |n| between(1.0 - progress(n)))
    });
}

#[test]
fn warmup_then_cosine() {
    check(LrDecay::Cosine, |n| {
        reference(n, |n| between((1.0 + (PI * progress(n)).cos()) / 2.0))
    });
}

#[test]
fn warmup_then_inverse_square_root() {
    check(LrDecay::InverseSquareRoot, |n| {
        reference(n, |n| (PEAK * (WARMUP as f64 / n).sqrt()).max(FLOOR))
    });
    // Without warm-up the curve starts at the peak (position 0 counts as 1).
    let schedule = LrSchedule::new(PEAK, 0.0, 0, 100, LrDecay::InverseSquareRoot).unwrap();
    assert_eq!((schedule.lr(0), schedule.lr(1)), (PEAK, PEAK));
    assert_eq!(schedule.lr(4), PEAK / 2.0);
    assert_eq!(schedule.lr(101), 0.0);
}

#[test]
fn warmup_stable_decay() {
    const ANNEAL: u64 = 5;
    let start = (DECAY - ANNEAL) as f64;
    type Shape = fn(f64) -> f64;
    let styles: [(WsdAnneal, Shape); 4] = [
        (WsdAnneal::Linear, |r| 1.0 - r),
        (WsdAnneal::Cosine, |r| (1.0 + (PI * r).cos()) / 2.0),
        (WsdAnneal::Exponential, |r| 2.0 * 0.5f64.powf(r) - 1.0),
        (WsdAnneal::MinusSqrt, |r| 1.0 - r.sqrt()),
    ];
    for (style, shape) in styles {
        let decay = LrDecay::Wsd {
            anneal_steps: ANNEAL,
            style,
        };
        check(decay, |n| {
            reference(n, |n| {
                if n <= start {
                    PEAK
                } else {
                    between(shape((n - start) / ANNEAL as f64))
                }
            })
        });
    }
}

/// With `init_lr` 0 (the default) the first update runs at rate 0, as Megatron's does.
#[test]
fn the_first_update_runs_at_the_initial_rate() {
    let schedule = LrSchedule::new(3e-3, 3e-4, 20, 500, LrDecay::Cosine).unwrap();
    assert_eq!(schedule.lr(0), 0.0);
    assert_eq!(schedule.lr(20), 3e-3);
    assert_eq!(schedule.lr(500), 3e-4);
    assert!(schedule.lr(499) > 3e-4);
}

/// `-loss` is `Σ w`: the gradient of every element is 1 at every step, so AdamW's
/// bias-corrected moments are exactly 1 and each update moves `w` by `lr / (1 + eps)`.
/// The rate of the k-th update, recovered from the move, is the curve at k − 1.
#[test]
fn adamw_takes_the_kth_rate_from_position_k_minus_1() {
    let schedule = LrSchedule::new(PEAK, FLOOR, WARMUP, DECAY, LrDecay::Cosine)
        .and_then(|s| s.with_init_lr(INIT))
        .unwrap();
    let param: Parameter<f64> = Parameter::new("w", Tensor::from_vec(vec![0.0; 3], &[3]).unwrap());
    let config = AdamWConfig {
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut adamw = AdamW::new(vec![param.clone()], config)
        .unwrap()
        .with_schedule(schedule);
    let rates = moves(&mut adamw, &param, DECAY + 3);
    for (k, rate) in (1..).zip(rates) {
        let (got, expected) = (adamw_rate_of(k, &rate), schedule.lr(k - 1));
        // Neighbouring positions differ by more than 0.01: the tolerance is only rounding.
        assert!(
            (got - expected).abs() < 1e-12,
            "update {k}: {got}, expected {expected}"
        );
    }
}

/// What AdamW's k-th move of `-lr / (1 + eps)` per element says the rate was.
fn adamw_rate_of(k: u64, moved: &[f64]) -> f64 {
    let rate = -moved[0] * (1.0 + AdamWConfig::default().eps);
    assert!(
        moved.iter().all(|&m| m == moved[0]),
        "update {k}: {moved:?}"
    );
    rate
}

/// SGD moves each element by exactly `-lr` for a gradient of 1.
#[test]
fn sgd_takes_the_kth_rate_from_position_k_minus_1() {
    let schedule = LrSchedule::new(PEAK, FLOOR, WARMUP, DECAY, LrDecay::Linear).unwrap();
    let param: Parameter<f64> = Parameter::new("w", Tensor::from_vec(vec![0.0; 2], &[2]).unwrap());
    let mut sgd = Sgd::new(vec![param.clone()], SgdConfig::new(99.0))
        .unwrap()
        .with_schedule(schedule);
    let rates = moves(&mut sgd, &param, DECAY + 3);
    for (k, moved) in (1..).zip(rates) {
        let expected = schedule.lr(k - 1);
        // `after - before` rounds; neighbouring positions differ by more than 0.01.
        assert!(
            moved.iter().all(|m| (m + expected).abs() < 1e-12),
            "update {k}: moved {moved:?}, expected -{expected} (the rate at position {})",
            k - 1
        );
    }
}

/// The change of `param` made by each of `steps` updates of `Σ param`, after checking
/// that the optimizer announced the rate it then used.
fn moves(optimizer: &mut dyn Optimizer<f64>, param: &Parameter<f64>, steps: u64) -> Vec<Vec<f64>> {
    (0..steps)
        .map(|_| {
            let before = param.value().unwrap().to_vec().unwrap();
            optimizer.zero_grad();
            let tape = Tape::new();
            tape.watch(param)
                .unwrap()
                .sum()
                .unwrap()
                .backward()
                .unwrap();
            optimizer.step().unwrap();
            let after = param.value().unwrap().to_vec().unwrap();
            after.iter().zip(&before).map(|(a, b)| a - b).collect()
        })
        .collect()
}

/// `torch.optim.AdamW` under `LambdaLR` with the same curve, fed the same gradients,
/// in f64 (values printed by `tests/fixtures/torch_adamw_lambdalr.py`, torch 2.15): the
/// parameters after each of 8 updates agree to rounding. The first update, at position
/// 0, is at rate 0 in both.
#[test]
fn adamw_on_a_schedule_equals_torch_adamw_under_lambdalr() {
    const TORCH: [[f64; 3]; 8] = [
        [0.5, -0.25, 1.0],
        [
            0.49502769460390533,
            -0.25485132758834594,
            0.9989850041798285,
        ],
        [
            0.48503250651115665,
            -0.26256226194358784,
            1.0035684482657643,
        ],
        [0.4763030524150761, -0.26535966636894176, 1.0099096513103638],
        [0.4713379476273476, -0.2644456143263434, 1.0157497160659756],
        [0.4701080299687487, -0.2626007521582629, 1.0194623407004195],
        [0.4703503737157752, -0.26134504500464184, 1.020676378856794],
        [0.47068689131200614, -0.260933078891175, 1.0207268714337336],
    ];
    let schedule = LrSchedule::new(1e-2, 1e-3, 2, 8, LrDecay::Cosine).unwrap();
    let start = Tensor::from_vec(vec![0.5, -0.25, 1.0], &[3]).unwrap();
    let w: Parameter<f64> = Parameter::new("w", start);
    let config = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        ..AdamWConfig::default()
    };
    let mut adamw = AdamW::new(vec![w.clone()], config)
        .unwrap()
        .with_schedule(schedule);
    for (k, expected) in (1..).zip(TORCH) {
        let grad: Vec<f64> = (0..3).map(|i| (0.7 * k as f64 + i as f64).sin()).collect();
        w.set_grad(Some(Tensor::from_vec(grad, &[3]).unwrap()))
            .unwrap();
        adamw.step().unwrap();
        let got = w.value().unwrap().to_vec().unwrap();
        for (g, e) in got.iter().zip(expected) {
            assert!(
                (g - e).abs() <= 1e-14,
                "update {k}: {got:?}, torch {expected:?}"
            );
        }
    }
}
