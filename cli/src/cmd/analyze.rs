//! `teraio analyze`: lifetime analysis of a trace, and what it needs on a hardware model: the
//! least GPU memory, the lower bound of the iteration, the tier space and SSD writes of a plan.

use serde_json::json;
use teraio_scheduler::analysis::summarize;
use teraio_scheduler::{Policy, Resource, SelectOptions, choose, lower_bound_for};

use crate::Result;
use crate::cmd::hw_args::HwArgs;
use crate::cmd::plan::{PlanArgs, drive_life};
use crate::output::outln;
use crate::units::to_gb;

/// Options of `teraio analyze`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  teraio analyze preset:llama3-8b                      # on the paper's hardware, auto plan
  teraio analyze trace.json --gpu-mem-gb 40 --ssds 1 --ssd-gb 500 --json")]
pub struct Args {
    /// Trace file, or `preset:NAME[,KEY=VALUE...]` (e.g. `preset:llama3-8b,dtype=tf32`).
    pub trace: String,
    /// Policy of the plan whose needs are reported (SSD and host space, SSD writes).
    #[arg(long, default_value = "auto")]
    pub policy: String,
    #[command(flatten)]
    pub hw: HwArgs,
    #[command(flatten)]
    pub planner: PlanArgs,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Run `teraio analyze`.
pub fn run(args: Args) -> Result<()> {
    let trace = crate::cmd::trace::load(&args.trace)?;
    let hw = args.hw.hardware()?;
    let policy: Policy = args.policy.parse()?;
    let s = summarize(&trace);
    let opts = args.planner.options()?;
    let bound = lower_bound_for(&trace, &hw, &opts)?;
    let checked =
        choose(&trace, &hw, &SelectOptions::cli(policy, opts.clone(), hw.gpu_memory_bytes));
    if args.json {
        let mut v = serde_json::to_value(&s)?;
        if let Some(o) = v.as_object_mut() {
            o.insert("lower_bound".into(), serde_json::to_value(&bound)?);
            o.insert(
                "plan".into(),
                match &checked {
                    Ok(c) => json!({
                        "policy": c.plan.policy,
                        "iteration_time_us": c.report.iteration_time_us,
                        "peak_ssd_bytes": c.report.peak_ssd_bytes,
                        "peak_host_bytes": c.report.peak_host_bytes,
                        "ssd_written_bytes": written(&c.report),
                        "drive_life_days": c.report.drive_life_days,
                    }),
                    Err(e) => json!({ "policy": policy.as_str(), "refused": e.to_string() }),
                },
            );
        }
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    outln!("trace {}: {} kernels, {} tensors", s.name, s.kernels, s.tensors);
    outln!("ideal iteration          {:.3} s", s.iteration_time_us / 1e6);
    outln!("tensor bytes             {:.2} GB", to_gb(s.total_tensor_bytes));
    outln!("peak if nothing moves    {:.2} GB", to_gb(s.peak_resident_bytes));
    outln!(
        "least GPU memory         {:.2} GB: kernel {} ({}) uses that much at once; no plan runs \
         in less",
        to_gb(s.min_gpu_bytes),
        s.min_gpu_kernel,
        trace.kernels[s.min_gpu_kernel].name
    );
    outln!(
        "active memory            {:.2}% on average (time-weighted), {:.2}% at most",
        100.0 * s.mean_active_fraction,
        100.0 * s.max_active_fraction
    );
    outln!(
        "inactive intervals       {} ({:.1}% longer than 10 ms)",
        s.inactive_intervals,
        100.0 * s.inactive_over_10ms_fraction
    );
    let recomputable: Vec<_> =
        trace.tensors.iter().filter(|t| t.recomputable().is_some()).collect();
    outln!(
        "recomputable tensors     {} ({:.2} GB)",
        recomputable.len(),
        to_gb(recomputable.iter().map(|t| t.bytes).sum())
    );
    outln!(
        "\non {:.0} GB GPU, {} SSDs, host tier {:.0} GB:",
        to_gb(hw.gpu_memory_bytes),
        hw.ssd_count,
        to_gb(hw.host_memory_cap_bytes)
    );
    match &bound.infeasible {
        None => outln!(
            "  lower bound            {:.3} s ({:.1}% of ideal at best)",
            bound.iteration_us / 1e6,
            100.0 * bound.compute_us / bound.iteration_us
        ),
        Some(why) => outln!("  no plan can run: {why}"),
    }
    match &checked {
        Ok(c) => {
            let r = &c.report;
            outln!(
                "  {} plan             {:.3} s ({:.1}% of ideal), needs {:.2} GB on the SSD array \
                 and {:.2} GB of host tier; writes {:.2} GB to the SSDs per iteration; drive life {}",
                policy,
                r.iteration_time_us / 1e6,
                r.percent_of_ideal,
                to_gb(r.peak_ssd_bytes),
                to_gb(r.peak_host_bytes),
                to_gb(written(r)),
                drive_life(r.drive_life_days, hw.ssd_endurance_tbw)
            );
        }
        Err(e) => outln!("  {policy} plan refused: {e}"),
    }
    outln!("\ninactive period      count        GB");
    for b in &s.inactive_period_histogram {
        outln!("  {:<14} {:>9} {:>9.2}", b.label, b.count, to_gb(b.bytes));
    }
    outln!("\ntensor size         count        GB");
    for b in &s.tensor_size_histogram {
        outln!("  {:<14} {:>9} {:>9.2}", b.label, b.count, to_gb(b.bytes));
    }
    outln!("\nkind                count        GB");
    for k in &s.by_kind {
        outln!("  {:<14} {:>9} {:>9.2}", k.kind.as_str(), k.count, to_gb(k.bytes));
    }
    Ok(())
}

fn written(r: &teraio_scheduler::SimReport) -> u64 {
    r.bytes_moved.iter().find(|b| b.resource == Resource::SsdWrite).map_or(0, |b| b.bytes)
}
