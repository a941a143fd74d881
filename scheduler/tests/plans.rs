//! Invariants of every policy's plans, on random small traces (property tests) and on the
//! presets (golden tests).

use proptest::prelude::*;
use teraio_scheduler::{
    Hardware, Kernel, ModelConfig, Move, Outcome, Plan, Policy, SimOptions, Tensor, TensorId,
    TensorKind, Tier, Trace, generate, plan, simulate,
};

/// Independent check of the per-tensor rules: every prefetch follows an offload of the same
/// tensor (cyclically, from the initial placement), nothing is offloaded right before a GPU
/// kernel that accesses it, no GPU kernel accesses a tensor that is offloaded without a
/// prefetch, and a host kernel (CPU) only accesses offloaded tensors.
fn check_plan(trace: &Trace, p: &Plan) {
    p.validate(trace).unwrap();
    check_drops(trace, p);
    let n = trace.kernel_count();
    let on_host = |k: usize| p.host_kernels.iter().any(|h| h.kernel == k);
    for t in &trace.tensors {
        let mut offloaded = p.initially_offloaded.iter().any(|x| x.tensor == t.id);
        let mut ins = p.instructions.iter().filter(|i| i.tensor == t.id).peekable();
        for k in 0..=n {
            while let Some(i) = ins.next_if(|i| i.issue_before_kernel == k) {
                match i.op {
                    Move::Offload { .. } => {
                        assert!(!offloaded, "{} offloaded twice", t.id);
                        assert!(
                            !t.accesses.contains(&k) || on_host(k),
                            "{} offloaded while active at {k}",
                            t.id
                        );
                        offloaded = true;
                    }
                    Move::Prefetch => {
                        assert!(offloaded, "{} prefetched before any offload", t.id);
                        offloaded = false;
                    }
                }
            }
            if k < n && t.accesses.contains(&k) {
                if on_host(k) {
                    assert!(offloaded, "{} in GPU memory at host kernel {k}", t.id);
                } else {
                    assert!(!offloaded, "{} accessed at {k} while offloaded", t.id);
                }
            }
        }
    }
}

/// Independent check of clean drops: walking back from a drop (cyclically for a global
/// tensor), an offload to the SSD comes before any GPU kernel that writes the tensor, before
/// any host-kernel write made while it sat on the host tier, and before any prefetch that no
/// GPU kernel used. Also: every SSD offload where that holds is a drop.
fn check_drops(trace: &Trace, p: &Plan) {
    enum Ev {
        Off(Tier, bool),
        Pre,
        Acc { write: bool, host: bool },
    }
    let n = trace.kernel_count();
    let on_host = |k: usize| p.host_kernels.iter().any(|h| h.kernel == k);
    for t in &trace.tensors {
        let mut evs = Vec::new();
        let mut ins = p.instructions.iter().filter(|i| i.tensor == t.id).peekable();
        for k in 0..=n {
            while let Some(i) = ins.next_if(|i| i.issue_before_kernel == k) {
                evs.push(match i.op {
                    Move::Offload { dest } => Ev::Off(dest, i.clean),
                    Move::Prefetch => Ev::Pre,
                });
            }
            if k < n && t.accesses.contains(&k) {
                evs.push(Ev::Acc { write: t.writes_at(k), host: on_host(k) });
            }
        }
        for (i, e) in evs.iter().enumerate() {
            let Ev::Off(dest, clean) = *e else { continue };
            if dest != Tier::Ssd {
                assert!(!clean, "{}: clean drop to the host tier", t.id);
                continue;
            }
            let (mut host_write, mut used) = (false, false);
            let mut valid = false;
            for step in 1..=evs.len() {
                if !t.global && step > i {
                    break; // back to creation: no copy
                }
                match evs[(i + evs.len() - step) % evs.len()] {
                    Ev::Acc { write, host: false } => {
                        used = true;
                        if write {
                            break;
                        }
                    }
                    Ev::Acc { write, host: true } => host_write |= write,
                    Ev::Pre if !used => break,
                    Ev::Pre => {}
                    Ev::Off(Tier::Ssd, _) => {
                        valid = true;
                        break;
                    }
                    Ev::Off(Tier::Host, _) if host_write => break,
                    Ev::Off(Tier::Host, _) => {}
                }
            }
            assert_eq!(clean, valid, "{}: drop flag of event {i} of {}", p.policy, t.id);
        }
    }
}

