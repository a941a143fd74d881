//! io_uring backend (the default): the `io-uring` crate directly, no async runtime.
//!
//! Each device gets `threads_per_device` dedicated I/O threads; each thread owns one ring for
//! its device, with the device's file registered (fixed file 0) and at most `queue_depth`
//! requests in flight. Rings are single-issuer with deferred task work where the kernel has it
//! (6.1+): completions are processed in batches when the thread waits. Requests reach a thread
//! through a channel; a thread that sleeps in `io_uring_enter` is woken by an eventfd whose
//! read is kept armed in the ring, so new work is picked up without waiting for an I/O to
//! finish. Multi-piece requests use `READV`/`WRITEV`; single-piece ones use
//! `READ_FIXED`/`WRITE_FIXED` when their buffer comes from the
//! [`BufferPool`](crate::pool::BufferPool), else `READ`/`WRITE`. `TERAIO_FIXED_BUFFERS=0`
//! turns fixed buffers off (for comparisons). Short transfers are resubmitted for the
//! remainder.
//!
//! Registered buffers: each pool mapping of at most 1 GiB owns a slot of every ring's sparse
//! buffer table while it is mapped ([`Registration`](crate::pool::Registration): index and
//! generation). A ring registers a mapping on its first fixed request and follows three rules:
//! - the kernel looks a fixed buffer up when it *issues* the request, during a later
//!   `io_uring_enter`, not when the SQE is written: a slot is never re-registered while a
//!   submission of this ring (queued or in the kernel) uses it, so no request is ever issued
//!   against a mapping other than its own (that would fail with `EFAULT`, or worse, move the
//!   bytes of another buffer);
//! - a mapping the kernel refuses (over 1 GiB, no memory to pin) is not retried: plain I/O;
//! - when the pool unmaps a mapping, the ring clears its slot the next time it runs, so the
//!   kernel unpins that memory (huge pages included) instead of holding it until the slot is
//!   reused.
//!
//! Memory safety: a request's context (its [`IoRequest`], which owns the buffer through its
//! completion) stays in the thread's slot table until its completion entry arrives; a thread
//! exits only when nothing it submitted is in flight, so the kernel never writes into freed
//! memory, whatever the callers drop.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{IoUring, opcode, squeue, types};

use super::psync::fdatasync;
use super::{Backend, IoDirection, IoFailure, IoRequest, IoVec, advance_iovecs, bad_device};
use crate::pool::{REGISTRATION_SLOTS, registration_live, registration_releases};

/// Largest iovec count one READV/WRITEV takes (Linux IOV_MAX).
const IOV_MAX: usize = 1024;
/// user_data of the eventfd read that wakes a sleeping thread.
const WAKE: u64 = u64::MAX;

/// Whether io_uring can be used here (not disabled by sysctl, seccomp or an old kernel).
pub fn probe() -> io::Result<()> {
    let ring = IoUring::new(2)?;
    drop(ring);
    Ok(())
}

struct WorkerShared {
    eventfd: OwnedFd,
    sleeping: AtomicBool,
    /// Submissions that used a registered (fixed) buffer.
    fixed_ops: std::sync::atomic::AtomicU64,
    /// Entries of the ring's buffer table that hold a mapping now.
    registered_now: std::sync::atomic::AtomicU64,
}

impl WorkerShared {
    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd this struct owns.
        let _ = unsafe {
            libc::write(
                self.eventfd.as_raw_fd(),
                (&raw const one).cast(),
                std::mem::size_of::<u64>(),
            )
        };
    }
}

struct Worker {
    tx: Option<Sender<IoRequest>>,
    shared: Arc<WorkerShared>,
    join: Option<JoinHandle<()>>,
}

struct DeviceWorkers {
    workers: Vec<Worker>,
    next: AtomicUsize,
}

/// The io_uring backend.
pub struct UringBackend {
    files: Vec<Arc<OwnedFd>>,
    devices: Vec<DeviceWorkers>,
    queue_depth: u32,
}

