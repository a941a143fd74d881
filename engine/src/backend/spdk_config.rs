//! What the `spdk` backend is asked to open: its target syntax and options. Plain data, built
//! with or without the `spdk` feature, so configurations and the CLI name SPDK targets the same
//! way everywhere and a build without the feature can say clearly what is missing.
//!
//! Target syntax (an array target string when the backend is `spdk`):
//!
//! | target | meaning |
//! | --- | --- |
//! | `PATH` | SPDK bdev over a file or block device (the `bdev` option: uring by default) |
//! | `uring:PATH`, `aio:PATH` | the same with the bdev module named |
//! | `nvme:TRID [ns:N]` | SPDK's NVMe driver; `TRID` in SPDK's transport ID syntax, e.g. `trtype:tcp adrfam:ipv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2016-06.io.spdk:cnode1` |
//! | `nvme:BDF [ns:N]` | SPDK's NVMe driver on a PCIe function, e.g. `nvme:0000:5e:00.0` (bound to vfio-pci) |
//!
//! `ns` defaults to 1. A fabrics target must name its subsystem (`subnqn`): the backend never
//! attaches to something the user did not name.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::units::ByteSize;
use crate::{Error, Result};

/// SPDK bdev module used over a file or block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileBdev {
    /// `bdev_uring` (io_uring inside SPDK's reactor).
    #[default]
    Uring,
    /// `bdev_aio` (Linux AIO).
    Aio,
}

impl FileBdev {
    /// "uring" or "aio".
    pub fn name(self) -> &'static str {
        match self {
            FileBdev::Uring => "uring",
            FileBdev::Aio => "aio",
        }
    }
}

/// One target of the `spdk` backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpdkTarget {
    /// An SPDK bdev over a file or block device.
    Bdev {
        /// The bdev module.
        module: FileBdev,
        /// The file or block device.
        path: PathBuf,
    },
    /// A namespace of an NVMe controller driven by SPDK's NVMe driver.
    Nvme {
        /// SPDK transport ID string (`trtype:... traddr:...`), without the namespace.
        trid: String,
        /// The PCIe address when the transport is PCIe.
        pci_addr: Option<String>,
        /// Namespace id (1 by default).
        nsid: u32,
    },
}

impl SpdkTarget {
    /// A short name for messages and `device_name`.
    pub fn describe(&self) -> String {
        match self {
            SpdkTarget::Bdev { module, path } => format!("{}:{}", module.name(), path.display()),
            SpdkTarget::Nvme { trid, nsid, .. } => format!("nvme:{trid} ns:{nsid}"),
        }
    }
}

/// The prefixes that mark a target string as SPDK syntax.
const PREFIXES: [&str; 3] = ["nvme:", "uring:", "aio:"];

/// Whether a target string uses the `spdk` backend's own syntax (`nvme:`, `uring:`, `aio:`),
/// which other backends refuse instead of creating a file of that name.
pub fn is_spdk_syntax(target: &Path) -> bool {
    let s = target.to_string_lossy();
    PREFIXES.iter().any(|p| s.starts_with(p))
}

/// Whether `s` is a PCIe address `DDDD:BB:DD.F` (domain optional).
fn is_bdf(s: &str) -> bool {
    let parts: Vec<&str> = s.split(':').collect();
    let (bus_dev, domain_ok) = match parts.as_slice() {
        [d, b, df] => (Some((*b, *df)), d.len() == 4 && d.chars().all(|c| c.is_ascii_hexdigit())),
        [b, df] => (Some((*b, *df)), true),
        _ => (None, false),
    };
    let Some((bus, devfn)) = bus_dev else { return false };
    let Some((dev, func)) = devfn.split_once('.') else { return false };
    let hex = |x: &str, n: usize| x.len() == n && x.chars().all(|c| c.is_ascii_hexdigit());
    domain_ok
        && hex(bus, 2)
        && hex(dev, 2)
        && func.len() == 1
        && func.chars().all(|c| c.is_digit(8))
}

