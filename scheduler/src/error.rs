//! The one error type of the scheduler crate.

/// Everything the scheduler reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A trace (or plan) is malformed; `path` names the bad field, e.g. `tensors[3].bytes`.
    #[error("invalid trace at {path}: {detail}")]
    InvalidTrace {
        /// JSON path of the offending field.
        path: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A parameter is out of its valid range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Result alias of the scheduler crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
