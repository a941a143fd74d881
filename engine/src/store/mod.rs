//! The tensor store: offload tensors to the SSD array (or the host tier), prefetch them back,
//! free them; asynchronously, in order per tensor, checksummed, never losing data.
//!
//! ```text
//! offload(id, src) ──► per-tensor queue ──► priority channel ──► worker
//!                                                   │  allocate extents, crc32c per unit,
//!                                                   │  striped O_DIRECT write, (journal)
//!                                                   ▼
//!                                 src released only now; Handle completes
//! ```
//!
//! Contracts:
//! - Operations on one tensor apply in issue order.
//! - A prefetch moves the tensor back to the caller. In a volatile store (the default) the store
//!   then forgets the content: its SSD extents or host-tier memory are released, and the tensor
//!   must be offloaded again before the next prefetch. A persistent store, or one configured with
//!   `retain_on_prefetch`, keeps the SSD copy until the tensor is offloaded again or freed (so a
//!   caller can drop an unmodified tensor without writing it).
//! - In a volatile, non-retaining store, a prefetch issued while the tensor's offload is still
//!   queued (not yet started) cancels that offload and completes at once from its source memory;
//!   every older copy of the tensor is then forgotten (after the operations still ahead of it).
//! - A prefetch returns the newest version offloaded before it, or an error naming the tensor,
//!   never an older version: a failed offload's held source supersedes every older copy (a
//!   persistent store keeps its older SSD copy as the durable version, what a reopen finds, but
//!   does not read it in this session).
//! - Persistent mode: extents of freed or overwritten tensors become reusable at the next
//!   checkpoint; an allocation that finds no space while such extents wait writes one and retries.
//! - The source memory of an offload is released only after the write completed (and, in
//!   persistent mode, after the journal record naming the tensor is durable). A failed offload
//!   leaves the tensor held by the store ([`Location::Held`]); a later prefetch returns it.
//! - A prefetch verifies the crc32c of every chunk (stripe unit) it read; a mismatch is
//!   [`Error::ChecksumMismatch`] naming the tensor, never bad data.

mod faults;
mod gpu;
mod key;
mod persist;
mod stats;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Mutex, RwLockReadGuard};
use serde::Serialize;
use teraio_allocator::{ArrayAllocator, ArrayStats, ExtentAllocator};
use teraio_layout::StripeMap;
use teraio_layout::format::RecordBody;

use crate::array::DeviceArray;
use crate::pool::{BufferPool, IoBuf, PoolConfig};
use crate::queue::{Budget, Handle, Priority, Queues, Slot};
use crate::tier::{DeviceFence, GpuDevice, MemoryTier, TensorMem};
use crate::{Error, Result};

pub use gpu::{GpuIoConfig, GpuPath, GpuPathInfo, GpuStats, PathStats, select_path};
pub use key::TensorKey;
pub use persist::{DeviceMeta, Persistence, StoreMeta, TensorMeta};
pub use stats::{DirectionStats, QueueWaitStats, StoreStats, diff_stats};

/// Where an offload should put the tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Default)]
pub enum Destination {
    /// The SSD array.
    #[default]
    Ssd,
    /// The host-memory tier (falls back to SSD when the tier is full or absent).
    Host,
}

/// Where a tensor is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Location {
    /// In the caller's memory only (never offloaded, or prefetched back without a store copy).
    Caller,
    /// An offload is queued or running.
    Offloading,
    /// A prefetch is queued or running.
    Prefetching,
    /// On the SSD array.
    OnSsd,
    /// In the host tier.
    InHost,
    /// In memory held by the store: the source of a failed offload.
    Held,
}

/// What an offload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum OffloadOutcome {
    /// Written to the SSD array (durable when the store is persistent).
    OnSsd,
    /// Copied to the host tier.
    InHost,
    /// Cancelled by a later prefetch before it started; the data went straight to that prefetch.
    Cancelled,
}

/// Options of one offload.
#[derive(Debug, Clone, Default)]
pub struct OffloadOptions {
    /// SSD or host tier.
    pub destination: Destination,
    /// Queue priority.
    pub priority: Priority,
    /// A name recorded with the tensor (persistent stores look tensors up by name after reopen).
    pub name: Option<String>,
}

/// What the store knows of one tensor.
#[derive(Debug, Clone, Serialize)]
pub struct TensorInfo {
    /// Id.
    pub id: TensorKey,
    /// Name, when one was given.
    pub name: Option<String>,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Current location.
    pub location: Location,
    /// Where it lives on the array, when it has an SSD copy.
    pub stripe_map: Option<StripeMap>,
    /// Number of crc32c-checksummed chunks of the SSD copy.
    pub checksummed_chunks: usize,
    /// Whether the host tier holds a copy.
    pub host_copy: bool,
    /// Operations queued or running.
    pub pending_ops: usize,
}

/// How a tensor store is set up.
pub struct StoreConfig {
    /// The SSD array.
    pub array: Arc<DeviceArray>,
    /// The host tier used as a second offload destination (None: SSD only).
    pub host_tier: Option<Arc<dyn MemoryTier>>,
    /// Compute and verify crc32c per chunk (turn off only for benchmarks).
    pub checksums: bool,
    /// Worker threads of the migration engine.
    pub workers: usize,
    /// Bytes that may be in flight (being read or written) at once.
    pub inflight_bytes_max: u64,
    /// Operations that may be queued at once; further calls block (backpressure).
    pub queued_ops_max: u64,
    /// Persistent mode: metadata journal + checkpoints, reopenable after a crash.
    pub persistent: bool,
    /// Keep a tensor's SSD copy after a prefetch (a persistent store always does), so a caller
    /// that did not modify the tensor can release its memory later without writing it again.
    /// Cancellation of queued offloads by a prefetch is then off (the copy must stay current).
    pub retain_on_prefetch: bool,
    /// Allocation unit of the extent allocator (a power of two >= 4 KiB).
    pub alloc_unit_bytes: u64,
    /// How device (GPU) memory moves: path (auto, gds, bounce) and pipeline sizes.
    pub gpu: GpuIoConfig,
}

impl StoreConfig {
    /// Defaults for an array: checksums on, 4 workers, 1 GiB in flight, volatile.
    pub fn new(array: Arc<DeviceArray>) -> Self {
        Self {
            array,
            host_tier: None,
            checksums: true,
            workers: 4,
            inflight_bytes_max: 1 << 30,
            queued_ops_max: 1 << 16,
            persistent: false,
            retain_on_prefetch: false,
            alloc_unit_bytes: 1 << 20,
            gpu: GpuIoConfig::default(),
        }
    }
}

/// The durable copy of a tensor on the array.
#[derive(Debug, Clone)]
pub(crate) struct SsdCopy {
    pub(crate) map: StripeMap,
    pub(crate) chunk_bytes: u64,
    pub(crate) checksums: Vec<u32>,
}

/// A fence recorded now on the caller's `stream`, on the device of `mem` (device memory only).
fn device_fence(id: TensorKey, mem: &TensorMem, stream: u64) -> Result<Box<dyn DeviceFence>> {
    match mem.device() {
        Some(dev) => dev.gpu().record_on_stream(stream),
        None => Err(Error::InvalidArgument(format!(
            "tensor {id}: ordering after a CUDA stream needs device memory, not {mem:?}"
        ))),
    }
}

/// What a request queued on one tensor does.
enum RequestKind {
    Offload {
        src: Option<TensorMem>,
        destination: Destination,
        name: Option<String>,
        /// Wait on this fence (recorded on the caller's stream) before reading `src`.
        after: Option<Box<dyn DeviceFence>>,
        /// Device memory to the host tier: queue the copy on the device after `after` and
        /// finish without waiting for it (`src` comes back with the copy as its ready fence).
        queued: bool,
    },
    Prefetch {
        dst: Option<TensorMem>,
        /// Wait on this fence (recorded on the caller's stream) before writing `dst`: memory a
        /// caching allocator just handed out may still be read by the caller's queued work.
        after: Option<Box<dyn DeviceFence>>,
    },
    Free,
    /// Forget every copy the tensor has once the operations before it finished: queued by a
    /// prefetch that cancelled the newest offload and took its data (the copies older
    /// operations leave are older versions, never to be read again).
    Discard,
}

