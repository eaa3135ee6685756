//! A mapping is a tape op whose forward is one [`Collective`] and whose backward is its
//! conjugate; this module builds and checks the plans both passes run.

use std::sync::Arc;

use ferrotron_comm_core::{Communicator, CommunicatorExt};
use ferrotron_tape::{CustomOp, Tensor};

use crate::collective::{Collective, Partition};
use crate::error::{Error, Result};
use crate::split::split_sizes_for;
use crate::Scalar;

/// A differentiable collective, ready to apply.
pub(crate) struct Mapping {
    pub(crate) name: &'static str,
    pub(crate) group: Arc<dyn Communicator>,
    pub(crate) forward: Collective,
    pub(crate) backward: Collective,
}

impl Mapping {
    /// Records the mapping on `x`'s tape and runs its forward step. A group of one rank
    /// is the identity: every plan is then the identity, so nothing is recorded or sent.
    pub(crate) fn apply<T: Scalar>(self, x: &Tensor<T>) -> Result<Tensor<T>> {
        if self.group.size() == 1 {
            return Ok(x.clone());
        }
        Tensor::apply(Arc::new(self), &[x]).map_err(Error::from_tape)
    }
}

impl<T: Scalar> CustomOp<T> for Mapping {
    fn name(&self) -> &str {
        self.name
    }

    fn forward(
        &self,
        inputs: &[Tensor<T>],
        _saved: &mut Vec<Tensor<T>>,
    ) -> ferrotron_tape::Result<Tensor<T>> {
        let x = inputs
            .first()
            .ok_or_else(|| ferrotron_tape::Error::custom(self.name, "a mapping takes one input"))?;
        self.forward
            .run(self.name, x, self.group.as_ref())
            .map_err(|e| ferrotron_tape::Error::custom(self.name, e))
    }

    fn backward(
        &self,
        grad_output: &Tensor<T>,
        _saved: &[Tensor<T>],
    ) -> ferrotron_tape::Result<Vec<Option<Tensor<T>>>> {
        let grad = self
            .backward
            .run(self.name, grad_output, self.group.as_ref())
            .map_err(|e| ferrotron_tape::Error::custom(self.name, e))?;
        Ok(vec![Some(grad)])
    }
}

/// Runs `checks` of this rank's own arguments before a mapping's first collective.
///
/// Arguments can be wrong on some ranks only (a tensor of another rank count, a size list
/// of another length). A rank whose checks fail issues a barrier in place of the
/// collective: that mismatches the peers' call, so they fail at once with
/// [`Error::PeerRejected`] instead of waiting for a call that never comes.
pub(crate) fn check_before_collective<R>(
    group: &dyn Communicator,
    checks: impl FnOnce() -> Result<R>,
) -> Result<R> {
    checks().inspect_err(|_| {
        if group.size() > 1 {
            // This rank's own error is the one to report; the barrier only tells the peers.
            let _ = group.barrier();
        }
    })
}

/// Checks that explicit per-rank sizes have one entry per rank and cover `len`.
fn check_sizes(op: &'static str, sizes: &[usize], parts: usize, len: usize) -> Result<()> {
    let reason = if sizes.len() != parts {
        format!("the group has {parts} ranks; pass one size per rank")
    } else if sizes.iter().sum::<usize>() != len {
        format!("they must add up to the dimension's length {len}")
    } else {
        return Ok(());
    };
    Err(Error::InvalidSizes {
        op,
        sizes: sizes.to_vec(),
        reason,
    })
}

/// The length of dimension `dim` of `shape`.
pub(crate) fn dim_len(op: &'static str, shape: &[usize], dim: usize) -> Result<usize> {
    shape.get(dim).copied().ok_or_else(|| Error::DimOutOfRange {
        op,
        dim,
        shape: shape.to_vec(),
    })
}

