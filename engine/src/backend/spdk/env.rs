//! SPDK's process-wide part: the environment (DPDK), started once per process by the first
//! array that uses the `spdk` backend, and the "app" SPDK thread that owns control-path calls
//! (creating and deleting bdevs, attaching controllers, keep-alive of fabrics controllers).
//!
//! DPDK can be started only once per process, so the environment lives until the process
//! exits; everything an array creates (bdevs, controllers, SPDK threads, channels) is released
//! when the array is dropped. Files: DPDK runs with `--no-shconf` and unlinked huge pages
//! (`shm_id = -1`), its runtime folder is redirected (`RUNTIME_DIRECTORY`) into a folder the
//! engine owns, removed at exit; no RPC server is started. A process killed before its exit
//! handler ran leaves its default folder behind: the next start of SPDK in any process of the
//! same user removes those whose process is gone ([`sweep_stale`]).

use std::ffi::{CString, c_int, c_void};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use super::ffi;
use crate::backend::spdk_config::SpdkOptions;
use crate::{Error, Result};

type Job = Box<dyn FnOnce() + Send>;

/// How long a control-path call (create a bdev, connect a controller) may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// The started environment.
pub(crate) struct SpdkEnv {
    jobs: Sender<Job>,
    /// The folder holding DPDK's runtime files.
    pub(crate) runtime_dir: PathBuf,
    /// PCIe functions DPDK may touch (empty: `no_pci`).
    pub(crate) pci_allowed: Vec<String>,
    /// SPDK runs in interrupt mode (`spdk_interrupt_mode_enable`), for the whole process.
    pub(crate) interrupt: bool,
}

static ENV: Mutex<Option<std::result::Result<Arc<SpdkEnv>, String>>> = Mutex::new(None);
/// Folders removed at exit: (DPDK's subfolder, the runtime folder if the engine created it).
static CLEANUP: OnceLock<(PathBuf, Option<PathBuf>)> = OnceLock::new();

/// Set at process exit: every thread that polls SPDK stops doing so and parks, so SPDK's and
/// DPDK's destructors never run under a thread still inside SPDK.
pub(crate) static EXITING: AtomicBool = AtomicBool::new(false);
/// Threads that poll SPDK now (app thread and reactors).
pub(crate) static POLLERS: AtomicUsize = AtomicUsize::new(0);

/// Called by a polling thread in its loop: at process exit, stop polling for good.
pub(crate) fn park_if_exiting() {
    if EXITING.load(Ordering::Acquire) {
        POLLERS.fetch_sub(1, Ordering::AcqRel);
        loop {
            std::thread::park();
        }
    }
}

extern "C" fn at_exit() {
    EXITING.store(true, Ordering::Release);
    let start = std::time::Instant::now();
    while POLLERS.load(Ordering::Acquire) > 0 && start.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(1));
    }
    if let Some((dpdk, own)) = CLEANUP.get() {
        let _ = std::fs::remove_dir_all(dpdk);
        if let Some(own) = own {
            let _ = std::fs::remove_dir_all(own);
        }
    }
}

/// The running environment, if SPDK was started in this process.
pub(crate) fn current() -> Option<Arc<SpdkEnv>> {
    ENV.lock().ok()?.as_ref()?.as_ref().ok().cloned()
}

