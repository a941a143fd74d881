//! A seeded random fuzzer over the C ABI's argument space, in-process through the `extern "C"`
//! functions: every one of the 62 exported functions, called in random order with live, stale
//! (closed, freed), wrong-kind, NULL and made-up handles; NULL, valid and misaligned pointers;
//! lengths from 0 to `SIZE_MAX`; valid and mangled configurations, traces, plans, hardware and
//! policy names. The contract it checks: every call returns a known status and never
//! `TERAIO_ERR_INTERNAL` (a panic caught at the boundary), a failing call leaves a message, a
//! successful one writes its out-parameter, and no call runs longer than
//! [`HANG_S`] seconds (a watchdog aborts the process with the seed and the last calls).
//!
//! Pointers it passes are valid for what the contract asks (a length that exceeds the memory
//! behind a pointer is only ever one the engine must refuse before touching it: larger than
//! its host buffers, or than `isize::MAX`), so a crash is a bug too.
//!
//! CI runs it for [`DEFAULT_SECS`] seconds; a long run:
//! `TERAIO_ABI_FUZZ_SECS=3600 TERAIO_ABI_FUZZ_SEED=7 nice -n 19 cargo test --release -p teraio-capi
//! --test fuzz_abi -- --nocapture` (docs/BENCHMARKS.md). A failure prints the seed and the calls
//! that led to it; the same seed replays the same calls.

use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, CString, c_char, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use teraio::*;

/// Seconds of fuzzing when `TERAIO_ABI_FUZZ_SECS` is not set (CI).
const DEFAULT_SECS: u64 = 5;
/// A call running longer than this is a hang.
const HANG_S: u64 = 120;
/// Bytes of the memory offloads read from and prefetches write to.
const SCRATCH: usize = 1 << 20;
/// The engines' host buffer bound: lengths above it (and above `SCRATCH`) are refused before
/// any memory is touched.
const HOST_BUFFERS: usize = 64 << 20;

/// Floats of the memory the host optimizer's steps run over.
const OPTIM_FLOATS: usize = 4096;

/// xorshift64*: small, seeded, reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len() as u64) as usize]
    }
}

/// The calls made so far (the last ones are printed on a failure).
struct Log {
    seed: u64,
    last: VecDeque<String>,
}

static CALL_STARTED_MS: AtomicU64 = AtomicU64::new(0);
/// Panics that were not caught at the boundary (engine threads).
static OTHER_PANICS: AtomicU64 = AtomicU64::new(0);

struct Fuzz {
    rng: Rng,
    log: Arc<Mutex<Log>>,
    start: Instant,
    dir: tempfile::TempDir,
    engines: Vec<*mut teraio_engine>,
    ops: Vec<*mut teraio_op>,
    buffers: Vec<*mut teraio_buffer>,
    traces: Vec<*mut teraio_trace>,
    executors: Vec<*mut teraio_executor>,
    strings: Vec<*mut c_char>,
    /// Handles closed or freed, of every kind.
    stale: Vec<u64>,
    /// Plans (JSON) made, and the trace each was made for.
    plans: Vec<(CString, *mut teraio_trace)>,
    /// Traces made from the fuzzer's own JSON: kernel count and the global tensors (id, bytes).
    shapes: HashMap<u64, (usize, Vec<(u32, u64)>)>,
    /// The shape of the last JSON trace text made.
    last_shape: (usize, Vec<(u32, u64)>),
    scratch: Vec<u8>,
    /// Tensors offloaded: (id, bytes), so prefetches often ask for the right size.
    known: Vec<(u64, usize)>,
    /// Prefetch destinations: they live as long as the fuzzer (an op may outlive any call).
    dsts: Vec<Box<[u8]>>,
    /// Memory handed to executors (attach, the allocator): lives as long as the fuzzer.
    arena: &'static mut [u8],
    /// The host optimizer's buffers (float32).
    floats: Vec<f32>,
    stats: HashMap<&'static str, [u64; 3]>,
    calls: u64,
    /// Print every call before it is made (`TERAIO_ABI_FUZZ_VERBOSE=1`).
    verbose: bool,
}

/// What the fuzz allocator hands out: pieces of a leaked arena, or NULL.
struct AllocCtx {
    base: usize,
    len: usize,
    next: AtomicU64,
}

unsafe extern "C" fn fuzz_alloc(ctx: *mut c_void, _t: u32, bytes: u64, _why: i32) -> *mut c_void {
    // SAFETY: ctx is the leaked AllocCtx the fuzzer registered.
    let c = unsafe { &*(ctx as *const AllocCtx) };
    let n = c.next.fetch_add(1, Ordering::Relaxed);
    if bytes as usize > c.len || n % 17 == 16 {
        return null_mut();
    }
    // The pieces overlap (the bytes are never checked): any offset that leaves `bytes` inside.
    let off = (n as usize * 4096) % (c.len - bytes as usize + 1);
    (c.base + (off & !63)) as *mut c_void
}

unsafe extern "C" fn fuzz_release(_ctx: *mut c_void, _t: u32, _p: *mut c_void, _len: u64) {}

fn cs(s: &str) -> CString {
    CString::new(s.replace('\0', " ")).unwrap()
}

impl Fuzz {
    fn new(seed: u64) -> Fuzz {
        let arena = Box::leak(vec![0u8; 8 << 20].into_boxed_slice());
        Fuzz {
            rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            log: Arc::new(Mutex::new(Log { seed, last: VecDeque::new() })),
            start: Instant::now(),
            dir: tempfile::tempdir().unwrap(),
            engines: Vec::new(),
            ops: Vec::new(),
            buffers: Vec::new(),
            traces: Vec::new(),
            executors: Vec::new(),
            strings: Vec::new(),
            stale: Vec::new(),
            plans: Vec::new(),
            shapes: HashMap::new(),
            last_shape: (0, Vec::new()),
            known: Vec::new(),
            scratch: (0..SCRATCH).map(|i| i as u8).collect(),
            dsts: (0..4).map(|_| vec![0u8; SCRATCH].into_boxed_slice()).collect(),
            arena,
            floats: vec![0.5; OPTIM_FLOATS],
            stats: HashMap::new(),
            calls: 0,
            verbose: std::env::var_os("TERAIO_ABI_FUZZ_VERBOSE").is_some(),
        }
    }

    /// Record the call about to be made (for the watchdog and a failure's report).
    fn begin(&mut self, what: String) {
        if self.verbose {
            eprintln!("{} {}", self.calls, &what[..what.len().min(300)]);
        }
        let mut log = self.log.lock().unwrap();
        if log.last.len() == 64 {
            log.last.pop_front();
        }
        log.last.push_back(what);
        drop(log);
        CALL_STARTED_MS.store(self.start.elapsed().as_millis() as u64 + 1, Ordering::SeqCst);
    }

