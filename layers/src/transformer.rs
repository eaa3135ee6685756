//! Layer norm, the tensor-parallel MLP and self-attention, and a pre-norm transformer
//! block built from them. Activations are sequence-first, `[sequence, batch, hidden]`, as
//! in Megatron-Core; under sequence parallelism the sequence dimension is this rank's
//! part outside the tensor-parallel regions.

use std::sync::Arc;

use ferrotron_comm_core::Communicator;
use ferrotron_mappings::{
    gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region,
};
use ferrotron_tape::{AttentionKernel, AttentionOptions, Tape, Tensor};

use crate::config::BlockConfig;
use crate::error::{Error, Result};
use crate::init::{sharded, MasterInit};
use crate::linear::{ColumnParallelLinear, LinearOptions, LinearOutput, RowParallelLinear};
use crate::mlp::ParallelMlp;
use crate::parallel::{Module, ShardedParameter, Sharding, TensorParallel};
use crate::random::RngTracker;

/// Layer normalisation over the last dimension, with replicated weight and bias.
///
/// Under sequence parallelism each rank normalises only its part of the sequence, so its
/// parameter gradients are partial sums: both parameters are flagged with
/// [`grad_reduce_group`](ShardedParameter::grad_reduce_group) `= Some("tp")`.
#[derive(Clone)]
pub struct LayerNorm {
    weight: ShardedParameter,
    bias: ShardedParameter,
    eps: f64,
}

impl LayerNorm {
    /// A layer norm called `name` over `hidden` features.
    pub fn new(
        tp: &TensorParallel,
        name: &str,
        hidden: usize,
        eps: f64,
        init: &MasterInit,
    ) -> Result<Self> {
        let make = |suffix: &str, offset: f32| -> Result<ShardedParameter> {
            let full_name = format!("{name}.{suffix}");
            let full = init.bias(&full_name, &[hidden], offset)?;
            sharded(
                tp,
                full_name,
                &full,
                Sharding::Replicated,
                tp.sequence_parallel(),
            )
        };
        Ok(LayerNorm {
            weight: make("weight", 1.0)?,
            bias: make("bias", 0.0)?,
            eps,
        })
    }

    /// Normalises `x: [..., hidden]`.
    pub fn forward(&self, tape: &Tape, x: &Tensor) -> Result<Tensor> {
        let weight = tape.watch(&self.weight.param)?;
        let bias = tape.watch(&self.bias.param)?;
        Ok(x.layer_norm(Some(&weight), Some(&bias), self.eps)?)
    }
}

impl Module for LayerNorm {
    fn parameters(&self) -> Vec<ShardedParameter> {
        vec![self.weight.clone(), self.bias.clone()]
    }
}

/// Causal multi-head (or grouped-query) self-attention with the heads divided among the
/// tensor-parallel ranks: a column-parallel QKV projection, attention over this rank's
/// heads, and a row-parallel output projection.
///
/// The fused QKV weight's rows are laid out group by group (the queries of group 0's
/// heads, its key and its value, then group 1's, ...), as Megatron-Core's; with one query
/// per group that is `[q, k, v]` head by head. Cutting its rows among ranks hands each
/// rank whole groups. The core is fused ([`AttentionKernel::Fused`]: no `sequence²`
/// tensor kept) unless the config asks for the unfused reference.
#[derive(Clone)]
pub struct ParallelSelfAttention {
    qkv: ColumnParallelLinear,
    proj: RowParallelLinear,
    local_heads: usize,
    /// Query heads per key/value group.
    per_group: usize,
    head_dim: usize,
    dropout: f64,
    recompute_core: bool,
    kernel: AttentionKernel,
    /// The ring attention runs over, under context parallelism.
    context: Option<Arc<dyn Communicator>>,
}

