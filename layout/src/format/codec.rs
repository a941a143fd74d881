//! Little-endian reading and writing with bounds checks, and the crc32c rule shared by every
//! structure: the checksum covers the structure's bytes with its own 4-byte field read as zero.

use crate::{Error, Result};

/// Offset of the crc32c field in every structure's common header
/// (magic u64, version u32, crc32c u32).
pub(crate) const CRC_OFFSET: usize = 12;
/// Length of the common header.
pub(crate) const COMMON_HEADER_BYTES: usize = 16;

/// crc32c of `bytes` with `bytes[CRC_OFFSET..CRC_OFFSET + 4]` taken as zero.
///
/// `bytes` must be at least [`COMMON_HEADER_BYTES`] long (callers check first).
pub(crate) fn crc_with_zeroed_field(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(&bytes[..CRC_OFFSET]);
    let crc = crc32c::crc32c_append(crc, &[0u8; 4]);
    crc32c::crc32c_append(crc, &bytes[CRC_OFFSET + 4..])
}

/// Store the crc of `bytes` (computed with the field as zero) into its field.
pub(crate) fn seal(bytes: &mut [u8]) {
    bytes[CRC_OFFSET..CRC_OFFSET + 4].fill(0);
    let crc = crc32c::crc32c(bytes);
    bytes[CRC_OFFSET..CRC_OFFSET + 4].copy_from_slice(&crc.to_le_bytes());
}

/// Check the magic and version of the common header at the start of `bytes`.
///
/// Errors: `Corruption` (shorter than the header), `BadMagic`, `UnsupportedVersion`.
pub(crate) fn check_magic_and_version(
    bytes: &[u8],
    what: &'static str,
    magic: u64,
    supported: u32,
) -> Result<()> {
    if bytes.len() < COMMON_HEADER_BYTES {
        return Err(truncated(what, COMMON_HEADER_BYTES, bytes.len()));
    }
    let found = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if found != magic {
        return Err(Error::BadMagic { what, expected: magic, found });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version == 0 || version > supported {
        return Err(Error::UnsupportedVersion { what, found: version, supported });
    }
    Ok(())
}

/// Verify the stored crc of `bytes` (the whole covered range).
pub(crate) fn check_crc(bytes: &[u8], what: &'static str) -> Result<()> {
    let stored = u32::from_le_bytes(bytes[CRC_OFFSET..CRC_OFFSET + 4].try_into().expect("4 bytes"));
    let computed = crc_with_zeroed_field(bytes);
    if stored != computed {
        return Err(Error::ChecksumMismatch { what, stored, computed });
    }
    Ok(())
}

/// The error for input shorter than a structure needs.
pub(crate) fn truncated(what: &'static str, needed: usize, found: usize) -> Error {
    Error::Corruption { what, detail: format!("truncated: needs {needed} bytes, found {found}") }
}

/// A `Corruption` error.
pub(crate) fn corrupt(what: &'static str, detail: impl Into<String>) -> Error {
    Error::Corruption { what, detail: detail.into() }
}

/// Reads little-endian values from a byte slice; every read is bounds-checked.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `buf`, naming `what` in its errors.
    pub(crate) fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, pos: 0, what }
    }

    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Current position from the start of the buffer.
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    /// The next `n` bytes.
    pub(crate) fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(corrupt(
                self.what,
                format!(
                    "truncated: needs {n} bytes at offset {}, only {} left",
                    self.pos,
                    self.remaining()
                ),
            ));
        }
        let out = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    /// Skip `n` bytes.
    pub(crate) fn skip(&mut self, n: usize) -> Result<()> {
        self.bytes(n).map(|_| ())
    }

    /// A fixed-size array.
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.bytes(N)?.try_into().expect("N bytes"))
    }

    /// A little-endian u32.
    pub(crate) fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// A little-endian u64.
    pub(crate) fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A u32 that must be zero (a reserved field of this version).
    pub(crate) fn reserved_u32(&mut self, field: &str) -> Result<()> {
        let at = self.pos;
        match self.u32()? {
            0 => Ok(()),
            v => Err(corrupt(self.what, format!("reserved field {field} at offset {at} is {v}"))),
        }
    }

    /// A u32 count of items of at least `min_item_bytes` each, bounded by the bytes left.
    pub(crate) fn count(&mut self, field: &str, min_item_bytes: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        let fits = n.checked_mul(min_item_bytes).is_some_and(|b| b <= self.remaining());
        if !fits {
            return Err(corrupt(
                self.what,
                format!(
                    "{field} {n} cannot fit in the {} bytes left ({min_item_bytes} bytes each)",
                    self.remaining()
                ),
            ));
        }
        Ok(n)
    }

    /// Error unless every byte was read.
    pub(crate) fn finish(&self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(corrupt(self.what, format!("{n} unexpected trailing bytes"))),
        }
    }
}

/// Appends little-endian values to a buffer.
pub(crate) struct Writer {
    /// The bytes written so far.
    pub(crate) buf: Vec<u8>,
}

impl Writer {
    /// A writer with `capacity` bytes reserved.
    pub(crate) fn with_capacity(capacity: usize) -> Self {
        Self { buf: Vec::with_capacity(capacity) }
    }

    /// Append a u32.
    pub(crate) fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Append a u64.
    pub(crate) fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Append raw bytes.
    pub(crate) fn bytes(&mut self, v: &[u8]) {
        self.buf.extend_from_slice(v);
    }

    /// Append the common header with a zero crc (sealed later with [`seal`]).
    pub(crate) fn header(&mut self, magic: u64, version: u32) {
        self.u64(magic);
        self.u32(version);
        self.u32(0);
    }

    /// Overwrite a u32 at `at` (a length known only after the body was written).
    pub(crate) fn patch_u32(&mut self, at: usize, v: u32) {
        self.buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// Overwrite a u64 at `at`.
    pub(crate) fn patch_u64(&mut self, at: usize, v: u64) {
        self.buf[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    /// Pad with zeros to a multiple of `align`.
    pub(crate) fn pad_to(&mut self, align: usize) {
        let len = self.buf.len().div_ceil(align) * align;
        self.buf.resize(len, 0);
    }
}
