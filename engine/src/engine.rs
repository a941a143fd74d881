//! The engine entry point: one [`Engine`] opened from one [`EngineConfig`], used by every
//! front end (the CLI, the C ABI, the Python package) so none of them assembles arrays, stores
//! and tiers itself.
//!
//! An engine is the SSD array ([`DeviceArray`]), the tensor store on it ([`TensorStore`]), the
//! optional host-memory offload tier ([`HostTier`]) and a pool of aligned host buffers that
//! callers can fill and hand to the store without a copy ([`Engine::alloc_host`]).
//!
//! The configuration comes from code or from a small TOML or JSON file, so one array is
//! described once for every front end:
//!
//! ```toml
//! # teraio.toml
//! targets = ["/mnt/nvme0/teraio.dat", "/mnt/nvme1/teraio.dat"]
//! file_size = "64G"          # files are created or grown to this size (0: keep)
//! persistent = true          # reopen after a crash with every acknowledged tensor
//! host_tier = "32G"          # host memory as a second offload tier (0: none)
//!
//! [gpu]                      # optional: real GPU memory as a tier (feature `cuda`)
//! device = 0                 # CUDA ordinal
//! path = "auto"              # auto | gds | bounce (GPUDirect Storage or pinned bounce)
//! budget = "40G"             # GPU memory the tier may hold (0: 90% of what is free)
//! ```
//!
//! ```no_run
//! use teraio_engine::{Engine, EngineConfig};
//! use teraio_engine::store::OffloadOptions;
//! # fn main() -> teraio_engine::Result<()> {
//! let engine = Engine::open(EngineConfig::from_file("teraio.toml")?)?;
//! let mut buf = engine.alloc_host(10 << 20)?;
//! buf.host_mut().expect("host memory").fill(7);
//! engine.store().offload(1, buf, OffloadOptions::default())?.wait()?;
//! let back = engine.store().prefetch_sync(1, engine.alloc_host(10 << 20)?)?;
//! assert!(back.host().expect("host memory").iter().all(|&b| b == 7));
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::array::{ArrayConfig, BackendKind, DeviceArray, ExistingData, Target};
use crate::backend::spdk_config::{SpdkOptions, is_spdk_syntax};
use crate::executor::{AllocFor, Executor, ExecutorConfig, TensorAllocator};
use crate::pool::{BufferPool, PoolConfig};
use crate::store::{GpuIoConfig, GpuPath, GpuPathInfo, StoreConfig, StoreMeta, TensorStore};
use crate::tier::{GpuDevice, HostDeviceTier, HostTier, MemoryTier, TensorMem};
use crate::units::{ByteSize, parse_bytes};
use crate::{Error, Result};

/// How I/O is submitted, as named in a configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendName {
    /// io_uring (falls back to psync with a notice where io_uring is unavailable).
    #[default]
    Uring,
    /// pread/pwrite on a thread pool.
    Psync,
    /// SPDK (cargo feature `spdk`): bdevs over the targets, or SPDK's NVMe driver for `nvme:`
    /// targets (docs/SPDK.md).
    Spdk,
}

impl From<BackendName> for BackendKind {
    fn from(b: BackendName) -> Self {
        match b {
            BackendName::Uring => BackendKind::Uring,
            BackendName::Psync => BackendKind::Psync,
            BackendName::Spdk => BackendKind::Spdk,
        }
    }
}

/// What to do with targets that already hold data, as named in a configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Overwrite {
    /// Refuse a target holding a partition table, filesystem, RAID/LVM signature or a teraio
    /// array (a persistent engine accepts its own teraio array: that is how it reopens).
    #[default]
    Refuse,
    /// Accept a teraio array (reuse it), refuse everything else.
    Teraio,
    /// Overwrite whatever the targets hold (`--force`).
    Anything,
}

/// The GPU section of an [`EngineConfig`]: which GPU's memory becomes the engine's GPU tier
/// and how its tensors move to and from the array.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GpuConfig {
    /// CUDA ordinal of the GPU (absent: no GPU tier).
    pub device: Option<u32>,
    /// Data path: auto (GPUDirect Storage where it runs peer to peer, else the pinned bounce),
    /// gds (cuFile, also in its compatibility mode) or bounce.
    pub path: GpuPath,
    /// GPU memory the tier may hold, bytes (0: 90% of what is free when the engine opens).
    #[serde(rename = "budget")]
    pub budget_bytes: ByteSize,
    /// Bounce path: bytes per pipelined chunk.
    #[serde(rename = "chunk")]
    pub chunk_bytes: ByteSize,
    /// Bounce path: chunks in flight per operation (at least 2).
    pub depth: usize,
    /// GDS path: threads per array device issuing cuFile reads and writes.
    pub gds_threads: usize,
    /// GDS path: largest single cuFile request.
    #[serde(rename = "gds_io")]
    pub gds_io_bytes: ByteSize,
    /// Host memory stands in for the GPU (the same data paths, no CUDA): tests and dry runs.
    pub emulated: bool,
}

impl Default for GpuConfig {
    /// No GPU; when one is named: auto path, 90% of free memory, the store's pipeline defaults.
    fn default() -> Self {
        let io = GpuIoConfig::default();
        Self {
            device: None,
            path: io.path,
            budget_bytes: ByteSize(0),
            chunk_bytes: ByteSize(io.chunk_bytes),
            depth: io.depth,
            gds_threads: io.gds_threads_per_device,
            gds_io_bytes: ByteSize(io.gds_io_bytes),
            emulated: false,
        }
    }
}

impl GpuConfig {
    /// The store's view of it.
    pub fn io(&self) -> GpuIoConfig {
        GpuIoConfig {
            path: self.path,
            chunk_bytes: self.chunk_bytes.0,
            depth: self.depth,
            gds_threads_per_device: self.gds_threads,
            gds_io_bytes: self.gds_io_bytes.0,
        }
    }
}

