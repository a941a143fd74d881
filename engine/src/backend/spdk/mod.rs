//! The `spdk` backend (feature `spdk`): SPDK's userspace NVMe driver and its bdev layer.
//!
//! - Targets ([`spdk_config`](crate::backend::spdk_config) syntax): an SPDK bdev (uring or aio)
//!   over a file or block device, or a namespace of an NVMe controller attached with SPDK's own
//!   driver (`spdk_nvme_*`) over PCIe (a function bound to vfio-pci) or NVMe-oF (TCP).
//! - Threads: each device gets `io_threads` reactors. A reactor is an OS thread that owns one
//!   SPDK thread and one I/O channel (bdev) or I/O queue pair (NVMe). Requests reach it over a
//!   lock-free crossbeam channel; it submits up to `queue_depth` of them and busy-polls while
//!   any is in flight, then parks on the channel (1 ms) so an idle array costs no core.
//!   Completions run on the reactor and end the engine's tickets. In SPDK's interrupt mode
//!   (`interrupt`, aio bdevs only) a reactor with requests in flight sleeps in `poll` on its
//!   SPDK thread's fd group and an eventfd that submitters write when it said it sleeps. With
//!   `poll_sleep_us` (polling mode) it sleeps the same way on its uring bdev's io_uring (the
//!   descriptor that appeared while it took its channel), else naps that long.
//! - Request sizes: SPDK's large iobuf buffers are sized to the engine's largest request, so
//!   the bdev layer does not split requests to the uring/aio bdevs ([`env`]).
//! - Memory: bdevs over files and NVMe/TCP move the engine's own buffers (the kernel or the TCP
//!   stack copies them; nothing is DMAed into them). PCIe targets, and every target when
//!   `bounce` is set, copy through a DMA buffer from SPDK's heap (`spdk_malloc`), freed when
//!   the request completes.
//! - Control path (create/delete bdevs, attach/detach controllers, admin queue polling) runs on
//!   the process-wide app thread ([`env`]).
//! - Shutdown: dropping the backend drains every reactor (each waits for its requests in
//!   flight), releases channels, queue pairs and SPDK threads, then closes and deletes the
//!   bdevs and detaches the controllers. Every error path of [`SpdkBackend::open`] drops what
//!   it built the same way.

mod env;
mod ffi;

use std::cell::Cell;
use std::collections::VecDeque;
use std::ffi::{CString, c_int, c_void};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering, fence};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};

use super::spdk_config::{
    FileBdev, SpdkOptions, SpdkTarget, check_interrupt_support, check_pci_binding, parse_target,
};
use super::{Backend, IoDirection, IoFailure, IoRequest, IoVec, bad_device};
use crate::device::{self, DEFAULT_MAX_IO_BYTES};
use crate::{Error, Result};

/// What the array needs to know of one opened SPDK target.
#[derive(Debug)]
pub struct SpdkDeviceInfo {
    /// Name for messages (`uring:/path`, `nvme:trtype:... ns:1`).
    pub name: String,
    /// The file or device path (bdevs), or the target string (NVMe).
    pub path: PathBuf,
    /// Usable bytes.
    pub capacity_bytes: u64,
    /// Logical block size.
    pub block_bytes: u32,
    /// Largest request passed whole.
    pub max_io_bytes: u64,
    /// The file's exclusive lock (bdevs over files), held while the array lives.
    pub lock: Option<OwnedFd>,
}

/// The opened SPDK object behind one device.
enum Handle {
    Bdev {
        name: CString,
        module: FileBdev,
        desc: *mut ffi::spdk_bdev_desc,
        block: u32,
        blocks: u64,
        flush: bool,
    },
    Nvme {
        ctrlr: *mut ffi::spdk_nvme_ctrlr,
        ns: *mut ffi::spdk_nvme_ns,
        sector: u32,
    },
}

// SAFETY: the raw pointers are SPDK objects used by the rules of SPDK's threading model: a
// bdev descriptor is opened and closed on the app thread and used by reactors through their own
// channels; an NVMe controller's qpair allocation is internally locked and each qpair is used
// by one reactor; the namespace is read-only.
unsafe impl Send for Handle {}
// SAFETY: see `Send`: shared access only reads the pointers.
unsafe impl Sync for Handle {}

impl Handle {
    fn block(&self) -> u32 {
        match self {
            Handle::Bdev { block, .. } => *block,
            Handle::Nvme { sector, .. } => *sector,
        }
    }
}

enum Cmd {
    Io(IoRequest),
    Flush(std::sync::mpsc::SyncSender<io::Result<()>>),
}

struct Reactor {
    tx: Option<Sender<Cmd>>,
    /// Interrupt mode: wakes the reactor when it sleeps with requests in flight.
    wake: Option<Arc<Wake>>,
    join: Option<JoinHandle<()>>,
}

impl Reactor {
    /// Hand `cmd` to the reactor (waking it in interrupt mode); gives it back if the reactor
    /// is gone.
    fn send(&self, cmd: Cmd) -> std::result::Result<(), Cmd> {
        let Some(tx) = &self.tx else { return Err(cmd) };
        tx.send(cmd).map_err(|e| e.0)?;
        if let Some(w) = &self.wake {
            w.notify();
        }
        Ok(())
    }
}

/// How a reactor in interrupt mode is woken for new requests while it sleeps on its SPDK
/// thread's fd group: an eventfd written only when the reactor said it sleeps.
struct Wake {
    fd: OwnedFd,
    sleeping: AtomicBool,
}

