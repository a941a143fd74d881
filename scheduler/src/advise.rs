//! Capacity advisor: the fewest SSDs, or the least host memory, that let a policy reach a
//! target % of ideal in the simulator.
//!
//! Both searches assume throughput does not fall when a resource grows (true of the model:
//! more bandwidth or host room only widens the planner's choices) and binary-search it; each
//! probe is a full plan + simulation.

use serde::{Deserialize, Serialize};

use crate::hardware::Hardware;
use crate::planner::{Policy, plan};
use crate::sim::{Outcome, SimOptions, SimReport, simulate};
use crate::trace::Trace;
use crate::{Error, Result};

/// One probe of a search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    /// The value tried (SSD count or host bytes).
    pub value: u64,
    /// % of ideal reached (0 if out of memory).
    pub percent_of_ideal: f64,
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
    /// Every probe, in order.
    pub probes: Vec<Probe>,
}

fn probe(trace: &Trace, hw: &Hardware, policy: Policy) -> Result<SimReport> {
    let p = plan(trace, hw, policy)?;
    simulate(trace, &p, hw, &SimOptions::default())
}

fn pct(r: &SimReport) -> f64 {
    if r.outcome == Outcome::Completed { r.percent_of_ideal } else { 0.0 }
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
    let mut probes = Vec::new();
    let top = eval(hi)?;
    probes.push(Probe { value: hi, percent_of_ideal: pct(&top) });
    if pct(&top) < target {
        return Ok(Advice {
            resource: resource.into(),
            target_percent: target,
            value: None,
            report: None,
            probes,
        });
    }
    let (mut lo, mut hi, mut best) = (lo, hi, top);
    // Invariant: `hi` reaches the target; values below `lo` were not tried or fail.
    for _ in 0..64 {
        if lo >= hi {
            break;
        }
        let mid = lo + (hi - lo) / 2;
        let r = eval(mid)?;
        probes.push(Probe { value: mid, percent_of_ideal: pct(&r) });
        if pct(&r) >= target {
            hi = mid;
            best = r;
        } else {
            lo = mid + 1;
        }
    }
    Ok(Advice {
        resource: resource.into(),
        target_percent: target,
        value: Some(hi),
        report: Some(best),
        probes,
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
