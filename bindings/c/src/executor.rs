//! The plan executor through the C ABI (docs/EXECUTOR.md): the engine's `Executor` behind a
//! handle, with the caller's memory moved through the store's staging buffers and, optionally,
//! the caller's allocator for prefetch destinations and created tensors.

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::Arc;

use ::teraio_engine::executor::{AllocFor, Event, Executor, ExecutorConfig, TensorAllocator};
use ::teraio_engine::tier::TensorMem;
use parking_lot::Mutex;
use teraio_bindings_core::{self as core, Error, Status};
use teraio_scheduler::TensorId;

use crate::ffi::{arg_str, guard, need, opt_str, put, put_string};
use crate::registry::{Kind, Registry};
use crate::{TRACES, handle, teraio_engine, teraio_status, teraio_trace, with_engine};

/// A plan executor (opaque).
pub struct teraio_executor {
    _private: [u8; 0],
}

/// The executor asks for memory of a tensor a kernel creates (`allocate_created`).
pub const TERAIO_ALLOC_CREATE: i32 = 0;
/// The executor asks for the destination of a prefetch.
pub const TERAIO_ALLOC_PREFETCH: i32 = 1;
/// The executor asks for memory of a tensor it recomputes (not asked of a C allocator yet: it
/// cannot run producers, so an executor refuses plans with recomputations).
pub const TERAIO_ALLOC_RECOMPUTE: i32 = 2;

/// Where an executor's memory comes from: `alloc` returns `bytes` bytes for tensor `tensor`
/// (`why`: `TERAIO_ALLOC_*`) or NULL on failure; `release` (may be NULL) gets memory the
/// executor no longer holds (an offload was stored, the tensor died), attached or allocated.
/// Both are called from the thread calling the executor function that needs them, while that
/// call runs; `ctx` is passed through.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct teraio_allocator {
    /// Passed to the callbacks.
    pub ctx: *mut c_void,
    /// Memory for a tensor. NULL: no room now although the budget has (a caching allocator's
    /// rounded blocks, memory outside the plan): the executor moves out what the kernel it
    /// waits for does not use and asks again; with nothing left to move that kernel fails
    /// with TERAIO_ERR_NO_SPACE.
    pub alloc: Option<unsafe extern "C" fn(*mut c_void, u32, u64, i32) -> *mut c_void>,
    /// Memory given back (may be NULL).
    pub release: Option<unsafe extern "C" fn(*mut c_void, u32, *mut c_void, u64)>,
}

/// tensor -> (address, length) of the caller memory holding it now.
type Table = Arc<Mutex<HashMap<u32, (usize, usize)>>>;

struct CAllocator {
    a: teraio_allocator,
    table: Table,
    device: DeviceMode,
}

// SAFETY: the C caller guarantees (docs/C_ABI.md) that its allocator's callbacks and `ctx` may
// be used from whichever thread calls the executor; teraio calls them only during such calls,
// one at a time (the executor is behind a mutex).
unsafe impl Send for CAllocator {}

impl TensorAllocator for CAllocator {
    fn alloc(
        &mut self,
        t: TensorId,
        bytes: u64,
        why: AllocFor,
    ) -> ::teraio_engine::Result<TensorMem> {
        let why = match why {
            AllocFor::Create => TERAIO_ALLOC_CREATE,
            AllocFor::Prefetch => TERAIO_ALLOC_PREFETCH,
            AllocFor::Recompute => TERAIO_ALLOC_RECOMPUTE,
        };
        let f = self.a.alloc.ok_or_else(|| {
            ::teraio_engine::Error::InvalidArgument("the allocator has no alloc callback".into())
        })?;
        // SAFETY: a C function pointer the caller registered, called with its own context.
        let p = unsafe { f(self.a.ctx, t.0, bytes, why) };
        if p.is_null() {
            return Err(::teraio_engine::Error::NoSpace(format!(
                "the allocator returned NULL for tensor {t} ({bytes} bytes)"
            )));
        }
        let len = usize::try_from(bytes).map_err(|_| {
            ::teraio_engine::Error::InvalidArgument(format!("{bytes} bytes do not fit in memory"))
        })?;
        // SAFETY: the allocator's contract (docs/C_ABI.md): the memory it returns is valid
        // (device memory in device mode) until it is released.
        let mem = unsafe { caller_mem(&self.device, p as usize, len) }?;
        self.table.lock().insert(t.0, (p as usize, len));
        Ok(mem)
    }