/// The environment, started with `opts` and the PCIe functions `pci` if this is the first use
/// in the process.
pub(crate) fn get(opts: &SpdkOptions, pci: &[String]) -> Result<Arc<SpdkEnv>> {
    let mut guard = ENV.lock().unwrap_or_else(|e| e.into_inner());
    match &*guard {
        Some(Ok(rt)) => {
            if let Some(missing) = pci.iter().find(|p| !rt.pci_allowed.contains(p)) {
                return Err(Error::Unsupported(format!(
                    "SPDK was started in this process {} and DPDK can be started only once: the \
                     PCIe device {missing} must be named by the first SPDK array of the process",
                    if rt.pci_allowed.is_empty() {
                        "without PCIe (no_pci)".to_string()
                    } else {
                        format!("for PCIe devices {}", rt.pci_allowed.join(", "))
                    }
                )));
            }
            if opts.interrupt != rt.interrupt {
                let mode = |i: bool| if i { "interrupt mode" } else { "polling mode" };
                return Err(Error::Unsupported(format!(
                    "SPDK was started in this process in {} and its mode is set once per \
                     process: an SPDK array asking for {} (spdk interrupt = {}) must run in a \
                     process of its own",
                    mode(rt.interrupt),
                    mode(opts.interrupt),
                    opts.interrupt
                )));
            }
            return Ok(Arc::clone(rt));
        }
        Some(Err(msg)) => {
            return Err(Error::Unsupported(format!(
                "SPDK failed to start earlier in this process and cannot be restarted: {msg}"
            )));
        }
        None => {}
    }
    let started = start(opts, pci);
    *guard = Some(match &started {
        Ok(rt) => Ok(Arc::clone(rt)),
        Err(e) => Err(e.to_string()),
    });
    started
}

/// Whether `dir` is a hugetlbfs mount.
fn is_hugetlbfs(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_encoded_bytes()) else { return false };
    // SAFETY: an all-zero statfs is a valid value to be filled in.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_type as i64 == 0x9584_58f6
}

/// Free huge pages of the default size (from /proc/meminfo).
fn free_huge_pages() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines().find_map(|l| l.strip_prefix("HugePages_Free:")?.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// The default runtime folder is `$TMPDIR/teraio-spdk.PID`.
const DEFAULT_PREFIX: &str = "teraio-spdk.";

/// The default runtime folder, open and locked (`flock`) for the life of the process: the lock
/// tells [`sweep_stale`] of other processes that its owner is alive, whatever its PID looks like
/// from their PID namespace. The kernel releases it when the process ends, however it ends.
static OWN_LOCK: OnceLock<std::fs::File> = OnceLock::new();

/// Create `dir` (mode 0700) and lock it. A sweep of another process may remove the folder
/// between its creation and the lock (only if this process took the PID of the folder's dead
/// owner, and only while it holds the folder's lock): then the folder is made again.
fn create_own(dir: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    for _ in 0..8 {
        std::fs::create_dir_all(dir)?;
        let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
        let f = match std::fs::File::open(dir) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        f.lock()?;
        let (held, now) = (f.metadata()?, std::fs::symlink_metadata(dir));
        if let Ok(now) = now
            && (held.dev(), held.ino()) == (now.dev(), now.ino())
        {
            return Ok(f);
        }
    }
    Err(std::io::Error::other("the folder kept being removed by another process"))
}

/// Whether a process `pid` exists (as this process sees it; a zombie counts).
fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled; `pid` is
    // positive, so it names one process, never a group.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Remove the default runtime folders (`teraio-spdk.PID` in `parent`) that processes left
/// behind when they ended without running their exit handler (killed by a signal: SIGKILL,
/// or SIGTERM/SIGINT without a handler). A folder is removed only if it is this user's, a
/// real folder (not a link), no process `PID` exists, no process holds its lock, and it holds
/// nothing but DPDK's `dpdk` folder (anything else: not the engine's, kept). Returns how many
/// were removed. Runs only when this process uses the default folder: a `runtime_dir` the user
/// named is never looked at.
fn sweep_stale(parent: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(parent) else { return 0 };
    // SAFETY: a plain query without arguments.
    let uid = unsafe { libc::geteuid() };
    let me = std::process::id();
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(DEFAULT_PREFIX)) else {
            continue;
        };
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(pid) = pid.parse::<i32>() else { continue };
        if pid <= 0 || pid as u32 == me || pid_alive(pid) {
            continue;
        }
        let path = e.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else { continue };
        if !meta.is_dir() || meta.uid() != uid {
            continue;
        }
        let Ok(inside) = std::fs::read_dir(&path) else { continue };
        let only_dpdk = inside.into_iter().all(|i| {
            i.is_ok_and(|i| i.file_name() == "dpdk" && i.file_type().is_ok_and(|t| t.is_dir()))
        });
        if !only_dpdk {
            continue;
        }
        let Ok(f) = std::fs::File::open(&path) else { continue };
        if f.try_lock().is_err() {
            continue; // its owner is alive (in another PID namespace), or the lock failed
        }
        // The lock is on the folder checked above, not on one made since under its name.
        let same = f.metadata().is_ok_and(|h| (h.dev(), h.ino()) == (meta.dev(), meta.ino()));
        if same && std::fs::remove_dir_all(&path).is_ok() {
            removed += 1;
        }
    }
    removed
}

