//! MLP, attention and transformer blocks on TP ∈ {2, 3, 4} equal the serial (TP = 1)
//! model built from the same master weights, with sequence parallelism off and on —
//! outputs, input gradients and every parameter gradient. The serial attention is also
//! checked against a plain, single-head-at-a-time implementation; attention both ways,
//! fused and unfused, multi-head and grouped-query.

mod common;

use common::{assert_close, assert_runs_equal, run_sequence_model, AnyResult};
use ferrotron_layers::{
    BlockConfig, MasterInit, Module, ParallelMlp, ParallelSelfAttention, TransformerBlock,
};
use ferrotron_tape::{causal_mask, AttentionKernel, Generator, Tape, Tensor};

const SEQ: usize = 6;
const BATCH: usize = 2;
const HIDDEN: usize = 24;
const HEADS: usize = 12;

fn config() -> BlockConfig {
    BlockConfig {
        // 50 is not divisible by 3 or 4: the MLP is split unevenly.
        ffn_hidden: 50,
        ..BlockConfig::new(HIDDEN, HEADS)
    }
}

fn init() -> MasterInit {
    MasterInit::new(2024, 0.2).with_bias_std(0.1)
}

fn data() -> (Tensor, Tensor) {
    let mut rng = Generator::new(5);
    (
        Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng),
        Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng),
    )
}

/// Two pre-norm blocks, enough to see gradients flow through a residual stack.
struct TwoBlocks(TransformerBlock, TransformerBlock);

impl Module for TwoBlocks {
    fn parameters(&self) -> Vec<ferrotron_layers::ShardedParameter> {
        let mut params = self.0.parameters();
        params.extend(self.1.parameters());
        params
    }
}

#[test]
fn mlp_matches_serial_for_every_tp_and_sequence_parallel() -> AnyResult<()> {
    let (x, w) = data();
    let build =
        |tp: &ferrotron_layers::TensorParallel| ParallelMlp::new(tp, "mlp", &config(), &init());
    let forward = |m: &ParallelMlp,
                   tape: &Tape,
                   x: &Tensor,
                   _: &mut ferrotron_layers::RngTracker| m.forward(tape, x);
    let serial = run_sequence_model(1, false, &x, &w, build, forward)?;
    for tp in [2, 3, 4] {
        for sp in [false, true] {
            let parallel = run_sequence_model(tp, sp, &x, &w, build, forward)?;
            assert_runs_equal(&format!("mlp tp={tp} sp={sp}"), &parallel, &serial);
        }
    }
    Ok(())
}

/// Multi-head and grouped-query attention (4 groups of 3 heads), fused and unfused.
fn attention_configs() -> Vec<BlockConfig> {
    let mut configs = Vec::new();
    for query_groups in [None, Some(4)] {
        for attention in [AttentionKernel::Fused, AttentionKernel::Unfused] {
            configs.push(BlockConfig {
                query_groups,
                attention,
                ..config()
            });
        }
    }
    configs
}

#[test]
fn attention_matches_serial_for_every_tp_and_sequence_parallel() -> AnyResult<()> {
    let (x, w) = data();
    for config in attention_configs() {
        let build = |tp: &ferrotron_layers::TensorParallel| {
            ParallelSelfAttention::new(tp, "attn", &config, &init())
        };
        let forward =
            |m: &ParallelSelfAttention,
             tape: &Tape,
             x: &Tensor,
             rng: &mut ferrotron_layers::RngTracker| { m.forward(tape, x, rng) };
        let serial = run_sequence_model(1, false, &x, &w, build, forward)?;
        // Tensor parallelism divides the key/value groups.
        for tp in [2, 3, 4].into_iter().filter(|tp| config.groups() % tp == 0) {
            for sp in [false, true] {
                let parallel = run_sequence_model(tp, sp, &x, &w, build, forward)?;
                let what = format!(
                    "{:?} groups {:?} tp={tp} sp={sp}",
                    config.attention, config.query_groups
                );
                assert_runs_equal(&what, &parallel, &serial);
            }
        }
    }
    Ok(())
}

