//! Measuring the machine under an engine: the hardware model that plans are made for.
//!
//! A plan is only as good as the rates it assumes: planned for the paper's machine (4 SSDs,
//! PCIe 5), an H200 machine's steps ran 25% slower than planned for its own figures. [`measure`]
//! takes a few seconds to measure, through the engine's own paths, what the scheduler's
//! [`Hardware`] model needs:
//!
//! - the array's write and read bandwidth, and both directions at once, through the tensor
//!   store (O_DIRECT, striped, checksummed: what an offload and a prefetch pay), from host
//!   buffers, with up to [`ProbeOptions::array_bytes`] each way;
//! - host memory copies, on as many threads as the engine has workers;
//! - the host's AdamW (teraio's own, `crate::optim`, on its default threads) over buffers of
//!   a quarter of [`ProbeOptions::copy_bytes`] each: the parameters a second an optimizer
//!   update on the host runs at (`cpu_adam_params_per_s`, which the optimizer's placement
//!   weighs);
//! - with a GPU, pinned host <-> device copies each way alone and both at once, on the engine's
//!   copy queues (as prefetches and offloads go). On a CPU-only engine the "GPU" is host memory:
//!   its copy rates are the host copy rate, and the report says so.
//!
//! A part that cannot run (an array with too little free space, no memory for a buffer) is
//! skipped and the report's notes say why; the model then keeps the `dev` preset's figures for
//! it, and [`ProbeReport::from_default`] lists every field that was not measured or taken from
//! the engine. [`measure_cached`] keeps the result per machine and array ([`cache`]), so a
//! later session on the same machine and array reads it in a moment.

pub mod cache;

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};
use teraio_scheduler::Hardware;

use crate::queue::{Handle, Priority};
use crate::store::OffloadOptions;
use crate::tier::{CopyWay, TensorMem};
use crate::{Engine, Error, Result};

pub use cache::{CacheMode, ProbeKey, cache_dir, measure_cached, measure_cached_in};

/// How much a measurement moves and how long each of its parts may take.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeOptions {
    /// Bytes written to the array (and read back, and written again while reading) to measure
    /// it. Capped at a quarter of the array's free space; below [`ARRAY_BYTES_MIN`] the array
    /// is not measured (and the report says so). 0: the array is not measured.
    pub array_bytes: u64,
    /// Size of each buffer of the host and GPU copy measurements.
    pub copy_bytes: u64,
    /// The longest one timed phase may run (array write, read, both; each copy measurement):
    /// a slow array is measured with fewer bytes rather than for longer.
    pub phase_time_max: Duration,
}

impl Default for ProbeOptions {
    /// 256 MiB through the array, 64 MiB copy buffers, at most a second a phase: a few seconds
    /// in all.
    fn default() -> Self {
        Self {
            array_bytes: 256 << 20,
            copy_bytes: 64 << 20,
            phase_time_max: Duration::from_secs(1),
        }
    }
}

impl ProbeOptions {
    /// A quick measurement (tests): `array_bytes` through the array, 4 MiB copy buffers, a
    /// quarter of a second a phase.
    pub fn quick(array_bytes: u64) -> Self {
        Self { array_bytes, copy_bytes: 4 << 20, phase_time_max: Duration::from_millis(250) }
    }
}

/// Below this many bytes to spare the array is not measured: its figures would be noise.
pub const ARRAY_BYTES_MIN: u64 = 4 << 20;

/// Tensor ids the probe uses: the top of the id space, far from any trainer's.
const PROBE_ID_BASE: u64 = u64::MAX - (1 << 21);

/// The array's figures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArrayRates {
    /// What the array is: "4 files in ./teraio-data (uring, volatile)".
    pub what: String,
    /// Its devices.
    pub devices: u32,
    /// Bytes written in the write phase (0: not measured).
    pub bytes: u64,
    /// Size of each probe tensor.
    pub tensor_bytes: u64,
    /// Writing alone, bytes/s, the whole array.
    pub write_bytes_per_s: Option<f64>,
    /// Reading alone, bytes/s.
    pub read_bytes_per_s: Option<f64>,
    /// Reading and writing at once, both directions together, bytes/s.
    pub both_bytes_per_s: Option<f64>,
}

