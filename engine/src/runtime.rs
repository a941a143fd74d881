//! The plan runtime: replays a training iteration's trace in real time, executing a
//! scheduler [`Plan`] with the real migration engine.
//!
//! Kernels are emulated by waiting their (scaled) duration; tensors are real buffers in an
//! emulated GPU memory (any [`MemoryTier`], host memory by default, CUDA later) filled with
//! checkable data; every planned offload and prefetch runs on the [`TensorStore`]; a kernel
//! waits (stalls) until its tensors are back. Every tensor that comes back is verified.
//!
//! The semantics are those of the scheduler's simulator (see `teraio_scheduler::plan`), so the
//! two can be compared:
//! - at boundary `i` (kernel `i` about to start) the instructions issued there run in plan
//!   order: an offload starts at once and releases the tensor's GPU memory when its copy is
//!   stored; a prefetch allocates GPU memory first (FIFO, waiting while memory is full), then
//!   reads. A prefetch issued while the tensor's offload is still being written keeps the GPU
//!   copy (no read): the store hands the source back ([`TensorStore::offload_keep`]).
//! - a kernel starts once the tensors it creates are allocated and every tensor it accesses is
//!   resident; tensors die after their last kernel.
//! - GPU memory is accounted in exact bytes against the emulated capacity.
//! - A clean drop (an offload the plan marks `clean`) releases the memory without writing when
//!   the store holds a current copy; the store must retain copies after prefetches
//!   (`StoreConfig::retain_on_prefetch`). Without a copy (the first iteration) it is an offload.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde::Serialize;
use teraio_scheduler::{Op, Plan, Tier, Trace};

use crate::migrate::{Handle, Priority, StoreStats};
use crate::store::{Destination, OffloadOptions, OffloadOutcome, TensorStore};
use crate::tier::{MemoryTier, TensorMem};
use crate::{Error, Result};

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayConfig {
    /// Emulated GPU memory for the iteration's tensors, bytes.
    pub gpu_capacity_bytes: u64,
    /// Kernel durations are multiplied by this (1.0: the trace's own times).
    pub time_scale: f64,
    /// Iterations replayed back to back; the last one is reported (>= 1).
    pub iterations: usize,
    /// Fill tensors with checkable data and verify every tensor that comes back.
    pub verify: bool,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        Self { gpu_capacity_bytes: 1 << 30, time_scale: 1.0, iterations: 2, verify: true }
    }
}

/// Where the replay is, for progress reporting.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Iteration (0-based).
    pub iteration: usize,
    /// Kernel about to run.
    pub kernel: usize,
    /// Kernels per iteration.
    pub kernels: usize,
}

/// What a replay measured (the last iteration unless said otherwise).
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// Wall time of the reported iteration, seconds.
    pub iteration_time_s: f64,
    /// Wall time of every iteration, seconds.
    pub iteration_times_s: Vec<f64>,
    /// Sum of the (scaled) kernel durations: the iteration time with no stall, seconds.
    pub kernel_time_s: f64,
    /// Time kernels waited for tensors or memory in the reported iteration, seconds.
    pub stall_s: f64,
    /// Time the emulation itself ran over kernel durations (filling and verifying buffers took
    /// longer than the kernel), seconds, reported iteration.
    pub overrun_s: f64,
    /// Peak emulated GPU bytes in the reported iteration.
    pub peak_gpu_bytes: u64,
    /// Emulated GPU capacity.
    pub gpu_capacity_bytes: u64,
    /// Offloads issued in the reported iteration (writes).
    pub offloads: u64,
    /// Clean drops in the reported iteration: memory released without writing, the store's
    /// copy being current.
    pub clean_drops: u64,
    /// Prefetches issued in the reported iteration.
    pub prefetches: u64,
    /// Prefetches that found the offload still being written and kept the GPU copy.
    pub kept_copies: u64,
    /// Tensors verified after coming back (all iterations).
    pub verified_tensors: u64,
    /// Bytes verified (all iterations).
    pub verified_bytes: u64,
    /// (seconds from the reported iteration's start, GPU bytes in use) at every change.
    pub memory_timeline: Vec<(f64, u64)>,
    /// Store statistics over the reported iteration (bytes and bandwidth per direction).
    pub store: StoreStats,
}

