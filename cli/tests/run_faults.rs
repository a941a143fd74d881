//! `teraio run --sim --fault ...`: faults injected into simulated disks while the main job
//! replays, seen through the CLI's output and exit status.

use std::process::Command;
use std::sync::Mutex;

/// One replay at a time: the slow-device test compares an iteration's bandwidth with the first
/// one's, and a replay of another test beside the first iteration (2 cores in CI) made that
/// baseline a third of what the disks give, so the slow iteration no longer looked slow.
static ONE_REPLAY_AT_A_TIME: Mutex<()> = Mutex::new(());

fn teraio() -> Command {
    Command::new(env!("CARGO_BIN_EXE_teraio"))
}

/// A small iteration (2 layers, 1 s) on 4 simulated disks.
fn small_run(extra: &[&str]) -> (std::process::Output, serde_json::Value) {
    let one = ONE_REPLAY_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let out = teraio()
        .args(["run", "--json", "--sim", "--model", "gpt2-replay,layers=2,iteration-s=1"])
        .args(["--file-size", "512M", "--probe-size", "32M"])
        .args(extra)
        .output()
        .unwrap();
    drop(one);
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out, v)
}

#[test]
fn a_corrupt_copy_stops_its_iteration_names_the_tensor_and_the_next_one_runs() {
    let (out, v) = small_run(&["--iterations", "3", "--fault", "corrupt@0:20"]);
    let notes = v["notes"].as_array().unwrap();
    assert!(
        notes.iter().any(|n| n.as_str().unwrap().contains("corrupted the SSD copy")),
        "{notes:?}"
    );
    let its = v["replay"]["iterations"].as_array().unwrap();
    assert_eq!(its.len(), 3);
    let why = its[0]["stopped"].as_str().expect("iteration 0 stopped");
    let lost = &its[0]["lost"];
    for part in [
        format!("t{}", lost["tensor"]),
        format!("kernel {}", lost["kernel"]),
        "device ".to_string(),
        "checksum mismatch".to_string(),
    ] {
        assert!(why.contains(&part), "`{part}` not in {why}");
    }
    assert!(its[1]["stopped"].is_null() && its[2]["stopped"].is_null(), "the next iterations ran");
    assert_eq!(v["replay"]["stopped_iterations"], 1);
    // Exit status 1, and a one-line error saying so.
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("1 of 3 iterations stopped"), "{err}");
}

#[test]
fn a_slow_device_makes_the_next_iteration_run_a_new_plan() {
    let (out, v) =
        small_run(&["--iterations", "3", "--sim-bandwidth", "256M", "--fault", "slow:1:10@1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let replans = v["replay"]["replans"].as_array().unwrap();
    let after = replans.iter().find(|r| r["after_iteration"] == 1).unwrap_or_else(|| {
        panic!("no re-plan after the first slow iteration: {replans:?}; {}", v["replay"])
    });
    let (w, r) = (after["write_scale"].as_f64().unwrap(), after["read_scale"].as_f64().unwrap());
    assert!(w < 1.0 / 1.5 || r < 1.0 / 1.5, "planned for a slower array: {after}");
    assert_eq!(v["replay"]["iterations"][2]["replanned"], true);
}

#[test]
fn faults_need_simulated_disks_and_bad_specs_say_what_is_expected() {
    let out = teraio().args(["run", "--fault", "eio-read:0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--sim"));
    let out = teraio().args(["run", "--sim", "--fault", "melt:0"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown kind `melt`") && err.contains("expected"), "{err}");
    let out = teraio()
        .args(["run", "--sim", "--fault", "eio-write:9", "--file-size", "64M"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("device 9 does not exist"));
}
