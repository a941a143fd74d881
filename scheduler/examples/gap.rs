//! Where a plan's iteration differs from the lower bound: per window of the partition that
//! gives the bound, the bound's share (kernels, bytes to read and write, recomputation) beside
//! what the `auto` plan spends over the same kernels in the simulator (elapsed, stalls,
//! recomputation).
//!
//! `cargo run --release -p teraio-scheduler --example gap -- SPEC GPU_GB [HW_JSON|paper] [HOST_GB] [POLICY]`
//! e.g. `... --example gap -- llama3-8b,layers=8,dtype=bf16,micro-batches=2 28.0`

use teraio_scheduler::{
    Hardware, ModelConfig, PlanOptions, Policy, SimOptions, generate, lower_bound_windows,
    plan_checked, simulate,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 2 {
        return Err("usage: gap SPEC GPU_GB [HW_JSON|paper] [HOST_GB] [POLICY]".into());
    }
    let trace = generate(&ModelConfig::from_spec(&args[0])?)?;
    let mut hw = match args.get(2).map(String::as_str) {
        None | Some("paper") => Hardware::paper(),
        Some(path) => serde_json::from_str(&std::fs::read_to_string(path)?)?,
    };
    hw.gpu_memory_bytes = (args[1].parse::<f64>()? * 1e9) as u64;
    if let Some(h) = args.get(3).filter(|h| h.as_str() != "-") {
        hw.host_memory_cap_bytes = (h.parse::<f64>()? * 1e9) as u64;
    }
    let policy: Policy = args.get(4).map_or(Ok(Policy::Auto), |p| p.parse())?;
    let (bound, windows) = lower_bound_windows(&trace, &hw)?;
    let checked = plan_checked(&trace, &hw, policy, &PlanOptions::default())?;
    let opts = SimOptions { record_timeline: true, ..SimOptions::default() };
    let r = simulate(&trace, &checked.plan, &hw, &opts)?;
    let tl = r.timeline.as_ref().ok_or("no timeline")?;
    let n = trace.kernel_count();
    let at = |k: usize| if k >= n { r.iteration_time_us } else { tl.kernel_starts_us[k] };
    let mut rc_before = vec![0.0; n + 1];
    for rc in &checked.plan.recomputations {
        rc_before[rc.before_kernel] += trace.recompute_us(rc.tensor).unwrap_or(0.0);
    }
    println!(
        "{}: plan {} {:.3} s, bound {:.3} s, ideal {:.3} s; stall {:.3} s, recompute {:.3} s",
        args[0],
        checked.plan.policy,
        r.iteration_time_us / 1e6,
        bound.iteration_us / 1e6,
        bound.compute_us / 1e6,
        r.stall_us / 1e6,
        r.recompute_us / 1e6
    );
    println!(
        "{:>6} {:>6} {:<22} {:>9} {:>9} {:>8} {:>8} {:>8} | {:>9} {:>9} {:>9} {:>9}",
        "start",
        "end",
        "first kernel",
        "bound ms",
        "kern ms",
        "read GB",
        "write GB",
        "rc GB",
        "plan ms",
        "stall ms",
        "rc ms",
        "plan-bd"
    );
    for w in &windows {
        let plan_us = at(w.end) - at(w.start);
        // What happens before a kernel starts belongs to the window it starts after.
        let (a, b) = ((w.start + 1).min(n), (w.end + 1).min(n));
        let stall: f64 = tl.kernel_stalls_us[a..b].iter().sum();
        let rc: f64 = rc_before[a..b].iter().sum();
        println!(
            "{:>6} {:>6} {:<22} {:>9.1} {:>9.1} {:>8.2} {:>8.2} {:>8.2} | {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            w.start,
            w.end,
            trace.kernels[w.start].name.chars().take(22).collect::<String>(),
            w.bound_us / 1e3,
            w.kernels_us / 1e3,
            w.read_bytes / 1e9,
            w.write_bytes / 1e9,
            w.recompute_bytes / 1e9,
            plan_us / 1e3,
            stall / 1e3,
            rc / 1e3,
            (plan_us - w.bound_us) / 1e3
        );
    }
    Ok(())
}
