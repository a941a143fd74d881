//! Where a plan's iteration differs from the lower bound: per window of the partition that
//! gives the bound, the bound's share (kernels, bytes to read and write, recomputation) beside
//! what the `auto` plan spends over the same kernels in the simulator (elapsed, stalls,
//! recomputation).
//!
//! `cargo run --release -p teraio-scheduler --example gap -- SPEC GPU_GB [HW_JSON|paper] [HOST_GB] [POLICY]`
//! e.g. `... --example gap -- llama3-8b,layers=8,dtype=bf16,micro-batches=2 28.0`

use teraio_scheduler::{
    Hardware, ModelConfig, PlanOptions, Policy, Resource, SimOptions, TensorId, Trace, generate,
    lower_bound, lower_bound_windows, plan_checked, simulate,
};

/// `k` iterations of `t` in one trace: its kernels `k` times, a global tensor accessed in
/// every copy, the others once per copy (new ids).
fn unrolled(t: &Trace, k: usize) -> Trace {
    let n = t.kernel_count();
    let mut u = Trace::new(format!("{} x{k}", t.name));
    for _ in 0..k {
        u.kernels.extend(t.kernels.iter().cloned());
    }
    // Id of tensor `i`'s copy `r` (globals keep one id).
    let mut ids = vec![vec![0u32; k]; t.tensors.len()];
    let mut next = 0u32;
    for (i, x) in t.tensors.iter().enumerate() {
        if x.global {
            ids[i] = vec![next; k];
            next += 1;
        } else {
            for id in &mut ids[i] {
                *id = next;
                next += 1;
            }
        }
    }
    let mut out: Vec<Option<teraio_scheduler::Tensor>> = vec![None; next as usize];
    for (i, x) in t.tensors.iter().enumerate() {
        let copies = if x.global { 1 } else { k };
        for r in 0..copies {
            let shift = |v: &Vec<usize>| -> Vec<usize> {
                if x.global {
                    (0..k).flat_map(|q| v.iter().map(move |&a| a + q * n)).collect()
                } else {
                    v.iter().map(|&a| a + r * n).collect()
                }
            };
            let mut y = x.clone();
            y.id = TensorId(ids[i][r]);
            y.accesses = shift(&x.accesses);
            y.writes = x.writes.as_ref().map(shift);
            y.created_by = x.created_by.map(|c| c + r * n);
            y.dies_after = x.dies_after.map(|d| d + r * n);
            if let Some(p) = y.producer.as_mut() {
                p.inputs = p.inputs.iter().map(|j| TensorId(ids[j.index()][r])).collect();
            }
            out[ids[i][r] as usize] = Some(y);
        }
    }
    u.tensors = out.into_iter().flatten().collect();
    u
}

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
    // Bytes a resource carried between two times (rates are piecewise constant).
    let carried = |r: Resource, t0: f64, t1: f64| -> f64 {
        let bw = &tl.bandwidth;
        let mut sum = 0.0;
        for (k, (t, rates)) in bw.iter().enumerate() {
            let next = bw.get(k + 1).map_or(r_end(&r), |x| x.0);
            let (a, b) = (t.max(t0), next.min(t1));
            if b > a {
                sum += rates[r.index()] * (b - a) * 1e-6;
            }
        }
        sum
    };
    fn r_end(_: &Resource) -> f64 {
        f64::INFINITY
    }
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
    // The bound measures one iteration from any state the one before left; over k iterations
    // in a row, the first one's free start is shared by k.
    for k in [2, 3] {
        let u = unrolled(&trace, k);
        let b = lower_bound(&u, &hw)?;
        println!(
            "  bound over {k} iterations in a row: {:.3} s per iteration",
            b.iteration_us / 1e6 / k as f64
        );
    }
    println!(
        "{:>6} {:>6} {:<22} {:>9} {:>9} {:>8} {:>8} {:>8} | {:>9} {:>9} {:>9} {:>8} {:>8} {:>9}",
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
        "h2d GB",
        "d2h GB",
        "plan-bd"
    );
    for w in &windows {
        let plan_us = at(w.end) - at(w.start);
        // What happens before a kernel starts belongs to the window it starts after.
        let (a, b) = ((w.start + 1).min(n), (w.end + 1).min(n));
        let stall: f64 = tl.kernel_stalls_us[a..b].iter().sum();
        let rc: f64 = rc_before[a..b].iter().sum();
        println!(
            "{:>6} {:>6} {:<22} {:>9.1} {:>9.1} {:>8.2} {:>8.2} {:>8.2} | {:>9.1} {:>9.1} {:>9.1} {:>8.2} {:>8.2} {:>9.1}",
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
            carried(Resource::PcieH2d, at(w.start), at(w.end)) / 1e9,
            carried(Resource::PcieD2h, at(w.start), at(w.end)) / 1e9,
            (plan_us - w.bound_us) / 1e3
        );
    }
    Ok(())
}