impl Wake {
    fn new() -> Result<Self> {
        // SAFETY: plain syscall; the result is checked and owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::Os {
                context: "creating an eventfd for an SPDK reactor".into(),
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: `fd` is a new descriptor owned by nobody else.
        Ok(Self { fd: unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }, sleeping: false.into() })
    }

    /// After a command was queued: wake the reactor if it sleeps. Pairs with the fence in
    /// [`Wake::sleep`]: either the reactor sees the command before sleeping, or this sees it
    /// sleeping.
    fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) {
            let one = 1u64;
            // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
            unsafe { libc::write(self.fd.as_raw_fd(), (&raw const one).cast(), 8) };
        }
    }

    /// Sleep until `thread_fd` (the SPDK thread's fd group in interrupt mode, the uring bdev's
    /// ring when polling with naps; -1: none) is readable, a command is queued, or `timeout`
    /// passed. `queued` is re-checked after announcing the sleep.
    fn sleep(&self, thread_fd: c_int, timeout: Duration, queued: impl Fn() -> bool) {
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if !queued() {
            let mut fds = [
                libc::pollfd { fd: thread_fd, events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let ts = libc::timespec {
                tv_sec: timeout.as_secs() as libc::time_t,
                tv_nsec: libc::c_long::from(timeout.subsec_nanos() as i32),
            };
            // SAFETY: two valid pollfd entries (a negative fd is ignored) and a valid timespec;
            // no signal mask.
            unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        }
        self.sleeping.store(false, Ordering::Relaxed);
        let mut n = 0u64;
        // SAFETY: reads at most 8 bytes into a valid u64 (non-blocking; clears the eventfd).
        unsafe { libc::read(self.fd.as_raw_fd(), (&raw mut n).cast(), 8) };
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}

struct Device {
    handle: Arc<Handle>,
    reactors: Vec<Reactor>,
    next: AtomicUsize,
    /// Descriptor for fdatasync where the bdev module has no flush (bdev_uring).
    flush_fd: Option<Arc<OwnedFd>>,
    env: Arc<env::SpdkEnv>,
}

impl Drop for Device {
    fn drop(&mut self) {
        // Reactors first: each drains its requests and releases its channel or qpair.
        self.reactors.clear();
        release(&self.env, &self.handle);
    }
}

/// Close and delete a bdev, or detach a controller, on the app thread.
fn release(rt: &env::SpdkEnv, handle: &Arc<Handle>) {
    let h = Arc::clone(handle);
    let r = rt.call_async(move |done: Box<dyn FnOnce(c_int) + Send>| match &*h {
        Handle::Bdev { name, module, desc, .. } => {
            // SAFETY: the descriptor was opened on this (app) thread; no channel is left.
            unsafe { ffi::spdk_bdev_close(*desc) };
            delete_bdev(*module, name, done);
        }
        Handle::Nvme { ctrlr, .. } => {
            env::forget_controller(*ctrlr);
            // SAFETY: every qpair of the controller was freed by its reactor.
            done(unsafe { ffi::spdk_nvme_detach(*ctrlr) });
        }
    });
    if let Ok(rc) = r
        && rc != 0
    {
        crate::notice::warning(format!("releasing an SPDK target failed (error {rc})"));
    }
}

extern "C" fn bdev_deleted(arg: *mut c_void, rc: c_int) {
    // SAFETY: `arg` is the boxed callback leaked by `delete_bdev`, called exactly once.
    let done = unsafe { Box::from_raw(arg.cast::<Box<dyn FnOnce(c_int) + Send>>()) };
    done(rc);
}

/// Delete a file bdev (app thread); `done` gets the result.
fn delete_bdev(module: FileBdev, name: &CString, done: Box<dyn FnOnce(c_int) + Send>) {
    let arg = Box::into_raw(Box::new(done)).cast::<c_void>();
    // SAFETY: app thread; `arg` is reclaimed by `bdev_deleted`, which SPDK calls once.
    unsafe {
        match module {
            FileBdev::Uring => ffi::delete_uring_bdev(name.as_ptr(), Some(bdev_deleted), arg),
            FileBdev::Aio => ffi::bdev_aio_delete(name.as_ptr(), Some(bdev_deleted), arg),
        }
    }
}

extern "C" fn bdev_event(
    _kind: ffi::spdk_bdev_event_type,
    _bdev: *mut ffi::spdk_bdev,
    _ctx: *mut c_void,
) {
}

static BDEV_SEQ: AtomicUsize = AtomicUsize::new(0);

/// The SPDK backend.
pub struct SpdkBackend {
    devices: Vec<Device>,
    queue_depth: usize,
}

impl std::fmt::Debug for SpdkBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpdkBackend")
            .field("devices", &self.devices.len())
            .field("queue_depth", &self.queue_depth)
            .finish()
    }
}

fn nvme_error(target: &str, why: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("SPDK target {target}: {why}"))
}

