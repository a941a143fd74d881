//! Discrete-event replay of iterations under a plan and a hardware model.
//!
//! The semantics are those documented in [`crate::plan`](mod@crate::plan): kernels run one at
//! a time; at each boundary the plan's instructions are issued in order; offloads release GPU
//! memory when their copy completes; prefetches and tensor creations allocate GPU memory in
//! issue order (FIFO), waiting while memory is full; a kernel starts once its creations are
//! allocated and every tensor it accesses is resident. A prefetch issued while the same
//! tensor's offload is still copying keeps the GPU copy: the offload completes (the tier copy
//! is written) and the tensor is resident again without a read. A clean drop
//! ([`crate::Instruction::clean`]) releases the GPU memory when issued and moves nothing (a
//! valid plan drops only resident tensors).
//!
//! Bandwidth: every active migration uses the resources of its path
//! ([`Hardware::offload_path`], [`Hardware::prefetch_path`]); rates are max-min fair
//! (water-filling) among urgent migrations first, then among the rest with what is left.
//! SSD reads and writes both draw on [`Resource::SsdDuplex`] besides their own direction, so
//! a combined limit ([`Hardware::ssd_duplex_bytes_per_s`]) is shared fairly between them.
//!
//! Host kernels ([`crate::plan::HostKernel`]): the kernel starts once every tensor it accesses
//! is offloaded (offload complete), runs its CPU time and its SSD-to-host and host-to-SSD
//! streams as urgent transfers: at the same time when it is `pipelined` (perfect pipelining of
//! read, compute and write), else read, then compute, then write. It ends when all three are
//! done. The GPU runs nothing meanwhile.
//!
//! Host updates ([`crate::plan::HostUpdate`]): the CPU is a resource with a queue. When an
//! update's `after_kernel` finishes, its gradients' copies to the host start (over PCIe from
//! GPU memory, `pcie_d2h` + `pcie_duplex` + `host_memory`; from the host tier over
//! `host_memory`; from the SSD array over its read path), sharing bandwidth fairly with the
//! plan's migrations; once they are done the update joins the CPU's queue and runs for its
//! `cpu_us` when the CPU is free (one update at a time, first ready first, overlapping the
//! GPU's kernels; an update with a `cpu_after_kernel` also waits for that kernel to finish, as
//! a trainer's optimizer step reaches it); then its weights' copies start (into GPU memory
//! over `host_memory` + `pcie_h2d` + `pcie_duplex`, or into the tier copy where the plan has
//! the weight offloaded then). A GPU kernel that accesses one of these tensors waits until its
//! copy completed ([`SimReport::host_update_us`] is the CPU's busy time). A weight written
//! this way while resident makes its SSD copy stale: a later clean drop of it writes.
//!
//! Recomputations ([`crate::plan::Recompute`]): the drop releases the tensor's memory at its
//! boundary; before its kernel the tensor is allocated (ahead of the kernel's creations), the
//! kernel waits for the producer's inputs like for its own tensors, and the GPU spends the
//! producer's duration before the kernel's ([`SimReport::recompute_us`]).
//!
//! Tier space follows [`crate::plan`](mod@crate::plan) ("Tier space"): the SSD bytes held by
//! copies ([`SimReport::peak_ssd_bytes`]) and the host-tier bytes.
//!
//! The run replays `iterations` back-to-back iterations (default 2) starting from the plan's
//! steady state and reports the last one, so the offloads issued at the end of one iteration
//! compete with the next one as they would in training.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use crate::hardware::{Hardware, Resource, Tier};
use crate::plan::{HostKernel, HostUpdate, Move, Plan};
use crate::trace::{TensorId, Trace};
use crate::{Error, Result};

/// Options of a simulation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimOptions {
    /// Iterations replayed; the last one is reported (>= 1).
    pub iterations: usize,
    /// Record memory and bandwidth over time of the reported iteration.
    pub record_timeline: bool,
}

impl SimOptions {
    /// The most iterations one simulation replays: the reported iteration is steady after a
    /// few (the second already starts from the state the first leaves), and the run's time
    /// grows with the count, so a larger number is refused rather than left running.
    pub const ITERATIONS_MAX: usize = 1000;
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions { iterations: 2, record_timeline: false }
    }
}

/// How a simulation ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// Every iteration ran.
    Completed,
    /// An allocation could never be granted: nothing in flight could free memory.
    OutOfMemory {
        /// Iteration (0-based).
        iteration: usize,
        /// Kernel about to start.
        kernel: usize,
        /// Bytes the blocked allocation needs.
        needed_bytes: u64,
        /// GPU bytes in use at that point.
        used_bytes: u64,
        /// GPU capacity.
        capacity_bytes: u64,
    },
}

/// Bytes a resource carried in the reported iteration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResourceBytes {
    /// The resource.
    pub resource: Resource,
    /// Bytes carried.
    pub bytes: u64,
}

/// Memory and bandwidth over time (reported iteration; time from its start).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// (time us, GPU bytes in use) at every change.
    pub memory: Vec<(f64, u64)>,
    /// (time us, bytes/s per resource in [`Resource::ALL`] order) at every rate change.
    pub bandwidth: Vec<(f64, [f64; Resource::COUNT])>,
    /// Start time of every kernel, us.
    pub kernel_starts_us: Vec<f64>,
    /// How long every kernel waited to start once the one before it had finished, us: its
    /// tensors were not resident yet, or memory for its creations was not free. Sums to
    /// [`SimReport::stall_us`].
    #[serde(default)]
    pub kernel_stalls_us: Vec<f64>,
}

