//! A plan: ordered offload/prefetch instructions at kernel boundaries.
//!
//! # Semantics (shared by the simulator and the executor)
//! - Kernels run one after another. Boundary `i` is the moment kernel `i` is about to start
//!   (kernel `i-1` has finished); boundary `kernel_count` is the end of the iteration, just
//!   before boundary 0 of the next one.
//! - At boundary `i` every instruction with `issue_before_kernel == i` is issued, in plan
//!   order. An offload starts copying at once; it releases the tensor's GPU memory when its
//!   write has completed. A prefetch first allocates the tensor's GPU memory (allocations are
//!   granted in issue order, FIFO, and wait while GPU memory is full), then reads once any
//!   earlier offload of the same tensor has completed; a prefetch issued before that offload
//!   completed keeps the allocation (it is never released).
//! - A kernel starts when the allocations of the tensors it creates are granted (queued
//!   after the prefetches issued at its boundary) and every tensor it accesses is resident.
//! - Urgent migrations take bandwidth before non-urgent ones.
//! - A kernel listed in [`Plan::host_kernels`] runs on the host CPU instead of the GPU (the
//!   `zero-infinity` baseline's optimizer step): every tensor it accesses must be offloaded
//!   (the CPU works on the tier copy), it streams its SSD bytes through host memory while it
//!   computes, and the GPU waits for it like for any kernel. A non-global tensor whose last
//!   access is a host kernel may die offloaded (its tier copy is dropped at death).
//! - An entry of [`Plan::host_updates`] is an optimizer update that runs on the host CPU, beside
//!   the GPU's kernels (`optimizer::place` makes them): when kernel `after_kernel` has
//!   finished, its gradients are copied down, then the CPU runs the update (one update at a
//!   time, in the order they became ready: the CPU is a resource with a queue), then its
//!   weights are copied up (see [`HostUpdate`]). A GPU kernel that accesses one of those
//!   tensors waits until its copy is done: a weight is back before its next use.
//! - Steady state: global tensors listed in [`Plan::initially_offloaded`] are on their tier,
//!   not in GPU memory, when an iteration starts (they were offloaded at the end of the
//!   previous iteration and are prefetched before their first access in this one); every
//!   other global tensor is resident. A valid plan ends each iteration in the state it began,
//!   except that a non-global tensor may be offloaded after its last access and die on its
//!   tier: its copy is dropped at its death and nothing reads it back (a host kernel's last
//!   use; the paging plan of [`crate::select`] moving out a tensor that only waits to be
//!   freed). An offload still copying at the death completes, then its memory and copy go.
//!
//! # Clean drops
//! An offload with [`Instruction::clean`] set is a *clean drop*: the tensor's SSD copy is
//! still valid, so its GPU memory is released at once, without writing, and the tensor is
//! offloaded on the SSD; a later prefetch reads that copy. It moves no bytes and takes no
//! bandwidth. The tensor is resident when dropped: a GPU kernel used it since its last
//! prefetch (a rule of [`Plan::validate`]), and that kernel waited for any earlier offload of
//! it to complete, so the copy is durable.
//!
//! The SSD copy is *valid* from the moment an offload to the SSD is issued (it becomes durable
//! before the GPU memory goes) until the tensor is next *written* ([`crate::Tensor::writes`]):
//! - a GPU kernel that writes the tensor (it is resident then) invalidates the copy;
//! - a host kernel that writes the tensor while it is offloaded to the SSD updates the copy
//!   itself: it stays valid (offloaded to the host tier: the SSD copy, if any, is stale);
//! - a prefetch from the SSD reads the copy and keeps it (the store does not free it); a
//!   prefetch from the host tier releases the host copy (host memory is bounded), so only SSD
//!   copies outlive a prefetch and `dest` of a clean drop must be `ssd`;
//! - a non-global tensor has no copy when created (creation writes it) and its copy is
//!   discarded when it dies.
//!
//! Validity is part of the steady state: a global tensor resident at iteration start has a
//! valid SSD copy iff it has one at iteration end (e.g. a weight offloaded after the optimizer
//! step and prefetched before the end of the iteration). [`Plan::validate`] rejects a clean
//! drop of a tensor whose copy is not valid, and one issued after a prefetch of the same tensor
//! before any GPU kernel used it (that would discard the read in flight). In the very first
//! iteration of a run no copy exists yet: the executor executes a clean drop of a tensor it holds
//! no tier copy of as a plain offload (a write). [`Plan::mark_clean_drops`] turns every
//! offload where a drop is valid into one; every policy's plan goes through it.
//!
//! # Recomputation
//! A [`Recompute`] entry releases a tensor's GPU memory at boundary `drop_at`, without any
//! copy, and makes the tensor again right before kernel `before_kernel` by running its
//! producer ([`crate::Tensor::recomputable`]) once more on the GPU: at that boundary, after
//! the boundary's instructions were issued, the tensor's memory is allocated (in issue order,
//! ahead of the kernel's own creations); once it is granted and every input of the producer
//! is resident, the GPU spends the producer's duration, then runs the kernel. Several
//! recomputations before one kernel run in plan order; one of them may remake an input of
//! another (a chain: `before_kernel` is then a kernel that needs the tensor only as that
//! input). The producer's inputs count as read
//! by kernel `before_kernel`: they must be resident then, and none of them may be written
//! between the tensor's creation and the recomputation (the result would differ). Only
//! non-global tensors, within one iteration; nothing moves the tensor between its drop and
//! its recomputation, and an SSD copy made before stays valid (the value is the same).
//!
//! # Tier space
//! - Host tier: an offload to the host holds the tensor's bytes there from its issue until
//!   the prefetch that reads it back completes, or the tensor dies.
//! - SSD array: an offload to the SSD that writes allocates the tensor's bytes on the array
//!   when it is issued. That copy stays (a prefetch and a clean drop keep it: a later drop
//!   may need it) until the tensor dies, or until a later write of the tensor to the SSD
//!   completes, which replaces it (both are held while the new copy is written). In the
//!   steady state a global tensor written to the SSD at some point of the iteration holds its
//!   bytes there all the time.
//!
//! The simulator reports the peaks ([`crate::SimReport::peak_ssd_bytes`],
//! [`crate::SimReport::peak_host_bytes`]); planners keep them under
//! [`crate::Hardware::ssd_array_capacity_bytes`] and the host cap.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::hardware::Tier;
use crate::trace::{TensorId, Trace};
use crate::{Error, Result};

