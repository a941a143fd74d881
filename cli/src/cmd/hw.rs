//! `teraio hw`: the hardware model of this machine, measured through the engine.

use std::path::PathBuf;

use teraio_engine::Engine;
use teraio_engine::probe::{CacheMode, GpuKind, Measurement, ProbeOptions, Source};
use teraio_engine::units::ByteSize;

use super::engine_args::ArrayArgs;
use crate::output::outln;
use crate::units::{gbps, parse_size_or_zero};
use crate::{CliError, Result};

/// Subcommands of `teraio hw`.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Measure this machine (the array, host memory copies, GPU copies) into a hardware model,
    /// kept in the cache where teraio.torch's Session finds it.
    Measure(MeasureArgs),
}

/// Options of `teraio hw measure`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
What it measures, in a few seconds, through the engine's own paths:
  array       write, read, and both at once: tensors of up to 32 MiB through the tensor store
              (O_DIRECT, striped over the devices, checksummed), up to --probe-size each way
              and at most a second a phase; an array with too little free space is skipped
  host        memory copies, on as many threads as the engine has workers
  GPU         with --gpu N (or [gpu] device in --config): pinned host <-> GPU copies each way
              alone and both at once. Without a GPU the trainer's memory is host memory, and
              its copy rates are the host copy rate.
The hardware model (the JSON that `teraio simulate --hw FILE` reads) takes the measured rates;
the array's size, the host tier and the GPU's memory come from the engine; the other fields
(SSD latency, CPU optimizer rate, drive endurance) from the `dev` preset (the report lists them).

The cache: one file per machine and array (hostname, CPU model, GPU name and UUID; the array's
backend and device paths), in $TERAIO_CACHE_DIR, else $XDG_CACHE_HOME/teraio, else
~/.cache/teraio. teraio.torch's Session(hardware=None) reads it for the same array, so its
first plan does not wait for a measurement; a damaged file, or one of another machine, is
measured again with a warning.

Examples:
  teraio hw measure --dir /mnt/nvme/teraio --files 4 --file-size 64G --gpu 0
  teraio hw measure --config engine.toml -o hw.json   # then: teraio simulate --hw hw.json
  teraio hw measure --config engine.toml --cached     # what a Session would use now
  teraio hw measure --device /dev/nvme1n1 --device /dev/nvme2n1 --force --json")]
pub struct MeasureArgs {
    /// The SSD array: --config FILE, --device PATH (repeat), or --files N in --dir.
    #[command(flatten)]
    pub array: ArrayArgs,
    /// Measure the copies of this CUDA device (its pinned host <-> GPU rates) and key the cache
    /// by it; without it, and without [gpu] device in --config, the engine has no GPU.
    #[arg(long, value_name = "N")]
    pub gpu: Option<u32>,
    /// With --gpu: host memory stands in for the GPU (tests).
    #[arg(long, hide = true, requires = "gpu")]
    pub gpu_emulated: bool,
    /// Bytes written to the array each way (and read back); capped at a quarter of its free
    /// space. 0: the array is not measured.
    #[arg(long, default_value = "256M", value_parser = parse_size_or_zero, value_name = "SIZE")]
    pub probe_size: u64,
    /// Use this machine and array's cached measurement when there is one (what a Session would
    /// use); measure only when there is none.
    #[arg(long)]
    pub cached: bool,
    /// Neither read nor write the cache.
    #[arg(long, conflicts_with = "cached")]
    pub no_cache: bool,
    /// Write the hardware model to FILE (JSON): `teraio simulate --hw FILE`, `teraio plan --hw
    /// FILE`, `Session(hardware=FILE)`.
    #[arg(short = 'o', long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Machine-readable output: the measurement (model, report, cache file) as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Run `teraio hw`.
pub fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::Measure(a) => measure(a),
    }
}

