//! Targeted unit tests; the model-based test lives in `tests/state_machine.rs`.

use teraio_layout::{ArrayGeometry, Extent, Lane, StripeMap};

use crate::{ArrayAllocator, Error, ExtentAllocator, Stats};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const TIB: u64 = 1 << 40;

fn ext(offset: u64, len: u64) -> Extent {
    Extent { offset, len }
}

/// A device of `units` 1 MiB units at base 0, checked after construction.
fn device(units: u64) -> ExtentAllocator {
    let a = ExtentAllocator::new(0, 0, units * MIB, MIB).unwrap();
    a.check_invariants().unwrap();
    a
}

/// Everything observable about an allocator, to compare before and after a failing call.
fn snapshot(a: &ExtentAllocator) -> (Vec<u8>, Stats, Vec<Extent>) {
    (a.bitmap_bytes(), a.stats(), a.free_extents().collect())
}

#[test]
fn new_validates_unit_base_and_length() {
    assert!(matches!(ExtentAllocator::new(0, 0, MIB, 3 * KIB), Err(Error::InvalidArgument(_))));
    assert!(matches!(ExtentAllocator::new(0, 0, MIB, 2 * KIB), Err(Error::InvalidArgument(_))));
    assert!(matches!(ExtentAllocator::new(0, 512, MIB, 4 * KIB), Err(Error::InvalidArgument(_))));
    assert!(matches!(ExtentAllocator::new(0, 0, MIB - 1, MIB), Err(Error::InvalidArgument(_))));
    assert!(ExtentAllocator::new(0, u64::MAX - MIB, 2 * MIB, MIB).is_err());
    // A tail shorter than a unit is not managed.
    let a = ExtentAllocator::new(3, 8 * KIB, 10 * MIB + 5, MIB).unwrap();
    assert_eq!(a.capacity_bytes(), 10 * MIB);
    assert_eq!(a.unit_count(), 10);
    assert_eq!(a.free_extents().collect::<Vec<_>>(), vec![ext(8 * KIB, 10 * MIB)]);
}

#[test]
fn alloc_rounds_up_to_units_and_offsets_start_at_base() {
    let mut a = ExtentAllocator::new(1, 4 * MIB, 16 * MIB, MIB).unwrap();
    assert_eq!(a.alloc(1).unwrap(), vec![ext(4 * MIB, MIB)]);
    assert_eq!(a.alloc(MIB + 1).unwrap(), vec![ext(5 * MIB, 2 * MIB)]);
    assert_eq!(a.stats().used_bytes, 3 * MIB);
    assert!(matches!(a.alloc(0), Err(Error::InvalidArgument(_))));
    a.check_invariants().unwrap();
}

#[test]
fn best_fit_takes_the_smallest_hole_that_fits() {
    let mut a = device(32);
    // Holes of 4, 2 and 3 units separated by allocated units.
    let e: Vec<Extent> = (0..7).map(|_| a.alloc(MIB).unwrap()[0]).collect();
    assert_eq!(a.alloc(25 * MIB).unwrap(), vec![ext(7 * MIB, 25 * MIB)]);
    // Units 0..7 allocated one by one, 7..32 in one piece. Open holes 0..4 and 5..7.
    for i in [0, 1, 2, 3, 5, 6] {
        a.free(e[i]).unwrap();
    }
    assert_eq!(a.free_extents().collect::<Vec<_>>(), vec![ext(0, 4 * MIB), ext(5 * MIB, 2 * MIB)]);
    // 2 units fit exactly in the 2-unit hole, not the first (larger) one.
    assert_eq!(a.alloc(2 * MIB).unwrap(), vec![ext(5 * MIB, 2 * MIB)]);
    assert_eq!(a.alloc(MIB).unwrap(), vec![ext(0, MIB)]);
    a.check_invariants().unwrap();
}

