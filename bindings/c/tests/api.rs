//! The C ABI driven from Rust through its extern functions, as a C program would: round trips,
//! every kind of bad handle and argument, persistence across close and crash, threads, and the
//! scheduler.

use std::ffi::{CStr, CString, c_void};
use std::ptr::null_mut;

use teraio::*;

mod common;
use common::{cs, last_error, take_string};

fn config(dir: &std::path::Path, persistent: bool) -> CString {
    cs(&format!(
        "dir = {:?}\nfiles = 2\nfile_size = \"64M\"\npersistent = {persistent}\nworkers = 2\n",
        dir.display().to_string()
    ))
}

fn open(dir: &std::path::Path, persistent: bool) -> *mut teraio_engine {
    let mut e = null_mut();
    // SAFETY: valid string and out-pointer.
    let s = unsafe { teraio_engine_open_toml(config(dir, persistent).as_ptr(), &mut e) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    assert!(!e.is_null());
    e
}

fn offload(e: *mut teraio_engine, id: u64, data: &[u8], name: Option<&str>) -> *mut teraio_op {
    let name = name.map(cs);
    let mut op = null_mut();
    // SAFETY: data is valid for its length; name is NULL or a valid string.
    let s = unsafe {
        teraio_offload(
            e,
            id,
            data.as_ptr().cast(),
            data.len(),
            name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()),
            TERAIO_DEST_SSD,
            TERAIO_PRIORITY_NORMAL,
            &mut op,
        )
    };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    op
}

fn prefetch_into(e: *mut teraio_engine, id: u64, out: &mut [u8]) -> teraio_status {
    let mut op = null_mut();
    // SAFETY: out is valid until the op is freed below.
    let s = unsafe {
        teraio_prefetch(e, id, out.as_mut_ptr().cast(), out.len(), TERAIO_PRIORITY_URGENT, &mut op)
    };
    if s != TERAIO_OK {
        return s;
    }
    let w = teraio_wait(op, -1);
    assert_eq!(teraio_op_free(op), w);
    w
}

fn pattern(id: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u64).wrapping_mul(31).wrapping_add(id) as u8).collect()
}

#[test]
fn version_and_status_names_are_static_strings() {
    // SAFETY: static NUL-terminated strings.
    let v = unsafe { CStr::from_ptr(teraio_version()) }.to_str().unwrap();
    assert_eq!(v, env!("CARGO_PKG_VERSION"));
    assert_eq!(teraio_abi_version(), TERAIO_ABI_VERSION);
    // SAFETY: as above.
    let n = unsafe { CStr::from_ptr(teraio_status_name(TERAIO_ERR_NO_SPACE)) };
    assert_eq!(n.to_str().unwrap(), "ERR_NO_SPACE");
    // SAFETY: as above.
    let n = unsafe { CStr::from_ptr(teraio_status_name(12345)) };
    assert_eq!(n.to_str().unwrap(), "UNKNOWN");
}

#[test]
fn a_file_backed_engine_round_trips_odd_sizes_through_pointers_and_buffers() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path(), false);
    let sizes = [1usize, 4095, 4097, (1 << 20) + 3, (5 << 20) + 77];
    let ops: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| offload(e, i as u64, &pattern(i as u64, n), Some(&format!("t{i}"))))
        .collect();
    for op in ops {
        assert_eq!(teraio_wait(op, -1), TERAIO_OK, "{}", last_error());
        let mut outcome = -1;
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { teraio_op_outcome(op, &mut outcome) }, TERAIO_OK);
        assert_eq!(outcome, TERAIO_OUTCOME_SSD);
        assert_eq!(teraio_op_free(op), TERAIO_OK);
    }
    let mut json = null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { teraio_list_tensors(e, &mut json) }, TERAIO_OK);
    let list: serde_json::Value = serde_json::from_str(&take_string(json)).unwrap();
    assert_eq!(list.as_array().unwrap().len(), sizes.len());
    assert_eq!(list[4]["size_bytes"], (5 << 20) + 77);
    assert_eq!(list[4]["location"], "on_ssd");
    let mut id = 0;
    let name = cs("t3");
    // SAFETY: valid string and out-pointer.
    assert_eq!(unsafe { teraio_lookup(e, name.as_ptr(), &mut id) }, TERAIO_OK);
    assert_eq!(id, 3);
    for (i, &n) in sizes.iter().enumerate() {
        let mut out = vec![0u8; n];
        assert_eq!(prefetch_into(e, i as u64, &mut out), TERAIO_OK, "{}", last_error());
        assert!(out == pattern(i as u64, n), "tensor {i} of {n} bytes came back different");
    }
    // Engine buffers: no copy, stable address, busy while lent.
    let mut buf = null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { teraio_buffer_alloc((3 << 20) + 1, &mut buf) }, TERAIO_OK);
    let (mut data, mut len) = (null_mut::<c_void>(), 0usize);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { teraio_buffer_data(buf, &mut data, &mut len) }, TERAIO_OK);
    assert_eq!(len, (3 << 20) + 1);
    assert_eq!(data as usize % 4096, 0);
    // SAFETY: the buffer's memory is `len` bytes at `data` while the handle lives.
    let mem = unsafe { std::slice::from_raw_parts_mut(data.cast::<u8>(), len) };
    mem.copy_from_slice(&pattern(99, len));
    let mut op = null_mut();
    // SAFETY: valid handles and out-pointer.
    let s =
        unsafe { teraio_offload_buffer(e, 99, buf, std::ptr::null(), TERAIO_DEST_SSD, 1, &mut op) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_wait(op, -1), TERAIO_OK);
    assert_eq!(teraio_op_free(op), TERAIO_OK);
    mem.fill(0);
    // SAFETY: valid handles and out-pointer.
    assert_eq!(unsafe { teraio_prefetch_buffer(e, 99, buf, 0, &mut op) }, TERAIO_OK);
    // Busy while the prefetch runs (or already done: then a second prefetch finds no copy).
    let mut op2 = null_mut();
    // SAFETY: valid handles and out-pointer.
    let s2 = unsafe { teraio_prefetch_buffer(e, 99, buf, 0, &mut op2) };
    assert!(s2 == TERAIO_ERR_INVALID_STATE || s2 == TERAIO_OK, "{s2}: {}", last_error());
    assert_eq!(teraio_wait(op, -1), TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_op_free(op), TERAIO_OK);
    if s2 == TERAIO_OK {
        assert_eq!(teraio_op_free(op2), TERAIO_ERR_INVALID_STATE, "no copy left to prefetch");
    }
    assert!(*mem == pattern(99, len)[..]);
    assert_eq!(teraio_buffer_free(buf), TERAIO_OK);
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

