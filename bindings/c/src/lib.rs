//! teraio's C ABI (`libteraio.so`, `libteraio.a`, header `include/teraio.h`).
//!
//! Every function returns a [`teraio_status`] (`TERAIO_OK` = 0, errors < 0; see
//! docs/C_ABI.md for the table), leaves results in out-parameters, and on failure leaves a
//! message for [`teraio_last_error_message`] (per thread). Handles (`teraio_engine *`,
//! `teraio_op *`, `teraio_buffer *`, `teraio_trace *`) are opaque ids checked on every call:
//! NULL, made-up, wrong-kind, closed or freed handles give `TERAIO_ERR_INVALID_HANDLE` (or
//! `TERAIO_ERR_CLOSED` for an engine), never undefined behaviour. A Rust panic never crosses
//! the boundary (`TERAIO_ERR_INTERNAL`). JSON results are strings the caller frees with
//! [`teraio_string_free`].
//!
//! Memory: `teraio_offload` copies the caller's bytes before it returns; `teraio_prefetch`
//! copies into the caller's buffer when the operation is waited (`teraio_wait`, a `teraio_poll`
//! that reports completion, or `teraio_op_free`), so that buffer must stay valid until then;
//! `teraio_buffer` memory moves without a copy.
#![allow(non_camel_case_types)]

mod executor;
mod ffi;
mod optim;
mod registry;

pub use executor::*;
pub use optim::*;

use std::ffi::{c_char, c_void};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ::teraio_engine::Engine;
use ::teraio_engine::queue::Priority;
use ::teraio_engine::store::{Destination, OffloadOptions, OffloadOutcome};
use parking_lot::{Mutex, RwLock};
use teraio_bindings_core::{self as core, ConfigSource, Error, HostBuffer, Op, Outcome, Status};
use teraio_scheduler::Trace;

use ffi::{arg_str, guard, need, opt_str, put, put_string};
use registry::{Kind, Registry};

/// A status code: `TERAIO_OK` (0), `TERAIO_PENDING` (1) or a `TERAIO_ERR_*` (< 0). The values
/// are stable.
pub type teraio_status = i32;

/// Success.
pub const TERAIO_OK: teraio_status = 0;
/// The operation has not finished yet (`teraio_poll`, or `teraio_wait` whose timeout passed).
pub const TERAIO_PENDING: teraio_status = 1;
/// A parameter is wrong: NULL pointer, size, name, configuration key or value.
pub const TERAIO_ERR_INVALID_ARGUMENT: teraio_status = -1;
/// A handle is NULL, made up, of another kind, or already freed.
pub const TERAIO_ERR_INVALID_HANDLE: teraio_status = -2;
/// An I/O system call failed or moved fewer bytes than asked.
pub const TERAIO_ERR_IO: teraio_status = -3;
/// The array, a memory tier or the engine's host buffers are full.
pub const TERAIO_ERR_NO_SPACE: teraio_status = -4;
/// On-disk metadata is damaged or inconsistent.
pub const TERAIO_ERR_CORRUPTION: teraio_status = -5;
/// Data read back does not match the checksum written with it.
pub const TERAIO_ERR_CHECKSUM_MISMATCH: teraio_status = -6;
/// A target holds other data (filesystem, partition table, another array).
pub const TERAIO_ERR_OVERWRITE_REFUSED: teraio_status = -7;
/// No tensor with this id or name.
pub const TERAIO_ERR_UNKNOWN_TENSOR: teraio_status = -8;
/// Not valid in the current state (a prefetch of a freed tensor, a busy buffer).
pub const TERAIO_ERR_INVALID_STATE: teraio_status = -9;
/// Not available on this system or build.
pub const TERAIO_ERR_UNSUPPORTED: teraio_status = -10;
/// The engine was closed (use after close, double close).
pub const TERAIO_ERR_CLOSED: teraio_status = -11;
/// A trace is malformed (the message names the JSON path).
pub const TERAIO_ERR_TRACE: teraio_status = -12;
/// A plan is inconsistent with its trace.
pub const TERAIO_ERR_PLAN: teraio_status = -13;
/// The simulator could not make progress.
pub const TERAIO_ERR_SIMULATION: teraio_status = -14;
/// The caller's iteration left the plan (the executor runs in safe mode until re-planned).
pub const TERAIO_ERR_DIVERGED: teraio_status = -15;
/// A GPU (CUDA driver, NVRTC, cuFile) call failed.
pub const TERAIO_ERR_DEVICE: teraio_status = -16;
/// A bug: a panic was caught at the boundary.
pub const TERAIO_ERR_INTERNAL: teraio_status = -99;

/// Priority: must finish before the next kernel; runs before everything else.
pub const TERAIO_PRIORITY_URGENT: i32 = 0;
/// Priority: planned ahead of need.
pub const TERAIO_PRIORITY_NORMAL: i32 = 1;
/// Priority: opportunistic work.
pub const TERAIO_PRIORITY_BACKGROUND: i32 = 2;

/// Offload destination: the SSD array.
pub const TERAIO_DEST_SSD: i32 = 0;
/// Offload destination: the host-memory tier (the SSD array when absent or full).
pub const TERAIO_DEST_HOST: i32 = 1;

/// Outcome of a finished offload: written to the SSD array.
pub const TERAIO_OUTCOME_SSD: i32 = 0;
/// Outcome of a finished offload: copied to the host tier.
pub const TERAIO_OUTCOME_HOST: i32 = 1;
/// Outcome of a finished offload: a later prefetch took the data before it was written.
pub const TERAIO_OUTCOME_CANCELLED: i32 = 2;
/// Outcome of a finished prefetch.
pub const TERAIO_OUTCOME_PREFETCHED: i32 = 3;
/// Outcome of a finished free.
pub const TERAIO_OUTCOME_FREED: i32 = 4;

/// `teraio_engine_measure_hardware` flag: neither read nor write the cache.
pub const TERAIO_HW_NO_CACHE: u32 = 1;
/// `teraio_engine_measure_hardware` flag: measure even when a model is cached, and replace it.
pub const TERAIO_HW_FRESH: u32 = 2;

