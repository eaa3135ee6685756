//! `GradScaler`: the scale's schedule (backoff down to its floor, growth after its
//! interval, never past f32), unscaling over a tensor-parallel group (once per step,
//! checking the divided values) (a non-finite gradient on one rank leaves
//! every rank's gradients as they were and tells every rank to skip; otherwise every
//! gradient is divided by the scale), the scaled loss, and typed errors for bad settings
//! and states.

use std::sync::Arc;

use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_layers::{GradScaler, GradScalerConfig, ShardedParameter, Sharding, TensorParallel};
use ferrotron_tape::{Parameter, Tape, Tensor};

type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn scaler(growth_interval: u32) -> GradScaler {
    GradScaler::new(GradScalerConfig {
        growth_interval,
        ..GradScalerConfig::default()
    })
    .expect("valid settings")
}

#[test]
fn the_scale_backs_off_grows_after_its_interval_and_stays_finite() {
    let mut s = scaler(3);
    let mut seen = Vec::new();
    for finite in [true, true, false, true, true, true, true] {
        s.update(finite);
        seen.push((s.scale(), s.state().growth_tracker));
    }
    let k = 65536.0;
    assert_eq!(
        seen,
        [
            (k, 1),
            (k, 2),
            (k / 2.0, 0),
            (k / 2.0, 1),
            (k / 2.0, 2),
            (k, 0),
            (k, 1)
        ]
    );

    // 2^126: its inverse is still a normal f32.
    let top = 2f64.powi(126);
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: top,
        growth_interval: 1,
        ..GradScalerConfig::default()
    })
    .unwrap();
    s.update(true);
    assert_eq!((s.scale(), s.state().growth_tracker), (top, 0));

    let mut restored = scaler(3);
    restored.load_state(s.state()).unwrap();
    assert_eq!(restored.state(), s.state());

    // Backoff stops at the floor: a model that overflows there skips steps at it.
    let mut s = GradScaler::new(GradScalerConfig {
        init_scale: 4.0,
        min_scale: 2.0,
        ..GradScalerConfig::default()
    })
    .unwrap();
    s.update(false);
    s.update(false);
    assert_eq!(s.scale(), 2.0);
}

#[test]
fn the_scaled_loss_carries_the_scale_into_the_gradients() -> AnyResult<()> {
    let s = scaler(2000);
    let w = Parameter::new("w", Tensor::from_vec(vec![1.5, -2.0], &[2])?);
    let tape = Tape::new();
    let loss = tape.watch(&w)?.mul(&tape.watch(&w)?)?.sum()?;
    s.scale_loss(&loss)?.backward()?;
    assert_eq!(w.grad().unwrap().to_vec()?, [3.0 * 65536.0, -4.0 * 65536.0]);
    Ok(())
}

/// Each of two tensor-parallel ranks holds a gradient `[1, 2] · 2^16 · (rank + 1)`, rank
/// 1's last element replaced by `bad` when given; what `unscale_grads` returns on each
/// rank, and the gradients after it.
fn unscale(bad: Option<f32>) -> AnyResult<Vec<(bool, Vec<f32>)>> {
    Ok(run_local(2, |comm| -> AnyResult<(bool, Vec<f32>)> {
        let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>);
        let w = Parameter::new("w", Tensor::zeros(&[2]));
        let r = tp.rank() as f32 + 1.0;
        let mut grad = vec![65536.0 * r, 2.0 * 65536.0 * r];
        if let (1, Some(bad)) = (tp.rank(), bad) {
            grad[1] = bad;
        }
        w.set_grad(Some(Tensor::from_vec(grad, &[2])?))?;
        // A parameter without a gradient takes no part.
        let idle = Parameter::new("idle", Tensor::zeros(&[1]));
        let params = [w.clone(), idle].map(|param| ShardedParameter {
            param,
            sharding: Sharding::Replicated,
            grad_reduce_group: None,
            shared_copy: false,
            expert: false,
        });
        let finite = scaler(2000).unscale_grads(&params, &tp, &[])?;
        Ok((finite, w.grad().unwrap().to_vec()?))
    })?)
}

