//! `teraio bench --gpu N`: GPU memory <-> the SSD array through the tensor store, in the spirit
//! of gdsio and KvikIO's benchmark.
//!
//! `--iodepth` GPU buffers of `--bs` bytes (random data, written once) carry
//! `size x devices / bs` tensors: every tensor is offloaded from one of them (the store hands
//! the buffer back once the copy is stored, and the next tensor goes out of it), then every
//! tensor is prefetched into them, verified by the store's crc32c (on the GPU on the gds path,
//! on the CPU on the bounce path) and spot-checked against the data written. The output names
//! the path and whether cuFile runs in compatibility mode; `--json` gives fio's field names.
//! Like fio and gdsio, a buffer goes to the next tensor as soon as any tensor in flight is done,
//! not the oldest: `--iodepth` stay in flight when tensors finish out of order (they do, over
//! several devices).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use teraio_engine::queue::{Handle, Priority};
use teraio_engine::store::{OffloadOptions, OffloadOutcome};
use teraio_engine::tier::TensorMem;
use teraio_engine::units::ByteSize;
use teraio_engine::{Engine, EngineConfig};

use super::bench::{Args, DirStats, dir_json, print_dir};
use crate::{CliError, Result};

/// The engine of a GPU benchmark: the array options, one store worker per tensor in flight.
pub fn engine_config(args: &Args, gpu: u32) -> Result<EngineConfig> {
    let mut cfg = args.engine_config()?;
    if args.array.file_size.is_none() {
        // Every tensor is on the array at the end of the write phase, and the metadata regions
        // (journal, checkpoints) take up to 1/8 of each file.
        cfg.file_size_bytes = ByteSize(args.size / 4 * 5 + (64 << 20));
    }
    cfg.gpu.device = Some(gpu);
    cfg.gpu.path = args.gpu_path.into();
    cfg.gpu.emulated = args.gpu_emulated;
    let inflight = u64::from(args.iodepth.max(1)) * args.bs;
    cfg.gpu.budget_bytes = ByteSize(inflight + (64 << 20));
    cfg.workers = (args.iodepth as usize).clamp(1, 64);
    cfg.inflight_bytes_max = ByteSize(inflight.max(1 << 20) * 2);
    cfg.checksums = !args.no_checksums;
    Ok(cfg)
}

/// What one GPU benchmark measured.
pub struct GpuBench {
    /// GPU -> SSD.
    pub write: (DirStats, Duration),
    /// SSD -> GPU.
    pub read: (DirStats, Duration),
    /// "gds" or "bounce".
    pub path: &'static str,
    /// Why that path, and how cuFile reaches the disk.
    pub reason: String,
    /// The cuFile mode, where cuFile was opened.
    pub direct_mode: Option<String>,
    /// The GPU.
    pub device: String,
    /// The array.
    pub array: String,
    /// Tensors per phase.
    pub tensors: u64,
    /// GPU time spent on crc32c, seconds (gds path).
    pub gpu_crc_s: f64,
}

/// An offload in flight that hands its GPU buffer back.
type OffloadHandle = Handle<(OffloadOutcome, TensorMem)>;

/// Take the first operation in flight to finish, in whatever order they finish: a finished
/// one if any, else a short wait on the oldest, then look again.
fn next_done<K, T>(
    q: &mut VecDeque<(K, Instant, Handle<T>)>,
) -> (K, Instant, teraio_engine::Result<T>) {
    loop {
        if let Some(i) = q.iter().position(|(_, _, h)| h.is_done()) {
            let (k, at, h) = q.remove(i).expect("the index was just found");
            return (k, at, h.wait());
        }
        let (k, at, h) = q.pop_front().expect("an operation in flight");
        match h.wait_timeout(Duration::from_micros(50)) {
            Ok(r) => return (k, at, r),
            Err(h) => q.push_front((k, at, h)),
        }
    }
}