#[test]
fn bad_handles_are_errors_never_crashes() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path(), false);
    let op = offload(e, 1, &[7; 100], None);
    assert_eq!(teraio_wait(op, -1), TERAIO_OK);
    // Null, made-up and wrong-kind handles.
    assert_eq!(teraio_wait(null_mut(), 0), TERAIO_ERR_INVALID_HANDLE);
    assert!(last_error().contains("NULL"), "{}", last_error());
    assert_eq!(teraio_wait(0xdead_beef_usize as *mut teraio_op, 0), TERAIO_ERR_INVALID_HANDLE);
    assert_eq!(teraio_engine_drain(op.cast()), TERAIO_ERR_INVALID_HANDLE);
    assert!(last_error().contains("operation handle"), "{}", last_error());
    assert_eq!(teraio_wait(e.cast(), 0), TERAIO_ERR_INVALID_HANDLE);
    // Double free and use after free of an op.
    assert_eq!(teraio_op_free(op), TERAIO_OK);
    assert_eq!(teraio_op_free(op), TERAIO_ERR_INVALID_HANDLE);
    assert!(last_error().contains("already freed"), "{}", last_error());
    assert_eq!(teraio_poll(op), TERAIO_ERR_INVALID_HANDLE);
    // Buffers and traces.
    let mut buf = null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { teraio_buffer_alloc(10, &mut buf) }, TERAIO_OK);
    assert_eq!(teraio_buffer_free(buf), TERAIO_OK);
    assert_eq!(teraio_buffer_free(buf), TERAIO_ERR_INVALID_HANDLE);
    let mut op = null_mut();
    // SAFETY: valid out-pointer; the buffer handle is stale.
    let s = unsafe { teraio_offload_buffer(e, 2, buf, std::ptr::null(), 0, 1, &mut op) };
    assert_eq!(s, TERAIO_ERR_INVALID_HANDLE);
    assert_eq!(teraio_trace_free(null_mut()), TERAIO_ERR_INVALID_HANDLE);
    // Strings: double free and foreign pointers refused.
    let mut json = null_mut();
    // SAFETY: valid out-pointer.
    assert_eq!(unsafe { teraio_engine_info(e, &mut json) }, TERAIO_OK);
    assert_eq!(teraio_string_free(json), TERAIO_OK);
    assert_eq!(teraio_string_free(json), TERAIO_ERR_INVALID_HANDLE);
    let mine = cs("not teraio's");
    assert_eq!(teraio_string_free(mine.as_ptr().cast_mut()), TERAIO_ERR_INVALID_HANDLE);
    assert_eq!(teraio_string_free(null_mut()), TERAIO_OK);
    // Close, double close, use after close.
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
    assert_eq!(teraio_engine_close(e), TERAIO_ERR_CLOSED);
    assert!(last_error().contains("closed"), "{}", last_error());
    let mut op = null_mut();
    // SAFETY: valid pointers; the engine handle is closed.
    let s =
        unsafe { teraio_offload(e, 1, [1u8].as_ptr().cast(), 1, std::ptr::null(), 0, 1, &mut op) };
    assert_eq!(s, TERAIO_ERR_CLOSED);
    assert!(op.is_null(), "no handle written on failure");
    assert_eq!(teraio_engine_drain(e), TERAIO_ERR_CLOSED);
}

#[test]
fn bad_arguments_are_errors_that_name_them() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path(), false);
    let mut op = null_mut();
    // SAFETY: every pointer is valid or NULL as the case tests.
    unsafe {
        assert_eq!(
            teraio_offload(e, 1, std::ptr::null(), 10, std::ptr::null(), 0, 1, &mut op),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("data"), "{}", last_error());
        let d = [1u8; 10];
        assert_eq!(
            teraio_offload(e, 1, d.as_ptr().cast(), 0, std::ptr::null(), 0, 1, &mut op),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("empty"), "{}", last_error());
        assert_eq!(
            teraio_offload(e, 1, d.as_ptr().cast(), 10, std::ptr::null(), 7, 1, &mut op),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("destination 7"), "{}", last_error());
        assert_eq!(
            teraio_offload(e, 1, d.as_ptr().cast(), 10, std::ptr::null(), 0, -3, &mut op),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            teraio_offload(e, 1, d.as_ptr().cast(), 10, std::ptr::null(), 0, 1, null_mut()),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("out_op"), "{}", last_error());
        let bad_utf8 = [0xffu8, 0xfe, 0];
        assert_eq!(
            teraio_offload(e, 1, d.as_ptr().cast(), 10, bad_utf8.as_ptr().cast(), 0, 1, &mut op),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("UTF-8"), "{}", last_error());
        // Wrong size and unknown tensor on prefetch; nothing is lost by a refused prefetch.
        let op1 = offload(e, 5, &d, None);
        assert_eq!(teraio_op_free(op1), TERAIO_OK);
        let mut small = [0u8; 9];
        assert_eq!(prefetch_into(e, 5, &mut small), TERAIO_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("10 bytes"), "{}", last_error());
        let mut out = [0u8; 10];
        assert_eq!(prefetch_into(e, 77, &mut out), TERAIO_ERR_UNKNOWN_TENSOR);
        assert_eq!(prefetch_into(e, 5, &mut out), TERAIO_OK);
        assert_eq!(out, d);
        // Configurations.
        let mut e2 = null_mut();
        let bad = cs("dir = \"/tmp/x\"\nqueue_depht = 3\n");
        assert_eq!(teraio_engine_open_toml(bad.as_ptr(), &mut e2), TERAIO_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("queue_depht"), "{}", last_error());
        assert_eq!(teraio_engine_open_json(std::ptr::null(), &mut e2), TERAIO_ERR_INVALID_ARGUMENT);
        let missing = cs("/nonexistent/teraio.toml");
        assert_eq!(
            teraio_engine_open_file(missing.as_ptr(), std::ptr::null(), &mut e2),
            TERAIO_ERR_IO
        );
        assert!(last_error().contains("/nonexistent/teraio.toml"), "{}", last_error());
        assert!(e2.is_null());
        let mut id = 0;
        let nobody = cs("nobody");
        assert_eq!(teraio_lookup(e, nobody.as_ptr(), &mut id), TERAIO_ERR_UNKNOWN_TENSOR);
    }
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

