//! The `teraio` command-line tool: run an offloaded training iteration, benchmark storage,
//! generate traces, plan, simulate, advise, and inspect arrays.

mod cmd;
mod error;
mod output;
mod plot;
mod units;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
    /// Throughput of the host optimizer step (AdamW, Adam, SGD) in memory traffic per second.
    BenchOptim(cmd::bench_optim::Args),
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
    /// This machine's hardware model: measure the array, host memory and GPU copies (cached
    /// per machine and array, where teraio.torch's Session finds it).
    #[command(subcommand)]
    Hw(cmd::hw::Command),
    /// Device-side test of the GPU data paths (scripts/gpu-check.sh runs it on a GPU machine).
    #[command(hide = true)]
    GpuCheck(cmd::gpu_check::Args),
}

/// The command line's parser: a negative number is taken as an option's value (and refused by
/// the option with its name), not as an unknown flag `-1`.
fn command() -> clap::Command {
    fn negative_values(c: clap::Command) -> clap::Command {
        #[allow(deprecated)]
        c.allow_negative_numbers(true).mut_subcommands(negative_values)
    }
    negative_values(Cli::command())
}

/// Parse the arguments, or exit with clap's message; a negative number given to an option that
/// counts says so.
fn parse_args(args: impl IntoIterator<Item = std::ffi::OsString>) -> Result<Cli, clap::Error> {
    let mut cmd = command();
    let matches = cmd.try_get_matches_from_mut(args)?;
    Cli::from_arg_matches(&matches).map_err(|e| e.format(&mut cmd))
}

/// Clap's "invalid digit" for `-1` given to an unsigned option, said as what to change.
fn negative_number_message(e: &clap::Error) -> Option<String> {
    if e.kind() != ErrorKind::ValueValidation {
        return None;
    }
    let text = |k| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        _ => None,
    };
    let (arg, value) = (text(ContextKind::InvalidArg)?, text(ContextKind::InvalidValue)?);
    let negative = value.strip_prefix('-').is_some_and(|v| v.parse::<f64>().is_ok());
    let m = e.to_string();
    let unsigned = m.contains("invalid digit") || m.contains("is not in 0..=");
    (negative && unsigned).then(|| {
        format!("error: {arg} must be zero or more (a whole number), got {value}\n\nFor more information, try '--help'.")
    })
}

fn main() {
    let cli = match parse_args(std::env::args_os()) {
        Ok(cli) => cli,
        Err(e) => {
            if let Some(m) = negative_number_message(&e) {
                eprintln!("{m}");
                std::process::exit(2);
            }
            e.exit()
        }
    };
    // The engine never prints: what it has to say (a fallback taken, a cleanup that failed)
    // comes here and goes to stderr beside the command's own output.
    teraio_engine::notice::set_sink(Some(std::sync::Arc::new(
        |n: &teraio_engine::notice::Notice| eprintln!("{n}"),
    )));
    let result = match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::BenchOptim(a) => cmd::bench_optim::run(a),
        Command::Trace(c) => cmd::trace::run(c),
        Command::Analyze(a) => cmd::analyze::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Simulate(a) => cmd::simulate::run(a),
        Command::Advise(a) => cmd::advise::run(a),
        Command::Inspect(a) => cmd::inspect::run(a),
        Command::Hw(c) => cmd::hw::run(c),
        Command::GpuCheck(a) => cmd::gpu_check::run(a),
    };
    if let Err(e) = result {
        eprintln!("{}", error_report(&e));
        std::process::exit(1);
    }
}

/// `error: ...` and the causes that add something (a cause the message already quotes is not
/// printed again).
fn error_report(e: &CliError) -> String {
    let mut out = format!("error: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(&format!("\n  caused by: {text}"));
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Cli, clap::Error> {
        parse_args(line.split_whitespace().map(std::ffi::OsString::from))
    }

    #[test]
    fn a_negative_number_names_its_option_and_what_it_must_be() {
        for (line, arg) in [
            ("teraio run --files -1", "--files"),
            ("teraio bench --iodepth -1", "--iodepth"),
            ("teraio run --iterations -2", "--iterations"),
        ] {
            let e = parse(line).unwrap_err();
            let m = negative_number_message(&e).unwrap_or_else(|| panic!("{line}: {e}"));
            assert!(m.contains(arg) && m.contains("zero or more") && m.contains('-'), "{m}");
        }
        let e = parse("teraio run --file-size -1").unwrap_err().to_string();
        assert!(e.contains("--file-size") && e.contains("negative"), "{e}");
        assert!(parse("teraio run --files 2").is_ok());
    }

    #[test]
    fn a_cause_the_message_quotes_is_not_printed_twice() {
        let json = serde_json::from_str::<serde_json::Value>("[1, 2").unwrap_err();
        let e = CliError::Scheduler(teraio_scheduler::Error::Json(json));
        let report = error_report(&e);
        assert_eq!(report.matches("EOF").count(), 1, "{report}");
        let io = std::io::Error::other("disk on fire");
        let e = CliError::File { path: "/x".into(), source: io };
        assert_eq!(error_report(&e).matches("disk on fire").count(), 1);
    }
}
