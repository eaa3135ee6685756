//! Differentiable collectives for tensor, sequence and context parallel regions.
//!
//! A *mapping* is a [`tape`](ferrotron_tape) op whose forward pass is one collective over a group
//! communicator and whose backward pass is the conjugate collective, as in Megatron-Core's
//! `tensor_parallel/mappings.py`:
//!
//! | mapping | forward | backward |
//! |---|---|---|
//! | [`copy_to_region`] | identity | all-reduce (sum) |
//! | [`reduce_from_region`] | all-reduce (sum) | identity |
//! | [`scatter_to_region`] | keep own part along `dim` | all-gather along `dim` |
//! | [`gather_from_region`] | all-gather along `dim` | keep own part |
//! | [`reduce_scatter_to_region`] | reduce-scatter along `dim` | all-gather along `dim` |
//! | [`all_gather_from_region`] | all-gather along `dim` | reduce-scatter along `dim` |
//! | [`scatter_to_sequence_parallel_region`] | keep own part along dim 0 | all-gather |
//! | [`gather_from_sequence_parallel_region`] | all-gather along dim 0 | reduce-scatter, or keep own part |
//! | [`reduce_scatter_to_sequence_parallel_region`] | reduce-scatter along dim 0 | all-gather |
//! | [`all_gather_variable`] | all-gather of per-rank lengths | keep own part, optionally summed first |
//! | [`all_to_all`] | all-to-all (cut one dim, join another) | the inverse all-to-all |
//!
//! Mappings use only the [`Communicator`](ferrotron_comm_core::Communicator) trait, so they run
//! unchanged on every backend; groups come from `parallel-state` (`state.tp()`, ...) or
//! any communicator. A group of one rank is the identity with no communication. Every
//! mapping returns a new tensor and never changes its input.
//!
//! # Uneven parts
//! Every dimension-cutting mapping takes per-rank `sizes: Option<&[usize]>`. Cutting a
//! whole tensor with `None` follows one rule, [`split_sizes`] (balanced, as
//! `torch.tensor_split`: 10 over 4 is `[3, 3, 2, 2]`); gathering with `None` exchanges
//! the lengths. So `gather ∘ scatter` is the identity for every length ≥ the group size.
//!
//! # Errors
//! Bad dims, sizes or shapes are typed [`Error`]s on every rank: checks of data every
//! rank has (exchanged shapes, per-rank counts compared by comm-core) fail everywhere at
//! once, and a rank that rejects its own arguments makes its peers fail with
//! [`Error::PeerRejected`] rather than wait. Errors in a backward pass come out of
//! `backward()` as [`ferrotron_tape::Error::Custom`] whose source is this crate's [`Error`].
//! Every rank must run backward through the same mappings in the same order, as it ran
//! forward (a rank whose input does not require grad skips the backward collective, and
//! its peers then time out).
//!
//! # Tensor parallelism, one layer
//! A two-rank row-parallel product `y = x·W`: each rank keeps half of the input features
//! ([`scatter_to_region`]) and holds the matching rows of `W`; the partial products add
//! up in [`reduce_from_region`]. Backward, the scatter gathers the two halves of the
//! input gradient, exactly as if one rank had computed the whole product.
//! ```
//! use ferrotron_comm_core::{run_local, Communicator};
//! use ferrotron_mappings::{reduce_from_region, scatter_to_region};
//! use std::sync::Arc;
//! use ferrotron_tape::{Parameter, Tape, Tensor};
//!
//! let grads = run_local(2, |comm| {
//!     let group: Arc<dyn Communicator> = Arc::new(comm);
//!     let x = Parameter::new("x", Tensor::<f64>::from_vec(vec![1.0, 2.0, 3.0, 4.0], &[1, 4])?);
//!     // This rank's two rows of W = [[1], [1], [1], [1]] · (rank + 1).
//!     let w = Tensor::full(&[2, 1], group.rank() as f64 + 1.0);
//!     let tape = Tape::new();
//!     let x_part = scatter_to_region(&tape.watch(&x)?, &group, 1, None)?;
//!     let y = reduce_from_region(&x_part.matmul(&w)?, &group)?;
//!     assert_eq!(y.to_vec()?, vec![1.0 + 2.0 + 2.0 * (3.0 + 4.0)]);
//!     y.sum()?.backward()?;
//!     Ok::<_, ferrotron_mappings::Error>(x.grad().map(|g| g.to_vec()).transpose()?)
//! })?;
//! // dy/dx = W on every rank: the scatter's backward gathered the two halves.
//! assert_eq!(grads[0], Some(vec![1.0, 1.0, 2.0, 2.0]));
//! assert_eq!(grads[0], grads[1]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Uneven gathers
//! Three ranks hold 1, 2 and 3 rows; the gather learns the lengths by itself, and its
//! backward hands each rank the gradient of its own rows.
//! ```
//! use ferrotron_comm_core::{run_local, Communicator};
//! use ferrotron_mappings::all_gather_variable;
//! use std::sync::Arc;
//! use ferrotron_tape::{Parameter, Tape, Tensor};
//!
//! let results = run_local(3, |comm| {
//!     let rows = comm.rank() + 1;
//!     let group: Arc<dyn Communicator> = Arc::new(comm);
//!     let x = Parameter::new("x", Tensor::<f64>::full(&[rows, 2], rows as f64));
//!     let tape = Tape::new();
//!     let (all, sizes) = all_gather_variable(&tape.watch(&x)?, &group, 0, None, false)?;
//!     assert_eq!(all.shape(), &[6, 2]);
//!     all.scale(2.0)?.sum()?.backward()?;
//!     Ok::<_, ferrotron_mappings::Error>((sizes, x.grad().map(|g| g.shape().to_vec())))
//! })?;
//! assert_eq!(results[2], (vec![1, 2, 3], Some(vec![3, 2])));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Cargo features
//! None is on by default.
//! * `mpi`: the MPI test binary (enables `ferrotron-comm-core/mpi`).
#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod all_to_all;
mod collective;
mod error;
mod mapping;
mod regions;
mod split;

pub use all_to_all::all_to_all;
pub use error::{Error, Result};
pub use regions::{
    all_gather_from_region, all_gather_variable, copy_to_region, copy_to_region_beside,
    gather_from_region, gather_from_sequence_parallel_region, reduce_from_region,
    reduce_scatter_to_region, reduce_scatter_to_sequence_parallel_region, scatter_to_region,
    scatter_to_sequence_parallel_region,
};
pub use split::split_sizes;

/// An element type both tensors and collectives handle: `f32` and `f64`.
pub trait Scalar: ferrotron_tape::Element + ferrotron_comm_core::Element {}

impl<T: ferrotron_tape::Element + ferrotron_comm_core::Element> Scalar for T {}
