//! Measurements kept per machine and array, so that a later session reads one in a moment.
//!
//! One JSON file per machine and array in the cache folder ([`cache_dir`]:
//! `$TERAIO_CACHE_DIR`, else `$XDG_CACHE_HOME/teraio`, else `~/.cache/teraio`), named
//! `hardware-<hash of the key>.json`. The file is a hardware model as `teraio simulate --hw`
//! and `Session(hardware=PATH)` read it (the scheduler's `Hardware` fields), with one more
//! object, `teraio_probe`, that readers of a model ignore:
//!
//! ```json
//! { "gpu_memory_bytes": ..., "ssd_count": 4, "ssd_read_bytes_per_s": ..., ...,
//!   "teraio_probe": { "format": 2, "key": { "hostname": ..., "cpu_model": ..., "gpu": ...,
//!     "backend": "uring", "devices": 4, "array": ["/mnt/nvme0/teraio/dev0", ...] },
//!     "measured_unix_s": ..., "report": { ... } } }
//! ```
//!
//! The key is the machine (hostname, CPU model, the GPU's name and UUID if the engine has one)
//! and the array (its backend, and its devices' canonical paths, in order). A file that does not
//! parse, was written by another format, or holds another key (copied from another machine, a
//! hash collision) is ignored with a notice ([`crate::notice`]) and measured again; files are
//! replaced atomically (a temporary file in the same folder, synced, then renamed), so a reader
//! never sees half of one.

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use teraio_scheduler::Hardware;

use super::{Measurement, ProbeOptions, ProbeReport, Source, engine_fields, measure};
use crate::{Engine, Error, Result};

/// Version of the `teraio_probe` section; a file of another is measured again. 2 (2026-12-07):
/// the host's AdamW is measured (`cpu_adam_params_per_s`), so models of format 1 hold the
/// default CPU figure.
pub const FORMAT: u32 = 2;

/// The environment variable naming the cache folder (first choice).
pub const CACHE_DIR_ENV: &str = "TERAIO_CACHE_DIR";

/// What a cached measurement is for: the machine and the array.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeKey {
    /// The machine's hostname.
    pub hostname: String,
    /// The CPU model (`/proc/cpuinfo`).
    pub cpu_model: String,
    /// The engine's GPU: name and UUID ("NVIDIA H200 GPU-1a2b..."), "emulated:N"; None
    /// without one.
    pub gpu: Option<String>,
    /// The I/O backend ("uring", "psync", "spdk").
    pub backend: String,
    /// The array's devices.
    pub devices: u32,
    /// The devices' canonical paths, in array order.
    pub array: Vec<String>,
}

impl ProbeKey {
    /// The key of `engine`'s machine and array; `None` for an array of simulated disks (they
    /// have no path, and nothing measured on them is this machine's).
    pub fn of(engine: &Engine) -> Option<ProbeKey> {
        let paths = engine.array().device_paths()?;
        Some(ProbeKey {
            hostname: hostname(),
            cpu_model: cpu_model(),
            gpu: engine.gpu_identity(),
            backend: engine.array().backend_name().to_string(),
            devices: engine.array().device_count(),
            array: paths
                .iter()
                .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()))
                .map(|p| p.to_string_lossy().into_owned())
                .collect(),
        })
    }

    /// The cache file's name: `hardware-<16 hex digits>.json`, a hash of the whole key.
    pub fn file_name(&self) -> String {
        let text = serde_json::to_string(self).expect("a key serializes");
        // FNV-1a, 64 bits: stable across builds and platforms (std's hasher is not).
        let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        format!("hardware-{hash:016x}.json")
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown".into())
}

fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    // x86: "model name"; Arm: "Model" or the "CPU implementer"/"CPU part" pair.
    let field = |name: &str| {
        info.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim().to_string())
        })
    };
    field("model name")
        .or_else(|| field("Model"))
        .or_else(|| Some(format!("{} {}", field("CPU implementer")?, field("CPU part")?)))
        .unwrap_or_else(|| "unknown".into())
}

/// The cache folder: `$TERAIO_CACHE_DIR`, else `$XDG_CACHE_HOME/teraio`, else
/// `$HOME/.cache/teraio`; `None` when none of them is set.
pub fn cache_dir() -> Option<PathBuf> {
    cache_dir_from(|k| std::env::var_os(k))
}

/// [`cache_dir`] with the environment given (tests).
pub fn cache_dir_from(env: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |k: &str| env(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = set(CACHE_DIR_ENV) {
        return Some(d);
    }
    // (the XDG specification: a relative path is invalid and ignored)
    if let Some(d) = set("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        return Some(d.join("teraio"));
    }
    set("HOME").map(|h| h.join(".cache").join("teraio"))
}

/// Whether to use the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// Read this machine and array's measurement when there is one; else measure and keep it.
    Use,
    /// Measure now and keep the result (replacing a cached one).
    Refresh,
    /// Measure now; neither read nor write the cache.
    Off,
}

/// The `teraio_probe` section of a cache file.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Section {
    format: u32,
    key: ProbeKey,
    measured_unix_s: u64,
    report: ProbeReport,
}

/// [`measure`] with the cache in [`cache_dir`] (see the module's documentation).
pub fn measure_cached(engine: &Engine, options: &ProbeOptions, mode: CacheMode) -> Measurement {
    measure_cached_in(engine, options, mode, cache_dir().as_deref())
}

