//! `teraio plan`: plan offloads, prefetches and recomputations for a trace, checked in the
//! simulator before it is handed out.

use std::path::PathBuf;
use std::time::Instant;

use teraio_scheduler::{
    Choice, Move, PlanOptions, Policy, Resource, SelectOptions, choose, lower_bound_for,
};

use crate::cmd::hw_args::{HwArgs, explain};
use crate::output::outln;
use crate::units::to_gb;
use crate::{CliError, Result};

/// The planner options shared by `plan`, `simulate`, `analyze` and `advise`.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    /// With `auto`: among plans within this many percent of the fastest, keep the one that
    /// writes the fewest bytes to the SSDs (they wear out); 0 keeps the fastest.
    #[arg(long, default_value_t = 1.0, value_name = "PERCENT")]
    pub wear_tolerance: f64,
    /// With `auto`: never recompute a tensor instead of keeping or moving it (the trace says
    /// which tensors can be recomputed; `teraio run` replays no recomputation yet); the lower
    /// bound then remakes nothing either.
    #[arg(long)]
    pub no_recompute: bool,
}

impl PlanArgs {
    /// The scheduler's options.
    pub fn options(&self) -> Result<PlanOptions> {
        if !(self.wear_tolerance.is_finite() && self.wear_tolerance >= 0.0) {
            return Err(CliError::Usage(format!(
                "--wear-tolerance must be a percentage >= 0, got {}",
                self.wear_tolerance
            )));
        }
        Ok(PlanOptions {
            wear_tolerance: self.wear_tolerance / 100.0,
            recompute: !self.no_recompute,
        })
    }
}

/// Options of `teraio plan`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
The plan is checked in the simulator before it is written: a GPU memory below the trace's
largest working set, a plan that runs out of GPU memory, or one that needs more SSD or host
space than there is, is refused with what is needed, what there is, and the option to change.

Examples:
  teraio plan preset:llama3-8b                        # auto: fastest, then fewest SSD writes
  teraio plan preset:llama3-8b --ssd-tbw 1200 -o plan.json
  teraio plan trace.json --gpu-mem-gb 40 --ssds 1 --host-gb 120 --policy teraio-hybrid")]
pub struct Args {
    /// Trace file, or `preset:NAME[,KEY=VALUE...]` (e.g. `preset:llama3-8b,dtype=tf32`).
    pub trace: String,
    /// auto (the default: the best of several teraio variants, recomputation included),
    /// teraio, teraio-hybrid, g10, zero-infinity, zero-infinity-pipelined, lru, ideal, none.
    #[arg(long, default_value = "auto")]
    pub policy: String,
    #[command(flatten)]
    pub hw: HwArgs,
    #[command(flatten)]
    pub planner: PlanArgs,
    /// Write the plan (JSON) here.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Print the plan (JSON) to standard output instead of a summary.
    #[arg(long)]
    pub json: bool,
}

