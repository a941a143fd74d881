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
    /// The GPU memory is smaller than what one kernel needs resident at once (the trace's
    /// largest working set): no plan can run the trace.
    #[error(
        "GPU memory too small: kernel {kernel} ({name}) needs {needed_bytes} bytes resident at \
         once (the trace's largest working set; no plan runs it in less), the GPU has \
         {capacity_bytes}"
    )]
    GpuMemoryTooSmall {
        /// The kernel with the largest working set.
        kernel: usize,
        /// Its name.
        name: String,
        /// Its working set, bytes.
        needed_bytes: u64,
        /// GPU memory, bytes.
        capacity_bytes: u64,
    },
    /// A plan runs out of GPU memory in the simulator: refused.
    #[error(
        "the {policy} plan runs out of GPU memory at kernel {kernel} ({name}): it needs \
         {needed_bytes} more bytes with {used_bytes} of {capacity_bytes} in use"
    )]
    PlanOutOfMemory {
        /// Policy of the plan.
        policy: String,
        /// Kernel about to start.
        kernel: usize,
        /// Its name.
        name: String,
        /// Bytes the blocked allocation needs.
        needed_bytes: u64,
        /// GPU bytes in use then.
        used_bytes: u64,
        /// GPU memory, bytes.
        capacity_bytes: u64,
    },
    /// A plan needs more room on a tier than the hardware has: refused.
    #[error(
        "the {policy} plan needs {needed_bytes} bytes on the {tier} at its peak, which holds \
         {capacity_bytes}"
    )]
    TierTooSmall {
        /// Policy of the plan.
        policy: String,
        /// `SSD array` or `host tier`.
        tier: String,
        /// Peak bytes the plan keeps there.
        needed_bytes: u64,
        /// What the tier holds, bytes.
        capacity_bytes: u64,
    },
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