    /// Check a call's status; count it.
    #[track_caller]
    fn end(&mut self, name: &'static str, s: teraio_status) -> teraio_status {
        CALL_STARTED_MS.store(0, Ordering::SeqCst);
        self.calls += 1;
        let e = self.stats.entry(name).or_default();
        e[if s == TERAIO_OK {
            0
        } else if s == TERAIO_PENDING {
            1
        } else {
            2
        }] += 1;
        let known = s == TERAIO_OK
            || s == TERAIO_PENDING
            // SAFETY: a static string.
            || unsafe { CStr::from_ptr(teraio_status_name(s)) }.to_bytes() != b"UNKNOWN";
        let msg = last_error();
        if !known || s == TERAIO_ERR_INTERNAL || (s < 0 && msg.is_empty()) {
            self.fail(&format!("{name} returned {s}: {msg:?}"));
        }
        s
    }

    fn fail(&self, what: &str) -> ! {
        let log = self.log.lock().unwrap();
        let calls: Vec<&String> = log.last.iter().collect();
        panic!("C ABI fuzz failure (seed {}): {what}\nlast calls:\n{calls:#?}", log.seed);
    }

    // --- argument generators ------------------------------------------------------------

    /// A handle of kind `live`: mostly a live one, else stale, NULL, made up or another kind's.
    fn handle<T>(&mut self, live: &[*mut T]) -> *mut T {
        match self.rng.below(100) {
            0..70 if !live.is_empty() => *self.rng.pick(live),
            0..80 if !self.stale.is_empty() => *self.rng.pick(&self.stale) as usize as *mut T,
            80..85 => null_mut(),
            85..90 => self.rng.next() as usize as *mut T,
            _ => {
                let mut all: Vec<u64> = Vec::new();
                all.extend(self.engines.iter().map(|&h| h as u64));
                all.extend(self.ops.iter().map(|&h| h as u64));
                all.extend(self.buffers.iter().map(|&h| h as u64));
                all.extend(self.traces.iter().map(|&h| h as u64));
                all.extend(self.executors.iter().map(|&h| h as u64));
                if all.is_empty() { null_mut() } else { *self.rng.pick(&all) as usize as *mut T }
            }
        }
    }

    /// A length for memory of `have` bytes: within it, or one the engine must refuse untouched.
    fn len(&mut self, have: usize) -> usize {
        match self.rng.below(12) {
            0 => 0,
            1 => 1,
            2 => have,
            3..=6 => self.rng.below(have as u64 + 1) as usize,
            7 => usize::MAX,
            8 => isize::MAX as usize,
            9 => isize::MAX as usize + 1,
            10 => HOST_BUFFERS + 1 + self.rng.below(1 << 40) as usize,
            _ => usize::MAX - self.rng.below(1 << 22) as usize,
        }
    }

    fn tensor_id(&mut self) -> u64 {
        match self.rng.below(10) {
            0 => u64::MAX,
            1 => self.rng.next(),
            _ => self.rng.below(16),
        }
    }

    fn kernel(&mut self) -> usize {
        match self.rng.below(10) {
            0 => usize::MAX,
            1 => self.rng.next() as usize,
            2 => self.rng.below(64) as usize,
            _ => self.rng.below(8) as usize,
        }
    }

    fn small_i32(&mut self) -> i32 {
        match self.rng.below(16) {
            0 => i32::MIN,
            1 => i32::MAX,
            2 => -1,
            3..=5 => self.rng.below(4) as i32,
            _ => self.rng.below(2) as i32,
        }
    }

    /// An optional string: NULL, valid, empty, long, invalid UTF-8 or from `choices`.
    fn string(&mut self, choices: &[&str]) -> Option<CString> {
        match self.rng.below(12) {
            0 => None,
            1 => Some(CString::default()),
            2 => Some(CString::new(vec![0xff, 0xfe, b'x']).unwrap()),
            3 => Some(cs(&"n".repeat(1 + self.rng.below(1 << 16) as usize))),
            4 => Some(cs(&format!("t{}", self.rng.below(8)))),
            _ if !choices.is_empty() => Some(cs(self.rng.pick::<&str>(choices))),
            _ => Some(cs("x")),
        }
    }

    fn config(&mut self) -> (CString, bool) {
        let json = self.rng.chance(30);
        let d = self.dir.path().join(format!("e{}", self.rng.below(4)));
        let mut kv: Vec<(String, String)> = vec![
            ("dir".into(), format!("{:?}", d.display().to_string())),
            ("files".into(), (1 + self.rng.below(3)).to_string()),
            ("file_size".into(), format!("\"{}M\"", 8 << self.rng.below(3))),
            ("workers".into(), (1 + self.rng.below(3)).to_string()),
            ("persistent".into(), self.rng.chance(50).to_string()),
            ("host_buffers".into(), format!("\"{}M\"", HOST_BUFFERS >> 20)),
        ];
        if self.rng.chance(30) {
            kv.push(("host_tier".into(), "\"16M\"".into()));
        }
        if self.rng.chance(20) {
            kv.push(("backend".into(), (*self.rng.pick(&["\"psync\"", "\"uring\""])).into()));
        }
        // Mangle: junk values, never of `dir` (files would go to the current directory) or
        // `host_buffers` (the lengths the fuzzer passes beyond its memory rely on the bound), and
        // never a missing size (a default engine preallocates GiBs).
        let junk = [
            "-1",
            "\"1E\"",
            "\"99999999999999999999T\"",
            "[]",
            "\"\"",
            "true",
            "0",
            "18446744073709551615",
            "\"0M\"",
            "{}",
            "1e308",
        ];
        for _ in 0..if self.rng.chance(30) { 1 + self.rng.below(2) } else { 0 } {
            if self.rng.chance(40) {
                let i = 1 + self.rng.below(kv.len() as u64 - 1) as usize;
                if kv[i].0 != "host_buffers" {
                    kv[i].1 = (*self.rng.pick(&junk)).into();
                }
            } else if self.rng.chance(50) {
                kv.push((format!("unknown_{}", self.rng.below(3)), "1".into()));
            }
        }
        let text = if json {
            let body: Vec<String> = kv.iter().map(|(k, v)| format!("{k:?}: {v}")).collect();
            format!("{{{}}}", body.join(", "))
        } else {
            kv.iter().map(|(k, v)| format!("{k} = {v}\n")).collect()
        };
        (cs(&text), json)
    }

    /// A trace spec or JSON text: small presets, small JSON traces, mangled ones.
    fn trace_json(&mut self) -> String {
        let n = 1 + self.rng.below(6) as usize;
        let dur = *self.rng.pick(&["100", "0", "1e308", "-1", "1e12", "\"x\""]);
        let bytes =
            *self.rng.pick(&["65536", "4611686018427387904", "0", "1", "18446744073709551615"]);
        let kernels: Vec<String> = (0..n)
            .map(|i| {
                let d = if i == 0 && self.rng.chance(30) { dur } else { "100" };
                format!("{{\"name\": \"k{i}\", \"duration_us\": {d}}}")
            })
            .collect();
        let tensors: Vec<String> = (0..n)
            .map(|i| {
                let last = (i + 1).min(n - 1);
                let acc = if last == i { format!("[{i}]") } else { format!("[{i}, {last}]") };
                let b = if self.rng.chance(15) { bytes } else { "65536" };
                format!(
                    "{{\"id\": {i}, \"name\": \"a{i}\", \"bytes\": {b}, \"kind\": \"activation\", \
                     \"global\": false, \"created_by\": {i}, \"accesses\": {acc}, \
                     \"dies_after\": {last}, \"writes\": [{i}]}}"
                )
            })
            .collect();
        self.last_shape = (n, Vec::new());
        let globals = if self.rng.chance(50) {
            self.last_shape.1.push((n as u32, 131072));
            format!(
                ", {{\"id\": {n}, \"name\": \"w\", \"bytes\": 131072, \"kind\": \"weight\", \
                 \"global\": true, \"created_by\": null, \"accesses\": [0], \"dies_after\": null, \
                 \"writes\": []}}"
            )
        } else {
            String::new()
        };
        let mut text = format!(
            "{{\"format\": \"teraio-trace\", \"version\": 1, \"name\": \"f\", \"kernels\": [{}], \
             \"tensors\": [{}{globals}]}}",
            kernels.join(","),
            tensors.join(",")
        );
        if self.rng.chance(10) {
            text.insert(0, '\u{feff}');
        }
        if self.rng.chance(10) {
            let mut cut = self.rng.below(text.len() as u64) as usize;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
        }
        text
    }