impl std::fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringBackend")
            .field("files", &self.files.len())
            .field("queue_depth", &self.queue_depth)
            .finish()
    }
}

impl UringBackend {
    /// A backend over open files (request device `i` is `files[i]`), with `threads_per_device`
    /// I/O threads per file, each with one ring of `queue_depth` requests in flight.
    pub fn new(
        files: Vec<Arc<OwnedFd>>,
        queue_depth: u32,
        threads_per_device: usize,
    ) -> io::Result<Self> {
        let queue_depth = queue_depth.clamp(1, 4096);
        let mut backend = UringBackend { files: files.clone(), devices: Vec::new(), queue_depth };
        for (d, file) in files.iter().enumerate() {
            let mut workers = Vec::new();
            for t in 0..threads_per_device.max(1) {
                // SAFETY: eventfd takes no pointers; the result is checked below.
                let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
                if efd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: `efd` is a fresh descriptor nobody else owns.
                let eventfd = unsafe { OwnedFd::from_raw_fd(efd) };
                let shared = Arc::new(WorkerShared {
                    eventfd,
                    sleeping: AtomicBool::new(false),
                    fixed_ops: Default::default(),
                    registered_now: Default::default(),
                });
                // DEFER_TASKRUN (6.1+, with SINGLE_ISSUER): completions are processed only when
                // the I/O thread waits, in batches, and never interrupt it. The ring is created
                // disabled and enabled by its thread, which becomes its single issuer (and may
                // then update its buffer table). Else COOP_TASKRUN (5.19+), else plain.
                let depth = queue_depth + 1;
                let (ring, deferred) = match IoUring::builder()
                    .setup_single_issuer()
                    .setup_defer_taskrun()
                    .setup_taskrun_flag()
                    .setup_r_disabled()
                    .build(depth)
                {
                    Ok(r) => (r, true),
                    Err(_) => match IoUring::builder().setup_coop_taskrun().build(depth) {
                        Ok(r) => (r, false),
                        Err(_) => (IoUring::builder().build(depth)?, false),
                    },
                };
                ring.submitter().register_files(&[file.as_raw_fd()])?;
                // Fixed buffers: a sparse table filled lazily with the pool's mappings. Without
                // it (old kernel, or TERAIO_FIXED_BUFFERS=0) plain READ/WRITE are used.
                let fixed = std::env::var("TERAIO_FIXED_BUFFERS").map_or(true, |v| v != "0")
                    && ring.submitter().register_buffers_sparse(REGISTRATION_SLOTS).is_ok();
                let (tx, rx) = crossbeam_channel::unbounded::<IoRequest>();
                let thread_shared = Arc::clone(&shared);
                let file = Arc::clone(file);
                let (started_tx, started_rx) = std::sync::mpsc::sync_channel::<io::Result<()>>(1);
                let join = std::thread::Builder::new()
                    .name(format!("teraio-uring-{d}.{t}"))
                    .spawn(move || {
                        if deferred && let Err(e) = ring.submitter().register_enable_rings() {
                            let _ = started_tx.send(Err(e));
                            return;
                        }
                        let _ = started_tx.send(Ok(()));
                        let mut w =
                            RingThread::new(ring, rx, thread_shared, queue_depth as usize, fixed);
                        w.run();
                        drop(file);
                    })?;
                let started = started_rx
                    .recv()
                    .unwrap_or_else(|_| Err(io::Error::other("io_uring thread exited at start")));
                if let Err(e) = started {
                    let _ = join.join();
                    return Err(e);
                }
                workers.push(Worker { tx: Some(tx), shared, join: Some(join) });
            }
            // Owned by `backend` at once, so an error further on shuts these threads down.
            backend.devices.push(DeviceWorkers { workers, next: AtomicUsize::new(0) });
        }
        Ok(backend)
    }
}

