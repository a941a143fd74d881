//! `teraio simulate`: replay iterations under a plan and report time, stalls and traffic.

use std::path::PathBuf;
use std::time::Instant;

use teraio_scheduler::model::{optimizer_steps_moved, recomputes_activations};
use teraio_scheduler::{
    Bound, Error as PlanError, Outcome, Plan, Policy, Resource, SelectOptions, SimOptions,
    SimReport, choose, lower_bound_for, simulate,
};

use crate::cmd::hw_args::HwArgs;
use crate::cmd::plan::PlanArgs;
use crate::output::outln;
use crate::units::to_gb;
use crate::{CliError, Result};

/// Options of `teraio simulate`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Each policy's plan is checked before it is simulated: one that cannot run (out of memory, more
SSD or host space than there is) is listed as refused, with why. `gap %` is how far each
iteration is above the lower bound no plan can beat (printed above the table); `ssd GB` the
peak space the plan's copies take on the SSD array; `life d` how many days the SSDs last at
the plan's write rate (from the drives' TBW, --ssd-tbw).

Examples:
  teraio simulate preset:llama3-8b --policy all              # every policy side by side
  teraio simulate llama3-8b.json --plan plan.json --plot llama3-8b.svg
  teraio simulate preset:llama3-8b --checkpointed-trace preset:llama3-8b,activation-checkpointing \\
      --policy teraio,teraio+checkpointing,zero-infinity     # ZeRO-Infinity as DeepSpeed runs it
  teraio simulate preset:llama3-8b,dtype=tf32,selective-recompute --ssds 8 --policy teraio,teraio-hybrid
  teraio simulate preset:llama3-70b --stalls 10                # where the plan makes the GPU wait
  teraio simulate step.trace.json --gpu-mem-gb 6 --checkpoint-layers auto
                                          # which layers to checkpoint, the rest planned
  teraio simulate preset:gpt2-small,dtype=bf16,micro-batch=1 --gpu-mem-gb 0.9 --optimizer-on auto
                                          # which parameters' optimizer updates go to the host CPU
  teraio simulate preset:llama3-8b,fsdp-ranks=8 --gpu-mem-gb 40   # one rank of FSDP2 over 8 GPUs
  teraio simulate preset:llama3-8b,dtype=bf16,gpu=h100-sxm --fsdp-ranks 1,2,4,8 --gpu-mem-gb 40
                                          # N ranks, one SSD array each, against CPU offload

--optimizer-on auto: for each choice of which optimizer updates (one per parameter tensor of a
generated trace) run on the host CPU instead of the GPU, from none to every one, the trace is
planned with --policy and simulated with the host updates: gradient copied down when backward
is done with it, the update queued on the CPU (at --cpu-adam parameters a second; one update
at a time) when the optimizer's step reaches it (--updates-in-backward: as soon as its gradient
arrived), the weight copied up before its next use. It prints the choice, the iteration of
all-GPU and all-host, the lower bound, and every choice simulated (--json: all of it). The
CPU's speed is the hardware model's `cpu_adam_params_per_s` (--cpu-adam overrides it).