    /// An out-pointer: valid (usually), NULL, or misaligned.
    fn out<T>(&mut self, slot: &mut [u8; 64]) -> *mut T {
        match self.rng.below(10) {
            0 => null_mut(),
            1 => slot.as_mut_ptr().wrapping_add(1).cast(),
            _ => slot.as_mut_ptr().wrapping_add(8 - (slot.as_ptr() as usize % 8)).cast(),
        }
    }

    // --- the calls ----------------------------------------------------------------------

    fn step(&mut self) {
        let mut slot = [0u8; 64];
        match self.rng.below(62) {
            0 => {
                self.begin("open_toml/json".into());
                let (cfg, json) = self.config();
                let out: *mut *mut teraio_engine = self.out(&mut slot);
                let s = if self.engines.len() >= 3 {
                    return;
                } else if json {
                    // SAFETY: valid string; out NULL, or valid for a (possibly misaligned) write.
                    unsafe { teraio_engine_open_json(cfg.as_ptr(), out) }
                } else {
                    // SAFETY: as above.
                    unsafe { teraio_engine_open_toml(cfg.as_ptr(), out) }
                };
                self.end("engine_open", s);
                if s == TERAIO_OK {
                    // SAFETY: written on success.
                    let e = unsafe { out.read_unaligned() };
                    if e.is_null() {
                        self.fail("engine_open OK with a NULL engine");
                    }
                    self.engines.push(e);
                }
            }
            1 => {
                // A configuration file of the fuzzer's (an empty one, /dev/null, would open the
                // defaults: GiBs of files and of host buffers, beyond what the lengths assume).
                let file = self.dir.path().join("engine.toml");
                if !file.exists() {
                    let (cfg, json) = self.config();
                    if json {
                        return;
                    }
                    std::fs::write(&file, cfg.as_bytes()).unwrap();
                }
                let file = file.display().to_string();
                let path = self.string(&[&file, &file, "/nonexistent.toml", "/"]);
                let over = self.string(&["{\"files\": 1}", "[1]", "{"]);
                self.begin(format!("open_file {path:?} {over:?}"));
                let mut e = null_mut();
                if self.engines.len() >= 3 {
                    return;
                }
                // SAFETY: NULL or valid strings; valid out.
                let s = unsafe {
                    teraio_engine_open_file(
                        path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                        over.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
                        &mut e,
                    )
                };
                self.end("engine_open_file", s);
                if s == TERAIO_OK {
                    self.engines.push(e);
                }
            }
            2 => {
                let e = self.handle(&self.engines.clone());
                self.begin(format!("engine_close {e:p}"));
                let s = self.end("engine_close", teraio_engine_close(e));
                if let Some(i) = self.engines.iter().position(|&x| x == e) {
                    if s != TERAIO_OK && s != TERAIO_ERR_IO {
                        self.fail(&format!("closing a live engine gave {s}"));
                    }
                    self.engines.swap_remove(i);
                    self.stale.push(e as u64);
                }
            }
            3..=6 => {
                let e = self.handle(&self.engines.clone());
                let which = self.rng.below(5);
                // (the hardware probe never touches the cache: nothing left on disk)
                let flags = TERAIO_HW_NO_CACHE | if self.rng.chance(20) { 4 } else { 0 };
                self.begin(format!(
                    "engine_info/stats/tensors/lookup/measure {which} {e:p} {flags}"
                ));
                let out: *mut *mut c_char = self.out(&mut slot);
                // SAFETY: out NULL or valid.
                let (name, s) = unsafe {
                    match which {
                        0 => ("engine_info", teraio_engine_info(e, out)),
                        1 => ("engine_stats", teraio_engine_stats(e, out)),
                        2 => ("list_tensors", teraio_list_tensors(e, out)),
                        3 => ("measure_hardware", teraio_engine_measure_hardware(e, flags, out)),
                        _ => {
                            let n = self.string(&["t1", "t2"]);
                            let o: *mut u64 = self.out(&mut slot);
                            let p = n.as_ref().map_or(std::ptr::null(), |n| n.as_ptr());
                            ("lookup", teraio_lookup(e, p, o))
                        }
                    }
                };
                self.end(name, s);
                if s == TERAIO_OK && which < 4 {
                    // SAFETY: written on success.
                    self.strings.push(unsafe { out.read_unaligned() });
                }
            }
            7 => {
                let e = self.handle(&self.engines.clone());
                let which = self.rng.chance(50);
                self.begin(format!("engine_drain/checkpoint {which} {e:p}"));
                let s = if which { teraio_engine_drain(e) } else { teraio_engine_checkpoint(e) };
                self.end("engine_drain_checkpoint", s);
            }
            8..=14 => self.offload(&mut slot),
            15..=18 => self.prefetch(&mut slot),
            19 => {
                let e = self.handle(&self.engines.clone());
                let (id, ptr, len) = (self.tensor_id(), self.rng.next(), self.rng.next());
                let which = self.rng.chance(50);
                self.begin(format!("offload/prefetch_device {which} {e:p} {id} {ptr:#x} {len}"));
                let mut op = null_mut();
                // SAFETY: no engine of the fuzzer has a GPU: the pointer is refused unread.
                let s = unsafe {
                    if which {
                        teraio_offload_device(e, id, ptr, len, 0, std::ptr::null(), 0, 1, &mut op)
                    } else {
                        teraio_prefetch_device(e, id, ptr, len, 0, 1, &mut op)
                    }
                };
                self.end("device", s);
                if s == TERAIO_OK {
                    self.fail("a device pointer was accepted by an engine without a GPU");
                }
            }
            20..=22 => {
                let e = self.handle(&self.engines.clone());
                let b = self.handle(&self.buffers.clone());
                let id = self.tensor_id();
                let which = self.rng.chance(50);
                let (d, p) = (self.small_i32(), self.small_i32());
                self.begin(format!("offload/prefetch_buffer {which} {e:p} {id} {b:p} {d} {p}"));
                let mut op = null_mut();
                // SAFETY: valid out.
                let s = unsafe {
                    if which {
                        teraio_offload_buffer(e, id, b, std::ptr::null(), d, p, &mut op)
                    } else {
                        teraio_prefetch_buffer(e, id, b, p, &mut op)
                    }
                };
                self.end("buffer_op", s);
                if s == TERAIO_OK {
                    self.ops.push(op);
                }
            }
            23 => {
                let e = self.handle(&self.engines.clone());
                let id = self.tensor_id();
                self.begin(format!("free_tensor {e:p} {id}"));
                let out: *mut *mut teraio_op = self.out(&mut slot);
                // SAFETY: out NULL or valid.
                let s = unsafe { teraio_free_tensor(e, id, out) };
                self.end("free_tensor", s);
                if s == TERAIO_OK {
                    // SAFETY: written on success.
                    self.ops.push(unsafe { out.read_unaligned() });
                }
            }
            24..=27 => {
                let op = self.handle(&self.ops.clone());
                let which = self.rng.below(4);
                let t = *self.rng.pick(&[-1i64, 0, 1000, i64::MIN, i64::MAX, 50_000]);
                self.begin(format!("wait/poll/outcome/free {which} {op:p} {t}"));
                let (name, s) = match which {
                    0 => ("wait", teraio_wait(op, t)),
                    1 => ("poll", teraio_poll(op)),
                    2 => {
                        let o: *mut i32 = self.out(&mut slot);
                        // SAFETY: out NULL or valid.
                        ("op_outcome", unsafe { teraio_op_outcome(op, o) })
                    }
                    _ => ("op_free", teraio_op_free(op)),
                };
                self.end(name, s);
                if which == 3
                    && s != TERAIO_ERR_INVALID_HANDLE
                    && let Some(i) = self.ops.iter().position(|&x| x == op)
                {
                    self.ops.swap_remove(i);
                    self.stale.push(op as u64);
                }
            }
            28..=29 => {
                let len = match self.rng.below(6) {
                    0 => 0,
                    1 => usize::MAX,
                    2 => 1 << 62,
                    3 => isize::MAX as usize + 1,
                    _ => 1 + self.rng.below(4 << 20) as usize,
                };
                self.begin(format!("buffer_alloc {len}"));
                let out: *mut *mut teraio_buffer = self.out(&mut slot);
                if self.buffers.len() >= 8 {
                    return;
                }
                // SAFETY: out NULL or valid.
                let s = unsafe { teraio_buffer_alloc(len, out) };
                self.end("buffer_alloc", s);
                if s == TERAIO_OK {
                    // SAFETY: written on success.
                    self.buffers.push(unsafe { out.read_unaligned() });
                }
            }
            30 => {
                let b = self.handle(&self.buffers.clone());
                self.begin(format!("buffer_data {b:p}"));
                let mut slot2 = [0u8; 64];
                let d: *mut *mut c_void = self.out(&mut slot);
                let l: *mut usize = self.out(&mut slot2);
                // SAFETY: outs NULL or valid.
                self.end("buffer_data", unsafe { teraio_buffer_data(b, d, l) });
            }
            31 => {
                let b = self.handle(&self.buffers.clone());
                self.begin(format!("buffer_free {b:p}"));
                let s = self.end("buffer_free", teraio_buffer_free(b));
                if s == TERAIO_OK
                    && let Some(i) = self.buffers.iter().position(|&x| x == b)
                {
                    self.buffers.swap_remove(i);
                    self.stale.push(b as u64);
                }
            }
            32..=33 => {
                let which = self.rng.below(3);
                let text = match which {
                    0 => format!(
                        "preset:gpt2-small,layers={},hidden=64,heads=2,kv-heads=2,ffn=128,vocab=100,seq=16,micro-batch=1",
                        *self.rng.pick(&["1", "2", "0", "4294967295", "x"])
                    ),
                    1 => (*self.rng.pick(&[
                        "/nonexistent.json",
                        "/",
                        "preset:nope",
                        "preset:gpt2-small,layers=99999999",
                        "preset:",
                    ]))
                    .to_string(),
                    _ => self.trace_json(),
                };
                self.begin(format!("trace_load/from_json {}", &text[..text.len().min(200)]));
                let out: *mut *mut teraio_trace = self.out(&mut slot);
                if self.traces.len() >= 6 {
                    return;
                }
                let c = cs(&text);
                // SAFETY: valid string; out NULL or valid.
                let s = unsafe {
                    if which == 2 {
                        teraio_trace_from_json(c.as_ptr(), out)
                    } else {
                        teraio_trace_load(c.as_ptr(), out)
                    }
                };
                self.end("trace_load", s);
                if s == TERAIO_OK {
                    // SAFETY: written on success.
                    let t = unsafe { out.read_unaligned() };
                    self.traces.push(t);
                    if which == 2 {
                        self.shapes.insert(t as u64, self.last_shape.clone());
                    }
                }
            }
            34 => {
                let t = self.handle(&self.traces.clone());
                self.begin(format!("trace_info {t:p}"));
                let out: *mut *mut c_char = self.out(&mut slot);
                // SAFETY: out NULL or valid.
                let s = self.end("trace_info", unsafe { teraio_trace_info(t, out) });
                if s == TERAIO_OK {
                    // SAFETY: written on success.
                    self.strings.push(unsafe { out.read_unaligned() });
                }
            }
            35 => {
                let t = self.handle(&self.traces.clone());
                self.begin(format!("trace_free {t:p}"));
                let s = self.end("trace_free", teraio_trace_free(t));
                if s == TERAIO_OK
                    && let Some(i) = self.traces.iter().position(|&x| x == t)
                {
                    self.traces.swap_remove(i);
                    self.stale.push(t as u64);
                }
            }
            36..=37 => {
                let t = self.handle(&self.traces.clone());
                let policy = self.string(&[
                    "teraio",
                    "none",
                    "lru",
                    "g10",
                    "zero-infinity",
                    "auto",
                    "ideal",
                ]);
                let hw = self.hardware();
                self.begin(format!("plan {t:p} {policy:?} {hw:?}"));
                let out: *mut *mut c_char = self.out(&mut slot);
                // SAFETY: NULL or valid strings; out NULL or valid.
                let s = unsafe { teraio_plan(t, opt(&policy), opt(&hw), out) };
                self.end("plan", s);
                if s == TERAIO_OK {
                    // SAFETY: written on success; a string teraio returned.
                    let p = unsafe { out.read_unaligned() };
                    // SAFETY: as above.
                    let text = unsafe { CStr::from_ptr(p) }.to_owned();
                    self.plans.push((text, t));
                    if self.plans.len() > 16 {
                        self.plans.remove(0);
                    }
                    self.strings.push(p);
                }
            }
            38 => {
                let t = self.handle(&self.traces.clone());
                let plan = self.plan_text();
                let hw = self.hardware();
                let it = *self.rng.pick(&[0u32, 1, 2, 3, 1000, 1001, u32::MAX]);
                self.begin(format!("simulate {t:p} {hw:?} {it}"));
                let out: *mut *mut c_char = self.out(&mut slot);
                // SAFETY: NULL or valid strings; out NULL or valid.
                let s = unsafe { teraio_simulate(t, opt(&plan), opt(&hw), it, out) };
                self.end("simulate", s);
                if s == TERAIO_OK {
                    // SAFETY: written on success.
                    self.strings.push(unsafe { out.read_unaligned() });
                }
            }
            39 => {
                let t = self.handle(&self.traces.clone());
                let policies = self.string(&["teraio,none", "lru", "none,,x", "teraio, lru"]);
                let hw = self.hardware();
                self.begin(format!("compare {t:p} {policies:?} {hw:?}"));
                let out: *mut *mut c_char = self.out(&mut slot);
                // SAFETY: NULL or valid strings; out NULL or valid.
                let s = unsafe { teraio_compare_policies(t, opt(&policies), opt(&hw), out) };
                self.end("compare_policies", s);
                if s == TERAIO_OK {
                    // SAFETY: written on success.
                    self.strings.push(unsafe { out.read_unaligned() });
                }
            }
            40..=41 => {
                let p = if !self.strings.is_empty() && self.rng.chance(80) {
                    let i = self.rng.below(self.strings.len() as u64) as usize;
                    self.strings.swap_remove(i)
                } else if self.rng.chance(50) {
                    null_mut()
                } else {
                    // A pointer teraio did not return (never dereferenced: it is not registered).
                    self.scratch.as_mut_ptr().cast()
                };
                self.begin(format!("string_free {p:p}"));
                self.end("string_free", teraio_string_free(p));
            }
            42..=43 => self.executor_new(&mut slot),
            44..=47 => self.executor_episode(),
            48..=49 => self.optim_call(),
            60..=61 if self.rng.chance(25) => self.choose_checkpoint_call(&mut slot),
            60..=61 => self.select_call(&mut slot),
            _ => self.executor_call(&mut slot),
        }
        // Misc. static functions now and then.
        if self.rng.chance(3) {
            self.begin("version/abi/status_name/last_error".into());
            // SAFETY: static strings.
            unsafe {
                assert!(!CStr::from_ptr(teraio_version()).to_bytes().is_empty());
                let _ = CStr::from_ptr(teraio_status_name(self.small_i32()));
                let _ = CStr::from_ptr(teraio_last_error_message());
            }
            assert_eq!(teraio_abi_version(), TERAIO_ABI_VERSION);
            self.end("static", TERAIO_OK);
        }
        if self.rng.chance(3) {
            let mut slot2 = [0u8; 64];
            let level: *mut i32 = self.out(&mut slot);
            let msg: *mut *mut c_char = self.out(&mut slot2);
            self.begin(format!("take_notice {level:p} {msg:p}"));
            // SAFETY: valid, NULL or misaligned out-pointers (written unaligned).
            let s = unsafe { teraio_take_notice(level, msg) };
            self.end("take_notice", s);
            if s == TERAIO_OK {
                // SAFETY: written on success (NULL when no notice waited).
                let p = unsafe { msg.read_unaligned() };
                if !p.is_null() {
                    self.strings.push(p);
                }
            }
            let mut slot3 = [0u8; 64];
            let count: *mut u64 = self.out(&mut slot3);
            self.begin(format!("notices_dropped {count:p}"));
            // SAFETY: as above.
            let s = unsafe { teraio_notices_dropped(count) };
            self.end("notices_dropped", s);
        }
    }

