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

/// A JSON file named on the command line that does not parse: the file, what it should hold,
/// and, when it ends early, that it was probably cut short (one message, no cause repeating it).
pub fn json_file(path: &std::path::Path, what: &str, e: &serde_json::Error) -> CliError {
    let hint = if e.is_eof() {
        "; the file ends early: was it cut short while being written or copied? Write it again"
    } else {
        ""
    };
    CliError::Usage(format!("{}: not a valid JSON {what}: {e}{hint}", path.display()))
}

/// [`json_file`] for a scheduler error (its JSON errors); other errors pass through.
pub fn scheduler_file(path: &std::path::Path, what: &str, e: teraio_scheduler::Error) -> CliError {
    match e {
        teraio_scheduler::Error::Json(j) => json_file(path, what, &j),
        teraio_scheduler::Error::InvalidTrace { path: at, detail }
        | teraio_scheduler::Error::InvalidPlan { path: at, detail } => {
            CliError::Usage(format!("{}: invalid {what} at {at}: {detail}", path.display()))
        }
        other => CliError::Usage(format!("{}: {other}", path.display())),
    }
}