/// Work the emulation owes a resident tensor, done inside the next kernel that uses it (so it
/// costs kernel time, as the real kernel's reads and writes would, not stall time).
///
/// The work is done in steps while the main thread would otherwise sleep (during kernels), and
/// whatever is left when a kernel needs the tensor is finished at that kernel's start.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Check {
    None,
    /// Just created: the kernel writes it (fill with checkable data); bytes done so far.
    Fill(u64),
    /// Just came back: verify its bytes; bytes done so far.
    Verify(u64),
}

enum State {
    Absent,
    Resident(TensorMem, Check),
    Offloading { handle: Handle<(OffloadOutcome, TensorMem)>, keep: bool },
    Offloaded,
    QueuedPrefetch,
    Prefetching(Handle<TensorMem>),
}

enum Alloc {
    Create(usize),
    Prefetch(usize, Priority),
}

/// The word at index `i` of tensor `t`'s content.
#[inline]
fn word(t: usize, i: usize) -> u64 {
    ((t as u64) << 40) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Overwrite one word in every 512 bytes (the smallest block a device reads) so that bytes a
/// prefetch failed to read cannot pass verification with stale content. Memory the CPU cannot
/// address (GPU memory) is poisoned whole with one device memset instead (a byte pattern no
/// tensor's content has), not with a copy per 512 bytes.
fn poison(mem: &mut TensorMem) -> Result<()> {
    const MARK: [u8; 8] = *b"poisoned";
    let Some(h) = mem.host_mut() else { return mem.fill_byte(0xA5) };
    for c in h.chunks_mut(512) {
        let n = c.len().min(8);
        c[..n].copy_from_slice(&MARK[..n]);
    }
    Ok(())
}

/// Bytes filled or verified per step of the emulation's background work.
const CHECK_STEP_BYTES: u64 = 8 << 20;

/// Fill bytes `[from, to)` of tensor `t` (offsets multiples of 8) with its checkable content.
fn fill_range(t: usize, mem: &mut TensorMem, from: u64, to: u64) -> Result<()> {
    let write = |bytes: &mut [u8], first_word: usize| {
        let mut words = bytes.chunks_exact_mut(8);
        for (k, w) in (&mut words).enumerate() {
            w.copy_from_slice(&word(t, first_word + k).to_le_bytes());
        }
        let n = bytes.len() / 8;
        let rest = &mut bytes[n * 8..];
        let len = rest.len();
        rest.copy_from_slice(&word(t, first_word + n).to_le_bytes()[..len]);
    };
    if let Some(host) = mem.host_mut() {
        write(&mut host[from as usize..to as usize], from as usize / 8);
        return Ok(());
    }
    let mut chunk = vec![0u8; (to - from) as usize];
    write(&mut chunk, from as usize / 8);
    mem.copy_in(from, &chunk)
}

/// Check bytes `[from, to)` of tensor `t` against its content.
fn verify_range(t: usize, name: &str, mem: &TensorMem, from: u64, to: u64) -> Result<()> {
    let owned;
    let bytes = match mem.host() {
        Some(h) => &h[from as usize..to as usize],
        None => {
            let mut v = vec![0u8; (to - from) as usize];
            mem.copy_out(from, &mut v)?;
            owned = v;
            &owned[..]
        }
    };
    let first = from as usize / 8;
    let n = bytes.len() / 8;
    // Compare word by word without branching per word; locate the first bad word only on a
    // mismatch.
    let mut bad = 0u64;
    for (k, w) in bytes.chunks_exact(8).enumerate() {
        bad |= u64::from_le_bytes(w.try_into().expect("8 bytes")) ^ word(t, first + k);
    }
    let tail = &bytes[n * 8..];
    let tail_ok = tail == &word(t, first + n).to_le_bytes()[..tail.len()];
    if bad != 0 || !tail_ok {
        let at = bytes
            .chunks(8)
            .enumerate()
            .find(|(k, w)| *w != &word(t, first + k).to_le_bytes()[..w.len()])
            .map_or(0, |(k, _)| k * 8);
        return Err(Error::Corruption(format!(
            "tensor {t} ({name}) came back with wrong bytes near offset {}",
            from as usize + at
        )));
    }
    Ok(())
}

struct Replayer<'a> {
    trace: &'a Trace,
    plan: &'a Plan,
    store: &'a TensorStore,
    gpu: &'a dyn MemoryTier,
    cfg: &'a ReplayConfig,
    states: Vec<State>,
    allocs: VecDeque<Alloc>,
    /// Tensors owed a fill or verification, oldest first.
    pending: VecDeque<usize>,
    /// Each tensor keeps its own buffer between uses, so the emulation does not pay page
    /// faults on fresh memory inside the timed iterations (the accounting of emulated GPU
    /// memory is separate, in `used`).
    spare: Vec<Option<TensorMem>>,
    used: u64,
    peak: u64,
    in_flight: usize,
    iteration_start: Instant,
    timeline: Vec<(f64, u64)>,
    offloads: u64,
    drops: u64,
    prefetches: u64,
    kept: u64,
    verified_tensors: u64,
    verified_bytes: u64,
}