--fsdp-ranks 1,2,4,8: the trace must be a `preset:` model without fsdp-ranks=; for each N it
is generated as one rank of FSDP2 over N ranks and run five ways on this hardware model, which
is one rank's (GPU cap, SSD array, host tier, CPU share): ideal (unlimited memory; `peak GB`
says whether plain FSDP2 fits the cap), teraio (--policy, optimizer on the GPU), teraio with
the optimizer placed (--optimizer-on auto), teraio waiting for each collective (how
teraio.torch runs FSDP2 on a GPU today) and FSDP2's CPUOffloadPolicy (shards in host memory,
the optimizer step on the CPU, activations on the GPU). Simulator figures, not measurements;
the model and what it leaves out: docs/FSDP.md.")]
pub struct Args {
    /// Trace file, or `preset:NAME[,KEY=VALUE...]` (e.g. `preset:llama3-8b,dtype=tf32`).
    pub trace: String,
    /// The same model with activation checkpointing (`teraio trace gen
    /// --activation-checkpointing`, or `preset:NAME,activation-checkpointing`): the ZeRO-Infinity
    /// baselines are planned and simulated on it, as DeepSpeed can offload activations only as
    /// checkpoints. Their `% ideal` is still against the main trace's ideal iteration; their
    /// rows are marked `*`.
    #[arg(long, conflicts_with = "plan")]
    pub checkpointed_trace: Option<String>,
    /// A plan file made by `teraio plan` (else plan on the fly with --policy).
    #[arg(long, conflicts_with = "policy")]
    pub plan: Option<PathBuf>,
    /// Policy, or a comma-separated list for a comparison table (`all`: every policy). With
    /// --checkpointed-trace, `NAME+checkpointing` plans any policy on that trace too (e.g.
    /// `teraio,teraio+checkpointing`: offload activations, or recompute them).
    #[arg(long, default_value = "auto")]
    pub policy: String,
    #[command(flatten)]
    pub hw: HwArgs,
    #[command(flatten)]
    pub planner: PlanArgs,
    /// Iterations replayed (the last is reported).
    #[arg(long, default_value_t = 2)]
    pub iterations: usize,
    /// Print the report(s) as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG plot (memory over time without/with plan and capacity; bandwidth use).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// List the N kernels each policy waits on longest (the GPU idle before them: their
    /// tensors not back yet, or no memory free for what they create). With --json, each
    /// report gets a `stalls` array.
    #[arg(long, value_name = "N")]
    pub stalls: Option<usize>,
    /// Where the optimizer's updates run: `gpu` (the trace as it is) or `auto` (the planner
    /// chooses per parameter between the GPU and the host CPU by simulated cost; one policy).
    #[arg(long, default_value = "gpu", value_parser = ["gpu", "auto"])]
    pub optimizer_on: String,
    /// With `--optimizer-on auto`: the trainer runs a host update as soon as its gradients
    /// arrived, during backward (teraio.torch's `update_in_backward=True`); without it, at the
    /// optimizer's step, where the update's kernels were.
    #[arg(long)]
    pub updates_in_backward: bool,
    /// FSDP2 over each of these rank counts (e.g. `1,2,4,8`), each rank with its own GPU cap,
    /// SSD array and host tier (this hardware model): one rank's trace of the `preset:` model
    /// (sharded parameters, gradients and optimizer states; FSDP's gathered parameters kept;
    /// all-gathers and reduce-scatters at `link-gbps=`) under the ideal, teraio (--policy),
    /// teraio with the optimizer placed, teraio waiting for each collective, and FSDP2's
    /// CPUOffloadPolicy; per rank and the whole job's tokens/s (docs/FSDP.md).
    #[arg(long, value_name = "N,N,...", conflicts_with_all = ["plan", "checkpointed_trace", "plot", "stalls"])]
    pub fsdp_ranks: Option<String>,
    /// Checkpoint these layers of the trace (`Kernel::layer`; e.g. `0-5,8`, `all`) and plan
    /// the rest: the trace is rewritten as checkpointing them makes it (their activations
    /// that backward reads made again by a copy of their forward kernels right before the
    /// first one is read). `auto`: the layers whose checkpointing makes the `auto` plan's
    /// simulated iteration fastest, or none (printed first). `% ideal` is then against the
    /// rewritten trace; `iter s` compares with the trace's own.
    #[arg(long, value_name = "LAYERS|auto", conflicts_with_all = ["plan", "checkpointed_trace", "fsdp_ranks", "optimizer_on"])]
    pub checkpoint_layers: Option<String>,
}

/// One kernel's wait, as `--stalls` lists it.
#[derive(serde::Serialize)]
struct Stall<'a> {
    kernel: usize,
    name: &'a str,
    stall_us: f64,
    duration_us: f64,
}

/// One row of the comparison.
pub struct Row {
    /// The report.
    pub report: SimReport,
    /// Planning time, seconds.
    pub plan_s: f64,
    /// % above the lower bound of the trace it ran on (`None`: no finite bound).
    pub gap_percent: Option<f64>,
}

/// A policy whose plan was refused, and why.
struct Refused {
    policy: String,
    why: String,
}

fn moved(r: &SimReport, res: Resource) -> u64 {
    r.bytes_moved.iter().find(|b| b.resource == res).map_or(0, |b| b.bytes)
}