impl ParallelSelfAttention {
    /// Attention called `name` (`name.qkv`, `name.proj`). Errors when the heads do not
    /// divide the width, the groups do not divide the heads, or the tensor-parallel size
    /// does not divide the groups.
    pub fn new(
        tp: &TensorParallel,
        name: &str,
        config: &BlockConfig,
        init: &MasterInit,
    ) -> Result<Self> {
        const OP: &str = "ParallelSelfAttention";
        let (hidden, heads, groups) = (config.hidden, config.heads, config.groups());
        let divides =
            |what, value: usize, parts: usize| match parts > 0 && value.is_multiple_of(parts) {
                true => Ok(()),
                false => Err(Error::NotDivisible {
                    op: OP,
                    what,
                    value,
                    parts,
                }),
            };
        divides("hidden size", hidden, heads)?;
        divides("attention heads", heads, groups)?;
        let grouped = match config.query_groups {
            Some(_) => "query groups",
            None => "attention heads",
        };
        divides(grouped, groups, tp.size())?;
        if tp.context_parallel().is_some() && config.attention_dropout > 0.0 {
            return Err(Error::config(
                OP,
                format!(
                    "attention dropout ({}) under context parallelism is not supported: the \
                     ring keeps no probabilities to draw a mask over; set it to 0",
                    config.attention_dropout
                ),
            ));
        }
        let head_dim = hidden / heads;
        Ok(ParallelSelfAttention {
            qkv: ColumnParallelLinear::new(
                tp,
                &format!("{name}.qkv"),
                hidden,
                (heads + 2 * groups) * head_dim,
                false,
                LinearOptions::default(),
                init,
            )?,
            proj: RowParallelLinear::new(
                tp,
                &format!("{name}.proj"),
                hidden,
                hidden,
                true,
                // The block adds the bias with the residual (`bias_dropout_add`).
                LinearOptions {
                    skip_bias_add: true,
                    ..LinearOptions::default()
                },
                init,
            )?,
            local_heads: heads / tp.size(),
            per_group: heads / groups,
            head_dim,
            dropout: config.attention_dropout,
            recompute_core: config.recompute_attention_core,
            kernel: config.attention,
            context: tp.context_parallel().cloned(),
        })
    }

    /// Attends over `x: [sequence, batch, hidden]` (this rank's sequence part under
    /// sequence parallelism) in training, with dropout on the attention probabilities
    /// drawn from `rng`'s model-parallel stream; the output has `x`'s shape.
    pub fn forward(&self, tape: &Tape, x: &Tensor, rng: &mut RngTracker) -> Result<Tensor> {
        self.attend(tape, x, Some(rng))?.with_bias()
    }

    /// [`forward`](Self::forward) for evaluation and generation: no dropout, and no
    /// random stream is drawn from (PyTorch's and Megatron's `eval()` mode).
    pub fn forward_inference(&self, tape: &Tape, x: &Tensor) -> Result<Tensor> {
        self.attend(tape, x, None)?.with_bias()
    }

    /// Attention with dropout drawn from `rng`, or none without it; the output
    /// projection's bias is returned, not added.
    fn attend(
        &self,
        tape: &Tape,
        x: &Tensor,
        rng: Option<&mut RngTracker>,
    ) -> Result<LinearOutput> {
        if x.ndim() != 3 {
            return Err(Error::shape(
                "ParallelSelfAttention",
                x.shape(),
                "[sequence, batch, hidden]",
            ));
        }
        let qkv = self.qkv.forward(tape, x)?.output;
        let (seq, batch) = (qkv.shape()[0], qkv.shape()[1]);
        let groups = self.local_heads / self.per_group;
        let qkv = qkv.reshape(&[seq, batch, groups, self.per_group + 2, self.head_dim])?;
        let core = crate::attention_core::AttentionCore {
            scale: 1.0 / (self.head_dim as f64).sqrt(),
            dropout: self.dropout,
        };
        let unfused = self.kernel == AttentionKernel::Unfused;
        let context = match (&self.context, rng) {
            (None, Some(rng)) if self.recompute_core && unfused => {
                let (query, key, value) = self.split_heads(&qkv)?;
                self.merge_heads(&core.recomputed(&query, &key, &value, rng)?, seq, batch)?
            }
            // Fused, or the unfused products reading q, k and v in place.
            (None, rng) => {
                let dropout = rng.map(|rng| (self.dropout, rng.model_parallel_stream()));
                let options = AttentionOptions {
                    scale: core.scale,
                    causal: true,
                    kernel: self.kernel,
                };
                qkv.packed_attention(options, dropout)?
            }
            // The ring keeps no probabilities, so there is nothing for selective
            // recomputation to drop.
            (Some(group), _) => {
                let (query, key, value) = self.split_heads(&qkv)?;
                let context = crate::ring_attention(&query, &key, &value, group, core.scale, true)?;
                self.merge_heads(&context, seq, batch)?
            }
        };
        self.proj.forward(tape, &context)
    }

