//! Column- and row-parallel linear layers (Megatron-Core's `ColumnParallelLinear` and
//! `RowParallelLinear`). Weights are stored `[out_features, in_features]`, as PyTorch's.

use std::sync::Arc;

use ferrotron_mappings::{
    copy_to_region, copy_to_region_beside, gather_from_region,
    gather_from_sequence_parallel_region, reduce_from_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_region,
};
use ferrotron_tape::{Device, InputGradHook, Tape, Tensor};

use crate::error::{Error, Result};
use crate::init::{sharded, MasterInit};
use crate::parallel::{ShardedParameter, Sharding, TensorParallel};

/// A linear layer's output; `bias` is `Some` only with `skip_bias_add`, for the caller to
/// fuse into what follows (Megatron's `(output, output_bias)` pair).
#[derive(Debug, Clone)]
pub struct LinearOutput {
    /// `x·Wᵀ`, plus the bias unless `skip_bias_add`.
    pub output: Tensor,
    /// The bias that was not added.
    pub bias: Option<Tensor>,
}

impl LinearOutput {
    /// The output with the returned bias added, as the layer would have without
    /// `skip_bias_add`.
    pub fn with_bias(self) -> Result<Tensor> {
        Ok(match self.bias {
            Some(bias) => self.output.add(&bias)?,
            None => self.output,
        })
    }
}

/// Options shared by both linear layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearOptions {
    /// Whether the layer has a bias.
    pub bias: bool,
    /// Return the bias instead of adding it.
    pub skip_bias_add: bool,
}

impl Default for LinearOptions {
    fn default() -> Self {
        LinearOptions {
            bias: true,
            skip_bias_add: false,
        }
    }
}

/// `y = x·Wᵀ + b` with `W`'s output features (rows) divided among the tensor-parallel
/// ranks.
///
/// Forward, the replicated input enters the region (identity; its gradient is summed over
/// the group in backward), or under sequence parallelism the sequence parts of the input
/// (first dimension) are all-gathered (and the input gradient reduce-scattered). Each rank
/// computes its output features; `gather_output` all-gathers them along the last
/// dimension. Output features that the group size does not divide are split by
/// [`ferrotron_mappings::split_sizes`].
#[derive(Clone)]
pub struct ColumnParallelLinear {
    tp: TensorParallel,
    in_features: usize,
    out_features: usize,
    gather_output: bool,
    skip_bias_add: bool,
    weight: ShardedParameter,
    /// Whether the weight is this layer's own (listed by `parameters`), or another
    /// module's that this layer shares ([`sharing_weight`](Self::sharing_weight)).
    owns_weight: bool,
    bias: Option<ShardedParameter>,
}

impl ColumnParallelLinear {
    /// A layer called `name` (its parameters are `name.weight`, `name.bias`), initialised
    /// from `init`'s master weights.
    pub fn new(
        tp: &TensorParallel,
        name: &str,
        in_features: usize,
        out_features: usize,
        gather_output: bool,
        options: LinearOptions,
        init: &MasterInit,
    ) -> Result<Self> {
        check_features("ColumnParallelLinear", in_features, out_features)?;
        let weight_name = format!("{name}.weight");
        let weight = sharded(
            tp,
            weight_name.clone(),
            &init.weight(&weight_name, &[out_features, in_features]),
            Sharding::Split {
                dim: 0,
                full_len: out_features,
            },
            false,
        )?;
        let bias = if options.bias {
            let bias_name = format!("{name}.bias");
            Some(sharded(
                tp,
                bias_name.clone(),
                &init.bias(&bias_name, &[out_features], 0.0)?,
                Sharding::Split {
                    dim: 0,
                    full_len: out_features,
                },
                false,
            )?)
        } else {
            None
        };
        Ok(ColumnParallelLinear {
            tp: tp.clone(),
            in_features,
            out_features,
            gather_output,
            skip_bias_add: options.skip_bias_add,
            weight,
            owns_weight: true,
            bias,
        })
    }