    /// `teraio_select`: a trace handle, a hardware model, options valid and mangled (unknown
    /// keys, wrong types, budgets from 0 up), two out-parameters (each NULL, misaligned or
    /// valid).
    fn select_call(&mut self, slot: &mut [u8; 64]) {
        let t = self.handle(&self.traces.clone());
        let hw = self.hardware();
        let options = self.string(SELECT_OPTIONS);
        self.begin(format!("select {t:p} {hw:?} {options:?}"));
        let mut slot2 = [0u8; 64];
        let out_plan: *mut *mut c_char = self.out(slot);
        let out_sel: *mut *mut c_char = self.out(&mut slot2);
        // SAFETY: NULL or valid strings; outs NULL or valid for a (possibly misaligned) write.
        let s = unsafe { teraio_select(t, opt(&hw), opt(&options), out_plan, out_sel) };
        self.end("select", s);
        if s == TERAIO_OK {
            // SAFETY: both written on success; strings teraio returned.
            let (p, q) = unsafe { (out_plan.read_unaligned(), out_sel.read_unaligned()) };
            if p.is_null() || q.is_null() {
                self.fail("select OK with a NULL plan or selection");
            }
            // SAFETY: as above.
            let text = unsafe { CStr::from_ptr(p) }.to_owned();
            self.plans.push((text, t));
            if self.plans.len() > 16 {
                self.plans.remove(0);
            }
            self.strings.push(p);
            self.strings.push(q);
        }
    }

