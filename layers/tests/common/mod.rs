//! Helpers shared by the equivalence tests: run a model on `n` rank threads, put the
//! ranks' parts back together, and compare with the serial result.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::BTreeMap;
use std::sync::Arc;

use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_layers::{
    all_reduce_sequence_parallel_grads, Module, RngTracker, Sharding, TensorParallel,
};
use ferrotron_tape::{Parameter, Tape, Tensor};

pub type AnyResult<T> = anyhow::Result<T>;

/// Relative tolerance of every comparison. Elements are compared as
/// `|got − want| ≤ RTOL · (|want| + max|want|)`: relative to the element, with a floor
/// relative to the tensor's scale so that values that cancel to ~0 do not demand more
/// than f32 can give.
pub const RTOL: f32 = 1e-5;

pub fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shapes differ");
    let (got, want) = (got.to_vec().unwrap(), want.to_vec().unwrap());
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= RTOL * (w.abs() + scale),
            "{what}[{i}]: got {g}, want {w} (scale {scale})"
        );
    }
}

pub fn tp_context(
    comm: ferrotron_comm_core::LocalCommunicator,
    sequence_parallel: bool,
) -> TensorParallel {
    TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>)
        .with_sequence_parallel(sequence_parallel)
}

/// Rank `rank`'s part of `full` along `dim`, split as the layers split.
pub fn part(full: &Tensor, dim: usize, rank: usize, size: usize) -> Tensor {
    Sharding::Split {
        dim,
        full_len: full.shape()[dim],
    }
    .shard(full, rank, size)
    .unwrap()
}

pub fn join(parts: &[Tensor], dim: usize) -> Tensor {
    let detached: Vec<Tensor> = parts.iter().map(Tensor::detach).collect();
    let refs: Vec<&Tensor> = detached.iter().collect();
    Tensor::concat(&refs, dim).unwrap()
}

/// Every parameter's gradient (zeros when backward did not reach it), by name.
pub fn grads_of(module: &dyn Module) -> Vec<(String, Sharding, Tensor)> {
    module
        .parameters()
        .into_iter()
        .map(|p| {
            let grad = p
                .param
                .grad()
                .unwrap_or_else(|| Tensor::zeros(&p.param.shape()));
            (p.param.name().to_string(), p.sharding, grad)
        })
        .collect()
}

/// One rank's view of a run.
pub struct RankRun {
    pub output: Tensor,
    pub input_grad: Tensor,
    pub grads: Vec<(String, Sharding, Tensor)>,
}

/// The whole (serial-shaped) picture assembled from all ranks.
pub struct FullRun {
    pub output: Tensor,
    pub input_grad: Tensor,
    pub grads: BTreeMap<String, Tensor>,
}

/// Joins the ranks' parameter gradients; replicated ones must agree across ranks.
pub fn full_grads(ranks: &[Vec<(String, Sharding, Tensor)>]) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    for (index, (name, sharding, _)) in ranks[0].iter().enumerate() {
        let parts: Vec<Tensor> = ranks.iter().map(|r| r[index].2.clone()).collect();
        if *sharding == Sharding::Replicated {
            for (rank, p) in parts.iter().enumerate() {
                assert_close(&format!("{name} grad on rank {rank} vs 0"), p, &parts[0]);
            }
        }
        out.insert(name.clone(), sharding.unshard(&parts).unwrap());
    }
    out
}

/// Runs a sequence-first model (`[s, b, h] → [s, b, h]`) on `tp_size` ranks with loss
/// `Σ output ⊙ weights`. Without sequence parallelism every rank gets the whole input and
/// its outputs must agree; with it, rank r gets part r of the sequence. Sequence-parallel
/// gradients are all-reduced explicitly, as DDP's extra reductions would.
pub fn run_sequence_model<M: Module>(
    tp_size: usize,
    sequence_parallel: bool,
    input: &Tensor,
    loss_weights: &Tensor,
    build: impl Fn(&TensorParallel) -> ferrotron_layers::Result<M> + Sync,
    forward: impl Fn(&M, &Tape, &Tensor, &mut RngTracker) -> ferrotron_layers::Result<Tensor> + Sync,
) -> AnyResult<FullRun> {
    let runs = run_local(tp_size, |comm| -> AnyResult<RankRun> {
        let tp = tp_context(comm, sequence_parallel);
        let (rank, size) = (tp.rank(), tp.size());
        let model = build(&tp)?;
        let (x, weights) = if sequence_parallel {
            (
                part(input, 0, rank, size),
                part(loss_weights, 0, rank, size),
            )
        } else {
            (input.clone(), loss_weights.clone())
        };
        let x = Parameter::new("input", x);
        let tape = Tape::new();
        let mut rng = RngTracker::new(99, rank);
        let output = forward(&model, &tape, &tape.watch(&x)?, &mut rng)?;
        output.mul(&weights)?.sum()?.backward()?;
        all_reduce_sequence_parallel_grads(&model, tp.group())?;
        Ok(RankRun {
            output: output.detach(),
            input_grad: x.grad().expect("input gradient"),
            grads: grads_of(&model),
        })
    })?;
    let (output, input_grad) = if sequence_parallel {
        let outputs: Vec<Tensor> = runs.iter().map(|r| r.output.clone()).collect();
        let input_grads: Vec<Tensor> = runs.iter().map(|r| r.input_grad.clone()).collect();
        (join(&outputs, 0), join(&input_grads, 0))
    } else {
        for (rank, run) in runs.iter().enumerate() {
            assert_close(
                &format!("output of rank {rank}"),
                &run.output,
                &runs[0].output,
            );
            assert_close(
                &format!("input grad of rank {rank}"),
                &run.input_grad,
                &runs[0].input_grad,
            );
        }
        (runs[0].output.clone(), runs[0].input_grad.clone())
    };
    let grads: Vec<_> = runs.into_iter().map(|r| r.grads).collect();
    Ok(FullRun {
        output,
        input_grad,
        grads: full_grads(&grads),
    })
}

/// Asserts that a parallel run equals the serial one, output, input and every parameter.
pub fn assert_runs_equal(what: &str, got: &FullRun, want: &FullRun) {
    assert_close(&format!("{what}: output"), &got.output, &want.output);
    assert_close(
        &format!("{what}: input grad"),
        &got.input_grad,
        &want.input_grad,
    );
    assert_eq!(
        got.grads.keys().collect::<Vec<_>>(),
        want.grads.keys().collect::<Vec<_>>(),
        "{what}: parameter names"
    );
    for (name, grad) in &got.grads {
        assert_close(&format!("{what}: grad of {name}"), grad, &want.grads[name]);
    }
}

/// Every parameter's current value with its sharding, by name.
pub fn values_of(module: &dyn Module) -> ferrotron_tape::Result<Vec<(String, Sharding, Tensor)>> {
    module
        .parameters()
        .into_iter()
        .map(|p| Ok((p.param.name().to_string(), p.sharding, p.param.value()?)))
        .collect()
}
