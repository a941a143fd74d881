//! Checkpoint::decode and pick_checkpoint: never panic; whatever decodes re-encodes to the
//! same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use teraio_layout::format::{CHECKPOINT_MAGIC, Checkpoint, pick_checkpoint};

#[path = "common.rs"]
mod common;

fn check(bytes: &[u8]) {
    if let Ok(cp) = Checkpoint::decode(bytes) {
        let block = common::u32_at(bytes, 24).expect("decoded, so the header is there");
        let encoded = cp.encode(block).expect("a decoded checkpoint encodes");
        assert_eq!(&bytes[..encoded.len()], &encoded[..], "decode/encode round trip");
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    let half = data.len() / 2;
    let _ = pick_checkpoint([&data[..half], &data[half..]]);
    let mut sealed = data.to_vec();
    let total = common::u64_at(data, 16).unwrap_or(0).min(data.len() as u64) as usize;
    common::seal(&mut sealed, CHECKPOINT_MAGIC, total);
    check(&sealed);
});
