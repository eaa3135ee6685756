//! Typed errors: each names the file and says what is wrong with it.

use std::path::PathBuf;

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What can go wrong reading, writing or sampling a dataset.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// The file is not an indexed dataset's index, or not one this reader knows.
    #[error("{path}: {what}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong (a bad magic number, an unknown version or token type).
        what: String,
    },
    /// The file ends before what its index says it holds.
    #[error("{path} is truncated: {what} needs {needed} bytes but the file has {found}")]
    Truncated {
        /// The file.
        path: PathBuf,
        /// What lies beyond the end.
        what: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes there.
        found: u64,
    },
    /// A request or a configuration that cannot be met, with what would be valid.
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, what: impl Into<String>) -> Error {
        Error::Format {
            path: path.into(),
            what: what.into(),
        }
    }
}