#[test]
fn no_single_fit_uses_the_fewest_extents_largest_first() {
    let mut a = device(16);
    let units: Vec<Extent> = (0..16).map(|_| a.alloc(MIB).unwrap()[0]).collect();
    // Free holes of 1, 3, 2 and 4 units: [0], [2..5], [6..8], [10..14].
    for i in [0, 2, 3, 4, 6, 7, 10, 11, 12, 13] {
        a.free(units[i]).unwrap();
    }
    // 6 units: no hole holds them; largest (4) then the best fit for the remaining 2.
    let got = a.alloc(6 * MIB).unwrap();
    assert_eq!(got, vec![ext(6 * MIB, 2 * MIB), ext(10 * MIB, 4 * MIB)]);
    // 4 units left in holes of 1 and 3: both needed.
    let got = a.alloc(4 * MIB).unwrap();
    assert_eq!(got, vec![ext(0, MIB), ext(2 * MIB, 3 * MIB)]);
    assert_eq!(a.stats().free_bytes, 0);
    a.check_invariants().unwrap();
}

#[test]
fn no_space_leaves_the_allocator_unchanged() {
    let mut a = device(8);
    let x = a.alloc(3 * MIB).unwrap();
    let _y = a.alloc(2 * MIB).unwrap();
    a.free(x[0]).unwrap();
    // 6 units free in two holes (3 + 3); ask for 7.
    let before = snapshot(&a);
    let err = a.alloc(7 * MIB).unwrap_err();
    assert_eq!(
        err,
        Error::NoSpace { requested_bytes: 7 * MIB, free_bytes: 6 * MIB, device: Some(0) }
    );
    assert_eq!(snapshot(&a), before);
    a.check_invariants().unwrap();
    // Exactly the free space still succeeds, in two extents.
    assert_eq!(a.alloc(6 * MIB).unwrap().len(), 2);
}

#[test]
fn free_coalesces_with_both_neighbours() {
    let mut a = device(10);
    let x = a.alloc(2 * MIB).unwrap()[0];
    let y = a.alloc(3 * MIB).unwrap()[0];
    let z = a.alloc(MIB).unwrap()[0];
    assert_eq!(a.stats().free_extents, 1);
    a.free(x).unwrap();
    a.free(z).unwrap();
    assert_eq!(a.stats().free_extents, 2);
    a.free(y).unwrap();
    assert_eq!(a.free_extents().collect::<Vec<_>>(), vec![ext(0, 10 * MIB)]);
    assert_eq!(a.stats().largest_free_bytes, 10 * MIB);
    a.check_invariants().unwrap();
}

#[test]
fn double_and_partial_frees_are_errors_and_change_nothing() {
    let mut a = device(8);
    let x = a.alloc(2 * MIB).unwrap()[0];
    let y = a.alloc(2 * MIB).unwrap()[0];
    a.free(x).unwrap();
    let before = snapshot(&a);
    assert_eq!(a.free(x), Err(Error::NotAllocated { device: 0, offset: 0, len: 2 * MIB }));
    // Spanning the freed x and the allocated y.
    assert!(matches!(a.free(ext(MIB, 2 * MIB)), Err(Error::NotAllocated { .. })));
    assert!(matches!(a.free(ext(MIB / 2, MIB)), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.free(ext(2 * MIB, 0)), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.free(ext(6 * MIB, 4 * MIB)), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.free(ext(u64::MAX - MIB + 1, MIB)), Err(Error::InvalidArgument(_))));
    assert_eq!(snapshot(&a), before);
    // Freeing part of an allocation is allowed (it is a range of allocated units).
    a.free(ext(y.offset + MIB, MIB)).unwrap();
    assert!(a.check_allocated(ext(y.offset, MIB)).is_ok());
    a.check_invariants().unwrap();
}

#[test]
fn mark_allocated_splits_free_space_and_rejects_overlap() {
    let mut a = device(10);
    a.mark_allocated(ext(4 * MIB, 2 * MIB)).unwrap();
    assert_eq!(a.free_extents().collect::<Vec<_>>(), vec![ext(0, 4 * MIB), ext(6 * MIB, 4 * MIB)]);
    let before = snapshot(&a);
    assert_eq!(
        a.mark_allocated(ext(5 * MIB, 2 * MIB)),
        Err(Error::AlreadyAllocated { device: 0, offset: 5 * MIB, len: 2 * MIB })
    );
    assert_eq!(snapshot(&a), before);
    a.mark_allocated(ext(0, MIB)).unwrap();
    a.mark_allocated(ext(9 * MIB, MIB)).unwrap();
    assert_eq!(
        a.free_extents().collect::<Vec<_>>(),
        vec![ext(MIB, 3 * MIB), ext(6 * MIB, 3 * MIB)]
    );
    a.check_invariants().unwrap();
}

