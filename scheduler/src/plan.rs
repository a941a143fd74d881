//! A plan: ordered offload/prefetch instructions at kernel boundaries.
//!
//! # Semantics (shared by the simulator and the runtime)
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
//! - Steady state: global tensors listed in [`Plan::initially_offloaded`] are on their tier,
//!   not in GPU memory, when an iteration starts (they were offloaded at the end of the
//!   previous iteration and are prefetched before their first access in this one); every
//!   other global tensor is resident. A valid plan ends each iteration in the state it began.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::hardware::Tier;
use crate::trace::{TensorId, Trace};
use crate::{Error, Result};

/// What an instruction does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Copy the tensor to `dest` and release its GPU memory once the copy is durable.
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
    pub op: Op,
    /// Must finish before the next kernel can run: executed ahead of non-urgent migrations.
    pub urgent: bool,
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
}

/// Planner-side figures, for reporting.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PlanStats {
    /// Peak of the all-resident memory curve, bytes.
    pub peak_resident_bytes: u64,
    /// Peak of the memory curve the planner expects with its plan, bytes.
    pub planned_peak_bytes: u64,
    /// Offload bytes to SSD per iteration.
    pub ssd_offload_bytes: u64,
    /// Offload bytes to host memory per iteration.
    pub host_offload_bytes: u64,
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
        Ok(serde_json::from_str(text)?)
    }

    /// Check the plan against its trace: instructions sorted and in range; per tensor,
    /// offloads only of resident tensors, prefetches only of offloaded ones, no tensor
    /// accessed while offloaded without a prefetch issued, and the iteration ends in the
    /// state it began (steady state). Errors name the instruction by its JSON path.
    pub fn validate(&self, trace: &Trace) -> Result<()> {
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
        // Per tensor: its instructions in plan order.
        let mut per: HashMap<TensorId, Vec<usize>> = HashMap::new();
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
            per.entry(ins.tensor).or_default().push(i);
        }
        let none: Vec<usize> = Vec::new();
        for t in &trace.tensors {
            let tid = t.id;
            let list = per.get(&tid).unwrap_or(&none);
            // State: None = resident, Some(tier) = offloaded (prefetch pending counts as resident
            // for the "accessed while offloaded" rule since the kernel waits for it).
            let mut state: Option<Tier> = initial.get(&tid).copied();
            let alive =
                |b: usize| -> bool { t.global || (t.alloc_kernel() < b && b <= t.free_kernel(n)) };
            // A GPU kernel needs the tensor resident, a host kernel needs it offloaded.
            let check = |k: usize, state: Option<Tier>, path: &str| -> Result<()> {
                match (on_host[k], state) {
                    (false, Some(_)) => Err(Error::plan(
                        path,
                        format!(
                            "{tid} accessed by kernel {k} while offloaded (no prefetch issued)"
                        ),
                    )),
                    (true, None) => Err(Error::plan(
                        path,
                        format!("{tid} accessed by host kernel {k} while in GPU memory"),
                    )),
                    _ => Ok(()),
                }
            };
            let mut ai = 0; // next access index
            for &ii in list {
                let ins = self.instructions[ii];
                let path = format!("instructions[{ii}]");
                // Accesses of kernels before this boundary happen first.
                while ai < t.accesses.len() && t.accesses[ai] < ins.issue_before_kernel {
                    check(t.accesses[ai], state, &path)?;
                    ai += 1;
                }
                match ins.op {
                    Op::Offload { dest } => {
                        if state.is_some() {
                            return Err(Error::plan(path, format!("{tid} offloaded twice")));
                        }
                        if !alive(ins.issue_before_kernel) {
                            return Err(Error::plan(
                                path,
                                format!("{tid} offloaded outside its lifetime"),
                            ));
                        }
                        if t.accesses.get(ai) == Some(&ins.issue_before_kernel)
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
                        state = Some(dest);
                    }
                    Op::Prefetch => {
                        if state.is_none() {
                            return Err(Error::plan(
                                path,
                                format!("{tid} prefetched while resident"),
                            ));
                        }
                        state = None;
                    }
                }
            }
            while ai < t.accesses.len() {
                check(t.accesses[ai], state, "instructions")?;
                ai += 1;
            }
            // A non-global tensor last used by a host kernel may die on its tier.
            let dies_on_tier = !t.global && t.accesses.last().is_some_and(|&k| on_host[k]);
            if state != initial.get(&tid).copied() && !(dies_on_tier && state.is_some()) {
                return Err(Error::plan(
                    "initially_offloaded",
                    format!("{tid} ends the iteration in a different state than it began"),
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
