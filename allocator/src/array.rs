//! The array allocator: places a tensor over the devices of an array in stripe units.
//!
//! A tensor of `size` bytes uses `L = lane_count(size, stripe_unit, devices)` lanes. The `L`
//! devices with the most free bytes are chosen (ties: lower index), the device with the most
//! free space taking lane 0 (the lane that holds the most bytes), and so on. Each lane gets
//! [`lane_bytes`] rounded up to its device's allocation unit, in the fewest extents. Every call
//! is all-or-nothing: on any failure nothing is left allocated.
//!
//! The maps it returns are built with [`StripeMap::new_trusted`]: the allocator guarantees what
//! `StripeMap::new` would check (validated geometry, distinct devices, lanes cut from free space
//! and at least their share long), and that check cost as much as the allocation. Maps handed
//! back to `free_tensor` and `mark_tensor` are checked in full (a fast path for maps shaped like
//! the ones it builds, a sort for any other).

use serde::{Deserialize, Serialize};
use teraio_layout::{ArrayGeometry, Extent, Lane, StripeMap, lane_bytes, lane_count};

use crate::extent::{ExtentAllocator, Stats};
use crate::{Error, Result};

/// Arrays of at most this many devices choose a tensor's devices by insertion, larger ones sort.
const CHOOSE_BY_INSERTION_MAX: usize = 16;

/// Space accounting of an array: every device and the totals.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArrayStats {
    /// One entry per device, by index.
    pub devices: Vec<Stats>,
    /// Sums over the devices; `largest_free_bytes` is the largest of any device, and
    /// `fragmentation` is `1 - sum(largest free) / sum(free)`.
    pub total: Stats,
}

/// One [`ExtentAllocator`] per device of an array, striping tensors over them.
#[derive(Debug, Clone)]
pub struct ArrayAllocator {
    geometry: ArrayGeometry,
    devices: Vec<ExtentAllocator>,
    /// Reused buffers so the hot path does not allocate: device order, bytes per lane, the
    /// lanes of the map being built, the (device, extent) list of the overlap check, and
    /// (device, start unit, units) runs checked for freeing or marking.
    order: Vec<(u64, usize)>,
    needs: Vec<u64>,
    lanes: Vec<Lane>,
    scratch: Vec<(u32, Extent)>,
    runs: Vec<(u32, u64, u64)>,
    /// `seen[d] == epoch` when device `d` has a lane in the map being validated.
    seen: Vec<u64>,
    epoch: u64,
}

impl ArrayAllocator {
    /// Combine per-device allocators into an array allocator.
    ///
    /// `devices[i]` must serve device `i`, one per device of `geometry`, with an allocation unit
    /// and base offset that are multiples of the geometry's block size.
    pub fn new(geometry: ArrayGeometry, devices: Vec<ExtentAllocator>) -> Result<Self> {
        if devices.len() != geometry.device_count as usize {
            return Err(Error::InvalidArgument(format!(
                "the geometry has {} devices, {} allocators were given",
                geometry.device_count,
                devices.len()
            )));
        }
        // The fields are public: check the geometry as `ArrayGeometry::new` would, since the
        // maps built from it are trusted without re-validation.
        ArrayGeometry::new(
            geometry.device_count,
            geometry.block_bytes,
            geometry.stripe_unit_bytes,
        )?;
        let block = u64::from(geometry.block_bytes);
        for (i, dev) in devices.iter().enumerate() {
            if dev.device() as usize != i {
                return Err(Error::InvalidArgument(format!(
                    "allocator {i} serves device {}, expected device {i}",
                    dev.device()
                )));
            }
            if !dev.unit_bytes().is_multiple_of(block) || !dev.base_bytes().is_multiple_of(block) {
                return Err(Error::InvalidArgument(format!(
                    "device {i}: unit {} and base {} must be multiples of the block size {block}",
                    dev.unit_bytes(),
                    dev.base_bytes()
                )));
            }
        }
        let seen = vec![0; devices.len()];
        Ok(Self {
            geometry,
            devices,
            order: Vec::new(),
            needs: Vec::new(),
            lanes: Vec::new(),
            scratch: Vec::new(),
            runs: Vec::new(),
            seen,
            epoch: 0,
        })
    }

    /// The array's geometry.
    pub fn geometry(&self) -> &ArrayGeometry {
        &self.geometry
    }

