//! `teraio bench`: a storage benchmark in the spirit of fio, over files or raw block devices,
//! through teraio's own I/O engine (the same device array and backends a training run uses).
//!
//! Each device gets one driver thread that keeps `--iodepth` requests in flight through
//! [`DeviceArray::read_at`]/[`DeviceArray::write_at`] with buffers from the huge-page
//! [`BufferPool`]. Latencies go into HDR histograms; `--json` prints them with fio's field names
//! (`bw_bytes`, `iops`, `runtime`, `lat_ns`/`clat_ns`/`slat_ns` with percentile keys such as
//! `"99.000000"`) so the result can be put next to fio's.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::{Map, Value, json};
use teraio_engine::array::{CompletionSignal, DeviceArray, IoTicket, Target};
use teraio_engine::pool::{BufferPool, IoBuf, PoolConfig};
use teraio_engine::{EngineConfig, Overwrite};

use super::engine_args::ArrayArgs;
use crate::units::parse_size;
use crate::{CliError, Result};

/// The I/O pattern (fio's `--rw`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rw {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    Randread,
    /// Random writes.
    Randwrite,
    /// Sequential mixed reads and writes (`--rwmixread` % reads).
    #[value(alias = "rw")]
    Readwrite,
    /// Random mixed reads and writes.
    Randrw,
}

impl Rw {
    fn random(self) -> bool {
        matches!(self, Rw::Randread | Rw::Randwrite | Rw::Randrw)
    }
    fn reads(self) -> bool {
        !matches!(self, Rw::Write | Rw::Randwrite)
    }
    fn name(self) -> &'static str {
        match self {
            Rw::Read => "read",
            Rw::Write => "write",
            Rw::Randread => "randread",
            Rw::Randwrite => "randwrite",
            Rw::Readwrite => "rw",
            Rw::Randrw => "randrw",
        }
    }
}

/// Options of `teraio bench`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  teraio bench --rw write --bs 1M --iodepth 32          # 4 files in ./teraio-data
  teraio bench --target /dev/nvme1n1 --target /dev/nvme2n1 --rw randread --bs 4k --force
  teraio bench --config teraio.toml --rw read --json     # the array an engine config names
  teraio bench --tensors                                 # 1 MiB - 1 GiB tensors via the store
  teraio bench --gpu 0 --gpu-path gds --bs 64M --iodepth 8 --json   # GPU memory <-> the array")]
pub struct Args {
    /// The array: --config FILE, --target PATH (repeat), or --files N in --dir.
    #[command(flatten)]
    pub array: ArrayArgs,
    /// I/O pattern.
    #[arg(long, value_enum, default_value = "read")]
    pub rw: Rw,
    /// Block size of each I/O (k, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    pub bs: u64,
    /// Requests in flight per device.
    #[arg(long, default_value_t = 32)]
    pub iodepth: u32,
    /// Bytes per device to run over (new files are created with this size unless --file-size
    /// says otherwise; devices use at most this).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub size: u64,
    /// Run for this many seconds, wrapping around (default: one pass over `--size`).
    #[arg(long, value_name = "SECONDS")]
    pub runtime: Option<f64>,
    /// Percentage of reads in mixed workloads.
    #[arg(long, default_value_t = 50)]
    pub rwmixread: u32,
    /// Print fio-style JSON instead of the text summary.
    #[arg(long)]
    pub json: bool,
    /// Do not write new files before a read workload (reads of never-written blocks of a
    /// preallocated file do not touch the disk).
    #[arg(long)]
    pub no_prefill: bool,
    /// Use ordinary pages for the I/O buffers (to see what huge pages buy).
    #[arg(long)]
    pub no_huge_pages: bool,
    /// Seed of the random offsets.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Instead of raw blocks, move a realistic mix of tensors (log-uniform 1 MiB - 1 GiB, about
    /// 60% of the array) through the tensor store: offload them all, then prefetch them all
    /// (crc32c on; `--no-checksums` to leave it out).
    #[arg(long)]
    pub tensors: bool,
    /// With --tensors or --gpu: skip the store's crc32c per stripe unit.
    #[arg(long)]
    pub no_checksums: bool,
    /// GPU <-> SSD array instead of host memory: `--bs`-sized tensors in this CUDA device's
    /// memory are written to the array through the tensor store (`--iodepth` in flight,
    /// `--size` per device in total), then read back, like gdsio or KvikIO's benchmark.
    #[arg(long, value_name = "N", conflicts_with = "tensors")]
    pub gpu: Option<u32>,
    /// With --gpu: the data path (auto: GPUDirect Storage where it runs peer to peer, else the
    /// pinned bounce pipeline; gds: cuFile, also in its compatibility mode; bounce).
    #[arg(long, value_enum, default_value = "auto", requires = "gpu")]
    pub gpu_path: GpuPathArg,
    /// With --gpu: host memory stands in for the GPU (the same data paths; for tests).
    #[arg(long, hide = true, requires = "gpu")]
    pub gpu_emulated: bool,
}

