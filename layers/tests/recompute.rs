//! Activation recomputation: a run of blocks that keeps only its input and replays its
//! forward in backward (`recompute_blocks`, full), and blocks that recompute only their
//! attention core (`recompute_attention_core`, selective), give bit-identical outputs,
//! input gradients and parameter gradients, with dropout on, at TP 1 and 2, with and
//! without sequence parallelism.

mod common;

use common::{run_sequence_model, AnyResult, FullRun};
use ferrotron_layers::{
    recompute_blocks, BlockConfig, MasterInit, Module, RngTracker, TransformerBlock,
};
use ferrotron_tape::{AttentionKernel, Generator, Tape, Tensor};

const SEQ: usize = 8;
const BATCH: usize = 2;
const HIDDEN: usize = 16;
const HEADS: usize = 4;

/// Three blocks with both dropouts on, so a replay that drew other masks would differ.
struct Blocks(Vec<TransformerBlock>);

impl Module for Blocks {
    fn parameters(&self) -> Vec<ferrotron_layers::ShardedParameter> {
        self.0.iter().flat_map(Module::parameters).collect()
    }
}

fn build(tp: &ferrotron_layers::TensorParallel) -> ferrotron_layers::Result<Blocks> {
    build_with(tp, false)
}

/// The same blocks recomputing their attention core (selective recomputation).
fn build_selective(tp: &ferrotron_layers::TensorParallel) -> ferrotron_layers::Result<Blocks> {
    build_with(tp, true)
}

fn build_with(
    tp: &ferrotron_layers::TensorParallel,
    selective: bool,
) -> ferrotron_layers::Result<Blocks> {
    let config = BlockConfig {
        attention_dropout: 0.2,
        hidden_dropout: 0.1,
        recompute_attention_core: selective,
        // The unfused core is the one selective recomputation drops (the fused core
        // keeps no probabilities).
        attention: AttentionKernel::Unfused,
        ..BlockConfig::new(HIDDEN, HEADS)
    };
    let init = MasterInit::new(7, 0.2).with_bias_std(0.1);
    let blocks = (0..3)
        .map(|i| TransformerBlock::new(tp, &format!("block{i}"), &config, &init))
        .collect::<ferrotron_layers::Result<_>>()?;
    Ok(Blocks(blocks))
}

fn plain(
    m: &Blocks,
    tape: &Tape,
    x: &Tensor,
    rng: &mut RngTracker,
) -> ferrotron_layers::Result<Tensor> {
    let mut hidden = x.clone();
    for block in &m.0 {
        hidden = block.forward(tape, &hidden, rng)?;
    }
    Ok(hidden)
}

/// The first two blocks recomputed together, the third kept as usual.
fn recomputed(
    m: &Blocks,
    tape: &Tape,
    x: &Tensor,
    rng: &mut RngTracker,
) -> ferrotron_layers::Result<Tensor> {
    let hidden = recompute_blocks(&m.0[..2], tape, x, rng)?;
    m.0[2].forward(tape, &hidden, rng)
}

fn assert_identical(what: &str, got: &FullRun, want: &FullRun) {
    let bits = |t: &Tensor| t.to_vec().unwrap();
    assert_eq!(bits(&got.output), bits(&want.output), "{what}: output");
    assert_eq!(
        bits(&got.input_grad),
        bits(&want.input_grad),
        "{what}: input grad"
    );
    assert_eq!(got.grads.len(), want.grads.len(), "{what}: parameters");
    for (name, grad) in &want.grads {
        assert_eq!(
            bits(&got.grads[name]),
            bits(grad),
            "{what}: {name}'s gradient"
        );
    }
}

#[test]
fn recomputed_blocks_give_bit_identical_gradients_with_dropout_tp_and_sp() -> AnyResult<()> {
    let mut rng = Generator::new(3);
    let x = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    let w = Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut rng);
    for (tp, sp) in [(1, false), (2, false), (2, true)] {
        let kept = run_sequence_model(tp, sp, &x, &w, build, plain)?;
        let replayed = run_sequence_model(tp, sp, &x, &w, build, recomputed)?;
        assert_identical(&format!("full, tp={tp} sp={sp}"), &replayed, &kept);
        let selective = run_sequence_model(tp, sp, &x, &w, build_selective, plain)?;
        assert_identical(&format!("selective, tp={tp} sp={sp}"), &selective, &kept);
    }
    Ok(())
}