#[test]
fn poll_reports_pending_then_the_result_and_op_free_completes_a_prefetch() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path(), false);
    let data = pattern(3, 16 << 20);
    let op = offload(e, 3, &data, None);
    let mut polls = 0;
    loop {
        match teraio_poll(op) {
            TERAIO_PENDING => polls += 1,
            TERAIO_OK => break,
            s => panic!("poll: {s} {}", last_error()),
        }
        assert!(polls < 1_000_000, "an offload of 16 MiB never finished");
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    assert_eq!(teraio_poll(op), TERAIO_OK, "polling a finished op again");
    assert_eq!(teraio_op_free(op), TERAIO_OK);
    // A prefetch freed without a wait still delivers its bytes before op_free returns.
    let mut out = vec![0u8; data.len()];
    let mut op = null_mut();
    // SAFETY: out outlives the op (freed below).
    let s = unsafe { teraio_prefetch(e, 3, out.as_mut_ptr().cast(), out.len(), 1, &mut op) };
    assert_eq!(s, TERAIO_OK);
    assert_eq!(teraio_op_free(op), TERAIO_OK);
    assert!(out == data);
    // A wait with a zero timeout on a running op says pending or done, never blocks forever.
    let op = offload(e, 4, &data, None);
    let s = teraio_wait(op, 0);
    assert!(s == TERAIO_PENDING || s == TERAIO_OK, "{s}");
    assert_eq!(teraio_wait(op, -1), TERAIO_OK);
    assert_eq!(teraio_op_free(op), TERAIO_OK);
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

#[test]
fn several_threads_share_one_engine_and_nothing_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path(), false) as usize;
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            std::thread::spawn(move || {
                let e = e as *mut teraio_engine;
                for k in 0..6u64 {
                    let id = t * 100 + k;
                    let n = 4096 * (k as usize + 1) + t as usize * 13 + 1;
                    let op = offload(e, id, &pattern(id, n), None);
                    assert_eq!(teraio_wait(op, -1), TERAIO_OK, "{}", last_error());
                    assert_eq!(teraio_op_free(op), TERAIO_OK);
                    let mut out = vec![0u8; n];
                    assert_eq!(prefetch_into(e, id, &mut out), TERAIO_OK, "{}", last_error());
                    assert!(out == pattern(id, n), "tensor {id}");
                }
                // This thread's last error is its own.
                assert_eq!(teraio_wait(null_mut(), 0), TERAIO_ERR_INVALID_HANDLE);
                last_error()
            })
        })
        .collect();
    for t in threads {
        assert!(t.join().unwrap().contains("NULL"));
    }
    assert_eq!(teraio_engine_close(e as *mut teraio_engine), TERAIO_OK);
}

#[test]
fn a_persistent_engine_reopens_with_its_tensors_by_name_after_close() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path(), true);
    for i in 0..3u64 {
        let op = offload(e, i, &pattern(i, 100_000 + i as usize), Some(&format!("layer{i}.w")));
        assert_eq!(teraio_op_free(op), TERAIO_OK, "{}", last_error());
    }
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
    let e = open(dir.path(), true);
    for i in 0..3u64 {
        let mut id = u64::MAX;
        let name = cs(&format!("layer{i}.w"));
        // SAFETY: valid string and out-pointer.
        assert_eq!(unsafe { teraio_lookup(e, name.as_ptr(), &mut id) }, TERAIO_OK);
        let mut out = vec![0u8; 100_000 + i as usize];
        assert_eq!(prefetch_into(e, id, &mut out), TERAIO_OK, "{}", last_error());
        assert!(out == pattern(i, out.len()));
    }
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

/// The child half of the crash test: offload, wait for the acknowledgement, then die without
/// closing the engine.
#[test]
fn crash_child() {
    let Some(dir) = std::env::var_os("TERAIO_CAPI_CRASH_DIR") else { return };
    let e = open(std::path::Path::new(&dir), true);
    for i in 0..4u64 {
        let op = offload(e, i, &pattern(i, 300_000 + i as usize), Some(&format!("acked{i}")));
        assert_eq!(teraio_op_free(op), TERAIO_OK);
    }
    // Not acknowledged: may or may not survive.
    let _unacked = offload(e, 9, &pattern(9, 1 << 20), Some("unacked"));
    std::process::abort();
}

#[test]
fn a_persistent_engine_reopens_with_every_acknowledged_tensor_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads", "1"])
        .env("TERAIO_CAPI_CRASH_DIR", dir.path())
        .stderr(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success(), "the child aborts after its acknowledged offloads");
    let e = open(dir.path(), true);
    for i in 0..4u64 {
        let mut id = u64::MAX;
        let name = cs(&format!("acked{i}"));
        // SAFETY: valid string and out-pointer.
        let s = unsafe { teraio_lookup(e, name.as_ptr(), &mut id) };
        assert_eq!(s, TERAIO_OK, "acknowledged tensor acked{i} lost: {}", last_error());
        let mut out = vec![0u8; 300_000 + i as usize];
        assert_eq!(prefetch_into(e, id, &mut out), TERAIO_OK, "{}", last_error());
        assert!(out == pattern(i, out.len()), "acked{i} came back different");
    }
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