enum Done {
    Offload(Arc<Slot<OffloadOutcome>>),
    OffloadKeep(Arc<Slot<(OffloadOutcome, TensorMem)>>),
    Prefetch(Arc<Slot<TensorMem>>),
    Free(Arc<Slot<()>>),
    /// Nobody waits for it (a [`RequestKind::Discard`]).
    Discard,
}

/// One request on a tensor's queue (an offload, a prefetch, a free, a discard): the store's
/// workers run a tensor's requests in issue order.
struct Request {
    kind: RequestKind,
    priority: Priority,
    enqueued: Instant,
    done: Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Active {
    Idle,
    Dispatched,
    Running,
}

/// A tensor's copy in the host tier. A prefetch into device memory copies it asynchronously
/// (the worker does not wait for the GPU): the copy's fences are kept here, and a copy dropped
/// while one is still reading it goes to the store's [`Graveyard`] instead of back to the tier.
struct HostCopy {
    mem: Option<TensorMem>,
    readers: Vec<Box<dyn DeviceFence>>,
    /// The copy from device memory that writes it, while queued on the device (an offload from
    /// device memory does not wait for it): readers wait for it first.
    written: Option<Box<dyn DeviceFence>>,
    graveyard: Arc<Graveyard>,
}

impl HostCopy {
    fn new(mem: TensorMem, graveyard: Arc<Graveyard>) -> Self {
        Self { mem: Some(mem), readers: Vec::new(), written: None, graveyard }
    }

    /// A copy whose bytes arrive when `written` completes.
    fn being_written(
        mem: TensorMem,
        written: Box<dyn DeviceFence>,
        graveyard: Arc<Graveyard>,
    ) -> Self {
        Self { mem: Some(mem), readers: Vec::new(), written: Some(written), graveyard }
    }

    /// The fence of the copy still writing it, if any (cleared once it is done).
    fn pending_write(&mut self) -> Option<&dyn DeviceFence> {
        if self.written.as_ref().is_some_and(|w| w.is_done()) {
            self.written = None;
        }
        self.written.as_deref()
    }

    /// Copy into `dst`: host memory to device memory queued without blocking (the copy waits on
    /// the device for `dst`'s ready fence, `dst`'s ready fence becomes the copy's); anything
    /// else synchronously.
    fn copy_into(&mut self, dst: &mut TensorMem) -> Result<()> {
        self.pending_write();
        let mem = self.mem.as_ref().expect("a live host copy holds its memory");
        match (mem.host(), dst) {
            (Some(src), TensorMem::Device(d)) => {
                // SAFETY: `src` is this copy's memory, written only by the offload that made it
                // (`written`, which the copy waits for on the device); it is released only once
                // `f` completed (kept in `readers`, then the graveyard).
                let f = unsafe {
                    crate::tier::device::copy_in_async(d.as_mut(), src, self.written.as_deref())?
                };
                self.readers.retain(|r| !r.is_done());
                self.readers.push(f);
                Ok(())
            }
            (_, dst) => {
                if let Some(w) = &self.written {
                    w.wait()?;
                }
                mem.copy_into(dst)
            }
        }
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        self.readers.retain(|r| !r.is_done());
        // A copy still writing the memory keeps it from the tier like a reader does.
        if let Some(w) = self.written.take()
            && !w.is_done()
        {
            self.readers.push(w);
        }
        if let Some(mem) = self.mem.take()
            && !self.readers.is_empty()
        {
            self.graveyard.bury(std::mem::take(&mut self.readers), mem);
        }
    }
}

/// Host-tier memory whose copy was dropped while asynchronous copies to the GPU still read it:
/// released once they complete (reaped before the tier allocates, drained when it is full, and
/// waited for when the store closes).
#[derive(Default)]
struct Graveyard(Mutex<Vec<Buried>>);

/// Memory and the copies still reading it.
type Buried = (Vec<Box<dyn DeviceFence>>, TensorMem);

impl Graveyard {
    fn bury(&self, readers: Vec<Box<dyn DeviceFence>>, mem: TensorMem) {
        self.0.lock().push((readers, mem));
    }

    /// Release the memory no copy reads any more; returns how many bytes.
    fn reap(&self) -> u64 {
        let done: Vec<Buried> = {
            let mut g = self.0.lock();
            let (done, pending) = std::mem::take(&mut *g)
                .into_iter()
                .partition(|(r, _): &Buried| r.iter().all(|f| f.is_done()));
            *g = pending;
            done
        };
        done.iter().map(|(_, m)| m.len()).sum()
    }

    /// Wait for every copy still reading buried memory, then release it all; returns how many
    /// bytes.
    fn drain(&self) -> Result<u64> {
        let all = std::mem::take(&mut *self.0.lock());
        let bytes = all.iter().map(|(_, m)| m.len()).sum();
        let mut first = None;
        for (readers, mem) in all {
            for f in &readers {
                if let Err(e) = f.wait() {
                    first.get_or_insert(e);
                }
            }
            drop(mem);
        }
        first.map_or(Ok(bytes), Err)
    }

    /// Buried memory, bytes.
    fn bytes(&self) -> u64 {
        self.0.lock().iter().map(|(_, m)| m.len()).sum()
    }
}

impl Drop for Graveyard {
    fn drop(&mut self) {
        if let Err(e) = self.drain() {
            crate::notice::error(format!("waiting for copies from the host tier failed: {e}"));
        }
    }
}

struct Entry {
    size: u64,
    name: Option<String>,
    ssd: Option<SsdCopy>,
    /// Persistent mode: `ssd` is an older version than the newest one offloaded (whose write
    /// failed). It stays in the table, and on the array, as the tensor's durable version (what
    /// a reopen finds) but is never read in this session.
    ssd_superseded: bool,
    host: Option<HostCopy>,
    held: Option<TensorMem>,
    queue: VecDeque<Request>,
    active: Active,
}

impl Entry {
    fn new(size: u64) -> Self {
        Self {
            size,
            name: None,
            ssd: None,
            ssd_superseded: false,
            host: None,
            held: None,
            queue: VecDeque::new(),
            active: Active::Idle,
        }
    }

    fn location(&self) -> Location {
        match self.queue.front().map(|o| &o.kind) {
            Some(RequestKind::Offload { .. }) => Location::Offloading,
            Some(RequestKind::Prefetch { .. }) => Location::Prefetching,
            // The copies left are older than the version a prefetch took: about to go.
            Some(RequestKind::Discard) => Location::Caller,
            _ if self.held.is_some() => Location::Held,
            _ if self.host.is_some() => Location::InHost,
            _ if self.readable_ssd().is_some() => Location::OnSsd,
            _ => Location::Caller,
        }
    }

    /// The SSD copy, unless a newer version superseded it.
    fn readable_ssd(&self) -> Option<&SsdCopy> {
        self.ssd.as_ref().filter(|_| !self.ssd_superseded)
    }

    /// Whether a prefetch has a copy of the newest version to read.
    fn has_copy(&self) -> bool {
        self.readable_ssd().is_some() || self.host.is_some() || self.held.is_some()
    }