impl SpdkBackend {
    /// Open `targets` (SPDK target syntax) and start `io_threads` reactors per device with
    /// `queue_depth` requests in flight each. Files are created or grown to `file_size_bytes`.
    pub fn open(
        targets: &[PathBuf],
        file_size_bytes: u64,
        queue_depth: u32,
        io_threads: usize,
        opts: &SpdkOptions,
    ) -> Result<(Vec<SpdkDeviceInfo>, SpdkBackend)> {
        let parsed: Vec<SpdkTarget> =
            targets.iter().map(|t| parse_target(t, opts.bdev)).collect::<Result<_>>()?;
        if opts.interrupt {
            parsed.iter().try_for_each(check_interrupt_support)?;
        }
        for (i, t) in parsed.iter().enumerate() {
            if parsed[..i].contains(t) {
                return Err(Error::InvalidArgument(format!(
                    "{} is listed twice (same file or device)",
                    t.describe()
                )));
            }
        }
        let mut pci = Vec::new();
        for t in &parsed {
            if let SpdkTarget::Nvme { pci_addr: Some(bdf), .. } = t {
                check_pci_binding(Path::new("/sys"), bdf)?;
                pci.push(bdf.clone());
            }
        }
        // Files first: create, size and lock them before SPDK starts.
        let mut opened = Vec::new();
        for t in &parsed {
            opened.push(match t {
                SpdkTarget::Bdev { path, .. } => Some(device::open_path(path, file_size_bytes)?),
                SpdkTarget::Nvme { .. } => None,
            });
        }
        let rt = env::get(opts, &pci)?;
        let qd = queue_depth.clamp(1, 4096) as usize;
        let mut backend = SpdkBackend { devices: Vec::new(), queue_depth: qd };
        let mut infos = Vec::new();
        for (t, o) in parsed.iter().zip(opened) {
            let (handle, info) = match (t, o) {
                (SpdkTarget::Bdev { module, path }, Some(o)) => {
                    let name = CString::new(format!(
                        "teraio{}_{}",
                        std::process::id(),
                        BDEV_SEQ.fetch_add(1, Ordering::Relaxed)
                    ))
                    .expect("no NUL in a bdev name");
                    let handle = open_bdev(&rt, *module, name, path, o.block_bytes)?;
                    let info = SpdkDeviceInfo {
                        name: t.describe(),
                        path: path.clone(),
                        capacity_bytes: match &handle {
                            Handle::Bdev { blocks, block, .. } => blocks * u64::from(*block),
                            Handle::Nvme { .. } => unreachable!("a bdev target"),
                        },
                        block_bytes: handle.block(),
                        max_io_bytes: o.max_io_bytes.min(DEFAULT_MAX_IO_BYTES),
                        lock: o.lock,
                    };
                    (handle, (info, Some(o.fd)))
                }
                (SpdkTarget::Nvme { trid, nsid, pci_addr }, _) => {
                    let (handle, size, max_xfer) = open_nvme(&rt, t, trid, *nsid)?;
                    let block = handle.block();
                    let max = u64::from(max_xfer).clamp(u64::from(block), DEFAULT_MAX_IO_BYTES);
                    let info = SpdkDeviceInfo {
                        name: t.describe(),
                        path: PathBuf::from(pci_addr.clone().unwrap_or_else(|| t.describe())),
                        capacity_bytes: size / u64::from(block) * u64::from(block),
                        block_bytes: block,
                        max_io_bytes: max / u64::from(block) * u64::from(block),
                        lock: None,
                    };
                    (handle, (info, None))
                }
                (SpdkTarget::Bdev { .. }, None) => unreachable!("bdev targets were opened"),
            };
            let (info, flush_fd) = info;
            let handle = Arc::new(handle);
            let pcie = matches!(t, SpdkTarget::Nvme { pci_addr: Some(_), .. });
            let bounce = opts.bounce || pcie;
            let d = backend.devices.len();
            // Owned by `backend` at once: an error below releases it.
            backend.devices.push(Device {
                handle: Arc::clone(&handle),
                reactors: Vec::new(),
                next: AtomicUsize::new(0),
                flush_fd: flush_fd.clone(),
                env: Arc::clone(&rt),
            });
            for r in 0..io_threads.max(1) {
                let reactor = start_reactor(
                    format!("teraio-spdk-{d}.{r}"),
                    Arc::clone(&handle),
                    qd,
                    bounce,
                    flush_fd.clone(),
                    rt.interrupt,
                    Duration::from_micros(u64::from(opts.poll_sleep_us)),
                )?;
                backend.devices[d].reactors.push(reactor);
            }
            infos.push(info);
        }
        Ok((infos, backend))
    }
}

fn open_bdev(
    rt: &env::SpdkEnv,
    module: FileBdev,
    name: CString,
    path: &Path,
    block: u32,
) -> Result<Handle> {
    let file = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|_| {
        Error::InvalidArgument(format!("{}: a path with a NUL byte", path.display()))
    })?;
    let shown = path.display().to_string();
    let r =
        rt.call_async(move |done: Box<dyn FnOnce(std::result::Result<Handle, String>) + Send>| {
            // SAFETY: (whole block) app thread; every string outlives the calls that read it.
            let created = unsafe {
                match module {
                    FileBdev::Uring => {
                        let o = ffi::bdev_uring_opts {
                            name: name.as_ptr(),
                            filename: file.as_ptr(),
                            block_size: block,
                            uuid: Default::default(),
                        };
                        !ffi::create_uring_bdev(&o).is_null()
                    }
                    FileBdev::Aio => {
                        ffi::create_aio_bdev(
                            name.as_ptr(),
                            file.as_ptr(),
                            block,
                            false,
                            false,
                            std::ptr::null(),
                            false,
                        ) == 0
                    }
                }
            };
            if !created {
                return done(Err(format!(
                    "SPDK could not create a {} bdev over it (see SPDK's message above)",
                    module.name()
                )));
            }
            let mut desc: *mut ffi::spdk_bdev_desc = std::ptr::null_mut();
            // SAFETY: app thread; `desc` is a valid out-pointer; the event callback ignores events.
            let rc = unsafe {
                ffi::spdk_bdev_open_ext(
                    name.as_ptr(),
                    true,
                    Some(bdev_event),
                    std::ptr::null_mut(),
                    &mut desc,
                )
            };
            if rc != 0 {
                let msg = format!("SPDK could not open its bdev (error {rc})");
                return delete_bdev(module, &name, Box::new(move |_| done(Err(msg))));
            }
            // SAFETY: `desc` is open; the bdev outlives it.
            let (block, blocks, flush) = unsafe {
                let b = ffi::spdk_bdev_desc_get_bdev(desc);
                (
                    ffi::spdk_bdev_get_block_size(b),
                    ffi::spdk_bdev_get_num_blocks(b),
                    ffi::spdk_bdev_io_type_supported(b, ffi::SPDK_BDEV_IO_TYPE_FLUSH),
                )
            };
            done(Ok(Handle::Bdev { name, module, desc, block, blocks, flush }))
        })?;
    r.map_err(|m| Error::InvalidArgument(format!("SPDK target {}:{shown}: {m}", module.name())))
}

