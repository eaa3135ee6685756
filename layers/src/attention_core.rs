//! The core of attention, `dropout(causal_softmax(q·kᵀ · scale)) · v`, kept on the tape
//! or recomputed: Megatron's `selective` recomputation replays only this part of a block
//! in backward, whose `sequence²` activations are the largest a block keeps, from the
//! saved queries, keys and values, drawing the same dropout mask.

use std::sync::{Arc, Mutex};

use ferrotron_tape::{CustomOp, Parameter, Tape, Tensor};

use crate::RngTracker;

/// The core of attention on `[batch · heads, sequence, head_dim]` queries, keys and
/// values: `dropout(causal_softmax(q·kᵀ · scale)) · v`.
pub(crate) struct AttentionCore {
    pub scale: f64,
    /// Dropout on the probabilities, drawn from the model-parallel stream.
    pub dropout: f64,
}

impl AttentionCore {
    /// The core on the tape, keeping its activations (dropout only with `rng`).
    pub(crate) fn forward(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        rng: Option<&mut RngTracker>,
    ) -> ferrotron_tape::Result<Tensor> {
        let probs = query.matmul_transposed(key)?.causal_softmax(self.scale)?;
        let probs = match rng {
            Some(rng) => probs.dropout(self.dropout, rng.model_parallel_stream())?,
            None => probs,
        };
        probs.matmul(value)
    }

    /// The core as one recorded op that keeps only its inputs and replays itself in
    /// backward, drawing the same dropout mask.
    pub(crate) fn recomputed(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        rng: &mut RngTracker,
    ) -> ferrotron_tape::Result<Tensor> {
        let before = rng.clone();
        let (q, k, v) = (query.detach(), key.detach(), value.detach());
        let output = self.forward(&q, &k, &v, Some(rng))?;
        let op = Arc::new(RecomputeCore {
            core: AttentionCore { ..*self },
            rng: before,
            output: Mutex::new(Some(output)),
        });
        Tensor::apply(op, &[query, key, value])
    }
}

/// The recorded op of [`AttentionCore::recomputed`].
struct RecomputeCore {
    core: AttentionCore,
    rng: RngTracker,
    output: Mutex<Option<Tensor>>,
}

impl CustomOp for RecomputeCore {
    fn name(&self) -> &str {
        "recompute attention core"
    }

    fn forward(
        &self,
        inputs: &[Tensor],
        saved: &mut Vec<Tensor>,
    ) -> ferrotron_tape::Result<Tensor> {
        saved.extend(inputs.iter().cloned());
        let output = self.output.lock().ok().and_then(|mut output| output.take());
        output.ok_or_else(|| ferrotron_tape::Error::custom(self.name(), "its forward ran twice"))
    }

    fn backward(
        &self,
        grad: &Tensor,
        saved: &[Tensor],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor>>> {
        let replay = Tape::new();
        let inputs: Vec<Parameter> = (saved.iter().zip(["query", "key", "value"]))
            .map(|(value, name)| Parameter::activation(name, value.clone()))
            .collect();
        let watched: Vec<Tensor> = inputs
            .iter()
            .map(|p| replay.watch(p))
            .collect::<std::result::Result<_, _>>()?;
        let mut rng = self.rng.clone();
        let output = self
            .core
            .forward(&watched[0], &watched[1], &watched[2], Some(&mut rng))?;
        output.backward_with_grad(grad)?;
        Ok(inputs.iter().map(Parameter::grad).collect())
    }
}