#[test]
fn unscaling_divides_every_gradient_or_skips_on_every_rank() -> AnyResult<()> {
    assert_eq!(
        unscale(None)?,
        [(true, vec![1.0, 2.0]), (true, vec![2.0, 4.0])]
    );
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        let ranks = unscale(Some(bad))?;
        assert!(ranks.iter().all(|(finite, _)| !finite), "{bad}: {ranks:?}");
        assert_eq!(ranks[0].1, [65536.0, 131072.0], "{bad}: left as it was");
        assert_eq!(ranks[1].1[0], 131072.0, "{bad}: left as it was");
    }
    // The largest finite f32 is no overflow (a check by summing would call it one).
    let ranks = unscale(Some(f32::MAX))?;
    assert!(ranks.iter().all(|(finite, _)| *finite), "{ranks:?}");
    Ok(())
}

#[test]
fn unscaling_twice_in_a_step_is_an_error_and_the_check_sees_the_divided_values() -> AnyResult<()> {
    run_local(1, |comm| -> AnyResult<()> {
        let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>);
        let w = Parameter::new("w", Tensor::zeros(&[1]));
        let params = [ShardedParameter {
            param: w.clone(),
            sharding: Sharding::Replicated,
            grad_reduce_group: None,
            shared_copy: false,
            expert: false,
        }];
        // Below 1, dividing multiplies: f32::MAX / 0.5 overflows after the division.
        let mut s = GradScaler::new(GradScalerConfig {
            init_scale: 0.5,
            min_scale: 0.5,
            ..GradScalerConfig::default()
        })?;
        w.set_grad(Some(Tensor::from_vec(vec![f32::MAX], &[1])?))?;
        assert!(!s.unscale_grads(&params, &tp, &[])?);
        let err = s.unscale_grads(&params, &tp, &[]).unwrap_err();
        assert!(err.to_string().contains("unscaled already"), "{err}");
        s.update(false);
        w.set_grad(Some(Tensor::from_vec(vec![1.0], &[1])?))?;
        assert!(
            s.unscale_grads(&params, &tp, &[])?,
            "a new step after update"
        );
        assert_eq!(w.grad().unwrap().to_vec()?, [2.0]);
        Ok(())
    })?;
    Ok(())
}

#[test]
fn bad_settings_and_states_are_typed_errors() {
    let bad = [
        GradScalerConfig {
            init_scale: 0.0,
            ..Default::default()
        },
        GradScalerConfig {
            init_scale: 1e39,
            ..Default::default()
        },
        // Zero in f32, and an infinite inverse.
        GradScalerConfig {
            init_scale: 1e-50,
            min_scale: 1e-50,
            ..Default::default()
        },
        GradScalerConfig {
            min_scale: 0.0,
            ..Default::default()
        },
        GradScalerConfig {
            init_scale: 0.5,
            ..Default::default()
        },
        GradScalerConfig {
            growth_factor: 1.0,
            ..Default::default()
        },
        GradScalerConfig {
            growth_factor: f64::INFINITY,
            ..Default::default()
        },
        GradScalerConfig {
            backoff_factor: 1.0,
            ..Default::default()
        },
        GradScalerConfig {
            backoff_factor: 0.0,
            ..Default::default()
        },
        GradScalerConfig {
            growth_interval: 0,
            ..Default::default()
        },
    ];
    for config in bad {
        let err = GradScaler::new(config).unwrap_err();
        assert!(err.to_string().contains("GradScaler"), "{config:?}: {err}");
    }
    let mut s = scaler(2000);
    for scale in [f64::INFINITY, 0.0, -1.0, 1e39, 0.5] {
        let mut state = s.state();
        state.scale = scale;
        assert!(s.load_state(state).is_err(), "{scale}");
    }
    assert_eq!(s.scale(), 65536.0, "a refused state changes nothing");
}
