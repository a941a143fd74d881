//! The hardware options shared by `plan`, `simulate`, `analyze` and `advise`, turned into one
//! [`Hardware`] model; and the planner's refusals explained in terms of those options.

use teraio_scheduler::Hardware;

use crate::{CliError, Result};

/// Hardware selection shared by `plan`, `simulate`, `analyze` and `advise`.
#[derive(clap::Args, Debug, Clone)]
pub struct HwArgs {
    /// Hardware preset (`paper`: 94 GB H100 NVL, 4 SSDs x 6.7/6.5 GB/s of 4 TB and 2,400 TBW
    /// each, PCIe Gen5, 128 GB host tier; `dev`) or a JSON file of a `Hardware` (this
    /// machine's: `teraio hw measure -o hw.json`).
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
    /// Override the usable capacity of one SSD, GB (plans keep their SSD copies within the
    /// array: SSDs x this).
    #[arg(long)]
    pub ssd_gb: Option<f64>,
    /// Override the endurance of one SSD, terabytes written (TBW, from its datasheet): the
    /// reports project how many days the drives last at the plan's write rate.
    #[arg(long)]
    pub ssd_tbw: Option<f64>,
    /// Override the host CPU's optimizer throughput, parameters a second of an AdamW step
    /// (`cpu_adam_params_per_s`: the optimizer on the host, `--optimizer-on auto`,
    /// `zero-infinity`; `teraio bench-optim` measures this machine's).
    #[arg(long, value_name = "PARAMS_PER_S")]
    pub cpu_adam: Option<f64>,
}

impl HwArgs {
    /// Build the hardware model.
    pub fn hardware(&self) -> Result<Hardware> {
        let mut hw = if self.hw.ends_with(".json") {
            let text = std::fs::read_to_string(&self.hw)
                .map_err(|source| CliError::File { path: self.hw.clone().into(), source })?;
            serde_json::from_str(&text).map_err(|e| {
                crate::error::json_file(std::path::Path::new(&self.hw), "hardware model", &e)
            })?
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
        if let Some(c) = self.ssd_gb {
            if !(c.is_finite() && c > 0.0) {
                return Err(CliError::Usage(format!("--ssd-gb must be > 0, got {c}")));
            }
            hw.ssd_capacity_bytes = Some((c * 1e9) as u64);
        }
        if let Some(t) = self.ssd_tbw {
            hw.ssd_endurance_tbw = Some(t);
        }
        if let Some(c) = self.cpu_adam {
            hw.cpu_adam_params_per_s = c;
        }
        hw.validate()?;
        Ok(hw)
    }
}

/// A planner error, with the option that changes it where there is one: the message says what
/// is needed and what there is, this adds what to do.
pub fn explain(e: teraio_scheduler::Error) -> CliError {
    use teraio_scheduler::Error as E;
    let hint = match &e {
        E::GpuMemoryTooSmall { needed_bytes, .. } => format!(
            "give at least --gpu-mem-gb {:.2}, or split the kernel in the trace",
            (*needed_bytes as f64 / 1e9 * 100.0).ceil() / 100.0
        ),
        E::PlanOutOfMemory { .. } => "raise --gpu-mem-gb, give the plan a tier to move tensors \
            to (--ssds, --host-gb), or try --policy auto"
            .to_string(),
        E::TierTooSmall { tier, needed_bytes, .. } if tier.starts_with("SSD") => format!(
            "give the array at least {:.1} GB: bigger SSDs (--ssd-gb), more of them (--ssds), or \
             more host tier (--host-gb) to hold copies instead",
            *needed_bytes as f64 / 1e9
        ),
        E::TierTooSmall { needed_bytes, .. } => {
            format!("raise --host-gb to at least {:.1}", *needed_bytes as f64 / 1e9)
        }
        _ => return e.into(),
    };
    CliError::Usage(format!("{e}\n  to change it: {hint}"))
}