impl Backend for UringBackend {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn submit(&self, request: IoRequest) {
        let Some(dev) = self.devices.get(request.device()) else {
            let (d, n) = (request.device(), self.devices.len());
            return request.complete(Err(bad_device(d, n)));
        };
        let i = if dev.workers.len() == 1 {
            0
        } else {
            dev.next.fetch_add(1, Ordering::Relaxed) % dev.workers.len()
        };
        let w = &dev.workers[i];
        let Some(tx) = &w.tx else {
            return request
                .complete(Err(IoFailure::Os(io::Error::other("uring backend shut down"))));
        };
        if let Err(e) = tx.send(request) {
            return e.0.complete(Err(IoFailure::Os(io::Error::other("uring backend shut down"))));
        }
        if w.shared.sleeping.load(Ordering::SeqCst)
            && w.shared.sleeping.swap(false, Ordering::SeqCst)
        {
            w.shared.wake();
        }
    }

    fn flush(&self, device: usize) -> io::Result<()> {
        let fd = self.files.get(device).ok_or_else(|| io::Error::other("no such device"))?;
        fdatasync(fd.as_raw_fd())
    }

    fn fixed_buffer_ops(&self) -> u64 {
        self.devices
            .iter()
            .flat_map(|d| d.workers.iter())
            .map(|w| w.shared.fixed_ops.load(Ordering::Relaxed))
            .sum()
    }

