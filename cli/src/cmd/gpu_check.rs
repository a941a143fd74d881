//! `teraio gpu-check` (hidden): the device-side test of the GPU data paths, run on a GPU machine
//! by `scripts/gpu-check.sh`.
//!
//! Over 4 files in `--dir`: random data of odd sizes GPU -> SSD array -> GPU through both paths
//! (bounce and gds), compared byte for byte; a tensor written by one path read through the
//! other (persistent arrays reopened); a flipped byte on disk caught on both paths; a prefetch
//! into memory of the wrong size, a misaligned device pointer, a host pointer and a range past
//! its allocation refused; a trainer-owned (wrapped) pointer round-tripped; an offload ordered
//! after the caller's stream. Prints one line per check and `N passed, M failed`.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use teraio_engine::store::{GpuPath, OffloadOptions};
use teraio_engine::tier::TensorMem;
use teraio_engine::units::ByteSize;
use teraio_engine::{Engine, EngineConfig, Error, Overwrite};

use crate::{CliError, Result};

/// Options of `teraio gpu-check`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// CUDA device.
    #[arg(long, default_value_t = 0)]
    pub gpu: u32,
    /// Folder for the 4 array files (on the disk to test; O_DIRECT needs a real filesystem).
    #[arg(long, default_value = "./teraio-gpu-check")]
    pub dir: PathBuf,
    /// Host memory stands in for the GPU (CI: the same checks minus foreign pointers).
    #[arg(long, hide = true)]
    pub emulated: bool,
    /// Largest tensor of the odd sizes.
    #[arg(long, default_value = "300M", value_parser = crate::units::parse_size)]
    pub max_size: u64,
}

struct Checks {
    passed: u32,
    failed: u32,
}

impl Checks {
    fn check(&mut self, name: &str, r: Result<String>) {
        match r {
            Ok(detail) => {
                self.passed += 1;
                println!(
                    "PASS {name}{}",
                    if detail.is_empty() { String::new() } else { format!(": {detail}") }
                );
            }
            Err(e) => {
                self.failed += 1;
                println!("FAIL {name}: {e}");
            }
        }
    }
}

fn engine_config(args: &Args, path: GpuPath, dir: &Path, persistent: bool) -> EngineConfig {
    let mut cfg = EngineConfig {
        dir: dir.to_path_buf(),
        files: 4,
        file_size_bytes: ByteSize((args.max_size * 3 / 4 + (64 << 20)).max(256 << 20)),
        persistent,
        overwrite: if persistent { Overwrite::Teraio } else { Overwrite::Anything },
        ..EngineConfig::default()
    };
    cfg.gpu.device = Some(args.gpu);
    cfg.gpu.path = path;
    cfg.gpu.emulated = args.emulated;
    cfg.gpu.budget_bytes = ByteSize(4 * args.max_size + (256 << 20));
    cfg
}

fn random(len: u64, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    SmallRng::seed_from_u64(seed).fill(&mut v[..]);
    v
}

fn to_gpu(engine: &Engine, data: &[u8]) -> Result<TensorMem> {
    let mut m = engine.alloc_gpu(data.len() as u64)?;
    m.fill_from_host(data)?;
    Ok(m)
}

fn same(m: &TensorMem, data: &[u8]) -> Result<()> {
    let mut back = vec![0u8; m.len() as usize];
    m.read_to_host(&mut back)?;
    if back.len() != data.len() {
        return Err(CliError::Usage(format!("{} bytes came back for {}", back.len(), data.len())));
    }
    if let Some(i) = back.iter().zip(data).position(|(a, b)| a != b) {
        return Err(CliError::Usage(format!("byte {i} of {} differs", data.len())));
    }
    Ok(())
}

fn path_name(p: GpuPath) -> &'static str {
    match p {
        GpuPath::Gds => "gds",
        GpuPath::Bounce => "bounce",
        GpuPath::Auto => "auto",
    }
}