    fn release(&mut self, t: TensorId, mem: TensorMem) {
        drop(mem);
        let held = self.table.lock().remove(&t.0);
        if let (Some(f), Some((p, len))) = (self.a.release, held) {
            // SAFETY: the caller's callback, with memory it attached or allocated.
            unsafe { f(self.a.ctx, t.0, p as *mut c_void, len as u64) };
        }
    }
}

/// Engine host memory for the executor, remembering nothing (the default allocator).
struct EngineAllocator {
    inner: Box<dyn TensorAllocator>,
    table: Table,
}

impl TensorAllocator for EngineAllocator {
    fn alloc(
        &mut self,
        t: TensorId,
        bytes: u64,
        why: AllocFor,
    ) -> ::teraio_engine::Result<TensorMem> {
        self.table.lock().remove(&t.0);
        self.inner.alloc(t, bytes, why)
    }

    fn release(&mut self, t: TensorId, mem: TensorMem) {
        self.table.lock().remove(&t.0);
        self.inner.release(t, mem);
    }
}

/// Set by `teraio_executor_use_device_memory`: the engine whose GPU the caller's pointers are
/// memory of (its handle).
type DeviceMode = Arc<Mutex<Option<u64>>>;

struct ExecEntry {
    /// The handle of the engine it runs on: every call checks it is still open.
    engine: u64,
    ex: Mutex<Option<Executor>>,
    table: Table,
    device: DeviceMode,
}

/// Caller memory at `addr` as the executor's: device memory of the engine's GPU in device mode,
/// else host memory moved through the store's staging buffers.
///
/// # Safety
/// `addr` is `len` bytes of memory the caller keeps valid (and does not use) while the
/// executor holds it: GPU memory in device mode (on the emulation: host memory), else host
/// memory valid for reads and writes.
unsafe fn caller_mem(
    device: &DeviceMode,
    addr: usize,
    len: usize,
) -> ::teraio_engine::Result<TensorMem> {
    match *device.lock() {
        Some(engine) => with_engine(handle(engine), |e| {
            // SAFETY: forwarded contract.
            Ok(unsafe { e.wrap_caller_gpu(addr as u64, len as u64) }?)
        })
        .map_err(|e| ::teraio_engine::Error::InvalidArgument(e.to_string())),
        // SAFETY: forwarded contract (host memory valid for reads and writes, unused by the
        // caller while the executor holds it).
        None => Ok(unsafe { TensorMem::caller(addr, len, None) }),
    }
}

static EXECUTORS: Registry<ExecEntry> = Registry::new(Kind::Executor);

fn with_ex<R>(
    h: *mut teraio_executor,
    f: impl FnOnce(&mut Executor, &Table) -> ::teraio_engine::Result<R>,
) -> core::Result<R> {
    let entry = EXECUTORS.get(h as u64)?;
    // The engine stays open for the call (its close waits for it).
    on_engine(&entry, || {
        let mut g = entry.ex.lock();
        let ex =
            g.as_mut().ok_or_else(|| Error::InvalidState("the executor was finished".into()))?;
        Ok(f(ex, &entry.table)?)
    })
}

/// Run `f` while the executor's engine is open; `TERAIO_ERR_CLOSED` once it was closed.
fn on_engine<R>(entry: &ExecEntry, f: impl FnOnce() -> core::Result<R>) -> core::Result<R> {
    with_engine(handle(entry.engine), |_| f()).map_err(|e| match e {
        Error::Closed(_) => Error::Closed(format!(
            "the engine {:#x} this executor runs on was closed: finish (or free) the executor \
             before teraio_engine_close",
            entry.engine
        )),
        e => e,
    })
}