/// Parse one target string of the `spdk` backend; `default_bdev` is the module for a plain
/// path.
pub fn parse_target(target: &Path, default_bdev: FileBdev) -> Result<SpdkTarget> {
    let s = target.to_str().ok_or_else(|| {
        Error::InvalidArgument(format!("SPDK target {} is not UTF-8", target.display()))
    })?;
    if let Some(p) = s.strip_prefix("uring:") {
        return bdev(FileBdev::Uring, p);
    }
    if let Some(p) = s.strip_prefix("aio:") {
        return bdev(FileBdev::Aio, p);
    }
    let Some(rest) = s.strip_prefix("nvme:") else { return bdev(default_bdev, s) };
    let mut nsid = 1u32;
    let mut fields: Vec<String> = Vec::new();
    for tok in rest.split_whitespace() {
        let (k, v) = tok.split_once([':', '=']).unwrap_or((tok, ""));
        if k.eq_ignore_ascii_case("ns") {
            nsid = v.parse().ok().filter(|&n| n >= 1).ok_or_else(|| {
                Error::InvalidArgument(format!("SPDK target {s:?}: ns must be a number >= 1"))
            })?;
        } else {
            fields.push(tok.to_string());
        }
    }
    let bad = |why: &str| {
        Error::InvalidArgument(format!(
            "SPDK target {s:?}: {why} (syntax: nvme:BDF or nvme:trtype:tcp adrfam:ipv4 \
             traddr:ADDR trsvcid:PORT subnqn:NQN [ns:N])"
        ))
    };
    if fields.len() == 1 && is_bdf(&fields[0]) {
        let bdf = normalize_bdf(&fields[0]);
        return Ok(SpdkTarget::Nvme {
            trid: format!("trtype:PCIe traddr:{bdf}"),
            pci_addr: Some(bdf),
            nsid,
        });
    }
    let get = |key: &str| {
        fields.iter().find_map(|f| {
            let (k, v) = f.split_once([':', '='])?;
            k.eq_ignore_ascii_case(key).then(|| v.to_string())
        })
    };
    let Some(trtype) = get("trtype") else { return Err(bad("no trtype")) };
    let Some(traddr) = get("traddr") else { return Err(bad("no traddr")) };
    if trtype.eq_ignore_ascii_case("pcie") {
        if !is_bdf(&traddr) {
            return Err(bad("traddr of a PCIe target must be a PCIe address such as 0000:5e:00.0"));
        }
        let bdf = normalize_bdf(&traddr);
        return Ok(SpdkTarget::Nvme {
            trid: format!("trtype:PCIe traddr:{bdf}"),
            pci_addr: Some(bdf),
            nsid,
        });
    }
    if get("subnqn").is_none() {
        return Err(bad("a fabrics target must name its subsystem (subnqn:NQN)"));
    }
    Ok(SpdkTarget::Nvme { trid: fields.join(" "), pci_addr: None, nsid })
}

fn bdev(module: FileBdev, path: &str) -> Result<SpdkTarget> {
    if path.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "SPDK target {}: no file or device path",
            module.name()
        )));
    }
    Ok(SpdkTarget::Bdev { module, path: PathBuf::from(path) })
}

/// `5e:00.0` -> `0000:5e:00.0`, lower case.
fn normalize_bdf(s: &str) -> String {
    let s = s.to_ascii_lowercase();
    if s.matches(':').count() == 1 { format!("0000:{s}") } else { s }
}

/// Check that the PCIe function `bdf` exists under `sysfs` (normally `/sys`) and is bound to a
/// userspace I/O driver (vfio-pci, uio_pci_generic, igb_uio): never take a device from the
/// kernel's nvme driver.
pub fn check_pci_binding(sysfs: &Path, bdf: &str) -> Result<()> {
    let dev = sysfs.join("bus/pci/devices").join(bdf);
    if !dev.exists() {
        return Err(Error::InvalidArgument(format!(
            "SPDK target: PCIe device {bdf} not found ({} does not exist)",
            dev.display()
        )));
    }
    let driver = std::fs::read_link(dev.join("driver"))
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    match driver.as_deref() {
        Some("vfio-pci" | "uio_pci_generic" | "igb_uio") => Ok(()),
        Some("nvme") => Err(Error::InvalidArgument(format!(
            "SPDK target: PCIe device {bdf} is bound to the kernel's nvme driver; teraio will not \
             take it. If it holds nothing you need, unbind it and bind it to vfio-pci yourself \
             (docs/SPDK.md shows how)"
        ))),
        Some(other) => Err(Error::InvalidArgument(format!(
            "SPDK target: PCIe device {bdf} is bound to {other}, not to vfio-pci or uio"
        ))),
        None => Err(Error::InvalidArgument(format!(
            "SPDK target: PCIe device {bdf} is bound to no driver; bind it to vfio-pci first"
        ))),
    }
}

