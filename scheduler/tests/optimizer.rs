//! Where the optimizer's updates run (`optimizer::place`): host updates in the simulator
//! computed by hand, the decision at the extremes of the hardware, byte counts per dtype, and
//! properties over generated models and machines (the choice is never slower than all-GPU
//! and all-host, and no simulated choice beats the lower bound).

use proptest::prelude::*;
use teraio_scheduler::optimizer::{HOST_MIN_GAIN, PlaceOptions, host_trace, place, updates};
use teraio_scheduler::{
    Dtype, Hardware, HostUpdate, Kernel, ModelConfig, Plan, Policy, Resource, SimOptions,
    SimReport, Tensor, TensorId, TensorKind, Trace, generate, simulate,
};

fn tensor(id: u32, bytes: u64, kind: TensorKind, accesses: Vec<usize>) -> Tensor {
    Tensor {
        id: TensorId(id),
        name: format!("t{id}"),
        bytes,
        kind,
        global: true,
        created_by: None,
        accesses,
        dies_after: None,
        writes: None,
        producer: None,
    }
}

/// GPU memory ample, PCIe 1 GB/s each way, host memory far from limiting, CPU at 1e9
/// parameters/s, no SSD.
fn hw() -> Hardware {
    Hardware {
        gpu_memory_bytes: 1 << 40,
        ssd_count: 0,
        ssd_read_bytes_per_s: 1e9,
        ssd_write_bytes_per_s: 1e9,
        ssd_latency_us: 0.0,
        pcie_h2d_bytes_per_s: 1e9,
        pcie_d2h_bytes_per_s: 1e9,
        host_memory_cap_bytes: 0,
        host_memory_bytes_per_s: 1e12,
        gpudirect: true,
        ssd_duplex_bytes_per_s: None,
        pcie_duplex_bytes_per_s: None,
        cpu_adam_params_per_s: 1e9,
        ssd_capacity_bytes: None,
        ssd_endurance_tbw: None,
    }
}

/// `params` parameters of one weight (fp32): k0 forward (10 us), k1 backward making the
/// gradient (10 us), k2 the AdamW step (5 us) over two moments. With `two`, a second such
/// parameter used by the same kernels.
fn one_layer(params: u64, two: bool) -> Trace {
    let mut t = Trace::new("hand");
    t.kernels = [10.0, 10.0, 5.0, 5.0]
        .iter()
        .enumerate()
        .map(|(i, &d)| Kernel { name: format!("k{i}"), duration_us: d, layer: None })
        .collect();
    let b = params * 4;
    let copies = if two { 2 } else { 1 };
    for c in 0..copies {
        let step = 2 + c as usize;
        let base = (c * 4) as u32;
        t.tensors.push(tensor(base, b, TensorKind::Weight, vec![0, 1, step]));
        let mut g = tensor(base + 1, b, TensorKind::Gradient, vec![1, step]);
        g.global = false;
        g.created_by = Some(1);
        g.dies_after = Some(step);
        t.tensors.push(g);
        t.tensors.push(tensor(base + 2, b, TensorKind::OptimizerState, vec![step]));
        t.tensors.push(tensor(base + 3, b, TensorKind::OptimizerState, vec![step]));
    }
    t.validate().unwrap();
    t
}

fn run_host(t: &Trace, hw: &Hardware) -> (Trace, SimReport) {
    let ups = updates(t, hw).unwrap();
    let all = vec![true; ups.len()];
    let (gpu, host, _) = host_trace(t, &ups, &all).unwrap();
    let mut plan = Plan::empty("none", &gpu);
    plan.host_updates = host;
    plan.validate(&gpu).unwrap();
    let r =
        simulate(&gpu, &plan, hw, &SimOptions { iterations: 3, record_timeline: true }).unwrap();
    (gpu, r)
}

fn bytes(r: &SimReport, res: Resource) -> u64 {
    r.bytes_moved.iter().find(|b| b.resource == res).unwrap().bytes
}