fn start(opts: &SpdkOptions, pci: &[String]) -> Result<Arc<SpdkEnv>> {
    if let Some(h) = &opts.huge_dir {
        if !is_hugetlbfs(h) {
            return Err(Error::InvalidArgument(format!(
                "SPDK huge_dir {} is not a hugetlbfs mount (mount one of your own: mount -t \
                 hugetlbfs nodev DIR), or leave huge_dir unset to run without huge pages",
                h.display()
            )));
        }
        let free = free_huge_pages();
        let need = opts.memory_bytes.0.div_ceil(2 << 20);
        if free < need {
            return Err(Error::Unsupported(format!(
                "huge pages missing: SPDK needs {need} free 2 MiB pages for {} MiB, the system \
                 has {free} (reserve them: echo N > /proc/sys/vm/nr_hugepages)",
                opts.memory_bytes.0 >> 20
            )));
        }
    }
    let (dir, created) = match &opts.runtime_dir {
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| Error::Os {
                context: format!("creating the SPDK runtime folder {}", d.display()),
                source: e,
            })?;
            use std::os::unix::fs::PermissionsExt;
            let _ = std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700));
            (d.clone(), false)
        }
        None => {
            let tmp = std::env::temp_dir();
            sweep_stale(&tmp);
            let dir = tmp.join(format!("{DEFAULT_PREFIX}{}", std::process::id()));
            let lock = create_own(&dir).map_err(|e| Error::Os {
                context: format!("creating the SPDK runtime folder {}", dir.display()),
                source: e,
            })?;
            let _ = OWN_LOCK.set(lock);
            (dir, true)
        }
    };
    if CLEANUP.set((dir.join("dpdk"), created.then(|| dir.clone()))).is_ok() {
        // SAFETY: registers a plain function without arguments, run once at exit.
        unsafe { libc::atexit(at_exit) };
    }

    let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded::<Job>();
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<std::result::Result<(), String>>(1);
    let opts2 = opts.clone();
    let pci2 = pci.to_vec();
    let dir2 = dir.clone();
    std::thread::Builder::new()
        .name("teraio-spdk-app".into())
        .spawn(move || {
            POLLERS.fetch_add(1, Ordering::AcqRel);
            app_main(opts2, pci2, dir2, ready_tx, jobs_rx);
            POLLERS.fetch_sub(1, Ordering::AcqRel);
        })
        .map_err(|e| Error::Os { context: "starting the SPDK app thread".into(), source: e })?;
    match ready_rx.recv_timeout(CALL_TIMEOUT) {
        Ok(Ok(())) => {}
        Ok(Err(msg)) => return Err(Error::Unsupported(msg)),
        Err(_) => {
            return Err(Error::Unsupported("SPDK's environment did not start within 60 s".into()));
        }
    }
    Ok(Arc::new(SpdkEnv {
        jobs: jobs_tx,
        runtime_dir: dir,
        pci_allowed: pci.to_vec(),
        interrupt: opts.interrupt,
    }))
}

/// Bytes of one large iobuf buffer: the engine's largest request plus the largest buffer
/// alignment a file bdev asks for (4 KiB), which SPDK's bdev layer takes off (`max_rw_size`).
const LARGE_BUFSIZE: u32 = (crate::device::DEFAULT_MAX_IO_BYTES + 4096) as u32;
/// Large iobuf buffers: SPDK's minimum (8), 32 MiB of the DPDK memory at 4 MiB + 4 KiB each.
const LARGE_POOL: u64 = 8;

/// SPDK's default message pool size (`SPDK_DEFAULT_MSG_MEMPOOL_SIZE`).
const MSG_POOL: usize = 262_144 - 1;

