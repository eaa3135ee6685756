//! The crate's error type: bad dims, sizes and shapes are typed errors, never panics.

/// Result alias used by every fallible function in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong in a mapping, naming the mapping and the sizes involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `dim` does not name a dimension of the tensor.
    #[error("{op}: dimension {dim} is out of range for a tensor of shape {shape:?}")]
    DimOutOfRange {
        /// The mapping.
        op: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// The tensor's shape.
        shape: Vec<usize>,
    },

    /// A dimension is shorter than the group, so the split rule cannot give every rank a
    /// non-empty part.
    #[error(
        "{op}: cannot split a dimension of {len} elements into {parts} non-empty parts; \
         make it at least as long as the group, or pass explicit per-rank sizes (which may \
         be 0)"
    )]
    TooShortToSplit {
        /// The mapping (or `split_sizes`).
        op: &'static str,
        /// Length of the dimension.
        len: usize,
        /// Number of ranks.
        parts: usize,
    },

    /// Per-rank sizes do not fit the group or the tensor.
    #[error("{op}: per-rank sizes {sizes:?} do not fit: {reason}")]
    InvalidSizes {
        /// The mapping.
        op: &'static str,
        /// The sizes given (or derived).
        sizes: Vec<usize>,
        /// What is wrong and what would be right.
        reason: String,
    },

    /// Ranks passed tensors (or dims) that cannot be combined; every rank of the group
    /// reports the same error because it is found on data every rank has exchanged.
    #[error("{op} in group '{group}': ranks passed incompatible inputs: {reason}; shapes by rank: {shapes:?}")]
    ShapeMismatch {
        /// The mapping.
        op: &'static str,
        /// Group name.
        group: String,
        /// Every rank's input shape, by group rank.
        shapes: Vec<Vec<usize>>,
        /// Which rule they break.
        reason: String,
    },

    /// Other ranks found their own arguments invalid and stopped before communicating, so
    /// this rank stopped too; their errors name the cause.
    #[error(
        "{op} in group '{group}': ranks {ranks:?} rejected their own arguments (see their \
         errors), so the collective was abandoned on every rank"
    )]
    PeerRejected {
        /// The mapping.
        op: &'static str,
        /// Group name.
        group: String,
        /// Group ranks that rejected their input.
        ranks: Vec<usize>,
    },

    /// A collective failed (mismatched calls, a lost peer, a timeout).
    #[error(transparent)]
    Comm(#[from] ferrotron_comm_core::Error),

    /// A tensor operation failed.
    #[error(transparent)]
    Tape(#[from] ferrotron_tape::Error),
}

impl Error {
    /// Turns a collective's error into this crate's, recognising the signal of a peer that
    /// rejected its arguments (it issues a barrier where the others issue `op`).
    pub(crate) fn from_comm(op: &'static str, error: ferrotron_comm_core::Error) -> Error {
        match error {
            ferrotron_comm_core::Error::Mismatch {
                ref group,
                ref calls,
                ..
            } if calls
                .iter()
                .any(|c| c.op == ferrotron_comm_core::OpKind::Barrier) =>
            {
                Error::PeerRejected {
                    op,
                    group: group.clone(),
                    ranks: calls
                        .iter()
                        .filter(|c| c.op == ferrotron_comm_core::OpKind::Barrier)
                        .map(|c| c.rank)
                        .collect(),
                }
            }
            other => Error::Comm(other),
        }
    }

    /// Recovers this crate's error from a tape error raised inside a mapping's forward
    /// (the tape wraps custom-op errors in [`ferrotron_tape::Error::Custom`]).
    pub(crate) fn from_tape(error: ferrotron_tape::Error) -> Error {
        match error {
            ferrotron_tape::Error::Custom { op, source } => match source.downcast::<Error>() {
                Ok(ours) => *ours,
                Err(source) => Error::Tape(ferrotron_tape::Error::Custom { op, source }),
            },
            other => Error::Tape(other),
        }
    }
}
