//! Property tests of the stripe map: every byte of a tensor has exactly one home, and the I/O
//! segments cover a range exactly once, block-aligned and merged per device.

mod common;

use std::collections::HashMap;

use common::arbitrary_stripe_map;
use proptest::prelude::*;
use teraio_layout::{Extent, Lane, Segment, StripeMap, lane_bytes, lane_count};

/// Check `segments` against `locate` for `range` (start and end block-aligned or end = size).
fn check_segments(map: &StripeMap, start: u64, end: u64, segments: &[Segment], max_io: u64) {
    let block = u64::from(map.block_bytes());
    let end = if end == map.size_bytes() { map.padded_bytes() } else { end };
    let mut pieces = Vec::new();
    for s in segments {
        assert_eq!(s.device_offset % block, 0, "{s:?}");
        assert_eq!(s.len % block, 0, "{s:?}");
        assert!(s.len <= (max_io / block * block).max(block), "{s:?} longer than {max_io}");
        assert_eq!(s.len, s.pieces.iter().map(|p| p.len).sum::<u64>());
        let mut dev = s.device_offset;
        for p in &s.pieces {
            // The first and last byte of the piece live where the segment puts them.
            assert_eq!(map.locate(start + p.buf_offset).unwrap(), (s.device, dev));
            let last = start + p.buf_offset + p.len - 1;
            assert_eq!(map.locate(last).unwrap(), (s.device, dev + p.len - 1));
            dev += p.len;
            pieces.push((p.buf_offset, p.len));
        }
    }
    // Pieces tile [0, end - start) exactly once.
    pieces.sort_unstable();
    let mut at = 0;
    for (off, len) in pieces {
        assert_eq!(off, at, "gap or overlap at buffer offset {at}");
        at += len;
    }
    assert_eq!(at, end - start);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_block_of_a_tensor_has_exactly_one_home(map in arbitrary_stripe_map()) {
        let block = u64::from(map.block_bytes());
        let mut homes: HashMap<(u32, u64), u64> = HashMap::new();
        for b in 0..map.padded_bytes() / block {
            let (dev, off) = map.locate(b * block).unwrap();
            prop_assert_eq!(off % block, 0);
            // Within a block the bytes are contiguous on the device.
            prop_assert_eq!(map.locate(b * block + block - 1).unwrap(), (dev, off + block - 1));
            // The home lies inside one of the tensor's extents on that device.
            prop_assert!(map.extents().any(|(d, e)| d == dev && e.offset <= off && off + block <= e.end()));
            if let Some(prev) = homes.insert((dev, off), b) {
                prop_assert!(false, "blocks {} and {} both live at device {} offset {}", prev, b, dev, off);
            }
        }
        prop_assert!(map.locate(map.padded_bytes()).is_err());
    }

    #[test]
    fn segments_cover_the_whole_tensor_exactly_once(map in arbitrary_stripe_map(), max_io_blocks in prop_oneof![Just(u64::MAX / 4096), 1u64..64]) {
        let max_io = max_io_blocks.saturating_mul(u64::from(map.block_bytes()));
        let segs = map.segments(0..map.size_bytes(), max_io).unwrap();
        check_segments(&map, 0, map.size_bytes(), &segs, max_io);
    }

    #[test]
    fn segments_cover_any_aligned_subrange_exactly_once(
        map in arbitrary_stripe_map(),
        a in any::<prop::sample::Index>(),
        b in any::<prop::sample::Index>(),
        max_io_blocks in 1u64..64,
    ) {
        let block = u64::from(map.block_bytes());
        let blocks = map.padded_bytes() / block;
        let (x, y) = (a.index(blocks as usize) as u64, b.index(blocks as usize) as u64);
        let (start, end) = (x.min(y) * block, (x.max(y) + 1) * block);
        let max_io = max_io_blocks * block;
        let segs = map.segments(start..end, max_io).unwrap();
        check_segments(&map, start, end, &segs, max_io);
    }

    #[test]
    fn contiguous_lanes_merge_into_one_segment_per_device(
        block in prop_oneof![Just(512u32), Just(4096u32)],
        shift in 0u32..4,
        devices in 1u32..=8,
        size in 1u64..(1 << 22),
        starts in proptest::collection::vec(0u64..1024, 8),
    ) {
        let unit = u64::from(block) << shift;
        let need = lane_bytes(size, unit, block, lane_count(size, unit, devices));
        let lanes = need
            .iter()
            .zip(&starts)
            .enumerate()
            .map(|(i, (&n, &start))| Lane {
                device: i as u32,
                extents: vec![Extent { offset: start * u64::from(block), len: n }].into(),
            })
            .collect();
        let map = StripeMap::new(size, unit, block, lanes).unwrap();
        let segs = map.segments(0..map.size_bytes(), u64::MAX).unwrap();
        prop_assert_eq!(segs.len(), map.lanes().len());
        for (s, lane) in segs.iter().zip(map.lanes()) {
            prop_assert_eq!(s.device, lane.device);
            prop_assert_eq!(s.device_offset, lane.extents[0].offset);
            prop_assert_eq!(s.len, lane.extents[0].len);
        }
        check_segments(&map, 0, size, &segs, u64::MAX);
    }
}
