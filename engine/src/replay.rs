//! Replay: plays a training iteration's trace in real time, executing a
//! scheduler [`Plan`] with the real migration engine.
//!
//! Kernels are emulated by waiting their (scaled) duration; tensors are real buffers in an
//! emulated GPU memory (any [`MemoryTier`], host memory by default, CUDA later) filled with
//! checkable data; every planned offload and prefetch runs on the [`TensorStore`]; a kernel
//! waits (stalls) until its tensors are back. Every tensor that comes back is verified.
//!
//! The emulated trainer drives an [`Executor`] (see [`crate::executor`]), which holds the plan's
//! semantics (the scheduler simulator's) for every front end; this module only adds what the
//! emulation needs: timed kernels, buffers that keep their pages between uses, checkable
//! contents (filled when created, poisoned before a prefetch, verified when back).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use std::sync::Arc;

use serde::Serialize;
use teraio_scheduler::{Plan, TensorId, Trace};

use crate::executor::{AllocFor, Event, Executor, ExecutorConfig, LostTensor, TensorAllocator};
use crate::store::StoreStats;
use crate::store::TensorStore;
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
    /// Every iteration, in order.
    pub iterations: Vec<IterationSummary>,
    /// Iterations that stopped because a tensor was lost (the replay went on after them).
    pub stopped_iterations: usize,
    /// Plans replaced between iterations (by the `adapt` callback of [`replay_adaptive`]).
    pub replans: usize,
}

/// What one replayed iteration did, and what it measured.
#[derive(Debug, Clone, Serialize)]
pub struct IterationSummary {
    /// Iteration (0-based).
    pub iteration: usize,
    /// Wall time, seconds.
    pub time_s: f64,
    /// Time kernels waited for tensors or memory, seconds.
    pub stall_s: f64,
    /// Policy of the plan it ran.
    pub policy: String,
    /// Migrations of the plan it ran.
    pub migrations: usize,
    /// It ran a plan made after the previous iteration.
    pub replanned: bool,
    /// Offloads written.
    pub offloads: u64,
    /// Clean drops.
    pub clean_drops: u64,
    /// Prefetches issued.
    pub prefetches: u64,
    /// Offloads whose write failed: the tensor stayed in GPU memory.
    pub failed_offloads: u64,
    /// Failed SSD writes sent to the host tier instead.
    pub host_retries: u64,
    /// Failed reads tried again.
    pub prefetch_retries: u64,
    /// Tensors the executor moved out on its own (memory ran short).
    pub evictions: u64,
    /// Evicted tensors read back on demand.
    pub demand_fetches: u64,
    /// SSD copies freed when their tensors died.
    pub copies_freed: u64,
    /// Bytes written to the SSD array.
    pub ssd_write_bytes: u64,
    /// Bytes read from the SSD array.
    pub ssd_read_bytes: u64,
    /// Bytes written to the host tier.
    pub host_write_bytes: u64,
    /// Bytes read from the host tier.
    pub host_read_bytes: u64,
    /// SSD write bandwidth measured while writes ran, bytes/s (0: none).
    pub ssd_write_bytes_per_s: f64,
    /// SSD read bandwidth measured while reads ran, bytes/s (0: none).
    pub ssd_read_bytes_per_s: f64,
    /// Store operations that failed (all directions).
    pub io_errors: u64,
    /// The tensor the iteration lost, when it stopped.
    pub lost: Option<LostTensor>,
    /// Why the iteration stopped (the error, naming the tensor, the kernel and the device).
    pub stopped: Option<String>,
}

/// Work the emulation owes a resident tensor, done inside the next kernel that uses it (so it
/// costs kernel time, as the real kernel's reads and writes would, not stall time).
///
/// The work is done in steps while the main thread would otherwise sleep (during kernels), and
/// whatever is left when a kernel needs the tensor is finished at that kernel's start.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Check {
    None,
    /// Just created: the kernel writes it (fill with checkable data); bytes done so far.
    Fill(u64),
    /// Just came back: verify its bytes; bytes done so far.
    Verify(u64),
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

