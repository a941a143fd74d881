//! End-to-end tests of `teraio simulate` comparisons across an activation-checkpointed trace,
//! and of `teraio advise --what checkpointing`.

use std::process::{Command, Output};

fn teraio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_teraio")).args(args).output().unwrap()
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "teraio failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn secs(r: &serde_json::Value) -> f64 {
    assert_eq!(r["outcome"]["outcome"], "completed", "{r}");
    r["iteration_time_us"].as_f64().unwrap() / 1e6
}

#[test]
fn baselines_run_on_the_checkpointed_trace_against_the_main_ideal() {
    let out = teraio(&[
        "simulate",
        "preset:gpt2-small",
        "--checkpointed-trace",
        "preset:gpt2-small,activation-checkpointing",
        "--policy",
        "teraio,teraio+checkpointing,zero-infinity,zero-infinity-pipelined,ideal",
        "--json",
    ]);
    let v = json_of(&out);
    let rows = v.as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["teraio", "teraio*", "zero-infinity*", "zero-infinity-pipelined*", "ideal"]);
    let ideal = secs(&rows[4]);
    for r in &rows[1..4] {
        // Recomputation costs time: slower than the main trace's ideal, and `% ideal` is
        // against that ideal, not the checkpointed trace's own.
        let t = secs(r);
        assert!(t > ideal * 1.1, "{} {t} vs ideal {ideal}", r["policy"]);
        let pct = r["percent_of_ideal"].as_f64().unwrap();
        assert!((pct - 100.0 * ideal / t).abs() < 1e-6, "{pct}");
    }
    // DeepSpeed's default CPU step (read, compute, write in turn) is slower than the
    // pipelined one, and nothing else differs between the two plans.
    let (seq, pipe) = (&rows[2], &rows[3]);
    assert!(secs(seq) > secs(pipe));
    let (hs, hp) = (seq["host_step_us"].as_f64().unwrap(), pipe["host_step_us"].as_f64().unwrap());
    assert!((secs(seq) - secs(pipe) - (hs - hp) / 1e6).abs() < 1e-3, "{hs} {hp}");
}

