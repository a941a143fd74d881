//! The one error type of the bindings and the stable status codes every error maps to.

/// Stable status codes: `teraio_status` in C (`TERAIO_OK`, `TERAIO_ERR_*`), `.status` of every
/// Python `TeraioError`. The numbers never change meaning; new codes are only added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// The operation has not finished yet (poll, or a wait whose timeout passed). Not an error.
    Pending = 1,
    /// A parameter is wrong: a null pointer, a size, a name, a configuration key or value.
    InvalidArgument = -1,
    /// A handle is null, was never valid, is of another kind, or was already freed.
    InvalidHandle = -2,
    /// An I/O system call failed, or moved fewer bytes than asked.
    Io = -3,
    /// The array, a memory tier or the engine's host buffers are full.
    NoSpace = -4,
    /// On-disk metadata is damaged or inconsistent.
    Corruption = -5,
    /// Data read back does not match the checksum written with it.
    ChecksumMismatch = -6,
    /// A target holds other data (a filesystem, a partition table, another array).
    OverwriteRefused = -7,
    /// No tensor with this id or name.
    UnknownTensor = -8,
    /// The operation is not valid in the current state (e.g. a prefetch of a freed tensor, an
    /// engine buffer still busy with another operation).
    InvalidState = -9,
    /// Not available on this system or build.
    Unsupported = -10,
    /// The engine was closed (use after close, double close).
    Closed = -11,
    /// A trace is malformed (the message names the JSON path).
    Trace = -12,
    /// A plan is inconsistent with its trace.
    Plan = -13,
    /// The simulator could not make progress.
    Simulation = -14,
    /// The caller's iteration left the plan; the executor runs in safe mode until re-planned.
    Diverged = -15,
    /// A GPU (CUDA driver, NVRTC, cuFile) call failed.
    Device = -16,
    /// A bug: a panic was caught at the boundary (the message says where).
    Internal = -99,
}

impl Status {
    /// Every status, in code order (success first).
    pub const ALL: [Status; 19] = [
        Status::Ok,
        Status::Pending,
        Status::InvalidArgument,
        Status::InvalidHandle,
        Status::Io,
        Status::NoSpace,
        Status::Corruption,
        Status::ChecksumMismatch,
        Status::OverwriteRefused,
        Status::UnknownTensor,
        Status::InvalidState,
        Status::Unsupported,
        Status::Closed,
        Status::Trace,
        Status::Plan,
        Status::Simulation,
        Status::Diverged,
        Status::Device,
        Status::Internal,
    ];

    /// The integer code.
    pub fn code(self) -> i32 {
        self as i32
    }

    /// The status of an integer code, if it is one.
    pub fn from_code(code: i32) -> Option<Status> {
        Self::ALL.into_iter().find(|s| s.code() == code)
    }

