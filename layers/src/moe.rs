//! A mixture-of-experts MLP with expert parallelism, as Megatron-Core's `MoELayer` with
//! its all-to-all token dispatcher: a router picks `top_k` experts per token, tokens
//! travel to the ranks holding their experts by all-to-all over the expert-parallel group
//! (each rank sends each peer as many rows as it routes there: dropless), the experts are
//! MLPs (split by tensor parallelism inside each expert when the expert-tensor-parallel
//! group has several ranks), and their outputs come back and are summed weighted by the
//! router's probabilities.
//!
//! Routing is decided on the host from the router's logits (the chosen experts are not
//! differentiable; the weights are). With a capacity factor, each expert keeps at most
//! `ceil(tokens · top_k / experts · factor)` of a rank's tokens, those with the highest
//! weights (Megatron's `probs` drop policy), and the rest of those tokens' slots add
//! nothing to their output.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferrotron_comm_core::{Communicator, CommunicatorExt};
use ferrotron_mappings::all_to_all;
use ferrotron_tape::{CustomOp, Parameter, Tape, Tensor};

use crate::config::BlockConfig;
use crate::error::{Error, Result};
use crate::init::MasterInit;
use crate::mlp::ParallelMlp;
use crate::parallel::{ExpertParallel, Module, ShardedParameter, Sharding, TensorParallel};

/// Where the router's softmax goes relative to the top-k choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RouterSoftmax {
    /// Top-k of the logits, then a softmax over the k chosen (Megatron's default): each
    /// token's weights add up to 1.
    #[default]
    AfterTopK,
    /// A softmax over every expert, then the top k of those probabilities as the weights
    /// (Megatron's `--moe-router-pre-softmax`).
    BeforeTopK,
}

/// The mixture of experts' shape and routing.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts in the layer; the expert-parallel size must divide it.
    pub num_experts: usize,
    /// Experts each token goes to (1 or 2 in practice; at most `num_experts`).
    pub top_k: usize,
    /// Each expert's inner width.
    pub ffn_hidden: usize,
    /// Softmax before or after the top-k choice.
    pub softmax: RouterSoftmax,
    /// The load-balancing loss's coefficient (Switch/GShard form; 0 for none).
    pub aux_loss_coeff: f64,
    /// The router z-loss's coefficient (0 for none).
    pub z_loss_coeff: f64,
    /// Keep at most `ceil(tokens · top_k / experts · factor)` tokens per expert (of each
    /// rank's tokens); `None` keeps every token (dropless).
    pub capacity_factor: Option<f64>,
    /// The inner width of a shared expert every token also goes through (Megatron's
    /// `moe_shared_expert_intermediate_size`; DeepSeek's shared experts, their widths
    /// added up), or none. A dense MLP beside the routed experts, built by
    /// [`TransformerBlock::with_experts`](crate::TransformerBlock::with_experts);
    /// [`MoeMlp`] itself holds the routed experts only.
    pub shared_expert_ffn: Option<usize>,
}

impl MoeConfig {
    /// `num_experts` experts of width `ffn_hidden`, top-`top_k`, Megatron's defaults
    /// otherwise: softmax after the top-k, no load-balancing loss or z-loss, dropless.
    pub fn new(num_experts: usize, top_k: usize, ffn_hidden: usize) -> Self {
        MoeConfig {
            num_experts,
            top_k,
            ffn_hidden,
            softmax: RouterSoftmax::AfterTopK,
            aux_loss_coeff: 0.0,
            z_loss_coeff: 0.0,
            capacity_factor: None,
            shared_expert_ffn: None,
        }
    }
}

/// What a mixture of experts gives back besides its output.
pub struct MoeOutput {
    /// `[sequence, batch, hidden]`, the input's shape.
    pub output: Tensor,
    /// The load-balancing loss plus the z-loss, coefficients applied: a scalar to add to
    /// the model's loss.
    pub aux_loss: Tensor,
    /// How many of this rank's token slots the router sent to each expert (before any
    /// drop), by global expert id.
    pub tokens_per_expert: Vec<usize>,
    /// How many of those slots a capacity factor dropped.
    pub dropped: usize,
}

