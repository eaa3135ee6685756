//! bf16 / fp16 compression hooks: averages within the 16-bit rounding bound, with the
//! gradients' own f32 buckets and no second copy kept between steps.

use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::{CompressedAllReduce, DdpConfig, DistributedDataParallel};
use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

const RANKS: usize = 4;
const LEN: usize = 1000;

fn rank_gradient(rank: usize) -> Vec<f32> {
    let mut rng = Generator::new(7 + rank as u64);
    (0..LEN).map(|_| (rng.normal() * 3.0) as f32).collect()
}

/// Runs one step with `hook` and returns (worst error / max |g|, buffer bytes, grad bytes).
fn reduce_with(hook: CompressedAllReduce) -> Result<(f32, usize, usize)> {
    let results = run_local(RANKS, |comm| -> Result<(Vec<f32>, usize, usize)> {
        let rank = comm.rank();
        let w = Parameter::new("w", Tensor::zeros(&[LEN]));
        let config = DdpConfig {
            comm_hook: Arc::new(hook),
            ..DdpConfig::default()
        };
        let ddp = DistributedDataParallel::new(vec![w.clone()], Arc::new(comm), config)?;
        let tape = Tape::new();
        let seed = Tensor::from_vec(rank_gradient(rank), &[LEN])?;
        ddp.backward(&tape.watch(&w)?.mul(&seed)?.sum()?)?;
        let grad = w
            .grad()
            .map(|g| g.to_vec())
            .transpose()?
            .unwrap_or_default();
        Ok((grad, ddp.buffer_bytes(), ddp.gradient_bytes()))
    })?;
    let inputs: Vec<Vec<f32>> = (0..RANKS).map(rank_gradient).collect();
    let scale = inputs.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
    let mut worst = 0f32;
    for (grad, _, _) in &results {
        assert_eq!(grad, &results[0].0, "every rank gets the same average");
        for (i, g) in grad.iter().enumerate() {
            let exact = inputs.iter().map(|v| v[i]).sum::<f32>() / RANKS as f32;
            worst = worst.max((g - exact).abs() / scale);
        }
    }
    Ok((worst, results[0].1, results[0].2))
}

#[test]
fn bf16_average_is_within_two_roundings() -> Result<()> {
    let (error, buffer, grads) = reduce_with(CompressedAllReduce::bf16())?;
    // Rounding into bf16 (≤ 2⁻⁹ relative) and of the average (≤ 2⁻⁹): ≤ 2⁻⁸ of max |g|.
    assert!(error <= 2f32.powi(-8), "bf16 error {error}");
    assert!(error > 0.0, "bf16 should round something");
    assert_eq!(
        buffer, grads,
        "the buckets are the f32 gradients themselves"
    );
    Ok(())
}

#[test]
fn fp16_average_is_within_two_roundings() -> Result<()> {
    let (error, buffer, grads) = reduce_with(CompressedAllReduce::fp16())?;
    assert!(error <= 2f32.powi(-11), "fp16 error {error}");
    assert_eq!(buffer, grads);
    Ok(())
}
