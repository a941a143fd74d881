//! The one error type of the command-line tool.

/// What a `teraio` command can fail with. Printed as `error: ...` with the cause chain.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// From the engine (I/O, store, migration).
    #[error(transparent)]
    Engine(#[from] teraio_engine::Error),
    /// From the scheduler (traces, planning, simulation).
    #[error(transparent)]
    Scheduler(#[from] teraio_scheduler::Error),
    /// From the layout (geometry, on-disk format).
    #[error(transparent)]
    Layout(#[from] teraio_layout::Error),
    /// Reading or writing a file named on the command line.
    #[error("{path}: {source}")]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// JSON output could not be produced.
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// A combination of options that makes no sense.
    #[error("{0}")]
    Usage(String),
}

/// Result alias of the command-line tool.
pub type Result<T, E = CliError> = std::result::Result<T, E>;
