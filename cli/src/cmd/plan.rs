//! `teraio plan`: plan offloads and prefetches for a trace.

use std::path::PathBuf;
use std::time::Instant;

use teraio_scheduler::{Hardware, Op, Policy, plan};

use crate::{CliError, Result};

/// `println!` for command output: when standard output is a pipe whose reader has gone
/// (`teraio ... | head`), exit quietly with status 0 (as ripgrep does) instead of panicking
/// with "Broken pipe".
macro_rules! outln {
    () => {
        $crate::cmd::plan::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::cmd::plan::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}
pub(crate) use outln;

/// Write to standard output; see [`outln`]. Any other write error ends the process with
/// status 1 and the error on standard error.
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(e) = std::io::stdout().lock().write_fmt(args) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: writing to standard output: {e}");
        std::process::exit(1);
    }
}

/// Bytes as decimal gigabytes.
pub fn gb(bytes: u64) -> f64 {
    bytes as f64 / 1e9
}

/// Hardware selection shared by `plan`, `simulate` and `advise`.
#[derive(clap::Args, Debug, Clone)]
pub struct HwArgs {
    /// Hardware preset (`paper`: 94 GB H100 NVL, 4 SSDs x 6.7/6.5 GB/s, PCIe Gen5; `dev`) or
    /// a JSON file of a `Hardware`.
    #[arg(long, default_value = "paper")]
    pub hw: String,
    /// Override GPU memory, GB (10^9 bytes).
    #[arg(long)]
    pub gpu_mem_gb: Option<f64>,
    /// Override the SSD count.
    #[arg(long)]
    pub ssds: Option<u32>,
    /// Override the host-tier cap, GB.
    #[arg(long)]
    pub host_gb: Option<f64>,
}

impl HwArgs {
    /// Build the hardware model.
    pub fn hardware(&self) -> Result<Hardware> {
        let mut hw = if self.hw.ends_with(".json") {
            let text = std::fs::read_to_string(&self.hw)
                .map_err(|source| CliError::File { path: self.hw.clone().into(), source })?;
            serde_json::from_str(&text)?
        } else {
            Hardware::preset(&self.hw)?
        };
        if let Some(g) = self.gpu_mem_gb {
            hw.gpu_memory_bytes = (g * 1e9) as u64;
        }
        if let Some(s) = self.ssds {
            hw.ssd_count = s;
        }
        if let Some(h) = self.host_gb {
            hw.host_memory_cap_bytes = (h * 1e9) as u64;
        }
        hw.validate()?;
        Ok(hw)
    }
}

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
    outln!("peak if nothing moves    {:.2} GB", gb(p.stats.peak_resident_bytes));
    outln!(
        "planned peak             {:.2} GB (capacity {:.2} GB)",
        gb(p.stats.planned_peak_bytes),
        gb(hw.gpu_memory_bytes)
    );
    outln!(
        "offloaded per iteration  {:.2} GB written to SSD, {:.2} GB dropped clean, {:.2} GB to host",
        gb(p.stats.ssd_offload_bytes),
        gb(p.stats.clean_drop_bytes),
        gb(p.stats.host_offload_bytes)
    );
    outln!("candidates / evaluations {} / {}", p.stats.candidates, p.stats.evaluations);
    Ok(())
}
