//! The one error type of the layout crate.

/// Everything that can go wrong while validating geometry or decoding on-disk bytes.
///
/// Decoders never panic: any byte string either decodes or yields one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The bytes do not start with the expected magic number.
    #[error("bad magic in {what}: expected {expected:#018x}, found {found:#018x}")]
    BadMagic {
        /// Which structure was being decoded.
        what: &'static str,
        /// The magic this version writes.
        expected: u64,
        /// The magic found on disk.
        found: u64,
    },
    /// The structure was written by a format version this build cannot read.
    #[error("unsupported {what} format version {found} (this build reads up to {supported})")]
    UnsupportedVersion {
        /// Which structure was being decoded.
        what: &'static str,
        /// The version found on disk.
        found: u32,
        /// The newest version this build reads.
        supported: u32,
    },
    /// The stored checksum does not match the bytes.
    #[error("checksum mismatch in {what}: stored {stored:#010x}, computed {computed:#010x}")]
    ChecksumMismatch {
        /// Which structure was being decoded.
        what: &'static str,
        /// The crc32c stored with the data.
        stored: u32,
        /// The crc32c computed over the data.
        computed: u32,
    },
    /// The bytes pass the checksum but describe something impossible (truncated, out of range).
    #[error("corrupt {what}: {detail}")]
    Corruption {
        /// Which structure was being decoded.
        what: &'static str,
        /// What exactly is wrong.
        detail: String,
    },
    /// An offset or length is not a multiple of the required alignment.
    #[error("{what} {value} is not aligned to {align} bytes")]
    Misaligned {
        /// Which value is misaligned.
        what: &'static str,
        /// The value.
        value: u64,
        /// The required alignment.
        align: u64,
    },
    /// A parameter is out of its valid range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

/// Result alias of the layout crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