    /// The allocator of device `i`.
    ///
    /// # Panics
    /// If `i` is not a device of the array (`i >= device_count`).
    pub fn device(&self, i: u32) -> &ExtentAllocator {
        &self.devices[i as usize]
    }

    /// All device allocators, by index.
    pub fn devices(&self) -> &[ExtentAllocator] {
        &self.devices
    }

    /// Allocate a tensor of `size_bytes` striped over the array. All-or-nothing: on
    /// [`Error::NoSpace`] (or any error) nothing stays allocated.
    pub fn alloc_tensor(&mut self, size_bytes: u64) -> Result<StripeMap> {
        if size_bytes == 0 {
            return Err(Error::InvalidArgument("a tensor has at least one byte".into()));
        }
        let g = self.geometry;
        let lanes = lane_count(size_bytes, g.stripe_unit_bytes, g.device_count);
        lane_needs(size_bytes, g.stripe_unit_bytes, g.block_bytes, lanes, &mut self.needs);
        debug_assert_eq!(
            self.needs,
            lane_bytes(size_bytes, g.stripe_unit_bytes, g.block_bytes, lanes)
        );
        self.choose_devices(lanes as usize);
        // Returned straight from here: the map (up to a few hundred bytes) is built in place.
        self.alloc_lanes(size_bytes)
    }

    /// Allocate lane `i` of the tensor (`self.needs[i]` bytes) on device `self.order[i].1`, all
    /// or nothing.
    #[inline]
    fn alloc_lanes(&mut self, size_bytes: u64) -> Result<StripeMap> {
        let g = self.geometry;
        // Check every lane before touching anything: a device can serve a lane iff its free
        // bytes cover the lane rounded up to its unit (alloc may split into several extents).
        let fits =
            self.order.iter().zip(&self.needs).all(|(&(_, d), &need)| {
                self.devices[d].round_up(need) <= self.devices[d].free_bytes()
            });
        if !fits {
            return Err(self.no_space(size_bytes));
        }
        // The lanes go through a reused buffer into the map, which holds up to `INLINE_LANES`
        // of them (each lane's first extent too) without a heap block.
        let mut done = std::mem::take(&mut self.lanes);
        done.clear();
        for (&(_, d), &need) in self.order.iter().zip(&self.needs) {
            match self.devices[d].alloc_extents(need) {
                Ok(extents) => done.push(Lane { device: d as u32, extents }),
                Err(e) => {
                    self.roll_back(&done);
                    done.clear();
                    self.lanes = done;
                    return Err(match e {
                        Error::NoSpace { .. } => self.no_space(size_bytes),
                        other => other,
                    });
                }
            }
        }
        // Every lane was cut from free space on its own device, holds at least its share, and
        // is aligned to the (validated) geometry's block: what `StripeMap::new` would re-check.
        let map =
            StripeMap::new_trusted(size_bytes, g.stripe_unit_bytes, g.block_bytes, done.drain(..));
        self.lanes = done;
        Ok(map)
    }

    /// Free every extent of a tensor. All-or-nothing: every extent is checked to be allocated
    /// (and no two to overlap) before any is freed.
    pub fn free_tensor(&mut self, map: &StripeMap) -> Result<()> {
        self.collect_runs(map, ExtentAllocator::check_allocated_units)?;
        for &(d, start, len) in &self.runs {
            self.devices[d as usize].release(start, len);
        }
        Ok(())
    }

    /// Mark a tensor's extents allocated, as when rebuilding from metadata on reopen.
    /// All-or-nothing: every extent is checked to be free before any is marked.
    pub fn mark_tensor(&mut self, map: &StripeMap) -> Result<()> {
        self.collect_runs(map, ExtentAllocator::check_free_units)?;
        for &(d, start, len) in &self.runs {
            self.devices[d as usize].mark_units(start, len);
        }
        Ok(())
    }

    /// Per-device stats and totals.
    pub fn stats(&self) -> ArrayStats {
        let devices: Vec<Stats> = self.devices.iter().map(ExtentAllocator::stats).collect();
        let sum = |f: fn(&Stats) -> u64| devices.iter().map(f).sum::<u64>();
        let free_bytes = sum(|s| s.free_bytes);
        let largest_sum = sum(|s| s.largest_free_bytes);
        let total = Stats {
            capacity_bytes: sum(|s| s.capacity_bytes),
            used_bytes: sum(|s| s.used_bytes),
            free_bytes,
            largest_free_bytes: devices.iter().map(|s| s.largest_free_bytes).max().unwrap_or(0),
            free_extents: sum(|s| s.free_extents),
            fragmentation: Stats::fragmentation_of(largest_sum, free_bytes),
        };
        ArrayStats { devices, total }
    }