    /// Why a prefetch finds nothing to read, for an error naming the tensor.
    fn no_copy_detail(&self) -> String {
        if self.ssd_superseded {
            "its newest version is not in the store (its offload failed, and a prefetch or \
             take_held already took the memory the store held); the SSD copy is an older version \
             and is not returned: offload the tensor again"
                .into()
        } else {
            "it has no copy in the store to prefetch (never offloaded, freed, or already taken \
             back by a prefetch: a volatile store hands a tensor back and forgets it): offload it \
             again first"
                .into()
        }
    }
}

struct Inner {
    array: Arc<DeviceArray>,
    host_tier: Option<Arc<dyn MemoryTier>>,
    checksums: bool,
    table: Mutex<HashMap<TensorKey, Entry>>,
    alloc: Mutex<ArrayAllocator>,
    queues: Queues,
    inflight: Budget,
    queued: Budget,
    staging: Arc<BufferPool>,
    stats: Mutex<StoreStats>,
    persist: Option<Persistence>,
    retain: bool,
    gpu: gpu::GpuState,
    graveyard: Arc<Graveyard>,
}

/// The tensor store. Cheap to share (`Arc`); dropping the last handle drains the queues, stops
/// the workers and (in persistent mode) writes a checkpoint.
pub struct TensorStore {
    inner: Arc<Inner>,
    workers: Vec<JoinHandle<()>>,
}

impl TensorStore {
    /// Open a store over `config.array`: a fresh one, or, in persistent mode, the one already on
    /// the array (its tensors are readable again).
    pub fn open(config: StoreConfig) -> Result<Self> {
        if config.workers == 0 {
            return Err(Error::InvalidArgument("a store needs at least one worker".into()));
        }
        let array = config.array;
        let (persist, alloc, tensors) = if config.persistent {
            let (p, alloc, tensors) = Persistence::open(&array, config.alloc_unit_bytes)?;
            (Some(p), alloc, tensors)
        } else {
            let layout = persist::device_layouts(&array, config.alloc_unit_bytes)?;
            let devices = layout
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    ExtentAllocator::new(
                        i as u32,
                        l.data.offset,
                        l.data.len,
                        config.alloc_unit_bytes,
                    )
                })
                .collect::<std::result::Result<Vec<_>, _>>()?;
            (None, ArrayAllocator::new(array.geometry(), devices)?, Vec::new())
        };
        let mut table = HashMap::new();
        for (id, name, copy) in tensors {
            let mut e = Entry::new(copy.map.size_bytes());
            e.name = name;
            e.ssd = Some(copy);
            table.insert(id, e);
        }
        let staging = BufferPool::new(PoolConfig {
            capacity_bytes: config.inflight_bytes_max.max(64 << 20),
            ..PoolConfig::default()
        })?;
        let inner = Arc::new(Inner {
            array,
            host_tier: config.host_tier,
            checksums: config.checksums,
            table: Mutex::new(table),
            alloc: Mutex::new(alloc),
            queues: Queues::new(),
            inflight: Budget::new(config.inflight_bytes_max),
            queued: Budget::new(config.queued_ops_max),
            staging,
            stats: Mutex::new(StoreStats::default()),
            retain: persist.is_some() || config.retain_on_prefetch,
            persist,
            gpu: gpu::GpuState::new(config.gpu, config.workers)?,
            graveyard: Arc::default(),
        });
        let workers = (0..config.workers)
            .map(|i| {
                let inner = inner.clone();
                std::thread::Builder::new()
                    .name(format!("teraio-migrate-{i}"))
                    .spawn(move || inner.worker())
                    .map_err(|e| Error::Os {
                        context: "spawning a migration worker".into(),
                        source: e,
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { inner, workers })
    }

    /// The array under the store.
    pub fn array(&self) -> &Arc<DeviceArray> {
        &self.inner.array
    }

    /// Offload tensor `id` from `src`. The store owns `src` until the write completed, then
    /// releases it. Offloading an id that has an SSD copy replaces that copy.
    pub fn offload(
        &self,
        id: impl Into<TensorKey>,
        src: TensorMem,
        options: OffloadOptions,
    ) -> Result<Handle<OffloadOutcome>> {
        let id = id.into();
        let slot = Slot::new();
        self.enqueue_offload(id, src, options, None, Done::Offload(slot.clone()), false)?;
        Ok(Handle::new(slot))
    }

    /// Offload device memory `src` once the work already queued on the caller's CUDA `stream`
    /// (a `CUstream` as an integer) has finished: an event is recorded on that stream now and the
    /// worker waits on it before it reads the tensor. The caller's stream is never blocked and
    /// the device is never synchronized as a whole.
    pub fn offload_after_stream(
        &self,
        id: impl Into<TensorKey>,
        src: TensorMem,
        options: OffloadOptions,
        stream: u64,
    ) -> Result<Handle<OffloadOutcome>> {
        let id = id.into();
        let fence = device_fence(id, &src, stream)?;
        let slot = Slot::new();
        self.enqueue_offload(id, src, options, Some(fence), Done::Offload(slot.clone()), false)?;
        Ok(Handle::new(slot))
    }

    /// The data path that device memory of `gpu` takes to and from this store's array
    /// (decided on first use: direct storage is opened then), and why.
    pub fn gpu_path(&self, gpu: &Arc<dyn GpuDevice>) -> Result<GpuPathInfo> {
        self.inner.gpu.route_info(&self.inner.array, gpu).map(|(_, info)| info)
    }

    /// What the GPU data paths did so far.
    pub fn gpu_stats(&self) -> GpuStats {
        self.inner.gpu.stats()
    }

    /// Like [`offload`](Self::offload), but the source memory comes back through the handle
    /// once the copy is stored, instead of being released: the caller decides whether to keep
    /// the tensor resident (a prefetch that arrived while the copy was being written) or drop it.
    /// A queued `offload_keep` is never cancelled by a prefetch.
    pub fn offload_keep(
        &self,
        id: impl Into<TensorKey>,
        src: TensorMem,
        options: OffloadOptions,
    ) -> Result<Handle<(OffloadOutcome, TensorMem)>> {
        let id = id.into();
        let slot = Slot::new();
        self.enqueue_offload(id, src, options, None, Done::OffloadKeep(slot.clone()), false)?;
        Ok(Handle::new(slot))
    }

    /// Queue an offload; `queued`: see [`RequestKind::Offload`].
    fn enqueue_offload(
        &self,
        id: TensorKey,
        src: TensorMem,
        options: OffloadOptions,
        after: Option<Box<dyn DeviceFence>>,
        done: Done,
        queued: bool,
    ) -> Result<()> {
        if src.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "tensor {id}: cannot offload an empty tensor"
            )));
        }
        self.inner.queued.acquire(1);
        let mut table = self.inner.table.lock();
        let entry = table.entry(id).or_insert_with(|| Entry::new(src.len()));
        entry.size = src.len();
        let op = Request {
            kind: RequestKind::Offload {
                src: Some(src),
                destination: options.destination,
                name: options.name,
                after,
                queued,
            },
            priority: options.priority,
            enqueued: Instant::now(),
            done,
        };
        self.inner.enqueue(id, entry, op);
        Ok(())
    }

    /// Prefetch tensor `id` into `dst` (exactly the tensor's size). The handle returns `dst`
    /// filled and verified.
    pub fn prefetch(
        &self,
        id: impl Into<TensorKey>,
        dst: TensorMem,
        priority: Priority,
    ) -> Result<Handle<TensorMem>> {
        let id = id.into();
        self.enqueue_prefetch(id, dst, priority, None)
    }

    /// Prefetch tensor `id` into device memory `dst` once the work already queued on the
    /// caller's CUDA `stream` has finished (memory the caller's caching allocator just handed
    /// out may still be read by that work): an event is recorded on the stream now and the
    /// worker waits on it before it writes. The caller's stream is never blocked; before it uses
    /// the tensor it waits on the returned memory's ready fence
    /// ([`TensorMem::wait_ready_on_stream`]).
    pub fn prefetch_after_stream(
        &self,
        id: impl Into<TensorKey>,
        dst: TensorMem,
        priority: Priority,
        stream: u64,
    ) -> Result<Handle<TensorMem>> {
        let id = id.into();
        let fence = device_fence(id, &dst, stream)?;
        self.enqueue_prefetch(id, dst, priority, Some(fence))
    }

    /// [`offload_keep`](Self::offload_keep) of device memory, after the work queued on the
    /// caller's CUDA `stream` (as [`offload_after_stream`](Self::offload_after_stream)).
    ///
    /// With `on_device`, to the host tier of a volatile store, the copy is queued on the device
    /// instead (behind an event on `stream`) and the handle completes without waiting for the
    /// GPU: the memory
    /// comes back with the copy as its ready fence ([`DeviceMemory::ready`]), and whoever
    /// reuses it (writes it, frees it to a caching allocator) orders that work after the fence
    /// ([`TensorMem::wait_ready_on_stream`]), or waits until it is done. The stored copy is
    /// read only after it completes.
    ///
    /// [`DeviceMemory::ready`]: crate::tier::DeviceMemory::ready
    pub fn offload_keep_after_stream(
        &self,
        id: impl Into<TensorKey>,
        src: TensorMem,
        options: OffloadOptions,
        stream: u64,
        on_device: bool,
    ) -> Result<Handle<(OffloadOutcome, TensorMem)>> {
        let id = id.into();
        let fence = device_fence(id, &src, stream)?;
        let slot = Slot::new();
        let done = Done::OffloadKeep(slot.clone());
        self.enqueue_offload(id, src, options, Some(fence), done, on_device)?;
        Ok(Handle::new(slot))
    }

    fn enqueue_prefetch(
        &self,
        id: TensorKey,
        mut dst: TensorMem,
        priority: Priority,
        after: Option<Box<dyn DeviceFence>>,
    ) -> Result<Handle<TensorMem>> {
        let mut table = self.inner.table.lock();
        let Some(entry) = table.get_mut(&id) else {
            return Err(Error::UnknownTensor(id.to_string()));
        };
        if dst.len() != entry.size {
            return Err(Error::InvalidArgument(format!(
                "tensor {id} has {} bytes, the prefetch destination {}",
                entry.size,
                dst.len()
            )));
        }
        // Volatile stores: a queued (not yet running) offload at the tail is cancelled; its
        // source has the data. (A persistent store writes it: durability was asked for.)
        let tail_is_queued_offload = !self.inner.retain
            && matches!(
                entry.queue.back(),
                Some(Request { kind: RequestKind::Offload { .. }, done: Done::Offload(_), .. })
            )
            && !(entry.queue.len() == 1 && entry.active == Active::Running);
        if tail_is_queued_offload {
            let op = entry.queue.pop_back().expect("checked");
            let (
                RequestKind::Offload { src: Some(src), after: src_after, .. },
                Done::Offload(slot),
            ) = (op.kind, op.done)
            else {
                unreachable!("a queued offload owns its source")
            };
            // The data goes to this prefetch, and a volatile store forgets what a prefetch took:
            // every copy the store has, or the operations before the cancelled offload leave
            // (an older version, or the source of an older failed offload), is dropped, so no
            // later prefetch can return it.
            let mut older = None;
            if entry.queue.is_empty() {
                entry.active = Active::Idle;
                if let Some(old) = entry.ssd.take() {
                    self.inner.release_extents(&old.map);
                }
                entry.ssd_superseded = false;
                older = Some((entry.host.take(), entry.held.take()));
            } else {
                // Behind the operations still queued or running; it takes over the cancelled
                // offload's place in the queued-operations budget.
                let op = Request {
                    kind: RequestKind::Discard,
                    priority: op.priority,
                    enqueued: Instant::now(),
                    done: Done::Discard,
                };
                self.inner.enqueue(id, entry, op);
            }
            drop(table);
            if older.is_some() {
                drop(older);
                self.inner.queued.release(1);
            }
            self.inner.stats.lock().offloads_cancelled += 1;
            slot.complete(Ok(OffloadOutcome::Cancelled));
            // The caller's queued work on the source finishes before it is copied.
            // (and the caller's queued work on the destination, for a prefetch after a stream)
            let copied = src_after
                .map_or(Ok(()), |f| f.wait())
                .and_then(|()| after.map_or(Ok(()), |f| f.wait()))
                .and_then(|()| src.copy_into(&mut dst))
                .map(|()| dst);
            return Ok(Handle::ready(copied));
        }
        if entry.queue.is_empty() && !entry.has_copy() {
            return Err(Error::InvalidState {
                tensor: id.to_string(),
                detail: entry.no_copy_detail(),
            });
        }
        drop(table);
        self.inner.queued.acquire(1);
        let mut table = self.inner.table.lock();
        let entry = table.get_mut(&id).ok_or_else(|| Error::UnknownTensor(id.to_string()))?;
        let slot = Slot::new();
        let op = Request {
            kind: RequestKind::Prefetch { dst: Some(dst), after },
            priority,
            enqueued: Instant::now(),
            done: Done::Prefetch(slot.clone()),
        };
        self.inner.enqueue(id, entry, op);
        Ok(Handle::new(slot))
    }

    /// Free tensor `id`: after the operations issued before it, release its SSD extents and
    /// host copy and forget it.
    pub fn free(&self, id: impl Into<TensorKey>) -> Result<Handle<()>> {
        let id = id.into();
        self.inner.queued.acquire(1);
        let mut table = self.inner.table.lock();
        let Some(entry) = table.get_mut(&id) else {
            drop(table);
            self.inner.queued.release(1);
            return Err(Error::UnknownTensor(id.to_string()));
        };
        let slot = Slot::new();
        let op = Request {
            kind: RequestKind::Free,
            priority: Priority::Background,
            enqueued: Instant::now(),
            done: Done::Free(slot.clone()),
        };
        self.inner.enqueue(id, entry, op);
        Ok(Handle::new(slot))
    }

    /// Offload and wait.
    pub fn offload_sync(
        &self,
        id: impl Into<TensorKey>,
        src: TensorMem,
        options: OffloadOptions,
    ) -> Result<OffloadOutcome> {
        let id = id.into();
        self.offload(id, src, options)?.wait()
    }

    /// Prefetch and wait.
    pub fn prefetch_sync(&self, id: impl Into<TensorKey>, dst: TensorMem) -> Result<TensorMem> {
        let id = id.into();
        self.prefetch(id, dst, Priority::Urgent)?.wait()
    }

    /// Take back the memory of a tensor held by the store after a failed offload.
    pub fn take_held(&self, id: impl Into<TensorKey>) -> Option<TensorMem> {
        let id = id.into();
        self.inner
            .table
            .lock()
            .get_mut(&id)
            .and_then(|e| if e.queue.is_empty() { e.held.take() } else { None })
    }

    /// Whether the store has a host tier (a second offload destination).
    pub fn has_host_tier(&self) -> bool {
        self.inner.host_tier.is_some()
    }

    /// Whether tensor `id` has a copy in `tier` (the SSD array, or the host tier) and no
    /// operation queued or running: a caller that did not modify it may release its memory
    /// without writing, the tensor then being offloaded to that tier.
    pub fn has_current_copy_in(&self, id: impl Into<TensorKey>, tier: Destination) -> bool {
        let id = id.into();
        self.inner.table.lock().get(&id).is_some_and(|e| {
            // A held source is newer than any copy (its offload failed).
            e.queue.is_empty()
                && e.held.is_none()
                && match tier {
                    Destination::Ssd => e.readable_ssd().is_some(),
                    Destination::Host => e.host.is_some(),
                }
        })
    }

    /// What the store knows of tensor `id`.
    pub fn info(&self, id: impl Into<TensorKey>) -> Option<TensorInfo> {
        let id = id.into();
        self.inner.table.lock().get(&id).map(|e| info(id, e))
    }

    /// The key of the tensor named `name`: a [`TensorKey`], or (at a binding's boundary) the
    /// `u64` it holds.
    pub fn lookup<K: From<TensorKey>>(&self, name: &str) -> Option<K> {
        self.inner
            .table
            .lock()
            .iter()
            .find(|(_, e)| e.name.as_deref() == Some(name))
            .map(|(id, _)| K::from(*id))
    }

    /// Every tensor, sorted by id.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        let table = self.inner.table.lock();
        let mut v: Vec<_> = table.iter().map(|(id, e)| info(*id, e)).collect();
        v.sort_by_key(|t| t.id);
        v
    }

    /// Migration statistics so far.
    pub fn stats(&self) -> StoreStats {
        self.inner.stats.lock().clone()
    }

    /// Free space of the array.
    pub fn space(&self) -> ArrayStats {
        self.inner.alloc.lock().stats()
    }

    /// Wait until every queued operation has finished.
    pub fn drain(&self) {
        loop {
            let busy = self.inner.table.lock().values().any(|e| !e.queue.is_empty());
            if !busy {
                return;
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Persistent mode: write a checkpoint now (journal truncated; extents freed since the last
    /// checkpoint become reusable).
    pub fn checkpoint(&self) -> Result<()> {
        self.inner.checkpoint()
    }
}

impl Drop for TensorStore {
    fn drop(&mut self) {
        self.drain();
        self.inner.queues.shutdown();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        if self.inner.persist.as_ref().is_some_and(|p| !p.failed())
            && let Err(e) = self.inner.checkpoint()
        {
            crate::notice::error(format!(
                "checkpoint at close failed (the journal still has everything; Engine::close \
                 reports this as an error): {e}"
            ));
        }
    }
}

fn info(id: TensorKey, e: &Entry) -> TensorInfo {
    TensorInfo {
        id,
        name: e.name.clone(),
        size_bytes: e.size,
        location: e.location(),
        stripe_map: e.ssd.as_ref().map(|c| c.map.clone()),
        checksummed_chunks: e.ssd.as_ref().map_or(0, |c| c.checksums.len()),
        host_copy: e.host.is_some(),
        pending_ops: e.queue.len(),
    }
}

/// crc32c of every `chunk`-sized piece of `bytes`.
pub(crate) fn chunk_checksums(bytes: &[u8], chunk: u64) -> Vec<u32> {
    bytes.chunks(chunk as usize).map(crc32c::crc32c).collect()
}

enum Outcome {
    Offload(Result<OffloadOutcome>),
    Prefetch(Result<TensorMem>),
    Free(Result<()>),
    Discard,
}

impl Inner {
    fn enqueue(&self, id: TensorKey, entry: &mut Entry, op: Request) {
        let priority = op.priority;
        entry.queue.push_back(op);
        if entry.active == Active::Idle {
            entry.active = Active::Dispatched;
            self.queues.push(priority, id.get());
        }
    }

    fn worker(self: Arc<Self>) {
        while let Some(id) = self.queues.pop() {
            self.run_one(TensorKey(id));
        }
    }

    /// Run the head operation of tensor `id`, if it is dispatched.
    fn run_one(&self, id: TensorKey) {
        let (kind, priority, enqueued, ssd, host, held, no_copy) = {
            let mut table = self.table.lock();
            let Some(entry) = table.get_mut(&id) else { return };
            if entry.active != Active::Dispatched {
                return; // stale token
            }
            let Some(op) = entry.queue.front_mut() else {
                entry.active = Active::Idle;
                return;
            };
            entry.active = Active::Running;
            let kind = std::mem::replace(&mut op.kind, RequestKind::Free);
            // Put a marker back so location() still says what runs.
            op.kind = match &kind {
                RequestKind::Offload { destination, .. } => RequestKind::Offload {
                    src: None,
                    destination: *destination,
                    name: None,
                    after: None,
                    queued: false,
                },
                RequestKind::Prefetch { .. } => RequestKind::Prefetch { dst: None, after: None },
                RequestKind::Free => RequestKind::Free,
                RequestKind::Discard => RequestKind::Discard,
            };
            let (priority, enqueued) = (op.priority, op.enqueued);
            let (ssd, host, held) = match &kind {
                // A prefetch reads from whatever copy exists; take the memory copies out of the
                // table while the worker uses them (they go back unless consumed).
                // (An SSD copy older than the newest version is never read.)
                RequestKind::Prefetch { .. } => {
                    (entry.readable_ssd().cloned(), entry.host.take(), entry.held.take())
                }
                RequestKind::Free | RequestKind::Discard => {
                    (entry.ssd.take(), entry.host.take(), entry.held.take())
                }
                RequestKind::Offload { .. } => (None, None, entry.held.take()),
            };
            // What a prefetch that finds nothing says (the entry knows why).
            let no_copy = match &kind {
                RequestKind::Prefetch { .. }
                    if ssd.is_none() && host.is_none() && held.is_none() =>
                {
                    Some(entry.no_copy_detail())
                }
                _ => None,
            };
            (kind, priority, enqueued, ssd, host, held, no_copy)
        };
        self.stats.lock().queue_wait[priority as usize].record(enqueued.elapsed());
        let (outcome, update) = match kind {
            RequestKind::Offload { src, destination, name, after, queued } => {
                drop(held); // a newer version replaces the memory of a failed offload
                let src = src.expect("a dispatched offload owns its source");
                // The entry's size is that of the newest offload issued; this one has its own.
                let size = src.len();
                let on_device = queued
                    && destination == Destination::Host
                    && self.persist.is_none()
                    && src.device().is_some();
                match (on_device, after) {
                    (true, after) => self.run_offload_queued(id, size, src, name, after),
                    // The caller's queued work on the tensor finishes before it is read.
                    (false, after) => match after.map_or(Ok(()), |f| f.wait()) {
                        Ok(()) => self.run_offload(id, size, src, destination, name),
                        Err(e) => (Outcome::Offload(Err(e)), Update::Held(src)),
                    },
                }
            }
            RequestKind::Prefetch { dst, after } => {
                let mut dst = dst.expect("a dispatched prefetch owns its destination");
                // Device memory: what is copied into it waits for the caller's queued work on the
                // device (its ready fence), not in this worker.
                let after = match (after, &mut dst) {
                    (Some(f), TensorMem::Device(d)) if d.ready().is_none() => {
                        d.set_ready(Some(f));
                        None
                    }
                    (after, _) => after,
                };
                match after.map_or(Ok(()), |f| f.wait()) {
                    Ok(()) => match no_copy {
                        Some(detail) => {
                            let e = Error::InvalidState { tensor: id.to_string(), detail };
                            (Outcome::Prefetch(Err(e)), Update::None)
                        }
                        None => self.run_prefetch(id, dst, ssd, host, held),
                    },
                    Err(e) => (Outcome::Prefetch(Err(e)), Update::Restore { host, held }),
                }
            }
            RequestKind::Free => self.run_free(ssd, host, held),
            RequestKind::Discard => {
                drop((host, held));
                (Outcome::Discard, Update::Discarded(ssd))
            }
        };
        let (outcome, update, gate) = self.commit(id, outcome, update);
        // Apply the result to the table and dispatch the tensor's next operation.
        let (done, release) = {
            let mut table = self.table.lock();
            let entry = table.get_mut(&id).expect("an entry with a running op stays in the table");
            let release = update.apply(self, entry);
            let op = entry.queue.pop_front().expect("the running op is at the head");
            if let Some(next) = entry.queue.front() {
                entry.active = Active::Dispatched;
                self.queues.push(next.priority, id.get());
            } else {
                entry.active = Active::Idle;
                if !entry.has_copy() && matches!(outcome, Outcome::Free(Ok(()))) {
                    table.remove(&id);
                }
            }
            (op.done, release)
        };
        drop(gate);
        self.queued.release(1);
        let mut release = release;
        match (done, outcome) {
            (Done::Offload(s), Outcome::Offload(r)) => {
                // The source memory goes back before the handle completes: a waiter that sees
                // the offload done sees its memory released too (the tier's budget included).
                drop(release.take());
                s.complete(r)
            }
            (Done::OffloadKeep(s), Outcome::Offload(r)) => {
                let src = release.take();
                s.complete(r.map(|o| (o, src.expect("a stored offload hands back its source"))))
            }
            (Done::Prefetch(s), Outcome::Prefetch(r)) => s.complete(r),
            (Done::Free(s), Outcome::Free(r)) => s.complete(r),
            (Done::Discard, Outcome::Discard) => {}
            _ => unreachable!("an op's outcome matches its kind"),
        }
        // The rest (a prefetch's volatile copy, a freed tensor's memory) is released only now:
        // after the write and its journal record are durable and the table names the new copy.
        drop(release);
    }

    /// Persistent mode: make the operation's effect on the tensor table durable (a journal
    /// record) before it is applied. The returned guard is held until the table shows the
    /// change, so a checkpoint never covers a record whose effect it does not contain. A failed
    /// append turns a successful offload into a failure that keeps the source memory, and a
    /// free into a failure that keeps the tensor.
    fn commit(
        &self,
        id: TensorKey,
        outcome: Outcome,
        update: Update,
    ) -> (Outcome, Update, Option<RwLockReadGuard<'_, ()>>) {
        let Some(p) = &self.persist else { return (outcome, update, None) };
        let record = match &update {
            Update::Ssd { copy, name, .. } => {
                let name = name
                    .clone()
                    .or_else(|| self.table.lock().get(&id).and_then(|e| e.name.clone()));
                Persistence::put_record(id, name.as_deref(), copy)
            }
            Update::Freed(Some(_)) => RecordBody::DeleteTensor { id: id.get() },
            // No copy of the tensor is known to be durable, so there is nothing to delete;
            // but after a failed metadata write the record of its failed offload may have
            // reached the disk all the same (a journal write that failed at its sync), and a
            // reopen would bring the tensor back: the free cannot be promised then.
            Update::Freed(None) => {
                return match p.writable() {
                    Ok(()) => (outcome, update, None),
                    Err(e) => (Outcome::Free(Err(e)), Update::None, None),
                };
            }
            _ => return (outcome, update, None),
        };
        loop {
            let gate = p.commit_gate();
            match p.append(&self.array, record.clone()) {
                Ok(true) => return (outcome, update, Some(gate)),
                Ok(false) => {
                    drop(gate);
                    if let Err(e) = self.checkpoint() {
                        return self.fail_commit(e, update);
                    }
                }
                Err(e) => {
                    drop(gate);
                    return self.fail_commit(e, update);
                }
            }
        }
    }

    fn fail_commit(
        &self,
        e: Error,
        update: Update,
    ) -> (Outcome, Update, Option<RwLockReadGuard<'_, ()>>) {
        match update {
            Update::Ssd { copy, src, .. } => {
                // The record may have reached the disk although the append failed: free the
                // extents only after the next checkpoint, never now.
                self.release_extents(&copy.map);
                (Outcome::Offload(Err(e)), Update::Held(src), None)
            }
            Update::Freed(Some(copy)) => (Outcome::Free(Err(e)), Update::KeepSsd(copy), None),
            other => unreachable!("only puts and deletes are journaled, not {}", other.name()),
        }
    }

    fn checkpoint(&self) -> Result<()> {
        let Some(p) = &self.persist else { return Ok(()) };
        let _exclusive = p.exclusive_gate();
        // A consistent cut of the tensor table: every journaled change is applied.
        let table = self.table.lock();
        let tensors: Vec<_> = table
            .iter()
            .filter_map(|(id, e)| e.ssd.as_ref().map(|c| (*id, e.name.clone(), c.clone())))
            .collect();
        let mut alloc = self.alloc.lock();
        p.write_checkpoint(&self.array, &mut alloc, &tensors)
    }
}

/// What a finished operation changes in its tensor's entry (applied under the table lock).
enum Update {
    None,
    /// Offload succeeded to SSD: the new copy replaces any old one; host copy dropped; the
    /// source memory is released after the table shows the copy.
    Ssd {
        copy: SsdCopy,
        name: Option<String>,
        src: TensorMem,
    },
    /// Offload succeeded to the host tier; the source is released after the table update.
    Host {
        mem: TensorMem,
        name: Option<String>,
        src: TensorMem,
        /// The queued copy from device memory that fills `mem`, if it is still on the device.
        written: Option<Box<dyn DeviceFence>>,
    },
    /// Offload failed: the store keeps the source memory.
    Held(TensorMem),
    /// Prefetch done: give back memory copies that were not consumed.
    Restore {
        host: Option<HostCopy>,
        held: Option<TensorMem>,
    },
    /// Free done: the SSD copy (if any) is released.
    Freed(Option<SsdCopy>),
    /// Discard done (volatile stores only, never journaled): the SSD copy (if any) is released.
    Discarded(Option<SsdCopy>),
    /// Free failed: the SSD copy stays.
    KeepSsd(SsdCopy),
    /// A volatile prefetch read the SSD copy: release it.
    ConsumedSsd,
}

impl Update {
    fn name(&self) -> &'static str {
        match self {
            Update::None => "none",
            Update::Ssd { .. } => "ssd",
            Update::Host { .. } => "host",
            Update::Held(_) => "held",
            Update::Restore { .. } => "restore",
            Update::Freed(_) => "freed",
            Update::Discarded(_) => "discarded",
            Update::KeepSsd(_) => "keep-ssd",
            Update::ConsumedSsd => "consumed-ssd",
        }
    }

    /// Apply to `entry`; returns memory to release once the table lock is dropped.
    fn apply(self, inner: &Inner, entry: &mut Entry) -> Option<TensorMem> {
        match self {
            Update::None => None,
            Update::Ssd { copy, name, src } => {
                if let Some(old) = entry.ssd.replace(copy) {
                    inner.release_extents(&old.map);
                }
                entry.ssd_superseded = false;
                entry.host = None;
                if name.is_some() {
                    entry.name = name;
                }
                Some(src)
            }
            Update::Host { mem, name, src, written } => {
                let graveyard = inner.graveyard.clone();
                entry.host = Some(match written {
                    Some(w) => HostCopy::being_written(mem, w, graveyard),
                    None => HostCopy::new(mem, graveyard),
                });
                if let Some(old) = entry.ssd.take() {
                    inner.release_extents(&old.map);
                }
                entry.ssd_superseded = false;
                if name.is_some() {
                    entry.name = name;
                }
                Some(src)
            }
            Update::Held(mem) => {
                // The held source is the newest version: older copies must never be read again.
                // A volatile or retaining store drops them. A persistent one keeps the SSD copy
                // as the durable version (the one a reopen finds: the failed write was never
                // acknowledged) but marks it superseded, so this session never reads it.
                entry.held = Some(mem);
                entry.host = None;
                if inner.persist.is_some() {
                    entry.ssd_superseded = entry.ssd.is_some();
                } else if let Some(old) = entry.ssd.take() {
                    inner.release_extents(&old.map);
                }
                None
            }
            Update::Restore { host, held } => {
                if host.is_some() {
                    entry.host = host;
                }
                if held.is_some() {
                    entry.held = held;
                }
                None
            }
            Update::Freed(copy) | Update::Discarded(copy) => {
                if let Some(c) = copy {
                    inner.release_extents(&c.map);
                }
                entry.ssd_superseded = false;
                None
            }
            Update::KeepSsd(copy) => {
                entry.ssd = Some(copy);
                None
            }
            Update::ConsumedSsd => {
                if let Some(c) = entry.ssd.take() {
                    inner.release_extents(&c.map);
                }
                entry.ssd_superseded = false;
                None
            }
        }
    }
}

impl Inner {
    /// Give extents back to the allocator: at once in volatile mode, at the next checkpoint in
    /// persistent mode (a crash must never hand one tensor's blocks to another).
    fn release_extents(&self, map: &StripeMap) {
        match &self.persist {
            Some(p) => p.defer_free(map.clone()),
            None => {
                if let Err(e) = self.alloc.lock().free_tensor(map) {
                    // The table and the allocator disagree: a bug, never silently ignored.
                    panic!("teraio: allocator rejected the extents of a live tensor: {e}");
                }
            }
        }
    }

    /// Host-tier memory for a copy of `size` bytes: memory whose last reader finished goes back
    /// first; when the tier is full, wait for the readers of what is buried.
    fn host_alloc(&self, tier: &Arc<dyn MemoryTier>, size: u64) -> Result<TensorMem> {
        self.graveyard.reap();
        let mut got = tier.alloc(size);
        if matches!(got, Err(Error::NoSpace(_))) && self.graveyard.bytes() > 0 {
            got = self.graveyard.drain().and_then(|_| tier.alloc(size));
        }
        got
    }

    /// An offload of device memory to the host tier, queued on the device behind `after` (the
    /// caller's queued work): finished as soon as the copy is queued. `src` comes back with the
    /// copy as its ready fence; the host copy is marked as being written until it completes.
    /// Without room in the host tier (or when queuing fails) it runs as a blocking offload.
    fn run_offload_queued(
        &self,
        id: TensorKey,
        size: u64,
        mut src: TensorMem,
        name: Option<String>,
        after: Option<Box<dyn DeviceFence>>,
    ) -> (Outcome, Update) {
        let started = Instant::now();
        let queued = match (&self.host_tier, &mut src) {
            (Some(tier), TensorMem::Device(d)) => match self.host_alloc(tier, size) {
                Ok(mut mem) => {
                    let dst = mem.host_mut().expect("host-tier memory is host memory");
                    // SAFETY: `dst` is the new host copy's own memory: nobody reads it before
                    // `written` completes (HostCopy waits for it) and it is released only
                    // after (HostCopy's drop buries it with the fence); `src` comes back to the
                    // caller with the copy as its ready fence.
                    let r = unsafe {
                        crate::tier::device::copy_out_async(d.as_mut(), dst, after.as_deref())
                    };
                    r.ok().map(|written| (mem, written))
                }
                Err(_) => None,
            },
            _ => None,
        };
        let Some((mem, written)) = queued else {
            return match after.map_or(Ok(()), |f| f.wait()) {
                Ok(()) => self.run_offload(id, size, src, Destination::Host, name),
                Err(e) => (Outcome::Offload(Err(e)), Update::Held(src)),
            };
        };
        let mut st = self.stats.lock();
        st.host_write.start(started);
        st.host_write.finish(Instant::now(), started.elapsed(), size, true);
        st.host_writes_queued += 1;
        drop(st);
        (
            Outcome::Offload(Ok(OffloadOutcome::InHost)),
            Update::Host { mem, name, src, written: Some(written) },
        )
    }

    fn run_offload(
        &self,
        id: TensorKey,
        size: u64,
        src: TensorMem,
        destination: Destination,
        name: Option<String>,
    ) -> (Outcome, Update) {
        // The host tier is not durable: a persistent store offloads to SSD only.
        if destination == Destination::Host && self.persist.is_none() {
            if let Some(tier) = &self.host_tier {
                let started = Instant::now();
                self.stats.lock().host_write.start(started);
                match self.host_alloc(tier, size) {
                    Ok(mut mem) => {
                        let r = src.copy_into(&mut mem);
                        let ok = r.is_ok();
                        self.stats.lock().host_write.finish(
                            Instant::now(),
                            started.elapsed(),
                            size,
                            ok,
                        );
                        return match r {
                            Ok(()) => (
                                Outcome::Offload(Ok(OffloadOutcome::InHost)),
                                Update::Host { mem, name, src, written: None },
                            ),
                            Err(e) => (Outcome::Offload(Err(e)), Update::Held(src)),
                        };
                    }
                    Err(Error::NoSpace(_)) => {
                        let mut st = self.stats.lock();
                        st.host_write.finish(Instant::now(), started.elapsed(), 0, true);
                        st.host_write.ops -= 1;
                        st.host_fallbacks += 1;
                    }
                    Err(e) => {
                        self.stats.lock().host_write.finish(
                            Instant::now(),
                            started.elapsed(),
                            0,
                            false,
                        );
                        return (Outcome::Offload(Err(e)), Update::Held(src));
                    }
                }
            } else {
                self.stats.lock().host_fallbacks += 1;
            }
        }
        let budget = self.inflight.acquire(size);
        let started = Instant::now();
        self.stats.lock().ssd_write.start(started);
        let result = self.write_to_ssd(id, size, src);
        self.inflight.release(budget);
        let ok = result.is_ok();
        self.stats.lock().ssd_write.finish(Instant::now(), started.elapsed(), size, ok);
        match result {
            Ok((copy, src)) => {
                (Outcome::Offload(Ok(OffloadOutcome::OnSsd)), Update::Ssd { copy, name, src })
            }
            Err(failure) => {
                let (e, src) = *failure;
                (Outcome::Offload(Err(e)), Update::Held(src))
            }
        }
    }

    /// Extents for a tensor of `size` bytes. Persistent mode: the extents of overwritten and
    /// freed tensors become reusable only at a checkpoint (a crash must never hand one tensor's
    /// blocks to another), so when the array is full but such extents wait, a checkpoint is
    /// written (making them free, safely) and the allocation tried once more.
    fn alloc_extents(&self, size: u64) -> Result<StripeMap> {
        // (The allocator's lock is released before a checkpoint takes it.)
        let first = self.alloc.lock().alloc_tensor(size);
        match (first, &self.persist) {
            (Err(teraio_allocator::Error::NoSpace { .. }), Some(p)) if p.has_deferred_frees() => {
                self.checkpoint()?;
                Ok(self.alloc.lock().alloc_tensor(size)?)
            }
            (r, _) => Ok(r?),
        }
    }

    /// Allocate, checksum, write (and journal). On failure the source comes back.
    fn write_to_ssd(
        &self,
        id: TensorKey,
        size: u64,
        src: TensorMem,
    ) -> std::result::Result<(SsdCopy, TensorMem), Box<(Error, TensorMem)>> {
        let map = match self.alloc_extents(size) {
            Ok(m) => m,
            Err(e) => return Err(Box::new((e, src))),
        };
        let chunk = map.unit_bytes();
        let padded = map.padded_bytes() as usize;
        let fail = |e: Error, src: TensorMem| {
            if let Err(fe) = self.alloc.lock().free_tensor(&map) {
                panic!("teraio: could not return fresh extents of tensor {id}: {fe}");
            }
            Err(Box::new((e, src)))
        };
        // Device memory takes the GPU data paths (pipelined bounce or GPUDirect Storage).
        if let TensorMem::Device(dev) = &src {
            let r = self.gpu.write(&self.array, &self.staging, &map, dev.as_ref(), self.checksums);
            let checksums = match r {
                Ok(c) => c,
                Err(e) => return fail(e, src),
            };
            if self.persist.is_some()
                && let Err(e) = self.array.sync()
            {
                return fail(e, src);
            }
            return Ok((SsdCopy { map, chunk_bytes: chunk, checksums }, src));
        }
        // Host memory goes to the device directly; other memory through a staging buffer.
        let (buf, src_back) = match src {
            TensorMem::Host(mut b) => {
                if b.capacity() < padded {
                    let e = Error::InvalidArgument(format!(
                        "tensor {id}: buffer capacity {} is below the padded size {padded}",
                        b.capacity()
                    ));
                    return fail(e, TensorMem::Host(b));
                }
                b.set_len(padded);
                (b, None)
            }
            TensorMem::Device(_) => unreachable!("device memory returned above"),
            staged @ TensorMem::Staged(_) => {
                let mut b = match self.staging.alloc(padded) {
                    Ok(b) => b,
                    Err(e) => return fail(e, staged),
                };
                if let Err(e) = staged.copy_out(0, &mut b[..size as usize]) {
                    return fail(e, staged);
                }
                (b, Some(staged))
            }
        };
        let restore = |mut b: IoBuf, src_back: Option<TensorMem>| match src_back {
            Some(s) => s,
            None => {
                b.set_len(size as usize);
                TensorMem::Host(b)
            }
        };
        // The checksums are computed while the write is in flight: both only read the buffer.
        let (ptr, len) = (buf.as_ptr(), size as usize);
        let ticket = self.array.write_tensor(&map, 0..size, buf);
        let checksums = if self.checksums {
            // SAFETY: the buffer is owned by `ticket`, which stays alive (and keeps the memory
            // mapped) until `wait` below; `len <= padded <= capacity`; a write only reads the
            // buffer, so nothing mutates it while this shared view exists.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
            chunk_checksums(bytes, chunk)
        } else {
            Vec::new()
        };
        let (buf, r) = ticket.wait();
        let src = restore(buf, src_back);
        if let Err(e) = r {
            return fail(e, src);
        }
        if self.persist.is_some() {
            // Data durable before the journal record that names it.
            if let Err(e) = self.array.sync() {
                return fail(e, src);
            }
        }
        Ok((SsdCopy { map, chunk_bytes: chunk, checksums }, src))
    }

    fn run_prefetch(
        &self,
        id: TensorKey,
        mut dst: TensorMem,
        ssd: Option<SsdCopy>,
        host: Option<HostCopy>,
        held: Option<TensorMem>,
    ) -> (Outcome, Update) {
        let size = dst.len();
        let mut host = host;
        if held.is_some() || host.is_some() {
            let from_host = held.is_none();
            let started = Instant::now();
            if from_host {
                self.stats.lock().host_read.start(started);
            }
            let r = match (&held, &mut host) {
                (Some(mem), _) => mem.copy_into(&mut dst),
                (None, Some(h)) => h.copy_into(&mut dst),
                (None, None) => unreachable!("checked above"),
            }
            .map(|()| dst);
            if from_host {
                self.stats.lock().host_read.finish(
                    Instant::now(),
                    started.elapsed(),
                    size,
                    r.is_ok(),
                );
            }
            // Memory copies are consumed by a successful prefetch (the data lives in `dst` now),
            // except a host-tier copy in a retaining store; on failure they go back.
            return match r {
                Ok(d) if self.retain => {
                    (Outcome::Prefetch(Ok(d)), Update::Restore { host, held: None })
                }
                Ok(d) => (Outcome::Prefetch(Ok(d)), Update::None),
                Err(e) => (Outcome::Prefetch(Err(e)), Update::Restore { host, held }),
            };
        }
        let Some(copy) = ssd else {
            let e = Error::InvalidState {
                tensor: id.to_string(),
                detail: "no copy to prefetch from (freed?)".into(),
            };
            return (Outcome::Prefetch(Err(e)), Update::None);
        };
        let budget = self.inflight.acquire(size);
        let started = Instant::now();
        self.stats.lock().ssd_read.start(started);
        let r = self.read_from_ssd(id, dst, &copy);
        self.inflight.release(budget);
        self.stats.lock().ssd_read.finish(Instant::now(), started.elapsed(), size, r.is_ok());
        // A volatile store hands the tensor back and forgets it; a persistent or retaining one
        // keeps it.
        let update = if r.is_ok() && !self.retain { Update::ConsumedSsd } else { Update::None };
        (Outcome::Prefetch(r), update)
    }

    fn read_from_ssd(&self, id: TensorKey, dst: TensorMem, copy: &SsdCopy) -> Result<TensorMem> {
        let size = copy.map.size_bytes();
        let padded = copy.map.padded_bytes() as usize;
        if let TensorMem::Device(mut dev) = dst {
            let sums: &[u32] = if self.checksums { &copy.checksums } else { &[] };
            let name = id.to_string();
            self.gpu.read(&self.array, &self.staging, &copy.map, dev.as_mut(), sums, &name)?;
            self.stats.lock().chunks_verified += sums.len() as u64;
            return Ok(TensorMem::Device(dev));
        }
        let (buf, staged) = match dst {
            TensorMem::Host(mut b) => {
                if b.capacity() < padded {
                    return Err(Error::InvalidArgument(format!(
                        "tensor {id}: buffer capacity {} is below the padded size {padded}",
                        b.capacity()
                    )));
                }
                b.set_len(padded);
                (b, None)
            }
            TensorMem::Device(_) => unreachable!("device memory returned above"),
            staged @ TensorMem::Staged(_) => (self.staging.alloc(padded)?, Some(staged)),
        };
        let (mut buf, r) = self.array.read_tensor(&copy.map, 0..size, buf).wait();
        r?;
        if self.checksums && !copy.checksums.is_empty() {
            self.verify(id, &buf[..size as usize], copy)?;
        }
        match staged {
            Some(mut s) => {
                s.copy_in(0, &buf[..size as usize])?;
                Ok(s)
            }
            None => {
                buf.set_len(size as usize);
                Ok(TensorMem::Host(buf))
            }
        }
    }

    fn verify(&self, id: TensorKey, bytes: &[u8], copy: &SsdCopy) -> Result<()> {
        let chunks = bytes.chunks(copy.chunk_bytes as usize);
        if chunks.len() != copy.checksums.len() {
            return Err(Error::Corruption(format!(
                "tensor {id}: {} checksums recorded for {} chunks",
                copy.checksums.len(),
                chunks.len()
            )));
        }
        for (i, (c, &stored)) in chunks.zip(&copy.checksums).enumerate() {
            let computed = crc32c::crc32c(c);
            if computed != stored {
                return Err(Error::ChecksumMismatch {
                    tensor: id.to_string(),
                    offset: i as u64 * copy.chunk_bytes,
                    stored,
                    computed,
                });
            }
        }
        self.stats.lock().chunks_verified += copy.checksums.len() as u64;
        Ok(())
    }

    fn run_free(
        &self,
        ssd: Option<SsdCopy>,
        host: Option<HostCopy>,
        held: Option<TensorMem>,
    ) -> (Outcome, Update) {
        drop(host);
        drop(held);
        (Outcome::Free(Ok(())), Update::Freed(ssd))
    }
}

#[cfg(test)]
mod graveyard_tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// A fence that completes when the test says so (a copy still running on the device).
    struct Pending(Arc<AtomicBool>);

    impl DeviceFence for Pending {
        fn wait(&self) -> Result<()> {
            self.0.store(true, Ordering::SeqCst);
            Ok(())
        }
        fn is_done(&self) -> bool {
            self.0.load(Ordering::SeqCst)
        }
        fn wait_on_stream(&self, _stream: u64) -> Result<()> {
            Ok(())
        }
    }

    fn tier_mem(tier: &Arc<dyn MemoryTier>, bytes: u64) -> TensorMem {
        tier.alloc(bytes).unwrap()
    }

    #[test]
    fn a_host_copy_still_read_is_released_only_when_its_copies_complete() {
        let tier: Arc<dyn MemoryTier> = crate::tier::HostTier::new("host", 8 << 20).unwrap();
        let graveyard = Arc::new(Graveyard::default());
        let done = Arc::new(AtomicBool::new(false));
        let mut copy = HostCopy::new(tier_mem(&tier, 1 << 20), graveyard.clone());
        copy.readers.push(Box::new(Pending(done.clone())));
        drop(copy);
        assert_eq!(tier.used_bytes(), 1 << 20, "a copy still reads it: buried, not released");
        assert_eq!(graveyard.bytes(), 1 << 20);
        assert_eq!(graveyard.reap(), 0, "nothing to reap while the copy runs");
        assert_eq!(tier.used_bytes(), 1 << 20);
        done.store(true, Ordering::SeqCst);
        assert_eq!(graveyard.reap(), 1 << 20);
        assert_eq!(tier.used_bytes(), 0, "released once the copy completed");
        // A copy nobody reads goes straight back.
        drop(HostCopy::new(tier_mem(&tier, 1 << 20), graveyard.clone()));
        assert_eq!((tier.used_bytes(), graveyard.bytes()), (0, 0));
    }

    #[test]
    fn a_host_copy_still_being_written_waits_for_its_write() {
        let tier: Arc<dyn MemoryTier> = crate::tier::HostTier::new("host", 8 << 20).unwrap();
        let graveyard = Arc::new(Graveyard::default());
        // Dropped while its write is queued: buried until the write completes.
        let done = Arc::new(AtomicBool::new(false));
        let copy = HostCopy::being_written(
            tier_mem(&tier, 1 << 20),
            Box::new(Pending(done.clone())),
            graveyard.clone(),
        );
        drop(copy);
        assert_eq!(graveyard.bytes(), 1 << 20, "a copy still writes it: buried");
        assert_eq!(graveyard.reap(), 0);
        done.store(true, Ordering::SeqCst);
        assert_eq!(graveyard.reap(), 1 << 20);
        assert_eq!(tier.used_bytes(), 0);
        // Read into host memory: the reader waits for the write first.
        let written = Arc::new(AtomicBool::new(false));
        let mut copy = HostCopy::being_written(
            tier_mem(&tier, 4096),
            Box::new(Pending(written.clone())),
            graveyard.clone(),
        );
        assert!(copy.pending_write().is_some());
        let mut dst = tier_mem(&tier, 4096);
        copy.copy_into(&mut dst).unwrap();
        assert!(written.load(Ordering::SeqCst), "the read waited for the write");
        assert!(copy.pending_write().is_none(), "a completed write is forgotten");
        drop(copy);
        assert_eq!(graveyard.bytes(), 0, "nothing pending: straight back to the tier");
    }

    #[test]
    fn drain_waits_for_every_reader_and_dropping_the_graveyard_drains_it() {
        let tier: Arc<dyn MemoryTier> = crate::tier::HostTier::new("host", 8 << 20).unwrap();
        let graveyard = Arc::new(Graveyard::default());
        let flags: Vec<_> = (0..3).map(|_| Arc::new(AtomicBool::new(false))).collect();
        for f in &flags[..2] {
            let mut copy = HostCopy::new(tier_mem(&tier, 1 << 20), graveyard.clone());
            copy.readers.push(Box::new(Pending(f.clone())));
        }
        assert_eq!(graveyard.drain().unwrap(), 2 << 20);
        assert!(flags[..2].iter().all(|f| f.load(Ordering::SeqCst)), "every reader waited for");
        assert_eq!(tier.used_bytes(), 0);
        let mut copy = HostCopy::new(tier_mem(&tier, 1 << 20), graveyard.clone());
        copy.readers.push(Box::new(Pending(flags[2].clone())));
        drop(copy);
        drop(graveyard);
        assert!(flags[2].load(Ordering::SeqCst), "the graveyard waited before letting go");
        assert_eq!(tier.used_bytes(), 0);
    }
}
