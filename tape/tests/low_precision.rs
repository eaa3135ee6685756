//! bf16 and f16 tensors: every op the layers use, forward and backward, on the CPU and
//! every device (the emulator always, CUDA when present), against f32.
//!
//! An op on 16-bit inputs computes in f32 and rounds its result once, so its output is
//! the f32 result on the same (rounded) inputs, rounded: exactly on the CPU, within one
//! unit in the last place on a device (whose f32 sums may be ordered differently).
//! The gradient flowing into a 16-bit result is kept in its format (as PyTorch's and
//! Megatron's are), and the parameters' gradients are f32, so these equal the f32
//! gradients on the rounded inputs from the rounded incoming gradient, except where
//! backward reads the op's rounded output (softmax, exp, as PyTorch's do): those are
//! within two units of the format. Against the f32 result on unrounded inputs the
//! output stays within the format's tolerance.

#[path = "support/device.rs"]
mod device;

use ferrotron_tape::{
    CrossEntropyOptions, DType, Device, Gelu, Generator, Parameter, Result, Tape, Tensor,
};
use half::{bf16, f16};

/// What one run computed: output, its storage format, and each input's gradient.
struct Run {
    output: Vec<f32>,
    dtype: DType,
    grads: Vec<Vec<f32>>,
}

type Op<'a> = dyn Fn(&[Tensor]) -> Result<Tensor> + 'a;

/// `op` on `values` stored as `dtype` on `device`, with `loss = Σ op(x) · weights` (f32
/// weights, so the loss is f32, and the weights are the gradient flowing into `op`),
/// the weights rounded to `weights_rounded_to` if given.
fn run(
    device: Device,
    dtype: DType,
    values: &[Tensor],
    op: &Op<'_>,
    weights_rounded_to: Option<DType>,
) -> Result<Run> {
    let tape = Tape::new();
    let params: Vec<Parameter> = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            Ok(Parameter::new(
                format!("x{i}"),
                v.to_device(device)?.to_dtype(dtype)?,
            ))
        })
        .collect::<Result<_>>()?;
    let watched: Vec<Tensor> = params
        .iter()
        .map(|p| tape.watch(p))
        .collect::<std::result::Result<_, _>>()?;
    let out = op(&watched)?;
    let mut generator = Generator::new(7);
    let weights = Tensor::uniform(out.shape(), 0.5, 1.5, &mut generator);
    let weights = match weights_rounded_to {
        Some(format) => rounded(format, &weights)?,
        None => weights,
    }
    .to_device(device)?;
    let loss = out.mul(&weights)?.sum()?;
    assert_eq!(
        loss.dtype(),
        DType::F32,
        "an f32 operand makes the result f32"
    );
    loss.backward()?;
    let grads = params
        .iter()
        .map(|p| match p.grad() {
            Some(g) => {
                assert_eq!(g.dtype(), DType::F32, "gradients are f32");
                g.to_vec()
            }
            None => Ok(vec![0.0; p.numel()]),
        })
        .collect::<Result<_>>()?;
    Ok(Run {
        output: out.to_vec()?,
        dtype: out.dtype(),
        grads,
    })
}

fn round(dtype: DType, value: f32) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(value).to_f32(),
        DType::F16 => f16::from_f32(value).to_f32(),
        _ => value,
    }
}

/// An f32 tensor of `values` rounded to `dtype`'s values.
fn rounded(dtype: DType, values: &Tensor) -> Result<Tensor> {
    let data = values
        .to_vec()?
        .into_iter()
        .map(|x| round(dtype, x))
        .collect();
    Tensor::from_vec(data, values.shape())
}

/// The spacing of `dtype`'s values just above 1 (one unit in the last place, relative).
fn epsilon(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2f64.powi(-7),
        _ => 2f64.powi(-10),
    }
}

fn largest(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|v| f64::from(v.abs()))
        .fold(1.0, f64::max)
}

fn max_difference(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, f64::max)
}