/// The next forward waits for the weight: gradient down (1 ms), CPU (1 ms), weight up (1 ms)
/// after the backward kernel; the step's kernel takes no GPU time.
#[test]
fn a_host_update_delays_the_weights_next_use_by_its_copies_and_cpu_time() {
    let t = one_layer(250_000, false);
    let (gpu, r) = run_host(&t, &hw());
    assert_eq!(gpu.tensors.len(), 2, "the moments are not GPU tensors any more");
    assert_eq!(gpu.kernels[2].duration_us, 0.0);
    // 10 + 10 + (1000 + 250 + 1000): d2h 1 MB at 1 GB/s, 250k parameters at 1e9/s, h2d.
    assert!((r.iteration_time_us - 2270.0).abs() < 1e-3, "{}", r.iteration_time_us);
    assert!((r.host_update_us - 250.0).abs() < 1e-6, "{}", r.host_update_us);
    // k3 (5 us, not using the weight) runs beside the update: the next k0 waits 2245 us.
    assert!((r.stall_us - 2245.0).abs() < 1e-3, "{}", r.stall_us);
    assert_eq!(bytes(&r, Resource::PcieD2h), 1_000_000);
    assert_eq!(bytes(&r, Resource::PcieH2d), 1_000_000);
}

/// Two updates ready at the same time queue on the CPU: the second waits for the first.
#[test]
fn the_cpu_runs_one_host_update_at_a_time() {
    let t = one_layer(250_000, true);
    let (_, r) = run_host(&t, &hw());
    // Both gradients down together (2 MB at 1 GB/s: 2 ms), CPU 0.25 + 0.25 ms one after the
    // other, the first weight up (1 ms) overlapping the second update, then the second: the
    // link carries 1 MB at full rate from 2.25 to 2.5 ms, then both until 3.5 ms...
    // Whatever the sharing, the last byte is up no earlier than 2 ms + 0.5 ms CPU + 1 ms.
    assert!(r.iteration_time_us >= 20.0 + 2000.0 + 500.0 + 1000.0 - 1e-3, "{r:?}");
    assert!((r.host_update_us - 500.0).abs() < 1e-6);
    // And not later than with no overlap at all.
    assert!(r.iteration_time_us <= 20.0 + 2000.0 + 500.0 + 2000.0 + 1e-3);
}

/// A kernel after the update that does not use its weight runs meanwhile: the update overlaps.
#[test]
fn kernels_that_do_not_use_the_weight_run_beside_the_update() {
    let mut t = one_layer(250_000, false);
    // k3 (5 us) touches a tensor of its own.
    t.tensors.push(tensor(4, 8, TensorKind::Workspace, vec![3]));
    t.kernels[3].duration_us = 2000.0;
    t.validate().unwrap();
    let (_, r) = run_host(&t, &hw());
    // 10 + 10 + 0 + 2000, and the update (2250 us from the end of k1) ends 250 us later.
    assert!((r.iteration_time_us - 2270.0).abs() < 1e-3, "{}", r.iteration_time_us);
    assert!((r.stall_us - 250.0).abs() < 1e-3, "{}", r.stall_us);
}

/// A host update runs where the trainer runs it: at the optimizer's step by default (its CPU
/// work waits for the backward kernel between its gradient and its step, 2 ms here), during
/// backward with `cpu_after_kernel` None (`PlaceOptions::in_backward`).
#[test]
fn a_host_update_at_the_step_waits_for_the_rest_of_backward() {
    let mut t = Trace::new("hand");
    t.kernels = [10.0, 10.0, 2000.0, 5.0, 5.0]
        .iter()
        .enumerate()
        .map(|(i, &d)| Kernel { name: format!("k{i}"), duration_us: d, layer: None })
        .collect();
    let b = 1_000_000;
    t.tensors.push(tensor(0, b, TensorKind::Weight, vec![0, 1, 3]));
    let mut g = tensor(1, b, TensorKind::Gradient, vec![1, 3]);
    g.global = false;
    g.created_by = Some(1);
    g.dies_after = Some(3);
    t.tensors.push(g);
    t.tensors.push(tensor(2, b, TensorKind::OptimizerState, vec![3]));
    t.tensors.push(tensor(3, b, TensorKind::OptimizerState, vec![3]));
    t.tensors.push(tensor(4, 8, TensorKind::Workspace, vec![2]));
    t.validate().unwrap();
    let ups = updates(&t, &hw()).unwrap();
    let (gpu, host, _) = host_trace(&t, &ups, &[true]).unwrap();
    assert_eq!((host[0].after_kernel, host[0].cpu_after_kernel), (1, Some(2)));
    let run = |gate: Option<usize>| {
        let mut plan = Plan::empty("none", &gpu);
        plan.host_updates = host.clone();
        plan.host_updates[0].cpu_after_kernel = gate;
        plan.validate(&gpu).unwrap();
        simulate(&gpu, &plan, &hw(), &SimOptions { iterations: 3, record_timeline: false })
            .unwrap()
            .iteration_time_us
    };
    // at the step: k0 + k1, k2's 2 ms (the gradient down meanwhile), CPU 250 us, weight up 1 ms
    let at_step = run(Some(2));
    assert!((at_step - (20.0 + 2000.0 + 250.0 + 1000.0)).abs() < 1e-3, "{at_step}");
    // in backward: gradient down, CPU and weight up behind k2: 20 + 1000 + 250 + 1000
    let in_backward = run(None);
    assert!((in_backward - 2270.0).abs() < 1e-3, "{in_backward}");
    // place() simulates the one its options say
    let one = |in_backward: bool| {
        let o = PlaceOptions {
            policy: Policy::Teraio,
            candidates: 2,
            in_backward,
            ..PlaceOptions::default()
        };
        place(&t, &hw(), &o).unwrap().all_host_us.unwrap()
    };
    assert!((one(false) - at_step).abs() < 1e-3 && (one(true) - in_backward).abs() < 1e-3);
}