/// A plan executor over `engine`'s store for `trace` and a plan (JSON, as `teraio_plan`
/// returns it) under `gpu_budget_bytes`. `allocate_created`: the executor allocates created
/// tensors' memory (else the caller attaches it after `teraio_executor_before_kernel`).
/// `allocator` (may be NULL: engine host memory) provides prefetch destinations and created
/// tensors; it is copied.
///
/// # Safety
/// `plan_json` is a NUL-terminated string; `allocator` is NULL or valid for a read; its
/// callbacks may be called from any thread that calls this executor; `out_executor` is valid
/// for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_new(
    engine: *mut teraio_engine,
    trace: *mut teraio_trace,
    plan_json: *const c_char,
    gpu_budget_bytes: u64,
    allocate_created: bool,
    allocator: *const teraio_allocator,
    out_executor: *mut *mut teraio_executor,
) -> teraio_status {
    guard("teraio_executor_new", || {
        need(out_executor, "out_executor")?;
        let t = TRACES.get(trace as u64)?;
        // SAFETY: forwarded contract.
        let plan = core::sched::plan_from_json(&t, unsafe { arg_str(plan_json, "plan_json") }?)?;
        let table: Table = Arc::default();
        let device: DeviceMode = Arc::default();
        let stream = None; // teraio_executor_use_device_memory sets it
        let custom = if allocator.is_null() {
            None
        } else {
            // SAFETY: non-null; the caller guarantees it is readable.
            let a = unsafe { *allocator };
            if a.alloc.is_none() {
                return Err(Error::InvalidArgument("the allocator's `alloc` is NULL".into()));
            }
            Some(CAllocator { a, table: table.clone(), device: device.clone() })
        };
        let cfg = ExecutorConfig { gpu_budget_bytes, allocate_created, stream };
        let ex = with_engine(engine, |e| {
            let alloc: Box<dyn TensorAllocator> = match custom {
                Some(c) => Box::new(c),
                None => {
                    Box::new(EngineAllocator { inner: e.host_allocator(), table: table.clone() })
                }
            };
            Ok(e.executor((*t).clone(), plan, cfg, alloc)?)
        })?;
        let id = EXECUTORS.insert(ExecEntry {
            engine: engine as u64,
            ex: Mutex::new(Some(ex)),
            table,
            device,
        })?;
        // SAFETY: forwarded contract.
        unsafe { put(out_executor, "out_executor", handle(id)) }?;
        Ok(Status::Ok)
    })
}

/// Hand tensor `tensor`'s memory (`len` bytes at `ptr`, exactly the trace's size) to the
/// executor: a global tensor before `teraio_executor_start`, or a created one after
/// `teraio_executor_before_kernel` of its kernel (without `allocate_created`). The memory is
/// read and written by the engine's threads until the executor releases it (the allocator's
/// `release`, or `teraio_executor_finish`/`_free`).
///
/// # Safety
/// `ptr` is valid for reads and writes of `len` bytes until released.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_attach(
    executor: *mut teraio_executor,
    tensor: u32,
    ptr: *mut c_void,
    len: u64,
) -> teraio_status {
    guard("teraio_executor_attach", || {
        if ptr.is_null() {
            return Err(Error::InvalidArgument("`ptr` is NULL".into()));
        }
        let len = usize::try_from(len)
            .map_err(|_| Error::InvalidArgument(format!("{len} bytes do not fit in memory")))?;
        let device = EXECUTORS.get(executor as u64)?.device.clone();
        // SAFETY: forwarded contract (device memory in device mode).
        let mem = unsafe { caller_mem(&device, ptr as usize, len) }?;
        with_ex(executor, |ex, table| {
            ex.attach(TensorId(tensor), mem)?;
            table.lock().insert(tensor, (ptr as usize, len));
            Ok(())
        })?;
        Ok(Status::Ok)
    })
}

