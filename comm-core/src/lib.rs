//! Typed, checked collectives for ferrotron: the bottom layer every other crate stands on.
//!
//! A [`Communicator`] is one rank's handle on a group of ranks. It offers the collectives
//! that tensor- and data-parallel training need (all-reduce, broadcast, all-gather with
//! equal or per-rank counts, reduce-scatter, all-to-all, send/recv, barrier), MPI-style
//! [`split`](Communicator::split) into sub-groups, and non-blocking variants that own
//! their buffers ([`Communicator::start`], [`Work`]).
//!
//! # Backends
//! * `local` (always built): ranks are threads of one process; start them with
//!   [`run_local`] or [`LocalLauncher`]. This is what tests, examples and single-machine
//!   runs use.
//! * `mpi` (cargo feature `mpi`): the system MPI through rsmpi, launched by `mpirun`; see
//!   `mpi::MpiWorld`.
//! * `nccl` (cargo feature `cuda`): NCCL over device memory, bootstrapped over an MPI or
//!   local communicator; see `nccl::NcclCommunicator`.
//!
//! # A first collective
//! Four ranks sum their rank numbers; each gets `0 + 1 + 2 + 3`:
//! ```
//! use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, ReduceOp};
//!
//! let results = run_local(4, |comm| {
//!     let mut value = [comm.rank() as f64];
//!     comm.all_reduce_slice(&mut value, ReduceOp::Sum)?;
//!     Ok::<_, ferrotron_comm_core::Error>(value[0])
//! })?;
//! assert_eq!(results, vec![6.0; 4]);
//! # Ok::<(), ferrotron_comm_core::Error>(())
//! ```
//!
//! # Sub-groups
//! `split` works like `MPI_Comm_split`: ranks with the same colour form a group, ordered
//! by key. Here even and odd ranks form two groups and gather their world ranks:
//! ```
//! use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt};
//!
//! let gathered = run_local(4, |comm| {
//!     let color = (comm.rank() % 2) as u32;
//!     // Every rank passes a colour, so every rank gets a group back.
//!     let half = comm
//!         .split(Some(color), comm.rank() as u32, "parity")?
//!         .ok_or_else(|| ferrotron_comm_core::Error::Config("this rank opted out".into()))?;
//!     half.all_gather_vec(&[comm.rank() as i32])
//! })?;
//! assert_eq!(gathered, vec![vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]);
//! # Ok::<(), ferrotron_comm_core::Error>(())
//! ```
//!
//! # Overlapping communication
//! A non-blocking call takes ownership of its buffer and gives it back from
//! [`Work::wait`]; calls on one communicator complete in the order they were issued.
//! ```
//! use ferrotron_comm_core::{run_local, CommunicatorExt, ReduceOp};
//!
//! let out = run_local(2, |comm| {
//!     let work = comm.all_reduce_async(vec![1.0f32; 8], ReduceOp::Avg)?;
//!     // ... compute something else here ...
//!     work.wait()?.into_vec::<f32>()
//! })?;
//! assert_eq!(out[0], vec![1.0; 8]);
//! # Ok::<(), ferrotron_comm_core::Error>(())
//! ```
//!
//! # Errors, not hangs
//! Ranks that disagree about a call get [`Error::Mismatch`] on every rank; a rank that
//! fails or drops its communicator makes its peers fail with [`Error::PeerLost`]; a rank
//! that never arrives produces [`Error::Timeout`] naming it.
//! ```
//! use ferrotron_comm_core::{run_local, Communicator, CommunicatorExt, Error, ReduceOp};
//!
//! let err = run_local(2, |comm| {
//!     let mut x = vec![0.0f32; 1 + comm.rank()]; // rank 1 passes a longer buffer
//!     comm.all_reduce_slice(&mut x, ReduceOp::Sum)
//! })
//! .unwrap_err();
//! assert!(matches!(err.root_cause(), Error::Mismatch { seq: 0, .. }));
//! ```
//!
//! # Cargo features
//! None is on by default.
//! * `mpi`: the MPI backend (rsmpi); needs an MPI and `libclang-dev` to build.
//! * `cuda`: device buffers and the NCCL backend; libraries loaded at run time.
//! * `cli`: the `comm-bench` binary (clap, serde_json); off by default.
#![warn(missing_docs)]

// The README's example runs as a doctest, so the package's front page cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod buffer;
mod call;
mod calls;
mod communicator;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dtype;
mod dual;
mod error;
mod flight_record;
pub mod flight_recorder;
mod kernels;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "cuda")]
pub mod nccl;
mod ordering;
#[cfg(any(feature = "mpi", feature = "cuda", test))]
mod signature;
mod work;

#[doc(hidden)]
pub use buffer::inject_missing_receive_wait;
pub use buffer::{BufMut, BufRef, Buffer, LentMemory};
pub use calls::reduce_slices;
pub use communicator::{AsyncOp, Communicator, CommunicatorExt, P2p, P2pWork};
pub use dtype::{DType, Element, ReduceOp};
pub use dual::{DeviceOpener, DualCommunicator};
pub use error::{CallSignature, Error, OpKind, Result};
pub use ferrotron_device::Device;
pub use flight_recorder::{CallRecord, CallState, FlightRecord, RankHistory};
pub use local::{local_rank_threads, run_local, FaultInjector, LocalCommunicator, LocalLauncher};
#[cfg(feature = "cuda")]
pub use nccl::{NcclCommunicator, NcclWork};
pub use work::Work;

#[doc(hidden)]
pub use half;
