//! The hardware options shared by `plan`, `simulate` and `advise`, turned into one
//! [`Hardware`] model.

use teraio_scheduler::Hardware;

use crate::{CliError, Result};

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