    /// Queries, keys and values `[batch·heads, sequence, head_dim]` out of the packed
    /// `[sequence, batch, groups, per_group + 2, head_dim]`, each group's key and value
    /// repeated for its queries, for the cores that take them apart.
    fn split_heads(&self, qkv: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let [seq, batch, _, _, head_dim] = qkv.shape().try_into().map_err(|_| {
            Error::shape(
                "ParallelSelfAttention",
                qkv.shape(),
                "packed 5-D queries, keys and values",
            )
        })?;
        let r = self.per_group;
        let heads = |t: Tensor| -> Result<Tensor> {
            Ok(t.permute(&[1, 2, 3, 0, 4])?
                .reshape(&[batch * self.local_heads, seq, head_dim])?)
        };
        let shared = |index: usize| -> Result<Tensor> {
            let part = qkv.narrow(3, index, 1)?;
            match r {
                1 => heads(part),
                _ => heads(Tensor::concat(&vec![&part; r], 3)?),
            }
        };
        Ok((heads(qkv.narrow(3, 0, r)?)?, shared(r)?, shared(r + 1)?))
    }
    /// A `[batch·heads, sequence, head_dim]` context as `[sequence, batch, hidden]`.
    fn merge_heads(&self, context: &Tensor, seq: usize, batch: usize) -> Result<Tensor> {
        let (heads, head_dim) = (self.local_heads, self.head_dim);
        Ok(context
            .reshape(&[batch, heads, seq, head_dim])?
            .permute(&[2, 0, 1, 3])?
            .reshape(&[seq, batch, heads * head_dim])?)
    }
}

impl Module for ParallelSelfAttention {
    fn parameters(&self) -> Vec<ShardedParameter> {
        let mut params = self.qkv.parameters();
        params.extend(self.proj.parameters());
        params
    }
}

/// A pre-norm transformer block:
/// `h = x + dropout(attention(ln1(x)))`, `out = h + dropout(mlp(ln2(h)))`.
#[derive(Clone)]
pub struct TransformerBlock {
    ln1: LayerNorm,
    attention: ParallelSelfAttention,
    ln2: LayerNorm,
    mlp: BlockMlp,
    hidden_dropout: f64,
    sequence_parallel: bool,
}

impl TransformerBlock {
    /// A block called `name` (`name.ln1`, `name.attention`, `name.ln2`, `name.mlp`).
    pub fn new(
        tp: &TensorParallel,
        name: &str,
        config: &BlockConfig,
        init: &MasterInit,
    ) -> Result<Self> {
        let mlp = ParallelMlp::new(tp, &format!("{name}.mlp"), config, init)?;
        Self::around(tp, name, config, init, BlockMlp::Dense(Box::new(mlp)))
    }

