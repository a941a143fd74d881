//! Capacity advisor: the fewest SSDs, or the least host memory, that let a policy reach a
//! target % of ideal in the simulator (a probe whose plan needs more SSD or host space than
//! the hardware has counts as failing); how big the SSD array must be for a plan
//! ([`array_size`]); and how many layers to checkpoint (recompute rather than keep or offload
//! their activations) for the fastest iteration.
//!
//! Both searches binary-search the resource; each probe is a full plan + simulation. The
//! planner is a heuristic, so its plan for more hardware can come out slightly worse than its
//! plan for less (4 SSDs 97.9% of ideal where 2 SSDs gave 98.1%). More hardware can always run
//! the plan made for less (leave the extra SSDs or host memory unused), so the figure reported
//! for a value is the best of the plans probed at that value or below, and says which one
//! ([`Probe::planned_for`]): more hardware is never reported worse.

use serde::{Deserialize, Serialize};

use crate::hardware::{Hardware, Resource};
use crate::model::{ModelConfig, generate};
use crate::planner::{PlanOptions, Policy, plan, plan_checked};
use crate::sim::{Outcome, SimOptions, SimReport, simulate};
use crate::trace::Trace;
use crate::{Error, Result};

/// One probe of a search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// The value tried (SSD count or host bytes).
    pub value: u64,
    /// % of ideal reached with this much of the resource: the best of the plans probed at this
    /// value or below (0 if none runs).
    pub percent_of_ideal: f64,
    /// The value whose plan reached `percent_of_ideal` (`value` itself, or less when the plan
    /// made for less did better).
    pub planned_for: u64,
    /// Why no plan probed at this value or below runs, when none does ("out of memory", ...).
    pub fails: Option<String>,
}

/// Result of a search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Advice {
    /// What was searched: `ssd_count` or `host_memory_cap_bytes`.
    pub resource: String,
    /// Target % of ideal.
    pub target_percent: f64,
    /// Smallest value that reaches the target, if any within the search range.
    pub value: Option<u64>,
    /// Simulation at that value.
    pub report: Option<SimReport>,
    /// Every probe, by value.
    pub probes: Vec<Probe>,
}

fn probe(trace: &Trace, hw: &Hardware, policy: Policy) -> Result<SimReport> {
    let p = plan(trace, hw, policy)?;
    simulate(trace, &p, hw, &SimOptions::default())
}

fn pct(r: &SimReport) -> f64 {
    if failure(r).is_none() { r.percent_of_ideal } else { 0.0 }
}

/// Why a probe's plan does not run on its hardware, if it does not.
fn failure(r: &SimReport) -> Option<String> {
    if r.outcome != Outcome::Completed {
        Some("out of GPU memory (the plan cannot make room)".into())
    } else if r.ssd_cap_exceeded {
        Some("the plan needs more SSD space than the array has".into())
    } else if r.host_cap_exceeded {
        Some("the plan needs more host memory than the host tier has".into())
    } else {
        None
    }
}

/// Every probe (value, its own report), sorted by value, as reported: the best plan at or
/// below each value.
fn envelope(mut tried: Vec<(u64, SimReport)>) -> (Vec<Probe>, Vec<SimReport>) {
    tried.sort_by_key(|(v, _)| *v);
    let mut probes: Vec<Probe> = Vec::new();
    let mut reports: Vec<SimReport> = Vec::new();
    let mut best: Option<(u64, SimReport)> = None;
    for (value, r) in tried {
        if best.as_ref().is_none_or(|(_, b)| pct(&r) > pct(b)) {
            best = Some((value, r.clone()));
        }
        let (from, b) = best.as_ref().expect("set above");
        probes.push(Probe {
            value,
            percent_of_ideal: pct(b),
            planned_for: *from,
            fails: failure(b),
        });
        reports.push(b.clone());
    }
    (probes, reports)
}

