//! The store's two data paths for device (GPU) memory, chosen per array and device:
//!
//! - **bounce**: the tensor is cut into chunks (whole stripe units); each chunk is copied
//!   device-to-host into a pinned staging buffer (pool memory page-locked once with
//!   cuMemHostRegister), checksummed by the CPU (crc32c per stripe unit) and written with the
//!   array's O_DIRECT I/O; `depth` chunks are in flight at once, so PCIe copies, checksums and
//!   SSD writes overlap. Reads run the same pipeline backwards (read, verify, host-to-device).
//! - **gds**: GPUDirect Storage. Every stripe piece (one stripe unit at its device offset) is
//!   one direct read or write between GPU memory and the device's file (cuFile), the pieces of
//!   every device in flight at once from a pool of threads per device. crc32c is computed on
//!   the GPU ([`crate::gpucrc`]), with the same on-disk values as the bounce path. The last
//!   partial block of a tensor goes through a host buffer (device memory past the tensor's end
//!   may not exist, and O_DIRECT moves whole blocks).
//!
//! `auto` picks gds where direct storage reaches the disk peer to peer (nvidia-fs loaded), and
//! bounce otherwise: in compatibility mode cuFile itself bounces through host memory, one
//! request at a time per call, which the pipeline does with more overlap
//! (docs/BENCHMARKS.md has both measured).
//!
//! Both paths keep the store's contracts: the source memory is untouched and handed back on
//! failure, a prefetch verifies every unit before it reports success.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use teraio_layout::StripeMap;

use crate::array::{DeviceArray, IoTicket};
use crate::pool::{BufferPool, IoBuf, PoolConfig};
use crate::tier::{DeviceFence, DeviceMemory, DirectMode, DirectStorage, GpuDevice};
use crate::{Error, Result};

/// Which data path moves device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuPath {
    /// GPUDirect Storage where it runs peer to peer, the pinned bounce otherwise.
    #[default]
    Auto,
    /// GPUDirect Storage (cuFile), also in its compatibility mode; an error where unavailable.
    Gds,
    /// The pinned-host bounce pipeline.
    Bounce,
}

impl std::str::FromStr for GpuPath {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(GpuPath::Auto),
            "gds" => Ok(GpuPath::Gds),
            "bounce" => Ok(GpuPath::Bounce),
            other => Err(Error::InvalidArgument(format!(
                "GPU path `{other}`: expected auto, gds or bounce"
            ))),
        }
    }
}

/// How the store moves device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuIoConfig {
    /// Path selection.
    pub path: GpuPath,
    /// Bounce: bytes per chunk (rounded to whole stripe units).
    pub chunk_bytes: u64,
    /// Bounce: chunks in flight per operation (at least 2: double buffering).
    pub depth: usize,
    /// GDS: threads per array device issuing direct I/O.
    pub gds_threads_per_device: usize,
    /// GDS: largest single direct I/O (pieces longer than this are split).
    pub gds_io_bytes: u64,
}

impl Default for GpuIoConfig {
    /// auto, 16 MiB chunks (4 MiB per device of a 4-device array: whole requests), 6 in flight,
    /// 8 GDS threads per device, 8 MiB direct I/Os.
    fn default() -> Self {
        Self {
            path: GpuPath::Auto,
            chunk_bytes: 16 << 20,
            depth: 6,
            gds_threads_per_device: 8,
            gds_io_bytes: 8 << 20,
        }
    }
}

impl GpuIoConfig {
    /// Check ranges.
    pub fn validate(&self) -> Result<()> {
        if self.depth < 2 || self.depth > 64 {
            return Err(Error::InvalidArgument(format!(
                "GPU pipeline depth {} is outside 2..=64 (at least double buffering)",
                self.depth
            )));
        }
        if self.chunk_bytes < 4096 || self.chunk_bytes > 1 << 30 {
            return Err(Error::InvalidArgument(format!(
                "GPU chunk {} bytes is outside 4 KiB..=1 GiB",
                self.chunk_bytes
            )));
        }
        if self.gds_threads_per_device == 0 || self.gds_threads_per_device > 64 {
            return Err(Error::InvalidArgument(format!(
                "GDS threads per device {} is outside 1..=64",
                self.gds_threads_per_device
            )));
        }
        if self.gds_io_bytes < 4096 {
            return Err(Error::InvalidArgument("GDS I/O size below 4 KiB".into()));
        }
        Ok(())
    }
}

