//! Tensor-parallel and sequence-parallel regions: the conjugate pairs of Megatron-Core's
//! `tensor_parallel/mappings.py`, along any dimension and with uneven parts.

use std::sync::Arc;

use ferrotron_comm_core::{AsyncOp, Communicator, ReduceOp};
use ferrotron_tape::{InputGradHook, PendingGrad, Tensor};

use crate::collective::Collective;
use crate::error::Result;
use crate::mapping::{check_before_collective, gather_partition, split_partition, Mapping};
use crate::Scalar;

/// Enters a parallel region: forward is the identity, backward sums the gradient over
/// `group` (all-reduce).
///
/// Use it where a replicated activation feeds rank-local computation (the input of a
/// column-parallel linear layer): each rank's gradient covers only its part of the
/// computation, so the full gradient is their sum.
pub fn copy_to_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor<T>> {
    Mapping {
        name: "copy_to_region",
        group: group.clone(),
        forward: Collective::Identity,
        backward: Collective::AllReduce,
    }
    .apply(x)
}

/// [`copy_to_region`]'s backward for a product that runs it beside its weight gradient's
/// GEMM ([`Tensor::matmul_transposed_overlapped`], Megatron's asynchronous
/// tensor-parallel all-reduce): the input gradient is summed over `group` by a
/// non-blocking all-reduce started as soon as it is computed (on a device, queued on
/// the group's communication stream) and waited for once the weight gradient is queued.
/// Use the product on `x` itself in place of [`copy_to_region`]`(x)`.
pub fn copy_to_region_beside<T: Scalar>(
    group: &Arc<dyn Communicator>,
) -> Arc<dyn InputGradHook<T>> {
    Arc::new(SumBeside(group.clone()))
}

/// The hook of [`copy_to_region_beside`].
struct SumBeside(Arc<dyn Communicator>);

impl<T: Scalar> InputGradHook<T> for SumBeside {
    fn start(&self, grad: Tensor<T>) -> ferrotron_tape::Result<PendingGrad<T>> {
        let failed = |e| ferrotron_tape::Error::custom("copy_to_region", e);
        let op = AsyncOp::AllReduce {
            buf: grad.into_buffer()?,
            op: ReduceOp::Sum,
        };
        let work = self.0.start(op).map_err(failed)?;
        Ok(Box::new(move || {
            Tensor::from_buffer(work.wait().map_err(failed)?)
        }))
    }
}

/// Leaves a parallel region: forward sums `x` over `group` (all-reduce), backward is the
/// identity.
///
/// Use it where rank-local partial results add up to a replicated one (the output of a
/// row-parallel linear layer). Every rank passes a tensor of the same shape; comm-core
/// checks that the element counts agree (shapes are not exchanged, to keep this hot path
/// at one collective).
pub fn reduce_from_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor<T>> {
    Mapping {
        name: "reduce_from_region",
        group: group.clone(),
        forward: Collective::AllReduce,
        backward: Collective::Identity,
    }
    .apply(x)
}

/// Cuts a replicated `x` along `dim` and keeps this rank's part; backward all-gathers the
/// gradient along `dim`.
///
/// Parts have the given per-rank `sizes` (one per rank, adding up to the dimension), or
/// [`split_sizes`](crate::split_sizes) with `None`. The forward pass does not
/// communicate, so only this rank's arguments are checked.
pub fn scatter_to_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    dim: usize,
    sizes: Option<&[usize]>,
) -> Result<Tensor<T>> {
    const OP: &str = "scatter_to_region";
    let partition = split_partition(OP, x.shape(), dim, sizes, group.size())?;
    Mapping {
        name: OP,
        group: group.clone(),
        forward: Collective::KeepOwn(partition.clone()),
        backward: Collective::Gather(partition),
    }
    .apply(x)
}

/// Concatenates every rank's `x` along `dim` (all-gather); backward keeps this rank's
/// part of the gradient, with no communication.
///
/// This is right when the computation after the gather is replicated (every rank
/// computes the same loss from the gathered tensor); when it is rank-local, use
/// [`all_gather_from_region`], whose backward sums the gradients.
///
/// Ranks may hold different lengths along `dim`. With `sizes: None` they are exchanged
/// (one small extra all-gather that also checks every rank's shape and `dim`); pass
/// `Some(sizes)`, the same on every rank, when they are known, e.g. from
/// [`split_sizes`](crate::split_sizes).
pub fn gather_from_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    dim: usize,
    sizes: Option<&[usize]>,
) -> Result<Tensor<T>> {
    const OP: &str = "gather_from_region";
    let partition = gather_partition(OP, group.as_ref(), x.shape(), dim, sizes)?;
    Mapping {
        name: OP,
        group: group.clone(),
        forward: Collective::Gather(partition.clone()),
        backward: Collective::KeepOwn(partition),
    }
    .apply(x)
}

