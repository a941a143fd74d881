//! FSDP2 over N ranks, each rank with its own SSD array and host tier: what one rank's
//! iteration takes under teraio, against the all-resident ideal and FSDP2's own
//! `CPUOffloadPolicy` (issue 35; docs/FSDP.md).
//!
//! Each rank runs the same program on its own micro-batches, so one rank's trace
//! ([`ModelConfig::fsdp_ranks`]: its shards, FSDP's gathered parameters and collectives) planned
//! and simulated on one rank's [`Hardware`] stands for every rank, and the job trains `ranks`
//! times that rank's tokens per iteration. [`sweep`] does this for each rank count:
//! - **ideal**: the trace with unlimited GPU memory (the all-resident peak beside it says
//!   whether plain FSDP2 fits the cap);
//! - **teraio**: [`crate::select::choose`] with the policy given (`auto`), the optimizer on the
//!   GPU, under the cap;
//! - **teraio, optimizer placed**: [`crate::optimizer::place`], which also weighs each
//!   parameter's update on the host CPU;
//! - **teraio, collectives waited for**: the trace with [`ModelConfig::fsdp_no_overlap`], planned
//!   as `teraio`: how teraio.torch runs FSDP2 on a GPU today (it waits for each collective);
//! - **CPU offload**: FSDP2's `CPUOffloadPolicy` ([`cpu_offload_config`]: shards and the
//!   optimizer step on the host, nothing else moves).
//!
//! What the model leaves out is in docs/FSDP.md ("What is modelled").

use serde::{Deserialize, Serialize};

use crate::hardware::{Hardware, Resource};
use crate::model::{FsdpCpuOffload, ModelConfig, generate, is_fsdp_collective};
use crate::optimizer::{self, PlaceOptions};
use crate::plan::Plan;
use crate::planner::{PlanOptions, Policy};
use crate::select::{SelectOptions, choose};
use crate::sim::{Outcome, SimOptions, SimReport, simulate};
use crate::trace::{Tensor, TensorKind, Trace};
use crate::{Error, Result};

/// The most rank counts one [`sweep`] takes.
pub const SWEEP_POINTS_MAX: usize = 32;

/// FSDP2's `CPUOffloadPolicy` for one rank of `model` (its [`ModelConfig::fsdp_ranks`] set) on
/// `hw`: the model with [`ModelConfig::fsdp_cpu_offload`] at this hardware's rates (copies up
/// and down at the PCIe rate, or the host memory's where slower; the CPU's AdamW rate). Its
/// trace holds what stays in GPU memory (activations, FSDP's gathered parameters, the
/// micro-batch's unsharded gradients); run it with a plan that moves nothing
/// ([`Plan::empty`]): more than the cap is out of memory.
pub fn cpu_offload_config(model: &ModelConfig, hw: &Hardware) -> ModelConfig {
    let mut cfg = model.clone();
    cfg.fsdp_cpu_offload = Some(FsdpCpuOffload {
        h2d_bytes_per_s: hw.pcie_h2d_bytes_per_s.min(hw.host_memory_bytes_per_s),
        d2h_bytes_per_s: hw.pcie_d2h_bytes_per_s.min(hw.host_memory_bytes_per_s),
        cpu_adam_params_per_s: hw.cpu_adam_params_per_s,
    });
    cfg
}

/// Options of [`sweep`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepOptions {
    /// The policy teraio plans with.
    pub policy: Policy,
    /// Its options.
    pub plan: PlanOptions,
}

impl Default for SweepOptions {
    fn default() -> Self {
        SweepOptions { policy: Policy::Auto, plan: PlanOptions::default() }
    }
}

/// One way of running a rank's iteration under the cap, simulated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Method {
    /// What it is: `ideal`, `teraio`, `teraio, optimizer placed`, `teraio, collectives waited
    /// for`, `CPU offload`.
    pub name: String,
    /// The plan's policy as the simulator reports it.
    pub policy: String,
    /// One rank's iteration, microseconds; `None`: it does not run under the cap (`refused`).
    pub iteration_us: Option<f64>,
    /// Why it does not run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// The GPU waiting on transfers or host updates, microseconds.
    pub stall_us: f64,
    /// Bytes one rank moves over PCIe per iteration, both directions (every byte to or from
    /// its SSD array or host tier crosses it).
    pub pcie_bytes: u64,
    /// Bytes one rank reads and writes on its SSD array per iteration.
    pub ssd_bytes: u64,
    /// One rank's simulated GPU memory peak, bytes.
    pub peak_gpu_bytes: u64,
    /// Tokens the whole job trains a second: `ranks x tokens per rank / iteration`.
    pub job_tokens_per_s: Option<f64>,
}

