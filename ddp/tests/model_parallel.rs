//! DDP over a `layers` model under TP × DP: every gradient after `backward` equals the
//! serial model's (TP = DP = 1, the whole batch), built from the same seeded master
//! weights, to relative 1e-5 under `layers`' rule `|got − want| ≤ 1e-5 · (|want| +
//! max|want|)`.
//!
//! TP = 3 × DP = 2 with sequence parallelism, a transformer block whose MLP width (10) and
//! sequence (5) split unevenly over 3 ranks, and bucket caps so small that the buckets of
//! different TP ranks hold different parameters: the extra `"tp"` reductions of the layer
//! norms and row-parallel biases must not depend on the bucket layout.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Result;
use ferrotron_comm_core::{run_local, Communicator};
use ferrotron_ddp::{DdpConfig, DistributedDataParallel, NamedGroupReduction};
use ferrotron_layers::{
    part_of, BlockConfig, MasterInit, Module, RngTracker, Sharding, TensorParallel,
    TransformerBlock,
};
use ferrotron_parallel_state::{ParallelState, RankLayout};
use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

const TP: usize = 3;
const DP: usize = 2;
const SEQ: usize = 5;
/// Batch of one DP rank.
const BATCH: usize = 2;
const HIDDEN: usize = 6;
const HEADS: usize = 3;
const FFN: usize = 10;
const RTOL: f32 = 1e-5;

fn block_config() -> BlockConfig {
    BlockConfig {
        ffn_hidden: FFN,
        ..BlockConfig::new(HIDDEN, HEADS)
    }
}

fn block(tp: &TensorParallel) -> ferrotron_layers::Result<TransformerBlock> {
    TransformerBlock::new(tp, "block", &block_config(), &MasterInit::new(7, 0.3))
}

/// The whole batch `[SEQ, DP · BATCH, HIDDEN]` and the loss weights of the same shape.
fn data() -> (Tensor, Tensor) {
    let mut rng = Generator::new(11);
    let shape = [SEQ, DP * BATCH, HIDDEN];
    (
        Tensor::randn(&shape, 1.0, &mut rng),
        Tensor::randn(&shape, 1.0, &mut rng),
    )
}

/// One f32 bucket cap for the first bucket (the last block parameter, 6 elements) and a
/// cap of 40 elements after it: TP rank 0 holds 4 of the MLP's 10 inner rows, ranks 1
/// and 2 hold 3, so their buckets end at different parameters.
fn small_buckets() -> DdpConfig {
    DdpConfig {
        first_bucket_bytes: 6 * 4,
        bucket_cap_bytes: 40 * 4,
        ..DdpConfig::default()
    }
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
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

/// The serial gradients of loss `Σ output ⊙ weights / DP` (DDP averages the DP ranks'
/// losses `Σ output_part ⊙ weights_part`).
fn serial_grads() -> Result<Vec<(String, Tensor)>> {
    let (x, weights) = data();
    let mut runs = run_local(1, |comm| -> Result<Vec<(String, Tensor)>> {
        let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>);
        let model = block(&tp)?;
        let tape = Tape::new();
        let output = model.forward(&tape, &x, &mut RngTracker::new(5, 0))?;
        output
            .mul(&weights)?
            .sum()?
            .scale(1.0 / DP as f64)?
            .backward()?;
        Ok(model
            .parameters()
            .into_iter()
            .map(|p| {
                (
                    p.param.name().to_string(),
                    p.param.grad().expect("gradient"),
                )
            })
            .collect())
    })?;
    Ok(runs.remove(0))
}

/// One rank's gradients after DDP, and its bucket layout (parameter names per bucket).
struct RankGrads {
    tp_rank: usize,
    dp_rank: usize,
    buckets: Vec<Vec<String>>,
    grads: Vec<(String, Sharding, Tensor)>,
}