/// The first tensor key of the callers' own key space (`1 << 40`): an executor's trace tensor
/// `t` is key `t`, always below it, so a caller that counts its own keys from here shares an
/// engine with an executor without a collision.
pub const TERAIO_KEY_CALLER_FIRST: u64 = 0x100_0000_0000;
const _: () =
    assert!(TERAIO_KEY_CALLER_FIRST == ::teraio_engine::store::TensorKey::CALLER_FIRST.get());

/// Version of this C ABI: bumped when a function's signature or meaning changes.
pub const TERAIO_ABI_VERSION: u32 = 1;

/// An engine: the SSD array, the tensor store, host tier and host buffers (opaque).
pub struct teraio_engine {
    _private: [u8; 0],
}

/// A pending offload, prefetch or free (opaque).
pub struct teraio_op {
    _private: [u8; 0],
}

/// Engine host memory with a stable address, moved without a copy (opaque).
pub struct teraio_buffer {
    _private: [u8; 0],
}

/// A training-iteration trace for the scheduler (opaque).
pub struct teraio_trace {
    _private: [u8; 0],
}

struct EngineEntry {
    /// `None` once closed; calls hold the read lock for their duration, close the write lock.
    engine: RwLock<Option<Engine>>,
}

struct OpEntry {
    op: Mutex<Op>,
    /// A prefetch into caller memory: where the bytes go at completion.
    dest: Option<(usize, usize)>,
}

static ENGINES: Registry<EngineEntry> = Registry::new(Kind::Engine);
static OPS: Registry<OpEntry> = Registry::new(Kind::Op);
static BUFFERS: Registry<Arc<HostBuffer>> = Registry::new(Kind::Buffer);
pub(crate) static TRACES: Registry<Trace> = Registry::new(Kind::Trace);

pub(crate) fn with_engine<R>(
    h: *mut teraio_engine,
    f: impl FnOnce(&Engine) -> core::Result<R>,
) -> core::Result<R> {
    let entry = ENGINES.get(h as u64)?;
    // Recursive: an executor call holds its engine open while its allocator looks the engine
    // up again (device memory); a close waiting for the write lock must not deadlock it.
    let guard = entry.engine.read_recursive();
    let engine = guard.as_ref().ok_or_else(|| Error::Closed("the engine was closed".into()))?;
    f(engine)
}

pub(crate) fn handle<T>(id: u64) -> *mut T {
    id as usize as *mut T
}

fn priority(p: i32) -> core::Result<Priority> {
    match p {
        TERAIO_PRIORITY_URGENT => Ok(Priority::Urgent),
        TERAIO_PRIORITY_NORMAL => Ok(Priority::Normal),
        TERAIO_PRIORITY_BACKGROUND => Ok(Priority::Background),
        _ => Err(Error::InvalidArgument(format!(
            "priority {p} is not TERAIO_PRIORITY_URGENT (0), _NORMAL (1) or _BACKGROUND (2)"
        ))),
    }
}

fn destination(d: i32) -> core::Result<Destination> {
    match d {
        TERAIO_DEST_SSD => Ok(Destination::Ssd),
        TERAIO_DEST_HOST => Ok(Destination::Host),
        _ => Err(Error::InvalidArgument(format!(
            "destination {d} is not TERAIO_DEST_SSD (0) or TERAIO_DEST_HOST (1)"
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// Version and errors

/// The teraio version, e.g. "0.1.0" (a static string; do not free).
#[unsafe(no_mangle)]
pub extern "C" fn teraio_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// [`TERAIO_ABI_VERSION`] of the library actually loaded (compare with the header's).
#[unsafe(no_mangle)]
pub extern "C" fn teraio_abi_version() -> u32 {
    TERAIO_ABI_VERSION
}

/// The message of the last call on this thread that failed ("" if none). Valid until the next
/// failing call on this thread; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_last_error_message() -> *const c_char {
    ffi::last_error_ptr()
}

/// The name of a status code without the `TERAIO_` prefix ("OK", "ERR_NO_SPACE"; "UNKNOWN"
/// for a number that is no status). A static string; do not free.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_status_name(status: teraio_status) -> *const c_char {
    macro_rules! names {
        ($($s:ident => $n:literal),* $(,)?) => {
            match Status::from_code(status) {
                $(Some(Status::$s) => concat!($n, "\0"),)*
                None => "UNKNOWN\0",
            }
        };
    }
    let name: &'static str = names!(
        Ok => "OK", Pending => "PENDING", InvalidArgument => "ERR_INVALID_ARGUMENT",
        InvalidHandle => "ERR_INVALID_HANDLE", Io => "ERR_IO", NoSpace => "ERR_NO_SPACE",
        Corruption => "ERR_CORRUPTION", ChecksumMismatch => "ERR_CHECKSUM_MISMATCH",
        OverwriteRefused => "ERR_OVERWRITE_REFUSED", UnknownTensor => "ERR_UNKNOWN_TENSOR",
        InvalidState => "ERR_INVALID_STATE", Unsupported => "ERR_UNSUPPORTED",
        Closed => "ERR_CLOSED", Trace => "ERR_TRACE", Plan => "ERR_PLAN",
        Simulation => "ERR_SIMULATION", Diverged => "ERR_DIVERGED", Device => "ERR_DEVICE",
        Internal => "ERR_INTERNAL",
    );
    name.as_ptr().cast()
}

/// Free a string returned by teraio (JSON results). NULL is accepted and does nothing; a
/// pointer teraio did not return, or one already freed, gives `TERAIO_ERR_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_string_free(s: *mut c_char) -> teraio_status {
    guard("teraio_string_free", || ffi::free_string(s).map(|()| Status::Ok))
}

// ---------------------------------------------------------------------------------------------
// Notices

/// Notice level: a choice the library made that the caller may want to know (a slower
/// fallback taken: no io_uring, no O_DIRECT).
pub const TERAIO_NOTICE_INFO: i32 = 0;
/// Notice level: something went wrong and was worked around (a host buffer that could not be
/// page-locked).
pub const TERAIO_NOTICE_WARNING: i32 = 1;
/// Notice level: something failed where no call could return the error (a final checkpoint in
/// a destructor).
pub const TERAIO_NOTICE_ERROR: i32 = 2;

/// Take the oldest waiting notice. teraio never prints: what it has to say outside a call's
/// result waits in a queue of the latest 256 notices until taken here. `*out_message` is NULL
/// when none waits, else the notice's text (free it with `teraio_string_free`) and
/// `*out_level` one of `TERAIO_NOTICE_*`.
///
/// # Safety
/// `out_level` and `out_message` are valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_take_notice(
    out_level: *mut i32,
    out_message: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_take_notice", || {
        ffi::need(out_level, "out_level")?;
        ffi::need(out_message, "out_message")?;
        let Some(n) = ::teraio_engine::notice::take() else {
            // SAFETY: checked non-null; the caller guarantees validity.
            unsafe { ffi::put(out_message, "out_message", std::ptr::null_mut())? };
            return Ok(Status::Ok);
        };
        let level = match n.level {
            ::teraio_engine::notice::Level::Info => TERAIO_NOTICE_INFO,
            ::teraio_engine::notice::Level::Warning => TERAIO_NOTICE_WARNING,
            ::teraio_engine::notice::Level::Error => TERAIO_NOTICE_ERROR,
        };
        // SAFETY: checked non-null; the caller guarantees validity.
        unsafe {
            ffi::put(out_level, "out_level", level)?;
            ffi::put_string(out_message, "out_message", n.message)?;
        }
        Ok(Status::Ok)
    })
}