/// Host memory copies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostCopyRates {
    /// Bytes of one copy.
    pub bytes: u64,
    /// Threads copying at once (each a share of the bytes).
    pub threads: usize,
    /// Bytes copied per second (each read once and written once).
    pub bytes_per_s: Option<f64>,
}

/// The host's AdamW.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct CpuAdamRate {
    /// Parameters of one timed step.
    pub params: u64,
    /// Threads of the step.
    pub threads: usize,
    /// Parameters updated per second.
    pub params_per_s: Option<f64>,
}

/// What stands in the GPU's place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuKind {
    /// No GPU: the trainer's memory is host memory.
    None,
    /// Host memory emulating a GPU through the device data paths (tests).
    Emulated,
    /// A CUDA GPU.
    Cuda,
}

/// Host <-> GPU copies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuRates {
    /// What the GPU is.
    pub kind: GpuKind,
    /// "cuda:0 (NVIDIA H200, sm_90)", or what stands in for it.
    pub what: String,
    /// Bytes of one copy.
    pub bytes: u64,
    /// Pinned host -> device, bytes/s.
    pub h2d_bytes_per_s: Option<f64>,
    /// Device -> pinned host, bytes/s.
    pub d2h_bytes_per_s: Option<f64>,
    /// Both ways at once, both directions together, bytes/s.
    pub both_bytes_per_s: Option<f64>,
}

/// What a measurement measured, what it did not and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeReport {
    /// The array.
    pub array: ArrayRates,
    /// Host memory copies.
    pub host_copy: HostCopyRates,
    /// The host's AdamW.
    #[serde(default)]
    pub cpu_adam: CpuAdamRate,
    /// The GPU, or what stands in for it.
    pub gpu: GpuRates,
    /// Fields of the model that were neither measured nor taken from the engine's
    /// configuration: they are the `dev` preset's.
    pub from_default: Vec<String>,
    /// What was skipped and why, and what the figures stand for, for people.
    pub notes: Vec<String>,
    /// How long the measurement took, seconds.
    pub seconds: f64,
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "not measured".to_string(), |r| format!("{:.2} GB/s", r / 1e9))
}

impl ProbeReport {
    /// One line: "array of 4 devices: write 1.52 GB/s, read 1.83 GB/s, both at once 1.41
    /// GB/s; host copies 9.80 GB/s; no GPU (host memory stands in for it)".
    pub fn summary(&self) -> String {
        let a = &self.array;
        let array = if a.bytes == 0 {
            format!("array of {} devices not measured", a.devices)
        } else {
            format!(
                "array of {} devices: write {}, read {}, both at once {}",
                a.devices,
                rate(a.write_bytes_per_s),
                rate(a.read_bytes_per_s),
                rate(a.both_bytes_per_s)
            )
        };
        let gpu = match self.gpu.kind {
            GpuKind::None => "no GPU (host memory stands in for it)".to_string(),
            _ => format!(
                "{}: host -> GPU {}, GPU -> host {}, both at once {}",
                self.gpu.what,
                rate(self.gpu.h2d_bytes_per_s),
                rate(self.gpu.d2h_bytes_per_s),
                rate(self.gpu.both_bytes_per_s)
            ),
        };
        let adam = self.cpu_adam.params_per_s.map_or_else(
            || "not measured".to_string(),
            |r| format!("{:.2} G parameters/s", r / 1e9),
        );
        format!(
            "{array}; host copies {}; host AdamW {adam}; {gpu}",
            rate(self.host_copy.bytes_per_s)
        )
    }
}

/// Where a [`Measurement`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// Measured by this call.
    Measured,
    /// Read from the cache (measured earlier on this machine and array).
    Cache,
}

