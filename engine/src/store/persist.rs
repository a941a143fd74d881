//! Persistent mode: superblocks, the metadata journal and checkpoints on the array (format in
//! docs/FORMAT.md), and reopening a store after a clean close or a crash.
//!
//! Write order of an offload: data extents, `sync`, journal record naming them, `sync`; only
//! then is the offload acknowledged and its source memory released. A free appends a delete
//! record; the freed extents are not reused until the next checkpoint is durable, so a crash can
//! never hand one tensor's blocks to another. A checkpoint writes the tensor table (device 0)
//! and every device's allocator bitmap to the inactive slot, syncs, and restarts the journal.
//!
//! Reopen: pick each device's valid superblock, device 0's newest checkpoint, replay the journal
//! records after it (the scan stops cleanly at a torn tail), rebuild the allocator from the
//! table (cross-checked against the checkpoint bitmaps), refuse overlapping tensors, and sync
//! the devices (what was read is durable before the store shows it).

use std::collections::BTreeMap;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use serde::Serialize;
use teraio_allocator::{ArrayAllocator, ExtentAllocator};
use teraio_layout::StripeMap;
use teraio_layout::format::{
    Checkpoint, DeviceLayout, RecordBody, SUPERBLOCK_OFFSETS, ScanStop, Superblock, TensorRecord,
    encode_journal_batch, pick_checkpoint, pick_superblock, scan_journal,
};

use super::{SsdCopy, TensorKey};
use crate::array::DeviceArray;
use crate::pool::{BufferPool, IoBuf, PoolConfig};
use crate::{Error, Result};

/// The journal lives on device 0.
const JOURNAL_DEVICE: u32 = 0;

/// The layout of every device of `array` for allocation unit `unit`.
pub(crate) fn device_layouts(array: &DeviceArray, unit: u64) -> Result<Vec<DeviceLayout>> {
    let block = array.geometry().block_bytes;
    (0..array.device_count())
        .map(|d| Ok(DeviceLayout::with_defaults(array.device_capacity(d), block, unit)?))
        .collect()
}

fn check_failed(j: &JournalState) -> Result<()> {
    match &j.failed {
        Some(why) => Err(Error::Corruption(format!(
            "persistent metadata is read-only after an earlier failure ({why}); reopen the store"
        ))),
        None => Ok(()),
    }
}

impl Persistence {
    /// Whether an earlier metadata write failed (the store then writes no more metadata).
    pub(crate) fn failed(&self) -> bool {
        self.journal.lock().failed.is_some()
    }
}

/// A device's chosen superblock, with a note when one copy is damaged.
type SuperblockAndNote = (Superblock, Option<String>);

/// A tensor recovered from the array: id, name, copy.
pub(crate) type Recovered = (TensorKey, Option<String>, SsdCopy);

struct JournalState {
    /// Set when a metadata write failed: what is durable is then unknown, so nothing more is
    /// written until the store is reopened (which reads back what actually is).
    failed: Option<String>,
    next_seq: u64,
    used_bytes: u64,
    generation: u64,
    pending_free: Vec<StripeMap>,
}

/// The persistent metadata of an open store.
pub struct Persistence {
    uuid: [u8; 16],
    layouts: Vec<DeviceLayout>,
    block_bytes: u32,
    journal: Mutex<JournalState>,
    /// Commits (journal append + table update) hold it shared; a checkpoint holds it exclusive,
    /// so the table it captures reflects every record it covers.
    gate: RwLock<()>,
    io: std::sync::Arc<BufferPool>,
}

/// What `teraio inspect` shows of an array: read without changing a byte.
#[derive(Debug, Clone, Serialize)]
pub struct StoreMeta {
    /// Array uuid, hex.
    pub array_uuid: String,
    /// One entry per device.
    pub devices: Vec<DeviceMeta>,
    /// Generation of the checkpoint the table was loaded from.
    pub checkpoint_generation: u64,
    /// Journal records replayed on top of it.
    pub journal_records: usize,
    /// Bytes of the journal in use.
    pub journal_used_bytes: u64,
    /// Why the journal scan stopped.
    pub journal_stop: String,
    /// The live tensors.
    pub tensors: Vec<TensorMeta>,
}