/// How many notices were dropped, the queue being full, since the last call.
///
/// # Safety
/// `out_count` is valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_notices_dropped(out_count: *mut u64) -> teraio_status {
    guard("teraio_notices_dropped", || {
        ffi::need(out_count, "out_count")?;
        // SAFETY: checked non-null; the caller guarantees validity.
        unsafe { ffi::put(out_count, "out_count", ::teraio_engine::notice::take_dropped())? };
        Ok(Status::Ok)
    })
}

// ---------------------------------------------------------------------------------------------
// Engines

fn open_into(
    out: *mut *mut teraio_engine,
    f: impl FnOnce() -> core::Result<Engine>,
) -> core::Result<Status> {
    need(out, "engine")?;
    let engine = f()?;
    let id = ENGINES.insert(EngineEntry { engine: RwLock::new(Some(engine)) })?;
    // SAFETY: `out` checked non-null; the caller guarantees it is valid for a write.
    unsafe { put(out, "engine", handle(id)) }?;
    Ok(Status::Ok)
}

fn overrides(text: Option<&str>) -> core::Result<Option<serde_json::Value>> {
    text.map(|t| {
        serde_json::from_str(t)
            .map_err(|e| Error::InvalidArgument(format!("engine overrides (JSON): {e}")))
    })
    .transpose()
}

/// Open an engine from a TOML configuration (the keys of docs/C_ABI.md; e.g.
/// `dir = "/tmp/t"\nfiles = 2\nfile_size = "256M"\npersistent = true`).
///
/// # Safety
/// `toml` is a NUL-terminated string; `out` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_engine_open_toml(
    toml: *const c_char,
    out: *mut *mut teraio_engine,
) -> teraio_status {
    guard("teraio_engine_open_toml", || {
        // SAFETY: forwarded contract.
        let text = unsafe { arg_str(toml, "toml") }?;
        open_into(out, || core::open_engine(ConfigSource::Toml(text), None))
    })
}

/// Open an engine from a JSON configuration (same keys as TOML).
///
/// # Safety
/// `json` is a NUL-terminated string; `out` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_engine_open_json(
    json: *const c_char,
    out: *mut *mut teraio_engine,
) -> teraio_status {
    guard("teraio_engine_open_json", || {
        // SAFETY: forwarded contract.
        let text = unsafe { arg_str(json, "json") }?;
        open_into(out, || core::open_engine(ConfigSource::Json(text), None))
    })
}

/// Open an engine from a configuration file (TOML; JSON when the name ends in `.json`;
/// relative paths in it are relative to its folder). `overrides_json` (may be NULL) is a JSON
/// object of configuration keys that replace the file's.
///
/// # Safety
/// `path` and `overrides_json` (unless NULL) are NUL-terminated strings; `out` is valid for a
/// write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_engine_open_file(
    path: *const c_char,
    overrides_json: *const c_char,
    out: *mut *mut teraio_engine,
) -> teraio_status {
    guard("teraio_engine_open_file", || {
        // SAFETY: forwarded contract.
        let path = unsafe { arg_str(path, "path") }?;
        // SAFETY: forwarded contract.
        let over = overrides(unsafe { opt_str(overrides_json, "overrides_json") }?)?;
        open_into(out, || core::open_engine(ConfigSource::File(Path::new(path)), over.as_ref()))
    })
}

/// Close an engine: waits for queued operations, writes a checkpoint (persistent engines) and
/// releases everything. The handle is invalid afterwards (`TERAIO_ERR_CLOSED`), also when
/// this returns an error: a failed final checkpoint is reported (e.g. `TERAIO_ERR_IO`; the
/// journal still has every acknowledged change, so a reopen finds them). Pending operation
/// handles stay valid: they complete, and must still be freed. An executor of the engine
/// answers `TERAIO_ERR_CLOSED` from then on (finish or free it before closing).
#[unsafe(no_mangle)]
pub extern "C" fn teraio_engine_close(engine: *mut teraio_engine) -> teraio_status {
    guard("teraio_engine_close", || {
        let entry = ENGINES.remove(engine as u64)?;
        let e = entry.engine.write().take();
        if let Some(e) = e {
            e.close()?;
        }
        Ok(Status::Ok)
    })
}

/// What the engine is, as JSON: `{"describe", "capacity_bytes", "persistent", "devices",
/// "config"}`. Free the string with `teraio_string_free`.
///
/// # Safety
/// `out_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_engine_info(
    engine: *mut teraio_engine,
    out_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_engine_info", || {
        need(out_json, "out_json")?;
        let text = with_engine(engine, |e| Ok(core::engine_json(e).to_string()))?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_json, "out_json", text) }?;
        Ok(Status::Ok)
    })
}

/// Migration statistics as JSON (bytes, operations, errors and busy time per direction,
/// queue waits). Free the string with `teraio_string_free`.
///
/// # Safety
/// `out_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_engine_stats(
    engine: *mut teraio_engine,
    out_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_engine_stats", || {
        need(out_json, "out_json")?;
        let text = with_engine(engine, |e| Ok(core::stats_json(e).to_string()))?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_json, "out_json", text) }?;
        Ok(Status::Ok)
    })
}