/// What an op's backward reads, which sets how close its gradients come to the f32
/// gradients on the rounded inputs (relative to the largest).
#[derive(Clone, Copy)]
enum BackwardReads {
    /// The inputs (and the rounded incoming gradient) alone: equal, up to the order of
    /// f32 sums.
    Inputs,
    /// The output rounded to the format: within two units of it.
    RoundedOutput,
}

/// Checks `op` in bf16 and f16 on the CPU and every device (see the file's doc), on
/// inputs drawn from [-2, 2).
fn check(name: &str, shapes: &[&[usize]], op: impl Fn(&[Tensor]) -> Result<Tensor>) {
    check_in(name, shapes, (-2.0, 2.0), BackwardReads::Inputs, op)
}

/// [`check`] for an op whose backward reads its rounded output.
fn check_reading_output(name: &str, shapes: &[&[usize]], op: impl Fn(&[Tensor]) -> Result<Tensor>) {
    check_in(name, shapes, (-2.0, 2.0), BackwardReads::RoundedOutput, op)
}

/// [`check`] on inputs drawn from `[low, high)`.
fn check_in(
    name: &str,
    shapes: &[&[usize]],
    (low, high): (f64, f64),
    backward: BackwardReads,
    op: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let mut generator = Generator::new(name.len() as u64 * 13 + 5);
    let values: Vec<Tensor> = shapes
        .iter()
        .map(|s| Tensor::uniform(s, low, high, &mut generator))
        .collect();
    let exact = run(Device::Cpu, DType::F32, &values, &op, None).unwrap();
    let mut devices = vec![Device::Cpu];
    devices.extend(device::devices());
    for dtype in [DType::BF16, DType::F16] {
        let inputs: Vec<Tensor> = values
            .iter()
            .map(|v| rounded(dtype, v))
            .collect::<Result<_>>()
            .unwrap();
        let reference = run(Device::Cpu, DType::F32, &inputs, &op, Some(dtype)).unwrap();
        let expected: Vec<f32> = reference.output.iter().map(|&x| round(dtype, x)).collect();
        for &device in &devices {
            let got = run(device, dtype, &values, &op, None)
                .unwrap_or_else(|e| panic!("{name} in {dtype} on {device}: {e}"));
            assert_eq!(
                got.dtype, dtype,
                "{name} on {device}: the result keeps {dtype}"
            );
            let scale = largest(&expected);
            let ulps = if device == Device::Cpu { 0.0 } else { 1.0 };
            let diff = max_difference(&got.output, &expected);
            assert!(
                diff <= ulps * epsilon(dtype) * scale,
                "{name} in {dtype} on {device}: output is {diff} from the rounded f32 result"
            );
            let diff = max_difference(&got.output, &exact.output);
            let tolerance = 4.0 * epsilon(dtype) * largest(&exact.output);
            assert!(
                diff <= tolerance,
                "{name} in {dtype} on {device}: output is {diff} from f32 (tolerance {tolerance})"
            );
            let relative = match backward {
                BackwardReads::Inputs => 1e-5,
                BackwardReads::RoundedOutput => 2.0 * epsilon(dtype),
            };
            for (i, (g, r)) in got.grads.iter().zip(&reference.grads).enumerate() {
                let diff = max_difference(g, r);
                assert!(
                    diff <= relative * largest(r),
                    "{name} in {dtype} on {device}: gradient of input {i} is {diff} from f32's"
                );
            }
        }
    }
}