/// Run `teraio plan`.
pub fn run(args: Args) -> Result<()> {
    let trace = crate::cmd::trace::load(&args.trace)?;
    let hw = args.hw.hardware()?;
    let policy: Policy = args.policy.parse()?;
    let opts = args.planner.options()?;
    let start = Instant::now();
    // The bound beside the planning, on a core of its own where there is one.
    let (checked, bound) = std::thread::scope(|scope| {
        let bound = scope.spawn(|| lower_bound_for(&trace, &hw, &opts));
        let checked =
            choose(&trace, &hw, &SelectOptions::cli(policy, opts.clone(), hw.gpu_memory_bytes));
        (checked, bound.join())
    });
    let checked = checked.map_err(explain)?;
    let bound =
        bound.map_err(|_| CliError::Usage("the lower bound's thread panicked".into()))??;
    let elapsed = start.elapsed();
    let (p, r) = (&checked.plan, &checked.report);
    let text = p.to_json();
    if let Some(out) = &args.output {
        std::fs::write(out, &text)
            .map_err(|source| CliError::File { path: out.clone(), source })?;
    }
    if args.json {
        outln!("{text}");
        return Ok(());
    }
    let offloads = p.instructions.iter().filter(|i| matches!(i.op, Move::Offload { .. })).count();
    let drops = p.instructions.iter().filter(|i| i.is_clean_drop()).count();
    let urgent = p.instructions.iter().filter(|i| i.urgent).count();
    outln!(
        "policy {} on {} ({} kernels, {} tensors)",
        p.policy,
        trace.name,
        p.kernel_count,
        p.tensor_count
    );
    outln!(
        "plan time                {:.3} s (with the check and the bound)",
        elapsed.as_secs_f64()
    );
    outln!(
        "instructions             {} ({offloads} offloads of which {drops} clean drops, {urgent} \
         urgent)",
        p.instructions.len()
    );
    outln!(
        "recomputations           {} ({:.2} GB, {:.3} s of GPU time)",
        p.recomputations.len(),
        to_gb(p.stats.recompute_bytes),
        p.stats.recompute_us / 1e6
    );
    outln!("initially offloaded      {}", p.initially_offloaded.len());
    if checked.choice != Choice::AsModelled {
        outln!("chosen                   {}", checked.why);
    }
    outln!("peak if nothing moves    {:.2} GB", to_gb(p.stats.peak_resident_bytes));
    outln!(
        "least GPU memory         {:.2} GB (kernel {}, {}: its working set)",
        to_gb(bound.min_gpu_bytes),
        bound.min_gpu_kernel,
        trace.kernels[bound.min_gpu_kernel].name
    );
    outln!(
        "peak GPU memory          {:.2} GB (capacity {:.2} GB)",
        to_gb(r.peak_gpu_bytes),
        to_gb(hw.gpu_memory_bytes)
    );
    let array =
        hw.ssd_array_capacity_bytes().map_or("unlimited".into(), |c| format!("{:.1} GB", to_gb(c)));
    outln!(
        "tier space needed        {:.2} GB on the SSD array (holds {array}), {:.2} GB of host \
         tier (cap {:.2} GB)",
        to_gb(r.peak_ssd_bytes),
        to_gb(r.peak_host_bytes),
        to_gb(hw.host_memory_cap_bytes)
    );
    let written =
        r.bytes_moved.iter().find(|b| b.resource == Resource::SsdWrite).map_or(0, |b| b.bytes);
    outln!(
        "offloaded per iteration  {:.2} GB written to SSD, {:.2} GB dropped clean, {:.2} GB to host",
        to_gb(written),
        to_gb(p.stats.clean_drop_bytes),
        to_gb(p.stats.host_offload_bytes)
    );
    outln!("drive life               {}", drive_life(r.drive_life_days, hw.ssd_endurance_tbw));
    outln!(
        "simulated iteration      {:.3} s ({:.1}% of ideal {:.3} s; {})",
        r.iteration_time_us / 1e6,
        r.percent_of_ideal,
        r.ideal_time_us / 1e6,
        gap(&bound, r.iteration_time_us)
    );
    outln!("candidates / evaluations {} / {}", p.stats.candidates, p.stats.evaluations);
    Ok(())
}

/// `12.4 days at 2400 TBW per SSD`, or why there is no figure.
pub fn drive_life(days: Option<f64>, tbw: Option<f64>) -> String {
    match (days, tbw) {
        (Some(d), Some(t)) if d >= 3650.0 => {
            format!("{:.0} years at {t:.0} TBW per SSD", d / 365.0)
        }
        (Some(d), Some(t)) => format!("{d:.1} days at {t:.0} TBW per SSD"),
        (None, None) => "unknown (give the drives' endurance with --ssd-tbw)".into(),
        _ => "not worn (nothing written to the SSDs)".into(),
    }
}

/// `lower bound 74.218 s, 0.5% above it` (or why there is no bound).
pub fn gap(bound: &teraio_scheduler::Bound, iteration_us: f64) -> String {
    match bound.gap_percent(iteration_us) {
        Some(g) => format!("lower bound {:.3} s, {g:.1}% above it", bound.iteration_us / 1e6),
        None => {
            format!("no lower bound: {}", bound.infeasible.as_deref().unwrap_or("no plan can run"))
        }
    }
}
