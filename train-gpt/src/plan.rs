//! `--plan`: the peak memory each pipeline stage's busiest rank will hold, predicted from
//! the model and the layout without training, by category. The figures follow what this
//! implementation keeps, not a generic formula: tape keeps both inputs of every product
//! and sum, layer norms their input and row statistics, softmax its output; the logits
//! are kept in f32; a schedule's plan says how many microbatches each chunk holds at
//! once; and a rank also holds its sampler's shuffled window order.

use pipeline::{Action, Schedule};

/// What the prediction needs to know of the model.
#[derive(Clone, Copy, Debug)]
pub struct Model {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// The MLP's width (4 × hidden in the demo).
    pub ffn: usize,
    pub vocab: usize,
    pub seq: usize,
    pub tied: bool,
    pub hidden_dropout: bool,
    pub attention_dropout: bool,
}

/// Which activations a block recomputes in backward instead of keeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    None,
    /// Groups of `layers` blocks keep only their input.
    Uniform {
        layers: usize,
    },
    /// The first `layers` blocks of each chunk keep only their input.
    Block {
        layers: usize,
    },
    /// The attention cores (scores, softmax, dropout).
    Selective,
}

/// The layout and the run's options that change memory.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    pub schedule: Schedule,
    pub microbatches: usize,
    /// Sequences per data-parallel rank and step (`--batch`).
    pub batch: usize,
    /// Bytes of a stored activation or parameter: 4 for f32, 2 for bf16 and fp16.
    pub element: usize,
    pub distributed_optimizer: bool,
    pub sequence_parallel: bool,
    pub recompute: Recompute,
    /// The emulated device (its masks take a byte an element, and its softmax backward
    /// is not in place) rather than the CPU.
    pub device: bool,
    /// Bytes of the training corpus (each rank shuffles one index per window of it).
    pub corpus_bytes: usize,
}

/// Bytes one rank holds at its peak, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Breakdown {
    pub parameters: usize,
    pub gradients: usize,
    pub master_weights: usize,
    pub moments: usize,
    /// Activations kept for backward by the microbatches in flight.
    pub activations: usize,
    /// What one op holds besides them at the peak (the loss's f32 work, an attention
    /// backward's score gradients, a recomputed group).
    pub working: usize,
    /// The rank's data: its sampler's window order and the step's token ids.
    pub other: usize,
}

impl Breakdown {
    pub fn total(&self) -> usize {
        self.parameters
            + self.gradients
            + self.master_weights
            + self.moments
            + self.activations
            + self.working
            + self.other
    }
}

/// The predicted peak of each pipeline stage's busiest rank (its first tensor-parallel
/// rank, which takes the larger share of an uneven vocabulary).
pub fn predict(model: &Model, layout: &Layout) -> Result<Vec<Breakdown>, pipeline::Error> {
    let chunks = layout.schedule.chunks();
    (0..layout.pp)
        .map(|stage| {
            let plan = layout
                .schedule
                .plan(layout.pp, stage, layout.microbatches)?;
            let parts: Vec<Chunk> = (0..chunks)
                .map(|c| Chunk::of(model, layout, stage, c))
                .collect();
            let (activations, working) = peak_of(&plan, &parts);
            let parameters: usize = parts.iter().map(|p| p.parameters).sum();
            Ok(model_state(
                parameters,
                &parts,
                layout,
                activations,
                working,
                model,
            ))
        })
        .collect()
}

/// What one model chunk of a rank holds: its parameters, and per microbatch in flight
/// what it keeps and the most it works with besides: in forward, and in each phase of
/// its backward (head, then blocks last to first), with what it still keeps then.
struct Chunk {
    parameters: usize,
    kept: usize,
    forward_working: usize,
    /// (what the chunk still keeps, working memory) in each backward phase.
    backward: Vec<(usize, usize)>,
}

