//! Plan selection: the one entry point ([`choose`]) that turns a trace, a hardware model and a
//! GPU budget into the plan a front end runs, with the rules that pick and adjust it. `teraio
//! plan`, `simulate` and `analyze`, the C ABI (`teraio_select`) and teraio.torch's `Session`
//! (through `teraio.select`) all call it; none of them holds a rule of its own.
//!
//! The rules, in the order [`choose`] applies them:
//! 1. **The budget** ([`Budget::resolve`]): the bytes the executor accounts against are the GPU
//!    budget less an [`Allowance`] (what the trainer's allocator needs beside the plan's
//!    tensors) and less the bytes others hold beside the plan (FSDP's unsharded parameters);
//!    plans are made for that less a margin ([`Budget::plan_margin`]).
//! 2. **Working sets**: a kernel whose inputs, outputs and workspace (its working set, as
//!    traced) exceed the whole budget can never run under it: [`Error::GpuMemoryTooSmall`]
//!    names it, its bytes and the budget, before anything is planned. A kernel that fits the
//!    budget is planned: where the allowance or the margin would leave less than the largest
//!    working set, both budgets are raised ([`Budgets::raised_to_working_set`]): under the fixed
//!    rule to the budget less the largest tensor once (instead of twice) where that holds the
//!    working set, else to the working set and [`WORKING_SET_SLACK`] of it, within the budget.
//!    (Raised to exactly the working set, a plan has no byte to spare at that kernel: the zoo's
//!    GPT-2 and GPT-NeoX at 1/2.5 of their peaks found no plan, 8 bytes short.)
//! 3. **The plan** of the policy ([`crate::plan_checked`]: checked in the simulator).
//! 4. **A second plan for slower transfers** ([`SelectOptions::traffic_margin`]): the trace is
//!    planned again as if every transfer were [`SLOWER_TRANSFERS`] as fast, and that plan is
//!    taken when it moves fewer bytes and simulates (on the model as given) within the margin
//!    of the first: on a GPU the copies slow the kernels beside them, so of two plans the model
//!    finds about as fast, the one that moves less runs faster.
//! 5. **Paging** ([`SelectOptions::paging_fallback`]): where the policy's plan does not run
//!    (out of memory or tier space in the simulator), the pager's own schedule as a plan
//!    (on-demand eviction by last use, tensors waiting to be freed included) is one more
//!    candidate; when it runs within the budget and the tiers, it is the plan
//!    ([`Choice::Paging`]), instead of a refusal.

use serde::{Deserialize, Serialize};

use crate::hardware::Hardware;
use crate::plan::Plan;
use crate::planner::{self, PlanOptions, Policy};
use crate::sim::{Outcome, SimOptions, SimReport};
use crate::trace::Trace;
use crate::{Error, Result};

/// How fast, relative to the model, the second plan assumes every transfer
/// ([`SelectOptions::traffic_margin`]).
pub const SLOWER_TRANSFERS: f64 = 0.7;

/// What a budget raised to the largest working set adds to it, as a share of it (within the
/// budget): the working set is the kernel's own tensors, and a plan may hold a few bytes more
/// there (a scalar it keeps: the zoo's GPT-NeoX at 1/2.5 of its peak ran out by 8 bytes at
/// exactly the working set).
pub const WORKING_SET_SLACK: f64 = 0.01;

/// The share of the budget a GPU plan keeps under [`Allowance::Fixed`] by default
/// (teraio.torch's `page_fraction`).
pub const KEEP_FRACTION_DEFAULT: f64 = 0.85;

/// What the trainer's memory allocator needs beside the plan's tensors, within the budget.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Allowance {
    /// Nothing: the plan's tensors are all the memory (the CLI's model, CPU memory, the
    /// emulated GPU, where the executor's accounting is the memory).
    None,
    /// The fixed rule (a GPU without a measurement): plans keep `keep_fraction` of the budget,
    /// and stay below it by twice the trace's largest tensor where that is less than half the
    /// budget (the caching allocator must place that tensor beside everything else, its blocks
    /// rounded and scattered: bf16 GPT on an H200 at a 4 GiB cap ran out of memory at 0.85
    /// and runs at 0.75, docs/BENCHMARKS.md). Where that leaves less than the largest working
    /// set, by the largest tensor once ([`Budget::resolve`]).
    Fixed {
        /// Share of the budget the plan may hold, in (0, 1].
        keep_fraction: f64,
    },
    /// Measured: the allocator needed this many bytes beside the traced tensors in a
    /// profiled step (on a GPU: the caching allocator's reserved-minus-allocated peak and
    /// the allocations the trace does not see, such as library workspaces).
    Measured {
        /// Bytes kept free beside the plan.
        bytes: u64,
    },
}

/// The GPU budget and what it must hold beside the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Budget {
    /// The memory the iteration may use, bytes (> 0).
    pub gpu_budget_bytes: u64,
    /// What the allocator needs beside the plan.
    pub allowance: Allowance,
    /// Bytes others hold beside the plan's tensors (FSDP's unsharded parameters).
    pub reserved_bytes: u64,
    /// Plans are made for this fraction less than the executor's budget, in [0, 0.5).
    pub plan_margin: f64,
}

impl Budget {
    /// The whole of `gpu_budget_bytes` for the plan (the CLI's and the C ABI's model).
    pub fn whole(gpu_budget_bytes: u64) -> Budget {
        Budget { gpu_budget_bytes, allowance: Allowance::None, reserved_bytes: 0, plan_margin: 0.0 }
    }