fn record(stats: &mut DirStats, bytes: u64, took: Duration) {
    let ns = (took.as_nanos() as u64).max(1);
    stats.ios += 1;
    stats.bytes += bytes;
    let _ = stats.clat.record(ns);
    let _ = stats.lat.record(ns);
}

/// Run the benchmark (both phases).
pub fn execute(args: &Args, gpu: u32) -> Result<GpuBench> {
    if args.bs == 0 || args.iodepth == 0 {
        return Err(CliError::Usage("--bs and --iodepth must be positive".into()));
    }
    let cfg = engine_config(args, gpu)?;
    let engine = Engine::open(cfg)?;
    let info = engine.gpu_path()?;
    let devices = u64::from(engine.array().device_count());
    let tensors = (args.size * devices / args.bs).max(1);
    let depth = (args.iodepth as u64).min(tensors) as usize;
    let store = engine.store();
    // Buffers with random data, written once before the clock starts.
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let mut host = vec![0u8; args.bs as usize];
    let mut free: Vec<(usize, TensorMem)> = Vec::with_capacity(depth);
    let mut marks = Vec::with_capacity(depth);
    for b in 0..depth {
        rng.fill(&mut host[..]);
        let mut m = engine.alloc_gpu(args.bs)?;
        m.fill_from_host(&host)?;
        marks.push((host[0], host[host.len() - 1]));
        free.push((b, m));
    }
    // Warm-up before the clock: staging buffers pinned, the crc32c kernel compiled, cuFile's
    // buffers set up (KvikIO's benchmark script warms up the same way).
    {
        let (b, m) = free.pop().expect("at least one buffer");
        let warm = u64::MAX;
        let (_, m) = store.offload_keep(warm, m, OffloadOptions::default())?.wait()?;
        let m = store.prefetch(warm, m, Priority::Normal)?.wait()?;
        free.push((b, m));
        if store.info(warm).is_some() {
            store.free(warm)?.wait()?;
        }
    }
    // Write phase: tensor t goes out of whichever buffer is free; `iodepth` in flight.
    let mut writes = DirStats::new();
    let mut in_flight: VecDeque<(usize, Instant, OffloadHandle)> = VecDeque::new();
    let mut owner = vec![0usize; tensors as usize];
    let start = Instant::now();
    for t in 0..tensors {
        if free.is_empty() {
            let (b, issued, r) = next_done(&mut in_flight);
            let (_, m) = r?;
            record(&mut writes, args.bs, issued.elapsed());
            free.push((b, m));
        }
        let (b, m) = free.pop().expect("a free buffer");
        owner[t as usize] = b;
        let h = store.offload_keep(t, m, OffloadOptions::default())?;
        in_flight.push_back((b, Instant::now(), h));
    }
    for (b, issued, h) in in_flight.drain(..) {
        let (_, m) = h.wait()?;
        record(&mut writes, args.bs, issued.elapsed());
        free.push((b, m));
    }
    let write_time = start.elapsed();
    // Read phase.
    let mut reads = DirStats::new();
    let mut pending: VecDeque<(u64, Instant, Handle<TensorMem>)> = VecDeque::new();
    let mut bufs: Vec<TensorMem> = free.into_iter().map(|(_, m)| m).collect();
    let check = |t: u64, m: &TensorMem| -> Result<()> {
        let (first, last) = marks[owner[t as usize]];
        let (mut a, mut z) = ([0u8; 1], [0u8; 1]);
        m.copy_out(0, &mut a)?;
        m.copy_out(m.len() - 1, &mut z)?;
        if (a[0], z[0]) != (first, last) {
            return Err(CliError::Usage(format!("tensor {t} came back with wrong bytes")));
        }
        Ok(())
    };
    let start = Instant::now();
    let mut checks = Vec::new();
    for t in 0..tensors {
        if bufs.is_empty() {
            let (pt, issued, r) = next_done(&mut pending);
            let m = r?;
            record(&mut reads, args.bs, issued.elapsed());
            if checks.len() < 64 {
                checks.push(pt);
                check(pt, &m)?;
            }
            bufs.push(m);
        }
        let m = bufs.pop().expect("a free buffer");
        pending.push_back((t, Instant::now(), store.prefetch(t, m, Priority::Normal)?));
    }
    for (pt, issued, h) in pending.drain(..) {
        let m = h.wait()?;
        record(&mut reads, args.bs, issued.elapsed());
        check(pt, &m)?;
    }
    let read_time = start.elapsed();
    let st = store.gpu_stats();
    Ok(GpuBench {
        write: (writes, write_time),
        read: (reads, read_time),
        path: info.path,
        reason: info.reason,
        direct_mode: info.direct_mode.map(|m| m.describe().to_string()),
        device: engine.gpu_description().unwrap_or("?").to_string(),
        array: engine.describe(),
        tensors,
        gpu_crc_s: st.gpu_crc_ns as f64 * 1e-9,
    })
}