fn tight(trace: &Trace, fraction: f64) -> u64 {
    let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap();
    let (_, ws) = teraio_scheduler::analysis::largest_working_set(trace);
    ((peak as f64 * fraction) as u64).max(ws + ws / 4)
}

fn small(dtype: Dtype, layers: u32) -> Trace {
    let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
    cfg.layers = layers;
    cfg.dtype = dtype;
    generate(&cfg).unwrap()
}

fn opts() -> PlaceOptions {
    PlaceOptions { policy: Policy::Teraio, candidates: 4, ..PlaceOptions::default() }
}

#[test]
fn a_fast_cpu_behind_a_slow_link_takes_every_update() {
    let t = small(Dtype::Fp32, 2);
    let mut h = Hardware::paper();
    h.gpu_memory_bytes = tight(&t, 0.6);
    h.pcie_h2d_bytes_per_s = 2e9;
    h.pcie_d2h_bytes_per_s = 2e9;
    h.cpu_adam_params_per_s = 1e13;
    let p = place(&t, &h, &opts()).unwrap();
    assert!(p.on_host.iter().zip(&p.updates).all(|(&h, u)| h == u.eligible), "{}", p.summary());
    assert!(p.updates.iter().all(|u| u.eligible));
    assert_eq!(p.host_params, p.total_params);
    assert!(p.iteration_us < p.all_gpu_us.unwrap(), "{}", p.summary());
}

#[test]
fn a_slow_cpu_takes_none() {
    let t = small(Dtype::Fp32, 2);
    let mut h = Hardware::paper();
    h.gpu_memory_bytes = tight(&t, 0.6);
    h.cpu_adam_params_per_s = 1e6;
    let p = place(&t, &h, &opts()).unwrap();
    assert!(p.on_host.iter().all(|&h| !h), "{}", p.summary());
    assert_eq!(p.host_params, 0);
    assert_eq!(p.plan.host_updates.len(), 0);
    assert_eq!(Some(p.iteration_us), p.all_gpu_us);
}

/// Host updates move a gradient down and a weight up: 8 bytes a parameter in fp32, 4 in bf16.
#[test]
fn host_updates_move_the_bytes_of_the_dtypes() {
    for (dtype, per_param) in [(Dtype::Fp32, 4u64), (Dtype::Bf16, 2)] {
        let t = small(dtype, 1);
        let mut h = Hardware::paper();
        h.gpu_memory_bytes = 1 << 40;
        let ups = updates(&t, &h).unwrap();
        let params: u64 = ups.iter().map(|u| u.params).sum();
        let cfg = {
            let mut c = ModelConfig::preset("gpt2-small").unwrap();
            c.layers = 1;
            c
        };
        // The generator's parameter count: every weight tensor's elements.
        let weights: u64 = t
            .tensors
            .iter()
            .filter(|x| x.kind == TensorKind::Weight)
            .map(|x| x.bytes / dtype.bytes())
            .sum();
        assert_eq!(params, weights, "{dtype:?} {}", cfg.name);
        for u in &ups {
            assert_eq!(u.gradient_bytes, u.params * per_param, "{dtype:?}");
            assert_eq!(u.weight_bytes, u.params * per_param, "{dtype:?}");
            // AdamW's two moments, plus the fp32 master in bf16.
            let states = if dtype == Dtype::Bf16 { 12 } else { 8 };
            assert_eq!(u.state_bytes, u.params * states, "{dtype:?}");
        }
        let all = vec![true; ups.len()];
        let (gpu, host, _) = host_trace(&t, &ups, &all).unwrap();
        let mut plan = Plan::empty("none", &gpu);
        plan.host_updates = host;
        let r = simulate(&gpu, &plan, &h, &SimOptions::default()).unwrap();
        assert_eq!(bytes(&r, Resource::PcieD2h), params * per_param, "{dtype:?}");
        assert_eq!(bytes(&r, Resource::PcieH2d), params * per_param, "{dtype:?}");
        assert!(gpu.tensors.iter().all(|x| x.kind != TensorKind::OptimizerState));
    }
}

