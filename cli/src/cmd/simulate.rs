//! `teraio simulate`: replay iterations under a plan and report time, stalls and traffic.

use std::path::PathBuf;
use std::time::Instant;

use teraio_scheduler::{Outcome, Plan, Policy, Resource, SimOptions, SimReport, plan, simulate};

use crate::cmd::plan::{HwArgs, gb, outln};
use crate::{CliError, Result};

/// Options of `teraio simulate`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace file, or `preset:NAME`.
    pub trace: String,
    /// A plan file made by `teraio plan` (else plan on the fly with --policy).
    #[arg(long, conflicts_with = "policy")]
    pub plan: Option<PathBuf>,
    /// Policy, or a comma-separated list for a comparison table (`all`: every policy).
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
    outln!(
        "{:<14} {:>10} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8}",
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
                "{:<14} {:>10.3} {:>8.1} {:>9.3} {:>9.2} {:>9.1} {:>9.1} {:>9.1} {:>8.3}",
                r.policy,
                r.iteration_time_us / 1e6,
                r.percent_of_ideal,
                r.stall_us / 1e6,
                gb(r.peak_gpu_bytes),
                gb(moved(r, Resource::SsdRead)),
                gb(moved(r, Resource::SsdWrite)),
                gb(r.peak_host_bytes),
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
                    "{:<14} out of memory at iteration {iteration}, kernel {kernel}: needs {:.2} GB, \
                     {:.2} of {:.2} GB in use",
                    r.policy,
                    gb(*needed_bytes),
                    gb(*used_bytes),
                    gb(*capacity_bytes)
                )
            }
        }
    }
}

/// Run `teraio simulate`.
pub fn run(args: Args) -> Result<()> {
    let trace = crate::cmd::trace::load(&args.trace)?;
    let hw = args.hw.hardware()?;
    let opts = SimOptions { iterations: args.iterations, record_timeline: args.plot.is_some() };
    let mut plans: Vec<(Plan, f64)> = Vec::new();
    if let Some(path) = &args.plan {
        let text = std::fs::read_to_string(path)
            .map_err(|source| CliError::File { path: path.clone(), source })?;
        plans.push((Plan::from_json(&text)?, 0.0));
    } else {
        let names: Vec<String> = if args.policy == "all" {
            Policy::ALL.iter().map(|p| p.to_string()).collect()
        } else {
            args.policy.split(',').map(|s| s.trim().to_string()).collect()
        };
        for name in names {
            let policy: Policy = name.parse()?;
            let start = Instant::now();
            let p = plan(&trace, &hw, policy)?;
            plans.push((p, start.elapsed().as_secs_f64()));
        }
    }
    if args.plot.is_some() && plans.len() != 1 {
        return Err(CliError::Usage("--plot needs exactly one plan or policy".into()));
    }
    let mut rows = Vec::new();
    for (p, plan_s) in &plans {
        let report = simulate(&trace, p, &hw, &opts)?;
        rows.push(Row { report, plan_s: *plan_s });
    }
    if let Some(path) = &args.plot {
        crate::plot::memory_and_bandwidth(path, &trace, &rows[0].report, &hw)?;
    }
    if args.json {
        let reports: Vec<&SimReport> = rows.iter().map(|r| &r.report).collect();
        if reports.len() == 1 {
            outln!("{}", serde_json::to_string_pretty(reports[0])?);
        } else {
            outln!("{}", serde_json::to_string_pretty(&reports)?);
        }
        return Ok(());
    }
    outln!(
        "{} on {:.0} GB GPU, {} SSDs x {:.1}/{:.1} GB/s, PCIe {:.0}/{:.0} GB/s, host tier {:.0} GB; \
         ideal iteration {:.3} s",
        trace.name,
        gb(hw.gpu_memory_bytes),
        hw.ssd_count,
        hw.ssd_read_bytes_per_s / 1e9,
        hw.ssd_write_bytes_per_s / 1e9,
        hw.pcie_h2d_bytes_per_s / 1e9,
        hw.pcie_d2h_bytes_per_s / 1e9,
        gb(hw.host_memory_cap_bytes),
        trace.iteration_time_us() / 1e6
    );
    if let Some(d) = hw.ssd_duplex_bytes_per_s {
        outln!("SSD reads and writes share {:.1} GB/s per SSD", d / 1e9);
    }
    print_table(&rows);
    Ok(())
}
