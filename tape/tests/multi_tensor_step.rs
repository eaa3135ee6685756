//! AdamW on a device updates its parameters together, up to 48 to a launch (a
//! multi-tensor step), with each parameter's own options and step count, and gives the
//! CPU's numbers: parameters of many sizes (empty ones too), some without a gradient in
//! some steps, over more parameters than one launch takes.

#[path = "support/device.rs"]
mod device;

use ferrotron_tape::profile;
use ferrotron_tape::{
    AdamW, AdamWConfig, Device, Generator, Optimizer, ParamOptions, Parameter, Tensor,
};

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

const PARAMS: usize = 100;
const STEPS: usize = 3;

fn shape(i: usize) -> Vec<usize> {
    match i % 4 {
        0 => vec![i % 7 + 1, 3],
        1 => vec![i % 5],
        2 => vec![1],
        _ => vec![2, i % 3 + 1, 2],
    }
}

/// The values after `STEPS` steps on `device`, and the launches of the last step.
fn train(device: Device) -> AnyResult<(Vec<Vec<f32>>, u64)> {
    let mut generator = Generator::new(8);
    let params: Vec<Parameter> = (0..PARAMS)
        .map(|i| {
            let value: Tensor = Tensor::randn(&shape(i), 1.0, &mut generator);
            Ok(Parameter::new(format!("p{i}"), value.to_device(device)?))
        })
        .collect::<ferrotron_tape::Result<_>>()?;
    let config = AdamWConfig {
        lr: 1e-2,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut adamw =
        AdamW::new(params.clone(), config)?.with_param_options(ParamOptions::megatron_groups);
    let mut launches = 0;
    for step in 0..STEPS {
        for (i, param) in params.iter().enumerate() {
            // Every seventh parameter skips the middle step: its step count falls behind.
            let grad =
                (step != 1 || i % 7 != 0).then(|| Tensor::randn(&shape(i), 1.0, &mut generator));
            param.set_grad(grad.map(|g| g.to_device(device)).transpose()?)?;
        }
        profile::start(device);
        adamw.step()?;
        launches = profile::finish()?.total().launches;
    }
    let values = params
        .iter()
        .map(|p| p.value()?.to_vec())
        .collect::<ferrotron_tape::Result<_>>()?;
    Ok((values, launches))
}

#[test]
fn a_device_step_is_a_few_launches_with_the_cpus_numbers() -> Result<(), Box<dyn std::error::Error>>
{
    let (cpu, _) = train(Device::Cpu)?;
    for device in device::devices() {
        let (values, launches) = train(device)?;
        assert_eq!(values, cpu, "on {device}");
        // 100 parameters, 48 to a launch.
        assert_eq!(launches, 3, "on {device}");
    }
    Ok(())
}

/// A parameter listed twice is updated twice on a device, as on the CPU (the gathered
/// updates run before its second one).
#[test]
fn a_parameter_listed_twice_is_updated_twice() -> AnyResult<()> {
    let run = |device: Device| -> AnyResult<Vec<f32>> {
        let param = Parameter::new(
            "p",
            Tensor::from_vec(vec![1.0f32, -2.0], &[2])?.to_device(device)?,
        );
        let mut adamw = AdamW::new(vec![param.clone(), param.clone()], AdamWConfig::default())?;
        for _ in 0..2 {
            param.set_grad(Some(
                Tensor::from_vec(vec![0.5f32, 0.25], &[2])?.to_device(device)?,
            ))?;
            adamw.step()?;
        }
        Ok(param.value()?.to_vec()?)
    };
    let cpu = run(Device::Cpu)?;
    for device in device::devices() {
        assert_eq!(run(device)?, cpu, "on {device}");
    }
    Ok(())
}
