//! FSDP2 in generated traces (`ModelConfig::fsdp_ranks`) and the N-rank sweep
//! (`teraio_scheduler::fsdp`): one rank's shards, FSDP's gathered parameters kept, the
//! collectives' time, the CPU offload model, and the errors for bad arguments.

use std::collections::HashMap;

use teraio_scheduler::analysis::inactive_intervals;
use teraio_scheduler::fsdp::{SweepOptions, cpu_offload_config, shard_copy_bytes, sweep};
use teraio_scheduler::model::is_fsdp_collective;
use teraio_scheduler::{
    Hardware, ModelConfig, Outcome, Plan, Policy, SelectOptions, SimOptions, TensorKind, Trace,
    choose, generate, simulate,
};

/// A small GPT-2 (4 layers, 2 micro-batches) in `dtype`, with `fsdp` ranks (0: none).
fn model(dtype: &str, fsdp: u32) -> ModelConfig {
    let mut spec = format!("gpt2-small,layers=4,micro-batches=2,micro-batch=2,dtype={dtype}");
    if fsdp > 0 {
        spec.push_str(&format!(",fsdp-ranks={fsdp}"));
    }
    ModelConfig::from_spec(&spec).unwrap()
}

fn make(cfg: &ModelConfig) -> Trace {
    let t = generate(cfg).unwrap();
    t.validate().unwrap();
    t
}

/// FSDP's own tensors: the gathered parameters and the micro-batches' unsharded gradients.
fn is_unsharded(name: &str) -> bool {
    name.contains(".unsharded")
}

fn gathered(t: &Trace) -> Vec<&teraio_scheduler::Tensor> {
    t.tensors.iter().filter(|x| x.kind == TensorKind::Weight && is_unsharded(&x.name)).collect()
}

/// Bytes of parameters, gradients and optimizer states, FSDP's unsharded copies left out.
fn model_state_bytes(t: &Trace) -> u64 {
    t.tensors
        .iter()
        .filter(|x| !matches!(x.kind, TensorKind::Activation | TensorKind::Workspace))
        .filter(|x| !is_unsharded(&x.name))
        .map(|x| x.bytes)
        .sum()
}

#[test]
fn each_rank_holds_one_nth_of_the_parameters_gradients_and_states() {
    for dtype in ["fp32", "bf16"] {
        let plain = make(&model(dtype, 0));
        let whole = model_state_bytes(&plain);
        // 16 bytes a parameter either way: bf16 weights and gradients plus fp32 master and
        // moments, or FSDP2's fp32 shards, fp32 gradient shards and moments.
        let params = model(dtype, 0).parameters_per_gpu();
        assert_eq!(whole, 16 * params, "{dtype}");
        let tensors_per_param = 4;
        let shards = plain.tensors.iter().filter(|x| x.kind == TensorKind::Weight).count() as u64;
        for n in [1u32, 2, 3, 4, 8] {
            let t = make(&model(dtype, n));
            let per_rank = model_state_bytes(&t);
            // ceil(elements / n) per shard: n x a rank's bytes exceed the whole by less than
            // one element per rank of every shard (4 bytes, 4 tensors a parameter).
            let n64 = u64::from(n);
            let slack = shards * tensors_per_param * 4 * (n64 - 1);
            assert!(per_rank * n64 >= whole, "{dtype} {n}: {per_rank} x {n} < {whole}");
            assert!(per_rank * n64 - whole <= slack, "{dtype} {n}: {per_rank} x {n} vs {whole}");
            // The global ones (weights, moments) are shards of the whole parameter too.
            for x in t.tensors.iter().filter(|x| x.global) {
                let full = plain.tensors.iter().find(|p| p.name == x.name);
                if let Some(p) = full.filter(|p| p.kind == TensorKind::OptimizerState) {
                    assert_eq!(x.bytes, (p.bytes / 4).div_ceil(n64) * 4, "{}", x.name);
                }
            }
        }
    }
}

