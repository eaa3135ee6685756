//! The GPT: vocabulary-parallel token embedding plus a learned (replicated) position
//! embedding → pre-norm transformer blocks → final layer norm → column-parallel head whose
//! logits stay divided over the vocabulary, fed straight into the vocabulary-parallel
//! cross-entropy.
//!
//! As in Megatron's GPT the head's weight is the token embedding's table unless the
//! embeddings are untied. With pipeline stages the first stage (lookups) and the last
//! (logits) each hold a copy, built from the same master weights, whose gradients DDP sums
//! over the `"embedding"` group; the optimizer then updates both alike, so they stay equal.

use anyhow::{Context, Result};
use ferrotron_comm_core::Communicator;
use ferrotron_layers::{
    vocab_parallel_cross_entropy_per_token, BlockConfig, ColumnParallelLinear, LayerNorm,
    LinearOptions, MasterInit, Module, RngTracker, ShardedParameter, Sharding, TensorParallel,
    TokenLoss, TransformerBlock, VocabParallelEmbedding, EMBEDDING_GROUP, TP_GROUP,
};
use ferrotron_tape::{AttentionKernel, CrossEntropyOptions, Parameter, Tape, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// Standard deviation of the master weights (GPT-2's).
const INIT_STD: f64 = 0.02;

/// Added to a padded vocabulary entry's logit: finite (so sums stay finite), and far
/// enough below any real logit that its exponential underflows to 0.
const PADDING_LOGIT: f32 = -1e30;

#[derive(Debug, Clone, Copy)]
pub struct GptConfig {
    /// Rows of the embedding and columns of the logits: the tokens, padded.
    pub vocab: usize,
    /// Tokens that exist; the logits of the padding after them are left out of the loss.
    pub valid_vocab: usize,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    /// Key/value heads of grouped-query attention (`None`: one per head).
    pub query_groups: Option<usize>,
    /// The attention core's kernel (a setting of the run: both give the same model).
    pub attention: AttentionKernel,
    /// Longest context; the position table has this many rows.
    pub seq: usize,
    /// Whether the head's weight is the token embedding's table (Megatron's default).
    pub tied: bool,
    /// Dropout on attention probabilities and on each residual branch, in training.
    pub attention_dropout: f64,
    pub hidden_dropout: f64,
    /// Recompute each block's attention core in backward (selective recomputation), a
    /// setting of the run like dropout.
    pub recompute_attention_core: bool,
    /// Mixture-of-experts MLPs, and in every how-many-th block (from block 0).
    pub moe: Option<(ferrotron_layers::MoeConfig, usize)>,
}

impl GptConfig {
    /// Floating-point operations of one training step per token, as Megatron counts a
    /// model's: 6 per weight a token multiplies (2 forward, 4 backward: every block's
    /// projections (the key and value ones narrower under grouped-query attention) and MLP, a mixture of experts' `top_k` experts, router and shared
    /// expert, and the output layer), plus attention's two products over the whole
    /// context, 12·seq·hidden per block (the causal mask's skipped half counted, as
    /// Megatron does). Recomputation is not counted: these are model flops.
    pub fn flops_per_token(&self) -> f64 {
        let h = self.hidden as f64;
        let dense_mlp = 2.0 * h * 4.0 * h;
        let mlp = |block: usize| match &self.moe {
            Some((moe, every)) if block.is_multiple_of(*every) => {
                let expert = 2.0 * h * moe.ffn_hidden as f64;
                let shared = moe.shared_expert_ffn.map_or(0.0, |f| 2.0 * h * f as f64);
                moe.top_k as f64 * expert + shared + h * moe.num_experts as f64
            }
            _ => dense_mlp,
        };
        let kv = 2.0 * h * h * self.query_groups.unwrap_or(self.heads) as f64 / self.heads as f64;
        let attention = 2.0 * h * h + kv;
        let weights: f64 =
            (0..self.layers).map(|b| attention + mlp(b)).sum::<f64>() + h * self.vocab as f64;
        6.0 * weights + 12.0 * (self.seq as f64) * h * self.layers as f64
    }
}

/// The whole model, or (under pipeline parallelism) the blocks of one stage, with the
/// embeddings if it starts the model and the final norm and head if it ends it.
pub struct Gpt {
    tp: TensorParallel,
    config: GptConfig,
    first: Option<Embeddings>,
    blocks: Vec<TransformerBlock>,
    last: Option<(LayerNorm, ColumnParallelLinear)>,
    /// Which of the blocks training recomputes in backward.
    recompute: Option<Recompute>,
    /// What `without_padding` adds to this rank's logits, made once on their device.
    padding_mask: std::sync::OnceLock<Tensor>,
}

/// Megatron's full activation recomputation, by its method: `Uniform(n)` recomputes the
/// chunk's blocks in groups of `n` (each group keeping only its input), `Block(n)` the
/// first `n` blocks of the chunk one by one, keeping the rest as usual.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    Uniform(usize),
    Block(usize),
}