/// A mixture-of-experts MLP: a replicated router and this rank's share of the experts.
#[derive(Clone)]
pub struct MoeMlp {
    router: ShardedParameter,
    /// This rank's experts with their global ids, ascending.
    experts: Vec<(usize, ParallelMlp)>,
    config: MoeConfig,
    ep: Arc<dyn Communicator>,
    hidden: usize,
    /// What backward seeds the auxiliary loss with inside a block (f64 bits; shared by
    /// clones): [`set_aux_loss_scale`](Self::set_aux_loss_scale).
    aux_scale: Arc<AtomicU64>,
    /// Routing counts since the last [`take_stats`](Self::take_stats).
    stats: Arc<Mutex<MoeStats>>,
}

/// Routing counts a mixture of experts gathered over some forward passes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MoeStats {
    /// Token slots the router sent to each expert, by global id (before drops).
    pub tokens_per_expert: Vec<usize>,
    /// Of those, how many a capacity factor dropped.
    pub dropped: usize,
}

/// A token slot the router filled: token `token`'s `slot`-th choice, expert `expert` with
/// the weight the routing ranked it by.
#[derive(Clone, Copy, Debug)]
struct Choice {
    token: usize,
    slot: usize,
    expert: usize,
    weight: f32,
}

impl MoeMlp {
    /// An MoE called `name` (`name.router`, `name.experts.{e}.fc1`, ...) on `block`'s
    /// hidden size. Expert `e`'s weights are drawn by its global id, so any
    /// expert-parallel and expert-tensor-parallel size builds the same model.
    pub fn new(
        ctx: &ExpertParallel,
        name: &str,
        block: &BlockConfig,
        config: &MoeConfig,
        init: &MasterInit,
    ) -> Result<Self> {
        const OP: &str = "MoeMlp";
        let (experts, ep) = (config.num_experts, ctx.ep.size());
        if experts == 0 || !experts.is_multiple_of(ep) {
            return Err(Error::NotDivisible {
                op: OP,
                what: "experts",
                value: experts,
                parts: ep,
            });
        }
        if config.top_k == 0 || config.top_k > experts {
            return Err(Error::config(
                OP,
                format!(
                    "top-{} routing needs between 1 and {experts} experts per token",
                    config.top_k
                ),
            ));
        }
        if config.shared_expert_ffn.is_some() {
            return Err(Error::config(
                OP,
                "MoeMlp holds the routed experts only: build the block with \
                 TransformerBlock::with_experts for a shared expert, or add a ParallelMlp \
                 beside the layer",
            ));
        }
        if config.ffn_hidden == 0 {
            return Err(Error::config(
                OP,
                "each expert needs an inner width of at least 1",
            ));
        }
        if config
            .capacity_factor
            .is_some_and(|f| !(f.is_finite() && f > 0.0))
        {
            return Err(Error::config(
                OP,
                "the capacity factor must be positive and finite",
            ));
        }
        let router_name = format!("{name}.router.weight");
        let router = ShardedParameter {
            param: Parameter::new(
                router_name.clone(),
                init.weight(&router_name, &[experts, block.hidden]),
            ),
            sharding: Sharding::Replicated,
            grad_reduce_group: None,
            shared_copy: false,
            expert: false,
        };
        let expert_block = BlockConfig {
            ffn_hidden: config.ffn_hidden,
            ..*block
        };
        let local = experts / ep;
        let first = ctx.ep.rank() * local;
        let expert_tp = TensorParallel::new(ctx.expert_tp.clone());
        let experts = (first..first + local)
            .map(|e| {
                let mlp = ParallelMlp::new(
                    &expert_tp,
                    &format!("{name}.experts.{e}"),
                    &expert_block,
                    init,
                )?;
                Ok((e, mlp))
            })
            .collect::<Result<_>>()?;
        Ok(MoeMlp {
            router,
            experts,
            config: *config,
            ep: ctx.ep.clone(),
            hidden: block.hidden,
            aux_scale: Arc::new(AtomicU64::new(1f64.to_bits())),
            stats: Arc::new(Mutex::new(MoeStats {
                tokens_per_expert: vec![0; config.num_experts],
                dropped: 0,
            })),
        })
    }

    /// The router's weight: replicated, its gradient reduced over data parallelism.
    pub fn router_parameters(&self) -> Vec<ShardedParameter> {
        vec![self.router.clone()]
    }

    /// This rank's experts' parameters: different on each expert-parallel rank, their
    /// gradients reduced over the expert-data-parallel group.
    pub fn expert_parameters(&self) -> Vec<ShardedParameter> {
        (self.experts.iter())
            .flat_map(|(_, mlp)| mlp.parameters())
            .map(|p| ShardedParameter { expert: true, ..p })
            .collect()
    }