/// Print a comparison table.
fn print_table(rows: &[Row], refused: &[Refused]) {
    let w = rows
        .iter()
        .map(|r| r.report.policy.len())
        .chain(refused.iter().map(|r| r.policy.len()))
        .max()
        .unwrap_or(0)
        .max(14);
    outln!(
        "{:<w$} {:>10} {:>8} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>8}",
        "policy",
        "iter s",
        "% ideal",
        "gap %",
        "stall s",
        "peak GB",
        "ssd rd GB",
        "ssd wr GB",
        "ssd GB",
        "host GB",
        "life d",
        "plan s"
    );
    for row in rows {
        let r = &row.report;
        match &r.outcome {
            Outcome::Completed => outln!(
                "{:<w$} {:>10.3} {:>8.1} {:>7} {:>9.3} {:>9.2} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7} \
                 {:>8.3}",
                r.policy,
                r.iteration_time_us / 1e6,
                r.percent_of_ideal,
                row.gap_percent.map_or("-".into(), |g| format!("{g:.1}")),
                r.stall_us / 1e6,
                to_gb(r.peak_gpu_bytes),
                to_gb(moved(r, Resource::SsdRead)),
                to_gb(moved(r, Resource::SsdWrite)),
                to_gb(r.peak_ssd_bytes),
                to_gb(r.peak_host_bytes),
                r.drive_life_days.map_or("-".into(), |d| format!("{d:.0}")),
                row.plan_s
            ),
            Outcome::OutOfMemory {
                iteration,
                kernel,
                needed_bytes,
                used_bytes,
                capacity_bytes,
            } => {
                outln!(
                    "{:<w$} out of memory at iteration {iteration}, kernel {kernel}: needs {:.2} GB, \
                     {:.2} of {:.2} GB in use",
                    r.policy,
                    to_gb(*needed_bytes),
                    to_gb(*used_bytes),
                    to_gb(*capacity_bytes)
                )
            }
        }
    }
    for r in refused {
        outln!("{:<w$} refused: {}", r.policy, r.why);
    }
}

