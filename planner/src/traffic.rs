//! Bytes a rank sends in one training step, by group, as ring collectives move them: an
//! all-reduce of N elements over g ranks sends 2·(g−1)/g·N per rank, an all-gather or a
//! reduce-scatter (g−1)/g·N.

use crate::memory::{stage_shape, Layout, Model};
use crate::Result;

/// What one rank of a pipeline stage sends per step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Traffic {
    /// Over its tensor-parallel group: two collectives per block forward and two in
    /// backward (again forward for a recomputed block), the embedding's and the output
    /// layer's, and cross-entropy's three row statistics.
    pub tensor: f64,
    /// Over its data-parallel group: the f32 gradients all-reduced, or under the
    /// distributed optimizer reduce-scattered and the parameters all-gathered.
    pub data: f64,
    /// To its pipeline neighbours: an activation forward per microbatch and chunk
    /// boundary, and its gradient back.
    pub pipeline: f64,
    /// Between the first and last stage, the tied word embedding's f32 gradient.
    pub embedding: f64,
}

impl Traffic {
    /// Bytes in all.
    pub fn total(&self) -> f64 {
        self.tensor + self.data + self.pipeline + self.embedding
    }
}

fn all_reduce(group: usize) -> f64 {
    2.0 * gather(group)
}

fn gather(group: usize) -> f64 {
    (group as f64 - 1.0) / group as f64
}

/// Each pipeline stage's traffic per rank and step, stage 0 first.
pub fn traffic(model: &Model, layout: &Layout) -> Result<Vec<Traffic>> {
    layout.check(model)?;
    Ok((0..layout.pp)
        .map(|stage| stage_traffic(model, layout, stage))
        .collect())
}

fn stage_traffic(model: &Model, layout: &Layout, stage: usize) -> Traffic {
    let (t, d, pp, e) = (layout.tp, layout.dp, layout.pp, layout.element as f64);
    let (first, last) = (stage == 0, stage == pp - 1);
    let m = layout.microbatches as f64;
    let micro = (layout.batch / layout.microbatches) as f64;
    let tokens = micro * model.seq as f64;
    let sbh = tokens * model.hidden as f64;
    let shape = stage_shape(model, layout, stage);
    let blocks = (model.layers / pp) as f64;
    // Per microbatch, in activation elements: four all-reduces' worth a block, two more
    // for a replayed forward (selective recomputation replays the attention core inside
    // a rank: none); the embedding's and the output layer's one each. Sequence
    // parallelism trades each all-reduce for a reduce-scatter and an all-gather: the same.
    let mut tensor_elements = (4.0 * blocks + 2.0 * shape.recomputed as f64) * sbh;
    tensor_elements += sbh * (f64::from(u8::from(first)) + f64::from(u8::from(last)));
    let mut tensor = m * all_reduce(t) * tensor_elements * e;
    if last {
        // Cross-entropy's f32 row maximum, target logit and sum of exponentials.
        tensor += m * all_reduce(t) * 3.0 * tokens * 4.0;
    }
    let parameters = shape.padded as f64;
    let data = match layout.distributed_optimizer {
        true => gather(d) * parameters * (4.0 + e),
        false => all_reduce(d) * parameters * 4.0,
    };
    let chunks = layout.schedule.chunks() as f64;
    let message = match layout.sequence_parallel && t > 1 {
        true => sbh / t as f64,
        false => sbh,
    };
    let sends = (chunks - f64::from(u8::from(last))) + (chunks - f64::from(u8::from(first)));
    let pipeline = if pp > 1 { m * sends * message * e } else { 0.0 };
    let embedding = match model.tied && pp > 1 && (first || last) {
        true => all_reduce(2) * (model.vocab.div_ceil(t) * model.hidden) as f64 * 4.0,
        false => 0.0,
    };
    Traffic {
        tensor,
        data,
        pipeline,
        embedding,
    }
}
