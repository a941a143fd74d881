//! The tensor store over real files with the io_uring and psync backends: many tensors written,
//! rewritten and read back concurrently, every byte checked (the crc32c of every stripe unit is
//! verified by the store too).

use std::sync::Arc;

use teraio_engine::array::{ArrayConfig, BackendKind, DeviceArray, Target};
use teraio_engine::pool::{BufferPool, PoolConfig};
use teraio_engine::queue::Priority;
use teraio_engine::store::{OffloadOptions, StoreConfig, TensorStore};
use teraio_engine::tier::TensorMem;

const MIB: u64 = 1 << 20;

fn run(backend: BackendKind, retain: bool) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ArrayConfig::new(
        (0..4).map(|i| Target::Path(dir.path().join(format!("dev{i}")))).collect(),
    );
    // 32 live tensors of 8 MiB plus the versions being rewritten need about 320 MiB of the
    // 640 MiB; the files are preallocated, so keep them small (CI's disk is shared).
    cfg.file_size_bytes = 160 * MIB;
    cfg.backend = backend;
    let array = DeviceArray::open(cfg).unwrap();
    let mut scfg = StoreConfig::new(array);
    scfg.retain_on_prefetch = retain;
    let store = TensorStore::open(scfg).unwrap();
    let pool: Arc<BufferPool> =
        BufferPool::new(PoolConfig { capacity_bytes: 1 << 30, ..PoolConfig::default() }).unwrap();
    let len = 8 * MIB as usize;
    let n = 16u64;
    let mem = |v: u8| {
        let mut b = pool.alloc(len).unwrap();
        b.fill(v);
        TensorMem::Host(b)
    };
    let check = |m: &TensorMem, v: u8, what: &str| {
        let mut got = vec![0u8; len];
        m.copy_out(0, &mut got).unwrap();
        if let Some(at) = got.iter().position(|&b| b != v) {
            panic!("{what}: byte {at} is {:#x}, expected {v:#x}", got[at]);
        }
    };
    for round in 0..4u8 {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                store.offload(i, mem(round * 16 + i as u8), OffloadOptions::default()).unwrap()
            })
            .collect();
        for h in hs {
            h.wait().unwrap();
        }
        // Read them all back, then write the very buffers read as new versions.
        let back: Vec<_> = (0..n)
            .map(|i| store.prefetch(i, mem(0xEE), Priority::Normal).unwrap())
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.wait().unwrap())
            .collect();
        let hs: Vec<_> = back
            .into_iter()
            .enumerate()
            .map(|(i, m)| store.offload(i as u64, m, OffloadOptions::default()).unwrap())
            .collect();
        hs.into_iter().for_each(|h| {
            h.wait().unwrap();
        });
        // Interleave reads of these with writes of others.
        let mut pairs = Vec::new();
        for i in 0..n {
            let w = store.offload(1000 + i, mem(200 + i as u8), OffloadOptions::default()).unwrap();
            let r = store.prefetch(i, mem(0xEE), Priority::Normal).unwrap();
            pairs.push((w, r));
        }
        for (i, (w, r)) in pairs.into_iter().enumerate() {
            w.wait().unwrap();
            let got = r.wait().unwrap_or_else(|e| panic!("round {round} tensor {i}: {e}"));
            check(&got, round * 16 + i as u8, &format!("round {round} tensor {i}"));
        }
        for i in 0..n {
            let r = store.prefetch(1000 + i, mem(0xEE), Priority::Normal).unwrap().wait().unwrap();
            check(&r, 200 + i as u8, &format!("round {round} tensor {}", 1000 + i));
        }
    }
}

#[test]
fn uring_volatile() {
    run(BackendKind::Uring, false);
}

#[test]
fn uring_retaining() {
    run(BackendKind::Uring, true);
}

#[test]
fn psync_retaining() {
    run(BackendKind::Psync, true);
}

#[cfg(feature = "spdk")]
#[test]
fn spdk_bdev_retaining() {
    run(BackendKind::Spdk, true);
}

/// Issue 36: 55 overwrites of one 1 MiB tensor in a persistent store on a 64 MiB file failed
/// with "no space for 1048576 bytes: 0 bytes free" (replaced extents waited for a checkpoint
/// that nothing wrote). 120 overwrites, then a reopen that finds the last one.
#[test]
fn a_persistent_store_on_a_64_mib_file_takes_any_number_of_overwrites() {
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        let mut cfg = ArrayConfig::new(vec![Target::Path(dir.path().join("dev0"))]);
        cfg.file_size_bytes = 64 * MIB;
        cfg.backend = BackendKind::Psync;
        cfg.existing = teraio_engine::array::ExistingData::AllowTeraio;
        let mut scfg = StoreConfig::new(DeviceArray::open(cfg).unwrap());
        scfg.persistent = true;
        TensorStore::open(scfg).unwrap()
    };
    let pool: Arc<BufferPool> =
        BufferPool::new(PoolConfig { capacity_bytes: 64 * MIB, ..PoolConfig::default() }).unwrap();
    let len = MIB as usize;
    let mem = |v: u8| {
        let mut b = pool.alloc(len).unwrap();
        b.fill(v);
        TensorMem::Host(b)
    };
    let rounds = 120u32;
    {
        let store = open();
        assert!(u64::from(rounds) * MIB > 64 * MIB, "the overwrites outgrow the file");
        for v in 0..rounds {
            store
                .offload_sync(1, mem(v as u8), OffloadOptions::default())
                .unwrap_or_else(|e| panic!("overwrite {v}: {e}"));
        }
    }
    let store = open();
    let got = store.prefetch_sync(1, mem(0xEE)).unwrap();
    let mut bytes = vec![0u8; len];
    got.copy_out(0, &mut bytes).unwrap();
    assert!(bytes.iter().all(|&b| b == (rounds - 1) as u8), "the last overwrite after reopen");
}