    /// The C constant's name without its prefix: `OK`, `ERR_NO_SPACE`, ...
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::Pending => "PENDING",
            Status::InvalidArgument => "ERR_INVALID_ARGUMENT",
            Status::InvalidHandle => "ERR_INVALID_HANDLE",
            Status::Io => "ERR_IO",
            Status::NoSpace => "ERR_NO_SPACE",
            Status::Corruption => "ERR_CORRUPTION",
            Status::ChecksumMismatch => "ERR_CHECKSUM_MISMATCH",
            Status::OverwriteRefused => "ERR_OVERWRITE_REFUSED",
            Status::UnknownTensor => "ERR_UNKNOWN_TENSOR",
            Status::InvalidState => "ERR_INVALID_STATE",
            Status::Unsupported => "ERR_UNSUPPORTED",
            Status::Closed => "ERR_CLOSED",
            Status::Trace => "ERR_TRACE",
            Status::Plan => "ERR_PLAN",
            Status::Simulation => "ERR_SIMULATION",
            Status::Diverged => "ERR_DIVERGED",
            Status::Device => "ERR_DEVICE",
            Status::Internal => "ERR_INTERNAL",
        }
    }

    /// The Python exception class of this status (in the `teraio` package).
    pub fn python_class(self) -> &'static str {
        match self {
            Status::Ok | Status::Pending => "TeraioError",
            Status::InvalidArgument => "InvalidArgumentError",
            Status::InvalidHandle => "InvalidHandleError",
            Status::Io => "IoError",
            Status::NoSpace => "NoSpaceError",
            Status::Corruption => "CorruptionError",
            Status::ChecksumMismatch => "ChecksumMismatchError",
            Status::OverwriteRefused => "OverwriteRefusedError",
            Status::UnknownTensor => "UnknownTensorError",
            Status::InvalidState => "InvalidStateError",
            Status::Unsupported => "UnsupportedError",
            Status::Closed => "ClosedError",
            Status::Trace => "TraceError",
            Status::Plan => "PlanError",
            Status::Simulation => "SimulationError",
            Status::Diverged => "DivergedError",
            Status::Device => "DeviceError",
            Status::Internal => "InternalError",
        }
    }
}

