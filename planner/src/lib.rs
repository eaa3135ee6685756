//! Memory you can predict before a run: each pipeline stage's peak bytes per rank, by
//! category, for a model and a layout, with what each rank sends per step; and the
//! layouts of a world that fit a memory budget.
//!
//! The prediction follows what ferrotron keeps (the tape's saved operands, the schedules'
//! microbatches in flight, the optimizer's state and padding), not a generic formula, and
//! `train-gpt --plan` checks it against the peak a run measures. [`megatron::estimate`]
//! restates Megatron-LM's formula for the same configuration, to set beside it.
//!
//! # A prediction
//! A 4-layer GPT at TP 2 × PP 2 × DP 2 in bf16 with the distributed optimizer:
//! ```
//! use ferrotron_pipeline::Schedule;
//! use ferrotron_planner::{predict, traffic, Layout, Model, Recompute, Target};
//!
//! let model = Model::gpt(4, 256, 8, 1024, 128);
//! let layout = Layout {
//!     tp: 2,
//!     pp: 2,
//!     dp: 2,
//!     schedule: Schedule::OneFOneB,
//!     microbatches: 4,
//!     batch: 8,
//!     element: 2,
//!     distributed_optimizer: true,
//!     sequence_parallel: true,
//!     recompute: Recompute::None,
//!     target: Target::Device,
//!     corpus_bytes: 0,
//! };
//! let stages = predict(&model, &layout)?;
//! // 1F1B: stage 0 holds two microbatches' activations, stage 1 one.
//! assert!(stages[0].activations > stages[1].activations);
//! // Each rank keeps its parameters in bf16 and its share of the f32 optimizer state.
//! let params = stages[0].parameters / 2;
//! assert!(stages[0].moments >= 8 * params / 2);
//!
//! // The same layout recomputing every block keeps less.
//! let full = Layout { recompute: Recompute::Uniform { layers: 1 }, ..layout };
//! assert!(predict(&model, &full)?[0].activations < stages[0].activations);
//!
//! // What each stage's ranks send per step; pipelines send activations both ways.
//! let sent = traffic(&model, &layout)?;
//! assert!(sent[0].pipeline > 0.0 && sent[0].data > 0.0);
//! # Ok::<(), ferrotron_planner::Error>(())
//! ```
//!
//! # Layouts that fit
//! ```
//! use ferrotron_planner::{fit, Bytes, Model, Search, Target};
//!
//! let model = Model::gpt(8, 512, 8, 1024, 256);
//! let search = Search {
//!     world: 8,
//!     budget: "64MiB".parse::<Bytes>()?.0,
//!     global_batch: 16,
//!     micro_batch: 1,
//!     max_tp: 8,
//!     element: 2,
//!     target: Target::Device,
//!     corpus_bytes: 0,
//! };
//! let found = fit(&model, &search)?;
//! assert!(found.fitting.iter().all(|c| c.peak <= search.budget));
//! assert!(found.fitting.windows(2).all(|w| w[0].traffic <= w[1].traffic));
//! # Ok::<(), ferrotron_planner::Error>(())
//! ```
//!
//! # Cargo features
//! None: the crate builds and runs as it is.
#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod bytes;
mod fit;
pub mod megatron;
mod memory;
mod traffic;

pub use bytes::Bytes;
pub use fit::{fit, Candidate, Fit, Search};
pub use memory::{predict, Breakdown, Layout, Model, Recompute, Target};
pub use traffic::{traffic, Traffic};

/// What can go wrong: a layout or search that cannot be planned, with why.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model and the layout do not go together, or a value is out of range.
    #[error("{0}")]
    Invalid(String),
    /// The schedule refuses the layout.
    #[error(transparent)]
    Schedule(#[from] ferrotron_pipeline::Error),
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;
