//! `teraio bench --tensors`: migration throughput through the tensor store, with a realistic
//! mix of tensor sizes (log-uniform 1 MiB - 1 GiB), on the same targets as the raw benchmark.
//!
//! Every tensor is offloaded (allocation, crc32c per stripe unit, striped O_DIRECT writes on all
//! devices), then prefetched back (striped reads, checksum verification). The figure to compare
//! with `teraio bench --rw write|read` on the same files is bytes over wall time per phase.

use std::sync::Arc;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use teraio_engine::array::{ArrayConfig, BackendKind, DeviceArray, ExistingData, Target};
use teraio_engine::migrate::Priority;
use teraio_engine::pool::{BufferPool, PoolConfig};
use teraio_engine::store::{OffloadOptions, StoreConfig, TensorStore};
use teraio_engine::tier::TensorMem;

use crate::Result;

/// What one phase moved.
pub struct Phase {
    /// Bytes moved.
    pub bytes: u64,
    /// Wall time, seconds.
    pub seconds: f64,
}

impl Phase {
    /// Bytes per second.
    pub fn bandwidth(&self) -> f64 {
        self.bytes as f64 / self.seconds
    }
}

/// Result of a tensor benchmark.
pub struct TensorBench {
    /// Tensor sizes used.
    pub sizes: Vec<u64>,
    /// Offload phase.
    pub offload: Phase,
    /// Prefetch phase.
    pub prefetch: Phase,
}

/// Log-uniform sizes in [1 MiB, 1 GiB] adding up to about `total` bytes.
pub fn tensor_mix(total: u64, seed: u64) -> Vec<u64> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let (lo, hi) = ((1u64 << 20) as f64, (1u64 << 30) as f64);
    let mut sizes = Vec::new();
    let mut sum = 0;
    while sum < total {
        let s = (lo.ln() + rng.r#gen::<f64>() * (hi.ln() - lo.ln())).exp() as u64;
        let s = s.min(total - sum).max(1 << 20);
        sizes.push(s);
        sum += s;
    }
    sizes
}

/// Offload every tensor of `sizes` through a store on `array`, then prefetch them all back.
/// Host buffers for all of them are allocated and touched before the clock starts.
pub fn run(
    array: Arc<DeviceArray>,
    sizes: &[u64],
    checksums: bool,
    workers: usize,
) -> Result<TensorBench> {
    let total: u64 = sizes.iter().sum();
    let pool = BufferPool::new(PoolConfig {
        capacity_bytes: sizes
            .iter()
            .map(|&s| BufferPool::capacity_for(s as usize) as u64)
            .sum::<u64>()
            + (64 << 20),
        ..PoolConfig::default()
    })?;
    let mut cfg = StoreConfig::new(array);
    cfg.checksums = checksums;
    cfg.workers = workers;
    let store = TensorStore::open(cfg)?;
    // Buffers are allocated and touched before the clock starts.
    let mut mems = Vec::with_capacity(sizes.len());
    for (i, &s) in sizes.iter().enumerate() {
        let mut b = pool.alloc(s as usize)?;
        b.fill(i as u8);
        mems.push(TensorMem::Host(b));
    }
    let start = Instant::now();
    let handles = mems
        .into_iter()
        .enumerate()
        .map(|(i, m)| store.offload_keep(i as u64, m, OffloadOptions::default()))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let mut back = Vec::with_capacity(handles.len());
    for h in handles {
        back.push(h.wait()?.1);
    }
    let offload = Phase { bytes: total, seconds: start.elapsed().as_secs_f64() };
    let start = Instant::now();
    let handles = back
        .into_iter()
        .enumerate()
        .map(|(i, m)| store.prefetch(i as u64, m, Priority::Normal))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    for (i, h) in handles.into_iter().enumerate() {
        let m = h.wait()?;
        // Spot check: the first byte of every tensor is what was written.
        let mut first = [0u8; 1];
        m.copy_out(0, &mut first)?;
        if first[0] != i as u8 {
            return Err(crate::CliError::Usage(format!("tensor {i} came back with wrong bytes")));
        }
    }
    let prefetch = Phase { bytes: total, seconds: start.elapsed().as_secs_f64() };
    Ok(TensorBench { sizes: sizes.to_vec(), offload, prefetch })
}

