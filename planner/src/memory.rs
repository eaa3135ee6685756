//! Peak memory per rank, predicted from the model and the layout without training, by
//! category. The figures follow what ferrotron's layers keep, not a generic formula: the
//! tape keeps both inputs of every product and sum, layer norms their input and row
//! statistics, softmax its output; the logits are kept in f32; a schedule's plan says how
//! many microbatches each chunk holds at once; and a rank also holds its sampler's
//! shuffled window order.

use crate::{Error, Result};
use ferrotron_pipeline::{Action, Schedule};

/// The model: a GPT of pre-norm blocks (layer norms with biases, biased linears,
/// multi-head attention, a GELU MLP) with learned positions, as `layers` builds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Model {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads (`hidden` must divide by it).
    pub heads: usize,
    /// Key/value heads (grouped-query attention; `heads` for multi-head attention): it
    /// divides `heads`, and TP divides it.
    pub query_groups: usize,
    /// The attention core is fused (no `sequence²` tensor kept, one f32 log-sum-exp per
    /// query instead) rather than the unfused reference.
    pub fused_attention: bool,
    /// The MLP's width (4 × hidden in the demo).
    pub ffn: usize,
    /// Vocabulary entries, as the embedding holds them (pad it first if you pad).
    pub vocab: usize,
    /// Sequence length.
    pub seq: usize,
    /// The output layer reuses the word embedding.
    pub tied: bool,
    /// Dropout after attention and after the MLP (its masks are kept).
    pub hidden_dropout: bool,
    /// Dropout on the attention probabilities.
    pub attention_dropout: bool,
}

impl Model {
    /// A GPT of `layers` blocks of width `hidden` with an MLP of 4 × `hidden`, tied
    /// embeddings, multi-head fused attention and no dropout.
    pub fn gpt(layers: usize, hidden: usize, heads: usize, vocab: usize, seq: usize) -> Model {
        Model {
            layers,
            hidden,
            heads,
            query_groups: heads,
            fused_attention: true,
            ffn: 4 * hidden,
            vocab,
            seq,
            tied: true,
            hidden_dropout: false,
            attention_dropout: false,
        }
    }

    /// Parameters of the whole model (every stage, no TP split).
    pub fn parameters(&self) -> usize {
        let (h, f, qkv) = (self.hidden, self.ffn, self.qkv_width());
        let block = h * qkv + h * h + 2 * f * h + qkv + f + 6 * h;
        let head = if self.tied { 0 } else { self.vocab * h };
        self.layers * block + (self.vocab + self.seq) * h + 2 * h + head
    }
}

impl Model {
    /// Width of the fused QKV projection: the queries, and a key and a value per group.
    pub fn qkv_width(&self) -> usize {
        self.hidden + 2 * self.hidden * self.query_groups / self.heads.max(1)
    }
}

/// Which activations a block recomputes in backward instead of keeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Everything is kept.
    None,
    /// Full recomputation, Megatron's `uniform` method: groups of `layers` blocks keep
    /// only their input.
    Uniform {
        /// Blocks per group.
        layers: usize,
    },
    /// Full recomputation, Megatron's `block` method: the first `layers` blocks of each
    /// chunk keep only their input.
    Block {
        /// Blocks recomputed per chunk.
        layers: usize,
    },
    /// The attention cores (scores, softmax, dropout).
    Selective,
}

/// Whose memory a prediction is for: the layouts differ in small ways.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Host memory: dropout masks take an f32 an element, softmax's backward works in
    /// place, and 16-bit products widen their operands to f32.
    Cpu,
    /// Device memory, as the emulated device allocates it: masks take a byte an element.
    /// (Checked against the emulated device; CUDA's allocator is not modelled.)
    Device,
}

/// The layout and the run's options that change memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Layout {
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel size.
    pub dp: usize,
    /// The pipeline schedule (its chunks are the virtual stages).
    pub schedule: Schedule,
    /// Microbatches per step on each data-parallel rank.
    pub microbatches: usize,
    /// Sequences per data-parallel rank and step (`--batch`): `microbatches` × the
    /// micro-batch size.
    pub batch: usize,
    /// Bytes of a stored activation or parameter: 4 for f32, 2 for bf16 and fp16.
    pub element: usize,
    /// Optimizer state and master weights sharded over the data-parallel group.
    pub distributed_optimizer: bool,
    /// Sequence parallelism (with TP > 1).
    pub sequence_parallel: bool,
    /// What the blocks recompute.
    pub recompute: Recompute,
    /// Host or device memory.
    pub target: Target,
    /// Bytes of the demo's training corpus (each rank shuffles one index per window of
    /// it); 0 for data the demo's sampler does not hold.
    pub corpus_bytes: usize,
}