/// This machine's hardware model, measured through the engine in a few seconds (the array's
/// write, read and both-at-once bandwidth through the store; host memory copies; with a GPU,
/// pinned host <-> GPU copies), or read from the cache of this machine and array
/// (`$TERAIO_CACHE_DIR`, else `$XDG_CACHE_HOME/teraio`, else `~/.cache/teraio`), as JSON:
/// `{"hardware", "report", "source" ("measured" or "cache"), "cache_path", "key",
/// "measured_unix_s", "summary"}`; `"hardware"` is a model `teraio_plan` takes. `flags`: 0, or
/// `TERAIO_HW_NO_CACHE` and/or `TERAIO_HW_FRESH`. A damaged cache file is measured again and
/// leaves a notice (`teraio_take_notice`). Free the string with `teraio_string_free`.
///
/// # Safety
/// `out_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_engine_measure_hardware(
    engine: *mut teraio_engine,
    flags: u32,
    out_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_engine_measure_hardware", || {
        need(out_json, "out_json")?;
        let known = TERAIO_HW_NO_CACHE | TERAIO_HW_FRESH;
        if flags & !known != 0 {
            return Err(Error::InvalidArgument(format!(
                "flags {flags:#x}: only TERAIO_HW_NO_CACHE (1) and TERAIO_HW_FRESH (2) are known"
            )));
        }
        let cache = flags & TERAIO_HW_NO_CACHE == 0;
        let fresh = flags & TERAIO_HW_FRESH != 0;
        let text =
            with_engine(engine, |e| Ok(core::measure_hardware(e, cache, fresh, None).to_string()))?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_json, "out_json", text) }?;
        Ok(Status::Ok)
    })
}

/// Wait until every queued operation of the engine has finished.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_engine_drain(engine: *mut teraio_engine) -> teraio_status {
    guard("teraio_engine_drain", || {
        with_engine(engine, |e| {
            e.store().drain();
            Ok(Status::Ok)
        })
    })
}

/// Persistent engines: write a metadata checkpoint now (volatile engines: nothing to do).
#[unsafe(no_mangle)]
pub extern "C" fn teraio_engine_checkpoint(engine: *mut teraio_engine) -> teraio_status {
    guard("teraio_engine_checkpoint", || {
        with_engine(engine, |e| {
            e.store().checkpoint()?;
            Ok(Status::Ok)
        })
    })
}

/// Every tensor of the engine as a JSON array of `{"id", "name", "size_bytes", "location",
/// "host_copy", "pending_ops", "checksummed_chunks"}`, sorted by id. Free the string with
/// `teraio_string_free`.
///
/// # Safety
/// `out_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_list_tensors(
    engine: *mut teraio_engine,
    out_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_list_tensors", || {
        need(out_json, "out_json")?;
        let text = with_engine(engine, |e| Ok(core::tensors_json(e).to_string()))?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_json, "out_json", text) }?;
        Ok(Status::Ok)
    })
}

/// The id of the tensor named `name` (`TERAIO_ERR_UNKNOWN_TENSOR` if none).
///
/// # Safety
/// `name` is a NUL-terminated string; `out_id` is valid for a write of a `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_lookup(
    engine: *mut teraio_engine,
    name: *const c_char,
    out_id: *mut u64,
) -> teraio_status {
    guard("teraio_lookup", || {
        // SAFETY: forwarded contract.
        let name = unsafe { arg_str(name, "name") }?;
        need(out_id, "out_id")?;
        let id = with_engine(engine, |e| {
            e.store().lookup::<u64>(name).ok_or_else(|| {
                ::teraio_engine::Error::UnknownTensor(format!("named {name:?}")).into()
            })
        })?;
        // SAFETY: forwarded contract.
        unsafe { put(out_id, "out_id", id) }?;
        Ok(Status::Ok)
    })
}

// ---------------------------------------------------------------------------------------------
// Operations

fn submit(
    out: *mut *mut teraio_op,
    dest: Option<(usize, usize)>,
    f: impl FnOnce() -> core::Result<Op>,
) -> core::Result<Status> {
    need(out, "out_op")?;
    let op = f()?;
    let id = OPS.insert(OpEntry { op: Mutex::new(op), dest })?;
    // SAFETY: `out` checked non-null; the caller guarantees it is valid for a write.
    unsafe { put(out, "out_op", handle(id)) }?;
    Ok(Status::Ok)
}

/// A length of caller memory: at most `isize::MAX` bytes (no object is larger), else an error
/// naming the argument.
fn caller_len(len: usize, what: &str) -> core::Result<()> {
    if len > isize::MAX as usize {
        return Err(Error::InvalidArgument(format!(
            "`{what}` {len} is larger than any memory object (at most {} bytes)",
            isize::MAX
        )));
    }
    Ok(())
}

fn offload_options(name: Option<&str>, dest: i32, prio: i32) -> core::Result<OffloadOptions> {
    Ok(OffloadOptions {
        destination: destination(dest)?,
        priority: priority(prio)?,
        name: name.map(str::to_string),
    })
}

/// Offload `len` bytes at `data` as tensor `tensor_id`. The bytes are copied into engine
/// memory before this returns: `data` may be reused at once. A `len` above `PTRDIFF_MAX` is
/// `TERAIO_ERR_INVALID_ARGUMENT`, one above the engine's host buffers `TERAIO_ERR_NO_SPACE`
/// (both before `data` is read). `name` (may be NULL) is recorded
/// with the tensor (persistent engines find it again with `teraio_lookup`). `destination` is a
/// `TERAIO_DEST_*`, `priority` a `TERAIO_PRIORITY_*`. On success `*out_op` is a pending
/// operation to wait on and free.
///
/// # Safety
/// `data` is valid for reads of `len` bytes; `name` is NULL or a NUL-terminated string;
/// `out_op` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_offload(
    engine: *mut teraio_engine,
    tensor_id: u64,
    data: *const c_void,
    len: usize,
    name: *const c_char,
    destination: i32,
    priority: i32,
    out_op: *mut *mut teraio_op,
) -> teraio_status {
    guard("teraio_offload", || {
        // SAFETY: forwarded contract.
        let name = unsafe { opt_str(name, "name") }?;
        let opts = offload_options(name, destination, priority)?;
        if data.is_null() {
            return Err(Error::InvalidArgument("`data` is NULL".into()));
        }
        caller_len(len, "len")?;
        // SAFETY: non-null, and the caller guarantees `len` readable bytes at `data` for the
        // call (the bytes are copied before it returns).
        let bytes = unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) };
        submit(out_op, None, || {
            with_engine(engine, |e| Op::offload_copy(e, tensor_id, bytes, opts))
        })
    })
}