impl Timeline {
    /// The `n` kernels that waited longest to start, longest first: (kernel, wait us), only
    /// those that waited at all.
    pub fn longest_stalls(&self, n: usize) -> Vec<(usize, f64)> {
        let mut v: Vec<(usize, f64)> =
            self.kernel_stalls_us.iter().copied().enumerate().filter(|s| s.1 > 0.0).collect();
        v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        v.truncate(n);
        v
    }
}

/// What a simulation reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Policy of the plan.
    pub policy: String,
    /// Trace name.
    pub trace: String,
    /// Completed or out of memory.
    pub outcome: Outcome,
    /// Time of the reported iteration, us (0 if it did not complete).
    pub iteration_time_us: f64,
    /// All-resident iteration time, us.
    pub ideal_time_us: f64,
    /// `100 * ideal / iteration time` (0 if it did not complete).
    pub percent_of_ideal: f64,
    /// Time kernels waited (for tensors or memory) in the reported iteration, us.
    pub stall_us: f64,
    /// Time host kernels ran (CPU compute and their SSD streams) in the reported iteration,
    /// us; their GPU durations in the trace are not spent. Iteration time = ideal time - GPU
    /// time of host kernels + `host_step_us` + `recompute_us` + `stall_us`.
    #[serde(default)]
    pub host_step_us: f64,
    /// Peak GPU bytes in use in the reported iteration.
    pub peak_gpu_bytes: u64,
    /// GPU capacity used (u64::MAX for unlimited).
    pub gpu_capacity_bytes: u64,
    /// Peak host-tier bytes in the reported iteration.
    pub peak_host_bytes: u64,
    /// Whether the host tier ever held more than its cap.
    pub host_cap_exceeded: bool,
    /// Peak bytes of tensor copies on the SSD array in the reported iteration (steady state
    /// from the second iteration on; see [`crate::plan`](mod@crate::plan), "Tier space").
    #[serde(default)]
    pub peak_ssd_bytes: u64,
    /// Whether the SSD copies ever needed more than
    /// [`Hardware::ssd_array_capacity_bytes`].
    #[serde(default)]
    pub ssd_cap_exceeded: bool,
    /// GPU time spent recomputing dropped tensors in the reported iteration, us (part of the
    /// iteration time besides the kernels and the stalls).
    #[serde(default)]
    pub recompute_us: f64,
    /// CPU time of the host updates ([`crate::plan::HostUpdate`]) started in the reported
    /// iteration, us: it overlaps the GPU's kernels (it adds to the iteration only where a
    /// kernel waits for a weight, counted in `stall_us`).
    #[serde(default)]
    pub host_update_us: f64,
    /// How many days the SSDs last at this plan's write rate
    /// ([`Hardware::drive_life_days`]); `None` when the endurance is unknown, nothing is
    /// written or the run did not complete.
    #[serde(default)]
    pub drive_life_days: Option<f64>,
    /// Bytes carried per resource in the reported iteration.
    pub bytes_moved: Vec<ResourceBytes>,
    /// Offloads and prefetches completed in the reported iteration (clean drops not counted).
    pub migrations: u64,
    /// Clean drops issued in the reported iteration (GPU memory released without a write).
    #[serde(default)]
    pub clean_drops: u64,
    /// Memory and bandwidth over time, if requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum TState {
    Absent,
    Resident,
    /// Offload copying; `keep`: a prefetch was issued meanwhile.
    Offloading {
        dest: Tier,
        keep: bool,
    },
    Offloaded(Tier),
    /// Prefetch waiting for its allocation.
    Queued(Tier),
    Prefetching,
}

#[derive(Debug, Clone, Copy)]
enum Alloc {
    Create(TensorId),
    Prefetch(TensorId),
}

struct Transfer {
    tensor: TensorId,
    /// A host kernel's SSD stream (no tensor state changes when it completes).
    stream: bool,
    /// A copy of a host update's job (index into `Sim::jobs`; no tensor state changes).
    job: Option<usize>,
    left: f64,
    path: [bool; Resource::COUNT],
    urgent: bool,
    offload: Option<Tier>,
    source: Tier,
    rate: f64,
}

/// `100 * ideal / time`, rounded to 1e-9 and never above 100 (a time within rounding error of
/// ideal reads 100, not 100.0000000004); 0 if the run did not complete.
fn percent_of_ideal(done: bool, ideal_us: f64, time_us: f64) -> f64 {
    if !done || time_us <= 0.0 {
        return 0.0;
    }
    let p = 100.0 * ideal_us / time_us;
    ((p * 1e9).round() / 1e9).min(100.0)
}

/// Replay `trace` under `plan` on `hw`.
pub fn simulate(trace: &Trace, plan: &Plan, hw: &Hardware, opts: &SimOptions) -> Result<SimReport> {
    trace.validate()?;
    hw.validate()?;
    plan.validate(trace)?;
    if opts.iterations == 0 || opts.iterations > SimOptions::ITERATIONS_MAX {
        return Err(Error::InvalidArgument(format!(
            "iterations {}: at least 1 and at most {} (SimOptions::ITERATIONS_MAX)",
            opts.iterations,
            SimOptions::ITERATIONS_MAX
        )));
    }
    Sim::new(trace, plan, hw, opts).run()
}