/// Everything needed to open an [`Engine`]. Every field has a default, so a file may name only
/// its targets; unknown keys are refused (a misspelt option is an error, not a silent default).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// The devices, in array order: files (created if missing) or raw block devices. Empty:
    /// `files` files named `dev0`, `dev1`, ... in `dir`.
    pub targets: Vec<PathBuf>,
    /// Folder of the default files when `targets` is empty (created if missing). No default:
    /// an engine opened without `targets` or `dir` is refused rather than filling the current
    /// folder (the `teraio` command line's default is `./teraio-data`).
    pub dir: PathBuf,
    /// Number of default files in `dir` when `targets` is empty.
    pub files: u32,
    /// Files are created or grown (never shrunk) to this size; 0 keeps their size. Raw block
    /// devices are used whole.
    #[serde(rename = "file_size")]
    pub file_size_bytes: ByteSize,
    /// I/O backend.
    pub backend: BackendName,
    /// Requests in flight per device.
    pub queue_depth: u32,
    /// I/O threads per device (io_uring: one ring each).
    pub io_threads: usize,
    /// Stripe unit: a tensor's bytes go round-robin over the devices in pieces of this size.
    #[serde(rename = "stripe_unit")]
    pub stripe_unit_bytes: ByteSize,
    /// Persistent mode: metadata journal and checkpoints on the array; reopening finds every
    /// acknowledged tensor, by id and name, also after a crash. Volatile (the default) starts
    /// empty each time and never writes metadata.
    pub persistent: bool,
    /// Keep a tensor's SSD copy after a prefetch, so an unmodified tensor can be dropped again
    /// without a write (what plan executors want; a persistent engine always keeps copies).
    pub retain_on_prefetch: bool,
    /// Host memory usable as a second offload tier, bytes (0: SSD only).
    #[serde(rename = "host_tier")]
    pub host_tier_bytes: ByteSize,
    /// Upper bound of the engine's own aligned host buffers handed to callers
    /// ([`Engine::alloc_host`]); mapped lazily, so a large bound costs nothing until used.
    #[serde(rename = "host_buffers")]
    pub host_buffers_bytes: ByteSize,
    /// crc32c per stripe unit on every write, verified on every read (off only for
    /// benchmarks that want raw bandwidth).
    pub checksums: bool,
    /// Worker threads of the migration engine.
    pub workers: usize,
    /// Bytes that may be in flight (being written or read) at once.
    #[serde(rename = "inflight_max")]
    pub inflight_bytes_max: ByteSize,
    /// Allocation unit of the extent allocator (a power of two, at least 4 KiB).
    #[serde(rename = "alloc_unit")]
    pub alloc_unit_bytes: ByteSize,
    /// Targets that already hold data.
    pub overwrite: Overwrite,
    /// GPU memory as a tier (section `[gpu]`; none by default).
    pub gpu: GpuConfig,
    /// Options of the `spdk` backend (section `[spdk]`).
    pub spdk: SpdkOptions,
    /// Simulated disks instead of `targets` (tests and examples; not expressible in a file).
    #[serde(skip)]
    pub sim_disks: Vec<Arc<crate::backend::sim::SimDisk>>,
}

impl Default for EngineConfig {
    /// No location (name `dir` or `targets`; opening refuses a configuration without one), 4
    /// files of 1 GiB when `dir` is named, io_uring, queue depth 32, 1 MiB stripe unit,
    /// volatile, checksums on, no host tier, 4 workers, 1 GiB in flight.
    fn default() -> Self {
        Self {
            targets: Vec::new(),
            dir: PathBuf::new(),
            files: 4,
            file_size_bytes: ByteSize(1 << 30),
            backend: BackendName::Uring,
            queue_depth: 32,
            io_threads: 1,
            stripe_unit_bytes: ByteSize(teraio_layout::geometry::DEFAULT_STRIPE_UNIT_BYTES),
            persistent: false,
            retain_on_prefetch: false,
            host_tier_bytes: ByteSize(0),
            host_buffers_bytes: ByteSize(8 << 30),
            checksums: true,
            workers: 4,
            inflight_bytes_max: ByteSize(1 << 30),
            alloc_unit_bytes: ByteSize(1 << 20),
            overwrite: Overwrite::Refuse,
            gpu: GpuConfig::default(),
            spdk: SpdkOptions::default(),
            sim_disks: Vec::new(),
        }
    }
}

impl EngineConfig {
    /// A configuration over these targets, everything else default.
    pub fn with_targets(targets: Vec<PathBuf>) -> Self {
        Self { targets, ..Self::default() }
    }

    /// A configuration over simulated in-memory disks (tests, examples).
    pub fn with_sim_disks(disks: Vec<Arc<crate::backend::sim::SimDisk>>) -> Self {
        Self { sim_disks: disks, ..Self::default() }
    }

