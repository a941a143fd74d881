//! The per-device map of regions ([`DeviceLayout`]) and the superblock that records it.

use super::codec::{
    COMMON_HEADER_BYTES, Reader, Writer, check_crc, check_magic_and_version, corrupt, seal,
    truncated,
};
use super::{
    CHECKPOINT_HEADER_BYTES, Chosen, FORMAT_VERSION, MAX_BLOCK_BYTES, MIN_BLOCK_BYTES,
    SUPERBLOCK_AREA_BYTES, SUPERBLOCK_MAGIC, SUPERBLOCK_OFFSETS, choose,
};
use crate::geometry::ArrayGeometry;
use crate::{Error, Extent, Result};

const WHAT: &str = "superblock";

/// Default size of the journal region: 64 MiB (see [`default_journal_bytes`] for small devices).
pub const DEFAULT_JOURNAL_BYTES: u64 = 64 << 20;
/// Default room for the tensor table in each checkpoint slot: 64 MiB (see
/// [`default_table_bytes`] for small devices).
pub const DEFAULT_TABLE_BYTES: u64 = 64 << 20;
/// Smallest default journal or table size: 64 KiB (a multiple of every valid block size).
const DEFAULT_FLOOR_BYTES: u64 = MAX_BLOCK_BYTES as u64;

/// Bytes of the superblock's fields in format version 1; the rest of its block is zero.
pub const SUPERBLOCK_FIELDS_BYTES: usize = 168;

/// The largest power of two <= `v` (0 for 0).
fn pow2_floor(v: u64) -> u64 {
    if v == 0 { 0 } else { 1 << (63 - v.leading_zeros()) }
}

/// The default journal size for a device of `capacity_bytes`: [`DEFAULT_JOURNAL_BYTES`], or
/// the largest power of two <= capacity / 16 on small devices, and at least 64 KiB.
pub fn default_journal_bytes(capacity_bytes: u64) -> u64 {
    DEFAULT_JOURNAL_BYTES.min(pow2_floor(capacity_bytes / 16)).max(DEFAULT_FLOOR_BYTES)
}

/// The default tensor-table room of a checkpoint slot: [`DEFAULT_TABLE_BYTES`], or the largest
/// power of two <= capacity / 32 on small devices, and at least 64 KiB.
pub fn default_table_bytes(capacity_bytes: u64) -> u64 {
    DEFAULT_TABLE_BYTES.min(pow2_floor(capacity_bytes / 32)).max(DEFAULT_FLOOR_BYTES)
}

fn checked_align_up(value: u64, align: u64) -> Option<u64> {
    value.checked_add(align - 1).map(|v| v & !(align - 1))
}

/// Check a block size: a power of two in `MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES`.
pub(crate) fn check_block_bytes(block_bytes: u32) -> std::result::Result<(), String> {
    if block_bytes.is_power_of_two() && (MIN_BLOCK_BYTES..=MAX_BLOCK_BYTES).contains(&block_bytes) {
        Ok(())
    } else {
        Err(format!(
            "block size {block_bytes} must be a power of two in {MIN_BLOCK_BYTES}..={MAX_BLOCK_BYTES}"
        ))
    }
}

/// The regions of one device, in device order:
///
/// ```text
/// [0, 64 KiB)        superblock copy 0 (its first block_bytes bytes)
/// [64 KiB, 128 KiB)  superblock copy 1
/// journal            journal_bytes (may be 0)
/// checkpoint slot 0  header + allocator bitmap + tensor table room, block-aligned
/// checkpoint slot 1  same size
/// (gap up to the next multiple of alloc_unit_bytes)
/// data               whole allocation units up to the end of the device
/// ```
///
/// Every region is block-aligned; the data region starts and ends on allocation-unit
/// boundaries. Allocation unit `i` is device bytes `[data.offset + i * alloc_unit_bytes, ..)`.
/// The layout is a pure function of its five parameters ([`DeviceLayout::compute`]); the
/// superblock stores both and a reader checks they agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLayout {
    /// Device capacity the layout was computed for (a multiple of `block_bytes`).
    pub capacity_bytes: u64,
    /// Block size: the alignment of every region.
    pub block_bytes: u32,
    /// Allocation unit of the data region (a power of two >= `block_bytes`).
    pub alloc_unit_bytes: u64,
    /// Room for the tensor table requested in each checkpoint slot.
    pub table_bytes: u64,
    /// The two superblock copies (each `block_bytes` long, at [`SUPERBLOCK_OFFSETS`]).
    pub superblocks: [Extent; 2],
    /// The journal region (length 0 when the device keeps no journal).
    pub journal: Extent,
    /// The two checkpoint slots, equal in size.
    pub checkpoints: [Extent; 2],
    /// The data region handed to the extent allocator.
    pub data: Extent,
}