/// Attach the controller and find the namespace: (handle, namespace bytes, max transfer).
fn open_nvme(
    rt: &env::SpdkEnv,
    target: &SpdkTarget,
    trid: &str,
    nsid: u32,
) -> Result<(Handle, u64, u32)> {
    let shown = target.describe();
    let c = CString::new(trid).map_err(|_| nvme_error(&shown, "a NUL byte in the target"))?;
    let r = rt.call(move || -> std::result::Result<(Handle, u64, u32), String> {
        let mut id = ffi::spdk_nvme_transport_id::default();
        // SAFETY: valid out-pointer and NUL-terminated string.
        if unsafe { ffi::spdk_nvme_transport_id_parse(&mut id, c.as_ptr()) } != 0 {
            return Err("SPDK cannot parse this transport ID".into());
        }
        let mut o = ffi::spdk_nvme_ctrlr_opts::default();
        let size = std::mem::size_of::<ffi::spdk_nvme_ctrlr_opts>();
        // SAFETY: valid out-pointer of the size given.
        unsafe { ffi::spdk_nvme_ctrlr_get_default_ctrlr_opts(&mut o, size) };
        // SAFETY: `id` and `o` are valid for the call; the connect is synchronous.
        let ctrlr = unsafe { ffi::spdk_nvme_connect(&id, &o, size) };
        if ctrlr.is_null() {
            return Err("no NVMe controller could be attached there (not found, not \
                        listening, or refused; see SPDK's message above)"
                .into());
        }
        // SAFETY: `ctrlr` is attached; namespaces live as long as it.
        let ns = unsafe { ffi::spdk_nvme_ctrlr_get_ns(ctrlr, nsid) };
        // SAFETY: as above; `ns` checked for NULL before use.
        if ns.is_null() || !unsafe { ffi::spdk_nvme_ns_is_active(ns) } {
            // SAFETY: no qpair exists yet.
            unsafe { ffi::spdk_nvme_detach(ctrlr) };
            return Err(format!("the controller has no active namespace {nsid}"));
        }
        // SAFETY: `ns` is an active namespace of the attached controller.
        let (size, sector, max) = unsafe {
            (
                ffi::spdk_nvme_ns_get_size(ns),
                ffi::spdk_nvme_ns_get_sector_size(ns),
                ffi::spdk_nvme_ns_get_max_io_xfer_size(ns),
            )
        };
        env::poll_controller(ctrlr);
        Ok((Handle::Nvme { ctrlr, ns, sector }, size, max))
    })?;
    r.map_err(|m| nvme_error(&shown, m))
}

fn start_reactor(
    name: String,
    handle: Arc<Handle>,
    qd: usize,
    bounce: bool,
    flush_fd: Option<Arc<OwnedFd>>,
    interrupt: bool,
    nap: Duration,
) -> Result<Reactor> {
    let (tx, rx) = crossbeam_channel::unbounded::<Cmd>();
    // Interrupt mode, and polling with naps: the reactor sleeps on file descriptors, and a
    // submission writes its eventfd when it said it sleeps.
    let wake = if interrupt || !nap.is_zero() { Some(Arc::new(Wake::new()?)) } else { None };
    let wake2 = wake.clone();
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<std::result::Result<(), String>>(1);
    let thread_name = name.clone();
    let join = std::thread::Builder::new()
        .name(name)
        .spawn(move || {
            env::POLLERS.fetch_add(1, Ordering::AcqRel);
            let nap = if interrupt { Duration::ZERO } else { nap };
            reactor_main(thread_name, handle, rx, qd, bounce, flush_fd, wake2, nap, ready_tx);
            env::POLLERS.fetch_sub(1, Ordering::AcqRel);
        })
        .map_err(|e| Error::Os { context: "starting an SPDK reactor".into(), source: e })?;
    let mut reactor = Reactor { tx: Some(tx), wake, join: Some(join) };
    match ready_rx.recv() {
        Ok(Ok(())) => Ok(reactor),
        Ok(Err(m)) => Err(Error::Unsupported(m)),
        Err(_) => {
            reactor.tx = None;
            Err(Error::Unsupported("an SPDK reactor exited at start".into()))
        }
    }
}

/// Per-reactor counters shared with the completion callbacks (same OS thread).
struct ReactorState {
    in_flight: Cell<usize>,
}

enum Work {
    Io(IoRequest),
    Flush(std::sync::mpsc::SyncSender<io::Result<()>>),
}

/// One request handed to SPDK; owned by SPDK (as its callback argument) while in flight.
struct Ctx {
    work: Work,
    /// The iovecs SPDK reads (kept stable until completion).
    iov: Vec<libc::iovec>,
    /// DMA buffer of a bounced transfer (NULL otherwise).
    bounce: *mut u8,
    state: *const ReactorState,
    /// SGL cursor for NVMe vectored commands.
    sgl_idx: usize,
    sgl_off: usize,
}

impl Ctx {
    fn len(&self) -> u64 {
        self.iov.iter().map(|v| v.iov_len as u64).sum()
    }
}

/// End a request: copy a bounced read back, free the bounce buffer, complete.
#[allow(clippy::boxed_local)] // the Ctx travels boxed through SPDK as a raw pointer
fn finish(ctx: Box<Ctx>, ok: std::result::Result<(), String>) {
    let Ctx { work, iov, bounce, .. } = *ctx;
    if !bounce.is_null() {
        if ok.is_ok()
            && let Work::Io(req) = &work
            && req.kind() == IoDirection::Read
        {
            let mut off = 0usize;
            for v in &iov {
                // SAFETY: the bounce buffer holds the request's length; each iovec names
                // memory the request owns until it completes (below).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bounce.add(off),
                        v.iov_base.cast::<u8>(),
                        v.iov_len,
                    )
                };
                off += v.iov_len;
            }
        }
        // SAFETY: allocated by spdk_malloc in `start`; SPDK is done with it.
        unsafe { ffi::spdk_free(bounce.cast()) };
    }
    match work {
        Work::Io(req) => req.complete(ok.map_err(|m| IoFailure::Os(io::Error::other(m)))),
        Work::Flush(tx) => {
            let _ = tx.send(ok.map_err(io::Error::other));
        }
    }
}

