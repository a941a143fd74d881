//! The advisor's searches: their answers are checked against direct simulations.

use teraio_scheduler::advise::{best_checkpointing, fewest_ssds, least_host_memory};
use teraio_scheduler::{
    Dtype, Hardware, ModelConfig, Outcome, Policy, SimOptions, generate, plan, simulate,
};

fn pct(t: &teraio_scheduler::Trace, hw: &Hardware, policy: Policy) -> f64 {
    let p = plan(t, hw, policy).unwrap();
    let r = simulate(t, &p, hw, &SimOptions::default()).unwrap();
    if r.outcome == Outcome::Completed { r.percent_of_ideal } else { 0.0 }
}

/// gpt2-small with TF32 matmuls on 6 GB of GPU memory and slow drives: I/O-bound.
fn io_bound() -> (ModelConfig, Hardware) {
    let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
    cfg.dtype = Dtype::Tf32;
    let mut hw = Hardware::paper();
    hw.gpu_memory_bytes = 6_000_000_000;
    hw.ssd_count = 1;
    hw.ssd_read_bytes_per_s = 2e9;
    hw.ssd_write_bytes_per_s = 2e9;
    hw.host_memory_cap_bytes = 0;
    (cfg, hw)
}

#[test]
fn fewest_ssds_is_the_smallest_count_that_reaches_the_target() {
    let (cfg, mut hw) = io_bound();
    let t = generate(&cfg).unwrap();
    hw.ssd_count = 64;
    let target = 0.9 * pct(&t, &hw, Policy::Teraio);
    let a = fewest_ssds(&t, &hw, Policy::Teraio, target, 64).unwrap();
    let v = a.value.expect("reachable with 64 SSDs") as u32;
    assert!(v >= 1);
    hw.ssd_count = v;
    assert!(pct(&t, &hw, Policy::Teraio) >= target);
    hw.ssd_count = v - 1;
    assert!(pct(&t, &hw, Policy::Teraio) < target, "{v} SSDs is not the fewest");
    assert!(a.report.unwrap().percent_of_ideal >= target);
    // Out of range: reported as such.
    let a = fewest_ssds(&t, &hw, Policy::Teraio, 100.0, 1).unwrap();
    assert_eq!(a.value, None);
    assert!(fewest_ssds(&t, &hw, Policy::Teraio, 120.0, 4).is_err());
}

#[test]
fn least_host_memory_is_the_smallest_amount_that_reaches_the_target() {
    let (cfg, mut hw) = io_bound();
    let t = generate(&cfg).unwrap();
    hw.ssd_count = 0;
    let step = 250_000_000;
    let a = least_host_memory(&t, &hw, Policy::Teraio, 1.0, 20 * step, step).unwrap();
    let v = a.value.expect("fits with 5 GB of host memory");
    assert!(v > 0 && v.is_multiple_of(step));
    hw.host_memory_cap_bytes = v;
    assert!(pct(&t, &hw, Policy::Teraio) >= 1.0);
    hw.host_memory_cap_bytes = v - step;
    assert!(pct(&t, &hw, Policy::Teraio) < 1.0);
    assert!(least_host_memory(&t, &hw, Policy::Teraio, 50.0, step, 0).is_err());
}

#[test]
fn best_checkpointing_is_the_fastest_probe_and_beats_no_recomputation_when_io_bound() {
    let (cfg, hw) = io_bound();
    let mut seen = 0;
    let a = best_checkpointing(&cfg, &hw, Policy::Teraio, |_| seen += 1).unwrap();
    assert_eq!(seen, a.probes.len());
    assert_eq!(a.layers, 12);
    let ideal = generate(&cfg).unwrap().iteration_time_us();
    assert_eq!(a.ideal_us, ideal);
    // Every setting is probed once; both extremes of both selective settings are there.
    let mut ls: Vec<(u32, bool)> = a.probes.iter().map(|p| (p.layers, p.selective)).collect();
    ls.sort_unstable();
    ls.dedup();
    assert_eq!(ls.len(), a.probes.len());
    for s in [(0, false), (12, false), (0, true), (12, true)] {
        assert!(ls.contains(&s), "{s:?} not probed");
    }
    let best = a.best.unwrap();
    let best_us = a.report.as_ref().unwrap().iteration_time_us;
    for p in &a.probes {
        if let Some(us) = p.iteration_us {
            assert!(best_us <= us, "{} layers: {us} < best {best_us}", p.layers);
            assert!((p.percent_of_ideal - 100.0 * ideal / us).abs() < 1e-9);
        }
    }
    // The probe agrees with a direct simulation of that setting.
    let mut c = cfg.clone();
    (c.checkpointed_layers, c.selective_recompute) = best;
    let t = generate(&c).unwrap();
    let p = plan(&t, &hw, Policy::Teraio).unwrap();
    let r = simulate(&t, &p, &hw, &SimOptions::default()).unwrap();
    assert_eq!(r.iteration_time_us, best_us);
    // I/O-bound: recomputing something beats offloading every activation.
    let none = a.probes.iter().find(|p| (p.layers, p.selective) == (0, false)).unwrap();
    assert!(none.iteration_us.is_none_or(|us| best_us < us), "{best:?} vs {none:?}");
    assert_ne!(best, (0, false));
}

#[test]
fn selective_recomputation_remakes_norms_and_activation_in_backward() {
    let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
    let plain = generate(&cfg).unwrap();
    cfg.selective_recompute = true;
    let t = generate(&cfg).unwrap();
    // Three cheap kernels per layer and micro-batch; a little more time, less memory.
    assert_eq!(t.kernel_count(), plain.kernel_count() + 3 * 12);
    assert!(t.iteration_time_us() > plain.iteration_time_us());
    assert!(t.iteration_time_us() < 1.05 * plain.iteration_time_us());
    let peak = |t: &teraio_scheduler::Trace| t.resident_memory_per_kernel().into_iter().max();
    assert!(peak(&t) < peak(&plain));
    let find = |n: &str| t.tensors.iter().find(|x| x.name == n).unwrap();
    let first_bwd = t.kernels.iter().position(|k| k.name.contains(".bwd")).unwrap();
    // The forward's outputs die in the forward; backward reads the remade ones.
    for (old, new, reader) in [
        ("mb0.L5.n1", "mb0.L5.rc.n1", "mb0.L5.qkv.bwd"),
        ("mb0.L5.n2", "mb0.L5.rc.n2", "mb0.L5.up.bwd"),
        ("mb0.L5.a", "mb0.L5.rc.a", "mb0.L5.down.bwd"),
    ] {
        assert!(find(old).accesses.iter().all(|&k| k < first_bwd), "{old}");
        let made = find(new);
        assert!(made.accesses.iter().any(|&k| t.kernels[k].name == reader), "{new}");
        assert_eq!(made.accesses.len(), 2, "{new}: made, then read once");
    }
    // With every layer checkpointed there is nothing left to recompute selectively.
    cfg.checkpointed_layers = 12;
    let both = generate(&cfg).unwrap();
    cfg.selective_recompute = false;
    assert_eq!(both, generate(&cfg).unwrap());
}
