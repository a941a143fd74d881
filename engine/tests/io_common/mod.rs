//! Helpers shared by the I/O integration tests: arrays on every backend, stripe maps, patterns.
//! With the `spdk` feature, [`ALL`] also holds the SPDK backend over files (uring bdevs; aio
//! bdevs with bounce buffers) and over SPDK's NVMe driver talking NVMe/TCP to an `nvmf_tgt` on
//! loopback ([`spdk_tcp`]).
#![allow(dead_code)]

#[cfg(feature = "spdk")]
pub mod spdk_tcp;

use std::sync::Arc;

use teraio_engine::array::{ArrayConfig, BackendKind, DeviceArray, ExistingData, Target};
use teraio_engine::backend::sim::SimDisk;
use teraio_engine::pool::{BufferPool, PoolConfig};
use teraio_layout::{Extent, Lane, StripeMap, align_up, lane_bytes, lane_count};

/// Which backend an array under test uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Uring,
    Psync,
    Sim,
    /// SPDK uring bdevs over files.
    #[cfg(feature = "spdk")]
    Spdk,
    /// SPDK aio bdevs over files, every transfer bounced through SPDK's DMA heap (the path PCIe
    /// targets take).
    #[cfg(feature = "spdk")]
    SpdkAioBounce,
    /// SPDK's NVMe driver over NVMe/TCP (loopback `nvmf_tgt`, aio bdevs over files behind it).
    #[cfg(feature = "spdk")]
    SpdkNvmeTcp,
    /// SPDK aio bdevs over files in SPDK's interrupt mode (`spdk.interrupt`). Not in [`ALL`]:
    /// SPDK's mode is set once per process, so [`all`] runs it alone in a child process started
    /// with [`SPDK_INTERRUPT_ENV`].
    #[cfg(feature = "spdk")]
    SpdkAioInterrupt,
}

/// Set in a child test process that runs the suite on SPDK in interrupt mode.
#[cfg(feature = "spdk")]
pub const SPDK_INTERRUPT_ENV: &str = "TERAIO_TEST_SPDK_INTERRUPT";

/// The kinds a test runs on: [`ALL`], or only [`Kind::SpdkAioInterrupt`] in a process started
/// with [`SPDK_INTERRUPT_ENV`].
pub fn all() -> Vec<Kind> {
    #[cfg(feature = "spdk")]
    if std::env::var_os(SPDK_INTERRUPT_ENV).is_some() {
        return vec![Kind::SpdkAioInterrupt];
    }
    ALL.to_vec()
}

#[cfg(not(feature = "spdk"))]
pub const ALL: [Kind; 3] = [Kind::Uring, Kind::Psync, Kind::Sim];
#[cfg(feature = "spdk")]
pub const ALL: [Kind; 6] =
    [Kind::Uring, Kind::Psync, Kind::Sim, Kind::Spdk, Kind::SpdkAioBounce, Kind::SpdkNvmeTcp];

/// An array under test and what keeps its storage alive.
pub struct Fixture {
    pub array: Arc<DeviceArray>,
    pub sims: Vec<Arc<SimDisk>>,
    pub dir: Option<tempfile::TempDir>,
    /// What serves the devices outside this process (the NVMe/TCP subsystems), released after
    /// the array.
    #[cfg(feature = "spdk")]
    pub served: Option<spdk_tcp::Served>,
}

