//! Activation recomputation, Megatron's `full` granularity: a run of transformer blocks
//! keeps only its input during forward, and backward runs the blocks' forward again (on
//! a tape of its own, with the random streams where they stood, so dropout draws the
//! same masks) and then their backward. Gradients are bit-identical to the run that
//! keeps every activation; the memory of the blocks' activations is traded for a second
//! forward.
//!
//! On the caller's tape the run is one custom op whose inputs are the blocks' input and
//! every parameter they watch, so parameter gradients reach the parameters (and DDP's
//! hooks) as any other op's do.
//!
//! The `selective` granularity, the attention core alone, is `crate::attention_core`.

use std::sync::{Arc, Mutex};

use ferrotron_tape::{CustomOp, Parameter, Tape, Tensor};

use crate::{Module, Result, RngTracker, TransformerBlock};

/// `x` through `blocks` in order (with dropout drawn from `rng`, which advances as the
/// plain forward would), recording one op that recomputes them in backward. An empty
/// run returns `x`.
pub fn recompute_blocks(
    blocks: &[TransformerBlock],
    tape: &Tape,
    x: &Tensor,
    rng: &mut RngTracker,
) -> Result<Tensor> {
    if blocks.is_empty() {
        return Ok(x.clone());
    }
    let params: Vec<Parameter> = (blocks.iter())
        .flat_map(Module::parameters)
        .map(|sharded| sharded.param)
        .collect();
    let watched: Vec<Tensor> = params
        .iter()
        .map(|p| tape.watch(p))
        .collect::<std::result::Result<_, _>>()?;
    let before = rng.clone();
    // The forward keeps nothing for backward: run off the tape, on the values.
    let output = tape.no_grad(|| -> Result<Tensor> {
        let mut hidden = x.detach();
        for block in blocks {
            hidden = block.forward(tape, &hidden, rng)?;
        }
        Ok(hidden)
    })?;
    let op = Arc::new(Recompute {
        blocks: blocks.to_vec(),
        params,
        rng: before,
        output: Mutex::new(Some(output)),
    });
    let mut inputs = vec![x];
    inputs.extend(watched.iter());
    Ok(Tensor::apply(op, &inputs)?)
}

/// The recorded op: its forward hands over the output computed off the tape; its
/// backward replays the blocks.
struct Recompute {
    blocks: Vec<TransformerBlock>,
    /// The parameters the blocks watch, in the op's input order (after the input).
    params: Vec<Parameter>,
    /// The random streams as they stood before the forward.
    rng: RngTracker,
    /// The forward's output, taken once by `forward`.
    output: Mutex<Option<Tensor>>,
}

impl CustomOp for Recompute {
    fn name(&self) -> &str {
        "recompute"
    }

    fn forward(
        &self,
        inputs: &[Tensor],
        saved: &mut Vec<Tensor>,
    ) -> ferrotron_tape::Result<Tensor> {
        // The input and the parameters' values at this forward: what backward replays.
        saved.extend(inputs.iter().cloned());
        let output = self.output.lock().ok().and_then(|mut output| output.take());
        output.ok_or_else(|| ferrotron_tape::Error::custom("recompute", "its forward ran twice"))
    }

    fn backward(
        &self,
        grad: &Tensor,
        saved: &[Tensor],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor>>> {
        let replay = Tape::new();
        // Stand-ins with the saved values take the parameters' places, so the replay's
        // gradients land in them and go back through the caller's tape.
        let stand_ins: Vec<Parameter> = (self.params.iter().zip(&saved[1..]))
            .map(|(param, value)| {
                let stand_in = Parameter::new(param.name(), value.clone());
                replay.substitute(param, &stand_in);
                stand_in
            })
            .collect();
        let input = Parameter::activation("recompute.input", saved[0].clone());
        let mut hidden = replay.watch(&input)?;
        let mut rng = self.rng.clone();
        for block in &self.blocks {
            hidden = (block.forward(&replay, &hidden, &mut rng))
                .map_err(|e| ferrotron_tape::Error::custom("recompute", e))?;
        }
        hidden.backward_with_grad(grad)?;
        let mut grads = vec![input.grad()];
        grads.extend(stand_ins.iter().map(Parameter::grad));
        Ok(grads)
    }
}
