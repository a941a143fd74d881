//! `teraio plan`: plan offloads and prefetches for a trace.

use std::path::PathBuf;
use std::time::Instant;

use teraio_scheduler::{Op, Policy, plan};

use crate::cmd::hw_args::HwArgs;
use crate::output::outln;
use crate::units::to_gb;
use crate::{CliError, Result};

/// Options of `teraio plan`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace file, or `preset:NAME[,KEY=VALUE...]` (e.g. `preset:llama3-8b,dtype=tf32`).
    pub trace: String,
    /// teraio, teraio-hybrid, g10, zero-infinity, lru, ideal, none.
    #[arg(long, default_value = "teraio")]
    pub policy: String,
    #[command(flatten)]
    pub hw: HwArgs,
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
    let start = Instant::now();
    let p = plan(&trace, &hw, policy)?;
    let elapsed = start.elapsed();
    let text = p.to_json();
    if let Some(out) = &args.output {
        std::fs::write(out, &text)
            .map_err(|source| CliError::File { path: out.clone(), source })?;
    }
    if args.json {
        outln!("{text}");
        return Ok(());
    }
    let offloads = p.instructions.iter().filter(|i| matches!(i.op, Op::Offload { .. })).count();
    let drops = p.instructions.iter().filter(|i| i.is_clean_drop()).count();
    let urgent = p.instructions.iter().filter(|i| i.urgent).count();
    outln!(
        "policy {} on {} ({} kernels, {} tensors)",
        p.policy,
        trace.name,
        p.kernel_count,
        p.tensor_count
    );
    outln!("plan time                {:.3} s", elapsed.as_secs_f64());
    outln!(
        "instructions             {} ({offloads} offloads of which {drops} clean drops, {urgent} \
         urgent)",
        p.instructions.len()
    );
    outln!("initially offloaded      {}", p.initially_offloaded.len());
    outln!("peak if nothing moves    {:.2} GB", to_gb(p.stats.peak_resident_bytes));
    outln!(
        "planned peak             {:.2} GB (capacity {:.2} GB)",
        to_gb(p.stats.planned_peak_bytes),
        to_gb(hw.gpu_memory_bytes)
    );
    outln!(
        "offloaded per iteration  {:.2} GB written to SSD, {:.2} GB dropped clean, {:.2} GB to host",
        to_gb(p.stats.ssd_offload_bytes),
        to_gb(p.stats.clean_drop_bytes),
        to_gb(p.stats.host_offload_bytes)
    );
    outln!("candidates / evaluations {} / {}", p.stats.candidates, p.stats.evaluations);
    Ok(())
}