/// What a plan needs of the SSD array ([`array_size`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArraySize {
    /// Policy of the plan (as it names itself).
    pub policy: String,
    /// Peak bytes of the plan's copies on the array (the array must hold this), bytes.
    pub ssd_bytes: u64,
    /// Peak host-tier bytes of the plan.
    pub host_bytes: u64,
    /// SSDs the plan was made for.
    pub ssd_count: u32,
    /// Usable bytes each of them must have at least: `ssd_bytes / ssd_count`, rounded up.
    pub bytes_per_ssd: u64,
    /// With [`Hardware::ssd_capacity_bytes`] given: SSDs of that size the array needs.
    pub ssds_of_given_size: Option<u64>,
    /// Bytes written to the SSDs per iteration.
    pub ssd_written_bytes: u64,
    /// Simulated iteration, microseconds.
    pub iteration_us: f64,
    /// How long the drives last ([`Hardware::drive_life_days`]).
    pub drive_life_days: Option<f64>,
}

/// How big the SSD array must be for `policy`'s plan on `hw`: the plan is made with the
/// array unlimited (so the size does not shape it) and checked in the simulator; its peak SSD
/// space is what the array must hold ([`crate::plan`](mod@crate::plan), "Tier space").
pub fn array_size(
    trace: &Trace,
    hw: &Hardware,
    policy: Policy,
    opts: &PlanOptions,
) -> Result<ArraySize> {
    let mut free = hw.clone();
    free.ssd_capacity_bytes = None;
    let c = plan_checked(trace, &free, policy, opts)?;
    let r = &c.report;
    let count = u64::from(hw.ssd_count.max(1));
    let written =
        r.bytes_moved.iter().find(|b| b.resource == Resource::SsdWrite).map_or(0, |b| b.bytes);
    Ok(ArraySize {
        policy: c.plan.policy.clone(),
        ssd_bytes: r.peak_ssd_bytes,
        host_bytes: r.peak_host_bytes,
        ssd_count: hw.ssd_count,
        bytes_per_ssd: r.peak_ssd_bytes.div_ceil(count),
        ssds_of_given_size: hw.ssd_capacity_bytes.map(|each| r.peak_ssd_bytes.div_ceil(each)),
        ssd_written_bytes: written,
        iteration_us: r.iteration_time_us,
        drive_life_days: hw.drive_life_days(written, r.iteration_time_us),
    })
}