fn check_report(trace: &Trace, hw: &Hardware, p: &Plan) -> teraio_scheduler::SimReport {
    let r = simulate(trace, p, hw, &SimOptions::default()).unwrap();
    if !p.unlimited_memory {
        assert!(r.peak_gpu_bytes <= hw.gpu_memory_bytes, "{} over capacity", p.policy);
    }
    assert!(!r.host_cap_exceeded, "{} over the host cap", p.policy);
    if r.outcome == Outcome::Completed {
        let ideal = trace.iteration_time_us();
        if p.host_kernels.is_empty() {
            assert!(r.iteration_time_us >= ideal * (1.0 - 1e-9), "{} faster than ideal", p.policy);
        }
        // Time = GPU kernel time + host-kernel time + recomputation + stalls, exactly.
        let on_host: f64 = p.host_kernels.iter().map(|h| trace.kernels[h.kernel].duration_us).sum();
        let expect = ideal - on_host + r.host_step_us + r.recompute_us + r.stall_us;
        let planned: f64 =
            p.recomputations.iter().map(|x| trace.recompute_us(x.tensor).unwrap()).sum();
        assert!((r.recompute_us - planned).abs() <= 1e-6 * planned.max(1.0));
        assert!((r.iteration_time_us - expect).abs() <= 1e-6 * ideal.max(1.0));
        assert!(r.percent_of_ideal <= 100.0, "{}", r.percent_of_ideal);
    }
    r
}