/// From now on, memory attached to the executor and returned by its allocator is the caller's
/// GPU memory (device addresses of `engine`'s GPU, cast to pointers; on the engine's host-memory
/// emulation, host memory), moved by the engine's GPU data paths in the order of CUDA stream
/// `stream` (a `CUstream` cast to an integer; 0 the legacy default stream): an offload reads a
/// tensor after the work queued on the stream when it is issued, a prefetch writes after it,
/// and once `teraio_executor_before_kernel` / `_kernel_ready` says a kernel can run, the stream
/// waits (on the GPU) for its tensors. Call it before the first `teraio_executor_attach`.
/// `TERAIO_ERR_INVALID_ARGUMENT` when the engine has no GPU.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_executor_use_device_memory(
    executor: *mut teraio_executor,
    engine: *mut teraio_engine,
    stream: u64,
) -> teraio_status {
    guard("teraio_executor_use_device_memory", || {
        with_engine(engine, |e| {
            e.gpu_device().map(|_| ()).ok_or_else(|| {
                Error::InvalidArgument(
                    "the engine has no GPU: name one in its configuration ([gpu] device = 0)"
                        .into(),
                )
            })
        })?;
        let entry = EXECUTORS.get(executor as u64)?;
        with_ex(executor, |ex, _| {
            ex.set_stream(Some(stream));
            Ok(())
        })?;
        *entry.device.lock() = Some(engine as u64);
        Ok(Status::Ok)
    })
}

/// Offload the plan's initially offloaded global tensors; ready for the first iteration.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_executor_start(executor: *mut teraio_executor) -> teraio_status {
    guard("teraio_executor_start", || {
        with_ex(executor, |ex, _| ex.start())?;
        Ok(Status::Ok)
    })
}

/// Issue the plan's instructions up to boundary `k` (kernel `k` about to run). `name` (may be
/// NULL) is checked against the trace's kernel name (`TERAIO_ERR_DIVERGED` when it differs).
///
/// # Safety
/// `name` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_boundary(
    executor: *mut teraio_executor,
    k: usize,
    name: *const c_char,
) -> teraio_status {
    guard("teraio_executor_boundary", || {
        // SAFETY: forwarded contract.
        let name = unsafe { opt_str(name, "name") }?;
        with_ex(executor, |ex, _| match name {
            Some(n) => ex.boundary_named(k, n),
            None => ex.boundary(k),
        })?;
        Ok(Status::Ok)
    })
}

/// The iteration left the plan at kernel `k` for a reason of the caller's (`detail`, may be
/// NULL): safe mode until it ends (nothing more offloaded, everything offloaded read back; the
/// report's `diverged` says where and why). After `teraio_executor_start`.
///
/// # Safety
/// `detail` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_leave_plan(
    executor: *mut teraio_executor,
    k: usize,
    detail: *const c_char,
) -> teraio_status {
    guard("teraio_executor_leave_plan", || {
        // SAFETY: forwarded contract.
        let detail = unsafe { opt_str(detail, "detail") }?;
        with_ex(executor, |ex, _| ex.leave_plan(k, detail.unwrap_or("(no detail)")))?;
        Ok(Status::Ok)
    })
}

/// Without blocking: issue boundary `k` if not yet, collect what finished, and say whether
/// kernel `k` can run (`TERAIO_OK` with `*ready` set).
///
/// # Safety
/// `ready` is valid for a write of a `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_kernel_ready(
    executor: *mut teraio_executor,
    k: usize,
    ready: *mut bool,
) -> teraio_status {
    guard("teraio_executor_kernel_ready", || {
        need(ready, "ready")?;
        let r = with_ex(executor, |ex, _| ex.kernel_ready(k))?;
        // SAFETY: forwarded contract.
        unsafe { put(ready, "ready", r) }?;
        Ok(Status::Ok)
    })
}

/// Issue boundary `k` and wait until kernel `k` can run; the seconds waited in `*stall_s`
/// (may be NULL).
///
/// # Safety
/// `stall_s` is NULL or valid for a write of a `double`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_before_kernel(
    executor: *mut teraio_executor,
    k: usize,
    stall_s: *mut f64,
) -> teraio_status {
    guard("teraio_executor_before_kernel", || {
        let d = with_ex(executor, |ex, _| ex.before_kernel(k))?;
        if !stall_s.is_null() {
            // SAFETY: non-null; forwarded contract.
            unsafe { put(stall_s, "stall_s", d.as_secs_f64()) }?;
        }
        Ok(Status::Ok)
    })
}

