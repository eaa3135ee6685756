//! Attention's forward and backward, fused (on tensor cores where they apply, and on CUDA
//! cores) and unfused, beside `tape/benches/torch_attention_reference.py` (PyTorch's
//! `scaled_dot_product_attention` on the same GPU); not run in CI.
//!
//! `cargo run --release -p ferrotron-tape --features cuda --example bench_attention -- --device cuda:0`
//! prints one JSON object per line and case: causal self-attention on packed
//! `[seq, batch, groups, heads / groups + 2, head_dim]` input (batch 8, 12 heads of 64,
//! one per group, by default, at sequences 1024 and 4096, in bf16 and f32; Llama's shape
//! is `--batch 2 --heads 32 --groups 8 --head-dim 128 --seqs 4096 --dtypes bf16`), the
//! kernel (`tape-fused-tensor-cores`, `tape-fused-cuda-cores`, `tape-unfused`), its
//! mean time per forward and backward and
//! the achieved TFLOP/s (the causal half of `4 · seq² · head_dim` per head forward, twice
//! that backward, as FlashAttention counts), from the device profile's event times on a
//! GPU or the wall clock on the CPU, and the most memory held above the input. On the
//! emulated device the lines have launches and bytes moved, and no time.
//!
//! `-- --device cpu --batch 1 --seqs 1024,4096 --dtypes f32` compares the CPU's two paths.

use std::time::Instant;

use anyhow::{Context, Result};
use ferrotron_tape::profile;
use ferrotron_tape::{
    fused_attention_takes, tensor_core_attention_takes, with_cuda_core_attention, AttentionKernel,
    AttentionOptions, DType, Device, Generator, Parameter, Tape, Tensor,
};

/// Counts the host bytes live, for the CPU's peaks.
#[path = "../tests/support/counting.rs"]
mod counting;

/// Measured runs per case after one warm-up.
const REPEATS: usize = 5;

struct Case {
    device: Device,
    batch: usize,
    heads: usize,
    groups: usize,
    head_dim: usize,
    seq: usize,
    dtype: DType,
    kernel: Kernel,
}

/// The kernels compared.
#[derive(Clone, Copy, PartialEq)]
enum Kernel {
    /// Fused, on tensor cores where they take the case (else as `CudaCores`).
    Fused,
    /// Fused, on CUDA cores (`with_cuda_core_attention`).
    CudaCores,
    Unfused,
}

impl Case {
    /// The name the JSON line gives the kernel that runs, or `None` where it would run
    /// another one's (the CUDA-core kernel where tensor cores do not apply, or beyond
    /// its head dimensions).
    fn name(&self) -> Option<&'static str> {
        let tensor_cores = tensor_core_attention_takes(self.device, self.dtype, self.head_dim);
        let cuda_cores = fused_attention_takes::<f32>(self.device, self.head_dim);
        match self.kernel {
            Kernel::Fused if tensor_cores => Some("tape-fused-tensor-cores"),
            Kernel::Fused => None,
            Kernel::CudaCores if cuda_cores => Some("tape-fused-cuda-cores"),
            Kernel::CudaCores => None,
            Kernel::Unfused => Some("tape-unfused"),
        }
    }
}

/// One forward and backward of `case` on `qkv`.
fn step(case: &Case, qkv: &Parameter, upstream: &Tensor) -> Result<()> {
    let run = || -> Result<()> {
        qkv.zero_grad();
        let tape = Tape::new();
        let options = AttentionOptions {
            kernel: match case.kernel {
                Kernel::Unfused => AttentionKernel::Unfused,
                _ => AttentionKernel::Fused,
            },
            ..AttentionOptions::causal(case.head_dim)
        };
        let out = tape.watch(qkv)?.packed_attention(options, None)?;
        out.backward_with_grad(upstream)?;
        Ok(())
    };
    match case.kernel {
        Kernel::CudaCores => with_cuda_core_attention(run),
        _ => run(),
    }
}

