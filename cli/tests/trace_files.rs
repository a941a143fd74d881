//! Trace and plan files the CLI refuses or accepts: a gzip file that expands beyond the limit on
//! a trace's text is refused, naming the file and the limit, without decompressing it all; a
//! byte order mark is skipped; every decoding error names the file; sums over huge tensors are
//! refused instead of printed wrapped.

use std::io::Write;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn teraio(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_teraio"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A gzip file of `bytes` spaces (a few hundred KiB compressed per GiB).
fn gzip_of_spaces(path: &std::path::Path, bytes: usize) {
    let f = std::fs::File::create(path).unwrap();
    let mut gz = flate2::write::GzEncoder::new(f, flate2::Compression::best());
    let chunk = vec![b' '; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len());
        gz.write_all(&chunk[..n]).unwrap();
        left -= n;
    }
    gz.finish().unwrap();
}

#[test]
fn a_gzip_trace_that_expands_beyond_the_limit_is_refused_naming_file_and_limit() {
    let dir = tempfile::tempdir().unwrap();
    let bomb = dir.path().join("bomb.trace.json.gz");
    // 8 MiB expanded against a 4 MiB limit (the default, 256 MiB, works the same way).
    gzip_of_spaces(&bomb, 8 << 20);
    let start = Instant::now();
    let out =
        teraio(&["analyze", bomb.to_str().unwrap()], &[("TERAIO_TRACE_BYTES_MAX", "4194304")]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("bomb.trace.json.gz") && e.contains("4194304"), "{e}");
    assert!(e.contains("TERAIO_TRACE_BYTES_MAX"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(20));
    // A plain file over the limit too.
    let big = dir.path().join("big.json");
    std::fs::write(&big, vec![b' '; 5 << 20]).unwrap();
    let out = teraio(&["analyze", big.to_str().unwrap()], &[("TERAIO_TRACE_BYTES_MAX", "4194304")]);
    let e = stderr(&out);
    assert!(!out.status.success() && e.contains("big.json") && e.contains("4194304"), "{e}");
    // A limit that is no number is named.
    let out = teraio(&["analyze", big.to_str().unwrap()], &[("TERAIO_TRACE_BYTES_MAX", "lots")]);
    let e = stderr(&out);
    assert!(
        !out.status.success() && e.contains("TERAIO_TRACE_BYTES_MAX") && e.contains("lots"),
        "{e}"
    );
}

#[test]
fn a_byte_order_mark_is_skipped_and_decoding_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    let out = teraio(
        &["trace", "gen", "--model", "gpt2-small", "--layers", "1", "-o", trace.to_str().unwrap()],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&trace).unwrap();
    let bom = dir.path().join("bom.json");
    std::fs::write(&bom, format!("\u{feff}{text}")).unwrap();
    let out = teraio(&["analyze", bom.to_str().unwrap(), "--json"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    // Not JSON at all: the file is named.
    let junk = dir.path().join("junk.json");
    std::fs::write(&junk, "\u{feff}nope").unwrap();
    let out = teraio(&["analyze", junk.to_str().unwrap()], &[]);
    let e = stderr(&out);
    assert!(!out.status.success() && e.contains("junk.json") && e.contains("line 1"), "{e}");
    // A plan file likewise.
    let out = teraio(&["simulate", trace.to_str().unwrap(), "--plan", junk.to_str().unwrap()], &[]);
    let e = stderr(&out);
    assert!(!out.status.success() && e.contains("junk.json"), "{e}");
}

#[test]
fn analyze_refuses_tensor_sizes_whose_sums_would_wrap() {
    let dir = tempfile::tempdir().unwrap();
    let tensors: Vec<String> = (0..4)
        .map(|i| {
            format!(
                "{{\"id\": {i}, \"name\": \"huge{i}\", \"bytes\": 4611686018427387904, \
                 \"kind\": \"weight\", \"global\": true, \"created_by\": null, \"accesses\": [0], \
                 \"dies_after\": null}}"
            )
        })
        .collect();
    let json = format!(
        "{{\"format\": \"teraio-trace\", \"version\": 1, \"name\": \"huge\", \"kernels\": \
         [{{\"name\": \"k0\", \"duration_us\": 10}}, {{\"name\": \"k1\", \"duration_us\": 10}}], \
         \"tensors\": [{}]}}",
        tensors.join(",")
    );
    let p = dir.path().join("huge.json");
    std::fs::write(&p, json).unwrap();
    let out = teraio(&["analyze", p.to_str().unwrap()], &[]);
    let e = stderr(&out);
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        e.contains("huge.json") && e.contains("tensors[1].bytes") && e.contains("huge1"),
        "{e}"
    );
}

#[test]
fn kernel_durations_near_f64_max_are_refused_naming_the_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let json = "{\"format\": \"teraio-trace\", \"version\": 1, \"name\": \"slow\", \"kernels\": \
         [{\"name\": \"k0\", \"duration_us\": 10}, {\"name\": \"the.slow.one\", \"duration_us\": 1e308}], \
         \"tensors\": [{\"id\": 0, \"name\": \"w\", \"bytes\": 4096, \"kind\": \"weight\", \
         \"global\": true, \"created_by\": null, \"accesses\": [0, 1], \"dies_after\": null}]}";
    let p = dir.path().join("slow.json");
    std::fs::write(&p, json).unwrap();
    let out = teraio(&["simulate", p.to_str().unwrap(), "--policy", "teraio"], &[]);
    let e = stderr(&out);
    assert!(!out.status.success());
    assert!(e.contains("slow.json") && e.contains("kernels[1].duration_us"), "{e}");
    assert!(e.contains("the.slow.one") && !e.contains("waiting for  with"), "{e}");
}