/// Kernel `k` ran: tensors whose last use it was die (their memory is released). `k` is the
/// kernel `teraio_executor_before_kernel` (or `_kernel_ready`) last said could run, once: a
/// kernel outside the trace, one not readied, or one already ended is
/// `TERAIO_ERR_INVALID_ARGUMENT` naming the kernel expected. Left out, the kernel ends when the
/// next one is readied or the iteration ends.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_executor_after_kernel(
    executor: *mut teraio_executor,
    k: usize,
) -> teraio_status {
    guard("teraio_executor_after_kernel", || {
        with_ex(executor, |ex, _| ex.after_kernel(k))?;
        Ok(Status::Ok)
    })
}

/// The caller's allocator ran out of memory running kernel `k` within the budget (its blocks
/// rounded and scattered, memory the trace does not see): tensors kernel `k` does not use leave
/// GPU memory, the furthest next use first, until `bytes` went back to the allocator (released
/// through its callback), and come back before their next use. The bytes handed back in
/// `*freed` (may be NULL); 0 in safe mode.
///
/// # Safety
/// `freed` is NULL or valid for a write of a `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_make_room(
    executor: *mut teraio_executor,
    k: usize,
    bytes: u64,
    freed: *mut u64,
) -> teraio_status {
    guard("teraio_executor_make_room", || {
        let n = with_ex(executor, |ex, _| ex.make_room(k, bytes))?;
        if !freed.is_null() {
            // SAFETY: non-null; forwarded contract.
            unsafe { put(freed, "freed", n) }?;
        }
        Ok(Status::Ok)
    })
}

/// The caller freed tensor `tensor` before the trace says it dies.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_executor_free_tensor(
    executor: *mut teraio_executor,
    tensor: u32,
) -> teraio_status {
    guard("teraio_executor_free_tensor", || {
        with_ex(executor, |ex, _| ex.free(TensorId(tensor)))?;
        Ok(Status::Ok)
    })
}

/// The memory of a resident tensor: the caller's (attached or from its allocator) or engine
/// host memory. `TERAIO_ERR_INVALID_STATE` when the tensor is not resident with memory.
///
/// # Safety
/// `out_ptr` and `out_len` are NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_resident(
    executor: *mut teraio_executor,
    tensor: u32,
    out_ptr: *mut *mut c_void,
    out_len: *mut u64,
) -> teraio_status {
    guard("teraio_executor_resident", || {
        let (p, len) = with_ex(executor, |ex, table| {
            let Some(mem) = ex.resident(TensorId(tensor)) else {
                return Err(::teraio_engine::Error::InvalidState {
                    tensor: tensor.to_string(),
                    detail: "it is not resident (or has no memory attached yet)".into(),
                });
            };
            Ok(match mem.host() {
                Some(b) => (b.as_ptr() as usize, b.len()),
                None => table.lock().get(&tensor).copied().ok_or_else(|| {
                    ::teraio_engine::Error::InvalidState {
                        tensor: tensor.to_string(),
                        detail: "its memory is not host memory".into(),
                    }
                })?,
            })
        })?;
        if !out_ptr.is_null() {
            // SAFETY: non-null; forwarded contract.
            unsafe { put(out_ptr, "out_ptr", p as *mut c_void) }?;
        }
        if !out_len.is_null() {
            // SAFETY: non-null; forwarded contract.
            unsafe { put(out_len, "out_len", len as u64) }?;
        }
        Ok(Status::Ok)
    })
}

/// Arrivals and releases since the last call, as JSON: `[{"event": "arrived"|"released",
/// "tensor": N}, ...]`.
///
/// # Safety
/// `out_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_events(
    executor: *mut teraio_executor,
    out_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_executor_events", || {
        need(out_json, "out_json")?;
        let ev = with_ex(executor, |ex, _| Ok(ex.events()))?;
        let v: Vec<_> = ev
            .into_iter()
            .map(|e| match e {
                Event::Arrived(t) => serde_json::json!({"event": "arrived", "tensor": t.0}),
                Event::Released(t) => serde_json::json!({"event": "released", "tensor": t.0}),
            })
            .collect();
        // SAFETY: forwarded contract.
        unsafe { put_string(out_json, "out_json", serde_json::Value::Array(v).to_string()) }?;
        Ok(Status::Ok)
    })
}