impl Chunk {
    fn of(model: &Model, layout: &Layout, stage: usize, chunk: usize) -> Chunk {
        let (pp, chunks) = (layout.pp, layout.schedule.chunks());
        let blocks = model.layers / (pp * chunks);
        let first = stage == 0 && chunk == 0;
        let last = stage == pp - 1 && chunk == chunks - 1;
        let sizes = Sizes::of(model, layout);
        let recomputed = match layout.recompute {
            Recompute::Uniform { layers } => blocks.div_ceil(layers.max(1)),
            Recompute::Block { layers } => layers.min(blocks),
            _ => 0,
        };
        let group = match layout.recompute {
            Recompute::Uniform { layers } => layers.min(blocks),
            Recompute::Block { .. } if recomputed > 0 => 1,
            _ => 0,
        };
        let kept_blocks = match layout.recompute {
            Recompute::Uniform { .. } => 0,
            _ => blocks - recomputed,
        };
        let mut kept = recomputed * sizes.block_input + kept_blocks * sizes.block;
        let mut parameters = blocks * sizes.block_parameters;
        let mut forward_working = if blocks > 0 { sizes.block_forward } else { 0 };
        if first {
            kept += sizes.embedding;
            parameters += (sizes.vocab_shard + model.seq) * model.hidden;
        }
        // Backward, in order: the head, then the kept blocks, then the recomputed groups
        // (each replays its blocks and keeps their stand-in gradients meanwhile).
        let mut backward = Vec::new();
        let mut left = kept + if last { sizes.head } else { 0 };
        if last {
            backward.push((left, sizes.loss_backward));
            left -= sizes.head;
        }
        for _ in 0..kept_blocks {
            backward.push((left, sizes.block_backward));
            left -= sizes.block;
        }
        let replay = group * (sizes.block + 4 * sizes.block_parameters) + sizes.block_backward;
        for _ in 0..recomputed {
            backward.push((left, replay));
            left -= sizes.block_input.min(left);
        }
        if last {
            kept += sizes.head;
            parameters += 2 * model.hidden;
            let head = match (model.tied, pp) {
                (true, 1) => 0,
                (true, _) => sizes.vocab_shard * model.hidden,
                (false, _) => sizes.vocab_shard * (model.hidden + 1),
            };
            parameters += head;
            forward_working = forward_working.max(sizes.loss_forward);
        }
        Chunk {
            parameters,
            kept,
            forward_working,
            backward,
        }
    }
}

/// The most a rank holds of activations, and of working memory besides them, as its
/// plan runs: after each forward (with that forward's working memory) and before each
/// backward (with the backward's).
fn peak_of(plan: &[Action], chunks: &[Chunk]) -> (usize, usize) {
    let (mut held, mut best) = (0usize, (0usize, 0usize));
    let mut consider = |held: usize, working: usize| {
        if held + working > best.0 + best.1 {
            best = (held, working);
        }
    };
    for action in plan {
        match *action {
            Action::Forward { chunk, .. } => {
                held += chunks[chunk].kept;
                consider(held, chunks[chunk].forward_working);
            }
            Action::Backward { chunk, .. } => {
                let others = held.saturating_sub(chunks[chunk].kept);
                for &(left, working) in &chunks[chunk].backward {
                    consider(others + left, working);
                }
                held = others;
            }
            Action::Exchange(_) => {}
        }
    }
    best
}

fn model_state(
    parameters: usize,
    chunks: &[Chunk],
    layout: &Layout,
    activations: usize,
    working: usize,
    model: &Model,
) -> Breakdown {
    let dp = layout.dp;
    // The distributed optimizer pads each chunk's bucket to a multiple of 64 × DP.
    let padded: usize = match layout.distributed_optimizer {
        true => chunks
            .iter()
            .map(|c| c.parameters.next_multiple_of(64 * dp))
            .sum(),
        false => parameters,
    };
    let sixteen_bit = layout.element < 4;
    let (master_weights, moments) = match layout.distributed_optimizer {
        true => (
            if sixteen_bit { 4 * padded / dp } else { 0 },
            8 * padded / dp,
        ),
        false => (if sixteen_bit { 4 * parameters } else { 0 }, 8 * parameters),
    };
    let windows = (layout.corpus_bytes * 9 / 10).saturating_sub(model.seq);
    // The distributed optimizer's step holds the reduce-scattered f32 gradient shards and
    // the updated f32 shards while it gathers the parameters anew: when the activations
    // are few, that is the peak.
    let step = match layout.distributed_optimizer {
        true => 8 * padded / dp + layout.element * padded,
        false => 0,
    };
    let (activations, working) = match step > activations + working {
        true => (0, step),
        false => (activations, working),
    };
    Breakdown {
        parameters: parameters * layout.element,
        gradients: 4 * padded,
        master_weights,
        moments,
        activations,
        working,
        other: 8 * windows
            + 16 * layout.batch * model.seq
            + RUNTIME
            + PIPELINE * usize::from(layout.pp > 1),
    }
}

