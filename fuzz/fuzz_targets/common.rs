//! Helpers shared by the targets (included with `#[path]`).
#![allow(dead_code)] // each target uses a subset
//!
//! Every structure is guarded by a crc32c, so random bytes almost never get past the checksum.
//! Each target therefore decodes the input twice: as is, and "sealed": with a valid magic and
//! version written over the first 12 bytes and the crc recomputed over the covered range, so
//! the fuzzer exercises the field checks and record parsers behind the checksum.

/// Overwrite magic and version, then store the crc32c of `bytes[..covered]` (crc field zeroed).
pub fn seal(bytes: &mut [u8], magic: u64, covered: usize) {
    if bytes.len() < 16 {
        return;
    }
    bytes[..8].copy_from_slice(&magic.to_le_bytes());
    bytes[8..12].copy_from_slice(&teraio_layout::format::FORMAT_VERSION.to_le_bytes());
    let covered = covered.clamp(16, bytes.len());
    bytes[12..16].fill(0);
    let crc = crc32c::crc32c(&bytes[..covered]);
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
}

/// The little-endian u32 at `at`, if the input is long enough.
pub fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

/// The little-endian u64 at `at`, if the input is long enough.
pub fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}
