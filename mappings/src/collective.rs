//! The non-differentiable steps a mapping runs in its forward or backward pass: each one
//! collective (or none) over a group, on a whole tensor, returning a new tensor.

use comm_core::{Communicator, CommunicatorExt, ReduceOp};
use tape::Tensor;

use crate::error::{Error, Result};
use crate::split::{offsets, DimLayout};
use crate::Scalar;

/// How the group's ranks divide one dimension: rank `r` holds `sizes[r]` elements of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Partition {
    pub(crate) dim: usize,
    pub(crate) sizes: Vec<usize>,
}

/// The plan of one all-to-all, agreed on by every rank before it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Exchange {
    /// This rank's tensor is cut along `scatter_dim`; part `r` goes to rank `r`.
    pub(crate) scatter_dim: usize,
    /// Received parts are joined along `gather_dim`, in rank order.
    pub(crate) gather_dim: usize,
    /// Length along `scatter_dim` of the part sent to each rank.
    pub(crate) send_sizes: Vec<usize>,
    /// Length along `gather_dim` of the part received from each rank.
    pub(crate) recv_sizes: Vec<usize>,
}

impl Exchange {
    /// The exchange that sends every part back where it came from.
    pub(crate) fn inverse(&self) -> Exchange {
        Exchange {
            scatter_dim: self.gather_dim,
            gather_dim: self.scatter_dim,
            send_sizes: self.recv_sizes.clone(),
            recv_sizes: self.send_sizes.clone(),
        }
    }
}

/// One step of a mapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Collective {
    /// Passes the tensor through.
    Identity,
    /// Sums the tensor over the group.
    AllReduce,
    /// Concatenates every rank's part along the dimension.
    Gather(Partition),
    /// Keeps this rank's part of a whole tensor; no communication.
    KeepOwn(Partition),
    /// Sums whole tensors over the group and keeps this rank's part.
    ReduceScatter(Partition),
    /// Personalised exchange of parts.
    AllToAll(Exchange),
}

impl Collective {
    /// Runs the step on `x`; `op` names the mapping in errors.
    pub(crate) fn run<T: Scalar>(
        &self,
        op: &'static str,
        x: &Tensor<T>,
        group: &dyn Communicator,
    ) -> Result<Tensor<T>> {
        let comm = |e| Error::from_comm(op, e);
        let rank = group.rank();
        // Device tensors are exchanged through host memory (the communicator sees host
        // slices); the result goes back to the input's device.
        let on_input_device = |t: Tensor<T>| t.to_device(x.device()).map_err(Error::from);
        let moved = match self {
            Collective::Identity => Ok(x.clone()),
            Collective::AllReduce => {
                let mut data = x.to_vec()?;
                group
                    .all_reduce_slice(&mut data, ReduceOp::Sum)
                    .map_err(comm)?;
                Ok(Tensor::from_vec(data, x.shape())?)
            }
            Collective::Gather(Partition { dim, sizes }) => {
                let layout = layout_with(op, x.shape(), *dim, sizes[rank])?;
                let blocks = group
                    .all_gather_v_vec(&x.to_vec()?, &layout.counts(sizes))
                    .map_err(comm)?;
                let shape = with_len(x.shape(), *dim, sizes.iter().sum());
                Ok(Tensor::from_vec(
                    layout.unpack_rank_blocks(blocks, sizes),
                    &shape,
                )?)
            }
            Collective::KeepOwn(Partition { dim, sizes }) => {
                layout_with(op, x.shape(), *dim, sizes.iter().sum())?;
                Ok(x.narrow(*dim, offsets(sizes)[rank], sizes[rank])?)
            }
            Collective::ReduceScatter(Partition { dim, sizes }) => {
                let layout = layout_with(op, x.shape(), *dim, sizes.iter().sum())?;
                let blocks = layout.pack_rank_blocks(x.to_vec()?, sizes);
                let mine = group
                    .reduce_scatter_v_vec(&blocks, &layout.counts(sizes), ReduceOp::Sum)
                    .map_err(comm)?;
                Ok(Tensor::from_vec(
                    mine,
                    &with_len(x.shape(), *dim, sizes[rank]),
                )?)
            }
            Collective::AllToAll(exchange) => {
                let Exchange {
                    scatter_dim,
                    gather_dim,
                    send_sizes,
                    recv_sizes,
                } = exchange;
                let sending = layout_with(op, x.shape(), *scatter_dim, send_sizes.iter().sum())?;
                let blocks = sending.pack_rank_blocks(x.to_vec()?, send_sizes);
                // Every received part has this rank's part shape except along gather_dim.
                let part = with_len(x.shape(), *scatter_dim, send_sizes[rank]);
                let shape = with_len(&part, *gather_dim, recv_sizes.iter().sum());
                let receiving = DimLayout::new(op, &shape, *gather_dim)?;
                let received = group
                    .all_to_all_v_vec(
                        &blocks,
                        &sending.counts(send_sizes),
                        &receiving.counts(recv_sizes),
                    )
                    .map_err(comm)?;
                Ok(Tensor::from_vec(
                    receiving.unpack_rank_blocks(received, recv_sizes),
                    &shape,
                )?)
            }
        };
        moved.and_then(on_input_device)
    }
}

/// `shape` with dimension `dim` set to `len` (unchanged if there is no such dimension;
/// callers check `dim` with [`DimLayout::new`]).
pub(crate) fn with_len(shape: &[usize], dim: usize, len: usize) -> Vec<usize> {
    let mut shape = shape.to_vec();
    if let Some(d) = shape.get_mut(dim) {
        *d = len;
    }
    shape
}

/// The layout of `shape` around `dim`, after checking that the dimension is `len` long
/// (a plan made for one shape must not run on another).
fn layout_with(op: &'static str, shape: &[usize], dim: usize, len: usize) -> Result<DimLayout> {
    let layout = DimLayout::new(op, shape, dim)?;
    if shape[dim] == len {
        Ok(layout)
    } else {
        Err(Error::InvalidSizes {
            op,
            sizes: vec![shape[dim]],
            reason: format!("dimension {dim} of shape {shape:?} should be {len} long here"),
        })
    }
}
