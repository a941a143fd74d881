//! The device array: N targets (files, raw block devices or simulated disks) behind one
//! backend, and striped tensor reads and writes over the layout's [`StripeMap`].
//!
//! "Where bytes live" is decided here (a stripe map range becomes per-device segments of at
//! most [`DeviceArray::max_io_bytes`]); "how I/O is submitted" is the backend's business. Every
//! request is validated (alignment, buffer size, device bounds) before anything is submitted,
//! so a bad call never leaves half an operation in flight.
//!
//! ```no_run
//! use teraio_engine::array::{ArrayConfig, DeviceArray, Target};
//! use teraio_engine::pool::{BufferPool, PoolConfig};
//! # fn main() -> teraio_engine::Result<()> {
//! let mut config = ArrayConfig::new(vec![Target::Path("/mnt/nvme0/teraio.dat".into())]);
//! config.file_size_bytes = 1 << 30;
//! let array = DeviceArray::open(config)?;
//! let pool = BufferPool::new(PoolConfig::default())?;
//! let mut buf = pool.alloc(1 << 20)?;
//! buf.fill(7);
//! let (buf, result) = array.write_at(0, 0, buf)?.wait();
//! result?;
//! let (back, result) = array.read_at(0, 0, buf)?.wait();
//! result?;
//! assert!(back.iter().all(|&b| b == 7));
//! # Ok(()) }
//! ```

use std::ops::Range;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};
use teraio_layout::{ArrayGeometry, StripeMap};

use crate::backend::psync::PsyncBackend;
use crate::backend::sim::{SimBackend, SimDisk};
use crate::backend::spdk_config::{self, SpdkOptions};
use crate::backend::uring::{self, UringBackend};
use crate::backend::{Backend, IoDirection, IoFailure, IoRequest, IoVec};
use crate::device::{self, DEFAULT_MAX_IO_BYTES, PROBE_BYTES};
use crate::pool::{IoBuf, PageBacking, Registration};
use crate::{Error, Result};

/// One device of an array.
#[derive(Debug, Clone)]
pub enum Target {
    /// A regular file (created if missing) or a raw block device.
    Path(PathBuf),
    /// A simulated in-memory disk (tests).
    Sim(Arc<SimDisk>),
}

/// How I/O is submitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// io_uring; falls back to [`BackendKind::Psync`] with a one-line notice when io_uring is not
    /// available (old kernel, seccomp, `kernel.io_uring_disabled`).
    #[default]
    Uring,
    /// pread/pwrite on a thread pool.
    Psync,
    /// SPDK (feature `spdk`): its bdevs over the target files or devices, or its NVMe driver
    /// (target syntax in [`crate::backend::spdk_config`]). Without the feature, opening an
    /// array with it fails with [`Error::Unsupported`].
    Spdk,
}

/// What to do when a target already holds data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExistingData {
    /// Refuse any target holding a partition table, filesystem, volume manager or RAID
    /// signature, or another teraio array.
    #[default]
    Refuse,
    /// Accept a teraio superblock (reopening our own array); refuse everything else.
    AllowTeraio,
    /// Overwrite whatever is there.
    AllowAnything,
}

/// How to open an array.
#[derive(Debug, Clone)]
pub struct ArrayConfig {
    /// The devices, in array order.
    pub targets: Vec<Target>,
    /// Files are created or resized to this size; 0 keeps their size. A file holding a teraio
    /// array keeps its size when `keeps_contents` (asking another is an error).
    pub file_size_bytes: u64,
    /// The array's contents are kept across opens (a persistent store reopens them): an
    /// existing file holding a teraio array is never resized. Otherwise (volatile: nothing
    /// survives an open) files of another size are resized to `file_size_bytes`.
    pub keeps_contents: bool,
    /// io_uring (default) or psync.
    pub backend: BackendKind,
    /// Requests in flight per device (io_uring ring depth; psync threads per device).
    pub queue_depth: u32,
    /// Policy for targets that already hold data.
    pub existing: ExistingData,
    /// Stripe unit of the array geometry.
    pub stripe_unit_bytes: u64,
    /// I/O threads per device (io_uring: one ring each; spdk: one reactor each). 0 means 1.
    pub io_threads: usize,
    /// Options of the `spdk` backend (ignored by the others).
    pub spdk: SpdkOptions,
}

impl ArrayConfig {
    /// Defaults: keep file sizes, io_uring, queue depth 32, refuse existing data, 1 MiB stripe
    /// unit, one I/O thread per device.
    pub fn new(targets: Vec<Target>) -> Self {
        Self {
            targets,
            file_size_bytes: 0,
            keeps_contents: false,
            backend: BackendKind::Uring,
            queue_depth: 32,
            existing: ExistingData::Refuse,
            stripe_unit_bytes: teraio_layout::geometry::DEFAULT_STRIPE_UNIT_BYTES,
            io_threads: 1,
            spdk: SpdkOptions::default(),
        }
    }
}

