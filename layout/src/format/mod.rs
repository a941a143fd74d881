//! The on-disk format: superblocks, the device map, journal batches and checkpoints.
//!
//! Everything is little-endian. Every structure starts with the same 16-byte header
//! (`u64` magic, `u32` format version, `u32` crc32c) and its crc32c covers all of its bytes
//! (padding included) with the crc field read as zero. The byte-exact tables, the device map
//! and the rules (which copy wins, where a journal scan stops, versioning) are in
//! `docs/FORMAT.md`.
//!
//! | structure | encode | decode |
//! |---|---|---|
//! | [`Superblock`] (one block, two copies per device) | [`Superblock::encode`] | [`Superblock::decode`], [`pick_superblock`] |
//! | [`DeviceLayout`] (regions of a device) | [`DeviceLayout::compute`] | stored in the superblock |
//! | journal batch of [`RecordBody`] | [`encode_journal_batch`] | [`decode_journal_batch`], [`scan_journal`] |
//! | [`Checkpoint`] (two slots per device) | [`Checkpoint::encode`] | [`Checkpoint::decode`], [`pick_checkpoint`] |
//! | [`TensorRecord`] (inside batches and checkpoints) | [`TensorRecord::encode`] | [`TensorRecord::decode`] |
//!
//! Encoders check the same rules as decoders and return `InvalidArgument` rather than write
//! bytes that would not read back; whatever encodes decodes to an equal value. Decoders never
//! panic, bound every length by the input size, and return `BadMagic`, `UnsupportedVersion`,
//! `ChecksumMismatch` or `Corruption`.
//!
//! ```
//! use teraio_layout::format::{DeviceLayout, Superblock, pick_superblock, SUPERBLOCK_MAGIC};
//! let layout = DeviceLayout::with_defaults(1 << 30, 4096, 1 << 20).unwrap();
//! let sb = Superblock::new([7; 16], 0, 4, 1 << 20, layout, 1, 1_700_000_000).unwrap();
//! let bytes = sb.encode().unwrap();
//! assert_eq!(bytes.len(), 4096);
//! assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()), SUPERBLOCK_MAGIC);
//! let zeroed = vec![0u8; 4096]; // copy 1 lost
//! let chosen = pick_superblock([&bytes, &zeroed]).unwrap();
//! assert_eq!((&chosen.value, chosen.index), (&sb, 0));
//! assert!(chosen.damaged().is_some());
//! ```

mod checkpoint;
mod codec;
mod journal;
mod record;
mod superblock;

pub use checkpoint::{Checkpoint, pick_checkpoint};
pub use journal::{
    JOURNAL_BATCH_HEADER_BYTES, JournalBatch, JournalScan, ScanStop, decode_journal_batch,
    encode_journal_batch, scan_journal,
};
pub use record::{
    MAX_STRIPE_LANES, MAX_TENSOR_BYTES, MAX_TENSOR_NAME_BYTES, RecordBody, TensorRecord,
};
pub use superblock::{
    DEFAULT_JOURNAL_BYTES, DEFAULT_TABLE_BYTES, DeviceLayout, SUPERBLOCK_FIELDS_BYTES, Superblock,
    default_journal_bytes, default_table_bytes, pick_superblock,
};

use crate::{Error, Result};

/// The format version this build writes, and the newest it reads (all structures share it).
pub const FORMAT_VERSION: u32 = 1;
/// Magic of a superblock: the bytes `"TERAIOSB"` at offset 0 of every teraio device.
pub const SUPERBLOCK_MAGIC: u64 = u64::from_le_bytes(*b"TERAIOSB");
/// Magic of a journal batch: the bytes `"TERAIOJB"`.
pub const JOURNAL_BATCH_MAGIC: u64 = u64::from_le_bytes(*b"TERAIOJB");
/// Magic of a checkpoint: the bytes `"TERAIOCP"`.
pub const CHECKPOINT_MAGIC: u64 = u64::from_le_bytes(*b"TERAIOCP");
/// Smallest block size the format accepts.
pub const MIN_BLOCK_BYTES: u32 = 512;
/// Largest block size the format accepts (a superblock copy fits its 64 KiB slot).
pub const MAX_BLOCK_BYTES: u32 = 64 << 10;
/// Device offsets of the two superblock copies; fixed, whatever the block size.
pub const SUPERBLOCK_OFFSETS: [u64; 2] = [0, 64 << 10];
/// Bytes reserved at the start of every device for the superblock copies.
pub const SUPERBLOCK_AREA_BYTES: u64 = 128 << 10;
/// Bytes of a checkpoint header; the bitmap follows it.
pub const CHECKPOINT_HEADER_BYTES: usize = 88;

/// The outcome of reading a structure kept in two copies (superblocks, checkpoint slots).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen<T> {
    /// The winning copy, decoded.
    pub value: T,
    /// Which copy won (0 or 1).
    pub index: usize,
    /// For each copy: its generation, or why it did not decode.
    pub copies: [Result<u64>; 2],
}

impl<T> Chosen<T> {
    /// The losing copy and its error, when it did not decode (a damaged or never-written copy).
    pub fn damaged(&self) -> Option<(usize, &Error)> {
        let other = 1 - self.index;
        self.copies[other].as_ref().err().map(|e| (other, e))
    }

    /// Whether both copies decoded with the same generation (superblocks: nothing to repair).
    pub fn in_sync(&self) -> bool {
        matches!(&self.copies, [Ok(a), Ok(b)] if a == b)
    }
}

/// Pick the valid copy with the highest generation (copy 0 on a tie).
fn choose<T: PartialEq>(
    what: &'static str,
    decoded: [Result<T>; 2],
    generation: impl Fn(&T) -> u64,
) -> Result<Chosen<T>> {
    let copies = [0, 1].map(|i| decoded[i].as_ref().map(&generation).map_err(Clone::clone));
    let [a, b] = decoded;
    match (a, b) {
        (Ok(a), Ok(b)) => {
            let (ga, gb) = (generation(&a), generation(&b));
            if ga == gb && a != b {
                return Err(codec::corrupt(
                    what,
                    format!("both copies have generation {ga} but different contents"),
                ));
            }
            if gb > ga {
                Ok(Chosen { value: b, index: 1, copies })
            } else {
                Ok(Chosen { value: a, index: 0, copies })
            }
        }
        (Ok(a), Err(_)) => Ok(Chosen { value: a, index: 0, copies }),
        (Err(_), Ok(b)) => Ok(Chosen { value: b, index: 1, copies }),
        (Err(ea), Err(eb)) => {
            let ea_is_magic = matches!(ea, Error::BadMagic { .. });
            let eb_is_magic = matches!(eb, Error::BadMagic { .. });
            Err(if ea_is_magic && !eb_is_magic { eb } else { ea })
        }
    }
}