extern "C" fn bdev_done(io: *mut ffi::spdk_bdev_io, success: bool, arg: *mut c_void) {
    // SAFETY: SPDK hands back the I/O it gave us; freed once.
    unsafe { ffi::spdk_bdev_free_io(io) };
    // SAFETY: `arg` is the Ctx leaked at submission, reclaimed exactly once here.
    let ctx = unsafe { Box::from_raw(arg.cast::<Ctx>()) };
    // SAFETY: the reactor state outlives every request it submitted.
    let st = unsafe { &*ctx.state };
    st.in_flight.set(st.in_flight.get() - 1);
    finish(ctx, if success { Ok(()) } else { Err("SPDK bdev I/O failed".into()) });
}

extern "C" fn nvme_done(arg: *mut c_void, cpl: *const ffi::spdk_nvme_cpl) {
    // SAFETY: a completion entry is 16 bytes; the status field is the last 16-bit word.
    let status = unsafe { std::ptr::read_unaligned(cpl.cast::<u8>().add(14).cast::<u16>()) };
    let (sc, sct) = ((status >> 1) & 0xff, (status >> 9) & 0x7);
    // SAFETY: `arg` is the Ctx leaked at submission, reclaimed exactly once here.
    let ctx = unsafe { Box::from_raw(arg.cast::<Ctx>()) };
    // SAFETY: the reactor state outlives every request it submitted.
    let st = unsafe { &*ctx.state };
    st.in_flight.set(st.in_flight.get() - 1);
    let r = if sc == 0 && sct == 0 {
        Ok(())
    } else {
        Err(format!("NVMe command failed (status code type {sct:#x}, status code {sc:#x})"))
    };
    finish(ctx, r);
}

extern "C" fn sgl_reset(arg: *mut c_void, offset: u32) {
    // SAFETY: `arg` is the in-flight Ctx; SPDK calls this on the reactor thread.
    let ctx = unsafe { &mut *arg.cast::<Ctx>() };
    let mut off = offset as usize;
    ctx.sgl_idx = 0;
    while ctx.sgl_idx < ctx.iov.len() && off >= ctx.iov[ctx.sgl_idx].iov_len {
        off -= ctx.iov[ctx.sgl_idx].iov_len;
        ctx.sgl_idx += 1;
    }
    ctx.sgl_off = off;
}

extern "C" fn sgl_next(arg: *mut c_void, address: *mut *mut c_void, length: *mut u32) -> c_int {
    // SAFETY: `arg` is the in-flight Ctx; SPDK calls this on the reactor thread.
    let ctx = unsafe { &mut *arg.cast::<Ctx>() };
    let Some(v) = ctx.iov.get(ctx.sgl_idx) else { return -libc::EINVAL };
    // SAFETY: out-pointers from SPDK; the address stays inside the iovec.
    unsafe {
        *address = v.iov_base.cast::<u8>().add(ctx.sgl_off).cast();
        *length = (v.iov_len - ctx.sgl_off) as u32;
    }
    ctx.sgl_idx += 1;
    ctx.sgl_off = 0;
    0
}

/// What a reactor submits through.
enum Io {
    Bdev {
        desc: *mut ffi::spdk_bdev_desc,
        ch: *mut ffi::spdk_io_channel,
        block: u64,
        blocks: u64,
        flush: bool,
    },
    Nvme {
        ns: *mut ffi::spdk_nvme_ns,
        qpair: *mut ffi::spdk_nvme_qpair,
        sector: u64,
    },
}

