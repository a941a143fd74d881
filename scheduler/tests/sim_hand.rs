//! Simulator cases computed by hand: the combined SSD read+write limit and host kernels.

use std::collections::HashMap;

use teraio_scheduler::{
    Hardware, HostKernel, InitialPlacement, Instruction, Kernel, ModelConfig, Move, Outcome, Plan,
    Policy, Resource, SimOptions, Tensor, TensorId, TensorKind, Tier, Trace, generate, plan,
    simulate,
};

const GB: u64 = 1_000_000_000;

fn weight(id: u32, bytes: u64, kind: TensorKind, accesses: Vec<usize>) -> Tensor {
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

fn kernels(durations: &[f64]) -> Vec<Kernel> {
    durations
        .iter()
        .enumerate()
        .map(|(i, &d)| Kernel { name: format!("k{i}"), duration_us: d, layer: None })
        .collect()
}

/// One SSD of 2 GB/s read and 2 GB/s write, PCIe and memory far from limiting.
fn one_ssd(duplex: Option<f64>) -> Hardware {
    Hardware {
        gpu_memory_bytes: 10 * GB,
        ssd_count: 1,
        ssd_read_bytes_per_s: 2e9,
        ssd_write_bytes_per_s: 2e9,
        ssd_latency_us: 0.0,
        pcie_h2d_bytes_per_s: 50e9,
        pcie_d2h_bytes_per_s: 50e9,
        host_memory_cap_bytes: 0,
        host_memory_bytes_per_s: 100e9,
        gpudirect: true,
        ssd_duplex_bytes_per_s: duplex,
        pcie_duplex_bytes_per_s: None,
        cpu_adam_params_per_s: 1e9,
        ssd_capacity_bytes: None,
        ssd_endurance_tbw: None,
    }
}

fn ins(at: usize, t: u32, op: Move, urgent: bool) -> Instruction {
    Instruction { issue_before_kernel: at, tensor: TensorId(t), op, urgent, clean: false }
}

/// Kernels 0..4 of 1000, 1, 1000, 1 us. A (1 GB) is used by kernel 0, B (1 GB) by kernel 2.
/// At boundary 1, A is offloaded while B is prefetched: one write and one read of 1 GB at once;
/// kernel 2 waits for B.
fn overlap_case(urgent_prefetch: bool) -> (Trace, Plan) {
    let mut t = Trace::new("overlap");
    t.kernels = kernels(&[1000.0, 1.0, 1000.0, 1.0]);
    t.tensors.push(weight(0, GB, TensorKind::Weight, vec![0]));
    t.tensors.push(weight(1, GB, TensorKind::Weight, vec![2]));
    let ssd = Move::Offload { dest: Tier::Ssd };
    let p = Plan {
        policy: "hand".into(),
        kernel_count: 4,
        tensor_count: 2,
        unlimited_memory: false,
        initially_offloaded: vec![InitialPlacement { tensor: TensorId(1), tier: Tier::Ssd }],
        instructions: vec![
            ins(1, 0, ssd, false),
            ins(1, 1, Move::Prefetch, urgent_prefetch),
            ins(3, 1, ssd, false),
            ins(3, 0, Move::Prefetch, false),
        ],
        host_kernels: Vec::new(),
        host_updates: Vec::new(),
        recomputations: Vec::new(),
        stats: Default::default(),
    };
    p.validate(&t).unwrap();
    (t, p)
}

fn one_iteration(t: &Trace, p: &Plan, hw: &Hardware) -> teraio_scheduler::SimReport {
    let opts = SimOptions { iterations: 1, record_timeline: true };
    let r = simulate(t, p, hw, &opts).unwrap();
    assert_eq!(r.outcome, Outcome::Completed);
    r
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

#[test]
fn combined_ssd_limit_slows_overlapping_reads_and_writes() {
    let (t, p) = overlap_case(false);
    // Without a combined limit: read and write at 2 GB/s each; B arrives 0.5 s after
    // boundary 1 (t = 1000 us), kernel 2 starts at 501 000 us, the iteration ends 1001 us later.
    let free = one_iteration(&t, &p, &one_ssd(None));
    assert!(close(free.iteration_time_us, 502_001.0), "{}", free.iteration_time_us);
    assert!(close(free.stall_us, 499_999.0), "{}", free.stall_us);
    // 3 GB/s in total: max-min fair, 1.5 GB/s each; B arrives after 1e9 / 1.5e9 s.
    let shared = one_iteration(&t, &p, &one_ssd(Some(3e9)));
    let arrive = 1000.0 + 1e6 / 1.5;
    assert!(close(shared.iteration_time_us, arrive + 1001.0), "{}", shared.iteration_time_us);
    assert!(close(shared.stall_us, arrive - 1001.0), "{}", shared.stall_us);
    assert!(shared.iteration_time_us > free.iteration_time_us);
    split_evenly(&shared, [Resource::SsdRead, Resource::SsdWrite, Resource::SsdDuplex], 3e9);
}

/// The recorded rates of directions `a` and `b` never exceed `limit` together, `both` records
/// their sum, and while both run they split the limit evenly.
fn split_evenly(r: &teraio_scheduler::SimReport, [a, b, both]: [Resource; 3], limit: f64) {
    let tl = r.timeline.as_ref().unwrap();
    let (a, b, both) = (a.index(), b.index(), both.index());
    for (_, v) in &tl.bandwidth {
        assert!(v[a] + v[b] <= limit * (1.0 + 1e-9), "{v:?}");
        assert!(close(v[both], v[a] + v[b]), "{v:?}");
    }
    let half = limit / 2.0;
    assert!(tl.bandwidth.iter().any(|(_, v)| close(v[a], half) && close(v[b], half)));
}

/// The same transfers over a PCIe link of 2 GB/s each way (SSDs far from limiting) that moves
/// `duplex` bytes/s in total both ways.
fn one_link(duplex: Option<f64>) -> Hardware {
    Hardware {
        ssd_read_bytes_per_s: 100e9,
        ssd_write_bytes_per_s: 100e9,
        pcie_h2d_bytes_per_s: 2e9,
        pcie_d2h_bytes_per_s: 2e9,
        pcie_duplex_bytes_per_s: duplex,
        ..one_ssd(None)
    }
}

#[test]
fn a_pcie_link_moving_both_ways_slows_overlapping_offloads_and_prefetches() {
    let (t, p) = overlap_case(false);
    let free = one_iteration(&t, &p, &one_link(None));
    assert!(close(free.iteration_time_us, 502_001.0), "{}", free.iteration_time_us);
    // 3 GB/s both ways together: 1.5 GB/s each while both run, B arrives after 1e9 / 1.5e9 s.
    let shared = one_iteration(&t, &p, &one_link(Some(3e9)));
    let arrive = 1000.0 + 1e6 / 1.5;
    assert!(close(shared.iteration_time_us, arrive + 1001.0), "{}", shared.iteration_time_us);
    split_evenly(&shared, [Resource::PcieH2d, Resource::PcieD2h, Resource::PcieDuplex], 3e9);
    // An urgent prefetch takes the link first: kernel 2 waits no longer than without a limit.
    let (t, p) = overlap_case(true);
    let urgent = one_iteration(&t, &p, &one_link(Some(3e9)));
    assert!(close(urgent.iteration_time_us, 502_001.0), "{}", urgent.iteration_time_us);
}

#[test]
fn urgent_prefetch_takes_the_combined_budget_first() {
    // Urgent B reads at its full 2 GB/s; A's write gets the remaining 1 GB/s: kernel 2 waits
    // exactly as long as without the limit.
    let (t, p) = overlap_case(true);
    let r = one_iteration(&t, &p, &one_ssd(Some(3e9)));
    assert!(close(r.iteration_time_us, 502_001.0), "{}", r.iteration_time_us);
    let tl = r.timeline.unwrap();
    let (rd, wr) = (Resource::SsdRead.index(), Resource::SsdWrite.index());
    assert!(tl.bandwidth.iter().any(|(_, v)| close(v[rd], 2e9) && close(v[wr], 1e9)));
}

#[test]
fn json_without_the_new_fields_still_parses() {
    let mut v = serde_json::to_value(Hardware::paper()).unwrap();
    let o = v.as_object_mut().unwrap();
    o.remove("ssd_duplex_bytes_per_s");
    o.remove("pcie_duplex_bytes_per_s");
    o.remove("cpu_adam_params_per_s");
    let hw: Hardware = serde_json::from_value(v).unwrap();
    assert_eq!(hw, Hardware::paper());
    let mut bad = Hardware::paper();
    bad.ssd_duplex_bytes_per_s = Some(0.0);
    assert!(bad.validate().unwrap_err().to_string().contains("ssd_duplex_bytes_per_s"));
    let mut bad = Hardware::paper();
    bad.pcie_duplex_bytes_per_s = Some(f64::NAN);
    assert!(bad.validate().unwrap_err().to_string().contains("pcie_duplex_bytes_per_s"));
}

/// Kernel 0 (GPU, 100 us) uses W (1 GB); kernel 1 runs on the host over W and S (a 2 GB
/// optimizer state that never enters GPU memory), streaming 2 GB in and 2 GB out.
fn host_case() -> (Trace, Plan) {
    let mut t = Trace::new("host");
    t.kernels = kernels(&[100.0, 50.0]);
    t.tensors.push(weight(0, GB, TensorKind::Weight, vec![0, 1]));
    t.tensors.push(weight(1, 2 * GB, TensorKind::OptimizerState, vec![1]));
    let p = Plan {
        policy: "hand".into(),
        kernel_count: 2,
        tensor_count: 2,
        unlimited_memory: false,
        initially_offloaded: vec![InitialPlacement { tensor: TensorId(1), tier: Tier::Ssd }],
        instructions: vec![
            ins(1, 0, Move::Offload { dest: Tier::Ssd }, false),
            ins(2, 0, Move::Prefetch, false),
        ],
        host_kernels: vec![HostKernel {
            kernel: 1,
            duration_us: 100.0,
            ssd_read_bytes: 2 * GB,
            ssd_write_bytes: 2 * GB,
            pipelined: true,
        }],
        host_updates: Vec::new(),
        recomputations: Vec::new(),
        stats: Default::default(),
    };
    p.validate(&t).unwrap();
    (t, p)
}

#[test]
fn host_kernel_waits_for_offload_and_its_streams() {
    let (t, p) = host_case();
    let mut hw = one_ssd(None);
    hw.ssd_write_bytes_per_s = 1e9;
    // W's offload at 1 GB/s: kernel 1 starts at 100 + 1e6 us; its streams take 1 s (read at
    // 2 GB/s) and 2 s (write at 1 GB/s), longer than its 100 us of CPU time.
    let r = one_iteration(&t, &p, &hw);
    assert!(close(r.stall_us, 1e6), "{}", r.stall_us);
    assert!(close(r.host_step_us, 2e6), "{}", r.host_step_us);
    assert!(close(r.iteration_time_us, 100.0 + 1e6 + 2e6), "{}", r.iteration_time_us);
    // Identity: ideal - GPU time of host kernels + host step + stall.
    let ideal = t.iteration_time_us();
    assert!(close(r.iteration_time_us, ideal - 50.0 + r.host_step_us + r.stall_us));
    // With 1.5 GB/s in total the two 2 GB streams share it: 0.75 GB/s each, 2/0.75 s.
    hw.ssd_duplex_bytes_per_s = Some(1.5e9);
    let r = one_iteration(&t, &p, &hw);
    assert!(close(r.host_step_us, 2e6 / 0.75), "{}", r.host_step_us);
    // CPU-bound: 10 s of compute hides the streams.
    let mut slow = p.clone();
    slow.host_kernels[0].duration_us = 10e6;
    let r = one_iteration(&t, &slow, &one_ssd(None));
    assert!(close(r.host_step_us, 10e6), "{}", r.host_step_us);
}

#[test]
fn host_kernel_without_pipelining_reads_computes_then_writes() {
    let (t, mut p) = host_case();
    p.host_kernels[0].pipelined = false;
    let mut hw = one_ssd(None);
    hw.ssd_write_bytes_per_s = 1e9;
    // Read 2 GB at 2 GB/s (1 s), 100 us of CPU, write 2 GB at 1 GB/s (2 s), one after the other.
    let r = one_iteration(&t, &p, &hw);
    assert!(close(r.host_step_us, 3e6 + 100.0), "{}", r.host_step_us);
    assert!(close(r.iteration_time_us, 100.0 + 1e6 + 3e6 + 100.0), "{}", r.iteration_time_us);
    let ideal = t.iteration_time_us();
    assert!(close(r.iteration_time_us, ideal - 50.0 + r.host_step_us + r.stall_us));
    // Nothing to read or write: the CPU time alone.
    p.host_kernels[0].ssd_read_bytes = 0;
    p.host_kernels[0].ssd_write_bytes = 0;
    let r = one_iteration(&t, &p, &hw);
    assert!(close(r.host_step_us, 100.0), "{}", r.host_step_us);
    // Old plan files (no `pipelined` field) keep the overlapping behaviour.
    let mut v = serde_json::to_value(&p).unwrap();
    v["host_kernels"][0].as_object_mut().unwrap().remove("pipelined");
    let old: Plan = serde_json::from_value(v).unwrap();
    assert!(old.host_kernels[0].pipelined);
}

#[test]
fn host_kernel_rules_are_validated() {
    let (t, p) = host_case();
    // W resident while the host kernel runs.
    let mut bad = p.clone();
    bad.instructions.clear();
    let e = bad.validate(&t).unwrap_err().to_string();
    assert!(e.contains("host kernel 1 while in GPU memory"), "{e}");
    // Without the host kernel, kernel 1 is a GPU kernel: W may not leave right before it.
    let mut bad = p.clone();
    bad.host_kernels.clear();
    let e = bad.validate(&t).unwrap_err().to_string();
    assert!(e.contains("offloaded right before kernel 1"), "{e}");
    let mut bad = p;
    bad.host_kernels[0].kernel = 2;
    assert!(bad.validate(&t).unwrap_err().to_string().contains("no kernel 2"));
}

/// zero-infinity on a small model: every AdamW kernel runs on the CPU, for exactly its
/// CPU-Adam time when the CPU is the bottleneck.
#[test]
fn zero_infinity_runs_the_optimizer_on_the_cpu() {
    let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
    cfg.micro_batch = 2;
    let t = generate(&cfg).unwrap();
    let mut hw = Hardware::paper();
    hw.gpu_memory_bytes = 2_500_000_000;
    hw.cpu_adam_params_per_s = 1e8; // slow CPU: streams (26 GB/s) are hidden behind compute
    let p = plan(&t, &hw, Policy::ZeroInfinityPipelined).unwrap();
    assert!(p.host_kernels.iter().all(|h| h.pipelined));
    p.validate(&t).unwrap();
    let adamw: Vec<usize> =
        (0..t.kernel_count()).filter(|&k| t.kernels[k].name.ends_with(".adamw")).collect();
    let hosted: Vec<usize> = p.host_kernels.iter().map(|h| h.kernel).collect();
    assert_eq!(hosted, adamw);
    let params: u64 = cfg.parameters_per_gpu();
    let cpu_us: f64 = p.host_kernels.iter().map(|h| h.duration_us).sum();
    assert!(close(cpu_us, params as f64 / 1e8 * 1e6), "{cpu_us} for {params} parameters");
    // fp32, as DeepSpeed does it: 16 bytes written and read back per parameter (the gradient,
    // which the step swaps out to NVMe and in, the fp32 master and two moments); the
    // parameter copy of a model this small stays in host memory (`max_in_cpu`).
    let read: u64 = p.host_kernels.iter().map(|h| h.ssd_read_bytes).sum();
    let written: u64 = p.host_kernels.iter().map(|h| h.ssd_write_bytes).sum();
    assert_eq!((read, written), (16 * params, 16 * params));
    // The optimizer states never enter GPU memory.
    for tn in t.tensors.iter().filter(|x| x.kind == TensorKind::OptimizerState) {
        assert!(p.initially_offloaded.iter().any(|i| i.tensor == tn.id));
        assert!(!p.instructions.iter().any(|i| i.tensor == tn.id));
    }
    let r = simulate(&t, &p, &hw, &SimOptions::default()).unwrap();
    assert_eq!(r.outcome, Outcome::Completed);
    assert!(r.peak_gpu_bytes <= hw.gpu_memory_bytes);
    assert!(!r.host_cap_exceeded);
    assert!(close(r.host_step_us, cpu_us), "{} vs {cpu_us}", r.host_step_us);
    let gpu_adamw: f64 = adamw.iter().map(|&k| t.kernels[k].duration_us).sum();
    let ideal = t.iteration_time_us();
    assert!(close(r.iteration_time_us, ideal - gpu_adamw + r.host_step_us + r.stall_us));
    // DeepSpeed's default (`zero-infinity`): the streams add to the CPU time, at the SSD
    // array's bandwidth (4 x 6.7 GB/s read, 4 x 6.5 GB/s write; weights read from NVMe).
    let seq = plan(&t, &hw, Policy::ZeroInfinity).unwrap();
    assert!(seq.host_kernels.iter().all(|h| !h.pipelined));
    let r = simulate(&t, &seq, &hw, &SimOptions::default()).unwrap();
    let streams_us = (read as f64 / 26.8e9 + written as f64 / 26e9) * 1e6;
    assert!(
        close(r.host_step_us, cpu_us + streams_us),
        "{} vs {cpu_us} + {streams_us}",
        r.host_step_us
    );
}

/// The overlap case with clean drops: A (read at kernel 0) and B (read at kernel 2) are never
/// written, so their SSD copies stay valid and both offloads can be drops. One SSD of 2 GB/s
/// read, 2 GB/s write and 2 GB/s in total.
fn drop_case() -> (Trace, Plan) {
    let (mut t, p) = overlap_case(false);
    for x in &mut t.tensors {
        x.writes = Some(Vec::new());
    }
    t.validate().unwrap();
    (t, p)
}

#[test]
fn clean_drop_frees_the_ssd_for_the_read() {
    let (t, dirty) = drop_case();
    let mut clean = dirty.clone();
    clean.mark_clean_drops(&t).unwrap();
    // Both offloads become drops; nothing else changes.
    let flags: Vec<bool> = clean.instructions.iter().map(|i| i.clean).collect();
    assert_eq!(flags, vec![true, false, true, false]);
    assert_eq!(clean.stats.clean_drop_bytes, 2 * GB);
    let hw = one_ssd(Some(2e9));
    // Written: A's write and B's read share 2 GB/s, 1 GB/s each: B arrives 1 s after
    // boundary 1 (t = 1000 us); kernels 2 and 3 take 1001 us more.
    let w = one_iteration(&t, &dirty, &hw);
    assert!(close(w.iteration_time_us, 1000.0 + 1e6 + 1001.0), "{}", w.iteration_time_us);
    assert_eq!(w.clean_drops, 0);
    // Dropped: A's memory goes at once, B reads alone at 2 GB/s: 0.5 s.
    let d = one_iteration(&t, &clean, &hw);
    assert!(close(d.iteration_time_us, 1000.0 + 5e5 + 1001.0), "{}", d.iteration_time_us);
    assert!(close(d.stall_us, 5e5 - 1.0), "{}", d.stall_us);
    assert_eq!(d.clean_drops, 2, "A's at boundary 1, B's at boundary 3");
    let bytes = |r: &teraio_scheduler::SimReport, res: Resource| {
        r.bytes_moved.iter().find(|b| b.resource == res).unwrap().bytes
    };
    assert_eq!(bytes(&d, Resource::SsdWrite), 0);
    // B, and 1 us of A's prefetch (issued at boundary 3) at 2 GB/s before the iteration ends.
    assert_eq!(bytes(&d, Resource::SsdRead), GB + 2000);
    // A, and 1 us of B's write at boundary 3 (sharing 2 GB/s with A's read: 1 GB/s).
    assert_eq!(bytes(&w, Resource::SsdWrite), GB + 1000);
    // A drop releases memory at once: B's allocation comes after A's release (peak 1 GB);
    // while A's write runs, both are allocated (2 GB).
    assert_eq!(d.peak_gpu_bytes, GB);
    assert_eq!(w.peak_gpu_bytes, 2 * GB);
    // A drop writes nothing but its copy stays on the SSD: A's (written by a run's first
    // iteration, though A starts resident) and B's. An array that holds one of them is full.
    assert_eq!(d.peak_ssd_bytes, 2 * GB);
    assert!(!d.ssd_cap_exceeded);
    let small = Hardware { ssd_capacity_bytes: Some(3 * GB / 2), ..hw.clone() };
    assert!(one_iteration(&t, &clean, &small).ssd_cap_exceeded);
    let two = simulate(&t, &clean, &small, &SimOptions::default()).unwrap();
    assert!(two.ssd_cap_exceeded && two.peak_ssd_bytes == 2 * GB, "{two:?}");
}

#[test]
fn dirty_drops_are_rejected() {
    let (mut t, p) = drop_case();
    let mut clean = p.clone();
    clean.mark_clean_drops(&t).unwrap();
    clean.validate(&t).unwrap();
    // Kernel 0 writes A: its SSD copy (made at boundary 1 of the previous iteration) is stale
    // by boundary 1, so A's drop is invalid; B's stays valid.
    t.tensors[0].writes = Some(vec![0]);
    let e = clean.validate(&t).unwrap_err().to_string();
    assert!(e.contains("instructions[0].clean") && e.contains("not valid"), "{e}");
    let mut again = p.clone();
    again.mark_clean_drops(&t).unwrap();
    let flags: Vec<bool> = again.instructions.iter().map(|i| i.clean).collect();
    assert_eq!(flags, vec![false, false, true, false]);
    // Old traces (every access writes): no drop is valid.
    for x in &mut t.tensors {
        x.writes = None;
    }
    let e = clean.validate(&t).unwrap_err().to_string();
    assert!(e.contains("clean drop of t"), "{e}");
    let mut old = p.clone();
    old.mark_clean_drops(&t).unwrap();
    assert!(old.instructions.iter().all(|i| !i.clean));
    assert_eq!(old, p);
    // Only offloads to the SSD can be drops.
    let (t, _) = drop_case();
    let mut host = p.clone();
    host.instructions[0].op = Move::Offload { dest: Tier::Host };
    host.instructions[0].clean = true;
    let e = host.validate(&t).unwrap_err().to_string();
    assert!(e.contains("instructions[0].clean") && e.contains("ssd"), "{e}");
    let mut pre = p.clone();
    pre.instructions[1].clean = true;
    assert!(pre.validate(&t).unwrap_err().to_string().contains("instructions[1].clean"));
}

/// A drop right after a prefetch, before any kernel used the tensor, is rejected.
#[test]
fn drop_of_an_unused_prefetch_is_rejected() {
    let mut t = Trace::new("unused");
    t.kernels = kernels(&[10.0, 10.0, 10.0]);
    t.tensors.push(weight(0, GB, TensorKind::Weight, vec![0]));
    t.tensors[0].writes = Some(Vec::new());
    let p = Plan {
        policy: "hand".into(),
        kernel_count: 3,
        tensor_count: 1,
        unlimited_memory: false,
        initially_offloaded: Vec::new(),
        instructions: vec![
            ins(1, 0, Move::Offload { dest: Tier::Ssd }, false),
            ins(2, 0, Move::Prefetch, false),
            Instruction::drop_clean(3, TensorId(0)),
            ins(3, 0, Move::Prefetch, false),
        ],
        host_kernels: Vec::new(),
        host_updates: Vec::new(),
        recomputations: Vec::new(),
        stats: Default::default(),
    };
    let e = p.validate(&t).unwrap_err().to_string();
    assert!(e.contains("instructions[2].clean") && e.contains("before any kernel used"), "{e}");
}

/// Host kernels update the SSD copy itself: zero-infinity's weights on NVMe (written only by
/// the CPU optimizer step, on their NVMe copy) are always dropped, never written back by the
/// GPU; gradients and activations (written on the GPU) never are. gpt2-xl (1.6 billion
/// parameters) is past DeepSpeed's `max_in_cpu` (10^9 elements): its first weights are held
/// in host memory, the rest on NVMe, and the step writes the parameter copy of those (20
/// bytes per parameter in all) but not of the others (16).
#[test]
fn zero_infinity_drops_its_parameters() {
    let mut cfg = ModelConfig::preset("gpt2-xl").unwrap();
    cfg.micro_batch = 1;
    cfg.micro_batches = 2;
    let t = generate(&cfg).unwrap();
    let hw = Hardware::paper();
    let p = plan(&t, &hw, Policy::ZeroInfinity).unwrap();
    let mut on_ssd = HashMap::new();
    for i in &p.instructions {
        let Move::Offload { dest } = i.op else { continue };
        let x = t.tensor(i.tensor);
        match x.kind {
            TensorKind::Weight if dest == Tier::Ssd => {
                assert!(i.clean, "{} written back", x.name);
                on_ssd.insert(x.id, x.bytes);
            }
            // Held in host memory: a host copy does not outlive a prefetch in a plan, so
            // the release is a write (generous to DeepSpeed by that D2H traffic).
            TensorKind::Weight => assert!(!on_ssd.contains_key(&x.id), "{} on both", x.name),
            _ => assert!(!i.clean, "{} dropped", x.name),
        }
    }
    // An NVMe weight is read again for every use but the ones right after another use
    // (DeepSpeed re-read its NVMe parameters on every use, docs/BENCHMARKS.md).
    let n = t.kernel_count();
    let hosted: Vec<usize> = p.host_kernels.iter().map(|h| h.kernel).collect();
    for (&id, &bytes) in &on_ssd {
        let x = t.tensor(id);
        if bytes < 400_000 {
            continue; // persistent (under 10^5 elements): moved only around the step, below
        }
        let gpu: Vec<usize> = x.accesses.iter().copied().filter(|k| !hosted.contains(k)).collect();
        let mut gaps: Vec<(usize, usize)> = gpu.windows(2).map(|w| (w[0], w[1])).collect();
        gaps.push((gpu[gpu.len() - 1], gpu[0] + n));
        let reads = gaps.iter().filter(|(a, b)| b - a > 1).count();
        let prefetches = p
            .instructions
            .iter()
            .filter(|i| i.tensor == id && matches!(i.op, Move::Prefetch))
            .count();
        assert_eq!(prefetches, reads, "{}", x.name);
    }
    let params = cfg.parameters_per_gpu();
    let nvme_params: u64 = on_ssd.values().sum::<u64>() / 4;
    assert!(nvme_params > 0 && params - nvme_params <= 1_000_000_000, "{nvme_params} of {params}");
    // Persistent parameters (norms, under 10^5 elements) move only around the CPU step.
    for x in t.tensors.iter().filter(|x| x.kind == TensorKind::Weight && x.bytes < 400_000) {
        let moves = p.instructions.iter().filter(|i| i.tensor == x.id).count();
        assert!(moves <= 2, "{} moved {moves} times", x.name);
    }
    let written: u64 = p.host_kernels.iter().map(|h| h.ssd_write_bytes).sum();
    let read: u64 = p.host_kernels.iter().map(|h| h.ssd_read_bytes).sum();
    assert_eq!((read, written), (16 * params, 16 * params + 4 * nvme_params));
    let r = simulate(&t, &p, &hw, &SimOptions::default()).unwrap();
    assert_eq!(r.outcome, Outcome::Completed);
    // Every SSD write of the iteration is the CPU step's (the gradients wait in host memory).
    let ssd_wr = r.bytes_moved.iter().find(|b| b.resource == Resource::SsdWrite).unwrap().bytes;
    assert!(ssd_wr.abs_diff(written) <= 64, "{ssd_wr} vs {written}");
}

/// DeepSpeed releases a parameter after a use only when more than `stage3_max_reuse_distance`
/// (10^9) parameter elements are used before its next use: on a model smaller than that,
/// zero-infinity keeps every weight on the GPU between uses, and moves weights only around
/// the CPU step.
#[test]
fn zero_infinity_keeps_parameters_reused_soon() {
    let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
    cfg.micro_batch = 2;
    cfg.micro_batches = 2;
    let t = generate(&cfg).unwrap();
    let p = plan(&t, &Hardware::paper(), Policy::ZeroInfinity).unwrap();
    for x in t.tensors.iter().filter(|x| x.kind == TensorKind::Weight) {
        let moves: Vec<_> = p.instructions.iter().filter(|i| i.tensor == x.id).collect();
        assert_eq!(moves.len(), 2, "{}: {moves:?}", x.name);
        let hosted = p.host_kernels.iter().map(|h| h.kernel);
        let step = hosted.filter(|&k| x.accesses.contains(&k)).collect::<Vec<_>>();
        assert_eq!(step.len(), 1, "{}", x.name);
        assert!(moves[0].issue_before_kernel <= step[0], "{}: {moves:?}", x.name);
    }
}

/// Regression: gpt2-replay at 0.5 s per iteration on 1.02 GB of GPU memory and 0.5 GB/s of
/// SSD bandwidth in all (reads and writes shared). The bandwidth cannot carry what `teraio`
/// chooses, and its early-issued prefetches used to take the memory kernel 113's creations
/// needed with nothing in flight to release it: out of memory in the simulator, where `lru`
/// completes. Every teraio plan must complete (stalling is fine).
#[test]
fn teraio_under_heavy_bandwidth_pressure_completes() {
    let mut cfg = ModelConfig::preset("gpt2-replay").unwrap();
    cfg.target_iteration_us = Some(0.5e6);
    let trace = generate(&cfg).unwrap();
    let bw = 0.5e9;
    let hw = Hardware {
        gpu_memory_bytes: 1_015_906_713,
        ssd_count: 4,
        ssd_read_bytes_per_s: bw / 4.0,
        ssd_write_bytes_per_s: bw / 4.0,
        ssd_latency_us: 200.0,
        pcie_h2d_bytes_per_s: 50e9,
        pcie_d2h_bytes_per_s: 50e9,
        host_memory_cap_bytes: 0,
        host_memory_bytes_per_s: 50e9,
        gpudirect: true,
        ssd_duplex_bytes_per_s: Some(bw / 4.0),
        pcie_duplex_bytes_per_s: None,
        cpu_adam_params_per_s: Hardware::paper().cpu_adam_params_per_s,
        ssd_capacity_bytes: None,
        ssd_endurance_tbw: None,
    };
    for (policy, r) in teraio_completes_where_lru_does(&trace, &hw) {
        assert!(r.iteration_time_us > 0.0 && r.stall_us > 0.0, "{policy}: {r:?}");
    }
}

/// A feasible plan exists (`lru`'s completes), and both `teraio` policies' plans are valid
/// and complete too; their reports.
fn teraio_completes_where_lru_does(
    trace: &Trace,
    hw: &Hardware,
) -> Vec<(Policy, teraio_scheduler::SimReport)> {
    let opts = SimOptions::default();
    let lru = simulate(trace, &plan(trace, hw, Policy::Lru).unwrap(), hw, &opts).unwrap();
    assert_eq!(lru.outcome, Outcome::Completed);
    [Policy::Teraio, Policy::TeraioHybrid]
        .into_iter()
        .map(|policy| {
            let p = plan(trace, hw, policy).unwrap();
            p.validate(trace).unwrap();
            let r = simulate(trace, &p, hw, &opts).unwrap();
            assert_eq!(r.outcome, Outcome::Completed, "{policy}");
            (policy, r)
        })
        .collect()
}

/// Regression: gpt2-small with TF32 matmuls (kernels of tens of microseconds) on 6 GB of GPU
/// memory and one SSD. Most inactive intervals are far shorter than their transfers at any
/// bandwidth, so the bandwidth-aware phases could not bring memory under capacity and the
/// plan ran out of memory where on-demand swapping (`lru`) completes. The forced phase takes
/// such intervals as on-demand fetches: the plan completes, stalling.
#[test]
fn teraio_completes_when_intervals_are_shorter_than_their_transfers() {
    let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
    cfg.dtype = teraio_scheduler::Dtype::Tf32;
    let trace = generate(&cfg).unwrap();
    let mut hw = Hardware::paper();
    hw.gpu_memory_bytes = 6_000_000_000;
    hw.ssd_count = 1;
    hw.host_memory_cap_bytes = 0;
    for (policy, r) in teraio_completes_where_lru_does(&trace, &hw) {
        assert!(r.peak_gpu_bytes <= hw.gpu_memory_bytes);
        assert!(r.stall_us > 0.0, "{policy}: {r:?}");
    }
}

/// A non-global tensor: created by its first access, alive until `dies_after`.
fn temp(id: u32, bytes: u64, kind: TensorKind, accesses: Vec<usize>, dies_after: usize) -> Tensor {
    Tensor {
        id: TensorId(id),
        name: format!("t{id}"),
        bytes,
        kind,
        global: false,
        created_by: Some(accesses[0]),
        accesses,
        dies_after: Some(dies_after),
        writes: None,
        producer: None,
    }
}

/// Three kernels, the first two 1 us long; only the host tier (no SSD). Kernel 1 is above
/// capacity by 87 MB and only W (156 MB, used by kernel 0) can leave over it; S (123 MB)
/// can leave over kernel 2 only. Host room: exactly W.
fn short_kernel_case(extra: Option<u64>) -> (Trace, Hardware) {
    let mut t = Trace::new("short-kernel");
    t.kernels = kernels(&[1.0, 1.0, 993.6]);
    let mut id = 0;
    let mut next = || {
        id += 1;
        id - 1
    };
    if let Some(bytes) = extra {
        // Activations alive over kernel 2: more pressure there.
        t.tensors.push(temp(next(), bytes, TensorKind::Activation, vec![0], 2));
        t.tensors.push(temp(next(), 77_037_087, TensorKind::Activation, vec![2], 2));
    } else {
        t.tensors.push(temp(next(), 85_341_545, TensorKind::Activation, vec![0], 1));
    }
    t.tensors.push(weight(next(), 122_950_460, TensorKind::OptimizerState, vec![0, 1]));
    t.tensors.push(temp(next(), 122_057_082, TensorKind::Gradient, vec![1, 2], 2));
    t.tensors.push(weight(next(), 156_239_078, TensorKind::Weight, vec![0]));
    t.tensors.push(temp(next(), 119_121_608, TensorKind::Gradient, vec![0, 1, 2], 2));
    t.validate().unwrap();
    let peak = t.resident_memory_per_kernel().into_iter().max().unwrap();
    let mut hw = Hardware::paper();
    hw.gpu_memory_bytes = peak - 86_902_380;
    hw.ssd_count = 0;
    hw.host_memory_cap_bytes = 156_239_078;
    (t, hw)
}

/// Regression (found by `teraio_completes_where_lru_does`): the forced phase used to rank by
/// time-weighted area, where a 1 us kernel above capacity counts for almost nothing; S won,
/// took the host room, and kernel 1 ran out of memory. It now ranks by bytes above capacity
/// per kernel and takes W.
#[test]
fn forced_phase_counts_every_kernel_above_capacity() {
    let (t, hw) = short_kernel_case(None);
    for (policy, r) in teraio_completes_where_lru_does(&t, &hw) {
        assert!(r.peak_gpu_bytes <= hw.gpu_memory_bytes, "{policy}");
        let p = plan(&t, &hw, policy).unwrap();
        assert_eq!(p.policy, policy.as_str(), "no fallback needed");
        assert!(p.instructions.iter().any(|i| i.tensor == TensorId(3)), "W moves");
        assert!(!p.instructions.iter().any(|i| i.tensor == TensorId(1)), "S stays");
    }
}

/// With more pressure on kernel 2, the greedy's choice of S is still its best local choice and
/// W no longer fits on the host after it: `teraio` falls back to on-demand swapping rather
/// than run out of memory, and says so.
#[test]
fn teraio_falls_back_to_lru_where_its_greedy_cannot_fit() {
    let (mut t, mut hw) = short_kernel_case(Some(138_895_468));
    let peak = t.resident_memory_per_kernel().into_iter().max().unwrap();
    hw.gpu_memory_bytes = (peak as f64 * 0.856528021514001) as u64;
    hw.host_memory_cap_bytes = (peak as f64 * 0.257943796044329) as u64;
    t.name = "short-kernel-2".into();
    for (policy, _) in teraio_completes_where_lru_does(&t, &hw) {
        let p = plan(&t, &hw, policy).unwrap();
        assert_eq!(p.policy, format!("{policy}+lru-fallback"));
    }
}

/// The timeline's per-kernel waits account for the whole stall, kernel by kernel, and
/// `longest_stalls` lists the longest first. gpt2-replay on the dev machine's model (about
/// half the memory it needs, a slow array), where `lru` waits a lot.
#[test]
fn kernel_stalls_add_up_to_the_reported_stall() {
    let trace = generate(&ModelConfig::preset("gpt2-replay").unwrap()).unwrap();
    let hw = Hardware::dev();
    let p = plan(&trace, &hw, Policy::Lru).unwrap();
    let opts = SimOptions { iterations: 2, record_timeline: true };
    let r = simulate(&trace, &p, &hw, &opts).unwrap();
    assert_eq!(r.outcome, Outcome::Completed);
    assert!(r.stall_us > 1e5, "lru should stall here: {} us", r.stall_us);
    let tl = r.timeline.as_ref().unwrap();
    assert_eq!(tl.kernel_stalls_us.len(), trace.kernel_count());
    let sum: f64 = tl.kernel_stalls_us.iter().sum();
    assert!((sum - r.stall_us).abs() < 1e-6 * r.stall_us.max(1.0), "{sum} vs {}", r.stall_us);
    // Each wait is the gap between the kernel before it finishing and this one starting.
    for k in 1..trace.kernel_count() {
        let gap =
            tl.kernel_starts_us[k] - tl.kernel_starts_us[k - 1] - trace.kernels[k - 1].duration_us;
        assert!(
            (gap - tl.kernel_stalls_us[k]).abs() < 1e-3,
            "kernel {k}: {gap} vs {}",
            tl.kernel_stalls_us[k]
        );
    }
    let top = tl.longest_stalls(5);
    assert_eq!(top.len(), 5);
    assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "{top:?}");
    let max = tl.kernel_stalls_us.iter().copied().fold(0.0, f64::max);
    assert_eq!(top[0].1, max);
    assert!(tl.longest_stalls(usize::MAX).iter().all(|s| s.1 > 0.0));
}
