//! Device benchmarks, side by side with `tape/benches/torch_device_reference.py` (which
//! measures the same with PyTorch on the same GPU); not run in CI.
//!
//! `cargo run --release -p ferrotron-tape --features cuda --example bench_device -- --device cuda:0`
//! prints one JSON object per line:
//! - `gemm`: a 4096×4096·4096×4096 f32 product, FP32 and TF32 (median ms, TFLOP/s);
//! - `gemm_bf16`: an 8192×8192·8192×8192 product of bf16 matrices, accumulated in f32
//!   (`--bf16-size N` for another size);
//! - `tiny_ops`: a chain of 1000 elementwise ops on 1024-element tensors with its
//!   backward (µs per op forward, per node backward), i.e. per-op overhead.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use ferrotron_tape::{
    set_allow_tf32, synchronize, DType, Device, Generator, Parameter, Tape, Tensor,
};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median ms of an `n`×`n` product of matrices stored as `dtype` (f32 with or without
/// TF32, or bf16).
fn gemm(device: Device, n: usize, dtype: DType, tf32: bool) -> Result<f64> {
    set_allow_tf32(tf32);
    let mut rng = Generator::new(1);
    let a = Tensor::<f32>::randn(&[n, n], 1.0, &mut rng)
        .to_device(device)?
        .to_dtype(dtype)?;
    let b = Tensor::<f32>::randn(&[n, n], 1.0, &mut rng)
        .to_device(device)?
        .to_dtype(dtype)?;
    let mut times = Vec::new();
    for i in 0..25 {
        synchronize(device)?;
        let start = Instant::now();
        let c = a.matmul(&b)?;
        synchronize(device)?;
        if i >= 5 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        drop(c);
    }
    Ok(median(times))
}

fn tiny_ops(device: Device) -> Result<(f64, f64)> {
    const CHAIN: usize = 1000;
    let mut rng = Generator::new(2);
    let x = Parameter::new(
        "x",
        Tensor::<f32>::uniform(&[1024], -1.0, 1.0, &mut rng).to_device(device)?,
    );
    let s = Parameter::new(
        "s",
        Tensor::<f32>::uniform(&[1024], 0.5, 0.9, &mut rng).to_device(device)?,
    );
    let (mut forward, mut backward) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        x.zero_grad();
        s.zero_grad();
        let tape = Tape::new();
        synchronize(device)?;
        let start = Instant::now();
        let scale = tape.watch(&s)?;
        let mut y = tape.watch(&x)?;
        for i in 0..CHAIN {
            y = if i % 2 == 0 {
                y.mul(&scale)?
            } else {
                y.add(&scale)?
            };
        }
        let loss = y.sum()?;
        synchronize(device)?;
        forward.push(start.elapsed().as_secs_f64() * 1e6 / (CHAIN + 1) as f64);
        let nodes = tape.len();
        let start = Instant::now();
        loss.backward()?;
        synchronize(device)?;
        backward.push(start.elapsed().as_secs_f64() * 1e6 / nodes as f64);
    }
    Ok((median(forward), median(backward)))
}

fn main() -> Result<()> {
    let mut device = Device::Cuda(0);
    let (mut size, mut bf16_size) = (4096, 8192);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--device" => device = args.next().context("--device needs a value")?.parse()?,
            "--size" => size = args.next().context("--size needs a value")?.parse()?,
            "--bf16-size" => {
                bf16_size = args.next().context("--bf16-size needs a value")?.parse()?
            }
            other => bail!("unknown argument {other}; use --device D [--size N] [--bf16-size N]"),
        }
    }
    let tflops = |n: usize, ms: f64| 2.0 * (n as f64).powi(3) / (ms * 1e-3) / 1e12;
    for tf32 in [false, true] {
        let ms = gemm(device, size, DType::F32, tf32)?;
        println!(
            "{}",
            serde_json::json!({"bench": "gemm", "impl": "tape", "device": device.to_string(),
                "n": size, "tf32": tf32, "ms": ms, "tflops": tflops(size, ms)})
        );
    }
    let ms = gemm(device, bf16_size, DType::BF16, false)?;
    println!(
        "{}",
        serde_json::json!({"bench": "gemm_bf16", "impl": "tape", "device": device.to_string(),
            "n": bf16_size, "ms": ms, "tflops": tflops(bf16_size, ms)})
    );
    let (forward_us, backward_us) = tiny_ops(device)?;
    println!(
        "{}",
        serde_json::json!({"bench": "tiny_ops", "impl": "tape", "device": device.to_string(),
            "forward_us_per_op": forward_us, "backward_us_per_node": backward_us})
    );
    Ok(())
}
