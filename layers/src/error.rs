//! The crate's error type: bad shapes, ids, configurations and checkpoints are typed
//! errors naming what is wrong, never panics.

use std::path::PathBuf;

/// Result alias used by every fallible function in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in a layer, a loss or a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An input tensor does not have the shape the layer expects.
    #[error("{op}: input of shape {shape:?} does not fit: expected {expected}")]
    Shape {
        /// The layer or function.
        op: &'static str,
        /// The shape it was given.
        shape: Vec<usize>,
        /// What it expects, in words.
        expected: String,
    },
    /// A token id is not in the vocabulary.
    #[error("{op}: token id {id} is out of range for a vocabulary of {vocab_size}")]
    IdOutOfRange {
        /// The layer.
        op: &'static str,
        /// The offending id.
        id: usize,
        /// Size of the (whole, unsharded) vocabulary.
        vocab_size: usize,
    },
    /// A label is neither a class of the vocabulary nor the ignore index.
    #[error("{op}: label {label} is out of range for a vocabulary of {vocab_size} (and is not the ignore index)")]
    LabelOutOfRange {
        /// The loss.
        op: &'static str,
        /// The offending label.
        label: i64,
        /// Size of the (whole, unsharded) vocabulary.
        vocab_size: usize,
    },
    /// A size that must be split evenly is not divisible by the number of parts.
    #[error("{op}: {what} = {value} is not divisible by {parts}")]
    NotDivisible {
        /// The layer.
        op: &'static str,
        /// Which size (e.g. "attention heads").
        what: &'static str,
        /// Its value.
        value: usize,
        /// What it must be divisible by (e.g. the tensor-parallel size).
        parts: usize,
    },
    /// A configuration value is invalid (zero sizes, probabilities outside `[0, 1]`,
    /// incompatible switches).
    #[error("{op}: invalid configuration: {reason}")]
    Config {
        /// The layer or function.
        op: &'static str,
        /// What is wrong and what would be right.
        reason: String,
    },
    /// A random stream was given a seed that another stream of the tracker already uses,
    /// so the two would draw the same numbers.
    #[error("{op}: seed {seed} already exists (stream '{stream}' uses it); give each stream its own seed")]
    DuplicateSeed {
        /// The function.
        op: &'static str,
        /// The seed asked for.
        seed: u64,
        /// The stream that already has it.
        stream: String,
    },
    /// A saved [`RngState`](crate::RngState) does not fit the tracker it is restored
    /// into (streams missing or extra, other seeds, malformed generator words).
    #[error("RngTracker::restore: {reason}")]
    RngStateMismatch {
        /// What differs, naming the stream.
        reason: String,
    },
    /// A checkpoint file is missing, malformed, or does not match the model.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("checkpoint {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// A collective failed (mismatched calls, a lost peer, a timeout).
    #[error(transparent)]
    Comm(#[from] ferrotron_comm_core::Error),
    /// A tensor operation failed.
    #[error(transparent)]
    Tape(#[from] ferrotron_tape::Error),
    /// A differentiable collective failed.
    #[error(transparent)]
    Mappings(#[from] ferrotron_mappings::Error),
    /// A parallel layout or group was invalid.
    #[error(transparent)]
    ParallelState(#[from] ferrotron_parallel_state::Error),
}

impl Error {
    pub(crate) fn shape(op: &'static str, shape: &[usize], expected: impl Into<String>) -> Self {
        Error::Shape {
            op,
            shape: shape.to_vec(),
            expected: expected.into(),
        }
    }

    pub(crate) fn config(op: &'static str, reason: impl Into<String>) -> Self {
        Error::Config {
            op,
            reason: reason.into(),
        }
    }

    pub(crate) fn checkpoint(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Checkpoint {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
