//! Property tests of the on-disk format: round trips, and decoders that never panic on random
//! or mutated bytes.

mod common;

use common::*;
use proptest::prelude::*;
use teraio_layout::Error;
use teraio_layout::format::*;

/// Encode `batches` one after another into a journal region of `region_bytes`.
fn write_journal(
    batches: &[Vec<RecordBody>],
    block: u32,
    region_bytes: usize,
) -> (Vec<u8>, Vec<usize>) {
    let mut region = vec![0u8; region_bytes];
    let mut ends = Vec::new();
    let (mut pos, mut seq) = (0usize, 1u64);
    for records in batches {
        let bytes = encode_journal_batch(seq, records, block).unwrap();
        region[pos..pos + bytes.len()].copy_from_slice(&bytes);
        pos += bytes.len();
        seq += records.len() as u64;
        ends.push(pos);
    }
    (region, ends)
}

fn arbitrary_batches() -> impl Strategy<Value = Vec<Vec<RecordBody>>> {
    proptest::collection::vec(proptest::collection::vec(arbitrary_record_body(), 0..4), 1..5)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn superblock_round_trips(sb in arbitrary_superblock()) {
        let bytes = sb.encode().unwrap();
        prop_assert_eq!(bytes.len(), sb.block_bytes as usize);
        prop_assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()), SUPERBLOCK_MAGIC);
        prop_assert_eq!(Superblock::decode(&bytes).unwrap(), sb.clone());
        // A longer read (the whole 64 KiB copy slot) decodes the same.
        let mut slot = bytes.clone();
        slot.resize(64 << 10, 0xa5);
        prop_assert_eq!(Superblock::decode(&slot).unwrap(), sb);
    }

    #[test]
    fn device_layout_regions_are_ordered_aligned_and_inside(layout in arbitrary_device_layout()) {
        let block = u64::from(layout.block_bytes);
        let regions = [
            layout.superblocks[0],
            layout.superblocks[1],
            layout.journal,
            layout.checkpoints[0],
            layout.checkpoints[1],
            layout.data,
        ];
        for r in regions {
            prop_assert_eq!(r.offset % block, 0, "{:?}", r);
            prop_assert_eq!(r.len % block, 0, "{:?}", r);
        }
        prop_assert_eq!(layout.superblocks.map(|e| e.offset), SUPERBLOCK_OFFSETS);
        prop_assert!(layout.superblocks[1].end() <= SUPERBLOCK_AREA_BYTES);
        prop_assert_eq!(layout.journal.offset, SUPERBLOCK_AREA_BYTES);
        for w in regions[2..].windows(2) {
            prop_assert!(w[0].end() <= w[1].offset, "{:?} overlaps {:?}", w[0], w[1]);
        }
        prop_assert_eq!(layout.checkpoints[0].len, layout.checkpoints[1].len);
        let bitmap_bytes = layout.data_units().div_ceil(8);
        prop_assert!(layout.checkpoints[0].len >= CHECKPOINT_HEADER_BYTES as u64 + bitmap_bytes + layout.table_bytes);
        prop_assert!(layout.data.len > 0);
        prop_assert_eq!(layout.data.offset % layout.alloc_unit_bytes, 0);
        prop_assert_eq!(layout.data.len % layout.alloc_unit_bytes, 0);
        prop_assert!(layout.data.end() <= layout.capacity_bytes);
        // No whole allocation unit is wasted at the end.
        prop_assert!(layout.capacity_bytes - layout.data.end() < layout.alloc_unit_bytes);
    }

    #[test]
    fn tensor_record_round_trips(rec in arbitrary_tensor_record()) {
        let bytes = rec.encode().unwrap();
        prop_assert_eq!(TensorRecord::decode(&bytes).unwrap(), rec);
    }

    #[test]
    fn journal_round_trips(batches in arbitrary_batches(), block in arbitrary_block_bytes(), spare_blocks in 0usize..3) {
        let used: usize = batches
            .iter()
            .scan(1u64, |seq, r| {
                let len = encode_journal_batch(*seq, r, block).unwrap().len();
                *seq += r.len() as u64;
                Some(len)
            })
            .sum();
        let (region, ends) = write_journal(&batches, block, used + spare_blocks * block as usize);
        let scan = scan_journal(&region, block, 1).unwrap();
        prop_assert_eq!(scan.bytes_used as usize, used);
        prop_assert_eq!(&scan.stop, &if spare_blocks == 0 { ScanStop::End } else { ScanStop::Zeroed });
        prop_assert_eq!(scan.batches.len(), batches.len());
        for (i, b) in scan.batches.iter().enumerate() {
            prop_assert_eq!(b.offset as usize, if i == 0 { 0 } else { ends[i - 1] });
            prop_assert_eq!(b.len_bytes % u64::from(block), 0);
        }
        let all: Vec<&RecordBody> = batches.iter().flatten().collect();
        let scanned: Vec<(u64, &RecordBody)> = scan.records().collect();
        prop_assert_eq!(scanned.len(), all.len());
        for (i, (seq, rec)) in scanned.into_iter().enumerate() {
            prop_assert_eq!(seq, i as u64 + 1);
            prop_assert_eq!(rec, all[i]);
        }
        prop_assert_eq!(scan.next_seq, all.len() as u64 + 1);
    }

    #[test]
    fn checkpoint_round_trips(cp in arbitrary_checkpoint(), block in arbitrary_block_bytes()) {
        let bytes = cp.encode(block).unwrap();
        prop_assert_eq!(bytes.len() % block as usize, 0);
        prop_assert_eq!(Checkpoint::decode(&bytes).unwrap(), cp.clone());
        let mut slot = bytes;
        slot.extend(std::iter::repeat_n(0x5a, 3 * block as usize));
        prop_assert_eq!(Checkpoint::decode(&slot).unwrap(), cp);
    }

    #[test]
    fn random_bytes_never_decode(bytes in proptest::collection::vec(any::<u8>(), 0..9000), block in arbitrary_block_bytes()) {
        prop_assert!(Superblock::decode(&bytes).is_err());
        prop_assert!(Checkpoint::decode(&bytes).is_err());
        prop_assert!(decode_journal_batch(&bytes, block).is_err());
        // Random bytes may hold no valid batch: the scan stops cleanly before the first.
        let scan = scan_journal(&bytes, block, 1).unwrap();
        prop_assert!(scan.batches.is_empty());
        prop_assert_eq!(scan.bytes_used, 0);
        // A tensor record has no checksum of its own; it must not panic, and random bytes
        // essentially never form one.
        let _ = TensorRecord::decode(&bytes);
    }

    #[test]
    fn random_bytes_behind_a_valid_header_never_panic(
        tail in proptest::collection::vec(any::<u8>(), 0..4096),
        which in 0usize..3,
    ) {
        // Valid magic, version and crc in front of random fields: the field checks must hold.
        let (magic, mut bytes) = match which {
            0 => (SUPERBLOCK_MAGIC, Vec::new()),
            1 => (JOURNAL_BATCH_MAGIC, Vec::new()),
            _ => (CHECKPOINT_MAGIC, Vec::new()),
        };
        bytes.extend_from_slice(&magic.to_le_bytes());
        bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&[0; 4]);
        bytes.extend_from_slice(&tail);
        reseal(&mut bytes);
        let _ = Superblock::decode(&bytes);
        let _ = Checkpoint::decode(&bytes);
        let _ = decode_journal_batch(&bytes, 512);
        let _ = scan_journal(&bytes, 512, 1);
    }

    #[test]
    fn mutated_superblock_fails(sb in arbitrary_superblock(), at in any::<prop::sample::Index>(), bit in 0u8..8, byte in any::<u8>(), flip in any::<bool>()) {
        let mut bytes = sb.encode().unwrap();
        let i = at.index(bytes.len());
        mutate(&mut bytes, i, flip, bit, byte);
        prop_assert!(Superblock::decode(&bytes).is_err());
    }

    #[test]
    fn mutated_checkpoint_fails(cp in arbitrary_checkpoint(), at in any::<prop::sample::Index>(), bit in 0u8..8, byte in any::<u8>(), flip in any::<bool>()) {
        let mut bytes = cp.encode(4096).unwrap();
        let i = at.index(bytes.len());
        mutate(&mut bytes, i, flip, bit, byte);
        prop_assert!(Checkpoint::decode(&bytes).is_err());
    }

    #[test]
    fn mutated_tensor_record_never_panics(rec in arbitrary_tensor_record(), at in any::<prop::sample::Index>(), bit in 0u8..8, byte in any::<u8>(), flip in any::<bool>()) {
        let mut bytes = rec.encode().unwrap();
        let i = at.index(bytes.len());
        mutate(&mut bytes, i, flip, bit, byte);
        // No checksum of its own, so a mutation may still decode (e.g. a changed id); it must
        // then re-encode to the same bytes.
        if let Ok(r) = TensorRecord::decode(&bytes) {
            prop_assert_eq!(r.encode().unwrap(), bytes);
        }
    }

    #[test]
    fn mutated_journal_stops_cleanly_at_the_last_batch_else_reports_corruption(
        batches in arbitrary_batches(),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
        byte in any::<u8>(),
        flip in any::<bool>(),
    ) {
        let block = 4096u32;
        let (mut region, ends) = write_journal(&batches, block, 1 << 20);
        let used = *ends.last().unwrap();
        let pos = at.index(used);
        mutate(&mut region, pos, flip, bit, byte);
        let hit = ends.iter().position(|&end| pos < end).unwrap();
        match scan_journal(&region, block, 1) {
            Ok(scan) => {
                prop_assert_eq!(hit, batches.len() - 1, "damage before the last batch went unreported");
                prop_assert_eq!(scan.batches.len(), hit);
                prop_assert_eq!(scan.bytes_used as usize, if hit == 0 { 0 } else { ends[hit - 1] });
                prop_assert!(matches!(scan.stop, ScanStop::TornTail { .. }), "{:?}", scan.stop);
            }
            Err(e) => {
                prop_assert!(hit < batches.len() - 1, "torn last batch reported as {e}");
                prop_assert!(matches!(e, Error::Corruption { .. }), "{e}");
            }
        }
    }
}

/// Change byte `at`: flip one bit, or replace it with a different value.
fn mutate(bytes: &mut [u8], at: usize, flip: bool, bit: u8, byte: u8) {
    if flip || bytes[at] == byte {
        bytes[at] ^= 1 << bit;
    } else {
        bytes[at] = byte;
    }
}