#[derive(Debug)]
struct Slot {
    index: u32,
    name: String,
    path: PathBuf,
    capacity_bytes: u64,
    block_bytes: u32,
    max_io_bytes: u64,
    /// Largest request from ordinary (scattered 4 KiB) pages that the device takes whole:
    /// `max_segments` pages, rounded down to a power of two.
    max_io_scattered_bytes: u64,
    /// The file's exclusive lock (see [`device::open_path`]), held while the array lives.
    _lock: Option<OwnedFd>,
}

/// N devices behind one backend. `Send + Sync`; share it as `Arc<DeviceArray>`.
pub struct DeviceArray {
    slots: Vec<Arc<Slot>>,
    /// Files this open created (did not exist before).
    created: Vec<PathBuf>,
    backend: Box<dyn Backend>,
    geometry: ArrayGeometry,
    max_io_bytes: u64,
    max_io_scattered_bytes: u64,
}

impl std::fmt::Debug for DeviceArray {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceArray")
            .field("devices", &self.slots.iter().map(|s| &s.name).collect::<Vec<_>>())
            .field("backend", &self.backend.name())
            .field("geometry", &self.geometry)
            .finish()
    }
}

pub(crate) fn check_existing(policy: ExistingData, path: &Path, head: &[u8]) -> Result<()> {
    if policy == ExistingData::AllowAnything {
        return Ok(());
    }
    let Some(found) = device::detect_signature(head) else { return Ok(()) };
    if policy == ExistingData::AllowTeraio && found.contains("teraio") {
        return Ok(());
    }
    Err(Error::OverwriteRefused { path: path.to_path_buf(), found })
}

/// Open the targets with the SPDK backend.
#[cfg(feature = "spdk")]
fn open_spdk(config: &ArrayConfig) -> Result<(Vec<Slot>, Box<dyn Backend>)> {
    use crate::backend::spdk::SpdkBackend;
    let paths: Vec<PathBuf> = config
        .targets
        .iter()
        .map(|t| match t {
            Target::Path(p) => p.clone(),
            Target::Sim(_) => unreachable!("refused by the caller"),
        })
        .collect();
    let (infos, backend) = SpdkBackend::open(
        &paths,
        config.file_size_bytes,
        config.queue_depth.max(1),
        config.io_threads.max(1),
        &config.spdk,
    )?;
    let mut slots = Vec::new();
    for info in infos {
        slots.push(Slot {
            index: slots.len() as u32,
            name: info.name,
            path: info.path,
            capacity_bytes: info.capacity_bytes,
            block_bytes: info.block_bytes,
            max_io_bytes: info.max_io_bytes,
            // SPDK takes the request's iovecs whole (the bdev or the NVMe SGL splits).
            max_io_scattered_bytes: info.max_io_bytes,
            _lock: info.lock,
        });
    }
    let backend: Box<dyn Backend> = Box::new(backend);
    // The overwrite guard, through SPDK itself (an NVMe namespace has no path to read).
    for s in &slots {
        let head = read_head_via(&*backend, s)?;
        check_existing(config.existing, Path::new(&s.name), &head)?;
    }
    Ok((slots, backend))
}

#[cfg(not(feature = "spdk"))]
fn open_spdk(_config: &ArrayConfig) -> Result<(Vec<Slot>, Box<dyn Backend>)> {
    Err(Error::Unsupported(
        "the spdk backend is not in this build: rebuild teraio with the cargo feature `spdk` \
         (SPDK installed, see docs/SPDK.md)"
            .into(),
    ))
}

/// Read the first [`PROBE_BYTES`] (at most the capacity) of one device through `backend`.
#[cfg(feature = "spdk")]
fn read_head_via(backend: &dyn Backend, slot: &Slot) -> Result<Vec<u8>> {
    let block = u64::from(slot.block_bytes).max(512);
    let len = (PROBE_BYTES as u64).min(slot.capacity_bytes) / block * block;
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::from_size_align(len as usize, 4096)
        .map_err(|e| Error::InvalidArgument(format!("probe buffer: {e}")))?;
    struct Aligned(*mut u8, std::alloc::Layout);
    // SAFETY: the pointer is owned by this value alone.
    unsafe impl Send for Aligned {}
    impl Drop for Aligned {
        fn drop(&mut self) {
            // SAFETY: allocated below with this layout.
            unsafe { std::alloc::dealloc(self.0, self.1) }
        }
    }
    // SAFETY: non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        std::alloc::handle_alloc_error(layout);
    }
    let buf = Aligned(ptr, layout);
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let iov = vec![IoVec { ptr, len: len as usize }];
    let done = Box::new(move |r: std::result::Result<(), IoFailure>| {
        let _ = tx.send((buf, r));
    });
    // SAFETY: the iovec names `buf`, owned by the completion until it runs.
    let req = unsafe { IoRequest::new(IoDirection::Read, slot.index as usize, 0, iov, done) };
    backend.submit(req);
    let (buf, r) = rx.recv().map_err(|_| Error::Closed("spdk backend"))?;
    r.map_err(|e| Error::Io {
        device: slot.index,
        path: slot.path.clone(),
        source: match e {
            IoFailure::Os(e) => e,
            other => std::io::Error::other(other.to_string()),
        },
    })?;
    // SAFETY: `len` bytes were read into the buffer.
    Ok(unsafe { std::slice::from_raw_parts(buf.0, len as usize) }.to_vec())
}

