//! Optimizer steps and user-defined ops on devices equal the CPU (see support/device.rs
//! for the device list).

#[path = "support/device.rs"]
mod device;

use std::sync::Arc;

use ferrotron_tape::{
    AdamW, AdamWConfig, CustomOp, Device, Generator, Optimizer, Parameter, Result, Sgd, SgdConfig,
    Tape, Tensor,
};

/// Parameters after `steps` steps of `optimizer` on `loss = Σ (w·x − 1)²` with `w` on
/// `device`; the gradient changes every step, so buffers and moments are exercised.
fn train(
    device: Device,
    steps: usize,
    make: &dyn Fn(Vec<Parameter<f64>>) -> Box<dyn Optimizer<f64>>,
) -> Result<Vec<f64>> {
    let mut generator = Generator::new(11);
    let w0 = Tensor::<f64>::uniform(&[4, 3], -1.0, 1.0, &mut generator);
    let x = Tensor::<f64>::uniform(&[3, 5], -1.0, 1.0, &mut generator).to_device(device)?;
    let w = Parameter::new("w", w0.to_device(device)?);
    let mut optimizer = make(vec![w.clone()]);
    for _ in 0..steps {
        let tape = Tape::new();
        let y = tape.watch(&w)?.matmul(&x)?;
        let ones = Tensor::ones(y.shape()).to_device(device)?;
        let r = y.sub(&ones)?;
        r.mul(&r)?.sum()?.backward()?;
        optimizer.step()?;
        optimizer.zero_grad();
    }
    assert_eq!(w.device(), device);
    w.value()?.to_vec()
}

fn compare(name: &str, make: &dyn Fn(Vec<Parameter<f64>>) -> Box<dyn Optimizer<f64>>) {
    let cpu = train(Device::Cpu, 5, make).unwrap();
    for device in device::devices() {
        let got = train(device, 5, make).unwrap_or_else(|e| panic!("{name} on {device}: {e}"));
        let diff = got
            .iter()
            .zip(&cpu)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            diff < 1e-12,
            "{name} on {device}: parameters differ by {diff}"
        );
    }
}

#[test]
fn sgd_variants_match_the_cpu() {
    let configs = [
        SgdConfig::new(0.1),
        SgdConfig {
            weight_decay: 0.01,
            ..SgdConfig::new(0.1)
        },
        SgdConfig {
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            ..SgdConfig::new(0.05)
        },
        SgdConfig {
            momentum: 0.9,
            nesterov: true,
            ..SgdConfig::new(0.05)
        },
    ];
    for config in configs {
        compare(&format!("{config:?}"), &move |p| {
            Box::new(Sgd::new(p, config).unwrap())
        });
    }
}

#[test]
fn adamw_matches_the_cpu() {
    let config = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    compare("adamw", &move |p| Box::new(AdamW::new(p, config).unwrap()));
}

#[test]
fn optimizer_does_not_change_values_handed_out_before_the_step() {
    let w = Parameter::new(
        "w",
        Tensor::<f64>::ones(&[2])
            .to_device(Device::Emulated)
            .unwrap(),
    );
    let before = w.value().unwrap();
    w.set_grad(Some(
        Tensor::ones(&[2]).to_device(Device::Emulated).unwrap(),
    ))
    .unwrap();
    Sgd::new(vec![w.clone()], SgdConfig::new(0.5))
        .unwrap()
        .step()
        .unwrap();
    assert_eq!(before.to_vec().unwrap(), vec![1.0, 1.0]);
    assert_eq!(w.value().unwrap().to_vec().unwrap(), vec![0.5, 0.5]);
}

/// `2·x`, computed by user code with tensor ops (which run on the input's device).
struct Double;

impl CustomOp<f64> for Double {
    fn name(&self) -> &str {
        "double"
    }
    fn forward(&self, inputs: &[Tensor<f64>], _: &mut Vec<Tensor<f64>>) -> Result<Tensor<f64>> {
        inputs[0].scale(2.0)
    }
    fn backward(&self, grad: &Tensor<f64>, _: &[Tensor<f64>]) -> Result<Vec<Option<Tensor<f64>>>> {
        Ok(vec![Some(grad.scale(2.0)?)])
    }
}

#[test]
fn custom_ops_run_on_the_inputs_device() {
    device::check::<f64>("custom op", device::Inputs::new(&[&[3, 2]]), 1e-12, |x| {
        Tensor::apply(Arc::new(Double), &[&x[0]])?.exp()
    });
}
