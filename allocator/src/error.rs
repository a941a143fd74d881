//! The one error type of the allocator crate.

/// Allocation failures. Every failing call leaves the allocator exactly as it was.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// Not enough free space; nothing was allocated.
    #[error("no space for {requested_bytes} bytes{}: {free_bytes} bytes free", device.map(|d| format!(" on device {d}")).unwrap_or_default())]
    NoSpace {
        /// Bytes asked for.
        requested_bytes: u64,
        /// Bytes free where the request was tried.
        free_bytes: u64,
        /// The device, when the request was for one device.
        device: Option<u32>,
    },
    /// Freeing (part of) an extent that is not allocated: a double free or a foreign extent.
    #[error("extent at {offset} (+{len} bytes) on device {device} is not allocated")]
    NotAllocated {
        /// The device.
        device: u32,
        /// Offset in bytes.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// Marking an extent allocated that is (partly) allocated already.
    #[error("extent at {offset} (+{len} bytes) on device {device} overlaps an allocated extent")]
    AlreadyAllocated {
        /// The device.
        device: u32,
        /// Offset in bytes.
        offset: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A parameter is out of its valid range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A persisted bitmap does not fit this allocator.
    #[error("corrupt allocator state: {0}")]
    Corruption(String),
    /// A layout error (building a stripe map).
    #[error(transparent)]
    Layout(#[from] teraio_layout::Error),
}

/// Result alias of the allocator crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
