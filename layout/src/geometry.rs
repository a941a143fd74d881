//! Device and array geometry, and alignment helpers.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Logical block size assumed when the device does not tell (a safe O_DIRECT default).
pub const DEFAULT_BLOCK_BYTES: u32 = 4096;
/// Default stripe unit: the bytes of a tensor placed on one device before moving to the next.
pub const DEFAULT_STRIPE_UNIT_BYTES: u64 = 1 << 20;

/// Round `value` up to a multiple of `align` (a power of two).
#[inline]
pub const fn align_up(value: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    (value + align - 1) & !(align - 1)
}

/// Round `value` down to a multiple of `align` (a power of two).
#[inline]
pub const fn align_down(value: u64, align: u64) -> u64 {
    debug_assert!(align.is_power_of_two());
    value & !(align - 1)
}

/// Whether `value` is a multiple of `align` (a power of two).
#[inline]
pub const fn is_aligned(value: u64, align: u64) -> bool {
    value & (align - 1) == 0
}

/// One device (a raw block device or a file) as the layout sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceGeometry {
    /// Logical block size: the O_DIRECT alignment of offsets, lengths and buffers.
    pub logical_block_bytes: u32,
    /// Usable capacity in bytes (a multiple of the logical block size).
    pub capacity_bytes: u64,
}

impl DeviceGeometry {
    /// Validate and build a device geometry.
    pub fn new(logical_block_bytes: u32, capacity_bytes: u64) -> Result<Self> {
        if !logical_block_bytes.is_power_of_two() || logical_block_bytes < 512 {
            return Err(Error::InvalidArgument(format!(
                "logical block size {logical_block_bytes} must be a power of two >= 512"
            )));
        }
        if !is_aligned(capacity_bytes, u64::from(logical_block_bytes)) {
            return Err(Error::Misaligned {
                what: "device capacity",
                value: capacity_bytes,
                align: u64::from(logical_block_bytes),
            });
        }
        Ok(Self { logical_block_bytes, capacity_bytes })
    }
}

/// N devices striped together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayGeometry {
    /// Number of devices in the array.
    pub device_count: u32,
    /// Block size of the array: the largest logical block size of its devices.
    pub block_bytes: u32,
    /// Stripe unit in bytes: a power of two >= `block_bytes`.
    pub stripe_unit_bytes: u64,
}

impl ArrayGeometry {
    /// Validate and build an array geometry.
    pub fn new(device_count: u32, block_bytes: u32, stripe_unit_bytes: u64) -> Result<Self> {
        if device_count == 0 {
            return Err(Error::InvalidArgument("an array needs at least one device".into()));
        }
        if !block_bytes.is_power_of_two() || block_bytes < 512 {
            return Err(Error::InvalidArgument(format!(
                "block size {block_bytes} must be a power of two >= 512"
            )));
        }
        if !stripe_unit_bytes.is_power_of_two() || stripe_unit_bytes < u64::from(block_bytes) {
            return Err(Error::InvalidArgument(format!(
                "stripe unit {stripe_unit_bytes} must be a power of two >= the block size {block_bytes}"
            )));
        }
        Ok(Self { device_count, block_bytes, stripe_unit_bytes })
    }
}