impl<'a> Replayer<'a> {
    fn bytes(&self, t: usize) -> u64 {
        self.trace.tensors[t].bytes
    }

    fn set_used(&mut self, used: u64) {
        self.used = used;
        self.peak = self.peak.max(used);
        let at = self.iteration_start.elapsed().as_secs_f64();
        self.timeline.push((at, used));
    }

    /// Memory for tensor `t`: its own buffer from earlier (already faulted in), else a new one.
    fn alloc_mem(&mut self, t: usize) -> Result<TensorMem> {
        if let Some(m) = self.spare[t].take() {
            return Ok(m);
        }
        self.gpu.alloc(self.bytes(t)).map_err(|e| match e {
            Error::NoSpace(why) => Error::NoSpace(format!(
                "the emulated GPU memory's backing ran out for tensor {t} ({why}); \
                 the runtime's accounting allowed it, so raise the backing slack"
            )),
            e => e,
        })
    }

    /// Collect finished migrations and grant waiting allocations. Returns whether anything
    /// changed.
    fn poll(&mut self) -> Result<bool> {
        let mut changed = false;
        for t in 0..self.states.len() {
            let done = match &self.states[t] {
                State::Offloading { handle, .. } => handle.is_done(),
                State::Prefetching(h) => h.is_done(),
                _ => false,
            };
            if !done {
                continue;
            }
            changed = true;
            self.in_flight -= 1;
            match std::mem::replace(&mut self.states[t], State::Absent) {
                State::Offloading { handle, keep } => {
                    let (_, mem) = handle.wait()?;
                    if keep {
                        self.states[t] = State::Resident(mem, Check::None);
                    } else {
                        self.spare[t] = Some(mem);
                        self.set_used(self.used - self.bytes(t));
                        self.states[t] = State::Offloaded;
                    }
                }
                State::Prefetching(h) => {
                    let mem = h.wait()?;
                    self.states[t] = State::Resident(mem, Check::Verify(0));
                    self.pending.push_back(t);
                }
                _ => unreachable!("checked above"),
            }
        }
        while let Some(a) = self.allocs.front() {
            let t = match a {
                Alloc::Create(t) | Alloc::Prefetch(t, _) => *t,
            };
            if self.used + self.bytes(t) > self.cfg.gpu_capacity_bytes {
                break;
            }
            let a = self.allocs.pop_front().expect("front exists");
            let mem = self.alloc_mem(t)?;
            self.set_used(self.used + self.bytes(t));
            changed = true;
            match a {
                Alloc::Create(t) => {
                    self.states[t] = State::Resident(mem, Check::Fill(0));
                    self.pending.push_back(t);
                }
                Alloc::Prefetch(t, priority) => {
                    let mut mem = mem;
                    if self.cfg.verify {
                        poison(&mut mem)?;
                    }
                    let h = self.store.prefetch(t as u64, mem, priority)?;
                    self.in_flight += 1;
                    self.states[t] = State::Prefetching(h);
                }
            }
        }
        Ok(changed)
    }

