//! The store's GPU data paths (pinned bounce pipeline and GPUDirect Storage) on the emulated
//! device ([`HostDeviceTier`]): the same pipeline code as on a GPU, with host memory standing in
//! for device memory, so chunking, checksums, tails, stripe pieces, path selection and failure
//! handling are tested without a GPU.

mod store_common;

use std::sync::Arc;

use store_common::*;
use teraio_engine::Error;
use teraio_engine::array::{ArrayConfig, BackendKind, DeviceArray, ExistingData, Target};
use teraio_engine::backend::sim::{SimFault, SimOp};
use teraio_engine::pool::{BufferPool, PoolConfig};
use teraio_engine::store::{
    GpuIoConfig, GpuPath, OffloadOptions, StoreConfig, TensorStore, select_path,
};
use teraio_engine::tier::{DirectMode, HostDeviceTier, MemoryTier, TensorMem};

/// Sizes around every boundary: below a block, odd, one block +- 1, a stripe unit +- 1, across
/// chunks of the small pipeline configuration used here.
const SIZES: [u64; 9] = [
    1,
    777,
    4095,
    4097,
    (64 << 10) - 1,
    (64 << 10) + 1,
    (1 << 20) + 333,
    3 * (1 << 20) + 5,
    1 << 20,
];

fn small_pipeline(path: GpuPath) -> GpuIoConfig {
    // 64 KiB chunks over 16 KiB stripe units: many chunks per tensor, depth 3.
    GpuIoConfig {
        path,
        chunk_bytes: 64 << 10,
        depth: 3,
        gds_threads_per_device: 2,
        gds_io_bytes: 8 << 10,
    }
}

fn sim_store(path: GpuPath, disks: &[Arc<teraio_engine::backend::sim::SimDisk>]) -> TensorStore {
    let mut acfg = ArrayConfig::new(disks.iter().map(|d| Target::Sim(d.clone())).collect());
    acfg.existing = ExistingData::AllowTeraio;
    acfg.stripe_unit_bytes = 16 << 10;
    let mut cfg = StoreConfig::new(DeviceArray::open(acfg).unwrap());
    cfg.alloc_unit_bytes = 16 << 10;
    cfg.workers = 2;
    cfg.gpu = small_pipeline(path);
    TensorStore::open(cfg).unwrap()
}

fn file_store(path: GpuPath, dir: &std::path::Path) -> TensorStore {
    let targets = (0..4).map(|i| Target::Path(dir.join(format!("dev{i}")))).collect();
    let mut acfg = ArrayConfig::new(targets);
    acfg.existing = ExistingData::AllowAnything;
    acfg.file_size_bytes = 64 << 20;
    acfg.backend = BackendKind::Psync;
    acfg.stripe_unit_bytes = 16 << 10;
    let mut cfg = StoreConfig::new(DeviceArray::open(acfg).unwrap());
    cfg.alloc_unit_bytes = 16 << 10;
    cfg.workers = 2;
    cfg.gpu = small_pipeline(path);
    TensorStore::open(cfg).unwrap()
}

fn device_mem(tier: &HostDeviceTier, bytes: &[u8]) -> TensorMem {
    let mut m = tier.alloc(bytes.len() as u64).unwrap();
    m.fill_from_host(bytes).unwrap();
    m
}

fn read_back(m: &TensorMem) -> Vec<u8> {
    let mut v = vec![0u8; m.len() as usize];
    m.read_to_host(&mut v).unwrap();
    v
}

fn host_pool() -> Arc<BufferPool> {
    BufferPool::new(PoolConfig { capacity_bytes: 64 << 20, ..PoolConfig::default() }).unwrap()
}

/// Device memory through `store` and back for every size, compared byte for byte; then the
/// same tensors read into host memory (the CPU verifies the stored checksums) and written from
/// host memory read into device memory: one path's checksums verify through the other.
fn round_trips(store: &TensorStore, tier: &HostDeviceTier) {
    let pool = host_pool();
    for (i, &size) in SIZES.iter().enumerate() {
        let id = i as u64;
        let data = content(id, 1, size as usize);
        let src = device_mem(tier, &data);
        store.offload_sync(id, src, OffloadOptions::default()).unwrap();
        let dst = tier.alloc(size).unwrap();
        let back = store.prefetch_sync(id, dst).unwrap();
        assert!(matches!(back, TensorMem::Device(_)));
        assert!(read_back(&back) == data, "device round trip of {size} bytes");
        // Device -> SSD, SSD -> host (the CPU verifies the checksums the device path wrote).
        store.offload_sync(id, back, OffloadOptions::default()).unwrap();
        let host = store.prefetch_sync(id, host_zeroed(&pool, size as usize)).unwrap();
        assert!(host.host().unwrap() == &data[..], "device -> host of {size} bytes");
        // Host -> SSD, SSD -> device (the device path verifies the CPU's checksums).
        store.offload_sync(id, host, OffloadOptions::default()).unwrap();
        let dev = store.prefetch_sync(id, tier.alloc(size).unwrap()).unwrap();
        assert!(read_back(&dev) == data, "host -> device of {size} bytes");
        store.free(id).unwrap().wait().unwrap();
    }
    assert_eq!(tier.used_bytes(), 0, "every device buffer was released");
}