fn search(
    resource: &str,
    target: f64,
    lo: u64,
    hi: u64,
    mut eval: impl FnMut(u64) -> Result<SimReport>,
) -> Result<Advice> {
    if !(target > 0.0 && target <= 100.0) {
        return Err(Error::InvalidArgument(format!("target must be in (0, 100], got {target}")));
    }
    let mut tried: Vec<(u64, SimReport)> = Vec::new();
    // The best percentage of the plans tried at `v` or below: what `v` of the resource reaches.
    let reach = |tried: &[(u64, SimReport)], v: u64| {
        tried.iter().filter(|(u, _)| *u <= v).map(|(_, r)| pct(r)).fold(0.0, f64::max)
    };
    let top = eval(hi)?;
    tried.push((hi, top));
    if reach(&tried, hi) >= target {
        let (mut lo, mut hi) = (lo, hi);
        // Invariant: `hi` reaches the target; values below `lo` were not tried or fail.
        for _ in 0..64 {
            if lo >= hi {
                break;
            }
            let mid = lo + (hi - lo) / 2;
            let r = eval(mid)?;
            tried.push((mid, r));
            if reach(&tried, mid) >= target {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        let value = hi;
        let (probes, reports) = envelope(tried);
        let at = probes.iter().position(|p| p.value == value).expect("the value was probed");
        return Ok(Advice {
            resource: resource.into(),
            target_percent: target,
            value: Some(value),
            report: Some(reports[at].clone()),
            probes,
        });
    }
    Ok(Advice {
        resource: resource.into(),
        target_percent: target,
        value: None,
        report: None,
        probes: envelope(tried).0,
    })
}

/// Fewest SSDs in `[0, max_ssds]` (other hardware as given) for `policy` to reach `target`
/// % of ideal.
pub fn fewest_ssds(
    trace: &Trace,
    hw: &Hardware,
    policy: Policy,
    target: f64,
    max_ssds: u32,
) -> Result<Advice> {
    search("ssd_count", target, 0, u64::from(max_ssds), |v| {
        let mut h = hw.clone();
        h.ssd_count = v as u32;
        probe(trace, &h, policy)
    })
}

/// Least host memory (to `granularity_bytes`, up to `max_bytes`) for `policy` to reach
/// `target` % of ideal.
pub fn least_host_memory(
    trace: &Trace,
    hw: &Hardware,
    policy: Policy,
    target: f64,
    max_bytes: u64,
    granularity_bytes: u64,
) -> Result<Advice> {
    if granularity_bytes == 0 {
        return Err(Error::InvalidArgument("granularity must be > 0".into()));
    }
    let steps = max_bytes / granularity_bytes;
    let mut a = search("host_memory_cap_bytes", target, 0, steps, |v| {
        let mut h = hw.clone();
        h.host_memory_cap_bytes = v * granularity_bytes;
        probe(trace, &h, policy)
    })?;
    a.value = a.value.map(|v| v * granularity_bytes);
    for p in &mut a.probes {
        p.value *= granularity_bytes;
    }
    Ok(a)
}

/// One probe of [`best_checkpointing`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointProbe {
    /// Layers checkpointed (the first ones of the stage).
    pub layers: u32,
    /// Selective recomputation in the other layers ([`ModelConfig::selective_recompute`]).
    pub selective: bool,
    /// Simulated iteration, microseconds (`None`: out of memory).
    pub iteration_us: Option<f64>,
    /// % of the ideal iteration *without* recomputation (recomputation counts as a cost).
    pub percent_of_ideal: f64,
}

/// Result of [`best_checkpointing`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointAdvice {
    /// Transformer layers of the stage (the search range is `0..=layers`).
    pub layers: u32,
    /// Ideal iteration of the model without any recomputation, microseconds.
    pub ideal_us: f64,
    /// Fastest setting found (layers checkpointed, selective recomputation), if any probe
    /// completed.
    pub best: Option<(u32, bool)>,
    /// Simulation at the best setting.
    pub report: Option<SimReport>,
    /// Every probe, in order.
    pub probes: Vec<CheckpointProbe>,
}

