//! The all-to-all mapping of context and expert parallelism: every rank cuts its tensor
//! along one dimension, sends part `r` to rank `r`, and joins what it receives along
//! another (or the same) dimension.

use std::sync::Arc;

use ferrotron_comm_core::Communicator;
use ferrotron_tape::Tensor;

use crate::collective::{Collective, Exchange};
use crate::error::{Error, Result};
use crate::mapping::{
    agree_outside, check_before_collective, dim_len, exchange_headers, split_partition, Mapping,
};
use crate::Scalar;

/// Cuts `x` along `scatter_dim` into one part per rank, sends part `r` to rank `r`, and
/// concatenates the parts received along `gather_dim` in rank order; backward runs the
/// inverse exchange (gradient parts go back where their data came from).
///
/// `splits` gives the length along `scatter_dim` of the part for each rank (adding up to
/// the dimension; a part may be empty), or [`split_sizes`](crate::split_sizes) with
/// `None`. Ranks exchange their shapes and splits first, so each learns what it receives
/// and every rank checks that the parts fit together:
///
/// * `scatter_dim == gather_dim` (expert dispatch, Megatron-Core's `all_to_all`): shapes
///   agree outside that dimension; splits may differ by rank.
/// * `scatter_dim != gather_dim` (Ulysses-style context parallelism, e.g. trading a
///   sequence split for a heads split): every rank passes the same splits, and shapes
///   agree outside `gather_dim`, along which each rank may hold a different length.
///
/// ```
/// use ferrotron_comm_core::{run_local, Communicator};
/// use ferrotron_mappings::all_to_all;
/// use std::sync::Arc;
/// use ferrotron_tape::Tensor;
///
/// // Each of 2 ranks holds its half of a sequence (dim 0) with 2 heads (dim 1);
/// // afterwards each holds the whole sequence for one head.
/// let outputs = run_local(2, |comm| {
///     let r = comm.rank() as f64;
///     let x = Tensor::<f64>::from_vec(vec![10.0 * r, 10.0 * r + 1.0], &[1, 2])?;
///     let group = Arc::new(comm) as Arc<dyn Communicator>;
///     all_to_all(&x, &group, 1, 0, None)?.to_vec().map_err(ferrotron_mappings::Error::from)
/// })?;
/// assert_eq!(outputs, vec![vec![0.0, 10.0], vec![1.0, 11.0]]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn all_to_all<T: Scalar>(
    x: &Tensor<T>,
    group: &Arc<dyn Communicator>,
    scatter_dim: usize,
    gather_dim: usize,
    splits: Option<&[usize]>,
) -> Result<Tensor<T>> {
    const OP: &str = "all_to_all";
    let (rank, parts) = (group.rank(), group.size());
    let shape = x.shape();
    let send_sizes = check_before_collective(group.as_ref(), || {
        dim_len(OP, shape, gather_dim)?;
        split_partition(OP, shape, scatter_dim, splits, parts).map(|p| p.sizes)
    })?;
    if parts == 1 {
        return Ok(x.clone());
    }

    let mut header = vec![scatter_dim, gather_dim];
    header.extend_from_slice(shape);
    header.extend_from_slice(&send_sizes);
    let rows = exchange_headers(OP, group.as_ref(), &header)?;
    let ndim = shape.len();
    let shapes: Vec<Vec<usize>> = rows.iter().map(|row| row[2..2 + ndim].to_vec()).collect();
    let all_splits: Vec<&[usize]> = rows.iter().map(|row| &row[2 + ndim..]).collect();
    let mismatch = |reason: String| Error::ShapeMismatch {
        op: OP,
        group: group.name().to_string(),
        shapes: shapes.clone(),
        reason,
    };
    if rows
        .iter()
        .any(|row| row[0] != scatter_dim || row[1] != gather_dim)
    {
        let dims: Vec<(usize, usize)> = rows.iter().map(|row| (row[0], row[1])).collect();
        return Err(mismatch(format!(
            "ranks pass different (scatter_dim, gather_dim) pairs {dims:?}"
        )));
    }
    let recv_sizes = if scatter_dim == gather_dim {
        if !agree_outside(&shapes, &[scatter_dim]) {
            return Err(mismatch(format!(
                "shapes must agree in every dimension except {scatter_dim}"
            )));
        }
        all_splits.iter().map(|splits| splits[rank]).collect()
    } else {
        if all_splits
            .iter()
            .any(|splits| *splits != send_sizes.as_slice())
        {
            return Err(mismatch(format!(
                "with scatter_dim {scatter_dim} != gather_dim {gather_dim} every rank must \
                 pass the same splits, but they pass {all_splits:?}"
            )));
        }
        if !agree_outside(&shapes, &[gather_dim]) {
            return Err(mismatch(format!(
                "shapes must agree in every dimension except gather_dim {gather_dim}"
            )));
        }
        shapes.iter().map(|shape| shape[gather_dim]).collect()
    };
    let exchange = Exchange {
        scatter_dim,
        gather_dim,
        send_sizes,
        recv_sizes,
    };
    Mapping {
        name: OP,
        group: group.clone(),
        backward: Collective::AllToAll(exchange.inverse()),
        forward: Collective::AllToAll(exchange),
    }
    .apply(x)
}