/// Prefetch tensor `tensor_id` into `len` bytes at `dst` (exactly the tensor's size, else
/// `TERAIO_ERR_INVALID_ARGUMENT`). The bytes arrive in `dst` when the operation is waited
/// (`teraio_wait` returning `TERAIO_OK`, `teraio_poll` reporting completion, or `teraio_op_free`),
/// so `dst` must stay valid until then and must not be read before.
///
/// # Safety
/// `dst` is valid for writes of `len` bytes until the operation is waited or freed;
/// `out_op` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_prefetch(
    engine: *mut teraio_engine,
    tensor_id: u64,
    dst: *mut c_void,
    len: usize,
    priority: i32,
    out_op: *mut *mut teraio_op,
) -> teraio_status {
    guard("teraio_prefetch", || {
        let prio = self::priority(priority)?;
        if dst.is_null() {
            return Err(Error::InvalidArgument("`dst` is NULL".into()));
        }
        caller_len(len, "len")?;
        if (dst as usize).checked_add(len).is_none() {
            return Err(Error::InvalidArgument(format!(
                "`dst` {dst:p} + `len` {len} wraps around the address space"
            )));
        }
        let dest = Some((dst as usize, len));
        submit(out_op, dest, || {
            with_engine(engine, |e| Op::prefetch_copy(e, tensor_id, len as u64, prio))
        })
    })
}

/// Offload `len` bytes of the caller's GPU memory at device address `device_ptr` (memory of the
/// engine's GPU, 16-byte aligned) as tensor `tensor_id`, read once the work queued so far on
/// CUDA stream `stream` (a `CUstream` cast to an integer; 0 the legacy default stream) has
/// finished: an event is recorded on the stream, which is never blocked. The memory must stay
/// allocated and unwritten until the operation finished. Needs an engine with a GPU
/// (`[gpu] device = N`); on the host-memory emulation (`emulated = true`) `device_ptr` is host
/// memory, so the same program runs its GPU path on any machine.
///
/// # Safety
/// `device_ptr` is `len` bytes of live memory of the engine's GPU (on the emulation: host memory
/// valid for reads) until the operation finished; `name` is NULL or a NUL-terminated string;
/// `out_op` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_offload_device(
    engine: *mut teraio_engine,
    tensor_id: u64,
    device_ptr: u64,
    len: u64,
    stream: u64,
    name: *const c_char,
    destination: i32,
    priority: i32,
    out_op: *mut *mut teraio_op,
) -> teraio_status {
    guard("teraio_offload_device", || {
        // SAFETY: forwarded contract.
        let name = unsafe { opt_str(name, "name") }?;
        let opts = offload_options(name, destination, priority)?;
        if len == 0 {
            return Err(Error::InvalidArgument(format!("tensor {tensor_id}: 0 bytes")));
        }
        submit(out_op, None, || {
            with_engine(engine, |e| {
                // SAFETY: forwarded contract (checked to be memory of the GPU on a real one).
                let mem = unsafe { e.wrap_caller_gpu(device_ptr, len) }?;
                Op::offload_device(e, tensor_id, mem, stream, opts)
            })
        })
    })
}

/// Prefetch tensor `tensor_id` into `len` bytes of the caller's GPU memory at `device_ptr`
/// (exactly the tensor's size), written only after the work queued so far on `stream` (memory
/// a caching allocator just handed out may still be read by it). Once the operation is waited
/// (`teraio_wait` returning `TERAIO_OK`), work queued on `stream` afterwards sees the data: the
/// stream waits on the GPU, the host never waits for it.
///
/// # Safety
/// `device_ptr` is `len` bytes of live memory of the engine's GPU (on the emulation: host
/// memory valid for writes) that nobody else uses until the operation finished; `out_op` is
/// valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_prefetch_device(
    engine: *mut teraio_engine,
    tensor_id: u64,
    device_ptr: u64,
    len: u64,
    stream: u64,
    priority: i32,
    out_op: *mut *mut teraio_op,
) -> teraio_status {
    guard("teraio_prefetch_device", || {
        let prio = self::priority(priority)?;
        if len == 0 {
            return Err(Error::InvalidArgument(format!("tensor {tensor_id}: 0 bytes")));
        }
        submit(out_op, None, || {
            with_engine(engine, |e| {
                // SAFETY: forwarded contract.
                let mem = unsafe { e.wrap_caller_gpu(device_ptr, len) }?;
                Op::prefetch_device(e, tensor_id, mem, stream, prio)
            })
        })
    })
}

/// Offload the whole of `buffer` as tensor `tensor_id` without a copy. The buffer is busy
/// (other operations on it give `TERAIO_ERR_INVALID_STATE`) until the operation finished; do
/// not write to it meanwhile. After a failed offload the engine holds the memory as the
/// tensor's data until the tensor is prefetched or freed.
///
/// # Safety
/// `name` is NULL or a NUL-terminated string; `out_op` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_offload_buffer(
    engine: *mut teraio_engine,
    tensor_id: u64,
    buffer: *mut teraio_buffer,
    name: *const c_char,
    destination: i32,
    priority: i32,
    out_op: *mut *mut teraio_op,
) -> teraio_status {
    guard("teraio_offload_buffer", || {
        // SAFETY: forwarded contract.
        let name = unsafe { opt_str(name, "name") }?;
        let opts = offload_options(name, destination, priority)?;
        let buf = BUFFERS.get(buffer as u64)?;
        submit(out_op, None, || {
            with_engine(engine, |e| Op::offload_buffer(e, tensor_id, &buf, opts))
        })
    })
}