#[test]
fn serial_attention_matches_a_plain_per_head_implementation() -> AnyResult<()> {
    for config in attention_configs() {
        let (x, _) = data();
        let outputs = ferrotron_comm_core::run_local(1, |comm| -> AnyResult<Tensor> {
            let tp = common::tp_context(comm, false);
            let attention = ParallelSelfAttention::new(&tp, "attn", &config, &init())?;
            let mut rng = ferrotron_layers::RngTracker::new(0, 0);
            Ok(attention.forward(&Tape::new(), &x, &mut rng)?)
        })?;
        let what = format!("{:?} groups {:?}", config.attention, config.query_groups);
        assert_close(&what, &outputs[0], &plain_attention(&config, &x)?);
    }
    Ok(())
}

/// Attention from the master weights, one (batch, head) at a time: the QKV projection's
/// rows group by group (the group's queries, its key, its value).
fn plain_attention(config: &BlockConfig, x: &Tensor) -> AnyResult<Tensor> {
    let master = init();
    let (groups, head_dim) = (config.groups(), HIDDEN / HEADS);
    let per_group = HEADS / groups;
    let width = (HEADS + 2 * groups) * head_dim;
    let qkv_w = master.weight("attn.qkv.weight", &[width, HIDDEN]);
    let qkv_b = master.bias("attn.qkv.bias", &[width], 0.0)?;
    let proj_w = master.weight("attn.proj.weight", &[HIDDEN, HIDDEN]);
    let proj_b = master.bias("attn.proj.bias", &[HIDDEN], 0.0)?;
    let mut per_batch = Vec::new();
    for b in 0..BATCH {
        let xb = x.narrow(1, b, 1)?.reshape(&[SEQ, HIDDEN])?;
        let qkv = xb.matmul(&qkv_w.transpose(0, 1)?)?.add(&qkv_b)?;
        let mut heads = Vec::new();
        for h in 0..HEADS {
            let group = (h / per_group) * (per_group + 2);
            let column = |i: usize| qkv.narrow(1, (group + i) * head_dim, head_dim);
            let (q, k, v) = (
                column(h % per_group)?,
                column(per_group)?,
                column(per_group + 1)?,
            );
            let probs = q
                .matmul(&k.transpose(0, 1)?)?
                .scale(1.0 / (head_dim as f64).sqrt())?
                .masked_fill(&causal_mask(SEQ), f32::NEG_INFINITY)?
                .softmax()?;
            heads.push(probs.matmul(&v)?);
        }
        let refs: Vec<&Tensor> = heads.iter().collect();
        let context = Tensor::concat(&refs, 1)?;
        let out = context.matmul(&proj_w.transpose(0, 1)?)?.add(&proj_b)?;
        per_batch.push(out.reshape(&[SEQ, 1, HIDDEN])?);
    }
    let refs: Vec<&Tensor> = per_batch.iter().collect();
    Ok(Tensor::concat(&refs, 1)?)
}

#[test]
fn two_blocks_match_serial_with_and_without_sequence_parallel() -> AnyResult<()> {
    let (x, w) = data();
    let build = |tp: &ferrotron_layers::TensorParallel| -> ferrotron_layers::Result<TwoBlocks> {
        Ok(TwoBlocks(
            TransformerBlock::new(tp, "block0", &config(), &init())?,
            TransformerBlock::new(tp, "block1", &config(), &init())?,
        ))
    };
    let forward =
        |m: &TwoBlocks, tape: &Tape, x: &Tensor, rng: &mut ferrotron_layers::RngTracker| {
            let h = m.0.forward(tape, x, rng)?;
            m.1.forward(tape, &h, rng)
        };
    let serial = run_sequence_model(1, false, &x, &w, build, forward)?;
    for tp in [2, 4] {
        for sp in [false, true] {
            let parallel = run_sequence_model(tp, sp, &x, &w, build, forward)?;
            assert_runs_equal(&format!("2 blocks tp={tp} sp={sp}"), &parallel, &serial);
        }
    }
    Ok(())
}