/// Sums every rank's `x` and keeps this rank's part along `dim` (reduce-scatter);
/// backward all-gathers the gradient along `dim`.
///
/// Every rank passes the same shape. Parts have the given per-rank `sizes`, or
/// [`split_sizes`](crate::split_sizes) with `None`.
pub fn reduce_scatter_to_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    dim: usize,
    sizes: Option<&[usize]>,
) -> Result<Tensor<T>> {
    const OP: &str = "reduce_scatter_to_region";
    let partition = check_before_collective(group.as_ref(), || {
        split_partition(OP, x.shape(), dim, sizes, group.size())
    })?;
    Mapping {
        name: OP,
        group: group.clone(),
        forward: Collective::ReduceScatter(partition.clone()),
        backward: Collective::Gather(partition),
    }
    .apply(x)
}

/// Concatenates every rank's `x` along `dim` (all-gather); backward sums the gradient
/// over the group and keeps this rank's part (reduce-scatter).
///
/// This is right when the computation after the gather is rank-local (each rank's loss
/// covers its own share of the work, and the total loss is their sum). `sizes` is as in
/// [`gather_from_region`].
pub fn all_gather_from_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    dim: usize,
    sizes: Option<&[usize]>,
) -> Result<Tensor<T>> {
    const OP: &str = "all_gather_from_region";
    let partition = gather_partition(OP, group.as_ref(), x.shape(), dim, sizes)?;
    Mapping {
        name: OP,
        group: group.clone(),
        forward: Collective::Gather(partition.clone()),
        backward: Collective::ReduceScatter(partition),
    }
    .apply(x)
}

/// [`scatter_to_region`] along the first (sequence) dimension: each rank keeps its part
/// of the sequence; backward all-gathers the gradient.
pub fn scatter_to_sequence_parallel_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    sizes: Option<&[usize]>,
) -> Result<Tensor<T>> {
    scatter_to_region(x, group, 0, sizes)
}

/// All-gathers the sequence parts along the first dimension; backward depends on what
/// follows, as in Megatron-Core:
///
/// * `tensor_parallel_output_grad = true`: the gathered tensor feeds tensor-parallel
///   computation (a column-parallel layer), whose ranks each produce a partial gradient;
///   backward sums them and keeps this rank's part (reduce-scatter).
/// * `false`: the computation after the gather is replicated, so the gradient is already
///   complete; backward keeps this rank's part (no communication).
///
/// `sizes` is as in [`gather_from_region`].
pub fn gather_from_sequence_parallel_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    tensor_parallel_output_grad: bool,
    sizes: Option<&[usize]>,
) -> Result<Tensor<T>> {
    const OP: &str = "gather_from_sequence_parallel_region";
    let partition = gather_partition(OP, group.as_ref(), x.shape(), 0, sizes)?;
    let backward = if tensor_parallel_output_grad {
        Collective::ReduceScatter(partition.clone())
    } else {
        Collective::KeepOwn(partition.clone())
    };
    Mapping {
        name: OP,
        group: group.clone(),
        forward: Collective::Gather(partition),
        backward,
    }
    .apply(x)
}

/// [`reduce_scatter_to_region`] along the first (sequence) dimension: the partial sums of
/// a row-parallel layer are summed and each rank keeps its part of the sequence;
/// backward all-gathers the gradient.
pub fn reduce_scatter_to_sequence_parallel_region<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    sizes: Option<&[usize]>,
) -> Result<Tensor<T>> {
    reduce_scatter_to_region(x, group, 0, sizes)
}

/// All-gathers tensors whose length along `dim` differs by rank, as seed 000's
/// `all_gather_variable_dim` autograd function; returns the gathered tensor and every
/// rank's length along `dim`.
///
/// With `sizes: None` the lengths are exchanged first. Backward cuts the gradient by
/// those lengths and keeps this rank's part; with `all_reduce_grads` it first sums the
/// gradient over the group (done as one reduce-scatter, which equals all-reduce then
/// slice). So `all_reduce_grads = false` is [`gather_from_region`] and `true` is
/// [`all_gather_from_region`]; see their docs for which loss each one fits.
pub fn all_gather_variable<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    dim: usize,
    sizes: Option<&[usize]>,
    all_reduce_grads: bool,
) -> Result<(Tensor<T>, Vec<usize>)> {
    const OP: &str = "all_gather_variable";
    let partition = gather_partition(OP, group.as_ref(), x.shape(), dim, sizes)?;
    let backward = if all_reduce_grads {
        Collective::ReduceScatter(partition.clone())
    } else {
        Collective::KeepOwn(partition.clone())
    };
    let sizes = partition.sizes.clone();
    let gathered = Mapping {
        name: OP,
        group: group.clone(),
        forward: Collective::Gather(partition),
        backward,
    }
    .apply(x)?;
    Ok((gathered, sizes))
}