/// Runs one TP × DP backward step; `wrap` builds DDP over the rank's model.
fn parallel_grads(
    wrap: impl Fn(&TransformerBlock, &ParallelState) -> ferrotron_ddp::Result<DistributedDataParallel>
        + Sync,
) -> Result<Vec<RankGrads>> {
    let layout = RankLayout::builder(TP * DP).tp(TP).build()?;
    let (x, weights) = data();
    Ok(run_local(TP * DP, |comm| -> Result<RankGrads> {
        let state = ParallelState::new(Arc::new(comm), layout.clone())?;
        let (tp_rank, dp_rank) = (state.tp_rank(), state.dp_rank());
        let tp = TensorParallel::from_state(&state).with_sequence_parallel(true);
        let model = block(&tp)?;
        let ddp = wrap(&model, &state)?;
        let (seq_start, seq_len) = part_of(SEQ, tp_rank, TP)?;
        let part = |t: &Tensor| -> ferrotron_tape::Result<Tensor> {
            t.narrow(1, dp_rank * BATCH, BATCH)?
                .narrow(0, seq_start, seq_len)
        };
        let tape = Tape::new();
        let output = model.forward(&tape, &part(&x)?, &mut RngTracker::new(5, tp_rank))?;
        ddp.backward(&output.mul(&part(&weights)?)?.sum()?)?;
        Ok(RankGrads {
            tp_rank,
            dp_rank,
            buckets: ddp
                .buckets()
                .iter()
                .map(|b| b.params.iter().map(|p| p.name.clone()).collect())
                .collect(),
            grads: model
                .parameters()
                .into_iter()
                .map(|p| {
                    let grad = p.param.grad().expect("gradient");
                    (p.param.name().to_string(), p.sharding, grad)
                })
                .collect(),
        })
    })?)
}

/// Every DP replica's gradients, unsharded over its TP group, equal the serial ones;
/// replicated parameters' gradients agree across the TP group.
fn assert_equals_serial(ranks: &[RankGrads], serial: &[(String, Tensor)]) {
    let mut replicas: BTreeMap<usize, Vec<&RankGrads>> = BTreeMap::new();
    for rank in ranks {
        replicas.entry(rank.dp_rank).or_default().push(rank);
    }
    assert_eq!(replicas.len(), DP);
    for (dp_rank, replica) in &mut replicas {
        replica.sort_by_key(|r| r.tp_rank);
        assert_eq!(replica.len(), TP);
        assert_eq!(replica[0].grads.len(), serial.len());
        for (index, (name, want)) in serial.iter().enumerate() {
            let (got_name, sharding, _) = &replica[0].grads[index];
            assert_eq!(got_name, name, "parameter order");
            let parts: Vec<Tensor> = replica.iter().map(|r| r.grads[index].2.clone()).collect();
            if *sharding == Sharding::Replicated {
                for (tp_rank, part) in parts.iter().enumerate() {
                    assert_close(
                        &format!("{name} grad on DP {dp_rank} TP {tp_rank} vs TP 0"),
                        part,
                        &parts[0],
                    );
                }
            }
            let full = sharding.unshard(&parts).expect("unshard");
            assert_close(&format!("{name} grad of DP replica {dp_rank}"), &full, want);
        }
    }
}

#[test]
fn uneven_tp_shards_with_sequence_parallelism_give_the_serial_gradients() -> Result<()> {
    let ranks = parallel_grads(|model, state| {
        let mut marks = NamedGroupReduction::new();
        let sharded = model.parameters();
        for p in &sharded {
            if let Some(group) = p.grad_reduce_group {
                marks.mark(state, &p.param, &[group])?;
            }
        }
        let config = DdpConfig {
            extra_reductions: marks,
            ..small_buckets()
        };
        let params: Vec<Parameter> = sharded.into_iter().map(|p| p.param).collect();
        DistributedDataParallel::new(params, state.dp().clone(), config)
    })?;
    // The premise: TP ranks 0 and 1 lay their buckets out differently.
    let layout_of = |tp_rank: usize| {
        ranks
            .iter()
            .find(|r| r.tp_rank == tp_rank)
            .map(|r| r.buckets.clone())
    };
    assert_ne!(layout_of(0), layout_of(1));
    assert_equals_serial(&ranks, &serial_grads()?);
    Ok(())
}

/// `for_model` marks the model's sequence-parallel parameters itself. A manual mark in
/// the config for a parameter the model marks too joins it (the union): the gradient is
/// summed once, not twice.
#[test]
fn for_model_derives_the_reductions_from_the_model() -> Result<()> {
    let ranks = parallel_grads(|model, state| {
        let marked: Vec<String> = model
            .parameters()
            .iter()
            .filter(|p| p.grad_reduce_group.is_some())
            .map(|p| p.param.name().to_string())
            .collect();
        assert_eq!(
            marked,
            [
                "block.ln1.weight",
                "block.ln1.bias",
                "block.attention.proj.bias",
                "block.ln2.weight",
                "block.ln2.bias",
                "block.mlp.fc2.bias"
            ]
        );
        let mut marks = NamedGroupReduction::new();
        marks.mark(state, &model.parameters()[0].param, &["tp"])?;
        let config = DdpConfig {
            extra_reductions: marks,
            ..small_buckets()
        };
        DistributedDataParallel::for_model(model, state, config)
    })?;
    assert_equals_serial(&ranks, &serial_grads()?);
    Ok(())
}