#[test]
fn fragmentation_reflects_how_splintered_free_space_is() {
    let mut a = device(16);
    assert_eq!(a.stats().fragmentation, 0.0);
    let units: Vec<Extent> = (0..16).map(|_| a.alloc(MIB).unwrap()[0]).collect();
    assert_eq!(a.stats().fragmentation, 0.0, "nothing free, nothing fragmented");
    // Free every other unit: 8 free extents of 1 unit.
    for u in units.iter().step_by(2) {
        a.free(*u).unwrap();
    }
    let s = a.stats();
    assert_eq!((s.free_bytes, s.largest_free_bytes, s.free_extents), (8 * MIB, MIB, 8));
    assert!((s.fragmentation - 7.0 / 8.0).abs() < 1e-12, "{}", s.fragmentation);
    // Free units 1 and 3: units 0..5 become one free extent of 5 (0,1,2,3,4).
    a.free(units[1]).unwrap();
    a.free(units[3]).unwrap();
    let s = a.stats();
    assert_eq!((s.free_bytes, s.largest_free_bytes, s.free_extents), (10 * MIB, 5 * MIB, 6));
    assert!((s.fragmentation - 0.5).abs() < 1e-12);
    assert_eq!(s.used_bytes + s.free_bytes, s.capacity_bytes);
}

#[test]
fn bitmap_round_trips_and_rejects_corruption() {
    let mut a = ExtentAllocator::new(2, 0, 13 * 4 * KIB, 4 * KIB).unwrap();
    a.alloc(8 * KIB).unwrap();
    a.mark_allocated(ext(12 * 4 * KIB, 4 * KIB)).unwrap();
    let bits = a.bitmap_bytes();
    assert_eq!(bits, vec![0b0000_0011, 0b0001_0000]);
    let b = ExtentAllocator::from_bitmap(2, 0, 13 * 4 * KIB, 4 * KIB, &bits).unwrap();
    b.check_invariants().unwrap();
    assert_eq!(b.stats(), a.stats());
    assert_eq!(b.free_extents().collect::<Vec<_>>(), a.free_extents().collect::<Vec<_>>());
    let load = |bits: &[u8]| ExtentAllocator::from_bitmap(2, 0, 13 * 4 * KIB, 4 * KIB, bits);
    assert!(matches!(load(&[0b11]), Err(Error::Corruption(_))));
    assert!(matches!(load(&[0, 0, 0]), Err(Error::Corruption(_))));
    assert!(matches!(load(&[0, 0b0010_0000]), Err(Error::Corruption(_))), "padding bit set");
    let full = load(&[0xff, 0x1f]).unwrap();
    assert_eq!(full.stats().free_bytes, 0);
    full.check_invariants().unwrap();
}

#[test]
fn a_16_tib_array_is_cheap_to_build_and_account() {
    let devices: Vec<ExtentAllocator> =
        (0..4).map(|d| ExtentAllocator::new(d, MIB, 4 * TIB, MIB).unwrap()).collect();
    assert!(devices.iter().all(|d| d.unit_count() == 4 << 20));
    let geometry = ArrayGeometry::new(4, 4096, MIB).unwrap();
    let mut array = ArrayAllocator::new(geometry, devices).unwrap();
    let map = array.alloc_tensor(1 << 30).unwrap();
    let s = array.stats();
    assert_eq!(s.total.capacity_bytes, 16 * TIB);
    assert_eq!(s.total.used_bytes, 1 << 30);
    assert!(s.devices.iter().all(|d| d.used_bytes == 256 * MIB));
    assert_eq!(s.total.free_extents, 4);
    array.free_tensor(&map).unwrap();
    array.check_invariants().unwrap();
}