#[test]
fn elementwise_ops() {
    let (matrix, row): (&[usize], &[usize]) = (&[4, 6], &[6]);
    check("add", &[matrix, row], |x| x[0].add(&x[1]));
    check("sub", &[matrix, matrix], |x| x[0].sub(&x[1]));
    check("mul", &[matrix, row], |x| x[0].mul(&x[1]));
    check_in(
        "div",
        &[matrix, row],
        (0.5, 2.0),
        BackwardReads::Inputs,
        |x| x[0].div(&x[1]),
    );
    check("scale", &[matrix], |x| x[0].scale(0.37));
    check("neg", &[matrix], |x| x[0].neg());
    check_reading_output("exp", &[matrix], |x| x[0].exp());
    check_in("log", &[matrix], (0.5, 2.0), BackwardReads::Inputs, |x| {
        x[0].log()
    });
    check("tanh", &[matrix], |x| x[0].tanh());
    check("relu", &[matrix], |x| x[0].relu());
    check("gelu tanh", &[matrix], |x| x[0].gelu(Gelu::Tanh));
    check("gelu erf", &[matrix], |x| x[0].gelu(Gelu::Erf));
}

#[test]
fn matmul_accumulates_in_f32() {
    let matmul: fn(&[Tensor]) -> Result<Tensor> = |x| x[0].matmul(&x[1]);
    let transposed: fn(&[Tensor]) -> Result<Tensor> = |x| x[0].matmul_transposed(&x[1]);
    check("matmul", &[&[5, 40], &[40, 3]], matmul);
    check("batched matmul", &[&[2, 3, 16], &[2, 16, 4]], matmul);
    check("shared matmul", &[&[2, 3, 16], &[16, 4]], matmul);
    check("linear product", &[&[2, 3, 16], &[4, 16]], transposed);
    check(
        "batched transposed product",
        &[&[2, 3, 16], &[2, 4, 16]],
        transposed,
    );
}

#[test]
fn reductions_and_rows() {
    let shape: &[usize] = &[3, 5, 8];
    check("sum", &[shape], |x| x[0].sum());
    check("mean", &[shape], |x| x[0].mean());
    check("sum_dim", &[shape], |x| x[0].sum_dim(1, false));
    check("mean_dim", &[shape], |x| x[0].mean_dim(2, true));
    check("max_dim", &[shape], |x| x[0].max_dim(1, false));
    check_reading_output("softmax", &[shape], |x| x[0].softmax());
    check_reading_output("log_softmax", &[shape], |x| x[0].log_softmax());
    check_reading_output("causal_softmax", &[&[2, 6, 6]], |x| {
        x[0].causal_softmax(0.5)
    });
    check("layer_norm", &[shape, &[8], &[8]], |x| {
        x[0].layer_norm(Some(&x[1]), Some(&x[2]), 1e-5)
    });
}

#[test]
fn shapes_and_indexing() {
    let shape: &[usize] = &[2, 3, 4];
    // Views of activations (a parameter's view keeps f32 gradients: `grad_format.rs`);
    // scaling by one is exact.
    let activation = |x: &Tensor| x.scale(1.0);
    check("reshape", &[shape], move |x| {
        activation(&x[0])?.reshape(&[6, 4])
    });
    check("transpose", &[shape], move |x| {
        activation(&x[0])?.transpose(0, 2)
    });
    check("permute", &[shape], move |x| {
        activation(&x[0])?.permute(&[1, 2, 0])
    });
    check("narrow", &[shape], move |x| {
        activation(&x[0])?.narrow(2, 1, 2)
    });
    check("concat", &[shape, shape], move |x| {
        Tensor::concat(&[&activation(&x[0])?, &activation(&x[1])?], 1)
    });
    check("embedding", &[&[7, 4]], |x| {
        x[0].embedding(&[3, 0, 6, 3], &[2, 2])
    });
    let mask = ferrotron_tape::ndarray::ArrayD::from_shape_fn(
        ferrotron_tape::ndarray::IxDyn(shape),
        |i| (i[0] + i[1] + i[2]) % 3 == 0,
    );
    check("masked_fill", &[shape], move |x| {
        x[0].masked_fill(&mask, -1.5)
    });
    check("dropout", &[shape], |x| {
        x[0].dropout(0.25, &mut Generator::new(9))
    });
}

