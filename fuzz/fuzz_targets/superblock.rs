//! Superblock::decode and pick_superblock: never panic; whatever decodes re-encodes to the
//! same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use teraio_layout::format::{SUPERBLOCK_MAGIC, Superblock, pick_superblock};

#[path = "common.rs"]
mod common;

fn check(bytes: &[u8]) {
    if let Ok(sb) = Superblock::decode(bytes) {
        let encoded = sb.encode().expect("a decoded superblock encodes");
        assert_eq!(&bytes[..encoded.len()], &encoded[..], "decode/encode round trip");
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    let half = data.len() / 2;
    let _ = pick_superblock([&data[..half], &data[half..]]);
    let mut sealed = data.to_vec();
    let block = common::u32_at(data, 16).unwrap_or(0) as usize;
    common::seal(&mut sealed, SUPERBLOCK_MAGIC, block);
    check(&sealed);
});