/// What a plan instruction moves: a tensor out of GPU memory (offload, or a clean drop) or
/// back in (prefetch). (The store's queued requests and the bindings' pending operations are
/// other things: `engine::store`, `bindings/core`'s `Op`.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Move {
    /// Copy the tensor to `dest` and release its GPU memory once the copy is durable; with
    /// [`Instruction::clean`], release it without copying (a clean drop, see the module
    /// documentation).
    Offload {
        /// Where the copy goes.
        dest: Tier,
    },
    /// Allocate GPU memory and read the tensor back from where its last offload put it.
    Prefetch,
}

/// One migration, issued at a kernel boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instruction {
    /// Issued when kernel `issue_before_kernel` is about to start (`kernel_count`: at the end
    /// of the iteration).
    pub issue_before_kernel: usize,
    /// The tensor moved.
    pub tensor: TensorId,
    /// Offload or prefetch.
    #[serde(flatten)]
    pub op: Move,
    /// Must finish before the next kernel can run: executed ahead of non-urgent migrations.
    pub urgent: bool,
    /// Only on an offload to the SSD: a *clean drop*. The tensor's SSD copy is still valid
    /// (not written since it was made or read back), so the GPU memory is released at once
    /// without writing (see the module documentation). JSON: `"clean": true`, absent = false.
    /// An executor that ignores it stays correct: it rewrites an identical copy.
    #[serde(default, skip_serializing_if = "is_false")]
    pub clean: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl Instruction {
    /// An offload of `tensor` to `dest` at boundary `at` (a write, `clean` false).
    pub fn offload(at: usize, tensor: TensorId, dest: Tier, urgent: bool) -> Self {
        Instruction {
            issue_before_kernel: at,
            tensor,
            op: Move::Offload { dest },
            urgent,
            clean: false,
        }
    }

    /// A clean drop of `tensor` at boundary `at`: its SSD copy is valid, release the GPU
    /// memory without writing.
    pub fn drop_clean(at: usize, tensor: TensorId) -> Self {
        Instruction {
            issue_before_kernel: at,
            tensor,
            op: Move::Offload { dest: Tier::Ssd },
            urgent: false,
            clean: true,
        }
    }

    /// A prefetch of `tensor` at boundary `at`.
    pub fn prefetch(at: usize, tensor: TensorId, urgent: bool) -> Self {
        Instruction { issue_before_kernel: at, tensor, op: Move::Prefetch, urgent, clean: false }
    }

    /// Whether this is a clean drop (an offload that writes nothing).
    pub fn is_clean_drop(&self) -> bool {
        self.clean && matches!(self.op, Move::Offload { .. })
    }
}

