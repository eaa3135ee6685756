//! Fused elementwise ops give exactly the numbers of the ops they fuse (each rounded to
//! its storage format in between), on every device and in every format, and on a device
//! run as one kernel.

#[path = "support/device.rs"]
mod device;

use device::{check, devices, Inputs};
use ferrotron_tape::profile;
use ferrotron_tape::{DType, Device, Gelu, Generator, Parameter, Result, Tape, Tensor};

/// The output and both inputs' gradients of `f(x, bias)` with the inputs stored as
/// `dtype` on `device`, for `loss = Σ out · weights`.
fn run(
    device: Device,
    dtype: DType,
    f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Vec<Vec<f32>>> {
    let mut generator = Generator::new(4);
    let param = |shape: &[usize], generator: &mut Generator| -> Result<Parameter> {
        let value = Tensor::uniform(shape, -3.0, 3.0, generator).to_dtype(dtype)?;
        Ok(Parameter::new("p", value.to_device(device)?))
    };
    let (x, bias) = (
        param(&[5, 3, 33], &mut generator)?,
        param(&[33], &mut generator)?,
    );
    let tape = Tape::new();
    let out = f(&tape.watch(&x), &tape.watch(&bias))?;
    let weights: Tensor = Tensor::uniform(out.shape(), 0.5, 1.5, &mut generator);
    (out.to_dtype(DType::F32)?
        .mul(&weights.to_device(device)?)?
        .sum()?)
    .backward()?;
    let grad = |p: &Parameter| p.grad().expect("a gradient").to_vec();
    Ok(vec![out.to_vec()?, grad(&x)?, grad(&bias)?])
}

#[test]
fn bias_gelu_is_add_then_gelu_exactly() -> Result<()> {
    for device in [Device::Cpu].into_iter().chain(devices()) {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for gelu in [Gelu::Erf, Gelu::Tanh] {
                let fused = run(device, dtype, |x, b| x.bias_gelu(b, gelu))?;
                let composed = run(device, dtype, |x, b| x.add(b)?.gelu(gelu))?;
                assert_eq!(fused, composed, "{dtype} {gelu:?} on {device}");
            }
        }
    }
    Ok(())
}

#[test]
fn bias_gelu_matches_the_cpu() {
    check::<f64>("bias_gelu", Inputs::new(&[&[7, 40], &[40]]), 1e-12, |x| {
        x[0].bias_gelu(&x[1], Gelu::Tanh)
    });
    check::<f32>(
        "bias_gelu f32",
        Inputs::new(&[&[2, 3, 17], &[17]]),
        1e-5,
        |x| x[0].bias_gelu(&x[1], Gelu::Erf),
    );
}

/// One kernel forward, where the composition takes two; backward the GELU's gradient
/// and the bias's two-level sum.
#[test]
fn bias_gelu_is_one_kernel_forward() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = Device::Emulated;
    let mut generator = Generator::new(1);
    let x = Tensor::<f32>::uniform(&[64, 2, 48], -1.0, 1.0, &mut generator).to_device(device)?;
    let bias = Parameter::new("b", Tensor::zeros(&[48]).to_device(device)?);
    let tape = Tape::new();
    profile::start(device);
    let y = x.bias_gelu(&tape.watch(&bias), Gelu::Tanh)?;
    let forward = profile::finish()?;
    let names: Vec<(&str, u64)> = (forward.kernels.iter())
        .map(|k| (k.name.as_str(), k.launches))
        .collect();
    assert_eq!(names, [("unary_f32", 1)]);
    // x, the bias and the output, each once.
    let (n, h) = (64 * 2 * 48u64, 48u64);
    assert_eq!(forward.total().bytes(), 4 * (2 * n + h));
    profile::start(device);
    y.sum()?.backward()?;
    let backward = profile::finish()?;
    assert!(
        backward.kernels.iter().all(|k| k.name != "binary_f32"),
        "{backward:#?}"
    );
    Ok(())
}

#[test]
fn a_bias_of_another_width_is_a_shape_error() {
    let x = Tensor::<f32>::zeros(&[2, 3]);
    let error = x.bias_gelu(&Tensor::zeros(&[2]), Gelu::Erf).unwrap_err();
    assert!(error.to_string().contains("last dimension"), "{error}");
}
