//! The sizes and probabilities of a transformer block, shared by its attention, its MLP
//! and a mixture of experts in its place.

use ferrotron_tape::{AttentionKernel, Gelu};

/// Sizes and probabilities of a transformer block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockConfig {
    /// Model width.
    pub hidden: usize,
    /// Attention heads; the tensor-parallel size must divide it.
    pub heads: usize,
    /// Key/value heads, each shared by `heads / groups` query heads (grouped-query
    /// attention, Megatron's `--num-query-groups`); `None` gives every query head its
    /// own (multi-head attention). It must divide `heads`, and the tensor-parallel size
    /// must divide it.
    pub query_groups: Option<usize>,
    /// The attention core's kernel: fused (the default: no `sequence²` tensor kept) or
    /// the unfused reference.
    pub attention: AttentionKernel,
    /// Width of the MLP's inner layer (usually `4 · hidden`); any size, split unevenly
    /// when the tensor-parallel size does not divide it.
    pub ffn_hidden: usize,
    /// Layer-norm epsilon.
    pub layer_norm_eps: f64,
    /// Dropout on attention probabilities (model-parallel RNG stream).
    pub attention_dropout: f64,
    /// Dropout on each residual branch (default stream, or model-parallel stream under
    /// sequence parallelism, where the activations differ by rank).
    pub hidden_dropout: f64,
    /// GELU formula of the MLP.
    pub gelu: Gelu,
    /// Recompute the attention core (scores, softmax, dropout, the product with the
    /// values) in backward instead of keeping its `sequence²` activations: Megatron's
    /// `selective` recomputation. The fused core keeps none, so this changes nothing
    /// for it.
    pub recompute_attention_core: bool,
}

impl BlockConfig {
    /// `hidden` wide with `heads` heads, a `4 · hidden` MLP, no dropout, tanh GELU.
    pub fn new(hidden: usize, heads: usize) -> Self {
        BlockConfig {
            hidden,
            heads,
            query_groups: None,
            attention: AttentionKernel::Fused,
            ffn_hidden: 4 * hidden,
            layer_norm_eps: 1e-5,
            attention_dropout: 0.0,
            hidden_dropout: 0.0,
            gelu: Gelu::Tanh,
            recompute_attention_core: false,
        }
    }

    /// Key/value heads: [`query_groups`](Self::query_groups), or one per query head.
    pub fn groups(&self) -> usize {
        self.query_groups.unwrap_or(self.heads)
    }
}
