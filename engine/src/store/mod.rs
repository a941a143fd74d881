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

mod api;
mod commit;
mod faults;
mod gpu;
mod host_copy;
mod key;
mod persist;
mod stats;
mod transfer;
mod worker;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::Mutex;
use serde::Serialize;
use teraio_allocator::ArrayAllocator;
use teraio_layout::StripeMap;

use crate::array::DeviceArray;
use crate::pool::BufferPool;
use crate::queue::{Budget, Priority, Queues, Slot};
use crate::tier::{DeviceFence, MemoryTier, TensorMem};
use crate::{Error, Result};
use host_copy::{Graveyard, HostCopy};

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

/// crc32c of every `chunk`-sized piece of `bytes`.
pub(crate) fn chunk_checksums(bytes: &[u8], chunk: u64) -> Vec<u32> {
    bytes.chunks(chunk as usize).map(crc32c::crc32c).collect()
}