impl DeviceLayout {
    /// Compute the regions of a device.
    ///
    /// Each checkpoint slot holds [`CHECKPOINT_HEADER_BYTES`] + a bitmap of
    /// `capacity_bytes / alloc_unit_bytes` bits + `table_bytes`, rounded up to the block size.
    ///
    /// Errors: `InvalidArgument` for a block size outside 512..=64 KiB or not a power of two, an
    /// allocation unit that is not a power of two >= the block size, or a device too small to
    /// hold the metadata plus one allocation unit; `Misaligned` for a capacity or journal size
    /// that is not a multiple of the block size.
    pub fn compute(
        capacity_bytes: u64,
        block_bytes: u32,
        alloc_unit_bytes: u64,
        journal_bytes: u64,
        table_bytes: u64,
    ) -> Result<Self> {
        check_block_bytes(block_bytes).map_err(Error::InvalidArgument)?;
        let block = u64::from(block_bytes);
        if !alloc_unit_bytes.is_power_of_two() || alloc_unit_bytes < block {
            return Err(Error::InvalidArgument(format!(
                "allocation unit {alloc_unit_bytes} must be a power of two >= the block size {block}"
            )));
        }
        if !capacity_bytes.is_multiple_of(block) {
            return Err(Error::Misaligned {
                what: "device capacity",
                value: capacity_bytes,
                align: block,
            });
        }
        if !journal_bytes.is_multiple_of(block) {
            return Err(Error::Misaligned {
                what: "journal size",
                value: journal_bytes,
                align: block,
            });
        }
        let too_big = || {
            Error::InvalidArgument(format!(
                "device of {capacity_bytes} bytes cannot hold a {journal_bytes}-byte journal, two \
                 checkpoint slots with {table_bytes} bytes of table room and one {alloc_unit_bytes}-byte \
                 allocation unit"
            ))
        };
        let bitmap_bytes = (capacity_bytes / alloc_unit_bytes).div_ceil(8);
        let slot_bytes = (CHECKPOINT_HEADER_BYTES as u64)
            .checked_add(bitmap_bytes)
            .and_then(|b| b.checked_add(table_bytes))
            .and_then(|b| checked_align_up(b, block))
            .ok_or_else(too_big)?;
        let journal = Extent { offset: SUPERBLOCK_AREA_BYTES, len: journal_bytes };
        let cp0_offset = SUPERBLOCK_AREA_BYTES.checked_add(journal_bytes).ok_or_else(too_big)?;
        let cp1_offset = cp0_offset.checked_add(slot_bytes).ok_or_else(too_big)?;
        let meta_end = cp1_offset.checked_add(slot_bytes).ok_or_else(too_big)?;
        let data_offset = checked_align_up(meta_end, alloc_unit_bytes).ok_or_else(too_big)?;
        let data_end = capacity_bytes & !(alloc_unit_bytes - 1);
        if data_end <= data_offset {
            return Err(too_big());
        }
        Ok(Self {
            capacity_bytes,
            block_bytes,
            alloc_unit_bytes,
            table_bytes,
            superblocks: SUPERBLOCK_OFFSETS.map(|offset| Extent { offset, len: block }),
            journal,
            checkpoints: [
                Extent { offset: cp0_offset, len: slot_bytes },
                Extent { offset: cp1_offset, len: slot_bytes },
            ],
            data: Extent { offset: data_offset, len: data_end - data_offset },
        })
    }

    /// [`DeviceLayout::compute`] with [`default_journal_bytes`] and [`default_table_bytes`].
    pub fn with_defaults(
        capacity_bytes: u64,
        block_bytes: u32,
        alloc_unit_bytes: u64,
    ) -> Result<Self> {
        Self::compute(
            capacity_bytes,
            block_bytes,
            alloc_unit_bytes,
            default_journal_bytes(capacity_bytes),
            default_table_bytes(capacity_bytes),
        )
    }

    /// Number of allocation units in the data region: the bit count of this device's
    /// allocator bitmap in a [`Checkpoint`](super::Checkpoint).
    pub fn data_units(&self) -> u64 {
        self.data.len / self.alloc_unit_bytes
    }

    /// Recompute from the parameters; `Ok` when every region agrees.
    fn check_consistent(&self) -> std::result::Result<(), String> {
        let computed = Self::compute(
            self.capacity_bytes,
            self.block_bytes,
            self.alloc_unit_bytes,
            self.journal.len,
            self.table_bytes,
        )
        .map_err(|e| format!("layout parameters are invalid: {e}"))?;
        if computed != *self {
            return Err(format!(
                "stored regions {self:?} disagree with the layout computed from its parameters \
                 {computed:?}"
            ));
        }
        Ok(())
    }
}