#[test]
fn the_scheduler_plans_and_simulates_a_trace_and_names_bad_input() {
    let mut t = null_mut();
    let spec = cs("preset:gpt2-small,layers=2,micro-batch=2");
    // SAFETY: valid strings and out-pointers throughout.
    unsafe {
        assert_eq!(teraio_trace_load(spec.as_ptr(), &mut t), TERAIO_OK, "{}", last_error());
        let mut json = null_mut();
        assert_eq!(teraio_trace_info(t, &mut json), TERAIO_OK);
        let info: serde_json::Value = serde_json::from_str(&take_string(json)).unwrap();
        let peak = info["peak_resident_bytes"].as_u64().unwrap();
        let hw = cs(&format!(
            "{{\"gpu_memory_bytes\": {}, \"ssd_count\": 4, \"ssd_read_bytes_per_s\": 6.7e9, \
             \"ssd_write_bytes_per_s\": 6.5e9, \"ssd_latency_us\": 80, \
             \"pcie_h2d_bytes_per_s\": 5e10, \"pcie_d2h_bytes_per_s\": 5e10, \
             \"host_memory_cap_bytes\": 0, \"host_memory_bytes_per_s\": 1e11, \
             \"gpudirect\": true}}",
            peak * 3 / 4
        ));
        let policy = cs("teraio");
        let mut plan = null_mut();
        assert_eq!(
            teraio_plan(t, policy.as_ptr(), hw.as_ptr(), &mut plan),
            TERAIO_OK,
            "{}",
            last_error()
        );
        let plan_text = CString::new(take_string(plan)).unwrap();
        let mut report = null_mut();
        assert_eq!(
            teraio_simulate(t, plan_text.as_ptr(), hw.as_ptr(), 2, &mut report),
            TERAIO_OK,
            "{}",
            last_error()
        );
        let r: serde_json::Value = serde_json::from_str(&take_string(report)).unwrap();
        assert!(r["peak_gpu_bytes"].as_u64().unwrap() <= peak * 3 / 4);
        let policies = cs("teraio,none");
        let mut cmp = null_mut();
        assert_eq!(teraio_compare_policies(t, policies.as_ptr(), hw.as_ptr(), &mut cmp), TERAIO_OK);
        let c: serde_json::Value = serde_json::from_str(&take_string(cmp)).unwrap();
        assert_eq!(c.as_array().unwrap().len(), 2);
        assert_eq!(c[0]["report"]["percent_of_ideal"], r["percent_of_ideal"]);
        // Plan selection: the same plan `teraio plan` makes, the executor's budget beside it.
        let opts = cs("{\"policy\": \"teraio\"}");
        let (mut sel_plan, mut sel) = (null_mut(), null_mut());
        assert_eq!(
            teraio_select(t, hw.as_ptr(), opts.as_ptr(), &mut sel_plan, &mut sel),
            TERAIO_OK,
            "{}",
            last_error()
        );
        // (checked in the simulator: its stats carry the simulated tier peaks too)
        let chosen: serde_json::Value = serde_json::from_str(&take_string(sel_plan)).unwrap();
        let planned: serde_json::Value = serde_json::from_str(plan_text.to_str().unwrap()).unwrap();
        assert_eq!(chosen["instructions"], planned["instructions"]);
        assert_eq!(chosen["initially_offloaded"], planned["initially_offloaded"]);
        let s: serde_json::Value = serde_json::from_str(&take_string(sel)).unwrap();
        assert_eq!(s["choice"], "as_modelled");
        assert_eq!(s["budgets"]["executor_bytes"].as_u64().unwrap(), peak * 3 / 4);
        // A budget below a kernel's working set: refused, naming the kernel and the bytes.
        let tiny = cs("{\"gpu_budget_bytes\": 1000}");
        assert_eq!(
            teraio_select(t, hw.as_ptr(), tiny.as_ptr(), &mut sel_plan, &mut sel),
            TERAIO_ERR_SIMULATION
        );
        assert!(last_error().contains("GPU memory too small: kernel"), "{}", last_error());
        let unknown = cs("{\"budget\": 1}");
        assert_eq!(
            teraio_select(t, hw.as_ptr(), unknown.as_ptr(), &mut sel_plan, &mut sel),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("budget"), "{}", last_error());
        // Bad input.
        let magic = cs("magic");
        assert_eq!(
            teraio_plan(t, magic.as_ptr(), std::ptr::null(), &mut plan),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("magic"), "{}", last_error());
        let garbage = cs("{\"policy\": \"teraio\"}");
        assert_eq!(
            teraio_simulate(t, garbage.as_ptr(), std::ptr::null(), 2, &mut report),
            TERAIO_ERR_PLAN
        );
        assert_eq!(
            teraio_simulate(t, plan_text.as_ptr(), std::ptr::null(), 0, &mut report),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        let corrupt = cs("{\"name\": \"x\", \"kernels\": [{\"name\": \"k\"}], \"tensors\": 3}");
        let mut t2 = null_mut();
        assert_eq!(teraio_trace_from_json(corrupt.as_ptr(), &mut t2), TERAIO_ERR_TRACE);
        assert!(t2.is_null());
        assert_eq!(teraio_trace_free(t), TERAIO_OK);
        assert_eq!(teraio_trace_free(t), TERAIO_ERR_INVALID_HANDLE);
        assert_eq!(
            teraio_plan(t, policy.as_ptr(), std::ptr::null(), &mut plan),
            TERAIO_ERR_INVALID_HANDLE
        );
    }
}

/// A trace of two kernels named `first` and `second`, one activation living across them
/// (no layer on any kernel).
fn two_kernel_trace(first: &str, second: &str) -> *mut teraio_trace {
    let json = cs(&format!(
        "{{\"format\": \"teraio-trace\", \"version\": 1, \"name\": \"two\", \"kernels\": [\
         {{\"name\": \"{first}\", \"duration_us\": 100}}, \
         {{\"name\": \"{second}\", \"duration_us\": 100}}], \"tensors\": [\
         {{\"id\": 0, \"name\": \"a0\", \"bytes\": 65536, \"kind\": \"activation\", \
         \"global\": false, \"created_by\": 0, \"accesses\": [0, 1], \"dies_after\": 1, \
         \"writes\": [0]}}]}}"
    ));
    let mut t = null_mut();
    // SAFETY: valid string and out-pointer.
    let s = unsafe { teraio_trace_from_json(json.as_ptr(), &mut t) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    t
}

#[test]
fn checkpoint_layers_are_chosen_as_the_shared_implementation_chooses_them() {
    // Slow transfers and a squeezed GPU (as Python's test of `teraio.choose_checkpoint`):
    // remaking a layer beats moving its activations.
    let spec = "preset:gpt2-small,layers=2,micro-batch=2";
    let trace = teraio_bindings_core::sched::load_trace(spec).unwrap();
    let peak = trace.resident_memory_per_kernel().into_iter().max().unwrap();
    let mut hw =
        serde_json::to_value(teraio_scheduler::Hardware::preset("paper").unwrap()).unwrap();
    for (k, v) in [
        ("pcie_h2d_bytes_per_s", 1e8),
        ("pcie_d2h_bytes_per_s", 1e8),
        ("ssd_read_bytes_per_s", 1e7),
        ("ssd_write_bytes_per_s", 1e7),
    ] {
        hw[k] = serde_json::json!(v);
    }
    hw["host_memory_cap_bytes"] = serde_json::json!(0);
    let hw_text = hw.to_string();
    let options = format!("{{\"policy\": \"auto\", \"gpu_budget_bytes\": {}}}", peak * 3 / 4);
    let (c_spec, c_hw, c_options) = (cs(spec), cs(&hw_text), cs(&options));
    let mut t = null_mut();
    // SAFETY: valid strings and out-pointers throughout; the handles are the cases tested.
    unsafe {
        assert_eq!(teraio_trace_load(c_spec.as_ptr(), &mut t), TERAIO_OK, "{}", last_error());
        let mut out = null_mut();
        assert_eq!(
            teraio_choose_checkpoint(t, c_hw.as_ptr(), c_options.as_ptr(), &mut out),
            TERAIO_OK,
            "{}",
            last_error()
        );
        let choice: serde_json::Value = serde_json::from_str(&take_string(out)).unwrap();
        let layers = choice["layers"].as_array().expect("layers is an array");
        assert!(!layers.is_empty(), "{}", choice["why"]);
        assert!(layers.iter().all(|l| l.as_u64().is_some_and(|l| l < 2)), "{choice}");
        let with = choice["iteration_time_us"].as_f64().unwrap();
        // (`without_us` is null where the trace's own plan does not run)
        if let Some(without) = choice["without_us"].as_f64() {
            assert!(with <= without, "{choice}");
        }
        assert_eq!(choice["tried"][0]["layers"], serde_json::json!([]), "{choice}");
        // The same as the implementation Python and the CLI call, for the same inputs.
        let expected = teraio_bindings_core::sched::choose_checkpoint(
            &trace,
            &teraio_bindings_core::sched::hardware(&hw_text, None).unwrap(),
            &teraio_bindings_core::sched::SelectRequest::from_json(&options).unwrap(),
        )
        .unwrap();
        assert_eq!(choice, expected);
        // Defaults (NULL hardware: `paper`; NULL options: its GPU memory): room for everything,
        // nothing to gain.
        assert_eq!(
            teraio_choose_checkpoint(t, std::ptr::null(), std::ptr::null(), &mut out),
            TERAIO_OK,
            "{}",
            last_error()
        );
        let roomy: serde_json::Value = serde_json::from_str(&take_string(out)).unwrap();
        assert_eq!(roomy["layers"], serde_json::json!([]), "{roomy}");
        assert_eq!(roomy["iteration_time_us"], roomy["without_us"], "{roomy}");

        // An unknown option key: named, nothing written.
        let unknown = cs("{\"budget\": 1}");
        out = null_mut();
        assert_eq!(
            teraio_choose_checkpoint(t, c_hw.as_ptr(), unknown.as_ptr(), &mut out),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("budget"), "{}", last_error());
        assert!(out.is_null(), "nothing written on failure");
        let policy = cs("{\"policy\": \"magic\"}");
        assert_eq!(
            teraio_choose_checkpoint(t, c_hw.as_ptr(), policy.as_ptr(), &mut out),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("magic"), "{}", last_error());
        // A NULL out-parameter.
        assert_eq!(
            teraio_choose_checkpoint(t, c_hw.as_ptr(), c_options.as_ptr(), null_mut()),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("out_choice_json"), "{}", last_error());
        // Traces without backward kernels, or without layers: named.
        let forward = two_kernel_trace("fwd.a", "fwd.b");
        assert_eq!(
            teraio_choose_checkpoint(forward, std::ptr::null(), std::ptr::null(), &mut out),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("no backward kernel"), "{}", last_error());
        let unlayered = two_kernel_trace("fwd.a", "bwd.a");
        assert_eq!(
            teraio_choose_checkpoint(unlayered, std::ptr::null(), std::ptr::null(), &mut out),
            TERAIO_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("no kernel names a layer"), "{}", last_error());
        assert!(out.is_null(), "nothing written on failure");
        assert_eq!(teraio_trace_free(forward), TERAIO_OK);
        assert_eq!(teraio_trace_free(unlayered), TERAIO_OK);
        // NULL, made-up, wrong-kind and freed trace handles.
        assert_eq!(
            teraio_choose_checkpoint(null_mut(), std::ptr::null(), std::ptr::null(), &mut out),
            TERAIO_ERR_INVALID_HANDLE
        );
        assert!(last_error().contains("NULL"), "{}", last_error());
        let bogus = 0xdead_beef_usize as *mut teraio_trace;
        assert_eq!(
            teraio_choose_checkpoint(bogus, std::ptr::null(), std::ptr::null(), &mut out),
            TERAIO_ERR_INVALID_HANDLE
        );
        let mut buf = null_mut();
        assert_eq!(teraio_buffer_alloc(10, &mut buf), TERAIO_OK);
        assert_eq!(
            teraio_choose_checkpoint(buf.cast(), std::ptr::null(), std::ptr::null(), &mut out),
            TERAIO_ERR_INVALID_HANDLE
        );
        assert_eq!(teraio_buffer_free(buf), TERAIO_OK);
        assert_eq!(teraio_trace_free(t), TERAIO_OK);
        assert_eq!(
            teraio_choose_checkpoint(t, c_hw.as_ptr(), c_options.as_ptr(), &mut out),
            TERAIO_ERR_INVALID_HANDLE
        );
        assert!(last_error().contains("already freed"), "{}", last_error());
        assert!(out.is_null(), "nothing written on failure");
    }
}

/// A C-style allocator for the executor: heap memory, counted.
struct Heap {
    allocs: std::sync::atomic::AtomicU64,
    releases: std::sync::atomic::AtomicU64,
}

unsafe extern "C" fn heap_alloc(ctx: *mut c_void, _t: u32, bytes: u64, why: i32) -> *mut c_void {
    assert!(why == TERAIO_ALLOC_CREATE || why == TERAIO_ALLOC_PREFETCH);
    // SAFETY: ctx is the &Heap the test registered.
    let h = unsafe { &*(ctx as *const Heap) };
    h.allocs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // 256-byte aligned, as cudaMalloc (device mode takes these as device pointers)
    let layout = std::alloc::Layout::from_size_align(bytes as usize, 256).unwrap();
    // SAFETY: tensors have more than 0 bytes.
    unsafe { std::alloc::alloc_zeroed(layout) }.cast()
}

unsafe extern "C" fn heap_release(ctx: *mut c_void, _t: u32, p: *mut c_void, bytes: u64) {
    // SAFETY: ctx is the &Heap the test registered.
    let h = unsafe { &*(ctx as *const Heap) };
    h.releases.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let layout = std::alloc::Layout::from_size_align(bytes as usize, 256).unwrap();
    // SAFETY: only memory heap_alloc returned (with this layout) reaches release: the test
    // attaches globals from heap_alloc too.
    unsafe { std::alloc::dealloc(p.cast(), layout) };
}

#[test]
fn the_plan_executor_runs_planned_iterations_and_gives_every_tensor_back() {
    executor_iterations(false);
}

/// The same with the caller's memory as device memory (the engine's GPU emulation: the GPU data
/// paths, stream-ordered), as a C++ trainer with CUDA pointers drives it.
#[test]
fn the_plan_executor_moves_device_memory_in_stream_order() {
    executor_iterations(true);
}

fn executor_iterations(device: bool) {
    let dir = tempfile::tempdir().unwrap();
    let e = if device {
        let toml = cs(&format!(
            "dir = {:?}\nfiles = 2\nfile_size = \"64M\"\nworkers = 2\n[gpu]\ndevice = 0\nemulated = true\n",
            dir.path().display().to_string()
        ));
        let mut e = null_mut();
        // SAFETY: valid string and out-pointer.
        let s = unsafe { teraio_engine_open_toml(toml.as_ptr(), &mut e) };
        assert_eq!(s, TERAIO_OK, "{}", last_error());
        e
    } else {
        open(dir.path(), false)
    };
    let mut t = null_mut();
    let spec = cs(
        "preset:gpt2-small,layers=2,hidden=256,heads=4,kv-heads=4,ffn=1024,vocab=2000,seq=128,micro-batch=2",
    );
    // SAFETY: valid strings and out-pointers throughout; attached memory (leaked boxes from
    // heap_alloc's allocator) lives until released.
    unsafe {
        assert_eq!(teraio_trace_load(spec.as_ptr(), &mut t), TERAIO_OK, "{}", last_error());
        let mut json = null_mut();
        assert_eq!(teraio_trace_info(t, &mut json), TERAIO_OK);
        let info: serde_json::Value = serde_json::from_str(&take_string(json)).unwrap();
        let (peak, kernels) =
            (info["peak_resident_bytes"].as_u64().unwrap(), info["kernel_count"].as_u64().unwrap());
        let budget = peak * 3 / 4;
        let hw = cs(&format!(
            "{{\"gpu_memory_bytes\": {budget}, \"ssd_count\": 4, \"ssd_read_bytes_per_s\": 6.7e9, \
             \"ssd_write_bytes_per_s\": 6.5e9, \"ssd_latency_us\": 80, \
             \"pcie_h2d_bytes_per_s\": 5e10, \"pcie_d2h_bytes_per_s\": 5e10, \
             \"host_memory_cap_bytes\": 0, \"host_memory_bytes_per_s\": 1e11, \
             \"gpudirect\": true}}"
        ));
        let policy = cs("teraio");
        let mut plan = null_mut();
        assert_eq!(
            teraio_plan(t, policy.as_ptr(), hw.as_ptr(), &mut plan),
            TERAIO_OK,
            "{}",
            last_error()
        );
        let plan = CString::new(take_string(plan)).unwrap();
        // The tensors' sizes and globality: the same generator spec, from Rust.
        let spec_rs = spec.to_str().unwrap().strip_prefix("preset:").unwrap();
        let full =
            teraio_scheduler::generate(&teraio_scheduler::ModelConfig::from_spec(spec_rs).unwrap())
                .unwrap();
        let tensors: Vec<(u64, bool)> = full.tensors.iter().map(|x| (x.bytes, x.global)).collect();
        let heap = Heap { allocs: 0.into(), releases: 0.into() };
        let alloc = teraio_allocator {
            ctx: &heap as *const Heap as *mut c_void,
            alloc: Some(heap_alloc),
            release: Some(heap_release),
        };
        let mut ex = null_mut();
        assert_eq!(
            teraio_executor_new(e, t, plan.as_ptr(), budget, true, &alloc, &mut ex),
            TERAIO_OK,
            "{}",
            last_error()
        );
        if device {
            assert_eq!(teraio_executor_use_device_memory(ex, e, 0), TERAIO_OK, "{}", last_error());
        }
        // Globals: memory from the same allocator (so its release frees it), filled.
        for (i, &(bytes, global)) in tensors.iter().enumerate() {
            if global {
                let p = heap_alloc(alloc.ctx, i as u32, bytes, TERAIO_ALLOC_CREATE);
                std::slice::from_raw_parts_mut(p.cast::<u8>(), bytes as usize)
                    .copy_from_slice(&pattern(i as u64, bytes as usize));
                assert_eq!(
                    teraio_executor_attach(ex, i as u32, p, bytes),
                    TERAIO_OK,
                    "{}",
                    last_error()
                );
            }
        }
        assert_eq!(teraio_executor_start(ex), TERAIO_OK, "{}", last_error());
        for it in 0..2 {
            let mut freed = u64::MAX;
            for k in 0..kernels as usize {
                let mut stall = -1.0;
                assert_eq!(
                    teraio_executor_before_kernel(ex, k, &mut stall),
                    TERAIO_OK,
                    "{}",
                    last_error()
                );
                assert!(stall >= 0.0);
                if it == 1 && k == kernels as usize / 2 {
                    // The caller's allocator ran out: everything the kernel does not use leaves.
                    let r = teraio_executor_make_room(ex, k, u64::MAX, &mut freed);
                    assert_eq!(r, TERAIO_OK, "{}", last_error());
                }
                assert_eq!(teraio_executor_after_kernel(ex, k), TERAIO_OK);
            }
            let mut rep = null_mut();
            assert_eq!(teraio_executor_end_iteration(ex, &mut rep), TERAIO_OK, "{}", last_error());
            let r: serde_json::Value = serde_json::from_str(&take_string(rep)).unwrap();
            if it == 1 {
                let made = r["made_room"].as_u64().unwrap();
                assert!(freed != u64::MAX && freed > 0 && made > 0, "{freed} bytes, {r}");
                assert!(r["evictions"].as_u64().unwrap() >= made, "{r}");
            }
            assert!(r["peak_bytes"].as_u64().unwrap() <= budget, "{r}");
            assert!(r["offloads"].as_u64().unwrap() > 0 && r["prefetches"].as_u64().unwrap() > 0);
            assert!(r["diverged"].is_null());
        }
        // Between iterations, within no room at all: nothing read back, what is off stays off.
        let mut rep = null_mut();
        assert_eq!(
            teraio_executor_gather_globals_within(ex, 0, &mut rep),
            TERAIO_OK,
            "{}",
            last_error()
        );
        let g0: serde_json::Value = serde_json::from_str(&take_string(rep)).unwrap();
        assert_eq!(g0["read_back"], 0, "{g0}");
        assert!(g0["left_off"].as_u64().unwrap() > 0, "the plan leaves globals off the GPU: {g0}");
        // Then every global back (or keeping its memory while its write ends: those the first
        // call found in flight it counted).
        let mut rep = null_mut();
        assert_eq!(teraio_executor_gather_globals(ex, &mut rep), TERAIO_OK, "{}", last_error());
        let g: serde_json::Value = serde_json::from_str(&take_string(rep)).unwrap();
        let count = |r: &serde_json::Value| {
            r["kept_in_flight"].as_u64().unwrap() + r["kept_by_plan"].as_u64().unwrap()
        };
        let kept = count(&g0) + count(&g);
        assert_eq!(g["read_back"], g0["left_off"], "{g0} then {g}");
        let globals = tensors.iter().filter(|x| x.1).count() as u64;
        // Every resident global holds its bytes.
        let mut checked = 0;
        for (i, &(bytes, global)) in tensors.iter().enumerate() {
            let (mut p, mut len) = (null_mut(), 0u64);
            if global && teraio_executor_resident(ex, i as u32, &mut p, &mut len) == TERAIO_OK {
                assert_eq!(len, bytes);
                let got = std::slice::from_raw_parts(p.cast::<u8>(), len as usize);
                assert!(got == &pattern(i as u64, bytes as usize)[..], "global tensor {i}");
                checked += 1;
            }
        }
        assert!(checked > 0);
        // Off the GPU: at most the ones whose write was still in flight (some ended since).
        assert!(checked <= globals && checked + kept >= globals, "{checked} of {globals}: {g}");
        let first_global = tensors.iter().position(|x| x.1).unwrap() as u32;
        let first_local = tensors.iter().position(|x| !x.1).unwrap() as u32;
        assert_eq!(teraio_executor_modified(ex, first_global), TERAIO_OK, "{}", last_error());
        assert_eq!(teraio_executor_modified(ex, first_local), TERAIO_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("not a global tensor"), "{}", last_error());
        let mut ev = null_mut();
        assert_eq!(teraio_executor_events(ex, &mut ev), TERAIO_OK);
        assert!(take_string(ev).contains("released"));
        // A name that is not the trace's: diverged, once, then safe mode.
        assert_eq!(teraio_executor_before_kernel(ex, 0, null_mut()), TERAIO_OK);
        let bogus = cs("not-a-kernel");
        assert_eq!(teraio_executor_boundary(ex, 1, bogus.as_ptr()), TERAIO_ERR_DIVERGED);
        assert!(last_error().contains("diverged"), "{}", last_error());
        assert_eq!(teraio_executor_finish(ex), TERAIO_OK, "{}", last_error());
        assert_eq!(teraio_executor_finish(ex), TERAIO_ERR_INVALID_HANDLE);
        use std::sync::atomic::Ordering::Relaxed;
        assert_eq!(
            heap.allocs.load(Relaxed),
            heap.releases.load(Relaxed),
            "every buffer came back"
        );
        assert_eq!(teraio_trace_free(t), TERAIO_OK);
    }
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

/// 256-byte aligned host memory standing in for device memory on the engine's GPU emulation.
struct Aligned {
    buf: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize, fill: u8) -> Aligned {
        let buf = vec![fill; len + 256];
        let off = (256 - buf.as_ptr() as usize % 256) % 256;
        Aligned { buf, off, len }
    }
    fn addr(&mut self) -> u64 {
        self.buf[self.off..].as_mut_ptr() as u64
    }
    fn bytes(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

#[test]
fn device_pointers_offload_and_prefetch_in_stream_order_on_the_gpu_emulation() {
    let dir = tempfile::tempdir().unwrap();
    let toml = cs(&format!(
        "dir = {:?}\nfiles = 2\nfile_size = \"64M\"\n[gpu]\ndevice = 0\nemulated = true\nchunk = \"1M\"\n",
        dir.path().display().to_string()
    ));
    let mut e = null_mut();
    // SAFETY: valid string and out-pointer.
    let s = unsafe { teraio_engine_open_toml(toml.as_ptr(), &mut e) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    let len = (3 << 20) + 4096 + 48;
    let mut src = Aligned::new(len, 0);
    src.bytes_mut().copy_from_slice(&pattern(7, len));
    let mut op = null_mut();
    // SAFETY: src is live host memory (the emulation's device memory) until the op is waited.
    let s = unsafe {
        teraio_offload_device(
            e,
            7,
            src.addr(),
            len as u64,
            0,
            std::ptr::null(),
            TERAIO_DEST_SSD,
            TERAIO_PRIORITY_NORMAL,
            &mut op,
        )
    };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_wait(op, -1), TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_op_free(op), TERAIO_OK);
    let mut out = Aligned::new(len, 0xEE);
    // SAFETY: out is live and unused until the op is waited.
    let s = unsafe {
        teraio_prefetch_device(e, 7, out.addr(), len as u64, 0, TERAIO_PRIORITY_URGENT, &mut op)
    };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_wait(op, -1), TERAIO_OK, "{}", last_error());
    assert_eq!(teraio_op_free(op), TERAIO_OK);
    assert!(out.bytes() == src.bytes(), "the device prefetch brought other bytes");
    // misaligned, empty, wrong size: errors naming the problem
    // SAFETY: as above (refused before any access).
    let s = unsafe {
        teraio_offload_device(
            e,
            8,
            src.addr() + 1,
            100,
            0,
            std::ptr::null(),
            TERAIO_DEST_SSD,
            TERAIO_PRIORITY_NORMAL,
            &mut op,
        )
    };
    assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("misaligned"), "{}", last_error());
    // SAFETY: as above.
    let s =
        unsafe { teraio_prefetch_device(e, 7, out.addr(), 0, 0, TERAIO_PRIORITY_URGENT, &mut op) };
    assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT);
    assert_eq!(teraio_engine_close(e), TERAIO_OK);

    // an engine without a GPU says how to name one
    let plain = tempfile::tempdir().unwrap();
    let e = open(plain.path(), false);
    // SAFETY: refused before any access.
    let s = unsafe {
        teraio_offload_device(
            e,
            1,
            src.addr(),
            64,
            0,
            std::ptr::null(),
            TERAIO_DEST_SSD,
            TERAIO_PRIORITY_NORMAL,
            &mut op,
        )
    };
    assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("[gpu]"), "{}", last_error());
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}