impl Args {
    /// The engine configuration of the run: the array options, files sized to `--size` unless
    /// `--file-size` is given, the queue depth of `--iodepth`; an existing teraio array is
    /// reused (the benchmark overwrites it).
    pub fn engine_config(&self) -> Result<EngineConfig> {
        let mut cfg = self.array.engine_config()?;
        if self.array.file_size.is_none() {
            cfg.file_size_bytes.0 = self.size;
        }
        cfg.queue_depth = self.iodepth;
        if cfg.overwrite == Overwrite::Refuse {
            cfg.overwrite = Overwrite::Teraio;
        }
        Ok(cfg)
    }
}

/// Latency histograms of one direction (nanoseconds).
pub(crate) struct DirStats {
    pub(super) ios: u64,
    pub(super) bytes: u64,
    pub(super) slat: Histogram<u64>,
    pub(super) clat: Histogram<u64>,
    pub(super) lat: Histogram<u64>,
}

impl DirStats {
    pub(super) fn new() -> Self {
        let h = || Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds");
        Self { ios: 0, bytes: 0, slat: h(), clat: h(), lat: h() }
    }
    fn merge(&mut self, o: &DirStats) {
        self.ios += o.ios;
        self.bytes += o.bytes;
        self.slat.add(&o.slat).expect("same bounds");
        self.clat.add(&o.clat).expect("same bounds");
        self.lat.add(&o.lat).expect("same bounds");
    }
}

struct InFlight {
    ticket: IoTicket,
    read: bool,
    submitted: Instant,
    slat: Duration,
}

const PERCENTILES: [f64; 17] = [
    1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95,
    99.99,
];

/// What one device's driver thread should do.
struct Job {
    device: u32,
    rw: Rw,
    bs: u64,
    span: u64,
    iodepth: u32,
    ops: Option<u64>,
    runtime: Option<Duration>,
    rwmixread: u32,
    seed: u64,
}