/// The superblock: one block at the start of each copy's slot, on every device of the array.
///
/// Identifies the array (uuid), this device's place in it, the array geometry and this device's
/// [`DeviceLayout`]. Build with [`Superblock::new`]; the flat fields duplicate the layout's
/// parameters for convenience and must agree with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    /// The on-disk format version ([`FORMAT_VERSION`] for anything this build writes).
    pub format_version: u32,
    /// Identity of the array; every device of one array carries the same uuid.
    pub array_uuid: [u8; 16],
    /// This device's index in the array (< `device_count`).
    pub device_index: u32,
    /// Number of devices in the array.
    pub device_count: u32,
    /// Array block size (equal to `layout.block_bytes`).
    pub block_bytes: u32,
    /// Stripe unit of the array (a power of two >= the block size).
    pub stripe_unit_bytes: u64,
    /// Allocation unit of the data region (equal to `layout.alloc_unit_bytes`).
    pub alloc_unit_bytes: u64,
    /// Capacity of this device (equal to `layout.capacity_bytes`).
    pub device_capacity_bytes: u64,
    /// The regions of this device.
    pub layout: DeviceLayout,
    /// Bumped on every rewrite; of two valid copies the higher generation wins.
    pub generation: u64,
    /// When the array was created, in seconds since the Unix epoch.
    pub created_unix_s: u64,
}

impl Superblock {
    /// Build and validate a superblock for device `device_index` of `device_count`.
    ///
    /// Errors: `InvalidArgument` when the index is out of range, the geometry is invalid
    /// (see [`ArrayGeometry::new`]) or the layout is not what [`DeviceLayout::compute`] gives
    /// for its parameters.
    pub fn new(
        array_uuid: [u8; 16],
        device_index: u32,
        device_count: u32,
        stripe_unit_bytes: u64,
        layout: DeviceLayout,
        generation: u64,
        created_unix_s: u64,
    ) -> Result<Self> {
        let sb = Self {
            format_version: FORMAT_VERSION,
            array_uuid,
            device_index,
            device_count,
            block_bytes: layout.block_bytes,
            stripe_unit_bytes,
            alloc_unit_bytes: layout.alloc_unit_bytes,
            device_capacity_bytes: layout.capacity_bytes,
            layout,
            generation,
            created_unix_s,
        };
        sb.check().map_err(Error::InvalidArgument)?;
        Ok(sb)
    }

    fn check(&self) -> std::result::Result<(), String> {
        if self.format_version != FORMAT_VERSION {
            return Err(format!(
                "format version {} (this build writes {FORMAT_VERSION})",
                self.format_version
            ));
        }
        if self.device_index >= self.device_count {
            return Err(format!(
                "device index {} out of range for {} devices",
                self.device_index, self.device_count
            ));
        }
        ArrayGeometry::new(self.device_count, self.block_bytes, self.stripe_unit_bytes)
            .map_err(|e| e.to_string())?;
        let l = &self.layout;
        if (l.block_bytes, l.alloc_unit_bytes, l.capacity_bytes)
            != (self.block_bytes, self.alloc_unit_bytes, self.device_capacity_bytes)
        {
            return Err(format!(
                "block size, allocation unit and capacity ({}, {}, {}) disagree with the layout's \
                 ({}, {}, {})",
                self.block_bytes,
                self.alloc_unit_bytes,
                self.device_capacity_bytes,
                l.block_bytes,
                l.alloc_unit_bytes,
                l.capacity_bytes
            ));
        }
        l.check_consistent()
    }

    /// Encode into exactly one block (`block_bytes` long), sealed with its crc32c.
    ///
    /// Errors: `InvalidArgument` when the superblock is inconsistent (the checks of
    /// [`Superblock::new`]); whatever encodes, [`Superblock::decode`] reads back unchanged.
    pub fn encode(&self) -> Result<Vec<u8>> {
        self.check().map_err(Error::InvalidArgument)?;
        let l = &self.layout;
        let mut w = Writer::with_capacity(self.block_bytes as usize);
        w.header(SUPERBLOCK_MAGIC, FORMAT_VERSION);
        w.u32(self.block_bytes);
        w.u32(self.device_index);
        w.u32(self.device_count);
        w.u32(0); // reserved
        w.bytes(&self.array_uuid);
        w.u64(self.generation);
        w.u64(self.created_unix_s);
        w.u64(self.stripe_unit_bytes);
        w.u64(self.alloc_unit_bytes);
        w.u64(self.device_capacity_bytes);
        w.u64(l.table_bytes);
        for e in l.superblocks {
            w.u64(e.offset);
        }
        w.u64(l.journal.offset);
        w.u64(l.journal.len);
        w.u64(l.checkpoints[0].offset);
        w.u64(l.checkpoints[1].offset);
        w.u64(l.checkpoints[0].len);
        w.u64(l.data.offset);
        w.u64(l.data.len);
        debug_assert_eq!(w.buf.len(), SUPERBLOCK_FIELDS_BYTES);
        w.buf.resize(self.block_bytes as usize, 0);
        seal(&mut w.buf);
        Ok(w.buf)
    }

