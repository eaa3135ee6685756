//! What full recomputation saves: between forward and backward a recomputed run of
//! blocks holds about its input and output, where the plain run holds every block's
//! activations (one test in this binary: the allocator counts the whole process).

#[path = "../../tape/tests/support/counting.rs"]
mod counting;

use ferrotron_comm_core::run_local;
use ferrotron_layers::{
    recompute_blocks, BlockConfig, MasterInit, RngTracker, TensorParallel, TransformerBlock,
};
use ferrotron_tape::{Generator, Parameter, Tape, Tensor};

const SEQ: usize = 64;
const BATCH: usize = 4;
const HIDDEN: usize = 64;
const BLOCKS: usize = 4;

/// Bytes live after the forward of `BLOCKS` blocks, recomputed or not, and the input
/// gradient after backward.
fn held(recompute: bool) -> (isize, Vec<f32>) {
    run_local(1, move |comm| -> ferrotron_layers::Result<_> {
        let tp = TensorParallel::new(std::sync::Arc::new(comm));
        let config = BlockConfig {
            hidden_dropout: 0.1,
            ..BlockConfig::new(HIDDEN, 4)
        };
        let init = MasterInit::new(1, 0.1);
        let blocks = (0..BLOCKS)
            .map(|i| TransformerBlock::new(&tp, &format!("block{i}"), &config, &init))
            .collect::<ferrotron_layers::Result<Vec<_>>>()?;
        let x = Parameter::new(
            "x",
            Tensor::randn(&[SEQ, BATCH, HIDDEN], 1.0, &mut Generator::new(2)),
        );
        let (tape, mut rng) = (Tape::new(), RngTracker::new(3, 0));
        let before = counting::live();
        let output = if recompute {
            recompute_blocks(&blocks, &tape, &tape.watch(&x)?, &mut rng)?
        } else {
            let mut hidden = tape.watch(&x)?;
            for block in &blocks {
                hidden = block.forward(&tape, &hidden, &mut rng)?;
            }
            hidden
        };
        let held = counting::live() - before;
        output.sum()?.backward()?;
        Ok((held, x.grad().expect("a gradient").to_vec()?))
    })
    .unwrap()
    .remove(0)
}

#[test]
fn recomputed_blocks_hold_about_their_output_until_backward() {
    let (kept, kept_grad) = held(false);
    let (recomputed, recomputed_grad) = held(true);
    assert_eq!(recomputed_grad, kept_grad, "the same gradient");
    let activation = (SEQ * BATCH * HIDDEN * 4) as isize;
    println!("held until backward: {kept} bytes kept, {recomputed} recomputed");
    // The output, the op's record and the saved handles; the plain run keeps each
    // block's normalised inputs, projections, attention scores, masks and MLP layers.
    assert!(
        recomputed < 2 * activation,
        "recomputed: {recomputed} bytes held, one activation is {activation}"
    );
    assert!(
        kept > 10 * recomputed,
        "kept {kept} bytes, recomputed {recomputed}"
    );
}
