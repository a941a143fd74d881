//! Inputs at the edges of their types: kernel durations near `f64::MAX`, tensor sizes whose
//! sums would wrap, iteration counts a caller sets, a UTF-8 byte order mark. Each is refused
//! with an error that names the kernel, tensor or argument, or accepted and summed right.

use std::time::{Duration, Instant};

use teraio_scheduler::analysis::summarize;
use teraio_scheduler::{
    Error, Hardware, Kernel, Plan, Policy, SimOptions, Tensor, TensorId, TensorKind, Trace, plan,
    simulate,
};

/// `n` kernels of 100 us and one global tensor per entry of `sizes`, accessed by kernel 0.
fn trace(n: usize, sizes: &[u64]) -> Trace {
    let mut t = Trace::new("limits");
    for i in 0..n {
        t.kernels.push(Kernel { name: format!("k{i}"), duration_us: 100.0, layer: None });
    }
    for (i, &bytes) in sizes.iter().enumerate() {
        t.tensors.push(Tensor {
            id: TensorId(i as u32),
            name: format!("big{i}"),
            bytes,
            kind: TensorKind::Weight,
            global: true,
            created_by: None,
            accesses: vec![0],
            dies_after: None,
            writes: Some(vec![]),
            producer: None,
        });
    }
    t
}

fn trace_error(r: teraio_scheduler::Result<impl std::fmt::Debug>) -> (String, String) {
    match r {
        Err(Error::InvalidTrace { path, detail }) => (path, detail),
        other => panic!("expected an invalid trace, got {other:?}"),
    }
}

#[test]
fn kernel_durations_beyond_the_maximum_are_refused_naming_the_kernel() {
    for d in [1e308, f64::MAX, 1e12 * 1.5, f64::INFINITY, -1.0] {
        let mut t = trace(3, &[4096]);
        t.kernels[1].name = "mb0.L7.attn".into();
        t.kernels[1].duration_us = d;
        let (path, detail) = trace_error(t.validate());
        assert_eq!(path, "kernels[1].duration_us");
        assert!(detail.contains("\"mb0.L7.attn\"") && detail.contains("1e12"), "{detail}");
        // The same from JSON (infinity has no JSON spelling).
        if d.is_finite() {
            let (path, _) = trace_error(Trace::from_json(&t.to_json()));
            assert_eq!(path, "kernels[1].duration_us");
        }
    }
    let mut t = trace(3, &[4096]);
    t.kernels[1].duration_us = Kernel::DURATION_US_MAX;
    t.validate().unwrap();
}

#[test]
fn tensor_sizes_whose_sums_would_wrap_are_refused_naming_the_tensor() {
    // The trace: tensors of 2^62 bytes. Each counts twice (its size and its access).
    let t = trace(2, &[1 << 62, 1 << 62, 1 << 62, 1 << 62]);
    let (path, detail) = trace_error(t.validate());
    assert_eq!(path, "tensors[1].bytes");
    assert!(detail.contains("\"big1\"") && detail.contains("2^64"), "{detail}");
    assert!(Trace::from_json(&t.to_json()).is_err());
    let t = trace(2, &[u64::MAX]);
    assert_eq!(trace_error(t.validate()).0, "tensors[0].bytes");
    // Sums that fit are right: no wrap, no more than 100% active.
    let t = trace(2, &[1 << 61, 1 << 61, 1 << 61]);
    t.validate().unwrap();
    let s = summarize(&t);
    assert_eq!(s.total_tensor_bytes, 3 << 61);
    assert_eq!(s.peak_resident_bytes, 3 << 61);
    assert!(s.max_active_fraction <= 1.0 + 1e-12, "{}", s.max_active_fraction);
    assert_eq!(s.min_gpu_bytes, 3 << 61);
}

#[test]
fn more_iterations_than_the_maximum_are_refused_at_once() {
    let t = trace(4, &[4096, 8192]);
    let hw = Hardware::paper();
    let p = plan(&t, &hw, Policy::Teraio).unwrap();
    let start = Instant::now();
    for iterations in [0, SimOptions::ITERATIONS_MAX + 1, u32::MAX as usize, usize::MAX] {
        let e = simulate(&t, &p, &hw, &SimOptions { iterations, record_timeline: false })
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("iterations {iterations}")) && e.contains("at most 1000"),
            "{e}"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(2), "{:?}", start.elapsed());
    let opts = SimOptions { iterations: SimOptions::ITERATIONS_MAX, record_timeline: false };
    simulate(&t, &p, &hw, &opts).unwrap();
}

#[test]
fn a_byte_order_mark_is_skipped_in_traces_and_plans() {
    let t = trace(4, &[4096, 8192]);
    let back = Trace::from_json(&format!("\u{feff}{}", t.to_json())).unwrap();
    assert_eq!(back, t);
    let p = plan(&t, &Hardware::paper(), Policy::Teraio).unwrap();
    let q = Plan::from_json(&format!("\u{feff}{}", p.to_json())).unwrap();
    assert_eq!(q.to_json(), p.to_json());
}
