//! The per-device extent allocator.
//!
//! The truth is a bitmap with one bit per allocation unit (1 = allocated). Two in-memory indexes
//! of the free extents make allocation and free O(log n) in the number of free extents:
//! `by_offset` (start unit -> length in units) finds neighbours to coalesce with, and `by_size`
//! (length, start packed in one `u128`) finds the best fit. Free extents in the indexes are
//! always maximal: two free extents never touch.
//!
//! Placement policy (deterministic, so a model can predict it):
//! 1. A request of `n` units that fits in one free extent takes the first `n` units of the
//!    smallest free extent of at least `n` units (ties: lowest offset).
//! 2. Otherwise it takes whole free extents, the largest first (ties: lowest offset), until the
//!    rest fits in one free extent, where rule 1 places it. This yields the fewest extents.
//!
//! Extents are returned in offset order.

use std::collections::{BTreeMap, BTreeSet};

use bitvec::prelude::{BitVec, Lsb0};
use serde::{Deserialize, Serialize};
use teraio_layout::Extent;

use crate::{Error, Result};

/// The smallest allocation unit: the O_DIRECT-safe block size.
pub const MIN_UNIT_BYTES: u64 = 4096;
/// The default allocation unit.
pub const DEFAULT_UNIT_BYTES: u64 = 1 << 20;

/// Space accounting of one device (or, in [`crate::ArrayStats::total`], of the array).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Bytes the allocator manages: whole allocation units.
    pub capacity_bytes: u64,
    /// Bytes allocated.
    pub used_bytes: u64,
    /// Bytes free; `used_bytes + free_bytes == capacity_bytes`.
    pub free_bytes: u64,
    /// Length of the largest free extent in bytes.
    pub largest_free_bytes: u64,
    /// Number of (maximal) free extents.
    pub free_extents: u64,
    /// `1 - largest_free_bytes / free_bytes`: 0 when all free space is one extent (or nothing is
    /// free), approaching 1 as free space splinters into many small extents.
    pub fragmentation: f64,
}

impl Stats {
    pub(crate) fn fragmentation_of(largest_free_bytes: u64, free_bytes: u64) -> f64 {
        if free_bytes == 0 { 0.0 } else { 1.0 - largest_free_bytes as f64 / free_bytes as f64 }
    }
}

/// Pack a free extent as a `by_size` key: ordered by length, then by start.
#[inline]
fn size_key(len: u64, start: u64) -> u128 {
    (u128::from(len) << 64) | u128::from(start)
}

/// Unpack a `by_size` key into (length, start).
#[inline]
fn split_key(key: u128) -> (u64, u64) {
    ((key >> 64) as u64, key as u64)
}

/// Allocator of one device's byte range `[base_bytes, base_bytes + capacity)` in whole units.
///
/// Every failing call leaves the allocator exactly as it was.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    device: u32,
    base_bytes: u64,
    unit_bytes: u64,
    unit_shift: u32,
    units: u64,
    /// One bit per unit, 1 = allocated. The persistable truth.
    bits: BitVec<u64, Lsb0>,
    /// Free extents: start unit -> length in units.
    by_offset: BTreeMap<u64, u64>,
    /// Free extents as `size_key(len, start)`.
    by_size: BTreeSet<u128>,
    free_units: u64,
}

