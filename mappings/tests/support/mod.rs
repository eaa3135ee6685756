//! The "world" emulation the mapping tests compare against: every rank's tensor is built
//! on one thread, the collective becomes concat / sum / narrow on the tape, and the
//! gradients come from the tape's own (grad-checked) ops.
#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;

use anyhow::{ensure, Result};
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_tape::{transfers, Device, Generator, Parameter, Tape, Tensor, Transfers};

/// A group handle as the mappings take it.
pub type Group = Arc<dyn Communicator>;

/// One rank's view after forward and backward: output values and shape, input gradient.
#[derive(Debug, Clone, PartialEq)]
pub struct RankResult {
    pub output: Vec<f64>,
    pub shape: Vec<usize>,
    pub grad: Vec<f64>,
}

/// Whether a tensor holds the same value on every rank or one part per rank. The loss
/// downstream of a replicated output is replicated too (every rank weighs it the same);
/// downstream of a per-rank output it is rank-local, and the total loss is the sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Replicated,
    PerRank,
}

/// Random `f64` values of `shape`, reproducible from `seed`.
pub fn random(shape: &[usize], seed: u64) -> Tensor<f64> {
    Tensor::randn(shape, 1.0, &mut Generator::new(seed))
}

/// Weight of rank `rank`'s output in the loss `Σ_r <w_r, y_r>`.
pub fn loss_weight(shape: &[usize], output: Layout, rank: usize) -> Tensor<f64> {
    let seed = match output {
        Layout::Replicated => 1_000,
        Layout::PerRank => 1_001 + rank as u64,
    };
    random(shape, seed)
}

/// Runs `mapping` on `inputs.len()` local ranks: rank `r` watches `inputs[r]`, maps it,
/// and backpropagates `<w_r, y_r>`.
pub fn distributed<F>(inputs: &[Tensor<f64>], output: Layout, mapping: F) -> Result<Vec<RankResult>>
where
    F: Fn(&Tensor<f64>, &Group) -> ferrotron_mappings::Result<Tensor<f64>> + Sync,
{
    let on_cpu = distributed_on(Device::Cpu, inputs, output, mapping)?;
    Ok(on_cpu.into_iter().map(|(result, _)| result).collect())
}

/// [`distributed`] with inputs, outputs and gradients on `device`; also returns each
/// rank's host↔device copies between uploading its inputs and downloading its results.
pub fn distributed_on<F>(
    device: Device,
    inputs: &[Tensor<f64>],
    output: Layout,
    mapping: F,
) -> Result<Vec<(RankResult, Transfers)>>
where
    F: Fn(&Tensor<f64>, &Group) -> ferrotron_mappings::Result<Tensor<f64>> + Sync,
{
    let results = run_local(inputs.len(), |comm| -> Result<(RankResult, Transfers)> {
        let rank = comm.rank();
        let group: Group = Arc::new(comm);
        let x = Parameter::new("x", inputs[rank].to_device(device)?);
        let tape = Tape::new();
        let before = transfers(device);
        let y = mapping(&tape.watch(&x)?, &group)?;
        let forward = transfers(device) - before;
        let weight = loss_weight(y.shape(), output, rank).to_device(device)?;
        let before = transfers(device);
        y.mul(&weight)?.sum()?.backward()?;
        let moved = forward + (transfers(device) - before);
        let grad = match x.grad() {
            Some(g) => g.to_vec()?,
            None => vec![0.0; inputs[rank].numel()],
        };
        let result = RankResult {
            output: y.to_vec()?,
            shape: y.shape().to_vec(),
            grad,
        };
        Ok((result, moved))
    })?;
    Ok(results)
}

/// The same computation on one thread: `world` maps every rank's input (the one shared
/// tensor `inputs[0]`, for a replicated input) to every rank's output.
pub fn serial<F>(
    inputs: &[Tensor<f64>],
    input: Layout,
    output: Layout,
    world: F,
) -> Result<Vec<RankResult>>
where
    F: Fn(&[Tensor<f64>]) -> ferrotron_tape::Result<Vec<Tensor<f64>>>,
{
    let n = inputs.len();
    let params: Vec<Parameter<f64>> = match input {
        Layout::Replicated => vec![Parameter::new("x", inputs[0].clone())],
        Layout::PerRank => inputs
            .iter()
            .enumerate()
            .map(|(r, x)| Parameter::new(format!("x{r}"), x.clone()))
            .collect(),
    };
    let tape = Tape::new();
    let watched: Vec<Tensor<f64>> = (0..n)
        .map(|r| tape.watch(&params[r.min(params.len() - 1)]))
        .collect::<std::result::Result<_, _>>()?;
    let outputs = world(&watched)?;
    ensure!(
        outputs.len() == n,
        "the emulation must give one output per rank"
    );
    // A replicated output's loss is one loss, computed alike on every rank; rank-local
    // losses add up.
    let losing = match output {
        Layout::Replicated => &outputs[..1],
        Layout::PerRank => &outputs[..],
    };
    let mut terms = Vec::new();
    for (r, y) in losing.iter().enumerate() {
        terms.push(y.mul(&loss_weight(y.shape(), output, r))?.sum()?);
    }
    let loss = sum_all(&terms)?;
    loss.backward()?;
    (0..n)
        .map(|r| {
            let param = &params[r.min(params.len() - 1)];
            let grad = match param.grad() {
                Some(g) => g.to_vec()?,
                None => vec![0.0; param.numel()],
            };
            Ok(RankResult {
                output: outputs[r].to_vec()?,
                shape: outputs[r].shape().to_vec(),
                grad,
            })
        })
        .collect()
}

/// Checks two runs element by element with grad-check tolerances
/// (`|a − b| ≤ 1e-9 + 1e-9·|b|`, far inside `ferrotron_tape::gradcheck`'s `1e-5 + 1e-3·|b|`).
pub fn assert_close(what: &str, got: &[RankResult], want: &[RankResult]) -> Result<()> {
    ensure!(got.len() == want.len(), "{what}: rank counts differ");
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        ensure!(
            g.shape == w.shape,
            "{what}: rank {r} shape {:?} != {:?}",
            g.shape,
            w.shape
        );
        ensure!(
            close(&g.output, &w.output),
            "{what}: rank {r} output {:?} != {:?}",
            g.output,
            w.output
        );
        ensure!(
            close(&g.grad, &w.grad),
            "{what}: rank {r} grad {:?} != {:?}",
            g.grad,
            w.grad
        );
    }
    Ok(())
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-9 + 1e-9 * y.abs())
}

/// Sum of tensors on the tape.
pub fn sum_all(xs: &[Tensor<f64>]) -> ferrotron_tape::Result<Tensor<f64>> {
    let mut total = xs[0].clone();
    for x in &xs[1..] {
        total = total.add(x)?;
    }
    Ok(total)
}

/// Rank `r`'s part of `x` along `dim` when ranks hold `sizes`.
pub fn part(
    x: &Tensor<f64>,
    dim: usize,
    sizes: &[usize],
    r: usize,
) -> ferrotron_tape::Result<Tensor<f64>> {
    x.narrow(dim, sizes[..r].iter().sum(), sizes[r])
}

/// `shape` with dimension `dim` set to `len`.
pub fn with_len(shape: &[usize], dim: usize, len: usize) -> Vec<usize> {
    let mut shape = shape.to_vec();
    shape[dim] = len;
    shape
}
