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
    /// Each must exist (a raw block device, or a file on a mounted filesystem) unless --create
    /// is given: a mistyped device name is refused, not made into a file. A path under /dev
    /// that is not a block device is always refused.
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
    /// Size each file is created or resized to (raw devices are used whole; a file holding a
    /// persistent teraio array keeps its size, docs/ENGINE.md) [default: 1G].
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
    /// With --device: create a --device PATH that does not exist as a regular file (like fio's
    /// --filename with --size), of --file-size bytes (`teraio bench`: --size). Never under /dev.
    #[arg(long, requires = "devices")]
    pub create: bool,
    /// Use targets that hold a filesystem, partition table or teraio array (overwriting them).
    #[arg(long)]
    pub force: bool,
}

/// The folder of the array files when neither the command line nor the configuration file
/// names one (`teraio` only: an engine configuration without a location is refused).
pub const DEFAULT_DIR: &str = "./teraio-data";

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
        if !self.create {
            for d in &self.devices {
                check_device_exists(d)?;
            }
        }
        if cfg.targets.is_empty() && cfg.dir.as_os_str().is_empty() {
            cfg.dir = PathBuf::from(DEFAULT_DIR);
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// A `--device PATH` that does not exist is a mistyped device or a file the user did not ask to
/// create: refused with what to do (SPDK targets such as `nvme:...` are not paths).
fn check_device_exists(path: &std::path::Path) -> Result<()> {
    if teraio_engine::backend::spdk_config::is_spdk_syntax(path) {
        return Ok(());
    }
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let under_dev = path.starts_with("/dev");
            Err(crate::CliError::Usage(if under_dev {
                format!(
                    "--device {}: no such device; check its name (`lsblk` lists the drives, e.g. \
                     /dev/nvme1n1)",
                    path.display()
                )
            } else {
                format!(
                    "--device {}: no such file or device; check the name, or add --create to \
                     create it as a file of --file-size bytes (`teraio bench`: --size), as fio's \
                     --filename with --size does",
                    path.display()
                )
            }))
        }
        Err(e) => Err(crate::CliError::File { path: path.to_path_buf(), source: e }),
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
        let args = ArrayArgs {
            config: Some(file.clone()),
            file_size: Some(1 << 20),
            ..Default::default()
        };
        let cfg = args.engine_config().unwrap();
        assert_eq!(cfg.files, 2);
        assert_eq!(cfg.file_size_bytes.0, 1 << 20);
        assert_eq!(cfg.backend, BackendName::Psync);
        assert_eq!(cfg.dir, PathBuf::from(DEFAULT_DIR), "the file names no folder");
        std::fs::write(&file, "dir = \"data\"\nfiles = 2\n").unwrap();
        let args = ArrayArgs { config: Some(file), ..Default::default() };
        assert_eq!(args.engine_config().unwrap().dir, dir.path().join("data"), "relative to it");
        let plain = ArrayArgs::default().engine_config().unwrap();
        assert_eq!((plain.files, plain.file_size_bytes.0), (4, 1 << 30));
        assert_eq!(plain.dir, PathBuf::from(DEFAULT_DIR));
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

    #[test]
    fn a_device_that_does_not_exist_is_refused_unless_asked_to_create_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nvme-typo");
        let args = ArrayArgs { devices: vec![missing.clone()], ..Default::default() };
        let e = args.engine_config().unwrap_err().to_string();
        assert!(e.contains("--device") && e.contains("nvme-typo") && e.contains("--create"), "{e}");
        let args = ArrayArgs { devices: vec!["/dev/nvme9n1".into()], ..Default::default() };
        let e = args.engine_config().unwrap_err().to_string();
        assert!(e.contains("/dev/nvme9n1") && e.contains("no such device") && e.contains("lsblk"));
        let args = ArrayArgs { devices: vec![missing.clone()], create: true, ..Default::default() };
        assert_eq!(args.engine_config().unwrap().targets, vec![missing.clone()]);
        assert!(!missing.exists(), "the configuration creates nothing; opening does");
    }
}
