//! Pending operations of the bindings: an offload, a prefetch or a free on an engine's store,
//! with the memory semantics both bindings document:
//!
//! - **Caller memory, offload**: the bytes are copied into engine host memory when the
//!   operation is submitted ([`Op::offload_copy`]); the caller's memory is free at once.
//! - **Caller memory, prefetch**: the tensor is read into engine host memory; the binding
//!   copies it into the caller's memory when the operation completes ([`Op::wait`] hands it
//!   the bytes once). The engine never touches caller memory on its own threads.
//! - **[`HostBuffer`]**: no copy; the store moves the buffer's own memory.

use std::sync::Arc;
use std::time::Duration;

use teraio_engine::Engine;
use teraio_engine::queue::{Handle, Priority};
use teraio_engine::store::{OffloadOptions, OffloadOutcome};
use teraio_engine::tier::TensorMem;

use crate::{Error, HostBuffer, Result};

/// What kind of operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    /// Offload.
    Offload,
    /// Prefetch.
    Prefetch,
    /// Free.
    Free,
}

impl OpKind {
    /// `offload`, `prefetch`, `free`.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Offload => "offload",
            OpKind::Prefetch => "prefetch",
            OpKind::Free => "free",
        }
    }
}

/// What a finished operation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// An offload: where the tensor went.
    Offloaded(OffloadOutcome),
    /// A prefetch: the bytes are in the destination.
    Prefetched,
    /// A free.
    Freed,
}

impl Outcome {
    /// `ssd`, `host`, `cancelled` (offloads), `prefetched`, `freed`.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Offloaded(OffloadOutcome::OnSsd) => "ssd",
            Outcome::Offloaded(OffloadOutcome::InHost) => "host",
            Outcome::Offloaded(OffloadOutcome::Cancelled) => "cancelled",
            Outcome::Prefetched => "prefetched",
            Outcome::Freed => "freed",
        }
    }
}

enum Running {
    Offload(Handle<OffloadOutcome>),
    OffloadBuffer(Handle<(OffloadOutcome, TensorMem)>, Arc<HostBuffer>),
    Prefetch(Handle<TensorMem>),
    PrefetchBuffer(Handle<TensorMem>, Arc<HostBuffer>),
    /// Into the caller's device memory; the caller's stream waits for the data on completion.
    PrefetchDevice(Handle<TensorMem>, u64),
    Free(Handle<()>),
}

/// A pending operation. Dropping it does not cancel the operation (the store finishes it),
/// but a prefetch into caller memory is then never copied out: bindings wait before dropping.
pub struct Op {
    kind: OpKind,
    tensor: u64,
    running: Option<Running>,
    result: Option<Result<Outcome>>,
}

impl std::fmt::Debug for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op")
            .field("kind", &self.kind)
            .field("tensor", &self.tensor)
            .field("finished", &self.result.is_some())
            .finish()
    }
}

fn empty_tensor(id: u64) -> Error {
    Error::InvalidArgument(format!("tensor {id}: cannot offload an empty tensor (0 bytes)"))
}

impl Op {
    fn new(kind: OpKind, tensor: u64, running: Running) -> Op {
        Op { kind, tensor, running: Some(running), result: None }
    }

    /// Offload `data` (copied into engine host memory before this returns).
    pub fn offload_copy(
        engine: &Engine,
        id: u64,
        data: &[u8],
        options: OffloadOptions,
    ) -> Result<Op> {
        if data.is_empty() {
            return Err(empty_tensor(id));
        }
        let mut mem = engine.alloc_host(data.len() as u64)?;
        mem.copy_in(0, data)?;
        let h = engine.store().offload(id, mem, options)?;
        Ok(Op::new(OpKind::Offload, id, Running::Offload(h)))
    }

    /// Offload the whole of `buf` without a copy; the buffer is busy until the op finished (and,
    /// when the offload failed, until the tensor is prefetched or freed: the store holds the
    /// memory as the tensor's data, as it holds the source of any failed offload).
    pub fn offload_buffer(
        engine: &Engine,
        id: u64,
        buf: &Arc<HostBuffer>,
        options: OffloadOptions,
    ) -> Result<Op> {
        let mem = buf.lend(id)?;
        match engine.store().offload_keep(id, mem, options) {
            Ok(h) => Ok(Op::new(OpKind::Offload, id, Running::OffloadBuffer(h, buf.clone()))),
            Err(e) => {
                // Refused before queueing: the store dropped the memory; it is home again.
                let _ = buf.is_busy();
                Err(e.into())
            }
        }
    }