fn bench(case: &Case) -> Result<()> {
    let Some(name) = case.name() else {
        return Ok(());
    };
    let (s, b, n, d, g) = (case.seq, case.batch, case.heads, case.head_dim, case.groups);
    anyhow::ensure!(g > 0 && n % g == 0, "--groups must divide --heads");
    let mut rng = Generator::new(3);
    let value = Tensor::<f32>::randn(&[s, b, g, n / g + 2, d], 1.0, &mut rng)
        .to_device(case.device)?
        .to_dtype(case.dtype)?;
    let qkv = Parameter::new("qkv", value);
    let upstream = Tensor::<f32>::randn(&[s, b, n * d], 1.0, &mut rng)
        .to_device(case.device)?
        .to_dtype(case.dtype)?;
    step(case, &qkv, &upstream)?;
    ferrotron_tape::synchronize(case.device)?;
    let (device_before, host_before) = (
        ferrotron_tape::device_memory(case.device).live,
        counting::live(),
    );
    ferrotron_tape::reset_device_peak(case.device);
    counting::reset_peak();
    profile::start(case.device);
    let started = Instant::now();
    for _ in 0..REPEATS {
        step(case, &qkv, &upstream)?;
    }
    ferrotron_tape::synchronize(case.device)?;
    let wall = started.elapsed().as_secs_f64();
    let profile = profile::finish()?;
    let total = profile.total();
    let seconds = match case.device {
        Device::Cpu => Some(wall),
        _ => total.time.map(|t| t.as_secs_f64()),
    };
    let held = match case.device {
        Device::Cpu => (counting::peak() - host_before) as f64,
        device => (ferrotron_tape::device_memory(device).peak - device_before) as f64,
    };
    // Forward 4·s²·d per head (two products), backward twice that; causal halves both.
    let flops = 3.0 * 4.0 * (s * s * d * b * n) as f64 / 2.0;
    println!(
        "{}",
        serde_json::json!({
            "bench": "attention", "impl": name, "device": case.device.to_string(),
            "batch": b, "heads": n, "groups": g, "head_dim": d, "seq": s, "dtype": case.dtype.to_string(),
            "causal": true, "launches_per_step": total.launches as f64 / REPEATS as f64,
            "bytes_per_step": total.bytes() as f64 / REPEATS as f64,
            "ms": seconds.map(|t| t * 1e3 / REPEATS as f64),
            "tflops": seconds.map(|t| flops * REPEATS as f64 / t / 1e12),
            "peak_bytes_held": held,
        })
    );
    Ok(())
}

/// `--name value` from the command line, or `default`.
fn flag(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
        .unwrap_or_else(|| default.to_string())
}

fn dtype(text: &str) -> Result<DType> {
    Ok(match text {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" | "fp16" => DType::F16,
        other => anyhow::bail!("--dtypes takes f32, bf16 and f16, not {other}"),
    })
}

fn list(text: &str) -> Vec<String> {
    text.split(',').map(str::to_string).collect()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let device: Device = flag(&args, "--device", "cuda:0").parse()?;
    let number = |name: &str, default: &str| -> Result<usize> {
        flag(&args, name, default)
            .parse()
            .with_context(|| format!("{name} takes a number"))
    };
    let (batch, heads, head_dim) = (
        number("--batch", "8")?,
        number("--heads", "12")?,
        number("--head-dim", "64")?,
    );
    let groups = number("--groups", &heads.to_string())?;
    for seq in list(&flag(&args, "--seqs", "1024,4096")) {
        for name in list(&flag(&args, "--dtypes", "bf16,f32")) {
            for kernel in [Kernel::Fused, Kernel::CudaCores, Kernel::Unfused] {
                let case = Case {
                    device,
                    batch,
                    heads,
                    groups,
                    head_dim,
                    seq: seq.parse().context("--seqs takes numbers")?,
                    dtype: dtype(&name)?,
                    kernel,
                };
                bench(&case)?;
            }
        }
    }
    Ok(())
}