/// A hardware model of the machine under an engine, and how it was obtained.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Measurement {
    /// The model: measured fields from the report, the array's size, the host tier and the
    /// GPU's memory from the engine, the rest from the `dev` preset.
    pub hardware: Hardware,
    /// What was measured.
    pub report: ProbeReport,
    /// Measured now, or read from the cache.
    pub source: Source,
    /// The cache file read or written (None: not cached; the report's notes say why).
    pub cache_path: Option<PathBuf>,
    /// What the cache is keyed by (None: an array that cannot be keyed, simulated disks).
    pub key: Option<ProbeKey>,
    /// When it was measured, seconds since the Unix epoch.
    pub measured_unix_s: u64,
}

impl Measurement {
    /// One line for a log: "this machine's, measured now in 2.1 s (...), cached in PATH" or
    /// "this machine's, from the cache PATH (measured 2026-12-05 17:32 UTC: ...)".
    pub fn describe(&self) -> String {
        let what = self.report.summary();
        match (self.source, &self.cache_path) {
            (Source::Cache, Some(p)) => format!(
                "this machine's, from the cache {} (measured {} in {:.1} s: {what})",
                p.display(),
                utc(self.measured_unix_s),
                self.report.seconds
            ),
            (_, Some(p)) => format!(
                "this machine's, measured now in {:.1} s ({what}), cached in {}",
                self.report.seconds,
                p.display()
            ),
            (_, None) => {
                format!(
                    "this machine's, measured now in {:.1} s ({what}), not cached",
                    self.report.seconds
                )
            }
        }
    }

    /// The measurement as JSON: its fields and `summary` ([`describe`](Self::describe)).
    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("a measurement serializes");
        v["summary"] = serde_json::Value::String(self.describe());
        v
    }
}