#[test]
fn cross_entropy_reads_16_bit_logits_as_a_cast_to_f32_would() -> Result<()> {
    // The loss is f32 whatever the logits' format: the numbers of casting the logits to
    // f32 first, loss and gradient bit for bit, without the f32 copy.
    let logits = Tensor::uniform(&[6, 9], -3.0, 3.0, &mut Generator::new(5));
    let labels = [0, 8, 3, 3, -100, 5];
    let smoothed = CrossEntropyOptions {
        label_smoothing: 0.1,
        reduction: ferrotron_tape::Reduction::Sum,
        ..CrossEntropyOptions::default()
    };
    let mut devices = vec![Device::Cpu];
    devices.extend(device::devices());
    for options in [CrossEntropyOptions::default(), smoothed] {
        for (dtype, device) in [DType::BF16, DType::F16]
            .into_iter()
            .flat_map(|d| devices.iter().map(move |&device| (d, device)))
        {
            let run = |cast: bool| -> Result<(f32, Vec<f32>)> {
                let tape = Tape::new();
                let param = Parameter::new("x", logits.to_device(device)?.to_dtype(dtype)?);
                let x = tape.watch(&param)?.scale(1.0)?;
                let x = if cast { x.to_dtype(DType::F32)? } else { x };
                let loss = x.cross_entropy(&labels, &options)?;
                assert_eq!(loss.dtype(), DType::F32, "{dtype} on {device}");
                loss.backward()?;
                Ok((loss.item()?, param.grad().expect("a gradient").to_vec()?))
            };
            assert_eq!(run(false)?, run(true)?, "{dtype} on {device}");
        }
    }
    Ok(())
}

#[test]
fn cross_entropy_in_f32_from_16_bit_logits() {
    // What a model does: the loss computed in f32 from bf16 logits, gradients back in f32.
    let mut generator = Generator::new(3);
    let logits = Tensor::uniform(&[4, 11], -3.0, 3.0, &mut generator);
    let labels = [1, 10, 0, 4];
    let options = CrossEntropyOptions::default();
    let loss_of = |dtype: DType, device: Device| -> Result<(f32, Vec<f32>)> {
        let tape = Tape::new();
        let param = Parameter::new("logits", logits.to_device(device)?.to_dtype(dtype)?);
        let x = tape.watch(&param)?.to_dtype(DType::F32)?;
        let loss = x.cross_entropy(&labels, &options)?;
        assert_eq!(loss.dtype(), DType::F32);
        loss.backward()?;
        Ok((loss.item()?, param.grad().expect("a gradient").to_vec()?))
    };
    let (exact, exact_grad) = loss_of(DType::F32, Device::Cpu).unwrap();
    for device in [Device::Cpu, Device::Emulated] {
        let (loss, grad) = loss_of(DType::BF16, device).unwrap();
        assert!(
            (loss - exact).abs() <= 2e-2 * exact.abs(),
            "{loss} vs {exact}"
        );
        assert!(max_difference(&grad, &exact_grad) <= 2e-2);
    }
}

#[test]
fn conversions_on_devices_match_the_cpu_bit_for_bit() {
    // Every 16-bit pattern widens, and a sweep of f32 values (normal, subnormal, huge,
    // infinite, NaN) narrows, to the same bits on every device as on the CPU.
    let patterns: Vec<u16> = (0..=u16::MAX).collect();
    let mut singles: Vec<f32> = (0..=u32::MAX).step_by(4_099).map(f32::from_bits).collect();
    singles.extend([
        0.0,
        -0.0,
        65_504.0,
        65_520.0,
        6.0e-8,
        3.0e-8,
        f32::MAX,
        f32::INFINITY,
    ]);
    for dtype in [DType::BF16, DType::F16] {
        let widened: Vec<f32> = patterns
            .iter()
            .map(|&bits| match dtype {
                DType::BF16 => bf16::from_bits(bits).to_f32(),
                _ => f16::from_bits(bits).to_f32(),
            })
            .collect();
        let narrowed: Vec<f32> = singles.iter().map(|&x| round(dtype, x)).collect();
        for device in device::devices() {
            // Narrowing then widening on the device: the CPU's rounding, bit for bit.
            let on_device = Tensor::from_vec(singles.clone(), &[singles.len()])
                .unwrap()
                .to_device(device)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let back = on_device.to_dtype(DType::F32).unwrap().to_vec().unwrap();
            same_bits(
                &back,
                &narrowed,
                &format!("narrowing to {dtype} on {device}"),
            );
            // Widening every pattern on the device (after an exact round trip through f32).
            let all = Tensor::from_vec(widened.clone(), &[widened.len()])
                .unwrap()
                .to_device(device)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            same_bits(
                &all.to_vec().unwrap(),
                &widened,
                &format!("{dtype} on {device}"),
            );
        }
    }
}