/// The emulation's memory: each tensor keeps its own buffer between uses, so the emulation
/// does not pay page faults on fresh memory inside the timed iterations (the executor accounts
/// the emulated GPU memory separately). Prefetch destinations are poisoned first so bytes a
/// prefetch failed to read cannot pass verification.
struct ReplayAllocator {
    gpu: Arc<dyn MemoryTier>,
    spare: Vec<Option<TensorMem>>,
    poison: bool,
}

impl ReplayAllocator {
    fn take(&mut self, t: usize, bytes: u64) -> Result<TensorMem> {
        if let Some(m) = self.spare[t].take() {
            return Ok(m);
        }
        self.gpu.alloc(bytes).map_err(|e| match e {
            Error::NoSpace(why) => Error::NoSpace(format!(
                "the emulated GPU memory's backing ran out for tensor {t} ({why}); \
                 the executor's accounting allowed it, so raise the backing slack"
            )),
            e => e,
        })
    }
}

impl TensorAllocator for ReplayAllocator {
    fn alloc(&mut self, t: TensorId, bytes: u64, why: AllocFor) -> Result<TensorMem> {
        let mut mem = self.take(t.index(), bytes)?;
        if why == AllocFor::Prefetch && self.poison {
            poison(&mut mem)?;
        }
        Ok(mem)
    }

    fn release(&mut self, t: TensorId, mem: TensorMem) {
        self.spare[t.index()] = Some(mem);
    }
}

/// The emulated trainer driving the executor: fills and verifications owed per tensor.
struct Emulation {
    verify: bool,
    checks: Vec<Check>,
    /// Tensors owed a fill or verification, oldest first.
    pending: VecDeque<usize>,
    verified_tensors: u64,
    verified_bytes: u64,
}

impl Emulation {
    /// Take the executor's events: arrived tensors are owed a verification.
    fn events(&mut self, ex: &mut Executor) {
        for e in ex.events() {
            match e {
                Event::Arrived(t) => self.owe(t.index(), Check::Verify(0)),
                Event::Released(t) => self.checks[t.index()] = Check::None,
            }
        }
    }

    fn owe(&mut self, t: usize, c: Check) {
        if self.verify {
            self.checks[t] = c;
            self.pending.push_back(t);
        }
    }

    /// Advance the fill or verification tensor `t` is owed by at most `budget` bytes (all of it
    /// with `u64::MAX`). Returns whether nothing is left.
    fn check(&mut self, ex: &mut Executor, t: usize, budget: u64) -> Result<bool> {
        let check = self.checks[t];
        if check == Check::None {
            return Ok(true);
        }
        let name = ex.trace().tensors[t].name.clone();
        let Some(mem) = ex.resident_mut(TensorId(t as u32)) else {
            // Gone (offloaded or dead) before its check: nothing to do any more.
            self.checks[t] = Check::None;
            return Ok(true);
        };
        let len = mem.len();
        self.checks[t] = match check {
            Check::None => Check::None,
            Check::Fill(done) => {
                let to = done.saturating_add(budget).min(len);
                fill_range(t, mem, done, to)?;
                if to == len { Check::None } else { Check::Fill(to) }
            }
            Check::Verify(done) => {
                let to = done.saturating_add(budget).min(len);
                verify_range(t, &name, mem, done, to)?;
                if to == len {
                    self.verified_tensors += 1;
                    self.verified_bytes += len;
                    Check::None
                } else {
                    Check::Verify(to)
                }
            }
        };
        Ok(self.checks[t] == Check::None)
    }

    /// One step of pending fills and verifications; false when none is left.
    fn background_step(&mut self, ex: &mut Executor) -> Result<bool> {
        while let Some(&t) = self.pending.front() {
            if self.check(ex, t, CHECK_STEP_BYTES)? {
                self.pending.pop_front();
                continue;
            }
            return Ok(true);
        }
        Ok(false)
    }
}

/// `TERAIO_DEBUG_STALLS=1`: a notice ([`crate::notice`]) for every stall longer than 20 ms.
fn debug_stalls() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TERAIO_DEBUG_STALLS").is_some_and(|v| v != "0"))
}