    /// `teraio_choose_checkpoint`: a trace handle (the fuzzer's own JSON traces have neither
    /// backward kernels nor layers, the presets both), a hardware model, options as
    /// `teraio_select` takes them, valid and mangled, an out-parameter (NULL, misaligned or
    /// valid).
    fn choose_checkpoint_call(&mut self, slot: &mut [u8; 64]) {
        let t = self.handle(&self.traces.clone());
        let hw = self.hardware();
        let options = self.string(SELECT_OPTIONS);
        self.begin(format!("choose_checkpoint {t:p} {hw:?} {options:?}"));
        let out: *mut *mut c_char = self.out(slot);
        // SAFETY: NULL or valid strings; out NULL or valid for a (possibly misaligned) write.
        let s = unsafe { teraio_choose_checkpoint(t, opt(&hw), opt(&options), out) };
        self.end("choose_checkpoint", s);
        if s == TERAIO_OK {
            // SAFETY: written on success; a string teraio returned.
            let p = unsafe { out.read_unaligned() };
            if p.is_null() {
                self.fail("choose_checkpoint OK with a NULL choice");
            }
            self.strings.push(p);
        }
    }

    fn hardware(&mut self) -> Option<CString> {
        match self.rng.below(8) {
            0 => None,
            1 => Some(cs("dev")),
            2 => Some(cs("paper")),
            3 => Some(cs("{\"gpu_memory_bytes\": 0}")),
            4 => Some(cs("{\"gpu_memory_bytes\": 1e308}")),
            5 => Some(cs("nope")),
            _ => None,
        }
    }

    fn plan_text(&mut self) -> Option<CString> {
        if !self.plans.is_empty() && self.rng.chance(80) {
            let i = self.rng.below(self.plans.len() as u64) as usize;
            return Some(self.plans[i].0.clone());
        }
        self.string(&["{\"policy\": \"teraio\"}", "{}", "[]"])
    }

    fn offload(&mut self, slot: &mut [u8; 64]) {
        let e = self.handle(&self.engines.clone());
        let id = self.tensor_id();
        let misaligned = self.rng.chance(20);
        let have = SCRATCH - usize::from(misaligned);
        let len = self.len(have);
        let name = self.string(&["t1", "t2", "t3"]);
        let (d, p) = (self.small_i32(), self.small_i32());
        let null_data = self.rng.chance(5);
        self.begin(format!("offload {e:p} {id} len={len} {name:?} {d} {p} null={null_data}"));
        let data: *const c_void = if null_data {
            std::ptr::null()
        } else {
            self.scratch.as_ptr().wrapping_add(usize::from(misaligned)).cast()
        };
        let out: *mut *mut teraio_op = self.out(slot);
        // SAFETY: `data` is valid for `len` bytes, or `len` is one the engine refuses before
        // reading (above its host buffers, or isize::MAX); name NULL or valid; out NULL or valid.
        let s = unsafe { teraio_offload(e, id, data, len, opt(&name), d, p, out) };
        self.end("offload", s);
        if s == TERAIO_OK {
            if len > have {
                self.fail(&format!("an offload of {len} bytes from {have} was accepted"));
            }
            // SAFETY: written on success.
            self.ops.push(unsafe { out.read_unaligned() });
            self.known.push((id, len));
            if self.known.len() > 64 {
                self.known.remove(0);
            }
        }
    }