/// Run `teraio gpu-check`.
pub fn run(args: Args) -> Result<()> {
    let mut c = Checks { passed: 0, failed: 0 };
    let mut sizes = vec![1u64, 4095, 4097, (1 << 20) - 1, (1 << 20) + 1, (7 << 20) + 13];
    let mut rng = SmallRng::seed_from_u64(2026);
    for _ in 0..4 {
        sizes.push(rng.gen_range((1 << 20)..args.max_size) | 1);
    }
    sizes.push(args.max_size | 1);
    for path in [GpuPath::Bounce, GpuPath::Gds] {
        let name = path_name(path);
        let dir = args.dir.join(name);
        let engine = match Engine::open(engine_config(&args, path, &dir, false)) {
            Ok(e) => e,
            Err(e) => {
                c.check(&format!("{name}: open the engine"), Err(e.into()));
                continue;
            }
        };
        c.check(
            &format!("{name}: path"),
            (|| {
                let info = engine.gpu_path()?;
                if info.path != name {
                    return Err(CliError::Usage(format!(
                        "{} was chosen: {}",
                        info.path, info.reason
                    )));
                }
                Ok(format!(
                    "{} on {}; cuFile {}",
                    info.reason,
                    engine.gpu_description().unwrap_or("?"),
                    info.direct_mode.map_or("not opened", |m| m.describe())
                ))
            })(),
        );
        for (i, &size) in sizes.iter().enumerate() {
            c.check(
                &format!("{name}: {size} bytes GPU -> SSD -> GPU"),
                (|| {
                    let data = random(size, i as u64);
                    let id = i as u64;
                    engine.store().offload_sync(
                        id,
                        to_gpu(&engine, &data)?,
                        OffloadOptions::default(),
                    )?;
                    let back = engine.store().prefetch_sync(id, engine.alloc_gpu(size)?)?;
                    same(&back, &data)?;
                    Ok(String::new())
                })(),
            );
        }
        c.check(&format!("{name}: flipped byte on disk"), flipped_byte(&engine, &dir));
        c.check(&format!("{name}: wrong sizes and pointers refused"), wrong_inputs(&engine, &args));
        c.check(
            &format!("{name}: offload after the caller's stream"),
            (|| {
                let data = random(5 << 20, 77);
                let h = engine.store().offload_after_stream(
                    500,
                    to_gpu(&engine, &data)?,
                    OffloadOptions::default(),
                    0,
                )?;
                h.wait()?;
                let back = engine.store().prefetch_sync(500, engine.alloc_gpu(5 << 20)?)?;
                back.wait_ready_on_stream(0)?;
                same(&back, &data)?;
                Ok(String::new())
            })(),
        );
        let st = engine.store().gpu_stats();
        println!(
            "     {name}: gpu stats: {} direct I/Os, {} tail bounces, GPU crc {:.3} s over {} bytes, {} bytes of pinned staging",
            st.direct_ios,
            st.tail_bounces,
            st.gpu_crc_ns as f64 * 1e-9,
            st.gpu_crc_bytes,
            st.pinned_staging_bytes
        );
    }
    // Cross-path reads over persistent arrays.
    for (w, r) in [(GpuPath::Gds, GpuPath::Bounce), (GpuPath::Bounce, GpuPath::Gds)] {
        let name = format!("written by {}, read by {}", path_name(w), path_name(r));
        let dir = args.dir.join("cross");
        let _ = std::fs::remove_dir_all(&dir);
        c.check(
            &name,
            (|| {
                let size = (args.max_size / 3) | 1;
                let data = random(size, 99);
                {
                    let e = Engine::open(engine_config(&args, w, &dir, true))?;
                    e.store().offload_sync(1, to_gpu(&e, &data)?, OffloadOptions::default())?;
                }
                let e = Engine::open(engine_config(&args, r, &dir, true))?;
                let back = e.store().prefetch_sync(1, e.alloc_gpu(size)?)?;
                same(&back, &data)?;
                let st = e.store().gpu_stats();
                let reads = if r == GpuPath::Gds { st.gds_read.ops } else { st.bounce_read.ops };
                if reads != 1 {
                    return Err(CliError::Usage("the read did not take the asked path".into()));
                }
                Ok(format!("{size} bytes"))
            })(),
        );
    }
    println!("{} passed, {} failed", c.passed, c.failed);
    if c.failed > 0 {
        return Err(CliError::Usage(format!("{} GPU checks failed", c.failed)));
    }
    Ok(())
}