/// A host update started: which one, copies of its current stage still in flight, and the
/// iteration it started in.
struct Job {
    update: usize,
    left: usize,
    iteration: usize,
}

struct Sim<'a> {
    trace: &'a Trace,
    plan: &'a Plan,
    hw: &'a Hardware,
    opts: &'a SimOptions,
    n: usize,
    cap: u64,
    per_kernel: Vec<Vec<TensorId>>,
    created: Vec<Vec<TensorId>>,
    dying: Vec<Vec<TensorId>>,
    instr_at: Vec<(usize, usize)>,
    state: Vec<TState>,
    used: u64,
    host_used: u64,
    queue: VecDeque<Alloc>,
    transfers: Vec<Transfer>,
    rates_dirty: bool,
    t: f64,
    measuring: bool,
    peak: u64,
    peak_host: u64,
    host_exceeded: bool,
    /// Per tensor: it has a copy on the SSD array; a new one is being written over it.
    ssd_copy: Vec<bool>,
    ssd_replacing: Vec<bool>,
    ssd_used: u64,
    peak_ssd: u64,
    ssd_exceeded: bool,
    ssd_cap: Option<u64>,
    /// Per boundary: tensors dropped for recomputation.
    drops_at: Vec<Vec<TensorId>>,
    /// Per kernel: GPU time of the recomputations that run before it.
    recompute_us_at: Vec<f64>,
    moved: [f64; Resource::COUNT],
    migrations: u64,
    clean_drops: u64,
    timeline: Option<Timeline>,
    iter_start: f64,
    urgent_prefetch: Vec<bool>,
    /// Per kernel: its host-kernel entry, if the plan runs it on the CPU.
    host_kernel: Vec<Option<HostKernel>>,
    /// Host-kernel streams still in flight.
    streams_left: usize,
    /// Per tensor: it died while its offload was still copying (the offload completes, then
    /// its memory and its copy go).
    died_offloading: Vec<bool>,
    /// Per kernel: the host updates that start when it finishes.
    updates_after: Vec<Vec<usize>>,
    /// Per tensor: host-update copies of it not completed (a GPU kernel using it waits).
    held: Vec<u32>,
    /// Host updates started, in start order.
    jobs: Vec<Job>,
    /// Per kernel: jobs whose gradients arrived, waiting for it to finish before the CPU may
    /// run them ([`HostUpdate::cpu_after_kernel`]).
    cpu_gated: Vec<Vec<usize>>,
    /// The iteration running (from 0) and the last kernel finished in it (None: none yet).
    iteration: usize,
    last_done: Option<usize>,
    /// Jobs whose gradients arrived, waiting for the CPU, first ready first.
    cpu_queue: VecDeque<usize>,
    /// The job the CPU runs and when it is done.
    cpu_running: Option<(usize, f64)>,
    /// CPU time of the host updates started in the measured iteration.
    host_update_us: f64,
    /// Per tensor: a host update wrote the GPU copy, its SSD copy is stale.
    stale_ssd: Vec<bool>,
}

impl<'a> Sim<'a> {
    fn new(trace: &'a Trace, plan: &'a Plan, hw: &'a Hardware, opts: &'a SimOptions) -> Self {
        let n = trace.kernel_count();
        // Per kernel: what it allocates before it runs (recomputed tensors first, in plan
        // order, then its creations) and what it needs resident (its accesses and the inputs
        // of the recomputations before it).
        let mut created = vec![Vec::new(); n];
        let mut dying = vec![Vec::new(); n];
        let mut per_kernel = trace.accesses_per_kernel();
        let mut drops_at = vec![Vec::new(); n + 1];
        let mut recompute_us_at = vec![0.0; n];
        for r in &plan.recomputations {
            let t = trace.tensor(r.tensor);
            created[r.before_kernel].push(r.tensor);
            drops_at[r.drop_at].push(r.tensor);
            if let Some(p) = &t.producer {
                recompute_us_at[r.before_kernel] += trace.recompute_us(r.tensor).unwrap_or(0.0);
                per_kernel[r.before_kernel].extend(&p.inputs);
            }
        }
        for list in &mut per_kernel {
            list.sort_unstable();
            list.dedup();
        }
        for t in &trace.tensors {
            if !t.global {
                created[t.alloc_kernel()].push(t.id);
                dying[t.free_kernel(n)].push(t.id);
            }
        }
        let mut instr_at = vec![(0, 0); n + 1];
        let mut i = 0;
        for (b, slot) in instr_at.iter_mut().enumerate() {
            let s = i;
            while i < plan.instructions.len() && plan.instructions[i].issue_before_kernel == b {
                i += 1;
            }
            *slot = (s, i);
        }
        Sim {
            trace,
            plan,
            hw,
            opts,
            n,
            cap: if plan.unlimited_memory { u64::MAX } else { hw.gpu_memory_bytes },
            per_kernel,
            created,
            dying,
            instr_at,
            state: vec![TState::Absent; trace.tensors.len()],
            died_offloading: vec![false; trace.tensors.len()],
            used: 0,
            host_used: 0,
            queue: VecDeque::new(),
            transfers: Vec::new(),
            rates_dirty: false,
            t: 0.0,
            measuring: opts.iterations == 1,
            peak: 0,
            peak_host: 0,
            host_exceeded: false,
            ssd_copy: vec![false; trace.tensors.len()],
            ssd_replacing: vec![false; trace.tensors.len()],
            ssd_used: 0,
            peak_ssd: 0,
            ssd_exceeded: false,
            ssd_cap: hw.ssd_array_capacity_bytes(),
            drops_at,
            recompute_us_at,
            moved: [0.0; Resource::COUNT],
            migrations: 0,
            clean_drops: 0,
            timeline: None,
            iter_start: 0.0,
            urgent_prefetch: vec![false; trace.tensors.len()],
            host_kernel: {
                let mut h = vec![None; n];
                for hk in &plan.host_kernels {
                    h[hk.kernel] = Some(*hk);
                }
                h
            },
            streams_left: 0,
            updates_after: {
                let mut v = vec![Vec::new(); n];
                for (i, u) in plan.host_updates.iter().enumerate() {
                    v[u.after_kernel].push(i);
                }
                v
            },
            held: vec![0; trace.tensors.len()],
            jobs: Vec::new(),
            cpu_gated: vec![Vec::new(); n],
            iteration: 0,
            last_done: None,
            cpu_queue: VecDeque::new(),
            cpu_running: None,
            host_update_us: 0.0,
            stale_ssd: vec![false; trace.tensors.len()],
        }
    }