/// Replay `trace` under `plan` on `store`, with tensors in `gpu` memory: an emulated trainer
/// driving an [`Executor`] (kernels are timed waits, tensors are filled when created and
/// verified when they come back).
///
/// The plan must be valid for the trace (`Plan::validate`). Global tensors the plan starts
/// offloaded are created and offloaded before the clock starts. `progress` is called before
/// every kernel.
///
/// An iteration that loses a tensor (its only copy could not be read back) stops there; the
/// replay goes on with the next iteration ([`ReplayReport::iterations`] says which stopped,
/// naming the tensor, the kernel and the device). Any other error ends the replay.
pub fn replay(
    trace: &Trace,
    plan: &Plan,
    store: &Arc<TensorStore>,
    gpu: Arc<dyn MemoryTier>,
    cfg: &ReplayConfig,
    progress: &mut dyn FnMut(Progress),
) -> Result<ReplayReport> {
    replay_adaptive(trace, plan, store, gpu, cfg, progress, &mut |_| Ok(None))
}

/// [`replay`], asking `adapt` after every iteration but the last whether to run another plan
/// (for the same trace) from the next iteration on: a front end re-plans with the bandwidth the
/// iteration measured ([`IterationSummary`]). The executor moves the global tensors to the new
/// plan's starting placement in between ([`Executor::set_plan`]).
pub fn replay_adaptive(
    trace: &Trace,
    plan: &Plan,
    store: &Arc<TensorStore>,
    gpu: Arc<dyn MemoryTier>,
    cfg: &ReplayConfig,
    progress: &mut dyn FnMut(Progress),
    adapt: &mut dyn FnMut(&IterationSummary) -> Result<Option<Plan>>,
) -> Result<ReplayReport> {
    if cfg.iterations == 0 || !(cfg.time_scale > 0.0 && cfg.time_scale.is_finite()) {
        return Err(Error::InvalidArgument(
            "iterations must be >= 1 and the time scale a positive number".into(),
        ));
    }
    plan.validate(trace)
        .map_err(|e| Error::InvalidArgument(format!("the plan does not fit the trace: {e}")))?;
    let n = trace.kernels.len();
    let mut alloc = ReplayAllocator {
        gpu,
        spare: (0..trace.tensors.len()).map(|_| None).collect(),
        poison: cfg.verify,
    };
    // Every tensor's buffer is allocated and faulted in before the clock starts; globals are
    // filled and handed to the executor.
    let mut globals = Vec::new();
    for (i, t) in trace.tensors.iter().enumerate() {
        let mut mem = alloc.take(i, t.bytes)?;
        fill_range(i, &mut mem, 0, t.bytes)?;
        if t.global {
            globals.push((i, mem));
        } else {
            alloc.spare[i] = Some(mem);
        }
    }
    let ex_cfg = ExecutorConfig {
        gpu_budget_bytes: cfg.gpu_capacity_bytes,
        allocate_created: true,
        stream: None,
    };
    let mut ex =
        Executor::new(store.clone(), Box::new(alloc), trace.clone(), plan.clone(), ex_cfg)?;
    for (i, mem) in globals {
        ex.attach(TensorId(i as u32), mem)?;
    }
    ex.start()?;
    let mut emu = Emulation {
        verify: cfg.verify,
        checks: vec![Check::None; trace.tensors.len()],
        pending: VecDeque::new(),
        verified_tensors: 0,
        verified_bytes: 0,
    };
    let accesses = trace.accesses_per_kernel();
    let mut creations = vec![Vec::new(); n];
    for (i, t) in trace.tensors.iter().enumerate() {
        if let (false, Some(c)) = (t.global, t.created_by) {
            creations[c].push(i);
        }
    }

    let mut times = Vec::new();
    let mut summaries = Vec::new();
    let mut report = None;
    let mut replans = 0;
    let kernel_time_s: f64 =
        trace.kernels.iter().map(|k| k.duration_us * 1e-6 * cfg.time_scale).sum();
    for iteration in 0..cfg.iterations {
        let iteration_start = Instant::now();
        let mut overrun = Duration::ZERO;
        let ran = (|| -> Result<()> {
            for k in 0..n {
                progress(Progress { iteration, kernel: k, kernels: n });
                run_kernel(
                    trace,
                    cfg,
                    &mut ex,
                    &mut emu,
                    k,
                    &accesses[k],
                    &creations[k],
                    &mut overrun,
                    iteration_start,
                )?;
            }
            Ok(())
        })();
        let elapsed = iteration_start.elapsed();
        // End-of-iteration instructions (offloads wrapping into the next iteration); an
        // iteration that lost a tensor stops, and the executor is put back in shape for the
        // next one.
        let (it, stopped) = match ran.and_then(|()| ex.end_iteration()) {
            Ok(it) => (it, None),
            Err(e @ Error::TensorLost { .. }) => {
                let msg = e.to_string();
                (ex.abort_iteration()?, Some(msg))
            }
            Err(e) => return Err(e),
        };
        emu.events(&mut ex);
        times.push(elapsed.as_secs_f64());
        let summary = IterationSummary {
            iteration,
            time_s: elapsed.as_secs_f64(),
            stall_s: it.stall_s,
            policy: ex.plan().policy.clone(),
            migrations: ex.plan().instructions.len(),
            replanned: it.replanned,
            offloads: it.offloads,
            clean_drops: it.clean_drops,
            prefetches: it.prefetches,
            failed_offloads: it.failed_offloads,
            host_retries: it.host_retries,
            prefetch_retries: it.prefetch_retries,
            evictions: it.evictions,
            demand_fetches: it.demand_fetches,
            copies_freed: it.copies_freed,
            ssd_write_bytes: it.store.ssd_write.bytes,
            ssd_read_bytes: it.store.ssd_read.bytes,
            host_write_bytes: it.store.host_write.bytes,
            host_read_bytes: it.store.host_read.bytes,
            ssd_write_bytes_per_s: it.store.ssd_write.bandwidth_bytes_per_s(),
            ssd_read_bytes_per_s: it.store.ssd_read.bandwidth_bytes_per_s(),
            io_errors: it.store.ssd_write.errors
                + it.store.ssd_read.errors
                + it.store.host_write.errors
                + it.store.host_read.errors,
            lost: it.lost.clone(),
            stopped,
        };
        if iteration + 1 < cfg.iterations
            && let Some(p) = adapt(&summary)?
        {
            ex.set_plan(p)?;
            replans += 1;
        }
        summaries.push(summary);
        if iteration + 1 == cfg.iterations {
            report = Some(ReplayReport {
                iteration_time_s: elapsed.as_secs_f64(),
                iteration_times_s: Vec::new(),
                kernel_time_s,
                stall_s: it.stall_s,
                overrun_s: overrun.as_secs_f64(),
                peak_gpu_bytes: it.peak_bytes,
                gpu_capacity_bytes: cfg.gpu_capacity_bytes,
                offloads: it.offloads,
                clean_drops: it.clean_drops,
                prefetches: it.prefetches,
                kept_copies: it.kept_copies,
                verified_tensors: 0,
                verified_bytes: 0,
                memory_timeline: it.memory_timeline,
                store: it.store,
                iterations: Vec::new(),
                stopped_iterations: 0,
                replans: 0,
            });
        }
    }
    // Let the wrap-around offloads finish, then leave the store empty.
    ex.finish()?;
    let mut report = report.expect("at least one iteration");
    report.iteration_times_s = times;
    report.verified_tensors = emu.verified_tensors;
    report.verified_bytes = emu.verified_bytes;
    report.stopped_iterations = summaries.iter().filter(|s| s.stopped.is_some()).count();
    report.iterations = summaries;
    report.replans = replans;
    Ok(report)
}