/// Prefetch tensor `tensor_id` into the whole of `buffer` (exactly the tensor's size) without
/// a copy. The buffer is busy until the operation finished.
///
/// # Safety
/// `out_op` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_prefetch_buffer(
    engine: *mut teraio_engine,
    tensor_id: u64,
    buffer: *mut teraio_buffer,
    priority: i32,
    out_op: *mut *mut teraio_op,
) -> teraio_status {
    guard("teraio_prefetch_buffer", || {
        let prio = self::priority(priority)?;
        let buf = BUFFERS.get(buffer as u64)?;
        submit(out_op, None, || {
            with_engine(engine, |e| Op::prefetch_buffer(e, tensor_id, &buf, prio))
        })
    })
}

/// Free tensor `tensor_id` (after the operations issued before it): its space is released and
/// the engine forgets it.
///
/// # Safety
/// `out_op` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_free_tensor(
    engine: *mut teraio_engine,
    tensor_id: u64,
    out_op: *mut *mut teraio_op,
) -> teraio_status {
    guard("teraio_free_tensor", || {
        submit(out_op, None, || with_engine(engine, |e| Op::free(e, tensor_id)))
    })
}

/// Collect the result of `entry` (at most `timeout`); the status of the operation.
fn collect(entry: &OpEntry, op: &mut Op, timeout: Option<Duration>) -> core::Result<Status> {
    let dest = entry.dest;
    let r = op.wait(timeout, |bytes| {
        let (ptr, len) = dest.expect("a prefetch into caller memory has a destination");
        if bytes.len() != len {
            return Err(Error::InvalidArgument(format!(
                "prefetch read {} bytes for a destination of {len}",
                bytes.len()
            )));
        }
        // SAFETY: the caller of teraio_prefetch guaranteed `len` writable bytes at `ptr` until
        // the operation is waited or freed, which is now; nothing else writes them.
        let out = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
        out.copy_from_slice(bytes);
        Ok(())
    });
    match r {
        None => Ok(Status::Pending),
        Some(Ok(_)) => Ok(Status::Ok),
        Some(Err(e)) => Err(e.duplicate()),
    }
}

/// Wait for an operation: `timeout_us` microseconds at most (< 0: as long as it takes). Returns
/// `TERAIO_OK` when it succeeded, `TERAIO_PENDING` when the timeout passed first (wait again
/// later), or the operation's error. A prefetch's bytes are in its destination once this
/// returns `TERAIO_OK`. Waiting again returns the same status.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_wait(op: *mut teraio_op, timeout_us: i64) -> teraio_status {
    guard("teraio_wait", || {
        let entry = OPS.get(op as u64)?;
        let timeout = u64::try_from(timeout_us).ok().map(Duration::from_micros);
        let mut guard = entry.op.lock();
        collect(&entry, &mut guard, timeout)
    })
}

/// Whether an operation finished, without blocking: `TERAIO_PENDING`, `TERAIO_OK`, or the
/// operation's error (its result is collected as by `teraio_wait`).
#[unsafe(no_mangle)]
pub extern "C" fn teraio_poll(op: *mut teraio_op) -> teraio_status {
    guard("teraio_poll", || {
        let entry = OPS.get(op as u64)?;
        // Another thread waiting on it holds the lock: still pending for us.
        let Some(mut guard) = entry.op.try_lock() else { return Ok(Status::Pending) };
        if !guard.is_done() {
            return Ok(Status::Pending);
        }
        collect(&entry, &mut guard, Some(Duration::ZERO))
    })
}

/// The outcome of a finished operation (`TERAIO_OUTCOME_*`): for an offload where the tensor
/// went (SSD, host tier, or cancelled by a later prefetch). `TERAIO_PENDING` while it runs
/// (nothing written), the operation's error if it failed.
///
/// # Safety
/// `out_outcome` is valid for a write of an `int32_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_op_outcome(
    op: *mut teraio_op,
    out_outcome: *mut i32,
) -> teraio_status {
    guard("teraio_op_outcome", || {
        need(out_outcome, "out_outcome")?;
        let entry = OPS.get(op as u64)?;
        let Some(mut guard) = entry.op.try_lock() else { return Ok(Status::Pending) };
        if guard.result().is_none() && !guard.is_done() {
            return Ok(Status::Pending);
        }
        collect(&entry, &mut guard, Some(Duration::ZERO))?;
        let code = match guard.result() {
            Some(Ok(Outcome::Offloaded(OffloadOutcome::OnSsd))) => TERAIO_OUTCOME_SSD,
            Some(Ok(Outcome::Offloaded(OffloadOutcome::InHost))) => TERAIO_OUTCOME_HOST,
            Some(Ok(Outcome::Offloaded(OffloadOutcome::Cancelled))) => TERAIO_OUTCOME_CANCELLED,
            Some(Ok(Outcome::Prefetched)) => TERAIO_OUTCOME_PREFETCHED,
            Some(Ok(Outcome::Freed)) => TERAIO_OUTCOME_FREED,
            _ => return Ok(Status::Pending),
        };
        // SAFETY: forwarded contract.
        unsafe { put(out_outcome, "out_outcome", code) }?;
        Ok(Status::Ok)
    })
}

/// Free an operation handle. An operation still running is waited for first (a prefetch's
/// bytes are copied into its destination), so once this returns teraio no longer touches the
/// caller's memory. Returns the operation's status (`TERAIO_OK` or its error); the handle is
/// freed in every case except `TERAIO_ERR_INVALID_HANDLE`.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_op_free(op: *mut teraio_op) -> teraio_status {
    guard("teraio_op_free", || {
        let entry = OPS.remove(op as u64)?;
        let mut guard = entry.op.lock();
        collect(&entry, &mut guard, None)
    })
}

// ---------------------------------------------------------------------------------------------
// Engine buffers

/// Allocate `len` bytes of engine host memory (4 KiB aligned, 2 MiB aligned from 2 MiB up;
/// contents undefined) that offloads and prefetches move without a copy. Independent of any
/// engine: it may outlive them.
///
/// # Safety
/// `out_buffer` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_buffer_alloc(
    len: usize,
    out_buffer: *mut *mut teraio_buffer,
) -> teraio_status {
    guard("teraio_buffer_alloc", || {
        need(out_buffer, "out_buffer")?;
        let buf = HostBuffer::new(len as u64)?;
        let id = BUFFERS.insert(buf)?;
        // SAFETY: forwarded contract.
        unsafe { put(out_buffer, "out_buffer", handle(id)) }?;
        Ok(Status::Ok)
    })
}