/// Submit `ctx` (already prepared); returns it back on -ENOMEM (retry later).
fn submit(io: &Io, ctx: Box<Ctx>) -> Option<Box<Ctx>> {
    // SAFETY: the reactor state outlives every request it submitted.
    let st = unsafe { &*ctx.state };
    let (kind, offset) = match &ctx.work {
        Work::Io(r) => (Some(r.kind()), r.offset()),
        Work::Flush(_) => (None, 0),
    };
    let len = ctx.len();
    let single = ctx.bounce.is_null().then(|| (ctx.iov.len() == 1).then(|| ctx.iov[0].iov_base));
    let raw = Box::into_raw(ctx);
    let arg = raw.cast::<c_void>();
    // SAFETY: (whole match) every pointer handed to SPDK (iovecs, bounce buffer, the Ctx as
    // callback argument) stays valid until the callback reclaims the Ctx; on a failed
    // submission SPDK keeps nothing and the Ctx is reclaimed below.
    let rc = unsafe {
        let iov = (*raw).iov.as_mut_ptr().cast::<ffi::iovec>();
        let n = (*raw).iov.len() as c_int;
        let bounce = (*raw).bounce.cast::<c_void>();
        match (io, kind) {
            (Io::Bdev { desc, ch, blocks, flush, .. }, None) => {
                if *flush {
                    ffi::spdk_bdev_flush_blocks(*desc, *ch, 0, *blocks, Some(bdev_done), arg)
                } else {
                    -libc::EOPNOTSUPP
                }
            }
            (Io::Bdev { desc, ch, block, .. }, Some(k)) => {
                let (ob, nb) = (offset / block, len / block);
                match (k, bounce.is_null()) {
                    (IoDirection::Read, true) => ffi::spdk_bdev_readv_blocks(
                        *desc,
                        *ch,
                        iov,
                        n,
                        ob,
                        nb,
                        Some(bdev_done),
                        arg,
                    ),
                    (IoDirection::Write, true) => ffi::spdk_bdev_writev_blocks(
                        *desc,
                        *ch,
                        iov,
                        n,
                        ob,
                        nb,
                        Some(bdev_done),
                        arg,
                    ),
                    (IoDirection::Read, false) => {
                        ffi::spdk_bdev_read_blocks(*desc, *ch, bounce, ob, nb, Some(bdev_done), arg)
                    }
                    (IoDirection::Write, false) => ffi::spdk_bdev_write_blocks(
                        *desc,
                        *ch,
                        bounce,
                        ob,
                        nb,
                        Some(bdev_done),
                        arg,
                    ),
                }
            }
            (Io::Nvme { ns, qpair, .. }, None) => {
                ffi::spdk_nvme_ns_cmd_flush(*ns, *qpair, Some(nvme_done), arg)
            }
            (Io::Nvme { ns, qpair, sector }, Some(k)) => {
                let (lba, count) = (offset / sector, (len / sector) as u32);
                let contiguous = if bounce.is_null() { single.flatten() } else { Some(bounce) };
                match (k, contiguous) {
                    (IoDirection::Read, Some(buf)) => ffi::spdk_nvme_ns_cmd_read(
                        *ns,
                        *qpair,
                        buf,
                        lba,
                        count,
                        Some(nvme_done),
                        arg,
                        0,
                    ),
                    (IoDirection::Write, Some(buf)) => ffi::spdk_nvme_ns_cmd_write(
                        *ns,
                        *qpair,
                        buf,
                        lba,
                        count,
                        Some(nvme_done),
                        arg,
                        0,
                    ),
                    (IoDirection::Read, None) => ffi::spdk_nvme_ns_cmd_readv(
                        *ns,
                        *qpair,
                        lba,
                        count,
                        Some(nvme_done),
                        arg,
                        0,
                        Some(sgl_reset),
                        Some(sgl_next),
                    ),
                    (IoDirection::Write, None) => ffi::spdk_nvme_ns_cmd_writev(
                        *ns,
                        *qpair,
                        lba,
                        count,
                        Some(nvme_done),
                        arg,
                        0,
                        Some(sgl_reset),
                        Some(sgl_next),
                    ),
                }
            }
        }
    };
    if rc == 0 {
        st.in_flight.set(st.in_flight.get() + 1);
        return None;
    }
    // SAFETY: the submission failed, so SPDK holds no reference to the Ctx.
    let ctx = unsafe { Box::from_raw(raw) };
    if rc == -libc::ENOMEM {
        return Some(ctx);
    }
    let msg = if rc == -libc::EOPNOTSUPP {
        "not supported".to_string()
    } else {
        format!("SPDK refused the request: {}", io::Error::from_raw_os_error(-rc))
    };
    finish(ctx, Err(msg));
    None
}

