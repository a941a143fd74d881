//! The per-device extent allocator.
//!
//! The truth is a bitmap with one bit per allocation unit (1 = allocated), with summary levels
//! ([`LevelBits`]) that find the nearest allocated unit left or right of any unit in a few word
//! reads. Free extents are always maximal (two free extents never touch), so the bitmap alone
//! says where each free extent starts and ends: freeing finds its free neighbours there, with no
//! index by offset. One index, [`SizeIndex`], orders the free extents by (length, start) for best
//! fit: an exact-length bin per short length (an occupancy bit set finds the smallest non-empty
//! bin at or above a length) and one ordered set for the few long extents.
//!
//! Placement policy (deterministic, so a model can predict it):
//! 1. A request of `n` units that fits in one free extent takes the first `n` units of the
//!    smallest free extent of at least `n` units (ties: lowest offset).
//! 2. Otherwise it takes whole free extents, the largest first (ties: lowest offset), until the
//!    rest fits in one free extent, where rule 1 places it. This yields the fewest extents.
//!
//! Extents are returned in offset order.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use teraio_layout::{Extent, Extents};

use crate::bits::LevelBits;
use crate::blocks::BlockSet;
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

/// The most exact-length bins of a [`SizeIndex`]: free extents of 4096 units or more (4 GiB in
/// 1 MiB units) share one ordered set, which then holds at most `units / 4096` of them.
const BINS_MAX: u64 = 4096;

/// Pack a long free extent as a key of [`SizeIndex::long`]: ordered by length, then by start.
#[inline]
fn size_key(len: u64, start: u64) -> u128 {
    (u128::from(len) << 64) | u128::from(start)
}

/// Unpack a [`SizeIndex::long`] key into (length, start).
#[inline]
fn split_key(key: u128) -> (u64, u64) {
    ((key >> 64) as u64, key as u64)
}

/// The free extents of one device ordered by (length, start): what best fit searches.
///
/// A free extent of `len < bins.len()` units lives in the exact-length bin `bins[len]` (an
/// ordered [`BlockSet`] of starts, so the lowest offset of a length is its first element); `occupied`
/// finds the smallest non-empty bin at or above a length in O(log64 bins) word reads. Longer
/// extents share the ordered set `long`.
#[derive(Debug, Clone)]
struct SizeIndex {
    /// `bins[len]`: starts of the free extents of exactly `len` units (`bins[0]` stays empty).
    bins: Vec<BlockSet>,
    /// Bit `len` is set iff `bins[len]` is non-empty.
    occupied: LevelBits,
    /// Free extents of `bins.len()` units or more, as `size_key(len, start)`.
    long: BTreeSet<u128>,
    /// Free extents held.
    count: u64,
}

impl SizeIndex {
    /// An empty index for a device of `units` units. The bin count grows with the device (up to
    /// [`BINS_MAX`]) so that small devices use both the bins and the long set.
    fn new(units: u64) -> Self {
        let bins = (units / 16).clamp(2, BINS_MAX);
        Self {
            bins: vec![BlockSet::default(); bins as usize],
            occupied: LevelBits::new(bins),
            long: BTreeSet::new(),
            count: 0,
        }
    }

    #[inline]
    fn is_binned(&self, len: u64) -> bool {
        len < self.bins.len() as u64
    }

    #[inline]
    fn insert(&mut self, len: u64, start: u64) {
        debug_assert!(len > 0);
        let fresh = if self.is_binned(len) {
            let bin = &mut self.bins[len as usize];
            if bin.is_empty() {
                self.occupied.set_range(len, len + 1);
            }
            bin.insert(start)
        } else {
            self.long.insert(size_key(len, start))
        };
        debug_assert!(fresh, "free extent {start}+{len} units indexed twice");
        self.count += 1;
    }

    #[inline]
    fn remove(&mut self, len: u64, start: u64) {
        let present = if self.is_binned(len) {
            let bin = &mut self.bins[len as usize];
            let present = bin.remove(start);
            if bin.is_empty() {
                self.occupied.clear_range(len, len + 1);
            }
            present
        } else {
            self.long.remove(&size_key(len, start))
        };
        debug_assert!(present, "free extent {start}+{len} units is not in the size index");
        self.count -= 1;
    }

    fn contains(&self, len: u64, start: u64) -> bool {
        if self.is_binned(len) {
            self.bins[len as usize].contains(start)
        } else {
            self.long.contains(&size_key(len, start))
        }
    }