    /// Prefetch tensor `id` (of `len` bytes) into engine memory; [`wait`](Self::wait) copies
    /// it into the caller's memory.
    pub fn prefetch_copy(engine: &Engine, id: u64, len: u64, priority: Priority) -> Result<Op> {
        if len == 0 {
            return Err(Error::InvalidArgument(format!(
                "tensor {id}: a prefetch destination of 0 bytes"
            )));
        }
        let mem = engine.alloc_host(len)?;
        let h = engine.store().prefetch(id, mem, priority)?;
        Ok(Op::new(OpKind::Prefetch, id, Running::Prefetch(h)))
    }

    /// Prefetch tensor `id` into the whole of `buf` without a copy.
    pub fn prefetch_buffer(
        engine: &Engine,
        id: u64,
        buf: &Arc<HostBuffer>,
        priority: Priority,
    ) -> Result<Op> {
        let mem = buf.lend(id)?;
        match engine.store().prefetch(id, mem, priority) {
            Ok(h) => Ok(Op::new(OpKind::Prefetch, id, Running::PrefetchBuffer(h, buf.clone()))),
            Err(e) => {
                let _ = buf.is_busy();
                Err(e.into())
            }
        }
    }

    /// Offload the caller's GPU memory `mem` (from `Engine::wrap_caller_gpu`) once the work
    /// queued on the caller's CUDA `stream` (a `CUstream` as an integer, 0 the legacy default
    /// stream) has finished; the stream is not blocked. The memory must stay allocated and
    /// unwritten until the operation finished.
    pub fn offload_device(
        engine: &Engine,
        id: u64,
        mem: TensorMem,
        stream: u64,
        options: OffloadOptions,
    ) -> Result<Op> {
        let h = engine.store().offload_after_stream(id, mem, options, stream)?;
        Ok(Op::new(OpKind::Offload, id, Running::Offload(h)))
    }

    /// Prefetch tensor `id` into the caller's GPU memory `mem`, written only after the work
    /// queued on `stream` when this is called (memory a caching allocator just handed out may
    /// still be read by it). Once the operation finished (waited), work queued on `stream`
    /// afterwards sees the data; the host never blocks on the stream.
    pub fn prefetch_device(
        engine: &Engine,
        id: u64,
        mem: TensorMem,
        stream: u64,
        priority: Priority,
    ) -> Result<Op> {
        let h = engine.store().prefetch_after_stream(id, mem, priority, stream)?;
        Ok(Op::new(OpKind::Prefetch, id, Running::PrefetchDevice(h, stream)))
    }

    /// Free tensor `id`.
    pub fn free(engine: &Engine, id: u64) -> Result<Op> {
        let h = engine.store().free(id)?;
        Ok(Op::new(OpKind::Free, id, Running::Free(h)))
    }

    /// The kind of operation.
    pub fn kind(&self) -> OpKind {
        self.kind
    }

    /// The tensor it concerns.
    pub fn tensor(&self) -> u64 {
        self.tensor
    }

    /// Whether the engine finished it (never blocks; the result is collected by `wait`).
    pub fn is_done(&self) -> bool {
        match &self.running {
            None => true,
            Some(Running::Offload(h)) => h.is_done(),
            Some(Running::OffloadBuffer(h, _)) => h.is_done(),
            Some(Running::Free(h)) => h.is_done(),
            Some(
                Running::Prefetch(h)
                | Running::PrefetchBuffer(h, _)
                | Running::PrefetchDevice(h, _),
            ) => h.is_done(),
        }
    }

    /// The result, once collected.
    pub fn result(&self) -> Option<&Result<Outcome>> {
        self.result.as_ref()
    }

    /// Wait for the operation (at most `timeout`; `None`: as long as it takes) and collect
    /// its result. `copy_out` is called exactly once, when a prefetch into caller memory
    /// finished, with the bytes read; its error becomes the operation's. Returns `None` when
    /// the timeout passed first (the operation may be waited again).
    pub fn wait(
        &mut self,
        timeout: Option<Duration>,
        copy_out: impl FnOnce(&[u8]) -> Result<()>,
    ) -> Option<&Result<Outcome>> {
        if self.result.is_none() {
            let running = self.running.take().expect("an op without a result is running");
            match finish(running, timeout, copy_out) {
                Ok(r) => self.result = Some(r),
                Err(still) => self.running = Some(still),
            }
        }
        self.result.as_ref()
    }
}

