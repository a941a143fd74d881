//! decode_journal_batch and scan_journal: never panic; a decoded batch re-encodes to the same
//! bytes; a scan's batches are consecutive and lie inside the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use teraio_layout::format::{
    JOURNAL_BATCH_HEADER_BYTES, JOURNAL_BATCH_MAGIC, decode_journal_batch, encode_journal_batch,
    scan_journal,
};

#[path = "common.rs"]
mod common;

const BLOCK: u32 = 512;

fn check(bytes: &[u8], first_seq: u64) {
    if let Ok(batch) = decode_journal_batch(bytes, BLOCK) {
        let encoded = encode_journal_batch(batch.seq_first, &batch.records, BLOCK)
            .expect("a decoded batch encodes");
        assert_eq!(&bytes[..encoded.len()], &encoded[..], "decode/encode round trip");
    }
    if let Ok(scan) = scan_journal(bytes, BLOCK, first_seq) {
        assert!(scan.bytes_used as usize <= bytes.len());
        let mut expected = first_seq;
        for b in &scan.batches {
            assert_eq!(b.seq_first, expected);
            expected = b.seq_end();
        }
        assert_eq!(scan.next_seq, expected);
    }
}

fuzz_target!(|data: &[u8]| {
    check(data, 1);
    // Seal the first batch (its covered length comes from its payload field) and scan from
    // its own sequence number.
    let mut sealed = data.to_vec();
    let payload = common::u64_at(data, 32).unwrap_or(0).min(data.len() as u64) as usize;
    let covered = (JOURNAL_BATCH_HEADER_BYTES + payload).div_ceil(BLOCK as usize) * BLOCK as usize;
    common::seal(&mut sealed, JOURNAL_BATCH_MAGIC, covered);
    let seq = common::u64_at(data, 16).unwrap_or(1);
    check(&sealed, seq);
});