fn flipped_byte(engine: &Engine, dir: &Path) -> Result<String> {
    let size = (9 << 20) + 3;
    let data = random(size, 5);
    engine.store().offload_sync(300, to_gpu(engine, &data)?, OffloadOptions::default())?;
    let map = engine.store().info(300).and_then(|i| i.stripe_map).expect("an SSD copy");
    let at = 5_555_555u64;
    let (dev, off) = map.locate(at).map_err(Error::from)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(format!("dev{dev}")))
        .map_err(|source| CliError::File { path: dir.join(format!("dev{dev}")), source })?;
    let mut b = [0u8; 1];
    let io = |e| CliError::File { path: dir.to_path_buf(), source: e };
    file.read_exact_at(&mut b, off).map_err(io)?;
    file.write_all_at(&[b[0] ^ 1], off).map_err(io)?;
    file.sync_all().map_err(io)?;
    match engine.store().prefetch_sync(300, engine.alloc_gpu(size)?) {
        Err(Error::ChecksumMismatch { offset, .. })
            if offset == at / map.unit_bytes() * map.unit_bytes() =>
        {
            Ok(format!("mismatch reported at unit offset {offset}"))
        }
        Err(e) => Err(CliError::Usage(format!("expected a checksum mismatch, got: {e}"))),
        Ok(_) => Err(CliError::Usage("the corrupted tensor was handed back".into())),
    }
}

fn wrong_inputs(engine: &Engine, args: &Args) -> Result<String> {
    let data = random(3 << 20, 8);
    engine.store().offload_sync(400, to_gpu(engine, &data)?, OffloadOptions::default())?;
    let e = engine.store().prefetch_sync(400, engine.alloc_gpu((3 << 20) + 1)?);
    if !matches!(e, Err(Error::InvalidArgument(_))) {
        return Err(CliError::Usage(format!("a prefetch into a larger buffer gave {e:?}")));
    }
    let back = engine.store().prefetch_sync(400, engine.alloc_gpu(3 << 20)?)?;
    same(&back, &data)?;
    if engine.alloc_gpu(0).is_ok() {
        return Err(CliError::Usage("a GPU tensor of 0 bytes was allocated".into()));
    }
    if args.emulated {
        return Ok("sizes (foreign pointers need a real GPU)".into());
    }
    let ptr = back.device().expect("GPU memory").device_ptr();
    if !matches!(engine.wrap_gpu(ptr + 1, 100), Err(Error::Misaligned { .. })) {
        return Err(CliError::Usage("a misaligned device pointer was accepted".into()));
    }
    let host = [0u64; 512];
    if engine.wrap_gpu((host.as_ptr() as u64 + 15) & !15, 2048).is_ok() {
        return Err(CliError::Usage("a host pointer was accepted as GPU memory".into()));
    }
    if engine.wrap_gpu(ptr, 64 << 20).is_ok() {
        return Err(CliError::Usage("a range past its allocation was accepted".into()));
    }
    // A trainer-owned pointer goes out and comes back into the same memory.
    let foreign = engine.wrap_gpu(ptr, 3 << 20)?;
    engine.store().offload_sync(401, foreign, OffloadOptions::default())?;
    let zeros = vec![0u8; 3 << 20];
    let mut back = back;
    back.fill_from_host(&zeros)?;
    let into = engine.wrap_gpu(ptr, 3 << 20)?;
    let _filled = engine.store().prefetch_sync(401, into)?;
    same(&back, &data)?;
    Ok("sizes, misaligned, host and out-of-range pointers; wrapped pointer round trip".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_check_passes_on_an_emulated_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let args =
            Args { gpu: 0, dir: dir.path().to_path_buf(), emulated: true, max_size: 24 << 20 };
        run(args).unwrap();
    }
}