impl Layout {
    /// The checks a run would make of this layout for `model`, as typed errors.
    pub fn check(&self, model: &Model) -> Result<()> {
        let invalid = |what: String| Err(Error::Invalid(what));
        let chunks = self.schedule.chunks();
        if [self.tp, self.pp, self.dp, self.microbatches, chunks].contains(&0) {
            return invalid(
                "tp, pp, dp, microbatches and virtual stages must be at least 1".into(),
            );
        }
        if model.heads == 0
            || !model.hidden.is_multiple_of(model.heads)
            || !model.heads.is_multiple_of(self.tp)
        {
            return invalid(format!(
                "{} heads must divide the hidden size {} and divide by tp {}",
                model.heads, model.hidden, self.tp
            ));
        }
        if model.query_groups == 0
            || !model.heads.is_multiple_of(model.query_groups)
            || !model.query_groups.is_multiple_of(self.tp)
        {
            return invalid(format!(
                "{} query groups must divide the {} heads and divide by tp {}",
                model.query_groups, model.heads, self.tp
            ));
        }
        if !model.layers.is_multiple_of(self.pp * chunks) {
            return invalid(format!(
                "{} layers do not split evenly over {} stages × {chunks} chunks",
                model.layers, self.pp
            ));
        }
        if !self.batch.is_multiple_of(self.microbatches) {
            return invalid(format!(
                "a batch of {} sequences does not split into {} equal microbatches",
                self.batch, self.microbatches
            ));
        }
        if ![2, 4].contains(&self.element) {
            return invalid(format!(
                "{}-byte elements: use 4 (fp32) or 2 (bf16, fp16)",
                self.element
            ));
        }
        match self.recompute {
            Recompute::Uniform { layers: 0 } | Recompute::Block { layers: 0 } => {
                invalid("full recomputation needs at least 1 layer".into())
            }
            _ => Ok(()),
        }
    }
}

/// Bytes one rank holds at its peak, by category.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Breakdown {
    /// The parameters in their training precision.
    pub parameters: usize,
    /// f32 gradients (the buckets DDP reduces; padded under the distributed optimizer).
    pub gradients: usize,
    /// f32 master weights of 16-bit runs (this rank's shard under the distributed
    /// optimizer).
    pub master_weights: usize,
    /// AdamW's two f32 moments (this rank's shard under the distributed optimizer).
    pub moments: usize,
    /// Activations kept for backward by the microbatches in flight.
    pub activations: usize,
    /// What one op holds besides them at the peak (the loss's f32 work, an attention
    /// backward's score gradients, a recomputed group).
    pub working: usize,
    /// Communication buffers held at the peak: the distributed optimizer's gradient
    /// shards and gathered parameters when its step is the peak, and a pipelined rank's
    /// messages.
    pub communication: usize,
    /// The rank's data (its sampler's window order and the step's token ids) and its
    /// runtime's allowance.
    pub other: usize,
}

impl Breakdown {
    /// Bytes in all.
    pub fn total(&self) -> usize {
        self.parameters
            + self.gradients
            + self.master_weights
            + self.moments
            + self.activations
            + self.working
            + self.communication
            + self.other
    }
}

/// The predicted peak of each pipeline stage's busiest rank (its first tensor-parallel
/// rank, which takes the larger share of an uneven vocabulary), stage 0 first.
pub fn predict(model: &Model, layout: &Layout) -> Result<Vec<Breakdown>> {
    layout.check(model)?;
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
    /// Blocks that replay their forward in backward (under full recomputation).
    recomputed: usize,
    kept: usize,
    forward_working: usize,
    /// (what the chunk still keeps, working memory) in each backward phase.
    backward: Vec<(usize, usize)>,
}