/// `teraio bench --tensors`: open the same targets as the raw benchmark and run the mix.
pub fn from_args(args: &super::bench::Args) -> Result<()> {
    let targets: Vec<std::path::PathBuf> = if args.targets.is_empty() {
        std::fs::create_dir_all(&args.dir)
            .map_err(|e| crate::CliError::File { path: args.dir.clone(), source: e })?;
        (0..args.files).map(|i| args.dir.join(format!("dev{i}"))).collect()
    } else {
        args.targets.clone()
    };
    let mut config = ArrayConfig::new(targets.into_iter().map(Target::Path).collect());
    config.file_size_bytes = args.size;
    config.queue_depth = args.iodepth;
    config.backend = match args.backend {
        super::bench::BackendArg::Uring => BackendKind::Uring,
        super::bench::BackendArg::Psync => BackendKind::Psync,
    };
    config.existing =
        if args.force { ExistingData::AllowAnything } else { ExistingData::AllowTeraio };
    let array = DeviceArray::open(config)?;
    let capacity: u64 = (0..array.device_count()).map(|d| array.device_capacity(d)).sum();
    let sizes = tensor_mix(capacity * 6 / 10, args.seed);
    let r = run(array, &sizes, !args.no_checksums, 4)?;
    report(&r, args.json)
}

/// Print a tensor benchmark as text or JSON.
pub fn report(r: &TensorBench, json_out: bool) -> Result<()> {
    let total: u64 = r.sizes.iter().sum();
    if json_out {
        let v = json!({
            "workload": "tensors",
            "tensors": r.sizes.len(),
            "total_bytes": total,
            "min_tensor_bytes": r.sizes.iter().min(),
            "max_tensor_bytes": r.sizes.iter().max(),
            "offload": { "bw_bytes": r.offload.bandwidth(), "runtime_s": r.offload.seconds },
            "prefetch": { "bw_bytes": r.prefetch.bandwidth(), "runtime_s": r.prefetch.seconds },
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "tensors: {} tensors, {:.2} GB ({:.1} MB .. {:.1} MB)",
        r.sizes.len(),
        total as f64 / 1e9,
        *r.sizes.iter().min().unwrap_or(&0) as f64 / 1e6,
        *r.sizes.iter().max().unwrap_or(&0) as f64 / 1e6
    );
    println!(
        "  offload  (write): {:.2} GB/s ({:.2} s)",
        r.offload.bandwidth() / 1e9,
        r.offload.seconds
    );
    println!(
        "  prefetch (read):  {:.2} GB/s ({:.2} s)",
        r.prefetch.bandwidth() / 1e9,
        r.prefetch.seconds
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_is_log_uniform_within_bounds_and_adds_up() {
        let total = 10u64 << 30;
        let sizes = tensor_mix(total, 7);
        assert_eq!(sizes.iter().sum::<u64>(), total);
        assert!(sizes.iter().all(|&s| (1 << 20..=1 << 30).contains(&s)));
        // Log-uniform: about as many tensors below 32 MiB (the geometric middle) as above.
        let small = sizes.iter().filter(|&&s| s < 32 << 20).count();
        assert!(
            small * 4 > sizes.len() && small * 4 < 3 * sizes.len(),
            "{small} of {}",
            sizes.len()
        );
        assert_eq!(tensor_mix(total, 7), sizes, "seeded");
    }

    #[test]
    fn a_small_mix_round_trips_through_the_store() {
        use teraio_engine::backend::sim::SimDisk;
        let disks: Vec<_> = (0..2).map(|i| SimDisk::new(256 << 20, 4096, i)).collect();
        let array = DeviceArray::open(ArrayConfig::new(
            disks.iter().map(|d| Target::Sim(d.clone())).collect(),
        ))
        .unwrap();
        let sizes = [1 << 20, 3 << 20, 40 << 20, (5 << 20) + 7];
        let r = run(array, &sizes, true, 2).unwrap();
        assert_eq!(r.offload.bytes, sizes.iter().sum::<u64>());
        assert!(r.offload.bandwidth() > 0.0 && r.prefetch.bandwidth() > 0.0);
    }
}
