//! A small MLP built from tape ops, its data, and DDP / single-rank training loops shared
//! by the test binaries (each uses a different subset).
#![allow(dead_code)]

use std::sync::Arc;

use ferrotron_comm_core::Communicator;
use ferrotron_ddp::{DdpConfig, DistributedDataParallel};
use ferrotron_tape::{
    AdamW, AdamWConfig, Generator, Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor,
};

pub const INPUTS: usize = 6;
pub const HIDDEN: usize = 8;
pub const OUTPUTS: usize = 3;

/// `relu(x·w1 + b1)·w2 + b2`, parameters in registration order.
pub fn mlp(seed: u64) -> Vec<Parameter> {
    let mut rng = Generator::new(seed);
    vec![
        Parameter::new("w1", Tensor::randn(&[INPUTS, HIDDEN], 0.4, &mut rng)),
        Parameter::new("b1", Tensor::randn(&[HIDDEN], 0.1, &mut rng)),
        Parameter::new("w2", Tensor::randn(&[HIDDEN, OUTPUTS], 0.4, &mut rng)),
        Parameter::new("b2", Tensor::randn(&[OUTPUTS], 0.1, &mut rng)),
    ]
}

/// Mean squared error of the MLP on `(x, target)`.
pub fn loss(
    tape: &Tape,
    params: &[Parameter],
    x: &Tensor,
    target: &Tensor,
) -> ferrotron_tape::Result<Tensor> {
    let h = x
        .matmul(&tape.watch(&params[0])?)?
        .add(&tape.watch(&params[1])?)?
        .relu()?;
    let y = h
        .matmul(&tape.watch(&params[2])?)?
        .add(&tape.watch(&params[3])?)?;
    let diff = y.sub(target)?;
    diff.mul(&diff)?.mean()
}

/// The whole batch of step `step`: `rows` rows.
pub fn global_batch(step: usize, rows: usize) -> (Tensor, Tensor) {
    let mut rng = Generator::new(1000 + step as u64);
    (
        Tensor::randn(&[rows, INPUTS], 1.0, &mut rng),
        Tensor::randn(&[rows, OUTPUTS], 1.0, &mut rng),
    )
}

/// Rows `[part·rows, (part+1)·rows)` of a batch.
pub fn slice(
    batch: &(Tensor, Tensor),
    part: usize,
    rows: usize,
) -> ferrotron_tape::Result<(Tensor, Tensor)> {
    Ok((
        batch.0.narrow(0, part * rows, rows)?,
        batch.1.narrow(0, part * rows, rows)?,
    ))
}

#[derive(Clone, Copy, Debug)]
pub enum Opt {
    Sgd,
    AdamW,
}

pub fn optimizer(kind: Opt, params: Vec<Parameter>) -> ferrotron_tape::Result<Box<dyn Optimizer>> {
    Ok(match kind {
        Opt::Sgd => Box::new(Sgd::new(
            params,
            SgdConfig {
                momentum: 0.9,
                ..SgdConfig::new(0.1)
            },
        )?),
        Opt::AdamW => Box::new(AdamW::new(
            params,
            AdamWConfig {
                lr: 0.01,
                ..AdamWConfig::default()
            },
        )?),
    })
}

pub fn values(params: &[Parameter]) -> ferrotron_tape::Result<Vec<Vec<f32>>> {
    params.iter().map(|p| p.value()?.to_vec()).collect()
}

pub fn grads(params: &[Parameter]) -> ferrotron_tape::Result<Vec<Option<Vec<f32>>>> {
    params
        .iter()
        .map(|p| p.grad().map(|g| g.to_vec()).transpose())
        .collect()
}

/// One rank training on the whole batch (`ranks · rows` rows) for `steps` steps, from the
/// parameters DP rank 0 starts with (seed 100).
pub fn train_single(
    kind: Opt,
    ranks: usize,
    rows: usize,
    steps: usize,
) -> ferrotron_tape::Result<Vec<Vec<f32>>> {
    let params = mlp(100);
    let mut opt = optimizer(kind, params.clone())?;
    let tape = Tape::new();
    for step in 0..steps {
        let (x, target) = global_batch(step, ranks * rows);
        opt.zero_grad();
        loss(&tape, &params, &x, &target)?.backward()?;
        opt.step()?;
    }
    values(&params)
}

/// DP training: every rank starts from its own seed (construction broadcasts rank 0's,
/// seed 100) and trains on its `rows`-row slice of each step's batch.
pub fn train_ddp(
    dp: Arc<dyn Communicator>,
    kind: Opt,
    rows: usize,
    steps: usize,
    config: DdpConfig,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let (rank, ranks) = (dp.rank(), dp.size());
    let params = mlp(100 + rank as u64);
    let ddp = DistributedDataParallel::new(params.clone(), dp, config)?;
    let mut opt = optimizer(kind, params.clone())?;
    let tape = Tape::new();
    for step in 0..steps {
        let (x, target) = slice(&global_batch(step, ranks * rows), rank, rows)?;
        opt.zero_grad();
        ddp.backward(&loss(&tape, &params, &x, &target)?)?;
        opt.step()?;
    }
    Ok(values(&params)?)
}

/// Tiny caps so that the MLP spreads over several buckets.
pub fn small_buckets() -> DdpConfig {
    DdpConfig {
        first_bucket_bytes: 16,
        bucket_cap_bytes: 4 * HIDDEN * OUTPUTS + 16,
        ..DdpConfig::default()
    }
}

/// Largest `|a − b|` of each tensor relative to its largest `|b|`, over all tensors.
pub fn max_relative_error(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "tensor counts differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            assert_eq!(x.len(), y.len(), "tensor lengths differ");
            let scale = y
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()))
                .max(f32::MIN_POSITIVE);
            x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / scale
        })
        .fold(0f32, f32::max)
}

/// Width of [`tp_block`].
pub const BLOCK_HIDDEN: usize = 16;

/// A transformer block of width [`BLOCK_HIDDEN`] (4 heads, FFN width 42, so that it
/// splits unevenly at TP 4) over `state`'s tensor-parallel group, seeded the same on
/// every layout, with its tensor-parallel context.
pub fn tp_block(
    state: &ferrotron_parallel_state::ParallelState,
    sequence_parallel: bool,
) -> ferrotron_layers::Result<(
    ferrotron_layers::TensorParallel,
    ferrotron_layers::TransformerBlock,
)> {
    let tp = ferrotron_layers::TensorParallel::from_state(state)
        .with_sequence_parallel(sequence_parallel);
    let config = ferrotron_layers::BlockConfig {
        ffn_hidden: 42,
        ..ferrotron_layers::BlockConfig::new(BLOCK_HIDDEN, 4)
    };
    let init = ferrotron_layers::MasterInit::new(7, 0.3).with_bias_std(0.1);
    let block = ferrotron_layers::TransformerBlock::new(&tp, "block", &config, &init)?;
    Ok((tp, block))
}
