//! Row-kernel bandwidth: softmax (plain and causal), log-softmax, layer norm and
//! cross-entropy, and the fused elementwise ops a block runs (bias + GELU, bias +
//! dropout + residual), forward and backward, at `[rows, width]` in f32 and bf16, beside
//! `tape/benches/torch_rows_reference.py` (PyTorch's on the same GPU); not run in CI.
//!
//! `cargo run --release -p ferrotron-tape --features cuda --example bench_rows -- --device cuda:0`
//! prints one JSON object per line and kernel: its launches, bytes moved (each array
//! read or written once), mean µs and achieved GB/s from the device profile's event
//! times, and `copy_gbs`, what a plain elementwise kernel (a scale) achieves on the same
//! GPU at the same size, as the reference a memory-bound kernel can reach. On the
//! emulated device (`--device emulated`, small shapes by default) the lines have
//! launches and bytes, and no time.

use anyhow::{bail, Context, Result};
use ferrotron_tape::profile::{self, Profile};
use ferrotron_tape::{
    CrossEntropyOptions, DType, Device, Gelu, Generator, Parameter, Tape, Tensor,
};

/// Launches of each op per measurement.
const REPEATS: usize = 20;

/// Runs `op` once to warm up (compilation, allocation), then `REPEATS` times under a
/// profile.
fn profiled(device: Device, mut op: impl FnMut() -> Result<()>) -> Result<Profile> {
    op()?;
    ferrotron_tape::synchronize(device)?;
    profile::start(device);
    for _ in 0..REPEATS {
        op()?;
    }
    Ok(profile::finish()?)
}

/// One JSON line per kernel of `profile` whose name starts with a row kernel's.
fn report(profile: &Profile, op: &str, shape: [usize; 2], dtype: DType, copy_gbs: Option<f64>) {
    for kernel in &profile.kernels {
        let row_kernel = ["softmax_rows", "layer_norm_rows", "cross_entropy_rows"]
            .iter()
            .any(|k| kernel.name.starts_with(k));
        // The fused ops' own kernels (not the bias gradient's reduction).
        let fused = op.starts_with("bias_")
            && ["unary", "bias_dropout_add"]
                .iter()
                .any(|k| kernel.name.starts_with(k));
        if !row_kernel && !fused {
            continue;
        }
        let launches = kernel.launches.max(1) as f64;
        let seconds = kernel.time.map(|t| t.as_secs_f64());
        println!(
            "{}",
            serde_json::json!({
                "bench": "row_kernel", "impl": "tape", "op": op, "kernel": kernel.name,
                "rows": shape[0], "width": shape[1], "dtype": dtype.to_string(),
                "launches": kernel.launches, "bytes_per_launch": kernel.bytes() as f64 / launches,
                "mean_us": seconds.map(|s| s * 1e6 / launches),
                "gbs": seconds.map(|s| kernel.bytes() as f64 / s / 1e9),
                "copy_gbs": copy_gbs,
            })
        );
    }
}

/// What a scale of `[rows, width]` elements of `dtype` achieves (GB/s), where timed.
fn copy_bandwidth(device: Device, x: &Tensor) -> Result<Option<f64>> {
    let profile = profiled(device, || {
        x.scale(1.0)?;
        Ok(())
    })?;
    let total = profile.total();
    Ok(total
        .time
        .map(|t| total.bytes() as f64 / t.as_secs_f64() / 1e9))
}