#[test]
fn hidden_dropout_on_replicated_activations_is_identical_across_tp() -> AnyResult<()> {
    // Dropout after the row-parallel reduction draws from the default stream, the same
    // on every tensor-parallel rank and in the serial model.
    let (x, w) = data();
    let config = BlockConfig {
        hidden_dropout: 0.3,
        ..config()
    };
    let build = |tp: &ferrotron_layers::TensorParallel| {
        TransformerBlock::new(tp, "block0", &config, &init())
    };
    let forward =
        |m: &TransformerBlock, tape: &Tape, x: &Tensor, rng: &mut ferrotron_layers::RngTracker| {
            m.forward(tape, x, rng)
        };
    let serial = run_sequence_model(1, false, &x, &w, build, forward)?;
    let parallel = run_sequence_model(2, false, &x, &w, build, forward)?;
    assert_runs_equal("block with hidden dropout, tp=2", &parallel, &serial);
    // Some elements really were dropped: the output differs from the no-dropout block.
    let plain = run_sequence_model(
        1,
        false,
        &x,
        &w,
        |tp: &ferrotron_layers::TensorParallel| {
            TransformerBlock::new(tp, "block0", &self::config(), &init())
        },
        forward,
    )?;
    assert_ne!(plain.output.to_vec()?, serial.output.to_vec()?);
    Ok(())
}

#[test]
fn sequence_parallel_flags_exactly_the_norms_and_row_biases() -> AnyResult<()> {
    let flagged = ferrotron_comm_core::run_local(2, |comm| -> AnyResult<Vec<String>> {
        let tp = common::tp_context(comm, true);
        let block = TransformerBlock::new(&tp, "b", &config(), &init())?;
        Ok(block
            .parameters()
            .into_iter()
            .filter(|p| p.grad_reduce_group == Some(ferrotron_layers::TP_GROUP))
            .map(|p| p.param.name().to_string())
            .collect())
    })?;
    assert_eq!(
        flagged[0],
        [
            "b.ln1.weight",
            "b.ln1.bias",
            "b.attention.proj.bias",
            "b.ln2.weight",
            "b.ln2.bias",
            "b.mlp.fc2.bias"
        ]
    );
    Ok(())
}

/// The streams a block with dropout draws from, as Megatron's tracker routes them, on
/// two tensor-parallel ranks: attention probabilities (sharded by head) from each rank's
/// model-parallel stream; residual branches from the default stream shared by the ranks,
/// or under sequence parallelism (each rank its part of the sequence) from the
/// model-parallel one. Evaluation draws from none.
#[test]
fn dropout_draws_from_the_streams_megatron_uses() -> AnyResult<()> {
    use ferrotron_layers::{RngState, RngTracker, TensorParallel};
    let (x, _) = data();
    let cases = [
        // (attention, hidden, sequence parallel, default drawn, model-parallel drawn)
        (0.2, 0.0, false, false, true),
        (0.0, 0.2, false, true, false),
        (0.0, 0.2, true, false, true),
    ];
    for (attention_dropout, hidden_dropout, sp, default_drawn, private_drawn) in cases {
        let config = BlockConfig {
            attention_dropout,
            hidden_dropout,
            ..config()
        };
        let what = format!("attention {attention_dropout}, hidden {hidden_dropout}, sp {sp}");
        let ranks =
            ferrotron_comm_core::run_local(2, |comm| -> AnyResult<(RngState, RngState, bool)> {
                let tp: TensorParallel = common::tp_context(comm, sp);
                let block = TransformerBlock::new(&tp, "block0", &config, &init())?;
                let x = if sp {
                    common::part(&x, 0, tp.rank(), tp.size())
                } else {
                    x.clone()
                };
                let mut rng = RngTracker::new(5, tp.rank());
                let before = rng.state();
                let tape = Tape::new();
                let evaluated = block.forward_inference(&tape, &x)?;
                assert_eq!(rng.state(), before, "{what}: evaluation drew");
                let trained = block.forward(&tape, &x, &mut rng)?;
                let dropped = trained.to_vec()? != evaluated.to_vec()?;
                Ok((before, rng.state(), dropped))
            })?;
        for (rank, (before, after, dropped)) in ranks.iter().enumerate() {
            assert!(dropped, "{what}, rank {rank}: training dropped nothing");
            let drawn = |i: usize| before.streams[i] != after.streams[i];
            assert_eq!(
                drawn(0),
                default_drawn,
                "{what}, rank {rank}: default stream"
            );
            assert_eq!(
                drawn(1),
                private_drawn,
                "{what}, rank {rank}: model-parallel"
            );
        }
        // The ranks' default streams stay in step; their model-parallel ones never meet.
        assert_eq!(ranks[0].1.streams[0], ranks[1].1.streams[0], "{what}");
        assert_ne!(ranks[0].1.streams[1], ranks[1].1.streams[1], "{what}");
    }
    Ok(())
}
