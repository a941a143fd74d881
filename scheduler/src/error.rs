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
    /// A plan is inconsistent with its trace; `path` names the instruction, e.g.
    /// `instructions[12]`.
    #[error("invalid plan at {path}: {detail}")]
    InvalidPlan {
        /// JSON path of the offending instruction or field.
        path: String,
        /// What is wrong with it.
        detail: String,
    },
    /// The JSON text itself could not be parsed (syntax error, wrong top-level shape).
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A parameter is out of its valid range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The simulator could not make progress for a reason other than running out of memory
    /// (which is a normal outcome reported in the simulation report).
    #[error("simulation stuck at iteration {iteration}, kernel {kernel}: {detail}")]
    SimulationStuck {
        /// Iteration (0-based) of the simulated run.
        iteration: usize,
        /// Kernel index within the iteration.
        kernel: usize,
        /// What blocks progress.
        detail: String,
    },
}

impl Error {
    pub(crate) fn trace(path: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::InvalidTrace { path: path.into(), detail: detail.into() }
    }
    pub(crate) fn plan(path: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::InvalidPlan { path: path.into(), detail: detail.into() }
    }
}

/// Result alias of the scheduler crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
