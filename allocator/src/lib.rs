//! teraio's extent allocator (pure): where a tensor's bytes go on the SSDs of an array.
//!
//! - [`ExtentAllocator`] manages one device in allocation units (default 1 MiB, any power of
//!   two >= 4 KiB). Its truth is a bitmap (one bit per unit) that can be persisted with
//!   [`ExtentAllocator::bitmap_bytes`] and rebuilt with [`ExtentAllocator::from_bitmap`]. Summary
//!   levels over the bitmap (one bit per non-zero word, up to one word) find a freed extent's free
//!   neighbours in a few word reads, and one index orders the free extents by (length, offset)
//!   for best fit: an exact-length bin per length below 4096 units (a sorted block list each,
//!   found through an occupancy bit set) and an ordered set for longer ones. `alloc` and `free`
//!   cost O(log64 units + log bin size), with no bitmap scan. Free coalesces neighbours.
//! - [`ArrayAllocator`] stripes a tensor over the devices with the most free space and returns a
//!   [`teraio_layout::StripeMap`]. The hot path allocates nothing for a map of up to
//!   [`teraio_layout::stripe::INLINE_LANES`] lanes each in one extent (the map holds them in
//!   place), and one block for a larger one.
//!
//! Every failing call leaves the allocator exactly as it was: [`Error::NoSpace`] allocates
//! nothing, and freeing an extent that is not (wholly) allocated is [`Error::NotAllocated`], not a
//! silent double free.
//!
//! ```
//! use teraio_allocator::{ArrayAllocator, Error, ExtentAllocator};
//! use teraio_layout::{ArrayGeometry, Extent};
//! const MIB: u64 = 1 << 20;
//!
//! // One device of 64 MiB in 1 MiB units, starting after a 1 MiB header.
//! let mut dev = ExtentAllocator::new(0, MIB, 64 * MIB, MIB).unwrap();
//! let a = dev.alloc(3 * MIB + 1).unwrap(); // rounded up to 4 units, one extent
//! assert_eq!(a, vec![Extent { offset: MIB, len: 4 * MIB }]);
//! dev.free(a[0]).unwrap();
//! assert!(matches!(dev.free(a[0]), Err(Error::NotAllocated { .. })));
//!
//! // Persist and rebuild.
//! let b = dev.alloc(10 * MIB).unwrap();
//! let again = ExtentAllocator::from_bitmap(0, MIB, 64 * MIB, MIB, &dev.bitmap_bytes()).unwrap();
//! assert_eq!(again.stats(), dev.stats());
//! assert!(again.check_allocated(b[0]).is_ok());
//!
//! // Four devices, 1 MiB stripe unit: a 6 MiB tensor takes 2 units on devices 0 and 1, 1 on 2 and 3.
//! let geometry = ArrayGeometry::new(4, 4096, MIB).unwrap();
//! let devices = (0..4).map(|d| ExtentAllocator::new(d, 0, 64 * MIB, MIB).unwrap()).collect();
//! let mut array = ArrayAllocator::new(geometry, devices).unwrap();
//! let map = array.alloc_tensor(6 * MIB).unwrap();
//! assert_eq!(map.lanes().len(), 4);
//! assert_eq!(array.stats().total.used_bytes, 6 * MIB);
//! array.free_tensor(&map).unwrap();
//! assert_eq!(array.stats().total.used_bytes, 0);
//! ```
#![forbid(unsafe_code)]

mod array;
mod bits;
mod blocks;
mod error;
mod extent;

pub use array::{ArrayAllocator, ArrayStats};
pub use error::{Error, Result};
pub use extent::{DEFAULT_UNIT_BYTES, ExtentAllocator, MIN_UNIT_BYTES, Stats};

#[cfg(test)]
mod tests;
