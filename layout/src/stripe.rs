//! Extents and the stripe map: where every byte of a tensor lives.
//!
//! A tensor of `size_bytes` is cut into stripe units of `unit_bytes`. Unit `k` goes to lane
//! `k % lanes`, at lane position `(k / lanes) * unit_bytes`; each lane is one device and owns a
//! list of extents on it, walked in order. This is RAID-0 without md: because every lane's units
//! are consecutive in the lane, a large range of the tensor becomes one long, device-contiguous
//! segment per lane (a vectored I/O gathering the units from the tensor buffer).
//!
//! The tail of the last unit is padded to the block size: writes cover `padded_bytes()` of the
//! buffer, reads fill it and the caller trims to `size_bytes()`.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::geometry::{align_up, is_aligned};
use crate::{Error, Result};

/// A contiguous byte range on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Extent {
    /// Byte offset on the device.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Extent {
    /// One past the last byte.
    #[inline]
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// The extents of one lane, in lane order: a list of [`Extent`] that holds one extent inline.
///
/// A lane placed in one piece (the common case) then needs no heap block of its own, so a stripe
/// map costs one allocation (its lane vector) instead of one per lane. Reads as a slice
/// (`Deref<Target = [Extent]>`); built from a `Vec<Extent>`, an array, one [`Extent`] or an
/// iterator, or grown with [`Extents::push`]. Equality, `Debug` and serde's form are those of the
/// slice, whatever the storage: `Extents::from(vec![e]) == Extents::from(e)`.
#[derive(Clone)]
pub struct Extents(ExtentsRepr);

/// The storage of [`Extents`]: one extent inline, or a vector (empty, or two and more, or one
/// when built from a vector that held one and was not worth converting).
#[derive(Clone)]
enum ExtentsRepr {
    One(Extent),
    Many(Vec<Extent>),
}

impl Extents {
    /// No extents (no heap block).
    pub const fn new() -> Self {
        Self(ExtentsRepr::Many(Vec::new()))
    }

    /// Append an extent. The first one of an empty list is stored inline; a second one moves
    /// both to the heap.
    #[inline]
    pub fn push(&mut self, extent: Extent) {
        match &mut self.0 {
            ExtentsRepr::One(first) => {
                let first = *first;
                self.0 = ExtentsRepr::Many(vec![first, extent]);
            }
            ExtentsRepr::Many(v) if v.capacity() == 0 => self.0 = ExtentsRepr::One(extent),
            ExtentsRepr::Many(v) => v.push(extent),
        }
    }

    /// The extents as a slice.
    #[inline]
    pub fn as_slice(&self) -> &[Extent] {
        match &self.0 {
            ExtentsRepr::One(e) => std::slice::from_ref(e),
            ExtentsRepr::Many(v) => v,
        }
    }

    /// The extents as a mutable slice (the count cannot change through it).
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [Extent] {
        match &mut self.0 {
            ExtentsRepr::One(e) => std::slice::from_mut(e),
            ExtentsRepr::Many(v) => v,
        }
    }

    /// The extents as a vector (allocates when one extent was held inline).
    pub fn into_vec(self) -> Vec<Extent> {
        match self.0 {
            ExtentsRepr::One(e) => vec![e],
            ExtentsRepr::Many(v) => v,
        }
    }
}

impl Default for Extents {
    fn default() -> Self {
        Self::new()
    }
}

impl std::ops::Deref for Extents {
    type Target = [Extent];

