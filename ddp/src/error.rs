//! The crate's error type: every failure on user input is one of these, never a panic.

use std::fmt;

/// Result alias used by every fallible function in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong while setting up or running data-parallel gradient sync.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A collective failed (peer lost, timeout, mismatch between ranks, ...).
    #[error(transparent)]
    Comm(#[from] ferrotron_comm_core::Error),

    /// A tensor or parameter operation failed (including errors from backward).
    #[error(transparent)]
    Tape(#[from] ferrotron_tape::Error),

    /// A layers function (such as the gradient-norm reduction) failed.
    #[error(transparent)]
    Layers(#[from] ferrotron_layers::Error),

    /// A named group could not be found or joined.
    #[error(transparent)]
    ParallelState(#[from] ferrotron_parallel_state::Error),

    /// The data-parallel ranks do not hold the same parameter shapes, so their gradients
    /// cannot be averaged element by element.
    #[error(
        "parameter shapes differ across the {group_size} ranks of data-parallel group '{group}' \
         (compared with DP rank 0):\n  {}\nevery DP rank must build the same model with the \
         parameters in the same order",
        mismatches.iter().map(|m| m.to_string()).collect::<Vec<_>>().join("\n  ")
    )]
    ShapeMismatch {
        /// Name of the data-parallel communicator.
        group: String,
        /// Its size.
        group_size: usize,
        /// Every difference found, by rank.
        mismatches: Vec<ShapeMismatch>,
    },

    /// Backward ended without a gradient for some parameters, so their buckets never
    /// started and the ranks would disagree about which collectives to run.
    #[error(
        "these parameters got no gradient in this backward pass, so bucket(s) {buckets:?} \
         never started their all-reduce: {names:?}; set find_unused_parameters = true if \
         parts of the model are legitimately skipped, or make the loss depend on them"
    )]
    UnusedParameters {
        /// Names of the parameters without a gradient, in registration order.
        names: Vec<String>,
        /// Indices of the buckets that hold them.
        buckets: Vec<usize>,
    },

    /// A parameter's gradient became ready a second time before [`finish`] ended the
    /// previous sync.
    ///
    /// [`finish`]: crate::DistributedDataParallel::finish
    #[error(
        "parameter '{name}' got a second gradient before the previous one was synchronised; \
         call finish() (or DistributedDataParallel::backward) after every backward pass, or \
         wrap accumulation passes in no_sync()"
    )]
    FinishNotCalled {
        /// The parameter.
        name: String,
    },

    /// The same parameter was passed twice.
    #[error(
        "parameter '{name}' appears at positions {first} and {second}; pass each parameter once"
    )]
    DuplicateParameter {
        /// Its name.
        name: String,
        /// First position in the list.
        first: usize,
        /// Second position in the list.
        second: usize,
    },

    /// A parameter marked for an extra reduction is unusable for it.
    #[error("cannot mark parameter '{name}' for a reduction in group '{group}': {reason}")]
    InvalidMark {
        /// The parameter.
        name: String,
        /// The group.
        group: String,
        /// What is wrong.
        reason: String,
    },

    /// A configuration value is out of range.
    #[error("invalid DDP configuration: {0}")]
    Config(String),
}

/// One difference between a rank's parameters and DP rank 0's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShapeMismatch {
    /// Data-parallel rank that differs from rank 0.
    pub rank: usize,
    /// Parameter position in registration order, or `None` when the parameter counts
    /// differ.
    pub index: Option<usize>,
    /// This rank's name for the parameter at `index`.
    pub name: Option<String>,
    /// The shape (or `[count]`) on DP rank 0.
    pub expected: Vec<usize>,
    /// The shape (or `[count]`) on `rank`.
    pub found: Vec<usize>,
}

impl fmt::Display for ShapeMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.index {
            Some(index) => write!(
                f,
                "rank {}: parameter #{index} ('{}') has shape {:?}, rank 0 has {:?}",
                self.rank,
                self.name.as_deref().unwrap_or("?"),
                self.found,
                self.expected
            ),
            None => write!(
                f,
                "rank {}: {} parameters, rank 0 has {}",
                self.rank,
                self.found.first().copied().unwrap_or(0),
                self.expected.first().copied().unwrap_or(0)
            ),
        }
    }
}

impl Error {
    /// Recovers an error of this crate that a grad-ready hook passed out of `backward`
    /// wrapped in [`ferrotron_tape::Error::Custom`]; other tape errors stay tape errors.
    pub(crate) fn from_backward(error: ferrotron_tape::Error) -> Error {
        match error {
            ferrotron_tape::Error::Custom { op, source } => match source.downcast::<Error>() {
                Ok(ours) => *ours,
                Err(source) => Error::Tape(ferrotron_tape::Error::Custom { op, source }),
            },
            other => Error::Tape(other),
        }
    }
}