/// Run `f` on the executor and hand its report to the caller as a JSON string.
///
/// # Safety
/// `out` is valid for a write of a pointer.
unsafe fn report_json(
    executor: *mut teraio_executor,
    out: *mut *mut c_char,
    f: impl FnOnce(&mut Executor) -> ::teraio_engine::Result<serde_json::Value>,
) -> core::Result<Status> {
    need(out, "out_report_json")?;
    let text = with_ex(executor, |ex, _| f(ex))?.to_string();
    // SAFETY: forwarded contract.
    unsafe { put_string(out, "out_report_json", text) }?;
    Ok(Status::Ok)
}

/// End the iteration; its report as JSON (`time_s`, `stall_s`, `peak_bytes`, `offloads`,
/// `prefetches`, `diverged`, `memory_timeline`, `store`, ...).
///
/// # Safety
/// `out_report_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_end_iteration(
    executor: *mut teraio_executor,
    out_report_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_executor_end_iteration", || {
        // SAFETY: forwarded contract.
        unsafe {
            report_json(executor, out_report_json, |ex| {
                ex.end_iteration().map(|r| serde_json::json!(r))
            })
        }
    })
}

/// Between iterations (after `teraio_executor_end_iteration`): make every global tensor
/// resident with its bytes in place until the next iteration's first kernel, for the caller's
/// own code between steps (logging, a checkpoint). Offloads still being written keep their
/// memory; tensors already off the GPU are read back (on a GPU the caller's stream waits for
/// them). The report as JSON (`read_back`, `read_back_bytes`, `kept_in_flight`, `kept_by_plan`,
/// `waited_s`, `used_bytes`). Kernel 0 of the next iteration puts them back where the plan
/// starts them.
///
/// # Safety
/// `out_report_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_gather_globals(
    executor: *mut teraio_executor,
    out_report_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_executor_gather_globals", || {
        // SAFETY: forwarded contract.
        unsafe {
            report_json(executor, out_report_json, |ex| {
                ex.gather_globals().map(|r| serde_json::json!(r))
            })
        }
    })
}

/// `teraio_executor_gather_globals` within `limit_bytes` GPU bytes (e.g. the budget): global
/// tensors off the GPU are read back, those the iteration uses first first, while they fit; the
/// others stay stored (the report's `left_off`, `left_off_bytes`).
///
/// # Safety
/// `out_report_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_executor_gather_globals_within(
    executor: *mut teraio_executor,
    limit_bytes: u64,
    out_report_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_executor_gather_globals_within", || {
        // SAFETY: forwarded contract.
        unsafe {
            report_json(executor, out_report_json, |ex| {
                ex.gather_globals_within(limit_bytes).map(|r| serde_json::json!(r))
            })
        }
    })
}

/// The caller wrote global tensor `tensor` between iterations (after
/// `teraio_executor_gather_globals`): the store's copy is stale and the next offload writes it.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_executor_modified(
    executor: *mut teraio_executor,
    tensor: u32,
) -> teraio_status {
    guard("teraio_executor_modified", || {
        with_ex(executor, |ex, _| ex.modified(TensorId(tensor)))?;
        Ok(Status::Ok)
    })
}

/// Wait for the migrations in flight, free the store's copies of the trace's tensors, release
/// resident memory, and free the handle (also when it fails).
#[unsafe(no_mangle)]
pub extern "C" fn teraio_executor_finish(executor: *mut teraio_executor) -> teraio_status {
    guard("teraio_executor_finish", || {
        let entry = EXECUTORS.remove(executor as u64)?;
        let ex = entry.ex.lock().take();
        if let Some(ex) = ex {
            // After the engine's close the executor is only dropped (the handle is freed).
            on_engine(&entry, || Ok(ex.finish()?))?;
        }
        Ok(Status::Ok)
    })
}

/// Free an executor handle without `finish` (migrations in flight complete; the store keeps
/// its copies until the tensors are freed or the engine closes).
#[unsafe(no_mangle)]
pub extern "C" fn teraio_executor_free(executor: *mut teraio_executor) -> teraio_status {
    guard("teraio_executor_free", || {
        EXECUTORS.remove(executor as u64)?;
        Ok(Status::Ok)
    })
}