impl Recompute {
    /// The chunk's `blocks` blocks as runs, each recomputed or not, in order.
    fn runs(self, blocks: usize) -> Vec<(std::ops::Range<usize>, bool)> {
        let (size, recomputed) = match self {
            Recompute::Uniform(n) => (n.max(1), blocks),
            Recompute::Block(n) => (1, n.min(blocks)),
        };
        let mut runs: Vec<_> = (0..recomputed)
            .step_by(size)
            .map(|start| (start..(start + size).min(recomputed), true))
            .collect();
        if recomputed < blocks {
            runs.push((recomputed..blocks, false));
        }
        runs
    }
}

/// Name of the token embedding's table, and of the last stage's copy of it when tied.
const EMBEDDING_WEIGHT: &str = "embed.weight";

struct Embeddings {
    tokens: VocabParallelEmbedding,
    position: ShardedParameter,
}

impl Embeddings {
    /// The first stage's token and position embeddings.
    fn new(tp: &TensorParallel, config: &GptConfig, init: &MasterInit) -> Result<Embeddings> {
        let tokens = VocabParallelEmbedding::new(tp, "embed", config.vocab, config.hidden, init)?;
        let position = ShardedParameter {
            param: Parameter::new(
                "position.weight",
                init.weight("position.weight", &[config.seq, config.hidden]),
            ),
            sharding: Sharding::Replicated,
            // Under sequence parallelism each rank adds only its rows of the table, so
            // its gradient is a partial sum over the tensor-parallel group, like a
            // layer norm's.
            grad_reduce_group: (tp.sequence_parallel() && tp.size() > 1).then_some(TP_GROUP),
            shared_copy: false,
            expert: false,
        };
        Ok(Embeddings { tokens, position })
    }
}

/// The last stage's final layer norm and head: the token embedding's table itself when
/// this stage holds it too (tied), else a copy of it under the same name, or a head of its
/// own (untied; without a bias either way, as Megatron's output layer).
fn output_layers(
    tp: &TensorParallel,
    config: &GptConfig,
    block: &BlockConfig,
    first: Option<&Embeddings>,
    init: &MasterInit,
) -> Result<(LayerNorm, ColumnParallelLinear)> {
    let ln_f = LayerNorm::new(tp, "ln_f", config.hidden, block.layer_norm_eps, init)?;
    let no_bias = LinearOptions {
        bias: false,
        skip_bias_add: false,
    };
    // The last stage's copy of a tied table has the table's name and master weights.
    let name = match config.tied {
        true => "embed",
        false => "head",
    };
    let head = match (first, config.tied) {
        (Some(first), true) => {
            ColumnParallelLinear::sharing_weight(tp, first.tokens.weight(), false)?
        }
        _ => {
            ColumnParallelLinear::new(tp, name, config.hidden, config.vocab, false, no_bias, init)?
        }
    };
    Ok((ln_f, head))
}