/// Kernel `k` of the emulated iteration: wait until the executor has its tensors, fill and
/// verify what it owes, spend its duration while migrations go on, let its dead tensors go.
#[allow(clippy::too_many_arguments)]
fn run_kernel(
    trace: &Trace,
    cfg: &ReplayConfig,
    ex: &mut Executor,
    emu: &mut Emulation,
    k: usize,
    accesses: &[TensorId],
    creations: &[usize],
    overrun: &mut Duration,
    iteration_start: Instant,
) -> Result<()> {
    let waited = ex.before_kernel(k)?;
    emu.events(ex);
    if debug_stalls() && waited > Duration::from_millis(20) {
        crate::notice::info(format!(
            "stall {:.1} ms before kernel {k} ({}) at {:.3} s; GPU {} of {} bytes in use, {} migrations in flight",
            waited.as_secs_f64() * 1e3,
            trace.kernels[k].name,
            iteration_start.elapsed().as_secs_f64(),
            ex.used_bytes(),
            cfg.gpu_capacity_bytes,
            ex.in_flight()
        ));
    }
    for &t in creations {
        emu.owe(t, Check::Fill(0));
    }
    // The kernel runs: its duration passes while migrations go on.
    let start = Instant::now();
    for t in accesses {
        let t0 = Instant::now();
        emu.check(ex, t.index(), u64::MAX)?;
        if debug_stalls() && t0.elapsed() > Duration::from_millis(20) {
            crate::notice::info(format!(
                "kernel {k}: checking tensor {} ({} bytes) took {:.1} ms",
                t.index(),
                trace.tensors[t.index()].bytes,
                t0.elapsed().as_secs_f64() * 1e3
            ));
        }
    }
    let deadline =
        start + Duration::from_secs_f64(trace.kernels[k].duration_us * 1e-6 * cfg.time_scale);
    loop {
        ex.poll()?;
        emu.events(ex);
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        // Idle time: the emulation's own work (fills, verifications) goes here.
        if !emu.background_step(ex)? {
            std::thread::sleep((deadline - now).min(Duration::from_micros(200)));
        }
    }
    let over = start.elapsed().saturating_sub(deadline - start);
    *overrun += over;
    if debug_stalls() && over > Duration::from_millis(20) {
        crate::notice::info(format!(
            "kernel {k} ({}) ran {:.1} ms over its {:.1} ms",
            trace.kernels[k].name,
            over.as_secs_f64() * 1e3,
            trace.kernels[k].duration_us * 1e-3 * cfg.time_scale
        ));
    }
    ex.after_kernel(k)?;
    emu.events(ex);
    Ok(())
}

