//! The array options shared by `run`, `bench` and `inspect`, turned into one
//! [`EngineConfig`]: the commands open the engine (or its array) from it and assemble nothing
//! themselves.

use std::path::PathBuf;

use teraio_engine::{BackendName, EngineConfig, Overwrite};

use crate::Result;
use crate::units::parse_size;

/// I/O backend of a run.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// io_uring (falls back to psync with a notice when unavailable).
    Uring,
    /// pread/pwrite on a thread pool.
    Psync,
    /// SPDK, userspace NVMe (needs a teraio built with the cargo feature `spdk`): SPDK bdevs
    /// over the --device files/devices, or SPDK's NVMe driver for `nvme:` targets.
    Spdk,
}

impl From<BackendArg> for BackendName {
    fn from(b: BackendArg) -> Self {
        match b {
            BackendArg::Uring => BackendName::Uring,
            BackendArg::Psync => BackendName::Psync,
            BackendArg::Spdk => BackendName::Spdk,
        }
    }
}

/// Where the array is: a configuration file, devices, or files in a folder.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ArrayArgs {
    /// Engine configuration file (TOML, or JSON when named *.json) describing the array, as the
    /// C and Python bindings read it (docs/ENGINE.md). Options given here override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A file or raw block device of the array; repeat for several, in array order. Default:
    /// --files files in --dir.
    ///
    /// With --backend spdk a target is one of: PATH (an SPDK uring bdev over the file or
    /// device), `uring:PATH` or `aio:PATH` (the bdev module named), `nvme:BDF` (a PCIe NVMe
    /// drive bound to vfio-pci, e.g. `nvme:0000:5e:00.0`; never one the kernel's nvme driver
    /// holds) or `nvme:TRID` with SPDK's transport ID, e.g. "nvme:trtype:tcp adrfam:ipv4
    /// traddr:127.0.0.1 trsvcid:4420 subnqn:nqn.2016-06.io.spdk:cnode1" (add ` ns:N` for a
    /// namespace other than 1). See docs/SPDK.md.
    #[arg(long = "device", visible_alias = "target", value_name = "PATH")]
    pub devices: Vec<PathBuf>,
    /// Folder of the default array files (`dev0`, `dev1`, ...), created if missing
    /// [default: ./teraio-data].
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Number of files in --dir [default: 4].
    #[arg(long, value_name = "N")]
    pub files: Option<u32>,
    /// Size each file is created or grown to (raw devices are used whole) [default: 1G].
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub file_size: Option<u64>,
    /// I/O backend [default: uring]. `spdk` needs a build with the cargo feature `spdk`
    /// (docs/SPDK.md); its options (memory, huge pages, bdev module) go in the configuration
    /// file's [spdk] section.
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// With --backend spdk: run SPDK in interrupt mode (reactors sleep on file descriptors
    /// instead of busy-polling a core while I/O is in flight). Only SPDK aio bdevs support it
    /// (`aio:PATH` targets, or `bdev = "aio"` in the [spdk] section); the same as
    /// `interrupt = true` there.
    #[arg(long)]
    pub spdk_interrupt: bool,
    /// Use targets that hold a filesystem, partition table or teraio array (overwriting them).
    #[arg(long)]
    pub force: bool,
}

impl ArrayArgs {
    /// The engine configuration: the file's (or the defaults), with the options given on the
    /// command line on top.
    pub fn engine_config(&self) -> Result<EngineConfig> {
        let mut cfg = match &self.config {
            Some(path) => EngineConfig::from_file(path)?,
            None => EngineConfig::default(),
        };
        if !self.devices.is_empty() {
            cfg.targets = self.devices.clone();
        }
        if let Some(d) = &self.dir {
            cfg.dir = d.clone();
            cfg.targets.clear();
        }
        if let Some(n) = self.files {
            cfg.files = n;
            cfg.targets.clear();
        }
        if let Some(s) = self.file_size {
            cfg.file_size_bytes.0 = s;
        }
        if let Some(b) = self.backend {
            cfg.backend = b.into();
        }
        if self.force {
            cfg.overwrite = Overwrite::Anything;
        }
        if self.spdk_interrupt {
            if cfg.backend != BackendName::Spdk {
                return Err(crate::CliError::Usage(
                    "--spdk-interrupt is an option of the spdk backend: add --backend spdk".into(),
                ));
            }
            cfg.spdk.interrupt = true;
        }
        if !self.devices.is_empty() && (self.dir.is_some() || self.files.is_some()) {
            return Err(crate::CliError::Usage(
                "--device and --dir/--files both name the array: give one or the other".into(),
            ));
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_override_the_file_and_the_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("e.toml");
        std::fs::write(&file, "files = 2\nfile_size = \"64M\"\nbackend = \"psync\"\n").unwrap();
        let args = ArrayArgs { config: Some(file), file_size: Some(1 << 20), ..Default::default() };
        let cfg = args.engine_config().unwrap();
        assert_eq!(cfg.files, 2);
        assert_eq!(cfg.file_size_bytes.0, 1 << 20);
        assert_eq!(cfg.backend, BackendName::Psync);
        assert_eq!(cfg.dir, dir.path().join("teraio-data"), "relative to the file");
        let plain = ArrayArgs::default().engine_config().unwrap();
        assert_eq!((plain.files, plain.file_size_bytes.0), (4, 1 << 30));
        let devices =
            ArrayArgs { devices: vec!["/a".into()], files: Some(2), ..Default::default() };
        assert!(devices.engine_config().is_err());
        let intr = ArrayArgs {
            spdk_interrupt: true,
            backend: Some(BackendArg::Spdk),
            ..Default::default()
        };
        assert!(intr.engine_config().unwrap().spdk.interrupt);
        let no_spdk = ArrayArgs { spdk_interrupt: true, ..Default::default() };
        assert!(no_spdk.engine_config().is_err(), "--spdk-interrupt needs --backend spdk");
        assert!(!plain.spdk.interrupt);
    }
}
