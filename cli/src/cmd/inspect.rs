//! `teraio inspect`: print the superblock, the tensors and the free space of a teraio array,
//! without writing a byte.

use std::path::PathBuf;

use teraio_engine::{Engine, EngineConfig};

use crate::Result;
use crate::units::binary_spaced;

/// Options of `teraio inspect`.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  teraio inspect teraio-data/dev0 teraio-data/dev1 teraio-data/dev2 teraio-data/dev3\n  \
teraio inspect --json /dev/nvme1n1 /dev/nvme2n1\n  \
teraio inspect --config teraio.toml"
)]
pub struct Args {
    /// The array's devices or files, in array order (as given when it was created).
    #[arg(value_name = "DEVICE", required_unless_present = "config")]
    pub devices: Vec<PathBuf>,
    /// The engine configuration file naming the array (instead of DEVICE...).
    #[arg(long, value_name = "FILE", conflicts_with = "devices")]
    pub config: Option<PathBuf>,
    /// List every tensor (default: the first 20).
    #[arg(long)]
    pub all: bool,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

/// Run `teraio inspect`.
pub fn run(args: Args) -> Result<()> {
    let cfg = match &args.config {
        Some(path) => EngineConfig::from_file(path)?,
        None => EngineConfig::with_targets(args.devices.clone()),
    };
    for t in cfg.resolved_targets() {
        if let teraio_engine::array::Target::Path(p) = t
            && !p.exists()
        {
            return Err(crate::CliError::Usage(format!("{}: no such file or device", p.display())));
        }
    }
    let meta = Engine::inspect(&cfg)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&meta)?);
        return Ok(());
    }
    println!("array {}", meta.array_uuid);
    println!(
        "checkpoint generation {}, {} journal records after it ({} used; scan stopped: {})",
        meta.checkpoint_generation,
        meta.journal_records,
        binary_spaced(meta.journal_used_bytes),
        meta.journal_stop
    );
    println!();
    println!(
        "{:>3}  {:<32} {:>10} {:>10} {:>10} {:>12} {:>8}",
        "dev", "path", "capacity", "data", "used", "largest free", "free ext"
    );
    for d in &meta.devices {
        println!(
            "{:>3}  {:<32} {:>10} {:>10} {:>10} {:>12} {:>8}",
            d.index,
            d.name,
            binary_spaced(d.capacity_bytes),
            binary_spaced(d.data_bytes),
            binary_spaced(d.used_bytes),
            binary_spaced(d.largest_free_bytes),
            d.free_extents
        );
        if let Some(note) = &d.superblock_note {
            println!("     warning: {note}");
        }
    }
    if let Some(d) = meta.devices.first() {
        println!(
            "block {} B, stripe unit {}, allocation unit {}",
            d.block_bytes,
            binary_spaced(d.stripe_unit_bytes),
            binary_spaced(d.alloc_unit_bytes)
        );
    }
    let total: u64 = meta.tensors.iter().map(|t| t.size_bytes).sum();
    println!();
    println!("{} tensors, {}", meta.tensors.len(), binary_spaced(total));
    if !meta.tensors.is_empty() {
        println!(
            "{:>10}  {:<32} {:>10} {:>6} {:>8} {:>9}",
            "id", "name", "size", "lanes", "extents", "checksums"
        );
        let shown = if args.all { meta.tensors.len() } else { meta.tensors.len().min(20) };
        for t in &meta.tensors[..shown] {
            println!(
                "{:>10}  {:<32} {:>10} {:>6} {:>8} {:>9}",
                t.id,
                t.name,
                binary_spaced(t.size_bytes),
                t.lanes,
                t.extents,
                t.checksums
            );
        }
        if shown < meta.tensors.len() {
            println!("... {} more (--all lists them)", meta.tensors.len() - shown);
        }
    }
    Ok(())
}