    /// Start host update `u` (its `after_kernel` finished): its gradients' copies to the host.
    fn start_update(&mut self, u: usize) {
        let job = self.jobs.len();
        let grads = self.plan.host_updates[u].gradients.clone();
        self.jobs.push(Job { update: u, left: grads.len(), iteration: self.iteration });
        for w in &self.plan.host_updates[u].weights {
            self.held[w.index()] += 1;
        }
        for g in grads {
            self.held[g.index()] += 1;
            let path = match self.state[g.index()] {
                TState::Offloaded(Tier::Host) => vec![Resource::HostMemory],
                TState::Offloaded(Tier::Ssd) => self.hw.ssd_to_host_path(),
                _ => vec![Resource::PcieD2h, Resource::PcieDuplex, Resource::HostMemory],
            };
            self.start_job_copy(job, g, &path);
        }
    }

    fn start_job_copy(&mut self, job: usize, tensor: TensorId, path_list: &[Resource]) {
        let mut path = [false; Resource::COUNT];
        for r in path_list {
            path[r.index()] = true;
        }
        self.transfers.push(Transfer {
            tensor,
            stream: false,
            job: Some(job),
            left: self.trace.tensor(tensor).bytes as f64,
            path,
            urgent: false,
            offload: None,
            source: Tier::Host,
            rate: 0.0,
        });
        self.rates_dirty = true;
    }

    /// A copy of job `job` of `tensor` completed.
    fn job_copy_done(&mut self, job: usize, tensor: TensorId) {
        self.held[tensor.index()] -= 1;
        let j = &mut self.jobs[job];
        j.left -= 1;
        if j.left > 0 {
            return;
        }
        let u = j.update;
        // The gradients arrived (the update is not running yet): queue for the CPU. The
        // weights' copies are the last stage: the job is done.
        if self.plan.host_updates[u].gradients.contains(&tensor) {
            // (its CPU work waits for the kernel it runs after, when that one has not finished
            // in the job's iteration yet)
            if let Some(gate) = self.plan.host_updates[u].cpu_after_kernel {
                let passed = self.jobs[job].iteration < self.iteration
                    || self.last_done.is_some_and(|d| d >= gate);
                if !passed {
                    self.cpu_gated[gate].push(job);
                    return;
                }
            }
            self.cpu_queue.push_back(job);
            self.start_cpu();
        }
    }

    /// Give the CPU the next update in its queue if it is free.
    fn start_cpu(&mut self) {
        if self.cpu_running.is_some() {
            return;
        }
        if let Some(job) = self.cpu_queue.pop_front() {
            let us = self.plan.host_updates[self.jobs[job].update].cpu_us;
            if self.measuring {
                self.host_update_us += us;
            }
            self.cpu_running = Some((job, self.t + us));
        }
    }

    /// The CPU finished job `job`: its weights' copies start where each weight is.
    fn cpu_done(&mut self, job: usize) {
        self.cpu_running = None;
        let u: &HostUpdate = &self.plan.host_updates[self.jobs[job].update];
        let weights = u.weights.clone();
        self.jobs[job].left = weights.len();
        for w in weights {
            let i = w.index();
            let path = match self.state[i] {
                TState::Offloaded(Tier::Host)
                | TState::Offloading { dest: Tier::Host, keep: false } => {
                    vec![Resource::HostMemory]
                }
                TState::Offloaded(Tier::Ssd)
                | TState::Offloading { dest: Tier::Ssd, keep: false } => self.hw.host_to_ssd_path(),
                _ => {
                    // Into GPU memory: the SSD copy, if any, no longer holds the value.
                    if self.ssd_copy[i] {
                        self.stale_ssd[i] = true;
                    }
                    vec![Resource::HostMemory, Resource::PcieH2d, Resource::PcieDuplex]
                }
            };
            self.start_job_copy(job, w, &path);
        }
        self.start_cpu();
    }

    fn set_used(&mut self, used: u64) {
        self.used = used;
        if self.measuring {
            self.peak = self.peak.max(used);
            if let Some(tl) = &mut self.timeline {
                tl.memory.push((self.t - self.iter_start, used));
            }
        }
    }