impl ExtentAllocator {
    /// An allocator with everything free.
    ///
    /// `unit_bytes` must be a power of two >= [`MIN_UNIT_BYTES`]; `base_bytes` a multiple of
    /// [`MIN_UNIT_BYTES`]. The allocator manages `len_bytes / unit_bytes` whole units starting at
    /// `base_bytes`; a tail shorter than one unit is not used. Construction is O(units / 64):
    /// only the bitmap is sized by the device.
    pub fn new(device: u32, base_bytes: u64, len_bytes: u64, unit_bytes: u64) -> Result<Self> {
        if !unit_bytes.is_power_of_two() || unit_bytes < MIN_UNIT_BYTES {
            return Err(Error::InvalidArgument(format!(
                "allocation unit {unit_bytes} must be a power of two >= {MIN_UNIT_BYTES}"
            )));
        }
        if !base_bytes.is_multiple_of(MIN_UNIT_BYTES) {
            return Err(Error::InvalidArgument(format!(
                "device {device}: base offset {base_bytes} is not a multiple of {MIN_UNIT_BYTES}"
            )));
        }
        let units = len_bytes / unit_bytes;
        if units == 0 {
            return Err(Error::InvalidArgument(format!(
                "device {device}: {len_bytes} bytes hold no whole allocation unit of {unit_bytes}"
            )));
        }
        if base_bytes.checked_add(units * unit_bytes).is_none() {
            return Err(Error::InvalidArgument(format!(
                "device {device}: range at {base_bytes} (+{len_bytes} bytes) overflows"
            )));
        }
        let Ok(units_usize) = usize::try_from(units) else {
            return Err(Error::InvalidArgument(format!(
                "device {device}: {units} units do not fit in memory on this platform"
            )));
        };
        let mut this = Self {
            device,
            base_bytes,
            unit_bytes,
            unit_shift: unit_bytes.trailing_zeros(),
            units,
            bits: BitVec::repeat(false, units_usize),
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free_units: 0,
        };
        this.insert_free(0, units);
        this.free_units = units;
        Ok(this)
    }

    /// Rebuild an allocator from a bitmap written by [`ExtentAllocator::bitmap_bytes`].
    ///
    /// The bitmap must be exactly `ceil(units / 8)` bytes with the padding bits after the last
    /// unit clear; otherwise [`Error::Corruption`]. Never panics on any byte string.
    pub fn from_bitmap(
        device: u32,
        base_bytes: u64,
        len_bytes: u64,
        unit_bytes: u64,
        bits: &[u8],
    ) -> Result<Self> {
        let mut this = Self::new(device, base_bytes, len_bytes, unit_bytes)?;
        let units = this.units as usize;
        let expected = units.div_ceil(8);
        if bits.len() != expected {
            return Err(Error::Corruption(format!(
                "device {device}: bitmap is {} bytes, {units} units need {expected}",
                bits.len()
            )));
        }
        let words: Vec<u64> = bits
            .chunks(8)
            .map(|chunk| {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                u64::from_le_bytes(word)
            })
            .collect();
        let mut loaded: BitVec<u64, Lsb0> = BitVec::from_vec(words);
        if loaded[units..].any() {
            return Err(Error::Corruption(format!(
                "device {device}: bitmap has bits set beyond its last unit ({units})"
            )));
        }
        loaded.truncate(units);
        this.bits = loaded;
        this.by_offset.clear();
        this.by_size.clear();
        this.free_units = 0;
        let runs: Vec<(u64, u64)> = free_runs(&this.bits).collect();
        for (start, len) in runs {
            this.insert_free(start, len);
            this.free_units += len;
        }
        Ok(this)
    }

    /// The device index this allocator serves.
    pub fn device(&self) -> u32 {
        self.device
    }

    /// The first byte offset managed.
    pub fn base_bytes(&self) -> u64 {
        self.base_bytes
    }