/// What a rank's thread holds besides its model, its activations and its data (thread
/// buffers, a communicator's bookkeeping): an allowance measured on the CPU, not derived.
const RUNTIME: usize = 192 << 10;

/// What a pipelined rank holds besides for its messages: measured likewise.
const PIPELINE: usize = 192 << 10;

/// Bytes of the pieces, per microbatch, for one rank.
struct Sizes {
    vocab_shard: usize,
    block_parameters: usize,
    block: usize,
    block_input: usize,
    embedding: usize,
    head: usize,
    block_forward: usize,
    block_backward: usize,
    loss_forward: usize,
    loss_backward: usize,
}

impl Sizes {
    fn of(model: &Model, layout: &Layout) -> Sizes {
        let (t, e) = (layout.tp, layout.element);
        let (h, f, a, s) = (model.hidden, model.ffn, model.heads, model.seq);
        let b = layout.batch / layout.microbatches.max(1);
        let (sbh, sb) = (s * b * h, s * b);
        let scores = a * b * s * s / t;
        let vocab_shard = model.vocab.div_ceil(t);
        let logits = sb * vocab_shard;
        // A dropout mask's element: f32 on the CPU, a byte on the device.
        let mask = if layout.device { 1 } else { 4 };
        let sp = layout.sequence_parallel && t > 1;
        // What a block keeps: its input, the layer norms' outputs (gathered under SP),
        // the products' and sums' operands, q, k, v, the probabilities, GELU's input and
        // output, and four rows of f32 statistics.
        let mut block = if sp {
            e * (2 * sbh + (7 * sbh + 3 * s * b * f) / t + 6 * sbh / t) + 16 * sb / t
        } else {
            e * (8 * sbh + (7 * sbh + 3 * s * b * f) / t) + 16 * sb
        };
        block += e * scores;
        let local = if sp { sbh / t } else { sbh };
        if model.hidden_dropout {
            block += 2 * mask * local;
        }
        if model.attention_dropout {
            block += (e + mask) * scores;
        }
        if layout.recompute == Recompute::Selective {
            block -= e * scores;
            if model.attention_dropout {
                block -= (e + mask) * scores;
            }
        }
        let embedding = e * local
            + 8 * sb
            + if t > 1 {
                if layout.device {
                    sb
                } else {
                    sbh
                }
            } else {
                0
            };
        let untied_bias = if model.tied { 0 } else { e * logits };
        let head = e * local
            + 8 * sb / if sp { t } else { 1 }
            + e * sbh
            + 4 * logits
            + 4 * sb
            + 17 * sb
            + untied_bias;
        let sixteen_bit_logits = if e < 4 { e * logits } else { 0 };
        let softmax_backward = if layout.device || e < 4 { 8 } else { 4 };
        // On the CPU a 16-bit product widens its operands to f32 and computes in f32: the
        // first MLP product (the gathered input and the weight) is the largest.
        let widened = if e < 4 && !layout.device {
            4 * (sbh + s * b * f / t + h * f / t)
        } else {
            0
        };
        Sizes {
            vocab_shard,
            block_parameters: (4 * h * h + 2 * f * h + 3 * h + f) / t + 6 * h,
            block,
            block_input: e * local,
            embedding,
            head,
            block_forward: (e * (3 * sbh / t + scores)).max(widened),
            block_backward: softmax_backward * scores + 8 * sbh,
            loss_forward: 8 * logits + sixteen_bit_logits,
            loss_backward: 4 * logits,
        }
    }
}
