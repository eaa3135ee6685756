//! Micro-benchmarks of the tape (not run in CI).
//!
//! `cargo run --release -p ferrotron-tape --example bench_tape -- --json [--threads N]` prints one
//! JSON object per line; `tape/benches/torch_reference.py` measures the same with PyTorch.
//! One thread unless `--threads` says otherwise.

use std::time::Instant;

use anyhow::Result;
// Training steps allocate and free many large arrays: mimalloc, told to keep freed pages,
// hands them to the next step without page faults (see the performance chapter).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Keeps the memory a step frees for the next step instead of returning it to the OS.
fn keep_freed_memory() {
    // `mi_option_purge_delay` is 15 in the mimalloc v2 sources libmimalloc-sys builds
    // (between its `mi_option_eager_commit_delay` and `mi_option_use_numa_nodes`); -1: never.
    const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
    // SAFETY: sets a plain integer option; mimalloc reads options atomically.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, -1) }
}

use ferrotron_tape::{Generator, Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor};

const CHAIN_LEN: usize = 1000;
const WIDTH: usize = 1024;

/// Forward µs per op and backward µs per node of a chain of elementwise ops; best of 20.
fn tiny_ops() -> Result<(f64, f64)> {
    let mut rng = Generator::new(1);
    let x = Parameter::new("x", Tensor::<f32>::uniform(&[WIDTH], -1.0, 1.0, &mut rng));
    let s = Parameter::new("s", Tensor::<f32>::uniform(&[WIDTH], 0.5, 0.9, &mut rng));
    let tape = Tape::new();
    let (mut best_fwd, mut best_bwd) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..20 {
        x.zero_grad();
        s.zero_grad();
        let start = Instant::now();
        let s_tensor = tape.watch(&s)?;
        let mut y = tape.watch(&x)?;
        for i in 0..CHAIN_LEN {
            y = if i % 2 == 0 {
                y.mul(&s_tensor)?
            } else {
                y.add(&s_tensor)?
            };
        }
        let loss = y.sum()?;
        let forward = start.elapsed().as_secs_f64();
        let nodes = tape.len();
        let start = Instant::now();
        loss.backward()?;
        let backward = start.elapsed().as_secs_f64();
        best_fwd = best_fwd.min(forward * 1e6 / (CHAIN_LEN + 1) as f64);
        best_bwd = best_bwd.min(backward * 1e6 / nodes as f64);
    }
    Ok((best_fwd, best_bwd))
}

/// Median ms per training step of a 1024→4096→1024 MLP on a 64-row batch, and peak RSS.
fn mlp_step() -> Result<(f64, f64)> {
    let mut rng = Generator::new(2);
    let w1 = Parameter::new("w1", Tensor::<f32>::randn(&[1024, 4096], 0.02, &mut rng));
    let b1 = Parameter::new("b1", Tensor::<f32>::zeros(&[4096]));
    let w2 = Parameter::new("w2", Tensor::<f32>::randn(&[4096, 1024], 0.02, &mut rng));
    let b2 = Parameter::new("b2", Tensor::<f32>::zeros(&[1024]));
    let x = Tensor::<f32>::randn(&[64, 1024], 1.0, &mut rng);
    let target = Tensor::<f32>::randn(&[64, 1024], 1.0, &mut rng);
    let mut sgd = Sgd::new(
        vec![w1.clone(), b1.clone(), w2.clone(), b2.clone()],
        SgdConfig::new(1e-3),
    )?;
    let tape = Tape::new();
    let mut times = Vec::new();
    for step in 0..25 {
        let start = Instant::now();
        let h = x
            .matmul(&tape.watch(&w1)?)?
            .add(&tape.watch(&b1)?)?
            .relu()?;
        let y = h.matmul(&tape.watch(&w2)?)?.add(&tape.watch(&b2)?)?;
        let diff = y.sub(&target)?;
        let loss = diff.mul(&diff)?.mean()?;
        sgd.zero_grad();
        loss.backward()?;
        sgd.step()?;
        if step >= 5 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], peak_rss_mb()))
}

/// Peak resident set size of this process (Linux `VmHWM`), in MiB; 0 where unavailable.
fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kib / 1024.0)
        })
        .unwrap_or(0.0)
}

fn main() -> Result<()> {
    keep_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    let threads = match args.iter().position(|a| a == "--threads") {
        Some(i) => args
            .get(i + 1)
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("--threads needs a positive integer"))?,
        None => 1,
    };
    ferrotron_tape::set_num_threads(threads)?;
    let (fwd, bwd) = tiny_ops()?;
    let (ms, rss) = mlp_step()?;
    if json {
        println!(r#"{{"bench":"tiny_ops","fwd_us_per_op":{fwd:.3},"bwd_us_per_node":{bwd:.3}}}"#);
        println!(r#"{{"bench":"mlp_step","ms_per_step":{ms:.3},"peak_rss_mb":{rss:.1}}}"#);
    } else {
        println!("tiny_ops: forward {fwd:.3} µs/op, backward {bwd:.3} µs/node");
        println!("mlp_step: {ms:.3} ms/step, peak RSS {rss:.1} MiB");
    }
    Ok(())
}