/// "2026-12-05 17:32 UTC".
fn utc(unix_s: u64) -> String {
    // Howard Hinnant's days-to-civil.
    let days = (unix_s / 86_400) as i64;
    let (h, m) = ((unix_s % 86_400) / 3600, (unix_s % 3600) / 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{m:02} UTC")
}

pub(crate) fn now_unix_s() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Measure the machine under `engine` now (no cache: [`measure_cached`] keeps results). Never
/// fails for a part that cannot run: that part is skipped and said in the report.
pub fn measure(engine: &Engine, options: &ProbeOptions) -> Measurement {
    let started = Instant::now();
    let mut notes = Vec::new();
    let array = measure_array(engine, options, &mut notes);
    let threads = engine.config().workers.clamp(1, available_threads());
    let host_copy = HostCopyRates {
        bytes: options.copy_bytes,
        threads,
        bytes_per_s: match host_copy_rate(options.copy_bytes, threads, options.phase_time_max) {
            Ok(r) => Some(r),
            Err(e) => {
                notes.push(format!("host copies: not measured ({e})"));
                None
            }
        },
    };
    let gpu = measure_gpu(engine, options, &host_copy, &mut notes);
    let params = options.copy_bytes / 16;
    let cpu_adam = CpuAdamRate {
        params,
        threads: crate::optim::default_threads(),
        params_per_s: match cpu_adam_rate(params, options.phase_time_max) {
            Ok(r) => Some(r),
            Err(e) => {
                notes.push(format!("host AdamW: not measured ({e})"));
                None
            }
        },
    };
    let report = ProbeReport {
        array,
        host_copy,
        cpu_adam,
        gpu,
        from_default: Vec::new(),
        notes,
        seconds: started.elapsed().as_secs_f64(),
    };
    let (hardware, report) = model(engine, report);
    Measurement {
        hardware,
        report,
        source: Source::Measured,
        cache_path: None,
        key: ProbeKey::of(engine),
        measured_unix_s: now_unix_s(),
    }
}

/// Threads the machine runs at once.
fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The fields of the model that come from the engine's configuration, not from a measurement:
/// the array's devices and size, the host tier, the GPU's memory. Set on a cached model too
/// (the array's files may have been resized, the host tier changed).
pub(crate) fn engine_fields(engine: &Engine, hw: &mut Hardware) {
    let devices = engine.array().device_count().max(1);
    hw.ssd_count = devices;
    hw.ssd_capacity_bytes = Some((engine.capacity_bytes() / u64::from(devices)).max(1));
    hw.host_memory_cap_bytes = engine.config().host_tier_bytes.0;
    if let Some(g) = engine.gpu_memory_bytes() {
        hw.gpu_memory_bytes = g;
    }
}

/// The hardware model of a report: measured fields, the engine's, the `dev` preset's for the
/// rest (listed in the report).
fn model(engine: &Engine, mut report: ProbeReport) -> (Hardware, ProbeReport) {
    let mut hw = Hardware::dev();
    let mut default = Vec::new();
    engine_fields(engine, &mut hw);
    if engine.gpu_memory_bytes().is_none() {
        default.push("gpu_memory_bytes");
    }
    let n = f64::from(hw.ssd_count);
    let a = &report.array;
    match (a.write_bytes_per_s, a.read_bytes_per_s) {
        (Some(w), Some(r)) => {
            hw.ssd_write_bytes_per_s = w / n;
            hw.ssd_read_bytes_per_s = r / n;
            // Reads and writes share the drives: a measured total below the two alone is the
            // array's limit when both run (above it, nothing limits them together).
            hw.ssd_duplex_bytes_per_s = a.both_bytes_per_s.filter(|&b| b < w + r).map(|b| b / n);
        }
        _ => default.extend(["ssd_read_bytes_per_s", "ssd_write_bytes_per_s"]),
    }
    let copy = report.host_copy.bytes_per_s;
    match copy {
        // A copy of N bytes reads N and writes N: the memory moves twice the copy rate, which
        // the model's host bandwidth (reads and writes together) counts.
        Some(c) => hw.host_memory_bytes_per_s = 2.0 * c,
        None => default.push("host_memory_bytes_per_s"),
    }
    let g = &report.gpu;
    match g.kind {
        GpuKind::None => {
            // The "GPU" is host memory: moving a tensor to or from the host tier is a copy, and
            // the array reads and writes the trainer's memory directly.
            match copy {
                Some(c) => (hw.pcie_h2d_bytes_per_s, hw.pcie_d2h_bytes_per_s) = (c, c),
                None => default.extend(["pcie_h2d_bytes_per_s", "pcie_d2h_bytes_per_s"]),
            }
            hw.pcie_duplex_bytes_per_s = None;
            hw.gpudirect = true;
        }
        GpuKind::Emulated | GpuKind::Cuda => {
            match (g.h2d_bytes_per_s, g.d2h_bytes_per_s) {
                (Some(up), Some(down)) => {
                    hw.pcie_h2d_bytes_per_s = up;
                    hw.pcie_d2h_bytes_per_s = down;
                    hw.pcie_duplex_bytes_per_s = g.both_bytes_per_s.filter(|&b| b < up + down);
                }
                _ => default.extend(["pcie_h2d_bytes_per_s", "pcie_d2h_bytes_per_s"]),
            }
            // SSD transfers skip host memory only where cuFile runs peer to peer.
            hw.gpudirect = engine.gpu_path().is_ok_and(|p| {
                p.path == "gds" && p.direct_mode == Some(crate::tier::DirectMode::P2p)
            });
        }
    }
    match report.cpu_adam.params_per_s {
        Some(r) => hw.cpu_adam_params_per_s = r,
        None => default.push("cpu_adam_params_per_s"),
    }
    default.extend(["ssd_latency_us", "ssd_endurance_tbw"]);
    report.from_default = default.into_iter().map(str::to_owned).collect();
    debug_assert!(hw.validate().is_ok(), "a measured model is valid: {hw:?}");
    (hw, report)
}

/// How the array part is sized: `count` tensors of `tensor_bytes`, `window` in flight.
struct ArrayPlan {
    tensor_bytes: u64,
    count: u64,
    window: usize,
}

/// The array's part of the measurement, within the array's free space.
fn plan_array(engine: &Engine, options: &ProbeOptions) -> std::result::Result<ArrayPlan, String> {
    if options.array_bytes == 0 {
        return Err("not measured (array_bytes is 0)".into());
    }
    let free = engine.store().space().total.free_bytes;
    // Two sets are on the array at once (read one while writing the other), within half of
    // what is free.
    let bytes = options.array_bytes.min(free / 4);
    if bytes < ARRAY_BYTES_MIN {
        return Err(format!(
            "not measured: {} MB free on the array, too little to measure (the probe needs {} MB; \
             a larger array, or `teraio hw measure` on it)",
            free / 1_000_000,
            4 * ARRAY_BYTES_MIN / 1_000_000
        ));
    }
    let tensor_bytes = ((bytes / 16).clamp(64 << 10, 32 << 20) >> 16) << 16;
    let count = (bytes / tensor_bytes).max(4);
    let in_use =
        (0..2 * count).map(|i| PROBE_ID_BASE + i).find(|&id| engine.store().info(id).is_some());
    if let Some(id) = in_use {
        return Err(format!("not measured: tensor id {id}, one the probe uses, holds a tensor"));
    }
    Ok(ArrayPlan { tensor_bytes, count, window: 2 * engine.config().workers.max(1) })
}

/// Write, read, then write and read at once, through the store from host buffers.
fn measure_array(engine: &Engine, options: &ProbeOptions, notes: &mut Vec<String>) -> ArrayRates {
    let mut rates = ArrayRates {
        what: engine.describe(),
        devices: engine.array().device_count(),
        bytes: 0,
        tensor_bytes: 0,
        write_bytes_per_s: None,
        read_bytes_per_s: None,
        both_bytes_per_s: None,
    };
    let plan = match plan_array(engine, options) {
        Ok(p) => p,
        Err(why) => {
            notes.push(format!("array: {why}; its figures are the `dev` preset's"));
            return rates;
        }
    };
    rates.tensor_bytes = plan.tensor_bytes;
    let result = array_phases(engine, &plan, options.phase_time_max, &mut rates);
    // Whatever happened, the probe's tensors go.
    for i in 0..2 * plan.count {
        let id = PROBE_ID_BASE + i;
        if engine.store().info(id).is_some()
            && let Ok(h) = engine.store().free(id)
        {
            let _ = h.wait();
        }
    }
    if let Err(e) = result {
        notes.push(format!(
            "array: the measurement failed ({e}); its figures are the `dev` preset's"
        ));
        rates.write_bytes_per_s = None;
        rates.read_bytes_per_s = None;
        rates.both_bytes_per_s = None;
    }
    if plan.count * plan.tensor_bytes > rates.bytes && rates.bytes > 0 {
        notes.push(format!(
            "array: measured with {} MB each way (a phase stops after {:.1} s)",
            rates.bytes / 1_000_000,
            options.phase_time_max.as_secs_f64()
        ));
    }
    rates
}

/// Host buffers of `bytes`, filled with a pattern (outside the timed phases).
fn filled(engine: &Engine, n: u64, bytes: u64) -> Result<Vec<TensorMem>> {
    (0..n)
        .map(|i| {
            let mut m = engine.alloc_host(bytes)?;
            if let Some(h) = m.host_mut() {
                h.fill(i as u8 ^ 0x5a);
            }
            Ok(m)
        })
        .collect()
}

/// A probe operation in flight: an offload or a prefetch.
enum Op {
    Write(Handle<crate::store::OffloadOutcome>),
    Read(Handle<TensorMem>),
}

impl Op {
    /// Wait for it; a prefetch's memory comes back.
    fn wait(self) -> Result<Option<TensorMem>> {
        match self {
            Op::Write(h) => h.wait().map(|_| None),
            Op::Read(h) => h.wait().map(Some),
        }
    }
}

/// Issue `issue(i)` for i in 0..n with at most `window` in flight, the first `min(n, window)`
/// always and the others until `deadline`, and wait for each in order. Returns what the
/// operations returned, in order.
fn pump(
    n: u64,
    window: usize,
    deadline: Instant,
    mut issue: impl FnMut(u64) -> Result<Op>,
) -> Result<Vec<Option<TensorMem>>> {
    let mut in_flight = VecDeque::with_capacity(window);
    let mut done = Vec::new();
    let mut next = 0;
    loop {
        while next < n
            && in_flight.len() < window.max(1)
            && (next < window as u64 || Instant::now() < deadline)
        {
            match issue(next) {
                Ok(op) => in_flight.push_back(op),
                Err(e) => {
                    // What is in flight finishes before its memory goes.
                    in_flight.into_iter().for_each(|op: Op| drop(op.wait()));
                    return Err(e);
                }
            }
            next += 1;
        }
        match in_flight.pop_front() {
            Some(op) => match op.wait() {
                Ok(m) => done.push(m),
                Err(e) => {
                    in_flight.into_iter().for_each(|op| drop(op.wait()));
                    return Err(e);
                }
            },
            None => return Ok(done),
        }
    }
}

/// Host buffers for `n` prefetches, taken before the clock starts.
fn buffers(engine: &Engine, n: u64, bytes: u64) -> Result<Vec<Option<TensorMem>>> {
    (0..n).map(|_| engine.alloc_host(bytes).map(Some)).collect()
}

fn array_phases(
    engine: &Engine,
    plan: &ArrayPlan,
    phase: Duration,
    rates: &mut ArrayRates,
) -> Result<()> {
    let store = engine.store();
    let (tb, first, second) = (plan.tensor_bytes, PROBE_ID_BASE, PROBE_ID_BASE + plan.count);
    let offload = |id, m| store.offload(id, m, OffloadOptions::default()).map(Op::Write);
    let prefetch = |id, m| store.prefetch(id, m, Priority::Normal).map(Op::Read);
    // Writing alone.
    let mut src: Vec<Option<TensorMem>> =
        filled(engine, plan.count, tb)?.into_iter().map(Some).collect();
    let start = Instant::now();
    let n = pump(plan.count, plan.window, start + phase, |i| {
        offload(first + i, src[i as usize].take().expect("each once"))
    })?
    .len() as u64;
    rates.write_bytes_per_s = Some((n * tb) as f64 / start.elapsed().as_secs_f64());
    rates.bytes = n * tb;
    drop(src);
    // Reading alone.
    let mut dst = buffers(engine, n, tb)?;
    let start = Instant::now();
    let read = pump(n, plan.window, start + phase, |i| {
        prefetch(first + i, dst[i as usize].take().expect("each once"))
    })?;
    let r = read.len() as u64;
    rates.read_bytes_per_s = Some((r * tb) as f64 / start.elapsed().as_secs_f64());
    drop(dst);
    // A volatile store that keeps no copy after a prefetch forgot what it handed back: write it
    // again (untimed), so the next phase has a set to read.
    let keeps = engine.config().retain_on_prefetch || engine.config().persistent;
    for (i, m) in read.into_iter().enumerate() {
        if let Some(m) = m
            && !keeps
        {
            store.offload(first + i as u64, m, OffloadOptions::default())?.wait()?;
        }
    }
    // Both at once: read the first set while writing a second one, issued interleaved.
    let mut src: Vec<Option<TensorMem>> = filled(engine, r, tb)?.into_iter().map(Some).collect();
    let mut dst = buffers(engine, r, tb)?;
    let start = Instant::now();
    let both = pump(2 * r, plan.window, start + phase, |j| {
        let i = (j / 2) as usize;
        if j % 2 == 0 {
            offload(second + j / 2, src[i].take().expect("each once"))
        } else {
            prefetch(first + j / 2, dst[i].take().expect("each once"))
        }
    })?
    .len() as u64;
    rates.both_bytes_per_s = Some((both * tb) as f64 / start.elapsed().as_secs_f64());
    Ok(())
}

/// Bytes per second of copying `bytes` between two host buffers on `threads` threads (each a
/// share): the best of at most 16 rounds that fit in `phase` (at least 3), after one untimed
/// round (the first touch of fresh pages is not the memory's rate).
fn host_copy_rate(bytes: u64, threads: usize, phase: Duration) -> Result<f64> {
    let len = usize::try_from(bytes)
        .ok()
        .filter(|&l| l >= 4096)
        .ok_or_else(|| Error::InvalidArgument(format!("copy_bytes {bytes} is below 4096")))?;
    let src = vec![0x5au8; len];
    let mut dst = vec![0u8; len];
    let chunk = len.div_ceil(threads.max(1));
    let best = best_round(16, phase, || {
        let start = Instant::now();
        std::thread::scope(|s| {
            for (d, from) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(from));
            }
        });
        Ok(start.elapsed())
    })?;
    Ok(bytes as f64 / best.as_secs_f64().max(1e-9))
}

