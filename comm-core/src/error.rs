//! The typed errors every backend returns.

pub use crate::call::{CallSignature, OpKind};
use crate::dtype::{DType, ReduceOp};
use crate::flight_record::FlightRecord;
use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every way a collective can fail. Each variant says what went wrong and, through its
/// `Display`, what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Ranks of one group issued different collectives at the same sequence number.
    #[error(
        "collective mismatch in group '{group}' at call #{seq}: ranks disagree on what to do:\n  {}\n\
         every rank of a group must issue the same collectives (op, dtype, count, root) in the same order",
        calls.iter().map(|c| c.to_string()).collect::<Vec<_>>().join("\n  ")
    )]
    Mismatch {
        /// Group name.
        group: String,
        /// Sequence number of the call within the group (0-based).
        seq: u64,
        /// What each rank asked for, by group rank.
        calls: Vec<CallSignature>,
    },

    /// Some ranks did not reach a collective within the timeout.
    #[error(
        "timeout in group '{group}': {op} (call #{seq}) waited {waited:?} and ranks {missing:?} \
         (world ranks {missing_world:?}) never arrived; they are stuck elsewhere or issue \
         collectives in a different order. Raise the limit with FERROTRON_TIMEOUT_SECS or \
         the backend's timeout setting if they are merely slow{}",
        history.summary()
    )]
    Timeout {
        /// Group name.
        group: String,
        /// The collective that timed out.
        op: OpKind,
        /// Sequence number of the call within the group.
        seq: u64,
        /// Group ranks that never arrived.
        missing: Vec<usize>,
        /// The same ranks as world ranks.
        missing_world: Vec<usize>,
        /// How long this rank waited.
        waited: Duration,
        /// The flight recorder's recent calls: every rank's on the local backend, this
        /// rank's (and the file it was written to) on NCCL; empty when the recorder is
        /// off.
        history: Box<FlightRecord>,
    },

    /// A peer failed (error, panic) or dropped its communicator, so this call can never
    /// complete.
    #[error(
        "peer lost in group '{group}': rank {rank} (world rank {world_rank}) failed or dropped \
         its communicator, so {op} (call #{seq}) cannot complete; look for that rank's own \
         error, which is the root cause{}",
        history.summary()
    )]
    PeerLost {
        /// Group name.
        group: String,
        /// The collective that could not complete.
        op: OpKind,
        /// Sequence number of the call within the group.
        seq: u64,
        /// Group rank of the lost peer.
        rank: usize,
        /// World rank of the lost peer.
        world_rank: usize,
        /// The flight recorder's recent calls of every rank (local backend); empty when
        /// the recorder is off.
        history: Box<FlightRecord>,
    },

    /// A call failed because a [`FaultInjector`](crate::FaultInjector) armed it to, as
    /// a broken link fails one: the group is broken, and its other ranks' calls fail
    /// with [`PeerLost`](Error::PeerLost) naming this rank.
    #[error(
        "injected failure in group '{group}': {op} (call #{seq}) of rank {rank} (world rank \
         {world_rank}) failed as a broken link fails it, because a fault injector armed it \
         (FERROTRON_FAIL_COLLECTIVE in train-gpt); unset it to train normally"
    )]
    Injected {
        /// Group name.
        group: String,
        /// The call that failed.
        op: OpKind,
        /// Its sequence number among this rank's calls of that kind in the group.
        seq: u64,
        /// Group rank that failed.
        rank: usize,
        /// The same rank in the world.
        world_rank: usize,
    },

    /// A previous failure (timeout, lost peer) left this group unusable.
    #[error(
        "group '{group}' is broken by an earlier failure ({cause}); create new communicators \
         after recovering"
    )]
    Broken {
        /// Group name.
        group: String,
        /// The failure that broke the group.
        cause: String,
    },

    /// A buffer has the wrong length or type for the call; detected before communicating.
    #[error("invalid buffer for {op} in group '{group}': {detail}")]
    InvalidBuffer {
        /// The collective.
        op: OpKind,
        /// Group name.
        group: String,
        /// What is wrong and what would be right.
        detail: String,
    },

    /// An argument other than a buffer is invalid (root or peer out of range, wrong
    /// number of per-rank counts, ...); detected before communicating.
    #[error("invalid argument for {op} in group '{group}': {detail}")]
    InvalidArgument {
        /// The collective.
        op: OpKind,
        /// Group name.
        group: String,
        /// What is wrong and what would be right.
        detail: String,
    },

    /// The reduction operator is not defined for the dtype.
    #[error("{reduce} is not defined for {dtype} in {op}: {hint}")]
    Unsupported {
        /// The collective.
        op: OpKind,
        /// The reduction operator.
        reduce: ReduceOp,
        /// The element type.
        dtype: DType,
        /// What to use instead.
        hint: &'static str,
    },

    /// An owned buffer was asked for as the wrong element type.
    #[error("buffer holds {found} elements, not {expected}")]
    WrongDType {
        /// The type asked for.
        expected: DType,
        /// The type the buffer holds.
        found: DType,
    },

    /// A host vector was asked of a [`Buffer`](crate::Buffer) that holds lent memory.
    #[error(
        "the buffer holds lent {memory} memory, not a host vector; read it through its \
         owner (the tensor or bucket that lent it)"
    )]
    LentBuffer {
        /// Where the lent memory lives.
        memory: crate::Device,
    },

    /// A rank of `run_local` returned an error or panicked.
    #[error(
        "rank {rank} failed: {source}{}",
        streams.as_ref().map_or(String::new(), |s| format!("; its device streams failed too: {s}"))
    )]
    RankFailed {
        /// The world rank.
        rank: usize,
        /// Its error (a panic becomes a message error).
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
        /// What its device streams reported as the rank ended, if they failed as well
        /// (an unordered access the emulated device's checker found on the way out).
        streams: Option<String>,
    },

    /// Invalid configuration of a backend or launcher (zero ranks, bad environment
    /// variable, ...).
    #[error("invalid configuration: {0}")]
    Config(String),

    /// The MPI library failed or is unusable.
    #[error("MPI: {0}")]
    Mpi(String),

    /// A CUDA library could not be loaded (libraries are found at run time); the device
    /// layer's message.
    #[error("{}", ferrotron_device::Error::LibraryMissing { library, purpose, hint })]
    LibraryMissing {
        /// The library's file name, as searched for.
        library: &'static str,
        /// What needed it.
        purpose: &'static str,
        /// Library-specific advice (may be empty).
        hint: &'static str,
    },

    /// The CUDA driver is loaded but there is no device with the requested ordinal; the
    /// device layer's message.
    #[error("{}", ferrotron_device::Error::NoDevice { requested: *requested, available: *available })]
    NoDevice {
        /// The ordinal asked for.
        requested: usize,
        /// How many devices the driver reports.
        available: usize,
    },

    /// Emulated device memory accessed out of the order a GPU guarantees: the device
    /// layer's ordering checker found two accesses, at least one a write, that nothing
    /// orders (its message names both and the memory).
    #[error("{0}")]
    Unordered(ferrotron_device::Error),

    /// A CUDA driver or NVRTC call failed; `message` is CUDA's own.
    #[error("CUDA {call} failed: {message}")]
    Cuda {
        /// The call (or step) that failed.
        call: String,
        /// CUDA's error name and description.
        message: String,
    },

    /// An NCCL call failed; `message` is NCCL's own.
    #[error("NCCL {call} failed in group '{group}': {message}")]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// Group name.
        group: String,
        /// NCCL's error string and last-error detail.
        message: String,
    },
}

