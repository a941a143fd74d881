//! DeviceLayout::compute on arbitrary parameters: never panics; a computed layout is ordered,
//! aligned, inside the device, and round-trips through a superblock.
#![no_main]

use libfuzzer_sys::fuzz_target;
use teraio_layout::format::{DeviceLayout, Superblock};

#[path = "common.rs"]
mod common;

fuzz_target!(|data: &[u8]| {
    let capacity = common::u64_at(data, 0).unwrap_or(0);
    let block = 1u32 << (common::u32_at(data, 8).unwrap_or(0) % 20);
    let unit = common::u64_at(data, 12).unwrap_or(0);
    let journal = common::u64_at(data, 20).unwrap_or(0);
    let table = common::u64_at(data, 28).unwrap_or(0);
    let Ok(l) = DeviceLayout::compute(capacity, block, unit, journal, table) else { return };
    let b = u64::from(block);
    let regions = [l.journal, l.checkpoints[0], l.checkpoints[1], l.data];
    for w in regions.windows(2) {
        assert!(w[0].offset + w[0].len <= w[1].offset);
    }
    assert!(regions.iter().all(|r| r.offset % b == 0 && r.len % b == 0));
    assert!(l.data.offset % unit == 0 && l.data.len % unit == 0 && l.data.len > 0);
    assert!(l.data.offset + l.data.len <= capacity);
    let sb = Superblock::new([1; 16], 0, 1, unit.max(b), l, 1, 0).expect("valid superblock");
    assert_eq!(Superblock::decode(&sb.encode().unwrap()).unwrap(), sb);
});