impl Gpt {
    /// This rank's part of the model holding blocks `blocks` (all of them for the whole
    /// model), built from the seeded master weights of the whole model, so every
    /// tensor- and pipeline-parallel size starts from the same model.
    pub fn chunk(
        tp: &TensorParallel,
        config: GptConfig,
        seed: u64,
        blocks: std::ops::Range<usize>,
    ) -> Result<Gpt> {
        let init = MasterInit::new(seed, INIT_STD);
        let block = BlockConfig {
            attention_dropout: config.attention_dropout,
            hidden_dropout: config.hidden_dropout,
            recompute_attention_core: config.recompute_attention_core,
            query_groups: config.query_groups,
            attention: config.attention,
            ..BlockConfig::new(config.hidden, config.heads)
        };
        let first = match blocks.start {
            0 => Some(Embeddings::new(tp, &config, &init)?),
            _ => None,
        };
        let last = match blocks.end == config.layers {
            true => Some(output_layers(tp, &config, &block, first.as_ref(), &init)?),
            false => None,
        };
        let blocks = blocks
            .map(|i| match config.moe {
                Some((moe, every)) if i.is_multiple_of(every) => {
                    TransformerBlock::with_experts(tp, &format!("block{i}"), &block, &moe, &init)
                }
                _ => TransformerBlock::new(tp, &format!("block{i}"), &block, &init),
            })
            .collect::<ferrotron_layers::Result<Vec<_>>>()?;
        Ok(Gpt {
            tp: tp.clone(),
            config,
            first,
            blocks,
            last,
            recompute: None,
            padding_mask: std::sync::OnceLock::new(),
        })
    }

    /// This part's output for `tokens` laid out `[seq, batch]` (a first part) or the
    /// previous part's `input`: the next part's input, or this rank's logits `[seq, batch,
    /// local vocab]` (a last part). With `rng` it trains (dropout drawn from it); without,
    /// it evaluates (no dropout, no draws).
    pub fn forward_chunk(
        &self,
        tape: &Tape,
        tokens: Tokens<'_>,
        input: Option<&Tensor>,
        seq: usize,
        batch: usize,
        rng: Option<&mut RngTracker>,
    ) -> Result<Tensor> {
        let mut hidden = match (&self.first, input) {
            (Some(first), _) => self.embed(first, tape, tokens, seq, batch)?,
            (None, Some(input)) => input.clone(),
            (None, None) => anyhow::bail!("a later pipeline stage needs its input"),
        };
        hidden = self.blocks_forward(tape, hidden, rng)?;
        match &self.last {
            Some((ln_f, head)) => {
                let hidden = ln_f.forward(tape, &hidden)?;
                Ok(head.forward(tape, &hidden)?.output)
            }
            None => Ok(hidden),
        }
    }

    /// The token embeddings of `tokens` plus their positions' (this rank's sequence part
    /// under sequence parallelism): positions are indices `0..seq` (this rank's two
    /// chunks of them under context parallelism), or `tokens.positions` when given.
    fn embed(
        &self,
        first: &Embeddings,
        tape: &Tape,
        tokens: Tokens<'_>,
        seq: usize,
        batch: usize,
    ) -> Result<Tensor> {
        let embedded = first.tokens.forward(tape, tokens.ids, &[seq, batch])?;
        let table = tape.watch(&first.position.param)?;
        let (start, len) = match self.tp.sequence_parallel() {
            true => self.tp.part(seq)?,
            false => (0, seq),
        };
        if let Some(positions) = tokens.positions {
            // Already this rank's, in the ids' layout: look up its sequence part's rows.
            let part = &positions[start * batch..(start + len) * batch];
            return Ok(embedded.add(&table.embedding(part, &[len, batch])?)?);
        }
        // Under context parallelism this rank holds two chunks of the sequence,
        let table = match self.tp.context_size() {
            1 => table,
            cp => {
                let [(a, c), (b, _)] = ferrotron_layers::context_parallel_chunks(
                    self.config.seq,
                    self.tp.context_rank(),
                    cp,
                )?;
                Tensor::concat(&[&table.narrow(0, a, c)?, &table.narrow(0, b, c)?], 0)?
            }
        };
        // and under sequence parallelism its part of those.
        let positions = (table.narrow(0, start, len)?).reshape(&[len, 1, self.config.hidden])?;
        Ok(embedded.add(&positions)?)
    }

    /// This part's mixtures of experts.
    pub fn experts(&self) -> impl Iterator<Item = &ferrotron_layers::MoeMlp> {
        self.blocks.iter().filter_map(TransformerBlock::experts)
    }

