//! The first hour of a new user (issue 33): bad input on the command line is refused with a
//! message naming the option or file, the value and what to change, once, and a refused command
//! creates nothing on disk.

use std::process::{Command, Output};

fn teraio(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_teraio")).args(args).output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_mistyped_device_is_refused_not_made_into_a_file() {
    for cmd in [
        &["bench", "--target", "/dev/nvme9n1", "--rw", "write", "--size", "4M"][..],
        &["run", "--device", "/dev/nvme9n1"][..],
    ] {
        let out = teraio(cmd);
        assert!(!out.status.success(), "{cmd:?}");
        let e = stderr(&out);
        assert!(e.contains("/dev/nvme9n1") && e.contains("no such device"), "{e}");
        assert!(e.contains("lsblk"), "what to do: {e}");
        assert!(!std::path::Path::new("/dev/nvme9n1").exists(), "nothing created in /dev");
    }
    // Even when asked to create it: never a file under /dev.
    let out = teraio(&["bench", "--target", "/dev/nvme9n1", "--create", "--size", "4M"]);
    let e = stderr(&out);
    assert!(!out.status.success() && e.contains("not a block device"), "{e}");
    assert!(!std::path::Path::new("/dev/nvme9n1").exists());
    // A missing file elsewhere: refused unless --create, then made with --size.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bench.dat");
    let fs = f.to_str().unwrap();
    let out = teraio(&["bench", "--target", fs, "--rw", "write", "--size", "4M"]);
    let e = stderr(&out);
    assert!(!out.status.success() && e.contains("--create") && e.contains(fs), "{e}");
    assert!(!f.exists());
    let out = teraio(&[
        "bench",
        "--target",
        fs,
        "--create",
        "--rw",
        "write",
        "--size",
        "4M",
        "--backend",
        "psync",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(std::fs::metadata(&f).unwrap().len(), 4 << 20);
}

#[test]
fn a_truncated_trace_is_named_once() {
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("full.json");
    let out = teraio(&["trace", "gen", "--model", "gpt2-small", "-o", full.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read(&full).unwrap();
    let cut = dir.path().join("cut.json");
    std::fs::write(&cut, &text[..text.len() / 2]).unwrap();
    let cut = cut.to_str().unwrap();
    for cmd in [&["analyze", cut][..], &["run", "--trace", cut, "--sim"][..]] {
        let out = teraio(cmd);
        assert!(!out.status.success());
        let e = stderr(&out);
        assert!(e.contains("cut.json") && e.contains("cut short"), "{cmd:?}: {e}");
        assert_eq!(e.matches("EOF while parsing").count(), 1, "printed once: {e}");
    }
}

#[test]
fn a_negative_count_names_the_option() {
    let out = teraio(&["run", "--iterations", "-1"]);
    let e = stderr(&out);
    assert!(!out.status.success());
    assert!(e.contains("--iterations") && e.contains("-1") && e.contains("zero or more"), "{e}");
    assert!(!e.contains("unexpected argument"), "{e}");
}

#[test]
fn files_that_do_not_fit_are_refused_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let out = teraio(&[
        "bench",
        "--dir",
        data.to_str().unwrap(),
        "--files",
        "4",
        "--size",
        "1048576T",
        "--rw",
        "write",
    ]);
    let e = stderr(&out);
    assert!(!out.status.success());
    assert!(e.contains("dev0") && e.contains("free") && e.contains("nothing was created"), "{e}");
    assert!(!data.exists(), "the folder it would have made is not left behind");
}

#[test]
fn the_config_help_points_to_a_document_that_exists() {
    let out = teraio(&["bench", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("docs/ENGINE.md"), "{help}");
    let doc = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/ENGINE.md");
    let text = std::fs::read_to_string(doc).expect("docs/ENGINE.md exists");
    // Every key of the configuration is documented.
    let cfg = teraio_engine::EngineConfig::default().to_toml();
    for line in cfg.lines() {
        let key = line.split(" = ").next().unwrap().trim();
        if let Some(section) = key.strip_prefix('[') {
            let section = section.trim_end_matches(']');
            assert!(text.contains(&format!("`[{section}]`")), "section [{section}] undocumented");
        } else if !key.is_empty() {
            assert!(text.contains(&format!("| `{key}` |")), "key {key} undocumented");
        }
    }
}