    /// The block's norms and attention around `mlp`.
    fn around(
        tp: &TensorParallel,
        name: &str,
        config: &BlockConfig,
        init: &MasterInit,
        mlp: BlockMlp,
    ) -> Result<Self> {
        Ok(TransformerBlock {
            ln1: LayerNorm::new(
                tp,
                &format!("{name}.ln1"),
                config.hidden,
                config.layer_norm_eps,
                init,
            )?,
            attention: ParallelSelfAttention::new(tp, &format!("{name}.attention"), config, init)?,
            ln2: LayerNorm::new(
                tp,
                &format!("{name}.ln2"),
                config.hidden,
                config.layer_norm_eps,
                init,
            )?,
            mlp,
            hidden_dropout: config.hidden_dropout,
            sequence_parallel: tp.sequence_parallel(),
        })
    }

    /// A block whose MLP is a mixture of experts (`name.mlp.router`,
    /// `name.mlp.experts.{e}`) over `tp`'s [expert groups](TensorParallel::expert_parallel).
    /// Its auxiliary loss reaches backward through the block's output
    /// ([`MoeMlp::forward_in_block`](crate::MoeMlp::forward_in_block)). With
    /// [`shared_expert_ffn`](crate::MoeConfig::shared_expert_ffn) a dense MLP
    /// (`name.mlp.shared_expert`) runs beside the routed experts and its output is added.
    /// The experts must be split over as many tensor-parallel ranks as the block
    /// (an [`Error`] otherwise).
    ///
    /// Under sequence parallelism the tensor-parallel ranks gather the sequence's parts
    /// before the router and keep their own part of the output, so that every
    /// tensor-parallel rank routes the same tokens and the results equal those without
    /// sequence parallelism (the router's gradient is then whole on each rank: no sum
    /// over the group).
    pub fn with_experts(
        tp: &TensorParallel,
        name: &str,
        config: &BlockConfig,
        moe: &crate::MoeConfig,
        init: &MasterInit,
    ) -> Result<Self> {
        const OP: &str = "TransformerBlock::with_experts";
        let Some(experts) = tp.expert_parallel() else {
            return Err(Error::config(
                OP,
                "a mixture of experts needs its groups: build the context with \
                 TensorParallel::from_state or with_expert_parallel",
            ));
        };
        if experts.expert_tp.size() != tp.size() {
            // The tensor-parallel ranks hold the same tokens, and only they: unless the
            // expert-tensor-parallel ranks are they, each would send its copy of every
            // token to the experts, or they would split experts over different tokens.
            return Err(Error::config(
                OP,
                format!(
                    "experts split over {} tensor-parallel ranks in a block of {}: the \
                     expert-tensor-parallel size must equal the tensor-parallel size",
                    experts.expert_tp.size(),
                    tp.size()
                ),
            ));
        }
        let shared = match moe.shared_expert_ffn {
            Some(0) => {
                return Err(Error::config(
                    OP,
                    "a shared expert needs an inner width of at least 1",
                ))
            }
            Some(ffn_hidden) => {
                let width = BlockConfig {
                    ffn_hidden,
                    ..*config
                };
                let name = format!("{name}.mlp.shared_expert");
                Some(Box::new(ParallelMlp::new(tp, &name, &width, init)?))
            }
            None => None,
        };
        let routed = crate::MoeConfig {
            shared_expert_ffn: None,
            ..*moe
        };
        let moe = crate::MoeMlp::new(experts, &format!("{name}.mlp"), config, &routed, init)?;
        let gather = (tp.sequence_parallel() && tp.size() > 1).then(|| tp.group().clone());
        let mlp = BlockMlp::Experts {
            moe: Box::new(moe),
            gather,
            shared,
        };
        Self::around(tp, name, config, init, mlp)
    }

    /// The block's mixture of experts, if its MLP is one.
    pub fn experts(&self) -> Option<&crate::MoeMlp> {
        match &self.mlp {
            BlockMlp::Experts { moe, .. } => Some(moe.as_ref()),
            BlockMlp::Dense(_) => None,
        }
    }