fn drive(
    array: &DeviceArray,
    pool: &Arc<BufferPool>,
    job: &Job,
    progress: &AtomicU64,
    stop: &AtomicBool,
    ready: &Barrier,
) -> Result<(DirStats, DirStats, Instant)> {
    let (mut rd, mut wr) = (DirStats::new(), DirStats::new());
    let blocks = job.span / job.bs;
    let mut rng = SmallRng::seed_from_u64(job.seed ^ (u64::from(job.device) << 32));
    // Buffers are allocated and touched (faulting their pages in) before the clock starts.
    let bufs: Result<Vec<IoBuf>> = (0..job.iodepth)
        .map(|_| {
            let mut b = pool.alloc(job.bs as usize)?;
            rng.fill(&mut b[..]);
            Ok(b)
        })
        .collect();
    ready.wait();
    let mut free = bufs?;
    let deadline = job.runtime.map(|r| Instant::now() + r);
    let mut queue: VecDeque<InFlight> = VecDeque::with_capacity(job.iodepth as usize);
    let signal = CompletionSignal::new();
    let mut issued = 0u64;
    let mut next_block = 0u64;
    loop {
        let more = |issued: u64| {
            job.ops.is_none_or(|n| issued < n)
                && deadline.is_none_or(|d| Instant::now() < d)
                && !stop.load(Ordering::Relaxed)
        };
        while queue.len() < job.iodepth as usize && more(issued) {
            let block = if job.rw.random() {
                rng.gen_range(0..blocks)
            } else {
                let b = next_block;
                next_block = (next_block + 1) % blocks;
                b
            };
            let read = match job.rw {
                Rw::Read | Rw::Randread => true,
                Rw::Write | Rw::Randwrite => false,
                Rw::Readwrite | Rw::Randrw => rng.gen_range(0..100) < job.rwmixread,
            };
            let buf = free.pop().expect("one buffer per slot of the queue");
            let t0 = Instant::now();
            let ticket = if read {
                array.read_at(job.device, block * job.bs, buf)?
            } else {
                array.write_at(job.device, block * job.bs, buf)?
            };
            let slat = t0.elapsed();
            ticket.notify_on_completion(&signal);
            queue.push_back(InFlight { ticket, read, submitted: t0, slat });
            issued += 1;
        }
        // Take every finished request (in any order, so one slow request does not hold back
        // the others' slots), waiting for the next completion when none has finished.
        if queue.is_empty() {
            break;
        }
        let mut finished = Vec::new();
        loop {
            let seen = signal.count();
            let mut i = 0;
            while i < queue.len() {
                if queue[i].ticket.is_done() {
                    finished.extend(queue.swap_remove_back(i));
                } else {
                    i += 1;
                }
            }
            if !finished.is_empty() {
                break;
            }
            signal.wait_beyond(seen);
        }
        for f in finished {
            let (buf, result, done) = f.ticket.wait_timed();
            result?;
            let lat = done.saturating_duration_since(f.submitted);
            let s = if f.read { &mut rd } else { &mut wr };
            s.ios += 1;
            s.bytes += job.bs;
            let ns = |d: Duration| (d.as_nanos() as u64).max(1);
            s.slat.saturating_record(ns(f.slat));
            s.clat.saturating_record(ns(lat.saturating_sub(f.slat)));
            s.lat.saturating_record(ns(lat));
            progress.fetch_add(job.bs, Ordering::Relaxed);
            free.push(buf);
        }
    }
    Ok((rd, wr, Instant::now()))
}

fn hist_json(h: &Histogram<u64>, with_percentiles: bool) -> Value {
    let mut m = Map::new();
    let n = h.len();
    m.insert("min".into(), json!(if n == 0 { 0 } else { h.min() }));
    m.insert("max".into(), json!(h.max()));
    m.insert("mean".into(), json!(if n == 0 { 0.0 } else { h.mean() }));
    m.insert("stddev".into(), json!(if n == 0 { 0.0 } else { h.stdev() }));
    m.insert("N".into(), json!(n));
    if with_percentiles {
        let mut p = Map::new();
        for q in PERCENTILES {
            p.insert(format!("{q:.6}"), json!(h.value_at_quantile(q / 100.0)));
        }
        m.insert("percentile".into(), Value::Object(p));
    }
    Value::Object(m)
}

pub(super) fn dir_json(s: &DirStats, runtime: Duration) -> Value {
    let secs = runtime.as_secs_f64().max(1e-9);
    let bw = s.bytes as f64 / secs;
    json!({
        "io_bytes": s.bytes,
        "io_kbytes": s.bytes / 1024,
        "bw_bytes": bw.round() as u64,
        "bw": (bw / 1024.0).round() as u64,
        "iops": s.ios as f64 / secs,
        "runtime": runtime.as_millis() as u64,
        "total_ios": s.ios,
        "slat_ns": hist_json(&s.slat, false),
        "clat_ns": hist_json(&s.clat, true),
        "lat_ns": hist_json(&s.lat, true),
    })
}

pub(super) fn print_dir(name: &str, s: &DirStats, runtime: Duration) {
    if s.ios == 0 {
        return;
    }
    let secs = runtime.as_secs_f64().max(1e-9);
    let bw = s.bytes as f64 / secs;
    println!(
        "  {name}: IOPS={:.0}, BW={:.2}GB/s ({}/s) ({} in {:.3}s)",
        s.ios as f64 / secs,
        bw / 1e9,
        crate::units::binary_compact(bw),
        crate::units::binary_compact(s.bytes as f64),
        secs
    );
    let us = |v: u64| v as f64 / 1000.0;
    let h = &s.lat;
    println!(
        "    lat (usec): min={:.1}, avg={:.1}, p50={:.1}, p99={:.1}, p99.9={:.1}, max={:.1}",
        us(h.min()),
        h.mean() / 1000.0,
        us(h.value_at_quantile(0.5)),
        us(h.value_at_quantile(0.99)),
        us(h.value_at_quantile(0.999)),
        us(h.max())
    );
}

