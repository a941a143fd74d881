//! Checkpoints: a device's allocator bitmap and (on device 0) the tensor table, as of a journal
//! sequence number. Two slots per device; the newest valid one wins.

use super::codec::{
    COMMON_HEADER_BYTES, Reader, Writer, check_crc, check_magic_and_version, corrupt, seal,
    truncated,
};
use super::record::TensorRecord;
use super::superblock::check_block_bytes;
use super::{CHECKPOINT_HEADER_BYTES, CHECKPOINT_MAGIC, Chosen, FORMAT_VERSION, choose};
use crate::{Error, Result};

const WHAT: &str = "checkpoint";

/// The state of one device's metadata, complete as of journal record `journal_seq`.
///
/// Bitmap: bit `i` (byte `i / 8`, bit `i % 8`, least significant first) is 1 when allocation
/// unit `i` of the data region is in use. `bitmap` holds exactly `bitmap_bits.div_ceil(8)`
/// bytes, and the unused high bits of its last byte are 0. Tensors are sorted by strictly
/// increasing id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The array this checkpoint belongs to (compare with the superblock's).
    pub array_uuid: [u8; 16],
    /// Bumped on every checkpoint; of two valid slots the higher generation wins.
    pub generation: u64,
    /// Journal records with seq <= this are included; replay starts at `journal_seq + 1`.
    pub journal_seq: u64,
    /// The device this checkpoint describes.
    pub device_index: u32,
    /// Allocation unit the bitmap counts in (a power of two).
    pub alloc_unit_bytes: u64,
    /// Number of allocation units the bitmap covers.
    pub bitmap_bits: u64,
    /// The allocator bitmap.
    pub bitmap: Vec<u8>,
    /// The tensor table (empty on devices other than 0), sorted by id.
    pub tensors: Vec<TensorRecord>,
}

impl Checkpoint {
    fn check(&self) -> std::result::Result<(), String> {
        if !self.alloc_unit_bytes.is_power_of_two() {
            return Err(format!("allocation unit {} is not a power of two", self.alloc_unit_bytes));
        }
        if self.bitmap.len() as u64 != self.bitmap_bits.div_ceil(8) {
            return Err(format!(
                "bitmap of {} bytes for {} bits (needs {})",
                self.bitmap.len(),
                self.bitmap_bits,
                self.bitmap_bits.div_ceil(8)
            ));
        }
        let tail_bits = self.bitmap_bits % 8;
        if let Some(last) = self.bitmap.last()
            && tail_bits != 0
            && last >> tail_bits != 0
        {
            return Err(format!("bits past bit {} of the bitmap are set", self.bitmap_bits));
        }
        if let Some(w) = self.tensors.windows(2).find(|w| w[0].id >= w[1].id) {
            return Err(format!(
                "tensor ids must increase strictly: {} is followed by {}",
                w[0].id, w[1].id
            ));
        }
        if self.tensors.len() > u32::MAX as usize {
            return Err(format!("{} tensors in one checkpoint", self.tensors.len()));
        }
        Ok(())
    }

    /// Whether allocation unit `unit` is in use (false past `bitmap_bits`).
    pub fn unit_in_use(&self, unit: u64) -> bool {
        unit < self.bitmap_bits
            && usize::try_from(unit / 8)
                .ok()
                .and_then(|i| self.bitmap.get(i))
                .is_some_and(|b| b & (1 << (unit % 8)) != 0)
    }

    /// Encode, padded with zeros to whole blocks of `block_bytes`; the crc covers every byte.
    ///
    /// The result must fit the device's checkpoint slot (`DeviceLayout::checkpoints[i].len`);
    /// the caller checks before writing. Errors: `InvalidArgument` for an invalid block size or
    /// a checkpoint that breaks a rule of [`Checkpoint`] or [`TensorRecord`].
    pub fn encode(&self, block_bytes: u32) -> Result<Vec<u8>> {
        check_block_bytes(block_bytes).map_err(Error::InvalidArgument)?;
        self.check().map_err(Error::InvalidArgument)?;
        let mut w = Writer::with_capacity(CHECKPOINT_HEADER_BYTES + self.bitmap.len());
        w.header(CHECKPOINT_MAGIC, FORMAT_VERSION);
        w.u64(0); // total length, patched below
        w.u32(block_bytes);
        w.u32(self.device_index);
        w.bytes(&self.array_uuid);
        w.u64(self.generation);
        w.u64(self.journal_seq);
        w.u64(self.alloc_unit_bytes);
        w.u64(self.bitmap_bits);
        w.u32(self.tensors.len() as u32);
        w.u32(0); // reserved
        debug_assert_eq!(w.buf.len(), CHECKPOINT_HEADER_BYTES);
        w.bytes(&self.bitmap);
        for t in &self.tensors {
            let len_at = w.buf.len();
            w.u32(0);
            t.write(&mut w)?;
            let len = u32::try_from(w.buf.len() - len_at - 4).map_err(|_| {
                Error::InvalidArgument(format!("tensor {} record longer than 4 GiB", t.id))
            })?;
            w.patch_u32(len_at, len);
        }
        w.pad_to(block_bytes as usize);
        let total = w.buf.len() as u64;
        w.patch_u64(16, total);
        seal(&mut w.buf);
        Ok(w.buf)
    }