/// Whether `path` names something under `/dev` (where a regular file is never what was meant).
fn under_dev(path: &Path) -> bool {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().map(|d| d.join(path)).unwrap_or_else(|_| path.to_path_buf())
    };
    abs.starts_with("/dev")
}

/// What a path target is before anything is opened: checked whole before any file is created or
/// resized, so a refused open changes nothing.
struct PathCheck {
    /// It exists (a file or a block device).
    exists: bool,
    /// A regular file (existing) to be shrunk to the asked size after the checks.
    shrink_to: Option<u64>,
}

/// The checks of one path target that need nothing opened: a path under /dev must be a block
/// device, an existing file's contents pass the overwrite guard, its size agrees with the
/// configuration.
fn check_path(config: &ArrayConfig, path: &Path) -> Result<PathCheck> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::metadata(path) {
        Ok(m) => Some(m),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(Error::Os { context: format!("looking at {}", path.display()), source: e });
        }
    };
    let is_block = meta.as_ref().is_some_and(|m| m.file_type().is_block_device());
    if under_dev(path) && !is_block {
        let what = match &meta {
            None => "no such device".to_string(),
            Some(m) if m.file_type().is_char_device() => "a character device".to_string(),
            Some(m) if m.is_dir() => "a folder".to_string(),
            Some(_) => "a regular file (in /dev, memory-backed: not a drive)".to_string(),
        };
        return Err(Error::InvalidArgument(format!(
            "{} is not a block device ({what}): name an NVMe drive or partition that exists \
             (`lsblk` lists them, e.g. /dev/nvme1n1), or a file on a mounted filesystem; teraio \
             never creates files under /dev",
            path.display()
        )));
    }
    let Some(meta) = meta else {
        if config.file_size_bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "{} does not exist and file_size is 0 (keep the size of existing files): set \
                 file_size (--file-size) to create it",
                path.display()
            )));
        }
        return Ok(PathCheck { exists: false, shrink_to: None });
    };
    if !is_block && !meta.is_file() {
        return Err(Error::InvalidArgument(format!(
            "{} is neither a regular file nor a block device: name a file (created if missing) \
             or a raw block device",
            path.display()
        )));
    }
    let head = device::read_head(path)?;
    check_existing(config.existing, path, &head)?;
    let asked = config.file_size_bytes;
    if is_block || asked == 0 || meta.len() == asked {
        return Ok(PathCheck { exists: true, shrink_to: None });
    }
    let holds_array = device::detect_signature(&head).is_some_and(|f| f.contains("teraio"));
    if config.keeps_contents && holds_array {
        let have = crate::units::display_size(meta.len());
        return Err(Error::InvalidArgument(format!(
            "{} holds a persistent teraio array of {} bytes ({have}) but file_size asks {asked} \
             bytes ({}): reopen it with file_size = 0 (keep) or file_size = \"{have}\", or \
             remove the array's files to start a new one of the new size (its tensors are lost)",
            path.display(),
            meta.len(),
            crate::units::display_size(asked),
        )));
    }
    Ok(PathCheck { exists: true, shrink_to: (meta.len() > asked).then_some(asked) })
}

/// Refuse, before anything is created, files that would not fit: the bytes still to allocate
/// on each filesystem (new files and growth of existing ones) against its free space.
fn check_free_space(config: &ArrayConfig, paths: &[(&Path, PathCheck)]) -> Result<()> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let asked = config.file_size_bytes;
    if asked == 0 {
        return Ok(());
    }
    // filesystem id -> (a folder on it, bytes needed, files)
    let mut need: Vec<(u64, PathBuf, u64, Vec<String>)> = Vec::new();
    for (path, check) in paths {
        let (folder, have) = if check.exists {
            let m = std::fs::metadata(path).map_err(|e| Error::Os {
                context: format!("stat of {}", path.display()),
                source: e,
            })?;
            if m.file_type().is_block_device() {
                continue;
            }
            (path.to_path_buf(), m.blocks() * 512)
        } else {
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            (parent, 0)
        };
        let more = asked.saturating_sub(have);
        if more == 0 {
            continue;
        }
        let Ok(fs) = std::fs::metadata(&folder).map(|m| m.dev()) else { continue };
        let name = path.display().to_string();
        match need.iter_mut().find(|n| n.0 == fs) {
            Some(n) => {
                n.2 += more;
                n.3.push(name);
            }
            None => need.push((fs, folder, more, vec![name])),
        }
    }
    for (_, folder, more, files) in need {
        let free = device::free_bytes(&folder)?;
        if more > free {
            let d = crate::units::display_size;
            let names = if files.len() == 1 {
                files[0].clone()
            } else {
                format!("{} files ({})", files.len(), files.join(", "))
            };
            return Err(Error::NoSpace(format!(
                "{names} of file_size {asked} bytes ({}) need {more} more bytes ({}) on the \
                 filesystem of {}, which has {free} bytes ({}) free: lower file_size \
                 (--file-size), use fewer files, or put the array on a disk with room (df -h); \
                 nothing was created",
                d(asked),
                d(more),
                folder.display(),
                d(free),
            )));
        }
    }
    Ok(())
}

