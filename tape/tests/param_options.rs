//! Per-parameter learning-rate and weight-decay multipliers: a parameter with options
//! follows exactly the trajectory of an optimizer whose config has those values folded
//! in, on the CPU and on the emulated device; vectors get no decay by the usual default.

use ferrotron_tape::{
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
            let value = param.value()?;
            param.set_grad(Some(value.mul(&value)?.sub(&value.scale(0.3)?)?))?;
        }
        optimizer.step()?;
    }
    Ok(optimizer
        .params()
        .iter()
        .map(|p| p.value()?.to_vec())
        .collect::<std::result::Result<_, _>>()?)
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
    // Nesterov momentum takes no dampening (torch.optim.SGD refuses the pair).
    nesterov: false,
};

/// The matrix with lr × 0.5; the vector with no weight decay.
fn options(param: &Parameter) -> ParamOptions {
    if param.name() == "w" {
        ParamOptions {
            lr_mult: 0.5,
            wd_mult: 1.0,
        }
    } else {
        ParamOptions::megatron_groups(param)
    }
}

#[test]
fn options_equal_a_config_with_the_multipliers_folded_in() -> AnyResult {
    for device in [Device::Cpu, Device::Emulated] {
        let grouped =
            train(&mut AdamW::new(parameters(device)?, ADAMW)?.with_param_options(options))?;
        let [w, b]: [Parameter; 2] = parameters(device)?.try_into().expect("two parameters");
        let w_alone = train(&mut AdamW::new(vec![w], AdamWConfig { lr: 0.05, ..ADAMW })?)?;
        let b_alone = train(&mut AdamW::new(
            vec![b],
            AdamWConfig {
                weight_decay: 0.0,
                ..ADAMW
            },
        )?)?;
        assert_eq!(grouped, [w_alone, b_alone].concat(), "AdamW on {device:?}");

        let grouped = train(&mut Sgd::new(parameters(device)?, SGD)?.with_param_options(options))?;
        let [w, b]: [Parameter; 2] = parameters(device)?.try_into().expect("two parameters");
        let w_alone = train(&mut Sgd::new(vec![w], SgdConfig { lr: 0.05, ..SGD })?)?;
        let b_alone = train(&mut Sgd::new(
            vec![b],
            SgdConfig {
                weight_decay: 0.0,
                ..SGD
            },
        )?)?;
        assert_eq!(grouped, [w_alone, b_alone].concat(), "SGD on {device:?}");
    }
    Ok(())
}

/// Megatron-Core's `_get_param_groups`: a name ending in `.bias` or one dimension means
/// no decay, whatever else holds; everything else is decayed.
#[test]
fn megatron_groups_skip_decay_for_biases_and_vectors() {
    let decay = |name: &str, shape: &[usize]| {
        let param: Parameter = Parameter::new(name, Tensor::zeros(shape));
        let options = ParamOptions::megatron_groups(&param);
        assert_eq!(options.lr_mult, 1.0, "{name}");
        options.wd_mult
    };
    // A 2-D weight is decayed; a `.bias` of two dimensions is not.
    assert_eq!(decay("block0.mlp.fc1.weight", &[4, 3]), 1.0);
    assert_eq!(decay("adapter.bias", &[4, 3]), 0.0);
    // A 1-D weight (a norm's) is not decayed, nor a 1-D bias.
    assert_eq!(decay("block0.ln1.weight", &[3]), 0.0);
    assert_eq!(decay("block0.mlp.fc1.bias", &[3]), 0.0);
    // Only the suffix counts: `.bias` inside a name, or `bias` without the dot, is not it.
    assert_eq!(decay("bias_proj.weight", &[2, 2]), 1.0);
    assert_eq!(decay("unbias", &[2, 2]), 1.0);
    // Scalars and 3-D tensors are decayed, as in Megatron (only `len(shape) == 1` is).
    assert_eq!(decay("temperature", &[]), 1.0);
    assert_eq!(decay("conv.weight", &[2, 2, 2]), 1.0);
}

#[test]
fn slices_of_different_lengths_are_refused() {
    let update = ferrotron_tape::AdamWUpdate::new(&ADAMW, ParamOptions::default(), 1);
    let (mut values, mut m, mut v) = (vec![1.0f32; 3], vec![0.0; 3], vec![0.0; 2]);
    let err = update
        .apply(&mut values, &[0.5; 3], &mut m, &mut v)
        .unwrap_err();
    assert!(err.to_string().contains("one length"), "{err}");
    let sgd = ferrotron_tape::SgdUpdate::new(&SGD, ParamOptions::default());
    let err = sgd
        .apply(&mut values, &[0.5; 2], &mut [0.0; 3], false)
        .unwrap_err();
    assert!(err.to_string().contains("one length"), "{err}");
    assert_eq!(values, vec![1.0; 3], "a refused update changes nothing");
}