/// The memory of a buffer: its address (valid until `teraio_buffer_free`) and its length.
/// Either out-pointer may be NULL.
///
/// # Safety
/// `out_data` and `out_len` are NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_buffer_data(
    buffer: *mut teraio_buffer,
    out_data: *mut *mut c_void,
    out_len: *mut usize,
) -> teraio_status {
    guard("teraio_buffer_data", || {
        let buf = BUFFERS.get(buffer as u64)?;
        if !out_data.is_null() {
            // SAFETY: non-null; the caller guarantees validity.
            unsafe { put(out_data, "out_data", buf.addr() as *mut c_void) }?;
        }
        if !out_len.is_null() {
            // SAFETY: non-null; the caller guarantees validity.
            unsafe { put(out_len, "out_len", buf.len()) }?;
        }
        Ok(Status::Ok)
    })
}

/// Free a buffer handle. Its memory stays valid while an operation still uses it and is
/// released after; the caller must not use the address any more.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_buffer_free(buffer: *mut teraio_buffer) -> teraio_status {
    guard("teraio_buffer_free", || {
        BUFFERS.remove(buffer as u64)?;
        Ok(Status::Ok)
    })
}

// ---------------------------------------------------------------------------------------------
// Scheduler

fn trace_into(
    out: *mut *mut teraio_trace,
    f: impl FnOnce() -> core::Result<Trace>,
) -> core::Result<Status> {
    need(out, "out_trace")?;
    let id = TRACES.insert(f()?)?;
    // SAFETY: `out` checked non-null; the caller guarantees it is valid for a write.
    unsafe { put(out, "out_trace", handle(id)) }?;
    Ok(Status::Ok)
}

/// Load a trace from a JSON file (docs/TRACE.md) or generate one from a spec
/// `preset:NAME[,KEY=VALUE...]` (e.g. `preset:gpt2-small,layers=2`).
///
/// # Safety
/// `path_or_spec` is a NUL-terminated string; `out_trace` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_trace_load(
    path_or_spec: *const c_char,
    out_trace: *mut *mut teraio_trace,
) -> teraio_status {
    guard("teraio_trace_load", || {
        // SAFETY: forwarded contract.
        let spec = unsafe { arg_str(path_or_spec, "path_or_spec") }?;
        trace_into(out_trace, || core::sched::load_trace(spec))
    })
}

/// A trace from its JSON text.
///
/// # Safety
/// `json` is a NUL-terminated string; `out_trace` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_trace_from_json(
    json: *const c_char,
    out_trace: *mut *mut teraio_trace,
) -> teraio_status {
    guard("teraio_trace_from_json", || {
        // SAFETY: forwarded contract.
        let text = unsafe { arg_str(json, "json") }?;
        trace_into(out_trace, || core::sched::trace_from_json(text))
    })
}

/// What a trace is, as JSON: `{"name", "kernel_count", "tensor_count", "iteration_time_us",
/// "peak_resident_bytes"}`.
///
/// # Safety
/// `out_json` is valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_trace_info(
    trace: *mut teraio_trace,
    out_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_trace_info", || {
        need(out_json, "out_json")?;
        let t = TRACES.get(trace as u64)?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_json, "out_json", core::sched::trace_json(&t).to_string()) }?;
        Ok(Status::Ok)
    })
}

/// Free a trace handle.
#[unsafe(no_mangle)]
pub extern "C" fn teraio_trace_free(trace: *mut teraio_trace) -> teraio_status {
    guard("teraio_trace_free", || {
        TRACES.remove(trace as u64)?;
        Ok(Status::Ok)
    })
}

/// # Safety
/// `hardware` is NULL or a NUL-terminated string.
unsafe fn hardware_arg(hardware: *const c_char) -> core::Result<teraio_scheduler::Hardware> {
    // SAFETY: forwarded contract.
    let text = unsafe { opt_str(hardware, "hardware") }?.unwrap_or("paper");
    core::sched::hardware(text, None)
}

/// Plan `trace` with `policy` (`teraio`, `teraio-hybrid`, `g10`, `zero-infinity`, `lru`,
/// `ideal`, `none`, ...) on `hardware` (NULL: `paper`; a preset name, `paper` or `dev`, or a
/// JSON object of the scheduler's `Hardware`). The plan as JSON (what `teraio plan --json`
/// writes).
///
/// # Safety
/// `policy` is a NUL-terminated string, `hardware` NULL or one; `out_plan_json` is valid for
/// a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_plan(
    trace: *mut teraio_trace,
    policy: *const c_char,
    hardware: *const c_char,
    out_plan_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_plan", || {
        need(out_plan_json, "out_plan_json")?;
        let t = TRACES.get(trace as u64)?;
        // SAFETY: forwarded contract.
        let policy = core::sched::policy(unsafe { arg_str(policy, "policy") }?)?;
        // SAFETY: forwarded contract.
        let hw = unsafe { hardware_arg(hardware) }?;
        let plan = core::sched::plan(&t, &hw, policy)?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_plan_json, "out_plan_json", plan.to_json()) }?;
        Ok(Status::Ok)
    })
}