    fn set_host(&mut self, host: u64) {
        self.host_used = host;
        if host > self.hw.host_memory_cap_bytes {
            self.host_exceeded = true;
        }
        if self.measuring {
            self.peak_host = self.peak_host.max(host);
        }
    }

    fn set_ssd(&mut self, ssd: u64) {
        self.ssd_used = ssd;
        if self.ssd_cap.is_some_and(|c| ssd > c) {
            self.ssd_exceeded = true;
        }
        if self.measuring {
            self.peak_ssd = self.peak_ssd.max(ssd);
        }
    }

    /// Release the SSD space `t` holds (its copy, and one being written over it).
    fn free_ssd(&mut self, t: TensorId) {
        let i = t.index();
        let copies = u64::from(std::mem::take(&mut self.ssd_copy[i]))
            + u64::from(std::mem::take(&mut self.ssd_replacing[i]));
        let bytes = self.trace.tensor(t).bytes * copies;
        self.set_ssd(self.ssd_used.saturating_sub(bytes));
    }

    fn start_transfer(
        &mut self,
        tensor: TensorId,
        offload: Option<Tier>,
        source: Tier,
        urgent: bool,
    ) {
        let path_list = match offload {
            Some(dest) => self.hw.offload_path(dest),
            None => self.hw.prefetch_path(source),
        };
        let mut path = [false; Resource::COUNT];
        for r in path_list {
            path[r.index()] = true;
        }
        let left = self.trace.tensor(tensor).bytes as f64;
        self.transfers.push(Transfer {
            tensor,
            stream: false,
            job: None,
            left,
            path,
            urgent,
            offload,
            source,
            rate: 0.0,
        });
        self.rates_dirty = true;
    }

    /// Start a host kernel's stream of `bytes` over `path_list` (urgent: the GPU waits).
    fn start_stream(&mut self, path_list: &[Resource], bytes: u64) -> bool {
        if bytes == 0 {
            return false;
        }
        let mut path = [false; Resource::COUNT];
        for r in path_list {
            path[r.index()] = true;
        }
        self.transfers.push(Transfer {
            tensor: TensorId(0),
            stream: true,
            job: None,
            left: bytes as f64,
            path,
            urgent: true,
            offload: None,
            source: Tier::Host,
            rate: 0.0,
        });
        self.rates_dirty = true;
        true
    }

    fn issue(&mut self, boundary: usize) {
        let (s, e) = self.instr_at[boundary];
        for i in s..e {
            let ins = self.plan.instructions[i];
            let ti = ins.tensor.index();
            let bytes = self.trace.tensor(ins.tensor).bytes;
            match (ins.op, self.state[ti]) {
                // A clean drop: the SSD copy is valid, release the memory without writing. With
                // no copy yet (a run's first iteration) it writes one, as the executor does.
                (Move::Offload { dest }, TState::Resident)
                    if ins.clean && self.ssd_copy[ti] && !self.stale_ssd[ti] =>
                {
                    self.state[ti] = TState::Offloaded(dest);
                    self.set_used(self.used - bytes);
                    if self.measuring {
                        self.clean_drops += 1;
                    }
                }
                (Move::Offload { dest }, TState::Resident) => {
                    self.state[ti] = TState::Offloading { dest, keep: false };
                    if dest == Tier::Ssd {
                        self.stale_ssd[ti] = false;
                    }
                    if dest == Tier::Host {
                        self.set_host(self.host_used + bytes);
                    } else {
                        // New space for the copy; one it replaces goes when the write is done.
                        if self.ssd_copy[ti] {
                            self.ssd_replacing[ti] = true;
                        }
                        self.ssd_copy[ti] = true;
                        self.set_ssd(self.ssd_used + bytes);
                    }
                    self.start_transfer(ins.tensor, Some(dest), dest, ins.urgent);
                }
                (Move::Prefetch, TState::Offloading { dest, .. }) => {
                    self.state[ti] = TState::Offloading { dest, keep: true };
                }
                (Move::Prefetch, TState::Offloaded(src)) => {
                    self.state[ti] = TState::Queued(src);
                    self.queue.push_back(Alloc::Prefetch(ins.tensor));
                    // Urgency travels with the tensor through the queue.
                    if ins.urgent {
                        self.urgent_prefetch[ti] = true;
                    }
                }
                // A validated plan never reaches these; keep going without moving anything.
                _ => {}
            }
        }
        for i in 0..self.drops_at[boundary].len() {
            let t = self.drops_at[boundary][i];
            if self.state[t.index()] == TState::Resident {
                self.state[t.index()] = TState::Absent;
                self.set_used(self.used - self.trace.tensor(t).bytes);
            }
        }
    }

    fn grant(&mut self) {
        while let Some(&a) = self.queue.front() {
            let t = match a {
                Alloc::Create(t) | Alloc::Prefetch(t) => t,
            };
            let bytes = self.trace.tensor(t).bytes;
            if self.used.saturating_add(bytes) > self.cap {
                return;
            }
            self.queue.pop_front();
            self.set_used(self.used + bytes);
            match a {
                Alloc::Create(_) => self.state[t.index()] = TState::Resident,
                Alloc::Prefetch(_) => {
                    let TState::Queued(src) = self.state[t.index()] else { continue };
                    self.state[t.index()] = TState::Prefetching;
                    let urgent = std::mem::take(&mut self.urgent_prefetch[t.index()]);
                    self.start_transfer(t, None, src, urgent);
                }
            }
        }
    }