    /// Applies the block to `x: [sequence, batch, hidden]` (this rank's sequence part
    /// under sequence parallelism) in training, with dropout drawn from `rng`.
    pub fn forward(&self, tape: &Tape, x: &Tensor, rng: &mut RngTracker) -> Result<Tensor> {
        self.apply(tape, x, Some(rng))
    }

    /// [`forward`](Self::forward) for evaluation and generation: no dropout, and no
    /// random stream is drawn from, so evaluating between training steps leaves the
    /// training's masks as they would have been.
    pub fn forward_inference(&self, tape: &Tape, x: &Tensor) -> Result<Tensor> {
        self.apply(tape, x, None)
    }

    fn apply(&self, tape: &Tape, x: &Tensor, mut rng: Option<&mut RngTracker>) -> Result<Tensor> {
        let normed = self.ln1.forward(tape, x)?;
        let attended = self.attention.attend(tape, &normed, rng.as_deref_mut())?;
        let hidden = self.residual_add(attended, x, rng.as_deref_mut())?;
        let normed = self.ln2.forward(tape, &hidden)?;
        let transformed = match &self.mlp {
            BlockMlp::Dense(mlp) => mlp.forward_parts(tape, &normed)?,
            BlockMlp::Experts {
                moe,
                gather,
                shared,
            } => {
                let routed = match gather {
                    None => moe.forward_in_block(tape, &normed)?,
                    Some(tp) => {
                        // The experts' output and input gradient are whole and the same on
                        // every tensor-parallel rank: backward keeps this rank's part of the
                        // gradient, and all-gathers the output's.
                        let whole = gather_from_sequence_parallel_region(&normed, tp, false, None)?;
                        let out = moe.forward_in_block(tape, &whole)?;
                        scatter_to_sequence_parallel_region(&out, tp, None)?
                    }
                };
                let output = match shared {
                    // A dense MLP, sequence-parallel like the block's own would be.
                    Some(shared) => routed.add(&shared.forward(tape, &normed)?)?,
                    None => routed,
                };
                LinearOutput { output, bias: None }
            }
        };
        self.residual_add(transformed, &hidden, rng)
    }

    /// `residual + dropout(branch + its bias)`, one kernel on a device. Dropout draws from
    /// the default stream (the branch is the same on every tensor-parallel rank), or the
    /// model-parallel one under sequence parallelism (each rank holds another part of the
    /// sequence).
    fn residual_add(
        &self,
        branch: LinearOutput,
        residual: &Tensor,
        rng: Option<&mut RngTracker>,
    ) -> Result<Tensor> {
        let dropout = rng.map(|rng| {
            let stream = rng.for_activations(self.sequence_parallel);
            (self.hidden_dropout, stream)
        });
        let bias = branch.bias.as_ref();
        Ok(branch.output.bias_dropout_add(bias, residual, dropout)?)
    }
}

impl Module for TransformerBlock {
    fn parameters(&self) -> Vec<ShardedParameter> {
        let mut params = self.ln1.parameters();
        params.extend(self.attention.parameters());
        params.extend(self.ln2.parameters());
        params.extend(match &self.mlp {
            BlockMlp::Dense(mlp) => mlp.parameters(),
            BlockMlp::Experts { moe, shared, .. } => {
                let mut params = moe.parameters();
                params.extend(shared.iter().flat_map(|mlp| mlp.parameters()));
                params
            }
        });
        params
    }
}

/// A block's MLP: dense, or a mixture of experts.
#[derive(Clone)]
enum BlockMlp {
    Dense(Box<ParallelMlp>),
    Experts {
        moe: Box<crate::MoeMlp>,
        /// The tensor-parallel group under sequence parallelism: the experts route the
        /// whole sequence, gathered from its parts.
        gather: Option<Arc<dyn Communicator>>,
        /// A dense MLP every token goes through beside the routed experts.
        shared: Option<Box<ParallelMlp>>,
    },
}
