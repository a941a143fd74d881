//! The hardware model shared by planners and the simulator (and built by the engine's probe from
//! measured bandwidths).

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// One data-movement resource. Every migration uses a fixed set of them (its *path*).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    /// The SSD array, reading (sum over SSDs).
    SsdRead,
    /// The SSD array, writing (sum over SSDs).
    SsdWrite,
    /// PCIe host-to-device (prefetches).
    PcieH2d,
    /// PCIe device-to-host (offloads).
    PcieD2h,
    /// Host DRAM bandwidth (host-tier copies; SSD copies too when GPUDirect is off).
    HostMemory,
    /// The SSD array, reads and writes together (sum over SSDs): real drives share one
    /// budget between the two directions ([`Hardware::ssd_duplex_bytes_per_s`]). Every SSD
    /// transfer uses it besides [`Resource::SsdRead`] or [`Resource::SsdWrite`].
    SsdDuplex,
    /// The PCIe link, both directions together: a link moving both ways at once serves less
    /// than the sum of its one-way rates ([`Hardware::pcie_duplex_bytes_per_s`]; an H200 in
    /// this repository's measurements: 55 GB/s each way alone, 48.8 GB/s each way when both run,
    /// 97.6 GB/s in total). Every transfer over PCIe uses it besides [`Resource::PcieH2d`] or
    /// [`Resource::PcieD2h`].
    PcieDuplex,
}

impl Resource {
    /// Number of resources.
    pub const COUNT: usize = 7;

    /// All resources, in reporting order (`ALL[r.index()] == r`).
    pub const ALL: [Resource; Resource::COUNT] = [
        Resource::SsdRead,
        Resource::SsdWrite,
        Resource::PcieH2d,
        Resource::PcieD2h,
        Resource::HostMemory,
        Resource::SsdDuplex,
        Resource::PcieDuplex,
    ];

    /// Index into [`Resource::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether this is one of the SSD array's resources (zero bandwidth without SSDs).
    pub fn is_ssd(self) -> bool {
        matches!(self, Resource::SsdRead | Resource::SsdWrite | Resource::SsdDuplex)
    }

    /// Short name.
    pub fn as_str(self) -> &'static str {
        match self {
            Resource::SsdRead => "ssd_read",
            Resource::SsdWrite => "ssd_write",
            Resource::PcieH2d => "pcie_h2d",
            Resource::PcieD2h => "pcie_d2h",
            Resource::HostMemory => "host_memory",
            Resource::SsdDuplex => "ssd_duplex",
            Resource::PcieDuplex => "pcie_duplex",
        }
    }
}

/// Where an offloaded tensor goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// The SSD array (striped by teraio's allocator).
    Ssd,
    /// Pinned host memory, bounded by [`Hardware::host_memory_cap_bytes`].
    Host,
}