/// Open the targets and run the workload.
fn execute(args: &Args) -> Result<Report> {
    if args.iodepth == 0 {
        return Err(CliError::Usage("--iodepth must be at least 1".into()));
    }
    if args.rwmixread > 100 {
        return Err(CliError::Usage("--rwmixread is a percentage (0-100)".into()));
    }
    if args.runtime.is_some_and(|r| !(r > 0.0 && r.is_finite())) {
        return Err(CliError::Usage("--runtime must be a positive number of seconds".into()));
    }
    let cfg = args.engine_config()?;
    // Files that do not yet hold `size` bytes get written before a read workload.
    let needs_prefill: Vec<bool> = cfg
        .resolved_targets()
        .iter()
        .map(|t| match t {
            Target::Path(p) => match std::fs::metadata(p) {
                Ok(m) if m.file_type().is_file() => m.len() < args.size,
                Ok(_) => false,
                Err(_) => true,
            },
            Target::Sim(_) => false,
        })
        .collect();
    let array = cfg.open_array()?;
    let block = u64::from(array.geometry().block_bytes);
    if !args.bs.is_multiple_of(block) {
        return Err(CliError::Usage(format!(
            "--bs {} is not a multiple of the devices' block size {block} (O_DIRECT)",
            args.bs
        )));
    }
    if args.bs > array.max_io_bytes() {
        eprintln!(
            "teraio: notice: --bs {} exceeds the devices' largest request ({} bytes); each I/O is split",
            args.bs,
            array.max_io_bytes()
        );
    }
    let n = array.device_count();
    let spans: Vec<u64> =
        (0..n).map(|d| array.device_capacity(d).min(args.size) / args.bs * args.bs).collect();
    if let Some((d, _)) = spans.iter().enumerate().find(|(_, s)| **s == 0) {
        return Err(CliError::Usage(format!(
            "{} holds less than one --bs block",
            array.device_name(d as u32)
        )));
    }
    let slots = u64::from(args.iodepth) * u64::from(n);
    let per_buf = BufferPool::capacity_for(args.bs as usize) as u64;
    let pool = BufferPool::new(PoolConfig {
        capacity_bytes: (slots * per_buf + (4 << 20)).next_multiple_of(2 << 20),
        prefer_huge_pages: !args.no_huge_pages,
    })?;

    if args.rw.reads() && !args.no_prefill && needs_prefill.iter().any(|&b| b) {
        eprintln!(
            "teraio: writing the new data files once before reading them (--no-prefill skips)"
        );
        let jobs: Vec<Job> = (0..n)
            .filter(|&d| needs_prefill[d as usize])
            .map(|d| Job {
                device: d,
                rw: Rw::Write,
                bs: args.bs,
                span: spans[d as usize],
                iodepth: args.iodepth,
                ops: Some(spans[d as usize] / args.bs),
                runtime: None,
                rwmixread: 0,
                seed: args.seed,
            })
            .collect();
        run_jobs(&array, &pool, jobs, None, true)?;
        array.sync()?;
    }

    let runtime = args.runtime.map(Duration::from_secs_f64);
    let jobs: Vec<Job> = (0..n)
        .map(|d| Job {
            device: d,
            rw: args.rw,
            bs: args.bs,
            span: spans[d as usize],
            iodepth: args.iodepth,
            ops: if runtime.is_some() { None } else { Some(spans[d as usize] / args.bs) },
            runtime,
            rwmixread: args.rwmixread,
            seed: args.seed,
        })
        .collect();
    let total = if runtime.is_some() { None } else { Some(spans.iter().sum::<u64>()) };
    let (rd, wr, cpu) = run_jobs(&array, &pool, jobs, total.map(|t| (t, args.runtime)), args.json)?;
    if !args.rw.reads() {
        // Not part of the timing (as fio without --end_fsync), but leave the data durable.
        array.sync()?;
    }
    let runtime = rd.1.max(wr.1).max(Duration::from_nanos(1));
    Ok(Report {
        rd: rd.0,
        wr: wr.0,
        runtime,
        cpu,
        names: (0..n).map(|d| array.device_name(d)).collect(),
        backend: array.backend_name(),
        backing: pool.backing(),
    })
}