impl DeviceArray {
    /// Open every target, apply the overwrite guard, and start the backend.
    ///
    /// Path targets are checked before anything is created or resized: a path under /dev must
    /// be a block device, an existing target must pass the overwrite guard and (holding a teraio
    /// array whose contents are kept) have the asked size, and the files must fit in their
    /// filesystems' free space. A failed open removes the files it created (never files that
    /// existed before).
    pub fn open(config: ArrayConfig) -> Result<Arc<DeviceArray>> {
        let mut created = Vec::new();
        match Self::open_inner(&config, &mut created) {
            Ok(mut array) => {
                array.created = created;
                Ok(Arc::new(array))
            }
            Err(e) => {
                for f in &created {
                    let _ = std::fs::remove_file(f);
                }
                Err(e)
            }
        }
    }

    /// Files this array's open created (they did not exist before): what a failed open of
    /// something built on the array removes.
    pub fn created_files(&self) -> &[PathBuf] {
        &self.created
    }

    fn open_inner(config: &ArrayConfig, created: &mut Vec<PathBuf>) -> Result<DeviceArray> {
        if config.targets.is_empty() {
            return Err(Error::InvalidArgument("an array needs at least one target".into()));
        }
        let sims: Vec<Arc<SimDisk>> = config
            .targets
            .iter()
            .filter_map(|t| if let Target::Sim(d) = t { Some(Arc::clone(d)) } else { None })
            .collect();
        let spdk = config.backend == BackendKind::Spdk;
        if !spdk
            && let Some(Target::Path(p)) = config
                .targets
                .iter()
                .find(|t| matches!(t, Target::Path(p) if spdk_config::is_spdk_syntax(p)))
        {
            return Err(Error::InvalidArgument(format!(
                "target {:?} is an SPDK target (nvme:, uring:, aio:); it needs the spdk backend \
                 (--backend spdk)",
                p.display().to_string()
            )));
        }
        let (slots, backend): (Vec<Slot>, Box<dyn Backend>) = if spdk {
            if !sims.is_empty() {
                return Err(Error::InvalidArgument(
                    "the spdk backend does not take simulated disks".into(),
                ));
            }
            open_spdk(config)?
        } else if !sims.is_empty() {
            if sims.len() != config.targets.len() {
                return Err(Error::InvalidArgument(
                    "an array cannot mix simulated disks with files or block devices".into(),
                ));
            }
            let mut slots = Vec::new();
            for (i, d) in sims.iter().enumerate() {
                if sims[..i].iter().any(|o| Arc::ptr_eq(o, d)) {
                    return Err(Error::InvalidArgument(format!("sim disk {i} is listed twice")));
                }
                let name = format!("sim:{i}");
                let mut head = vec![0u8; PROBE_BYTES];
                d.peek(0, &mut head);
                check_existing(config.existing, Path::new(&name), &head)?;
                slots.push(Slot {
                    index: slots.len() as u32,
                    path: PathBuf::from(&name),
                    name,
                    capacity_bytes: d.capacity_bytes(),
                    block_bytes: d.block_bytes(),
                    max_io_bytes: DEFAULT_MAX_IO_BYTES,
                    // As a virtio disk with 254 segments: 1016 KiB, rounded down to 512 KiB.
                    max_io_scattered_bytes: 512 << 10,
                    _lock: None,
                });
            }
            let backend = SimBackend::new(sims)
                .map_err(|e| Error::Os { context: "starting the sim backend".into(), source: e })?;
            (slots, Box::new(backend))
        } else {
            let mut slots = Vec::new();
            let mut fds: Vec<Arc<OwnedFd>> = Vec::new();
            let mut ids: Vec<(u64, u64)> = Vec::new();
            // The same file or device twice would be locked against itself (files) or refused
            // as busy (block devices): name the real problem before opening anything.
            let identity = |meta: &std::fs::Metadata| {
                use std::os::unix::fs::{FileTypeExt, MetadataExt};
                if meta.file_type().is_block_device() {
                    (0, meta.rdev())
                } else {
                    (meta.dev(), meta.ino())
                }
            };
            let mut seen: Vec<(u64, u64)> = Vec::new();
            for (i, t) in config.targets.iter().enumerate() {
                let Target::Path(path) = t else { unreachable!("all targets are paths here") };
                let same_path =
                    config.targets[..i].iter().any(|o| matches!(o, Target::Path(p) if p == path));
                let id = std::fs::metadata(path).ok().map(|m| identity(&m));
                if same_path || id.is_some_and(|id| seen.contains(&id)) {
                    return Err(Error::InvalidArgument(format!(
                        "{} is listed twice (same file or device)",
                        path.display()
                    )));
                }
                seen.extend(id);
            }
            let mut checks = Vec::new();
            for t in &config.targets {
                let Target::Path(path) = t else { unreachable!("all targets are paths here") };
                checks.push((path.as_path(), check_path(config, path)?));
            }
            check_free_space(config, &checks)?;
            for (path, check) in &checks {
                let path = *path;
                if let Some(size) = check.shrink_to {
                    // A volatile array's file of another size holds nothing that is kept.
                    std::fs::OpenOptions::new()
                        .write(true)
                        .open(path)
                        .and_then(|f| f.set_len(size))
                        .map_err(|e| Error::Os {
                            context: format!("resizing {} to {size} bytes", path.display()),
                            source: e,
                        })?;
                }
                let opened = device::open_path(path, config.file_size_bytes)?;
                if !check.exists {
                    created.push(path.to_path_buf());
                }
                let meta = std::fs::metadata(path).map_err(|e| Error::Os {
                    context: format!("stat of {}", path.display()),
                    source: e,
                })?;
                let id = identity(&meta);
                if ids.contains(&id) {
                    return Err(Error::InvalidArgument(format!(
                        "{} is listed twice (same file or device)",
                        path.display()
                    )));
                }
                ids.push(id);
                if check.exists {
                    // Checked before it was opened; again, as it is now.
                    check_existing(config.existing, path, &device::read_head(path)?)?;
                }
                slots.push(Slot {
                    index: slots.len() as u32,
                    name: path.display().to_string(),
                    path: path.to_path_buf(),
                    capacity_bytes: opened.capacity_bytes,
                    block_bytes: opened.block_bytes,
                    max_io_bytes: opened.max_io_bytes,
                    max_io_scattered_bytes: opened.max_segments.map_or(opened.max_io_bytes, |n| {
                        let bytes = u64::from(n) * 4096;
                        (1u64 << bytes.ilog2()).min(opened.max_io_bytes)
                    }),
                    _lock: opened.lock,
                });
                fds.push(opened.fd);
            }
            let qd = config.queue_depth.max(1);
            let threads = config.io_threads.max(1);
            let use_uring = match config.backend {
                BackendKind::Psync => false,
                BackendKind::Spdk => unreachable!("handled above"),
                BackendKind::Uring => match uring::probe() {
                    Ok(()) => true,
                    Err(e) => {
                        crate::notice::info(format!(
                            "io_uring is not available ({e}); using psync"
                        ));
                        false
                    }
                },
            };
            let backend: Box<dyn Backend> = if use_uring {
                Box::new(UringBackend::new(fds, qd, threads).map_err(|e| Error::Os {
                    context: "starting the io_uring backend".into(),
                    source: e,
                })?)
            } else {
                let n = (qd as usize * slots.len()).clamp(1, 256);
                Box::new(PsyncBackend::new(fds, n).map_err(|e| Error::Os {
                    context: "starting the psync backend".into(),
                    source: e,
                })?)
            };
            (slots, backend)
        };
        let block = slots.iter().map(|s| s.block_bytes).max().expect("at least one target");
        let geometry = ArrayGeometry::new(slots.len() as u32, block, config.stripe_unit_bytes)?;
        let max_io_bytes = slots.iter().map(|s| s.max_io_bytes).min().expect("at least one target");
        let max_io_bytes =
            (max_io_bytes / u64::from(block) * u64::from(block)).max(u64::from(block));
        let scattered = slots.iter().map(|s| s.max_io_scattered_bytes).min().expect("a target");
        let max_io_scattered_bytes =
            (scattered / u64::from(block) * u64::from(block)).clamp(u64::from(block), max_io_bytes);
        Ok(DeviceArray {
            slots: slots.into_iter().map(Arc::new).collect(),
            created: Vec::new(),
            backend,
            geometry,
            max_io_bytes,
            max_io_scattered_bytes,
        })
    }

