use std::path::Path;

use super::*;
use crate::EngineConfig;
use crate::units::ByteSize;

/// A volatile engine over `files` files of 64 MiB in `dir`.
fn engine_in(dir: &Path, files: u32) -> Engine {
    let cfg = EngineConfig {
        dir: dir.to_path_buf(),
        files,
        file_size_bytes: ByteSize(64 << 20),
        workers: 2,
        ..EngineConfig::default()
    };
    Engine::open(cfg).unwrap()
}

/// The notices queued since the last call that mention `marker` (other tests' are left out:
/// the queue is the process's).
fn notices_about(marker: &str) -> Vec<String> {
    crate::notice::take_all()
        .into_iter()
        .map(|n| n.message)
        .filter(|m| m.contains(marker))
        .collect()
}

#[test]
fn a_file_backed_array_gets_positive_rates_and_a_valid_model() {
    for retain in [false, true] {
        // (a store that keeps its copies after a prefetch, as plan executors' do, and one that
        // forgets them)
        let dir = tempfile::tempdir().unwrap();
        let mut engine = engine_in(&dir.path().join("a"), 2);
        if retain {
            let mut cfg = engine.config().clone();
            drop(engine);
            cfg.retain_on_prefetch = true;
            cfg.overwrite = crate::Overwrite::Anything;
            engine = Engine::open(cfg).unwrap();
        }
        measured_on(&engine);
    }
}

fn measured_on(engine: &Engine) {
    let m = measure(engine, &ProbeOptions::quick(16 << 20));
    let a = &m.report.array;
    assert!(a.bytes >= ARRAY_BYTES_MIN && a.devices == 2, "{a:?}");
    for r in [a.write_bytes_per_s, a.read_bytes_per_s, a.both_bytes_per_s] {
        assert!(r.is_some_and(|r| r.is_finite() && r > 0.0), "{a:?} {:?}", m.report.notes);
    }
    assert!(m.report.host_copy.bytes_per_s.is_some_and(|r| r > 0.0));
    // the host's AdamW measured, and the model's CPU figure is it
    let adam = m.report.cpu_adam.params_per_s.expect("measured");
    assert!(adam.is_finite() && adam > 0.0 && m.report.cpu_adam.params == 1 << 18);
    assert_eq!(m.hardware.cpu_adam_params_per_s, adam);
    assert!(!m.report.from_default.iter().any(|f| f == "cpu_adam_params_per_s"), "{:?}", m.report);
    assert!(m.report.summary().contains("host AdamW"), "{}", m.report.summary());
    assert_eq!(m.report.gpu.kind, GpuKind::None);
    assert!(m.report.notes.iter().any(|n| n.contains("host memory")), "{:?}", m.report.notes);
    let hw = &m.hardware;
    hw.validate().unwrap();
    assert_eq!(hw.ssd_count, 2);
    // Per SSD in the model: the array's rate over its devices.
    assert!((hw.ssd_write_bytes_per_s * 2.0 - a.write_bytes_per_s.unwrap()).abs() < 1.0);
    assert_eq!(hw.pcie_h2d_bytes_per_s, m.report.host_copy.bytes_per_s.unwrap());
    assert!(hw.ssd_capacity_bytes.unwrap() <= 64 << 20);
    assert!(!m.report.from_default.iter().any(|f| f.starts_with("ssd_read")), "{:?}", m.report);
    // The probe leaves nothing behind.
    assert!(engine.store().tensors().is_empty());
    assert_eq!(engine.store().space().total.used_bytes, 0);
    assert!(m.describe().contains("measured now"), "{}", m.describe());
}

#[test]
fn an_array_too_small_to_measure_is_skipped_and_said() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_in(dir.path(), 1);
    let m = measure(&engine, &ProbeOptions { array_bytes: 0, ..ProbeOptions::quick(0) });
    assert_eq!(m.report.array.bytes, 0);
    assert!(m.report.array.write_bytes_per_s.is_none());
    assert!(m.report.notes.iter().any(|n| n.starts_with("array: not measured")), "{:?}", m.report);
    assert!(m.report.from_default.contains(&"ssd_read_bytes_per_s".to_string()));
    assert_eq!(m.hardware.ssd_read_bytes_per_s, Hardware::dev().ssd_read_bytes_per_s);
    m.hardware.validate().unwrap();
    assert!(m.report.summary().contains("not measured"), "{}", m.report.summary());
}