/// `teraio bench --gpu N`.
pub fn run(args: &Args, gpu: u32) -> Result<()> {
    let r = execute(args, gpu)?;
    let checksums = if args.no_checksums {
        "off"
    } else if r.path == "gds" {
        "on (GPU)"
    } else {
        "on (CPU, staging buffers)"
    };
    if args.json {
        let out = json!({
            "teraio version": env!("CARGO_PKG_VERSION"),
            "global options": {
                "bs": args.bs.to_string(),
                "iodepth": args.iodepth.to_string(),
                "size": args.size.to_string(),
                "direct": "1",
                "ioengine": format!("teraio-gpu-{}", r.path),
                "filename": r.array,
            },
            "gpu": {
                "device": r.device,
                "path": r.path,
                "reason": r.reason,
                "cufile_mode": r.direct_mode,
                "checksums": checksums,
                "gpu_crc_s": r.gpu_crc_s,
                "tensors": r.tensors,
            },
            "jobs": [
                { "jobname": "gpu-to-ssd", "job_runtime": r.write.1.as_millis() as u64,
                  "write": dir_json(&r.write.0, r.write.1) },
                { "jobname": "ssd-to-gpu", "job_runtime": r.read.1.as_millis() as u64,
                  "read": dir_json(&r.read.0, r.read.1) },
            ],
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("teraio bench --gpu: {} <-> {}", r.device, r.array);
    println!("  path: {} ({})", r.path, r.reason);
    if let Some(m) = &r.direct_mode {
        println!("  cuFile: {m}");
    }
    println!(
        "  {} tensors of {} each way, {} in flight, crc32c {checksums}",
        r.tensors,
        crate::units::binary_compact(args.bs as f64),
        args.iodepth
    );
    print_dir("write (GPU -> SSD)", &r.write.0, r.write.1);
    print_dir("read  (SSD -> GPU)", &r.read.0, r.read.1);
    if r.gpu_crc_s > 0.0 {
        println!("  GPU crc32c: {:.3} s in total", r.gpu_crc_s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[test]
    fn the_gpu_benchmark_runs_both_paths_on_an_emulated_gpu() {
        let dir = tempfile::tempdir().unwrap();
        for path in ["bounce", "gds"] {
            let d = dir.path().join(path);
            let cli = Cli::parse_from([
                "bench",
                "--gpu",
                "0",
                "--gpu-emulated",
                "--gpu-path",
                path,
                "--dir",
                d.to_str().unwrap(),
                "--files",
                "2",
                "--size",
                "8M",
                "--bs",
                "3M",
                "--iodepth",
                "2",
                "--backend",
                "psync",
            ]);
            let r = execute(&cli.args, 0).unwrap();
            assert_eq!(r.path, path);
            assert_eq!(r.tensors, 5);
            assert_eq!(r.write.0.ios, 5);
            assert_eq!(r.read.0.ios, 5);
            assert_eq!(r.read.0.bytes, 15 << 20);
            if path == "gds" {
                assert!(r.gpu_crc_s > 0.0, "checksums computed on the (emulated) device");
            }
        }
    }
}
