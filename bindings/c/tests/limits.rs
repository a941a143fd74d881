//! Arguments at the edges of their types and calls out of order, through the C ABI: each is an
//! error status that names the argument, never a panic (`TERAIO_ERR_INTERNAL`), a hang, or a
//! message printed by the library.

use std::ffi::CString;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use teraio::*;

mod common;
use common::{cs, last_error, take_string};

fn open(dir: &std::path::Path) -> *mut teraio_engine {
    let toml = cs(&format!(
        "dir = {:?}\nfiles = 2\nfile_size = \"64M\"\nworkers = 2\nhost_buffers = \"64M\"\n",
        dir.display().to_string()
    ));
    let mut e = null_mut();
    // SAFETY: valid string and out-pointer.
    let s = unsafe { teraio_engine_open_toml(toml.as_ptr(), &mut e) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    e
}

/// `s` is `want`, and the last error mentions every one of `needles`.
#[track_caller]
fn expect(s: teraio_status, want: teraio_status, needles: &[&str]) {
    let m = last_error();
    assert_eq!(s, want, "{m}");
    for n in needles {
        assert!(m.contains(n), "{n:?} not in {m:?}");
    }
}

#[test]
fn lengths_up_to_size_max_are_errors_that_name_the_length() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path());
    let data = [7u8; 64];
    let mut op = null_mut();
    for len in [usize::MAX, usize::MAX - 4095, isize::MAX as usize + 1] {
        // SAFETY: the length is refused before `data` is read.
        let s = unsafe {
            teraio_offload(e, 1, data.as_ptr().cast(), len, std::ptr::null(), 0, 1, &mut op)
        };
        expect(s, TERAIO_ERR_INVALID_ARGUMENT, &["`len`", &len.to_string()]);
        let mut out = [0u8; 64];
        // SAFETY: refused before anything is written.
        let s = unsafe { teraio_prefetch(e, 1, out.as_mut_ptr().cast(), len, 1, &mut op) };
        expect(s, TERAIO_ERR_INVALID_ARGUMENT, &["`len`", &len.to_string()]);
    }
    // Within isize but beyond the engine's host buffers: no space, naming the bytes.
    let mut out = [0u8; 64];
    let len = isize::MAX as usize;
    // SAFETY: refused before anything is written.
    let s = unsafe { teraio_prefetch(e, 1, out.as_mut_ptr().cast(), len, 1, &mut op) };
    expect(s, TERAIO_ERR_NO_SPACE, &[&len.to_string(), "host_buffers"]);
    let mut buf = null_mut();
    // SAFETY: valid out-pointer.
    let s = unsafe { teraio_buffer_alloc(usize::MAX, &mut buf) };
    assert!(s == TERAIO_ERR_NO_SPACE || s == TERAIO_ERR_INVALID_ARGUMENT, "{s}: {}", last_error());
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

/// A trace of `n` kernels, one activation per kernel living from it to the next.
fn small_trace(n: usize) -> *mut teraio_trace {
    let kernels: Vec<String> =
        (0..n).map(|i| format!("{{\"name\": \"k{i}\", \"duration_us\": 100}}")).collect();
    let tensors: Vec<String> = (0..n)
        .map(|i| {
            let last = (i + 1).min(n - 1);
            let acc = if last == i { format!("[{i}]") } else { format!("[{i}, {last}]") };
            format!(
                "{{\"id\": {i}, \"name\": \"a{i}\", \"bytes\": 65536, \"kind\": \"activation\", \
                 \"global\": false, \"created_by\": {i}, \"accesses\": {acc}, \
                 \"dies_after\": {last}, \"writes\": [{i}]}}"
            )
        })
        .collect();
    let json = cs(&format!(
        "{{\"format\": \"teraio-trace\", \"version\": 1, \"name\": \"small\", \"kernels\": [{}], \
         \"tensors\": [{}]}}",
        kernels.join(","),
        tensors.join(",")
    ));
    let mut t = null_mut();
    // SAFETY: valid string and out-pointer.
    let s = unsafe { teraio_trace_from_json(json.as_ptr(), &mut t) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    t
}

fn plan_of(t: *mut teraio_trace, policy: &str) -> CString {
    let policy = cs(policy);
    let mut plan = null_mut();
    // SAFETY: valid handle, string and out-pointer.
    let s = unsafe { teraio_plan(t, policy.as_ptr(), std::ptr::null(), &mut plan) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    CString::new(take_string(plan)).unwrap()
}

fn executor(e: *mut teraio_engine, t: *mut teraio_trace) -> *mut teraio_executor {
    let plan = plan_of(t, "none");
    let mut ex = null_mut();
    // SAFETY: valid handles, string and out-pointer; NULL allocator (engine memory).
    let s = unsafe {
        teraio_executor_new(e, t, plan.as_ptr(), 1 << 30, true, std::ptr::null(), &mut ex)
    };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_executor_start(ex), TERAIO_OK, "{}", last_error());
    ex
}

#[test]
fn after_kernel_out_of_range_or_out_of_order_is_an_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path());
    let t = small_trace(4);
    let ex = executor(e, t);
    expect(
        teraio_executor_after_kernel(ex, usize::MAX),
        TERAIO_ERR_INVALID_ARGUMENT,
        &[&usize::MAX.to_string(), "4 kernels"],
    );
    let mut stall = 0.0;
    // SAFETY: valid handle and out-pointer.
    assert_eq!(unsafe { teraio_executor_before_kernel(ex, 0, &mut stall) }, TERAIO_OK);
    expect(
        teraio_executor_after_kernel(ex, 2),
        TERAIO_ERR_INVALID_ARGUMENT,
        &["after_kernel(2)", "expected kernel 0"],
    );
    assert_eq!(teraio_executor_after_kernel(ex, 0), TERAIO_OK, "{}", last_error());
    expect(teraio_executor_after_kernel(ex, 0), TERAIO_ERR_INVALID_ARGUMENT, &["after_kernel(0)"]);
    assert_eq!(teraio_executor_finish(ex), TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_trace_free(t), TERAIO_OK);
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