/// The shortest of `round`'s times: one untimed round first, then at least 3 and at most
/// `rounds`, stopping after `phase` once 3 ran.
fn best_round(
    rounds: usize,
    phase: Duration,
    mut round: impl FnMut() -> Result<Duration>,
) -> Result<Duration> {
    round()?;
    let started = Instant::now();
    let mut best = Duration::MAX;
    for i in 0..rounds {
        best = best.min(round()?);
        if i >= 2 && started.elapsed() >= phase {
            break;
        }
    }
    Ok(best)
}

/// Parameters a second of teraio's host AdamW over `params` parameters (four buffers of that
/// many f32: parameter, gradient, two states), on its default threads: the best of up to 8
/// steps after one untimed, within `phase` ([`best_round`]).
fn cpu_adam_rate(params: u64, phase: Duration) -> Result<f64> {
    let n = usize::try_from(params)
        .ok()
        .filter(|&n| n >= 1024)
        .ok_or_else(|| Error::InvalidArgument(format!("{params} parameters is below 1024")))?;
    let mut param = vec![0.5f32; n];
    let grad = vec![0.01f32; n];
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    let adam = crate::optim::AdamW::default();
    let mut k = 0;
    let best = best_round(8, phase, || {
        k += 1;
        let start = Instant::now();
        adam.step(k, &mut param, &grad, &mut m, &mut v, None)?;
        Ok(start.elapsed())
    })?;
    Ok(params as f64 / best.as_secs_f64().max(1e-9))
}

