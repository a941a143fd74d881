//! `teraio analyze`: lifetime analysis of a trace.

use teraio_scheduler::analysis::summarize;

use crate::Result;
use crate::output::outln;
use crate::units::to_gb;

/// Options of `teraio analyze`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Trace file, or `preset:NAME[,KEY=VALUE...]` (e.g. `preset:llama3-8b,dtype=tf32`).
    pub trace: String,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Run `teraio analyze`.
pub fn run(args: Args) -> Result<()> {
    let trace = crate::cmd::trace::load(&args.trace)?;
    let s = summarize(&trace);
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    outln!("trace {}: {} kernels, {} tensors", s.name, s.kernels, s.tensors);
    outln!("ideal iteration          {:.3} s", s.iteration_time_us / 1e6);
    outln!("tensor bytes             {:.2} GB", to_gb(s.total_tensor_bytes));
    outln!("peak if nothing moves    {:.2} GB", to_gb(s.peak_resident_bytes));
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