    fn registered_buffers(&self) -> u64 {
        self.devices
            .iter()
            .flat_map(|d| d.workers.iter())
            .map(|w| w.shared.registered_now.load(Ordering::Relaxed))
            .sum()
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        // Disconnect every thread first so they drain in parallel; each Worker's drop joins.
        for dev in &mut self.devices {
            for w in &mut dev.workers {
                w.tx = None;
                w.shared.wake();
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.tx = None;
        self.shared.wake();
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

/// Errors of io_uring_enter that only mean "try again".
fn benign(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::EAGAIN))
}

/// io_uring_enter failed for a reason that cannot be retried (a bug: EBADF, EFAULT...). The
/// kernel may still write into the buffers of requests in flight, so unwinding (which would
/// free them) is not safe: stop the process with the reason (on stderr: the one place the
/// library prints, since no notice survives the abort; see [`crate::notice`]).
fn enter_failed(e: &io::Error) -> ! {
    eprintln!("teraio: fatal: io_uring_enter failed with requests in flight: {e}");
    std::process::abort()
}

/// A request in flight in a ring.
struct InFlight {
    req: IoRequest,
    /// What is left to move.
    iov: Vec<IoVec>,
    /// The iovec array handed to the kernel for the current submission (stable until its
    /// completion arrives).
    raw: Vec<libc::iovec>,
    done: u64,
    /// The buffer-table slot the submission in the kernel uses, if it is a fixed one.
    table_slot: Option<u16>,
}

struct RingThread {
    ring: IoUring,
    rx: Receiver<IoRequest>,
    shared: Arc<WorkerShared>,
    slots: Vec<Option<InFlight>>,
    free: Vec<usize>,
    in_flight: usize,
    /// Target of the armed eventfd read.
    wake_buf: Box<u64>,
    wake_armed: bool,
    disconnected: bool,
    /// Whether the ring has a sparse buffer table.
    fixed: bool,
    /// Generation registered in each slot of the buffer table (0: none).
    registered: Vec<u64>,
    /// Submissions queued or in the kernel that use each slot of the buffer table. A slot is
    /// re-registered only while this is 0: the kernel looks a fixed buffer up when it issues
    /// the request (during a later io_uring_enter), so re-registering a slot under a queued
    /// request would hand it another mapping.
    users: Vec<u32>,
    /// Generation whose registration the kernel refused, per slot (not retried).
    refused: Vec<u64>,
    /// `registration_releases()` when the table was last checked for stale entries.
    releases_seen: u64,
}

impl RingThread {
    fn new(
        ring: IoUring,
        rx: Receiver<IoRequest>,
        shared: Arc<WorkerShared>,
        depth: usize,
        fixed: bool,
    ) -> Self {
        Self {
            ring,
            rx,
            shared,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            in_flight: 0,
            wake_buf: Box::new(0),
            wake_armed: false,
            disconnected: false,
            fixed,
            registered: if fixed { vec![0; REGISTRATION_SLOTS as usize] } else { Vec::new() },
            users: if fixed { vec![0; REGISTRATION_SLOTS as usize] } else { Vec::new() },
            refused: if fixed { vec![0; REGISTRATION_SLOTS as usize] } else { Vec::new() },
            releases_seen: 0,
        }
    }

    /// Drop the table entries whose mapping the pool unmapped since, so the kernel unpins that
    /// memory (huge pages included) instead of holding it until the slot is reused.
    fn drop_stale_registrations(&mut self) {
        if !self.fixed {
            return;
        }
        let releases = registration_releases();
        if releases == self.releases_seen {
            return;
        }
        self.releases_seen = releases;
        for idx in 0..self.registered.len() {
            let generation = self.registered[idx];
            if generation == 0 || self.users[idx] > 0 || registration_live(idx as u16) == generation
            {
                continue;
            }
            // A null, empty iovec clears the slot (io_uring_register(2), BUFFERS_UPDATE).
            let empty = libc::iovec { iov_base: std::ptr::null_mut(), iov_len: 0 };
            // SAFETY: clearing a slot hands the kernel no memory; no submission uses the slot.
            let cleared = unsafe {
                self.ring.submitter().register_buffers_update(idx as u32, &[empty], None)
            };
            if cleared.is_ok() {
                self.registered[idx] = 0;
                self.shared.registered_now.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// The fixed-buffer slot to use for `piece` of slot `i`'s request, registering the
    /// request's mapping in this ring first if needed. `None`: use a plain READ/WRITE.
    fn fixed_slot(&mut self, i: usize, piece: IoVec) -> Option<u16> {
        if !self.fixed {
            return None;
        }
        let r = self.slots[i].as_ref()?.req.registration()?;
        let (start, end) = (r.base as usize, r.base as usize + r.len);
        if (piece.ptr as usize) < start || piece.ptr as usize + piece.len > end {
            return None;
        }
        let idx = usize::from(r.index);
        if *self.registered.get(idx)? != r.generation {
            // The slot holds another (older) mapping. Requests of that mapping may still be
            // queued or in flight here: never swap the slot under them.
            if self.users[idx] > 0 || self.refused[idx] == r.generation {
                return None;
            }
            let iov = libc::iovec { iov_base: r.base.cast(), iov_len: r.len };
            // SAFETY: the mapping is valid now (the request's buffer lies in it and is kept
            // alive); it is used for I/O only while the generation matches, i.e. while the
            // pool has not unmapped it (the kernel pins the pages anyway).
            let ok = unsafe {
                self.ring.submitter().register_buffers_update(r.index.into(), &[iov], None)
            };
            if ok.is_err() {
                self.refused[idx] = r.generation;
                return None;
            }
            if self.registered[idx] == 0 {
                self.shared.registered_now.fetch_add(1, Ordering::Relaxed);
            }
            self.registered[idx] = r.generation;
        }
        self.shared.fixed_ops.fetch_add(1, Ordering::Relaxed);
        Some(r.index)
    }

    fn push(&mut self, entry: squeue::Entry) {
        loop {
            // SAFETY: every entry pushed names memory that outlives its completion: a slot's
            // iovecs/buffer (kept in `slots` until the completion) or `wake_buf` (kept until
            // the armed read completes, see `run`).
            if unsafe { self.ring.submission().push(&entry) }.is_ok() {
                return;
            }
            // Submission queue full: hand what is queued to the kernel and retry.
            if let Err(e) = self.ring.submit()
                && !benign(&e)
            {
                enter_failed(&e);
            }
        }
    }

    fn arm_wake(&mut self) {
        if self.wake_armed || self.disconnected {
            return;
        }
        let buf: *mut u64 = &mut *self.wake_buf;
        let e = opcode::Read::new(types::Fd(self.shared.eventfd.as_raw_fd()), buf.cast(), 8)
            .build()
            .user_data(WAKE);
        self.push(e);
        self.wake_armed = true;
    }

    /// Queue the SQE for slot `i`'s remaining bytes.
    fn issue(&mut self, i: usize) {
        let first = self.slots[i].as_ref().expect("issued slot is occupied").iov[0];
        let single = self.slots[i].as_ref().is_some_and(|f| f.iov.len() == 1);
        let buf_index = if single { self.fixed_slot(i, first) } else { None };
        if let Some(b) = buf_index {
            self.users[usize::from(b)] += 1;
        }
        let f = self.slots[i].as_mut().expect("issued slot is occupied");
        debug_assert!(f.table_slot.is_none(), "one submission per request at a time");
        f.table_slot = buf_index;
        let off = f.req.offset() + f.done;
        let fixed = types::Fixed(0);
        let entry = if single {
            let v = first;
            let len = v.len.min(u32::MAX as usize & !4095) as u32;
            match (f.req.kind(), buf_index) {
                (IoDirection::Read, Some(b)) => {
                    opcode::ReadFixed::new(fixed, v.ptr, len, b).offset(off).build()
                }
                (IoDirection::Write, Some(b)) => {
                    opcode::WriteFixed::new(fixed, v.ptr, len, b).offset(off).build()
                }
                (IoDirection::Read, None) => {
                    opcode::Read::new(fixed, v.ptr, len).offset(off).build()
                }
                (IoDirection::Write, None) => {
                    opcode::Write::new(fixed, v.ptr, len).offset(off).build()
                }
            }
        } else {
            f.raw.clear();
            f.raw.extend(
                f.iov
                    .iter()
                    .take(IOV_MAX)
                    .map(|v| libc::iovec { iov_base: v.ptr.cast(), iov_len: v.len }),
            );
            let (p, n) = (f.raw.as_ptr(), f.raw.len() as u32);
            match f.req.kind() {
                IoDirection::Read => opcode::Readv::new(fixed, p, n).offset(off).build(),
                IoDirection::Write => opcode::Writev::new(fixed, p, n).offset(off).build(),
            }
        };
        self.push(entry.user_data(i as u64));
    }

    fn start(&mut self, req: IoRequest) {
        if req.is_empty() {
            return req.complete(Ok(()));
        }
        let i = self.free.pop().expect("start is called only with a free slot");
        let iov = req.iovecs().to_vec();
        self.slots[i] = Some(InFlight { req, iov, raw: Vec::new(), done: 0, table_slot: None });
        self.in_flight += 1;
        self.issue(i);
    }

    fn finish(&mut self, i: usize, result: Result<(), IoFailure>) {
        let f = self.slots[i].take().expect("completed slot is occupied");
        self.free.push(i);
        self.in_flight -= 1;
        f.req.complete(result);
    }

    fn on_completion(&mut self, user_data: u64, res: i32) {
        if user_data == WAKE {
            self.wake_armed = false;
            return;
        }
        let i = user_data as usize;
        // The kernel is done with this submission (and its buffer-table slot).
        let slot = self.slots[i].as_mut().expect("completed slot is occupied");
        if let Some(b) = slot.table_slot.take() {
            self.users[usize::from(b)] -= 1;
        }
        if res < 0 {
            if res == -libc::EAGAIN || res == -libc::EINTR {
                return self.issue(i);
            }
            return self.finish(i, Err(IoFailure::Os(io::Error::from_raw_os_error(-res))));
        }
        let f = self.slots[i].as_mut().expect("completed slot is occupied");
        if res == 0 {
            let (done, len) = (f.done, f.req.len());
            return self.finish(i, Err(IoFailure::Short { done, len }));
        }
        f.done += res as u64;
        advance_iovecs(&mut f.iov, res as usize);
        if f.iov.is_empty() {
            self.finish(i, Ok(()));
        } else {
            self.issue(i);
        }
    }

    fn intake(&mut self) {
        while !self.free.is_empty() {
            match self.rx.try_recv() {
                Ok(req) => self.start(req),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.disconnected = true;
                    break;
                }
            }
        }
    }

    fn run(&mut self) {
        loop {
            self.drop_stale_registrations();
            self.intake();
            if self.disconnected && self.in_flight == 0 {
                break;
            }
            let can_accept = !self.free.is_empty() && !self.disconnected;
            if can_accept {
                self.arm_wake();
                self.shared.sleeping.store(true, Ordering::SeqCst);
                if !self.rx.is_empty() {
                    self.shared.sleeping.store(false, Ordering::SeqCst);
                    if let Err(e) = self.ring.submit()
                        && !benign(&e)
                    {
                        enter_failed(&e);
                    }
                    self.reap();
                    continue;
                }
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if benign(&e) => {}
                Err(e) => enter_failed(&e),
            }
            self.shared.sleeping.store(false, Ordering::SeqCst);
            self.reap();
        }
        // Nothing of ours is in flight; the eventfd read may still be armed: complete it so the
        // kernel is done with `wake_buf` before it is freed.
        while self.wake_armed {
            self.shared.wake();
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if benign(&e) => {}
                Err(e) => enter_failed(&e),
            }
            self.reap();
        }
    }

    fn reap(&mut self) {
        loop {
            let batch: Vec<(u64, i32)> =
                self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            if batch.is_empty() {
                break;
            }
            for (ud, res) in batch {
                self.on_completion(ud, res);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::pool::{BufferPool, IoBuf, PoolConfig};

    fn submit(b: &UringBackend, kind: IoDirection, offset: u64, mut buf: IoBuf) -> (IoBuf, bool) {
        let (tx, rx) = mpsc::channel();
        let iov = vec![IoVec { ptr: buf.as_mut_ptr(), len: buf.len() }];
        let reg = buf.registration();
        let holder = Mutex::new(Some(buf));
        let done = Box::new(move |r: Result<(), IoFailure>| {
            let buf = holder.lock().take().expect("completed once");
            tx.send((buf, r.is_ok())).expect("receiver alive");
        });
        // SAFETY: the iovec points into `buf`, owned by the completion until it runs.
        let mut req = unsafe { IoRequest::new(kind, 0, offset, iov, done) };
        // SAFETY: the registration is the one of the mapping holding `buf`.
        unsafe { req.set_registration(reg) };
        b.submit(req);
        rx.recv().expect("completion arrives")
    }

    use parking_lot::Mutex;

    #[test]
    fn pool_buffers_use_fixed_slots_and_survive_slot_reuse() {
        let dir = tempfile::tempdir().unwrap();
        let dev = crate::device::open_path(&dir.path().join("f"), 8 << 20).unwrap();
        let b = UringBackend::new(vec![dev.fd], 4, 1).unwrap();
        for round in 0..3u8 {
            // A new pool each round: its mapping may reuse a slot index with a new generation.
            let pool =
                BufferPool::new(PoolConfig { capacity_bytes: 8 << 20, prefer_huge_pages: true })
                    .unwrap();
            let mut buf = pool.alloc(1 << 20).unwrap();
            buf.fill(round + 1);
            let before = b.fixed_buffer_ops();
            let (buf, ok) = submit(&b, IoDirection::Write, 0, buf);
            assert!(ok);
            let mut buf = buf;
            buf.fill(0);
            let (buf, ok) = submit(&b, IoDirection::Read, 0, buf);
            assert!(ok);
            assert!(buf.iter().all(|&x| x == round + 1), "round {round}: data came back");
            if std::env::var("TERAIO_FIXED_BUFFERS").as_deref() != Ok("0") {
                assert_eq!(b.fixed_buffer_ops(), before + 2, "both requests used a fixed buffer");
            }
        }
    }
}
