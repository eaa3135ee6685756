//! Bucketed, backward-overlapped data-parallel gradient sync for ferrotron — PyTorch's
//! `DistributedDataParallel` reducer, with Megatron-Core's extra reductions for
//! parameters shared across model-parallel groups.
//!
//! # Training with DDP
//! Every data-parallel rank builds the same model, wraps its parameters in a
//! [`DistributedDataParallel`] over the data-parallel communicator, and trains on its
//! own slice of the batch. After [`DistributedDataParallel::backward`] every rank holds
//! the gradient averaged over all ranks, so the optimizer steps stay identical — the same
//! parameters as one rank training on the whole batch.
//! ```
//! use comm_core::run_local;
//! use ddp::{DdpConfig, DistributedDataParallel};
//! use std::sync::Arc;
//! use tape::{Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor};
//!
//! let weights = run_local(2, |comm| -> ddp::Result<Vec<f32>> {
//!     // Ranks start from different values: construction broadcasts rank 0's.
//!     let w = Parameter::new("w", Tensor::full(&[2, 1], comm_core::Communicator::rank(&comm) as f32));
//!     let ddp = DistributedDataParallel::new(vec![w.clone()], Arc::new(comm), DdpConfig::default())?;
//!     let mut sgd = Sgd::new(vec![w.clone()], SgdConfig::new(0.1));
//!
//!     // This rank's half of the batch.
//!     let rank = ddp.communicator().rank() as f32;
//!     let x = Tensor::from_vec(vec![1.0 + rank, 2.0], &[1, 2])?;
//!     let tape = Tape::new();
//!     let loss = x.matmul(&tape.watch(&w))?.mean()?;
//!     sgd.zero_grad();
//!     ddp.backward(&loss)?; // backward + bucketed all-reduce
//!     sgd.step()?;
//!     Ok(w.value().to_vec()?)
//! })?;
//! // d(loss)/dw averaged over the two rows [1, 2] and [2, 2] is [1.5, 2].
//! assert_eq!(weights[0], vec![-0.15, -0.2]);
//! assert_eq!(weights[0], weights[1]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Gradient accumulation
//! Inside [`no_sync`](DistributedDataParallel::no_sync) backward passes only accumulate;
//! the last micro-batch, outside it, reduces the accumulated gradient once.
//! ```
//! # use comm_core::run_local;
//! # use ddp::{DdpConfig, DistributedDataParallel};
//! # use std::sync::Arc;
//! # use tape::{Parameter, Tape, Tensor};
//! let grads = run_local(2, |comm| -> ddp::Result<Vec<f32>> {
//!     let w = Parameter::new("w", Tensor::ones(&[3]));
//!     let ddp = DistributedDataParallel::new(vec![w.clone()], Arc::new(comm), DdpConfig::default())?;
//!     let tape = Tape::new();
//!     for micro_batch in 0..4 {
//!         let loss = tape.watch(&w).scale(micro_batch as f64)?.sum()?;
//!         if micro_batch < 3 {
//!             let _accumulate = ddp.no_sync();
//!             ddp.backward(&loss)?;
//!         } else {
//!             ddp.backward(&loss)?;
//!         }
//!     }
//!     Ok(w.grad().map(|g| g.to_vec()).transpose()?.unwrap_or_default())
//! })?;
//! assert_eq!(grads[0], vec![6.0; 3]); // 0 + 1 + 2 + 3, averaged over identical ranks
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Comm hooks
//! [`DdpConfig::comm_hook`] chooses how buckets travel over the data-parallel group:
//! [`AllReduceAvg`] (default), [`CompressedAllReduce`] (bf16/fp16 buckets, half the
//! memory and traffic), or your own [`CommHook`].
//!
//! # Model-parallel groups
//! Some gradients must also be summed over a model-parallel group after the
//! data-parallel average (Megatron's `finalize_model_grads`): sequence-parallel layer
//! norms over `"tp"`, tied embeddings over `"embedding"`. Mark them in a
//! [`NamedGroupReduction`] and pass it as [`DdpConfig::extra_reductions`] (see its docs
//! for an example).
//!
//! # How it works
//! * [`bucket`](BucketInfo) layout — parameters in reverse registration order, a small
//!   first bucket, then buckets up to a byte cap; identical on every rank of the
//!   data-parallel group (which holds the same shapes), but not across a
//!   tensor-parallel group, whose ranks hold shards of different sizes when a dimension
//!   does not divide evenly.
//! * `reducer` — grad-ready hooks copy each gradient into its bucket (rounded to the hook's
//!   wire dtype) and start a bucket's non-blocking all-reduce once it is complete and
//!   every earlier bucket has started; `finish` waits for them in order, runs the hook's
//!   post-processing and writes the averages back into the parameters.
//! * extra reductions — then `finish` runs, per named group in registry order, one f32
//!   SUM all-reduce of the group's marked gradients, coalesced in registration order.
//!   They never depend on the bucket layout, so every member of a group issues the same
//!   collectives with the same counts.
//! * `init` — the construction-time shape check and broadcast from DP rank 0.
//!
//! **Gradient buffer.** tape's gradients are separate tensors, so buckets do not alias
//! them: gradients are *copied* into the buckets at hook time and the reduced values are
//! written back in `finish`. The buckets together are one flat per-dtype gradient index
//! space (see [`BucketInfo::flat_offset`]), but each bucket is its own allocation,
//! because a non-blocking all-reduce takes ownership of its buffer until it completes.
//! They are allocated once and reused every step; their total,
//! [`buffer_bytes`](DistributedDataParallel::buffer_bytes), is exactly the gradient size
//! (half of it with a 16-bit hook), plus one parameter's gradient transiently while it
//! is copied.
#![warn(missing_docs)]

mod bucket;
mod config;
mod ddp;
mod error;
mod hook;
mod init;
mod named;
mod reducer;

pub use bucket::{BucketInfo, BucketParam};
pub use config::{DdpConfig, DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
pub use ddp::{DistributedDataParallel, NoSync, SyncProgress};
pub use error::{Error, Result, ShapeMismatch};
pub use hook::{AllReduceAvg, CommHook, CompressedAllReduce, ReducedBucket};
pub use named::NamedGroupReduction;
