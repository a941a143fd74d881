//! `teraio advise`: the fewest SSDs / least host memory that reach a target % of ideal, how big
//! the SSD array must be for a plan, or how many layers to checkpoint for the fastest
//! iteration.

use indicatif::{ProgressBar, ProgressStyle};
use teraio_scheduler::advise::{
    Advice, CheckpointProbe, array_size, best_checkpointing, fewest_ssds, least_host_memory,
};
use teraio_scheduler::{ModelConfig, Policy};

use crate::cmd::hw_args::{HwArgs, explain};
use crate::cmd::plan::{PlanArgs, drive_life};
use crate::output::outln;
use crate::units::to_gb;
use crate::{CliError, Result};

/// Options of `teraio advise`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  teraio advise llama3-8b.json --target 90                 # fewest SSDs for 90% of ideal
  teraio advise preset:llama3-70b --what array --ssd-gb 2000   # how big the SSD array must be
  teraio advise preset:llama3-70b --what host --ssds 2      # least host memory with 2 SSDs
  teraio advise preset:llama3-8b,dtype=tf32 --what checkpointing --policy teraio-hybrid
  teraio advise preset:llama3-8b,dtype=bf16,optimizer-in-backward --what checkpointing --json")]
pub struct Args {
    /// Trace file, or `preset:NAME[,KEY=VALUE...]` (e.g. `preset:llama3-8b,dtype=tf32`).
    pub trace: String,
    /// Target % of ideal throughput.
    #[arg(long, default_value_t = 90.0)]
    pub target: f64,
    /// Policy to plan with.
    #[arg(long, default_value = "auto")]
    pub policy: String,
    /// What to size: `ssds` (SSD count, other hardware fixed; a count whose array is too
    /// small for the plan's copies fails), `host` (host-tier memory), `array` (the SSD space
    /// the plan needs at its peak, and how many SSDs of --ssd-gb that is; --target is not
    /// used), or
    /// `checkpointing` (how many of the first layers to checkpoint, i.e. recompute in backward
    /// instead of keeping or offloading their activations, and whether to recompute the norms
    /// and activation function in the others, for the fastest iteration; needs a `preset:`
    /// model, not a trace file; --target is not used).
    #[arg(long, default_value = "ssds")]
    pub what: String,
    /// Largest SSD count tried.
    #[arg(long, default_value_t = 32)]
    pub max_ssds: u32,
    /// Largest host tier tried, GB.
    #[arg(long, default_value_t = 1024.0)]
    pub max_host_gb: f64,
    /// Host-memory granularity, GB.
    #[arg(long, default_value_t = 8.0)]
    pub host_step_gb: f64,
    #[command(flatten)]
    pub hw: HwArgs,
    #[command(flatten)]
    pub planner: PlanArgs,
    /// Print the advice as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Run `teraio advise`.
pub fn run(args: Args) -> Result<()> {
    let hw = args.hw.hardware()?;
    let policy: Policy = args.policy.parse()?;
    if args.what == "checkpointing" {
        return checkpointing(&args, &hw, policy);
    }
    let trace = crate::cmd::trace::load(&args.trace)?;
    if args.what == "array" {
        let a = array_size(&trace, &hw, policy, &args.planner.options()?).map_err(explain)?;
        if args.json {
            outln!("{}", serde_json::to_string_pretty(&a)?);
            return Ok(());
        }
        outln!(
            "{}: the {} plan ({:.3} s per iteration) keeps at most {:.1} GB of copies on the SSD \
             array and {:.1} GB on the host tier",
            trace.name,
            a.policy,
            a.iteration_us / 1e6,
            to_gb(a.ssd_bytes),
            to_gb(a.host_bytes)
        );
        outln!(
            "  with its {} SSDs: at least {:.1} GB usable on each",
            a.ssd_count,
            to_gb(a.bytes_per_ssd)
        );
        if let (Some(n), Some(each)) = (a.ssds_of_given_size, hw.ssd_capacity_bytes) {
            outln!(
                "  SSDs of {:.0} GB: {n} hold it (the bandwidth was planned for {})",
                to_gb(each),
                a.ssd_count
            );
        }
        outln!(
            "  writes {:.1} GB to the SSDs per iteration; drive life {}",
            to_gb(a.ssd_written_bytes),
            drive_life(a.drive_life_days, hw.ssd_endurance_tbw)
        );
        return Ok(());
    }
    let advice: Advice = match args.what.as_str() {
        "ssds" => fewest_ssds(&trace, &hw, policy, args.target, args.max_ssds)?,
        "host" => {
            if args.host_step_gb.is_nan() || args.host_step_gb <= 0.0 {
                return Err(CliError::Usage("--host-step-gb must be > 0".into()));
            }
            least_host_memory(
                &trace,
                &hw,
                policy,
                args.target,
                (args.max_host_gb * 1e9) as u64,
                (args.host_step_gb * 1e9) as u64,
            )?
        }
        w => {
            return Err(CliError::Usage(format!(
                "--what must be ssds, host or checkpointing, or array (the SSD space a plan \
                 needs), got {w:?}"
            )));
        }
    };
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&advice)?);
        return Ok(());
    }
    let amount = |v: u64| {
        if advice.resource == "ssd_count" {
            format!("{v} SSD{}", if v == 1 { "" } else { "s" })
        } else {
            format!("{:.0} GB host", to_gb(v))
        }
    };
    for p in &advice.probes {
        let v = amount(p.value);
        match &p.fails {
            Some(why) => outln!("  {v:>14}: no plan runs: {why}"),
            None if p.planned_for != p.value => outln!(
                "  {v:>14}: {:.1}% of ideal (the plan for {}: better than the one made for {v})",
                p.percent_of_ideal,
                amount(p.planned_for)
            ),
            None => outln!("  {v:>14}: {:.1}% of ideal", p.percent_of_ideal),
        }
    }
    match (advice.value, &advice.report) {
        (Some(v), Some(r)) if advice.resource == "ssd_count" => outln!(
            "{}: {} {} {:.1}% of ideal (target {:.1}%) with {}; the plan keeps {:.1} GB on \
             them ({:.1} GB per SSD) and {:.1} GB on the host tier",
            trace.name,
            amount(v),
            if v == 1 { "reaches" } else { "reach" },
            r.percent_of_ideal,
            args.target,
            policy,
            to_gb(r.peak_ssd_bytes),
            to_gb(r.peak_ssd_bytes.div_ceil(v.max(1))),
            to_gb(r.peak_host_bytes)
        ),
        (Some(v), Some(r)) => outln!(
            "{}: {:.0} GB of host memory reach {:.1}% of ideal (target {:.1}%) with {}; the plan \
             keeps {:.1} GB on the SSD array",
            trace.name,
            to_gb(v),
            r.percent_of_ideal,
            args.target,
            policy,
            to_gb(r.peak_ssd_bytes)
        ),
        _ => outln!(
            "{}: target {:.1}% not reached within the search range with {}",
            trace.name,
            args.target,
            policy
        ),
    }
    Ok(())
}

