//! The store's public API: opening it, queueing offloads, prefetches and frees on a tensor's
//! queue, and what it holds.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use teraio_allocator::{ArrayAllocator, ArrayStats, ExtentAllocator};

use super::{
    Active, Destination, Done, Entry, GpuPathInfo, GpuStats, Inner, OffloadOptions, OffloadOutcome,
    Persistence, Request, RequestKind, StoreConfig, StoreStats, TensorInfo, TensorKey, TensorStore,
    device_fence, gpu, persist,
};
use crate::array::DeviceArray;
use crate::pool::{BufferPool, PoolConfig};
use crate::queue::{Budget, Handle, Priority, Queues, Slot};
use crate::tier::{DeviceFence, GpuDevice, TensorMem};
use crate::{Error, Result};

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
