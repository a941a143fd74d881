//! proptest strategies for the layout crate's types, shared by the integration tests.
#![allow(dead_code)] // each test binary uses a subset

use proptest::prelude::*;
use teraio_layout::format::{Checkpoint, DeviceLayout, RecordBody, Superblock, TensorRecord};
use teraio_layout::{Extent, Lane, StripeMap, lane_bytes, lane_count};

/// A tiny deterministic generator (splitmix64) for shapes derived from one proptest seed.
pub struct Mix(pub u64);

impl Mix {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A valid stripe map over `devices` of 16 possible device ids, its lanes cut into up to three
/// extents each with gaps between them, some lanes holding more than they need.
pub fn build_stripe_map(
    block: u32,
    unit_shift: u32,
    devices: u32,
    size: u64,
    seed: u64,
) -> StripeMap {
    let unit = u64::from(block) << unit_shift;
    let lanes = lane_count(size, unit, devices);
    let need = lane_bytes(size, unit, block, lanes);
    let mut mix = Mix(seed);
    let block = u64::from(block);
    let mut ids: Vec<u32> = (0..16).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, mix.below(i as u64 + 1) as usize);
    }
    let lanes = need
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let total_blocks = n.div_ceil(block) + mix.below(3);
            let pieces = 1 + mix.below(3.min(total_blocks));
            let mut cuts: Vec<u64> = (1..pieces).map(|_| 1 + mix.below(total_blocks - 1)).collect();
            cuts.push(0);
            cuts.push(total_blocks);
            cuts.sort_unstable();
            cuts.dedup();
            let mut cursor = mix.below(1024) * block;
            let extents = cuts
                .windows(2)
                .map(|w| {
                    let e = Extent { offset: cursor, len: (w[1] - w[0]) * block };
                    cursor = e.end() + mix.below(4) * block;
                    e
                })
                .collect();
            Lane { device: ids[i], extents }
        })
        .collect();
    StripeMap::new(size, unit, block as u32, lanes).expect("valid by construction")
}

pub fn arbitrary_stripe_map() -> impl Strategy<Value = StripeMap> {
    (prop_oneof![Just(512u32), Just(4096u32)], 0u32..4, 1u32..=6, 1u64..=(1 << 22), any::<u64>())
        .prop_map(|(block, shift, devices, size, seed)| {
            build_stripe_map(block, shift, devices, size, seed)
        })
}

pub fn arbitrary_tensor_record() -> impl Strategy<Value = TensorRecord> {
    (
        any::<u64>(),
        "\\PC{0,24}",
        arbitrary_stripe_map(),
        prop_oneof![Just(0u64), Just(4096u64), Just(65536u64), 1u64..(1 << 20)],
    )
        .prop_flat_map(|(id, name, stripe, chunk)| {
            let count = match chunk {
                0 => 0,
                c => stripe.size_bytes().div_ceil(c) as usize,
            };
            proptest::collection::vec(any::<u32>(), count).prop_map(move |checksums| TensorRecord {
                id,
                name: name.clone(),
                size_bytes: stripe.size_bytes(),
                stripe: stripe.clone(),
                checksum_chunk_bytes: chunk,
                checksums,
            })
        })
}

pub fn arbitrary_record_body() -> impl Strategy<Value = RecordBody> {
    prop_oneof![
        arbitrary_tensor_record().prop_map(RecordBody::PutTensor),
        any::<u64>().prop_map(|id| RecordBody::DeleteTensor { id }),
        (any::<u64>(), 0u32..2)
            .prop_map(|(generation, slot)| RecordBody::Checkpoint { generation, slot }),
    ]
}

pub fn arbitrary_block_bytes() -> impl Strategy<Value = u32> {
    (9u32..=16).prop_map(|s| 1 << s)
}

pub fn arbitrary_device_layout() -> impl Strategy<Value = DeviceLayout> {
    (arbitrary_block_bytes(), 0u32..10, 1u64..(1 << 27), 0u64..2048, 0u64..(4 << 20), any::<bool>())
        .prop_filter_map(
            "device too small for its metadata",
            |(block, unit_shift, capacity_blocks, journal_blocks, table, defaults)| {
                let b = u64::from(block);
                let capacity = capacity_blocks * b;
                let unit = b << unit_shift;
                if defaults {
                    DeviceLayout::with_defaults(capacity, block, unit).ok()
                } else {
                    DeviceLayout::compute(capacity, block, unit, journal_blocks * b, table).ok()
                }
            },
        )
}

pub fn arbitrary_superblock() -> impl Strategy<Value = Superblock> {
    (
        arbitrary_device_layout(),
        any::<[u8; 16]>(),
        1u32..=64,
        any::<u32>(),
        0u32..8,
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(layout, uuid, count, index, unit_shift, generation, created)| {
            let stripe_unit = u64::from(layout.block_bytes) << unit_shift;
            Superblock::new(uuid, index % count, count, stripe_unit, layout, generation, created)
                .expect("valid by construction")
        })
}

pub fn arbitrary_checkpoint() -> impl Strategy<Value = Checkpoint> {
    (
        any::<[u8; 16]>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        9u32..40,
        0u64..5000,
        proptest::collection::vec(arbitrary_tensor_record(), 0..4),
    )
        .prop_flat_map(|(uuid, generation, seq, device, unit_shift, bits, tensors)| {
            proptest::collection::vec(any::<u8>(), bits.div_ceil(8) as usize).prop_map(
                move |mut bitmap| {
                    if let Some(last) = bitmap.last_mut()
                        && bits % 8 != 0
                    {
                        *last &= (1u8 << (bits % 8)) - 1;
                    }
                    let mut tensors = tensors.clone();
                    tensors.sort_by_key(|t| t.id);
                    tensors.dedup_by_key(|t| t.id);
                    Checkpoint {
                        array_uuid: uuid,
                        generation,
                        journal_seq: seq,
                        device_index: device,
                        alloc_unit_bytes: 1 << unit_shift,
                        bitmap_bits: bits,
                        bitmap,
                        tensors,
                    }
                },
            )
        })
}

/// Recompute and store the crc32c of a structure (bytes 12..16, over `bytes` with the field
/// zeroed), as a writer would: lets a test change a field and still pass the checksum.
pub fn reseal(bytes: &mut [u8]) {
    bytes[12..16].fill(0);
    let crc = crc32c::crc32c(bytes);
    bytes[12..16].copy_from_slice(&crc.to_le_bytes());
}