    /// Check every device's invariants (see [`ExtentAllocator::check_invariants`]).
    pub fn check_invariants(&self) -> Result<()> {
        self.devices.iter().try_for_each(ExtentAllocator::check_invariants)
    }

    /// Leave in `self.order` the `lanes` devices with the most free bytes, most free first
    /// (ties: lower index), as (`!free_bytes`, device) so that plain tuple order sorts them.
    ///
    /// Up to [`CHOOSE_BY_INSERTION_MAX`] devices, a bounded insertion (keep the `lanes` smallest
    /// keys sorted while walking the devices): for a handful of devices a general sort costs
    /// several times more. Larger arrays sort.
    fn choose_devices(&mut self, lanes: usize) {
        let order = &mut self.order;
        order.clear();
        let keys = self.devices.iter().enumerate().map(|(d, dev)| (!dev.free_bytes(), d));
        if self.devices.len() > CHOOSE_BY_INSERTION_MAX {
            order.extend(keys);
            order.sort_unstable();
            order.truncate(lanes);
            return;
        }
        for key in keys {
            if order.len() == lanes {
                // Keys arrive in device order, so a tie with the last kept key loses.
                if order.last().is_none_or(|&last| last <= key) {
                    continue;
                }
                order.pop();
            }
            order.push(key);
            let mut i = order.len() - 1;
            while i > 0 && order[i - 1] > order[i] {
                order.swap(i - 1, i);
                i -= 1;
            }
        }
    }

    fn no_space(&self, size_bytes: u64) -> Error {
        Error::NoSpace {
            requested_bytes: size_bytes,
            free_bytes: self.devices.iter().map(ExtentAllocator::free_bytes).sum(),
            device: None,
        }
    }

    /// Free the lanes a failing `alloc_tensor` allocated so far.
    fn roll_back(&mut self, done: &[Lane]) {
        for lane in done {
            for &e in &lane.extents {
                self.devices[lane.device as usize]
                    .free(e)
                    .expect("rolling back an extent allocated by this very call");
            }
        }
    }

    /// Leave in `self.runs` the map's extents as (device, start unit, units), each passing
    /// `check` on its device, no two overlapping, every device one of the array's (a
    /// deserialized map has not been through `StripeMap::new`). Errors, in order of precedence:
    /// an unknown device, overlapping extents, then the first extent that fails `check`.
    #[inline]
    fn collect_runs(
        &mut self,
        map: &StripeMap,
        check: impl Fn(&ExtentAllocator, Extent) -> Result<(u64, u64)>,
    ) -> Result<()> {
        self.runs.clear();
        self.epoch += 1;
        // A map freed long after it was made is usually cold, and so are the bitmap words of
        // its extents: load every lane's first extent and its bitmap word up front,
        // independent loads whose misses overlap, before the loop below.
        let mut touched = 0;
        for lane in map.lanes() {
            if let Some(e) = lane.extents.first()
                && let Some(dev) = self.devices.get(lane.device as usize)
            {
                touched ^= dev.bitmap_word_at(e.offset);
            }
        }
        std::hint::black_box(touched);
        // Fast path: every lane on its own device, its extents in increasing, disjoint order
        // (what `alloc_tensor` builds). Then no two extents can overlap.
        let mut simple = true;
        let mut failed: Option<Error> = None;
        for lane in map.lanes() {
            let d = lane.device;
            let Some(first) = lane.extents.first() else { continue };
            if d >= self.geometry.device_count {
                return Err(self.unknown_device(d));
            }
            let seen = &mut self.seen[d as usize];
            simple &= *seen != self.epoch;
            *seen = self.epoch;
            let dev = &self.devices[d as usize];
            let mut end = first.offset;
            for &e in &lane.extents {
                simple &= end <= e.offset;
                end = e.offset.saturating_add(e.len);
                match check(dev, e) {
                    Ok((start, len)) => self.runs.push((d, start, len)),
                    Err(err) => {
                        failed.get_or_insert(err);
                    }
                }
            }
        }
        if !simple {
            self.check_overlaps(map)?;
        }
        failed.map_or(Ok(()), Err)
    }