/// The path a device's tensors take, and why.
#[derive(Debug, Clone, Serialize)]
pub struct GpuPathInfo {
    /// "gds" or "bounce".
    pub path: &'static str,
    /// How direct storage reaches the disk, where it was opened.
    pub direct_mode: Option<DirectMode>,
    /// One line a person can read: what was chosen and why.
    pub reason: String,
}

/// Traffic of one path and direction.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PathStats {
    /// Completed operations.
    pub ops: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Sum of operation times, ns.
    pub time_ns: u64,
}

impl PathStats {
    fn add(&mut self, bytes: u64, started: Instant) {
        self.ops += 1;
        self.bytes += bytes;
        self.time_ns += started.elapsed().as_nanos() as u64;
    }
}

/// What the GPU data paths did so far.
#[derive(Debug, Clone, Default, Serialize)]
pub struct GpuStats {
    /// Bounce path, GPU -> SSD.
    pub bounce_write: PathStats,
    /// Bounce path, SSD -> GPU.
    pub bounce_read: PathStats,
    /// GDS path, GPU -> SSD.
    pub gds_write: PathStats,
    /// GDS path, SSD -> GPU.
    pub gds_read: PathStats,
    /// Time spent computing crc32c on the GPU (GDS path), ns, and bytes checksummed.
    pub gpu_crc_ns: u64,
    /// Bytes checksummed on the GPU.
    pub gpu_crc_bytes: u64,
    /// Direct I/O requests issued (GDS path).
    pub direct_ios: u64,
    /// Tensor tails (the last partial block) moved through a host buffer on the GDS path.
    pub tail_bounces: u64,
    /// Host staging memory page-locked for the bounce path, bytes.
    pub pinned_staging_bytes: u64,
}

/// Pinned staging buffers shared by the store's workers: each operation takes `depth` at once
/// (so operations never wait on each other half-way) and gives them back at its end.
struct Staging {
    gpu: Arc<dyn GpuDevice>,
    free: Mutex<Vec<IoBuf>>,
    freed: Condvar,
    pinned: Vec<usize>,
    buf_bytes: usize,
    _pool: Arc<BufferPool>,
}

impl Staging {
    fn new(gpu: Arc<dyn GpuDevice>, count: usize, buf_bytes: usize) -> Result<Arc<Staging>> {
        let pool = BufferPool::new(PoolConfig {
            capacity_bytes: (count * BufferPool::capacity_for(buf_bytes)) as u64,
            ..PoolConfig::default()
        })?;
        let mut bufs = Vec::with_capacity(count);
        let mut pinned = Vec::with_capacity(count);
        let unpin_all = |pinned: &[usize]| {
            for &p in pinned {
                // SAFETY: pinned just above by this device; no copy uses it yet.
                let _ = unsafe { gpu.unpin_host(p as *mut u8) };
            }
        };
        for _ in 0..count {
            let mut b = match pool.alloc(buf_bytes) {
                Ok(b) => b,
                Err(e) => {
                    unpin_all(&pinned);
                    return Err(e);
                }
            };
            // Fault the pages in before they are locked.
            b.as_full_slice_mut().fill(0);
            let cap = b.capacity();
            // SAFETY: the buffer's mapping lives in `pool`, which this struct keeps until Drop,
            // where it is unpinned before the buffers are released.
            if let Err(e) = unsafe { gpu.pin_host(b.as_mut_ptr(), cap) } {
                unpin_all(&pinned);
                return Err(e);
            }
            pinned.push(b.as_mut_ptr() as usize);
            bufs.push(b);
        }
        Ok(Arc::new(Staging {
            gpu,
            free: Mutex::new(bufs),
            freed: Condvar::new(),
            pinned,
            buf_bytes,
            _pool: pool,
        }))
    }