/// Options of the `spdk` backend (section `[spdk]` of an engine configuration).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SpdkOptions {
    /// Folder the engine owns for DPDK's runtime files (absent: `$TMPDIR/teraio-spdk.PID`,
    /// removed at exit, or by the next start of SPDK if the process was killed). SPDK is
    /// started once per process, by the first array that uses it.
    pub runtime_dir: Option<PathBuf>,
    /// DPDK memory, bytes (rounded to MiB; the DMA heap bounce buffers and SPDK's pools come
    /// from it).
    #[serde(rename = "memory")]
    pub memory_bytes: ByteSize,
    /// A hugetlbfs mount (of your own) for DPDK's memory; absent: no huge pages (`--no-huge`).
    pub huge_dir: Option<PathBuf>,
    /// Module for plain-path targets.
    pub bdev: FileBdev,
    /// Copy every transfer through a DMA buffer (`spdk_malloc`) instead of handing the engine's
    /// memory to SPDK. Always on for PCIe targets (the engine's memory is not registered for
    /// DMA); elsewhere for tests and comparisons.
    pub bounce: bool,
    /// SPDK's interrupt mode (`spdk_interrupt_mode_enable`): reactors sleep on file descriptors
    /// while requests are in flight instead of busy-polling a core. Process-wide, like SPDK's
    /// environment: the first SPDK array of the process sets it, and a later array asking for
    /// the other mode is refused. Only bdev modules with interrupt support can run in it: in
    /// this SPDK, `aio` (an eventfd per I/O channel); `uring` bdevs and SPDK's NVMe driver are
    /// polled and are refused ([`check_interrupt_support`]).
    pub interrupt: bool,
    /// Polling mode: when a reactor with requests in flight polls and finds nothing done, it
    /// sleeps instead of spinning: on the uring bdev's io_uring (until a completion, a new
    /// request or 1 ms) where it can tell which one SPDK made for it, else for at most this
    /// many microseconds; a new request wakes it either way. 0 (default): busy-poll. Saves
    /// most of the core a reactor spins (docs/SPDK.md, "Polling naps"). Ignored in interrupt
    /// mode.
    pub poll_sleep_us: u32,
}

impl Default for SpdkOptions {
    /// Runtime folder in $TMPDIR, 512 MiB without huge pages, uring bdevs, no bounce.
    fn default() -> Self {
        Self {
            runtime_dir: None,
            memory_bytes: ByteSize(512 << 20),
            huge_dir: None,
            bdev: FileBdev::Uring,
            bounce: false,
            interrupt: false,
            poll_sleep_us: 0,
        }
    }
}