/// How much to recompute for the fastest simulated iteration of `cfg` with `policy` on `hw`:
/// how many of the first layers to checkpoint, and whether to recompute the norms and the
/// activation function in the others (selective recomputation). Offloading an activation
/// costs SSD or PCIe bandwidth, recomputing it costs GPU time; which is cheaper depends on the
/// model, batch and hardware. The recomputation fields of `cfg` are ignored.
///
/// The iteration time is not monotone in the layer count, so for both selective settings this
/// scans `0..=layers` in eighths, then every layer count within one step of the best (at a
/// quarter of the step); each probe generates the trace, plans and simulates it. `progress`
/// sees every probe.
pub fn best_checkpointing(
    cfg: &ModelConfig,
    hw: &Hardware,
    policy: Policy,
    mut progress: impl FnMut(&CheckpointProbe),
) -> Result<CheckpointAdvice> {
    let layers = cfg.layers / cfg.pipeline_parallel.max(1);
    let mut base = cfg.clone();
    base.checkpointed_layers = 0;
    base.selective_recompute = false;
    let ideal_us = generate(&base)?.iteration_time_us();
    let mut probes: Vec<CheckpointProbe> = Vec::new();
    let mut best: Option<(f64, (u32, bool), SimReport)> = None;
    let mut try_one = |n: u32, selective: bool, probes: &mut Vec<CheckpointProbe>| -> Result<()> {
        if probes.iter().any(|p| (p.layers, p.selective) == (n, selective)) {
            return Ok(());
        }
        let mut c = base.clone();
        c.checkpointed_layers = n;
        c.selective_recompute = selective;
        let trace = generate(&c)?;
        let mut r = probe(&trace, hw, policy)?;
        let done = r.outcome == Outcome::Completed;
        if done {
            r.percent_of_ideal = 100.0 * ideal_us / r.iteration_time_us;
        }
        let p = CheckpointProbe {
            layers: n,
            selective,
            iteration_us: done.then_some(r.iteration_time_us),
            percent_of_ideal: if done { r.percent_of_ideal } else { 0.0 },
        };
        progress(&p);
        probes.push(p);
        if done && best.as_ref().is_none_or(|b| r.iteration_time_us < b.0) {
            best = Some((r.iteration_time_us, (n, selective), r));
        }
        Ok(())
    };
    let step = layers.div_ceil(8).max(1);
    for selective in [false, true] {
        for n in (0..=layers).step_by(step as usize).chain([layers]) {
            try_one(n, selective, &mut probes)?;
        }
    }
    // Refine around the best coarse probe of each selective setting.
    for selective in [false, true] {
        let coarse = probes
            .iter()
            .filter(|p| p.selective == selective)
            .filter_map(|p| p.iteration_us.map(|us| (us, p.layers)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        if let Some((_, b)) = coarse {
            let fine = (step / 4).max(1);
            let lo = b.saturating_sub(step - 1);
            let hi = (b + step - 1).min(layers);
            for n in (lo..=hi).step_by(fine as usize) {
                try_one(n, selective, &mut probes)?;
            }
        }
    }
    Ok(CheckpointAdvice {
        layers,
        ideal_us,
        best: best.as_ref().map(|b| b.1),
        report: best.map(|b| b.2),
        probes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hardware::Hardware;
    use crate::model::ModelConfig;

    /// A real report of a small model, with its percentage replaced.
    fn reports() -> impl FnMut(u64, f64) -> SimReport {
        let t = generate(&ModelConfig::preset("gpt2-small").unwrap()).unwrap();
        let r = probe(&t, &Hardware::paper(), Policy::Teraio).unwrap();
        assert_eq!(r.outcome, Outcome::Completed);
        move |_, pct| {
            let mut r = r.clone();
            r.percent_of_ideal = pct;
            r
        }
    }

    #[test]
    fn more_hardware_is_never_reported_worse_nor_recommended_for_less() {
        let mut report = reports();
        // A heuristic planner's figures, as `teraio advise` met them: 4 worse than 2, 0 fails.
        let raw = |v: u64| match v {
            0 => None,
            1 => Some(93.0),
            2 => Some(98.1),
            3 => Some(97.0),
            4 => Some(97.9),
            _ => Some(97.5),
        };
        let a = search("ssd_count", 90.0, 0, 8, |v| {
            Ok(match raw(v) {
                Some(p) => report(v, p),
                None => {
                    let mut r = report(v, 0.0);
                    r.outcome = Outcome::OutOfMemory {
                        iteration: 0,
                        kernel: 0,
                        needed_bytes: 1,
                        used_bytes: 0,
                        capacity_bytes: 0,
                    };
                    r
                }
            })
        })
        .unwrap();
        assert_eq!(a.value, Some(1));
        assert!((a.report.as_ref().unwrap().percent_of_ideal - 93.0).abs() < 1e-9);
        assert!(a.probes.windows(2).all(|w| w[0].value < w[1].value), "{:?}", a.probes);
        for w in a.probes.windows(2) {
            assert!(w[1].percent_of_ideal >= w[0].percent_of_ideal, "{:?}", a.probes);
        }
        for p in &a.probes {
            assert!(p.planned_for <= p.value);
            if p.value >= 2 {
                assert_eq!((p.percent_of_ideal, p.planned_for), (98.1, 2), "{p:?}");
            }
        }
        let zero = a.probes.iter().find(|p| p.value == 0).expect("0 was probed");
        assert!(zero.fails.as_deref().is_some_and(|w| w.contains("out of GPU memory")), "{zero:?}");
    }
}