    fn prefetch(&mut self, slot: &mut [u8; 64]) {
        let e = self.handle(&self.engines.clone());
        let (id, len) = if !self.known.is_empty() && self.rng.chance(60) {
            *self.rng.pick(&self.known)
        } else {
            (self.tensor_id(), self.len(SCRATCH))
        };
        let p = self.small_i32();
        let which = self.rng.below(self.dsts.len() as u64) as usize;
        let null_dst = self.rng.chance(5);
        self.begin(format!("prefetch {e:p} {id} len={len} {p} null={null_dst}"));
        let dst: *mut c_void =
            if null_dst { null_mut() } else { self.dsts[which].as_mut_ptr().cast() };
        let out: *mut *mut teraio_op = self.out(slot);
        // SAFETY: `dst` (which lives as long as the fuzzer) is valid for `len` bytes, or `len`
        // is one the engine refuses; out NULL or valid.
        let s = unsafe { teraio_prefetch(e, id, dst, len, p, out) };
        self.end("prefetch", s);
        if s == TERAIO_OK {
            if len > SCRATCH {
                self.fail(&format!("a prefetch of {len} bytes into {SCRATCH} was accepted"));
            }
            // SAFETY: written on success.
            self.ops.push(unsafe { out.read_unaligned() });
        }
    }