    fn take(&self, n: usize) -> Vec<IoBuf> {
        let mut free = self.free.lock();
        while free.len() < n {
            self.freed.wait(&mut free);
        }
        let at = free.len() - n;
        free.split_off(at)
    }

    fn give(&self, bufs: impl IntoIterator<Item = IoBuf>) {
        self.free.lock().extend(bufs);
        self.freed.notify_all();
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        for &p in &self.pinned {
            // SAFETY: pinned in `new` by this device; every operation returned its buffers
            // (they are all in `free` now), so no copy uses them.
            if let Err(e) = unsafe { self.gpu.unpin_host(p as *mut u8) } {
                crate::notice::warning(format!("unpinning a staging buffer failed: {e}"));
            }
        }
    }
}

/// A countdown of direct I/Os; the first error is kept.
struct Latch {
    state: Mutex<(usize, Option<Error>)>,
    cv: Condvar,
}

impl Latch {
    fn new(n: usize) -> Arc<Latch> {
        Arc::new(Latch { state: Mutex::new((n, None)), cv: Condvar::new() })
    }
    fn done(&self, r: Result<()>) {
        let mut g = self.state.lock();
        if let Err(e) = r {
            g.1.get_or_insert(e);
        }
        g.0 -= 1;
        if g.0 == 0 {
            self.cv.notify_all();
        }
    }
    fn wait(&self) -> Result<()> {
        let mut g = self.state.lock();
        while g.0 > 0 {
            self.cv.wait(&mut g);
        }
        g.1.take().map_or(Ok(()), Err)
    }
}

struct Job {
    write: bool,
    file: u32,
    base: u64,
    buf_offset: u64,
    len: usize,
    offset: u64,
    latch: Arc<Latch>,
}

