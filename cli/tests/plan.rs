//! End-to-end tests of what the planner commands say about feasibility, tier space, the lower
//! bound and SSD wear: `teraio plan`, `simulate`, `analyze`, `advise --what array`, and the
//! array check of `teraio run` before it writes anything.

use std::process::{Command, Output};

fn teraio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_teraio")).args(args).output().unwrap()
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "teraio failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn stderr(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure: {}", String::from_utf8_lossy(&out.stdout));
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const SMALL: &str = "preset:gpt2-small,micro-batch=4";

#[test]
fn too_little_gpu_memory_is_refused_with_the_kernel_the_bytes_and_the_option() {
    let err = stderr(&teraio(&["plan", SMALL, "--gpu-mem-gb", "0.5"]));
    assert!(err.contains("GPU memory too small: kernel"), "{err}");
    assert!(err.contains("500000000") && err.contains("--gpu-mem-gb 1.6"), "{err}");
    // analyze says the same figure up front.
    let v = json_of(&teraio(&["analyze", SMALL, "--gpu-mem-gb", "0.5", "--json"]));
    assert!(v["min_gpu_bytes"].as_u64().unwrap() > 500_000_000);
    assert!(v["lower_bound"]["infeasible"].as_str().unwrap().contains("more than"));
    assert!(v["plan"]["refused"].as_str().unwrap().contains("GPU memory too small"));
}

#[test]
fn simulate_reports_the_bound_tier_space_and_refusals() {
    let v = json_of(&teraio(&[
        "simulate",
        SMALL,
        "--gpu-mem-gb",
        "3",
        "--policy",
        "auto,teraio,lru,none",
        "--ssd-tbw",
        "600",
        "--json",
    ]));
    let rows = v.as_array().unwrap();
    let by = |p: &str| rows.iter().find(|r| r["policy"].as_str().unwrap().starts_with(p)).unwrap();
    let (auto, teraio_row, lru) = (by("auto["), by("teraio"), by("lru"));
    let t = |r: &serde_json::Value| r["iteration_time_us"].as_f64().unwrap();
    let bound = auto["lower_bound_us"].as_f64().unwrap();
    for r in [auto, teraio_row, lru] {
        assert!(t(r) >= bound, "{}: {} below the bound {bound}", r["policy"], t(r));
        let gap = r["gap_to_bound_percent"].as_f64().unwrap();
        assert!((gap - 100.0 * (t(r) / bound - 1.0)).abs() < 1e-6);
        assert!(r["peak_ssd_bytes"].is_u64() && r["peak_host_bytes"].is_u64());
    }
    assert!(t(auto) <= t(teraio_row).min(t(lru)) * 1.01);
    // teraio writes to the SSDs: its drive life is projected from the given endurance.
    let written = teraio_row["bytes_moved"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["resource"] == "ssd_write")
        .unwrap()["bytes"]
        .as_f64()
        .unwrap();
    let days = teraio_row["drive_life_days"].as_f64().unwrap();
    let expect = 600e12 / (written / 4.0 / (t(teraio_row) * 1e-6)) / 86400.0;
    assert!((days / expect - 1.0).abs() < 1e-9, "{days} vs {expect}");
    // Moving nothing does not fit: refused, saying where.
    let none = by("none");
    assert!(none["refused"].as_str().unwrap().contains("runs out of GPU memory at kernel"));
    // The table says it too, with the bound above it.
    let out = teraio(&["simulate", SMALL, "--gpu-mem-gb", "3", "--policy", "auto,none"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("lower bound") && text.contains("gap %"), "{text}");
    assert!(text.contains("none") && text.contains("refused:"), "{text}");
}

#[test]
fn an_array_too_small_for_the_plan_is_refused_or_respected() {
    // One SSD with 0.3 GB and no host tier: the plan must keep its copies under it.
    let base = ["--gpu-mem-gb", "3", "--ssds", "1", "--host-gb", "0"];
    let size =
        json_of(&teraio(&[&["advise", SMALL, "--what", "array", "--json"][..], &base].concat()));
    let need = size["ssd_bytes"].as_u64().unwrap();
    assert!(need > 300_000_000, "the case needs more than 0.3 GB of SSD: {size}");
    assert_eq!(size["bytes_per_ssd"].as_u64().unwrap(), need);
    let out = teraio(&[&["plan", SMALL, "--ssd-gb", "0.3"][..], &base].concat());
    if out.status.success() {
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text.lines().find(|l| l.starts_with("tier space needed")).unwrap();
        let gb: f64 = line.split_whitespace().nth(3).unwrap().parse().unwrap();
        assert!(gb <= 0.3, "{line}");
    } else {
        let err = stderr(&out);
        assert!(err.contains("on the SSD array at its peak") && err.contains("--ssd-gb"), "{err}");
    }
    // The advisor sizes the array in drives of a given size.
    let v = json_of(&teraio(
        &[&["advise", SMALL, "--what", "array", "--ssd-gb", "0.1", "--json"][..], &base].concat(),
    ));
    assert_eq!(v["ssds_of_given_size"].as_u64().unwrap(), need.div_ceil(100_000_000));
}

#[test]
fn run_checks_the_array_before_it_writes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let err = stderr(&teraio(&["run", "--dir", d, "--file-size", "64M", "--probe-size", "64M"]));
    assert!(err.contains("the SSD array is too small for measuring it"), "{err}");
    assert!(err.contains("--file-size") && err.contains("--probe-size"), "{err}");
    assert!(!err.contains("no space for"), "{err}");
}

#[test]
fn without_recomputation_the_bound_does_not_recompute_either() {
    // A real trace whose forward results have producers (teraio.torch on an H200, fp32).
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/torch-eval/traces/gpt-12l-1024h-b16x1024-fp32-paged-h200.trace.json.gz"
    );
    let hw =
        concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/torch-eval/traces/h200-one-disk.hw.json");
    let run = |extra: &[&str]| {
        let mut args =
            vec!["simulate", trace, "--hw", hw, "--gpu-mem-gb", "4", "--host-gb", "25.77"];
        args.extend_from_slice(&["--policy", "auto,teraio-hybrid", "--json"]);
        args.extend_from_slice(extra);
        json_of(&teraio(&args))
    };
    let bound = |v: &serde_json::Value| v[0]["lower_bound_us"].as_f64().unwrap();
    let (with, without) = (run(&[]), run(&["--no-recompute"]));
    // The bound that may remake activations lies below what moving them alone can reach.
    assert!(bound(&without) > bound(&with) * 1.05, "{} vs {}", bound(&without), bound(&with));
    for r in without.as_array().unwrap() {
        let t = r["iteration_time_us"].as_f64().unwrap();
        assert!(t >= bound(&without), "{}: {t} below {}", r["policy"], bound(&without));
        assert_eq!(r["lower_bound_us"].as_f64().unwrap(), bound(&without));
    }
    // `analyze` takes the same bound for the same options.
    let analyzed = |extra: &[&str]| {
        let mut args =
            vec!["analyze", trace, "--hw", hw, "--gpu-mem-gb", "4", "--host-gb", "25.77"];
        args.push("--json");
        args.extend_from_slice(extra);
        json_of(&teraio(&args))["lower_bound"]["iteration_us"].as_f64().unwrap()
    };
    assert_eq!(analyzed(&[]), bound(&with));
    assert_eq!(analyzed(&["--no-recompute"]), bound(&without));
}
