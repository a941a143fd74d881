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

/// The extents one device holds for one tensor, in lane order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lane {
    /// Index of the device in the array.
    pub device: u32,
    /// Extents on that device, walked in order.
    pub extents: Vec<Extent>,
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
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StripeMap {
    size_bytes: u64,
    unit_bytes: u64,
    block_bytes: u32,
    lanes: Vec<Lane>,
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
        Ok(Self { size_bytes, unit_bytes, block_bytes, lanes })
    }

    /// Build a stripe map from lanes whose producer guarantees everything [`StripeMap::new`]
    /// checks (the array allocator: distinct devices, lanes cut from free space, each at least
    /// [`lane_bytes`] long, geometry validated). Skips the validation in release builds, where it
    /// costs more than the allocation; debug builds run it and panic on a bad map. Not unsafe,
    /// but `locate` and `segments` may panic on a map that breaks the checks.
    pub fn new_trusted(
        size_bytes: u64,
        unit_bytes: u64,
        block_bytes: u32,
        lanes: Vec<Lane>,
    ) -> Self {
        if cfg!(debug_assertions)
            && let Err(e) = Self::new(size_bytes, unit_bytes, block_bytes, lanes.clone())
        {
            panic!("StripeMap::new_trusted got an invalid map: {e}");
        }
        Self { size_bytes, unit_bytes, block_bytes, lanes }
    }

    /// The tensor's size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The size rounded up to the block size: the bytes a full write or read moves.
    pub fn padded_bytes(&self) -> u64 {
        align_up(self.size_bytes, u64::from(self.block_bytes))
    }

    /// The stripe unit.
    pub fn unit_bytes(&self) -> u64 {
        self.unit_bytes
    }

    /// The block size every segment is aligned to.
    pub fn block_bytes(&self) -> u32 {
        self.block_bytes
    }

    /// The lanes, in striping order.
    pub fn lanes(&self) -> &[Lane] {
        &self.lanes
    }

    /// Every (device, extent) the tensor owns.
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
                extents: vec![Extent { offset: 8 * MIB, len: align_up(n, MIB) }],
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
        let overlap = vec![Lane { device: 0, extents: vec![e(0, MIB), e(MIB / 2, MIB)] }];
        assert!(StripeMap::new(MIB, MIB, 4096, overlap).is_err());
        let mis = vec![Lane { device: 0, extents: vec![e(100, MIB)] }];
        assert!(matches!(StripeMap::new(MIB, MIB, 4096, mis), Err(Error::Misaligned { .. })));
        let short = vec![Lane { device: 0, extents: vec![e(0, MIB)] }];
        assert!(StripeMap::new(2 * MIB, MIB, 4096, short).is_err());
        let dup = vec![
            Lane { device: 0, extents: vec![e(0, MIB)] },
            Lane { device: 0, extents: vec![e(MIB, MIB)] },
        ];
        assert!(StripeMap::new(2 * MIB, MIB, 4096, dup).is_err());
    }

    #[test]
    fn fragmented_lane_splits_at_extent_boundaries() {
        let e = |o, l| Extent { offset: o, len: l };
        let lanes = vec![Lane { device: 2, extents: vec![e(0, MIB), e(10 * MIB, 2 * MIB)] }];
        let map = StripeMap::new(3 * MIB, MIB, 4096, lanes).unwrap();
        let segs = map.segments(0..3 * MIB, u64::MAX).unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!((segs[0].device_offset, segs[0].len), (0, MIB));
        assert_eq!((segs[1].device_offset, segs[1].len), (10 * MIB, 2 * MIB));
        assert_eq!(segs[1].pieces, vec![Piece { buf_offset: MIB, len: 2 * MIB }]);
    }
}