#[test]
fn bad_options_and_choices_are_refused_by_name() {
    let t = small(Dtype::Fp32, 1);
    let h = Hardware::paper();
    let e = place(&t, &h, &PlaceOptions { candidates: 1, ..PlaceOptions::default() })
        .unwrap_err()
        .to_string();
    assert!(e.contains("candidates 1"), "{e}");
    let ups = updates(&t, &h).unwrap();
    let e = host_trace(&t, &ups, &[true]).unwrap_err().to_string();
    assert!(e.contains("on_host has 1 entries"), "{e}");
    let mut plan = Plan::empty("none", &t);
    plan.host_updates = vec![HostUpdate {
        after_kernel: 0,
        gradients: vec![],
        weights: vec![TensorId(0)],
        cpu_us: 1.0,
        cpu_after_kernel: None,
    }];
    let e = plan.validate(&t).unwrap_err().to_string();
    assert!(e.contains("host_updates[0].gradients"), "{e}");
    // a CPU gate before the update's start or past the trace
    let ups = updates(&t, &h).unwrap();
    let (gpu, host, _) = host_trace(&t, &ups, &vec![true; ups.len()]).unwrap();
    for gate in [host[0].after_kernel - 1, gpu.kernels.len()] {
        let mut plan = Plan::empty("none", &gpu);
        plan.host_updates = host.clone();
        plan.host_updates[0].cpu_after_kernel = Some(gate);
        let e = plan.validate(&gpu).unwrap_err().to_string();
        assert!(
            e.contains("host_updates[0].cpu_after_kernel") && e.contains(&format!("kernel {gate}")),
            "{e}"
        );
    }
}

fn arbitrary_case() -> impl Strategy<Value = (Dtype, u32, f64, f64, f64, u64)> {
    (
        prop_oneof![Just(Dtype::Fp32), Just(Dtype::Bf16)],
        1u32..=2,
        0.35f64..1.1,
        prop_oneof![Just(2e9), Just(16e9), Just(50e9)],
        prop_oneof![Just(1e8), Just(1e9), Just(4e9), Just(1e11)],
        1u64..=2,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// The choice simulates no slower than all-GPU, and within [`HOST_MIN_GAIN`] of every
    /// other (one with host updates beats all-GPU by that much); every simulated choice is at
    /// or above the lower bound; the plan of the choice is valid for its GPU trace.
    #[test]
    fn the_choice_beats_both_extremes_and_never_the_bound(
        (dtype, layers, fraction, pcie, cpu, mb) in arbitrary_case()
    ) {
        let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
        cfg.layers = layers;
        cfg.dtype = dtype;
        cfg.micro_batch = mb;
        let t = generate(&cfg).unwrap();
        let mut h = Hardware::paper();
        h.gpu_memory_bytes = tight(&t, fraction);
        h.pcie_h2d_bytes_per_s = pcie;
        h.pcie_d2h_bytes_per_s = pcie;
        h.cpu_adam_params_per_s = cpu;
        let p = match place(&t, &h, &opts()) {
            Ok(p) => p,
            Err(e) => {
                // Only where no placement runs at all.
                prop_assert!(e.to_string().contains("no placement"), "{e}");
                return Ok(());
            }
        };
        // the fastest, except that one with host updates must beat all-GPU by HOST_MIN_GAIN
        let keep = 1.0 - HOST_MIN_GAIN;
        if let Some(g) = p.all_gpu_us {
            prop_assert!(p.iteration_us <= g, "{}", p.summary());
            if p.host_params > 0 {
                prop_assert!(p.iteration_us <= g * keep, "{}", p.summary());
            }
        }
        if let Some(a) = p.all_host_us {
            prop_assert!(p.iteration_us * keep <= a, "{}", p.summary());
        }
        for c in &p.candidates {
            if let Some(us) = c.iteration_us {
                prop_assert!(us >= p.bound_us * (1.0 - 1e-9), "{c:?} below {}", p.bound_us);
                prop_assert!(p.iteration_us * keep <= us, "{c:?}: {}", p.summary());
            }
        }
        p.plan.validate(&p.trace).unwrap();
        let hosted = p.plan.host_updates.len();
        prop_assert_eq!(hosted, p.on_host.iter().filter(|&&b| b).count());
        prop_assert_eq!(p.host_weights.len(), hosted);
    }
}