/// GPU memory, SSD array, PCIe and host memory of one GPU's share of a machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    /// GPU memory available to the training iteration's tensors, bytes.
    pub gpu_memory_bytes: u64,
    /// SSDs in this GPU's array.
    pub ssd_count: u32,
    /// Sequential read bandwidth of one SSD, bytes/s.
    pub ssd_read_bytes_per_s: f64,
    /// Sequential write bandwidth of one SSD, bytes/s.
    pub ssd_write_bytes_per_s: f64,
    /// Latency of one SSD I/O, microseconds (used by the G10 qualification rule only).
    pub ssd_latency_us: f64,
    /// PCIe host-to-device bandwidth, bytes/s.
    pub pcie_h2d_bytes_per_s: f64,
    /// PCIe device-to-host bandwidth, bytes/s.
    pub pcie_d2h_bytes_per_s: f64,
    /// Host memory usable as an offload tier, bytes (0: no host tier).
    pub host_memory_cap_bytes: u64,
    /// Host DRAM bandwidth available to migrations, bytes/s (reads and writes together).
    pub host_memory_bytes_per_s: f64,
    /// GPUDirect Storage: SSD transfers bypass host memory. Without it an SSD transfer also
    /// uses [`Resource::HostMemory`] (bounce buffer).
    pub gpudirect: bool,
    /// Bandwidth of one SSD when reading and writing at once, bytes/s, reads and writes
    /// together ([`Resource::SsdDuplex`]). `None` (the JSON default): no limit beyond the
    /// separate read and write bandwidths, i.e. `read + write`. Flash drives and virtual disks
    /// usually serve much less than `read + write` in total under a mixed load (this
    /// repository's dev machine: about 1.8 GB/s either way alone, 1.0-1.5 GB/s in total mixed).
    #[serde(default)]
    pub ssd_duplex_bytes_per_s: Option<f64>,
    /// Bandwidth of the PCIe link moving both ways at once, bytes/s, both directions together
    /// ([`Resource::PcieDuplex`]). `None` (the JSON default): no limit beyond the two one-way
    /// bandwidths, i.e. `h2d + d2h`. `benches/gpu/pcie_duplex.py` measures it.
    #[serde(default)]
    pub pcie_duplex_bytes_per_s: Option<f64>,
    /// Optimizer throughput of the host CPU share of this GPU, parameters per second of an
    /// AdamW step (DeepSpeed CPU-Adam), used by policies that run the optimizer step on the
    /// CPU (`zero-infinity`). The JSON default is [`DEFAULT_CPU_ADAM_PARAMS_PER_S`].
    #[serde(default = "default_cpu_adam")]
    pub cpu_adam_params_per_s: f64,
    /// Usable capacity of one SSD for tensor copies, bytes (the array holds `ssd_count` times
    /// this). `None` (the JSON default): unlimited. Planners keep the SSD copies of a plan
    /// under the array's capacity at every point of the iteration (what occupies it:
    /// [`crate::plan`](mod@crate::plan), "Tier space").
    #[serde(default)]
    pub ssd_capacity_bytes: Option<u64>,
    /// Endurance of one SSD: terabytes (10^12 bytes) its maker guarantees can be written
    /// (TBW). `None` (the JSON default): unknown. With it, simulations project how long the
    /// drives last at the plan's write rate ([`crate::SimReport::drive_life_days`]).
    #[serde(default)]
    pub ssd_endurance_tbw: Option<f64>,
}

/// Default [`Hardware::cpu_adam_params_per_s`]: 4e9 parameters/s.
///
/// Source: the ZeRO-Offload paper (Ren et al., USENIX ATC'21), which measured its CPU-Adam
/// on a two-socket Xeon Platinum 8168 host (48 cores, AVX-512) at about 0.22 s per 10^9
/// parameters for a 1B-parameter step and about 2.4-2.6 s for 8-10B parameters, i.e. roughly
/// 4e9 parameters/s (figures recalled from the paper's CPU-Adam latency table; DeepSpeed's
/// tutorial states only "5X-7X faster than the standard PyTorch implementation"). The
/// step is memory-bandwidth bound (about 28 bytes of DRAM traffic per fp32 parameter). We give
/// the whole host's figure to one GPU, which favours ZeRO-Infinity on a machine whose GPUs
/// step at the same time (data parallel) and disfavours it on newer hosts with more DRAM
/// bandwidth; the paper's host CPU is not stated in our sources, so the measured figure is
/// taken as is.
pub const DEFAULT_CPU_ADAM_PARAMS_PER_S: f64 = 4e9;

fn default_cpu_adam() -> f64 {
    DEFAULT_CPU_ADAM_PARAMS_PER_S
}

impl Hardware {
    /// The paper's machine, per GPU: H100 NVL (94 GB), 4 x Samsung 990 PRO (6.7 GB/s read,
    /// 6.5 GB/s write each), PCIe Gen5 x16 (50 GB/s each way achieved), 128 GB of host
    /// memory as a tier, GPUDirect Storage. The paper does not state the drives' capacity:
    /// taken as the 4 TB model (4 x 10^12 bytes each, 2,400 TBW, Samsung's datasheet).
    pub fn paper() -> Self {
        Hardware {
            gpu_memory_bytes: 94_000_000_000,
            ssd_count: 4,
            ssd_read_bytes_per_s: 6.7e9,
            ssd_write_bytes_per_s: 6.5e9,
            ssd_latency_us: 80.0,
            pcie_h2d_bytes_per_s: 50e9,
            pcie_d2h_bytes_per_s: 50e9,
            host_memory_cap_bytes: 128_000_000_000,
            host_memory_bytes_per_s: 100e9,
            gpudirect: true,
            ssd_duplex_bytes_per_s: None,
            pcie_duplex_bytes_per_s: None,
            cpu_adam_params_per_s: DEFAULT_CPU_ADAM_PARAMS_PER_S,
            ssd_capacity_bytes: Some(4_000_000_000_000),
            ssd_endurance_tbw: Some(2400.0),
        }
    }