#[test]
fn the_engine_measures_this_machine_into_a_hardware_model_plan_takes() {
    let dir = tempfile::tempdir().unwrap();
    let e = open(dir.path(), false);
    let mut json = null_mut();
    // SAFETY: valid out-pointer. (No cache: the test writes nothing outside its folder.)
    let s = unsafe {
        teraio_engine_measure_hardware(e, TERAIO_HW_NO_CACHE | TERAIO_HW_FRESH, &mut json)
    };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    let m: serde_json::Value = serde_json::from_str(&take_string(json)).unwrap();
    assert_eq!(m["source"], "measured");
    assert!(m["cache_path"].is_null());
    assert_eq!(m["hardware"]["ssd_count"], 2);
    assert!(m["report"]["array"]["write_bytes_per_s"].as_f64().is_some_and(|r| r > 0.0), "{m}");
    // The model is one teraio_plan takes.
    let mut trace = null_mut();
    // SAFETY: valid string and out-pointer.
    let s = unsafe { teraio_trace_load(cs("preset:gpt2-small").as_ptr(), &mut trace) };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    let mut hw = m["hardware"].clone();
    hw["gpu_memory_bytes"] = serde_json::json!(20_000_000_000u64);
    hw["ssd_capacity_bytes"] = serde_json::Value::Null;
    let mut plan = null_mut();
    // SAFETY: valid strings and out-pointer.
    let s = unsafe {
        teraio_plan(trace, cs("teraio").as_ptr(), cs(&hw.to_string()).as_ptr(), &mut plan)
    };
    assert_eq!(s, TERAIO_OK, "{}", last_error());
    take_string(plan);
    assert_eq!(teraio_trace_free(trace), TERAIO_OK);
    // Unknown flags are refused, naming them.
    let mut json = null_mut();
    // SAFETY: valid out-pointer.
    let s = unsafe { teraio_engine_measure_hardware(e, 8, &mut json) };
    assert_eq!(s, TERAIO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("flags 0x8"), "{}", last_error());
    assert!(json.is_null());
    assert_eq!(teraio_engine_close(e), TERAIO_OK);
}