/// How a whole tensor is cut among the group along `dim`: the given per-rank sizes, or
/// [`split_sizes`](crate::split_sizes).
pub(crate) fn split_partition(
    op: &'static str,
    shape: &[usize],
    dim: usize,
    sizes: Option<&[usize]>,
    parts: usize,
) -> Result<Partition> {
    let len = dim_len(op, shape, dim)?;
    let sizes = match sizes {
        Some(sizes) => {
            check_sizes(op, sizes, parts, len)?;
            sizes.to_vec()
        }
        None => split_sizes_for(op, len, parts)?,
    };
    Ok(Partition { dim, sizes })
}

/// How the ranks' parts join along `dim`: the given per-rank sizes (this rank's own is
/// checked against `shape`; comm-core checks that every rank passes the same element
/// counts), or sizes exchanged with the peers, which also checks every rank's full shape
/// and `dim`.
pub(crate) fn gather_partition(
    op: &'static str,
    group: &dyn Communicator,
    shape: &[usize],
    dim: usize,
    sizes: Option<&[usize]>,
) -> Result<Partition> {
    let (rank, parts) = (group.rank(), group.size());
    let own = check_before_collective(group, || {
        let own = dim_len(op, shape, dim)?;
        if let Some(sizes) = sizes {
            if sizes.len() != parts || sizes[rank] != own {
                return Err(Error::InvalidSizes {
                    op,
                    sizes: sizes.to_vec(),
                    reason: format!(
                        "the group has {parts} ranks and rank {rank} holds {own} elements \
                         along dimension {dim} of shape {shape:?}; pass one size per rank, \
                         this rank's matching its tensor"
                    ),
                });
            }
        }
        Ok(own)
    })?;
    if let Some(sizes) = sizes {
        return Ok(Partition {
            dim,
            sizes: sizes.to_vec(),
        });
    }
    if parts == 1 {
        return Ok(Partition {
            dim,
            sizes: vec![own],
        });
    }
    let mut header = vec![dim];
    header.extend_from_slice(shape);
    let rows = exchange_headers(op, group, &header)?;
    let dims: Vec<usize> = rows.iter().map(|row| row[0]).collect();
    let shapes: Vec<Vec<usize>> = rows.iter().map(|row| row[1..].to_vec()).collect();
    let mismatch = |reason: String| Error::ShapeMismatch {
        op,
        group: group.name().to_string(),
        shapes: shapes.clone(),
        reason,
    };
    if dims.iter().any(|&d| d != dim) {
        return Err(mismatch(format!(
            "ranks gather along different dimensions {dims:?}"
        )));
    }
    if !agree_outside(&shapes, &[dim]) {
        return Err(mismatch(format!(
            "shapes must agree in every dimension except {dim}"
        )));
    }
    Ok(Partition {
        dim,
        sizes: shapes.iter().map(|s| s[dim]).collect(),
    })
}

/// Whether all `shapes` agree in every dimension not listed in `except`.
pub(crate) fn agree_outside(shapes: &[Vec<usize>], except: &[usize]) -> bool {
    shapes.iter().all(|shape| {
        shapes.first().is_some_and(|first| {
            shape.len() == first.len()
                && shape
                    .iter()
                    .zip(first)
                    .enumerate()
                    .all(|(d, (a, b))| except.contains(&d) || a == b)
        })
    })
}

/// All-gathers every rank's `header` (small integers: dims, shapes, sizes) and returns
/// one row per rank. Headers of different lengths (tensors of different rank) are a
/// count mismatch, which comm-core reports on every rank.
pub(crate) fn exchange_headers(
    op: &'static str,
    group: &dyn Communicator,
    header: &[usize],
) -> Result<Vec<Vec<usize>>> {
    let encoded: Vec<i64> = header.iter().map(|&v| v as i64).collect();
    let gathered = group
        .all_gather_vec(&encoded)
        .map_err(|e| Error::from_comm(op, e))?;
    Ok(gathered
        .chunks(header.len().max(1))
        .map(|row| row.iter().map(|&v| v as usize).collect())
        .collect())
}