#[test]
fn the_bounce_pipeline_round_trips_odd_sizes_over_sim_disks() {
    let disks = sim_disks(3, 64 << 20, 1);
    let store = sim_store(GpuPath::Bounce, &disks);
    let tier = HostDeviceTier::new(0, 256 << 20);
    round_trips(&store, &tier);
    let st = store.gpu_stats();
    assert_eq!(st.bounce_write.ops, 2 * SIZES.len() as u64);
    assert_eq!(st.bounce_read.ops, 2 * SIZES.len() as u64);
    assert_eq!(st.gds_write.ops + st.gds_read.ops, 0);
    assert!(st.pinned_staging_bytes >= 2 * 3 * (64 << 10), "workers x depth x chunk pinned");
    // Chunked: a 3 MiB tensor in 64 KiB chunks is 49 copies each way, not one.
    assert!(tier.copies() > 4 * 49, "{} copies", tier.copies());
    let info = store.gpu_path(tier.gpu()).unwrap();
    assert_eq!(info.path, "bounce");
}

#[test]
fn auto_over_sim_disks_takes_the_bounce_path_and_gds_is_a_clear_error() {
    let disks = sim_disks(2, 16 << 20, 2);
    let auto = sim_store(GpuPath::Auto, &disks);
    let tier = HostDeviceTier::new(0, 16 << 20);
    let info = auto.gpu_path(tier.gpu()).unwrap();
    assert_eq!(info.path, "bounce");
    assert!(info.reason.contains("simulated disks"), "{}", info.reason);
    drop(auto);
    let gds = sim_store(GpuPath::Gds, &disks);
    let e = gds.gpu_path(tier.gpu()).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    let src = device_mem(&tier, &[7u8; 5000]);
    let e = gds.offload_sync(1, src, OffloadOptions::default()).unwrap_err();
    assert!(e.to_string().contains("GPUDirect Storage"), "{e}");
    // The failed offload kept the tensor: it comes back whole.
    let held = gds.take_held(1).expect("held after a failed offload");
    assert!(read_back(&held) == vec![7u8; 5000]);
}

#[test]
fn path_selection_follows_the_request_and_the_direct_mode() {
    let none: teraio_engine::Result<DirectMode> = Err(Error::Unsupported("no cuFile".into()));
    assert_eq!(select_path(GpuPath::Auto, &Ok(DirectMode::P2p)).unwrap().0, "gds");
    assert_eq!(select_path(GpuPath::Auto, &Ok(DirectMode::Compat)).unwrap().0, "bounce");
    assert_eq!(select_path(GpuPath::Auto, &none).unwrap().0, "bounce");
    assert_eq!(select_path(GpuPath::Gds, &Ok(DirectMode::Compat)).unwrap().0, "gds");
    assert_eq!(select_path(GpuPath::Gds, &Ok(DirectMode::Emulated)).unwrap().0, "gds");
    assert!(matches!(select_path(GpuPath::Gds, &none), Err(Error::Unsupported(_))));
    assert_eq!(select_path(GpuPath::Bounce, &Ok(DirectMode::P2p)).unwrap().0, "bounce");
    assert_eq!("gds".parse::<GpuPath>().unwrap(), GpuPath::Gds);
    assert!("fast".parse::<GpuPath>().is_err());
}