#[test]
fn an_emulated_gpu_gets_its_copy_rates_measured() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = EngineConfig {
        dir: dir.path().to_path_buf(),
        files: 1,
        file_size_bytes: ByteSize(64 << 20),
        ..EngineConfig::default()
    };
    cfg.gpu.device = Some(0);
    cfg.gpu.emulated = true;
    cfg.gpu.budget_bytes = ByteSize(64 << 20);
    let engine = Engine::open(cfg).unwrap();
    let m = measure(&engine, &ProbeOptions::quick(0));
    let g = &m.report.gpu;
    assert_eq!(g.kind, GpuKind::Emulated);
    assert!(g.h2d_bytes_per_s.is_some_and(|r| r > 0.0) && g.d2h_bytes_per_s.is_some(), "{g:?}");
    assert_eq!(m.hardware.pcie_h2d_bytes_per_s, g.h2d_bytes_per_s.unwrap());
    assert_eq!(m.hardware.gpu_memory_bytes, 64 << 20);
    assert!(!m.hardware.gpudirect, "the emulation bounces through host buffers");
    assert!(m.key.unwrap().gpu.unwrap().starts_with("emulated:"));
}

#[test]
fn the_cache_round_trips_and_is_what_simulate_reads() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let engine = engine_in(&dir.path().join("a"), 2);
    let opts = ProbeOptions::quick(8 << 20);
    let first = measure_cached_in(&engine, &opts, CacheMode::Use, Some(&cache));
    assert_eq!(first.source, Source::Measured);
    let path = first.cache_path.clone().expect("kept");
    assert!(path.starts_with(&cache) && path.exists());
    assert!(first.describe().contains("cached in"), "{}", first.describe());
    // Read back: the same model, from the cache, at once.
    let started = Instant::now();
    let second = measure_cached_in(&engine, &opts, CacheMode::Use, Some(&cache));
    assert!(started.elapsed() < Duration::from_millis(200));
    assert_eq!(second.source, Source::Cache);
    assert_eq!(second.hardware, first.hardware);
    assert_eq!(second.report, first.report);
    assert_eq!(second.cache_path.as_deref(), Some(&*path));
    assert!(second.describe().contains("from the cache"), "{}", second.describe());
    // The file is a hardware model as `teraio simulate --hw` reads it.
    let text = std::fs::read_to_string(&path).unwrap();
    let hw: Hardware = serde_json::from_str(&text).unwrap();
    assert_eq!(hw, first.hardware);
    // Refresh measures again and replaces it; Off touches nothing.
    let third = measure_cached_in(&engine, &opts, CacheMode::Refresh, Some(&cache));
    assert_eq!(third.source, Source::Measured);
    assert_ne!(std::fs::read_to_string(&path).unwrap(), text, "replaced");
    let off = measure_cached_in(&engine, &opts, CacheMode::Off, Some(&cache));
    assert_eq!((off.source, off.cache_path), (Source::Measured, None));
    let leftovers: Vec<_> =
        std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temporary files left: {leftovers:?}");
}