/// Run `teraio simulate`.
pub fn run(args: Args) -> Result<()> {
    if let Some(ranks) = &args.fsdp_ranks {
        return crate::cmd::fsdp::sweep(&args, ranks);
    }
    let trace = crate::cmd::trace::load(&args.trace)?;
    let hw = args.hw.hardware()?;
    let plan_opts = args.planner.options()?;
    let trace = match &args.checkpoint_layers {
        Some(spec) => checkpointed(&args, trace, &hw, &plan_opts, spec)?,
        None => trace,
    };
    if args.optimizer_on == "auto" {
        return place_optimizer(&args, &trace, &hw, plan_opts);
    }
    if args.updates_in_backward {
        return Err(CliError::Usage(
            "--updates-in-backward says when host updates run: it goes with --optimizer-on auto"
                .into(),
        ));
    }
    let opts = SimOptions {
        iterations: args.iterations,
        record_timeline: args.plot.is_some() || args.stalls.is_some(),
    };
    let ckpt = args.checkpointed_trace.as_deref().map(crate::cmd::trace::load).transpose()?;
    if let Some(c) = &ckpt
        && c.name != trace.name
    {
        return Err(CliError::Usage(format!(
            "--checkpointed-trace models {:?} but the trace models {:?}",
            c.name, trace.name
        )));
    }
    // The trace a plan was made on: the checkpointed one, or the main one.
    let trace_for = |on_ckpt: bool| if on_ckpt { ckpt.as_ref().unwrap_or(&trace) } else { &trace };
    // (plan, planning time, planned on the checkpointed trace)
    let mut plans: Vec<(Plan, f64, bool)> = Vec::new();
    let mut refused: Vec<Refused> = Vec::new();
    if let Some(path) = &args.plan {
        let text = std::fs::read_to_string(path)
            .map_err(|source| CliError::File { path: path.clone(), source })?;
        let plan =
            Plan::from_json(&text).map_err(|e| crate::error::scheduler_file(path, "plan", e))?;
        plans.push((plan, 0.0, false));
    } else {
        let names: Vec<String> = if args.policy == "all" {
            Policy::ALL.iter().map(|p| p.to_string()).collect()
        } else {
            args.policy.split(',').map(|s| s.trim().to_string()).collect()
        };
        for name in names {
            let (policy, on_ckpt) = match name.strip_suffix("+checkpointing") {
                Some(base) if ckpt.is_none() => {
                    return Err(CliError::Usage(format!(
                        "policy {name:?} needs --checkpointed-trace (the {base} plan is made on it)"
                    )));
                }
                Some(base) => (base.parse::<Policy>()?, true),
                None => {
                    let p: Policy = name.parse()?;
                    (p, ckpt.is_some() && p.needs_activation_checkpointing())
                }
            };
            let start = Instant::now();
            let select = SelectOptions::cli(policy, plan_opts.clone(), hw.gpu_memory_bytes);
            match choose(trace_for(on_ckpt), &hw, &select) {
                Ok(c) => plans.push((c.plan, start.elapsed().as_secs_f64(), on_ckpt)),
                Err(
                    e @ (PlanError::GpuMemoryTooSmall { .. }
                    | PlanError::PlanOutOfMemory { .. }
                    | PlanError::TierTooSmall { .. }),
                ) => {
                    let mut policy = name.clone();
                    if on_ckpt && !policy.ends_with("+checkpointing") {
                        policy.push('*');
                    }
                    refused.push(Refused { policy, why: e.to_string() });
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    if args.plot.is_some() && plans.len() != 1 {
        let why = refused.first().map_or(String::new(), |r| format!(" ({})", r.why));
        return Err(CliError::Usage(format!("--plot needs exactly one plan or policy{why}")));
    }
    if plans.is_empty()
        && let [r] = &refused[..]
        && !args.json
    {
        // One policy asked for and refused: an error with the option that changes it.
        let again = args.policy.parse().ok().map(|p| {
            choose(&trace, &hw, &SelectOptions::cli(p, plan_opts.clone(), hw.gpu_memory_bytes))
        });
        return Err(match again {
            Some(Err(e)) => crate::cmd::hw_args::explain(e),
            _ => CliError::Usage(r.why.clone()),
        });
    }
    let ideal_us = trace.iteration_time_us();
    // With --no-recompute the bound remakes nothing either.
    let bound_of = |t: &teraio_scheduler::Trace| lower_bound_for(t, &hw, &plan_opts);
    let bound = bound_of(&trace)?;
    let ckpt_bound = ckpt.as_ref().map(bound_of).transpose()?;
    let bound_for = |on_ckpt: bool| -> &Bound {
        if on_ckpt { ckpt_bound.as_ref().unwrap_or(&bound) } else { &bound }
    };
    let mut rows = Vec::new();
    for (p, plan_s, on_ckpt) in &plans {
        let mut report = simulate(trace_for(*on_ckpt), p, &hw, &opts)?;
        // The bound is for plans within the GPU memory: none for `ideal`.
        let gap_percent = (report.outcome == Outcome::Completed && !p.unlimited_memory)
            .then(|| bound_for(*on_ckpt).gap_percent(report.iteration_time_us))
            .flatten();
        if *on_ckpt {
            // Against the main trace's ideal: the recomputation is part of the baseline's cost.
            if report.iteration_time_us > 0.0 {
                report.percent_of_ideal = 100.0 * ideal_us / report.iteration_time_us;
            }
            report.policy.push('*');
        }
        rows.push(Row { report, plan_s: *plan_s, gap_percent });
    }
    if let Some(path) = &args.plot {
        crate::plot::memory_and_bandwidth(path, &trace, &rows[0].report, &hw)?;
    }
    // The longest waits of every row, from its timeline (dropped from the report unless a
    // plot asked for it: it is large).
    let mut stalls: Vec<Vec<Stall>> = Vec::new();
    if let Some(n) = args.stalls {
        for (row, (_, _, on_ckpt)) in rows.iter_mut().zip(&plans) {
            let t = trace_for(*on_ckpt);
            let tl = row.report.timeline.as_ref();
            let top = tl.map(|tl| tl.longest_stalls(n)).unwrap_or_default();
            stalls.push(
                top.into_iter()
                    .map(|(k, us)| Stall {
                        kernel: k,
                        name: &t.kernels[k].name,
                        stall_us: us,
                        duration_us: t.kernels[k].duration_us,
                    })
                    .collect(),
            );
            if args.plot.is_none() {
                row.report.timeline = None;
            }
        }
    }
    if args.json {
        let mut reports = Vec::new();
        for (i, (row, (_, _, on_ckpt))) in rows.iter().zip(&plans).enumerate() {
            let mut v = serde_json::to_value(&row.report)?;
            if let Some(obj) = v.as_object_mut() {
                if let Some(list) = stalls.get(i) {
                    obj.insert("stalls".into(), serde_json::to_value(list)?);
                }
                let b = bound_for(*on_ckpt);
                obj.insert("lower_bound_us".into(), serde_json::json!(b.iteration_us));
                obj.insert("gap_to_bound_percent".into(), serde_json::json!(row.gap_percent));
                obj.insert("plan_time_s".into(), serde_json::json!(row.plan_s));
            }
            reports.push(v);
        }
        for r in &refused {
            reports.push(serde_json::json!({ "policy": r.policy, "refused": r.why }));
        }
        if reports.len() == 1 {
            outln!("{}", serde_json::to_string_pretty(&reports[0])?);
        } else {
            outln!("{}", serde_json::to_string_pretty(&reports)?);
        }
        return Ok(());
    }
    outln!(
        "{} on {:.0} GB GPU, {} SSDs x {:.1}/{:.1} GB/s, PCIe {:.0}/{:.0} GB/s, host tier {:.0} GB; \
         ideal iteration {:.3} s",
        trace.name,
        to_gb(hw.gpu_memory_bytes),
        hw.ssd_count,
        hw.ssd_read_bytes_per_s / 1e9,
        hw.ssd_write_bytes_per_s / 1e9,
        hw.pcie_h2d_bytes_per_s / 1e9,
        hw.pcie_d2h_bytes_per_s / 1e9,
        to_gb(hw.host_memory_cap_bytes),
        trace.iteration_time_us() / 1e6
    );
    if let Some(d) = hw.ssd_duplex_bytes_per_s {
        outln!("SSD reads and writes share {:.1} GB/s per SSD", d / 1e9);
    }
    if let Some(d) = hw.pcie_duplex_bytes_per_s {
        outln!("PCIe moves {:.1} GB/s in total both ways", d / 1e9);
    }
    match &bound.infeasible {
        None => outln!(
            "lower bound {:.3} s (no plan is faster); least GPU memory {:.2} GB (kernel {}, {})",
            bound.iteration_us / 1e6,
            to_gb(bound.min_gpu_bytes),
            bound.min_gpu_kernel,
            trace.kernels[bound.min_gpu_kernel].name
        ),
        Some(why) => outln!("no plan can run: {why}"),
    }
    print_table(&rows, &refused);
    for (row, list) in rows.iter().zip(&stalls) {
        let r = &row.report;
        let shown: f64 = list.iter().map(|s| s.stall_us).sum();
        outln!(
            "where {} waits: {} kernels, {:.3} of its {:.3} s of stall",
            r.policy,
            list.len(),
            shown / 1e6,
            r.stall_us / 1e6
        );
        for s in list {
            outln!(
                "  kernel {:>7}  {:<40} waited {:>10.1} ms  (runs {:.1} ms)",
                s.kernel,
                s.name,
                s.stall_us / 1e3,
                s.duration_us / 1e3
            );
        }
    }
    if ckpt.is_none()
        && plans.iter().any(|p| p.0.policy.starts_with("zero-infinity"))
        && !recomputes_activations(&trace)
    {
        outln!(
            "note: zero-infinity was planned on a trace without activation checkpointing, whose \
             saved activations DeepSpeed cannot offload (generous to it); compare it as it runs \
             with --checkpointed-trace (e.g. preset:NAME,activation-checkpointing)"
        );
    }
    // DeepSpeed steps after the backward pass: a ZeRO-Infinity row on a trace whose steps
    // were moved (optimizer in forward or in backward) is not how it runs.
    let moved = plans.iter().any(|(p, _, on_ckpt)| {
        p.policy.starts_with("zero-infinity") && optimizer_steps_moved(trace_for(*on_ckpt))
    });
    if moved {
        outln!(
            "note: zero-infinity was planned on a trace whose optimizer steps run inside the \
             forward or backward pass; DeepSpeed steps after the backward pass (generate its \
             trace without optimizer-in-forward/-backward)"
        );
    }
    if let Some(c) = &ckpt
        && plans.iter().any(|p| p.2)
    {
        outln!(
            "* planned and simulated on the activation-checkpointed trace ({} kernels, ideal {:.3} s \
             with recomputation); % ideal against the {:.3} s above",
            c.kernel_count(),
            c.iteration_time_us() / 1e6,
            ideal_us / 1e6
        );
    }
    Ok(())
}

/// `--optimizer-on auto`: the placement of the optimizer's updates, and every choice simulated.
fn place_optimizer(
    args: &Args,
    trace: &teraio_scheduler::Trace,
    hw: &teraio_scheduler::Hardware,
    plan: teraio_scheduler::PlanOptions,
) -> Result<()> {
    use teraio_scheduler::optimizer::{PlaceOptions, place};
    if args.plan.is_some() || args.checkpointed_trace.is_some() || args.policy.contains(',') {
        return Err(CliError::Usage(
            "--optimizer-on auto plans each choice itself with one --policy (no --plan, no \
             --checkpointed-trace, no list of policies)"
                .into(),
        ));
    }
    let policy = args.policy.parse::<Policy>()?;
    let in_backward = args.updates_in_backward;
    let p =
        place(trace, hw, &PlaceOptions { policy, plan, in_backward, ..PlaceOptions::default() })?;
    if args.json {
        let mut v = serde_json::to_value(&p).expect("a placement serializes");
        if let Some(o) = v.as_object_mut() {
            // (the GPU trace and its plan are large; the report stays)
            o.remove("trace");
            o.remove("plan");
        }
        outln!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
        return Ok(());
    }
    outln!("{}", p.summary());
    outln!("{:>14} {:>12} {:>10}", "host updates", "host Gparams", "iter s");
    for c in &p.candidates {
        let t = c.iteration_us.map_or_else(
            || format!("refused: {}", c.error.as_deref().unwrap_or("")),
            |us| format!("{:.4}", us / 1e6),
        );
        outln!("{:>14} {:>12.3} {:>10}", c.host_updates, c.host_params as f64 / 1e9, t);
    }
    let not: Vec<&str> = p.updates.iter().filter_map(|u| u.reason.as_deref()).collect();
    if !not.is_empty() {
        outln!("{} updates stay on the GPU: {}", not.len(), not[0]);
    }
    Ok(())
}

/// `--checkpoint-layers`: the trace with those layers checkpointed (`auto`: chosen by
/// `checkpoint::choose_layers`), the choice said on stderr (stdout with `--json` stays JSON).
fn checkpointed(
    args: &Args,
    trace: teraio_scheduler::Trace,
    hw: &teraio_scheduler::Hardware,
    plan_opts: &teraio_scheduler::PlanOptions,
    spec: &str,
) -> Result<teraio_scheduler::Trace> {
    use teraio_scheduler::checkpoint::{choose_layers, forward_layers, rewrite};
    let known: Vec<u32> =
        forward_layers(&trace).map(|f| f.spans.into_keys().collect()).unwrap_or_default();
    let layers: Vec<u32> = match spec {
        "auto" => {
            let select = SelectOptions::cli(Policy::Auto, plan_opts.clone(), hw.gpu_memory_bytes);
            let c = choose_layers(&trace, hw, &select)?;
            eprintln!("--checkpoint-layers auto: {}", c.why);
            c.layers
        }
        "all" => known,
        _ => parse_layers(spec, &known)?,
    };
    if layers.is_empty() {
        return Ok(trace);
    }
    let before = trace.iteration_time_us();
    let out = rewrite(&trace, &layers)
        .map_err(|e| CliError::Usage(format!("--checkpoint-layers {spec}: {e}")))?;
    if !args.json {
        eprintln!(
            "checkpointing layers {layers:?}: {} kernels run again (+{:.3} s); the trace's own ideal \
             iteration is {:.3} s",
            out.kernels.len() - trace.kernels.len(),
            (out.iteration_time_us() - before) / 1e6,
            before / 1e6
        );
    }
    Ok(out)
}

/// `0-5,8` -> [0, 1, 2, 3, 4, 5, 8]; a range past the trace's last layer (`known`) is an
/// error naming it (and is not expanded).
fn parse_layers(spec: &str, known: &[u32]) -> Result<Vec<u32>> {
    let bad = |part: &str| {
        CliError::Usage(format!(
            "--checkpoint-layers {spec}: {part:?} is not a layer or a range such as 0-5 \
             (or give all, or auto)"
        ))
    };
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim) {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (u32, u32) =
            (lo.parse().map_err(|_| bad(part))?, hi.parse().map_err(|_| bad(part))?);
        if lo > hi {
            return Err(bad(part));
        }
        if known.last().is_none_or(|&last| hi > last) {
            return Err(CliError::Usage(format!(
                "--checkpoint-layers {spec}: layer {hi} is not in the trace (its layers: {})",
                match (known.first(), known.last()) {
                    (Some(a), Some(b)) => format!("{a}-{b}"),
                    _ => "none".into(),
                }
            )));
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}
