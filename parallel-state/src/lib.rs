//! Megatron-Core rank layouts and process groups, on any ferrotron communicator.
//!
//! A world of N ranks with tensor (TP), pipeline (PP), context (CP) and expert (EP)
//! parallelism splits into groups exactly as Megatron-Core's `parallel_state` splits it
//! (its `RankGenerator` with an order string, and a second generator for expert
//! layers), so a configuration moves between the two without surprises.
//!
//! * [`RankLayout`] is the pure arithmetic: rank lists of every group family and each
//!   rank's coordinates, with no communication.
//! * [`ParallelState`] splits a world [`Communicator`](ferrotron_comm_core::Communicator) into one
//!   communicator per group, and keeps a registry of groups by name.
//!
//! # A layout
//! Megatron's docstring example: 16 ranks with TP = 2 and PP = 4 leave DP = 2. With the
//! default order `"tp-cp-ep-dp-pp"` the leftmost axis varies fastest, so TP groups are
//! neighbours and pipeline stages are 4 ranks apart.
//! ```
//! use ferrotron_parallel_state::{Coordinates, GroupKind, RankLayout};
//!
//! let layout = RankLayout::builder(16).tp(2).pp(4).build()?;
//! assert_eq!(layout.dp(), 2);
//! assert_eq!(layout.groups(GroupKind::Pp)[0], vec![0, 4, 8, 12]);
//! assert_eq!(layout.groups(GroupKind::Dp)[..2], [vec![0, 2], vec![1, 3]]);
//! // Embeddings live on the first and last stages of every pipeline.
//! assert_eq!(layout.groups(GroupKind::Embedding)[0], vec![0, 12]);
//!
//! // One rank's view costs O(group size), whatever the world size.
//! assert_eq!(layout.coordinates(13)?, Coordinates { tp: 1, cp: 0, dp: 0, pp: 3 });
//! assert_eq!(layout.group_of(GroupKind::TpPp, 13)?, Some(vec![0, 1, 4, 5, 8, 9, 12, 13]));
//! assert_eq!(layout.next_pipeline_rank(13)?, 1); // the last stage wraps to the first
//! # Ok::<(), ferrotron_parallel_state::Error>(())
//! ```
//!
//! # Invalid configurations
//! Errors say what is wrong and what would be valid:
//! ```
//! use ferrotron_parallel_state::{Error, RankLayout};
//!
//! let err = RankLayout::builder(12).tp(8).build().unwrap_err();
//! assert!(matches!(err, Error::NotDivisible { world: 12, product: 8, .. }));
//! assert!(err.to_string().contains("1, 2, 3, 4, 6, 12"));
//!
//! let err = RankLayout::builder(8).cp(2).order("tp-dp-pp".parse()?).build().unwrap_err();
//! assert!(matches!(err, Error::MissingOrderAxis { axis: "cp", .. }));
//! # Ok::<(), ferrotron_parallel_state::Error>(())
//! ```
//!
//! # Process groups
//! [`ParallelState::new`] is collective over the world. Here eight local ranks (threads)
//! with TP = 2, PP = 2 sum their world ranks over their TP group: group `[6, 7]` gets 13.
//! ```
//! use ferrotron_comm_core::{run_local, CommunicatorExt, ReduceOp};
//! use ferrotron_parallel_state::{ParallelState, RankLayout};
//! use std::sync::Arc;
//!
//! let layout = RankLayout::builder(8).tp(2).pp(2).build()?;
//! let sums = run_local(8, |comm| {
//!     let state = ParallelState::new(Arc::new(comm), layout.clone())?;
//!     let mut x = [state.rank() as f64];
//!     state.tp().all_reduce_slice(&mut x, ReduceOp::Sum)?;
//!     Ok::<_, ferrotron_parallel_state::Error>(x[0])
//! })?;
//! assert_eq!(sums, vec![1.0, 1.0, 5.0, 5.0, 9.0, 9.0, 13.0, 13.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Named groups
//! Code written against named groups (DDP's extra reductions, which sum some parameters'
//! gradients over `"tp"` or `"tp-cp"` after the `"dp"` average) looks them up by name;
//! user-defined rank lists join the registry with [`ParallelState::add_group`], also
//! collective.
//! ```
//! use ferrotron_comm_core::run_local;
//! use ferrotron_parallel_state::{ParallelState, RankLayout};
//! use std::sync::Arc;
//!
//! let layout = RankLayout::builder(4).tp(2).build()?;
//! let sizes = run_local(4, |comm| {
//!     let mut state = ParallelState::new(Arc::new(comm), layout.clone())?;
//!     state.add_group("evens", &[0, 2])?;
//!     let evens = state.size_named("evens").ok();
//!     Ok::<_, ferrotron_parallel_state::Error>((state.size_named("tp-cp")?, evens))
//! })?;
//! assert_eq!(sizes, vec![(2, Some(2)), (2, None), (2, Some(2)), (2, None)]);
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

mod check;
mod error;
mod grid;
mod layout;
mod order;
mod state;

pub use check::check_group_sums;
pub use error::{Error, Result};
pub use layout::{
    Coordinates, ExpertCoordinates, GroupKind, LayoutBuilder, Membership, RankLayout, Stage,
};
pub use order::{Axis, Order};
pub use state::ParallelState;
