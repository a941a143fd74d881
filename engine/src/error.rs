//! The one error type of the engine crate.

use std::path::PathBuf;

/// Everything the engine reports. Each variant names the problem and, where there is one, the
/// device or tensor it concerns.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O system call failed on one device.
    #[error("I/O error on device {device} ({path}): {source}")]
    Io {
        /// Index of the device in the array.
        device: u32,
        /// Path of the device or file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An I/O error not tied to one device of the array (opening a folder, mapping memory).
    #[error("{context}: {source}")]
    Os {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A transfer moved fewer bytes than asked and could not be resumed (end of device).
    #[error("short {op} on device {device} at offset {offset}: {done} of {len} bytes")]
    ShortTransfer {
        /// "read" or "write".
        op: &'static str,
        /// Index of the device.
        device: u32,
        /// Device offset of the request.
        offset: u64,
        /// Bytes moved.
        done: u64,
        /// Bytes asked.
        len: u64,
    },
    /// A buffer address, length or device offset breaks the alignment O_DIRECT (or a device
    /// pointer's) needs.
    #[error(
        "misaligned {what}: {value:#x} is not a multiple of {align} (O_DIRECT and DMA need aligned buffers)"
    )]
    Misaligned {
        /// Which value.
        what: &'static str,
        /// The value.
        value: u64,
        /// The required alignment.
        align: u64,
    },
    /// The array (or a tier) has no room for the request; nothing was allocated.
    #[error("no space: {0}")]
    NoSpace(String),
    /// Data read back does not match the checksum written with it.
    #[error(
        "checksum mismatch in tensor {tensor} at byte {offset}: stored {stored:#010x}, read {computed:#010x}"
    )]
    ChecksumMismatch {
        /// The tensor.
        tensor: String,
        /// Byte offset of the checksummed chunk inside the tensor.
        offset: u64,
        /// Checksum recorded at offload.
        stored: u32,
        /// Checksum of the bytes read.
        computed: u32,
    },
    /// On-disk metadata is damaged or inconsistent.
    #[error("corruption: {0}")]
    Corruption(String),
    /// A target would be overwritten although it holds something else.
    #[error(
        "refusing to overwrite {path}: it holds {found}; pass allow_overwrite (--force) to use it anyway"
    )]
    OverwriteRefused {
        /// The target.
        path: PathBuf,
        /// What was found there (a partition table, a filesystem, another teraio array...).
        found: String,
    },
    /// No tensor with this id or name.
    #[error("unknown tensor {0}")]
    UnknownTensor(String),
    /// The operation is not valid in the tensor's current state.
    #[error("tensor {tensor}: {detail}")]
    InvalidState {
        /// The tensor.
        tensor: String,
        /// Why.
        detail: String,
    },
    /// A parameter is out of its valid range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The trainer's iteration left the plan (another kernel count, a tensor of another size);
    /// the executor runs in safe mode until the caller re-plans.
    #[error(
        "the iteration diverged from the plan at kernel {kernel}: {detail}; the executor is in safe mode (nothing offloaded) until you re-plan"
    )]
    Diverged {
        /// The caller's kernel.
        kernel: usize,
        /// What did not match.
        detail: String,
    },
    /// A tensor's only copy could not be read back (an I/O error or a checksum mismatch on
    /// every attempt): the iteration stopped before `kernel`. The executor stays usable:
    /// `Executor::abort_iteration` ends the iteration and the next one runs (a lost
    /// activation is made again by its kernel; a lost global tensor must be attached again).
    #[error(
        "tensor {tensor} is lost: its copy on {device} could not be read back for kernel {kernel} ({kernel_name}): {detail}; the iteration stopped; the next one can run (abort_iteration() ends this one, or start the next at kernel 0)"
    )]
    TensorLost {
        /// The tensor (id and name).
        tensor: String,
        /// The kernel that needed it.
        kernel: usize,
        /// That kernel's name in the trace.
        kernel_name: String,
        /// Where the unreadable copy is ("device 2", "the host tier").
        device: String,
        /// The last error reading it.
        detail: String,
    },
    /// The feature is not available on this system or build.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A CUDA call (driver, NVRTC or cuFile) failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The engine (or the component) was shut down.
    #[error("shut down: {0}")]
    Closed(&'static str),
    /// Error from the layout crate (geometry, format decoding).
    #[error(transparent)]
    Layout(#[from] teraio_layout::Error),
    /// Error from the allocator crate.
    #[error(transparent)]
    Alloc(#[from] teraio_allocator::Error),
}

/// Result alias of the engine crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