/// One rank count of a [`sweep`]: what one rank holds and how fast its iteration runs each way.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRow {
    /// Ranks of the job (each its own GPU, SSD array and host tier).
    pub ranks: u32,
    /// One rank's GPU memory cap, bytes (the hardware model's).
    pub gpu_cap_bytes: u64,
    /// One rank's shards: parameters, gradients and optimizer states, bytes.
    pub shard_bytes: u64,
    /// One rank's all-resident peak, bytes: what plain FSDP2 needs (more than the cap: plain
    /// FSDP2 runs out of memory).
    pub peak_bytes: u64,
    /// The largest working set (no plan runs in less), bytes.
    pub least_gpu_bytes: u64,
    /// Tokens one rank trains on per iteration.
    pub tokens_per_rank: u64,
    /// Time the collectives spend on the link per iteration, microseconds.
    pub link_us: f64,
    /// Of that, the time compute does not hide (in every method's iteration but the
    /// `collectives waited for` one, which has all of `link_us`), microseconds.
    pub exposed_comm_us: f64,
    /// Unlimited memory, then each way of fitting the cap, in the order of the module
    /// documentation.
    pub methods: Vec<Method>,
}

impl RankRow {
    /// The method named `name`.
    pub fn method(&self, name: &str) -> Option<&Method> {
        self.methods.iter().find(|m| m.name == name)
    }
}

/// Bytes moved on `r` in a report.
fn moved(r: &SimReport, res: Resource) -> u64 {
    r.bytes_moved.iter().find(|b| b.resource == res).map_or(0, |b| b.bytes)
}

fn method(name: &str, ranks: u32, tokens: u64, r: &SimReport) -> Method {
    let runs = r.outcome == Outcome::Completed && !r.host_cap_exceeded && !r.ssd_cap_exceeded;
    let refused = match &r.outcome {
        Outcome::OutOfMemory { kernel, needed_bytes, used_bytes, capacity_bytes, .. } => {
            Some(format!(
                "out of GPU memory at kernel {kernel}: needs {needed_bytes} bytes more, \
                 {used_bytes} of {capacity_bytes} in use"
            ))
        }
        Outcome::Completed if r.host_cap_exceeded => {
            Some(format!("needs {} bytes of host tier, more than there is", r.peak_host_bytes))
        }
        Outcome::Completed if r.ssd_cap_exceeded => {
            Some(format!("needs {} bytes on the SSD array, more than there is", r.peak_ssd_bytes))
        }
        Outcome::Completed => None,
    };
    let iteration_us = runs.then_some(r.iteration_time_us);
    Method {
        name: name.into(),
        policy: r.policy.clone(),
        iteration_us,
        refused,
        stall_us: r.stall_us,
        pcie_bytes: moved(r, Resource::PcieH2d) + moved(r, Resource::PcieD2h),
        ssd_bytes: moved(r, Resource::SsdRead) + moved(r, Resource::SsdWrite),
        peak_gpu_bytes: r.peak_gpu_bytes,
        job_tokens_per_s: iteration_us
            .filter(|&us| us > 0.0)
            .map(|us| f64::from(ranks) * tokens as f64 / (us / 1e6)),
    }
}

fn refused(name: &str, why: String) -> Method {
    Method {
        name: name.into(),
        policy: String::new(),
        iteration_us: None,
        refused: Some(why),
        stall_us: 0.0,
        pcie_bytes: 0,
        ssd_bytes: 0,
        peak_gpu_bytes: 0,
        job_tokens_per_s: None,
    }
}

/// Whether `e` says that no plan fits (a result of the sweep, not a failure of it).
fn does_not_fit(e: &Error) -> bool {
    matches!(
        e,
        Error::GpuMemoryTooSmall { .. }
            | Error::PlanOutOfMemory { .. }
            | Error::TierTooSmall { .. }
    )
}