/// Watches the SSD bandwidth replayed iterations measure and says when it moved far enough from
/// what the plan assumed to plan again: the first iteration that moved at least `min_bytes` in a
/// direction sets that direction's baseline (the hardware model the first plan was made with
/// stands for it); afterwards, a direction whose bandwidth is off by more than `threshold`
/// times from what the current plan assumes gets a new scale (measured / baseline).
#[derive(Debug, Clone)]
pub struct BandwidthWatch {
    /// Factor by which a direction's bandwidth must move to re-plan (> 1).
    pub threshold: f64,
    /// Bytes a direction must have moved in an iteration for its bandwidth to count.
    pub min_bytes: u64,
    baseline: [Option<f64>; 2],
    scale: [f64; 2],
}

impl BandwidthWatch {
    /// A watch re-planning when a direction moves by more than `threshold` times.
    pub fn new(threshold: f64, min_bytes: u64) -> Self {
        Self { threshold: threshold.max(1.0), min_bytes, baseline: [None; 2], scale: [1.0; 2] }
    }

    /// The (write, read) bandwidth scales the current plan assumes, relative to the first
    /// plan's hardware model.
    pub fn scales(&self) -> (f64, f64) {
        (self.scale[0], self.scale[1])
    }

    /// After an iteration: `Some((write_scale, read_scale))` when the plan should be made again
    /// with the SSD bandwidth of the first plan's hardware model multiplied by these.
    pub fn observe(&mut self, s: &IterationSummary) -> Option<(f64, f64)> {
        if s.stopped.is_some() {
            return None;
        }
        let measured = [
            (s.ssd_write_bytes >= self.min_bytes).then_some(s.ssd_write_bytes_per_s),
            (s.ssd_read_bytes >= self.min_bytes).then_some(s.ssd_read_bytes_per_s),
        ];
        let mut changed = false;
        for (d, m) in measured.into_iter().enumerate() {
            let Some(bw) = m.filter(|b| *b > 0.0 && b.is_finite()) else { continue };
            let Some(base) = self.baseline[d] else {
                self.baseline[d] = Some(bw / self.scale[d]);
                continue;
            };
            let ratio = bw / base;
            if ratio < self.scale[d] / self.threshold || ratio > self.scale[d] * self.threshold {
                // Never above the first model: the baseline iteration may not have been busy
                // enough to show what the array can do.
                let new = ratio.min(1.0);
                if (new - self.scale[d]).abs() > 1e-9 {
                    self.scale[d] = new;
                    changed = true;
                }
            }
        }
        changed.then_some((self.scale[0], self.scale[1]))
    }
}
