//! Seed 001: a plain all-gather carries no gradient, so a contrastive loss over the
//! gathered batch needs a differentiable gather. The seed lists three ways; each is one
//! mapping (or flag) here, and each is right for one kind of loss:
//!
//! | seed's way | backward | mapping here | exact for |
//! |---|---|---|---|
//! | gather under no-grad, then `all_x[rank] = x` | own slice only | [`gather_from_region`], `all_gather_variable(.., false)` | a loss replicated on every rank |
//! | `GatherLayer` / CLIP4Clip `AllGather`: "slice only" | own slice only | the same | the same |
//! | `SyncFunction`: all-reduce, then slice | summed, own slice | [`all_gather_from_region`], `all_gather_variable(.., true)` | rank-local losses that add up to the total |
//!
//! A replicated loss is the full-batch loss computed identically on every rank: its
//! gradient for this rank's rows is already complete locally, and summing it over ranks
//! would count it `n` times. A rank-local loss (this rank's anchors against every
//! gathered row) depends on this rank's rows through every rank's loss, so the
//! gradients must be summed over ranks to be the total loss's.

mod support;

use std::sync::Arc;

use anyhow::{ensure, Result};
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_mappings::{all_gather_from_region, all_gather_variable, gather_from_region};
use ferrotron_tape::{CrossEntropyOptions, Parameter, Reduction, Tape, Tensor};
use support::{random, Group};

const BATCHES: [usize; 3] = [2, 3, 1];
const FEATURES: usize = 4;

fn embeddings(rank: usize) -> Tensor<f64> {
    random(&[BATCHES[rank], FEATURES], 100 + rank as u64)
}

fn offset(rank: usize) -> usize {
    BATCHES[..rank].iter().sum()
}