    /// Parse a TOML configuration. A syntax error names its line and column (the user wrote the
    /// text); a bad value names its key, the value and the expected form.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let table: toml::Table = toml::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("engine configuration (TOML): {e}")))?;
        let value = serde_json::to_value(table).map_err(|e| {
            Error::InvalidArgument(format!(
                "engine configuration (TOML): {e} (dates are not values of any key)"
            ))
        })?;
        Self::from_value(value)
    }

    /// Parse a JSON configuration (see [`from_toml_str`](Self::from_toml_str)).
    pub fn from_json_str(text: &str) -> Result<Self> {
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::InvalidArgument(format!("engine configuration (JSON): {e}")))?;
        Self::from_value(value)
    }

    /// A configuration from a JSON value (an object whose keys are those of the file): what the
    /// TOML and JSON readers and the bindings' keyword options come to. A bad value is an error
    /// naming the key (`[gpu] budget` in a section), the value and the expected form, never a
    /// position in text the caller did not write.
    pub fn from_value(value: serde_json::Value) -> Result<Self> {
        let serde_json::Value::Object(map) = value else {
            return Err(Error::InvalidArgument(format!(
                "engine configuration: expected a table of keys (targets, dir, files, \
                 file_size, ...; docs/ENGINE.md), got {}",
                short_json(&value)
            )));
        };
        check_keys::<Self>(&map, "")?;
        let cfg: Self = serde_json::from_value(serde_json::Value::Object(map))
            .map_err(|e| Error::InvalidArgument(format!("engine configuration: {e}")))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read a configuration file: JSON when its name ends in `.json`, TOML otherwise. Relative
    /// paths in the file (targets, dir) are taken relative to the file's folder.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::Os {
            context: format!("reading the engine configuration {}", path.display()),
            source: e,
        })?;
        let is_json = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("json"));
        let mut cfg = if is_json { Self::from_json_str(&text) } else { Self::from_toml_str(&text) }
            .map_err(|e| match e {
                Error::InvalidArgument(m) => {
                    Error::InvalidArgument(format!("{}: {m}", path.display()))
                }
                e => e,
            })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let rebase = |p: &mut PathBuf| {
            if is_spdk_syntax(p) {
                // `uring:PATH` / `aio:PATH`: the path part is relative to the file too.
                let s = p.to_string_lossy().into_owned();
                if let Some((prefix, rest)) = s.split_once(':')
                    && prefix != "nvme"
                    && Path::new(rest).is_relative()
                {
                    *p = PathBuf::from(format!("{prefix}:{}", base.join(rest).display()));
                }
            } else if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        cfg.targets.iter_mut().for_each(rebase);
        if !cfg.dir.as_os_str().is_empty() {
            rebase(&mut cfg.dir);
        }
        Ok(cfg)
    }

    /// The configuration as TOML (what `from_toml_str` reads back).
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("an engine configuration always serializes")
    }

    /// Check values that have a valid range. Called by every constructor and by
    /// [`Engine::open`].
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.targets.is_empty() && self.sim_disks.is_empty() && self.files == 0 {
            return bad("no targets: name `targets`, or `dir` and `files` >= 1".into());
        }
        if self.queue_depth == 0 || self.queue_depth > 4096 {
            return bad(format!("queue_depth {} is outside 1..=4096", self.queue_depth));
        }
        if self.workers == 0 || self.workers > 256 {
            return bad(format!("workers {} is outside 1..=256", self.workers));
        }
        if self.io_threads > 64 {
            return bad(format!("io_threads {} is above 64", self.io_threads));
        }
        let unit = self.alloc_unit_bytes.0;
        if unit < 4096 || !unit.is_power_of_two() {
            return bad(format!("alloc_unit {unit} is not a power of two >= 4096"));
        }
        let stripe = self.stripe_unit_bytes.0;
        if stripe < 4096 || !stripe.is_power_of_two() {
            return bad(format!("stripe_unit {stripe} is not a power of two >= 4096"));
        }
        if self.inflight_bytes_max.0 < 1 << 20 {
            return bad(format!("inflight_max {} is below 1 MiB", self.inflight_bytes_max.0));
        }
        if self.host_buffers_bytes.0 < 1 << 20 {
            return bad(format!("host_buffers {} is below 1 MiB", self.host_buffers_bytes.0));
        }
        self.gpu.io().validate().map_err(|e| match e {
            Error::InvalidArgument(m) => Error::InvalidArgument(format!("[gpu] {m}")),
            e => e,
        })?;
        Ok(())
    }

    /// The targets this configuration opens, in array order.
    pub fn resolved_targets(&self) -> Vec<Target> {
        if !self.sim_disks.is_empty() {
            return self.sim_disks.iter().cloned().map(Target::Sim).collect();
        }
        if !self.targets.is_empty() {
            return self.targets.iter().cloned().map(Target::Path).collect();
        }
        (0..self.files).map(|i| Target::Path(self.dir.join(format!("dev{i}")))).collect()
    }

    /// A short description of the targets: "4 files in ./teraio-data", "2 devices".
    pub fn describe_targets(&self) -> String {
        if !self.sim_disks.is_empty() {
            format!("{} simulated disks", self.sim_disks.len())
        } else if !self.targets.is_empty() {
            let files = self.targets.iter().filter(|t| !is_block_device(t)).count();
            match (files, self.targets.len() - files) {
                (n, 0) => format!("{n} file{}", if n == 1 { "" } else { "s" }),
                (0, n) => format!("{n} device{}", if n == 1 { "" } else { "s" }),
                (f, d) => format!("{f} files and {d} devices"),
            }
        } else {
            format!("{} files in {}", self.files, self.dir.display())
        }
    }

    /// Open only the device array (for raw-block tools such as `teraio bench` and `inspect`;
    /// [`Engine::open`] opens the array and everything above it). The default folder is
    /// created when the configuration names no targets.
    ///
    /// A failed open removes what it created (files, and the folders it made for them), never
    /// what existed before.
    pub fn open_array(&self) -> Result<Arc<DeviceArray>> {
        self.open_array_made().map(|(array, _)| array)
    }

    /// [`open_array`](Self::open_array), and the folders it made (for [`Engine::open`] to
    /// remove when a later step fails).
    fn open_array_made(&self) -> Result<(Arc<DeviceArray>, Vec<PathBuf>)> {
        self.validate()?;
        self.check_location()?;
        let made = if self.targets.is_empty() && self.sim_disks.is_empty() {
            create_dirs(&self.dir)?
        } else {
            Vec::new()
        };
        match self.open_array_in() {
            Ok(array) => Ok((array, made)),
            Err(e) => {
                remove_dirs(&made);
                Err(e)
            }
        }
    }

    /// An engine needs to be told where its array is: no files in the current folder by
    /// default.
    pub fn check_location(&self) -> Result<()> {
        if self.targets.is_empty() && self.sim_disks.is_empty() && self.dir.as_os_str().is_empty() {
            return Err(Error::InvalidArgument(format!(
                "the engine configuration names no array: set `dir` (a folder for `files` files \
                 of `file_size` each, e.g. dir = \"/mnt/nvme/teraio\", files = {}, file_size = \
                 \"{}\") or `targets` (files or raw block devices, one per SSD); nothing is \
                 created in the current folder by default",
                self.files,
                crate::units::display_size(self.file_size_bytes.0)
            )));
        }
        Ok(())
    }

    fn open_array_in(&self) -> Result<Arc<DeviceArray>> {
        let mut cfg = ArrayConfig::new(self.resolved_targets());
        // Raw block devices are used whole; files are sized as asked.
        cfg.file_size_bytes = self.file_size_bytes.0;
        cfg.backend = self.backend.into();
        cfg.queue_depth = self.queue_depth;
        cfg.io_threads = self.io_threads.max(1);
        cfg.spdk = self.spdk.clone();
        cfg.stripe_unit_bytes = self.stripe_unit_bytes.0;
        cfg.existing = match (self.overwrite, self.persistent) {
            (Overwrite::Anything, _) => ExistingData::AllowAnything,
            (Overwrite::Teraio, _) | (Overwrite::Refuse, true) => ExistingData::AllowTeraio,
            (Overwrite::Refuse, false) => ExistingData::Refuse,
        };
        // A persistent array's files keep their size (the store reopens what is on them); a
        // volatile array keeps nothing, so its files are resized to what is asked.
        cfg.keeps_contents = self.persistent && self.overwrite != Overwrite::Anything;
        DeviceArray::open(cfg)
    }
}

/// A JSON value as the user wrote it, cut short when long.
fn short_json(v: &serde_json::Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(77).collect::<String>())
    } else {
        s
    }
}