#[test]
fn an_executor_whose_engine_was_closed_answers_closed() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path());
    let t = small_trace(4);
    let ex = executor(e, t);
    let ex2 = executor(e, t);
    assert_eq!(teraio_engine_close(e), TERAIO_OK, "{}", last_error());
    let mut stall = 0.0;
    // SAFETY: valid out-pointer.
    let s = unsafe { teraio_executor_before_kernel(ex, 0, &mut stall) };
    expect(s, TERAIO_ERR_CLOSED, &["closed", "teraio_engine_close"]);
    expect(teraio_executor_after_kernel(ex, 0), TERAIO_ERR_CLOSED, &["closed"]);
    expect(teraio_executor_start(ex), TERAIO_ERR_CLOSED, &["closed"]);
    let mut rep = null_mut();
    // SAFETY: valid out-pointer.
    let s = unsafe { teraio_executor_end_iteration(ex, &mut rep) };
    expect(s, TERAIO_ERR_CLOSED, &["closed"]);
    // finish reports it and frees the handle; free just frees.
    expect(teraio_executor_finish(ex), TERAIO_ERR_CLOSED, &["closed"]);
    assert_eq!(teraio_executor_finish(ex), TERAIO_ERR_INVALID_HANDLE);
    assert_eq!(teraio_executor_free(ex2), TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_trace_free(t), TERAIO_OK);
}

#[test]
fn simulating_more_iterations_than_the_maximum_is_refused_at_once() {
    let t = small_trace(4);
    let plan = plan_of(t, "teraio");
    let mut out = null_mut();
    let start = Instant::now();
    // SAFETY: valid handle, string and out-pointer.
    let s = unsafe { teraio_simulate(t, plan.as_ptr(), std::ptr::null(), u32::MAX, &mut out) };
    expect(s, TERAIO_ERR_INVALID_ARGUMENT, &["iterations", &u32::MAX.to_string(), "at most"]);
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    // SAFETY: as above.
    let s = unsafe { teraio_simulate(t, plan.as_ptr(), std::ptr::null(), 3, &mut out) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    take_string(out);
    assert_eq!(teraio_trace_free(t), TERAIO_OK);
}

/// A persistent one-file engine in `dir` (psync: the child's file size limit applies to its writes).
fn open_persistent(dir: &std::path::Path) -> *mut teraio_engine {
    let toml = cs(&format!(
        "dir = {:?}\nfiles = 1\nfile_size = \"32M\"\npersistent = true\nbackend = \"psync\"\n",
        dir.display().to_string()
    ));
    let mut e = null_mut();
    assert_eq!(
        // SAFETY: valid string and out-pointer.
        unsafe { teraio_engine_open_toml(toml.as_ptr(), &mut e) },
        TERAIO_OK,
        "{}",
        last_error()
    );
    e
}

/// From now on this process may not write past 4 KiB of any file (`prlimit --fsize`).
fn no_writes_past_4k() {
    let limit = std::process::Command::new("prlimit")
        .args(["--pid", &std::process::id().to_string(), "--fsize=4096:4096"])
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(limit.success());
}

/// Run test `child` of this binary in a child process with `env` set to `dir`; its stdout and
/// stderr (it must succeed). SIGXFSZ is ignored (the shell's `trap ''` survives exec), so a
/// write past the child's file size limit fails with EFBIG instead of killing it.
fn run_child(child: &str, env: &str, dir: &std::path::Path) -> (String, String) {
    let out = std::process::Command::new("sh")
        .args(["-c", &format!("trap '' XFSZ; exec \"$0\" --exact {child} --nocapture")])
        .arg(std::env::current_exe().unwrap())
        .env(env, dir)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stdout}\n{stderr}");
    (stdout, stderr)
}