    /// Device count, block size (the largest logical block of the devices) and stripe unit.
    pub fn geometry(&self) -> ArrayGeometry {
        self.geometry
    }

    /// Number of devices.
    pub fn device_count(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Usable bytes of one device (0 for an unknown index).
    pub fn device_capacity(&self, device: u32) -> u64 {
        self.slots.get(device as usize).map_or(0, |s| s.capacity_bytes)
    }

    /// The device's path, or "sim:N" (empty for an unknown index).
    pub fn device_name(&self, device: u32) -> String {
        self.slots.get(device as usize).map_or_else(String::new, |s| s.name.clone())
    }

    /// The largest single I/O issued: the smallest `max_sectors_kb` of the devices (capped at
    /// 4 MiB), rounded down to the block size.
    pub fn max_io_bytes(&self) -> u64 {
        self.max_io_bytes
    }

    /// The largest single I/O issued from a buffer on ordinary pages: the devices'
    /// `max_segments` x 4 KiB rounded down to a power of two (512 KiB for 254 segments), so a
    /// scattered buffer is cut into equal requests the device takes whole instead of being split
    /// by the kernel into a full and a tiny one.
    pub fn max_io_scattered_bytes(&self) -> u64 {
        self.max_io_scattered_bytes
    }

    /// The request size limit for a buffer: [`max_io_bytes`](Self::max_io_bytes) for huge-page
    /// memory, [`max_io_scattered_bytes`](Self::max_io_scattered_bytes) for ordinary pages.
    fn max_io_for(&self, buf: &IoBuf) -> u64 {
        match buf.pool().backing() {
            PageBacking::Normal => self.max_io_scattered_bytes,
            PageBacking::HugeTlb | PageBacking::TransparentHuge => self.max_io_bytes,
        }
    }

    /// The paths of the devices, in array order, for other I/O paths to open (GPUDirect
    /// Storage); `None` for simulated disks.
    pub fn device_paths(&self) -> Option<Vec<PathBuf>> {
        // SPDK owns its targets (a PCIe drive is not even visible to the kernel).
        if matches!(self.backend.name(), "sim" | "spdk") {
            return None;
        }
        Some(self.slots.iter().map(|s| s.path.clone()).collect())
    }

    /// "uring", "psync", "sim" or "spdk".
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// Requests so far that used io_uring registered (fixed) buffers (0 on other backends).
    pub fn fixed_buffer_ops(&self) -> u64 {
        self.backend.fixed_buffer_ops()
    }

    /// io_uring buffer-table entries (over all rings) that pin a pool mapping now. Entries of
    /// mappings the pool unmapped are dropped by each ring when it next runs.
    pub fn registered_buffers(&self) -> u64 {
        self.backend.registered_buffers()
    }

    fn block(&self) -> u64 {
        u64::from(self.geometry.block_bytes)
    }

    fn check_buf_address(&self, buf: &IoBuf) -> Result<()> {
        let addr = buf.as_ptr() as u64;
        if !addr.is_multiple_of(self.block()) {
            return Err(Error::Misaligned {
                what: "buffer address",
                value: addr,
                align: self.block(),
            });
        }
        Ok(())
    }

    fn check_extent(&self, device: u32, offset: u64, len: u64) -> Result<&Arc<Slot>> {
        let slot = self.slots.get(device as usize).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "device {device} does not exist (array has {})",
                self.slots.len()
            ))
        })?;
        let block = u64::from(slot.block_bytes);
        if !offset.is_multiple_of(block) {
            return Err(Error::Misaligned { what: "device offset", value: offset, align: block });
        }
        if !len.is_multiple_of(block) {
            return Err(Error::Misaligned { what: "transfer length", value: len, align: block });
        }
        if offset.checked_add(len).is_none_or(|end| end > slot.capacity_bytes) {
            return Err(Error::InvalidArgument(format!(
                "{len} bytes at offset {offset} run past the end of device {device} ({}, {} bytes)",
                slot.name, slot.capacity_bytes
            )));
        }
        Ok(slot)
    }

    fn submit_map(
        &self,
        kind: IoDirection,
        map: &StripeMap,
        range: Range<u64>,
        buf: IoBuf,
    ) -> Result<IoTicket> {
        self.submit_map_keep(kind, map, range, &mut Some(buf))
    }

    /// Validate, then take the buffer out of `holder` and submit. On a validation error the
    /// buffer is still in `holder`.
    fn submit_map_keep(
        &self,
        kind: IoDirection,
        map: &StripeMap,
        range: Range<u64>,
        holder: &mut Option<IoBuf>,
    ) -> Result<IoTicket> {
        let buf = holder.as_ref().expect("a buffer to submit");
        let block = self.block();
        if u64::from(map.block_bytes()) % block != 0 {
            return Err(Error::Misaligned {
                what: "stripe map block size",
                value: u64::from(map.block_bytes()),
                align: block,
            });
        }
        self.check_buf_address(buf)?;
        let segments = map.segments(range.clone(), self.max_io_for(buf))?;
        let need = segments
            .iter()
            .flat_map(|s| s.pieces.iter())
            .map(|p| p.buf_offset + p.len)
            .max()
            .unwrap_or(0);
        if (buf.capacity() as u64) < need {
            return Err(Error::InvalidArgument(format!(
                "buffer of {} bytes is shorter than the {need} bytes range {range:?} moves",
                buf.capacity()
            )));
        }
        let mut planned = Vec::with_capacity(segments.len());
        for s in &segments {
            let slot = self.check_extent(s.device, s.device_offset, s.len)?;
            planned.push(Arc::clone(slot));
        }
        let mut buf = holder.take().expect("checked above");
        let base = buf.as_mut_ptr();
        let registration = buf.registration();
        let state = TicketState::new(buf, segments.len());
        for (s, slot) in segments.iter().zip(planned) {
            let iovecs = s
                .pieces
                .iter()
                .map(|p| IoVec {
                    // SAFETY: every piece lies inside the buffer's capacity (checked: `need`).
                    ptr: unsafe { base.add(p.buf_offset as usize) },
                    len: p.len as usize,
                })
                .collect();
            self.submit_one(kind, s.device_offset, iovecs, &state, slot, registration);
        }
        Ok(IoTicket { state })
    }

    fn submit_one(
        &self,
        kind: IoDirection,
        offset: u64,
        iovecs: Vec<IoVec>,
        state: &Arc<TicketState>,
        slot: Arc<Slot>,
        registration: Option<Registration>,
    ) {
        let device = slot.index;
        let st = Arc::clone(state);
        let completion = Box::new(move |r: Result<(), IoFailure>| {
            let err = r.err().map(|f| match f {
                IoFailure::Os(source) => Error::Io { device, path: slot.path.clone(), source },
                IoFailure::Short { done, len } => {
                    Error::ShortTransfer { op: kind.name(), device, offset, done, len }
                }
            });
            st.complete_one(err);
        });
        // SAFETY: the iovecs point into the IoBuf owned by `state`, which the completion keeps
        // alive (Arc) until it has run; nobody touches the buffer until every completion ran
        // (IoTicket::wait hands it out only when `pending` reaches 0).
        let mut req = unsafe { IoRequest::new(kind, device as usize, offset, iovecs, completion) };
        // SAFETY: the registration is the one of the mapping holding that same IoBuf.
        unsafe { req.set_registration(registration) };
        self.backend.submit(req);
    }

    /// [`submit_write`](Self::submit_write) that never loses the buffer: a request that fails
    /// validation comes back as a completed ticket carrying the error and the buffer.
    pub fn write_tensor(&self, map: &StripeMap, range: Range<u64>, buf: IoBuf) -> IoTicket {
        self.transfer(IoDirection::Write, map, range, buf)
    }

    /// [`submit_read`](Self::submit_read) that never loses the buffer (see
    /// [`write_tensor`](Self::write_tensor)).
    pub fn read_tensor(&self, map: &StripeMap, range: Range<u64>, buf: IoBuf) -> IoTicket {
        self.transfer(IoDirection::Read, map, range, buf)
    }

    fn transfer(
        &self,
        kind: IoDirection,
        map: &StripeMap,
        range: Range<u64>,
        buf: IoBuf,
    ) -> IoTicket {
        let mut holder = Some(buf);
        match self.submit_map_keep(kind, map, range, &mut holder) {
            Ok(t) => t,
            Err(e) => {
                let buf = holder.take().expect("validation failed before the buffer was taken");
                let state = TicketState::new(buf, 0);
                state.inner.lock().error = Some(e);
                IoTicket { state }
            }
        }
    }

    /// Write `range` of a tensor from `buf` (offset 0 of `buf` is `range.start`). Every segment
    /// on every device is issued at once. Alignment and buffer size are checked before anything
    /// is submitted.
    pub fn submit_write(&self, map: &StripeMap, range: Range<u64>, buf: IoBuf) -> Result<IoTicket> {
        self.submit_map(IoDirection::Write, map, range, buf)
    }

    /// Read `range` of a tensor into `buf` (offset 0 of `buf` is `range.start`); the padded tail
    /// of the last block is read too. Same rules as [`submit_write`](Self::submit_write).
    pub fn submit_read(&self, map: &StripeMap, range: Range<u64>, buf: IoBuf) -> Result<IoTicket> {
        self.submit_map(IoDirection::Read, map, range, buf)
    }

    fn submit_raw(
        &self,
        kind: IoDirection,
        device: u32,
        offset: u64,
        mut buf: IoBuf,
    ) -> Result<IoTicket> {
        if buf.is_empty() {
            return Err(Error::InvalidArgument("an I/O moves at least one block".into()));
        }
        self.check_buf_address(&buf)?;
        let slot = Arc::clone(self.check_extent(device, offset, buf.len() as u64)?);
        let max = self.max_io_for(&buf) as usize;
        let base = buf.as_mut_ptr();
        let registration = buf.registration();
        let len = buf.len();
        let chunks = len.div_ceil(max);
        let state = TicketState::new(buf, chunks);
        for c in 0..chunks {
            let start = c * max;
            let n = max.min(len - start);
            // SAFETY: `start + n <= len <= capacity` of the buffer owned by `state`.
            let iov = vec![IoVec { ptr: unsafe { base.add(start) }, len: n }];
            let slot = Arc::clone(&slot);
            self.submit_one(kind, offset + start as u64, iov, &state, slot, registration);
        }
        Ok(IoTicket { state })
    }

    /// Write all of `buf` (`len()` a multiple of the block size) at a block-aligned offset of
    /// one device; for metadata. Split into [`max_io_bytes`](Self::max_io_bytes) requests.
    pub fn write_at(&self, device: u32, offset: u64, buf: IoBuf) -> Result<IoTicket> {
        self.submit_raw(IoDirection::Write, device, offset, buf)
    }

    /// Read `buf.len()` bytes (a multiple of the block size) at a block-aligned offset of one
    /// device.
    pub fn read_at(&self, device: u32, offset: u64, buf: IoBuf) -> Result<IoTicket> {
        self.submit_raw(IoDirection::Read, device, offset, buf)
    }

    /// Durability barrier on every device: every write whose ticket completed before this call
    /// is durable when it returns `Ok` (fdatasync; the simulator's flush). The first failing
    /// device is named in the error; the others are still flushed.
    pub fn sync(&self) -> Result<()> {
        let mut first = None;
        for (i, slot) in self.slots.iter().enumerate() {
            if let Err(source) = self.backend.flush(i) {
                first.get_or_insert(Error::Io {
                    device: i as u32,
                    path: slot.path.clone(),
                    source,
                });
            }
        }
        first.map_or(Ok(()), Err)
    }
}