/// The GPU's part: pinned copies on the engine's copy queues; on a CPU-only engine, what stands
/// in for it.
fn measure_gpu(
    engine: &Engine,
    options: &ProbeOptions,
    host_copy: &HostCopyRates,
    notes: &mut Vec<String>,
) -> GpuRates {
    let Some(what) = engine.gpu_description() else {
        notes.push(
            "GPU: none in the engine, so the trainer's memory is host memory: its copy rates are \
             the host copy rate, and the array reads and writes it directly"
                .into(),
        );
        return GpuRates {
            kind: GpuKind::None,
            what: "host memory (no GPU)".into(),
            bytes: host_copy.bytes,
            h2d_bytes_per_s: host_copy.bytes_per_s,
            d2h_bytes_per_s: host_copy.bytes_per_s,
            both_bytes_per_s: None,
        };
    };
    let kind = if engine.gpu_identity().is_some_and(|i| i.starts_with("emulated:")) {
        notes.push("GPU: emulated by host memory (the engine's `[gpu] emulated`): its copy rates are host copies".into());
        GpuKind::Emulated
    } else {
        GpuKind::Cuda
    };
    let mut g = GpuRates {
        kind,
        what: what.to_string(),
        bytes: options.copy_bytes,
        h2d_bytes_per_s: None,
        d2h_bytes_per_s: None,
        both_bytes_per_s: None,
    };
    match measure_pcie(engine, options.copy_bytes, 8) {
        Ok(p) => {
            g.h2d_bytes_per_s = Some(p.h2d);
            g.d2h_bytes_per_s = Some(p.d2h);
            g.both_bytes_per_s = Some(p.both);
        }
        Err(e) => notes.push(format!(
            "GPU copies: not measured ({e}); the model keeps the `dev` preset's PCIe rates"
        )),
    }
    g
}

