//! End-to-end tests of the `teraio` binary: a small `teraio run` and `teraio inspect`.

use std::path::Path;
use std::process::Command;

use teraio_engine::array::{ArrayConfig, DeviceArray, Target};
use teraio_engine::pool::{BufferPool, PoolConfig};
use teraio_engine::store::{OffloadOptions, StoreConfig, TensorStore};
use teraio_engine::tier::TensorMem;

fn teraio() -> Command {
    Command::new(env!("CARGO_BIN_EXE_teraio"))
}

fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "teraio failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

#[test]
fn a_small_run_replays_verifies_and_agrees_on_memory() {
    let dir = tempfile::tempdir().unwrap();
    let out = teraio()
        // The trace's own kernel times: at a few percent of them the `teraio` planner can
        // still emit plans that run out of memory (a known scheduler bug, issue 5).
        .args(["run", "--json", "--time-scale", "1", "--iterations", "2"])
        .args(["--file-size", "640M", "--probe-size", "64M", "--backend", "psync"])
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let v = json_of(&out);
    let replay = &v["replay"];
    let capacity = v["gpu_capacity_bytes"].as_u64().unwrap();
    assert!(capacity < v["peak_resident_bytes"].as_u64().unwrap(), "the iteration does not fit");
    assert!(replay["peak_gpu_bytes"].as_u64().unwrap() <= capacity);
    let prefetches = replay["prefetches"].as_u64().unwrap();
    let kept = replay["kept_copies"].as_u64().unwrap();
    assert!(prefetches > 0, "the plan moves tensors");
    assert!(replay["verified_tensors"].as_u64().unwrap() >= prefetches - kept);
    assert!(replay["iteration_time_s"].as_f64().unwrap() > 0.0);
    assert!(replay["store"]["ssd_write"]["bytes"].as_u64().unwrap() > 0);
    assert_eq!(replay["store"]["ssd_write"]["errors"].as_u64().unwrap(), 0);
    assert_eq!(replay["store"]["ssd_read"]["errors"].as_u64().unwrap(), 0);
}

#[test]
fn a_run_with_gpu_memory_moves_every_tensor_through_the_gpu_path() {
    // The GPU is emulated in host memory (CI has none); the data path is the real pipeline.
    let dir = tempfile::tempdir().unwrap();
    let out = teraio()
        .args(["run", "--json", "--iterations", "2", "--gpu", "0", "--gpu-emulated"])
        .args(["--gpu-path", "bounce", "--file-size", "640M", "--probe-size", "64M"])
        .args(["--backend", "psync", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let v = json_of(&out);
    assert_eq!(v["gpu"]["path"], "bounce");
    let stats = &v["gpu"]["stats"];
    let replay = &v["replay"];
    assert!(stats["bounce_write"]["bytes"].as_u64().unwrap() > 0);
    assert!(stats["bounce_read"]["bytes"].as_u64().unwrap() > 0);
    let prefetches = replay["prefetches"].as_u64().unwrap();
    let kept = replay["kept_copies"].as_u64().unwrap();
    assert!(replay["verified_tensors"].as_u64().unwrap() >= prefetches - kept);
    let pcie = |k: &str| v["gpu"][k].as_f64().unwrap_or_else(|| panic!("{k}: {}", v["gpu"]));
    let (h2d, d2h) = (pcie("pcie_h2d_bytes_per_s"), pcie("pcie_d2h_bytes_per_s"));
    assert!(h2d > 0.0 && d2h > 0.0);
    // The emulated device copies one at a time: both ways at once move no more than one way
    // alone, so the model gets a both-ways limit below the sum.
    let both = pcie("pcie_duplex_bytes_per_s");
    assert!(both > 0.0 && both < h2d + d2h, "{both} vs {h2d} + {d2h}");
}

#[test]
fn run_explains_a_capacity_too_small_for_the_resident_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let out = teraio()
        .args(["run", "--gpu-memory", "1M", "--file-size", "256M", "--probe-size", "32M"])
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("error:"), "{err}");
}