/// A global tensor that is on a tier (not in GPU memory) at iteration start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitialPlacement {
    /// The tensor.
    pub tensor: TensorId,
    /// Where it is.
    pub tier: Tier,
}

/// A kernel the plan runs on the host CPU instead of the GPU (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HostKernel {
    /// The kernel (index into the trace's kernels).
    pub kernel: usize,
    /// CPU compute time, microseconds (the kernel takes at least this long).
    pub duration_us: f64,
    /// Bytes it reads from the SSD array into host memory while it runs.
    pub ssd_read_bytes: u64,
    /// Bytes it writes from host memory to the SSD array while it runs.
    pub ssd_write_bytes: u64,
    /// Read, compute and write overlap (DeepSpeed's `pipeline_read`/`pipeline_write`): the
    /// kernel takes the longest of the three. `false`: one after the other (DeepSpeed's
    /// default), the kernel takes their sum. The JSON default is `true`.
    #[serde(default = "yes")]
    pub pipelined: bool,
}

fn yes() -> bool {
    true
}

/// An optimizer update the plan runs on the host CPU instead of the GPU: the trace it is made
/// for holds no optimizer state and no optimizer kernel of these parameters (they live in host
/// memory; `optimizer::host_trace` makes such a trace from a profiled one).
///
/// When kernel `after_kernel` finishes (the last GPU access of its weights and gradients
/// before the optimizer's turn), every gradient is copied to host memory (over PCIe from GPU
/// memory; from the host tier or the SSD array where the plan put it); once all have arrived
/// the update waits for the CPU, which runs one update at a time, first ready first, for
/// `cpu_us`; then every weight is copied where it is (up over PCIe into GPU memory, or into its
/// tier copy when the plan has it offloaded). A GPU kernel that accesses a gradient or weight of
/// the update waits until that tensor's copy is done. These copies share the links with the
/// plan's migrations (not urgent).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostUpdate {
    /// The kernel after which the update may start.
    pub after_kernel: usize,
    /// Gradients copied down (at least one).
    pub gradients: Vec<TensorId>,
    /// Weights copied up once updated (at least one).
    pub weights: Vec<TensorId>,
    /// CPU time of the update, microseconds.
    pub cpu_us: f64,
    /// The kernel after which the CPU may run it, once its gradients arrived (None: as soon as
    /// they arrived). A trainer that updates at its optimizer step (teraio.torch's
    /// `offload_optimizer` without `update_in_backward`) runs it when its step reaches the
    /// update's place: after the kernel before the update's own (empty) slots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_after_kernel: Option<usize>,
}

/// A tensor dropped and recomputed instead of kept or moved (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recompute {
    /// The tensor; it must be [`crate::Tensor::recomputable`].
    pub tensor: TensorId,
    /// Boundary at which its GPU memory is released, without a copy.
    pub drop_at: usize,
    /// Kernel right before which its producer runs again (a kernel that accesses it).
    pub before_kernel: usize,
}

/// Planner-side figures, for reporting.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanStats {
    /// Peak of the all-resident memory curve, bytes.
    pub peak_resident_bytes: u64,
    /// Peak of the memory curve the planner expects with its plan, bytes.
    pub planned_peak_bytes: u64,
    /// Offload bytes written to SSD per iteration (clean drops not counted).
    pub ssd_offload_bytes: u64,
    /// Bytes released by clean drops per iteration (no write).
    #[serde(default)]
    pub clean_drop_bytes: u64,
    /// Offload bytes to host memory per iteration.
    pub host_offload_bytes: u64,
    /// Bytes dropped and recomputed per iteration ([`Plan::recomputations`]).
    #[serde(default)]
    pub recompute_bytes: u64,
    /// GPU time the recomputations add per iteration, microseconds.
    #[serde(default)]
    pub recompute_us: f64,
    /// Peak bytes the plan holds on the SSD array (module documentation, "Tier space"), as
    /// simulated when the plan was checked ([`crate::planner::plan_checked`]); 0 if not.
    #[serde(default)]
    pub peak_ssd_bytes: u64,
    /// Peak host-tier bytes, as simulated when the plan was checked; 0 if not.
    #[serde(default)]
    pub peak_host_bytes: u64,
    /// Inactive intervals considered.
    pub candidates: usize,
    /// Candidate evaluations (including lazy re-evaluations).
    pub evaluations: usize,
}