#[test]
fn the_direct_path_round_trips_odd_sizes_over_files_with_device_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let store = file_store(GpuPath::Gds, dir.path());
    let tier = HostDeviceTier::new(0, 256 << 20);
    let info = store.gpu_path(tier.gpu()).unwrap();
    assert_eq!(info.path, "gds");
    assert_eq!(info.direct_mode, Some(DirectMode::Emulated));
    round_trips(&store, &tier);
    let st = store.gpu_stats();
    assert_eq!(st.gds_write.ops, 2 * SIZES.len() as u64);
    assert_eq!(st.gds_read.ops, 2 * SIZES.len() as u64);
    assert!(st.gpu_crc_bytes > 0 && tier.crc_calls() > 0, "checksums computed on the device");
    // Sizes that are not whole blocks end in a tail moved through a host buffer.
    let partial = SIZES.iter().filter(|&&s| s % 4096 != 0).count() as u64;
    assert_eq!(st.tail_bounces, 4 * partial);
    // 8 KiB direct I/Os: a 3 MiB tensor alone takes more than 380 of them.
    assert!(st.direct_ios > 380, "{}", st.direct_ios);
}

#[test]
fn a_tensor_written_by_one_path_reads_and_verifies_through_the_other() {
    let dir = tempfile::tempdir().unwrap();
    let tier = HostDeviceTier::new(0, 64 << 20);
    let size = 3 * (1 << 20) + 4099;
    for (write_path, read_path, id) in
        [(GpuPath::Gds, GpuPath::Bounce, 6u64), (GpuPath::Bounce, GpuPath::Gds, 7u64)]
    {
        let data = content(id, 5, size);
        let map = {
            let s = file_store_persistent(write_path, dir.path());
            s.offload_sync(id, device_mem(&tier, &data), OffloadOptions::default()).unwrap();
            s.info(id).unwrap().stripe_map.unwrap()
        };
        assert!(raw_bytes(dir.path(), &map, size) == data, "{write_path:?} put the bytes on disk");
        // Reopened with the other path: it verifies the checksums the first one recorded.
        let s = file_store_persistent(read_path, dir.path());
        let back = s.prefetch_sync(id, tier.alloc(size as u64).unwrap()).unwrap();
        assert!(read_back(&back) == data, "written by {write_path:?}, read by {read_path:?}");
        let st = s.gpu_stats();
        assert_eq!(st.bounce_read.ops + st.gds_read.ops, 1);
        assert_eq!(st.gds_read.ops, u64::from(read_path == GpuPath::Gds));
    }
}

fn file_store_persistent(path: GpuPath, dir: &std::path::Path) -> TensorStore {
    let targets = (0..4).map(|i| Target::Path(dir.join(format!("dev{i}")))).collect();
    let mut acfg = ArrayConfig::new(targets);
    acfg.existing = ExistingData::AllowTeraio;
    acfg.file_size_bytes = 64 << 20;
    acfg.backend = BackendKind::Psync;
    acfg.stripe_unit_bytes = 16 << 10;
    let mut cfg = StoreConfig::new(DeviceArray::open(acfg).unwrap());
    cfg.alloc_unit_bytes = 16 << 10;
    cfg.workers = 2;
    cfg.persistent = true;
    cfg.gpu = small_pipeline(path);
    TensorStore::open(cfg).unwrap()
}

/// The tensor's bytes as they lie in the files, gathered through its stripe map.
fn raw_bytes(dir: &std::path::Path, map: &teraio_layout::StripeMap, size: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let mut out = vec![0u8; size];
    let files: Vec<_> =
        (0..4).map(|i| std::fs::File::open(dir.join(format!("dev{i}"))).unwrap()).collect();
    let mut pos = 0u64;
    while pos < size as u64 {
        let (dev, off) = map.locate(pos).unwrap();
        let unit = map.unit_bytes();
        let n = (unit - pos % unit).min(size as u64 - pos) as usize;
        files[dev as usize].read_exact_at(&mut out[pos as usize..pos as usize + n], off).unwrap();
        pos += n as u64;
    }
    out
}

#[test]
fn a_flipped_byte_on_disk_is_caught_on_both_paths() {
    for path in [GpuPath::Gds, GpuPath::Bounce] {
        let dir = tempfile::tempdir().unwrap();
        let store = file_store(path, dir.path());
        let tier = HostDeviceTier::new(0, 64 << 20);
        let size = (1 << 20) + 12_345;
        let data = content(9, 1, size);
        store.offload_sync(9, device_mem(&tier, &data), OffloadOptions::default()).unwrap();
        let map = store.info(9).unwrap().stripe_map.unwrap();
        let at = 700_001u64;
        let (dev, off) = map.locate(at).unwrap();
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(dir.path().join(format!("dev{dev}")))
                .unwrap();
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, off).unwrap();
            f.write_all_at(&[b[0] ^ 0x40], off).unwrap();
        }
        let e = store.prefetch_sync(9, tier.alloc(size as u64).unwrap()).unwrap_err();
        match e {
            Error::ChecksumMismatch { offset, .. } => {
                assert_eq!(offset, at / map.unit_bytes() * map.unit_bytes(), "{path:?}")
            }
            e => panic!("{path:?}: expected a checksum mismatch, got {e}"),
        }
    }
}

