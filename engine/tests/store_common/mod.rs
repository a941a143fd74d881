//! Helpers shared by the store tests.
#![allow(dead_code)]

use std::sync::Arc;

use teraio_engine::array::{ArrayConfig, DeviceArray, ExistingData, Target};
use teraio_engine::backend::sim::SimDisk;
use teraio_engine::pool::{BufferPool, PoolConfig};
use teraio_engine::store::{StoreConfig, TensorStore};
use teraio_engine::tier::TensorMem;

pub const MIB: u64 = 1 << 20;

/// `n` simulated disks of `capacity` bytes.
pub fn sim_disks(n: usize, capacity: u64, seed: u64) -> Vec<Arc<SimDisk>> {
    (0..n).map(|i| SimDisk::new(capacity, 4096, seed + i as u64)).collect()
}

/// An array over the given disks (reopening a teraio array on them is allowed).
pub fn sim_array(disks: &[Arc<SimDisk>]) -> Arc<DeviceArray> {
    let mut cfg = ArrayConfig::new(disks.iter().map(|d| Target::Sim(d.clone())).collect());
    cfg.existing = ExistingData::AllowTeraio;
    DeviceArray::open(cfg).expect("open sim array")
}

/// A store over `disks`.
pub fn store(disks: &[Arc<SimDisk>], persistent: bool) -> TensorStore {
    let mut cfg = StoreConfig::new(sim_array(disks));
    cfg.persistent = persistent;
    cfg.workers = 3;
    TensorStore::open(cfg).expect("open store")
}

/// Deterministic content of tensor `id`, version `version`.
pub fn content(id: u64, version: u64, len: usize) -> Vec<u8> {
    let mut x =
        id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xD1B5_4A32_D192_ED03) ^ 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Host memory holding `bytes`.
pub fn host_mem(pool: &Arc<BufferPool>, bytes: &[u8]) -> TensorMem {
    let mut b = pool.alloc(bytes.len()).expect("pool alloc");
    b.copy_from_slice(bytes);
    TensorMem::Host(b)
}

/// Empty host memory of `len` bytes.
pub fn host_zeroed(pool: &Arc<BufferPool>, len: usize) -> TensorMem {
    let mut b = pool.alloc(len).expect("pool alloc");
    b.fill(0);
    TensorMem::Host(b)
}

pub fn pool() -> Arc<BufferPool> {
    BufferPool::new(PoolConfig { capacity_bytes: 2 << 30, prefer_huge_pages: false }).expect("pool")
}

pub fn bytes_of(m: &TensorMem) -> Vec<u8> {
    let mut v = vec![0u8; m.len() as usize];
    m.copy_out(0, &mut v).expect("copy out");
    v
}

/// Assert two byte strings are equal, reporting the first difference (not megabytes of bytes).
#[track_caller]
pub fn assert_same(got: &[u8], want: &[u8], what: &str) {
    if got.len() != want.len() {
        panic!("{what}: {} bytes, expected {}", got.len(), want.len());
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at byte {i}: {:#04x} != {:#04x}", got[i], want[i]);
    }
}