/// The output of a planner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// Policy that produced it.
    pub policy: String,
    /// Kernel count of the trace it was made for.
    pub kernel_count: usize,
    /// Tensor count of the trace it was made for.
    pub tensor_count: usize,
    /// The `ideal` policy: run as if GPU memory were unlimited.
    #[serde(default)]
    pub unlimited_memory: bool,
    /// Global tensors not in GPU memory at iteration start (steady state).
    pub initially_offloaded: Vec<InitialPlacement>,
    /// Instructions, sorted by `issue_before_kernel`; order within a boundary is issue order.
    pub instructions: Vec<Instruction>,
    /// Kernels run on the host CPU, sorted by kernel, each at most once (empty for every
    /// policy but `zero-infinity`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_kernels: Vec<HostKernel>,
    /// Tensors dropped and recomputed, sorted by `before_kernel` (module documentation).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recomputations: Vec<Recompute>,
    /// Optimizer updates run on the host CPU, sorted by `after_kernel` (module documentation;
    /// empty but for plans of `optimizer::place`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_updates: Vec<HostUpdate>,
    /// Planner figures.
    #[serde(default)]
    pub stats: PlanStats,
}

impl Plan {
    /// A plan that moves nothing.
    pub fn empty(policy: &str, trace: &Trace) -> Self {
        Plan {
            policy: policy.into(),
            kernel_count: trace.kernel_count(),
            tensor_count: trace.tensors.len(),
            unlimited_memory: false,
            initially_offloaded: Vec::new(),
            instructions: Vec::new(),
            host_kernels: Vec::new(),
            recomputations: Vec::new(),
            host_updates: Vec::new(),
            stats: PlanStats {
                peak_resident_bytes: trace
                    .resident_memory_per_kernel()
                    .into_iter()
                    .max()
                    .unwrap_or(0),
                ..PlanStats::default()
            },
        }
    }

    /// Parse from JSON (checked with [`Plan::validate`] by the caller, who has the trace).
    pub fn from_json(text: &str) -> Result<Plan> {
        // A UTF-8 byte order mark is not JSON: skip it.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        Ok(serde_json::from_str(text)?)
    }

    /// Check the plan against its trace: instructions sorted and in range; per tensor,
    /// offloads only of resident tensors, prefetches only of offloaded ones, no tensor
    /// accessed while offloaded without a prefetch issued, clean drops only of tensors whose
    /// SSD copy is valid (module documentation), and the iteration ends in the state it began
    /// (steady state). Errors name the instruction by its JSON path.
    pub fn validate(&self, trace: &Trace) -> Result<()> {
        self.walk(trace, |_, _| {})
    }

    /// Turn every offload to the SSD where a clean drop is valid into one (and every other
    /// offload into a write), so that no policy writes back a tensor that did not change since
    /// its SSD copy was made or read back. Updates `stats.ssd_offload_bytes` and
    /// `stats.clean_drop_bytes`. The plan must be valid for `trace` apart from its clean flags.
    pub fn mark_clean_drops(&mut self, trace: &Trace) -> Result<()> {
        for ins in &mut self.instructions {
            ins.clean = false;
        }
        let mut droppable = Vec::new();
        self.walk(trace, |i, ok| {
            if ok {
                droppable.push(i);
            }
        })?;
        let mut bytes = 0u64;
        for i in droppable {
            self.instructions[i].clean = true;
            bytes += trace.tensor(self.instructions[i].tensor).bytes;
        }
        self.stats.ssd_offload_bytes = self.stats.ssd_offload_bytes.saturating_sub(bytes);
        self.stats.clean_drop_bytes += bytes;
        Ok(())
    }