impl Error {
    /// The comm-core error behind a `RankFailed`, or `self`; handy when asserting on the
    /// root cause a launcher reports.
    pub fn root_cause(&self) -> &Error {
        match self {
            Error::RankFailed { source, .. } => source
                .downcast_ref::<Error>()
                .map(Error::root_cause)
                .unwrap_or(self),
            other => other,
        }
    }
}

/// What a caught panic said (its `&str` or `String` payload), for the error that reports
/// it: a rank thread of the local backend, a communicator's progress thread.
pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_string())
}

/// A device failure as a collective reports it: missing libraries and devices keep their
/// own variants, a failed driver call is [`Error::Cuda`], the rest a configuration error
/// with the device layer's message.
impl From<ferrotron_device::Error> for Error {
    fn from(error: ferrotron_device::Error) -> Error {
        match error {
            ferrotron_device::Error::LibraryMissing {
                library,
                purpose,
                hint,
            } => Error::LibraryMissing {
                library,
                purpose,
                hint,
            },
            ferrotron_device::Error::NoDevice {
                requested,
                available,
            } => Error::NoDevice {
                requested,
                available,
            },
            ferrotron_device::Error::Driver { call, message } => Error::Cuda { call, message },
            unordered @ ferrotron_device::Error::Unordered { .. } => Error::Unordered(unordered),
            other => Error::Config(other.to_string()),
        }
    }
}
