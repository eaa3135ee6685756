//! Optimizer state and learning-rate schedules: saving an optimizer's state and loading it
//! into a fresh optimizer continues bit-identically, on the CPU and on a device, and the
//! schedule's position travels with it.

use ferrotron_tape::{
    AdamW, AdamWConfig, Device, LrDecay, LrSchedule, Optimizer, Parameter, Sgd, SgdConfig, Tensor,
};

#[path = "support/optimizers.rs"]
mod optimizers;

use optimizers::parameters;

type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// A gradient that depends on the value, so that the trajectory depends on every step.
fn step(optimizer: &mut dyn Optimizer) -> AnyResult {
    for param in optimizer.params() {
        let value = param.value()?;
        param.set_grad(Some(value.mul(&value)?.sub(&value.scale(0.3)?)?))?;
    }
    Ok(optimizer.step()?)
}

fn values(params: &[Parameter]) -> AnyResult<Vec<Vec<f32>>> {
    Ok(params
        .iter()
        .map(|p| p.value()?.to_vec())
        .collect::<std::result::Result<_, _>>()?)
}

type Build = fn(Vec<Parameter>) -> Box<dyn Optimizer>;

fn optimizers() -> Vec<(&'static str, Build)> {
    vec![
        ("adamw", |params| {
            Box::new(
                AdamW::new(params, AdamWConfig::default())
                    .unwrap()
                    .with_schedule(LrSchedule::new(0.1, 0.01, 2, 6, LrDecay::Cosine).unwrap()),
            )
        }),
        ("sgd-momentum", |params| {
            let config = SgdConfig {
                momentum: 0.9,
                weight_decay: 0.01,
                ..SgdConfig::new(0.05)
            };
            Box::new(
                Sgd::new(params, config)
                    .unwrap()
                    .with_schedule(LrSchedule::new(0.05, 0.0, 1, 5, LrDecay::Linear).unwrap()),
            )
        }),
    ]
}

#[test]
fn a_loaded_state_continues_bit_identically() -> AnyResult {
    for device in [Device::Cpu, Device::Emulated] {
        for (name, build) in optimizers() {
            let params = parameters(device)?;
            let mut original = build(params.clone());
            for _ in 0..3 {
                step(original.as_mut())?;
            }
            let state = original.state()?;
            let saved_values = values(&params)?;
            for _ in 0..3 {
                step(original.as_mut())?;
            }

            let resumed_params = parameters(device)?;
            for (param, value) in resumed_params.iter().zip(&saved_values) {
                let tensor = Tensor::from_vec(value.clone(), &param.shape())?;
                param.set_value(tensor.to_device(device)?)?;
            }
            let mut resumed = build(resumed_params.clone());
            resumed.load_state(&state)?;
            assert_eq!(state.steps, 3, "{name} on {device}");
            assert_eq!(resumed.lr(), original_lr_at(name, 3), "{name} on {device}");
            for _ in 0..3 {
                step(resumed.as_mut())?;
            }
            assert_eq!(
                values(&resumed_params)?,
                values(&params)?,
                "{name} on {device}"
            );

            // Without the state the same steps give other values: the test can fail.
            let fresh_params = parameters(device)?;
            for (param, value) in fresh_params.iter().zip(&saved_values) {
                let tensor = Tensor::from_vec(value.clone(), &param.shape())?;
                param.set_value(tensor.to_device(device)?)?;
            }
            let mut fresh = build(fresh_params.clone());
            for _ in 0..3 {
                step(fresh.as_mut())?;
            }
            assert_ne!(
                values(&fresh_params)?,
                values(&params)?,
                "{name} on {device}"
            );
        }
    }
    Ok(())
}

/// The learning rate each test optimizer's schedule gives at `position` (after that
/// many steps).
fn original_lr_at(name: &str, position: u64) -> f64 {
    let schedule = match name {
        "adamw" => LrSchedule::new(0.1, 0.01, 2, 6, LrDecay::Cosine),
        _ => LrSchedule::new(0.05, 0.0, 1, 5, LrDecay::Linear),
    };
    schedule.unwrap().lr(position)
}

#[test]
fn a_state_for_other_parameters_is_an_error() -> AnyResult {
    let params = parameters(Device::Cpu)?;
    let mut adamw = AdamW::new(params.clone(), AdamWConfig::default())?;
    step(&mut adamw)?;
    let state = adamw.state()?;

    let mut fewer = AdamW::new(params[..1].to_vec(), AdamWConfig::default())?;
    assert!(matches!(
        fewer.load_state(&state),
        Err(ferrotron_tape::Error::InvalidArgument { .. })
    ));
    let mut sgd = Sgd::new(params.clone(), SgdConfig::new(0.1))?;
    assert!(matches!(
        sgd.load_state(&state),
        Err(ferrotron_tape::Error::InvalidArgument { .. })
    ));
    let reshaped = vec![params[1].clone(), params[0].clone()];
    let mut swapped = AdamW::new(reshaped, AdamWConfig::default())?;
    assert!(matches!(
        swapped.load_state(&state),
        Err(ferrotron_tape::Error::Shape { .. })
    ));
    Ok(())
}

#[test]
fn the_schedule_sets_each_steps_learning_rate() -> AnyResult {
    let param = Parameter::new("x", Tensor::from_vec(vec![0.0f32], &[1])?);
    let schedule = LrSchedule::new(1.0, 0.0, 2, 4, LrDecay::Linear)?;
    let mut sgd = Sgd::new(vec![param.clone()], SgdConfig::new(123.0))?.with_schedule(schedule);
    let mut moves = Vec::new();
    for _ in 0..5 {
        let before = param.value()?.to_vec()?[0];
        param.set_grad(Some(Tensor::from_vec(vec![-1.0], &[1])?))?;
        assert_eq!(sgd.lr(), schedule.lr(moves.len() as u64));
        sgd.step()?;
        moves.push(param.value()?.to_vec()?[0] - before);
    }
    // Plain SGD moves by lr · 1: the schedule's 0, 0.5, 1, 0.5, 0 (positions 0 to 4), not
    // the config's 123.
    assert_eq!(moves, [0.0, 0.5, 1.0, 0.5, 0.0]);
    Ok(())
}