fn make_persistent_array(files: &[std::path::PathBuf]) {
    let mut cfg = ArrayConfig::new(files.iter().cloned().map(Target::Path).collect());
    cfg.file_size_bytes = 128 << 20;
    let array = DeviceArray::open(cfg).unwrap();
    let mut scfg = StoreConfig::new(array);
    scfg.persistent = true;
    let store = TensorStore::open(scfg).unwrap();
    let pool =
        BufferPool::new(PoolConfig { capacity_bytes: 64 << 20, prefer_huge_pages: false }).unwrap();
    for (id, (name, len)) in
        [("embedding", 3 << 20), ("L0.wqkv", 5_000_000), ("adam.m", 123)].into_iter().enumerate()
    {
        let mut b = pool.alloc(len).unwrap();
        b.fill(id as u8);
        let opts = OffloadOptions { name: Some(name.to_string()), ..Default::default() };
        store.offload_sync(id as u64, TensorMem::Host(b), opts).unwrap();
    }
}

fn corrupt(path: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(b"garbage!", offset).unwrap();
}

#[test]
fn inspect_lists_tensors_and_space_and_names_damage() {
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<_> = (0..2).map(|i| dir.path().join(format!("dev{i}"))).collect();
    make_persistent_array(&files);

    let v = json_of(&teraio().arg("inspect").arg("--json").args(&files).output().unwrap());
    let names: Vec<_> = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["embedding", "L0.wqkv", "adam.m"]);
    assert_eq!(v["tensors"][1]["size_bytes"].as_u64().unwrap(), 5_000_000);
    assert_eq!(v["devices"].as_array().unwrap().len(), 2);
    let used: u64 =
        v["devices"].as_array().unwrap().iter().map(|d| d["used_bytes"].as_u64().unwrap()).sum();
    assert!(used >= (3 << 20) + 5_000_000);

    // One damaged superblock copy: still readable, with a warning naming it.
    corrupt(&files[1], 100);
    let out = teraio().arg("inspect").args(&files).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("superblock copy 0 is damaged"), "{text}");
    assert!(text.contains("3 tensors"), "{text}");

    // Both copies damaged: a clear error, not a panic.
    corrupt(&files[1], (64 << 10) + 100);
    let out = teraio().arg("inspect").args(&files).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("device 1") && err.contains("superblock"), "{err}");
}

#[test]
fn inspect_of_files_without_an_array_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("empty");
    std::fs::write(&f, vec![0u8; 1 << 20]).unwrap();
    let out = teraio().arg("inspect").arg(&f).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no teraio array"));
}

#[test]
fn bench_json_reports_throughput_and_cpu_per_io_like_fio() {
    let dir = tempfile::tempdir().unwrap();
    let out = teraio()
        .args(["bench", "--json", "--files", "2", "--size", "8M", "--bs", "64k", "--iodepth", "4"])
        .args(["--rw", "write", "--backend", "psync"])
        .arg("--dir")
        .arg(dir.path())
        .output()
        .unwrap();
    let v = json_of(&out);
    let job = &v["jobs"][0];
    assert_eq!(job["write"]["io_bytes"].as_u64().unwrap(), 16 << 20, "{job}");
    assert_eq!(job["write"]["total_ios"].as_u64().unwrap(), 256);
    // fio's fields: percent of one CPU over the run; and the CPU time per I/O.
    let (usr, sys) = (job["usr_cpu"].as_f64().unwrap(), job["sys_cpu"].as_f64().unwrap());
    assert!((0.0..=100.0 * 64.0).contains(&usr) && (0.0..=100.0 * 64.0).contains(&sys), "{job}");
    let per_io = job["cpu_us_per_io"].as_f64().unwrap();
    let runtime_us = job["job_runtime"].as_f64().unwrap() * 1e3;
    assert!(
        per_io >= 0.0 && per_io * 256.0 <= (usr + sys) / 100.0 * runtime_us + 20_000.0,
        "{job}"
    );
}
