//! `teraio bench --tensors`: migration throughput through the tensor store, with a realistic
//! mix of tensor sizes (log-uniform 1 MiB - 1 GiB), on the same targets as the raw benchmark.
//!
//! Every tensor is offloaded (allocation, crc32c per stripe unit, striped O_DIRECT writes on all
//! devices), then prefetched back (striped reads, checksum verification). The figure to compare
//! with `teraio bench --rw write|read` on the same files is bytes over wall time per phase.

use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use teraio_engine::pool::BufferPool;
use teraio_engine::queue::Priority;
use teraio_engine::store::OffloadOptions;
use teraio_engine::units::ByteSize;
use teraio_engine::{Engine, EngineConfig};

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

/// Offload every tensor of `sizes` through the engine's store, then prefetch them all back.
/// Host buffers (the engine's own, so the store moves them without a copy) for all of them are
/// allocated and touched before the clock starts; `config.host_buffers` is raised to hold them.
pub fn run(mut config: EngineConfig, sizes: &[u64]) -> Result<TensorBench> {
    let total: u64 = sizes.iter().sum();
    let buffers: u64 =
        sizes.iter().map(|&s| BufferPool::capacity_for(s as usize) as u64).sum::<u64>()
            + (64 << 20);
    config.host_buffers_bytes = ByteSize(config.host_buffers_bytes.0.max(buffers));
    let engine = Engine::open(config)?;
    let store = engine.store();
    // Buffers are allocated and touched before the clock starts.
    let mut mems = Vec::with_capacity(sizes.len());
    for (i, &s) in sizes.iter().enumerate() {
        let mut m = engine.alloc_host(s)?;
        m.host_mut().expect("engine buffers are host memory").fill(i as u8);
        mems.push(m);
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

/// `teraio bench --tensors`: on the array `config` names, a mix of tensors adding up to 60% of
/// its capacity.
pub fn from_config(mut config: EngineConfig, checksums: bool, seed: u64, json: bool) -> Result<()> {
    let capacity = {
        let array = config.open_array()?;
        (0..array.device_count()).map(|d| array.device_capacity(d)).sum::<u64>()
    };
    config.checksums = checksums;
    let sizes = tensor_mix(capacity * 6 / 10, seed);
    let r = run(config, &sizes)?;
    report(&r, json)
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
        let mut cfg = EngineConfig::with_sim_disks(disks);
        cfg.workers = 2;
        let sizes = [1 << 20, 3 << 20, 40 << 20, (5 << 20) + 7];
        let r = run(cfg, &sizes).unwrap();
        assert_eq!(r.offload.bytes, sizes.iter().sum::<u64>());
        assert!(r.offload.bandwidth() > 0.0 && r.prefetch.bandwidth() > 0.0);
    }
}
