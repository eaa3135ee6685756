//! Per-parameter learning-rate and weight-decay multipliers: a parameter with options
//! follows exactly the trajectory of an optimizer whose config has those values folded
//! in, on the CPU and on the emulated device; vectors get no decay by the usual default.

use tape::{
    AdamW, AdamWConfig, Device, Optimizer, ParamOptions, Parameter, Sgd, SgdConfig, Tensor,
};

#[path = "support/optimizers.rs"]
mod optimizers;

use optimizers::parameters;

type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Three steps with a gradient that depends on the value; the final values.
fn train(optimizer: &mut dyn Optimizer) -> AnyResult<Vec<Vec<f32>>> {
    for _ in 0..3 {
        for param in optimizer.params() {
            let value = param.value();
            param.set_grad(Some(value.mul(&value)?.sub(&value.scale(0.3)?)?))?;
        }
        optimizer.step()?;
    }
    Ok(optimizer
        .params()
        .iter()
        .map(|p| p.value().to_vec())
        .collect::<Result<_, _>>()?)
}

const ADAMW: AdamWConfig = AdamWConfig {
    lr: 0.1,
    betas: (0.9, 0.99),
    eps: 1e-8,
    weight_decay: 0.5,
};

const SGD: SgdConfig = SgdConfig {
    lr: 0.1,
    momentum: 0.9,
    weight_decay: 0.5,
    dampening: 0.1,
    nesterov: true,
};

/// The matrix with lr × 0.5; the vector with no weight decay.
fn options(param: &Parameter) -> ParamOptions {
    if param.name() == "w" {
        ParamOptions {
            lr_mult: 0.5,
            wd_mult: 1.0,
        }
    } else {
        ParamOptions::no_decay_for_vectors(param)
    }
}

#[test]
fn options_equal_a_config_with_the_multipliers_folded_in() -> AnyResult {
    for device in [Device::Cpu, Device::Emulated] {
        let grouped =
            train(&mut AdamW::new(parameters(device)?, ADAMW).with_param_options(options))?;
        let [w, b]: [Parameter; 2] = parameters(device)?.try_into().expect("two parameters");
        let w_alone = train(&mut AdamW::new(vec![w], AdamWConfig { lr: 0.05, ..ADAMW }))?;
        let b_alone = train(&mut AdamW::new(
            vec![b],
            AdamWConfig {
                weight_decay: 0.0,
                ..ADAMW
            },
        ))?;
        assert_eq!(grouped, [w_alone, b_alone].concat(), "AdamW on {device:?}");

        let grouped = train(&mut Sgd::new(parameters(device)?, SGD).with_param_options(options))?;
        let [w, b]: [Parameter; 2] = parameters(device)?.try_into().expect("two parameters");
        let w_alone = train(&mut Sgd::new(vec![w], SgdConfig { lr: 0.05, ..SGD }))?;
        let b_alone = train(&mut Sgd::new(
            vec![b],
            SgdConfig {
                weight_decay: 0.0,
                ..SGD
            },
        ))?;
        assert_eq!(grouped, [w_alone, b_alone].concat(), "SGD on {device:?}");
    }
    Ok(())
}

#[test]
fn vectors_get_no_decay_and_matrices_full_decay_by_default() {
    let matrix: Parameter = Parameter::new("w", Tensor::zeros(&[2, 3]));
    let vector: Parameter = Parameter::new("b", Tensor::zeros(&[3]));
    let scalar: Parameter = Parameter::new("s", Tensor::zeros(&[]));
    assert_eq!(
        ParamOptions::no_decay_for_vectors(&matrix),
        ParamOptions::default()
    );
    for param in [vector, scalar] {
        let options = ParamOptions::no_decay_for_vectors(&param);
        assert_eq!(
            (options.lr_mult, options.wd_mult),
            (1.0, 0.0),
            "{}",
            param.name()
        );
    }
}

#[test]
fn slices_of_different_lengths_are_refused() {
    let update = tape::AdamWUpdate::new(&ADAMW, ParamOptions::default(), 1);
    let (mut values, mut m, mut v) = (vec![1.0f32; 3], vec![0.0; 3], vec![0.0; 2]);
    let err = update
        .apply(&mut values, &[0.5; 3], &mut m, &mut v)
        .unwrap_err();
    assert!(err.to_string().contains("one length"), "{err}");
    let sgd = tape::SgdUpdate::new(&SGD, ParamOptions::default());
    let err = sgd
        .apply(&mut values, &[0.5; 2], &mut [0.0; 3], false)
        .unwrap_err();
    assert!(err.to_string().contains("one length"), "{err}");
    assert_eq!(values, vec![1.0; 3], "a refused update changes nothing");
}