fn array(device_count: u32, units_per_device: u64, unit: u64, stripe: u64) -> ArrayAllocator {
    let geometry = ArrayGeometry::new(device_count, 4096, stripe).unwrap();
    let devices = (0..device_count)
        .map(|d| ExtentAllocator::new(d, 0, units_per_device * unit, unit).unwrap())
        .collect();
    ArrayAllocator::new(geometry, devices).unwrap()
}

#[test]
fn array_new_validates_devices() {
    let geometry = ArrayGeometry::new(2, 4096, MIB).unwrap();
    let one = vec![ExtentAllocator::new(0, 0, 8 * MIB, MIB).unwrap()];
    assert!(matches!(ArrayAllocator::new(geometry, one), Err(Error::InvalidArgument(_))));
    let swapped = vec![
        ExtentAllocator::new(1, 0, 8 * MIB, MIB).unwrap(),
        ExtentAllocator::new(0, 0, 8 * MIB, MIB).unwrap(),
    ];
    assert!(matches!(ArrayAllocator::new(geometry, swapped), Err(Error::InvalidArgument(_))));
    let big_block = ArrayGeometry::new(1, 8192, MIB).unwrap();
    let small_unit = vec![ExtentAllocator::new(0, 0, 8 * MIB, 4 * KIB).unwrap()];
    assert!(matches!(ArrayAllocator::new(big_block, small_unit), Err(Error::InvalidArgument(_))));
}

