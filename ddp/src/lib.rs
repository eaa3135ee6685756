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
//! use ferrotron_comm_core::run_local;
//! use ferrotron_ddp::{DdpConfig, DistributedDataParallel};
//! use std::sync::Arc;
//! use ferrotron_tape::{Optimizer, Parameter, Sgd, SgdConfig, Tape, Tensor};
//!
//! let weights = run_local(2, |comm| -> ferrotron_ddp::Result<Vec<f32>> {
//!     // Ranks start from different values: construction broadcasts rank 0's.
//!     let w = Parameter::new("w", Tensor::full(&[2, 1], ferrotron_comm_core::Communicator::rank(&comm) as f32));
//!     let ddp = DistributedDataParallel::new(vec![w.clone()], Arc::new(comm), DdpConfig::default())?;
//!     let mut sgd = Sgd::new(vec![w.clone()], SgdConfig::new(0.1))?;
//!
//!     // This rank's half of the batch.
//!     let rank = ddp.communicator().rank() as f32;
//!     let x = Tensor::from_vec(vec![1.0 + rank, 2.0], &[1, 2])?;
//!     let tape = Tape::new();
//!     let loss = x.matmul(&tape.watch(&w)?)?.mean()?;
//!     sgd.zero_grad();
//!     ddp.backward(&loss)?; // backward + bucketed all-reduce
//!     sgd.step()?;
//!     Ok(w.value()?.to_vec()?)
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
//! # use ferrotron_comm_core::run_local;
//! # use ferrotron_ddp::{DdpConfig, DistributedDataParallel};
//! # use std::sync::Arc;
//! # use ferrotron_tape::{Parameter, Tape, Tensor};
//! let grads = run_local(2, |comm| -> ferrotron_ddp::Result<Vec<f32>> {
//!     let w = Parameter::new("w", Tensor::ones(&[3]));
//!     let ddp = DistributedDataParallel::new(vec![w.clone()], Arc::new(comm), DdpConfig::default())?;
//!     let tape = Tape::new();
//!     for micro_batch in 0..4 {
//!         let loss = tape.watch(&w)?.scale(micro_batch as f64)?.sum()?;
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
//! [`AllReduceAvg`] (default), [`CompressedAllReduce`] (bf16/fp16: half the traffic, at
//! the cost of a half-size copy of each bucket while it is in flight), or your own
//! [`CommHook`].
//!
//! # Model-parallel groups
//! Some gradients must also be summed over a model-parallel group after the
//! data-parallel average (Megatron's `finalize_model_grads`): sequence-parallel layer
//! norms and row-parallel biases over `"tp"`, tied embeddings over `"embedding"`.
//! [`DistributedDataParallel::for_model`] takes a `layers` model and derives these
//! reductions from its parameters' own
//! [`grad_reduce_group`](ferrotron_layers::ShardedParameter::grad_reduce_group), so nothing needs
//! marking by hand:
//! ```
//! use ferrotron_comm_core::run_local;
//! use ferrotron_ddp::{DdpConfig, DistributedDataParallel};
//! use ferrotron_layers::{LayerNorm, MasterInit, Module, TensorParallel};
//! use ferrotron_parallel_state::{ParallelState, RankLayout};
//! use std::sync::Arc;
//! use ferrotron_tape::{Generator, Tape, Tensor};
//!
//! // TP = 2 × DP = 2 with sequence parallelism: each rank normalises 2 of its
//! // replica's 4 sequence positions.
//! let layout = RankLayout::builder(4).tp(2).build()?;
//! let grads = run_local(4, |comm| -> Result<Vec<f32>, Box<dyn std::error::Error + Send + Sync>> {
//!     let state = ParallelState::new(Arc::new(comm), layout.clone())?;
//!     let tp = TensorParallel::from_state(&state).with_sequence_parallel(true);
//!     let ln = LayerNorm::new(&tp, "ln", 3, 1e-5, &MasterInit::new(1, 0.1))?;
//!     let ddp = DistributedDataParallel::for_model(&ln, &state, DdpConfig::default())?;
//!
//!     // This rank's [sequence part, batch, hidden] = [2, 1, 3].
//!     let x = Tensor::randn(&[2, 1, 3], 1.0, &mut Generator::new(state.rank() as u64));
//!     ddp.backward(&ln.forward(&Tape::new(), &x)?.sum()?)?;
//!     let bias = ln.parameters()[1].param.clone();
//!     Ok(bias.grad().expect("a gradient").to_vec()?)
//! })?;
//! // d(Σ output)/d bias counts positions: 2 per rank, summed over the TP pair to the
//! // replica's 4 (the serial model's), the same on both DP replicas.
//! assert!(grads.iter().all(|g| g == &vec![4.0; 3]));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//! For parameters the model does not mark (tied embeddings across pipeline stages), add
//! marks to a [`NamedGroupReduction`] and pass it as [`DdpConfig::extra_reductions`]
//! (see its docs); [`DistributedDataParallel::new`] takes plain parameters and only
//! those marks.
//!
//! # How it works
//! * [`bucket`](BucketInfo) layout — parameters in reverse registration order, a small
//!   first bucket, then buckets up to a byte cap; identical on every rank of the
//!   data-parallel group (which holds the same shapes), but not across a
//!   tensor-parallel group, whose ranks hold shards of different sizes when a dimension
//!   does not divide evenly.
//! * `reducer` — grad-ready hooks mark their parameter ready and start a bucket's
//!   non-blocking all-reduce once it is complete and every earlier bucket has started;
//!   `finish` waits for them in order and runs the hook's post-processing.
//! * extra reductions — then `finish` runs, per named group in registry order, one f32
//!   SUM all-reduce of the group's marked gradients, coalesced in registration order, on
//!   their device (after a small host all-reduce of which members have one). They never
//!   depend on the bucket layout, so every member of a group issues the same collectives
//!   with the same counts.
//! * `init` — the construction-time shape check and broadcast from DP rank 0.
//!
//! **Gradient buffer.** Each bucket is one allocation ([`ferrotron_tape::FlatStorage`]) on the
//! parameters' device, and the parameters' gradients are views into it
//! ([`ferrotron_tape::Parameter::attach_main_grad`]): backward accumulates into the bucket, the
//! all-reduce runs on it in place (it holds a lease on the storage until it completes),
//! and the averages are then the parameters' gradients, with no copy either way. The
//! buckets together are one flat gradient index space (see
//! [`BucketInfo::flat_offset`]); each is its own allocation so that a reduction in flight
//! locks only its own. Their total, [`buffer_bytes`](DistributedDataParallel::buffer_bytes),
//! is exactly the gradient size. Sharded, each bucket is reduce-scattered from its
//! storage into a shard on the same device, which the optimizer steps there. A 16-bit
//! comm hook sends a rounded copy of each bucket, made on its device, and the average is
//! widened back into the bucket (or, sharded, into the shard).
//!
//! # Cargo features
//! None is on by default.
//! * `mpi`: the MPI test binary (enables `ferrotron-comm-core/mpi`).
//! * `cuda`: CUDA tensors and NCCL in the benchmarks (enables `ferrotron-tape/cuda` and
//!   `ferrotron-comm-core/cuda`).
#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod bucket;
mod config;
mod ddp;
mod error;
mod hook;
mod init;
mod named;
mod optimizer;
mod reducer;

pub use bucket::{BucketInfo, BucketParam, SHARD_ALIGNMENT};
pub use config::{DdpConfig, DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_BYTES};
pub use ddp::{DistributedDataParallel, NoSync, SyncProgress};
pub use error::{Error, Result, ShapeMismatch};
pub use hook::{AllReduceAvg, CommHook, CompressedAllReduce, ReducedBucket};
pub use named::NamedGroupReduction;
pub use optimizer::DistributedOptimizer;