fn bench(device: Device, [rows, width]: [usize; 2], dtype: DType) -> Result<()> {
    let mut rng = Generator::new(5);
    let input = |rng: &mut Generator| -> Result<Tensor> {
        Ok(Tensor::<f32>::randn(&[rows, width], 1.0, rng)
            .to_device(device)?
            .to_dtype(dtype)?)
    };
    let x = Parameter::new("x", input(&mut rng)?);
    let affine = |rng: &mut Generator| -> Result<Parameter> {
        let value = Tensor::<f32>::randn(&[width], 1.0, rng).to_device(device)?;
        Ok(Parameter::new("affine", value.to_dtype(dtype)?))
    };
    let (weight, bias) = (affine(&mut rng)?, affine(&mut rng)?);
    let upstream = Tensor::<f32>::randn(&[rows, width], 1.0, &mut rng).to_device(device)?;
    let copy_gbs = copy_bandwidth(device, &x.value()?)?;
    // A residual stream beside the branch, for the fused addition.
    let residual = input(&mut rng)?;
    // Forward and backward of each op: the backward's kernels are the `_backward` lines.
    type Op<'a> = Box<dyn Fn(&Tape, &Tensor) -> ferrotron_tape::Result<Tensor> + 'a>;
    let mut ops: Vec<(&str, Op<'_>)> = vec![
        ("softmax", Box::new(|_, t| t.softmax())),
        ("log_softmax", Box::new(|_, t| t.log_softmax())),
        (
            "layer_norm",
            Box::new(|tape, t| {
                let (w, b) = (tape.watch(&weight)?, tape.watch(&bias)?);
                t.layer_norm(Some(&w), Some(&b), 1e-5)
            }),
        ),
    ];
    ops.push((
        "bias_gelu",
        Box::new(|tape, t| t.bias_gelu(&tape.watch(&bias)?, Gelu::Tanh)),
    ));
    ops.push((
        "bias_dropout_add",
        Box::new(|tape, t| t.bias_dropout_add(Some(&tape.watch(&bias)?), &residual, None)),
    ));
    // Attention's causal softmax, where the rows make whole [width, width] matrices.
    if rows % width == 0 {
        ops.push((
            "causal_softmax",
            Box::new(move |_, t| {
                (t.reshape(&[rows / width, width, width])?
                    .causal_softmax(0.125))?
                .reshape(&[rows, width])
            }),
        ));
    }
    for (name, op) in &ops {
        let profile = profiled(device, || {
            x.zero_grad();
            let tape = Tape::new();
            let y = op(&tape, &tape.watch(&x)?)?;
            y.backward_with_grad(&upstream)?;
            Ok(())
        })?;
        report(&profile, name, [rows, width], dtype, copy_gbs);
    }
    // Cross-entropy reads f32 logits (the output layer's product is widened for it).
    let labels: Vec<i64> = (0..rows).map(|r| ((r * 7919) % width) as i64).collect();
    let logits = Parameter::new("logits", input(&mut rng)?.to_dtype(DType::F32)?);
    let profile = profiled(device, || {
        logits.zero_grad();
        let tape = Tape::new();
        let loss = tape
            .watch(&logits)?
            .cross_entropy(&labels, &CrossEntropyOptions::default())?;
        loss.backward()?;
        Ok(())
    })?;
    report(
        &profile,
        "cross_entropy",
        [rows, width],
        DType::F32,
        copy_gbs,
    );
    Ok(())
}

fn main() -> Result<()> {
    let mut device = Device::Cuda(0);
    let mut shapes: Option<Vec<[usize; 2]>> = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--device" => device = args.next().context("--device needs a value")?.parse()?,
            "--shape" => {
                let text = args.next().context("--shape needs ROWSxWIDTH")?;
                let (rows, width) = text.split_once('x').context("--shape ROWSxWIDTH")?;
                shapes
                    .get_or_insert_with(Vec::new)
                    .push([rows.parse()?, width.parse()?]);
            }
            other => bail!("unknown argument {other}; use --device D [--shape ROWSxWIDTH]..."),
        }
    }
    let shapes = shapes.unwrap_or_else(|| match device {
        // GPT-2 small's rows of one step, and a long-context layer's.
        Device::Cuda(_) => vec![[8192, 768], [98304, 1024]],
        _ => vec![[64, 96]],
    });
    for shape in shapes {
        for dtype in [DType::F32, DType::BF16] {
            bench(device, shape, dtype)?;
        }
    }
    Ok(())
}