    fn executor_new(&mut self, slot: &mut [u8; 64]) {
        if self.executors.len() >= 4 {
            return;
        }
        let e = self.handle(&self.engines.clone());
        let (plan, t) = if !self.plans.is_empty() && self.rng.chance(85) {
            let (p, t) = self.rng.pick(&self.plans).clone();
            let t = if self.rng.chance(90) { t } else { self.handle(&self.traces.clone()) };
            (Some(p), t)
        } else {
            (self.string(&["{}"]), self.handle(&self.traces.clone()))
        };
        let budget = *self.rng.pick(&[0u64, 1 << 20, 1 << 30, u64::MAX, 300_000]);
        let created = self.rng.chance(50);
        let custom = self.rng.below(3);
        let ctx: &'static AllocCtx = Box::leak(Box::new(AllocCtx {
            base: self.arena.as_mut_ptr() as usize,
            len: self.arena.len(),
            next: AtomicU64::new(0),
        }));
        let a = teraio_allocator {
            ctx: ctx as *const AllocCtx as *mut c_void,
            alloc: if custom == 2 { None } else { Some(fuzz_alloc) },
            release: Some(fuzz_release),
        };
        self.begin(format!(
            "executor_new {e:p} {t:p} budget={budget} created={created} alloc={custom}"
        ));
        let out: *mut *mut teraio_executor = self.out(slot);
        let ap: *const teraio_allocator = if custom == 0 { std::ptr::null() } else { &a };
        // SAFETY: NULL or valid strings and allocator; out NULL or valid.
        let s = unsafe { teraio_executor_new(e, t, opt(&plan), budget, created, ap, out) };
        self.end("executor_new", s);
        if s == TERAIO_OK {
            // SAFETY: written on success.
            self.executors.push(unsafe { out.read_unaligned() });
        }
    }

    /// A hyperparameter: valid, an edge, or out of range.
    fn hyper(&mut self, valid: f64, good: bool) -> f64 {
        if good && self.rng.chance(90) {
            return valid;
        }
        *self.rng.pick(&[
            valid,
            valid,
            valid,
            0.0,
            -1.0,
            1.0,
            0.999_999,
            f64::NAN,
            f64::INFINITY,
            -0.0,
            1e300,
        ])
    }

    /// A float pointer for `len` elements: inside the fuzzer's memory (at a random, possibly
    /// overlapping, place), NULL, or one byte off (misaligned). Lengths past the memory are only
    /// ever ones the library refuses untouched (above `PTRDIFF_MAX / 4`).
    fn float_ptr(&mut self, len: usize) -> *mut f32 {
        let base = self.floats.as_mut_ptr();
        match self.rng.below(20) {
            0 => null_mut(),
            1 => base.cast::<u8>().wrapping_add(1).cast(),
            _ if len > OPTIM_FLOATS => base,
            _ => base.wrapping_add(self.rng.below((OPTIM_FLOATS - len + 1) as u64) as usize),
        }
    }

    fn optim_call(&mut self) {
        let len = match self.rng.below(10) {
            0 => 0,
            1 => usize::MAX - self.rng.below(16) as usize,
            2 => isize::MAX as usize / 4 + 1 + self.rng.below(1 << 20) as usize,
            3 => OPTIM_FLOATS,
            _ => self.rng.below(OPTIM_FLOATS as u64 / 4 + 1) as usize,
        };
        // Half the calls are well formed (five disjoint buffers, flags 0 or 1), so steps run.
        let good = self.rng.chance(50) && len <= OPTIM_FLOATS / 5;
        let ptrs: Vec<*mut f32> = (0..5)
            .map(|i| {
                if good {
                    self.floats.as_mut_ptr().wrapping_add(i * (OPTIM_FLOATS / 5))
                } else {
                    self.float_ptr(len)
                }
            })
            .collect();
        let flag = |f: &mut Self| if good { f.rng.below(2) as i32 } else { f.small_i32() };
        let threads = *self.rng.pick(&[0u32, 1, 2, 3, u32::MAX]);
        let mut slot = [0u8; 128];
        let at = if self.rng.chance(10) { 1 } else { 8 - (slot.as_ptr() as usize % 8) };
        let none = !good && self.rng.chance(5);
        if self.rng.chance(50) {
            let p = teraio_adamw_params {
                lr: self.hyper(1e-3, good),
                beta1: self.hyper(0.9, good),
                beta2: self.hyper(0.999, good),
                eps: self.hyper(1e-8, good),
                weight_decay: self.hyper(0.01, good),
                amsgrad: flag(self),
                maximize: flag(self),
                decoupled_weight_decay: flag(self),
                threads,
            };
            let step = *self.rng.pick(&[0u64, 1, 2, 1000, u64::MAX]);
            let pp: *mut teraio_adamw_params = slot.as_mut_ptr().wrapping_add(at).cast();
            // SAFETY: 128 bytes hold the struct at offset <= 8 (written unaligned).
            unsafe { pp.write_unaligned(p) };
            self.begin(format!("adamw_step {p:?} step {step} len {len} {ptrs:?}"));
            let pp = if none { std::ptr::null() } else { pp.cast_const() };
            // SAFETY: the params are NULL or readable; every pointer is NULL, misaligned (refused
            // unread) or valid for `len` floats in the fuzzer's memory, or `len` is refused.
            let s = unsafe {
                teraio_adamw_step(pp, step, ptrs[0], ptrs[1], ptrs[2], ptrs[3], ptrs[4], len)
            };
            self.end("adamw_step", s);
        } else {
            let p = teraio_sgd_params {
                lr: self.hyper(0.1, good),
                momentum: self.hyper(0.9, good),
                dampening: self.hyper(0.0, good),
                weight_decay: self.hyper(0.0, good),
                nesterov: flag(self),
                maximize: flag(self),
                threads,
            };
            let fresh = flag(self);
            let pp: *mut teraio_sgd_params = slot.as_mut_ptr().wrapping_add(at).cast();
            // SAFETY: as above.
            unsafe { pp.write_unaligned(p) };
            self.begin(format!("sgd_step {p:?} fresh {fresh} len {len} {ptrs:?}"));
            let pp = if none { std::ptr::null() } else { pp.cast_const() };
            // SAFETY: as above.
            let s = unsafe { teraio_sgd_step(pp, ptrs[0], ptrs[1], ptrs[2], fresh, len) };
            self.end("sgd_step", s);
        }
    }

    fn executor_call(&mut self, slot: &mut [u8; 64]) {
        let x = self.handle(&self.executors.clone());
        let k = self.kernel();
        let tensor = (self.tensor_id() as u32).min(if self.rng.chance(90) { 16 } else { u32::MAX });
        let which = self.rng.below(17);
        self.begin(format!("executor call {which} {x:p} k={k} tensor={tensor}"));
        // SAFETY: every call below gets outs NULL or valid (possibly misaligned), memory of the
        // leaked arena for attach, and NULL or valid strings.
        let (name, s) = unsafe {
            match which {
                0 => {
                    let len = self.rng.below(1 << 20);
                    let len = if self.rng.chance(10) { u64::MAX } else { len };
                    let p = if self.rng.chance(5) {
                        null_mut()
                    } else {
                        self.arena.as_mut_ptr().cast::<c_void>()
                    };
                    let len = if p.is_null() || len <= self.arena.len() as u64 { len } else { 1 };
                    ("executor_attach", teraio_executor_attach(x, tensor, p, len))
                }
                1 => {
                    let e = self.handle(&self.engines.clone());
                    ("use_device_memory", teraio_executor_use_device_memory(x, e, 0))
                }
                2 => ("executor_start", teraio_executor_start(x)),
                3 if self.rng.chance(25) => {
                    let n = self.string(&["an operator the trace lacks", ""]);
                    ("executor_leave_plan", teraio_executor_leave_plan(x, k, opt(&n)))
                }
                3 => {
                    let n = self.string(&["k0", "k1"]);
                    ("executor_boundary", teraio_executor_boundary(x, k, opt(&n)))
                }
                4 => {
                    let o: *mut bool = self.out(slot);
                    ("kernel_ready", teraio_executor_kernel_ready(x, k, o))
                }
                5 | 6 => {
                    let o: *mut f64 = self.out(slot);
                    ("before_kernel", teraio_executor_before_kernel(x, k, o))
                }
                7 | 8 => ("after_kernel", teraio_executor_after_kernel(x, k)),
                9 => {
                    let o: *mut u64 = self.out(slot);
                    let bytes = *self.rng.pick(&[0u64, 1, u64::MAX, 1 << 20]);
                    ("make_room", teraio_executor_make_room(x, k, bytes, o))
                }
                10 => ("executor_free_tensor", teraio_executor_free_tensor(x, tensor)),
                11 => {
                    let mut slot2 = [0u8; 64];
                    let p: *mut *mut c_void = self.out(slot);
                    let l: *mut u64 = self.out(&mut slot2);
                    ("executor_resident", teraio_executor_resident(x, tensor, p, l))
                }
                12..=14 => {
                    let o: *mut *mut c_char = self.out(slot);
                    let (n, s) = match which {
                        12 => ("executor_events", teraio_executor_events(x, o)),
                        13 => ("end_iteration", teraio_executor_end_iteration(x, o)),
                        _ if self.rng.chance(50) => {
                            ("gather_globals", teraio_executor_gather_globals(x, o))
                        }
                        _ => {
                            let limit = *self.rng.pick(&[0, 1, 65536, 1 << 30, u64::MAX]);
                            (
                                "gather_globals_within",
                                teraio_executor_gather_globals_within(x, limit, o),
                            )
                        }
                    };
                    if s == TERAIO_OK {
                        self.strings.push(o.read_unaligned());
                    }
                    (n, s)
                }
                15 => ("executor_modified", teraio_executor_modified(x, tensor)),
                _ => {
                    let finish = self.rng.chance(50);
                    let s =
                        if finish { teraio_executor_finish(x) } else { teraio_executor_free(x) };
                    if s != TERAIO_ERR_INVALID_HANDLE
                        && let Some(i) = self.executors.iter().position(|&h| h == x)
                    {
                        self.executors.swap_remove(i);
                        self.stale.push(x as u64);
                    }
                    ("executor_finish_free", s)
                }
            }
        };
        self.end(name, s);
    }

    /// A mostly well-behaved executor over a live engine and a plan of one of the fuzzer's own
    /// traces: globals attached, started, iterations run kernel by kernel, with now and then a
    /// call out of order, a bad kernel, a tensor freed early, or the engine closed under it.
    fn executor_episode(&mut self) {
        let mut slot = [0u8; 64];
        let candidates: Vec<(CString, *mut teraio_trace)> = self
            .plans
            .iter()
            .filter(|(_, t)| self.shapes.contains_key(&(*t as u64)))
            .cloned()
            .collect();
        if self.engines.is_empty() || candidates.is_empty() || self.executors.len() >= 4 {
            return;
        }
        let (plan, t) = self.rng.pick(&candidates).clone();
        let (n, globals) = self.shapes[&(t as u64)].clone();
        let e = *self.rng.pick(&self.engines);
        let created = self.rng.chance(70);
        self.begin(format!("episode: executor_new {e:p} {t:p} created={created}"));
        let mut x = null_mut();
        // SAFETY: valid handles and strings; NULL allocator.
        let s = unsafe {
            teraio_executor_new(e, t, plan.as_ptr(), 1 << 30, created, std::ptr::null(), &mut x)
        };
        self.end("executor_new", s);
        if s != TERAIO_OK {
            return;
        }
        self.executors.push(x);
        let arena = self.arena.as_mut_ptr() as usize;
        for (i, (id, bytes)) in globals.iter().enumerate() {
            self.begin(format!("episode: attach {id} {bytes}"));
            let p = (arena + i * (1 << 20)) as *mut c_void;
            // SAFETY: `bytes` (<= 1 MiB) of the leaked arena.
            let s = unsafe { teraio_executor_attach(x, *id, p, *bytes) };
            self.end("executor_attach", s);
        }
        self.begin("episode: start".into());
        let s = teraio_executor_start(x);
        self.end("executor_start", s);
        for _iteration in 0..1 + self.rng.below(3) {
            for k in 0..n {
                let k = if self.rng.chance(3) { self.kernel() } else { k };
                self.begin(format!("episode: before_kernel {k}"));
                let mut stall = 0.0;
                // SAFETY: valid out.
                let s = unsafe { teraio_executor_before_kernel(x, k, &mut stall) };
                self.end("before_kernel", s);
                if !created && s == TERAIO_OK {
                    // The kernel's activation (tensor k, 64 KiB) is the caller's to attach.
                    self.begin(format!("episode: attach created {k}"));
                    let p = (arena + (4 << 20) + (k % 4) * (1 << 16)) as *mut c_void;
                    // SAFETY: 64 KiB of the leaked arena.
                    let s = unsafe { teraio_executor_attach(x, k as u32, p, 65536) };
                    self.end("executor_attach", s);
                }
                if self.rng.chance(3) {
                    self.executor_call(&mut slot);
                }
                let k = if self.rng.chance(3) { self.kernel() } else { k };
                self.begin(format!("episode: after_kernel {k}"));
                let s = teraio_executor_after_kernel(x, k);
                self.end("after_kernel", s);
            }
            self.begin("episode: end_iteration".into());
            let mut rep = null_mut();
            // SAFETY: valid out.
            let s = unsafe { teraio_executor_end_iteration(x, &mut rep) };
            self.end("end_iteration", s);
            if s == TERAIO_OK {
                self.strings.push(rep);
            }
            if self.rng.chance(20) {
                self.begin("episode: gather_globals".into());
                let mut rep = null_mut();
                // SAFETY: valid out.
                let s = unsafe { teraio_executor_gather_globals(x, &mut rep) };
                self.end("gather_globals", s);
                if s == TERAIO_OK {
                    self.strings.push(rep);
                }
            }
        }
        if self.rng.chance(10) {
            // The engine closes under the executor: its calls answer CLOSED from now on.
            self.begin(format!("episode: engine_close {e:p}"));
            let s = teraio_engine_close(e);
            self.end("engine_close", s);
            if let Some(i) = self.engines.iter().position(|&h| h == e) {
                self.engines.swap_remove(i);
                self.stale.push(e as u64);
            }
            self.begin("episode: start after close".into());
            let s = teraio_executor_start(x);
            self.end("executor_start", s);
            // (Unless a random call in the episode freed the executor already.)
            if s != TERAIO_ERR_CLOSED && self.executors.contains(&x) {
                self.fail(&format!("an executor of a closed engine answered {s}"));
            }
        }
        if self.rng.chance(70) {
            self.begin("episode: finish".into());
            let s = teraio_executor_finish(x);
            self.end("executor_finish_free", s);
            self.executors.retain(|&h| h != x);
            self.stale.push(x as u64);
        }
    }

    /// Close and free everything (a fuzz run's end, and now and then to start over).
    fn reset(&mut self) {
        self.begin("reset".into());
        for x in std::mem::take(&mut self.executors) {
            let _ = teraio_executor_free(x);
        }
        for op in std::mem::take(&mut self.ops) {
            let _ = teraio_op_free(op);
        }
        for e in std::mem::take(&mut self.engines) {
            let s = teraio_engine_close(e);
            if s == TERAIO_ERR_INTERNAL {
                self.fail(&format!("engine_close: {}", last_error()));
            }
        }
        for b in std::mem::take(&mut self.buffers) {
            let _ = teraio_buffer_free(b);
        }
        for t in std::mem::take(&mut self.traces) {
            let _ = teraio_trace_free(t);
        }
        for s in std::mem::take(&mut self.strings) {
            assert_eq!(teraio_string_free(s), TERAIO_OK);
        }
        self.plans.clear();
        self.shapes.clear();
        self.stale.truncate(256);
        self.end("reset", TERAIO_OK);
    }
}