    /// Whether this part ends the model (its output is the logits).
    pub fn is_last(&self) -> bool {
        self.last.is_some()
    }

    /// Whether this part holds one of two copies of the tied embedding: the first
    /// stage's table or the last stage's, when different stages hold them.
    fn holds_tied_copy(&self) -> bool {
        self.config.tied && (self.first.is_some() != self.last.is_some())
    }

    /// This part's copy of the tied embedding when another stage holds the other one.
    pub fn tied_copy(&self) -> Option<Parameter> {
        self.holds_tied_copy().then(|| {
            (self.parameters().into_iter())
                .find(|p| p.param.name() == EMBEDDING_WEIGHT)
                .map(|p| p.param)
        })?
    }

    /// Cross-entropy of `logits` against `labels` (laid out like the ids) as this
    /// data-parallel rank's share of the mean over every token of the global batch
    /// (Megatron's per-token loss): the average over `dp` of the values is that mean, and
    /// DDP's average of the gradients is its gradient, whatever each rank's token count.
    pub fn loss(
        &self,
        logits: &Tensor,
        labels: &[i64],
        dp: &Arc<dyn Communicator>,
    ) -> Result<TokenLoss> {
        let logits = self.without_padding(logits)?;
        Ok(vocab_parallel_cross_entropy_per_token(
            &logits,
            labels,
            self.tp.group(),
            self.config.vocab,
            &CrossEntropyOptions::default(),
            dp,
        )?)
    }

    /// `logits` in f32 with the padded vocabulary's columns pushed to a value whose
    /// exponential is 0, so that they take no probability and get no gradient (Megatron
    /// pads the vocabulary for its matrix shapes; the padding is no token).
    fn without_padding(&self, logits: &Tensor) -> Result<Tensor> {
        let (vocab, valid) = (self.config.vocab, self.config.valid_vocab);
        if valid >= vocab {
            return Ok(logits.clone());
        }
        let mask = match self.padding_mask.get() {
            Some(mask) if mask.device() == logits.device() => mask.clone(),
            _ => {
                let range =
                    ferrotron_layers::VocabRange::new(vocab, self.tp.rank(), self.tp.size())?;
                let mask: Vec<f32> = (range.start..range.end)
                    .map(|id| if id < valid { 0.0 } else { PADDING_LOGIT })
                    .collect();
                let mask = Tensor::from_vec(mask, &[range.len()])?.to_device(logits.device())?;
                // Uploaded once: a later microbatch reuses it instead of copying again.
                let _ = self.padding_mask.set(mask.clone());
                mask
            }
        };
        Ok(logits.to_dtype(ferrotron_tape::DType::F32)?.add(&mask)?)
    }

    /// Recomputes blocks in backward as `recompute` says (training only: evaluation
    /// records nothing to recompute).
    pub fn with_recompute(mut self, recompute: Option<Recompute>) -> Gpt {
        self.recompute = recompute;
        self
    }

    /// `hidden` through the chunk's blocks: with dropout from `rng` and recomputation
    /// when training, without both otherwise.
    fn blocks_forward(
        &self,
        tape: &Tape,
        mut hidden: Tensor,
        rng: Option<&mut RngTracker>,
    ) -> Result<Tensor> {
        let Some(rng) = rng else {
            for block in &self.blocks {
                hidden = block.forward_inference(tape, &hidden)?;
            }
            return Ok(hidden);
        };
        let runs = match self.recompute {
            Some(recompute) => recompute.runs(self.blocks.len()),
            None => vec![(0..self.blocks.len(), false)],
        };
        for (range, recomputed) in runs {
            let blocks = &self.blocks[range];
            if recomputed {
                hidden = ferrotron_layers::recompute_blocks(blocks, tape, &hidden, rng)?;
                continue;
            }
            for block in blocks {
                hidden = block.forward(tape, &hidden, rng)?;
            }
        }
        Ok(hidden)
    }

    pub fn tp(&self) -> &TensorParallel {
        &self.tp
    }