#[test]
fn a_corrupt_or_foreign_cache_file_is_measured_again_with_a_notice() {
    let _g = crate::notice::tests::SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache-corrupt");
    let marker = cache.to_string_lossy().into_owned();
    let engine = engine_in(&dir.path().join("a"), 1);
    let opts = ProbeOptions::quick(0);
    let path = cache.join(ProbeKey::of(&engine).unwrap().file_name());
    std::fs::create_dir_all(&cache).unwrap();
    notices_about(&marker);
    for (bad, why) in [
        ("{\"gpu_memory_bytes\": 1", "not JSON"),
        ("{\"ssd_count\": 1}", "no `teraio_probe`"),
        ("{\"teraio_probe\": {\"format\": 99}}", "another format"),
        // (a model measured before the host's AdamW was)
        ("{\"teraio_probe\": {\"format\": 1, \"key\": 3}}", "another format"),
        ("{\"teraio_probe\": {\"format\": 2, \"key\": 3}}", "damaged"),
    ] {
        assert_eq!(super::cache::FORMAT, 2, "the cases above name the format");
        std::fs::write(&path, bad).unwrap();
        let m = measure_cached_in(&engine, &opts, CacheMode::Use, Some(&cache));
        assert_eq!(m.source, Source::Measured, "{bad}");
        let said = notices_about(&marker);
        assert!(
            said.len() == 1 && said[0].contains(why) && said[0].contains("measuring"),
            "{bad}: {said:?}"
        );
        // ... and the measurement replaced the file: the next read uses it.
        let again = measure_cached_in(&engine, &opts, CacheMode::Use, Some(&cache));
        assert_eq!(again.source, Source::Cache, "{bad}");
    }
    // A file of another array (copied, or a hash collision) under this array's name.
    let other = engine_in(&dir.path().join("b"), 1);
    let theirs = measure_cached_in(&other, &opts, CacheMode::Refresh, Some(&cache));
    std::fs::copy(theirs.cache_path.unwrap(), &path).unwrap();
    let m = measure_cached_in(&engine, &opts, CacheMode::Use, Some(&cache));
    assert_eq!(m.source, Source::Measured);
    let said = notices_about(&marker);
    assert!(said.len() == 1 && said[0].contains("another machine or array"), "{said:?}");
    // A folder that cannot be written: the measurement still comes back, with a notice.
    let blocked = dir.path().join("not-a-folder");
    std::fs::write(&blocked, "").unwrap();
    let m = measure_cached_in(&engine, &opts, CacheMode::Use, Some(&blocked));
    assert_eq!((m.source, m.cache_path), (Source::Measured, None));
    let said = notices_about(&blocked.to_string_lossy());
    assert!(said.len() == 1 && said[0].contains("could not keep"), "{said:?}");
}

#[test]
fn keys_tell_arrays_apart_and_stay_the_same_for_one_array() {
    let dir = tempfile::tempdir().unwrap();
    let a = ProbeKey::of(&engine_in(&dir.path().join("a"), 2)).unwrap();
    let b = ProbeKey::of(&engine_in(&dir.path().join("b"), 2)).unwrap();
    let a3 = {
        std::fs::remove_dir_all(dir.path().join("a")).unwrap();
        ProbeKey::of(&engine_in(&dir.path().join("a"), 3)).unwrap()
    };
    let again = {
        std::fs::remove_dir_all(dir.path().join("a")).unwrap();
        ProbeKey::of(&engine_in(&dir.path().join("a"), 2)).unwrap()
    };
    assert_eq!(a.devices, 2);
    assert_eq!(a.array.len(), 2);
    assert!(Path::new(&a.array[0]).is_absolute(), "{a:?}");
    assert_ne!(a.file_name(), b.file_name());
    assert_ne!(a.file_name(), a3.file_name(), "another device count");
    assert_eq!(a, again);
    assert_eq!(a.file_name(), again.file_name());
    assert_eq!((a.hostname.as_str() != "", a.gpu.as_deref()), (true, None));
    // Simulated disks are no machine's: not keyed, never cached.
    let sim = Engine::open(EngineConfig::with_sim_disks(vec![crate::backend::sim::SimDisk::new(
        64 << 20,
        4096,
        1,
    )]))
    .unwrap();
    assert!(ProbeKey::of(&sim).is_none());
    let m = measure_cached_in(&sim, &ProbeOptions::quick(0), CacheMode::Use, Some(dir.path()));
    assert!(m.cache_path.is_none() && m.report.notes.iter().any(|n| n.contains("simulated")));
}

#[test]
fn the_cache_folder_follows_the_environment() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v))
    };
    use std::ffi::OsString;
    let all = env(&[("TERAIO_CACHE_DIR", "/c"), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]);
    assert_eq!(cache::cache_dir_from(all), Some("/c".into()));
    let xdg = env(&[("TERAIO_CACHE_DIR", ""), ("XDG_CACHE_HOME", "/x"), ("HOME", "/h")]);
    assert_eq!(cache::cache_dir_from(xdg), Some("/x/teraio".into()));
    let relative = env(&[("XDG_CACHE_HOME", "x"), ("HOME", "/h")]);
    assert_eq!(cache::cache_dir_from(relative), Some("/h/.cache/teraio".into()));
    assert_eq!(cache::cache_dir_from(env(&[])), None);
}

#[test]
fn dates_read_as_utc() {
    assert_eq!(utc(0), "1970-01-01 00:00 UTC");
    assert_eq!(utc(951_782_400 + 3_600 + 120), "2000-02-29 01:02 UTC");
    assert_eq!(utc(1_798_761_600), "2027-01-01 00:00 UTC");
}