fn wait_handle<T, R>(
    h: Handle<T>,
    timeout: Option<Duration>,
    back: impl FnOnce(Handle<T>) -> R,
) -> std::result::Result<teraio_engine::Result<T>, R> {
    match timeout {
        None => Ok(h.wait()),
        Some(t) => h.wait_timeout(t).map_err(back),
    }
}

fn finish(
    running: Running,
    timeout: Option<Duration>,
    copy_out: impl FnOnce(&[u8]) -> Result<()>,
) -> std::result::Result<Result<Outcome>, Running> {
    Ok(match running {
        Running::Offload(h) => {
            wait_handle(h, timeout, Running::Offload)?.map(Outcome::Offloaded).map_err(Into::into)
        }
        Running::Free(h) => {
            wait_handle(h, timeout, Running::Free)?.map(|()| Outcome::Freed).map_err(Into::into)
        }
        Running::Prefetch(h) => match wait_handle(h, timeout, Running::Prefetch)? {
            Ok(mem) => {
                let bytes = mem.host().expect("engine host memory");
                copy_out(bytes).map(|()| Outcome::Prefetched)
            }
            Err(e) => Err(e.into()),
        },
        Running::PrefetchDevice(h, stream) => {
            match wait_handle(h, timeout, |h| Running::PrefetchDevice(h, stream))? {
                // The caller's memory is only forgotten when `mem` drops.
                Ok(mem) => mem
                    .wait_ready_on_stream(stream)
                    .map(|()| Outcome::Prefetched)
                    .map_err(Into::into),
                Err(e) => Err(e.into()),
            }
        }
        Running::PrefetchBuffer(h, buf) => {
            let r = match wait_handle(h, timeout, |h| (h, buf.clone())) {
                Ok(r) => r,
                Err((h, b)) => return Err(Running::PrefetchBuffer(h, b)),
            };
            match r {
                Ok(mem) => {
                    buf.restore(mem);
                    Ok(Outcome::Prefetched)
                }
                // The store dropped the memory: it is back in the buffer's pool.
                Err(e) => Err(e.into()),
            }
        }
        Running::OffloadBuffer(h, buf) => {
            let r = match wait_handle(h, timeout, |h| (h, buf.clone())) {
                Ok(r) => r,
                Err((h, b)) => return Err(Running::OffloadBuffer(h, b)),
            };
            match r {
                Ok((outcome, mem)) => {
                    buf.restore(mem);
                    Ok(Outcome::Offloaded(outcome))
                }
                // A failed offload leaves the memory held by the store as the tensor's data (a
                // later prefetch returns it, a free drops it); the buffer is busy until then.
                Err(e) => Err(e.into()),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Status;
    use teraio_engine::EngineConfig;
    use teraio_engine::backend::sim::SimDisk;

    fn engine() -> Engine {
        let disks: Vec<_> = (0..2).map(|i| SimDisk::new(64 << 20, 4096, i)).collect();
        Engine::open(EngineConfig::with_sim_disks(disks)).unwrap()
    }

    fn wait_ok(op: &mut Op, out: Option<&mut [u8]>) -> Outcome {
        let r = op.wait(None, |bytes| {
            out.expect("a prefetch into caller memory has a destination").copy_from_slice(bytes);
            Ok(())
        });
        *r.unwrap().as_ref().unwrap()
    }

    #[test]
    fn caller_memory_round_trips_with_odd_sizes_and_the_result_stays() {
        let e = engine();
        for (id, len) in [(1u64, 1usize), (2, 4095), (3, (3 << 20) + 17)] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + id as usize) as u8).collect();
            let mut op = Op::offload_copy(&e, id, &data, OffloadOptions::default()).unwrap();
            assert_eq!(op.kind(), OpKind::Offload);
            assert_eq!(wait_ok(&mut op, None), Outcome::Offloaded(OffloadOutcome::OnSsd));
            assert!(op.is_done());
            let mut out = vec![0u8; len];
            let mut op = Op::prefetch_copy(&e, id, len as u64, Priority::Normal).unwrap();
            assert_eq!(wait_ok(&mut op, Some(&mut out)), Outcome::Prefetched);
            assert_eq!(out, data);
            // Waiting again returns the same result and copies nothing again.
            let again = op.wait(None, |_| panic!("copied twice"));
            assert!(matches!(again, Some(Ok(Outcome::Prefetched))));
        }
        let e2 = Op::offload_copy(&e, 9, &[], OffloadOptions::default()).unwrap_err();
        assert_eq!(e2.status(), Status::InvalidArgument);
    }

    #[test]
    fn wrong_sizes_and_unknown_tensors_are_refused_at_submission() {
        let e = engine();
        let mut op = Op::offload_copy(&e, 1, &[1; 100], OffloadOptions::default()).unwrap();
        wait_ok(&mut op, None);
        let err = Op::prefetch_copy(&e, 1, 99, Priority::Normal).unwrap_err();
        assert_eq!(err.status(), Status::InvalidArgument);
        assert!(err.to_string().contains("100 bytes"), "{err}");
        let err = Op::prefetch_copy(&e, 77, 10, Priority::Normal).unwrap_err();
        assert_eq!(err.status(), Status::UnknownTensor);
        // The tensor is still there after the refused prefetch.
        let mut out = vec![0u8; 100];
        let mut op = Op::prefetch_copy(&e, 1, 100, Priority::Normal).unwrap();
        wait_ok(&mut op, Some(&mut out));
        assert!(out.iter().all(|&b| b == 1));
    }

    #[test]
    fn engine_buffers_move_without_a_copy_and_are_busy_meanwhile() {
        let e = engine();
        let a = HostBuffer::new((2 << 20) + 5).unwrap();
        let mut mem = a.lend(0).unwrap();
        mem.host_mut().unwrap().iter_mut().enumerate().for_each(|(i, b)| *b = (i % 253) as u8);
        a.restore(mem);
        let mut op = Op::offload_buffer(&e, 4, &a, OffloadOptions::default()).unwrap();
        assert!(Op::offload_buffer(&e, 5, &a, OffloadOptions::default()).is_err() || op.is_done());
        wait_ok(&mut op, None);
        assert!(!a.is_busy());
        let b = HostBuffer::new((2 << 20) + 5).unwrap();
        let mut op = Op::prefetch_buffer(&e, 4, &b, Priority::Urgent).unwrap();
        wait_ok(&mut op, None);
        let mem = b.lend(0).unwrap();
        assert!(mem.host().unwrap().iter().enumerate().all(|(i, &x)| x == (i % 253) as u8));
        b.restore(mem);
        // A failed prefetch (the tensor was consumed by the volatile store) leaves the buffer
        // usable.
        let mut op = Op::free(&e, 4).unwrap();
        let _ = op.wait(None, |_| Ok(()));
        let err = Op::prefetch_buffer(&e, 4, &b, Priority::Urgent).unwrap_err();
        assert!(matches!(err.status(), Status::UnknownTensor | Status::InvalidState), "{err}");
        assert!(!b.is_busy());
        let small = HostBuffer::new(10).unwrap();
        let mut op = Op::offload_buffer(&e, 6, &small, OffloadOptions::default()).unwrap();
        wait_ok(&mut op, None);
        let wrong = HostBuffer::new(11).unwrap();
        assert_eq!(
            Op::prefetch_buffer(&e, 6, &wrong, Priority::Normal).unwrap_err().status(),
            Status::InvalidArgument
        );
        assert!(!wrong.is_busy(), "a refused prefetch gives the buffer back");
    }

    #[test]
    fn a_timeout_leaves_the_op_waitable() {
        let disks: Vec<_> = (0..1).map(|i| SimDisk::new(64 << 20, 4096, i)).collect();
        let e = Engine::open(EngineConfig::with_sim_disks(disks)).unwrap();
        let data = vec![3u8; 8 << 20];
        let mut op = Op::offload_copy(&e, 1, &data, OffloadOptions::default()).unwrap();
        let first = op.wait(Some(Duration::ZERO), |_| Ok(())).is_some();
        let r = op.wait(None, |_| Ok(()));
        assert!(matches!(r, Some(Ok(Outcome::Offloaded(_)))), "first wait done: {first}");
    }

    /// A timeout beyond the clock's range (found by the Python buffer fuzz: 9.2e18 s panicked
    /// adding it to `Instant::now()`) waits without a limit.
    #[test]
    fn a_timeout_beyond_the_clock_waits_without_a_limit() {
        let disks: Vec<_> = (0..1).map(|i| SimDisk::new(64 << 20, 4096, i)).collect();
        let e = Engine::open(EngineConfig::with_sim_disks(disks)).unwrap();
        let data = vec![3u8; 1 << 20];
        for (i, t) in [Duration::MAX, Duration::from_secs(1 << 63), Duration::from_secs_f64(9.2e18)]
            .into_iter()
            .enumerate()
        {
            let mut op = Op::offload_copy(&e, i as u64, &data, OffloadOptions::default()).unwrap();
            let r = op.wait(Some(t), |_| Ok(()));
            assert!(matches!(r, Some(Ok(Outcome::Offloaded(_)))), "{t:?}");
        }
    }
}