    /// The gradient a block's backward gives the auxiliary loss (Megatron's
    /// `MoEAuxLossAutoScaler`): the main loss's scale over the microbatches it is
    /// averaged over, so that the auxiliary loss counts as a mean over microbatches too.
    pub fn set_aux_loss_scale(&self, scale: f64) {
        self.aux_scale.store(scale.to_bits(), Ordering::Relaxed);
    }

    /// The routing counts since the last call, reset.
    pub fn take_stats(&self) -> MoeStats {
        let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        let empty = MoeStats {
            tokens_per_expert: vec![0; self.config.num_experts],
            dropped: 0,
        };
        std::mem::replace(&mut *stats, empty)
    }

    /// [`forward`](Self::forward) inside a block: the output, carrying the auxiliary loss
    /// into backward (seeded with the [`set_aux_loss_scale`](Self::set_aux_loss_scale)),
    /// and the routing counts added to [`take_stats`](Self::take_stats)'.
    pub fn forward_in_block(&self, tape: &Tape, x: &Tensor) -> Result<Tensor> {
        let out = self.forward(tape, x)?;
        {
            let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
            for (total, n) in stats
                .tokens_per_expert
                .iter_mut()
                .zip(&out.tokens_per_expert)
            {
                *total += n;
            }
            stats.dropped += out.dropped;
        }
        let scale = f64::from_bits(self.aux_scale.load(Ordering::Relaxed));
        Ok(Tensor::apply(
            Arc::new(AttachAuxLoss { scale }),
            &[&out.output, &out.aux_loss],
        )?)
    }

    /// The global ids of this rank's experts.
    pub fn local_experts(&self) -> Vec<usize> {
        self.experts.iter().map(|(e, _)| *e).collect()
    }

    /// Routes `x: [sequence, batch, hidden]` (this rank's tokens) to their experts and
    /// back. Every rank of the expert-parallel group must call it (and run its backward)
    /// together.
    pub fn forward(&self, tape: &Tape, x: &Tensor) -> Result<MoeOutput> {
        const OP: &str = "MoeMlp";
        if x.ndim() != 3 || x.shape()[2] != self.hidden {
            return Err(Error::shape(OP, x.shape(), "[sequence, batch, hidden]"));
        }
        let (s, b, h) = (x.shape()[0], x.shape()[1], self.hidden);
        let tokens = s * b;
        let (experts, k) = (self.config.num_experts, self.config.top_k);
        let flat = x.reshape(&[tokens, h])?;
        let logits = flat.matmul_transposed(&tape.watch(&self.router.param)?)?;
        let choices = self.route(&logits.to_vec()?, tokens)?;
        let mut tokens_per_expert = vec![0; experts];
        for c in &choices {
            tokens_per_expert[c.expert] += 1;
        }
        let kept = self.keep(&choices, tokens);
        let dropped = choices.len() - kept.len();
        let weights = self.weights(&logits, &choices, tokens)?;
        let returned = self.dispatch_and_compute(tape, &flat, &kept)?;
        // Each (token, slot) reads its row of what came back, or a zero row if dropped.
        let mut row = vec![kept.len(); tokens * k];
        for (i, c) in kept.iter().enumerate() {
            row[c.token * k + c.slot] = i;
        }
        let zero = Tensor::<f32>::full_as(&[1, h], 0.0, returned.dtype(), returned.device())?;
        let padded = Tensor::concat(&[&returned, &zero], 0)?;
        let output = padded
            .embedding(&row, &[tokens, k])?
            .mul(&weights.reshape(&[tokens, k, 1])?)?
            .sum_dim(1, false)?
            .reshape(&[s, b, h])?;
        let aux_loss = self.aux_loss(&logits, &tokens_per_expert, tokens)?;
        Ok(MoeOutput {
            output,
            aux_loss,
            tokens_per_expert,
            dropped,
        })
    }

    /// Each token's `top_k` experts and the weights they are ranked by (ties go to the
    /// lower expert id).
    fn route(&self, logits: &[f32], tokens: usize) -> Result<Vec<Choice>> {
        let (experts, k) = (self.config.num_experts, self.config.top_k);
        if logits.iter().any(|l| !l.is_finite()) {
            return Err(Error::config(
                "MoeMlp",
                "the router's logits are not finite: no expert can be chosen",
            ));
        }
        let mut choices = Vec::with_capacity(tokens * k);
        for token in 0..tokens {
            let row = &logits[token * experts..(token + 1) * experts];
            let mut order: Vec<usize> = (0..experts).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            // The ranking by logits is the ranking by probabilities; the weight is what
            // the drop policy compares.
            let max = row[order[0]];
            let exp: Vec<f32> = row.iter().map(|l| (l - max).exp()).collect();
            let total: f32 = match self.config.softmax {
                RouterSoftmax::AfterTopK => order[..k].iter().map(|&e| exp[e]).sum(),
                RouterSoftmax::BeforeTopK => exp.iter().sum(),
            };
            for (slot, &expert) in order[..k].iter().enumerate() {
                choices.push(Choice {
                    token,
                    slot,
                    expert,
                    weight: exp[expert] / total,
                });
            }
        }
        Ok(choices)
    }