    /// The allocation unit in bytes.
    pub fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }

    /// Number of allocation units managed.
    pub fn unit_count(&self) -> u64 {
        self.units
    }

    /// Bytes managed (whole units).
    pub fn capacity_bytes(&self) -> u64 {
        self.units << self.unit_shift
    }

    /// Bytes free.
    pub fn free_bytes(&self) -> u64 {
        self.free_units << self.unit_shift
    }

    /// Bytes allocated.
    pub fn used_bytes(&self) -> u64 {
        (self.units - self.free_units) << self.unit_shift
    }

    /// Length of the largest free extent in bytes (0 when full).
    pub fn largest_free_bytes(&self) -> u64 {
        self.by_size.last().map_or(0, |&k| split_key(k).0 << self.unit_shift)
    }

    /// `bytes` rounded up to whole allocation units.
    pub fn round_up(&self, bytes: u64) -> u64 {
        bytes.div_ceil(self.unit_bytes).saturating_mul(self.unit_bytes)
    }

    /// The free extents in offset order (each maximal).
    pub fn free_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        self.by_offset.iter().map(|(&start, &len)| self.extent(start, len))
    }

    /// Allocate `bytes` rounded up to whole units: one extent when some free extent is large
    /// enough (best fit), else the fewest extents (largest first). See the module docs for the
    /// exact policy. Extents are returned in offset order.
    ///
    /// [`Error::NoSpace`] when fewer free bytes remain than asked for; nothing is allocated then.
    pub fn alloc(&mut self, bytes: u64) -> Result<Vec<Extent>> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "device {}: cannot allocate 0 bytes",
                self.device
            )));
        }
        let need = bytes.div_ceil(self.unit_bytes);
        if need > self.free_units {
            return Err(Error::NoSpace {
                requested_bytes: bytes,
                free_bytes: self.free_bytes(),
                device: Some(self.device),
            });
        }
        let mut out = Vec::with_capacity(1);
        let mut rest = need;
        // Each pass removes one free extent, so the loop ends after at most `free extents` passes.
        loop {
            if let Some(&key) = self.by_size.range(size_key(rest, 0)..).next() {
                let (len, start) = split_key(key);
                self.take(start, len, rest);
                out.push(self.extent(start, rest));
                break;
            }
            // `free_units >= rest > 0` and no extent holds `rest`: a smaller one exists.
            let &largest = self.by_size.last().expect("free units are held by free extents");
            let (max_len, _) = split_key(largest);
            let &key = self
                .by_size
                .range(size_key(max_len, 0)..)
                .next()
                .expect("the largest length is present");
            let (len, start) = split_key(key);
            self.take(start, len, len);
            out.push(self.extent(start, len));
            rest -= len;
        }
        self.free_units -= need;
        if out.len() > 1 {
            out.sort_unstable_by_key(|e| e.offset);
        }
        Ok(out)
    }

    /// Free an allocated extent (whole units, any part of an earlier allocation) and coalesce it
    /// with free neighbours.
    ///
    /// [`Error::NotAllocated`] if any unit of it is free (a double free); nothing changes then.
    pub fn free(&mut self, extent: Extent) -> Result<()> {
        let (start, len) = self.check_allocated_units(extent)?;
        self.bits[start as usize..(start + len) as usize].fill(false);
        let end = start + len;
        let right_len = self.by_offset.remove(&end);
        if let Some(right_len) = right_len {
            self.by_size.remove(&size_key(right_len, end));
        }
        let merged = len + right_len.unwrap_or(0);
        // A left neighbour that ends at `start` grows in place (its key stays).
        match self.by_offset.range_mut(..start).next_back() {
            Some((&left, left_len)) if left + *left_len == start => {
                self.by_size.remove(&size_key(*left_len, left));
                *left_len += merged;
                self.by_size.insert(size_key(*left_len, left));
            }
            _ => self.insert_free(start, merged),
        }
        self.free_units += len;
        Ok(())
    }

    /// Mark an extent allocated, as when rebuilding from metadata on reopen.
    ///
    /// [`Error::AlreadyAllocated`] if any unit of it is allocated; nothing changes then.
    pub fn mark_allocated(&mut self, extent: Extent) -> Result<()> {
        let (start, len) = self.check_free_units(extent)?;
        // Free extents are maximal, so a wholly free range lies inside exactly one of them.
        let (&free_start, &free_len) =
            self.by_offset.range(..=start).next_back().expect("a free unit lies in a free extent");
        assert!(
            free_start + free_len >= start + len,
            "device {}: free range {start}+{len} units is not inside one free extent \
             ({free_start}+{free_len}); the indexes disagree with the bitmap",
            self.device
        );
        self.remove_free(free_start, free_len);
        if start > free_start {
            self.insert_free(free_start, start - free_start);
        }
        let end = start + len;
        if end < free_start + free_len {
            self.insert_free(end, free_start + free_len - end);
        }
        self.bits[start as usize..end as usize].fill(true);
        self.free_units -= len;
        Ok(())
    }

    /// Ok when every unit of `extent` is allocated: what [`ExtentAllocator::free`] requires.
    pub fn check_allocated(&self, extent: Extent) -> Result<()> {
        self.check_allocated_units(extent).map(|_| ())
    }

    /// Ok when every unit of `extent` is free: what [`ExtentAllocator::mark_allocated`] requires.
    pub fn check_free(&self, extent: Extent) -> Result<()> {
        self.check_free_units(extent).map(|_| ())
    }

    /// The bitmap, one bit per unit (bit `i % 8` of byte `i / 8`, 1 = allocated), padding bits
    /// clear. Feed it to [`ExtentAllocator::from_bitmap`] to rebuild.
    pub fn bitmap_bytes(&self) -> Vec<u8> {
        let len = (self.units as usize).div_ceil(8);
        let mut out: Vec<u8> =
            self.bits.as_raw_slice().iter().flat_map(|word| word.to_le_bytes()).collect();
        out.truncate(len);
        if let Some(last) = out.last_mut()
            && !self.units.is_multiple_of(8)
        {
            // Padding bits of the last byte: the bitvec may keep stale bits past its length.
            *last &= (1u8 << (self.units % 8)) - 1;
        }
        out
    }

    /// Used, free, largest free extent, fragmentation. O(1).
    pub fn stats(&self) -> Stats {
        let free_bytes = self.free_bytes();
        let largest_free_bytes = self.largest_free_bytes();
        Stats {
            capacity_bytes: self.capacity_bytes(),
            used_bytes: self.used_bytes(),
            free_bytes,
            largest_free_bytes,
            free_extents: self.by_offset.len() as u64,
            fragmentation: Stats::fragmentation_of(largest_free_bytes, free_bytes),
        }
    }

    /// Verify that the indexes describe exactly the free runs of the bitmap (maximal, no
    /// overlap), that both indexes agree, and that used + free = capacity. O(units / 64 + free
    /// extents); meant for tests and after a rebuild, not for the hot path.
    pub fn check_invariants(&self) -> Result<()> {
        let dev = self.device;
        if self.bits.len() as u64 != self.units {
            return Err(Error::Corruption(format!(
                "device {dev}: bitmap has {} bits for {} units",
                self.bits.len(),
                self.units
            )));
        }
        if self.by_offset.len() != self.by_size.len() {
            return Err(Error::Corruption(format!(
                "device {dev}: {} free extents by offset but {} by size",
                self.by_offset.len(),
                self.by_size.len()
            )));
        }
        let mut runs = free_runs(&self.bits);
        let mut free_units = 0u64;
        for (&start, &len) in &self.by_offset {
            let run = runs.next();
            if run != Some((start, len)) {
                return Err(Error::Corruption(format!(
                    "device {dev}: free extent {start}+{len} units in the index, bitmap has {run:?}"
                )));
            }
            if !self.by_size.contains(&size_key(len, start)) {
                return Err(Error::Corruption(format!(
                    "device {dev}: free extent {start}+{len} units missing from the size index"
                )));
            }
            free_units += len;
        }
        if let Some(run) = runs.next() {
            return Err(Error::Corruption(format!(
                "device {dev}: bitmap free run {run:?} is missing from the index"
            )));
        }
        if free_units != self.free_units {
            return Err(Error::Corruption(format!(
                "device {dev}: free extents hold {free_units} units, the counter says {}",
                self.free_units
            )));
        }
        let used_units = self.bits.count_ones() as u64;
        if used_units + free_units != self.units {
            return Err(Error::Corruption(format!(
                "device {dev}: used {used_units} + free {free_units} units != capacity {}",
                self.units
            )));
        }
        Ok(())
    }

    /// Byte extent of `len` units at unit `start`.
    #[inline]
    fn extent(&self, start: u64, len: u64) -> Extent {
        Extent { offset: self.base_bytes + (start << self.unit_shift), len: len << self.unit_shift }
    }

    /// Validate `extent` as whole units inside the device: (start unit, length in units).
    fn units_of(&self, extent: Extent) -> Result<(u64, u64)> {
        let dev = self.device;
        let Extent { offset, len } = extent;
        let mask = self.unit_bytes - 1;
        let rel = offset.checked_sub(self.base_bytes).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "device {dev}: extent at {offset} starts before the managed range at {}",
                self.base_bytes
            ))
        })?;
        if rel & mask != 0 || len & mask != 0 || len == 0 {
            return Err(Error::InvalidArgument(format!(
                "device {dev}: extent at {offset} (+{len} bytes) is empty or not whole units of {}",
                self.unit_bytes
            )));
        }
        let start = rel >> self.unit_shift;
        let count = len >> self.unit_shift;
        if start >= self.units || count > self.units - start {
            return Err(Error::InvalidArgument(format!(
                "device {dev}: extent at {offset} (+{len} bytes) ends beyond the managed range \
                 ({} bytes at {})",
                self.capacity_bytes(),
                self.base_bytes
            )));
        }
        Ok((start, count))
    }

    fn check_allocated_units(&self, extent: Extent) -> Result<(u64, u64)> {
        let (start, len) = self.units_of(extent)?;
        if !self.bits[start as usize..(start + len) as usize].all() {
            return Err(Error::NotAllocated {
                device: self.device,
                offset: extent.offset,
                len: extent.len,
            });
        }
        Ok((start, len))
    }

    fn check_free_units(&self, extent: Extent) -> Result<(u64, u64)> {
        let (start, len) = self.units_of(extent)?;
        if self.bits[start as usize..(start + len) as usize].any() {
            return Err(Error::AlreadyAllocated {
                device: self.device,
                offset: extent.offset,
                len: extent.len,
            });
        }
        Ok((start, len))
    }

    /// Take the first `take` units of the free extent (`start`, `len`) and set their bits.
    #[inline]
    fn take(&mut self, start: u64, len: u64, take: u64) {
        debug_assert!(take <= len);
        self.remove_free(start, len);
        if take < len {
            self.insert_free(start + take, len - take);
        }
        self.bits[start as usize..(start + take) as usize].fill(true);
    }

    #[inline]
    fn insert_free(&mut self, start: u64, len: u64) {
        let fresh = self.by_offset.insert(start, len).is_none();
        debug_assert!(fresh, "free extent at unit {start} inserted twice");
        self.by_size.insert(size_key(len, start));
    }

    #[inline]
    fn remove_free(&mut self, start: u64, len: u64) {
        let removed = self.by_offset.remove(&start);
        debug_assert_eq!(removed, Some(len), "free extent at unit {start} not in the index");
        let present = self.by_size.remove(&size_key(len, start));
        debug_assert!(present, "free extent {start}+{len} not in the size index");
    }
}

/// The maximal runs of clear bits of `bits` as (start, length), in order. Word-wise scans.
fn free_runs(bits: &bitvec::slice::BitSlice<u64, Lsb0>) -> impl Iterator<Item = (u64, u64)> + '_ {
    let total = bits.len();
    let mut pos = 0usize;
    std::iter::from_fn(move || {
        if pos >= total {
            return None;
        }
        let start = pos + bits[pos..].first_zero()?;
        let end = bits[start..].first_one().map_or(total, |n| start + n);
        pos = end;
        Some((start as u64, (end - start) as u64))
    })
}