/// Every waiting notice on stdout (`NOTICE <level> <text>`), for a parent test to read: the
/// library never prints, what it had to say waits in its queue.
fn print_notices() {
    loop {
        let (mut level, mut msg) = (-1i32, null_mut());
        // SAFETY: valid out-pointers.
        let s = unsafe { teraio_take_notice(&mut level, &mut msg) };
        assert_eq!(s, TERAIO_OK, "{}", last_error());
        if msg.is_null() {
            break;
        }
        println!("NOTICE {level} {}", take_string(msg));
    }
}

/// The child of the next test: a persistent engine whose final checkpoint cannot be written (the
/// process may not write past 4 KiB of any file from then on: `prlimit --fsize`).
#[test]
fn checkpoint_failure_child() {
    let Some(dir) = std::env::var_os("TERAIO_CLOSE_CHILD_DIR") else { return };
    let e = open_persistent(std::path::Path::new(&dir));
    let data = vec![0x5au8; 100_000];
    let mut op = null_mut();
    let name = cs("kept");
    // SAFETY: valid pointers for the call.
    let s = unsafe {
        teraio_offload(e, 7, data.as_ptr().cast(), data.len(), name.as_ptr(), 0, 0, &mut op)
    };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_op_free(op), TERAIO_OK, "{}", last_error());
    no_writes_past_4k();
    let s = teraio_engine_close(e);
    println!("CLOSE STATUS {s} {}", last_error());
    print_notices();
}

#[test]
fn close_reports_a_failed_final_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (stdout, stderr) =
        run_child("checkpoint_failure_child", "TERAIO_CLOSE_CHILD_DIR", dir.path());
    let line = stdout.lines().find(|l| l.starts_with("CLOSE STATUS")).expect("the child closed");
    assert!(line.starts_with(&format!("CLOSE STATUS {TERAIO_ERR_IO} ")), "{line}");
    // Reported by the call, never printed by the library.
    assert!(!stderr.contains("checkpoint"), "the library printed: {stderr}");
    for n in stdout.lines().filter(|l| l.starts_with("NOTICE ")) {
        assert!(n.starts_with(&format!("NOTICE {TERAIO_NOTICE_ERROR} checkpoint")), "{n}");
    }
    // The journal had everything: the tensor is there after a reopen.
    let e = open_persistent(dir.path());
    let mut id = 0u64;
    let name = cs("kept");
    // SAFETY: valid string and out-pointer.
    assert_eq!(unsafe { teraio_lookup(e, name.as_ptr(), &mut id) }, TERAIO_OK, "{}", last_error());
    assert_eq!(id, 7);
    assert_eq!(teraio_engine_close(e), TERAIO_OK, "{}", last_error());
}

/// The child of the next test: a persistent engine closed while an executor still holds its
/// store; then the process may not write past 4 KiB, and freeing the executor drops the store,
/// whose final checkpoint fails where no call can return the error.
#[test]
fn notice_child() {
    let Some(dir) = std::env::var_os("TERAIO_NOTICE_CHILD_DIR") else { return };
    let e = open_persistent(std::path::Path::new(&dir));
    let t = small_trace(4);
    let ex = executor(e, t);
    assert_eq!(teraio_engine_close(e), TERAIO_OK, "{}", last_error());
    no_writes_past_4k();
    assert_eq!(teraio_executor_free(ex), TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_trace_free(t), TERAIO_OK);
    print_notices();
    let mut dropped = 7u64;
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { teraio_notices_dropped(&mut dropped) }, TERAIO_OK);
    println!("DROPPED {dropped}");
}

#[test]
fn a_failure_inside_a_destructor_is_a_notice_not_a_print() {
    let dir = tempfile::tempdir().unwrap();
    let (stdout, stderr) = run_child("notice_child", "TERAIO_NOTICE_CHILD_DIR", dir.path());
    let notices: Vec<&str> = stdout.lines().filter(|l| l.starts_with("NOTICE ")).collect();
    assert_eq!(notices.len(), 1, "{stdout}");
    assert!(
        notices[0].starts_with(&format!("NOTICE {TERAIO_NOTICE_ERROR} checkpoint at close failed")),
        "{}",
        notices[0]
    );
    assert!(stdout.contains("DROPPED 0"), "{stdout}");
    assert!(!stderr.contains("checkpoint"), "the library printed: {stderr}");
}

#[test]
fn take_notice_names_a_null_result_pointer() {
    let mut level = 0i32;
    let mut msg = null_mut();
    // SAFETY: NULL is what is being tested; the other pointers are valid.
    unsafe {
        assert_eq!(teraio_take_notice(std::ptr::null_mut(), &mut msg), TERAIO_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("out_level"), "{}", last_error());
        assert_eq!(
            teraio_take_notice(&mut level, std::ptr::null_mut()),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("out_message"), "{}", last_error());
        assert_eq!(teraio_notices_dropped(std::ptr::null_mut()), TERAIO_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("out_count"), "{}", last_error());
    }
}