    /// The choices a capacity factor keeps (all without one), in token order: per expert
    /// the `capacity` with the highest weights, ties to the earlier token.
    fn keep(&self, choices: &[Choice], tokens: usize) -> Vec<Choice> {
        let Some(factor) = self.config.capacity_factor else {
            return choices.to_vec();
        };
        let (experts, k) = (self.config.num_experts, self.config.top_k);
        let capacity = ((tokens * k) as f64 / experts as f64 * factor).ceil() as usize;
        let mut keep = vec![false; choices.len()];
        for expert in 0..experts {
            let mut mine: Vec<usize> = (0..choices.len())
                .filter(|&i| choices[i].expert == expert)
                .collect();
            mine.sort_by(|&a, &b| {
                choices[b]
                    .weight
                    .total_cmp(&choices[a].weight)
                    .then(a.cmp(&b))
            });
            for &i in mine.iter().take(capacity) {
                keep[i] = true;
            }
        }
        choices
            .iter()
            .zip(keep)
            .filter(|(_, k)| *k)
            .map(|(c, _)| *c)
            .collect()
    }

    /// The differentiable weight of every (token, slot): `[tokens, top_k]`.
    fn weights(&self, logits: &Tensor, choices: &[Choice], tokens: usize) -> Result<Tensor> {
        let (experts, k) = (self.config.num_experts, self.config.top_k);
        let picks: Vec<usize> = choices
            .iter()
            .map(|c| c.token * experts + c.expert)
            .collect();
        let pick = |t: &Tensor| -> Result<Tensor> {
            Ok(t.reshape(&[tokens * experts, 1])?
                .embedding(&picks, &[tokens, k])?
                .reshape(&[tokens, k])?)
        };
        Ok(match self.config.softmax {
            RouterSoftmax::AfterTopK => pick(logits)?.softmax()?,
            RouterSoftmax::BeforeTopK => pick(&logits.softmax()?)?,
        })
    }

    /// Sends the kept slots' rows to their experts' ranks, runs the experts on what
    /// arrives, and brings the results back: one row per kept slot, in `kept`'s order.
    fn dispatch_and_compute(&self, tape: &Tape, flat: &Tensor, kept: &[Choice]) -> Result<Tensor> {
        let (experts, ep) = (self.config.num_experts, self.ep.size());
        let local = experts / ep;
        // Rows sorted by expert (so by destination rank), each expert's in token order.
        let mut order: Vec<usize> = (0..kept.len()).collect();
        order.sort_by_key(|&i| (kept[i].expert, i));
        let rows: Vec<usize> = order.iter().map(|&i| kept[i].token).collect();
        let mut per_expert = vec![0usize; experts];
        for c in kept {
            per_expert[c.expert] += 1;
        }
        let send: Vec<usize> = per_expert.chunks(local).map(|c| c.iter().sum()).collect();
        // Every rank learns how many rows of each of its experts each peer sends.
        let counts: Vec<i64> = per_expert.iter().map(|&n| n as i64).collect();
        let received_counts =
            self.ep
                .all_to_all_v_vec(&counts, &vec![local; ep], &vec![local; ep])?;
        let received_counts: Vec<usize> = received_counts.iter().map(|&n| n as usize).collect();
        let receive: Vec<usize> = received_counts
            .chunks(local)
            .map(|c| c.iter().sum())
            .collect();
        let outgoing = flat.embedding(&rows, &[rows.len()])?;
        let arrived = all_to_all(&outgoing, &self.ep, 0, 0, Some(&send))?;
        let results = self.run_experts(tape, &arrived, &received_counts)?;
        let back = all_to_all(&results, &self.ep, 0, 0, Some(&receive))?;
        // Back in `order`; undo the sort.
        let mut position = vec![0; kept.len()];
        for (sorted, &i) in order.iter().enumerate() {
            position[i] = sorted;
        }
        Ok(back.embedding(&position, &[kept.len()])?)
    }