#[test]
fn a_failed_write_leaves_the_tensor_in_device_memory_usable() {
    let disks = sim_disks(2, 16 << 20, 3);
    let store = sim_store(GpuPath::Bounce, &disks);
    let tier = HostDeviceTier::new(0, 64 << 20);
    let data = content(4, 1, (1 << 20) + 3);
    disks[1].inject(SimFault::Eio { op: SimOp::Write, after_ops: 2 });
    let e = store.offload_sync(4, device_mem(&tier, &data), OffloadOptions::default());
    assert!(e.is_err(), "the injected EIO fails the offload");
    assert_eq!(tier.used_bytes(), data.len() as u64, "the GPU memory was not released");
    let held = store.take_held(4).expect("the store holds the source");
    assert!(read_back(&held) == data, "and it is intact");
    disks[1].clear_faults();
    store.offload_sync(4, held, OffloadOptions::default()).unwrap();
    assert_eq!(tier.used_bytes(), 0, "released once the write is durable");
    let back = store.prefetch_sync(4, tier.alloc(data.len() as u64).unwrap()).unwrap();
    assert!(read_back(&back) == data);
}

#[test]
fn offload_after_stream_and_wrong_sizes() {
    let disks = sim_disks(2, 16 << 20, 4);
    let store = sim_store(GpuPath::Auto, &disks);
    let tier = HostDeviceTier::new(0, 64 << 20);
    let data = content(1, 2, 70_000);
    let h = store
        .offload_after_stream(1, device_mem(&tier, &data), OffloadOptions::default(), 0)
        .unwrap();
    h.wait().unwrap();
    let e = store.prefetch_sync(1, tier.alloc(69_999).unwrap()).unwrap_err();
    assert!(e.to_string().contains("70000"), "{e}");
    let back = store.prefetch_sync(1, tier.alloc(70_000).unwrap()).unwrap();
    back.wait_ready_on_stream(0).unwrap();
    assert!(read_back(&back) == data);
    let host = host_zeroed(&host_pool(), 10);
    assert!(store.offload_after_stream(2, host, OffloadOptions::default(), 0).is_err());
}

/// Device memory to the host tier and back (the prefetch's copy is queued without the worker
/// waiting for the device), in a retaining store over several rounds, then rewritten: every
/// read gives the newest bytes and the host tier is empty once the tensors are freed.
#[test]
fn device_memory_through_the_host_tier_round_trips_and_releases_it() {
    let disks = sim_disks(2, 64 << 20, 11);
    let mut acfg = ArrayConfig::new(disks.iter().map(|d| Target::Sim(d.clone())).collect());
    acfg.existing = ExistingData::AllowTeraio;
    acfg.stripe_unit_bytes = 16 << 10;
    let host = teraio_engine::tier::HostTier::new("host", 16 << 20).unwrap();
    let mut cfg = StoreConfig::new(DeviceArray::open(acfg).unwrap());
    cfg.alloc_unit_bytes = 16 << 10;
    cfg.retain_on_prefetch = true;
    cfg.host_tier = Some(host.clone());
    cfg.gpu = small_pipeline(GpuPath::Bounce);
    let store = TensorStore::open(cfg).unwrap();
    let tier = HostDeviceTier::new(0, 64 << 20);
    let to_host = OffloadOptions {
        destination: teraio_engine::store::Destination::Host,
        ..OffloadOptions::default()
    };
    let sizes = [777u64, (1 << 20) + 333, 3 * (1 << 20) + 5];
    for (i, &size) in sizes.iter().enumerate() {
        let out = store.offload_sync(
            i as u64,
            device_mem(&tier, &content(i as u64, 0, size as usize)),
            to_host.clone(),
        );
        assert_eq!(out.unwrap(), teraio_engine::store::OffloadOutcome::InHost);
    }
    for round in 0..3 {
        for (i, &size) in sizes.iter().enumerate() {
            let back = store.prefetch_sync(i as u64, tier.alloc(size).unwrap()).unwrap();
            assert!(
                read_back(&back) == content(i as u64, 0, size as usize),
                "round {round}, {size} bytes"
            );
        }
    }
    // Rewritten on the device and offloaded again: the new copy replaces the old one.
    for (i, &size) in sizes.iter().enumerate() {
        let v = content(i as u64, 7, size as usize);
        store.offload_sync(i as u64, device_mem(&tier, &v), to_host.clone()).unwrap();
        let back = store.prefetch_sync(i as u64, tier.alloc(size).unwrap()).unwrap();
        assert!(read_back(&back) == v, "rewritten, {size} bytes");
        store.free(i as u64).unwrap().wait().unwrap();
    }
    assert_eq!(host.used_bytes(), 0, "every host-tier copy went back to the tier");
    assert_eq!(tier.used_bytes(), 0, "every device buffer was released");
}