struct TicketInner {
    pending: usize,
    buf: Option<IoBuf>,
    error: Option<Error>,
    failed_devices: Vec<u32>,
    completed_at: Option<Instant>,
    signal: Option<Arc<CompletionSignal>>,
}

struct TicketState {
    inner: Mutex<TicketInner>,
    cv: Condvar,
}

impl TicketState {
    fn new(buf: IoBuf, pending: usize) -> Arc<Self> {
        let done = pending == 0;
        Arc::new(TicketState {
            inner: Mutex::new(TicketInner {
                pending,
                buf: Some(buf),
                error: None,
                failed_devices: Vec::new(),
                completed_at: done.then(Instant::now),
                signal: None,
            }),
            cv: Condvar::new(),
        })
    }

    fn complete_one(&self, err: Option<Error>) {
        let mut g = self.inner.lock();
        if let Some(e) = err {
            if let Error::Io { device, .. } | Error::ShortTransfer { device, .. } = &e
                && !g.failed_devices.contains(device)
            {
                g.failed_devices.push(*device);
            }
            g.error.get_or_insert(e);
        }
        g.pending -= 1;
        if g.pending == 0 {
            g.completed_at = Some(Instant::now());
            let signal = g.signal.take();
            drop(g);
            self.cv.notify_all();
            if let Some(s) = signal {
                s.notify();
            }
        }
    }
}