    fn recompute_rates(&mut self) {
        let mut cap: [f64; Resource::COUNT] = Resource::ALL
            .map(|r| if r.is_ssd() && !self.hw.has_ssd() { 0.0 } else { self.hw.bandwidth(r) });
        let mut frozen = vec![false; self.transfers.len()];
        for class in [true, false] {
            // Each round freezes every transfer on one resource: at most COUNT rounds.
            for _round in 0..=Resource::COUNT {
                let mut count = [0usize; Resource::COUNT];
                for (i, tr) in self.transfers.iter().enumerate() {
                    if !frozen[i] && tr.urgent == class {
                        for (c, &on) in count.iter_mut().zip(&tr.path) {
                            *c += usize::from(on);
                        }
                    }
                }
                let mut best: Option<(usize, f64)> = None;
                for r in 0..Resource::COUNT {
                    if count[r] > 0 {
                        let share = cap[r].max(0.0) / count[r] as f64;
                        if best.is_none_or(|(_, s)| share < s) {
                            best = Some((r, share));
                        }
                    }
                }
                let Some((rb, share)) = best else { break };
                for (i, tr) in self.transfers.iter_mut().enumerate() {
                    if !frozen[i] && tr.urgent == class && tr.path[rb] {
                        tr.rate = share;
                        frozen[i] = true;
                        for (c, &on) in cap.iter_mut().zip(&tr.path) {
                            if on {
                                *c -= share;
                            }
                        }
                    }
                }
            }
        }
        self.rates_dirty = false;
        if self.measuring
            && let Some(tl) = &mut self.timeline
        {
            let mut total = [0.0; Resource::COUNT];
            for tr in &self.transfers {
                for (r, tot) in total.iter_mut().enumerate() {
                    if tr.path[r] {
                        *tot += tr.rate;
                    }
                }
            }
            tl.bandwidth.push((self.t - self.iter_start, total));
        }
    }

    fn complete(&mut self, idx: usize) {
        let tr = self.transfers.swap_remove(idx);
        self.rates_dirty = true;
        if let Some(job) = tr.job {
            self.job_copy_done(job, tr.tensor);
            return;
        }
        if tr.stream {
            self.streams_left -= 1;
            return;
        }
        if self.measuring {
            self.migrations += 1;
        }
        let ti = tr.tensor.index();
        let bytes = self.trace.tensor(tr.tensor).bytes;
        if tr.offload == Some(Tier::Ssd) && std::mem::take(&mut self.ssd_replacing[ti]) {
            self.set_ssd(self.ssd_used.saturating_sub(bytes));
        }
        if tr.offload.is_some() && std::mem::take(&mut self.died_offloading[ti]) {
            // The tensor died while this offload copied: its memory and its copy go now.
            if let TState::Offloading { dest, .. } = self.state[ti] {
                if dest == Tier::Host {
                    self.set_host(self.host_used - bytes);
                }
                self.set_used(self.used - bytes);
            }
            self.state[ti] = TState::Absent;
            if tr.offload == Some(Tier::Ssd) {
                self.free_ssd(tr.tensor);
            }
            return;
        }
        match tr.offload {
            Some(dest) => match self.state[ti] {
                TState::Offloading { keep: true, .. } => {
                    self.state[ti] = TState::Resident;
                    if dest == Tier::Host {
                        self.set_host(self.host_used - bytes);
                    }
                }
                _ => {
                    self.state[ti] = TState::Offloaded(dest);
                    self.set_used(self.used - bytes);
                }
            },
            None => {
                self.state[ti] = TState::Resident;
                if tr.source == Tier::Host {
                    self.set_host(self.host_used - bytes);
                }
            }
        }
    }

    fn begin_measuring(&mut self) {
        self.measuring = true;
        self.iter_start = self.t;
        self.moved = [0.0; Resource::COUNT];
        self.migrations = 0;
        self.clean_drops = 0;
        self.host_update_us = 0.0;
        self.peak = self.used;
        self.peak_host = self.host_used;
        self.peak_ssd = self.ssd_used;
        if self.opts.record_timeline {
            self.timeline =
                Some(Timeline { memory: vec![(0.0, self.used)], ..Timeline::default() });
            self.rates_dirty = true;
        }
    }

    fn report(
        &self,
        outcome: Outcome,
        iteration_time_us: f64,
        stall_us: f64,
        host_step_us: f64,
        recompute_us: f64,
    ) -> SimReport {
        let ideal = self.trace.iteration_time_us();
        let done = outcome == Outcome::Completed;
        let written = self.moved[Resource::SsdWrite.index()].round() as u64;
        SimReport {
            policy: self.plan.policy.clone(),
            trace: self.trace.name.clone(),
            outcome,
            iteration_time_us: if done { iteration_time_us } else { 0.0 },
            ideal_time_us: ideal,
            percent_of_ideal: percent_of_ideal(done, ideal, iteration_time_us),
            stall_us,
            host_step_us,
            peak_gpu_bytes: self.peak,
            gpu_capacity_bytes: self.cap,
            peak_host_bytes: self.peak_host,
            host_cap_exceeded: self.host_exceeded,
            peak_ssd_bytes: self.peak_ssd,
            ssd_cap_exceeded: self.ssd_exceeded,
            recompute_us,
            host_update_us: self.host_update_us,
            drive_life_days: if done {
                self.hw.drive_life_days(written, iteration_time_us)
            } else {
                None
            },
            bytes_moved: Resource::ALL
                .iter()
                .map(|&r| ResourceBytes {
                    resource: r,
                    bytes: self.moved[r.index()].round() as u64,
                })
                .collect(),
            migrations: self.migrations,
            clean_drops: self.clean_drops,
            timeline: self.timeline.clone(),
        }
    }