    fn issue(&mut self, boundary: usize, next_instr: &mut usize) -> Result<()> {
        let instrs = &self.plan.instructions;
        while *next_instr < instrs.len() && instrs[*next_instr].issue_before_kernel == boundary {
            let ins = instrs[*next_instr];
            *next_instr += 1;
            let t = ins.tensor.index();
            let priority = if ins.urgent { Priority::Urgent } else { Priority::Normal };
            match ins.op {
                Op::Offload { .. } if ins.is_clean_drop() && self.has_ssd_copy(t) => {
                    // The store's copy is still current: release the memory, write nothing.
                    let State::Resident(mem, _) =
                        std::mem::replace(&mut self.states[t], State::Absent)
                    else {
                        return Err(Error::InvalidArgument(format!(
                            "plan drops tensor {t} at boundary {boundary} while it is not resident"
                        )));
                    };
                    self.spare[t] = Some(mem);
                    self.set_used(self.used - self.bytes(t));
                    self.states[t] = State::Offloaded;
                    self.drops += 1;
                }
                Op::Offload { dest } => {
                    let State::Resident(mem, _) =
                        std::mem::replace(&mut self.states[t], State::Absent)
                    else {
                        return Err(Error::InvalidArgument(format!(
                            "plan offloads tensor {t} at boundary {boundary} while it is not resident"
                        )));
                    };
                    let destination = match dest {
                        Tier::Ssd => Destination::Ssd,
                        Tier::Host => Destination::Host,
                    };
                    let handle = self.store.offload_keep(
                        t as u64,
                        mem,
                        OffloadOptions { destination, priority, name: None },
                    )?;
                    self.in_flight += 1;
                    self.offloads += 1;
                    self.states[t] = State::Offloading { handle, keep: false };
                }
                Op::Prefetch => {
                    self.prefetches += 1;
                    match &mut self.states[t] {
                        State::Offloading { keep, .. } => {
                            *keep = true;
                            self.kept += 1;
                        }
                        State::Offloaded => {
                            self.states[t] = State::QueuedPrefetch;
                            self.allocs.push_back(Alloc::Prefetch(t, priority));
                        }
                        _ => {
                            return Err(Error::InvalidArgument(format!(
                                "plan prefetches tensor {t} at boundary {boundary} while it is not offloaded"
                            )));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Advance the fill or verification tensor `t` is owed by at most `budget` bytes (all of it
    /// with `u64::MAX`). Returns whether nothing is left.
    fn check(&mut self, t: usize, budget: u64) -> Result<bool> {
        if !self.cfg.verify {
            return Ok(true);
        }
        let name = &self.trace.tensors[t].name;
        let State::Resident(mem, check) = &mut self.states[t] else { return Ok(true) };
        let len = mem.len();
        match *check {
            Check::None => return Ok(true),
            Check::Fill(done) => {
                let to = done.saturating_add(budget).min(len);
                fill_range(t, mem, done, to)?;
                *check = if to == len { Check::None } else { Check::Fill(to) };
            }
            Check::Verify(done) => {
                let to = done.saturating_add(budget).min(len);
                verify_range(t, name, mem, done, to)?;
                if to == len {
                    *check = Check::None;
                    self.verified_tensors += 1;
                    self.verified_bytes += len;
                } else {
                    *check = Check::Verify(to);
                }
            }
        }
        Ok(matches!(self.states[t], State::Resident(_, Check::None)))
    }

    /// One step of pending fills and verifications; false when none is left.
    fn background_step(&mut self) -> Result<bool> {
        while let Some(&t) = self.pending.front() {
            if self.check(t, CHECK_STEP_BYTES)? {
                self.pending.pop_front();
                continue;
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// Whether the store holds a current SSD copy of tensor `t` (with no operation pending).
    fn has_ssd_copy(&self, t: usize) -> bool {
        self.store.has_current_ssd_copy(t as u64)
    }

    /// Wait until `ready` holds, processing events; error if nothing can make progress.
    fn wait_until(&mut self, kernel: usize, ready: impl Fn(&Self) -> bool) -> Result<()> {
        loop {
            self.poll()?;
            if ready(self) {
                return Ok(());
            }
            if self.in_flight == 0 {
                let need = self.allocs.front().map(|a| match a {
                    Alloc::Create(t) | Alloc::Prefetch(t, _) => self.bytes(*t),
                });
                return Err(Error::NoSpace(format!(
                    "emulated GPU memory: kernel {kernel} cannot start: {} bytes wanted, {} of {} in use and nothing in flight to free any",
                    need.unwrap_or(0),
                    self.used,
                    self.cfg.gpu_capacity_bytes
                )));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }
}

/// `TERAIO_DEBUG_STALLS=1` prints every stall longer than 20 ms.
fn debug_stalls() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TERAIO_DEBUG_STALLS").is_some_and(|v| v != "0"))
}

/// Replay `trace` under `plan` on `store`, with tensors in `gpu` memory.
///
/// The plan must be valid for the trace (`Plan::validate`). Global tensors the plan starts
/// offloaded are created and offloaded before the clock starts. `progress` is called before
/// every kernel.
pub fn replay(
    trace: &Trace,
    plan: &Plan,
    store: &TensorStore,
    gpu: &dyn MemoryTier,
    cfg: &ReplayConfig,
    progress: &mut dyn FnMut(Progress),
) -> Result<ReplayReport> {
    plan.validate(trace)
        .map_err(|e| Error::InvalidArgument(format!("the plan does not fit the trace: {e}")))?;
    if !plan.host_kernels.is_empty() {
        return Err(Error::Unsupported(format!(
            "the `{}` plan runs {} kernels on the CPU (host kernels); the runtime replays GPU \
             kernels only, so simulate this policy with `teraio simulate`",
            plan.policy,
            plan.host_kernels.len()
        )));
    }
    if cfg.iterations == 0 || !(cfg.time_scale > 0.0 && cfg.time_scale.is_finite()) {
        return Err(Error::InvalidArgument(
            "iterations must be >= 1 and the time scale a positive number".into(),
        ));
    }
    let n = trace.kernels.len();
    let mut creations = vec![Vec::new(); n];
    let mut deaths = vec![Vec::new(); n];
    for (i, t) in trace.tensors.iter().enumerate() {
        if !t.global {
            if let Some(c) = t.created_by {
                creations[c].push(i);
            }
            if let Some(d) = t.dies_after {
                deaths[d].push(i);
            }
        }
    }
    let accesses = trace.accesses_per_kernel();
    let mut r = Replayer {
        trace,
        plan,
        store,
        gpu,
        cfg,
        states: (0..trace.tensors.len()).map(|_| State::Absent).collect(),
        allocs: VecDeque::new(),
        pending: VecDeque::new(),
        spare: (0..trace.tensors.len()).map(|_| None).collect(),
        used: 0,
        peak: 0,
        in_flight: 0,
        iteration_start: Instant::now(),
        timeline: Vec::new(),
        offloads: 0,
        drops: 0,
        prefetches: 0,
        kept: 0,
        verified_tensors: 0,
        verified_bytes: 0,
    };
    // Every tensor's buffer is allocated and faulted in before the clock starts.
    for (i, t) in trace.tensors.iter().enumerate() {
        if !t.global {
            let mut mem = r.alloc_mem(i)?;
            fill_range(i, &mut mem, 0, t.bytes)?;
            r.spare[i] = Some(mem);
        }
    }
    // Steady state: every global tensor exists; those the plan starts offloaded are on their
    // tier.
    for (i, t) in trace.tensors.iter().enumerate() {
        if t.global {
            let mem = r.alloc_mem(i)?;
            r.states[i] = State::Resident(mem, Check::Fill(0));
            r.check(i, u64::MAX)?;
        }
    }
    let mut setup = Vec::new();
    for p in &plan.initially_offloaded {
        let t = p.tensor.index();
        let State::Resident(mem, _) = std::mem::replace(&mut r.states[t], State::Absent) else {
            return Err(Error::InvalidArgument(format!(
                "initially offloaded tensor {t} is not global"
            )));
        };
        let destination = match p.tier {
            Tier::Ssd => Destination::Ssd,
            Tier::Host => Destination::Host,
        };
        let h =
            store.offload(t as u64, mem, OffloadOptions { destination, ..Default::default() })?;
        setup.push(h);
        r.states[t] = State::Offloaded;
    }
    for h in setup {
        h.wait()?;
    }
    let resident: u64 = trace
        .tensors
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(r.states[*i], State::Resident(..)))
        .map(|(_, t)| t.bytes)
        .sum();
    if resident > cfg.gpu_capacity_bytes {
        return Err(Error::NoSpace(format!(
            "the resident global tensors need {resident} bytes, the emulated GPU has {}",
            cfg.gpu_capacity_bytes
        )));
    }
    r.used = resident;

    let mut times = Vec::new();
    let mut report = None;
    let kernel_time_s: f64 =
        trace.kernels.iter().map(|k| k.duration_us * 1e-6 * cfg.time_scale).sum();
    for iteration in 0..cfg.iterations {
        let last = iteration + 1 == cfg.iterations;
        let stats_before = store.stats();
        r.iteration_start = Instant::now();
        r.peak = r.used;
        r.timeline = vec![(0.0, r.used)];
        (r.offloads, r.drops, r.prefetches, r.kept) = (0, 0, 0, 0);
        let mut stall = Duration::ZERO;
        let mut overrun = Duration::ZERO;
        let mut next_instr = 0;
        for k in 0..n {
            progress(Progress { iteration, kernel: k, kernels: n });
            r.issue(k, &mut next_instr)?;
            for &t in &creations[k] {
                r.allocs.push_back(Alloc::Create(t));
            }
            let wait_start = Instant::now();
            r.wait_until(k, |r| {
                creations[k].iter().all(|&t| matches!(r.states[t], State::Resident(..)))
                    && accesses[k]
                        .iter()
                        .all(|t| matches!(r.states[t.index()], State::Resident(..)))
            })?;
            let waited = wait_start.elapsed();
            stall += waited;
            if debug_stalls() && waited > Duration::from_millis(20) {
                eprintln!(
                    "teraio: stall {:.1} ms before kernel {k} ({}) at {:.3} s; GPU {} of {} bytes in use, {} migrations in flight",
                    waited.as_secs_f64() * 1e3,
                    trace.kernels[k].name,
                    r.iteration_start.elapsed().as_secs_f64(),
                    r.used,
                    cfg.gpu_capacity_bytes,
                    r.in_flight
                );
            }
            // The kernel runs: its duration passes while migrations go on.
            let start = Instant::now();
            for t in &accesses[k] {
                let t0 = Instant::now();
                r.check(t.index(), u64::MAX)?;
                if debug_stalls() && t0.elapsed() > Duration::from_millis(20) {
                    eprintln!(
                        "teraio: kernel {k}: checking tensor {} ({} bytes) took {:.1} ms",
                        t.index(),
                        trace.tensors[t.index()].bytes,
                        t0.elapsed().as_secs_f64() * 1e3
                    );
                }
            }
            let deadline = start
                + Duration::from_secs_f64(trace.kernels[k].duration_us * 1e-6 * cfg.time_scale);
            loop {
                r.poll()?;
                let now = Instant::now();
                if now >= deadline {
                    break;
                }
                // Idle time: the emulation's own work (fills, verifications) goes here.
                if !r.background_step()? {
                    std::thread::sleep((deadline - now).min(Duration::from_micros(200)));
                }
            }
            let over = start.elapsed().saturating_sub(deadline - start);
            overrun += over;
            if debug_stalls() && over > Duration::from_millis(20) {
                eprintln!(
                    "teraio: kernel {k} ({}) ran {:.1} ms over its {:.1} ms",
                    trace.kernels[k].name,
                    over.as_secs_f64() * 1e3,
                    trace.kernels[k].duration_us * 1e-3 * cfg.time_scale
                );
            }
            for &t in &deaths[k] {
                if let State::Resident(mem, _) = std::mem::replace(&mut r.states[t], State::Absent)
                {
                    r.spare[t] = Some(mem);
                    r.set_used(r.used - trace.tensors[t].bytes);
                } else {
                    return Err(Error::InvalidArgument(format!(
                        "tensor {t} dies after kernel {k} while not resident"
                    )));
                }
            }
        }
        let elapsed = r.iteration_start.elapsed();
        // End-of-iteration instructions (offloads wrapping into the next iteration).
        r.issue(n, &mut next_instr)?;
        times.push(elapsed.as_secs_f64());
        if last {
            let after = store.stats();
            report = Some(ReplayReport {
                iteration_time_s: elapsed.as_secs_f64(),
                iteration_times_s: Vec::new(),
                kernel_time_s,
                stall_s: stall.as_secs_f64(),
                overrun_s: overrun.as_secs_f64(),
                peak_gpu_bytes: r.peak,
                gpu_capacity_bytes: cfg.gpu_capacity_bytes,
                offloads: r.offloads,
                clean_drops: r.drops,
                prefetches: r.prefetches,
                kept_copies: r.kept,
                verified_tensors: 0,
                verified_bytes: 0,
                memory_timeline: std::mem::take(&mut r.timeline),
                store: diff_stats(&stats_before, &after),
            });
        }
    }
    // Let the wrap-around offloads finish, then leave the store empty.
    while r.in_flight > 0 {
        r.poll()?;
        std::thread::sleep(Duration::from_micros(100));
    }
    for t in 0..trace.tensors.len() {
        if (matches!(r.states[t], State::Offloaded) || store.info(t as u64).is_some())
            && let Ok(h) = store.free(t as u64)
        {
            h.wait()?;
        }
    }
    let mut report = report.expect("at least one iteration");
    report.iteration_times_s = times;
    report.verified_tensors = r.verified_tensors;
    report.verified_bytes = r.verified_bytes;
    Ok(report)
}

fn diff_stats(before: &StoreStats, after: &StoreStats) -> StoreStats {
    let d = |a: &crate::migrate::DirectionStats, b: &crate::migrate::DirectionStats| {
        let mut x = b.clone();
        x.ops -= a.ops;
        x.bytes -= a.bytes;
        x.errors -= a.errors;
        x.op_time_ns -= a.op_time_ns;
        x.busy_ns -= a.busy_ns;
        x
    };
    let mut s = after.clone();
    s.ssd_write = d(&before.ssd_write, &after.ssd_write);
    s.ssd_read = d(&before.ssd_read, &after.ssd_read);
    s.host_write = d(&before.host_write, &after.host_write);
    s.host_read = d(&before.host_read, &after.host_read);
    s.chunks_verified -= before.chunks_verified;
    s.offloads_cancelled -= before.offloads_cancelled;
    s.host_fallbacks -= before.host_fallbacks;
    s
}