/// An operation in flight. Dropping it before completion is safe: the requests in flight keep
/// the buffer alive until their completions arrive, then the buffer returns to its pool.
pub struct IoTicket {
    state: Arc<TicketState>,
}

impl std::fmt::Debug for IoTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoTicket").field("done", &self.is_done()).finish()
    }
}

impl IoTicket {
    /// Wait for every request of the operation. The buffer always comes back; the result is the
    /// first error (naming its device) if any request failed. The other devices' requests ran
    /// to completion regardless.
    pub fn wait(self) -> (IoBuf, Result<()>) {
        let (buf, result, _) = self.wait_timed();
        (buf, result)
    }

    /// [`wait`](Self::wait), also returning when the last request completed (for latency
    /// measurements that do not wait in completion order).
    pub fn wait_timed(self) -> (IoBuf, Result<()>, Instant) {
        let mut g = self.state.inner.lock();
        while g.pending > 0 {
            self.state.cv.wait(&mut g);
        }
        let buf = g.buf.take().expect("the buffer is handed out once, by wait(self)");
        let at = g.completed_at.expect("set when pending reached 0");
        (buf, g.error.take().map_or(Ok(()), Err), at)
    }

    /// Whether every request has completed.
    pub fn is_done(&self) -> bool {
        self.state.inner.lock().pending == 0
    }