    /// Decode a checkpoint from the start of `bytes` (a whole slot may be passed; bytes past
    /// the checkpoint's recorded length are ignored).
    ///
    /// Errors: `BadMagic` (e.g. a slot never written), `UnsupportedVersion`,
    /// `ChecksumMismatch`, `Corruption` (truncated, bad lengths, invalid bitmap or tensor
    /// records, unsorted ids, non-zero padding). Never panics; allocations are bounded by the
    /// input length.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        check_magic_and_version(bytes, WHAT, CHECKPOINT_MAGIC, FORMAT_VERSION)?;
        let mut r = Reader::new(bytes, WHAT);
        r.skip(COMMON_HEADER_BYTES)?;
        let total = r.u64()?;
        let block_bytes = r.u32()?;
        check_block_bytes(block_bytes).map_err(|d| corrupt(WHAT, d))?;
        if total > bytes.len() as u64 {
            return Err(truncated(WHAT, usize::try_from(total).unwrap_or(usize::MAX), bytes.len()));
        }
        let total = total as usize;
        if total < CHECKPOINT_HEADER_BYTES || !total.is_multiple_of(block_bytes as usize) {
            return Err(corrupt(
                WHAT,
                format!("length {total} is not a whole number of {block_bytes}-byte blocks"),
            ));
        }
        let bytes = &bytes[..total];
        check_crc(bytes, WHAT)?;
        let mut r = Reader::new(bytes, WHAT);
        r.skip(COMMON_HEADER_BYTES + 12)?;
        let device_index = r.u32()?;
        let array_uuid = r.array::<16>()?;
        let generation = r.u64()?;
        let journal_seq = r.u64()?;
        let alloc_unit_bytes = r.u64()?;
        let bitmap_bits = r.u64()?;
        let tensor_count = r.u32()? as usize;
        r.reserved_u32("checkpoint flags")?;
        let bitmap_len = bitmap_bits.div_ceil(8);
        if bitmap_len > r.remaining() as u64 {
            return Err(corrupt(
                WHAT,
                format!("bitmap of {bitmap_bits} bits does not fit in {} bytes", r.remaining()),
            ));
        }
        let bitmap = r.bytes(bitmap_len as usize)?.to_vec();
        // Each tensor takes at least its length prefix.
        if tensor_count.saturating_mul(4) > r.remaining() {
            return Err(corrupt(
                WHAT,
                format!("{tensor_count} tensors cannot fit in {} bytes", r.remaining()),
            ));
        }
        let mut tensors = Vec::with_capacity(tensor_count);
        for _ in 0..tensor_count {
            let len = r.u32()? as usize;
            tensors.push(TensorRecord::decode(r.bytes(len)?)?);
        }
        if r.bytes(r.remaining())?.iter().any(|&b| b != 0) {
            return Err(corrupt(WHAT, "padding after the tensor table is not zero"));
        }
        let cp = Self {
            array_uuid,
            generation,
            journal_seq,
            device_index,
            alloc_unit_bytes,
            bitmap_bits,
            bitmap,
            tensors,
        };
        cp.check().map_err(|d| corrupt(WHAT, d))?;
        Ok(cp)
    }
}

/// Decode both checkpoint slots of a device and pick the valid one with the highest
/// generation.
///
/// `slots[i]` holds the bytes of slot `i` (the whole slot, or at least the checkpoint). A slot
/// that was never written reports `BadMagic`; the next checkpoint goes to the slot that did
/// not win. Errors: as [`pick_superblock`](super::pick_superblock).
pub fn pick_checkpoint(slots: [&[u8]; 2]) -> Result<Chosen<Checkpoint>> {
    choose(WHAT, slots.map(Checkpoint::decode), |cp| cp.generation)
}