/// The outcome of a run.
struct Report {
    rd: DirStats,
    wr: DirStats,
    runtime: Duration,
    /// Process CPU time (user, system) while the jobs ran.
    cpu: (Duration, Duration),
    names: Vec<String>,
    backend: &'static str,
    backing: teraio_engine::pool::PageBacking,
}

/// A GPU data path on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuPathArg {
    /// GPUDirect Storage where it runs peer to peer, the pinned bounce pipeline otherwise.
    Auto,
    /// GPUDirect Storage (cuFile), also in its compatibility mode.
    Gds,
    /// The pinned-host bounce pipeline.
    Bounce,
}

impl From<GpuPathArg> for teraio_engine::store::GpuPath {
    fn from(p: GpuPathArg) -> Self {
        match p {
            GpuPathArg::Auto => Self::Auto,
            GpuPathArg::Gds => Self::Gds,
            GpuPathArg::Bounce => Self::Bounce,
        }
    }
}

/// Run `teraio bench`.
pub fn run(args: Args) -> Result<()> {
    if let Some(gpu) = args.gpu {
        return super::bench_gpu::run(&args, gpu);
    }
    if args.tensors {
        let cfg = args.engine_config()?;
        return super::bench_tensors::from_config(cfg, !args.no_checksums, args.seed, args.json);
    }
    let report = execute(&args)?;
    let Report { rd, wr, runtime, cpu, names, backend, backing } = report;
    // As fio: percent of one CPU over the run; and the CPU time per I/O.
    let pct = |d: Duration| 100.0 * d.as_secs_f64() / runtime.as_secs_f64().max(1e-9);
    let ios = rd.ios + wr.ios;
    let cpu_us_per_io = (cpu.0 + cpu.1).as_secs_f64() * 1e6 / ios.max(1) as f64;
    let n = names.len();
    let engine = format!("teraio-{backend}");
    if args.json {
        let out = json!({
            "teraio version": env!("CARGO_PKG_VERSION"),
            "timestamp": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            "global options": {
                "rw": args.rw.name(),
                "bs": args.bs.to_string(),
                "iodepth": args.iodepth.to_string(),
                "size": args.size.to_string(),
                "direct": "1",
                "ioengine": engine,
                "numjobs": n.to_string(),
                "filename": names.join(":"),
            },
            "jobs": [{
                "jobname": "teraio",
                "job_runtime": runtime.as_millis() as u64,
                "usr_cpu": pct(cpu.0),
                "sys_cpu": pct(cpu.1),
                "cpu_us_per_io": cpu_us_per_io,
                "read": dir_json(&rd, runtime),
                "write": dir_json(&wr, runtime),
            }],
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "teraio bench: rw={} bs={} iodepth={} x {} device(s), backend={}, buffers={:?}",
            args.rw.name(),
            crate::units::binary_compact(args.bs as f64),
            args.iodepth,
            n,
            backend,
            backing
        );
        print_dir("read", &rd, runtime);
        print_dir("write", &wr, runtime);
        println!(
            "  cpu: usr={:.1}%, sys={:.1}% of one core, {:.1} us per I/O",
            pct(cpu.0),
            pct(cpu.1),
            cpu_us_per_io
        );
    }
    Ok(())
}

/// Read and write statistics with the wall time, and the process's CPU time (user, system)
/// over the same span.
type Totals = ((DirStats, Duration), (DirStats, Duration), (Duration, Duration));

/// This process's CPU time so far (user, system), from `/proc/self/stat` (clock ticks of 10 ms:
/// Linux's user-visible tick rate is 100 Hz on every architecture); zero where it is unreadable.
fn process_cpu() -> (Duration, Duration) {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return (Duration::ZERO, Duration::ZERO);
    };
    // The command name (field 2) may contain spaces: count fields after its closing ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    // utime and stime are fields 14 and 15 of the line: 12 and 13 after the name.
    let tick = |i: usize| Duration::from_millis(f.get(i).copied().unwrap_or(0) * 10);
    (tick(11), tick(12))
}