    fn check(&self) -> Result<()> {
        if self.gpu_budget_bytes == 0 {
            return Err(Error::InvalidArgument(
                "the GPU budget must be > 0 bytes (gpu_budget_bytes)".into(),
            ));
        }
        if !(self.plan_margin.is_finite() && (0.0..0.5).contains(&self.plan_margin)) {
            return Err(Error::InvalidArgument(format!(
                "plan_margin must be in [0, 0.5), got {}",
                self.plan_margin
            )));
        }
        if let Allowance::Fixed { keep_fraction } = self.allowance
            && !(keep_fraction.is_finite() && keep_fraction > 0.0 && keep_fraction <= 1.0)
        {
            return Err(Error::InvalidArgument(format!(
                "the fixed allowance's keep_fraction (page_fraction) must be in (0, 1], got \
                 {keep_fraction}"
            )));
        }
        Ok(())
    }

    /// The bytes the executor accounts against, given the trace's largest tensor (the fixed
    /// rule's headroom is twice it). At least 1.
    pub fn executor_bytes(&self, largest_tensor_bytes: u64) -> u64 {
        let budget = self.gpu_budget_bytes;
        let mut b = match self.allowance {
            Allowance::None => budget,
            Allowance::Fixed { keep_fraction } => {
                let mut b = self.kept(keep_fraction);
                let headroom = largest_tensor_bytes.saturating_mul(2);
                if headroom > 0 && headroom < budget / 2 {
                    b = b.min(budget - headroom);
                }
                b
            }
            Allowance::Measured { bytes } => budget.saturating_sub(bytes),
        };
        if self.reserved_bytes > 0 {
            b = b.saturating_sub(self.reserved_bytes);
        }
        b.max(1)
    }

    /// The executor's bytes where the allowance leaves less than the largest working set `ws`
    /// (which fits the budget): under [`Allowance::Fixed`], the room for the largest tensor once
    /// instead of twice (within the kept fraction) where that holds `ws`; else (and under the
    /// others: a measured allowance is what the allocator was seen to need) `ws` and
    /// [`WORKING_SET_SLACK`] of it, within the budget.
    fn raised_executor_bytes(&self, largest_tensor_bytes: u64, ws: u64) -> u64 {
        let once = match self.allowance {
            Allowance::Fixed { keep_fraction } => self
                .kept(keep_fraction)
                .min(self.gpu_budget_bytes.saturating_sub(largest_tensor_bytes))
                .saturating_sub(self.reserved_bytes),
            Allowance::None | Allowance::Measured { .. } => 0,
        };
        let capacity = self.gpu_budget_bytes.saturating_sub(self.reserved_bytes);
        let slack = (ws as f64 * WORKING_SET_SLACK) as u64;
        // `resolve` refused a `ws` above `capacity`, so this is at least `ws`.
        once.max(ws.saturating_add(slack).min(capacity))
    }

    /// The fixed rule's kept share of the budget.
    fn kept(&self, keep_fraction: f64) -> u64 {
        (self.gpu_budget_bytes as f64 * keep_fraction) as u64
    }

    /// The bytes plans are made for, given the executor's: that less the margin. At least 1.
    pub fn planning_bytes(&self, executor_bytes: u64) -> u64 {
        ((executor_bytes as f64 * (1.0 - self.plan_margin)) as u64).max(1)
    }

    /// The budgets for `trace`: the executor's and the planning one, raised where the
    /// allowance or the margin would leave less than the largest working set (to it, or under
    /// the fixed rule to the room for the largest tensor once where that holds it: see
    /// [`Allowance::Fixed`]). A kernel whose working set exceeds the budget (less what others
    /// hold) is [`Error::GpuMemoryTooSmall`].
    pub fn resolve(&self, trace: &Trace) -> Result<Budgets> {
        self.check()?;
        let largest = trace.tensors.iter().map(|t| t.bytes).max().unwrap_or(0);
        let (kernel, ws) = crate::analysis::largest_working_set(trace);
        let capacity = self.gpu_budget_bytes.saturating_sub(self.reserved_bytes).max(1);
        if ws > capacity {
            return Err(Error::GpuMemoryTooSmall {
                kernel,
                name: trace.kernels.get(kernel).map_or_else(String::new, |k| k.name.clone()),
                needed_bytes: ws,
                capacity_bytes: capacity,
            });
        }
        let mut executor = self.executor_bytes(largest);
        let raised = self.planning_bytes(executor) < ws;
        if executor < ws {
            executor = self.raised_executor_bytes(largest, ws);
        }
        let planning = self.planning_bytes(executor).max(ws);
        Ok(Budgets {
            gpu_budget_bytes: self.gpu_budget_bytes,
            executor_bytes: executor,
            planning_bytes: planning,
            allowance_bytes: self
                .gpu_budget_bytes
                .saturating_sub(self.reserved_bytes)
                .saturating_sub(executor),
            working_set_bytes: ws,
            working_set_kernel: kernel,
            raised_to_working_set: raised,
        })
    }
}

