//! Write valid encodings of every structure into `corpus/<target>/` as starting points for the
//! fuzzers (the checksums make valid inputs hard to find from scratch).
//!
//! Run from `fuzz/`: `cargo run --example seeds`.

use std::fs;

use teraio_layout::format::{
    Checkpoint, DeviceLayout, RecordBody, Superblock, TensorRecord, encode_journal_batch,
};
use teraio_layout::{Extent, Lane, StripeMap};

const MIB: u64 = 1 << 20;

fn tensor(id: u64, size: u64, devices: u32, chunk: u64) -> TensorRecord {
    let lanes = (0..devices)
        .map(|d| Lane {
            device: d,
            extents: vec![
                Extent { offset: 8 * MIB, len: 2 * MIB },
                Extent { offset: 64 * MIB, len: 8 * MIB },
            ]
            .into(),
        })
        .collect();
    let stripe = StripeMap::new(size, MIB, 4096, lanes).expect("valid stripe map");
    let count = if chunk == 0 { 0 } else { size.div_ceil(chunk) };
    TensorRecord {
        id,
        name: format!("model.layers.{id}.mlp.weight"),
        size_bytes: size,
        stripe,
        checksum_chunk_bytes: chunk,
        checksums: (0..count as u32).map(|i| i.wrapping_mul(0x9e37_79b9)).collect(),
    }
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = format!("corpus/{target}");
    fs::create_dir_all(&dir).expect("create corpus dir");
    fs::write(format!("{dir}/{name}"), bytes).expect("write seed");
}

fn main() {
    let tensors =
        [tensor(1, 3 * MIB + 5, 3, MIB), tensor(2, 4096, 1, 0), tensor(9, 7 * MIB, 2, 4096)];
    for (i, t) in tensors.iter().enumerate() {
        write("tensor_record", &format!("seed-{i}"), &t.encode().expect("encode tensor"));
    }
    for (i, (cap, block, unit)) in
        [(1 << 30, 512, 64 << 10), (64 * MIB, 4096, MIB), (1 << 40, 65536, 4 * MIB)]
            .into_iter()
            .enumerate()
    {
        let layout = DeviceLayout::with_defaults(cap, block, unit).expect("layout");
        let sb = Superblock::new([i as u8 + 1; 16], i as u32, 3, unit, layout, 7, 1_700_000_000)
            .expect("superblock");
        write("superblock", &format!("seed-{i}"), &sb.encode().expect("encode superblock"));
        let mut params = Vec::new();
        params.extend_from_slice(&cap.to_le_bytes());
        params.extend_from_slice(&block.trailing_zeros().to_le_bytes());
        params.extend_from_slice(&unit.to_le_bytes());
        params.extend_from_slice(&layout.journal.len.to_le_bytes());
        params.extend_from_slice(&layout.table_bytes.to_le_bytes());
        write("device_layout", &format!("seed-{i}"), &params);
    }
    let records = [
        RecordBody::PutTensor(tensors[0].clone()),
        RecordBody::DeleteTensor { id: 4 },
        RecordBody::Checkpoint { generation: 3, slot: 1 },
        RecordBody::PutTensor(tensors[1].clone()),
    ];
    let mut journal = Vec::new();
    let mut seq = 1;
    for chunk in records.chunks(2) {
        journal.extend(encode_journal_batch(seq, chunk, 512).expect("encode batch"));
        seq += chunk.len() as u64;
    }
    write("journal", "seed-0", &journal);
    write("journal", "seed-1", &encode_journal_batch(5, &records[1..3], 512).expect("batch"));
    let cp = Checkpoint {
        array_uuid: [3; 16],
        generation: 4,
        journal_seq: 17,
        device_index: 0,
        alloc_unit_bytes: MIB,
        bitmap_bits: 77,
        bitmap: vec![0xa5, 0, 0xff, 1, 0, 0, 0, 0, 0x10, 0x1f],
        tensors: tensors.to_vec(),
    };
    write("checkpoint", "seed-0", &cp.encode(512).expect("encode checkpoint"));
    let empty = Checkpoint { tensors: vec![], bitmap: vec![], bitmap_bits: 0, ..cp };
    write("checkpoint", "seed-1", &empty.encode(4096).expect("encode checkpoint"));
    println!("seeds written under corpus/");
}
