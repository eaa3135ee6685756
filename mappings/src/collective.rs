//! The non-differentiable steps a mapping runs in its forward or backward pass: each one
//! collective (or none) over a group, on a whole tensor, returning a new tensor.

use ferrotron_comm_core::{Communicator, ReduceOp};
use ferrotron_tape::Tensor;

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
    /// Runs the step on `x`; `op` names the mapping in errors. Collectives read `x`'s own
    /// memory and write the result's (see `Tensor::lend`), on `x`'s device.
    pub(crate) fn run<T: Scalar>(
        &self,
        op: &'static str,
        x: &Tensor<T>,
        group: &dyn Communicator,
    ) -> Result<Tensor<T>> {
        let comm = |e| Error::from_comm(op, e);
        let rank = group.rank();
        // The packing below is part of the collective, not of the model's graph.
        let x = &x.detach();
        let device = x.device();
        match self {
            Collective::Identity => Ok(x.clone()),
            Collective::AllReduce => {
                x.updated_by(|buf| group.all_reduce(buf, ReduceOp::Sum).map_err(comm))
            }
            Collective::Gather(Partition { dim, sizes }) => {
                let layout = layout_with(op, x.shape(), *dim, sizes[rank])?;
                let counts = layout.counts(sizes);
                let blocks = Tensor::filled_by(device, x.dtype(), &[counts.iter().sum()], |out| {
                    x.lend(|mine| group.all_gather_v(mine, out, &counts))?
                        .map_err(comm)
                })?;
                let shape = with_len(x.shape(), *dim, sizes.iter().sum());
                unpack_rank_blocks(&blocks, &shape, *dim, sizes)
            }
            Collective::KeepOwn(Partition { dim, sizes }) => {
                layout_with(op, x.shape(), *dim, sizes.iter().sum())?;
                Ok(x.narrow(*dim, offsets(sizes)[rank], sizes[rank])?)
            }
            Collective::ReduceScatter(Partition { dim, sizes }) => {
                let layout = layout_with(op, x.shape(), *dim, sizes.iter().sum())?;
                let counts = layout.counts(sizes);
                let blocks = pack_rank_blocks(x, *dim, sizes)?;
                let shape = with_len(x.shape(), *dim, sizes[rank]);
                Tensor::filled_by(device, x.dtype(), &shape, |mine| {
                    blocks
                        .lend(|all| group.reduce_scatter_v(all, mine, &counts, ReduceOp::Sum))?
                        .map_err(comm)
                })
            }
            Collective::AllToAll(exchange) => {
                let Exchange {
                    scatter_dim,
                    gather_dim,
                    send_sizes,
                    recv_sizes,
                } = exchange;
                let sending = layout_with(op, x.shape(), *scatter_dim, send_sizes.iter().sum())?;
                let blocks = pack_rank_blocks(x, *scatter_dim, send_sizes)?;
                // Every received part has this rank's part shape except along gather_dim.
                let part = with_len(x.shape(), *scatter_dim, send_sizes[rank]);
                let shape = with_len(&part, *gather_dim, recv_sizes.iter().sum());
                let receiving = DimLayout::new(op, &shape, *gather_dim)?;
                let (sends, recvs) = (sending.counts(send_sizes), receiving.counts(recv_sizes));
                let received =
                    Tensor::filled_by(device, x.dtype(), &[recvs.iter().sum()], |out| {
                        blocks
                            .lend(|input| group.all_to_all_v(input, &sends, out, &recvs))?
                            .map_err(comm)
                    })?;
                unpack_rank_blocks(&received, &shape, *gather_dim, recv_sizes)
            }
        }
    }
}

/// `x` (`sizes.sum()` long along `dim`) as one flat tensor of contiguous per-rank blocks
/// in rank order, what the `_v` collectives move; on `x`'s device.
fn pack_rank_blocks<T: Scalar>(x: &Tensor<T>, dim: usize, sizes: &[usize]) -> Result<Tensor<T>> {
    let flat = |t: Tensor<T>| t.reshape(&[t.numel()]);
    if x.shape()[..dim].iter().all(|&d| d == 1) {
        // Along the first (non-trivial) dimension the parts already are the blocks.
        return Ok(flat(x.clone())?);
    }
    let blocks = x
        .split(sizes, dim)?
        .into_iter()
        .map(flat)
        .collect::<ferrotron_tape::Result<Vec<_>>>()?;
    Ok(Tensor::concat(&blocks.iter().collect::<Vec<_>>(), 0)?)
}

/// The inverse of [`pack_rank_blocks`]: per-rank blocks joined along `dim` into `shape`.
fn unpack_rank_blocks<T: Scalar>(
    blocks: &Tensor<T>,
    shape: &[usize],
    dim: usize,
    sizes: &[usize],
) -> Result<Tensor<T>> {
    if shape[..dim].iter().all(|&d| d == 1) {
        return Ok(blocks.reshape(shape)?);
    }
    let layout = DimLayout::new("unpack_rank_blocks", shape, dim)?;
    let parts = blocks
        .split(&layout.counts(sizes), 0)?
        .into_iter()
        .zip(sizes)
        .map(|(block, &size)| block.reshape(&with_len(shape, dim, size)))
        .collect::<ferrotron_tape::Result<Vec<_>>>()?;
    Ok(Tensor::concat(&parts.iter().collect::<Vec<_>>(), dim)?)
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

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_tape::Device;

    #[test]
    fn blocks_round_trip_along_a_middle_dimension_on_every_device() -> Result<()> {
        for device in [Device::Cpu, Device::Emulated] {
            // Shape [2, 3, 2] split along dim 1 as [2, 1], and as [3, 0] (an empty part).
            let x = Tensor::<f32>::from_vec((0..12).map(|i| i as f32).collect(), &[2, 3, 2])?
                .to_device(device)?;
            let blocks = pack_rank_blocks(&x, 1, &[2, 1])?;
            assert_eq!(blocks.device(), device);
            assert_eq!(
                blocks.to_vec()?,
                [0., 1., 2., 3., 6., 7., 8., 9., 4., 5., 10., 11.]
            );
            let back = unpack_rank_blocks(&blocks, &[2, 3, 2], 1, &[2, 1])?;
            assert_eq!((back.shape(), back.to_vec()?), (x.shape(), x.to_vec()?));
            let blocks = pack_rank_blocks(&x, 1, &[3, 0])?;
            assert_eq!(blocks.to_vec()?, x.to_vec()?);
            let back = unpack_rank_blocks(&blocks, &[2, 3, 2], 1, &[3, 0])?;
            assert_eq!(back.to_vec()?, x.to_vec()?);
        }
        Ok(())
    }
}