/// InfoNCE-style loss: each anchor row against every row of the batch, its own row as the
/// positive. Labels are the anchors' global row indices.
fn contrastive(
    anchors: &Tensor<f64>,
    batch: &Tensor<f64>,
    first_label: usize,
    reduction: Reduction,
) -> ferrotron_tape::Result<Tensor<f64>> {
    let logits = anchors.matmul(&batch.transpose(0, 1)?)?;
    let labels: Vec<i64> = (0..anchors.shape()[0])
        .map(|i| (first_label + i) as i64)
        .collect();
    let options = CrossEntropyOptions {
        reduction,
        ..CrossEntropyOptions::default()
    };
    logits.cross_entropy(&labels, &options)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loss {
    /// Mean over the full batch, identical on every rank.
    Replicated,
    /// Sum over this rank's anchors; the total loss is the sum over ranks.
    Local,
}

#[derive(Clone, Copy, Debug)]
enum Gather {
    /// The seed's `all_x[rank] = x`: a gradient-free gather with the live tensor put back.
    OwnSliceByHand,
    /// `gather_from_region`: backward keeps the own slice (the seed's "slice only").
    SliceOnly,
    /// `all_gather_variable(all_reduce_grads = false)`.
    VariableSliceOnly,
    /// `all_gather_from_region`: backward sums, then keeps the own slice.
    AllReduceThenSlice,
    /// `all_gather_variable(all_reduce_grads = true)`.
    VariableAllReduceThenSlice,
}

const GATHERS: [Gather; 5] = [
    Gather::OwnSliceByHand,
    Gather::SliceOnly,
    Gather::VariableSliceOnly,
    Gather::AllReduceThenSlice,
    Gather::VariableAllReduceThenSlice,
];

impl Gather {
    fn sums_gradients(self) -> bool {
        matches!(
            self,
            Gather::AllReduceThenSlice | Gather::VariableAllReduceThenSlice
        )
    }

    fn run(self, x: &Tensor<f64>, group: &Group) -> ferrotron_mappings::Result<Tensor<f64>> {
        match self {
            Gather::OwnSliceByHand => {
                // Gathering a detached tensor records nothing: no gradient flows back.
                let (all, sizes) = all_gather_variable(&x.detach(), group, 0, None, false)?;
                let mut parts = all.split(&sizes, 0)?;
                parts[group.rank()] = x.clone();
                let refs: Vec<&Tensor<f64>> = parts.iter().collect();
                Ok(Tensor::concat(&refs, 0)?)
            }
            Gather::SliceOnly => gather_from_region(x, group, 0, None),
            Gather::VariableSliceOnly => Ok(all_gather_variable(x, group, 0, None, false)?.0),
            Gather::AllReduceThenSlice => all_gather_from_region(x, group, 0, None),
            Gather::VariableAllReduceThenSlice => {
                Ok(all_gather_variable(x, group, 0, None, true)?.0)
            }
        }
    }
}

/// Every rank's gradient of its embeddings, under each gather and loss.
fn distributed(gather: Gather, loss: Loss) -> Result<Vec<Vec<f64>>> {
    Ok(run_local(BATCHES.len(), |comm| -> Result<Vec<f64>> {
        let rank = comm.rank();
        let group: Group = Arc::new(comm);
        let x = Parameter::new("x", embeddings(rank));
        let tape = Tape::new();
        let mine = tape.watch(&x)?;
        let batch = gather.run(&mine, &group)?;
        let value = match loss {
            Loss::Replicated => contrastive(&batch, &batch, 0, Reduction::Mean)?,
            Loss::Local => contrastive(&mine, &batch, offset(rank), Reduction::Sum)?,
        };
        value.backward()?;
        Ok(x.grad()
            .map(|g| g.to_vec())
            .transpose()?
            .unwrap_or_default())
    })?)
}

/// Single-process gradients of the full-batch loss (mean, or the sum that the local losses
/// add up to), cut into each rank's rows.
fn single_process(reduction: Reduction) -> Result<Vec<Vec<f64>>> {
    let params: Vec<Parameter<f64>> = (0..BATCHES.len())
        .map(|r| Parameter::new(format!("x{r}"), embeddings(r)))
        .collect();
    let tape = Tape::new();
    let watched: Vec<Tensor<f64>> = params
        .iter()
        .map(|p| tape.watch(p))
        .collect::<std::result::Result<_, _>>()?;
    let refs: Vec<&Tensor<f64>> = watched.iter().collect();
    let batch = Tensor::concat(&refs, 0)?;
    contrastive(&batch, &batch, 0, reduction)?.backward()?;
    params
        .iter()
        .map(|p| {
            Ok(p.grad()
                .map(|g| g.to_vec())
                .transpose()?
                .unwrap_or_default())
        })
        .collect()
}

fn close(a: &[Vec<f64>], b: &[Vec<f64>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(a, b)| {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| (x - y).abs() <= 1e-9 + 1e-9 * y.abs())
        })
}

fn scaled(grads: &[Vec<f64>], factor: f64) -> Vec<Vec<f64>> {
    grads
        .iter()
        .map(|g| g.iter().map(|v| v * factor).collect())
        .collect()
}

#[test]
fn replicated_loss_needs_the_own_slice_only() -> Result<()> {
    let full = single_process(Reduction::Mean)?;
    for gather in GATHERS {
        let got = distributed(gather, Loss::Replicated)?;
        // Summing a replicated loss's gradient counts it once per rank: right only if the
        // data-parallel reduction then averages instead of summing.
        let expected = if gather.sums_gradients() {
            scaled(&full, BATCHES.len() as f64)
        } else {
            full.clone()
        };
        ensure!(
            close(&got, &expected),
            "{gather:?}: {got:?} vs {expected:?}"
        );
    }
    Ok(())
}

#[test]
fn local_losses_need_the_summed_gradient() -> Result<()> {
    let total = single_process(Reduction::Sum)?;
    for gather in GATHERS {
        let got = distributed(gather, Loss::Local)?;
        if gather.sums_gradients() {
            ensure!(close(&got, &total), "{gather:?}: {got:?} vs {total:?}");
        } else {
            // Each rank sees only its own loss's share of its rows' gradient, missing the
            // terms where its rows are negatives for other ranks' anchors.
            ensure!(
                !close(&got, &total),
                "{gather:?} should miss other ranks' terms"
            );
        }
    }
    Ok(())
}
