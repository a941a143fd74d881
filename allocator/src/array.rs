//! The array allocator: places a tensor over the devices of an array in stripe units.
//!
//! A tensor of `size` bytes uses `L = lane_count(size, stripe_unit, devices)` lanes. The `L`
//! devices with the most free bytes are chosen (ties: lower index), the device with the most
//! free space taking lane 0 (the lane that holds the most bytes), and so on. Each lane gets
//! [`lane_bytes`] rounded up to its device's allocation unit, in the fewest extents. Every call
//! is all-or-nothing: on any failure nothing is left allocated.

use serde::{Deserialize, Serialize};
use teraio_layout::{ArrayGeometry, Extent, Lane, StripeMap, lane_bytes, lane_count};

use crate::extent::{ExtentAllocator, Stats};
use crate::{Error, Result};

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
    /// Reused buffers so the hot path does not allocate: device order, and (device, extent)
    /// lists for roll-back and validation.
    order: Vec<usize>,
    scratch: Vec<(u32, Extent)>,
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
        Ok(Self { geometry, devices, order: Vec::new(), scratch: Vec::new() })
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
        let needs = lane_bytes(size_bytes, g.stripe_unit_bytes, g.block_bytes, lanes);
        self.choose_devices(lanes as usize);
        let chosen = std::mem::take(&mut self.order);
        let result = self.alloc_lanes(size_bytes, &chosen, &needs);
        self.order = chosen;
        result
    }

    /// Allocate lane `i` of the tensor on device `chosen[i]`, all or nothing.
    fn alloc_lanes(
        &mut self,
        size_bytes: u64,
        chosen: &[usize],
        needs: &[u64],
    ) -> Result<StripeMap> {
        let g = self.geometry;
        // Check every lane before touching anything: a device can serve a lane iff its free
        // bytes cover the lane rounded up to its unit (alloc may split into several extents).
        let fits = chosen
            .iter()
            .zip(needs)
            .all(|(&d, &need)| self.devices[d].round_up(need) <= self.devices[d].free_bytes());
        if !fits {
            return Err(self.no_space(size_bytes));
        }
        self.scratch.clear();
        let mut done: Vec<Lane> = Vec::with_capacity(chosen.len());
        for (&d, &need) in chosen.iter().zip(needs) {
            match self.devices[d].alloc(need) {
                Ok(extents) => {
                    self.scratch.extend(extents.iter().map(|&e| (d as u32, e)));
                    done.push(Lane { device: d as u32, extents });
                }
                Err(e) => {
                    self.roll_back();
                    return Err(match e {
                        Error::NoSpace { .. } => self.no_space(size_bytes),
                        other => other,
                    });
                }
            }
        }
        StripeMap::new(size_bytes, g.stripe_unit_bytes, g.block_bytes, done).map_err(|e| {
            self.roll_back();
            e.into()
        })
    }

    /// Free every extent of a tensor. All-or-nothing: every extent is checked to be allocated
    /// (and no two to overlap) before any is freed.
    pub fn free_tensor(&mut self, map: &StripeMap) -> Result<()> {
        self.validate_extents(map)?;
        for &(d, e) in &self.scratch {
            self.devices[d as usize].check_allocated(e)?;
        }
        for &(d, e) in &self.scratch {
            self.devices[d as usize]
                .free(e)
                .expect("extent was checked to be allocated and not to overlap another");
        }
        Ok(())
    }

    /// Mark a tensor's extents allocated, as when rebuilding from metadata on reopen.
    /// All-or-nothing: every extent is checked to be free before any is marked.
    pub fn mark_tensor(&mut self, map: &StripeMap) -> Result<()> {
        self.validate_extents(map)?;
        for &(d, e) in &self.scratch {
            self.devices[d as usize].check_free(e)?;
        }
        for &(d, e) in &self.scratch {
            self.devices[d as usize]
                .mark_allocated(e)
                .expect("extent was checked to be free and not to overlap another");
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
    /// (ties: lower index).
    fn choose_devices(&mut self, lanes: usize) {
        let devices = &self.devices;
        self.order.clear();
        self.order.extend(0..devices.len());
        self.order.sort_unstable_by_key(|&d| (std::cmp::Reverse(devices[d].free_bytes()), d));
        self.order.truncate(lanes);
    }

    fn no_space(&self, size_bytes: u64) -> Error {
        Error::NoSpace {
            requested_bytes: size_bytes,
            free_bytes: self.devices.iter().map(ExtentAllocator::free_bytes).sum(),
            device: None,
        }
    }

    /// Free what a failing `alloc_tensor` allocated so far (listed in `self.scratch`).
    fn roll_back(&mut self) {
        for &(d, e) in &self.scratch {
            self.devices[d as usize]
                .free(e)
                .expect("rolling back an extent allocated by this very call");
        }
        self.scratch.clear();
    }

    /// Leave in `self.scratch` the map's (device, extent) pairs, checked to name devices of the
    /// array and not to overlap one another (a deserialized map has not been through
    /// `StripeMap::new`).
    fn validate_extents(&mut self, map: &StripeMap) -> Result<()> {
        self.scratch.clear();
        self.scratch.extend(map.extents());
        let extents = &mut self.scratch;
        if let Some(&(d, _)) = extents.iter().find(|(d, _)| *d >= self.geometry.device_count) {
            return Err(Error::InvalidArgument(format!(
                "the tensor names device {d}, the array has {}",
                self.geometry.device_count
            )));
        }
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
}