#[test]
fn one_rank_is_the_plain_trace_plus_the_gathered_copies_and_zero_time_collectives() {
    let plain = make(&model("fp32", 0));
    let one = make(&model("fp32", 1));
    // The kernels: the plain ones, same names and times, in the same order, plus collectives
    // that take no time (nothing to send with one rank).
    let compute: Vec<_> = one.kernels.iter().filter(|k| !is_fsdp_collective(k)).collect();
    assert_eq!(compute.len(), plain.kernel_count());
    for (a, b) in compute.iter().zip(&plain.kernels) {
        assert_eq!((&a.name, a.duration_us, a.layer), (&b.name, b.duration_us, b.layer));
    }
    let collectives: Vec<_> = one.kernels.iter().filter(|k| is_fsdp_collective(k)).collect();
    // Per micro-batch: the root's and each layer's all-gather for forward and for backward,
    // the root's and each layer's reduce-scatter.
    let (layers, mbs) = (4, 2);
    assert_eq!(collectives.len(), mbs * (1 + 2 * layers + layers + 1));
    assert!(collectives.iter().all(|k| k.duration_us == 0.0));
    assert_eq!(one.iteration_time_us(), plain.iteration_time_us());
    // The tensors: every plain one by name, same size, kind and lifetime class (a weight's
    // shard is the whole weight with one rank), plus FSDP's unsharded ones.
    let by_name: HashMap<&str, _> = one.tensors.iter().map(|x| (x.name.as_str(), x)).collect();
    for p in &plain.tensors {
        let x = by_name.get(p.name.as_str()).unwrap_or_else(|| panic!("{} missing", p.name));
        assert_eq!((x.bytes, x.kind, x.global), (p.bytes, p.kind, p.global), "{}", p.name);
    }
    let extra: Vec<_> = one.tensors.iter().filter(|x| is_unsharded(&x.name)).collect();
    assert_eq!(extra.len(), one.tensors.len() - plain.tensors.len());
    let params = plain.tensors.iter().filter(|x| x.kind == TensorKind::Weight).count();
    let root = 2; // embedding (tied with the head) and final norm
    let per_layer = (params - root) / layers;
    let gathered = mbs * (root + 2 * layers * per_layer);
    let unsharded_grads = mbs * params;
    assert_eq!(extra.len(), gathered + unsharded_grads);
    assert!(extra.iter().all(|x| !x.global));
}

#[test]
fn the_gathered_parameters_are_kept_and_never_moved() {
    let cfg = model("bf16", 4);
    let t = make(&cfg);
    let g = gathered(&t);
    assert!(!g.is_empty());
    let ids: Vec<_> = g.iter().map(|x| x.id).collect();
    // Accessed by every kernel of their lifetime: no interval to move them in, and nothing
    // made from them is recomputed.
    for x in &g {
        let (from, to) = (x.created_by.unwrap(), x.dies_after.unwrap());
        assert_eq!(x.accesses, (from..=to).collect::<Vec<_>>(), "{}", x.name);
        assert!(x.producer.is_none());
    }
    assert!(inactive_intervals(&t).iter().all(|i| !ids.contains(&i.tensor)));
    for x in t.tensors.iter().filter_map(|x| x.producer.as_ref()) {
        assert!(x.inputs.iter().all(|i| !ids.contains(i)));
    }
    // A layer's copies for its forward are gathered while the layer before computes and
    // freed after its own last forward kernel.
    let l2 = t.tensors.iter().find(|x| x.name == "mb0.L2.wqkv.w.unsharded.fwd").unwrap();
    let k = |name: &str| t.kernels.iter().position(|k| k.name == name).unwrap();
    assert_eq!(l2.created_by, Some(k("mb0.L2.all_gather.fwd")));
    assert!(l2.created_by.unwrap() < k("mb0.L1.norm1.fwd"));
    assert_eq!(l2.dies_after, Some(k("mb0.L2.add2.fwd")));
    assert!(t.kernels[k("mb0.L2.qkv.fwd")].name.ends_with("qkv.fwd"));
    // Under a cap the plan moves other tensors, never these.
    let peak = t.resident_memory_per_kernel().into_iter().max().unwrap();
    let mut hw = Hardware::paper();
    hw.gpu_memory_bytes = peak * 7 / 10;
    let s =
        choose(&t, &hw, &SelectOptions::cli(Policy::Auto, Default::default(), hw.gpu_memory_bytes))
            .unwrap();
    assert_eq!(s.report.outcome, Outcome::Completed);
    assert!(s.report.peak_gpu_bytes <= hw.gpu_memory_bytes);
    assert!(!s.plan.instructions.is_empty(), "the cap is below the peak: something moves");
    assert!(s.plan.instructions.iter().all(|i| !ids.contains(&i.tensor)));
    assert!(s.plan.recomputations.iter().all(|r| !ids.contains(&r.tensor)));
}