    /// The first (lowest-offset) extent of the bin of `len` units, which must be occupied.
    #[inline]
    fn first_of_bin(&self, len: u64) -> (u64, u64) {
        let start = self.bins[len as usize].first().expect("an occupied bin has an extent");
        (len, start)
    }

    /// Remove and return the smallest free extent of at least `n` units (ties: lowest start),
    /// as (length, start).
    #[inline]
    fn take_best_fit(&mut self, n: u64) -> Option<(u64, u64)> {
        if self.is_binned(n)
            && let Some(len) = self.occupied.next_set(n)
        {
            let bin = &mut self.bins[len as usize];
            let start = bin.pop_first().expect("an occupied bin has an extent");
            if bin.is_empty() {
                self.occupied.clear_range(len, len + 1);
            }
            self.count -= 1;
            return Some((len, start));
        }
        let n = n.max(self.bins.len() as u64);
        let &key = self.long.range(size_key(n, 0)..).next()?;
        self.long.remove(&key);
        self.count -= 1;
        Some(split_key(key))
    }

    /// The largest free extent (ties: lowest start), as (length, start).
    fn largest(&self) -> Option<(u64, u64)> {
        if let Some(&last) = self.long.last() {
            let (len, _) = split_key(last);
            return self.long.range(size_key(len, 0)..).next().map(|&k| split_key(k));
        }
        self.occupied.prev_set(self.bins.len() as u64).map(|len| self.first_of_bin(len))
    }

    fn clear(&mut self) {
        while let Some(len) = self.occupied.next_set(0) {
            self.bins[len as usize].clear();
            self.occupied.clear_range(len, len + 1);
        }
        self.long.clear();
        self.count = 0;
    }

