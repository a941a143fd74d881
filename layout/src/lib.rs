//! teraio's block layout: device and array geometry, the stripe map that places every byte of a
//! tensor on exactly one (device, offset), and the versioned, checksummed on-disk format.
//!
//! Pure: no I/O, no unsafe. Decoders of on-disk bytes never panic.
//!
//! ```
//! use teraio_layout::{Extent, Lane, StripeMap};
//! const MIB: u64 = 1 << 20;
//! // A 3 MiB tensor over two devices: units 0 and 2 on device 0, unit 1 on device 1.
//! let lanes = vec![
//!     Lane { device: 0, extents: vec![Extent { offset: 0, len: 2 * MIB }].into() },
//!     Lane { device: 1, extents: vec![Extent { offset: 0, len: MIB }].into() },
//! ];
//! let map = StripeMap::new(3 * MIB, MIB, 4096, lanes).unwrap();
//! assert_eq!(map.locate(2 * MIB).unwrap(), (0, MIB));
//! let segments = map.segments(0..3 * MIB, u64::MAX).unwrap();
//! assert_eq!(segments.len(), 2); // one I/O per device
//! ```
#![forbid(unsafe_code)]

mod error;
pub mod format;
pub mod geometry;
pub mod stripe;

pub use error::{Error, Result};
pub use geometry::{ArrayGeometry, DeviceGeometry, align_down, align_up, is_aligned};
pub use stripe::{Extent, Extents, Lane, Piece, Segment, StripeMap, lane_bytes, lane_count};