/// One device of an inspected array.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceMeta {
    /// Index in the array.
    pub index: u32,
    /// Path or name.
    pub name: String,
    /// Capacity in bytes.
    pub capacity_bytes: u64,
    /// Superblock generation.
    pub superblock_generation: u64,
    /// A note when one superblock copy is damaged or stale.
    pub superblock_note: Option<String>,
    /// Block size, stripe unit, allocation unit.
    pub block_bytes: u32,
    /// Stripe unit.
    pub stripe_unit_bytes: u64,
    /// Allocation unit.
    pub alloc_unit_bytes: u64,
    /// Data region offset and length.
    pub data_offset: u64,
    /// Data region length.
    pub data_bytes: u64,
    /// Bytes used by live tensors.
    pub used_bytes: u64,
    /// Largest free extent.
    pub largest_free_bytes: u64,
    /// Number of free extents.
    pub free_extents: u64,
}

/// One tensor of an inspected array.
#[derive(Debug, Clone, Serialize)]
pub struct TensorMeta {
    /// Id.
    pub id: TensorKey,
    /// Name.
    pub name: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Number of extents over all devices.
    pub extents: usize,
    /// Devices it is striped over.
    pub lanes: usize,
    /// Checksummed chunks.
    pub checksums: usize,
}

fn record_of(id: TensorKey, name: Option<&str>, c: &SsdCopy) -> TensorRecord {
    TensorRecord {
        id: id.get(),
        name: name.unwrap_or_default().to_owned(),
        size_bytes: c.map.size_bytes(),
        stripe: c.map.clone(),
        checksum_chunk_bytes: if c.checksums.is_empty() { 0 } else { c.chunk_bytes },
        checksums: c.checksums.clone(),
    }
}

