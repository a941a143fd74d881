//! `teraio advise`: the fewest SSDs / least host memory that reach a target % of ideal.

use teraio_scheduler::Policy;
use teraio_scheduler::advise::{Advice, fewest_ssds, least_host_memory};

use crate::cmd::plan::{HwArgs, gb, outln};
use crate::{CliError, Result};

/// Options of `teraio advise`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace file, or `preset:NAME`.
    pub trace: String,
    /// Target % of ideal throughput.
    #[arg(long, default_value_t = 90.0)]
    pub target: f64,
    /// Policy to plan with.
    #[arg(long, default_value = "teraio")]
    pub policy: String,
    /// What to size: `ssds` (SSD count, other hardware fixed) or `host` (host-tier memory).
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
    /// Print the advice as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Run `teraio advise`.
pub fn run(args: Args) -> Result<()> {
    let trace = crate::cmd::trace::load(&args.trace)?;
    let hw = args.hw.hardware()?;
    let policy: Policy = args.policy.parse()?;
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
        w => return Err(CliError::Usage(format!("--what must be ssds or host, got {w:?}"))),
    };
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&advice)?);
        return Ok(());
    }
    for p in &advice.probes {
        let v = if advice.resource == "ssd_count" {
            format!("{} SSDs", p.value)
        } else {
            format!("{:.0} GB host", gb(p.value))
        };
        outln!("  {v:>14}: {:.1}% of ideal", p.percent_of_ideal);
    }
    match (advice.value, &advice.report) {
        (Some(v), Some(r)) if advice.resource == "ssd_count" => outln!(
            "{}: {v} SSDs reach {:.1}% of ideal (target {:.1}%) with {}",
            trace.name,
            r.percent_of_ideal,
            args.target,
            policy
        ),
        (Some(v), Some(r)) => outln!(
            "{}: {:.0} GB of host memory reach {:.1}% of ideal (target {:.1}%) with {}",
            trace.name,
            gb(v),
            r.percent_of_ideal,
            args.target,
            policy
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