    /// A laptop-class replay target (this repository's dev machine): 1 GiB of emulated GPU
    /// memory, 4 file-backed "SSDs" of 250 MB/s each (about 1 GB/s together), a 4 GB/s copy
    /// path, 1 GiB of host tier; capacity and endurance unknown (`teraio run` measures the
    /// array it opens).
    pub fn dev() -> Self {
        Hardware {
            gpu_memory_bytes: 1 << 30,
            ssd_count: 4,
            ssd_read_bytes_per_s: 250e6,
            ssd_write_bytes_per_s: 250e6,
            ssd_latency_us: 200.0,
            pcie_h2d_bytes_per_s: 4e9,
            pcie_d2h_bytes_per_s: 4e9,
            host_memory_cap_bytes: 1 << 30,
            host_memory_bytes_per_s: 8e9,
            gpudirect: true,
            ssd_duplex_bytes_per_s: None,
            pcie_duplex_bytes_per_s: None,
            cpu_adam_params_per_s: DEFAULT_CPU_ADAM_PARAMS_PER_S,
            ssd_capacity_bytes: None,
            ssd_endurance_tbw: None,
        }
    }

    /// A named preset: `paper` or `dev`.
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "paper" | "h100-nvl-4ssd" => Ok(Hardware::paper()),
            "dev" | "laptop" => Ok(Hardware::dev()),
            _ => Err(Error::InvalidArgument(format!(
                "unknown hardware preset {name:?} (known: paper, dev)"
            ))),
        }
    }

    /// Bandwidth of one resource, bytes/s.
    pub fn bandwidth(&self, r: Resource) -> f64 {
        match r {
            Resource::SsdRead => self.ssd_read_bytes_per_s * f64::from(self.ssd_count),
            Resource::SsdWrite => self.ssd_write_bytes_per_s * f64::from(self.ssd_count),
            Resource::PcieH2d => self.pcie_h2d_bytes_per_s,
            Resource::PcieD2h => self.pcie_d2h_bytes_per_s,
            Resource::HostMemory => self.host_memory_bytes_per_s,
            Resource::SsdDuplex => {
                self.ssd_duplex_bytes_per_s
                    .unwrap_or(self.ssd_read_bytes_per_s + self.ssd_write_bytes_per_s)
                    * f64::from(self.ssd_count)
            }
            Resource::PcieDuplex => self
                .pcie_duplex_bytes_per_s
                .unwrap_or(self.pcie_h2d_bytes_per_s + self.pcie_d2h_bytes_per_s),
        }
    }

    /// Resources an offload to `tier` uses.
    pub fn offload_path(&self, tier: Tier) -> Vec<Resource> {
        let pcie = [Resource::PcieD2h, Resource::PcieDuplex];
        match tier {
            Tier::Ssd if self.gpudirect => {
                [&pcie[..], &[Resource::SsdWrite, Resource::SsdDuplex]].concat()
            }
            Tier::Ssd => {
                [&pcie[..], &[Resource::SsdWrite, Resource::SsdDuplex, Resource::HostMemory]]
                    .concat()
            }
            Tier::Host => [&pcie[..], &[Resource::HostMemory]].concat(),
        }
    }

    /// Resources a prefetch from `tier` uses.
    pub fn prefetch_path(&self, tier: Tier) -> Vec<Resource> {
        let pcie = [Resource::PcieH2d, Resource::PcieDuplex];
        match tier {
            Tier::Ssd if self.gpudirect => {
                [&[Resource::SsdRead, Resource::SsdDuplex][..], &pcie].concat()
            }
            Tier::Ssd => {
                [&[Resource::SsdRead, Resource::SsdDuplex, Resource::HostMemory][..], &pcie]
                    .concat()
            }
            Tier::Host => [&[Resource::HostMemory][..], &pcie].concat(),
        }
    }

    /// Resources a host-side stream from the SSD array into host memory uses (the CPU
    /// optimizer step of `zero-infinity` reading its states).
    pub fn ssd_to_host_path(&self) -> Vec<Resource> {
        vec![Resource::SsdRead, Resource::SsdDuplex, Resource::HostMemory]
    }

    /// Resources a host-side stream from host memory to the SSD array uses.
    pub fn host_to_ssd_path(&self) -> Vec<Resource> {
        vec![Resource::SsdWrite, Resource::SsdDuplex, Resource::HostMemory]
    }

    /// Nominal bandwidth of a path (its slowest resource), bytes/s.
    pub fn path_bandwidth(&self, path: &[Resource]) -> f64 {
        path.iter().map(|&r| self.bandwidth(r)).fold(f64::INFINITY, f64::min)
    }

    /// Check that every bandwidth is positive and finite (an SSD count of 0 is allowed: no
    /// SSD tier).
    pub fn validate(&self) -> Result<()> {
        let checks = [
            ("ssd_read_bytes_per_s", self.ssd_read_bytes_per_s),
            ("ssd_write_bytes_per_s", self.ssd_write_bytes_per_s),
            ("pcie_h2d_bytes_per_s", self.pcie_h2d_bytes_per_s),
            ("pcie_d2h_bytes_per_s", self.pcie_d2h_bytes_per_s),
            ("host_memory_bytes_per_s", self.host_memory_bytes_per_s),
            ("ssd_duplex_bytes_per_s", self.ssd_duplex_bytes_per_s.unwrap_or(1.0)),
            ("pcie_duplex_bytes_per_s", self.pcie_duplex_bytes_per_s.unwrap_or(1.0)),
            ("cpu_adam_params_per_s", self.cpu_adam_params_per_s),
        ];
        for (name, v) in checks {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::InvalidArgument(format!(
                    "hardware.{name} must be finite and > 0, got {v}"
                )));
            }
        }
        if !(self.ssd_latency_us.is_finite() && self.ssd_latency_us >= 0.0) {
            return Err(Error::InvalidArgument("hardware.ssd_latency_us must be >= 0".into()));
        }
        if self.ssd_capacity_bytes == Some(0) {
            return Err(Error::InvalidArgument(
                "hardware.ssd_capacity_bytes must be > 0 (for no SSD tier, set ssd_count to 0)"
                    .into(),
            ));
        }
        if let Some(tbw) = self.ssd_endurance_tbw
            && !(tbw.is_finite() && tbw > 0.0)
        {
            return Err(Error::InvalidArgument(format!(
                "hardware.ssd_endurance_tbw must be finite and > 0, got {tbw}"
            )));
        }
        Ok(())
    }

    /// Usable capacity of the whole SSD array, bytes (`None`: unlimited; 0 without SSDs).
    pub fn ssd_array_capacity_bytes(&self) -> Option<u64> {
        if !self.has_ssd() {
            return Some(0);
        }
        self.ssd_capacity_bytes.map(|c| c.saturating_mul(u64::from(self.ssd_count)))
    }

    /// How many days the array's drives last when the array takes `written_bytes` every
    /// `iteration_us` microseconds, spread evenly over its drives (teraio stripes every
    /// tensor over all of them), from [`Hardware::ssd_endurance_tbw`]. `None` when the
    /// endurance is unknown, there is no SSD, or nothing is written.
    pub fn drive_life_days(&self, written_bytes: u64, iteration_us: f64) -> Option<f64> {
        let tbw = self.ssd_endurance_tbw?;
        if !self.has_ssd() || written_bytes == 0 || iteration_us.is_nan() || iteration_us <= 0.0 {
            return None;
        }
        let per_drive_per_s =
            written_bytes as f64 / f64::from(self.ssd_count) / (iteration_us * 1e-6);
        Some(tbw * 1e12 / per_drive_per_s / 86_400.0)
    }

    /// Whether the SSD tier exists.
    pub fn has_ssd(&self) -> bool {
        self.ssd_count > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example: 670 GB written per 75 s iteration to 4 drives of 2,400 TBW wears
    /// them out in about two weeks (190 TB a day per drive).
    #[test]
    fn drive_life_from_endurance() {
        let hw = Hardware::paper();
        let days = hw.drive_life_days(670_000_000_000, 75e6).unwrap();
        assert!((days - 12.44).abs() < 0.01, "{days}");
        assert_eq!(hw.drive_life_days(0, 75e6), None);
        let mut none = hw.clone();
        none.ssd_endurance_tbw = None;
        assert_eq!(none.drive_life_days(1, 1.0), None);
        assert_eq!(hw.ssd_array_capacity_bytes(), Some(16_000_000_000_000));
        let mut bad = hw.clone();
        bad.ssd_capacity_bytes = Some(0);
        assert!(bad.validate().unwrap_err().to_string().contains("ssd_capacity_bytes"));
        bad.ssd_capacity_bytes = None;
        bad.ssd_endurance_tbw = Some(-1.0);
        assert!(bad.validate().unwrap_err().to_string().contains("ssd_endurance_tbw"));
    }
}