    /// Decode a superblock from the start of `bytes` (at least one block; bytes past the
    /// superblock's own `block_bytes` are ignored, so a 64 KiB read of a copy's slot works).
    ///
    /// Errors: `BadMagic` (not a teraio superblock: e.g. a zeroed or foreign block),
    /// `UnsupportedVersion`, `ChecksumMismatch`, `Corruption` (truncated input, an invalid
    /// block size, non-zero reserved bytes, inconsistent geometry or layout). Never panics.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        check_magic_and_version(bytes, WHAT, SUPERBLOCK_MAGIC, FORMAT_VERSION)?;
        let mut r = Reader::new(bytes, WHAT);
        r.skip(COMMON_HEADER_BYTES)?;
        let block_bytes = r.u32()?;
        check_block_bytes(block_bytes).map_err(|d| corrupt(WHAT, d))?;
        let block = block_bytes as usize;
        if bytes.len() < block {
            return Err(truncated(WHAT, block, bytes.len()));
        }
        let bytes = &bytes[..block];
        check_crc(bytes, WHAT)?;
        let mut r = Reader::new(bytes, WHAT);
        r.skip(COMMON_HEADER_BYTES + 4)?;
        let format_version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        let device_index = r.u32()?;
        let device_count = r.u32()?;
        r.reserved_u32("superblock flags")?;
        let array_uuid = r.array::<16>()?;
        let generation = r.u64()?;
        let created_unix_s = r.u64()?;
        let stripe_unit_bytes = r.u64()?;
        let alloc_unit_bytes = r.u64()?;
        let device_capacity_bytes = r.u64()?;
        let table_bytes = r.u64()?;
        let sb0 = r.u64()?;
        let sb1 = r.u64()?;
        let journal = Extent { offset: r.u64()?, len: r.u64()? };
        let cp0 = r.u64()?;
        let cp1 = r.u64()?;
        let slot = r.u64()?;
        let data = Extent { offset: r.u64()?, len: r.u64()? };
        debug_assert_eq!(r.position(), SUPERBLOCK_FIELDS_BYTES);
        if let Some(i) = r.bytes(r.remaining())?.iter().position(|&b| b != 0) {
            return Err(corrupt(
                WHAT,
                format!("reserved byte at offset {} is not zero", SUPERBLOCK_FIELDS_BYTES + i),
            ));
        }
        let sb = Self {
            format_version,
            array_uuid,
            device_index,
            device_count,
            block_bytes,
            stripe_unit_bytes,
            alloc_unit_bytes,
            device_capacity_bytes,
            layout: DeviceLayout {
                capacity_bytes: device_capacity_bytes,
                block_bytes,
                alloc_unit_bytes,
                table_bytes,
                superblocks: [sb0, sb1]
                    .map(|offset| Extent { offset, len: u64::from(block_bytes) }),
                journal,
                checkpoints: [cp0, cp1].map(|offset| Extent { offset, len: slot }),
                data,
            },
            generation,
            created_unix_s,
        };
        sb.check().map_err(|d| corrupt(WHAT, d))?;
        Ok(sb)
    }
}

/// Decode both superblock copies of a device and pick the valid one with the highest
/// generation (copy 0 on a tie).
///
/// `copies[i]` holds the bytes read at [`SUPERBLOCK_OFFSETS`]`[i]` (at least one block; a
/// 64 KiB read is fine). The result says which copy won and what was wrong with the other:
/// when a copy is damaged or older, rewrite it from the winner.
///
/// Errors: when neither copy decodes, the error of copy 0, unless it is `BadMagic` and copy 1
/// failed otherwise (so "no teraio array here" is reported only when both copies say so).
/// `Corruption` when both copies are valid with the same generation but differ.
pub fn pick_superblock(copies: [&[u8]; 2]) -> Result<Chosen<Superblock>> {
    choose(WHAT, copies.map(Superblock::decode), |sb| sb.generation)
}