/// `teraio advise --what checkpointing`.
fn checkpointing(args: &Args, hw: &teraio_scheduler::Hardware, policy: Policy) -> Result<()> {
    let Some(spec) = args.trace.strip_prefix("preset:") else {
        return Err(CliError::Usage(format!(
            "--what checkpointing regenerates the model with each layer count, so it needs \
             `preset:NAME[,KEY=VALUE...]`, not the trace file {:?}",
            args.trace
        )));
    };
    let cfg = ModelConfig::from_spec(spec)?;
    let bar = if args.json { ProgressBar::hidden() } else { ProgressBar::new_spinner() };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {elapsed} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    let mut n = 0;
    let advice = best_checkpointing(&cfg, hw, policy, |p| {
        n += 1;
        let sel = if p.selective { " + selective" } else { "" };
        bar.set_message(format!("probe {n}: {} layers checkpointed{sel}", p.layers));
        bar.tick();
    })?;
    bar.finish_and_clear();
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&advice)?);
        return Ok(());
    }
    outln!(
        "{}: checkpointing the first N of {} layers, with or without selective recomputation \
         (norms and activation function) in the others; {policy}; ideal {:.3} s without \
         recomputation",
        cfg.name,
        advice.layers,
        advice.ideal_us / 1e6
    );
    let mut probes = advice.probes.clone();
    probes.sort_by_key(|p| (p.selective, p.layers));
    let secs = |p: &CheckpointProbe| match p.iteration_us {
        Some(us) => format!("{:.3} s ({:.1}% of ideal)", us / 1e6, p.percent_of_ideal),
        None => "out of memory".to_string(),
    };
    outln!("  {:>6} {:>28} {:>28}", "layers", "checkpointing only", "+ selective recomputation");
    let mut counts: Vec<u32> = probes.iter().map(|p| p.layers).collect();
    counts.sort_unstable();
    counts.dedup();
    let at = |l: u32, sel: bool| {
        probes.iter().find(|p| p.layers == l && p.selective == sel).map(secs).unwrap_or_default()
    };
    for l in counts {
        outln!("  {l:>6} {:>28} {:>28}", at(l, false), at(l, true));
    }
    let describe = |(l, sel): (u32, bool)| {
        let ck = match l {
            0 if sel => return "selective recomputation in every layer".to_string(),
            0 => "no checkpointing".to_string(),
            l if l == advice.layers => format!("checkpoint all {l} layers"),
            l => format!("checkpoint the first {l} of {} layers", advice.layers),
        };
        if sel && l < advice.layers {
            format!("{ck}, selective recomputation in the others")
        } else {
            ck
        }
    };
    match advice.best {
        Some(b) => outln!(
            "best: {}: {} (no recomputation: {}; all layers checkpointed: {})",
            describe(b),
            at(b.0, b.1),
            at(0, false),
            at(advice.layers, false)
        ),
        None => outln!("every setting runs out of memory with {policy}"),
    }
    Ok(())
}