    /// Every rule of [`Plan::validate`]; reports for every offload to the SSD (instruction
    /// index) whether a clean drop would be valid there, in the steady state.
    fn walk(&self, trace: &Trace, mut droppable: impl FnMut(usize, bool)) -> Result<()> {
        let n = trace.kernel_count();
        if self.kernel_count != n || self.tensor_count != trace.tensors.len() {
            return Err(Error::plan(
                "kernel_count",
                format!(
                    "plan is for {} kernels / {} tensors, trace has {n} / {}",
                    self.kernel_count,
                    self.tensor_count,
                    trace.tensors.len()
                ),
            ));
        }
        let mut initial: HashMap<TensorId, Tier> = HashMap::new();
        for (i, p) in self.initially_offloaded.iter().enumerate() {
            let path = format!("initially_offloaded[{i}]");
            let t = trace
                .tensors
                .get(p.tensor.index())
                .ok_or_else(|| Error::plan(&path, format!("no tensor {}", p.tensor)))?;
            if !t.global {
                return Err(Error::plan(path, format!("{} is not global", p.tensor)));
            }
            if initial.insert(p.tensor, p.tier).is_some() {
                return Err(Error::plan(path, format!("{} listed twice", p.tensor)));
            }
        }
        let mut on_host = vec![false; n];
        for (i, h) in self.host_kernels.iter().enumerate() {
            let path = format!("host_kernels[{i}]");
            if h.kernel >= n {
                return Err(Error::plan(path, format!("no kernel {}", h.kernel)));
            }
            if i > 0 && h.kernel <= self.host_kernels[i - 1].kernel {
                return Err(Error::plan(path, "host kernels not sorted and unique"));
            }
            if !(h.duration_us.is_finite() && h.duration_us >= 0.0) {
                return Err(Error::plan(path, format!("duration_us {} invalid", h.duration_us)));
            }
            on_host[h.kernel] = true;
        }
        self.check_host_updates(trace)?;
        // Per tensor: its instructions in plan order, and its drops and recomputations.
        let mut per: HashMap<TensorId, Vec<Event>> = HashMap::new();
        for (i, ins) in self.instructions.iter().enumerate() {
            let path = format!("instructions[{i}]");
            if ins.issue_before_kernel > n {
                return Err(Error::plan(
                    path,
                    format!("issue index {} > {n}", ins.issue_before_kernel),
                ));
            }
            if i > 0 && ins.issue_before_kernel < self.instructions[i - 1].issue_before_kernel {
                return Err(Error::plan(path, "instructions not sorted by issue_before_kernel"));
            }
            if ins.tensor.index() >= trace.tensors.len() {
                return Err(Error::plan(path, format!("no tensor {}", ins.tensor)));
            }
            if ins.clean && ins.op != (Move::Offload { dest: Tier::Ssd }) {
                return Err(Error::plan(
                    format!("{path}.clean"),
                    "only an offload to the ssd can be a clean drop (host copies do not \
                     outlive a prefetch)",
                ));
            }
            per.entry(ins.tensor).or_default().push((ins.issue_before_kernel, 0, Ev::Ins(i)));
        }
        // Inputs of recomputations are read by the kernel they run before.
        let mut extra_reads: HashMap<TensorId, Vec<usize>> = HashMap::new();
        for r in &self.recomputations {
            let inputs = trace.tensors.get(r.tensor.index()).and_then(|t| t.producer.as_ref());
            for x in inputs.iter().flat_map(|p| &p.inputs) {
                extra_reads.entry(*x).or_default().push(r.before_kernel);
            }
        }
        for (i, r) in self.recomputations.iter().enumerate() {
            let feeds = extra_reads.get(&r.tensor).is_some_and(|v| v.contains(&r.before_kernel));
            self.check_recompute(trace, i, r, &on_host, feeds)?;
            let b = r.before_kernel;
            let list = per.entry(r.tensor).or_default();
            list.push((r.drop_at, 1, Ev::Drop(i)));
            list.push((b, 2, Ev::Remake(i)));
        }
        for t in &trace.tensors {
            let mut events = per.remove(&t.id).unwrap_or_default();
            events.sort_by_key(|&(at, class, ev)| (at, class, ev.index()));
            let accesses = match extra_reads.get(&t.id) {
                None => t.accesses.clone(),
                Some(extra) => {
                    let mut v: Vec<usize> = t.accesses.iter().chain(extra).copied().collect();
                    v.sort_unstable();
                    v.dedup();
                    v
                }
            };
            let init = initial.get(&t.id).copied();
            let walk = TensorWalk {
                plan: self,
                trace,
                t,
                events: &events,
                accesses: &accesses,
                initial: init,
                on_host: &on_host,
            };
            if t.global {
                // Steady state: the SSD copy's validity at iteration start is what the
                // iteration leaves behind. A first pass from "no copy" (or, offloaded to the
                // SSD, "the copy is the tensor") finds it; the second pass checks from it.
                let start = init == Some(Tier::Ssd);
                let end = walk.run(start, None)?;
                let start = start || end;
                let end = walk.run(start, Some(&mut droppable))?;
                debug_assert_eq!(start, end || init == Some(Tier::Ssd));
            } else {
                walk.run(false, Some(&mut droppable))?;
            }
        }
        Ok(())
    }