/// Link time of the collectives without overlap (each kernel's duration is its link time).
fn link_s(cfg: &ModelConfig) -> f64 {
    let t = make(&ModelConfig { fsdp_no_overlap: true, ..cfg.clone() });
    t.kernels.iter().filter(|k| is_fsdp_collective(k)).map(|k| k.duration_us).sum::<f64>() / 1e6
}

#[test]
fn the_collectives_take_the_ring_time_on_the_link_less_what_compute_hides() {
    let cfg = model("fp32", 8);
    // All-gathers (forward and backward) of the whole parameters in fp32 and reduce-scatters
    // of their fp32 gradients, per micro-batch, but the root's all-gather only once: each
    // (n-1)/n of the bytes at the link's rate.
    let params = cfg.parameters_per_gpu() as f64;
    let root_params = (cfg.vocab * cfg.hidden + cfg.hidden) as f64;
    let per_mb = 4.0 * (2.0 * params - root_params) + 4.0 * params;
    let expected = 2.0 * per_mb * 7.0 / 8.0 / cfg.link_bytes_per_s();
    let got = link_s(&cfg);
    assert!((got - expected).abs() < 1e-9 * expected.max(1.0), "{got} vs {expected}");
    // Twice the link, half the time; with overlap, less exposed than on the link.
    let fast = ModelConfig::from_spec(
        "gpt2-small,layers=4,micro-batches=2,micro-batch=2,fsdp-ranks=8,link-gbps=700",
    )
    .unwrap();
    assert!((link_s(&fast) - got / 2.0).abs() < 1e-9);
    let t = make(&cfg);
    let exposed: f64 =
        t.kernels.iter().filter(|k| is_fsdp_collective(k)).map(|k| k.duration_us).sum::<f64>()
            / 1e6;
    assert!(exposed < got, "{exposed} vs {got}");
    let plain = make(&model("fp32", 0));
    let overhead = (t.iteration_time_us() - plain.iteration_time_us()) / 1e6;
    // (the optimizer steps shards: less GPU time than the plain step)
    assert!(overhead < exposed, "{overhead} vs {exposed}");
}