    /// A layer without a bias whose weight is `weight`, a parameter another module owns
    /// and lists: Megatron's output layer with `share_embeddings_and_output_weights`, where
    /// the [`VocabParallelEmbedding`](crate::VocabParallelEmbedding)'s table `[vocabulary
    /// part, hidden]` is also the head's `[output part, input]` weight. The two uses'
    /// gradients add up in the one parameter, and this layer's
    /// [`parameters`](crate::Module::parameters) leave it out, so an optimizer, DDP or a
    /// checkpoint meets it once, through its owner.
    ///
    /// `weight` must be split along its first dimension, as both layers split it.
    pub fn sharing_weight(
        tp: &TensorParallel,
        weight: &ShardedParameter,
        gather_output: bool,
    ) -> Result<Self> {
        const OP: &str = "ColumnParallelLinear::sharing_weight";
        let shape = weight.param.shape();
        let Sharding::Split { dim: 0, full_len } = weight.sharding else {
            return Err(Error::config(
                OP,
                format!(
                    "'{}' is {}; a shared weight must be split along its first dimension \
                     (split:0:<rows>), as a column-parallel layer splits its outputs",
                    weight.param.name(),
                    weight.sharding.encode()
                ),
            ));
        };
        let (_, rows) = crate::parallel::part_of(full_len, tp.rank(), tp.size())?;
        if shape.len() != 2 || shape[0] != rows {
            return Err(Error::shape(
                OP,
                &shape,
                format!("[{rows}, in_features]: this rank's part of {full_len} rows"),
            ));
        }
        check_features(OP, shape[1], full_len)?;
        Ok(ColumnParallelLinear {
            tp: tp.clone(),
            in_features: shape[1],
            out_features: full_len,
            gather_output,
            skip_bias_add: false,
            weight: weight.clone(),
            owns_weight: false,
            bias: None,
        })
    }

    /// Number of output features this rank computes.
    pub fn local_out_features(&self) -> usize {
        self.weight.param.shape()[0]
    }

    /// Applies the layer to `x` of shape `[..., in_features]` (under sequence
    /// parallelism `[sequence part, ..., in_features]`). The output is `[...,
    /// out_features]` with `gather_output`, else this rank's `[..., local out features]`.
    pub fn forward(&self, tape: &Tape, x: &Tensor) -> Result<LinearOutput> {
        const OP: &str = "ColumnParallelLinear";
        let min_dims = if self.tp.sequence_parallel() { 2 } else { 1 };
        if x.ndim() < min_dims || x.shape().last() != Some(&self.in_features) {
            return Err(Error::shape(
                OP,
                x.shape(),
                format!(
                    "[{}..., {}] (at least {min_dims} dimensions)",
                    if self.tp.sequence_parallel() {
                        "sequence part, "
                    } else {
                        ""
                    },
                    self.in_features
                ),
            ));
        }
        let group = self.tp.group();
        let weight = tape.watch(&self.weight.param)?;
        let mut output = if self.tp.sequence_parallel() {
            let input = gather_from_sequence_parallel_region(x, group, true, None)?;
            matmul_transposed(&input, &weight, None)?
        } else if group.size() > 1 && x.device() != Device::Cpu {
            // The input gradient's all-reduce runs beside the weight gradient's GEMM.
            matmul_transposed(x, &weight, Some(copy_to_region_beside(group)))?
        } else {
            matmul_transposed(&copy_to_region(x, group)?, &weight, None)?
        };
        let bias = self
            .bias
            .as_ref()
            .map(|b| tape.watch(&b.param))
            .transpose()?;
        let returned_bias = match bias {
            Some(bias) if !self.skip_bias_add => {
                output = output.add(&bias)?;
                None
            }
            other => other,
        };
        if self.gather_output {
            let sizes = ferrotron_mappings::split_sizes(self.out_features, self.tp.size())?;
            output = gather_from_region(&output, group, output.ndim() - 1, Some(&sizes))?;
        }
        Ok(LinearOutput {
            output,
            bias: returned_bias,
        })
    }
}

impl crate::Module for ColumnParallelLinear {
    /// The weight (unless it is shared: its owner lists it) and the bias.
    fn parameters(&self) -> Vec<ShardedParameter> {
        let weight = self.owns_weight.then(|| self.weight.clone());
        weight.into_iter().chain(self.bias.clone()).collect()
    }
}

/// `y = x·Wᵀ + b` with `W`'s input features (columns) divided among the tensor-parallel
/// ranks.
///
/// With `input_is_parallel` each rank receives its part of the input's last dimension
/// (the output of a column-parallel layer); otherwise the replicated input is cut here.
/// The partial products are summed over the group (all-reduce), or under sequence
/// parallelism summed and divided along the first dimension (reduce-scatter). The bias
/// is replicated and added once, after the reduction; under sequence parallelism its
/// gradient is partial per rank and is flagged for a tensor-parallel all-reduce.
#[derive(Clone)]
pub struct RowParallelLinear {
    tp: TensorParallel,
    in_features: usize,
    input_is_parallel: bool,
    skip_bias_add: bool,
    weight: ShardedParameter,
    bias: Option<ShardedParameter>,
}