fn same_bits(got: &[f32], expected: &[f32], what: &str) {
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        let same = g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan());
        assert!(
            same,
            "{what}: element {i}: {g:e} ({:#x}) vs {e:e} ({:#x})",
            g.to_bits(),
            e.to_bits()
        );
    }
}

#[test]
fn storage_format_travels_with_the_tensor() -> Result<()> {
    let x = Tensor::from_vec(vec![0.1f32, 2.5, -3.0, 1e-3], &[2, 2])?.to_dtype(DType::F16)?;
    assert_eq!((x.dtype(), x.nbytes()), (DType::F16, 8));
    for device in device::devices() {
        let there = x.to_device(device)?;
        assert_eq!(there.dtype(), DType::F16, "moving keeps the format");
        let back = there.to_device(Device::Cpu)?;
        assert_eq!(back.to_vec()?, x.to_vec()?);
    }
    // Scalars do not widen a 16-bit result (PyTorch's rule for 0-d operands) ...
    assert_eq!(x.mul(&Tensor::scalar(2.0))?.dtype(), DType::F16);
    // ... but a full f32 operand does, and mixed 16-bit formats compute in f32.
    assert_eq!(x.add(&Tensor::ones(&[2, 2]))?.dtype(), DType::F32);
    let y = x.to_dtype(DType::BF16)?;
    assert_eq!(x.add(&y)?.dtype(), DType::F32);
    // Only f32, bf16 and f16 storage for an f32 tensor.
    let err = x.to_dtype(DType::I32).unwrap_err().to_string();
    assert!(err.contains("bf16 or f16"), "{err}");
    // 16-bit storage is never updated in place: optimizers need an f32 master copy.
    let param = Parameter::new("w", x.clone());
    let tape = Tape::new();
    tape.watch(&param)?.sum()?.backward()?;
    let mut sgd = ferrotron_tape::Sgd::new(vec![param], ferrotron_tape::SgdConfig::new(0.1))?;
    let err = ferrotron_tape::Optimizer::step(&mut sgd)
        .unwrap_err()
        .to_string();
    assert!(err.contains("master"), "{err}");
    Ok(())
}

#[test]
fn full_as_rounds_its_value_once_into_the_format_on_every_device() -> Result<()> {
    let mut devices = vec![Device::Cpu];
    devices.extend(device::devices());
    for device in devices {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = Tensor::<f32>::full_as(&[2, 3], 0.1, dtype, device)?;
            assert_eq!((x.dtype(), x.device()), (dtype, device));
            assert_eq!(
                x.to_vec()?,
                vec![round(dtype, 0.1); 6],
                "{dtype} on {device}"
            );
        }
        // f16 overflows to infinity, as rounding an f32 tensor would.
        let big = Tensor::<f32>::full_as(&[1], 1.0e5, DType::F16, device)?;
        assert_eq!(big.to_vec()?, vec![f32::INFINITY], "on {device}");
        let err = Tensor::<f64>::full_as(&[1], 0.0, DType::F32, device).unwrap_err();
        assert!(err.to_string().contains("bf16 or f16"), "{err}");
    }
    Ok(())
}