    /// This rank's experts on the rows that arrived (from each source rank, its rows for
    /// each local expert in turn, `counts[source · local + expert]` of them), the results
    /// in the same order.
    fn run_experts(&self, tape: &Tape, arrived: &Tensor, counts: &[usize]) -> Result<Tensor> {
        let local = self.experts.len();
        let sources = counts.len() / local.max(1);
        // The arrived row index of every (source, expert, i).
        let mut start = vec![0; counts.len()];
        let mut offset = 0;
        for (i, &n) in counts.iter().enumerate() {
            start[i] = offset;
            offset += n;
        }
        let mut outputs = Vec::new();
        let mut produced = vec![0usize; counts.len()];
        let mut cursor = 0;
        for (l, (_, mlp)) in self.experts.iter().enumerate() {
            let rows: Vec<usize> = (0..sources)
                .flat_map(|s| {
                    let i = s * local + l;
                    start[i]..start[i] + counts[i]
                })
                .collect();
            // An expert runs even on no rows: the return trip then stays on the tape on
            // every rank alike (its backward is a collective), and an expert without
            // tokens gets a zero gradient, as Megatron's do, not none.
            let input = arrived.embedding(&rows, &[rows.len(), 1])?;
            let out = mlp
                .forward(tape, &input)?
                .reshape(&[rows.len(), self.hidden])?;
            for s in 0..sources {
                produced[s * local + l] = cursor;
                cursor += counts[s * local + l];
            }
            outputs.push(out);
        }
        let all = Tensor::concat(&outputs.iter().collect::<Vec<_>>(), 0)?;
        // From expert order back to arrival order.
        let back: Vec<usize> = (0..counts.len())
            .flat_map(|i| produced[i]..produced[i] + counts[i])
            .collect();
        Ok(all.embedding(&back, &[back.len()])?)
    }

    /// The load-balancing loss (Megatron's `switch_load_balancing_loss_func`:
    /// `coeff · E / (T² · k) · Σₑ (Σₜ pₜₑ) · countₑ`, the probabilities a softmax over every
    /// expert) plus the z-loss (`coeff · meanₜ logsumexp(logitsₜ)²`), over this rank's
    /// tokens.
    fn aux_loss(&self, logits: &Tensor, counts: &[usize], tokens: usize) -> Result<Tensor> {
        if tokens == 0 {
            // No token, no load to balance: zero, on the tape like the rest.
            return Ok(logits.sum()?.scale(0.0)?);
        }
        let (experts, k) = (self.config.num_experts, self.config.top_k);
        let device = logits.device();
        let counts = Tensor::from_vec(counts.iter().map(|&c| c as f32).collect(), &[experts])?
            .to_device(device)?;
        let scale = self.config.aux_loss_coeff * experts as f64 / ((tokens * tokens * k) as f64);
        let balance = logits
            .softmax()?
            .sum_dim(0, false)?
            .mul(&counts)?
            .sum()?
            .scale(scale)?;
        if self.config.z_loss_coeff == 0.0 {
            return Ok(balance);
        }
        let max = logits.max_dim(1, true)?;
        let lse = logits
            .sub(&max)?
            .exp()?
            .sum_dim(1, true)?
            .log()?
            .add(&max)?;
        let z = lse.mul(&lse)?.mean()?.scale(self.config.z_loss_coeff)?;
        Ok(balance.add(&z)?)
    }
}

/// The identity on a block's output whose backward also seeds the auxiliary loss with
/// `scale`, so that the loss reaches the router wherever the block sits in a pipeline.
struct AttachAuxLoss {
    scale: f64,
}

impl CustomOp for AttachAuxLoss {
    fn name(&self) -> &str {
        "attach auxiliary loss"
    }

    fn forward(
        &self,
        inputs: &[Tensor],
        saved: &mut Vec<Tensor>,
    ) -> ferrotron_tape::Result<Tensor> {
        saved.push(inputs[1].clone());
        Ok(inputs[0].clone())
    }

    fn backward(
        &self,
        grad: &Tensor,
        saved: &[Tensor],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor>>> {
        let aux = &saved[0];
        let seed =
            Tensor::<f32>::full_as(aux.shape(), self.scale as f32, aux.dtype(), aux.device())?;
        Ok(vec![Some(grad.clone()), Some(seed)])
    }
}

impl Module for MoeMlp {
    fn parameters(&self) -> Vec<ShardedParameter> {
        let mut params = self.router_parameters();
        params.extend(self.expert_parameters());
        params
    }
}