/// Deserialize every key of `map` alone into `T` (defaults elsewhere), so that the first bad
/// one is reported with its name and value; the sections `gpu` and `spdk` key by key too.
fn check_keys<T: serde::de::DeserializeOwned>(
    map: &serde_json::Map<String, serde_json::Value>,
    section: &str,
) -> Result<()> {
    for (key, value) in map {
        let mut one = serde_json::Map::new();
        one.insert(key.clone(), value.clone());
        let Err(e) = serde_json::from_value::<T>(serde_json::Value::Object(one)) else {
            continue;
        };
        if section.is_empty()
            && let serde_json::Value::Object(inner) = value
        {
            match key.as_str() {
                "gpu" => check_keys::<GpuConfig>(inner, "[gpu] ")?,
                "spdk" => check_keys::<SpdkOptions>(inner, "[spdk] ")?,
                _ => {}
            }
        }
        let e = e.to_string();
        let hint = if e.starts_with("unknown field") {
            " (a misspelt key? every key is in docs/ENGINE.md)"
        } else {
            ""
        };
        return Err(Error::InvalidArgument(format!(
            "engine configuration: {section}{key} = {}: {e}{hint}",
            short_json(value)
        )));
    }
    Ok(())
}

/// Create `dir` and its missing parents; the folders made, deepest last.
fn create_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut missing = Vec::new();
    let mut p = dir;
    while !p.as_os_str().is_empty() && !p.exists() {
        missing.push(p.to_path_buf());
        match p.parent() {
            Some(parent) => p = parent,
            None => break,
        }
    }
    missing.reverse();
    std::fs::create_dir_all(dir).map_err(|e| {
        remove_dirs(&missing);
        Error::Os { context: format!("creating the array folder {}", dir.display()), source: e }
    })?;
    Ok(missing)
}

/// Remove folders made by [`create_dirs`] (deepest first) where they are empty.
pub(crate) fn remove_dirs(made: &[PathBuf]) {
    for d in made.iter().rev() {
        let _ = std::fs::remove_dir(d);
    }
}

fn is_block_device(p: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(p).is_ok_and(|m| m.file_type().is_block_device())
}

/// The engine's GPU tier and its device.
struct GpuTier {
    tier: Arc<dyn MemoryTier>,
    device: Arc<dyn GpuDevice>,
    #[cfg(feature = "cuda")]
    cuda: Option<Arc<crate::cuda::CudaDevice>>,
    /// The host-memory emulation, when `emulated`.
    emulated: Option<Arc<HostDeviceTier>>,
    description: String,
}

impl GpuTier {
    fn open(cfg: &GpuConfig) -> Result<Option<GpuTier>> {
        let Some(ordinal) = cfg.device else { return Ok(None) };
        if cfg.emulated {
            let budget = match cfg.budget_bytes.0 {
                0 => 1 << 30,
                n => n,
            };
            let t = HostDeviceTier::new(ordinal, budget);
            return Ok(Some(GpuTier {
                device: t.gpu().clone(),
                description: format!("{} (host memory standing in for a GPU)", t.name()),
                emulated: Some(t.clone()),
                tier: t,
                #[cfg(feature = "cuda")]
                cuda: None,
            }));
        }
        #[cfg(feature = "cuda")]
        {
            let device = crate::cuda::CudaDevice::open(ordinal)?;
            let tier = crate::cuda::CudaTier::new(device.clone(), cfg.budget_bytes.0)?;
            Ok(Some(GpuTier {
                device: device.gpu(),
                description: device.describe(),
                tier,
                cuda: Some(device),
                emulated: None,
            }))
        }
        #[cfg(not(feature = "cuda"))]
        Err(Error::Unsupported(format!(
            "GPU {ordinal} was configured but this teraio was built without the `cuda` feature"
        )))
    }
}

/// The engine: array, tensor store, host tier and host buffers, opened from one configuration.
/// `Send + Sync`: share it behind an `Arc` between threads. Dropping it drains queued
/// operations and, when persistent, writes a checkpoint.
pub struct Engine {
    config: EngineConfig,
    // Field order is drop order: the store (workers, queues) goes before the tiers and pools
    // whose memory its operations may hold.
    store: Arc<TensorStore>,
    gpu: Option<GpuTier>,
    host_tier: Option<Arc<HostTier>>,
    buffers: Arc<BufferPool>,
    array: Arc<DeviceArray>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("array", &self.array)
            .field("persistent", &self.config.persistent)
            .field("host_tier_bytes", &self.config.host_tier_bytes.0)
            .finish()
    }
}

impl Engine {
    /// Open the array, the store on it (a persistent store reopens what is there), the host
    /// tier and the host buffer pool.
    ///
    /// A failed open removes what it created (the array's new files and the folders made for
    /// them), never what existed before.
    pub fn open(config: EngineConfig) -> Result<Engine> {
        let (array, made_dirs) = config.open_array_made()?;
        let created = array.created_files().to_vec();
        match Self::open_on(config, array) {
            Ok(engine) => Ok(engine),
            Err(e) => {
                // Everything holding the array's descriptors is gone with the error.
                for f in &created {
                    let _ = std::fs::remove_file(f);
                }
                remove_dirs(&made_dirs);
                Err(e)
            }
        }
    }

    fn open_on(config: EngineConfig, array: Arc<DeviceArray>) -> Result<Engine> {
        let gpu = GpuTier::open(&config.gpu)?;
        let host_tier = match config.host_tier_bytes.0 {
            0 => None,
            n => Some(HostTier::new("host", n)?),
        };
        // With a GPU, host-tier memory is page-locked as it is mapped: device tensors offloaded
        // there move by DMA, not through the driver's staging (7-8 GB/s on the H200).
        if let (Some(g), Some(h)) = (&gpu, &host_tier) {
            h.pool().pin_with(Arc::new(crate::tier::GpuPinner(g.device.clone())))?;
        }
        let mut scfg = StoreConfig::new(array.clone());
        scfg.host_tier = host_tier.clone().map(|t| t as Arc<dyn MemoryTier>);
        scfg.checksums = config.checksums;
        scfg.workers = config.workers;
        scfg.inflight_bytes_max = config.inflight_bytes_max.0;
        scfg.persistent = config.persistent;
        scfg.retain_on_prefetch = config.retain_on_prefetch;
        scfg.alloc_unit_bytes = config.alloc_unit_bytes.0;
        scfg.gpu = config.gpu.io();
        let store = Arc::new(TensorStore::open(scfg)?);
        let buffers = BufferPool::new(PoolConfig {
            capacity_bytes: config.host_buffers_bytes.0,
            ..PoolConfig::default()
        })?;
        Ok(Engine { config, store, gpu, host_tier, buffers, array })
    }

    /// Close the engine: wait for every queued operation, write the final checkpoint
    /// (persistent engines) and release everything. Unlike dropping it, this reports a failed
    /// final checkpoint (the journal still has every acknowledged change, so a reopen finds them
    /// all; the error says why the checkpoint failed). An executor still holding the store keeps
    /// it alive: its later operations are journaled, and checkpointed when it is dropped.
    pub fn close(self) -> Result<()> {
        self.store.drain();
        let checkpoint = if self.config.persistent { self.store.checkpoint() } else { Ok(()) };
        drop(self);
        checkpoint
    }