#[test]
fn small_tensors_spread_over_all_devices() {
    let mut a = array(4, 64, MIB, MIB);
    let maps: Vec<StripeMap> = (0..8).map(|_| a.alloc_tensor(100 * KIB).unwrap()).collect();
    // Each one-lane tensor goes to the device with the most free space: round robin.
    let devices: Vec<u32> = maps.iter().map(|m| m.lanes()[0].device).collect();
    assert_eq!(devices, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    assert!(a.stats().devices.iter().all(|d| d.used_bytes == 2 * MIB));
    // A two-lane tensor picks the two emptiest devices after device 1 and 2 got more.
    a.alloc_tensor(2 * MIB).unwrap(); // lanes on devices 0 and 1
    let m = a.alloc_tensor(2 * MIB).unwrap();
    let lanes: Vec<u32> = m.lanes().iter().map(|l| l.device).collect();
    assert_eq!(lanes, vec![2, 3]);
    a.check_invariants().unwrap();
}

#[test]
fn striped_tensor_lanes_hold_their_share() {
    let mut a = array(3, 64, MIB, MIB);
    // 7 MiB + 1 over 3 devices: units 0..8, lanes hold 3, 3, 2 units (the last with a 4 KiB tail).
    let map = a.alloc_tensor(7 * MIB + 1).unwrap();
    let held: Vec<u64> = map.lanes().iter().map(Lane::capacity_bytes).collect();
    assert_eq!(held, vec![3 * MIB, 3 * MIB, 2 * MIB]);
    assert_eq!(map.locate(7 * MIB).unwrap().0, 1);
    assert_eq!(a.stats().total.used_bytes, 8 * MIB);
}

#[test]
fn array_no_space_rolls_back_everything() {
    let mut a = array(2, 8, MIB, MIB);
    let big = a.alloc_tensor(12 * MIB).unwrap(); // 6 units per device
    assert_eq!(a.stats().total.free_bytes, 4 * MIB);
    let before: Vec<_> = a.devices().iter().map(snapshot).collect();
    // 5 MiB needs 3 units on one device; each device has 2 free.
    let err = a.alloc_tensor(5 * MIB).unwrap_err();
    assert_eq!(err, Error::NoSpace { requested_bytes: 5 * MIB, free_bytes: 4 * MIB, device: None });
    assert_eq!(a.devices().iter().map(snapshot).collect::<Vec<_>>(), before);
    // 4 MiB fits exactly.
    let fit = a.alloc_tensor(4 * MIB).unwrap();
    assert_eq!(a.stats().total.free_bytes, 0);
    a.free_tensor(&fit).unwrap();
    a.free_tensor(&big).unwrap();
    assert_eq!(a.stats().total.used_bytes, 0);
    a.check_invariants().unwrap();
}

#[test]
fn small_units_let_a_lane_use_fragmented_space() {
    // 4 KiB allocation units under a 64 KiB stripe unit.
    let mut a = array(2, 64, 4 * KIB, 64 * KIB);
    // Fill both devices with one-unit tensors; tensor j lands on device j % 2 at unit j / 2.
    let pieces: Vec<StripeMap> = (0..128).map(|_| a.alloc_tensor(4 * KIB).unwrap()).collect();
    assert_eq!(
        pieces[5].lanes()[0],
        Lane { device: 1, extents: vec![ext(2 * 4 * KIB, 4 * KIB)].into() }
    );
    // Free the tensors at even units: 32 one-unit holes per device.
    for (j, m) in pieces.iter().enumerate() {
        if (j / 2).is_multiple_of(2) {
            a.free_tensor(m).unwrap();
        }
    }
    assert_eq!(a.stats().total.free_extents, 64);
    // 128 KiB over 2 lanes: 64 KiB per lane = 16 units, in 16 one-unit extents each.
    let map = a.alloc_tensor(128 * KIB).unwrap();
    assert!(map.lanes().iter().all(|l| l.extents.len() == 16));
    let segs = map.segments(0..128 * KIB, u64::MAX).unwrap();
    assert_eq!(segs.iter().map(|s| s.len).sum::<u64>(), 128 * KIB);
    assert_eq!(a.stats().total.free_extents, 32);
    assert_eq!(a.stats().total.free_bytes, 32 * 4 * KIB);
    a.check_invariants().unwrap();
}

#[test]
fn free_tensor_validates_everything_before_freeing() {
    let mut a = array(2, 16, MIB, MIB);
    let map = a.alloc_tensor(4 * MIB).unwrap();
    // Free lane 0 through another map naming the same extents: the tensor is now half free.
    let lane0 = map.lanes()[0].clone();
    let half = map.extents().find(|&(d, _)| d != lane0.device).unwrap();
    a.free_tensor(&StripeMap::new(MIB, MIB, 4096, vec![lane0]).unwrap()).unwrap();
    let before: Vec<_> = a.devices().iter().map(snapshot).collect();
    assert!(matches!(a.free_tensor(&map), Err(Error::NotAllocated { .. })));
    assert_eq!(a.devices().iter().map(snapshot).collect::<Vec<_>>(), before);
    assert!(a.device(half.0).check_allocated(half.1).is_ok());
}

#[test]
fn mark_tensor_rebuilds_after_reopen() {
    let mut a = array(3, 32, MIB, MIB);
    let maps: Vec<StripeMap> =
        [5 * MIB, MIB, 9 * MIB].iter().map(|&s| a.alloc_tensor(s).unwrap()).collect();
    // Reopen from metadata only: fresh devices, every tensor marked again.
    let mut b = array(3, 32, MIB, MIB);
    for m in &maps {
        b.mark_tensor(m).unwrap();
    }
    assert_eq!(b.stats(), a.stats());
    for i in 0..3 {
        assert_eq!(b.device(i).bitmap_bytes(), a.device(i).bitmap_bytes());
    }
    let before: Vec<_> = b.devices().iter().map(snapshot).collect();
    assert!(matches!(b.mark_tensor(&maps[1]), Err(Error::AlreadyAllocated { .. })));
    assert_eq!(b.devices().iter().map(snapshot).collect::<Vec<_>>(), before);
    b.check_invariants().unwrap();
}

#[test]
fn array_rejects_maps_naming_unknown_devices() {
    let mut a = array(2, 16, MIB, MIB);
    let lanes = vec![Lane { device: 5, extents: vec![ext(0, MIB)].into() }];
    let map = StripeMap::new(MIB, MIB, 4096, lanes).unwrap();
    assert!(matches!(a.free_tensor(&map), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.mark_tensor(&map), Err(Error::InvalidArgument(_))));
    assert!(matches!(a.alloc_tensor(0), Err(Error::InvalidArgument(_))));
}