/// Everything the bindings report: the engine's and the scheduler's errors as they are, plus
/// the binding-level problems (bad handles, bad buffers, closed engines).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// From the engine.
    #[error(transparent)]
    Engine(#[from] teraio_engine::Error),
    /// From the scheduler.
    #[error(transparent)]
    Scheduler(#[from] teraio_scheduler::Error),
    /// A parameter is wrong.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A handle is not (or no longer) valid.
    #[error("invalid handle: {0}")]
    InvalidHandle(String),
    /// Not valid in the current state.
    #[error("{0}")]
    InvalidState(String),
    /// The engine was closed.
    #[error("engine closed: {0}")]
    Closed(String),
    /// A file of the bindings' own (a trace) could not be read.
    #[error("{context}: {source}")]
    File {
        /// What was read.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A panic caught at the boundary (a bug).
    #[error("internal error (a bug, please report): {0}")]
    Internal(String),
    /// An error reported before, again (an operation's stored result, waited twice).
    #[error("{message}")]
    Reported {
        /// Its status.
        status: Status,
        /// Its message.
        message: String,
    },
}

/// Result alias of the bindings.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The status code of this error.
    pub fn status(&self) -> Status {
        use teraio_engine::Error as E;
        use teraio_scheduler::Error as S;
        match self {
            Error::Engine(e) => match e {
                E::Io { .. } | E::Os { .. } | E::ShortTransfer { .. } => Status::Io,
                // a caller's buffer or pointer: their argument is wrong
                E::Misaligned { .. } => Status::InvalidArgument,
                E::NoSpace(_) => Status::NoSpace,
                E::ChecksumMismatch { .. } => Status::ChecksumMismatch,
                E::Corruption(_) => Status::Corruption,
                E::OverwriteRefused { .. } => Status::OverwriteRefused,
                E::UnknownTensor(_) => Status::UnknownTensor,
                E::InvalidState { .. } => Status::InvalidState,
                E::InvalidArgument(_) => Status::InvalidArgument,
                E::Unsupported(_) => Status::Unsupported,
                E::Closed(_) => Status::Closed,
                E::Diverged { .. } => Status::Diverged,
                E::Cuda(_) => Status::Device,
                E::Layout(l) => layout_status(l),
                E::Alloc(a) => alloc_status(a),
                // The engine's enum may grow; a new kind is an I/O-side failure until mapped.
                #[allow(unreachable_patterns)]
                _ => Status::Io,
            },
            Error::Scheduler(e) => match e {
                S::InvalidTrace { .. } | S::Json(_) => Status::Trace,
                S::InvalidPlan { .. } => Status::Plan,
                S::InvalidArgument(_) => Status::InvalidArgument,
                S::SimulationStuck { .. } => Status::Simulation,
                #[allow(unreachable_patterns)]
                _ => Status::Simulation,
            },
            Error::InvalidArgument(_) => Status::InvalidArgument,
            Error::InvalidHandle(_) => Status::InvalidHandle,
            Error::InvalidState(_) => Status::InvalidState,
            Error::Closed(_) => Status::Closed,
            Error::File { .. } => Status::Io,
            Error::Internal(_) => Status::Internal,
            Error::Reported { status, .. } => *status,
        }
    }

    /// The same error again (same status, same message), for results reported more than once.
    pub fn duplicate(&self) -> Error {
        Error::Reported { status: self.status(), message: self.to_string() }
    }
}

fn layout_status(e: &teraio_layout::Error) -> Status {
    use teraio_layout::Error as L;
    match e {
        L::InvalidArgument(_) => Status::InvalidArgument,
        L::Misaligned { .. } => Status::Io,
        L::UnsupportedVersion { .. } => Status::Unsupported,
        L::ChecksumMismatch { .. } => Status::ChecksumMismatch,
        L::BadMagic { .. } | L::Corruption { .. } => Status::Corruption,
        #[allow(unreachable_patterns)]
        _ => Status::Corruption,
    }
}

fn alloc_status(e: &teraio_allocator::Error) -> Status {
    use teraio_allocator::Error as A;
    match e {
        A::NoSpace { .. } => Status::NoSpace,
        A::InvalidArgument(_) => Status::InvalidArgument,
        A::Layout(l) => layout_status(l),
        A::NotAllocated { .. } | A::AlreadyAllocated { .. } | A::Corruption(_) => {
            Status::Corruption
        }
        #[allow(unreachable_patterns)]
        _ => Status::Corruption,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_stable_and_unique() {
        // These numbers are an ABI: changing one breaks compiled C programs.
        let expected = [
            ("OK", 0),
            ("PENDING", 1),
            ("ERR_INVALID_ARGUMENT", -1),
            ("ERR_INVALID_HANDLE", -2),
            ("ERR_IO", -3),
            ("ERR_NO_SPACE", -4),
            ("ERR_CORRUPTION", -5),
            ("ERR_CHECKSUM_MISMATCH", -6),
            ("ERR_OVERWRITE_REFUSED", -7),
            ("ERR_UNKNOWN_TENSOR", -8),
            ("ERR_INVALID_STATE", -9),
            ("ERR_UNSUPPORTED", -10),
            ("ERR_CLOSED", -11),
            ("ERR_TRACE", -12),
            ("ERR_PLAN", -13),
            ("ERR_SIMULATION", -14),
            ("ERR_DIVERGED", -15),
            ("ERR_DEVICE", -16),
            ("ERR_INTERNAL", -99),
        ];
        assert_eq!(Status::ALL.len(), expected.len());
        for (s, (name, code)) in Status::ALL.iter().zip(expected) {
            assert_eq!((s.name(), s.code()), (name, code));
            assert_eq!(Status::from_code(code), Some(*s));
        }
        assert_eq!(Status::from_code(-1000), None);
    }

    #[test]
    fn engine_and_scheduler_errors_get_their_codes() {
        let e = Error::from(teraio_engine::Error::NoSpace("x".into()));
        assert_eq!(e.status(), Status::NoSpace);
        let e = Error::from(teraio_engine::Error::UnknownTensor("7".into()));
        assert_eq!(e.status(), Status::UnknownTensor);
        let e = Error::from(teraio_scheduler::Trace::from_json("{").unwrap_err());
        assert_eq!(e.status(), Status::Trace);
        let e = Error::from(teraio_engine::Error::ChecksumMismatch {
            tensor: "1".into(),
            offset: 0,
            stored: 1,
            computed: 2,
        });
        assert_eq!(e.status(), Status::ChecksumMismatch);
        assert!(e.to_string().contains("checksum mismatch in tensor 1"), "{e}");
    }
}
