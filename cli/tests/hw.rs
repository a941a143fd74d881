//! `teraio hw measure`: this machine's hardware model, measured through the engine and kept in
//! the cache that teraio.torch's Session reads; its file is what `teraio simulate --hw` reads.

use std::path::Path;
use std::process::{Command, Output};

fn teraio(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_teraio"))
        .args(args)
        .env("TERAIO_CACHE_DIR", cache)
        .output()
        .unwrap()
}

fn ok(out: &Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn measure_keeps_the_model_in_the_cache_and_simulate_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let data = dir.path().join("data");
    let array = ["--dir", data.to_str().unwrap(), "--files", "2", "--file-size", "64M"];
    let measure = |extra: &[&str]| {
        let args: Vec<&str> =
            ["hw", "measure"].iter().chain(&array).chain(extra).copied().collect();
        teraio(&cache, &args)
    };
    let m: serde_json::Value =
        serde_json::from_str(&ok(&measure(&["--probe-size", "8M", "--json"]))).unwrap();
    assert_eq!(m["source"], "measured", "{m}");
    assert_eq!(m["hardware"]["ssd_count"], 2);
    for k in ["write_bytes_per_s", "read_bytes_per_s", "both_bytes_per_s"] {
        assert!(m["report"]["array"][k].as_f64().is_some_and(|r| r > 0.0), "{k}: {m}");
    }
    assert!(m["report"]["host_copy"]["bytes_per_s"].as_f64().is_some_and(|r| r > 0.0));
    assert_eq!(m["report"]["gpu"]["kind"], "none");
    let path = m["cache_path"].as_str().expect("cached").to_string();
    assert!(Path::new(&path).starts_with(&cache), "{path}");
    assert!(m["summary"].as_str().unwrap().contains("measured now"), "{m}");

    // --cached: what a Session on this array uses, read back without measuring.
    let c: serde_json::Value =
        serde_json::from_str(&ok(&measure(&["--cached", "--json"]))).unwrap();
    assert_eq!(c["source"], "cache");
    assert_eq!(c["hardware"], m["hardware"]);

    // -o: the model alone, as `teraio simulate --hw` and `teraio plan --hw` read it; the cache
    // file itself reads the same way.
    let hw = dir.path().join("hw.json");
    let text = ok(&measure(&["--probe-size", "0", "--no-cache", "-o", hw.to_str().unwrap()]));
    assert!(text.contains("array        not measured") && text.contains("not cached"), "{text}");
    assert!(text.contains("from the `dev` preset: ") && text.contains("ssd_read_bytes_per_s"));
    for file in [hw.to_str().unwrap(), &path] {
        let out = teraio(
            &cache,
            &[
                "simulate",
                "preset:gpt2-small",
                "--hw",
                file,
                "--gpu-mem-gb",
                "20",
                "--policy",
                "teraio",
            ],
        );
        ok(&out);
    }
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1, "--no-cache wrote nothing");
}

#[test]
fn a_damaged_cache_file_is_measured_again_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let data = dir.path().join("data");
    let args = [
        "hw",
        "measure",
        "--dir",
        data.to_str().unwrap(),
        "--files",
        "1",
        "--file-size",
        "32M",
        "--probe-size",
        "0",
        "--cached",
        "--json",
    ];
    let first: serde_json::Value = serde_json::from_str(&ok(&teraio(&cache, &args))).unwrap();
    let path = first["cache_path"].as_str().unwrap().to_string();
    std::fs::write(&path, "{\"ssd_count\": ").unwrap();
    let out = teraio(&cache, &args);
    let again: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(again["source"], "measured");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("warning: ignoring the hardware cache file") && err.contains(&path),
        "{err}"
    );
    assert!(err.contains("not JSON"), "{err}");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"teraio_probe\""), "rewritten: {text}");
}

#[test]
fn the_help_says_what_is_measured_and_where_it_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let help = ok(&teraio(dir.path(), &["hw", "measure", "--help"]));
    for want in [
        "TERAIO_CACHE_DIR",
        "~/.cache/teraio",
        "Session(hardware=None)",
        "--probe-size",
        "simulate --hw",
    ] {
        assert!(help.contains(want), "{want}: {help}");
    }
    let top = ok(&teraio(dir.path(), &["--help"]));
    assert!(top.contains("hw "), "{top}");
}