/// For each rank count of `ranks`: one rank's trace of `model` under FSDP2 over that many ranks
/// (its [`ModelConfig::fsdp_ranks`] set; the model must have none), on `hw` (one rank's GPU
/// cap, SSD array and host tier), run each way of the module documentation. An error for a bad
/// rank count names it (as [`ModelConfig::validate`] does), and for an empty or too long list.
pub fn sweep(
    model: &ModelConfig,
    ranks: &[u32],
    hw: &Hardware,
    opts: &SweepOptions,
) -> Result<Vec<RankRow>> {
    if let Some(n) = model.fsdp_ranks {
        return Err(Error::InvalidArgument(format!(
            "the model already has fsdp-ranks {n}: give the rank counts to the sweep only"
        )));
    }
    if ranks.is_empty() || ranks.len() > SWEEP_POINTS_MAX {
        return Err(Error::InvalidArgument(format!(
            "{} rank counts: give 1 to {SWEEP_POINTS_MAX}",
            ranks.len()
        )));
    }
    hw.validate()?;
    let mut configs = Vec::new();
    for &n in ranks {
        let mut cfg = model.clone();
        cfg.fsdp_ranks = Some(n);
        cfg.validate()?;
        configs.push(cfg);
    }
    let sim = SimOptions::default();
    let mut rows = Vec::new();
    for cfg in configs {
        let n = cfg.fsdp_ranks.expect("set");
        let tokens = cfg.tokens_per_iteration();
        let trace = generate(&cfg)?;
        let serial = generate(&ModelConfig { fsdp_no_overlap: true, ..cfg.clone() })?;
        let comm = |t: &Trace| -> f64 {
            t.kernels.iter().filter(|k| is_fsdp_collective(k)).map(|k| k.duration_us).sum()
        };
        let shard_bytes = trace
            .tensors
            .iter()
            .filter(|t| t.global || t.kind == TensorKind::Gradient && is_shard(t))
            .map(|t| t.bytes)
            .sum();
        let peak_bytes = trace.resident_memory_per_kernel().into_iter().max().unwrap_or(0);
        let (_, least_gpu_bytes) = crate::analysis::largest_working_set(&trace);
        let ideal_plan = crate::planner::plan(&trace, hw, Policy::Ideal)?;
        let mut methods =
            vec![method("ideal", n, tokens, &simulate(&trace, &ideal_plan, hw, &sim)?)];
        let select = SelectOptions::cli(opts.policy, opts.plan.clone(), hw.gpu_memory_bytes);
        for (name, t) in [("teraio", &trace), ("teraio, collectives waited for", &serial)] {
            methods.push(match choose(t, hw, &select) {
                Ok(s) => method(name, n, tokens, &s.report),
                Err(e) if does_not_fit(&e) => refused(name, e.to_string()),
                Err(e) => return Err(e),
            });
        }
        let place =
            PlaceOptions { policy: opts.policy, plan: opts.plan.clone(), ..Default::default() };
        let name = "teraio, optimizer placed";
        methods.push(match optimizer::place(&trace, hw, &place) {
            Ok(p) => {
                let mut m = method(name, n, tokens, &p.report);
                m.policy = format!("{} ({})", p.report.policy, host_share(&p));
                m
            }
            Err(e) if does_not_fit(&e) => refused(name, e.to_string()),
            Err(e) => return Err(e),
        });
        let cpu = generate(&cpu_offload_config(&cfg, hw))?;
        let none = Plan::empty("fsdp-cpu-offload", &cpu);
        let mut m = method("CPU offload", n, tokens, &simulate(&cpu, &none, hw, &sim)?);
        // (its copies are in its collectives' time, not migrations: count them here)
        m.pcie_bytes = shard_copy_bytes(&trace);
        methods.push(m);
        // (in the order of `METHODS`)
        methods.sort_by_key(|m| METHODS.iter().position(|&x| x == m.name));
        rows.push(RankRow {
            ranks: n,
            gpu_cap_bytes: hw.gpu_memory_bytes,
            shard_bytes,
            peak_bytes,
            least_gpu_bytes,
            tokens_per_rank: tokens,
            link_us: comm(&serial),
            exposed_comm_us: comm(&trace),
            methods,
        });
    }
    Ok(rows)
}

/// The methods of a [`RankRow`], in order.
pub const METHODS: [&str; 5] = [
    "ideal",
    "teraio",
    "teraio, optimizer placed",
    "teraio, collectives waited for",
    "CPU offload",
];

/// `N of M parameters on the host`.
fn host_share(p: &optimizer::Placement) -> String {
    let all: usize = p.updates.iter().map(|u| u.weights.len()).sum();
    format!("optimizer of {} of {all} parameters on the host", p.host_weights.len())
}

/// Bytes FSDP2's CPU offload copies over PCIe per iteration on `trace` (the same model without
/// it): each all-gather's parameter shards up, each reduce-scatter's gradient shards down.
pub fn shard_copy_bytes(trace: &Trace) -> u64 {
    let per_kernel = trace.accesses_per_kernel();
    let mut bytes = 0;
    for (k, kernel) in trace.kernels.iter().enumerate() {
        if !is_fsdp_collective(kernel) {
            continue;
        }
        for &t in &per_kernel[k] {
            let x = trace.tensor(t);
            if x.global || x.kind == TensorKind::Gradient && is_shard(x) {
                bytes += x.bytes;
            }
        }
    }
    bytes
}

/// A rank's gradient shard (the tensor the reduce-scatters make), not a micro-batch's unsharded
/// gradient.
fn is_shard(t: &Tensor) -> bool {
    !t.name.ends_with(".unsharded")
}