    /// The rules of [`Plan::host_updates`]: sorted, kernels (a CPU gate at or after the update's
    /// start) and tensors in range, at least one
    /// gradient and one weight each, no tensor in two updates, a finite CPU time.
    fn check_host_updates(&self, trace: &Trace) -> Result<()> {
        let n = trace.kernel_count();
        let mut seen = vec![false; trace.tensors.len()];
        for (i, u) in self.host_updates.iter().enumerate() {
            let path = format!("host_updates[{i}]");
            if u.after_kernel >= n {
                return Err(Error::plan(
                    format!("{path}.after_kernel"),
                    format!("no kernel {} (trace has {n})", u.after_kernel),
                ));
            }
            if let Some(g) = u.cpu_after_kernel
                && (g >= n || g < u.after_kernel)
            {
                return Err(Error::plan(
                    format!("{path}.cpu_after_kernel"),
                    format!(
                        "kernel {g} is not between its after_kernel {} and the trace's last ({})",
                        u.after_kernel,
                        n - 1
                    ),
                ));
            }
            if i > 0 && u.after_kernel < self.host_updates[i - 1].after_kernel {
                return Err(Error::plan(path, "host updates not sorted by after_kernel"));
            }
            if !(u.cpu_us.is_finite() && u.cpu_us >= 0.0) {
                return Err(Error::plan(
                    format!("{path}.cpu_us"),
                    format!("must be finite and >= 0, got {}", u.cpu_us),
                ));
            }
            for (field, list) in [("gradients", &u.gradients), ("weights", &u.weights)] {
                if list.is_empty() {
                    return Err(Error::plan(format!("{path}.{field}"), "must not be empty"));
                }
                for (j, t) in list.iter().enumerate() {
                    let p = format!("{path}.{field}[{j}]");
                    match seen.get_mut(t.index()) {
                        None => return Err(Error::plan(p, format!("no tensor {t}"))),
                        Some(s) if *s => {
                            return Err(Error::plan(p, format!("{t} is in two host updates")));
                        }
                        Some(s) => *s = true,
                    }
                }
            }
        }
        Ok(())
    }