/// [`measure_cached`] with the cache in `dir` (None: no cache folder; measured, not kept).
///
/// A cached measurement gets the engine's own fields again (the array's size, the host tier,
/// the GPU's memory: they are configuration, not measurements). A cache file that cannot be
/// used is ignored with a notice; one that cannot be written leaves a notice, and the
/// measurement is returned all the same.
pub fn measure_cached_in(
    engine: &Engine,
    options: &ProbeOptions,
    mode: CacheMode,
    dir: Option<&Path>,
) -> Measurement {
    let key = ProbeKey::of(engine);
    let path = match (&key, dir) {
        (Some(k), Some(d)) if mode != CacheMode::Off => Some(d.join(k.file_name())),
        _ => None,
    };
    if let (Some(path), Some(key), CacheMode::Use) = (&path, &key, mode) {
        match read(path, key) {
            Ok(Some((mut hardware, section))) => {
                engine_fields(engine, &mut hardware);
                return Measurement {
                    hardware,
                    report: section.report,
                    source: Source::Cache,
                    cache_path: Some(path.clone()),
                    key: Some(section.key),
                    measured_unix_s: section.measured_unix_s,
                };
            }
            Ok(None) => {}
            Err(why) => crate::notice::warning(format!(
                "ignoring the hardware cache file {}: {why}; measuring this machine again",
                path.display()
            )),
        }
    }
    let mut m = measure(engine, options);
    match (&path, &key) {
        (Some(path), Some(key)) => {
            match write(path, &m.hardware, key, &m.report, m.measured_unix_s) {
                Ok(()) => m.cache_path = Some(path.clone()),
                Err(e) => crate::notice::warning(format!(
                    "could not keep the hardware measurement in {}: {e}; the next session measures \
                 again (set {CACHE_DIR_ENV} to a writable folder)",
                    path.display()
                )),
            }
        }
        _ if mode == CacheMode::Off => {}
        (_, None) => {
            m.report.notes.push("not cached: simulated disks are not this machine's".into())
        }
        (None, _) => m.report.notes.push(format!(
            "not cached: no cache folder (set {CACHE_DIR_ENV}, XDG_CACHE_HOME or HOME)"
        )),
    }
    m
}

/// The cached model and its section at `path` for `key`; `Ok(None)` when there is no file;
/// `Err(why)` when there is one that cannot be used.
fn read(path: &Path, key: &ProbeKey) -> std::result::Result<Option<(Hardware, Section)>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        // (a cache folder that is a file: nothing to read; writing says why it cannot keep one)
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(format!("cannot read it ({e})")),
    };
    let mut v: Value = serde_json::from_str(&text).map_err(|e| format!("not JSON ({e})"))?;
    let section = v
        .as_object_mut()
        .and_then(|m| m.remove("teraio_probe"))
        .ok_or("not a measurement teraio wrote (no `teraio_probe` object)")?;
    let format = section.get("format").and_then(Value::as_u64);
    if format != Some(u64::from(FORMAT)) {
        return Err(format!(
            "written in another format ({}, this teraio reads {FORMAT})",
            format.map_or_else(|| "none".to_string(), |f| f.to_string())
        ));
    }
    let section: Section = serde_json::from_value(section)
        .map_err(|e| format!("its `teraio_probe` object is damaged ({e})"))?;
    if &section.key != key {
        return Err(format!(
            "it was measured for another machine or array ({}), not this one ({})",
            brief(&section.key),
            brief(key)
        ));
    }
    let hw: Hardware =
        serde_json::from_value(v).map_err(|e| format!("its hardware model is damaged ({e})"))?;
    hw.validate().map_err(|e| format!("its hardware model is invalid ({e})"))?;
    Ok(Some((hw, section)))
}

/// "host, 4 devices at /a/dev0, ..., GPU x".
fn brief(k: &ProbeKey) -> String {
    format!(
        "{}, {} {} device{} at {}{}",
        k.hostname,
        k.devices,
        k.backend,
        if k.devices == 1 { "" } else { "s" },
        k.array.join(", "),
        k.gpu.as_ref().map_or_else(String::new, |g| format!(", GPU {g}"))
    )
}

/// Write the cache file atomically: a temporary file in the same folder, synced, renamed over
/// `path` (the folder is created if missing).
fn write(
    path: &Path,
    hw: &Hardware,
    key: &ProbeKey,
    report: &ProbeReport,
    measured_unix_s: u64,
) -> Result<()> {
    let os = |context: String| move |source| Error::Os { context, source };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .map_err(os(format!("creating the cache folder {}", dir.display())))?;
    let mut v = serde_json::to_value(hw).expect("a hardware model serializes");
    let section =
        Section { format: FORMAT, key: key.clone(), measured_unix_s, report: report.clone() };
    v["teraio_probe"] = serde_json::to_value(section).expect("a section serializes");
    let text = serde_json::to_string_pretty(&v).expect("JSON serializes") + "\n";
    let name =
        path.file_name().map_or_else(|| "hardware".into(), |n| n.to_string_lossy().into_owned());
    // (unique per process and call: two writers never share a temporary file)
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{call}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(os(format!("writing {}", path.display()))(e));
    }
    Ok(())
}