/// Open `devices` devices of `capacity` bytes each on the given backend.
pub fn open(kind: Kind, devices: usize, capacity: u64, queue_depth: u32) -> Fixture {
    let (targets, sims, dir) = match kind {
        Kind::Sim => {
            let sims: Vec<_> =
                (0..devices).map(|i| SimDisk::new(capacity, 4096, 7 + i as u64)).collect();
            (sims.iter().map(|d| Target::Sim(Arc::clone(d))).collect(), sims, None)
        }
        #[cfg(feature = "spdk")]
        Kind::SpdkNvmeTcp => {
            let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
            let dir = tempfile::tempdir_in(base).unwrap();
            let served = spdk_tcp::serve(dir.path(), devices, capacity);
            let mut config = ArrayConfig::new(served.targets());
            config.queue_depth = queue_depth;
            config.existing = ExistingData::Refuse;
            config.backend = BackendKind::Spdk;
            let array = DeviceArray::open(config).unwrap();
            assert_eq!(array.backend_name(), "spdk");
            return Fixture { array, sims: Vec::new(), dir: Some(dir), served: Some(served) };
        }
        _ => {
            // Under the target dir (a real disk filesystem), not /tmp, so O_DIRECT is exercised.
            let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
            let dir = tempfile::tempdir_in(base).unwrap();
            let t =
                (0..devices).map(|i| Target::Path(dir.path().join(format!("dev{i}")))).collect();
            (t, Vec::new(), Some(dir))
        }
    };
    let mut config = ArrayConfig::new(targets);
    config.file_size_bytes = capacity;
    config.queue_depth = queue_depth;
    config.existing = ExistingData::Refuse;
    config.backend = match kind {
        Kind::Psync => BackendKind::Psync,
        #[cfg(feature = "spdk")]
        Kind::Spdk | Kind::SpdkAioBounce | Kind::SpdkNvmeTcp | Kind::SpdkAioInterrupt => {
            BackendKind::Spdk
        }
        _ => BackendKind::Uring,
    };
    #[cfg(feature = "spdk")]
    if kind == Kind::SpdkAioBounce {
        config.spdk.bdev = teraio_engine::backend::spdk_config::FileBdev::Aio;
        config.spdk.bounce = true;
    }
    #[cfg(feature = "spdk")]
    if kind == Kind::SpdkAioInterrupt {
        config.spdk.bdev = teraio_engine::backend::spdk_config::FileBdev::Aio;
        config.spdk.interrupt = true;
    }
    let array = DeviceArray::open(config).unwrap();
    let expect = match kind {
        Kind::Uring => "uring",
        Kind::Psync => "psync",
        Kind::Sim => "sim",
        #[cfg(feature = "spdk")]
        Kind::Spdk | Kind::SpdkAioBounce | Kind::SpdkNvmeTcp | Kind::SpdkAioInterrupt => "spdk",
    };
    assert_eq!(array.backend_name(), expect);
    Fixture {
        array,
        sims,
        dir,
        #[cfg(feature = "spdk")]
        served: None,
    }
}

pub fn pool(capacity: u64) -> Arc<BufferPool> {
    BufferPool::new(PoolConfig { capacity_bytes: capacity, prefer_huge_pages: true }).unwrap()
}

/// A stripe map for `size` bytes over the first `devices` devices (starting at `first`), each
/// lane one extent at `base` on its device.
pub fn map(size: u64, unit: u64, devices: u32, first: u32, base: u64) -> StripeMap {
    let lanes = lane_count(size, unit, devices);
    let need = lane_bytes(size, unit, 4096, lanes);
    let lanes = need
        .iter()
        .enumerate()
        .map(|(i, &n)| Lane {
            device: first + i as u32,
            extents: vec![Extent { offset: base, len: align_up(n.max(4096), 4096) }].into(),
        })
        .collect();
    StripeMap::new(size, unit, 4096, lanes).unwrap()
}

/// Deterministic bytes that differ by position and seed.
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed);
    v
}

/// An io_uring array of `devices` files with `threads` I/O threads (rings) per device.
pub fn open_uring_threads(
    devices: usize,
    capacity: u64,
    queue_depth: u32,
    threads: usize,
) -> Fixture {
    let base = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let dir = tempfile::tempdir_in(base).unwrap();
    let targets = (0..devices).map(|i| Target::Path(dir.path().join(format!("dev{i}")))).collect();
    let mut config = ArrayConfig::new(targets);
    config.file_size_bytes = capacity;
    config.queue_depth = queue_depth;
    config.io_threads = threads;
    let array = DeviceArray::open(config).unwrap();
    assert_eq!(array.backend_name(), "uring");
    Fixture {
        array,
        sims: Vec::new(),
        dir: Some(dir),
        #[cfg(feature = "spdk")]
        served: None,
    }
}

/// Run this test binary again as a child process with `args` (test-harness arguments) and
/// `env` added to its environment, and wait for it: whether it succeeded, and its standard
/// output and standard error joined (for assertions and failure messages).
pub fn run_child(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}