    /// The rules of one [`Recompute`] entry that do not depend on the other instructions;
    /// `feeds`: the tensor is an input of another recomputation before the same kernel (so it
    /// may be remade there although the kernel does not access it).
    fn check_recompute(
        &self,
        trace: &Trace,
        i: usize,
        r: &Recompute,
        on_host: &[bool],
        feeds: bool,
    ) -> Result<()> {
        let n = trace.kernel_count();
        let path = format!("recomputations[{i}]");
        let Some(t) = trace.tensors.get(r.tensor.index()) else {
            return Err(Error::plan(path, format!("no tensor {}", r.tensor)));
        };
        let tid = t.id;
        if i > 0 && r.before_kernel < self.recomputations[i - 1].before_kernel {
            return Err(Error::plan(path, "recomputations not sorted by before_kernel"));
        }
        let (Some(pr), Some(c)) = (t.recomputable(), t.created_by) else {
            return Err(Error::plan(
                path,
                format!(
                    "{tid} cannot be recomputed (no producer in the trace, global, or written \
                     after its creation)"
                ),
            ));
        };
        let b = r.before_kernel;
        if b >= n || (t.accesses.binary_search(&b).is_err() && !feeds) {
            return Err(Error::plan(
                format!("{path}.before_kernel"),
                format!(
                    "kernel {b} does not access {tid}, nor is {tid} an input of another \
                     recomputation there"
                ),
            ));
        }
        if !(c < r.drop_at && r.drop_at < b) {
            return Err(Error::plan(
                format!("{path}.drop_at"),
                format!(
                    "{tid} must be dropped after its creation (kernel {c}) and before its \
                     recomputation (kernel {b}), got boundary {}",
                    r.drop_at
                ),
            ));
        }
        if on_host[b] {
            return Err(Error::plan(path, format!("kernel {b} runs on the host")));
        }
        for &x in &pr.inputs {
            let input = trace.tensor(x);
            if !input.alive_at(b, n) {
                return Err(Error::plan(
                    path,
                    format!("input {x} of {tid} is not alive at kernel {b}"),
                ));
            }
            let written = input.accesses.iter().find(|&&k| c < k && k < b && input.writes_at(k));
            if let Some(k) = written {
                return Err(Error::plan(
                    path,
                    format!(
                        "input {x} of {tid} is written by kernel {k}, between {tid}'s creation \
                         and its recomputation: the result would differ"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Serialize to pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

/// Something that happens to one tensor at a boundary, in [`Plan::walk`]'s order: the
/// boundary's instructions (in plan order), then drops, then recomputations.
#[derive(Debug, Clone, Copy)]
enum Ev {
    /// Instruction (index).
    Ins(usize),
    /// The drop of recomputation entry (index).
    Drop(usize),
    /// The recomputation of entry (index).
    Remake(usize),
}

impl Ev {
    fn index(self) -> usize {
        match self {
            Ev::Ins(i) | Ev::Drop(i) | Ev::Remake(i) => i,
        }
    }
}

/// (boundary, class: 0 instruction, 1 drop, 2 recomputation, event).
type Event = (usize, u8, Ev);

/// One tensor's instructions and accesses replayed in logical order (see [`Plan::walk`]).
struct TensorWalk<'a> {
    plan: &'a Plan,
    trace: &'a Trace,
    t: &'a crate::trace::Tensor,
    events: &'a [Event],
    /// The tensor's accesses, and the kernels before which it is read by a recomputation.
    accesses: &'a [usize],
    initial: Option<Tier>,
    on_host: &'a [bool],
}
impl TensorWalk<'_> {
    /// Replay from `ssd_valid` (whether the SSD copy is valid at iteration start); returns
    /// whether it is valid at the end. With `report` (the checking pass), clean drops are
    /// checked and every SSD offload is reported with whether a drop would be valid there.
    fn run(
        &self,
        mut ssd_valid: bool,
        mut report: Option<&mut dyn FnMut(usize, bool)>,
    ) -> Result<bool> {
        let (t, n, on_host) = (self.t, self.trace.kernel_count(), self.on_host);
        let tid = t.id;
        // None = resident, Some(tier) = offloaded (a pending prefetch counts as resident for
        // the "accessed while offloaded" rule since the kernel waits for it).
        let mut state: Option<Tier> = self.initial;
        // A prefetch was issued and no GPU kernel has used the tensor since.
        let mut unused_prefetch = false;
        let alive =
            |b: usize| -> bool { t.global || (t.alloc_kernel() < b && b <= t.free_kernel(n)) };
        // A GPU kernel needs the tensor resident, a host kernel needs it offloaded.
        let access = |k: usize,
                      state: Option<Tier>,
                      dropped: bool,
                      ssd_valid: &mut bool,
                      unused_prefetch: &mut bool,
                      path: &str|
         -> Result<()> {
            if dropped {
                return Err(Error::plan(
                    path,
                    format!("{tid} accessed by kernel {k} while dropped for recomputation"),
                ));
            }
            match (on_host[k], state) {
                (false, Some(_)) => {
                    return Err(Error::plan(
                        path,
                        format!(
                            "{tid} accessed by kernel {k} while offloaded (no prefetch issued)"
                        ),
                    ));
                }
                (true, None) => {
                    return Err(Error::plan(
                        path,
                        format!("{tid} accessed by host kernel {k} while in GPU memory"),
                    ));
                }
                _ => {}
            }
            if !on_host[k] {
                *unused_prefetch = false;
            }
            if t.writes_at(k) {
                // On the GPU the SSD copy goes stale; a host kernel updates the copy it works
                // on, which is the SSD copy only if the tensor is offloaded there.
                *ssd_valid = on_host[k] && state == Some(Tier::Ssd);
            }
            Ok(())
        };
        let acc = self.accesses;
        // Dropped for recomputation (and not made again yet).
        let mut dropped = false;
        let mut ai = 0; // next access index
        for &(at, _, ev) in self.events {
            let path = match ev {
                Ev::Ins(ii) => format!("instructions[{ii}]"),
                Ev::Drop(ri) | Ev::Remake(ri) => format!("recomputations[{ri}]"),
            };
            // Accesses of kernels before this boundary happen first.
            while ai < acc.len() && acc[ai] < at {
                access(acc[ai], state, dropped, &mut ssd_valid, &mut unused_prefetch, &path)?;
                ai += 1;
            }
            let ii = match ev {
                Ev::Ins(ii) => ii,
                Ev::Drop(_) => {
                    if dropped || state.is_some() {
                        return Err(Error::plan(path, format!("{tid} dropped while not resident")));
                    }
                    if acc.get(ai) == Some(&at) {
                        return Err(Error::plan(
                            path,
                            format!("{tid} dropped right before kernel {at} that accesses it"),
                        ));
                    }
                    dropped = true;
                    continue;
                }
                Ev::Remake(_) => {
                    if !dropped {
                        return Err(Error::plan(
                            path,
                            format!("{tid} recomputed before kernel {at} but not dropped before"),
                        ));
                    }
                    dropped = false;
                    continue;
                }
            };
            let ins = self.plan.instructions[ii];
            if dropped {
                return Err(Error::plan(
                    path,
                    format!("{tid} moved while dropped for recomputation"),
                ));
            }
            match ins.op {
                Move::Offload { dest } => {
                    if state.is_some() {
                        return Err(Error::plan(path, format!("{tid} offloaded twice")));
                    }
                    if !alive(ins.issue_before_kernel) {
                        return Err(Error::plan(
                            path,
                            format!("{tid} offloaded outside its lifetime"),
                        ));
                    }
                    if acc.get(ai) == Some(&ins.issue_before_kernel)
                        && !on_host[ins.issue_before_kernel]
                    {
                        return Err(Error::plan(
                            path,
                            format!(
                                "{tid} offloaded right before kernel {} that accesses it",
                                ins.issue_before_kernel
                            ),
                        ));
                    }
                    if dest == Tier::Ssd {
                        let ok = ssd_valid && !unused_prefetch;
                        if let Some(report) = report.as_deref_mut() {
                            if ins.clean && !ssd_valid {
                                return Err(Error::plan(
                                    format!("{path}.clean"),
                                    format!(
                                        "clean drop of {tid}, but its SSD copy is not valid \
                                         (never made, or written since)"
                                    ),
                                ));
                            }
                            if ins.clean && unused_prefetch {
                                return Err(Error::plan(
                                    format!("{path}.clean"),
                                    format!(
                                        "clean drop of {tid} before any kernel used its \
                                         prefetch (the read would be discarded)"
                                    ),
                                ));
                            }
                            report(ii, ok);
                        }
                        ssd_valid = true;
                    }
                    state = Some(dest);
                }
                Move::Prefetch => {
                    if state.is_none() {
                        return Err(Error::plan(path, format!("{tid} prefetched while resident")));
                    }
                    state = None;
                    unused_prefetch = true;
                }
            }
        }
        while ai < acc.len() {
            let (k, path) = (acc[ai], "instructions");
            access(k, state, dropped, &mut ssd_valid, &mut unused_prefetch, path)?;
            ai += 1;
        }
        if dropped {
            return Err(Error::plan(
                "recomputations",
                format!("{tid} ends the iteration dropped (never recomputed)"),
            ));
        }
        // A non-global tensor may die on its tier: every access was checked above, so it was
        // offloaded after its last one (by a host kernel, or by a plan that pages it out).
        let dies_on_tier = !t.global;
        if state != self.initial && !(dies_on_tier && state.is_some()) {
            return Err(Error::plan(
                "initially_offloaded",
                format!("{tid} ends the iteration in a different state than it began"),
            ));
        }
        Ok(ssd_valid)
    }
}