    /// When the last request completed (`None` while in flight).
    pub fn completed_at(&self) -> Option<Instant> {
        self.state.inner.lock().completed_at
    }

    /// Have `signal` notified when the operation completes (at once if it already has). Lets one
    /// thread wait for whichever of many tickets finishes first.
    pub fn notify_on_completion(&self, signal: &Arc<CompletionSignal>) {
        let mut g = self.state.inner.lock();
        if g.pending == 0 {
            drop(g);
            signal.notify();
        } else {
            g.signal = Some(Arc::clone(signal));
        }
    }

    /// Devices whose requests failed so far, in order of failure.
    pub fn failed_devices(&self) -> Vec<u32> {
        self.state.inner.lock().failed_devices.clone()
    }
}

/// A counter of completions that one thread can wait on, shared by many tickets (see
/// [`IoTicket::notify_on_completion`]).
#[derive(Debug, Default)]
pub struct CompletionSignal {
    count: Mutex<u64>,
    cv: Condvar,
}

impl CompletionSignal {
    /// A signal with no completions yet.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn notify(&self) {
        *self.count.lock() += 1;
        self.cv.notify_all();
    }

    /// Completions signalled so far.
    pub fn count(&self) -> u64 {
        *self.count.lock()
    }

    /// Wait until more than `seen` completions were signalled; returns the new count.
    pub fn wait_beyond(&self, seen: u64) -> u64 {
        let mut g = self.count.lock();
        while *g <= seen {
            self.cv.wait(&mut g);
        }
        *g
    }
}