impl Chunk {
    fn of(model: &Model, layout: &Layout, stage: usize, chunk: usize) -> Chunk {
        let (pp, chunks) = (layout.pp, layout.schedule.chunks());
        let blocks = blocks_of(model, layout);
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
                (false, _) => sizes.vocab_shard * model.hidden,
            };
            parameters += head;
            forward_working = forward_working.max(sizes.loss_forward);
        }
        Chunk {
            parameters,
            recomputed: match layout.recompute {
                Recompute::Uniform { .. } => blocks,
                _ => recomputed,
            },
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

/// What the communication volume needs to know of a stage's rank.
pub(crate) struct StageShape {
    /// Its parameters as the distributed optimizer pads them (as they are without it).
    pub padded: usize,
    /// Blocks whose forward runs again in backward.
    pub recomputed: usize,
}

pub(crate) fn stage_shape(model: &Model, layout: &Layout, stage: usize) -> StageShape {
    let parts: Vec<Chunk> = (0..layout.schedule.chunks())
        .map(|c| Chunk::of(model, layout, stage, c))
        .collect();
    StageShape {
        padded: padded(&parts, layout),
        recomputed: parts.iter().map(|p| p.recomputed).sum(),
    }
}

fn blocks_of(model: &Model, layout: &Layout) -> usize {
    model.layers / (layout.pp * layout.schedule.chunks())
}

/// The distributed optimizer pads each chunk's bucket to a multiple of 64 × DP.
fn padded(chunks: &[Chunk], layout: &Layout) -> usize {
    let sum = |f: &dyn Fn(&Chunk) -> usize| chunks.iter().map(f).sum();
    match layout.distributed_optimizer {
        true => sum(&|c| c.parameters.next_multiple_of(64 * layout.dp)),
        false => sum(&|c| c.parameters),
    }
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
    let padded = padded(chunks, layout);
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
    let (activations, working, gathering) = match step > activations + working {
        true => (0, 0, step),
        false => (activations, working, 0),
    };
    Breakdown {
        parameters: parameters * layout.element,
        gradients: 4 * padded,
        master_weights,
        moments,
        activations,
        working,
        communication: gathering + pipeline_allowance(layout.target) * usize::from(layout.pp > 1),
        other: 8 * windows + 16 * layout.batch * model.seq + RUNTIME,
    }
}

/// What a rank's thread holds besides its model, its activations and its data (thread
/// buffers, a communicator's bookkeeping): an allowance measured on the CPU, not derived.
const RUNTIME: usize = 192 << 10;

/// What a pipelined rank holds besides for its messages, measured likewise: on the CPU
/// (where small messages are staged in host memory) and on the emulated device (where
/// they stay in device memory, modelled with the activations).
fn pipeline_allowance(target: Target) -> usize {
    match target {
        Target::Cpu => 192 << 10,
        Target::Device => 64 << 10,
    }
}

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
        let device = layout.target == Target::Device;
        let (h, f, a, s) = (model.hidden, model.ffn, model.heads, model.seq);
        let b = layout.batch / layout.microbatches.max(1);
        let (sbh, sb) = (s * b * h, s * b);
        let scores = a * b * s * s / t;
        let qkv = model.qkv_width();
        // The fused core's f32 log-sum-exp per query and head.
        let lse = 4 * a * sb / t;
        let vocab_shard = model.vocab.div_ceil(t);
        let logits = sb * vocab_shard;
        // A dropout mask's element: f32 on the CPU, a byte on the device.
        let mask = if device { 1 } else { 4 };
        let sp = layout.sequence_parallel && t > 1;
        // What a block keeps: its input, the layer norms' outputs (gathered under SP),
        // the products' and sums' operands, q, k, v, the probabilities, GELU's input and
        // output, and four rows of f32 statistics.
        let mut block = if sp {
            e * (2 * sbh + (7 * sbh + 3 * s * b * f) / t + 6 * sbh / t) + 16 * sb / t
        } else {
            e * (8 * sbh + (7 * sbh + 3 * s * b * f) / t) + 16 * sb
        };
        // The QKV projection's output is narrower than 3 · hidden under grouped-query
        // attention.
        block -= e * sb * (3 * h - qkv) / t;
        // The unfused core keeps the probabilities, the fused one a statistic per query.
        block += if model.fused_attention {
            lse
        } else {
            e * scores
        };
        let local = if sp { sbh / t } else { sbh };
        // On a device each residual branch's bias, dropout and addition is one kernel, and
        // so are the MLP's bias and GELU: neither keeps a sum, so two hidden-sized
        // activations per branch and one MLP-sized one are not kept.
        if device {
            block -= e * (4 * local + s * b * f / t);
        }
        if model.hidden_dropout {
            block += 2 * mask * local;
        }
        // The fused core regenerates its dropout mask in backward.
        let unfused = !model.fused_attention;
        if model.attention_dropout && unfused {
            block += (e + mask) * scores;
        }
        if layout.recompute == Recompute::Selective && unfused {
            block -= e * scores;
            if model.attention_dropout {
                block -= (e + mask) * scores;
            }
        }
        // On the CPU a 16-bit x·Wᵀ transposes W into a rounded copy that its product keeps
        // for backward: a 16-bit copy of the block's weights per microbatch in flight.
        let transposed = |weights: usize| match e < 4 && !device {
            true => e * weights,
            false => 0,
        };
        block += transposed((h * qkv + h * h + 2 * f * h) / t);
        let embedding = e * local
            + 8 * sb
            + if t > 1 {
                if device {
                    sb
                } else {
                    sbh
                }
            } else {
                0
            };
        // One device rank's whole vocabulary is tape's fused loss, which keeps the logits
        // as they are; elsewhere the loss keeps them in f32 (a cast's copy of 16-bit ones,
        // made while the 16-bit ones are still held).
        let fused_loss = device && t == 1;
        let kept_logits = if fused_loss { e * logits } else { 4 * logits };
        // Outside the fused loss, 16-bit logits stay held beside their f32 copy.
        let sixteen_bit_logits = if e < 4 && !fused_loss { e * logits } else { 0 };
        let head = e * local
            + 8 * sb / if sp { t } else { 1 }
            + e * sbh
            + kept_logits
            + sixteen_bit_logits
            + 4 * sb
            + 17 * sb
            + transposed(vocab_shard * h);
        // Backward holds two score-sized and two hidden-sized gradients at once: on a
        // device in the activations' format (16-bit gradients stay 16-bit), on the CPU in
        // f32 (where a 16-bit softmax's backward works on widened copies).
        let block_backward = match (device, e < 4) {
            (true, _) => 2 * e * (scores + sbh),
            (false, true) => 8 * scores + 8 * sbh,
            (false, false) => 4 * scores + 8 * sbh,
        };
        // The CPU reads 16-bit attention inputs through f32 copies.
        let as_f32 = |n: usize| if e < 4 { 4 * n } else { 0 };
        // The fused core's backward holds no scores: on a device the context's gradient,
        // the packed QKV gradient and a correction per query; on the CPU the f32 packed
        // gradient (and f32 copies of 16-bit inputs, output and its gradient).
        let block_backward = match (model.fused_attention, device) {
            (false, _) => block_backward,
            (true, true) => 2 * e * sbh + e * sb * qkv / t + lse,
            (true, false) => {
                8 * sbh + 4 * sb * qkv / t + as_f32((sb * qkv + 2 * sbh) / t) + 2 * lse
            }
        };
        // Forward: the unfused core's scores and probabilities; the fused one's output,
        // on the CPU in f32 before it is stored (and an f32 copy of 16-bit input).
        let attention_forward = match (model.fused_attention, device) {
            (false, _) => e * (3 * sbh / t + scores),
            (true, true) => e * 3 * sbh / t + lse,
            (true, false) => 4 * sbh / t + as_f32(sb * qkv / t) + e * sbh / t + lse,
        };
        // On the CPU a 16-bit product widens its operands to f32 and computes in f32: the
        // first MLP product (the gathered input and the weight) is the largest.
        let widened = if e < 4 && !device {
            4 * (sbh + s * b * f / t + h * f / t)
        } else {
            0
        };
        Sizes {
            vocab_shard,
            block_parameters: (h * qkv + h * h + 2 * f * h + qkv + f) / t + 6 * h,
            block,
            block_input: e * local,
            embedding,
            head,
            block_forward: attention_forward.max(widened),
            block_backward,
            // One rank's whole vocabulary is tape's fused loss, whose work is per row;
            // a split one's is the vocabulary-parallel composition over the f32 logits.
            loss_forward: if t == 1 { 8 * sb } else { 8 * logits },
            // The logits' gradient: the fused loss writes it in their format.
            loss_backward: if fused_loss { e * logits } else { 4 * logits },
        }
    }
}