#[allow(clippy::too_many_arguments)] // one reactor's whole setup, from start_reactor only
fn reactor_main(
    name: String,
    handle: Arc<Handle>,
    rx: Receiver<Cmd>,
    qd: usize,
    bounce: bool,
    flush_fd: Option<Arc<OwnedFd>>,
    wake: Option<Arc<Wake>>,
    nap: Duration,
    ready: std::sync::mpsc::SyncSender<std::result::Result<(), String>>,
) {
    let cname = CString::new(name.replace('-', "_")).expect("no NUL in a thread name");
    // SAFETY: the thread library is initialized (the environment exists); NULL cpumask: any core.
    let thread = unsafe { ffi::spdk_thread_create(cname.as_ptr(), std::ptr::null()) };
    if thread.is_null() {
        let _ = ready.send(Err("could not create an SPDK thread".into()));
        return;
    }
    // SAFETY: this OS thread polls `thread` from now on.
    unsafe { ffi::spdk_set_thread(thread) };
    let interrupt = wake.is_some() && nap.is_zero();
    let naps_on_ring = wake.is_some() && !nap.is_zero();
    let rings_before = if naps_on_ring { io_uring_fds() } else { Vec::new() };
    let io = match &*handle {
        Handle::Bdev { desc, block, blocks, flush, .. } => {
            // SAFETY: the descriptor is open; the channel belongs to this SPDK thread.
            let ch = unsafe { ffi::spdk_bdev_get_io_channel(*desc) };
            if ch.is_null() {
                let _ = ready.send(Err("could not get an SPDK bdev I/O channel".into()));
                exit_thread(thread);
                return;
            }
            Io::Bdev { desc: *desc, ch, block: u64::from(*block), blocks: *blocks, flush: *flush }
        }
        Handle::Nvme { ctrlr, ns, sector } => {
            // SAFETY: the controller is attached; default qpair options.
            let qpair = unsafe { ffi::spdk_nvme_ctrlr_alloc_io_qpair(*ctrlr, std::ptr::null(), 0) };
            if qpair.is_null() {
                let _ = ready.send(Err("could not allocate an NVMe I/O queue pair".into()));
                exit_thread(thread);
                return;
            }
            Io::Nvme { ns: *ns, qpair, sector: u64::from(*sector) }
        }
    };
    // Interrupt mode: the SPDK thread's fd group (an epoll fd) says when it has work.
    // Polling with naps over a uring bdev: the io_uring SPDK made for this thread's channel
    // (the one io_uring descriptor that appeared while the channel was taken; none if another
    // thread made one meanwhile) is readable when a completion is posted.
    let (thread_fd, wait) = if interrupt {
        // SAFETY: `thread` is this OS thread's SPDK thread.
        (unsafe { ffi::spdk_thread_get_interrupt_fd(thread) }, Duration::from_millis(10))
    } else if naps_on_ring && matches!(&*handle, Handle::Bdev { module: FileBdev::Uring, .. }) {
        let new: Vec<c_int> =
            io_uring_fds().into_iter().filter(|f| !rings_before.contains(f)).collect();
        match new[..] {
            [ring] => (ring, Duration::from_millis(1)),
            _ => (-1, nap),
        }
    } else {
        (-1, nap)
    };
    let _ = ready.send(Ok(()));
    if !nap.is_zero() {
        // Naps of tens of microseconds: the default timer slack (50 us) would double them.
        // SAFETY: a plain prctl on this thread, no pointers.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64) };
    }
    let state = ReactorState { in_flight: Cell::new(0) };
    let block = u64::from(handle.block());
    let mut retry: VecDeque<Box<Ctx>> = VecDeque::new();
    let mut disconnected = false;
    let start = |cmd: Cmd, retry: &mut VecDeque<Box<Ctx>>| {
        let ctx = match cmd {
            Cmd::Flush(tx) => {
                let no_spdk_flush = matches!(io, Io::Bdev { flush: false, .. });
                if no_spdk_flush {
                    // The module has no flush (bdev_uring): its writes are O_DIRECT to the
                    // file; fdatasync makes them and the file's metadata durable.
                    let r = match &flush_fd {
                        Some(fd) => super::psync::fdatasync(fd.as_raw_fd()),
                        None => Err(io::Error::other("no flush for this target")),
                    };
                    let _ = tx.send(r);
                    return;
                }
                Box::new(Ctx {
                    work: Work::Flush(tx),
                    iov: Vec::new(),
                    bounce: std::ptr::null_mut(),
                    state: &state,
                    sgl_idx: 0,
                    sgl_off: 0,
                })
            }
            Cmd::Io(req) => {
                if req.is_empty() {
                    return req.complete(Ok(()));
                }
                let (len, offset) = (req.len(), req.offset());
                if !offset.is_multiple_of(block) || !len.is_multiple_of(block) {
                    return req.complete(Err(IoFailure::Os(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "offset {offset} / length {len} not multiples of the block size {block}"
                        ),
                    ))));
                }
                let iov: Vec<libc::iovec> = req
                    .iovecs()
                    .iter()
                    .map(|v: &IoVec| libc::iovec { iov_base: v.ptr.cast(), iov_len: v.len })
                    .collect();
                let kind = req.kind();
                let mut ctx = Box::new(Ctx {
                    work: Work::Io(req),
                    iov,
                    bounce: std::ptr::null_mut(),
                    state: &state,
                    sgl_idx: 0,
                    sgl_off: 0,
                });
                if bounce {
                    // SAFETY: plain allocation from SPDK's DMA-safe heap; checked for NULL.
                    let b = unsafe {
                        ffi::spdk_malloc(
                            len as usize,
                            4096,
                            std::ptr::null_mut(),
                            -1,
                            ffi::SPDK_MALLOC_DMA,
                        )
                    };
                    if b.is_null() {
                        return finish(
                            ctx,
                            Err(format!(
                                "no SPDK DMA memory for a {len}-byte bounce buffer (raise the spdk memory option)"
                            )),
                        );
                    }
                    ctx.bounce = b.cast();
                    if kind == IoDirection::Write {
                        let mut off = 0usize;
                        for v in &ctx.iov {
                            // SAFETY: the bounce buffer holds `len` bytes; the iovecs name
                            // memory the request owns.
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    v.iov_base.cast::<u8>(),
                                    ctx.bounce.add(off),
                                    v.iov_len,
                                )
                            };
                            off += v.iov_len;
                        }
                    }
                }
                ctx
            }
        };
        if let Some(back) = submit(&io, ctx) {
            retry.push_back(back);
        }
    };
    loop {
        env::park_if_exiting();
        while let Some(ctx) = retry.pop_front() {
            if let Some(back) = submit(&io, ctx) {
                retry.push_front(back);
                break;
            }
        }
        while !disconnected && state.in_flight.get() + retry.len() < qd {
            match rx.try_recv() {
                Ok(cmd) => start(cmd, &mut retry),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => disconnected = true,
            }
        }
        let mut reaped = 0;
        if let Io::Nvme { qpair, .. } = &io {
            // SAFETY: this reactor is the only user of its qpair.
            reaped = unsafe { ffi::spdk_nvme_qpair_process_completions(*qpair, 0) }.max(0);
        }
        // SAFETY: polled from the OS thread that owns it. In interrupt mode this waits on the
        // thread's fd group without blocking and runs what is ready.
        let progress = unsafe { ffi::spdk_thread_poll(thread, 0, 0) } + reaped;
        let idle = state.in_flight.get() == 0 && retry.is_empty();
        if idle && disconnected {
            break;
        }
        if idle {
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(cmd) => start(cmd, &mut retry),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => disconnected = true,
            }
        } else if let Some(w) = &wake
            && progress == 0
        {
            // Requests in flight and nothing ready: sleep until a completion (interrupt mode:
            // the thread's fd group; naps: the uring bdev's ring, else `poll_sleep_us` at
            // most) or a new request instead of busy-polling.
            let room = !disconnected && state.in_flight.get() + retry.len() < qd;
            w.sleep(thread_fd, wait, || room && !rx.is_empty());
        }
    }
    match io {
        // SAFETY: nothing is in flight on the channel; it was taken by this SPDK thread.
        Io::Bdev { ch, .. } => unsafe { ffi::spdk_put_io_channel(ch) },
        Io::Nvme { qpair, .. } => {
            // SAFETY: nothing is in flight on the qpair, used only by this reactor.
            unsafe { ffi::spdk_nvme_ctrlr_free_io_qpair(qpair) };
        }
    }
    exit_thread(thread);
}

/// The process's descriptors that are io_uring instances.
fn io_uring_fds() -> Vec<c_int> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else { return Vec::new() };
    dir.flatten()
        .filter(|e| {
            std::fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == "anon_inode:[io_uring]")
        })
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