impl RowParallelLinear {
    /// A layer called `name`, initialised from `init`'s master weights. Sequence
    /// parallelism needs `input_is_parallel`.
    pub fn new(
        tp: &TensorParallel,
        name: &str,
        in_features: usize,
        out_features: usize,
        input_is_parallel: bool,
        options: LinearOptions,
        init: &MasterInit,
    ) -> Result<Self> {
        const OP: &str = "RowParallelLinear";
        check_features(OP, in_features, out_features)?;
        if tp.sequence_parallel() && !input_is_parallel {
            return Err(Error::config(
                OP,
                "sequence parallelism needs input_is_parallel = true",
            ));
        }
        let weight_name = format!("{name}.weight");
        let weight = sharded(
            tp,
            weight_name.clone(),
            &init.weight(&weight_name, &[out_features, in_features]),
            Sharding::Split {
                dim: 1,
                full_len: in_features,
            },
            false,
        )?;
        let bias = if options.bias {
            let bias_name = format!("{name}.bias");
            Some(sharded(
                tp,
                bias_name.clone(),
                &init.bias(&bias_name, &[out_features], 0.0)?,
                Sharding::Replicated,
                tp.sequence_parallel(),
            )?)
        } else {
            None
        };
        Ok(RowParallelLinear {
            tp: tp.clone(),
            in_features,
            input_is_parallel,
            skip_bias_add: options.skip_bias_add,
            weight,
            bias,
        })
    }

    /// Number of input features this rank multiplies.
    pub fn local_in_features(&self) -> usize {
        self.weight.param.shape()[1]
    }

    /// Applies the layer to `x` of shape `[..., local in features]` with
    /// `input_is_parallel`, else `[..., in_features]`. The output is `[...,
    /// out_features]`, under sequence parallelism this rank's part of the first dimension.
    pub fn forward(&self, tape: &Tape, x: &Tensor) -> Result<LinearOutput> {
        const OP: &str = "RowParallelLinear";
        let expected_in = if self.input_is_parallel {
            self.local_in_features()
        } else {
            self.in_features
        };
        let min_dims = if self.tp.sequence_parallel() { 2 } else { 1 };
        if x.ndim() < min_dims || x.shape().last() != Some(&expected_in) {
            return Err(Error::shape(
                OP,
                x.shape(),
                format!("[..., {expected_in}] (at least {min_dims} dimensions)"),
            ));
        }
        let group = self.tp.group();
        let input = if self.input_is_parallel {
            x.clone()
        } else {
            let sizes = ferrotron_mappings::split_sizes(self.in_features, self.tp.size())?;
            scatter_to_region(x, group, x.ndim() - 1, Some(&sizes))?
        };
        let partial = matmul_transposed(&input, &tape.watch(&self.weight.param)?, None)?;
        let mut output = if self.tp.sequence_parallel() {
            reduce_scatter_to_sequence_parallel_region(&partial, group, None)?
        } else {
            reduce_from_region(&partial, group)?
        };
        let bias = self
            .bias
            .as_ref()
            .map(|b| tape.watch(&b.param))
            .transpose()?;
        let returned_bias = match bias {
            Some(bias) if !self.skip_bias_add => {
                output = output.add(&bias)?;
                None
            }
            other => other,
        };
        Ok(LinearOutput {
            output,
            bias: returned_bias,
        })
    }
}

impl crate::Module for RowParallelLinear {
    fn parameters(&self) -> Vec<ShardedParameter> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }
}

fn check_features(op: &'static str, in_features: usize, out_features: usize) -> Result<()> {
    if in_features == 0 || out_features == 0 {
        return Err(Error::config(
            op,
            format!("features must be positive, got in {in_features}, out {out_features}"),
        ));
    }
    Ok(())
}

/// `x·Wᵀ` for `x` of any rank ≥ 1 and `W: [out, in]`: leading dimensions are flattened
/// into rows for one GEMM, which reads `W` as stored (no transposed copy on a device).
pub(crate) fn matmul_transposed(
    x: &Tensor,
    weight: &Tensor,
    input_grad: Option<Arc<dyn InputGradHook<f32>>>,
) -> Result<Tensor> {
    let shape = x.shape().to_vec();
    let in_features = shape.last().copied().unwrap_or(0);
    let rows = x.numel().checked_div(in_features).unwrap_or(0);
    let out_features = weight.shape()[0];
    let rows = x.reshape(&[rows, in_features])?;
    let product = match input_grad {
        Some(hook) => rows.matmul_transposed_overlapped(weight, hook)?,
        None => rows.matmul_transposed(weight)?,
    };
    let mut out_shape = shape;
    if let Some(last) = out_shape.last_mut() {
        *last = out_features;
    }
    Ok(product.reshape(&out_shape)?)
}