/// Thread operations in interrupt mode: nothing to do, every SPDK thread has an OS thread of
/// the engine that polls it.
extern "C" fn thread_op(_thread: *mut ffi::spdk_thread, _op: ffi::spdk_thread_op) -> c_int {
    0
}

/// No operation is "supported" (SPDK then does not hand new threads to a scheduler).
extern "C" fn thread_op_supported(_op: ffi::spdk_thread_op) -> bool {
    false
}

extern "C" fn init_done(rc: c_int, arg: *mut c_void) {
    // SAFETY: `arg` is the `Option<c_int>` that `app_main` polls for, alive until it is set.
    unsafe { *arg.cast::<Option<c_int>>() = Some(rc) };
}

thread_local! {
    /// Fabrics/PCIe controllers whose admin queue the app thread polls (keep-alive, AERs).
    static CONTROLLERS: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Poll `ctrlr`'s admin queue from the app thread until [`forget_controller`]. App thread only.
pub(crate) fn poll_controller(ctrlr: *mut ffi::spdk_nvme_ctrlr) {
    CONTROLLERS.with(|c| c.borrow_mut().push(ctrlr as usize));
}

/// Stop polling `ctrlr` (before detaching it). App thread only.
pub(crate) fn forget_controller(ctrlr: *mut ffi::spdk_nvme_ctrlr) {
    CONTROLLERS.with(|c| c.borrow_mut().retain(|&p| p != ctrlr as usize));
}

fn app_main(
    opts: SpdkOptions,
    pci: Vec<String>,
    dir: PathBuf,
    ready: SyncSender<std::result::Result<(), String>>,
    jobs: Receiver<Job>,
) {
    // DPDK pins the thread that starts it to its main core: remember the affinity to restore.
    // SAFETY: an all-zero cpu_set_t is an empty set, filled in by sched_getaffinity.
    let mut cpus: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer of the size given.
    let have_cpus =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut cpus) }
            == 0;
    // DPDK puts its runtime folder under $RUNTIME_DIRECTORY.
    // SAFETY: set once, before DPDK (the only reader) starts; Rust readers of the environment
    // take the same lock as set_var. No other C code reads the environment concurrently here.
    unsafe { std::env::set_var("RUNTIME_DIRECTORY", &dir) };

    let name = c"teraio";
    let env_args = c"--log-level=lib.eal:4";
    let huge_dir =
        opts.huge_dir.as_ref().and_then(|h| CString::new(h.as_os_str().as_encoded_bytes()).ok());
    let mut pci_addrs: Vec<ffi::spdk_pci_addr> = Vec::new();
    for p in &pci {
        let mut a = ffi::spdk_pci_addr::default();
        let Ok(c) = CString::new(p.as_str()) else { continue };
        // SAFETY: valid out-pointer and NUL-terminated string.
        if unsafe { ffi::spdk_pci_addr_parse(&mut a, c.as_ptr()) } != 0 {
            let _ = ready.send(Err(format!("bad PCIe address {p}")));
            return;
        }
        pci_addrs.push(a);
    }
    let mut eo = ffi::spdk_env_opts {
        opts_size: std::mem::size_of::<ffi::spdk_env_opts>(),
        ..Default::default()
    };
    // SAFETY: `eo` is a valid spdk_env_opts with opts_size set, as spdk_env_opts_init wants.
    unsafe { ffi::spdk_env_opts_init(&mut eo) };
    eo.name = name.as_ptr();
    eo.shm_id = -1;
    eo.mem_size = (opts.memory_bytes.0 >> 20).max(64) as c_int;
    eo.no_pci = pci_addrs.is_empty();
    if !pci_addrs.is_empty() {
        eo.pci_allowed = pci_addrs.as_mut_ptr();
        eo.num_pci_addr = pci_addrs.len();
    }
    match &huge_dir {
        Some(h) => {
            eo.hugedir = h.as_ptr();
            eo.unlink_hugepage = true;
        }
        None => eo.no_huge = true,
    }
    eo.env_context = env_args.as_ptr() as *mut c_void;
    // SAFETY: every pointer in `eo` (name, hugedir, pci list, env_context) outlives the call.
    let rc = unsafe { ffi::spdk_env_init(&eo) };
    if have_cpus {
        // SAFETY: restores the affinity read above for this thread.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &cpus) };
    }
    if rc != 0 {
        let _ = ready.send(Err(format!(
            "SPDK's environment (DPDK) failed to start (error {rc}){}",
            if huge_dir.is_some() { "; check the huge pages and huge_dir" } else { "" }
        )));
        return;
    }
    // SAFETY: plain calls after a successful spdk_env_init.
    unsafe { ffi::spdk_log_set_print_level(ffi::SPDK_LOG_WARN) };
    // Interrupt mode must be chosen before the thread library starts; every SPDK thread made
    // afterwards waits on its fd group instead of being busy-polled.
    // SAFETY: a plain call, before spdk_thread_lib_init.
    if opts.interrupt && unsafe { ffi::spdk_interrupt_mode_enable() } != 0 {
        let _ = ready.send(Err("SPDK could not enable its interrupt mode".into()));
        return;
    }
    // SAFETY: no scheduler callback: the engine polls its SPDK threads itself. In interrupt
    // mode SPDK calls the thread operation callback when a thread exits (to reschedule it):
    // a no-op one, for the same reason.
    let rc = unsafe {
        if opts.interrupt {
            ffi::spdk_thread_lib_init_ext(Some(thread_op), Some(thread_op_supported), 0, MSG_POOL)
        } else {
            ffi::spdk_thread_lib_init(None, 0)
        }
    };
    if rc != 0 {
        let _ = ready.send(Err("spdk_thread_lib_init failed".into()));
        return;
    }
    // SAFETY: the thread library is initialized; a NULL cpumask means any core.
    let thread = unsafe { ffi::spdk_thread_create(c"teraio_app".as_ptr(), std::ptr::null()) };
    if thread.is_null() {
        let _ = ready.send(Err("could not create SPDK's app thread".into()));
        return;
    }
    // SAFETY: this OS thread polls `thread` from now on; it is the app thread.
    unsafe { ffi::spdk_set_thread(thread) };
    // Smaller iobuf pools than SPDK's defaults (which need ~200 MiB): the engine's requests
    // go straight to the bdev with their own (aligned) memory.
    //
    // Large buffers as large as the engine's largest request: SPDK's bdev layer caps every
    // request to a bdev that states a buffer alignment (the uring and aio bdevs do) at one
    // large iobuf buffer (`max_rw_size` from `large_bufsize`, minus the alignment), and splits
    // larger ones. With SPDK's 132 KiB default a 1 MiB write became eight writes of 263 and 207
    // 512-byte blocks, each its own io_uring request (measured: 0.5-0.7x the io_uring
    // backend's 1 MiB throughput, and a 30-40 ms latency tail). One alignment's worth more, so
    // a whole `DEFAULT_MAX_IO_BYTES` request fits. Few of them: the engine's own buffers are
    // aligned, so the bdev layer takes none (they serve its bounce path for unaligned memory
    // only), and no SPDK thread caches any (the caches below are 0).
    let mut io = ffi::spdk_iobuf_opts::default();
    // SAFETY: valid out-pointer of the size given.
    unsafe { ffi::spdk_iobuf_get_opts(&mut io, std::mem::size_of::<ffi::spdk_iobuf_opts>()) };
    io.small_pool_count = 4096;
    io.large_pool_count = LARGE_POOL;
    io.large_bufsize = LARGE_BUFSIZE;
    io.opts_size = std::mem::size_of::<ffi::spdk_iobuf_opts>();
    // SAFETY: valid options struct, before the iobuf subsystem starts.
    if unsafe { ffi::spdk_iobuf_set_opts(&io) } != 0 {
        let _ = ready.send(Err("SPDK refused the engine's iobuf options".into()));
        return;
    }
    // Each SPDK thread's accel and bdev channels cache iobuf buffers: small caches of small
    // buffers and none of large ones, so many reactors fit in the pools above.
    let mut acc = ffi::spdk_accel_opts::default();
    // SAFETY: valid out-pointer of the size given.
    unsafe { ffi::spdk_accel_get_opts(&mut acc, std::mem::size_of::<ffi::spdk_accel_opts>()) };
    acc.small_cache_size = 16;
    acc.large_cache_size = 0;
    acc.opts_size = std::mem::size_of::<ffi::spdk_accel_opts>();
    // SAFETY: valid options struct, before the accel subsystem starts.
    unsafe { ffi::spdk_accel_set_opts(&acc) };
    let mut bo = ffi::spdk_bdev_opts::default();
    // SAFETY: valid out-pointer of the size given.
    unsafe { ffi::spdk_bdev_get_opts(&mut bo, std::mem::size_of::<ffi::spdk_bdev_opts>()) };
    bo.iobuf_small_cache_size = 16;
    bo.iobuf_large_cache_size = 0;
    // Never let other bdev modules (gpt, lvol...) examine the engine's targets.
    bo.bdev_auto_examine = false;
    bo.opts_size = std::mem::size_of::<ffi::spdk_bdev_opts>();
    // SAFETY: valid options struct, before the bdev subsystem starts.
    unsafe { ffi::spdk_bdev_set_opts(&mut bo) };
    let mut init: Option<c_int> = None;
    // SAFETY: `init` outlives the loop below, which polls until the callback ran.
    unsafe { ffi::spdk_subsystem_init(Some(init_done), (&raw mut init).cast()) };
    while init.is_none() {
        // SAFETY: polled from the OS thread that owns it.
        unsafe { ffi::spdk_thread_poll(thread, 0, 0) };
    }
    if let Some(rc) = init
        && rc != 0
    {
        let _ = ready.send(Err(format!("SPDK's subsystems failed to start (error {rc})")));
        return;
    }
    let _ = ready.send(Ok(()));
    loop {
        park_if_exiting();
        let mut busy = false;
        while let Ok(job) = jobs.try_recv() {
            job();
            busy = true;
        }
        // SAFETY: polled from the OS thread that owns it.
        busy |= unsafe { ffi::spdk_thread_poll(thread, 0, 0) } > 0;
        let ctrlrs = CONTROLLERS.with(|c| c.borrow().clone());
        for c in ctrlrs {
            // SAFETY: the controller stays attached until forget_controller (app thread).
            unsafe { ffi::spdk_nvme_ctrlr_process_admin_completions(c as *mut _) };
        }
        if !busy {
            match jobs.recv_timeout(Duration::from_millis(2)) {
                Ok(job) => job(),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
    }
}

impl SpdkEnv {
    /// Run `f` on the app thread and return its result.
    pub(crate) fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T> {
        self.call_async(move |done: Box<dyn FnOnce(T) + Send>| done(f()))
    }

    /// Run `f` on the app thread; it hands its result to `done`, now or from a later callback
    /// on the app thread. Waits for the result.
    pub(crate) fn call_async<T: Send + 'static>(
        &self,
        f: impl FnOnce(Box<dyn FnOnce(T) + Send>) + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<T>(1);
        let done: Box<dyn FnOnce(T) + Send> = Box::new(move |v| {
            let _ = tx.send(v);
        });
        self.jobs.send(Box::new(move || f(done))).map_err(|_| Error::Closed("SPDK app thread"))?;
        rx.recv_timeout(CALL_TIMEOUT).map_err(|_| {
            Error::Unsupported("an SPDK control call did not finish within 60 s".into())
        })
    }
}

/// Names of the bdevs that exist now (tests: nothing is left after an array is dropped).
pub(crate) fn bdev_names(rt: &SpdkEnv) -> Result<Vec<String>> {
    rt.call(|| {
        let mut names = Vec::new();
        // SAFETY: bdev iteration on the app thread; names are copied before the next call.
        unsafe {
            let mut b = ffi::spdk_bdev_first();
            while !b.is_null() {
                let n = std::ffi::CStr::from_ptr(ffi::spdk_bdev_get_name(b));
                names.push(n.to_string_lossy().into_owned());
                b = ffi::spdk_bdev_next(b);
            }
        }
        names
    })
}

/// Controllers the app thread keeps polling (tests: none is left after an array is dropped).
pub(crate) fn controller_count(rt: &SpdkEnv) -> Result<usize> {
    rt.call(|| CONTROLLERS.with(|c| c.borrow().len()))
}