/// Exit an SPDK thread (polling it until its deferred work, such as releasing channels, ran)
/// and destroy it. Called on the OS thread that polls it.
fn exit_thread(thread: *mut ffi::spdk_thread) {
    // SAFETY: `thread` is the current SPDK thread of this OS thread; polled until exited.
    unsafe {
        ffi::spdk_thread_exit(thread);
        while !ffi::spdk_thread_is_exited(thread) {
            ffi::spdk_thread_poll(thread, 0, 0);
        }
        ffi::spdk_thread_destroy(thread);
    }
}

impl Backend for SpdkBackend {
    fn name(&self) -> &'static str {
        "spdk"
    }

    fn submit(&self, request: IoRequest) {
        let Some(dev) = self.devices.get(request.device()) else {
            let (d, n) = (request.device(), self.devices.len());
            return request.complete(Err(bad_device(d, n)));
        };
        let n = dev.reactors.len();
        let i = if n <= 1 { 0 } else { dev.next.fetch_add(1, Ordering::Relaxed) % n };
        let closed = || IoFailure::Os(io::Error::other("spdk backend shut down"));
        let Some(reactor) = dev.reactors.get(i) else {
            return request.complete(Err(closed()));
        };
        if let Err(cmd) = reactor.send(Cmd::Io(request)) {
            match cmd {
                Cmd::Io(r) => r.complete(Err(closed())),
                Cmd::Flush(_) => unreachable!("an I/O was sent"),
            }
        }
    }

    fn flush(&self, device: usize) -> io::Result<()> {
        let dev = self.devices.get(device).ok_or_else(|| io::Error::other("no such device"))?;
        if let Some(fd) = &dev.flush_fd
            && matches!(&*dev.handle, Handle::Bdev { flush: false, .. })
        {
            return super::psync::fdatasync(fd.as_raw_fd());
        }
        let reactor =
            dev.reactors.first().ok_or_else(|| io::Error::other("spdk backend shut down"))?;
        let (done_tx, done_rx) = std::sync::mpsc::sync_channel(1);
        reactor
            .send(Cmd::Flush(done_tx))
            .map_err(|_| io::Error::other("spdk backend shut down"))?;
        done_rx.recv().map_err(|_| io::Error::other("spdk reactor exited during a flush"))?
    }
}

impl Drop for SpdkBackend {
    fn drop(&mut self) {
        // Disconnect every reactor first so they drain in parallel; each Device's drop joins
        // its reactors and then releases its target.
        for d in &mut self.devices {
            for r in &mut d.reactors {
                r.tx = None;
            }
        }
        self.devices.clear();
    }
}

/// The engine's SPDK runtime folder, when SPDK was started in this process.
pub fn runtime_dir() -> Option<PathBuf> {
    env::current().map(|r| r.runtime_dir.clone())
}

/// Names of the SPDK bdevs alive now (empty when SPDK is not started).
pub fn live_bdevs() -> Result<Vec<String>> {
    match env::current() {
        Some(rt) => env::bdev_names(&rt),
        None => Ok(Vec::new()),
    }
}

/// NVMe controllers attached now (0 when SPDK is not started).
pub fn live_controllers() -> Result<usize> {
    match env::current() {
        Some(rt) => env::controller_count(&rt),
        None => Ok(0),
    }
}

#[cfg(test)]
mod tests {
    use crate::array::{ArrayConfig, BackendKind, DeviceArray, Target};
    use crate::pool::{BufferPool, PoolConfig};

    const MIB: u64 = 1 << 20;

    /// Requests up to the engine's largest go to the bdev module whole (SPDK's large iobuf
    /// buffers are sized for them), and a reactor that naps between polls
    /// (`poll_sleep_us`) moves every byte: 1-4 MiB writes and reads with 8 in flight, each
    /// read verified.
    #[test]
    fn large_requests_and_polling_naps() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = ArrayConfig::new(vec![Target::Path(dir.path().join("dev0"))]);
        c.backend = BackendKind::Spdk;
        c.file_size_bytes = 64 * MIB;
        c.spdk.poll_sleep_us = 50;
        let array = DeviceArray::open(c).unwrap();
        let mut io = super::ffi::spdk_iobuf_opts::default();
        // SAFETY: valid out-pointer of the size given; SPDK is started (the array is open).
        unsafe {
            super::ffi::spdk_iobuf_get_opts(&mut io, std::mem::size_of_val(&io));
        }
        let max = crate::device::DEFAULT_MAX_IO_BYTES;
        assert!(u64::from(io.large_bufsize) >= max + 4096, "large iobuf {}", io.large_bufsize);
        let pool =
            BufferPool::new(PoolConfig { capacity_bytes: 64 * MIB, prefer_huge_pages: false })
                .unwrap();
        let sizes = [MIB, 4 * MIB, 2 * MIB, 3 * MIB];
        let byte = |i: usize, j: usize| (i * 31 + j / 4096) as u8;
        for pass in 0..2 {
            let mut tickets = Vec::new();
            for (i, &len) in sizes.iter().cycle().take(12).enumerate() {
                let off = i as u64 * 4 * MIB;
                let t = if pass == 0 {
                    let mut b = pool.alloc(len as usize).unwrap();
                    b.iter_mut().enumerate().for_each(|(j, x)| *x = byte(i, j));
                    array.write_at(0, off, b).unwrap()
                } else {
                    array.read_at(0, off, pool.alloc(len as usize).unwrap()).unwrap()
                };
                tickets.push((i, t));
                if tickets.len() == 8 || i == 11 {
                    for (i, t) in tickets.drain(..) {
                        let (b, r) = t.wait();
                        r.unwrap();
                        if pass == 1 {
                            assert!(b.iter().enumerate().all(|(j, &x)| x == byte(i, j)), "{i}");
                        }
                    }
                }
            }
        }
    }
}
