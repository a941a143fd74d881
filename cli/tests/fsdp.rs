//! End-to-end tests of FSDP2 traces: `teraio trace gen --fsdp-ranks`, `preset:...,fsdp-ranks=N`
//! and the N-rank sweep `teraio simulate --fsdp-ranks 1,2,...`.

use std::process::{Command, Output};

fn teraio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_teraio")).args(args).output().unwrap()
}

fn json_of(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "teraio failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("JSON on stdout")
}

fn fails_with(args: &[&str], needle: &str) {
    let out = teraio(args);
    assert!(!out.status.success(), "{args:?} succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(needle), "{args:?}: {err}");
}

const SMALL: &str = "preset:gpt2-small,layers=2,micro-batch=2";

#[test]
fn trace_gen_makes_one_ranks_trace_with_the_gathered_parameters() {
    let make = |extra: &[&str]| {
        let mut args = vec!["trace", "gen", "--layers", "2"];
        args.extend(extra);
        json_of(&teraio(&args))
    };
    let plain = make(&[]);
    let sharded = make(&["--fsdp-ranks", "4", "--link-gbps", "100"]);
    let bytes = |t: &serde_json::Value, name: &str| {
        t["tensors"].as_array().unwrap().iter().find(|x| x["name"] == name).unwrap()["bytes"]
            .as_u64()
            .unwrap()
    };
    // A quarter of the weight on this rank, and the whole of it gathered for a layer's forward.
    let w = bytes(&plain, "L1.wqkv.w");
    assert_eq!(bytes(&sharded, "L1.wqkv.w"), w.div_ceil(16) * 4);
    assert_eq!(bytes(&sharded, "mb0.L1.wqkv.w.unsharded.fwd"), w);
    let kernels: Vec<&str> = sharded["kernels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["name"].as_str().unwrap())
        .collect();
    assert!(
        kernels.contains(&"mb0.L1.all_gather.bwd") && kernels.contains(&"mb0.L1.reduce_scatter")
    );
    // Bad values name the option and the value.
    fails_with(&["trace", "gen", "--fsdp-ranks", "0"], "fsdp-ranks 0: at least 1 rank");
    fails_with(&["trace", "gen", "--fsdp-ranks", "2", "--link-gbps", "0"], "link-gbps 0");
    fails_with(
        &["trace", "gen", "--fsdp-ranks", "2", "--pp", "2"],
        "fsdp-ranks 2 with tp 1 and pp 2",
    );
    fails_with(
        &["trace", "gen", "--fsdp-ranks", "-2"],
        "--fsdp-ranks <N> must be zero or more (a whole number), got -2",
    );
    fails_with(&["trace", "gen", "--fsdp-no-overlap"], "--fsdp-ranks");
}

#[test]
fn the_sweep_prints_one_row_per_rank_count_in_text_and_json() {
    let v = json_of(&teraio(&[
        "simulate",
        SMALL,
        "--fsdp-ranks",
        "1,2",
        "--gpu-mem-gb",
        "3",
        "--json",
    ]));
    let rows = v["ranks"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(v["hardware_per_rank"]["gpu_memory_bytes"], 3_000_000_000u64);
    let methods: Vec<&str> = rows[0]["methods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        methods,
        [
            "ideal",
            "teraio",
            "teraio, optimizer placed",
            "teraio, collectives waited for",
            "CPU offload"
        ]
    );
    let shards = |r: &serde_json::Value| r["shard_bytes"].as_f64().unwrap();
    assert!((shards(&rows[0]) / shards(&rows[1]) - 2.0).abs() < 1e-3);
    let out = teraio(&["simulate", SMALL, "--fsdp-ranks", "1,2", "--gpu-mem-gb", "3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("simulator figures, not measurements"), "{text}");
    assert!(text.contains("whole job: tokens/s"), "{text}");
    // The one-rank trace of a preset runs through the ordinary simulate too.
    let r = json_of(&teraio(&["simulate", &format!("{SMALL},fsdp-ranks=2"), "--json"]));
    assert_eq!(r["outcome"]["outcome"], "completed");
}

#[test]
fn the_sweep_refuses_bad_rank_lists_and_inputs_naming_them() {
    fails_with(&["simulate", SMALL, "--fsdp-ranks", "1,x"], "\"x\" is not a whole number of ranks");
    fails_with(&["simulate", SMALL, "--fsdp-ranks", "2,0"], "--fsdp-ranks 2,0: fsdp-ranks 0");
    fails_with(&["simulate", "trace.json", "--fsdp-ranks", "2"], "needs a model to shard");
    fails_with(
        &["simulate", &format!("{SMALL},fsdp-ranks=2"), "--fsdp-ranks", "4"],
        "already has fsdp-ranks 2",
    );
    fails_with(&["simulate", SMALL, "--fsdp-ranks", "2", "--policy", "auto,lru"], "one --policy");
    fails_with(
        &["simulate", SMALL, "--fsdp-ranks", "2", "--optimizer-on", "auto"],
        "--optimizer-on",
    );
}