/// The budgets [`Budget::resolve`] found for a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budgets {
    /// The GPU budget, bytes.
    pub gpu_budget_bytes: u64,
    /// What the executor accounts against, bytes.
    pub executor_bytes: u64,
    /// What the plan was made for, bytes (<= `executor_bytes`).
    pub planning_bytes: u64,
    /// Bytes of the budget left to the allocator beside the plan (and what others hold).
    pub allowance_bytes: u64,
    /// The trace's largest working set, bytes, and its kernel.
    pub working_set_bytes: u64,
    /// The kernel of the largest working set.
    pub working_set_kernel: usize,
    /// The allowance or the margin would have left less than the largest working set: both
    /// budgets were raised to it (the kernel fits the budget, so it is planned).
    pub raised_to_working_set: bool,
}

/// Options of [`choose`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SelectOptions {
    /// The planning policy.
    pub policy: Policy,
    /// The planner's options.
    pub plan: PlanOptions,
    /// The budget (for the CLI: [`Budget::whole`] of the hardware's GPU memory).
    pub budget: Budget,
    /// The second plan for slower transfers: taken when it moves fewer bytes and simulates
    /// within this fraction of the first; 0: not made. In [0, 1).
    pub traffic_margin: f64,
    /// Where the policy's plan does not run, the pager's schedule as a plan is a candidate.
    pub paging_fallback: bool,
}

impl SelectOptions {
    /// `policy` with the default planner options, the whole of `gpu_budget_bytes`, no second
    /// plan, and the paging fallback for `auto` (a named policy is that policy's plan or a
    /// refusal): what `teraio plan` does.
    pub fn cli(policy: Policy, plan: PlanOptions, gpu_budget_bytes: u64) -> SelectOptions {
        SelectOptions {
            policy,
            plan,
            budget: Budget::whole(gpu_budget_bytes),
            traffic_margin: 0.0,
            paging_fallback: policy == Policy::Auto,
        }
    }
}

/// Which rule gave the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Choice {
    /// The policy's plan on the model as given.
    AsModelled,
    /// The plan made for slower transfers (it moves less, about as fast).
    SlowerTransfers,
    /// The pager's schedule: the policy's plan did not run.
    Paging,
}

/// A plan [`choose`] considered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    /// `as modelled`, `planned for slower transfers` or `paging`.
    pub name: String,
    /// The plan's policy name, when one was made.
    pub policy: Option<String>,
    /// Its simulated iteration on the model as given, us (None: it did not complete).
    pub iteration_time_us: Option<f64>,
    /// Bytes it offloads per iteration (SSD and host).
    pub moved_bytes: Option<u64>,
    /// Why it was refused, if it was.
    pub refused: Option<String>,
    /// It is the plan chosen.
    pub chosen: bool,
}

/// The figures of the second plan for slower transfers, as teraio.torch's steps report them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Traffic {
    /// `planned for slower transfers` or `as modelled`.
    pub chosen: String,
    /// The first plan's simulated iteration, seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub modelled_s: Option<f64>,
    /// The bytes the first plan offloads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub modelled_moved_bytes: Option<u64>,
    /// The second plan's simulated iteration (on the model as given), seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slower_transfers_s: Option<f64>,
    /// The bytes the second plan offloads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slower_transfers_moved_bytes: Option<u64>,
    /// `none (why)` when no second plan was made.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alternative: Option<String>,
}

/// What [`choose`] returns.
#[derive(Debug, Clone)]
pub struct Selection {
    /// The plan to run.
    pub plan: Plan,
    /// Its simulation on the planning budget (two iterations, the second reported).
    pub report: SimReport,
    /// The budgets: the executor runs the plan with `executor_bytes`.
    pub budgets: Budgets,
    /// Which rule gave the plan.
    pub choice: Choice,
    /// Why, in a sentence for a log line.
    pub why: String,
    /// Every plan considered, the chosen one marked.
    pub alternatives: Vec<Alternative>,
    /// The second plan's figures, when one was made (or tried).
    pub traffic: Option<Traffic>,
}

/// Bytes a plan offloads per iteration (SSD and host tier).
pub fn moved_bytes(plan: &Plan) -> u64 {
    plan.stats.ssd_offload_bytes + plan.stats.host_offload_bytes
}

/// `hw` with every transfer rate [`SLOWER_TRANSFERS`] as fast.
pub fn slower_transfers(hw: &Hardware) -> Hardware {
    let mut h = hw.clone();
    let f = SLOWER_TRANSFERS;
    h.ssd_read_bytes_per_s *= f;
    h.ssd_write_bytes_per_s *= f;
    h.pcie_h2d_bytes_per_s *= f;
    h.pcie_d2h_bytes_per_s *= f;
    h.host_memory_bytes_per_s *= f;
    h.ssd_duplex_bytes_per_s = h.ssd_duplex_bytes_per_s.map(|r| r * f);
    h.pcie_duplex_bytes_per_s = h.pcie_duplex_bytes_per_s.map(|r| r * f);
    h
}

/// The rule of the second plan: take it when it completed, moves fewer bytes than the first,
/// and its simulated iteration is within `margin` of the first's.
pub fn takes_slower_transfers_plan(
    first_us: f64,
    first_moved: u64,
    second: Option<(bool, f64, u64)>,
    margin: f64,
) -> bool {
    second.is_some_and(|(completed, us, moved)| {
        completed && moved < first_moved && us <= first_us * (1.0 + margin)
    })
}

fn completed_us(r: &SimReport) -> Option<f64> {
    (r.outcome == Outcome::Completed).then_some(r.iteration_time_us)
}