/// An offload of device memory to the host tier after the caller's stream is queued on the
/// device: the handle completes before the copy ran, the memory comes back with the copy as its
/// ready fence, and the stored copy is read only after the copy. On a device whose copies are
/// deferred: a caller write ordered after the fence leaves the stored copy as it was; one that is
/// not (what the fence is for) reaches it.
#[test]
fn an_offload_to_the_host_tier_is_queued_on_the_device_and_its_memory_comes_back_fenced() {
    let disks = sim_disks(2, 64 << 20, 12);
    let mut acfg = ArrayConfig::new(disks.iter().map(|d| Target::Sim(d.clone())).collect());
    acfg.existing = ExistingData::AllowTeraio;
    let host = teraio_engine::tier::HostTier::new("host", 16 << 20).unwrap();
    let mut cfg = StoreConfig::new(DeviceArray::open(acfg).unwrap());
    cfg.retain_on_prefetch = true;
    cfg.host_tier = Some(host.clone());
    let store = TensorStore::open(cfg).unwrap();
    let tier = HostDeviceTier::deferred(0, 64 << 20, u64::MAX);
    let to_host = OffloadOptions {
        destination: teraio_engine::store::Destination::Host,
        ..OffloadOptions::default()
    };
    let size = (1 << 20) + 333;
    let v0 = content(1, 0, size);
    let v1 = content(1, 1, size);
    for ordered in [true, false] {
        let id = u64::from(ordered);
        let src = tier.alloc(size as u64).unwrap();
        tier.kernel_write(&src, 0, &v0).unwrap();
        let h = store.offload_keep_after_stream(id, src, to_host.clone(), 0, true).unwrap();
        let (outcome, src) = h.wait().unwrap();
        assert_eq!(outcome, teraio_engine::store::OffloadOutcome::InHost);
        assert_eq!(tier.pending_copies(), 1, "the copy is queued, not run");
        let fence = src.device().unwrap().ready().expect("the copy is the memory's ready fence");
        assert!(!fence.is_done());
        if ordered {
            src.wait_ready_on_stream(0).unwrap();
            assert_eq!(tier.pending_copies(), 0);
        }
        // The caller's next kernel overwrites the tensor.
        tier.kernel_write(&src, 0, &v1).unwrap();
        let back = store.prefetch_after_stream(
            id,
            tier.alloc(size as u64).unwrap(),
            Default::default(),
            0,
        );
        let back = back.unwrap().wait().unwrap();
        back.wait_ready_on_stream(0).unwrap();
        let mut got = vec![0u8; size];
        tier.kernel_read(&back, 0, &mut got).unwrap();
        let want = if ordered { &v0 } else { &v1 };
        assert!(&got == want, "ordered {ordered}: the stored copy holds the wrong version");
        assert!(tier.faults().is_empty());
        assert_eq!(store.stats().host_writes_queued, if ordered { 1 } else { 2 });
    }
    // Memory freed before its queued copy ran: the emulation says so (a use after free).
    let src = tier.alloc(4096).unwrap();
    let (_, src) =
        store.offload_keep_after_stream(9, src, to_host.clone(), 0, true).unwrap().wait().unwrap();
    drop(src);
    tier.complete_copies();
    assert_eq!(tier.faults().len(), 1, "{:?}", tier.faults());
    // Not on the device: the worker waits for the caller's stream and copies; nothing pending.
    let src = tier.alloc(4096).unwrap();
    tier.kernel_write(&src, 0, &v0[..4096]).unwrap();
    let (_, src) =
        store.offload_keep_after_stream(10, src, to_host, 0, false).unwrap().wait().unwrap();
    assert!(src.device().unwrap().ready().is_none_or(|f| f.is_done()));
    assert_eq!((tier.pending_copies(), store.stats().host_writes_queued), (0, 3));
}