#[test]
fn cpu_offload_leaves_only_activations_and_fsdps_tensors_on_the_gpu() {
    let cfg = model("bf16", 2);
    let t = make(&cfg);
    let hw = Hardware::paper();
    let cpu = make(&cpu_offload_config(&cfg, &hw));
    // No shard, gradient shard or optimizer state in GPU memory.
    assert!(cpu.tensors.iter().all(|x| !x.global));
    assert!(cpu.tensors.iter().all(|x| x.kind != TensorKind::OptimizerState));
    assert!(
        cpu.tensors
            .iter()
            .filter(|x| matches!(x.kind, TensorKind::Weight | TensorKind::Gradient))
            .all(|x| is_unsharded(&x.name))
    );
    // The optimizer on the CPU: its kernels take the shards' parameters at the CPU's rate.
    let step_us: f64 =
        cpu.kernels.iter().filter(|k| k.name.ends_with(".cpu_adamw")).map(|k| k.duration_us).sum();
    let shard_params: u64 =
        t.tensors.iter().filter(|x| x.name.ends_with(".adam_m")).map(|x| x.bytes / 4).sum();
    let expected = shard_params as f64 / hw.cpu_adam_params_per_s * 1e6;
    assert!((step_us - expected).abs() < 1e-6 * expected, "{step_us} vs {expected}");
    // The copies: every all-gather's shards up and every reduce-scatter's down, in the
    // collectives' time (no overlap: each collective's duration is its link time).
    let serial = |c: &ModelConfig| ModelConfig { fsdp_no_overlap: true, ..c.clone() };
    let comm = |t: &Trace| -> f64 {
        t.kernels.iter().filter(|k| is_fsdp_collective(k)).map(|k| k.duration_us).sum()
    };
    let with = comm(&make(&serial(&cpu_offload_config(&cfg, &hw))));
    let without = comm(&make(&serial(&cfg)));
    let bytes = shard_copy_bytes(&t) as f64;
    let copy_us = bytes / hw.pcie_h2d_bytes_per_s.min(hw.host_memory_bytes_per_s) * 1e6;
    assert_eq!(hw.pcie_h2d_bytes_per_s, hw.pcie_d2h_bytes_per_s);
    assert!((with - without - copy_us).abs() < 1e-6 * copy_us, "{with} {without} {copy_us}");
    // A layer's backward hides the next layer's all-gather (copy up in its stream) and the
    // layer after's reduce-scatter (copy down in the other): with slow copies and one rank (no
    // link time) the GPU waits for the longer stream, not for both.
    let slow = ModelConfig {
        fsdp_cpu_offload: Some(teraio_scheduler::FsdpCpuOffload {
            h2d_bytes_per_s: 1e9,
            d2h_bytes_per_s: 1e9,
            cpu_adam_params_per_s: 1e9,
        }),
        ..model("fp32", 1)
    };
    let c = make(&slow);
    let dur = |name: &str| c.kernels.iter().find(|k| k.name == name).unwrap().duration_us;
    let l2_bwd: f64 = c
        .kernels
        .iter()
        .filter(|k| k.name.starts_with("mb0.L2.") && k.name.ends_with(".bwd"))
        .filter(|k| !is_fsdp_collective(k))
        .map(|k| k.duration_us)
        .sum();
    let layer_copy_us = |l: u32| -> f64 {
        let shard: u64 = t
            .tensors
            .iter()
            .filter(|x| x.name.starts_with(&format!("L{l}.")) && x.name.ends_with(".adam_m"))
            .map(|x| x.bytes)
            .sum();
        // (one rank: the shard is the whole parameter; `t` has two ranks)
        (shard * 2) as f64 / 1e9 * 1e6
    };
    let (up, down) = (layer_copy_us(1), layer_copy_us(3));
    assert!((up - down).abs() < 1.0 && up > 2.0 * l2_bwd, "{up} {down} {l2_bwd}");
    let exposed = dur("mb0.L1.all_gather.bwd") + dur("mb0.L3.reduce_scatter");
    assert!((exposed - (up.max(down) - l2_bwd)).abs() < 1e-6 * up, "{exposed} vs {up} - {l2_bwd}");
    // Nothing moves in its plan: under a cap below its peak it runs out of memory.
    let peak = cpu.resident_memory_per_kernel().into_iter().max().unwrap();
    let mut small = hw.clone();
    small.gpu_memory_bytes = peak - 1;
    let r = simulate(&cpu, &Plan::empty("fsdp-cpu-offload", &cpu), &small, &SimOptions::default())
        .unwrap();
    assert!(matches!(r.outcome, Outcome::OutOfMemory { .. }));
    small.gpu_memory_bytes = peak;
    let r = simulate(&cpu, &Plan::empty("fsdp-cpu-offload", &cpu), &small, &SimOptions::default())
        .unwrap();
    assert_eq!(r.outcome, Outcome::Completed);
    assert!(r.iteration_time_us > t.iteration_time_us());
}