fn copy_of(r: TensorRecord) -> Recovered {
    let name = (!r.name.is_empty()).then_some(r.name);
    let chunk =
        if r.checksum_chunk_bytes == 0 { r.stripe.unit_bytes() } else { r.checksum_chunk_bytes };
    (TensorKey(r.id), name, SsdCopy { map: r.stripe, chunk_bytes: chunk, checksums: r.checksums })
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Everything read from an array's metadata.
struct Loaded {
    superblocks: Vec<SuperblockAndNote>,
    checkpoint: Checkpoint,
    bitmaps: Vec<Option<Checkpoint>>,
    table: BTreeMap<u64, TensorRecord>,
    records: usize,
    journal_used: u64,
    next_seq: u64,
    stop: ScanStop,
}

impl Persistence {
    fn read(
        array: &DeviceArray,
        pool: &std::sync::Arc<BufferPool>,
        device: u32,
        offset: u64,
        len: u64,
    ) -> Result<IoBuf> {
        let buf = pool.alloc(len as usize)?;
        let (buf, r) = array.read_at(device, offset, buf)?.wait();
        r?;
        Ok(buf)
    }

    fn write(
        array: &DeviceArray,
        pool: &std::sync::Arc<BufferPool>,
        device: u32,
        offset: u64,
        bytes: &[u8],
    ) -> Result<()> {
        let mut buf = pool.alloc(bytes.len())?;
        buf.copy_from_slice(bytes);
        let (_, r) = array.write_at(device, offset, buf)?.wait();
        r
    }

    fn io_pool() -> Result<std::sync::Arc<BufferPool>> {
        BufferPool::new(PoolConfig { capacity_bytes: 512 << 20, prefer_huge_pages: false })
    }

    /// Read superblocks; `Ok(None)` when no device holds a teraio superblock (a fresh array).
    fn read_superblocks(
        array: &DeviceArray,
        pool: &std::sync::Arc<BufferPool>,
    ) -> Result<Option<Vec<SuperblockAndNote>>> {
        let n = array.device_count();
        let mut found = Vec::new();
        let mut missing = Vec::new();
        for d in 0..n {
            let area = Self::read(
                array,
                pool,
                d,
                0,
                SUPERBLOCK_OFFSETS[1] + u64::from(array.geometry().block_bytes),
            )?;
            let copies = [&area[..], &area[SUPERBLOCK_OFFSETS[1] as usize..]];
            match pick_superblock(copies) {
                Ok(chosen) => {
                    let note = chosen
                        .damaged()
                        .map(|(i, e)| format!("superblock copy {i} is damaged: {e}"));
                    found.push((chosen.value, note));
                }
                Err(teraio_layout::Error::BadMagic { .. }) => missing.push(d),
                Err(e) => {
                    return Err(Error::Corruption(format!(
                        "device {d} ({}): superblock: {e}",
                        array.device_name(d)
                    )));
                }
            }
        }
        if found.is_empty() {
            return Ok(None);
        }
        if !missing.is_empty() {
            return Err(Error::Corruption(format!(
                "devices {missing:?} hold no teraio superblock while the others do: wrong or missing device?"
            )));
        }
        let uuid = found[0].0.array_uuid;
        for (d, (sb, _)) in found.iter().enumerate() {
            if sb.array_uuid != uuid {
                return Err(Error::Corruption(format!(
                    "device {d} ({}) belongs to array {}, device 0 to {}",
                    array.device_name(d as u32),
                    hex(&sb.array_uuid),
                    hex(&uuid)
                )));
            }
            if sb.device_index != d as u32 || sb.device_count != n {
                return Err(Error::Corruption(format!(
                    "device {d} ({}) says it is device {} of {}, but the array was opened with {n} devices in this order",
                    array.device_name(d as u32),
                    sb.device_index,
                    sb.device_count
                )));
            }
            if sb.device_capacity_bytes > array.device_capacity(d as u32) {
                return Err(Error::Corruption(format!(
                    "device {d} was formatted with {} bytes but has {}",
                    sb.device_capacity_bytes,
                    array.device_capacity(d as u32)
                )));
            }
        }
        Ok(Some(found))
    }

    fn load(
        array: &DeviceArray,
        pool: &std::sync::Arc<BufferPool>,
        superblocks: Vec<SuperblockAndNote>,
    ) -> Result<Loaded> {
        let mut bitmaps = Vec::new();
        let mut cp0 = None;
        for (d, (sb, _)) in superblocks.iter().enumerate() {
            let l = &sb.layout;
            let s0 =
                Self::read(array, pool, d as u32, l.checkpoints[0].offset, l.checkpoints[0].len)?;
            let s1 =
                Self::read(array, pool, d as u32, l.checkpoints[1].offset, l.checkpoints[1].len)?;
            match pick_checkpoint([&s0[..], &s1[..]]) {
                Ok(c) if c.value.array_uuid == sb.array_uuid => {
                    if d == 0 {
                        cp0 = Some(c.value.clone());
                    }
                    bitmaps.push(Some(c.value));
                }
                Ok(_) => {
                    return Err(Error::Corruption(format!(
                        "device {d}: checkpoint of another array"
                    )));
                }
                Err(e) if d == 0 => {
                    return Err(Error::Corruption(format!("device 0: no valid checkpoint: {e}")));
                }
                Err(_) => bitmaps.push(None),
            }
        }
        let checkpoint = cp0.expect("device 0 checked above");
        let mut table: BTreeMap<u64, TensorRecord> =
            checkpoint.tensors.iter().cloned().map(|t| (t.id, t)).collect();
        let jl = superblocks[0].0.layout.journal;
        let bytes = Self::read(array, pool, JOURNAL_DEVICE, jl.offset, jl.len)?;
        let scan = scan_journal(&bytes, superblocks[0].0.block_bytes, checkpoint.journal_seq + 1)
            .map_err(|e| Error::Corruption(format!("journal: {e}")))?;
        let mut records = 0;
        for (_, rec) in scan.records() {
            records += 1;
            match rec {
                RecordBody::PutTensor(t) => {
                    table.insert(t.id, t.clone());
                }
                RecordBody::DeleteTensor { id } => {
                    table.remove(id);
                }
                RecordBody::Checkpoint { .. } => {}
            }
        }
        Ok(Loaded {
            superblocks,
            checkpoint,
            bitmaps,
            table,
            records,
            journal_used: scan.bytes_used,
            next_seq: scan.next_seq,
            stop: scan.stop,
        })
    }

    /// Build the allocator from the table, refusing overlaps and tensors outside the data
    /// regions, and cross-check the checkpoint bitmaps.
    fn rebuild(
        array: &DeviceArray,
        layouts: &[DeviceLayout],
        loaded: &Loaded,
    ) -> Result<ArrayAllocator> {
        let unit = layouts[0].alloc_unit_bytes;
        let devices = layouts
            .iter()
            .enumerate()
            .map(|(i, l)| ExtentAllocator::new(i as u32, l.data.offset, l.data.len, unit))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut alloc = ArrayAllocator::new(array.geometry(), devices)?;
        for t in loaded.table.values() {
            alloc.mark_tensor(&t.stripe).map_err(|e| {
                Error::Corruption(format!(
                    "tensor {} ({}): its extents cannot be claimed: {e}",
                    t.id, t.name
                ))
            })?;
        }
        // Tensors of the checkpoint (not replaced since) must be marked in their device's bitmap.
        for t in loaded.checkpoint.tensors.iter().filter(|t| loaded.table.get(&t.id) == Some(t)) {
            for (dev, e) in t.stripe.extents() {
                let Some(Some(cp)) = loaded.bitmaps.get(dev as usize) else { continue };
                if cp.generation != loaded.checkpoint.generation {
                    continue;
                }
                let l = &layouts[dev as usize];
                let first = (e.offset - l.data.offset) / unit;
                let last = (e.end() - l.data.offset).div_ceil(unit);
                if let Some(u) = (first..last).find(|&u| !cp.unit_in_use(u)) {
                    return Err(Error::Corruption(format!(
                        "tensor {} uses allocation unit {u} of device {dev}, which the checkpoint bitmap marks free",
                        t.id
                    )));
                }
            }
        }
        Ok(alloc)
    }

    /// Open the metadata of `array`: format it when it holds no teraio array, else load it.
    /// Returns the allocator and the live tensors.
    pub(crate) fn open(
        array: &DeviceArray,
        unit: u64,
    ) -> Result<(Self, ArrayAllocator, Vec<Recovered>)> {
        let pool = Self::io_pool()?;
        let Some(superblocks) = Self::read_superblocks(array, &pool)? else {
            return Self::format(array, unit, pool);
        };
        let layouts: Vec<_> = superblocks.iter().map(|(s, _)| s.layout).collect();
        let loaded = Self::load(array, &pool, superblocks)?;
        let alloc = Self::rebuild(array, &layouts, &loaded)?;
        // What was read may sit in a device's cache, not yet on stable storage (a journal write
        // whose sync failed before a restart): make it durable before the store shows it, or a
        // power loss could undo what the reopened store reported (a deleted tensor back).
        array.sync()?;
        let generation = loaded.checkpoint.generation;
        let p = Self {
            uuid: loaded.checkpoint.array_uuid,
            block_bytes: array.geometry().block_bytes,
            layouts,
            journal: Mutex::new(JournalState {
                failed: None,
                next_seq: loaded.next_seq,
                used_bytes: loaded.journal_used,
                generation,
                pending_free: Vec::new(),
            }),
            gate: RwLock::new(()),
            io: pool,
        };
        let tensors = loaded.table.into_values().map(copy_of).collect();
        Ok((p, alloc, tensors))
    }

    fn format(
        array: &DeviceArray,
        unit: u64,
        pool: std::sync::Arc<BufferPool>,
    ) -> Result<(Self, ArrayAllocator, Vec<Recovered>)> {
        let layouts = device_layouts(array, unit)?;
        let uuid: [u8; 16] = rand::random();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let p = Self {
            uuid,
            block_bytes: array.geometry().block_bytes,
            layouts,
            journal: Mutex::new(JournalState {
                failed: None,
                next_seq: 1,
                used_bytes: 0,
                generation: 0,
                pending_free: Vec::new(),
            }),
            gate: RwLock::new(()),
            io: pool,
        };
        let devices = p
            .layouts
            .iter()
            .enumerate()
            .map(|(i, l)| ExtentAllocator::new(i as u32, l.data.offset, l.data.len, unit))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let mut alloc = ArrayAllocator::new(array.geometry(), devices)?;
        // Journal and both checkpoint slots zeroed first, then a first checkpoint, then the
        // superblocks last: a crash while formatting leaves no superblock, i.e. no array.
        let block = u64::from(p.block_bytes);
        for (d, l) in p.layouts.iter().enumerate() {
            let zero = vec![0u8; block as usize];
            Self::write(array, &p.io, d as u32, l.journal.offset, &zero)?;
            Self::write(array, &p.io, d as u32, l.checkpoints[1].offset, &zero)?;
        }
        p.write_checkpoint(array, &mut alloc, &[])?;
        let stripe = array.geometry().stripe_unit_bytes;
        for (d, l) in p.layouts.iter().enumerate() {
            let sb = Superblock::new(uuid, d as u32, array.device_count(), stripe, *l, 1, now)?;
            let bytes = sb.encode()?;
            for off in SUPERBLOCK_OFFSETS {
                Self::write(array, &p.io, d as u32, off, &bytes)?;
            }
        }
        array.sync()?;
        Ok((p, alloc, Vec::new()))
    }

    /// Read an array's metadata without writing: for `teraio inspect`.
    pub fn inspect(array: &DeviceArray) -> Result<StoreMeta> {
        let pool = Self::io_pool()?;
        let Some(superblocks) = Self::read_superblocks(array, &pool)? else {
            return Err(Error::InvalidArgument(
                "no teraio array on these devices (no superblock found)".into(),
            ));
        };
        let layouts: Vec<_> = superblocks.iter().map(|(s, _)| s.layout).collect();
        let loaded = Self::load(array, &pool, superblocks)?;
        let alloc = Self::rebuild(array, &layouts, &loaded)?;
        let stats = alloc.stats();
        let devices = loaded
            .superblocks
            .iter()
            .enumerate()
            .map(|(i, (sb, note))| {
                let s = &stats.devices[i];
                DeviceMeta {
                    index: i as u32,
                    name: array.device_name(i as u32),
                    capacity_bytes: sb.device_capacity_bytes,
                    superblock_generation: sb.generation,
                    superblock_note: note.clone(),
                    block_bytes: sb.block_bytes,
                    stripe_unit_bytes: sb.stripe_unit_bytes,
                    alloc_unit_bytes: sb.alloc_unit_bytes,
                    data_offset: sb.layout.data.offset,
                    data_bytes: sb.layout.data.len,
                    used_bytes: s.used_bytes,
                    largest_free_bytes: s.largest_free_bytes,
                    free_extents: s.free_extents,
                }
            })
            .collect();
        Ok(StoreMeta {
            array_uuid: hex(&loaded.checkpoint.array_uuid),
            devices,
            checkpoint_generation: loaded.checkpoint.generation,
            journal_records: loaded.records,
            journal_used_bytes: loaded.journal_used,
            journal_stop: format!("{:?}", loaded.stop),
            tensors: loaded
                .table
                .values()
                .map(|t| TensorMeta {
                    id: TensorKey(t.id),
                    name: t.name.clone(),
                    size_bytes: t.size_bytes,
                    extents: t.stripe.extents().count(),
                    lanes: t.stripe.lanes().len(),
                    checksums: t.checksums.len(),
                })
                .collect(),
        })
    }

    /// Hold this while appending a record and applying it to the table.
    pub(crate) fn commit_gate(&self) -> RwLockReadGuard<'_, ()> {
        self.gate.read()
    }

    /// Append one record to the journal and make it durable. `Ok(false)`: the journal is full
    /// (checkpoint, then retry).
    pub(crate) fn append(&self, array: &DeviceArray, record: RecordBody) -> Result<bool> {
        let mut j = self.journal.lock();
        check_failed(&j)?;
        let bytes =
            encode_journal_batch(j.next_seq, std::slice::from_ref(&record), self.block_bytes)?;
        let region = self.layouts[JOURNAL_DEVICE as usize].journal;
        if j.used_bytes + bytes.len() as u64 > region.len {
            return Ok(false);
        }
        let written =
            Self::write(array, &self.io, JOURNAL_DEVICE, region.offset + j.used_bytes, &bytes)
                .and_then(|()| array.sync());
        if let Err(e) = written {
            j.failed = Some(format!("journal append failed: {e}"));
            return Err(e);
        }
        j.used_bytes += bytes.len() as u64;
        j.next_seq += 1;
        Ok(true)
    }

    /// The record of a put.
    pub(crate) fn put_record(id: TensorKey, name: Option<&str>, copy: &SsdCopy) -> RecordBody {
        RecordBody::PutTensor(record_of(id, name, copy))
    }

    /// Remember extents to free at the next checkpoint.
    pub(crate) fn defer_free(&self, map: StripeMap) {
        self.journal.lock().pending_free.push(map);
    }

    /// `Ok` unless an earlier metadata write failed (then nothing more is written).
    pub(crate) fn writable(&self) -> Result<()> {
        check_failed(&self.journal.lock())
    }

    /// Whether extents wait for the next checkpoint to become free.
    pub(crate) fn has_deferred_frees(&self) -> bool {
        !self.journal.lock().pending_free.is_empty()
    }

    /// Held while a checkpoint captures the table: no commit is half applied.
    pub(crate) fn exclusive_gate(&self) -> parking_lot::RwLockWriteGuard<'_, ()> {
        self.gate.write()
    }

    /// Write a checkpoint of `tensors` (the whole live table) and restart the journal; then free
    /// the extents deferred since the last one. The caller holds [`Self::exclusive_gate`] and
    /// the table lock.
    pub(crate) fn write_checkpoint(
        &self,
        array: &DeviceArray,
        alloc: &mut ArrayAllocator,
        tensors: &[Recovered],
    ) -> Result<()> {
        let mut j = self.journal.lock();
        check_failed(&j)?;
        let generation = j.generation + 1;
        let slot = (generation % 2) as usize;
        let unit = self.layouts[0].alloc_unit_bytes;
        let mut records: Vec<TensorRecord> =
            tensors.iter().map(|(id, name, c)| record_of(*id, name.as_deref(), c)).collect();
        records.sort_by_key(|r| r.id);
        for (d, l) in self.layouts.iter().enumerate() {
            let bits = l.data_units();
            let mut bitmap = vec![0u8; bits.div_ceil(8) as usize];
            for r in &records {
                for (dev, e) in r.stripe.extents().filter(|(dev, _)| *dev as usize == d) {
                    debug_assert_eq!(dev as usize, d);
                    let first = (e.offset - l.data.offset) / unit;
                    let last = (e.end() - l.data.offset).div_ceil(unit);
                    for u in first..last {
                        bitmap[(u / 8) as usize] |= 1 << (u % 8);
                    }
                }
            }
            let cp = Checkpoint {
                array_uuid: self.uuid,
                generation,
                journal_seq: j.next_seq - 1,
                device_index: d as u32,
                alloc_unit_bytes: unit,
                bitmap_bits: bits,
                bitmap,
                tensors: if d == 0 { records.clone() } else { Vec::new() },
            };
            let bytes = cp.encode(self.block_bytes)?;
            if bytes.len() as u64 > l.checkpoints[slot].len {
                return Err(Error::NoSpace(format!(
                    "checkpoint of {} tensors needs {} bytes, the slot holds {}",
                    records.len(),
                    bytes.len(),
                    l.checkpoints[slot].len
                )));
            }
            if let Err(e) =
                Self::write(array, &self.io, d as u32, l.checkpoints[slot].offset, &bytes)
            {
                j.failed = Some(format!("checkpoint write failed: {e}"));
                return Err(e);
            }
        }
        if let Err(e) = array.sync() {
            j.failed = Some(format!("checkpoint sync failed: {e}"));
            return Err(e);
        }
        // The journal restarts: records up to next_seq - 1 are in the checkpoint; stale batches
        // left in the region have lower sequence numbers and end the scan.
        j.generation = generation;
        j.used_bytes = 0;
        for map in j.pending_free.drain(..) {
            alloc
                .free_tensor(&map)
                .map_err(|e| Error::Corruption(format!("deferred free: {e}")))?;
        }
        Ok(())
    }
}