/// Whether `target` can run in SPDK's interrupt mode ([`SpdkOptions::interrupt`]): an error
/// that says why not and what to use instead.
pub fn check_interrupt_support(target: &SpdkTarget) -> Result<()> {
    match target {
        SpdkTarget::Bdev { module: FileBdev::Aio, .. } => Ok(()),
        SpdkTarget::Bdev { module: FileBdev::Uring, path } => Err(Error::Unsupported(format!(
            "SPDK target uring:{}: SPDK's uring bdev has no interrupt mode (its completion poller \
             would keep the reactor awake); with spdk interrupt = true use the aio bdev \
             (aio:{} or bdev = \"aio\"), or turn interrupt off",
            path.display(),
            path.display()
        ))),
        SpdkTarget::Nvme { .. } => Err(Error::Unsupported(format!(
            "SPDK target {}: the spdk backend polls NVMe queue pairs (NVMe/TCP has no interrupt \
             support in this SPDK, and PCIe interrupts through vfio are not wired up); turn spdk \
             interrupt off for NVMe targets",
            target.describe()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Result<SpdkTarget> {
        parse_target(Path::new(s), FileBdev::Uring)
    }

    #[test]
    fn target_syntax() {
        assert_eq!(
            p("/data/f").unwrap(),
            SpdkTarget::Bdev { module: FileBdev::Uring, path: "/data/f".into() }
        );
        assert_eq!(
            p("aio:/dev/sdb").unwrap(),
            SpdkTarget::Bdev { module: FileBdev::Aio, path: "/dev/sdb".into() }
        );
        assert_eq!(
            p("nvme:5E:00.0").unwrap(),
            SpdkTarget::Nvme {
                trid: "trtype:PCIe traddr:0000:5e:00.0".into(),
                pci_addr: Some("0000:5e:00.0".into()),
                nsid: 1
            }
        );
        let tcp = p("nvme:trtype:tcp adrfam:ipv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.x ns:2")
            .unwrap();
        assert_eq!(
            tcp,
            SpdkTarget::Nvme {
                trid: "trtype:tcp adrfam:ipv4 traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.x".into(),
                pci_addr: None,
                nsid: 2
            }
        );
        let err = p("nvme:trtype:tcp traddr:127.0.0.1").unwrap_err().to_string();
        assert!(err.contains("subnqn"), "{err}");
        assert!(p("nvme:trtype:pcie traddr:xyz").is_err());
        assert!(p("nvme:0000:5e:00.0 ns:0").is_err());
        assert!(p("uring:").is_err());
        assert!(is_spdk_syntax(Path::new("nvme:0000:5e:00.0")));
        assert!(!is_spdk_syntax(Path::new("/dev/nvme0n1")));
    }

    #[test]
    fn interrupt_mode_is_for_aio_bdevs_only() {
        check_interrupt_support(&p("aio:/data/f").unwrap()).unwrap();
        let e = check_interrupt_support(&p("/data/f").unwrap()).unwrap_err().to_string();
        assert!(e.contains("uring bdev has no interrupt mode") && e.contains("aio:/data/f"), "{e}");
        let e = check_interrupt_support(&p("nvme:0000:5e:00.0").unwrap()).unwrap_err().to_string();
        assert!(e.contains("polls NVMe queue pairs"), "{e}");
        let o: SpdkOptions = toml::from_str("interrupt = true\nbdev = \"aio\"").unwrap();
        assert!(o.interrupt && o.bdev == FileBdev::Aio);
        assert!(!SpdkOptions::default().interrupt);
    }

    #[test]
    fn pci_binding_is_checked_against_sysfs() {
        let root = tempfile::tempdir().unwrap();
        let sys = root.path();
        let devs = sys.join("bus/pci/devices");
        let drivers = sys.join("bus/pci/drivers");
        for (bdf, drv) in [("0000:01:00.0", Some("nvme")), ("0000:02:00.0", Some("vfio-pci"))] {
            std::fs::create_dir_all(devs.join(bdf)).unwrap();
            if let Some(d) = drv {
                std::fs::create_dir_all(drivers.join(d)).unwrap();
                std::os::unix::fs::symlink(drivers.join(d), devs.join(bdf).join("driver")).unwrap();
            }
        }
        std::fs::create_dir_all(devs.join("0000:03:00.0")).unwrap();
        let e = check_pci_binding(sys, "0000:01:00.0").unwrap_err().to_string();
        assert!(e.contains("kernel's nvme driver"), "{e}");
        check_pci_binding(sys, "0000:02:00.0").unwrap();
        let e = check_pci_binding(sys, "0000:03:00.0").unwrap_err().to_string();
        assert!(e.contains("no driver"), "{e}");
        let e = check_pci_binding(sys, "0000:09:00.0").unwrap_err().to_string();
        assert!(e.contains("not found"), "{e}");
    }
}
