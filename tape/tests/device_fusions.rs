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
    let out = f(&tape.watch(&x)?, &tape.watch(&bias)?)?;
    let weights: Tensor = Tensor::uniform(out.shape(), 0.5, 1.5, &mut generator);
    (out.to_dtype(DType::F32)?
        .mul(&weights.to_device(device)?)?
        .sum()?)
    .backward()?;
    // An unused input has no gradient: an empty one.
    let grad = |p: &Parameter| p.grad().map_or(Ok(Vec::new()), |g| g.to_vec());
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
    let y = x.bias_gelu(&tape.watch(&bias)?, Gelu::Tanh)?;
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

/// `residual + dropout(x + bias)` against its three ops, in each format for the branch
/// and the residual (an f32 residual stream under a 16-bit branch too), with and without
/// bias and dropout: the same numbers and the same mask.
#[test]
fn bias_dropout_add_is_add_dropout_add_exactly() -> Result<()> {
    let formats = [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::F32),
    ];
    for device in [Device::Cpu].into_iter().chain(devices()) {
        for (branch, stream) in formats {
            for (with_bias, p) in [(true, 0.0), (true, 0.4), (false, 0.4), (false, 0.0)] {
                let apply = |fused: bool| {
                    run(device, branch, |x, b| {
                        let mut generator = Generator::new(9);
                        let residual = x.scale(0.5)?.to_dtype(stream)?;
                        let bias = with_bias.then_some(b);
                        if fused {
                            return x.bias_dropout_add(bias, &residual, Some((p, &mut generator)));
                        }
                        let branch = match bias {
                            Some(b) => x.add(b)?,
                            None => x.clone(),
                        };
                        residual.add(&branch.dropout(p, &mut generator)?)
                    })
                };
                let case = format!("{branch} on {stream}, bias {with_bias}, p {p}, on {device}");
                assert_eq!(apply(true)?, apply(false)?, "{case}");
            }
        }
    }
    Ok(())
}

#[test]
fn bias_dropout_add_matches_the_cpu() {
    check::<f64>(
        "bias_dropout_add",
        Inputs::new(&[&[6, 2, 9], &[9], &[6, 2, 9]]),
        1e-12,
        |x| {
            let mut generator = Generator::new(2);
            x[0].bias_dropout_add(Some(&x[1]), &x[2], Some((0.3, &mut generator)))
        },
    );
}

#[test]
fn bias_dropout_add_is_one_kernel_forward() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = Device::Emulated;
    let mut generator = Generator::new(1);
    let mut tensor = |shape: &[usize]| {
        Tensor::<f32>::uniform(shape, -1.0, 1.0, &mut generator).to_device(device)
    };
    let (x, bias, residual) = (tensor(&[8, 2, 16])?, tensor(&[16])?, tensor(&[8, 2, 16])?);
    let mut draws = Generator::new(3);
    profile::start(device);
    x.bias_dropout_add(Some(&bias), &residual, Some((0.1, &mut draws)))?;
    let forward = profile::finish()?;
    let names: Vec<(&str, u64)> = (forward.kernels.iter())
        .map(|k| (k.name.as_str(), k.launches))
        .collect();
    assert_eq!(names, [("bias_dropout_add_f32", 1)]);
    let error = x.bias_dropout_add(None, &bias, None).unwrap_err();
    assert!(error.to_string().contains("one shape"), "{error}");
    Ok(())
}
