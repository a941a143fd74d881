//! Unit tests of the format's rules: one per error variant of every decoder, the choice between
//! two copies, and each way a journal scan stops.

mod common;

use common::{build_stripe_map, reseal};
use teraio_layout::format::*;
use teraio_layout::{Error, Extent, Lane, StripeMap};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn layout() -> DeviceLayout {
    DeviceLayout::with_defaults(GIB, 4096, MIB).unwrap()
}

fn superblock(generation: u64) -> Superblock {
    Superblock::new([0x42; 16], 1, 4, MIB, layout(), generation, 1_700_000_000).unwrap()
}

fn tensor(id: u64, size: u64) -> TensorRecord {
    let stripe = build_stripe_map(4096, 8, 3, size, id);
    TensorRecord {
        id,
        name: format!("layer{id}.weight"),
        size_bytes: size,
        stripe,
        checksum_chunk_bytes: 4096,
        checksums: (0..size.div_ceil(4096) as u32).collect(),
    }
}

fn checkpoint(generation: u64) -> Checkpoint {
    Checkpoint {
        array_uuid: [0x42; 16],
        generation,
        journal_seq: 17,
        device_index: 0,
        alloc_unit_bytes: MIB,
        bitmap_bits: 13,
        bitmap: vec![0b1010_0101, 0b1_0001],
        tensors: vec![tensor(3, 5 * MIB + 7), tensor(9, 100)],
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

// ---- superblock -----------------------------------------------------------------------------

#[test]
fn superblock_magic_is_at_offset_zero_and_reads_teraiosb() {
    let bytes = superblock(1).encode().unwrap();
    assert_eq!(&bytes[..8], b"TERAIOSB");
    assert_eq!(SUPERBLOCK_MAGIC, u64::from_le_bytes(*b"TERAIOSB"));
}

#[test]
fn superblock_bad_magic() {
    let err = Superblock::decode(&[0u8; 4096]).unwrap_err();
    assert_eq!(err, Error::BadMagic { what: "superblock", expected: SUPERBLOCK_MAGIC, found: 0 });
    let mut bytes = superblock(1).encode().unwrap();
    bytes[0] = b'X';
    assert!(matches!(Superblock::decode(&bytes), Err(Error::BadMagic { .. })));
}

#[test]
fn superblock_future_and_zero_version() {
    for version in [0u32, FORMAT_VERSION + 1, u32::MAX] {
        let mut bytes = superblock(1).encode().unwrap();
        bytes[8..12].copy_from_slice(&version.to_le_bytes());
        reseal(&mut bytes);
        assert_eq!(
            Superblock::decode(&bytes).unwrap_err(),
            Error::UnsupportedVersion {
                what: "superblock",
                found: version,
                supported: FORMAT_VERSION
            }
        );
    }
}

#[test]
fn superblock_checksum_mismatch() {
    let mut bytes = superblock(1).encode().unwrap();
    let stored = u32_at(&bytes, 12);
    bytes[40] ^= 0x10; // inside the uuid
    match Superblock::decode(&bytes).unwrap_err() {
        Error::ChecksumMismatch { what, stored: s, computed } => {
            assert_eq!((what, s), ("superblock", stored));
            assert_ne!(computed, stored);
        }
        e => panic!("expected a checksum mismatch, got {e}"),
    }
    // The padding up to the block size is covered too.
    let mut bytes = superblock(1).encode().unwrap();
    bytes[4095] = 1;
    assert!(matches!(Superblock::decode(&bytes), Err(Error::ChecksumMismatch { .. })));
}

#[test]
fn superblock_truncated() {
    let bytes = superblock(1).encode().unwrap();
    for len in [0, 7, 15, 19, 100, 4095] {
        match Superblock::decode(&bytes[..len]) {
            Err(Error::Corruption { what: "superblock", detail }) => {
                assert!(detail.contains("truncated"), "{len}: {detail}")
            }
            other => panic!("{len} bytes: expected truncation, got {other:?}"),
        }
    }
}

#[test]
fn superblock_fields_checked_after_the_checksum() {
    let corrupt_after = |edit: &dyn Fn(&mut Vec<u8>)| {
        let mut bytes = superblock(1).encode().unwrap();
        edit(&mut bytes);
        reseal(&mut bytes);
        Superblock::decode(&bytes).unwrap_err()
    };
    // Block size field not a power of two.
    let e = corrupt_after(&|b| b[16..20].copy_from_slice(&4097u32.to_le_bytes()));
    assert!(matches!(e, Error::Corruption { .. }), "{e}");
    // Device index out of range.
    let e = corrupt_after(&|b| b[20..24].copy_from_slice(&9u32.to_le_bytes()));
    assert!(
        matches!(&e, Error::Corruption { detail, .. } if detail.contains("device index")),
        "{e}"
    );
    // Reserved flags.
    let e = corrupt_after(&|b| b[28] = 1);
    assert!(matches!(&e, Error::Corruption { detail, .. } if detail.contains("reserved")), "{e}");
    // A byte past the fields.
    let e = corrupt_after(&|b| b[SUPERBLOCK_FIELDS_BYTES + 3] = 9);
    assert!(
        matches!(&e, Error::Corruption { detail, .. } if detail.contains("reserved byte")),
        "{e}"
    );
    // Stored data region that disagrees with the parameters.
    let e = corrupt_after(&|b| b[160..168].copy_from_slice(&MIB.to_le_bytes()));
    assert!(matches!(&e, Error::Corruption { detail, .. } if detail.contains("disagree")), "{e}");
}

#[test]
fn superblock_new_and_encode_reject_inconsistency() {
    let l = layout();
    assert!(matches!(Superblock::new([1; 16], 4, 4, MIB, l, 1, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        Superblock::new([1; 16], 0, 4, 1000, l, 1, 0),
        Err(Error::InvalidArgument(_))
    ));
    let mut sb = superblock(1);
    sb.layout.data.len -= MIB;
    assert!(matches!(sb.encode(), Err(Error::InvalidArgument(_))));
    let mut sb = superblock(1);
    sb.block_bytes = 512;
    assert!(matches!(sb.encode(), Err(Error::InvalidArgument(_))));
}

#[test]
fn pick_superblock_prefers_the_higher_valid_generation() {
    let old = superblock(4).encode().unwrap();
    let new = superblock(5).encode().unwrap();
    let c = pick_superblock([&old, &new]).unwrap();
    assert_eq!((c.index, c.value.generation), (1, 5));
    assert_eq!(c.copies, [Ok(4), Ok(5)]);
    assert!(!c.in_sync());
    assert!(c.damaged().is_none());

    let c = pick_superblock([&new, &new]).unwrap();
    assert_eq!(c.index, 0);
    assert!(c.in_sync());

    let mut torn = new.clone();
    torn[100] ^= 1;
    let c = pick_superblock([&torn, &old]).unwrap();
    assert_eq!((c.index, c.value.generation), (1, 4));
    assert!(matches!(c.damaged(), Some((0, Error::ChecksumMismatch { .. }))));
}

#[test]
fn pick_superblock_errors() {
    let zero = vec![0u8; 4096];
    assert!(matches!(pick_superblock([&zero, &zero]), Err(Error::BadMagic { .. })));
    let mut torn = superblock(1).encode().unwrap();
    torn[200] = 1;
    // A damaged teraio superblock is reported rather than "no array here".
    assert!(matches!(pick_superblock([&zero, &torn]), Err(Error::ChecksumMismatch { .. })));
    // Same generation, different contents.
    let a = superblock(3).encode().unwrap();
    let mut other = superblock(3);
    other.created_unix_s += 1;
    let b = other.encode().unwrap();
    assert!(matches!(pick_superblock([&a, &b]), Err(Error::Corruption { .. })));
}

// ---- device layout --------------------------------------------------------------------------

#[test]
fn device_layout_defaults() {
    let big = DeviceLayout::with_defaults(1 << 40, 4096, MIB).unwrap();
    assert_eq!(big.journal, Extent { offset: SUPERBLOCK_AREA_BYTES, len: DEFAULT_JOURNAL_BYTES });
    assert_eq!(big.table_bytes, DEFAULT_TABLE_BYTES);
    // Bitmap of 2^20 units = 128 KiB, plus header and table, rounded to the block.
    let slot =
        (CHECKPOINT_HEADER_BYTES as u64 + (128 << 10) + DEFAULT_TABLE_BYTES).div_ceil(4096) * 4096;
    assert_eq!(big.checkpoints[0].len, slot);
    // The worked example of docs/FORMAT.md.
    assert_eq!(big.checkpoints[0].offset, 67_239_936);
    assert_eq!(big.checkpoints[1].offset, 134_483_968);
    assert_eq!(slot, 67_244_032);
    assert_eq!(big.data.offset, 193 * MIB);
    assert_eq!(big.data.end(), 1 << 40);
    assert_eq!(big.data_units(), (1 << 20) - 193);

    let small = DeviceLayout::with_defaults(64 * MIB, 4096, 64 << 10).unwrap();
    assert_eq!(small.journal.len, 4 * MIB);
    assert_eq!(small.table_bytes, 2 * MIB);
    assert!(small.data_units() > 0);
    assert_eq!(default_journal_bytes(0), 64 << 10);
}

#[test]
fn device_layout_rejects_bad_parameters() {
    let c = DeviceLayout::compute;
    assert!(matches!(c(GIB, 1000, MIB, 0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(c(GIB, 256, MIB, 0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(c(GIB, 128 << 10, MIB, 0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(c(GIB, 4096, 2048, 0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(c(GIB, 4096, 3 * MIB, 0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(c(GIB + 512, 4096, MIB, 0, 0), Err(Error::Misaligned { .. })));
    assert!(matches!(c(GIB, 4096, MIB, 100, 0), Err(Error::Misaligned { .. })));
    // Too small for the metadata plus one unit, and overflowing sizes, are errors, not panics.
    assert!(matches!(c(MIB, 4096, MIB, 0, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(c(GIB, 4096, MIB, GIB, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(c(GIB, 4096, MIB, 0, u64::MAX), Err(Error::InvalidArgument(_))));
    let max_journal = u64::MAX / 4096 * 4096;
    assert!(matches!(
        c(u64::MAX / 4096 * 4096, 4096, 1 << 63, max_journal, 0),
        Err(Error::InvalidArgument(_))
    ));
    // A journal of 0 bytes is allowed (devices without one).
    let l = c(GIB, 4096, MIB, 0, 0).unwrap();
    assert_eq!(l.journal.len, 0);
    assert_eq!(l.checkpoints[0].offset, SUPERBLOCK_AREA_BYTES);
}

// ---- tensor records -------------------------------------------------------------------------

#[test]
fn tensor_record_encode_rejects_invalid_records() {
    let mut t = tensor(1, 3 * MIB);
    t.size_bytes += 1;
    assert!(matches!(t.encode(), Err(Error::InvalidArgument(_))));
    let mut t = tensor(1, 3 * MIB);
    t.checksums.pop();
    assert!(matches!(t.encode(), Err(Error::InvalidArgument(_))));
    let mut t = tensor(1, 3 * MIB);
    t.checksum_chunk_bytes = MIB;
    assert!(matches!(t.encode(), Err(Error::InvalidArgument(_))));
    t.checksums.truncate(3);
    assert!(t.encode().is_ok());
    t.checksum_chunk_bytes = 0;
    assert!(matches!(t.encode(), Err(Error::InvalidArgument(_))));
    t.checksums.clear();
    assert!(t.encode().is_ok());
    let mut t = tensor(1, 3 * MIB);
    t.name = "x".repeat(MAX_TENSOR_NAME_BYTES + 1);
    assert!(matches!(t.encode(), Err(Error::InvalidArgument(_))));
}

#[test]
fn tensor_record_truncated_or_trailing_bytes() {
    let bytes = tensor(1, 3 * MIB).encode().unwrap();
    for len in [0, 10, 47, 60, bytes.len() - 1] {
        assert!(
            matches!(TensorRecord::decode(&bytes[..len]), Err(Error::Corruption { .. })),
            "{len}"
        );
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(TensorRecord::decode(&long), Err(Error::Corruption { .. })));
}

#[test]
fn tensor_record_hostile_fields() {
    let t = tensor(1, 3 * MIB);
    let bytes = t.encode().unwrap();
    let edit = |at: usize, v: &[u8]| {
        let mut b = bytes.clone();
        b[at..at + v.len()].copy_from_slice(v);
        TensorRecord::decode(&b).unwrap_err()
    };
    // Fixed part: id 0, size 8, chunk 16, unit 24, block 32, name len 36, lanes 40, sums 44.
    let detail = |e: Error| match e {
        Error::Corruption { detail, .. } => detail,
        e => panic!("expected corruption, got {e}"),
    };
    assert!(detail(edit(36, &u32::MAX.to_le_bytes())).contains("name"));
    assert!(detail(edit(40, &u32::MAX.to_le_bytes())).contains("lanes"));
    assert!(detail(edit(44, &u32::MAX.to_le_bytes())).contains("checksums"));
    assert!(detail(edit(8, &u64::MAX.to_le_bytes())).contains("exceeds"));
    assert!(detail(edit(8, &(2 * MIB).to_le_bytes())).contains("checksums"));
    assert!(detail(edit(24, &3000u64.to_le_bytes())).contains("stripe map"));
    assert!(detail(edit(48, &[0xff])).contains("UTF-8"));
    // First extent: offset at 48 + name + 8; make it overflow.
    let ext = 48 + t.name.len() + 8;
    assert!(detail(edit(ext, &u64::MAX.to_le_bytes())).contains("overflows"));
    assert!(detail(edit(ext, &1u64.to_le_bytes())).contains("stripe map"));
}

#[test]
fn tensor_record_lanes_adding_past_u64_are_rejected_before_stripe_map_arithmetic() {
    // Two extents of 2^63 bytes each: their sum overflows u64.
    let e = Extent { offset: 0, len: 1 << 63 };
    let map = StripeMap::new(4096, 4096, 4096, vec![Lane { device: 0, extents: vec![e].into() }])
        .unwrap();
    let t = TensorRecord {
        id: 1,
        name: String::new(),
        size_bytes: 4096,
        stripe: map,
        checksum_chunk_bytes: 0,
        checksums: vec![],
    };
    let mut bytes = t.encode().unwrap();
    // Add a second lane by hand: device 1, one extent of 2^63.
    bytes[40..44].copy_from_slice(&2u32.to_le_bytes());
    bytes.extend_from_slice(&1u32.to_le_bytes());
    bytes.extend_from_slice(&1u32.to_le_bytes());
    bytes.extend_from_slice(&0u64.to_le_bytes());
    bytes.extend_from_slice(&(1u64 << 63).to_le_bytes());
    match TensorRecord::decode(&bytes).unwrap_err() {
        Error::Corruption { detail, .. } => assert!(detail.contains("2^64"), "{detail}"),
        e => panic!("{e}"),
    }
}

// ---- journal --------------------------------------------------------------------------------

const BLOCK: u32 = 4096;

/// A record of about 2 KiB (512 checksums).
fn put(id: u64) -> RecordBody {
    RecordBody::PutTensor(tensor(id, 2 * MIB + 3))
}

fn batch(seq: u64, records: &[RecordBody]) -> Vec<u8> {
    encode_journal_batch(seq, records, BLOCK).unwrap()
}

/// A 256 KiB region holding `batches` from offset `at`.
fn region_with(parts: &[(usize, &[u8])]) -> Vec<u8> {
    let mut region = vec![0u8; 256 << 10];
    for (at, bytes) in parts {
        region[*at..*at + bytes.len()].copy_from_slice(bytes);
    }
    region
}

#[test]
fn journal_batch_errors() {
    let b = batch(1, &[put(1), RecordBody::DeleteTensor { id: 1 }]);
    assert_eq!(&b[..8], b"TERAIOJB");
    let mut bad = b.clone();
    bad[3] = 0;
    assert!(matches!(decode_journal_batch(&bad, BLOCK), Err(Error::BadMagic { .. })));
    let mut future = b.clone();
    future[8..12].copy_from_slice(&2u32.to_le_bytes());
    reseal(&mut future);
    assert!(matches!(
        decode_journal_batch(&future, BLOCK),
        Err(Error::UnsupportedVersion { found: 2, supported: 1, .. })
    ));
    let mut flipped = b.clone();
    flipped[b.len() - 1] ^= 0x80; // padding is covered by the crc
    assert!(matches!(decode_journal_batch(&flipped, BLOCK), Err(Error::ChecksumMismatch { .. })));
    for len in [0, 20, 47, 48, b.len() - 1] {
        assert!(
            matches!(decode_journal_batch(&b[..len], BLOCK), Err(Error::Corruption { .. })),
            "{len}"
        );
    }
    // Payload length beyond the input, resealed: truncation, not an allocation.
    let mut huge = b.clone();
    huge[32..40].copy_from_slice(&u64::MAX.to_le_bytes());
    reseal(&mut huge);
    assert!(matches!(decode_journal_batch(&huge, BLOCK), Err(Error::Corruption { .. })));
    // Record count that cannot fit the payload.
    let mut many = b.clone();
    many[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    reseal(&mut many);
    assert!(matches!(decode_journal_batch(&many, BLOCK), Err(Error::Corruption { .. })));
    assert!(matches!(decode_journal_batch(&b, 1000), Err(Error::InvalidArgument(_))));
}

#[test]
fn journal_encode_rejects_invalid_input() {
    assert!(matches!(encode_journal_batch(0, &[], BLOCK), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        encode_journal_batch(u64::MAX, &[put(1)], BLOCK),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(encode_journal_batch(1, &[], 3000), Err(Error::InvalidArgument(_))));
    let bad_slot = RecordBody::Checkpoint { generation: 1, slot: 2 };
    assert!(matches!(encode_journal_batch(1, &[bad_slot], BLOCK), Err(Error::InvalidArgument(_))));
    let mut t = tensor(1, MIB);
    t.checksums.push(0);
    let bad = RecordBody::PutTensor(t);
    assert!(matches!(encode_journal_batch(1, &[bad], BLOCK), Err(Error::InvalidArgument(_))));
}

#[test]
fn journal_scan_stops_at_zeroed_block_and_at_end() {
    let a = batch(1, &[put(1), put(2)]);
    let b = batch(3, &[RecordBody::Checkpoint { generation: 2, slot: 1 }]);
    let region = region_with(&[(0, &a), (a.len(), &b)]);
    let scan = scan_journal(&region, BLOCK, 1).unwrap();
    assert_eq!(scan.stop, ScanStop::Zeroed);
    assert_eq!(scan.bytes_used as usize, a.len() + b.len());
    assert_eq!(scan.next_seq, 4);
    assert_eq!(scan.records().map(|(s, _)| s).collect::<Vec<_>>(), vec![1, 2, 3]);

    let full = [&a[..], &b[..]].concat();
    let scan = scan_journal(&full, BLOCK, 1).unwrap();
    assert_eq!((scan.stop, scan.bytes_used as usize), (ScanStop::End, full.len()));
    // A trailing partial block is not scanned.
    let scan = scan_journal(&full[..full.len() - 1], BLOCK, 1).unwrap();
    assert_eq!((scan.stop, scan.batches.len()), (ScanStop::End, 1));

    let empty = scan_journal(&[0u8; 8192], BLOCK, 42).unwrap();
    assert_eq!((empty.stop, empty.bytes_used, empty.next_seq), (ScanStop::Zeroed, 0, 42));
    assert!(matches!(scan_journal(&region, 100, 1), Err(Error::InvalidArgument(_))));
}

#[test]
fn journal_scan_stops_cleanly_at_a_torn_tail() {
    let a = batch(1, &[put(1)]);
    let b = batch(2, &[put(2), put(3), put(4)]);
    assert!(b.len() > BLOCK as usize);
    // Crash mid-append: only the first block of b reached the disk.
    let region = region_with(&[(0, &a), (a.len(), &b[..BLOCK as usize])]);
    let scan = scan_journal(&region, BLOCK, 1).unwrap();
    assert_eq!(scan.batches.len(), 1);
    assert_eq!((scan.bytes_used as usize, scan.next_seq), (a.len(), 2));
    assert!(matches!(scan.stop, ScanStop::TornTail { error: Error::ChecksumMismatch { .. } }));
    // Crash with only the tail blocks written: leftover non-zero bytes, no header.
    let region = region_with(&[(0, &a), (a.len() + BLOCK as usize, &b[BLOCK as usize..])]);
    let mut region = region;
    region[a.len()] = 0x77;
    let scan = scan_journal(&region, BLOCK, 1).unwrap();
    assert!(matches!(scan.stop, ScanStop::TornTail { error: Error::BadMagic { .. } }));
    assert_eq!(scan.bytes_used as usize, a.len());
}

#[test]
fn journal_scan_after_a_reset_ignores_older_batches() {
    // Before the checkpoint: a (seq 1..=3, several blocks) and b (seq 4). The checkpoint
    // covers seq 4, the journal restarts at offset 0 with seq 5.
    let a = batch(1, &[put(1), put(2), put(3)]);
    let b = batch(4, &[RecordBody::DeleteTensor { id: 1 }]);
    let c = batch(5, &[RecordBody::DeleteTensor { id: 2 }]);
    assert!(c.len() < a.len());
    let region = region_with(&[(0, &a), (a.len(), &b), (0, &c)]);
    let scan = scan_journal(&region, BLOCK, 5).unwrap();
    assert_eq!(scan.batches.len(), 1);
    assert_eq!((scan.bytes_used as usize, scan.next_seq), (c.len(), 6));
    // The next block holds the middle of a: torn-looking, and b after it is older: clean.
    assert!(matches!(scan.stop, ScanStop::TornTail { .. }), "{:?}", scan.stop);

    // Nothing appended since the reset: the first batch is stale.
    let region = region_with(&[(0, &a), (a.len(), &b)]);
    let scan = scan_journal(&region, BLOCK, 5).unwrap();
    assert_eq!(scan.stop, ScanStop::Stale { seq_first: 1 });
    assert_eq!((scan.bytes_used, scan.next_seq, scan.batches.len()), (0, 5, 0));

    // A new batch exactly as long as the old one: the old b follows and is stale.
    let c3 = batch(5, &[put(7), put(8), put(9)]);
    assert_eq!(c3.len(), a.len());
    let region = region_with(&[(0, &c3), (a.len(), &b)]);
    let scan = scan_journal(&region, BLOCK, 5).unwrap();
    assert_eq!(scan.stop, ScanStop::Stale { seq_first: 4 });
    assert_eq!(scan.next_seq, 8);
}

#[test]
fn journal_scan_reports_lost_records_as_corruption() {
    let a = batch(1, &[put(1)]);
    let b = batch(2, &[put(2)]);
    let c = batch(3, &[put(3)]);
    // Damage in the middle, valid newer batch after it.
    let mut region = region_with(&[(0, &a), (a.len(), &b), (a.len() + b.len(), &c)]);
    region[a.len() + 60] ^= 1;
    match scan_journal(&region, BLOCK, 1).unwrap_err() {
        Error::Corruption { what: "journal", detail } => {
            assert!(detail.contains(&format!("offset {} holds a damaged", a.len())), "{detail}");
            assert!(detail.contains("seq 3 follows"), "{detail}");
        }
        e => panic!("{e}"),
    }
    // A zeroed block in the middle (e.g. a lost write) with a newer batch after it.
    let region = region_with(&[(0, &a), (a.len() + b.len(), &c)]);
    match scan_journal(&region, BLOCK, 1).unwrap_err() {
        Error::Corruption { detail, .. } => assert!(detail.contains("zeroed"), "{detail}"),
        e => panic!("{e}"),
    }
    // An older batch where b should be (a lost overwrite after a restart), c after it.
    let old = batch(1, &[RecordBody::DeleteTensor { id: 5 }]);
    let region = region_with(&[(0, &a), (a.len(), &old), (a.len() + b.len(), &c)]);
    match scan_journal(&region, BLOCK, 1).unwrap_err() {
        Error::Corruption { detail, .. } => assert!(detail.contains("older batch"), "{detail}"),
        e => panic!("{e}"),
    }
    // A gap in sequence numbers between valid batches.
    let region = region_with(&[(0, &a), (a.len(), &c)]);
    assert!(matches!(scan_journal(&region, BLOCK, 1), Err(Error::Corruption { .. })));
    // The first batch is newer than the checkpoint expects (the newer checkpoint was lost).
    assert!(matches!(
        scan_journal(&region_with(&[(0, &b)]), BLOCK, 1),
        Err(Error::Corruption { .. })
    ));
}

// ---- checkpoints ----------------------------------------------------------------------------

#[test]
fn checkpoint_round_trip_and_bitmap() {
    let cp = checkpoint(3);
    let bytes = cp.encode(BLOCK).unwrap();
    assert_eq!(&bytes[..8], b"TERAIOCP");
    assert_eq!(Checkpoint::decode(&bytes).unwrap(), cp);
    let used: Vec<u64> = (0..16).filter(|&u| cp.unit_in_use(u)).collect();
    assert_eq!(used, vec![0, 2, 5, 7, 8, 12]);
}

#[test]
fn checkpoint_errors() {
    let bytes = checkpoint(3).encode(BLOCK).unwrap();
    assert!(matches!(
        Checkpoint::decode(&vec![0u8; bytes.len()]),
        Err(Error::BadMagic { found: 0, .. })
    ));
    let mut future = bytes.clone();
    future[8] = 7;
    reseal(&mut future);
    assert!(matches!(Checkpoint::decode(&future), Err(Error::UnsupportedVersion { found: 7, .. })));
    let mut flipped = bytes.clone();
    flipped[bytes.len() / 2] ^= 4;
    assert!(matches!(Checkpoint::decode(&flipped), Err(Error::ChecksumMismatch { .. })));
    for len in [0, 12, 30, 100, bytes.len() - 1] {
        assert!(
            matches!(Checkpoint::decode(&bytes[..len]), Err(Error::Corruption { .. })),
            "{len}"
        );
    }
    // A total length that is not whole blocks, resealed over the shorter range.
    let mut odd = bytes.clone();
    odd[16..24].copy_from_slice(&1000u64.to_le_bytes());
    reseal(&mut odd[..1000]);
    assert!(matches!(Checkpoint::decode(&odd), Err(Error::Corruption { .. })));
    // A bitmap bit count far beyond the input: corruption, not a huge allocation.
    let mut bits = bytes.clone();
    bits[72..80].copy_from_slice(&u64::MAX.to_le_bytes());
    reseal(&mut bits);
    assert!(matches!(Checkpoint::decode(&bits), Err(Error::Corruption { .. })));
}

#[test]
fn checkpoint_encode_rejects_invalid_checkpoints() {
    let mut cp = checkpoint(1);
    cp.tensors.swap(0, 1);
    assert!(matches!(cp.encode(BLOCK), Err(Error::InvalidArgument(_))));
    let mut cp = checkpoint(1);
    cp.bitmap.push(0);
    assert!(matches!(cp.encode(BLOCK), Err(Error::InvalidArgument(_))));
    let mut cp = checkpoint(1);
    cp.bitmap[1] |= 0x80; // bit 15 of a 13-bit bitmap
    assert!(matches!(cp.encode(BLOCK), Err(Error::InvalidArgument(_))));
    let mut cp = checkpoint(1);
    cp.alloc_unit_bytes = 3 * MIB;
    assert!(matches!(cp.encode(BLOCK), Err(Error::InvalidArgument(_))));
    assert!(matches!(checkpoint(1).encode(1 << 20), Err(Error::InvalidArgument(_))));
}

#[test]
fn pick_checkpoint_newest_valid_slot_wins() {
    let slot_bytes = 64 << 10;
    let mut s0 = checkpoint(6).encode(BLOCK).unwrap();
    let mut s1 = checkpoint(7).encode(BLOCK).unwrap();
    s0.resize(slot_bytes, 0);
    s1.resize(slot_bytes, 0);
    let c = pick_checkpoint([&s0, &s1]).unwrap();
    assert_eq!((c.index, c.value.generation), (1, 7));
    assert!(c.damaged().is_none());
    // Crash while writing slot 1 with generation 8: slot 0 (older) still wins over the torn one.
    let mut torn = checkpoint(8).encode(BLOCK).unwrap();
    torn.truncate(BLOCK as usize);
    torn.resize(slot_bytes, 0);
    let c = pick_checkpoint([&s0, &torn]).unwrap();
    assert_eq!((c.index, c.value.generation), (0, 6));
    assert!(c.damaged().is_some());
    // A fresh array: slot 1 never written.
    let zero = vec![0u8; slot_bytes];
    let c = pick_checkpoint([&s0, &zero]).unwrap();
    assert!(matches!(c.damaged(), Some((1, Error::BadMagic { .. }))));
    assert!(matches!(pick_checkpoint([&zero, &zero]), Err(Error::BadMagic { .. })));
}