fn arbitrary_trace() -> impl Strategy<Value = Trace> {
    let kernels = proptest::collection::vec(1.0f64..1000.0, 3..40);
    kernels
        .prop_flat_map(|durs| {
            let n = durs.len();
            let tensor = (
                1u64..200_000_000,
                any::<bool>(),
                proptest::collection::btree_set(0..n, 1..6),
                0usize..3,
                any::<bool>(),
                proptest::option::of(any::<u8>()),
            );
            (Just(durs), proptest::collection::vec(tensor, 1..25))
        })
        .prop_map(|(durs, tensors)| {
            let n = durs.len();
            let mut t = Trace::new("random");
            for (i, d) in durs.iter().enumerate() {
                t.kernels.push(Kernel {
                    name: format!("k{i}"),
                    duration_us: *d,
                    layer: Some(i as u32 / 4),
                });
            }
            for (i, (bytes, global, acc, extra, other, mask)) in tensors.into_iter().enumerate() {
                let accesses: Vec<usize> = acc.into_iter().collect();
                // Which accesses write: all (`None`, an old trace) or a random subset that
                // contains the creating access of a non-global tensor.
                let writes = mask.map(|m| {
                    accesses
                        .iter()
                        .enumerate()
                        .filter(|&(j, _)| m & (1 << j) != 0 || (j == 0 && !global))
                        .map(|(_, &k)| k)
                        .collect::<Vec<usize>>()
                });
                let last = *accesses.last().unwrap();
                // Optimizer states and gradients too, so that zero-infinity's CPU step (host
                // kernels) is exercised.
                let kind = match (global, other) {
                    (true, false) => TensorKind::Weight,
                    (true, true) => TensorKind::OptimizerState,
                    (false, false) => TensorKind::Activation,
                    (false, true) => TensorKind::Gradient,
                };
                t.tensors.push(Tensor {
                    id: TensorId(i as u32),
                    name: format!("t{i}"),
                    bytes,
                    kind,
                    global,
                    created_by: (!global).then_some(accesses[0]),
                    dies_after: (!global).then_some((last + extra).min(n - 1)),
                    accesses,
                    writes,
                    producer: None,
                });
            }
            t
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn every_policy_makes_valid_plans(trace in arbitrary_trace(), cap_frac in 0.3f64..1.2, ssds in 0u32..3, host_frac in 0.0f64..0.5) {
        trace.validate().unwrap();
        let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap();
        let mut hw = Hardware::paper();
        hw.gpu_memory_bytes = (peak as f64 * cap_frac) as u64;
        hw.ssd_count = ssds;
        hw.host_memory_cap_bytes = (peak as f64 * host_frac) as u64;
        for policy in Policy::ALL {
            let p = plan(&trace, &hw, policy).unwrap();
            check_plan(&trace, &p);
            let r = check_report(&trace, &hw, &p);
            if policy == Policy::Ideal {
                prop_assert_eq!(&r.outcome, &Outcome::Completed);
                prop_assert!((r.percent_of_ideal - 100.0).abs() < 1e-6);
            }
            if policy == Policy::None && cap_frac >= 1.0 {
                prop_assert_eq!(&r.outcome, &Outcome::Completed);
            }
        }
    }
}

/// One weight idle for most of a long iteration: offloading it and prefetching it back
/// must be fully hidden, so teraio reaches 100% of ideal within capacity.
#[test]
fn idle_weight_is_hidden() {
    let mut t = Trace::new("hand");
    for i in 0..10 {
        t.kernels.push(Kernel { name: format!("k{i}"), duration_us: 100_000.0, layer: None });
    }
    let gb = 1_000_000_000;
    t.tensors.push(Tensor {
        id: TensorId(0),
        name: "w0".into(),
        bytes: gb,
        kind: TensorKind::Weight,
        global: true,
        created_by: None,
        accesses: vec![0, 9],
        dies_after: None,
        writes: None,
        producer: None,
    });
    t.tensors.push(Tensor {
        id: TensorId(1),
        name: "act".into(),
        bytes: gb,
        kind: TensorKind::Activation,
        global: false,
        created_by: Some(4),
        accesses: vec![4, 5],
        dies_after: Some(5),
        writes: None,
        producer: None,
    });
    let mut hw = Hardware::paper();
    hw.gpu_memory_bytes = 1_500_000_000;
    let none = simulate(&t, &plan(&t, &hw, Policy::None).unwrap(), &hw, &SimOptions::default());
    assert!(matches!(none.unwrap().outcome, Outcome::OutOfMemory { kernel: 4, .. }));
    let p = plan(&t, &hw, Policy::Teraio).unwrap();
    check_plan(&t, &p);
    assert_eq!(p.instructions.len(), 2);
    assert_eq!(p.instructions[0].issue_before_kernel, 1);
    let r = check_report(&t, &hw, &p);
    assert_eq!(r.outcome, Outcome::Completed);
    assert!((r.percent_of_ideal - 100.0).abs() < 1e-6, "{}", r.percent_of_ideal);
    let written = r.bytes_moved.iter().find(|b| b.resource == teraio_scheduler::Resource::SsdWrite);
    assert_eq!(written.unwrap().bytes, gb);
}

fn preset_row(name: &str, policy: Policy) -> teraio_scheduler::SimReport {
    let trace = generate(&ModelConfig::preset(name).unwrap()).unwrap();
    let hw = Hardware::paper();
    let p = plan(&trace, &hw, policy).unwrap();
    check_plan(&trace, &p);
    check_report(&trace, &hw, &p)
}

/// Golden: the paper's 8B cases on the paper's hardware.
#[test]
fn golden_llama3_8b_and_granite_8b() {
    for name in ["llama3-8b", "granite-8b"] {
        let none = preset_row(name, Policy::None);
        assert!(matches!(none.outcome, Outcome::OutOfMemory { .. }), "{name}: none must not fit");
        let t = preset_row(name, Policy::Teraio);
        assert_eq!(t.outcome, Outcome::Completed, "{name}");
        assert!(t.percent_of_ideal >= 90.0, "{name}: teraio {:.1}%", t.percent_of_ideal);
        let lru = preset_row(name, Policy::Lru);
        assert!(t.percent_of_ideal > lru.percent_of_ideal, "{name}: teraio must beat lru");
        // G10's plan leaves memory above capacity; its unified memory pages the rest on
        // demand: it completes, slower than teraio.
        let g10 = preset_row(name, Policy::G10);
        assert_eq!(g10.outcome, Outcome::Completed, "{name}: g10");
        assert!(t.iteration_time_us < g10.iteration_time_us, "{name}: teraio must beat g10");
    }
}

/// Golden: the headline comparison on llama3-8b. ZeRO-Infinity runs as DeepSpeed does
/// (activation checkpointing, CPU step read, compute, write in turn, parameters moved by its
/// prefetcher's rules); `teraio` offloads instead of recomputing. Measured 1.48x with the
/// step at the end and 1.51x with the step in the next forward pass (docs/BENCHMARKS.md); a
/// plan with no I/O cost at all would be 1.51x.
#[test]
fn golden_teraio_vs_zero_infinity_on_llama3_8b() {
    let t = preset_row("llama3-8b", Policy::Teraio);
    let mut cfg = ModelConfig::preset("llama3-8b").unwrap();
    cfg.checkpointed_layers = cfg.layers;
    let ckpt = generate(&cfg).unwrap();
    let hw = Hardware::paper();
    let zp = plan(&ckpt, &hw, Policy::ZeroInfinity).unwrap();
    check_plan(&ckpt, &zp);
    let z = check_report(&ckpt, &hw, &zp);
    assert_eq!(z.outcome, Outcome::Completed);
    let speedup = z.iteration_time_us / t.iteration_time_us;
    assert!(speedup > 1.4, "teraio only {speedup:.3}x zero-infinity");
    let ideal = generate(&ModelConfig::preset("llama3-8b").unwrap()).unwrap().iteration_time_us();
    assert!(speedup < z.iteration_time_us / ideal, "faster than ideal?");
    // The optimizer step in the next forward pass: the same updates, overlapped.
    let mut cfg = ModelConfig::preset("llama3-8b").unwrap();
    cfg.optimizer_in_forward = true;
    let fwd = generate(&cfg).unwrap();
    assert!((fwd.iteration_time_us() - ideal).abs() < 1.0, "the same kernels");
    let p = plan(&fwd, &hw, Policy::Teraio).unwrap();
    check_plan(&fwd, &p);
    let r = check_report(&fwd, &hw, &p);
    assert_eq!(r.outcome, Outcome::Completed);
    assert!(r.iteration_time_us < t.iteration_time_us, "no faster with the step overlapped");
    assert!(r.percent_of_ideal > 99.0, "{:.2}% of ideal", r.percent_of_ideal);
}

/// The issue's target, on the paper's three presets and hardware: `teraio` at least 1.47x
/// `zero-infinity` on average (measured 1.507x, docs/BENCHMARKS.md), and faster still with
/// the training loop stepping each parameter's optimizer in the next forward pass (the same
/// updates; measured 1.531x).
#[test]
fn golden_paper_target_over_the_presets() {
    let hw = Hardware::paper();
    let (mut at_end, mut in_forward) = (Vec::new(), Vec::new());
    for name in ["llama3-8b", "granite-8b", "llama3-70b"] {
        let run = |cfg: &ModelConfig, policy| {
            let trace = generate(cfg).unwrap();
            let p = plan(&trace, &hw, policy).unwrap();
            check_plan(&trace, &p);
            let r = check_report(&trace, &hw, &p);
            assert_eq!(r.outcome, Outcome::Completed, "{name}: {policy}");
            r.iteration_time_us
        };
        let mut ckpt = ModelConfig::preset(name).unwrap();
        ckpt.checkpointed_layers = ckpt.layers;
        let zero = run(&ckpt, Policy::ZeroInfinity);
        at_end.push(zero / run(&ModelConfig::preset(name).unwrap(), Policy::Teraio));
        let mut fwd = ModelConfig::preset(name).unwrap();
        fwd.optimizer_in_forward = true;
        in_forward.push(zero / run(&fwd, Policy::Teraio));
    }
    let average = at_end.iter().sum::<f64>() / 3.0;
    assert!(average >= 1.47, "teraio {average:.4}x zero-infinity on average ({at_end:?})");
    for (e, f) in at_end.iter().zip(&in_forward) {
        assert!(f > e, "the step in the next forward is no faster: {in_forward:?} vs {at_end:?}");
    }
}

/// Golden: the 70B case completes within memory with teraio.
#[test]
fn golden_llama3_70b() {
    let t = preset_row("llama3-70b", Policy::Teraio);
    assert_eq!(t.outcome, Outcome::Completed);
    assert!(t.percent_of_ideal >= 80.0, "teraio {:.1}%", t.percent_of_ideal);
}

/// The laptop replay preset against the dev hardware: teraio completes within memory.
#[test]
fn replay_preset_on_dev_hardware() {
    let trace = generate(&ModelConfig::preset("gpt2-replay").unwrap()).unwrap();
    let hw = Hardware::dev();
    let p = plan(&trace, &hw, Policy::Teraio).unwrap();
    check_plan(&trace, &p);
    let r = check_report(&trace, &hw, &p);
    assert_eq!(r.outcome, Outcome::Completed);
    assert!(r.iteration_time_us > 5e6 && r.iteration_time_us < 30e6, "{}", r.iteration_time_us);
}

#[test]
fn plan_json_round_trip_and_rejects_bad_plans() {
    let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
    cfg.micro_batch = 2;
    let trace = generate(&cfg).unwrap();
    let mut hw = Hardware::paper();
    hw.gpu_memory_bytes = 2_500_000_000;
    let p = plan(&trace, &hw, Policy::Teraio).unwrap();
    assert!(!p.instructions.is_empty());
    let back = Plan::from_json(&p.to_json()).unwrap();
    assert_eq!(back, p);
    // Drop the first prefetch: the tensor is then accessed while offloaded.
    let mut bad = p.clone();
    let i = bad.instructions.iter().position(|i| i.op == Move::Prefetch).unwrap();
    bad.instructions.remove(i);
    let e = bad.validate(&trace).unwrap_err().to_string();
    assert!(e.contains("invalid plan"), "{e}");
    assert!(simulate(&trace, &bad, &hw, &SimOptions::default()).is_err());
}

/// Golden: on llama3-8b (paper hardware), truthful writes let teraio drop the weights' clean
/// copies instead of writing them back: fewer SSD bytes written and a faster iteration than
/// with the same trace read as "every access writes" (measured: 687 vs 813 GB, 78.7 vs
/// 81.9 s; docs/BENCHMARKS.md). Every drop is of a weight: gradients, optimizer states and
/// activations change between their accesses' copies.
#[test]
fn golden_clean_drops_on_llama3_8b() {
    let trace = generate(&ModelConfig::preset("llama3-8b").unwrap()).unwrap();
    let mut old = trace.clone();
    for t in &mut old.tensors {
        t.writes = None;
    }
    let hw = Hardware::paper();
    let run = |tr: &Trace| {
        let p = plan(tr, &hw, Policy::Teraio).unwrap();
        check_plan(tr, &p);
        let r = check_report(tr, &hw, &p);
        assert_eq!(r.outcome, Outcome::Completed);
        let wr = r.bytes_moved.iter().find(|b| b.resource == teraio_scheduler::Resource::SsdWrite);
        (p, r.iteration_time_us, wr.unwrap().bytes)
    };
    let (p_new, t_new, w_new) = run(&trace);
    let (p_old, t_old, w_old) = run(&old);
    assert!(p_old.instructions.iter().all(|i| !i.clean));
    assert!(p_new.instructions.iter().any(|i| i.clean));
    for i in p_new.instructions.iter().filter(|i| i.clean) {
        assert_eq!(trace.tensor(i.tensor).kind, TensorKind::Weight, "{}", i.tensor);
    }
    assert!(w_new < w_old, "SSD writes {w_new} vs {w_old}");
    assert!(t_new < t_old, "iteration {t_new} vs {t_old} us");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]
    /// `teraio` never runs out of memory where on-demand swapping fits: its forced phase
    /// takes intervals too short for their transfers, and where its greedy still chooses
    /// badly it falls back to `lru`'s plan (saying so in the policy name). `teraio-hybrid` is
    /// never slower than `teraio`.
    #[test]
    fn teraio_completes_where_lru_does(trace in arbitrary_trace(), cap_frac in 0.3f64..1.2, ssds in 0u32..3, host_frac in 0.0f64..0.5) {
        let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap();
        let mut hw = Hardware::paper();
        hw.gpu_memory_bytes = (peak as f64 * cap_frac) as u64;
        hw.ssd_count = ssds;
        hw.host_memory_cap_bytes = (peak as f64 * host_frac) as u64;
        let opts = teraio_scheduler::SimOptions::default();
        let lru_plan = plan(&trace, &hw, Policy::Lru).unwrap();
        let lru = teraio_scheduler::simulate(&trace, &lru_plan, &hw, &opts).unwrap();
        let mut times = Vec::new();
        for policy in [Policy::Teraio, Policy::TeraioHybrid] {
            let p = plan(&trace, &hw, policy).unwrap();
            prop_assert!(p.policy.starts_with(policy.as_str()));
            let r = teraio_scheduler::simulate(&trace, &p, &hw, &opts).unwrap();
            if lru.outcome == Outcome::Completed {
                prop_assert_eq!(&r.outcome, &Outcome::Completed, "{}", policy);
            }
            times.push((r.outcome == Outcome::Completed).then_some(r.iteration_time_us));
        }
        // The improvement policy keeps teraio's plan when that one is faster.
        if let [Some(t), h] = times[..] {
            prop_assert!(h.is_some_and(|h| h <= t), "teraio-hybrid {h:?} slower than teraio {t}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    /// Selection (`choose`, the front ends' entry point) with the paging fallback: a plan it
    /// gives is valid and runs within the budget and the tiers in the simulator; where it
    /// refuses (a kernel that can never fit aside), `lru` does not run either; and it refuses
    /// a kernel whose working set exceeds the budget, naming it.
    #[test]
    fn selection_plans_wherever_paging_runs(trace in arbitrary_trace(), cap_frac in 0.3f64..1.2, ssds in 0u32..3, host_frac in 0.0f64..0.5) {
        use teraio_scheduler::{Error, PlanOptions, SelectOptions, choose};
        let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap();
        let mut hw = Hardware::paper();
        hw.gpu_memory_bytes = ((peak as f64 * cap_frac) as u64).max(1);
        hw.ssd_count = ssds;
        hw.host_memory_cap_bytes = (peak as f64 * host_frac) as u64;
        let opts = SelectOptions::cli(Policy::Auto, PlanOptions::default(), hw.gpu_memory_bytes);
        let (k, ws) = teraio_scheduler::analysis::largest_working_set(&trace);
        match choose(&trace, &hw, &opts) {
            Ok(sel) => {
                check_plan(&trace, &sel.plan);
                let r = simulate(&trace, &sel.plan, &hw, &SimOptions::default()).unwrap();
                prop_assert_eq!(&r.outcome, &Outcome::Completed);
                prop_assert!(r.peak_gpu_bytes <= hw.gpu_memory_bytes);
                prop_assert!(!r.ssd_cap_exceeded && !r.host_cap_exceeded);
            }
            Err(Error::GpuMemoryTooSmall { kernel, needed_bytes, .. }) => {
                prop_assert_eq!((kernel, needed_bytes), (k, ws));
                prop_assert!(ws > hw.gpu_memory_bytes);
            }
            Err(e @ (Error::PlanOutOfMemory { .. } | Error::TierTooSmall { .. })) => {
                let lru = plan(&trace, &hw, Policy::Lru).unwrap();
                let r = simulate(&trace, &lru, &hw, &SimOptions::default()).unwrap();
                prop_assert!(
                    r.outcome != Outcome::Completed || r.ssd_cap_exceeded || r.host_cap_exceeded,
                    "refused ({e}) where lru runs"
                );
            }
            Err(e) => prop_assert!(false, "{e}"),
        }
    }
}