    fn run(mut self) -> Result<SimReport> {
        let n = self.n;
        // Steady-state initial placement.
        let mut initial = vec![None; self.trace.tensors.len()];
        for p in &self.plan.initially_offloaded {
            initial[p.tensor.index()] = Some(p.tier);
        }
        // A global the plan drops clean holds an SSD copy in the steady state (written by a
        // run's first iteration, kept since: nothing writes it after).
        let mut dropped_clean = vec![false; self.trace.tensors.len()];
        for ins in self.plan.instructions.iter().filter(|i| i.is_clean_drop()) {
            dropped_clean[ins.tensor.index()] = true;
        }
        let mut used = 0u64;
        let mut host = 0u64;
        for t in self.trace.tensors.iter().filter(|t| t.global) {
            if dropped_clean[t.id.index()] && initial[t.id.index()] != Some(Tier::Ssd) {
                self.ssd_copy[t.id.index()] = true;
                self.ssd_used += t.bytes;
            }
            match initial[t.id.index()] {
                Some(tier) => {
                    self.state[t.id.index()] = TState::Offloaded(tier);
                    if tier == Tier::Host {
                        host += t.bytes;
                    } else {
                        self.ssd_copy[t.id.index()] = true;
                        self.ssd_used += t.bytes;
                    }
                }
                None => {
                    self.state[t.id.index()] = TState::Resident;
                    used = used.saturating_add(t.bytes);
                }
            }
        }
        self.set_used(used);
        self.set_host(host);
        self.set_ssd(self.ssd_used);
        if self.measuring {
            self.begin_measuring();
        }
        if used > self.cap {
            return Ok(self.report(
                Outcome::OutOfMemory {
                    iteration: 0,
                    kernel: 0,
                    needed_bytes: used,
                    used_bytes: 0,
                    capacity_bytes: self.cap,
                },
                0.0,
                0.0,
                0.0,
                0.0,
            ));
        }
        let mut stall = 0.0;
        let mut recompute = 0.0;
        let mut host_step = 0.0;
        let mut started_at = 0.0;
        let mut k = 0;
        let mut running_until: Option<f64> = None;
        // Stage of a host kernel that is not pipelined: 0 reading, 1 computing, 2 writing.
        let mut host_stage = 0u8;
        let mut issued = false;
        let mut ready_t = 0.0;
        let mut pending_creates = 0usize;
        let mut create_marker: Vec<bool> = vec![false; self.trace.tensors.len()];
        // Every loop pass either starts a kernel or advances time to an event; bound it.
        let max_steps = (n + 2 * self.plan.instructions.len() + 16)
            .saturating_mul(64)
            .saturating_mul(self.opts.iterations);
        for _ in 0..max_steps {
            if !issued && running_until.is_none() {
                self.issue(k);
                for i in 0..self.created[k].len() {
                    let t = self.created[k][i];
                    self.queue.push_back(Alloc::Create(t));
                    create_marker[t.index()] = true;
                    pending_creates += 1;
                }
                issued = true;
                ready_t = self.t;
            }
            self.grant();
            if pending_creates > 0 {
                pending_creates = self.created[k]
                    .iter()
                    .filter(|t| self.state[t.index()] != TState::Resident)
                    .count();
            }
            let host = self.host_kernel[k];
            // A GPU kernel needs its tensors resident; a host kernel needs them on their tier.
            let ready = |s: TState| match host {
                None => s == TState::Resident,
                Some(_) => matches!(s, TState::Offloaded(_)),
            };
            if issued
                && running_until.is_none()
                && pending_creates == 0
                && self.per_kernel[k]
                    .iter()
                    .all(|t| ready(self.state[t.index()]) && self.held[t.index()] == 0)
            {
                if self.measuring {
                    stall += self.t - ready_t;
                    if let Some(tl) = &mut self.timeline {
                        tl.kernel_starts_us.push(self.t - self.iter_start);
                        tl.kernel_stalls_us.push(self.t - ready_t);
                    }
                }
                started_at = self.t;
                if self.measuring {
                    recompute += self.recompute_us_at[k];
                }
                running_until = Some(match host {
                    None => self.t + self.recompute_us_at[k] + self.trace.kernels[k].duration_us,
                    Some(h) if h.pipelined => {
                        let (rd, wr) = (self.hw.ssd_to_host_path(), self.hw.host_to_ssd_path());
                        self.streams_left = usize::from(self.start_stream(&rd, h.ssd_read_bytes))
                            + usize::from(self.start_stream(&wr, h.ssd_write_bytes));
                        self.t + h.duration_us
                    }
                    Some(h) => {
                        let rd = self.hw.ssd_to_host_path();
                        self.streams_left = usize::from(self.start_stream(&rd, h.ssd_read_bytes));
                        host_stage = 0;
                        self.t
                    }
                });
            }
            if self.rates_dirty {
                self.recompute_rates();
            }
            // Next event.
            // A host kernel past its CPU time waits for its streams: no timer event then.
            let mut dt = match running_until {
                Some(e) if self.t < e - 1e-9 => e - self.t,
                // Finished, or a host kernel's next stage: handled below at once.
                Some(_) if self.streams_left == 0 => 0.0,
                _ => f64::INFINITY,
            };
            let mut first: Option<usize> = None;
            for (i, tr) in self.transfers.iter().enumerate() {
                if tr.rate > 0.0 {
                    let d = tr.left / tr.rate * 1e6;
                    if d < dt {
                        dt = d;
                        first = Some(i);
                    }
                }
            }
            if let Some((_, end)) = self.cpu_running
                && end - self.t < dt
            {
                dt = (end - self.t).max(0.0);
                first = None;
            }
            if !dt.is_finite() {
                if let Some(&a) = self.queue.front() {
                    let (Alloc::Create(t) | Alloc::Prefetch(t)) = a;
                    return Ok(self.report(
                        Outcome::OutOfMemory {
                            iteration: self.iteration,
                            kernel: k,
                            needed_bytes: self.trace.tensor(t).bytes,
                            used_bytes: self.used,
                            capacity_bytes: self.cap,
                        },
                        0.0,
                        stall,
                        host_step,
                        recompute,
                    ));
                }
                let missing: Vec<String> = self.per_kernel[k]
                    .iter()
                    .filter(|t| {
                        self.state[t.index()] != TState::Resident || self.held[t.index()] > 0
                    })
                    .map(|t| format!("{t} ({:?})", self.state[t.index()]))
                    .collect();
                let name = &self.trace.kernels[k].name;
                let detail = if missing.is_empty() {
                    format!(
                        "kernel {k} ({name:?}) cannot start although its tensors are resident: \
                         time does not advance ({} in flight; are its durations too large?)",
                        self.transfers.len()
                    )
                } else {
                    format!(
                        "kernel {k} ({name:?}) waits for {} with no migration able to progress \
                         ({} in flight)",
                        missing.join(", "),
                        self.transfers.len()
                    )
                };
                return Err(Error::SimulationStuck {
                    iteration: self.iteration,
                    kernel: k,
                    detail,
                });
            }
            // Advance.
            for tr in &mut self.transfers {
                let d = tr.rate * dt * 1e-6;
                tr.left -= d;
                if self.measuring {
                    for r in 0..Resource::COUNT {
                        if tr.path[r] {
                            self.moved[r] += d;
                        }
                    }
                }
            }
            self.t += dt;
            if let Some(i) = first {
                self.transfers[i].left = 0.0;
            }
            let mut i = 0;
            while i < self.transfers.len() {
                if self.transfers[i].left <= 1e-3 {
                    self.complete(i);
                } else {
                    i += 1;
                }
            }
            if let Some((job, end)) = self.cpu_running
                && self.t >= end - 1e-9
            {
                self.cpu_done(job);
            }
            if let Some(end) = running_until
                && self.t >= end - 1e-9
                && self.streams_left == 0
                && let Some(h) = host.filter(|h| !h.pipelined && host_stage < 2)
            {
                // Next stage of a host kernel that is not pipelined.
                host_stage += 1;
                if host_stage == 1 {
                    running_until = Some(self.t + h.duration_us);
                } else {
                    let wr = self.hw.host_to_ssd_path();
                    self.streams_left = usize::from(self.start_stream(&wr, h.ssd_write_bytes));
                    running_until = Some(self.t);
                }
                continue;
            }
            if let Some(end) = running_until
                && self.t >= end - 1e-9
                && self.streams_left == 0
            {
                self.t = self.t.max(end);
                if self.measuring && host.is_some() {
                    host_step += self.t - started_at;
                }
                running_until = None;
                issued = false;
                for i in 0..self.dying[k].len() {
                    let t = self.dying[k][i];
                    let b = self.trace.tensor(t).bytes;
                    self.free_ssd(t);
                    match self.state[t.index()] {
                        TState::Resident => {
                            self.state[t.index()] = TState::Absent;
                            self.set_used(self.used - b);
                        }
                        // Offloaded after its last use (by a host kernel, or paged out while
                        // waiting to be freed): its tier copy is dropped.
                        TState::Offloaded(tier) => {
                            self.state[t.index()] = TState::Absent;
                            if tier == Tier::Host {
                                self.set_host(self.host_used - b);
                            }
                        }
                        // Still copying: the offload completes, then everything goes.
                        TState::Offloading { .. } => self.died_offloading[t.index()] = true,
                        _ => {}
                    }
                }
                for i in 0..self.updates_after[k].len() {
                    let u = self.updates_after[k][i];
                    self.start_update(u);
                }
                self.last_done = Some(k);
                if !self.cpu_gated[k].is_empty() {
                    let ready = std::mem::take(&mut self.cpu_gated[k]);
                    self.cpu_queue.extend(ready);
                    self.start_cpu();
                }
                k += 1;
                if k == n {
                    self.issue(n);
                    self.iteration += 1;
                    self.last_done = None;
                    k = 0;
                    if self.iteration == self.opts.iterations {
                        let time = self.t - self.iter_start;
                        return Ok(self.report(
                            Outcome::Completed,
                            time,
                            stall,
                            host_step,
                            recompute,
                        ));
                    }
                    if self.iteration + 1 == self.opts.iterations {
                        self.begin_measuring();
                        stall = 0.0;
                        host_step = 0.0;
                        recompute = 0.0;
                    }
                }
            }
        }
        Err(Error::SimulationStuck {
            iteration: self.iteration,
            kernel: k,
            detail: "event budget exhausted (livelock)".into(),
        })
    }
}