    #[inline]
    fn deref(&self) -> &[Extent] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for Extents {
    #[inline]
    fn deref_mut(&mut self) -> &mut [Extent] {
        self.as_mut_slice()
    }
}

impl std::fmt::Debug for Extents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl PartialEq for Extents {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Extents {}

impl PartialEq<[Extent]> for Extents {
    fn eq(&self, other: &[Extent]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<Vec<Extent>> for Extents {
    fn eq(&self, other: &Vec<Extent>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<const N: usize> PartialEq<[Extent; N]> for Extents {
    fn eq(&self, other: &[Extent; N]) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<Extents> for Vec<Extent> {
    fn eq(&self, other: &Extents) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl From<Extent> for Extents {
    fn from(extent: Extent) -> Self {
        Self(ExtentsRepr::One(extent))
    }
}

impl From<Vec<Extent>> for Extents {
    /// One extent moves inline (the vector is freed); any other count keeps the vector.
    fn from(v: Vec<Extent>) -> Self {
        match v.as_slice() {
            &[e] => Self(ExtentsRepr::One(e)),
            _ => Self(ExtentsRepr::Many(v)),
        }
    }
}

impl<const N: usize> From<[Extent; N]> for Extents {
    fn from(a: [Extent; N]) -> Self {
        match a.as_slice() {
            &[e] => Self(ExtentsRepr::One(e)),
            _ => Self(ExtentsRepr::Many(a.to_vec())),
        }
    }
}

impl From<Extents> for Vec<Extent> {
    fn from(e: Extents) -> Self {
        e.into_vec()
    }
}

impl FromIterator<Extent> for Extents {
    fn from_iter<I: IntoIterator<Item = Extent>>(iter: I) -> Self {
        let mut out = Self::new();
        for e in iter {
            out.push(e);
        }
        out
    }
}

impl Extend<Extent> for Extents {
    fn extend<I: IntoIterator<Item = Extent>>(&mut self, iter: I) {
        for e in iter {
            self.push(e);
        }
    }
}

impl<'a> IntoIterator for &'a Extents {
    type Item = &'a Extent;
    type IntoIter = std::slice::Iter<'a, Extent>;

    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

impl IntoIterator for Extents {
    type Item = Extent;
    type IntoIter = std::vec::IntoIter<Extent>;

    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}

impl Serialize for Extents {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Extents {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Vec::<Extent>::deserialize(d).map(Self::from)
    }
}

/// The extents one device holds for one tensor, in lane order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lane {
    /// Index of the device in the array.
    pub device: u32,
    /// Extents on that device, walked in order (one of them held inline: see [`Extents`]).
    pub extents: Extents,
}

impl Lane {
    /// Total bytes of the lane's extents.
    pub fn capacity_bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.len).sum()
    }
}

/// A contiguous piece of the tensor buffer inside a [`Segment`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Offset in the I/O buffer (relative to the start of the mapped range).
    pub buf_offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One I/O: a device-contiguous range, gathered from (or scattered to) buffer pieces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Index of the device in the array.
    pub device: u32,
    /// Byte offset on the device (block-aligned).
    pub device_offset: u64,
    /// Length in bytes (block-aligned); the sum of the pieces.
    pub len: u64,
    /// Buffer pieces in device order.
    pub pieces: Vec<Piece>,
}

/// The placement of one tensor over the array.
///
/// Up to [`INLINE_LANES`] lanes are held in the map itself, each with its first extent inline
/// (see [`Extents`]): the map of a tensor striped over a typical array, each lane in one piece,
/// owns no heap block at all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StripeMap {
    size_bytes: u64,
    unit_bytes: u64,
    block_bytes: u32,
    lanes: LaneStore,
}

/// A stripe map holds up to this many lanes without a heap block.
pub const INLINE_LANES: usize = 4;

/// An unused slot of [`LaneStore::Inline`] (holds no heap block).
const NO_LANE: Lane = Lane { device: 0, extents: Extents::new() };

/// The lanes of a [`StripeMap`]: up to [`INLINE_LANES`] in place, more in a vector. Reads as a
/// slice; equality, `Debug` and serde's form are those of the slice (of a `Vec<Lane>`).
#[derive(Clone)]
enum LaneStore {
    /// `lanes[..len]` are the lanes; the other slots hold [`NO_LANE`].
    Inline {
        len: u8,
        lanes: [Lane; INLINE_LANES],
    },
    Heap(Vec<Lane>),
}

impl LaneStore {
    #[inline]
    fn as_slice(&self) -> &[Lane] {
        match self {
            Self::Inline { len, lanes } => &lanes[..usize::from(*len)],
            Self::Heap(v) => v,
        }
    }
}

impl std::ops::Deref for LaneStore {
    type Target = [Lane];

    #[inline]
    fn deref(&self) -> &[Lane] {
        self.as_slice()
    }
}

impl FromIterator<Lane> for LaneStore {
    /// In place while at most [`INLINE_LANES`] lanes come, else a vector.
    #[inline]
    fn from_iter<I: IntoIterator<Item = Lane>>(iter: I) -> Self {
        let mut iter = iter.into_iter();
        // A heap map gets room for at least twice `INLINE_LANES` lanes: maps of 5 to 8 lanes
        // then have one block size, which malloc recycles from a freed map to the next one
        // through its per-size caches.
        let lower = iter.size_hint().0;
        if lower > INLINE_LANES {
            let mut v = Vec::with_capacity(lower.max(2 * INLINE_LANES));
            v.extend(iter);
            return Self::Heap(v);
        }
        let mut lanes = [NO_LANE; INLINE_LANES];
        let mut len = 0;
        while let Some(lane) = iter.next() {
            if len == INLINE_LANES {
                let mut v = Vec::with_capacity(2 * INLINE_LANES + iter.size_hint().0);
                v.extend(lanes);
                v.push(lane);
                v.extend(iter);
                return Self::Heap(v);
            }
            lanes[len] = lane;
            len += 1;
        }
        Self::Inline { len: len as u8, lanes }
    }
}

impl From<Vec<Lane>> for LaneStore {
    /// Up to [`INLINE_LANES`] lanes move in place (the vector is freed); more keep the vector.
    fn from(v: Vec<Lane>) -> Self {
        if v.len() > INLINE_LANES { Self::Heap(v) } else { v.into_iter().collect() }
    }
}

impl std::fmt::Debug for LaneStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

impl PartialEq for LaneStore {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for LaneStore {}

impl Serialize for LaneStore {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for LaneStore {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Vec::<Lane>::deserialize(d).map(Self::from)
    }
}

/// Number of lanes a tensor of `size_bytes` uses on an array of `device_count` devices.
pub fn lane_count(size_bytes: u64, unit_bytes: u64, device_count: u32) -> u32 {
    let units = size_bytes.div_ceil(unit_bytes).max(1);
    units.min(u64::from(device_count)) as u32
}

/// Bytes each lane must hold for a tensor of `size_bytes` striped over `lanes` lanes.
///
/// Every lane holds whole units except the lane of the last unit, whose tail is rounded up to
/// `block_bytes`. The allocator asks for at least this much on each lane's device.
pub fn lane_bytes(size_bytes: u64, unit_bytes: u64, block_bytes: u32, lanes: u32) -> Vec<u64> {
    assert!(lanes > 0, "a stripe map needs at least one lane");
    let lanes = u64::from(lanes);
    let padded = align_up(size_bytes.max(1), u64::from(block_bytes));
    let units = padded.div_ceil(unit_bytes);
    let last = units - 1;
    let tail = padded - last * unit_bytes;
    (0..lanes)
        .map(|lane| {
            if lane > last {
                return 0;
            }
            // Units of this lane: lane, lane + L, ... <= last.
            let count = (last - lane) / lanes + 1;
            if (last % lanes) == lane {
                (count - 1) * unit_bytes + tail
            } else {
                count * unit_bytes
            }
        })
        .collect()
}

impl StripeMap {
    /// Build and validate a stripe map.
    ///
    /// Checks: `unit_bytes` a power of two >= `block_bytes`; at least one lane, no device twice;
    /// every extent block-aligned and non-empty; no two extents of the map overlap on a device;
    /// each lane holds at least [`lane_bytes`] bytes.
    pub fn new(
        size_bytes: u64,
        unit_bytes: u64,
        block_bytes: u32,
        lanes: Vec<Lane>,
    ) -> Result<Self> {
        let block = u64::from(block_bytes);
        if !block_bytes.is_power_of_two() || block_bytes < 512 {
            return Err(Error::InvalidArgument(format!(
                "block size {block_bytes} is not a power of two >= 512"
            )));
        }
        if !unit_bytes.is_power_of_two() || unit_bytes < block {
            return Err(Error::InvalidArgument(format!(
                "stripe unit {unit_bytes} must be a power of two >= the block size {block}"
            )));
        }
        if lanes.is_empty() {
            return Err(Error::InvalidArgument("a stripe map needs at least one lane".into()));
        }
        if size_bytes == 0 {
            return Err(Error::InvalidArgument("a tensor has at least one byte".into()));
        }
        let needed = lane_bytes(size_bytes, unit_bytes, block_bytes, lanes.len() as u32);
        let mut seen: Vec<(u32, Extent)> = Vec::new();
        for (i, lane) in lanes.iter().enumerate() {
            if lanes[..i].iter().any(|l| l.device == lane.device) {
                return Err(Error::InvalidArgument(format!(
                    "device {} appears in two lanes",
                    lane.device
                )));
            }
            for e in &lane.extents {
                if e.len == 0 {
                    return Err(Error::InvalidArgument(format!(
                        "empty extent on device {}",
                        lane.device
                    )));
                }
                if !is_aligned(e.offset, block) {
                    return Err(Error::Misaligned {
                        what: "extent offset",
                        value: e.offset,
                        align: block,
                    });
                }
                if !is_aligned(e.len, block) {
                    return Err(Error::Misaligned {
                        what: "extent length",
                        value: e.len,
                        align: block,
                    });
                }
                if e.offset.checked_add(e.len).is_none() {
                    return Err(Error::InvalidArgument(format!("extent {e:?} overflows")));
                }
                seen.push((lane.device, *e));
            }
            if lane.capacity_bytes() < needed[i] {
                return Err(Error::InvalidArgument(format!(
                    "lane {i} (device {}) holds {} bytes, the tensor needs {}",
                    lane.device,
                    lane.capacity_bytes(),
                    needed[i]
                )));
            }
        }
        seen.sort_unstable();
        for w in seen.windows(2) {
            if w[0].0 == w[1].0 && w[0].1.end() > w[1].1.offset {
                return Err(Error::InvalidArgument(format!(
                    "extents {:?} and {:?} overlap on device {}",
                    w[0].1, w[1].1, w[0].0
                )));
            }
        }
        Ok(Self { size_bytes, unit_bytes, block_bytes, lanes: lanes.into() })
    }

    /// Build a stripe map from lanes whose producer guarantees everything [`StripeMap::new`]
    /// checks (the array allocator: distinct devices, lanes cut from free space, each at least
    /// [`lane_bytes`] long, geometry validated). Skips the validation in release builds, where it
    /// costs more than the allocation; debug builds run it and panic on a bad map. Not unsafe,
    /// but `locate` and `segments` may panic on a map that breaks the checks.
    ///
    /// Takes the lanes from any iterator (a `Vec<Lane>`, or a reused buffer's `drain(..)`), so
    /// that a map of up to [`INLINE_LANES`] lanes is built without a heap block.
    #[inline]
    pub fn new_trusted(
        size_bytes: u64,
        unit_bytes: u64,
        block_bytes: u32,
        lanes: impl IntoIterator<Item = Lane>,
    ) -> Self {
        let lanes: LaneStore = lanes.into_iter().collect();
        if cfg!(debug_assertions)
            && let Err(e) = Self::new(size_bytes, unit_bytes, block_bytes, lanes.to_vec())
        {
            panic!("StripeMap::new_trusted got an invalid map: {e}");
        }
        Self { size_bytes, unit_bytes, block_bytes, lanes }
    }

    /// The tensor's size in bytes.
    #[inline]
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The size rounded up to the block size: the bytes a full write or read moves.
    #[inline]
    pub fn padded_bytes(&self) -> u64 {
        align_up(self.size_bytes, u64::from(self.block_bytes))
    }

    /// The stripe unit.
    #[inline]
    pub fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }

    /// The block size every segment is aligned to.
    #[inline]
    pub fn block_bytes(&self) -> u32 {
        self.block_bytes
    }

    /// The lanes, in striping order.
    #[inline]
    pub fn lanes(&self) -> &[Lane] {
        &self.lanes
    }

    /// Every (device, extent) the tensor owns.
    #[inline]
    pub fn extents(&self) -> impl Iterator<Item = (u32, Extent)> + '_ {
        self.lanes.iter().flat_map(|l| l.extents.iter().map(move |e| (l.device, *e)))
    }

    /// Map a lane position to (device offset, bytes left in that extent).
    fn lane_to_device(&self, lane: &Lane, mut pos: u64) -> (u64, u64) {
        for e in &lane.extents {
            if pos < e.len {
                return (e.offset + pos, e.len - pos);
            }
            pos -= e.len;
        }
        unreachable!("lane position beyond the lane's capacity (validated in StripeMap::new)")
    }

    /// Where byte `offset` of the tensor lives: (device, device offset).
    pub fn locate(&self, offset: u64) -> Result<(u32, u64)> {
        if offset >= self.padded_bytes() {
            return Err(Error::InvalidArgument(format!(
                "offset {offset} is beyond the tensor ({} bytes padded)",
                self.padded_bytes()
            )));
        }
        let l = self.lanes.len() as u64;
        let k = offset / self.unit_bytes;
        let lane = &self.lanes[(k % l) as usize];
        let pos = (k / l) * self.unit_bytes + offset % self.unit_bytes;
        Ok((lane.device, self.lane_to_device(lane, pos).0))
    }

    /// The I/O segments that move `range` of the tensor.
    ///
    /// `range.start` must be block-aligned; `range.end` block-aligned or equal to the size (then
    /// padded to the block). Buffer offsets in the pieces are relative to `range.start`. Each
    /// lane's pieces are merged into device-contiguous segments of at most `max_io_bytes`
    /// (rounded down to the block size, at least one block). Segments are returned lane by lane
    /// in device-offset order.
    pub fn segments(&self, range: Range<u64>, max_io_bytes: u64) -> Result<Vec<Segment>> {
        let block = u64::from(self.block_bytes);
        let end = if range.end == self.size_bytes { self.padded_bytes() } else { range.end };
        if range.start >= end || end > self.padded_bytes() {
            return Err(Error::InvalidArgument(format!(
                "range {range:?} is empty or beyond the tensor ({} bytes)",
                self.size_bytes
            )));
        }
        if !is_aligned(range.start, block) {
            return Err(Error::Misaligned {
                what: "range start",
                value: range.start,
                align: block,
            });
        }
        if !is_aligned(end, block) {
            return Err(Error::Misaligned { what: "range end", value: range.end, align: block });
        }
        let max_io = (max_io_bytes / block * block).max(block);
        let l = self.lanes.len() as u64;
        let mut open: Vec<Option<Segment>> = vec![None; self.lanes.len()];
        let mut done: Vec<Vec<Segment>> = vec![Vec::new(); self.lanes.len()];
        let mut pos = range.start;
        while pos < end {
            let k = pos / self.unit_bytes;
            let unit_end = ((k + 1) * self.unit_bytes).min(end);
            let li = (k % l) as usize;
            let lane = &self.lanes[li];
            let mut lane_pos = (k / l) * self.unit_bytes + (pos - k * self.unit_bytes);
            while pos < unit_end {
                let (dev_off, extent_left) = self.lane_to_device(lane, lane_pos);
                let len = (unit_end - pos).min(extent_left);
                let buf_offset = pos - range.start;
                let mut rest = len;
                let (mut d, mut b) = (dev_off, buf_offset);
                while rest > 0 {
                    let slot = &mut open[li];
                    let joinable =
                        matches!(slot, Some(s) if s.device_offset + s.len == d && s.len < max_io);
                    if !joinable {
                        if let Some(s) = slot.take() {
                            done[li].push(s);
                        }
                        *slot = Some(Segment {
                            device: lane.device,
                            device_offset: d,
                            len: 0,
                            pieces: Vec::new(),
                        });
                    }
                    let s = slot.as_mut().expect("just set");
                    let take = rest.min(max_io - s.len);
                    match s.pieces.last_mut() {
                        Some(p) if p.buf_offset + p.len == b => p.len += take,
                        _ => s.pieces.push(Piece { buf_offset: b, len: take }),
                    }
                    s.len += take;
                    d += take;
                    b += take;
                    rest -= take;
                }
                pos += len;
                lane_pos += len;
            }
        }
        for (li, s) in open.into_iter().enumerate() {
            if let Some(s) = s {
                done[li].push(s);
            }
        }
        Ok(done.into_iter().flatten().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn contiguous_map(size: u64, devices: u32) -> StripeMap {
        let lanes = lane_count(size, MIB, devices);
        let need = lane_bytes(size, MIB, 4096, lanes);
        let lanes = need
            .iter()
            .enumerate()
            .map(|(i, &n)| Lane {
                device: i as u32,
                extents: vec![Extent { offset: 8 * MIB, len: align_up(n, MIB) }].into(),
            })
            .collect();
        StripeMap::new(size, MIB, 4096, lanes).unwrap()
    }

    #[test]
    fn one_large_tensor_becomes_one_segment_per_device() {
        let map = contiguous_map(64 * MIB, 4);
        let segs = map.segments(0..64 * MIB, u64::MAX).unwrap();
        assert_eq!(segs.len(), 4);
        for (i, s) in segs.iter().enumerate() {
            assert_eq!(s.device, i as u32);
            assert_eq!(s.device_offset, 8 * MIB);
            assert_eq!(s.len, 16 * MIB);
            assert_eq!(s.pieces.len(), 16);
            assert_eq!(s.pieces[1].buf_offset, (4 + i as u64) * MIB);
        }
    }

    #[test]
    fn max_io_splits_segments() {
        let map = contiguous_map(64 * MIB, 4);
        let segs = map.segments(0..64 * MIB, 4 * MIB).unwrap();
        assert_eq!(segs.len(), 16);
        assert!(segs.iter().all(|s| s.len == 4 * MIB));
    }

    #[test]
    fn tail_is_padded_to_the_block() {
        let map = contiguous_map(MIB + 1, 4);
        assert_eq!(map.padded_bytes(), MIB + 4096);
        let segs = map.segments(0..MIB + 1, u64::MAX).unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!(segs[1].len, 4096);
        assert_eq!(segs[1].pieces, vec![Piece { buf_offset: MIB, len: 4096 }]);
    }

    #[test]
    fn locate_follows_round_robin() {
        let map = contiguous_map(10 * MIB, 3);
        assert_eq!(map.locate(0).unwrap(), (0, 8 * MIB));
        assert_eq!(map.locate(MIB + 5).unwrap(), (1, 8 * MIB + 5));
        assert_eq!(map.locate(3 * MIB).unwrap(), (0, 9 * MIB));
        assert!(map.locate(10 * MIB).is_err());
    }

    #[test]
    fn rejects_overlap_misalignment_and_short_lanes() {
        let e = |o, l| Extent { offset: o, len: l };
        let overlap = vec![Lane { device: 0, extents: vec![e(0, MIB), e(MIB / 2, MIB)].into() }];
        assert!(StripeMap::new(MIB, MIB, 4096, overlap).is_err());
        let mis = vec![Lane { device: 0, extents: vec![e(100, MIB)].into() }];
        assert!(matches!(StripeMap::new(MIB, MIB, 4096, mis), Err(Error::Misaligned { .. })));
        let short = vec![Lane { device: 0, extents: vec![e(0, MIB)].into() }];
        assert!(StripeMap::new(2 * MIB, MIB, 4096, short).is_err());
        let dup = vec![
            Lane { device: 0, extents: vec![e(0, MIB)].into() },
            Lane { device: 0, extents: vec![e(MIB, MIB)].into() },
        ];
        assert!(StripeMap::new(2 * MIB, MIB, 4096, dup).is_err());
    }

    #[test]
    fn extents_hold_one_inline_and_compare_as_slices() {
        let e = |o, l| Extent { offset: o, len: l };
        // One extent inline: a lane is no larger than a Vec would make it.
        assert_eq!(std::mem::size_of::<Extents>(), std::mem::size_of::<Vec<Extent>>());
        let one = Extents::from(e(0, MIB));
        assert_eq!(one, Extents::from(vec![e(0, MIB)]));
        assert_eq!(one, vec![e(0, MIB)]);
        assert_eq!(format!("{one:?}"), format!("{:?}", vec![e(0, MIB)]));
        let mut grown = Extents::new();
        assert!(grown.is_empty());
        assert_eq!(grown, Extents::from(Vec::new()));
        for i in 0..5 {
            grown.push(e(i * 2 * MIB, MIB));
            assert_eq!(grown.len() as u64, i + 1);
            assert_eq!(grown[i as usize], e(i * 2 * MIB, MIB));
        }
        assert_eq!(grown.first(), Some(&e(0, MIB)));
        assert_ne!(grown, one);
        let collected: Extents = (0..5).map(|i| e(i * 2 * MIB, MIB)).collect();
        assert_eq!(collected, grown);
        assert_eq!(grown.clone().into_vec(), grown.to_vec());
        let mut sorted = Extents::from([e(4 * MIB, MIB), e(0, MIB)]);
        sorted.sort_unstable();
        assert_eq!(sorted, [e(0, MIB), e(4 * MIB, MIB)]);
        assert_eq!(Vec::from(sorted), vec![e(0, MIB), e(4 * MIB, MIB)]);
    }

    #[test]
    fn maps_of_any_lane_count_read_the_same_built_either_way() {
        // In place up to INLINE_LANES lanes, in a vector beyond: invisible through the API.
        for devices in 1..=2 * INLINE_LANES as u32 + 1 {
            let size = u64::from(devices) * 2 * MIB + 4096;
            let map = contiguous_map(size, devices);
            let lanes = map.lanes().to_vec();
            assert_eq!(lanes.len(), devices as usize);
            assert_eq!(lanes[devices as usize - 1].device, devices - 1);
            let trusted = StripeMap::new_trusted(size, MIB, 4096, lanes.clone());
            let from_iter = StripeMap::new_trusted(size, MIB, 4096, lanes.iter().cloned());
            assert_eq!(trusted, map);
            assert_eq!(from_iter, map);
            assert_eq!(from_iter.clone(), map);
            assert_eq!(format!("{:?}", map.lanes()), format!("{lanes:?}"));
            assert_eq!(map.extents().count(), devices as usize);
            assert_eq!(map.locate(0).unwrap(), (0, 8 * MIB));
            let segs = map.segments(0..size, u64::MAX).unwrap();
            assert_eq!(segs.iter().map(|s| s.len).sum::<u64>(), map.padded_bytes());
        }
    }

    #[test]
    fn fragmented_lane_splits_at_extent_boundaries() {
        let e = |o, l| Extent { offset: o, len: l };
        let lanes = vec![Lane { device: 2, extents: vec![e(0, MIB), e(10 * MIB, 2 * MIB)].into() }];
        let map = StripeMap::new(3 * MIB, MIB, 4096, lanes).unwrap();
        let segs = map.segments(0..3 * MIB, u64::MAX).unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!((segs[0].device_offset, segs[0].len), (0, MIB));
        assert_eq!((segs[1].device_offset, segs[1].len), (10 * MIB, 2 * MIB));
        assert_eq!(segs[1].pieces, vec![Piece { buf_offset: MIB, len: 2 * MIB }]);
    }
}