#[test]
fn the_sweep_reports_each_rank_count_and_the_jobs_tokens() {
    let cfg = model("fp32", 0);
    let plain = make(&cfg);
    let peak = plain.resident_memory_per_kernel().into_iter().max().unwrap();
    let mut hw = Hardware::paper();
    hw.gpu_memory_bytes = peak * 3 / 4;
    let rows = sweep(&cfg, &[1, 2, 4], &hw, &SweepOptions::default()).unwrap();
    assert_eq!(rows.iter().map(|r| r.ranks).collect::<Vec<_>>(), [1, 2, 4]);
    let tokens = cfg.tokens_per_iteration();
    for r in &rows {
        assert_eq!(r.tokens_per_rank, tokens);
        assert_eq!(r.gpu_cap_bytes, hw.gpu_memory_bytes);
        assert!(r.exposed_comm_us <= r.link_us);
        let names: Vec<&str> = r.methods.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, teraio_scheduler::fsdp::METHODS);
        let ideal = r.method("ideal").unwrap();
        assert_eq!(ideal.pcie_bytes, 0);
        for m in &r.methods {
            match (m.iteration_us, &m.refused) {
                (Some(us), None) => {
                    let job = f64::from(r.ranks) * tokens as f64 / (us / 1e6);
                    assert!((m.job_tokens_per_s.unwrap() - job).abs() < 1e-6 * job);
                }
                (None, Some(why)) => assert!(!why.is_empty()),
                other => panic!("{}: {other:?}", m.name),
            }
        }
        let teraio = r.method("teraio").unwrap();
        assert!(teraio.iteration_us.is_some(), "{:?}", teraio.refused);
        assert!(teraio.peak_gpu_bytes <= hw.gpu_memory_bytes);
        assert!(teraio.iteration_us.unwrap() >= ideal.iteration_us.unwrap() * 0.999);
    }
    // Half the ranks' shards each time (to rounding), the same activations.
    for w in rows.windows(2) {
        let ratio = w[0].shard_bytes as f64 / w[1].shard_bytes as f64;
        assert!((ratio - 2.0).abs() < 1e-3, "{ratio}");
        assert!(w[1].peak_bytes < w[0].peak_bytes);
    }
    assert_eq!(rows[0].link_us, 0.0);
    assert!(rows[2].link_us > rows[1].link_us);
}

#[test]
fn bad_fsdp_arguments_are_refused_naming_the_argument_and_value() {
    let err =
        |spec: &str| generate(&ModelConfig::from_spec(spec).unwrap()).unwrap_err().to_string();
    assert!(err("gpt2-small,fsdp-ranks=0").contains("fsdp-ranks 0: at least 1 rank"));
    assert!(err("gpt2-small,fsdp-ranks=5000").contains("fsdp-ranks 5000: at most 1024"));
    assert!(err("gpt2-small,fsdp-ranks=1000").contains("fsdp-ranks 1000: more ranks than"));
    let e = err("gpt2-small,fsdp-ranks=4,tp=2");
    assert!(e.contains("fsdp-ranks 4 with tp 2"), "{e}");
    let e = err("gpt2-small,fsdp-ranks=4,optimizer-in-forward");
    assert!(e.contains("fsdp-ranks 4 with optimizer-in-forward"), "{e}");
    assert!(err("gpt2-small,fsdp-ranks=2,link-gbps=0").contains("link-gbps 0: must be"));
    assert!(err("gpt2-small,link-gbps=-3").contains("link-gbps -3"));
    assert!(err("gpt2-small,fsdp-no-overlap").contains("fsdp-no-overlap without fsdp-ranks"));
    let spec = |s: &str| ModelConfig::from_spec(s).unwrap_err().to_string();
    assert!(spec("gpt2-small,fsdp-ranks=x").contains("fsdp-ranks=x: not a number"));
    assert!(spec("gpt2-small,fsdp-no-overlap=1").contains("fsdp-no-overlap takes no value"));
    // The sweep: its list, and a model that has ranks already.
    let hw = Hardware::paper();
    let cfg = model("fp32", 0);
    let e = sweep(&cfg, &[], &hw, &SweepOptions::default()).unwrap_err().to_string();
    assert!(e.contains("0 rank counts"), "{e}");
    let e = sweep(&cfg, &[2, 0], &hw, &SweepOptions::default()).unwrap_err().to_string();
    assert!(e.contains("fsdp-ranks 0"), "{e}");
    let e = sweep(&model("fp32", 2), &[2], &hw, &SweepOptions::default()).unwrap_err().to_string();
    assert!(e.contains("already has fsdp-ranks 2"), "{e}");
}
