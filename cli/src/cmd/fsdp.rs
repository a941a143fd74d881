//! `teraio simulate preset:MODEL --fsdp-ranks 1,2,4,8`: FSDP2 over N ranks, one SSD array and
//! host tier each, one rank's iteration under teraio against the ideal and CPU offload
//! (`teraio_scheduler::fsdp::sweep`; docs/FSDP.md).

use teraio_scheduler::fsdp::{METHODS, RankRow, SweepOptions, sweep as run_sweep};
use teraio_scheduler::{ModelConfig, Policy};

use crate::cmd::simulate::Args;
use crate::output::outln;
use crate::units::to_gb;
use crate::{CliError, Result};

/// Parse `1,2,4,8`: whole numbers (their range is the model's to check, naming the value).
pub fn parse_ranks(list: &str) -> Result<Vec<u32>> {
    let parts: Vec<&str> = list.split(',').map(str::trim).collect();
    let mut ranks = Vec::new();
    for p in &parts {
        let n = p.parse::<u32>().map_err(|_| {
            CliError::Usage(format!(
                "--fsdp-ranks {list:?}: {p:?} is not a whole number of ranks (e.g. --fsdp-ranks \
                 1,2,4,8)"
            ))
        })?;
        ranks.push(n);
    }
    Ok(ranks)
}

/// Run the sweep of `teraio simulate --fsdp-ranks LIST`.
pub fn sweep(args: &Args, list: &str) -> Result<()> {
    let Some(spec) = args.trace.strip_prefix("preset:") else {
        return Err(CliError::Usage(format!(
            "--fsdp-ranks needs a model to shard, `preset:NAME[,KEY=VALUE...]`, not the trace \
             {:?} (a trace file holds one rank's tensors already)",
            args.trace
        )));
    };
    if args.optimizer_on != "gpu" {
        return Err(CliError::Usage(
            "--fsdp-ranks places the optimizer itself (its `teraio, optimizer placed` column): \
             leave out --optimizer-on"
                .into(),
        ));
    }
    let policy: Policy = args
        .policy
        .parse()
        .map_err(|e| CliError::Usage(format!("--fsdp-ranks plans with one --policy: {e}")))?;
    let ranks = parse_ranks(list)?;
    let model = ModelConfig::from_spec(spec)?;
    let hw = args.hw.hardware()?;
    let opts = SweepOptions { policy, plan: args.planner.options()? };
    let rows = run_sweep(&model, &ranks, &hw, &opts).map_err(|e| match e {
        teraio_scheduler::Error::InvalidArgument(m) => {
            CliError::Usage(format!("--fsdp-ranks {list}: {m}"))
        }
        e => e.into(),
    })?;
    if args.json {
        let v = serde_json::json!({
            "simulated": "figures of the simulator on the hardware model below (one rank's), \
                          not measurements",
            "model": model,
            "link_bytes_per_s": model.link_bytes_per_s(),
            "hardware_per_rank": hw,
            "ranks": rows,
        });
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print_text(&model, &hw, &rows);
    Ok(())
}

fn print_text(model: &ModelConfig, hw: &teraio_scheduler::Hardware, rows: &[RankRow]) {
    outln!(
        "FSDP2 of {} ({}, {} x {} sequences of {} tokens per rank and iteration), link {:.0} \
         GB/s{}",
        model.name,
        format!("{:?}", model.dtype).to_lowercase(),
        model.micro_batches,
        model.micro_batch,
        model.seq_len,
        model.link_bytes_per_s() / 1e9,
        if model.fsdp_no_overlap { ", collectives not overlapped" } else { "" }
    );
    outln!(
        "each rank: {:.0} GB GPU cap, {} SSDs x {:.1}/{:.1} GB/s, PCIe {:.0}/{:.0} GB/s, host tier \
         {:.0} GB, CPU AdamW {:.1} G params/s",
        to_gb(hw.gpu_memory_bytes),
        hw.ssd_count,
        hw.ssd_read_bytes_per_s / 1e9,
        hw.ssd_write_bytes_per_s / 1e9,
        hw.pcie_h2d_bytes_per_s / 1e9,
        hw.pcie_d2h_bytes_per_s / 1e9,
        to_gb(hw.host_memory_cap_bytes),
        hw.cpu_adam_params_per_s / 1e9
    );
    outln!("simulator figures, not measurements (docs/FSDP.md says what is modelled)");
    outln!();
    outln!("per rank: shards, memory, collectives (s per iteration)");
    outln!(
        "{:>5} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "ranks",
        "shards GB",
        "peak GB",
        "least GB",
        "cap GB",
        "link s",
        "exposed s"
    );
    for r in rows {
        outln!(
            "{:>5} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9.3} {:>9.3}",
            r.ranks,
            to_gb(r.shard_bytes),
            to_gb(r.peak_bytes),
            to_gb(r.least_gpu_bytes),
            to_gb(r.gpu_cap_bytes),
            r.link_us / 1e6,
            r.exposed_comm_us / 1e6
        );
    }
    outln!();
    outln!("per rank: iteration s (% of ideal) / PCIe GB moved");
    let short = ["ideal", "teraio", "optimizer placed", "collectives waited", "CPU offload"];
    let mut head = format!("{:>5}", "ranks");
    for s in short {
        head.push_str(&format!(" {s:>22}"));
    }
    outln!("{head}");
    for r in rows {
        let ideal = r.method("ideal").and_then(|m| m.iteration_us);
        let mut line = format!("{:>5}", r.ranks);
        for name in METHODS {
            let cell = match r.method(name) {
                Some(m) => match m.iteration_us {
                    Some(us) => {
                        let pct =
                            ideal.map_or(String::new(), |i| format!(" ({:.0}%)", 100.0 * i / us));
                        format!("{:.3}{pct} / {:.0}", us / 1e6, to_gb(m.pcie_bytes))
                    }
                    None => "does not fit".into(),
                },
                None => "-".into(),
            };
            line.push_str(&format!(" {cell:>22}"));
        }
        outln!("{line}");
    }
    outln!();
    outln!("whole job: tokens/s (all ranks)");
    outln!("{head}");
    for r in rows {
        let mut line = format!("{:>5}", r.ranks);
        for name in METHODS {
            let cell = r
                .method(name)
                .and_then(|m| m.job_tokens_per_s)
                .map_or("-".to_string(), |t| format!("{t:.0}"));
            line.push_str(&format!(" {cell:>22}"));
        }
        outln!("{line}");
    }
    let refusals: Vec<String> = rows
        .iter()
        .flat_map(|r| {
            r.methods.iter().filter_map(move |m| {
                m.refused.as_ref().map(|why| format!("{} ranks, {}: {why}", r.ranks, m.name))
            })
        })
        .collect();
    if !refusals.is_empty() {
        outln!();
        for line in refusals {
            outln!("does not fit: {line}");
        }
    }
    for r in rows {
        if let Some(m) = r.method("teraio, optimizer placed")
            && m.iteration_us.is_some()
        {
            outln!("{} ranks, optimizer placed: {}", r.ranks, m.policy);
        }
    }
}