#[test]
fn checkpointed_comparisons_refuse_mismatched_or_missing_traces() {
    let out = teraio(&["simulate", "preset:gpt2-small", "--policy", "teraio+checkpointing"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs --checkpointed-trace"), "{err}");
    let out = teraio(&[
        "simulate",
        "preset:gpt2-small",
        "--checkpointed-trace",
        "preset:gpt2-medium,activation-checkpointing",
        "--policy",
        "zero-infinity",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("gpt2-medium") && err.contains("gpt2-small"), "{err}");
}

#[test]
fn trace_gen_knows_tf32_and_names_the_dtypes_it_knows() {
    let fp32 = json_of(&teraio(&["trace", "gen", "--model", "gpt2-small"]));
    let tf32 = json_of(&teraio(&["trace", "gen", "--model", "gpt2-small", "--dtype", "tf32"]));
    let total = |t: &serde_json::Value| -> f64 {
        t["kernels"].as_array().unwrap().iter().map(|k| k["duration_us"].as_f64().unwrap()).sum()
    };
    assert!(total(&tf32) < total(&fp32));
    assert_eq!(tf32["tensors"], fp32["tensors"]);
    let out = teraio(&["trace", "gen", "--model", "gpt2-small", "--dtype", "fp16"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("fp32") && err.contains("tf32") && err.contains("bf16"), "{err}");
}

#[test]
fn advise_checkpointing_reports_every_probe_and_needs_a_model() {
    let out = teraio(&[
        "advise",
        "preset:gpt2-small,dtype=tf32",
        "--what",
        "checkpointing",
        "--gpu-mem-gb",
        "6",
        "--ssds",
        "1",
        "--host-gb",
        "0",
        "--json",
    ]);
    let v = json_of(&out);
    assert_eq!(v["layers"], 12);
    let probes = v["probes"].as_array().unwrap();
    let (layers, selective) = (&v["best"][0], &v["best"][1]);
    let best_us = v["report"]["iteration_time_us"].as_f64().unwrap();
    assert!(probes.iter().any(|p| {
        &p["layers"] == layers && &p["selective"] == selective && p["iteration_us"] == best_us
    }));
    for p in probes {
        if let Some(us) = p["iteration_us"].as_f64() {
            assert!(best_us <= us);
        }
    }
    let out = teraio(&["advise", "/nonexistent.json", "--what", "checkpointing"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs `preset:NAME"), "{err}");
    let out = teraio(&["advise", "preset:gpt2-small", "--what", "layers"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ssds, host or checkpointing"), "{err}");
}

#[test]
fn zero_infinity_without_checkpointing_gets_a_note() {
    let text = |args: &[&str]| {
        let out = teraio(args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let plain = text(&["simulate", "preset:gpt2-small", "--policy", "teraio,zero-infinity"]);
    assert!(plain.contains("note: zero-infinity was planned on a trace without"), "{plain}");
    let fair = text(&[
        "simulate",
        "preset:gpt2-small",
        "--policy",
        "teraio,zero-infinity",
        "--checkpointed-trace",
        "preset:gpt2-small,activation-checkpointing",
    ]);
    assert!(!fair.contains("note:") && fair.contains("zero-infinity*"), "{fair}");
    let teraio_only = text(&["simulate", "preset:gpt2-small", "--policy", "teraio"]);
    assert!(!teraio_only.contains("note:"));
    // Optimizer steps moved into the forward or backward pass: not how DeepSpeed runs.
    for moved in ["optimizer-in-forward", "optimizer-in-backward"] {
        let out = text(&[
            "simulate",
            &format!("preset:gpt2-small,{moved}"),
            "--policy",
            "teraio,zero-infinity",
            "--checkpointed-trace",
            &format!("preset:gpt2-small,activation-checkpointing,{moved}"),
        ]);
        assert!(out.contains("DeepSpeed steps after the backward pass"), "{moved}: {out}");
    }
    let split = text(&[
        "simulate",
        "preset:gpt2-small,optimizer-in-forward",
        "--policy",
        "teraio,zero-infinity",
        "--checkpointed-trace",
        "preset:gpt2-small,activation-checkpointing",
    ]);
    assert!(!split.contains("note:"), "teraio's trace may move its steps: {split}");
}

#[test]
fn stalls_lists_where_each_policy_waits_longest() {
    let args = ["simulate", "preset:gpt2-replay", "--hw", "dev", "--policy", "teraio,lru"];
    let out = teraio(&[&args[..], &["--stalls", "3"]].concat());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("where lru waits: 3 kernels"), "{text}");
    assert!(text.contains("where teraio waits:"), "{text}");
    let v = json_of(&teraio(&[&args[..], &["--stalls", "3", "--json"]].concat()));
    for r in v.as_array().unwrap() {
        let list = r["stalls"].as_array().unwrap();
        assert!(list.len() <= 3, "{r}");
        assert!(r["timeline"].is_null(), "the timeline stays out of the JSON");
        let waits: Vec<f64> = list.iter().map(|s| s["stall_us"].as_f64().unwrap()).collect();
        assert!(waits.windows(2).all(|w| w[0] >= w[1]), "{waits:?}");
        assert!(waits.iter().sum::<f64>() <= r["stall_us"].as_f64().unwrap() + 1e-6);
        assert!(list.iter().all(|s| s["name"].as_str().is_some_and(|n| !n.is_empty())));
    }
    let lru = &v.as_array().unwrap()[1];
    assert_eq!(lru["stalls"].as_array().unwrap().len(), 3, "lru waits here: {lru}");
}

#[test]
fn gzip_compressed_traces_load_like_plain_ones_and_other_bytes_are_named() {
    let gz = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/torch-eval/traces/gpt-12l-1024h-b16x1024-bf16.trace.json.gz"
    );
    let dir = tempfile::tempdir().unwrap();
    // The same trace decompressed by hand.
    let mut text = String::new();
    std::io::Read::read_to_string(
        &mut flate2::read::GzDecoder::new(std::fs::File::open(gz).unwrap()),
        &mut text,
    )
    .unwrap();
    let plain = dir.path().join("t.json");
    std::fs::write(&plain, &text).unwrap();
    let a = json_of(&teraio(&["analyze", gz, "--json"]));
    let b = json_of(&teraio(&["analyze", plain.to_str().unwrap(), "--json"]));
    assert_eq!(a, b);
    assert_eq!(a["kernels"], 1519, "{a}");
    // Bytes that are neither: a clear error naming the file, no panic.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, [0xff, 0xfe, 0x00, 0x01]).unwrap();
    let out = teraio(&["analyze", junk.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("junk.json") && err.contains("neither JSON text nor gzip"), "{err}");
    // A gzip stream cut short.
    let cut = dir.path().join("cut.json.gz");
    std::fs::write(&cut, &std::fs::read(gz).unwrap()[..1000]).unwrap();
    let out = teraio(&["analyze", cut.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a whole gzip stream"));
}

/// `--optimizer-on auto`: a fast CPU behind the model takes updates to the host, a slow one
/// none; the choice is never slower than all-GPU and all-host; bad combinations are refused.
#[test]
fn the_optimizers_placement_is_shown_and_explained() {
    let base = [
        "simulate",
        "preset:gpt2-small,dtype=bf16,micro-batch=1,layers=2",
        "--gpu-mem-gb",
        "0.8",
        "--policy",
        "teraio",
        "--optimizer-on",
        "auto",
        "--json",
    ];
    let run = |cpu: &str| {
        let mut a = base.to_vec();
        a.extend(["--cpu-adam", cpu]);
        json_of(&teraio(&a))
    };
    let fast = run("1e13");
    let slow = run("1e3");
    for p in [&fast, &slow] {
        let best = p["iteration_us"].as_f64().unwrap();
        assert!(best <= p["all_gpu_us"].as_f64().unwrap(), "{p}");
        assert!(best <= p["all_host_us"].as_f64().unwrap(), "{p}");
        assert!(p["candidates"].as_array().unwrap().len() >= 2);
    }
    assert!(!fast["host_weights"].as_array().unwrap().is_empty(), "{fast}");
    assert!(slow["host_weights"].as_array().unwrap().is_empty(), "{slow}");
    let text = teraio(&base[..base.len() - 1]);
    assert!(text.status.success(), "{}", String::from_utf8_lossy(&text.stderr));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.starts_with("optimizer: ") && text.contains("all-GPU"), "{text}");
    let mut bad = base.to_vec();
    bad[5] = "teraio,lru";
    let out = teraio(&bad);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("one --policy"));
    // updates run during backward: all-host can only be as fast or faster than at the step
    let mut early = base.to_vec();
    early.extend(["--cpu-adam", "1e8", "--updates-in-backward"]);
    let early = json_of(&teraio(&early));
    let at_step = run("1e8");
    let host = |p: &serde_json::Value| p["all_host_us"].as_f64().unwrap();
    assert!(host(&early) < host(&at_step), "{} vs {}", host(&early), host(&at_step));
    let out = teraio(&["simulate", "preset:gpt2-small", "--updates-in-backward"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--optimizer-on auto"));
}

/// `--checkpoint-layers`: named layers checkpointed (their forward run again: a slower ideal,
/// less memory), `auto` says its choice first, and a bad value names the flag.
#[test]
fn checkpoint_layers_rewrite_the_trace_and_auto_says_its_choice() {
    let plain = json_of(&teraio(&["simulate", "preset:gpt2-small", "--policy", "ideal", "--json"]));
    let out = teraio(&[
        "simulate",
        "preset:gpt2-small",
        "--policy",
        "ideal",
        "--checkpoint-layers",
        "0-11",
        "--json",
    ]);
    let ckpt = json_of(&out);
    // (one policy: one report object)
    let (p, c) = (&plain, &ckpt);
    assert!(secs(c) > secs(p) * 1.1, "{} vs {}", secs(c), secs(p));
    let peak = |r: &serde_json::Value| r["peak_gpu_bytes"].as_u64().unwrap();
    assert!(peak(c) < peak(p), "{} vs {}", peak(c), peak(p));
    let out = teraio(&["simulate", "preset:gpt2-small", "--checkpoint-layers", "auto"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--checkpoint-layers auto: no checkpointing"), "{err}");
    for (bad, says) in [
        ("3-x", "\"3-x\" is not a layer"),
        ("40", "layer 40 is not in the trace (its layers: 0-11)"),
        // (named, not expanded into four billion layers)
        ("0-4000000000", "layer 4000000000 is not in the trace"),
    ] {
        let out = teraio(&["simulate", "preset:gpt2-small", "--checkpoint-layers", bad]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("--checkpoint-layers {bad}")) && err.contains(says), "{err}");
    }
}