    /// The slow path of `collect_runs`: sort the map's extents and reject overlapping ones.
    fn check_overlaps(&mut self, map: &StripeMap) -> Result<()> {
        self.scratch.clear();
        self.scratch.extend(map.extents());
        let extents = &mut self.scratch;
        extents.sort_unstable_by_key(|&(d, e)| (d, e.offset));
        for w in extents.windows(2) {
            let ((d0, e0), (d1, e1)) = (w[0], w[1]);
            if d0 == d1 && e0.offset.saturating_add(e0.len) > e1.offset {
                return Err(Error::InvalidArgument(format!(
                    "the tensor's extents {e0:?} and {e1:?} overlap on device {d0}"
                )));
            }
        }
        Ok(())
    }

    fn unknown_device(&self, d: u32) -> Error {
        Error::InvalidArgument(format!(
            "the tensor names device {d}, the array has {}",
            self.geometry.device_count
        ))
    }
}

/// Leave in `out` the bytes each of `lanes` lanes must hold for a tensor of `size_bytes`: what
/// [`teraio_layout::lane_bytes`] returns, without building a new vector, with one division.
#[inline]
fn lane_needs(size_bytes: u64, unit_bytes: u64, block_bytes: u32, lanes: u32, out: &mut Vec<u64>) {
    let (lanes, block) = (u64::from(lanes), u64::from(block_bytes));
    let padded = size_bytes.max(1).div_ceil(block) * block;
    let last = padded.div_ceil(unit_bytes) - 1;
    let tail = padded - last * unit_bytes;
    // Unit k goes to lane k % lanes: with last = q * lanes + r, lanes before r hold q + 1 units,
    // lane r holds q whole units and the tail, later lanes q units (0 when q = 0).
    let (q, r) = (last / lanes, last % lanes);
    out.clear();
    out.extend((0..lanes).map(|lane| match lane.cmp(&r) {
        std::cmp::Ordering::Less => (q + 1) * unit_bytes,
        std::cmp::Ordering::Equal => q * unit_bytes + tail,
        std::cmp::Ordering::Greater => q * unit_bytes,
    }));
}

#[cfg(test)]
mod tests {
    use teraio_layout::lane_bytes;

    use super::{ArrayAllocator, CHOOSE_BY_INSERTION_MAX, lane_needs};
    use crate::ExtentAllocator;

    #[test]
    fn lane_needs_are_layouts_lane_bytes() {
        const KIB: u64 = 1 << 10;
        let sizes = (1..300u64).map(|k| k * 997).chain((1..200).map(|k| k * 64 * KIB + k % 3));
        for size in sizes {
            for (unit, block) in [(4 * KIB, 4096u32), (64 * KIB, 4096), (1 << 20, 512)] {
                for lanes in 1..=7 {
                    let want = lane_bytes(size, unit, block, lanes);
                    let mut got = vec![7; 9];
                    lane_needs(size, unit, block, lanes, &mut got);
                    assert_eq!(got, want, "size {size}, unit {unit}, block {block}, {lanes} lanes");
                }
            }
        }
    }

    #[test]
    fn chosen_devices_are_the_most_free_lowest_index_first() {
        use teraio_layout::ArrayGeometry;
        const MIB: u64 = 1 << 20;
        // Both ways of choosing (insertion up to CHOOSE_BY_INSERTION_MAX devices, a sort above),
        // free space with many ties, every lane count.
        for devices in [1u32, 2, 3, 4, 7, 16, 17, 40] {
            assert_eq!(devices as usize > CHOOSE_BY_INSERTION_MAX, devices >= 17);
            let geometry = ArrayGeometry::new(devices, 4096, MIB).unwrap();
            let allocators = (0..devices)
                .map(|d| {
                    let units = 8 + u64::from(d * 7 % 5);
                    ExtentAllocator::new(d, 0, units * MIB, MIB).unwrap()
                })
                .collect();
            let mut a = ArrayAllocator::new(geometry, allocators).unwrap();
            for lanes in 1..=devices as usize {
                let mut want: Vec<(u64, usize)> =
                    a.devices.iter().enumerate().map(|(d, dev)| (!dev.free_bytes(), d)).collect();
                want.sort_unstable();
                want.truncate(lanes);
                a.choose_devices(lanes);
                assert_eq!(a.order, want, "{devices} devices, {lanes} lanes");
            }
        }
    }
}
