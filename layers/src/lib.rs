//! Tensor-parallel layers for ferrotron, exact against the serial model: Megatron-Core's
//! `tensor_parallel` layers, cross-entropy and RNG tracker, in Rust.
//!
//! * [`ColumnParallelLinear`] and [`RowParallelLinear`], with bias, `gather_output`,
//!   `input_is_parallel`, `skip_bias_add` and sequence parallelism;
//! * [`VocabParallelEmbedding`] and [`vocab_parallel_cross_entropy`] over a vocabulary
//!   divided among ranks (unevenly when needed, see [`VocabRange`]), with a per-token
//!   form over the data-parallel batch ([`vocab_parallel_cross_entropy_per_token`]);
//! * [`LayerNorm`], [`ParallelMlp`], [`ParallelSelfAttention`] and a pre-norm
//!   [`TransformerBlock`];
//! * initialisation from seeded master weights ([`MasterInit`]): any tensor-parallel size
//!   builds the same model as one rank;
//! * Megatron's RNG streams ([`RngTracker`]) and sharded safetensors checkpoints
//!   ([`checkpoint`]) convertible between tensor-parallel sizes;
//! * global gradient-norm clipping over the sharded model ([`clip_grad_norm`]).
//!
//! Every layer is built with a [`TensorParallel`] context (the tensor-parallel group and
//! the sequence-parallel switch) and runs on the [`tape`](ferrotron_tape) autograd; the collectives are
//! [`mappings`](ferrotron_mappings)' differentiable ones, so backward is exact too.
//!
//! # Two ranks compute what one rank computes
//! An MLP on two rank threads gives the serial output, because both start from the same
//! master weights:
//! ```
//! use ferrotron_comm_core::{run_local, Communicator};
//! use ferrotron_layers::{BlockConfig, MasterInit, ParallelMlp, TensorParallel};
//! use std::sync::Arc;
//! use ferrotron_tape::{Generator, Tape, Tensor};
//!
//! let config = BlockConfig::new(8, 2);
//! let init = MasterInit::new(42, 0.1);
//! let x = Tensor::randn(&[3, 2, 8], 1.0, &mut Generator::new(7));
//! let run = |tp_size: usize| {
//!     let x = x.clone();
//!     run_local(tp_size, move |comm| {
//!         let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>);
//!         let mlp = ParallelMlp::new(&tp, "mlp", &config, &init)?;
//!         let y = mlp.forward(&Tape::new(), &x)?;
//!         Ok::<_, ferrotron_layers::Error>(y.to_vec()?)
//!     })
//! };
//! let (serial, parallel) = (run(1)?, run(2)?);
//! for (a, b) in serial[0].iter().zip(&parallel[1]) {
//!     assert!((a - b).abs() < 1e-5);
//! }
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Training step with a vocabulary-parallel loss
//! Embedding → block → logits from a column-parallel layer (no gather) → cross-entropy
//! over the vocabulary shards; 3 ranks share a vocabulary of 10 as 4 + 3 + 3 ids.
//! ```
//! use ferrotron_comm_core::{run_local, Communicator};
//! use ferrotron_layers::{
//!     vocab_parallel_cross_entropy, BlockConfig, ColumnParallelLinear, LinearOptions,
//!     MasterInit, RngTracker, TensorParallel, TransformerBlock, VocabParallelEmbedding,
//! };
//! use std::sync::Arc;
//! use ferrotron_tape::{CrossEntropyOptions, Tape};
//!
//! let losses = run_local(3, |comm| {
//!     let tp = TensorParallel::new(Arc::new(comm) as Arc<dyn Communicator>);
//!     let init = MasterInit::new(1, 0.2);
//!     let config = BlockConfig::new(6, 3);
//!     let embed = VocabParallelEmbedding::new(&tp, "embed", 10, 6, &init)?;
//!     let block = TransformerBlock::new(&tp, "block0", &config, &init)?;
//!     let head = ColumnParallelLinear::new(&tp, "head", 6, 10, false, LinearOptions::default(), &init)?;
//!     let mut rng = RngTracker::new(1234, tp.rank());
//!     let tape = Tape::new();
//!     // ids are [sequence, batch] = [4, 1]; labels are the next tokens.
//!     let hidden = embed.forward(&tape, &[1, 5, 9, 2], &[4, 1])?;
//!     let hidden = block.forward(&tape, &hidden, &mut rng)?;
//!     let logits = head.forward(&tape, &hidden)?.output;
//!     let loss = vocab_parallel_cross_entropy(
//!         &logits, &[5, 9, 2, 3], tp.group(), 10, &CrossEntropyOptions::default())?;
//!     loss.backward()?;
//!     Ok::<_, ferrotron_layers::Error>(loss.item()?)
//! })?;
//! assert!(losses.iter().all(|&l| (l - losses[0]).abs() < 1e-6 && l > 0.0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Sequence parallelism and its extra gradient reduction
//! With [`TensorParallel::with_sequence_parallel`], activations outside the
//! tensor-parallel regions hold this rank's part of the sequence (the first dimension).
//! Layer norms and row-parallel biases then see only that part, so their gradients must
//! be summed over the tensor-parallel group after backward: they are the parameters whose
//! [`ShardedParameter::grad_reduce_group`] is `Some("tp")`. `ddp`'s
//! `DistributedDataParallel::for_model` turns these into its extra reductions, run after
//! the data-parallel average; without DDP, [`all_reduce_sequence_parallel_grads`] does it
//! by hand.
//!
//! # Uneven splits
//! Sizes the group does not divide (vocabulary, MLP width, sequence) are split by
//! [`ferrotron_mappings::split_sizes`]: the first `len % size` ranks get one more. Attention heads
//! must divide evenly ([`Error::NotDivisible`]).
//!
//! # Cargo features
//! None: the crate builds and runs as it is.
#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod attention_core;
pub mod checkpoint;
mod clip;
mod config;
mod context_parallel;
mod cross_entropy;
mod embedding;
mod error;
mod init;
mod linear;
mod mlp;
mod moe;
mod parallel;
mod random;
mod recompute;
mod scaler;
mod transformer;

pub use clip::{clip_grad_norm, reduce_grad_norm, GradNorm, LocalSquares};
pub use config::BlockConfig;
pub use context_parallel::{
    context_parallel_batch, context_parallel_chunks, context_parallel_position, ring_attention,
    ring_blocks, RingBlock,
};
pub use cross_entropy::{
    vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_per_token, TokenLoss,
};
pub use embedding::{VocabParallelEmbedding, VocabRange};
pub use error::{Error, Result};
pub use init::MasterInit;
pub use linear::{ColumnParallelLinear, LinearOptions, LinearOutput, RowParallelLinear};
pub use mlp::ParallelMlp;
pub use moe::{MoeConfig, MoeMlp, MoeOutput, MoeStats, RouterSoftmax};
pub use parallel::{
    all_reduce_sequence_parallel_grads, part_of, ExpertParallel, Module, ShardedParameter,
    Sharding, TensorParallel, EMBEDDING_GROUP, TP_GROUP,
};
pub use random::{
    RngState, RngStreamState, RngTracker, DEFAULT_STREAM, MODEL_PARALLEL_SEED_OFFSET,
    MODEL_PARALLEL_STREAM, PIPELINE_SEED_STRIDE,
};
pub use recompute::recompute_blocks;
pub use scaler::{all_finite, GradScaler, GradScalerConfig, GradScalerState};
pub use transformer::{LayerNorm, ParallelSelfAttention, TransformerBlock};