    /// Internal consistency: occupancy bits, counter, long extents really long.
    fn check(&self) -> Result<(), String> {
        self.occupied.check().map_err(|e| format!("size bins occupancy: {e}"))?;
        let mut held = self.long.len() as u64;
        for (len, bin) in self.bins.iter().enumerate() {
            bin.check().map_err(|e| format!("bin of {len}-unit extents: {e}"))?;
            if self.occupied.get(len as u64) == bin.is_empty() {
                return Err(format!("occupancy bit of the {len}-unit bin is wrong"));
            }
            held += bin.len() as u64;
        }
        if !self.bins[0].is_empty() {
            return Err("a free extent of 0 units is indexed".into());
        }
        if let Some(&first) = self.long.first()
            && self.is_binned(split_key(first).0)
        {
            return Err(format!(
                "short free extent {:?} (length, start) in the long set",
                split_key(first)
            ));
        }
        if held != self.count {
            return Err(format!("{held} free extents indexed, the counter says {}", self.count));
        }
        Ok(())
    }
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
    bits: LevelBits,
    /// Every (maximal) free extent by (length, start).
    sizes: SizeIndex,
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
        if usize::try_from(units).is_err() {
            return Err(Error::InvalidArgument(format!(
                "device {device}: {units} units do not fit in memory on this platform"
            )));
        }
        let mut this = Self {
            device,
            base_bytes,
            unit_bytes,
            unit_shift: unit_bytes.trailing_zeros(),
            units,
            bits: LevelBits::new(units),
            sizes: SizeIndex::new(units),
            free_units: units,
        };
        this.sizes.insert(units, 0);
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
        let units = this.units;
        let expected = units.div_ceil(8);
        if bits.len() as u64 != expected {
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
        if !units.is_multiple_of(64) && words[words.len() - 1] >> (units % 64) != 0 {
            return Err(Error::Corruption(format!(
                "device {device}: bitmap has bits set beyond its last unit ({units})"
            )));
        }
        this.bits = LevelBits::from_words(units, words);
        this.sizes.clear();
        this.free_units = 0;
        let runs: Vec<(u64, u64)> = free_runs(&this.bits).collect();
        for (start, len) in runs {
            this.sizes.insert(len, start);
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
    #[inline]
    pub fn free_bytes(&self) -> u64 {
        self.free_units << self.unit_shift
    }

    /// Bytes allocated.
    pub fn used_bytes(&self) -> u64 {
        (self.units - self.free_units) << self.unit_shift
    }

    /// Length of the largest free extent in bytes (0 when full).
    pub fn largest_free_bytes(&self) -> u64 {
        self.sizes.largest().map_or(0, |(len, _)| len << self.unit_shift)
    }

    /// `bytes` rounded up to whole allocation units.
    #[inline]
    pub fn round_up(&self, bytes: u64) -> u64 {
        self.units_for(bytes).saturating_mul(self.unit_bytes)
    }

    /// `bytes` in whole units, rounded up (a shift: the unit is a power of two).
    #[inline]
    fn units_for(&self, bytes: u64) -> u64 {
        (bytes >> self.unit_shift) + u64::from(bytes & (self.unit_bytes - 1) != 0)
    }

    /// The free extents in offset order (each maximal). Walks the bitmap: O(units / 64).
    pub fn free_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        free_runs(&self.bits).map(|(start, len)| self.extent(start, len))
    }

    /// Allocate `bytes` rounded up to whole units: one extent when some free extent is large
    /// enough (best fit), else the fewest extents (largest first). See the module docs for the
    /// exact policy. Extents are returned in offset order.
    ///
    /// [`Error::NoSpace`] when fewer free bytes remain than asked for; nothing is allocated then.
    pub fn alloc(&mut self, bytes: u64) -> Result<Vec<Extent>> {
        self.alloc_extents(bytes).map(Extents::into_vec)
    }

    /// [`ExtentAllocator::alloc`], returning the extents as [`Extents`]: the one extent of a
    /// request that fits in one free extent is held inline, with no heap block (what the array
    /// allocator puts in a stripe map's lane).
    pub fn alloc_extents(&mut self, bytes: u64) -> Result<Extents> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "device {}: cannot allocate 0 bytes",
                self.device
            )));
        }
        let need = self.units_for(bytes);
        if need > self.free_units {
            return Err(Error::NoSpace {
                requested_bytes: bytes,
                free_bytes: self.free_bytes(),
                device: Some(self.device),
            });
        }
        let mut out = Extents::new();
        let mut rest = need;
        // Each pass removes one free extent, so the loop ends after at most `free extents` passes.
        loop {
            if let Some((len, start)) = self.sizes.take_best_fit(rest) {
                if rest < len {
                    self.sizes.insert(len - rest, start + rest);
                }
                self.bits.set_range(start, start + rest);
                out.push(self.extent(start, rest));
                break;
            }
            // `free_units >= rest > 0` and no extent holds `rest`: a smaller one exists.
            let (len, start) = self.sizes.largest().expect("free units are held by free extents");
            self.sizes.remove(len, start);
            self.bits.set_range(start, start + len);
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
        self.release(start, len);
        Ok(())
    }

    /// Free `len` units at `start`, all allocated (checked by the caller), coalescing with the
    /// free neighbours the bitmap shows.
    #[inline]
    pub(crate) fn release(&mut self, start: u64, len: u64) {
        let end = start + len;
        debug_assert!(self.bits.all_set(start, end), "releasing free units {start}+{len}");
        // The free neighbours (if any) end at the nearest allocated units around the extent.
        let lo = self.bits.prev_set(start).map_or(0, |p| p + 1);
        if lo < start {
            self.sizes.remove(start - lo, lo);
        }
        let hi = self.bits.next_set(end).unwrap_or(self.units);
        if hi > end {
            self.sizes.remove(hi - end, end);
        }
        self.sizes.insert(hi - lo, lo);
        self.bits.clear_range(start, end);
        self.free_units += len;
    }

    /// Mark an extent allocated, as when rebuilding from metadata on reopen.
    ///
    /// [`Error::AlreadyAllocated`] if any unit of it is allocated; nothing changes then.
    pub fn mark_allocated(&mut self, extent: Extent) -> Result<()> {
        let (start, len) = self.check_free_units(extent)?;
        self.mark_units(start, len);
        Ok(())
    }

    /// Mark `len` free units at `start` (checked by the caller) allocated.
    pub(crate) fn mark_units(&mut self, start: u64, len: u64) {
        let end = start + len;
        debug_assert!(self.bits.all_clear(start, end), "marking allocated units {start}+{len}");
        // Free extents are maximal: the one holding these units runs from just after the
        // nearest allocated unit on the left to just before the nearest one on the right.
        let lo = self.bits.prev_set(start).map_or(0, |p| p + 1);
        let hi = self.bits.next_set(end).unwrap_or(self.units);
        self.sizes.remove(hi - lo, lo);
        if start > lo {
            self.sizes.insert(start - lo, lo);
        }
        if end < hi {
            self.sizes.insert(hi - end, end);
        }
        self.bits.set_range(start, end);
        self.free_units -= len;
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
        let len = self.units.div_ceil(8) as usize;
        let mut out: Vec<u8> =
            self.bits.words().iter().flat_map(|word| word.to_le_bytes()).collect();
        out.truncate(len);
        out
    }

    /// Used, free, largest free extent, fragmentation. O(log64 units).
    pub fn stats(&self) -> Stats {
        let free_bytes = self.free_bytes();
        let largest_free_bytes = self.largest_free_bytes();
        Stats {
            capacity_bytes: self.capacity_bytes(),
            used_bytes: self.used_bytes(),
            free_bytes,
            largest_free_bytes,
            free_extents: self.sizes.count,
            fragmentation: Stats::fragmentation_of(largest_free_bytes, free_bytes),
        }
    }

    /// Verify that the size index holds exactly the free runs of the bitmap (maximal, no
    /// overlap), that the bitmap's summary levels agree with it, and that used + free =
    /// capacity. O(units / 64 + free extents); meant for tests and after a rebuild, not for the
    /// hot path.
    pub fn check_invariants(&self) -> Result<()> {
        let dev = self.device;
        if self.bits.len() != self.units {
            return Err(Error::Corruption(format!(
                "device {dev}: bitmap has {} bits for {} units",
                self.bits.len(),
                self.units
            )));
        }
        self.bits.check().map_err(|e| Error::Corruption(format!("device {dev}: bitmap: {e}")))?;
        self.sizes
            .check()
            .map_err(|e| Error::Corruption(format!("device {dev}: size index: {e}")))?;
        let mut free_units = 0u64;
        let mut runs = 0u64;
        for (start, len) in free_runs(&self.bits) {
            if !self.sizes.contains(len, start) {
                return Err(Error::Corruption(format!(
                    "device {dev}: bitmap free run {start}+{len} units is missing from the index"
                )));
            }
            free_units += len;
            runs += 1;
        }
        // Every run is indexed and the index holds no more entries than runs: they are equal.
        if runs != self.sizes.count {
            return Err(Error::Corruption(format!(
                "device {dev}: the bitmap has {runs} free runs, the index {} free extents",
                self.sizes.count
            )));
        }
        if free_units != self.free_units {
            return Err(Error::Corruption(format!(
                "device {dev}: free extents hold {free_units} units, the counter says {}",
                self.free_units
            )));
        }
        let used_units = self.bits.count_ones();
        if used_units + free_units != self.units {
            return Err(Error::Corruption(format!(
                "device {dev}: used {used_units} + free {free_units} units != capacity {}",
                self.units
            )));
        }
        Ok(())
    }

    /// The bitmap word that holds the unit at byte `offset` (0 outside the device): a load to
    /// issue early, so that its cache miss overlaps others.
    #[inline]
    pub(crate) fn bitmap_word_at(&self, offset: u64) -> u64 {
        let unit = offset.wrapping_sub(self.base_bytes) >> self.unit_shift;
        self.bits.words().get((unit / 64) as usize).copied().unwrap_or(0)
    }

    /// Byte extent of `len` units at unit `start`.
    #[inline]
    fn extent(&self, start: u64, len: u64) -> Extent {
        Extent { offset: self.base_bytes + (start << self.unit_shift), len: len << self.unit_shift }
    }

    /// Validate `extent` as whole units inside the device: (start unit, length in units).
    #[inline]
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

    /// [`ExtentAllocator::check_allocated`] returning (start unit, length in units).
    #[inline]
    pub(crate) fn check_allocated_units(&self, extent: Extent) -> Result<(u64, u64)> {
        let (start, len) = self.units_of(extent)?;
        if !self.bits.all_set(start, start + len) {
            return Err(Error::NotAllocated {
                device: self.device,
                offset: extent.offset,
                len: extent.len,
            });
        }
        Ok((start, len))
    }

    /// [`ExtentAllocator::check_free`] returning (start unit, length in units).
    pub(crate) fn check_free_units(&self, extent: Extent) -> Result<(u64, u64)> {
        let (start, len) = self.units_of(extent)?;
        if !self.bits.all_clear(start, start + len) {
            return Err(Error::AlreadyAllocated {
                device: self.device,
                offset: extent.offset,
                len: extent.len,
            });
        }
        Ok((start, len))
    }
}

/// The maximal runs of clear bits of `bits` as (start, length), in order. Word-wise scans.
fn free_runs(bits: &LevelBits) -> impl Iterator<Item = (u64, u64)> + '_ {
    let mut pos = 0u64;
    std::iter::from_fn(move || {
        let start = bits.next_clear(pos)?;
        let end = bits.next_set(start).unwrap_or(bits.len());
        pos = end;
        Some((start, end - start))
    })
}
