//! The `teraio` command-line tool: run an offloaded training iteration, benchmark storage,
//! generate traces, plan, simulate, advise, and inspect arrays.

mod cmd;
mod error;
mod output;
mod plot;
mod units;

use clap::{Parser, Subcommand};

pub use error::{CliError, Result};

/// teraio: NVMe SSDs as an extension of GPU memory for LLM training.
///
/// teraio profiles a training iteration, learns every tensor's lifetime, plans when to offload
/// each idle tensor to SSD (or host memory) and when to bring it back, and executes that plan
/// with an asynchronous migration engine over its own striped SSD array.
#[derive(Parser, Debug)]
#[command(name = "teraio", version, about, long_about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Plan and replay a training iteration on the real engine, with emulated GPU memory.
    Run(cmd::run::Args),
    /// Storage benchmark in the spirit of fio, over files or raw block devices.
    Bench(cmd::bench::Args),
    /// Work with traces (generate synthetic transformer training traces).
    #[command(subcommand)]
    Trace(cmd::trace::Command),
    /// Lifetime analysis of a trace: active memory over time, inactive periods, sizes.
    Analyze(cmd::analyze::Args),
    /// Plan offloads and prefetches for a trace under a hardware model.
    Plan(cmd::plan::Args),
    /// Simulate an iteration under a plan and report time, stalls and traffic.
    Simulate(cmd::simulate::Args),
    /// Find the fewest SSDs / least host memory that reach a target % of ideal, or how much
    /// to recompute for the fastest iteration.
    Advise(cmd::advise::Args),
    /// Print the superblock, the tensors and the free space of a teraio array.
    Inspect(cmd::inspect::Args),
    /// Device-side test of the GPU data paths (scripts/gpu-check.sh runs it on a GPU machine).
    #[command(hide = true)]
    GpuCheck(cmd::gpu_check::Args),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Trace(c) => cmd::trace::run(c),
        Command::Analyze(a) => cmd::analyze::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Simulate(a) => cmd::simulate::run(a),
        Command::Advise(a) => cmd::advise::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::GpuCheck(a) => cmd::gpu_check::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            eprintln!("  caused by: {s}");
            source = s.source();
        }
        std::process::exit(1);
    }
}