fn measure(args: MeasureArgs) -> Result<()> {
    let mut cfg = args.array.engine_config()?;
    if let Some(n) = args.gpu {
        cfg.gpu.device = Some(n);
        cfg.gpu.emulated = args.gpu_emulated;
    }
    // The probe holds three sets of its tensors in host buffers at once.
    cfg.host_buffers_bytes =
        ByteSize(cfg.host_buffers_bytes.0.max(3 * args.probe_size + (256 << 20)));
    let engine = Engine::open(cfg)?;
    if !args.json {
        eprintln!(
            "teraio hw measure: {}; {}{}",
            engine.describe(),
            engine.gpu_description().map_or_else(
                || "no GPU (its memory is host memory)".to_string(),
                |g| format!("GPU {g}")
            ),
            if args.cached { "" } else { "; measuring ..." }
        );
    }
    let options = ProbeOptions { array_bytes: args.probe_size, ..ProbeOptions::default() };
    let mode = match (args.cached, args.no_cache) {
        (true, _) => CacheMode::Use,
        (_, true) => CacheMode::Off,
        _ => CacheMode::Refresh,
    };
    let m = teraio_engine::probe::measure_cached(&engine, &options, mode);
    engine.close()?;
    if let Some(path) = &args.output {
        let text = serde_json::to_string_pretty(&m.hardware)? + "\n";
        std::fs::write(path, text)
            .map_err(|source| CliError::File { path: path.clone(), source })?;
    }
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&m.to_json())?);
    } else {
        print_text(&m, args.output.as_deref());
    }
    Ok(())
}

fn rate(r: Option<f64>) -> String {
    r.map_or_else(|| "not measured".into(), gbps)
}

fn print_text(m: &Measurement, output: Option<&std::path::Path>) {
    let r = &m.report;
    let a = &r.array;
    if a.bytes > 0 {
        outln!(
            "array        write {}, read {}, both at once {} in total ({} devices, {} MB each way)",
            rate(a.write_bytes_per_s),
            rate(a.read_bytes_per_s),
            rate(a.both_bytes_per_s),
            a.devices,
            a.bytes / 1_000_000
        );
    } else {
        outln!("array        not measured ({} devices)", a.devices);
    }
    outln!(
        "host memory  copies {} ({} threads, {} MB)",
        rate(r.host_copy.bytes_per_s),
        r.host_copy.threads,
        r.host_copy.bytes / 1_000_000
    );
    match r.cpu_adam.params_per_s {
        Some(p) => outln!(
            "host AdamW   {:.2} G parameters/s ({} threads, {} M parameters)",
            p / 1e9,
            r.cpu_adam.threads,
            r.cpu_adam.params / 1_000_000
        ),
        None => outln!("host AdamW   not measured"),
    }
    match r.gpu.kind {
        GpuKind::None => outln!("GPU          none"),
        _ => outln!(
            "GPU          {}: host -> GPU {}, GPU -> host {}, both at once {} in total",
            r.gpu.what,
            rate(r.gpu.h2d_bytes_per_s),
            rate(r.gpu.d2h_bytes_per_s),
            rate(r.gpu.both_bytes_per_s)
        ),
    }
    for n in &r.notes {
        outln!("note         {n}");
    }
    let hw = &m.hardware;
    outln!(
        "model        {} SSDs of {} read / {} write each{}; PCIe {} up / {} down; host memory {}; \
         host AdamW {:.2} G parameters/s; GPUDirect {}",
        hw.ssd_count,
        gbps(hw.ssd_read_bytes_per_s),
        gbps(hw.ssd_write_bytes_per_s),
        hw.ssd_duplex_bytes_per_s
            .map_or_else(String::new, |d| format!(" ({} both at once)", gbps(d))),
        gbps(hw.pcie_h2d_bytes_per_s),
        gbps(hw.pcie_d2h_bytes_per_s),
        gbps(hw.host_memory_bytes_per_s),
        hw.cpu_adam_params_per_s / 1e9,
        if hw.gpudirect { "yes" } else { "no" }
    );
    outln!("             from the `dev` preset: {}", r.from_default.join(", "));
    match (m.source, &m.cache_path) {
        (Source::Cache, Some(_)) => outln!("cached       {}", m.describe()),
        (_, Some(p)) => outln!(
            "measured     in {:.1} s; cached in {} (Session(hardware=None) on this array reads it)",
            r.seconds,
            p.display()
        ),
        (_, None) => outln!("measured     in {:.1} s; not cached", r.seconds),
    }
    if let Some(o) = output {
        outln!("written      {} (teraio simulate --hw {})", o.display(), o.display());
    }
}