/// Plan selection, the rules `teraio plan` and teraio.torch use (the scheduler's
/// `select::choose`): `options_json` NULL or a JSON object of `policy` (default `auto`),
/// `gpu_budget_bytes` (default: the hardware model's GPU memory), `allowance`
/// (`{"kind": "fixed", "keep_fraction": F}` or `{"kind": "measured", "bytes": N}`),
/// `reserved_bytes`, `plan_margin`, `traffic_margin` (the second plan for slower transfers; 0:
/// none), `paging_fallback` (default: with `auto`), `wear_tolerance`, `recompute`; an unknown key
/// is `TERAIO_ERR_INVALID_ARGUMENT` naming it. On success the plan (JSON, as `teraio_plan`
/// writes it) and the selection (JSON: `choice`, `why`, `budgets` with the `executor_bytes` to
/// run it with, `alternatives`, `traffic`); a kernel that can never fit and a plan that does not
/// run are `TERAIO_ERR_SIMULATION` (as `teraio_simulate` reports an out-of-memory) with the
/// message naming the kernel and the bytes.
///
/// # Safety
/// `hardware` and `options_json` are NULL or NUL-terminated strings; `out_plan_json` and
/// `out_selection_json` are valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_select(
    trace: *mut teraio_trace,
    hardware: *const c_char,
    options_json: *const c_char,
    out_plan_json: *mut *mut c_char,
    out_selection_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_select", || {
        need(out_plan_json, "out_plan_json")?;
        need(out_selection_json, "out_selection_json")?;
        let t = TRACES.get(trace as u64)?;
        // SAFETY: forwarded contract.
        let hw = unsafe { hardware_arg(hardware) }?;
        // SAFETY: forwarded contract.
        let options = unsafe { opt_str(options_json, "options_json") }?.unwrap_or("{}");
        let request = core::sched::SelectRequest::from_json(options)?;
        let (plan, selection) = core::sched::select(&t, &hw, &request)?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_plan_json, "out_plan_json", plan.to_json()) }?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_selection_json, "out_selection_json", selection.to_string()) }?;
        Ok(Status::Ok)
    })
}

/// Which of the trace's layers to checkpoint (their forward run again in backward, as
/// `torch.utils.checkpoint` does) so that the plan `teraio_select` makes of the rest, with the
/// same `options_json`, simulates fastest on `hardware` (the scheduler's
/// `checkpoint::choose_layers`; teraio.torch's `checkpoint_layers="auto"`, `teraio simulate
/// --checkpoint-layers auto`): no layer, `k` layers spread evenly for each `k`, then each layer
/// toggled from the best. `options_json` as `teraio_select` takes it (`traffic_margin` is not
/// used: one plan per layer set); an unknown key is `TERAIO_ERR_INVALID_ARGUMENT` naming it.
/// On success the choice as JSON: `layers` (ascending; empty unless checkpointing simulates at
/// least 2% faster), `iteration_time_us` and `without_us` (the simulated iteration with those
/// layers and without checkpointing; null where no plan ran), `tried` (every layer set planned:
/// `layers`, `iteration_time_us`, and `refused` naming why no plan ran, e.g. a kernel that never
/// fits the budget, which is not an error here) and `why` (a sentence). A trace without a
/// backward kernel (a name starting with `bwd.`, holding `.bwd.` or ending in `.bwd`) or whose
/// kernels name no layer (`Kernel::layer`) is `TERAIO_ERR_INVALID_ARGUMENT` with the message
/// naming the trace and what it lacks; an unknown `policy` is `TERAIO_ERR_INVALID_ARGUMENT`.
///
/// # Safety
/// `hardware` and `options_json` are NULL or NUL-terminated strings; `out_choice_json` is
/// valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_choose_checkpoint(
    trace: *mut teraio_trace,
    hardware: *const c_char,
    options_json: *const c_char,
    out_choice_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_choose_checkpoint", || {
        need(out_choice_json, "out_choice_json")?;
        let t = TRACES.get(trace as u64)?;
        // SAFETY: forwarded contract.
        let hw = unsafe { hardware_arg(hardware) }?;
        // SAFETY: forwarded contract.
        let options = unsafe { opt_str(options_json, "options_json") }?.unwrap_or("{}");
        let request = core::sched::SelectRequest::from_json(options)?;
        let choice = core::sched::choose_checkpoint(&t, &hw, &request)?;
        // SAFETY: forwarded contract.
        unsafe { put_string(out_choice_json, "out_choice_json", choice.to_string()) }?;
        Ok(Status::Ok)
    })
}

/// Simulate a plan (JSON, as `teraio_plan` returns it) of `trace` on `hardware` for
/// `iterations` (1 to 1000, else `TERAIO_ERR_INVALID_ARGUMENT` at once; the last is reported).
/// The report as JSON (the simulator's `SimReport`:
/// `iteration_time_us`, `percent_of_ideal`, `stall_us`, `peak_gpu_bytes`, ...).
///
/// # Safety
/// `plan_json` is a NUL-terminated string, `hardware` NULL or one; `out_report_json` is valid
/// for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_simulate(
    trace: *mut teraio_trace,
    plan_json: *const c_char,
    hardware: *const c_char,
    iterations: u32,
    out_report_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_simulate", || {
        need(out_report_json, "out_report_json")?;
        let t = TRACES.get(trace as u64)?;
        // SAFETY: forwarded contract.
        let plan = core::sched::plan_from_json(&t, unsafe { arg_str(plan_json, "plan_json") }?)?;
        // SAFETY: forwarded contract.
        let hw = unsafe { hardware_arg(hardware) }?;
        let report = core::sched::simulate(&t, &plan, &hw, iterations as usize, false)?;
        let text = serde_json::to_string(&report).expect("a report serializes");
        // SAFETY: forwarded contract.
        unsafe { put_string(out_report_json, "out_report_json", text) }?;
        Ok(Status::Ok)
    })
}

/// Plan and simulate `trace` with several policies (`policies`: comma-separated names, NULL:
/// all) on `hardware`. A JSON array of `{"policy", "plan_time_s", "plan_stats", "report"}`.
///
/// # Safety
/// `policies` and `hardware` are NULL or NUL-terminated strings; `out_json` is valid for a
/// write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn teraio_compare_policies(
    trace: *mut teraio_trace,
    policies: *const c_char,
    hardware: *const c_char,
    out_json: *mut *mut c_char,
) -> teraio_status {
    guard("teraio_compare_policies", || {
        need(out_json, "out_json")?;
        let t = TRACES.get(trace as u64)?;
        // SAFETY: forwarded contract.
        let names = unsafe { opt_str(policies, "policies") }?;
        let policies = names
            .map(|n| {
                n.split(',')
                    .map(|p| core::sched::policy(p.trim()))
                    .collect::<core::Result<Vec<_>>>()
            })
            .transpose()?
            .unwrap_or_default();
        // SAFETY: forwarded contract.
        let hw = unsafe { hardware_arg(hardware) }?;
        let results = core::sched::compare(&t, &hw, &policies)?;
        let text = serde_json::to_string(&results).expect("results serialize");
        // SAFETY: forwarded contract.
        unsafe { put_string(out_json, "out_json", text) }?;
        Ok(Status::Ok)
    })
}
