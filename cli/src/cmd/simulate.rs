//! `teraio simulate`: replay iterations under a plan and report time, stalls and traffic.

use std::path::PathBuf;
use std::time::Instant;

use teraio_scheduler::model::{optimizer_steps_moved, recomputes_activations};
use teraio_scheduler::{Outcome, Plan, Policy, Resource, SimOptions, SimReport, plan, simulate};

use crate::cmd::hw_args::HwArgs;
use crate::output::outln;
use crate::units::to_gb;
use crate::{CliError, Result};

/// Options of `teraio simulate`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  teraio simulate preset:llama3-8b --policy all              # every policy side by side
  teraio simulate llama3-8b.json --plan plan.json --plot llama3-8b.svg
  teraio simulate preset:llama3-8b --checkpointed-trace preset:llama3-8b,activation-checkpointing \\
      --policy teraio,teraio+checkpointing,zero-infinity     # ZeRO-Infinity as DeepSpeed runs it
  teraio simulate preset:llama3-8b,dtype=tf32,selective-recompute --ssds 8 --policy teraio,teraio-hybrid
  teraio simulate preset:llama3-70b --stalls 10                # where the plan makes the GPU wait")]
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
    #[arg(long, default_value = "teraio")]
    pub policy: String,
    #[command(flatten)]
    pub hw: HwArgs,
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
}

fn moved(r: &SimReport, res: Resource) -> u64 {
    r.bytes_moved.iter().find(|b| b.resource == res).map_or(0, |b| b.bytes)
}

/// Print a comparison table.
pub fn print_table(rows: &[Row]) {
    let w = rows.iter().map(|r| r.report.policy.len()).max().unwrap_or(0).max(14);
    outln!(
        "{:<w$} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "policy",
        "iter s",
        "% ideal",
        "stall s",
        "peak GB",
        "ssd rd GB",
        "ssd wr GB",
        "host GB",
        "plan s"
    );
    for row in rows {
        let r = &row.report;
        match &r.outcome {
            Outcome::Completed => outln!(
                "{:<w$} {:>10.3} {:>8.1} {:>9.3} {:>9.2} {:>9.1} {:>9.1} {:>9.1} {:>8.3}",
                r.policy,
                r.iteration_time_us / 1e6,
                r.percent_of_ideal,
                r.stall_us / 1e6,
                to_gb(r.peak_gpu_bytes),
                to_gb(moved(r, Resource::SsdRead)),
                to_gb(moved(r, Resource::SsdWrite)),
                to_gb(r.peak_host_bytes),
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
}

/// Run `teraio simulate`.
pub fn run(args: Args) -> Result<()> {
    let trace = crate::cmd::trace::load(&args.trace)?;
    let hw = args.hw.hardware()?;
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
    if let Some(path) = &args.plan {
        let text = std::fs::read_to_string(path)
            .map_err(|source| CliError::File { path: path.clone(), source })?;
        plans.push((Plan::from_json(&text)?, 0.0, false));
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
            let p = plan(trace_for(on_ckpt), &hw, policy)?;
            plans.push((p, start.elapsed().as_secs_f64(), on_ckpt));
        }
    }
    if args.plot.is_some() && plans.len() != 1 {
        return Err(CliError::Usage("--plot needs exactly one plan or policy".into()));
    }
    let ideal_us = trace.iteration_time_us();
    let mut rows = Vec::new();
    for (p, plan_s, on_ckpt) in &plans {
        let mut report = simulate(trace_for(*on_ckpt), p, &hw, &opts)?;
        if *on_ckpt {
            // Against the main trace's ideal: the recomputation is part of the baseline's cost.
            if report.iteration_time_us > 0.0 {
                report.percent_of_ideal = 100.0 * ideal_us / report.iteration_time_us;
            }
            report.policy.push('*');
        }
        rows.push(Row { report, plan_s: *plan_s });
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
        for (i, row) in rows.iter().enumerate() {
            let mut v = serde_json::to_value(&row.report)?;
            if let (Some(list), Some(obj)) = (stalls.get(i), v.as_object_mut()) {
                obj.insert("stalls".into(), serde_json::to_value(list)?);
            }
            reports.push(v);
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
    print_table(&rows);
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