    pub fn config(&self) -> GptConfig {
        self.config
    }

    /// Restores the weights from a checkpoint's full tensors (joined from any
    /// tensor-parallel size and pipeline layout; `dir` names it in errors): this rank
    /// keeps its part of each of its parameters.
    pub fn load(&self, full: &BTreeMap<String, (Sharding, Tensor)>, dir: &Path) -> Result<()> {
        for sharded in self.parameters() {
            let name = sharded.param.name();
            let (sharding, tensor) = full
                .get(name)
                .with_context(|| format!("checkpoint {} has no '{name}'", dir.display()))?;
            anyhow::ensure!(
                *sharding == sharded.sharding,
                "checkpoint {}: '{name}' is {}, the model's is {}; was it saved with other \
                 model sizes?",
                dir.display(),
                sharding.encode(),
                sharded.sharding.encode()
            );
            let part = sharding.shard(tensor, self.tp.rank(), self.tp.size())?;
            sharded.param.set_value(part).with_context(|| {
                format!(
                    "checkpoint {}: '{name}' has another shape than the model's; pass the \
                     model sizes it was trained with",
                    dir.display()
                )
            })?;
        }
        Ok(())
    }
}

/// A first part's input: token ids `[seq, batch]` (sequence-first, flattened) and, when
/// positions are not simply each token's index, theirs in the same layout.
#[derive(Clone, Copy)]
pub struct Tokens<'a> {
    pub ids: &'a [usize],
    pub positions: Option<&'a [usize]>,
}

/// A rank's chunks of the model as one module: their parameters in chunk order, as the
/// optimizer holds them.
pub struct RankModel<'a>(pub &'a [Gpt]);

impl Module for RankModel<'_> {
    fn parameters(&self) -> Vec<ShardedParameter> {
        self.0.iter().flat_map(Module::parameters).collect()
    }
}

impl Module for Gpt {
    /// In the order forward uses them, which DDP's buckets follow. A tied head's weight is
    /// the table's, listed once; with the two on different stages, each copy is marked for
    /// a sum of the copies' gradients over the embedding group, and the last stage's as
    /// the shared copy that the gradient norm leaves out.
    fn parameters(&self) -> Vec<ShardedParameter> {
        let mut params = Vec::new();
        if let Some(first) = &self.first {
            params.extend(first.tokens.parameters());
            params.push(first.position.clone());
        }
        params.extend(self.blocks.iter().flat_map(Module::parameters));
        if let Some((ln_f, head)) = &self.last {
            params.extend(ln_f.parameters());
            params.extend(head.parameters());
        }
        if self.holds_tied_copy() {
            // The first stage counts the weight in sums over the model; the last holds a
            // shared copy.
            let shared_copy = self.first.is_none();
            for sharded in &mut params {
                if sharded.param.name() == EMBEDDING_WEIGHT {
                    sharded.grad_reduce_group = Some(EMBEDDING_GROUP);
                    sharded.shared_copy = shared_copy;
                }
            }
        }
        params
    }
}

#[cfg(test)]
mod tests {
    use super::GptConfig;

    fn gpt(layers: usize, hidden: usize, seq: usize, vocab: usize) -> GptConfig {
        GptConfig {
            vocab,
            valid_vocab: vocab,
            layers,
            hidden,
            heads: 12,
            query_groups: None,
            attention: ferrotron_tape::AttentionKernel::Fused,
            seq,
            tied: true,
            attention_dropout: 0.0,
            hidden_dropout: 0.0,
            recompute_attention_core: false,
            moe: None,
        }
    }

    #[test]
    fn model_flops_are_six_per_weight_and_token_plus_attention() {
        // GPT-2 small's shape: 12 blocks of 12h² weights and a 50257-row head (Megatron's
        // 72·l·h²·(1 + s/6h + V/12lh) per token).
        let (l, h, s, v) = (12.0, 768.0, 1024.0, 50257.0);
        let megatron = 72.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h));
        let ours = gpt(12, 768, 1024, 50257).flops_per_token();
        assert!(
            (ours - megatron).abs() <= 1e-9 * megatron,
            "{ours} vs {megatron}"
        );
    }
}