    /// Read `path` ([`EngineConfig::from_file`]) and open it.
    pub fn open_file(path: impl AsRef<Path>) -> Result<Engine> {
        Self::open(EngineConfig::from_file(path)?)
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The tensor store: offload, prefetch, free, wait, list.
    pub fn store(&self) -> &TensorStore {
        &self.store
    }

    /// The store, shared (executors and bindings keep it alive).
    pub fn store_arc(&self) -> &Arc<TensorStore> {
        &self.store
    }

    /// A plan executor over this engine's store (see [`crate::executor`]); prefetched tensors
    /// (and created ones, with `allocate_created`) land in memory from `alloc`.
    pub fn executor(
        &self,
        trace: teraio_scheduler::Trace,
        plan: teraio_scheduler::Plan,
        config: ExecutorConfig,
        alloc: Box<dyn TensorAllocator>,
    ) -> Result<Executor> {
        Executor::new(self.store.clone(), alloc, trace, plan, config)
    }

    /// A [`TensorAllocator`] over this engine's host buffers ([`alloc_host`](Self::alloc_host)):
    /// the executor's memory when the "GPU" is emulated in host memory or the trainer runs on
    /// the CPU.
    pub fn host_allocator(&self) -> Box<dyn TensorAllocator> {
        Box::new(HostBufferAllocator(self.buffers.clone()))
    }

    /// The SSD array under the store.
    pub fn array(&self) -> &Arc<DeviceArray> {
        &self.array
    }

    /// The host offload tier, when configured.
    pub fn host_tier(&self) -> Option<&Arc<HostTier>> {
        self.host_tier.as_ref()
    }

    /// The GPU tier, when the configuration names a GPU.
    pub fn gpu_tier(&self) -> Option<&Arc<dyn MemoryTier>> {
        self.gpu.as_ref().map(|g| &g.tier)
    }

    /// The GPU (its copy queues, fences, crc32c), when the configuration names one.
    pub fn gpu_device(&self) -> Option<&Arc<dyn GpuDevice>> {
        self.gpu.as_ref().map(|g| &g.device)
    }

    /// "cuda:0 (NVIDIA H200, sm_90)", when the configuration names a GPU.
    pub fn gpu_description(&self) -> Option<&str> {
        self.gpu.as_ref().map(|g| g.description.as_str())
    }

    /// What identifies the engine's GPU from one process to the next: its name and UUID on
    /// CUDA ("NVIDIA H200 GPU-1a2b..."), "emulated:N" on the host emulation; `None` without a
    /// GPU. (The hardware probe's cache is keyed by it.)
    pub fn gpu_identity(&self) -> Option<String> {
        let g = self.gpu.as_ref()?;
        if g.emulated.is_some() {
            return Some(format!("emulated:{}", g.device.ordinal()));
        }
        #[cfg(feature = "cuda")]
        if let Some(d) = &g.cuda {
            return Some(match d.uuid() {
                Some(u) => format!("{} {u}", d.model_name()),
                None => d.describe(),
            });
        }
        Some(g.description.clone())
    }

    /// Memory of the engine's GPU, bytes: the device's total on CUDA, the budget of the host
    /// emulation; `None` without a GPU (or where the driver does not say).
    pub fn gpu_memory_bytes(&self) -> Option<u64> {
        let g = self.gpu.as_ref()?;
        if g.emulated.is_some() {
            return Some(match self.config.gpu.budget_bytes.0 {
                0 => 1 << 30,
                n => n,
            });
        }
        #[cfg(feature = "cuda")]
        if let Some(d) = &g.cuda {
            return d.memory_info().ok().map(|(_, total)| total);
        }
        None
    }

    fn gpu_or_err(&self) -> Result<&GpuTier> {
        self.gpu.as_ref().ok_or_else(|| {
            Error::InvalidArgument(
                "the engine has no GPU: name one in the configuration ([gpu] device = 0)".into(),
            )
        })
    }

    /// GPU memory for a tensor of `bytes` bytes from the engine's GPU tier (`NoSpace` past its
    /// budget).
    pub fn alloc_gpu(&self, bytes: u64) -> Result<TensorMem> {
        self.gpu_or_err()?.tier.alloc(bytes)
    }

    /// GPU memory a trainer owns (`len` bytes at device address `ptr`, e.g. a PyTorch tensor's
    /// storage), checked to be device memory of the engine's GPU, aligned and in bounds.
    pub fn wrap_gpu(&self, ptr: u64, len: u64) -> Result<TensorMem> {
        let _g = self.gpu_or_err()?;
        #[cfg(feature = "cuda")]
        if let Some(d) = &_g.cuda {
            return crate::cuda::CudaMem::wrap_foreign(d, ptr, len);
        }
        Err(Error::Unsupported(format!(
            "wrapping device pointer {ptr:#x} ({len} bytes) needs a real CUDA GPU"
        )))
    }

    /// What a binding hands the store for a caller's device pointer: on a CUDA GPU,
    /// [`wrap_gpu`](Self::wrap_gpu) (checked); on the host-memory emulation, the caller's host
    /// memory as the emulated device's (so CPU tests run the device data paths end to end).
    ///
    /// # Safety
    /// On the emulation, `[ptr, ptr + len)` must be host memory valid for reads and writes and
    /// not used by anyone else while the engine may use it, until the returned memory is
    /// dropped. (On a GPU the pointer is checked, and the caller keeps the memory alive as
    /// for [`wrap_gpu`](Self::wrap_gpu).)
    pub unsafe fn wrap_caller_gpu(&self, ptr: u64, len: u64) -> Result<TensorMem> {
        match &self.gpu_or_err()?.emulated {
            // SAFETY: forwarded contract.
            Some(t) => unsafe { t.wrap_foreign(ptr, len) },
            None => self.wrap_gpu(ptr, len),
        }
    }

    /// The data path the GPU's tensors take to and from the array, and why (opens cuFile on
    /// first use).
    pub fn gpu_path(&self) -> Result<GpuPathInfo> {
        self.store.gpu_path(&self.gpu_or_err()?.device)
    }

    /// The pool behind [`alloc_host`](Self::alloc_host).
    pub fn host_buffers(&self) -> &Arc<BufferPool> {
        &self.buffers
    }

    /// An aligned host buffer of `bytes` bytes (contents undefined) that the store moves to and
    /// from the array without a copy. `NoSpace` when the engine's `host_buffers` bound is
    /// reached; never blocks.
    pub fn alloc_host(&self, bytes: u64) -> Result<TensorMem> {
        if bytes == 0 {
            return Err(Error::InvalidArgument("a host buffer of 0 bytes".into()));
        }
        let len = usize::try_from(bytes)
            .map_err(|_| Error::InvalidArgument(format!("{bytes} bytes do not fit in memory")))?;
        match self.buffers.alloc(len) {
            Ok(b) => Ok(TensorMem::Host(b)),
            Err(Error::NoSpace(why)) => Err(Error::NoSpace(format!(
                "engine host buffers ({why}); raise `host_buffers` in the engine configuration"
            ))),
            Err(e) => Err(e),
        }
    }

    /// "4 files in ./teraio-data (uring, volatile)".
    pub fn describe(&self) -> String {
        format!(
            "{} ({}, {})",
            self.config.describe_targets(),
            self.array.backend_name(),
            if self.config.persistent { "persistent" } else { "volatile" }
        )
    }

    /// Usable bytes of the array (all devices, data regions only, as the allocator sees them).
    pub fn capacity_bytes(&self) -> u64 {
        self.store.space().total.capacity_bytes
    }

    /// What a persistent array holds (superblocks, tensors, free space), read without writing
    /// a byte. The configuration's targets must be those of the array, in order.
    pub fn inspect(config: &EngineConfig) -> Result<StoreMeta> {
        let mut cfg = config.clone();
        cfg.overwrite = Overwrite::Teraio;
        cfg.file_size_bytes = ByteSize(0);
        cfg.backend = BackendName::Psync;
        let array = cfg.open_array()?;
        crate::store::Persistence::inspect(&array)
    }
}

/// Host buffers from the engine's pool, for an executor.
struct HostBufferAllocator(Arc<BufferPool>);

impl TensorAllocator for HostBufferAllocator {
    fn alloc(
        &mut self,
        t: teraio_scheduler::TensorId,
        bytes: u64,
        _why: AllocFor,
    ) -> Result<TensorMem> {
        let len = usize::try_from(bytes)
            .map_err(|_| Error::InvalidArgument(format!("{bytes} bytes do not fit in memory")))?;
        self.0.alloc(len).map(TensorMem::Host).map_err(|e| match e {
            Error::NoSpace(why) => Error::NoSpace(format!(
                "engine host buffers, for tensor {t} ({why}); raise `host_buffers` in the engine configuration"
            )),
            e => e,
        })
    }
}

/// Parse a byte size as in a configuration or on a command line: `4096`, `4k`, `1M`, `1GiB`
/// (powers of 1024).
pub fn parse_size(text: &str) -> Result<u64> {
    parse_bytes(text).map_err(Error::InvalidArgument)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::sim::SimDisk;
    use crate::store::{OffloadOptions, TensorKey};

    #[test]
    fn a_toml_file_names_only_what_differs_from_the_defaults() {
        let cfg = EngineConfig::from_toml_str(
            "targets = [\"/a\", \"/b\"]\nfile_size = \"2G\"\npersistent = true\nhost_tier = 1048576\n",
        )
        .unwrap();
        assert_eq!(cfg.targets, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(cfg.file_size_bytes.0, 2 << 30);
        assert!(cfg.persistent);
        assert_eq!(cfg.host_tier_bytes.0, 1 << 20);
        assert_eq!(cfg.queue_depth, 32);
        // What it writes, it reads back.
        let again = EngineConfig::from_toml_str(&cfg.to_toml()).unwrap();
        assert_eq!(again.to_toml(), cfg.to_toml());
    }

    #[test]
    fn json_and_toml_describe_the_same_engine() {
        let t =
            EngineConfig::from_toml_str("dir = \"/x\"\nfiles = 2\nbackend = \"psync\"\n").unwrap();
        let j = EngineConfig::from_json_str(r#"{"dir": "/x", "files": 2, "backend": "psync"}"#)
            .unwrap();
        assert_eq!(t.to_toml(), j.to_toml());
        assert_eq!(t.backend, BackendName::Psync);
    }

    #[test]
    fn misspelt_keys_and_bad_values_are_errors_that_name_them() {
        let e = EngineConfig::from_toml_str("target = [\"/a\"]\n").unwrap_err().to_string();
        assert!(e.contains("target"), "{e}");
        let e = EngineConfig::from_toml_str("queue_depth = 0\n").unwrap_err().to_string();
        assert!(e.contains("queue_depth"), "{e}");
        let e = EngineConfig::from_toml_str("stripe_unit = \"3k\"\n").unwrap_err().to_string();
        assert!(e.contains("stripe_unit"), "{e}");
        let e = EngineConfig::from_toml_str("file_size = \"lots\"\n").unwrap_err().to_string();
        assert!(e.contains("lots"), "{e}");
        let e = EngineConfig::from_json_str("{\"files\": 0}").unwrap_err().to_string();
        assert!(e.contains("no targets"), "{e}");
        let e = EngineConfig::from_json_str("{").unwrap_err().to_string();
        assert!(e.contains("JSON"), "{e}");
    }

    #[test]
    fn configuration_errors_name_the_key_the_value_and_the_form() {
        // Decimal sizes are sizes, in every form.
        let t =
            EngineConfig::from_toml_str("host_tier = \"1.5G\"\nfile_size = \"0.5M\"\n").unwrap();
        assert_eq!((t.host_tier_bytes.0, t.file_size_bytes.0), (3 << 29, 512 << 10));
        let j = EngineConfig::from_json_str(r#"{"host_tier": "1.5G", "file_size": 4096}"#).unwrap();
        assert_eq!((j.host_tier_bytes.0, j.file_size_bytes.0), (3 << 29, 4096));
        // A long JSON object of keyword options (as the bindings merge them): the key, the
        // value and the form, no position in text the user never wrote.
        let mut over = serde_json::to_value(EngineConfig::default()).unwrap();
        over["host_tier"] = "1.5x".into();
        let e = EngineConfig::from_value(over).unwrap_err().to_string();
        assert!(e.contains("host_tier") && e.contains("\"1.5x\"") && e.contains("1.5G"), "{e}");
        assert!(!e.contains("line") && !e.contains("column"), "{e}");
        let e = EngineConfig::from_json_str(r#"{"dir": "/x", "file_size": -1}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("file_size = -1") && e.contains("positive"), "{e}");
        assert!(!e.contains("untagged") && !e.contains("Raw"), "{e}");
        let e = EngineConfig::from_toml_str("[gpu]\nbudget = \"lots\"\n").unwrap_err().to_string();
        assert!(e.contains("[gpu] budget = \"lots\"") && e.contains("64M"), "{e}");
        let e = EngineConfig::from_json_str(r#"{"host_teir": "1G"}"#).unwrap_err().to_string();
        assert!(e.contains("host_teir") && e.contains("docs/ENGINE.md"), "{e}");
        let e = EngineConfig::from_json_str("[1]").unwrap_err().to_string();
        assert!(e.contains("[1]") && e.contains("dir"), "{e}");
    }

    #[test]
    fn an_empty_configuration_names_the_keys_it_needs_and_creates_nothing() {
        let before = std::fs::read_dir(".").unwrap().count();
        for cfg in [
            EngineConfig::from_toml_str("").unwrap(),
            EngineConfig::from_json_str("{}").unwrap(),
            EngineConfig::default(),
        ] {
            let e = Engine::open(cfg).unwrap_err().to_string();
            assert!(e.contains("`dir`") && e.contains("`targets`"), "{e}");
        }
        assert!(!Path::new("teraio-data").exists());
        assert_eq!(std::fs::read_dir(".").unwrap().count(), before, "nothing made here");
    }

    #[test]
    fn files_that_do_not_fit_are_refused_before_anything_is_created() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("new").join("array");
        let asked = 1u64 << 60;
        let cfg = EngineConfig {
            dir: dir.clone(),
            files: 2,
            file_size_bytes: ByteSize(asked),
            backend: BackendName::Psync,
            ..Default::default()
        };
        let e = Engine::open(cfg).unwrap_err();
        assert!(matches!(e, Error::NoSpace(_)), "{e:?}");
        let e = e.to_string();
        let free = crate::device::free_bytes(tmp.path()).unwrap();
        assert!(e.contains("dev0") && e.contains("dev1"), "names the files: {e}");
        assert!(e.contains(&asked.to_string()) && e.contains("1048576T"), "the size asked: {e}");
        // the free space, give or take what the filesystem did meanwhile
        let said: u64 = e
            .split(" bytes (")
            .nth(2)
            .and_then(|s| s.rsplit(' ').next())
            .map_or(0, |s| s.parse().unwrap_or(0));
        assert!(said.abs_diff(free) < 1 << 30, "free {free}, said {said}: {e}");
        assert!(e.contains("lower file_size") && e.contains("nothing was created"), "{e}");
        assert!(!tmp.path().join("new").exists(), "the folders it would have made are not there");
    }

    #[test]
    fn a_failed_open_removes_what_it_created_and_keeps_what_was_there() {
        let tmp = tempfile::tempdir().unwrap();
        // A GPU that no machine has: the engine fails after its array was opened.
        let no_gpu = GpuConfig { device: Some(4000), ..GpuConfig::default() };
        let cfg = EngineConfig {
            dir: tmp.path().join("a").join("b"),
            files: 2,
            file_size_bytes: ByteSize(8 << 20),
            backend: BackendName::Psync,
            gpu: no_gpu.clone(),
            ..Default::default()
        };
        assert!(Engine::open(cfg).is_err());
        assert!(!tmp.path().join("a").exists(), "files and folders it made are removed");
        let keep = tmp.path().join("keep");
        std::fs::write(&keep, vec![0u8; 4 << 20]).unwrap();
        let cfg = EngineConfig {
            targets: vec![keep.clone(), tmp.path().join("new")],
            file_size_bytes: ByteSize(4 << 20),
            backend: BackendName::Psync,
            gpu: no_gpu,
            ..Default::default()
        };
        assert!(Engine::open(cfg).is_err());
        assert!(!tmp.path().join("new").exists(), "the file it created is removed");
        assert_eq!(
            std::fs::metadata(&keep).unwrap().len(),
            4 << 20,
            "the file that was there stays"
        );
    }

    #[test]
    fn reopening_with_another_size_resizes_a_volatile_array_and_refuses_a_persistent_one() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = |size: u64, persistent: bool| EngineConfig {
            dir: tmp.path().to_path_buf(),
            files: 1,
            file_size_bytes: ByteSize(size),
            backend: BackendName::Psync,
            persistent,
            ..Default::default()
        };
        let file = tmp.path().join("dev0");
        let len = || std::fs::metadata(&file).unwrap().len();
        drop(Engine::open(cfg(64 << 20, false)).unwrap());
        assert_eq!(len(), 64 << 20);
        let e = Engine::open(cfg(32 << 20, false)).unwrap();
        assert_eq!(len(), 32 << 20, "a volatile array holds nothing: resized as asked");
        assert!(e.capacity_bytes() < 32 << 20);
        drop(e);
        drop(Engine::open(cfg(48 << 20, false)).unwrap());
        assert_eq!(len(), 48 << 20);
        std::fs::remove_file(&file).unwrap();
        drop(Engine::open(cfg(32 << 20, true)).unwrap());
        let e = Engine::open(cfg(16 << 20, true)).unwrap_err().to_string();
        assert!(e.contains("dev0") && e.contains(&(32u64 << 20).to_string()), "{e}");
        assert!(e.contains(&(16u64 << 20).to_string()) && e.contains("file_size = 0"), "{e}");
        assert_eq!(len(), 32 << 20, "refused: untouched");
        drop(Engine::open(cfg(0, true)).unwrap());
        drop(Engine::open(cfg(32 << 20, true)).unwrap());
    }

    #[test]
    fn a_path_under_dev_that_is_not_a_block_device_is_refused() {
        for (path, why) in [("/dev/nvme9n1teraio", "no such device"), ("/dev/null", "character")] {
            let mut cfg = EngineConfig::with_targets(vec![PathBuf::from(path)]);
            cfg.backend = BackendName::Psync;
            let e = Engine::open(cfg).unwrap_err().to_string();
            assert!(e.contains(path) && e.contains(why) && e.contains("lsblk"), "{e}");
        }
        assert!(!Path::new("/dev/nvme9n1teraio").exists(), "nothing created in /dev");
    }

    #[test]
    fn relative_paths_in_a_file_are_relative_to_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("engine.toml");
        std::fs::write(&path, "targets = [\"d0\", \"/abs/d1\"]\ndir = \"data\"\n").unwrap();
        let cfg = EngineConfig::from_file(&path).unwrap();
        assert_eq!(cfg.targets[0], dir.path().join("d0"));
        assert_eq!(cfg.targets[1], PathBuf::from("/abs/d1"));
        assert_eq!(cfg.dir, dir.path().join("data"));
        let e = EngineConfig::from_file(dir.path().join("missing.toml")).unwrap_err();
        assert!(e.to_string().contains("missing.toml"), "{e}");
    }

    #[test]
    fn an_engine_over_sim_disks_round_trips_a_tensor_without_a_copy() {
        let disks: Vec<_> = (0..3).map(|i| SimDisk::new(64 << 20, 4096, i)).collect();
        let engine = Engine::open(EngineConfig::with_sim_disks(disks)).unwrap();
        assert_eq!(engine.array().device_count(), 3);
        assert!(engine.describe().contains("3 simulated disks"), "{}", engine.describe());
        let size = (5 << 20) + 77;
        let mut buf = engine.alloc_host(size).unwrap();
        for (i, b) in buf.host_mut().unwrap().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        engine.store().offload(9, buf, OffloadOptions::default()).unwrap().wait().unwrap();
        let back = engine.store().prefetch_sync(9, engine.alloc_host(size).unwrap()).unwrap();
        assert!(back.host().unwrap().iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
        assert!(engine.capacity_bytes() > 0);
    }

    #[test]
    fn close_reports_a_failed_final_checkpoint() {
        use crate::backend::sim::{SimFault, SimOp};
        let disks: Vec<_> = (0..2).map(|i| SimDisk::new(64 << 20, 4096, i)).collect();
        let mut cfg = EngineConfig::with_sim_disks(disks.clone());
        cfg.persistent = true;
        let engine = Engine::open(cfg.clone()).unwrap();
        let buf = engine.alloc_host(1 << 20).unwrap();
        engine.store().offload(1, buf, OffloadOptions::default()).unwrap().wait().unwrap();
        // A clean close is Ok.
        engine.close().unwrap();
        let engine = Engine::open(cfg.clone()).unwrap();
        assert!(engine.store().info(1).is_some(), "reopened with its tensor");
        for d in &disks {
            d.inject(SimFault::Eio { op: SimOp::Write, after_ops: 0 });
        }
        let e = engine.close().unwrap_err();
        assert!(!e.to_string().is_empty());
        for d in &disks {
            d.clear_faults();
        }
        // The journal still had everything.
        let engine = Engine::open(cfg).unwrap();
        assert!(engine.store().info(1).is_some(), "reopened after the failed checkpoint");
        engine.close().unwrap();
    }

    #[test]
    fn the_host_buffer_bound_is_a_clear_error() {
        let disks = vec![SimDisk::new(16 << 20, 4096, 1)];
        let mut cfg = EngineConfig::with_sim_disks(disks);
        cfg.host_buffers_bytes = ByteSize(4 << 20);
        let engine = Engine::open(cfg).unwrap();
        let _a = engine.alloc_host(3 << 20).unwrap();
        let e = engine.alloc_host(3 << 20).unwrap_err().to_string();
        assert!(e.contains("host_buffers"), "{e}");
        assert!(engine.alloc_host(0).is_err());
    }

    #[test]
    fn a_persistent_engine_over_files_reopens_with_its_tensors_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = EngineConfig {
            dir: dir.path().to_path_buf(),
            files: 2,
            file_size_bytes: ByteSize(64 << 20),
            persistent: true,
            backend: BackendName::Psync,
            ..Default::default()
        };
        {
            let engine = Engine::open(cfg.clone()).unwrap();
            let mut buf = engine.alloc_host(3 << 20).unwrap();
            buf.host_mut().unwrap().fill(0x3c);
            let opts = OffloadOptions { name: Some("layer0.w".into()), ..Default::default() };
            engine.store().offload(4, buf, opts).unwrap().wait().unwrap();
        }
        let meta = Engine::inspect(&cfg).unwrap();
        assert_eq!(meta.tensors.len(), 1);
        let engine = Engine::open(cfg).unwrap();
        let id =
            engine.store().lookup::<TensorKey>("layer0.w").expect("found by name after reopen");
        let back = engine.store().prefetch_sync(id, engine.alloc_host(3 << 20).unwrap()).unwrap();
        assert!(back.host().unwrap().iter().all(|&b| b == 0x3c));
    }

    #[test]
    fn a_volatile_engine_refuses_files_holding_a_teraio_array_unless_told() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = EngineConfig {
            dir: dir.path().to_path_buf(),
            files: 1,
            file_size_bytes: ByteSize(32 << 20),
            backend: BackendName::Psync,
            ..Default::default()
        };
        let mut persistent = cfg.clone();
        persistent.persistent = true;
        drop(Engine::open(persistent).unwrap());
        let e = Engine::open(cfg.clone()).unwrap_err().to_string();
        assert!(e.contains("refusing to overwrite"), "{e}");
        cfg.overwrite = Overwrite::Anything;
        Engine::open(cfg).unwrap();
    }

    #[test]
    fn the_gpu_section_opens_a_gpu_tier_whose_tensors_take_the_gpu_paths() {
        let cfg = EngineConfig::from_toml_str(
            "[gpu]\ndevice = 0\npath = \"bounce\"\nbudget = \"64M\"\nchunk = \"1M\"\nemulated = true\n",
        )
        .unwrap();
        assert_eq!(cfg.gpu.device, Some(0));
        assert_eq!(cfg.gpu.path, GpuPath::Bounce);
        let again = EngineConfig::from_toml_str(&cfg.to_toml()).unwrap();
        assert_eq!(again.gpu, cfg.gpu);
        let mut cfg = cfg;
        cfg.sim_disks = (0..2).map(|i| SimDisk::new(64 << 20, 4096, i)).collect();
        let engine = Engine::open(cfg).unwrap();
        assert!(engine.gpu_description().unwrap().contains("standing in"));
        let size = (3 << 20) + 5;
        let data: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
        let mut m = engine.alloc_gpu(size as u64).unwrap();
        m.fill_from_host(&data).unwrap();
        engine.store().offload(1, m, OffloadOptions::default()).unwrap().wait().unwrap();
        let back = engine.store().prefetch_sync(1, engine.alloc_gpu(size as u64).unwrap()).unwrap();
        let mut out = vec![0u8; size];
        back.read_to_host(&mut out).unwrap();
        assert!(out == data);
        assert_eq!(engine.gpu_path().unwrap().path, "bounce");
        assert_eq!(engine.store().gpu_stats().bounce_write.ops, 1);
        assert!(engine.wrap_gpu(0x1000, 10).is_err(), "no foreign pointers on the emulation");
        let e = EngineConfig::from_toml_str("[gpu]\ndepth = 1\n").unwrap_err().to_string();
        assert!(e.contains("[gpu]") && e.contains("depth"), "{e}");
        let plain =
            Engine::open(EngineConfig::with_sim_disks(vec![SimDisk::new(16 << 20, 4096, 9)]))
                .unwrap();
        let e = plain.alloc_gpu(10).unwrap_err().to_string();
        assert!(e.contains("no GPU"), "{e}");
    }
}