fn opt(s: &Option<CString>) -> *const c_char {
    s.as_ref().map_or(std::ptr::null(), |c| c.as_ptr())
}

fn last_error() -> String {
    // SAFETY: teraio_last_error_message returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(teraio_last_error_message()) }.to_string_lossy().into_owned()
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[test]
fn the_c_abi_survives_random_calls_with_random_arguments() {
    let secs = env_u64("TERAIO_ABI_FUZZ_SECS", DEFAULT_SECS);
    let seed = env_u64("TERAIO_ABI_FUZZ_SEED", 1);
    // A panic on any thread that is not a call caught at the boundary (an engine worker, say)
    // reaches this hook (the library's hook hands those on): counted, the run fails.
    std::panic::set_hook(Box::new(|info| {
        OTHER_PANICS.fetch_add(1, Ordering::SeqCst);
        eprintln!("C ABI fuzz: a panic outside a C ABI call: {info}");
    }));
    let mut f = Fuzz::new(seed);
    // The watchdog: a call running longer than HANG_S is a hang; report and abort.
    let log = f.log.clone();
    let start = f.start;
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(1));
            let began = CALL_STARTED_MS.load(Ordering::SeqCst);
            if began > 0 && start.elapsed().as_millis() as u64 > began + HANG_S * 1000 {
                let l = log.lock().unwrap_or_else(|p| p.into_inner());
                eprintln!(
                    "C ABI fuzz: HANG (seed {}): a call ran more than {HANG_S} s; last calls:\n{:#?}",
                    l.seed, l.last
                );
                std::process::abort();
            }
        }
    });
    let deadline = Duration::from_secs(secs);
    let mut rounds = 0u64;
    while f.start.elapsed() < deadline {
        for _ in 0..500 {
            f.step();
        }
        rounds += 1;
        if rounds.is_multiple_of(20) {
            f.reset();
        }
    }
    f.reset();
    let mut names: Vec<_> = f.stats.iter().collect();
    names.sort();
    let functions = names.len();
    eprintln!(
        "C ABI fuzz: seed {seed}, {} calls in {:.0} s, {} panics outside calls, 0 caught, 0 hangs; \
         per call (ok, pending, error): {names:?}",
        f.calls,
        f.start.elapsed().as_secs_f64(),
        OTHER_PANICS.load(Ordering::SeqCst)
    );
    assert!(f.calls > 1000 && functions > 30, "{} calls of {functions} kinds", f.calls);
    assert_eq!(OTHER_PANICS.load(Ordering::SeqCst), 0, "panics outside the calls (above)");
}

/// Plan selection options, valid and mangled (unknown keys, wrong types, budgets from 0 up), as
/// `teraio_select` and `teraio_choose_checkpoint` take them.
const SELECT_OPTIONS: &[&str] = &[
    "{}",
    "{\"policy\": \"teraio\"}",
    "{\"policy\": \"auto\", \"gpu_budget_bytes\": 1}",
    "{\"gpu_budget_bytes\": 18446744073709551615}",
    "{\"allowance\": {\"kind\": \"fixed\", \"keep_fraction\": 0.85}, \"traffic_margin\": 0.03}",
    "{\"allowance\": {\"kind\": \"measured\", \"bytes\": 4096}, \"paging_fallback\": true}",
    "{\"allowance\": {\"kind\": \"other\"}}",
    "{\"plan_margin\": -1, \"recompute\": false}",
    "{\"wear_tolerance\": \"high\"}",
    "{\"policy\": \"nope\"}",
    "{\"no_such_key\": 1}",
    "[1, 2]",
    "{",
];