/// Run one driver thread per job; returns merged read and write stats with the wall time.
fn run_jobs(
    array: &Arc<DeviceArray>,
    pool: &Arc<BufferPool>,
    jobs: Vec<Job>,
    total: Option<(u64, Option<f64>)>,
    quiet: bool,
) -> Result<Totals> {
    let progress = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        let bar = match total {
            Some((bytes, _)) => indicatif::ProgressBar::new(bytes),
            None => indicatif::ProgressBar::new(0),
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec}",
            )
            .expect("valid template"),
        );
        bar
    };
    let ready = Barrier::new(jobs.len() + 1);
    let mut started = Instant::now();
    let mut cpu0 = process_cpu();
    let results = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .iter()
            .map(|job| {
                let (array, pool, progress, stop, ready) = (array, pool, &progress, &stop, &ready);
                s.spawn(move || {
                    let r = drive(array, pool, job, progress, stop, ready);
                    if r.is_err() {
                        stop.store(true, Ordering::Relaxed);
                    }
                    r
                })
            })
            .collect();
        ready.wait();
        started = Instant::now();
        cpu0 = process_cpu();
        while !handles.iter().all(|h| h.is_finished()) {
            bar.set_position(progress.load(Ordering::Relaxed));
            std::thread::sleep(Duration::from_millis(100));
        }
        handles.into_iter().map(|h| h.join().expect("driver thread panicked")).collect::<Vec<_>>()
    });
    let cpu1 = process_cpu();
    bar.finish_and_clear();
    let (mut rd, mut wr) = (DirStats::new(), DirStats::new());
    let mut ended = started;
    for r in results {
        let (a, b, end) = r?;
        rd.merge(&a);
        wr.merge(&b);
        ended = ended.max(end);
    }
    let elapsed = ended - started;
    let cpu = (cpu1.0.saturating_sub(cpu0.0), cpu1.1.saturating_sub(cpu0.1));
    Ok(((rd, elapsed), (wr, elapsed), cpu))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_keys_match_fio() {
        let mut h = Histogram::<u64>::new_with_bounds(1, 1_000_000, 3).unwrap();
        for v in 1..=1000 {
            h.record(v).unwrap();
        }
        let j = hist_json(&h, true);
        let p = j["percentile"].as_object().unwrap();
        assert!(
            p.contains_key("99.000000")
                && p.contains_key("50.000000")
                && p.contains_key("99.990000")
        );
        let p99 = p["99.000000"].as_u64().unwrap();
        assert!((985..=995).contains(&p99), "{p99}");
    }

    #[test]
    fn a_small_run_over_files_reports_what_it_moved() {
        let dir = tempfile::tempdir().unwrap();
        let args = Args {
            array: ArrayArgs {
                dir: Some(dir.path().to_path_buf()),
                files: Some(2),
                ..Default::default()
            },
            rw: Rw::Write,
            bs: 64 << 10,
            iodepth: 4,
            size: 1 << 20,
            runtime: None,
            rwmixread: 50,
            json: true,
            no_prefill: false,
            no_huge_pages: false,
            seed: 1,
            tensors: false,
            no_checksums: false,
            gpu: None,
            gpu_path: GpuPathArg::Auto,
            gpu_emulated: false,
        };
        let r = execute(&args).unwrap();
        assert_eq!(r.wr.ios, 32);
        assert_eq!(r.wr.bytes, 2 << 20);
        assert_eq!(r.rd.ios, 0);
        assert_eq!(r.wr.lat.len(), 32);
        assert_eq!(r.names.len(), 2);
        assert_eq!(std::fs::metadata(dir.path().join("dev1")).unwrap().len(), 1 << 20);
        // A read pass over the same files reads what was written.
        let args = Args { rw: Rw::Randread, bs: 4096, ..args };
        let r = execute(&args).unwrap();
        assert_eq!(r.rd.ios, 2 * 256);
        assert!(r.rd.clat.max() <= r.rd.lat.max());
    }
}