/// Pinned host <-> GPU copy rates, bytes/s: each way alone, and in total both ways at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PcieRates {
    /// Host to device.
    pub h2d: f64,
    /// Device to host.
    pub d2h: f64,
    /// Both at once, in total.
    pub both: f64,
}

/// Pinned host <-> GPU copy bandwidth of `copies` copies of `bytes` each way (host-to-device
/// alone, device-to-host alone, and both at once in total), on the engine's copy queues for each
/// direction (as prefetches and offloads go). `InvalidArgument` without a GPU.
pub fn measure_pcie(engine: &Engine, bytes: u64, copies: usize) -> Result<PcieRates> {
    let rt = engine.gpu_device().ok_or_else(|| {
        Error::InvalidArgument("measuring GPU copies needs an engine with a GPU".into())
    })?;
    let len = usize::try_from(bytes)
        .map_err(|_| Error::InvalidArgument(format!("{bytes} bytes do not fit in memory")))?;
    // Two buffers each side: one pair per direction, so both directions can run at once.
    let dev = [engine.alloc_gpu(bytes)?, engine.alloc_gpu(bytes)?];
    let mut host = [engine.alloc_host(bytes)?, engine.alloc_host(bytes)?];
    let mut ptrs = Vec::with_capacity(2);
    for h in &mut host {
        let h = h.host_mut().expect("engine buffers are host memory");
        h.fill(1);
        ptrs.push(h.as_mut_ptr());
    }
    let mut pinned = Vec::with_capacity(2);
    let mut r = Ok(());
    for &p in &ptrs {
        // SAFETY: `host` stays alive (and mapped) until after unpin below.
        r = unsafe { rt.pin_host(p, len) };
        if r.is_err() {
            break;
        }
        pinned.push(p);
    }
    let d = [0, 1].map(|i| dev[i].device().expect("GPU memory").device_ptr());
    // `copies` copies host -> GPU and/or GPU -> host, each direction on the engine's queues for
    // it, timed together; returns the bytes per second of all of them.
    let time = |h2d: bool, d2h: bool| -> Result<f64> {
        let (mut up, mut down) =
            (rt.copy_queue_toward(CopyWay::ToDevice)?, rt.copy_queue_toward(CopyWay::ToHost)?);
        let start = Instant::now();
        let mut queue = || -> Result<()> {
            for _ in 0..copies {
                // SAFETY: every range is a live allocation of `len` bytes; pair 0 goes one way
                // and pair 1 the other, and nobody else uses them until the copies finished
                // (waited for below, on success and on failure).
                unsafe {
                    if h2d {
                        up.host_to_device(ptrs[0], d[0], len)?;
                    }
                    if d2h {
                        down.device_to_host(d[1], ptrs[1], len)?;
                    }
                }
            }
            up.fence()?.wait()?;
            down.fence()?.wait()
        };
        if let Err(e) = queue() {
            // What was queued finishes before the buffers are unpinned and freed.
            let _ = (up.drain(), down.drain());
            return Err(e);
        }
        let n = copies * (usize::from(h2d) + usize::from(d2h));
        Ok(n as f64 * bytes as f64 / start.elapsed().as_secs_f64())
    };
    // One untimed round first (the first copies into fresh memory pay its page faults: on the
    // emulated GPU that made host -> GPU look 5x slower than the way back), then the best of
    // two rounds of each (a copy slowed by another process is not the link's rate).
    let best = |h2d: bool, d2h: bool| -> Result<f64> { Ok(time(h2d, d2h)?.max(time(h2d, d2h)?)) };
    let measured = r.and_then(|()| {
        time(true, true)?;
        Ok(PcieRates { h2d: best(true, false)?, d2h: best(false, true)?, both: best(true, true)? })
    });
    // Every buffer is unpinned, whatever fails; the first error is the one reported.
    let mut unpinned = Ok(());
    for p in pinned {
        // SAFETY: pinned above; no copy uses it any more (`time` waits for every copy it
        // queued, on failure too).
        let r = unsafe { rt.unpin_host(p) };
        if unpinned.is_ok() {
            unpinned = r;
        }
    }
    let pcie = measured?;
    unpinned?;
    Ok(pcie)
}

#[cfg(test)]
mod tests;