/// Whether a simulation ran within the GPU memory and every tier.
fn runs(r: &SimReport) -> bool {
    r.outcome == Outcome::Completed && !r.ssd_cap_exceeded && !r.host_cap_exceeded
}

/// The pager's schedule as a plan on `hw`, simulated; None where it does not run.
fn paging_plan(trace: &Trace, hw: &Hardware) -> Result<Option<(Plan, SimReport)>> {
    let mut p = planner::lru::plan_paging(trace, hw);
    p.mark_clean_drops(trace)?;
    let r = crate::sim::simulate(trace, &p, hw, &SimOptions::default())?;
    if !runs(&r) {
        return Ok(None);
    }
    p.stats.peak_ssd_bytes = r.peak_ssd_bytes;
    p.stats.peak_host_bytes = r.peak_host_bytes;
    Ok(Some((p, r)))
}

/// Choose the plan for `trace` on `hw` under `opts` (the rules: the module documentation).
/// `hw.gpu_memory_bytes` is ignored: the budget is `opts.budget`. Errors: a kernel that can
/// never fit ([`Error::GpuMemoryTooSmall`]), and, where no candidate runs, the policy's own
/// refusal ([`Error::PlanOutOfMemory`], [`Error::TierTooSmall`]).
pub fn choose(trace: &Trace, hw: &Hardware, opts: &SelectOptions) -> Result<Selection> {
    trace.validate()?;
    if !(opts.traffic_margin.is_finite() && (0.0..1.0).contains(&opts.traffic_margin)) {
        return Err(Error::InvalidArgument(format!(
            "traffic_margin must be in [0, 1), got {}",
            opts.traffic_margin
        )));
    }
    let mut budgets = if opts.policy == Policy::Ideal {
        // (unlimited memory: nothing to check against)
        let b = opts.budget.gpu_budget_bytes.max(1);
        let (kernel, ws) = crate::analysis::largest_working_set(trace);
        Budgets {
            gpu_budget_bytes: b,
            executor_bytes: b,
            planning_bytes: b,
            allowance_bytes: 0,
            working_set_bytes: ws,
            working_set_kernel: kernel,
            raised_to_working_set: false,
        }
    } else {
        opts.budget.resolve(trace)?
    };
    let mut planning = hw.clone();
    planning.gpu_memory_bytes = budgets.planning_bytes;
    planning.validate()?;
    let mut alternatives = Vec::new();
    let first = planner::plan_checked(trace, &planning, opts.policy, &opts.plan);
    let checked = match first {
        Ok(c) => c,
        Err(e @ (Error::PlanOutOfMemory { .. } | Error::TierTooSmall { .. }))
            if opts.paging_fallback && !matches!(opts.policy, Policy::None | Policy::Ideal) =>
        {
            alternatives.push(Alternative {
                name: "as modelled".into(),
                policy: Some(opts.policy.to_string()),
                iteration_time_us: None,
                moved_bytes: None,
                refused: Some(e.to_string()),
                chosen: false,
            });
            // The pager's schedule, for the planning budget, else for the executor's.
            let mut tries = vec![budgets.planning_bytes];
            if budgets.executor_bytes > budgets.planning_bytes {
                tries.push(budgets.executor_bytes);
            }
            for bytes in tries {
                let mut h = hw.clone();
                h.gpu_memory_bytes = bytes;
                if let Some((plan, report)) = paging_plan(trace, &h)? {
                    alternatives.push(Alternative {
                        name: "paging".into(),
                        policy: Some(plan.policy.clone()),
                        iteration_time_us: completed_us(&report),
                        moved_bytes: Some(moved_bytes(&plan)),
                        refused: None,
                        chosen: true,
                    });
                    budgets.planning_bytes = bytes;
                    let why = format!(
                        "the {} plan does not run ({e}); the pager's schedule as a plan does, \
                         within {bytes} bytes",
                        opts.policy
                    );
                    return Ok(Selection {
                        plan,
                        report,
                        budgets,
                        choice: Choice::Paging,
                        why,
                        alternatives,
                        traffic: None,
                    });
                }
            }
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    let first_us = checked.report.iteration_time_us;
    let first_moved = moved_bytes(&checked.plan);
    let mut first_alt = Alternative {
        name: "as modelled".into(),
        policy: Some(checked.plan.policy.clone()),
        iteration_time_us: completed_us(&checked.report),
        moved_bytes: Some(first_moved),
        refused: None,
        chosen: true,
    };
    if opts.traffic_margin <= 0.0 {
        alternatives.push(first_alt);
        let why = format!("the {} plan, checked in the simulator", opts.policy);
        return Ok(Selection {
            plan: checked.plan,
            report: checked.report,
            budgets,
            choice: Choice::AsModelled,
            why,
            alternatives,
            traffic: None,
        });
    }
    let slow = slower_transfers(&planning);
    let second = match planner::plan_checked(trace, &slow, opts.policy, &opts.plan) {
        Ok(c) => c,
        Err(e) => {
            alternatives.push(first_alt);
            alternatives.push(Alternative {
                name: "planned for slower transfers".into(),
                policy: None,
                iteration_time_us: None,
                moved_bytes: None,
                refused: Some(e.to_string()),
                chosen: false,
            });
            return Ok(Selection {
                plan: checked.plan,
                report: checked.report,
                budgets,
                choice: Choice::AsModelled,
                why: format!(
                    "the {} plan, checked in the simulator (none for slower transfers: {e})",
                    opts.policy
                ),
                alternatives,
                traffic: Some(Traffic {
                    chosen: "as modelled".into(),
                    modelled_s: None,
                    modelled_moved_bytes: None,
                    slower_transfers_s: None,
                    slower_transfers_moved_bytes: None,
                    alternative: Some(format!("none ({e})")),
                }),
            });
        }
    };
    // Both on the model as given.
    let second_report =
        crate::sim::simulate(trace, &second.plan, &planning, &SimOptions::default())?;
    let second_moved = moved_bytes(&second.plan);
    let completed = second_report.outcome == Outcome::Completed;
    let take = takes_slower_transfers_plan(
        first_us,
        first_moved,
        Some((completed, second_report.iteration_time_us, second_moved)),
        opts.traffic_margin,
    );
    let traffic = Traffic {
        chosen: if take { "planned for slower transfers" } else { "as modelled" }.into(),
        modelled_s: Some(first_us / 1e6),
        modelled_moved_bytes: Some(first_moved),
        slower_transfers_s: Some(second_report.iteration_time_us / 1e6),
        slower_transfers_moved_bytes: Some(second_moved),
        alternative: None,
    };
    first_alt.chosen = !take;
    alternatives.push(first_alt);
    alternatives.push(Alternative {
        name: "planned for slower transfers".into(),
        policy: Some(second.plan.policy.clone()),
        iteration_time_us: completed_us(&second_report),
        moved_bytes: Some(second_moved),
        refused: None,
        chosen: take,
    });
    let (plan, report, choice, why) = if take {
        let why = format!(
            "planned for slower transfers: {second_moved} bytes moved instead of {first_moved}, \
             {:+.1}% in the model",
            100.0 * (second_report.iteration_time_us / first_us - 1.0)
        );
        (second.plan, second_report, Choice::SlowerTransfers, why)
    } else {
        let why = format!(
            "the {} plan, checked in the simulator (the one for slower transfers moves \
             {second_moved} bytes, {:+.1}% in the model)",
            opts.policy,
            100.0 * (second_report.iteration_time_us / first_us - 1.0)
        );
        (checked.plan, checked.report, Choice::AsModelled, why)
    };
    Ok(Selection { plan, report, budgets, choice, why, alternatives, traffic: Some(traffic) })
}

/// Headrooms (percent of the capacity) [`choose_with_headroom`] plans for in turn.
pub const REPLAY_HEADROOM_PERCENT: [u64; 6] = [0, 5, 10, 15, 20, 30];

/// `teraio run`'s rule (its emulated replay runs the plan as made, without a check beside it):
/// `policy`'s plan for `capacity` bytes of GPU memory, simulated on `hw` (timeline recorded);
/// where it does not complete, planned again for [`REPLAY_HEADROOM_PERCENT`] less, the
/// difference left as headroom. Returns the plan, its simulation and the headroom (percent):
/// the last attempt when none completes (the caller says where it runs out).
pub fn choose_with_headroom(
    trace: &Trace,
    hw: &Hardware,
    capacity: u64,
    policy: Policy,
) -> Result<(Plan, SimReport, u64)> {
    let mut attempt = None;
    for headroom_percent in REPLAY_HEADROOM_PERCENT {
        let mut planning_hw = hw.clone();
        planning_hw.gpu_memory_bytes = capacity * (100 - headroom_percent) / 100;
        let p = planner::plan(trace, &planning_hw, policy)?;
        let sim = crate::sim::simulate(
            trace,
            &p,
            hw,
            &SimOptions { iterations: 2, record_timeline: true },
        )?;
        let fits = sim.outcome == Outcome::Completed;
        attempt = Some((p, sim, headroom_percent));
        if fits {
            break;
        }
    }
    Ok(attempt.expect("at least one attempt"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ModelConfig, generate};
    use crate::trace::{Kernel, Tensor, TensorId, TensorKind};

    const GB: u64 = 1_000_000_000;

    fn tensor(id: u32, bytes: u64, global: bool, accesses: Vec<usize>, dies: usize) -> Tensor {
        Tensor {
            id: TensorId(id),
            name: format!("t{id}"),
            bytes,
            kind: if global { TensorKind::Weight } else { TensorKind::Activation },
            global,
            created_by: (!global).then_some(accesses[0]),
            dies_after: (!global).then_some(dies),
            writes: Some(if global { Vec::new() } else { vec![accesses[0]] }),
            accesses,
            producer: None,
        }
    }

    /// Kernels 0..5 of 1 ms. `a` (1 GB) is made and used by kernel 0 and freed only after
    /// kernel 3 (it waits to be freed, as a result the trainer still holds); `b` (1 GB) lives
    /// at kernel 2; `w` (0.1 GB, global) is read by every kernel. At 1.5 GB, kernel 2 needs `a`
    /// out of the way: no interval of `a` is left to plan, and `lru` keeps it; the pager moves
    /// it out.
    fn waiting_case() -> (Trace, Hardware) {
        let mut t = Trace::new("waiting");
        t.kernels = (0..5)
            .map(|i| Kernel { name: format!("k{i}"), duration_us: 1000.0, layer: None })
            .collect();
        t.tensors.push(tensor(0, GB / 10, true, vec![0, 1, 2, 3, 4], 0));
        t.tensors.push(tensor(1, GB, false, vec![0], 3));
        t.tensors.push(tensor(2, GB, false, vec![2], 2));
        t.validate().unwrap();
        let mut hw = Hardware::paper();
        hw.host_memory_cap_bytes = 0;
        hw.gpu_memory_bytes = GB * 3 / 2;
        (t, hw)
    }

    fn squeezed_gpt(frac: f64) -> (Trace, Hardware) {
        let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
        cfg.micro_batch = 2;
        let trace = generate(&cfg).unwrap();
        let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap();
        let mut hw = Hardware::paper();
        hw.gpu_memory_bytes = (peak as f64 * frac) as u64;
        (trace, hw)
    }

    #[test]
    fn the_cli_selection_is_plan_checked_for_every_policy() {
        let (trace, hw) = squeezed_gpt(0.5);
        for policy in [Policy::Auto, Policy::Teraio, Policy::Lru, Policy::G10, Policy::Ideal] {
            let opts = PlanOptions::default();
            let old = planner::plan_checked(&trace, &hw, policy, &opts).unwrap();
            let sel = choose(&trace, &hw, &SelectOptions::cli(policy, opts, hw.gpu_memory_bytes))
                .unwrap();
            assert_eq!(sel.plan.to_json(), old.plan.to_json(), "{policy}");
            assert_eq!(sel.report, old.report, "{policy}");
            assert_eq!(sel.choice, Choice::AsModelled);
            assert_eq!(sel.budgets.executor_bytes, hw.gpu_memory_bytes);
            assert_eq!(sel.budgets.planning_bytes, hw.gpu_memory_bytes);
        }
    }

    #[test]
    fn a_named_policy_that_does_not_run_is_refused_as_before() {
        let (trace, hw) = squeezed_gpt(0.5);
        let old = planner::plan_checked(&trace, &hw, Policy::None, &PlanOptions::default())
            .unwrap_err()
            .to_string();
        let opts = SelectOptions::cli(Policy::None, PlanOptions::default(), hw.gpu_memory_bytes);
        let e = choose(&trace, &hw, &opts).unwrap_err().to_string();
        assert_eq!(e, old);
        assert!(e.contains("runs out of GPU memory at kernel"), "{e}");
    }

    #[test]
    fn where_every_plan_is_refused_the_pagers_schedule_runs_within_the_budget() {
        let (trace, hw) = waiting_case();
        let opts = PlanOptions::default();
        // Before: refused.
        let e = planner::plan_checked(&trace, &hw, Policy::Auto, &opts).unwrap_err();
        assert!(matches!(e, Error::PlanOutOfMemory { kernel: 2, .. }), "{e}");
        // Now: the pager's schedule, and the simulator runs it within the budget.
        let sel = choose(&trace, &hw, &SelectOptions::cli(Policy::Auto, opts, hw.gpu_memory_bytes))
            .unwrap();
        assert_eq!(sel.choice, Choice::Paging);
        assert_eq!(sel.plan.policy, "paging");
        assert!(sel.why.contains("does not run") && sel.why.contains("pager"), "{}", sel.why);
        sel.plan.validate(&trace).unwrap();
        let r = crate::sim::simulate(&trace, &sel.plan, &hw, &SimOptions::default()).unwrap();
        assert_eq!(r.outcome, Outcome::Completed);
        assert!(r.peak_gpu_bytes <= hw.gpu_memory_bytes, "{}", r.peak_gpu_bytes);
        assert!(!r.ssd_cap_exceeded && !r.host_cap_exceeded);
        assert_eq!(r, sel.report);
        // `a` goes out after its last use and dies on the SSD.
        assert!(sel.plan.instructions.iter().any(|i| i.tensor == TensorId(1)));
        assert_eq!(sel.alternatives.len(), 2);
        assert!(sel.alternatives[0].refused.is_some() && !sel.alternatives[0].chosen);
        assert!(sel.alternatives[1].chosen);
        // Without the fallback (a named policy): refused as before.
        let named = SelectOptions {
            paging_fallback: false,
            ..SelectOptions::cli(Policy::Auto, PlanOptions::default(), hw.gpu_memory_bytes)
        };
        assert!(matches!(choose(&trace, &hw, &named), Err(Error::PlanOutOfMemory { .. })));
    }

    #[test]
    fn the_paging_plan_leaves_alone_tensors_that_live_to_the_last_kernel() {
        // `a` lives to the last kernel (a trainer may read it after the step): not moved, so
        // nothing fits.
        let (mut trace, hw) = waiting_case();
        trace.tensors[1].dies_after = Some(4);
        trace.validate().unwrap();
        let opts = SelectOptions::cli(Policy::Auto, PlanOptions::default(), hw.gpu_memory_bytes);
        assert!(matches!(choose(&trace, &hw, &opts), Err(Error::PlanOutOfMemory { .. })));
    }

    #[test]
    fn the_paging_plan_holds_its_host_tier_and_frees_it_at_the_death() {
        let (trace, mut hw) = waiting_case();
        hw.ssd_count = 0;
        hw.host_memory_cap_bytes = GB + GB / 10;
        let opts = SelectOptions::cli(Policy::Auto, PlanOptions::default(), hw.gpu_memory_bytes);
        let sel = choose(&trace, &hw, &opts).unwrap();
        assert_eq!(sel.choice, Choice::Paging);
        let r = crate::sim::simulate(&trace, &sel.plan, &hw, &SimOptions::default()).unwrap();
        assert_eq!(r.outcome, Outcome::Completed);
        assert!(r.peak_host_bytes <= hw.host_memory_cap_bytes && !r.host_cap_exceeded);
    }

    #[test]
    fn a_kernel_that_can_never_fit_is_named_with_its_bytes_and_the_budget() {
        let (trace, hw) = waiting_case();
        let budget = Budget::whole(GB);
        let opts = SelectOptions {
            budget,
            ..SelectOptions::cli(Policy::Auto, PlanOptions::default(), GB)
        };
        let e = choose(&trace, &hw, &opts).unwrap_err();
        let Error::GpuMemoryTooSmall { kernel, name, needed_bytes, capacity_bytes } = &e else {
            panic!("{e}");
        };
        assert_eq!((*kernel, name.as_str()), (0, "k0"));
        assert_eq!((*needed_bytes, *capacity_bytes), (GB + GB / 10, GB));
        let text = e.to_string();
        assert!(text.contains("kernel 0 (k0)") && text.contains("1100000000"), "{text}");
        // What others hold beside the plan counts against it too.
        let opts = SelectOptions {
            budget: Budget { reserved_bytes: GB, ..Budget::whole(2 * GB) },
            ..SelectOptions::cli(Policy::Auto, PlanOptions::default(), GB)
        };
        assert!(matches!(choose(&trace, &hw, &opts), Err(Error::GpuMemoryTooSmall { .. })));
    }

    #[test]
    fn the_fixed_allowance_keeps_a_fraction_and_twice_the_largest_tensor() {
        // teraio.torch's rule, as it was in session.py (`plan_budget`).
        let b = 1_000_000u64;
        let fixed =
            Budget { allowance: Allowance::Fixed { keep_fraction: 0.85 }, ..Budget::whole(b) };
        assert_eq!(Budget::whole(b).executor_bytes(b), b);
        assert_eq!(fixed.executor_bytes(0), 850_000);
        assert_eq!(fixed.executor_bytes(b / 20), 850_000); // a small largest tensor: the fraction
        assert_eq!(fixed.executor_bytes(b / 5), b - 2 * (b / 5)); // a large one: twice it free
        assert_eq!(fixed.executor_bytes(b / 2), 850_000); // no room for it at all: the fraction
        let fsdp = Budget { reserved_bytes: 100_000, ..fixed.clone() };
        assert_eq!(fsdp.executor_bytes(0), 750_000);
        let margin = Budget { plan_margin: 0.1, ..Budget::whole(b) };
        assert_eq!(margin.planning_bytes(margin.executor_bytes(0)), 900_000);
        let measured =
            Budget { allowance: Allowance::Measured { bytes: 12_345 }, ..Budget::whole(b) };
        assert_eq!(measured.executor_bytes(b / 5), b - 12_345);
        let bad = Budget { allowance: Allowance::Fixed { keep_fraction: 1.5 }, ..Budget::whole(b) };
        assert!(bad.check().unwrap_err().to_string().contains("keep_fraction"));
        let bad = Budget { plan_margin: 0.5, ..Budget::whole(b) };
        assert!(bad.check().unwrap_err().to_string().contains("plan_margin"));
    }

    #[test]
    fn a_kernel_that_fits_the_budget_is_planned_when_the_allowance_would_leave_too_little() {
        let (trace, mut hw) = waiting_case();
        // The largest working set is 1.1 GB; the fixed rule at 1.2 GB keeps 0.85 of it, 1.02.
        let budget = GB * 6 / 5;
        hw.gpu_memory_bytes = budget;
        let b =
            Budget { allowance: Allowance::Fixed { keep_fraction: 0.85 }, ..Budget::whole(budget) };
        assert!(b.executor_bytes(GB) < GB + GB / 10);
        let got = b.resolve(&trace).unwrap();
        assert!(got.raised_to_working_set);
        // (the room for the 1 GB largest tensor once does not hold it: the working set and 1%)
        let raised = GB + GB / 10 + (GB + GB / 10) / 100;
        assert_eq!((got.executor_bytes, got.planning_bytes), (raised, raised));
        assert_eq!(got.allowance_bytes, budget - raised);
        let opts = SelectOptions {
            budget: b,
            ..SelectOptions::cli(Policy::Auto, PlanOptions::default(), budget)
        };
        let sel = choose(&trace, &hw, &opts).unwrap();
        let mut at = hw.clone();
        at.gpu_memory_bytes = sel.budgets.planning_bytes;
        let r = crate::sim::simulate(&trace, &sel.plan, &at, &SimOptions::default()).unwrap();
        assert_eq!(r.outcome, Outcome::Completed);
        assert!(r.peak_gpu_bytes <= sel.budgets.executor_bytes);
    }

    #[test]
    fn a_raised_budget_keeps_room_for_the_largest_tensor_once_where_the_budget_has_it() {
        // The zoo's GPT-2 200 M in fp32 at 1/2.5 of its peak: the logits' log-softmax backward
        // holds three tensors of the largest size L (1.65 GB) in a 7.54 GB budget (4.58 L).
        // Twice L free leaves 2.58 L, under the 3 L working set; raised to exactly 3 L, no
        // plan had a byte to spare there. Once L free leaves 3.58 L: that is the budget.
        let l = 1_646_821_376u64;
        let mut t = Trace::new("logits");
        t.kernels = (0..4)
            .map(|i| Kernel { name: format!("k{i}"), duration_us: 1000.0, layer: None })
            .collect();
        t.tensors.push(tensor(0, l / 10, true, vec![0, 3], 0));
        t.tensors.push(tensor(1, l, false, vec![0, 2], 2));
        t.tensors.push(tensor(2, l, false, vec![1, 2], 2));
        t.tensors.push(tensor(3, l, false, vec![2, 3], 3));
        t.validate().unwrap();
        let fixed = |budget: u64, reserved: u64| Budget {
            allowance: Allowance::Fixed { keep_fraction: KEEP_FRACTION_DEFAULT },
            reserved_bytes: reserved,
            ..Budget::whole(budget)
        };
        let budget = 7_535_917_875u64;
        let b = fixed(budget, 0);
        assert!(b.executor_bytes(l) < 3 * l);
        let got = b.resolve(&t).unwrap();
        assert_eq!(got.working_set_bytes, 3 * l);
        assert!(got.raised_to_working_set);
        assert_eq!((got.executor_bytes, got.planning_bytes), (budget - l, budget - l));
        assert_eq!(got.allowance_bytes, l);
        // Bytes others hold come off it too.
        let got = fixed(budget, l / 4).resolve(&t).unwrap();
        assert_eq!((got.executor_bytes, got.allowance_bytes), (budget - l - l / 4, l));
        // Where the budget less L no longer holds the working set: the working set and 1%.
        let slack = (3 * l) / 100;
        let got = fixed(3 * l + l / 2, 0).resolve(&t).unwrap();
        assert_eq!(got.executor_bytes, 3 * l + slack);
        // ... within the budget.
        let got = fixed(3 * l + slack / 2, 0).resolve(&t).unwrap();
        assert_eq!((got.executor_bytes, got.allowance_bytes), (3 * l + slack / 2, 0));
        // Under the fraction: never above what it keeps.
        let frac =
            Budget { allowance: Allowance::Fixed { keep_fraction: 0.75 }, ..Budget::whole(budget) };
        assert_eq!(frac.resolve(&t).unwrap().executor_bytes, (budget as f64 * 0.75) as u64);
        // A measured allowance is raised to the working set (and 1%) only.
        let measured = Budget {
            allowance: Allowance::Measured { bytes: budget / 2 },
            ..Budget::whole(budget)
        };
        assert_eq!(measured.resolve(&t).unwrap().executor_bytes, 3 * l + slack);
    }

    #[test]
    fn the_second_plan_rule() {
        // (moved, simulated time relative to the first, refused) -> taken, at a 3% margin:
        // the cases of the Python test this rule came from.
        let cases = [
            (1_000, 1.02, false, true),  // moves less, 2% slower: taken
            (1_000, 1.04, false, false), // 4% slower: not taken
            (9_000, 0.99, false, false), // faster, but moves as much or more: not taken
            (1_000, 1.00, true, false),  // no plan for slower transfers: the first one
        ];
        for (moved, rel, refused, taken) in cases {
            let second = (!refused).then_some((true, rel * 1e6, moved));
            assert_eq!(
                takes_slower_transfers_plan(1e6, 9_000, second, 0.03),
                taken,
                "{moved} {rel}"
            );
        }
        // A second plan that does not complete is never taken.
        assert!(!takes_slower_transfers_plan(1e6, 9_000, Some((false, 0.0, 0)), 0.03));
        let hw = Hardware::paper();
        let slow = slower_transfers(&hw);
        assert_eq!(slow.pcie_h2d_bytes_per_s, hw.pcie_h2d_bytes_per_s * 0.7);
        assert_eq!(slow.ssd_write_bytes_per_s, hw.ssd_write_bytes_per_s * 0.7);
        assert_eq!(slow.host_memory_bytes_per_s, hw.host_memory_bytes_per_s * 0.7);
        assert_eq!(slow.gpu_memory_bytes, hw.gpu_memory_bytes);
        assert_eq!(slow.ssd_latency_us, hw.ssd_latency_us);
    }

    #[test]
    fn the_second_plan_is_reported_and_taken_by_the_rule() {
        let (trace, mut hw) = squeezed_gpt(0.4);
        hw.ssd_count = 1;
        for margin in [0.03, 0.5] {
            let opts = SelectOptions {
                traffic_margin: margin,
                ..SelectOptions::cli(Policy::Auto, PlanOptions::default(), hw.gpu_memory_bytes)
            };
            let sel = choose(&trace, &hw, &opts).unwrap();
            let t = sel.traffic.clone().unwrap();
            let take = t.slower_transfers_moved_bytes < t.modelled_moved_bytes
                && t.slower_transfers_s.unwrap() <= t.modelled_s.unwrap() * (1.0 + margin);
            assert_eq!(t.chosen == "planned for slower transfers", take, "{t:?}");
            assert_eq!(sel.choice == Choice::SlowerTransfers, take);
            let want = if take { t.slower_transfers_moved_bytes } else { t.modelled_moved_bytes };
            assert_eq!(Some(moved_bytes(&sel.plan)), want);
            assert_eq!(sel.alternatives.iter().filter(|a| a.chosen).count(), 1);
        }
        let bad = SelectOptions {
            traffic_margin: 1.5,
            ..SelectOptions::cli(Policy::Auto, PlanOptions::default(), hw.gpu_memory_bytes)
        };
        assert!(choose(&trace, &hw, &bad).unwrap_err().to_string().contains("traffic_margin"));
    }
}