/// Direct storage with its threads: per array device, `threads` threads take that device's
/// requests from one queue, so every device's requests are in flight at once.
pub(crate) struct DirectPool {
    direct: Arc<dyn DirectStorage>,
    queues: Vec<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl DirectPool {
    fn new(direct: Arc<dyn DirectStorage>, devices: u32, threads: usize) -> Result<DirectPool> {
        let mut queues = Vec::new();
        let mut handles = Vec::new();
        for d in 0..devices {
            let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
            queues.push(tx);
            for t in 0..threads {
                let rx = rx.clone();
                let direct = direct.clone();
                let h = std::thread::Builder::new()
                    .name(format!("teraio-gds-{d}.{t}"))
                    .spawn(move || {
                        let bound = direct.bind_thread();
                        while let Ok(job) = rx.recv() {
                            let r = match &bound {
                                Err(e) => Err(Error::Unsupported(format!(
                                    "direct I/O thread could not bind to the device: {e}"
                                ))),
                                // SAFETY: the submitter keeps the device memory alive and
                                // unused by others until the latch reaches zero (it waits).
                                Ok(()) if job.write => unsafe {
                                    direct.write(
                                        job.file,
                                        job.base,
                                        job.buf_offset,
                                        job.len,
                                        job.offset,
                                    )
                                },
                                // SAFETY: as above.
                                Ok(()) => unsafe {
                                    direct.read(
                                        job.file,
                                        job.base,
                                        job.buf_offset,
                                        job.len,
                                        job.offset,
                                    )
                                },
                            };
                            job.latch.done(r);
                        }
                    })
                    .map_err(|e| Error::Os {
                        context: "spawning a GDS thread".into(),
                        source: e,
                    })?;
                handles.push(h);
            }
        }
        Ok(DirectPool { direct, queues, threads: handles })
    }
}

impl Drop for DirectPool {
    fn drop(&mut self) {
        self.queues.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[derive(Clone)]
pub(crate) enum Route {
    Bounce,
    Gds(Arc<DirectPool>),
}

/// Choose the path for `requested` given what opening direct storage gave.
pub fn select_path(
    requested: GpuPath,
    direct: &Result<DirectMode>,
) -> Result<(&'static str, String)> {
    match (requested, direct) {
        (GpuPath::Bounce, _) => Ok(("bounce", "bounce path requested".into())),
        (GpuPath::Gds, Ok(m)) => {
            Ok(("gds", format!("GPUDirect Storage requested; cuFile {}", m.describe())))
        }
        (GpuPath::Gds, Err(e)) => Err(Error::Unsupported(format!(
            "GPUDirect Storage was requested but is not available: {e}"
        ))),
        (GpuPath::Auto, Ok(DirectMode::P2p)) => {
            Ok(("gds", "auto: GPUDirect Storage runs peer to peer (nvidia-fs)".into()))
        }
        (GpuPath::Auto, Ok(m)) => Ok((
            "bounce",
            format!(
                "auto: cuFile would run in {}, so the pinned bounce pipeline moves the bytes \
                 (it overlaps PCIe and SSD itself); --gpu-path gds forces cuFile",
                m.describe()
            ),
        )),
        (GpuPath::Auto, Err(e)) => {
            Ok(("bounce", format!("auto: no GPUDirect Storage ({e}); pinned bounce pipeline")))
        }
    }
}

/// The GPU side of a store: configuration, staging buffers, direct storage per device.
pub(crate) struct GpuState {
    config: GpuIoConfig,
    workers: usize,
    staging: Mutex<HashMap<String, Arc<Staging>>>,
    routes: Mutex<HashMap<String, (Route, GpuPathInfo)>>,
    stats: Mutex<GpuStats>,
}

/// Operations that hold staging buffers at once (per device).
const MAX_STAGED_OPS: usize = 8;

/// Lock a route decision for one device: opening cuFile happens once.
static ROUTE_LOCK: Mutex<()> = Mutex::new(());

impl GpuState {
    pub(crate) fn new(config: GpuIoConfig, workers: usize) -> Result<GpuState> {
        config.validate()?;
        Ok(GpuState {
            config,
            workers,
            staging: Mutex::new(HashMap::new()),
            routes: Mutex::new(HashMap::new()),
            stats: Mutex::new(GpuStats::default()),
        })
    }

    pub(crate) fn stats(&self) -> GpuStats {
        self.stats.lock().clone()
    }

    fn staging(&self, rt: &Arc<dyn GpuDevice>, chunk: u64) -> Result<Arc<Staging>> {
        let key = rt.name();
        if let Some(s) = self.staging.lock().get(&key)
            && s.buf_bytes as u64 >= chunk
        {
            return Ok(s.clone());
        }
        let _g = ROUTE_LOCK.lock();
        if let Some(s) = self.staging.lock().get(&key)
            && s.buf_bytes as u64 >= chunk
        {
            return Ok(s.clone());
        }
        // At most 8 operations pipeline through staging at once (each has `depth` chunks in
        // flight, plenty for PCIe and the array); more would only pin more host memory.
        let count = self.workers.min(MAX_STAGED_OPS) * self.config.depth;
        let s = Staging::new(rt.clone(), count, chunk as usize)?;
        self.stats.lock().pinned_staging_bytes += (count * s.buf_bytes) as u64;
        self.staging.lock().insert(key, s.clone());
        Ok(s)
    }

    fn route(&self, array: &Arc<DeviceArray>, rt: &Arc<dyn GpuDevice>) -> Result<Route> {
        self.route_info(array, rt).map(|(r, _)| r)
    }

    /// The path of `rt`'s tensors on `array` (decided, and cuFile opened, on first use).
    pub(crate) fn route_info(
        &self,
        array: &Arc<DeviceArray>,
        rt: &Arc<dyn GpuDevice>,
    ) -> Result<(Route, GpuPathInfo)> {
        let key = rt.name();
        if let Some(r) = self.routes.lock().get(&key) {
            return Ok(r.clone());
        }
        let _g = ROUTE_LOCK.lock();
        if let Some(r) = self.routes.lock().get(&key) {
            return Ok(r.clone());
        }
        let direct = if self.config.path == GpuPath::Bounce {
            Err(Error::Unsupported("not opened (bounce requested)".into()))
        } else {
            match array.device_paths() {
                Some(paths) => rt.direct_storage(&paths),
                None => Err(Error::Unsupported(
                    "the array has simulated disks (direct storage needs files or block devices)"
                        .into(),
                )),
            }
        };
        let mode = direct.as_ref().map(|d| d.mode()).map_err(|e| Error::Unsupported(e.to_string()));
        let (path, reason) = select_path(self.config.path, &mode)?;
        let route = match (path, direct) {
            ("gds", Ok(d)) => Route::Gds(Arc::new(DirectPool::new(
                d,
                array.device_count(),
                self.config.gds_threads_per_device,
            )?)),
            _ => Route::Bounce,
        };
        let info = GpuPathInfo { path, direct_mode: mode.ok(), reason };
        self.routes.lock().insert(key, (route.clone(), info.clone()));
        Ok((route, info))
    }

    /// Write device memory `mem` to its fresh extents `map`; the crc32c per stripe unit when
    /// `checksums`.
    pub(crate) fn write(
        &self,
        array: &Arc<DeviceArray>,
        tail_pool: &Arc<BufferPool>,
        map: &StripeMap,
        mem: &dyn DeviceMemory,
        checksums: bool,
    ) -> Result<Vec<u32>> {
        if let Some(f) = mem.ready() {
            f.wait()?;
        }
        let started = Instant::now();
        let size = map.size_bytes();
        match self.route(array, mem.gpu())? {
            Route::Bounce => {
                let r = self.bounce_write(array, map, mem, checksums);
                if r.is_ok() {
                    self.stats.lock().bounce_write.add(size, started);
                }
                r
            }
            Route::Gds(pool) => {
                let r = self.gds_write(array, tail_pool, &pool, map, mem, checksums);
                if r.is_ok() {
                    self.stats.lock().gds_write.add(size, started);
                }
                r
            }
        }
    }

    /// Read extents `map` into device memory `mem` and verify `checksums` (empty: none).
    pub(crate) fn read(
        &self,
        array: &Arc<DeviceArray>,
        tail_pool: &Arc<BufferPool>,
        map: &StripeMap,
        mem: &mut dyn DeviceMemory,
        checksums: &[u32],
        tensor: &str,
    ) -> Result<()> {
        if let Some(f) = mem.ready() {
            f.wait()?;
        }
        mem.set_ready(None);
        let started = Instant::now();
        let size = map.size_bytes();
        let fence = match self.route(array, mem.gpu())? {
            Route::Bounce => {
                let f = self.bounce_read(array, map, &*mem, checksums, tensor)?;
                self.stats.lock().bounce_read.add(size, started);
                f
            }
            Route::Gds(pool) => {
                let f = self.gds_read(array, tail_pool, &pool, map, &*mem, checksums, tensor)?;
                self.stats.lock().gds_read.add(size, started);
                f
            }
        };
        mem.set_ready(Some(fence));
        Ok(())
    }

    fn chunk_bytes(&self, map: &StripeMap) -> u64 {
        let unit = map.unit_bytes();
        self.config.chunk_bytes.div_ceil(unit).max(1) * unit
    }

    fn bounce_write(
        &self,
        array: &Arc<DeviceArray>,
        map: &StripeMap,
        mem: &dyn DeviceMemory,
        checksums: bool,
    ) -> Result<Vec<u32>> {
        let size = map.size_bytes();
        let unit = map.unit_bytes();
        let chunk = self.chunk_bytes(map);
        let chunks = size.div_ceil(chunk);
        let staging = self.staging(mem.gpu(), chunk)?;
        let depth = self.config.depth.min(chunks as usize).max(1);
        let bufs = staging.take(depth);
        let mut free: VecDeque<IoBuf> = bufs.into();
        let mut copying: VecDeque<(u64, IoBuf, Box<dyn DeviceFence>)> = VecDeque::new();
        let mut writing: VecDeque<IoTicket> = VecDeque::new();
        let mut crcs = vec![0u32; if checksums { size.div_ceil(unit) as usize } else { 0 }];
        let mut first_err: Option<Error> = None;
        let mut next = 0u64;
        let base = mem.device_ptr();
        let mut queue = match mem.gpu().copy_queue() {
            Ok(q) => q,
            Err(e) => {
                staging.give(free);
                return Err(e);
            }
        };
        loop {
            // Writes that finished give their buffers back.
            while writing.front().is_some_and(IoTicket::is_done) {
                let (b, r) = writing.pop_front().expect("checked").wait();
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
                free.push_back(b);
            }
            // Start device-to-host copies into every free buffer.
            while first_err.is_none() && next < chunks && !free.is_empty() {
                let mut b = free.pop_front().expect("checked");
                let off = next * chunk;
                let len = chunk.min(size - off) as usize;
                // SAFETY: `b` (pinned, `chunk` bytes of capacity) stays owned by `copying` until
                // its fence completed; the device range lies inside `mem` (off + len <= size).
                let queued = unsafe { queue.device_to_host(base + off, b.as_mut_ptr(), len) }
                    .and_then(|()| queue.fence());
                match queued {
                    Ok(f) => copying.push_back((next, b, f)),
                    Err(e) => {
                        first_err = Some(e);
                        free.push_back(b);
                    }
                }
                next += 1;
            }
            // The oldest copy: wait, checksum, write.
            if let Some((c, mut b, f)) = copying.pop_front() {
                if let Err(e) = f.wait() {
                    first_err.get_or_insert(e);
                }
                if first_err.is_some() {
                    free.push_back(b);
                    continue;
                }
                let off = c * chunk;
                let len = chunk.min(size - off);
                if checksums {
                    let first = (off / unit) as usize;
                    for (i, piece) in
                        b.as_full_slice_mut()[..len as usize].chunks(unit as usize).enumerate()
                    {
                        crcs[first + i] = crc32c::crc32c(piece);
                    }
                }
                let padded = len.next_multiple_of(u64::from(map.block_bytes()));
                b.set_len(padded as usize);
                writing.push_back(array.write_tensor(map, off..off + len, b));
                continue;
            }
            // Nothing to copy: wait for the oldest write.
            if let Some(t) = writing.pop_front() {
                let (b, r) = t.wait();
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
                free.push_back(b);
                continue;
            }
            break;
        }
        debug_assert!(copying.is_empty() && writing.is_empty());
        staging.give(free);
        match first_err {
            Some(e) => Err(e),
            None => Ok(crcs),
        }
    }

    fn bounce_read(
        &self,
        array: &Arc<DeviceArray>,
        map: &StripeMap,
        mem: &dyn DeviceMemory,
        checksums: &[u32],
        tensor: &str,
    ) -> Result<Box<dyn DeviceFence>> {
        let size = map.size_bytes();
        let unit = map.unit_bytes();
        let chunk = self.chunk_bytes(map);
        let chunks = size.div_ceil(chunk);
        let staging = self.staging(mem.gpu(), chunk)?;
        let depth = self.config.depth.min(chunks as usize).max(1);
        let mut free: VecDeque<IoBuf> = staging.take(depth).into();
        let mut reading: VecDeque<(u64, IoTicket)> = VecDeque::new();
        let mut copying: VecDeque<(IoBuf, Box<dyn DeviceFence>)> = VecDeque::new();
        let mut first_err: Option<Error> = None;
        let mut next = 0u64;
        let mut last_fence: Option<Box<dyn DeviceFence>> = None;
        let base = mem.device_ptr();
        let mut queue = match mem.gpu().copy_queue() {
            Ok(q) => q,
            Err(e) => {
                staging.give(free);
                return Err(e);
            }
        };
        loop {
            while copying.front().is_some_and(|(_, f)| f.is_done()) {
                let (b, f) = copying.pop_front().expect("checked");
                if let Err(e) = f.wait() {
                    first_err.get_or_insert(e);
                }
                free.push_back(b);
                last_fence = Some(f);
            }
            while first_err.is_none() && next < chunks && !free.is_empty() {
                let mut b = free.pop_front().expect("checked");
                let off = next * chunk;
                let len = chunk.min(size - off);
                b.set_len(len.next_multiple_of(u64::from(map.block_bytes())) as usize);
                reading.push_back((next, array.read_tensor(map, off..off + len, b)));
                next += 1;
            }
            if let Some((c, t)) = reading.pop_front() {
                let (b, r) = t.wait();
                if let Err(e) = r {
                    first_err.get_or_insert(e);
                }
                if first_err.is_some() {
                    free.push_back(b);
                    continue;
                }
                let off = c * chunk;
                let len = chunk.min(size - off);
                if !checksums.is_empty() {
                    let first = (off / unit) as usize;
                    for (i, piece) in b[..len as usize].chunks(unit as usize).enumerate() {
                        let computed = crc32c::crc32c(piece);
                        let stored = checksums[first + i];
                        if computed != stored {
                            first_err.get_or_insert(Error::ChecksumMismatch {
                                tensor: tensor.to_string(),
                                offset: (first + i) as u64 * unit,
                                stored,
                                computed,
                            });
                            break;
                        }
                    }
                    if first_err.is_some() {
                        free.push_back(b);
                        continue;
                    }
                }
                // SAFETY: `b` stays owned by `copying` until its fence completed; the device
                // range lies inside `mem`, which the caller owns exclusively.
                let queued = unsafe { queue.host_to_device(b.as_ptr(), base + off, len as usize) }
                    .and_then(|()| queue.fence());
                match queued {
                    Ok(f) => copying.push_back((b, f)),
                    Err(e) => {
                        first_err.get_or_insert(e);
                        free.push_back(b);
                    }
                }
                continue;
            }
            if let Some((b, f)) = copying.pop_front() {
                if let Err(e) = f.wait() {
                    first_err.get_or_insert(e);
                }
                free.push_back(b);
                last_fence = Some(f);
                continue;
            }
            break;
        }
        staging.give(free);
        if let Some(e) = first_err {
            return Err(e);
        }
        match last_fence {
            Some(f) => Ok(f),
            None => queue.fence(),
        }
    }

    /// The direct I/Os that move `[0, full)` of the tensor: (device, device offset, tensor
    /// offset, length), each at most `gds_io_bytes`.
    fn direct_pieces(&self, map: &StripeMap, full: u64) -> Result<Vec<(u32, u64, u64, u64)>> {
        let mut out = Vec::new();
        if full == 0 {
            return Ok(out);
        }
        let max = self.config.gds_io_bytes;
        for s in map.segments(0..full, u64::MAX / 2)? {
            let mut dev_off = s.device_offset;
            for p in &s.pieces {
                let mut done = 0;
                while done < p.len {
                    let n = (p.len - done).min(max);
                    out.push((s.device, dev_off + done, p.buf_offset + done, n));
                    done += n;
                }
                dev_off += p.len;
            }
        }
        Ok(out)
    }

    fn run_direct(
        &self,
        pool: &DirectPool,
        write: bool,
        base: u64,
        pieces: &[(u32, u64, u64, u64)],
    ) -> Result<()> {
        let latch = Latch::new(pieces.len());
        for &(dev, dev_off, off, len) in pieces {
            let job = Job {
                write,
                file: dev,
                base,
                buf_offset: off,
                len: len as usize,
                offset: dev_off,
                latch: latch.clone(),
            };
            if let Err(e) = pool.queues[dev as usize].send(job) {
                e.0.latch.done(Err(Error::Closed("GDS threads")));
            }
        }
        self.stats.lock().direct_ios += pieces.len() as u64;
        latch.wait()
    }

    fn gpu_crcs(&self, mem: &dyn DeviceMemory, size: u64, unit: u64) -> Result<Vec<u32>> {
        let t = Instant::now();
        // SAFETY: `[ptr, ptr + size)` is the tensor's live device memory; nobody writes it
        // while the store owns it.
        let c = unsafe { mem.gpu().crc32c_units(mem.device_ptr(), size, unit)? };
        let mut st = self.stats.lock();
        st.gpu_crc_ns += t.elapsed().as_nanos() as u64;
        st.gpu_crc_bytes += size;
        Ok(c)
    }

    fn gds_write(
        &self,
        array: &Arc<DeviceArray>,
        tail_pool: &Arc<BufferPool>,
        pool: &DirectPool,
        map: &StripeMap,
        mem: &dyn DeviceMemory,
        checksums: bool,
    ) -> Result<Vec<u32>> {
        pool.direct.prepare(mem);
        let size = map.size_bytes();
        let unit = map.unit_bytes();
        let block = u64::from(map.block_bytes());
        let full = size / block * block;
        let pieces = self.direct_pieces(map, full)?;
        // The tail block: copy to host, pad, write with the array's own I/O, while the direct
        // writes run.
        let tail = if full < size {
            let (dev, off) = map.locate(full)?;
            let mut b = tail_pool.alloc(block as usize)?;
            b.fill(0);
            let n = (size - full) as usize;
            let mut q = mem.gpu().copy_queue()?;
            // SAFETY: `b` outlives the fence wait below; the range is the tensor's last bytes.
            unsafe { q.device_to_host(mem.device_ptr() + full, b.as_mut_ptr(), n)? };
            q.fence()?.wait()?;
            self.stats.lock().tail_bounces += 1;
            Some(array.write_at(dev, off, b)?)
        } else {
            None
        };
        // The GPU checksums the tensor while the direct writes read it (both only read).
        let (crcs, r) = std::thread::scope(|s| {
            let crc = checksums.then(|| s.spawn(|| self.gpu_crcs(mem, size, unit)));
            let r = self.run_direct(pool, true, mem.device_ptr(), &pieces);
            let crcs = match crc {
                Some(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(Error::Cuda("the crc32c thread panicked".into()))),
                None => Ok(Vec::new()),
            };
            (crcs, r)
        });
        if let Some(t) = tail {
            t.wait().1?;
        }
        r?;
        crcs
    }

    #[allow(clippy::too_many_arguments)]
    fn gds_read(
        &self,
        array: &Arc<DeviceArray>,
        tail_pool: &Arc<BufferPool>,
        pool: &DirectPool,
        map: &StripeMap,
        mem: &dyn DeviceMemory,
        checksums: &[u32],
        tensor: &str,
    ) -> Result<Box<dyn DeviceFence>> {
        pool.direct.prepare(mem);
        let size = map.size_bytes();
        let unit = map.unit_bytes();
        let block = u64::from(map.block_bytes());
        let full = size / block * block;
        let pieces = self.direct_pieces(map, full)?;
        let tail = if full < size {
            let (dev, off) = map.locate(full)?;
            let b = tail_pool.alloc(block as usize)?;
            Some(array.read_at(dev, off, b)?)
        } else {
            None
        };
        let r = self.run_direct(pool, false, mem.device_ptr(), &pieces);
        let mut q = mem.gpu().copy_queue()?;
        if let Some(t) = tail {
            let (b, tr) = t.wait();
            tr?;
            r?;
            let n = (size - full) as usize;
            // SAFETY: `b` outlives the fence wait below; the range is the tensor's last bytes.
            unsafe { q.host_to_device(b.as_ptr(), mem.device_ptr() + full, n)? };
            q.fence()?.wait()?;
            self.stats.lock().tail_bounces += 1;
        } else {
            r?;
        }
        if !checksums.is_empty() {
            let computed = self.gpu_crcs(mem, size, unit)?;
            if computed.len() != checksums.len() {
                return Err(Error::Corruption(format!(
                    "tensor {tensor}: {} checksums recorded for {} units",
                    checksums.len(),
                    computed.len()
                )));
            }
            if let Some((i, (&c, &s))) =
                computed.iter().zip(checksums).enumerate().find(|(_, (c, s))| c != s)
            {
                return Err(Error::ChecksumMismatch {
                    tensor: tensor.to_string(),
                    offset: i as u64 * unit,
                    stored: s,
                    computed: c,
                });
            }
        }
        q.fence()
    }
}
