//! Lifetime analysis: active and inactive intervals of every tensor, and the paper's
//! characterization (fraction of memory active over time, inactive-period and size
//! distributions).
//!
//! A tensor is *active* while a kernel that accesses it runs. An *inactive interval* is the
//! gap between two consecutive accesses `a < b` with at least one kernel between them: kernels
//! `a+1 .. b-1`. For a global tensor the gap after its last access wraps around into the next
//! iteration: `b` is then `first_access + kernel_count` (an unrolled index, `>= kernel_count`),
//! and its time is measured across the iteration boundary.

use serde::{Deserialize, Serialize};

use crate::trace::{TensorId, TensorKind, Trace};

/// A run of kernels `[start_kernel, end_kernel)` (unrolled: `end_kernel` may exceed the kernel
/// count for wrap-around) and its time span in an all-resident run, microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Span {
    /// First kernel of the span.
    pub start_kernel: usize,
    /// One past the last kernel (unrolled).
    pub end_kernel: usize,
    /// Start time, microseconds from iteration start.
    pub start_us: f64,
    /// End time, microseconds from iteration start (may exceed the iteration time).
    pub end_us: f64,
}

impl Span {
    /// Length in microseconds.
    pub fn duration_us(&self) -> f64 {
        self.end_us - self.start_us
    }
}

/// An inactive interval of one tensor: the candidate unit of every planner.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct InactiveInterval {
    /// The tensor.
    pub tensor: TensorId,
    /// Its size, bytes.
    pub bytes: u64,
    /// Last access before the gap (kernel index `< kernel_count`).
    pub last_access: usize,
    /// Next access after the gap (unrolled: `>= kernel_count` when it wraps).
    pub next_access: usize,
    /// The kernels of the gap: `last_access + 1 .. next_access`.
    pub span: Span,
    /// Whether the gap crosses the iteration boundary.
    pub wraps: bool,
    /// The tensor's latest writing kernel at or before `last_access` (cyclically for a
    /// global tensor: in the previous iteration if it comes before the first write of this
    /// one); `None` if nothing ever writes it. Intervals with the same `last_write` form one
    /// *epoch*: an SSD copy made in one of them is still valid in the later ones (clean drops).
    pub last_write: Option<usize>,
    /// Accesses after `last_write` up to and including `last_access` (0: `last_access`
    /// itself writes). Orders the intervals of one epoch.
    pub reads_since_write: usize,
}

/// Active and inactive spans of one tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorLifetime {
    /// The tensor.
    pub tensor: TensorId,
    /// Runs of consecutive accessing kernels.
    pub active: Vec<Span>,
    /// Gaps between accesses (see [`InactiveInterval`]).
    pub inactive: Vec<Span>,
}

/// Unrolled start time of kernel `k` (k may be in `[n, 2n]`).
pub(crate) fn time_at(starts: &[f64], k: usize) -> f64 {
    let n = starts.len() - 1;
    if k <= n { starts[k] } else { starts[n] + starts[k - n] }
}

/// Every inactive interval of the trace, tensor by tensor.
pub fn inactive_intervals(trace: &Trace) -> Vec<InactiveInterval> {
    let n = trace.kernel_count();
    let starts = trace.kernel_starts_us();
    let mut out = Vec::new();
    for t in &trace.tensors {
        let acc = &t.accesses;
        let m = acc.len();
        // Index of the latest writing access at or before each access (cyclic for globals).
        let mut last_w: Vec<Option<usize>> = Vec::with_capacity(m);
        let mut cur = if t.global { (0..m).rev().find(|&j| t.writes_at(acc[j])) } else { None };
        for (j, &k) in acc.iter().enumerate() {
            if t.writes_at(k) {
                cur = Some(j);
            }
            last_w.push(cur);
        }
        let epoch = |j: usize| -> (Option<usize>, usize) {
            match last_w[j] {
                None => (None, 0),
                Some(w) if w <= j => (Some(acc[w]), j - w),
                Some(w) => (Some(acc[w]), j + m - w), // written in the previous iteration
            }
        };
        let mut push = |j: usize, a: usize, b: usize, wraps: bool| {
            if b > a + 1 {
                let (last_write, reads_since_write) = epoch(j);
                out.push(InactiveInterval {
                    tensor: t.id,
                    bytes: t.bytes,
                    last_access: a,
                    next_access: b,
                    span: Span {
                        start_kernel: a + 1,
                        end_kernel: b,
                        start_us: time_at(&starts, a + 1),
                        end_us: time_at(&starts, b),
                    },
                    wraps,
                    last_write,
                    reads_since_write,
                });
            }
        };
        for (j, w) in acc.windows(2).enumerate() {
            push(j, w[0], w[1], false);
        }
        if t.global
            && let (Some(&first), Some(&last)) = (acc.first(), acc.last())
        {
            push(m - 1, last, first + n, true);
        }
    }
    out
}

/// Active and inactive spans of every tensor.
pub fn lifetimes(trace: &Trace) -> Vec<TensorLifetime> {
    let starts = trace.kernel_starts_us();
    let mut by_tensor: Vec<Vec<Span>> = vec![Vec::new(); trace.tensors.len()];
    for iv in inactive_intervals(trace) {
        by_tensor[iv.tensor.index()].push(iv.span);
    }
    trace
        .tensors
        .iter()
        .zip(by_tensor)
        .map(|(t, inactive)| {
            let mut active: Vec<Span> = Vec::new();
            for &k in &t.accesses {
                match active.last_mut() {
                    Some(s) if s.end_kernel == k => {
                        s.end_kernel = k + 1;
                        s.end_us = starts[k + 1];
                    }
                    _ => active.push(Span {
                        start_kernel: k,
                        end_kernel: k + 1,
                        start_us: starts[k],
                        end_us: starts[k + 1],
                    }),
                }
            }
            TensorLifetime { tensor: t.id, active, inactive }
        })
        .collect()
}

/// A histogram bucket `[low, high)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bucket {
    /// Label, e.g. `10-100 ms`.
    pub label: String,
    /// How many items fall in it.
    pub count: usize,
    /// Their total bytes.
    pub bytes: u64,
}

/// Bytes of tensors of one kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KindBytes {
    /// The kind.
    pub kind: TensorKind,
    /// Tensor count.
    pub count: usize,
    /// Total bytes.
    pub bytes: u64,
}

/// The characterization of a trace, like the paper's section 2.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Trace name.
    pub name: String,
    /// Kernels.
    pub kernels: usize,
    /// Tensors.
    pub tensors: usize,
    /// All-resident iteration time, microseconds.
    pub iteration_time_us: f64,
    /// Sum of all tensor sizes, bytes.
    pub total_tensor_bytes: u64,
    /// Peak memory if nothing moves, bytes.
    pub peak_resident_bytes: u64,
    /// Time-weighted mean over kernels of active bytes / allocated bytes.
    pub mean_active_fraction: f64,
    /// Largest per-kernel active fraction.
    pub max_active_fraction: f64,
    /// Inactive intervals.
    pub inactive_intervals: usize,
    /// Fraction of inactive intervals longer than 10 ms.
    pub inactive_over_10ms_fraction: f64,
    /// Inactive intervals by length.
    pub inactive_period_histogram: Vec<Bucket>,
    /// Tensors by size.
    pub tensor_size_histogram: Vec<Bucket>,
    /// Tensors by kind.
    pub by_kind: Vec<KindBytes>,
    /// The least GPU memory any plan can run the trace in: the largest working set (see
    /// [`largest_working_set`]), bytes.
    #[serde(default)]
    pub min_gpu_bytes: u64,
    /// The kernel with that working set.
    #[serde(default)]
    pub min_gpu_kernel: usize,
}

/// The kernel that needs the most bytes resident at once, and those bytes: every tensor it
/// accesses (creations included) must be in GPU memory while it runs, so no plan runs the
/// trace in less GPU memory. (And every trace runs in that much, given room on a tier for the
/// rest: on-demand swapping moves everything else away around each kernel.) The first such
/// kernel on ties.
pub fn largest_working_set(trace: &Trace) -> (usize, u64) {
    let mut ws = vec![0u64; trace.kernel_count()];
    for t in &trace.tensors {
        for &k in &t.accesses {
            ws[k] = ws[k].saturating_add(t.bytes);
        }
    }
    let mut best = (0, 0);
    for (k, &b) in ws.iter().enumerate() {
        if b > best.1 {
            best = (k, b);
        }
    }
    best
}

/// Analyse a trace. Sums saturate; a validated trace ([`Trace::validate`]) has none that
/// would overflow.
pub fn summarize(trace: &Trace) -> Summary {
    let n = trace.kernel_count();
    let mem = trace.resident_memory_per_kernel();
    let mut active = vec![0u64; n];
    for t in &trace.tensors {
        for &k in &t.accesses {
            active[k] = active[k].saturating_add(t.bytes);
        }
    }
    let total_time = trace.iteration_time_us();
    let mut weighted = 0.0;
    let mut max_frac: f64 = 0.0;
    for k in 0..n {
        let f = if mem[k] > 0 { active[k] as f64 / mem[k] as f64 } else { 0.0 };
        weighted += f * trace.kernels[k].duration_us;
        max_frac = max_frac.max(f);
    }
    let mean = if total_time > 0.0 { weighted / total_time } else { 0.0 };
    let intervals = inactive_intervals(trace);
    let edges_us =
        [(0.0, "<1 ms"), (1e3, "1-10 ms"), (1e4, "10-100 ms"), (1e5, "0.1-1 s"), (1e6, ">=1 s")];
    let mut periods: Vec<Bucket> =
        edges_us.iter().map(|(_, l)| Bucket { label: (*l).into(), count: 0, bytes: 0 }).collect();
    let mut over_10ms = 0;
    for iv in &intervals {
        let d = iv.span.duration_us();
        if d > 1e4 {
            over_10ms += 1;
        }
        let i = edges_us.iter().rposition(|(lo, _)| d >= *lo).unwrap_or(0);
        periods[i].count += 1;
        periods[i].bytes = periods[i].bytes.saturating_add(iv.bytes);
    }
    let size_edges = [
        (0u64, "<1 MB"),
        (1 << 20, "1-10 MB"),
        (10 << 20, "10-100 MB"),
        (100 << 20, "100 MB-1 GB"),
        (1 << 30, ">=1 GB"),
    ];
    let mut sizes: Vec<Bucket> =
        size_edges.iter().map(|(_, l)| Bucket { label: (*l).into(), count: 0, bytes: 0 }).collect();
    for t in &trace.tensors {
        let i = size_edges.iter().rposition(|(lo, _)| t.bytes >= *lo).unwrap_or(0);
        sizes[i].count += 1;
        sizes[i].bytes = sizes[i].bytes.saturating_add(t.bytes);
    }
    let by_kind = TensorKind::ALL
        .iter()
        .map(|&kind| {
            let (count, bytes) = trace
                .tensors
                .iter()
                .filter(|t| t.kind == kind)
                .fold((0, 0u64), |(c, b), t| (c + 1, b.saturating_add(t.bytes)));
            KindBytes { kind, count, bytes }
        })
        .collect();
    Summary {
        name: trace.name.clone(),
        kernels: n,
        tensors: trace.tensors.len(),
        iteration_time_us: total_time,
        total_tensor_bytes: trace.tensors.iter().fold(0u64, |s, t| s.saturating_add(t.bytes)),
        peak_resident_bytes: mem.iter().copied().max().unwrap_or(0),
        mean_active_fraction: mean,
        max_active_fraction: max_frac,
        inactive_intervals: intervals.len(),
        inactive_over_10ms_fraction: if intervals.is_empty() {
            0.0
        } else {
            over_10ms as f64 / intervals.len() as f64
        },
        inactive_period_histogram: periods,
        tensor_size_histogram: sizes,
        by_kind,
        min_gpu_bytes: largest_working_set(trace).1,
        min_gpu_kernel: largest_working_set(trace).0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Kernel, Tensor};

    #[test]
    fn wrap_around_interval_of_global_tensor() {
        let mut t = Trace::new("w");
        for i in 0..6 {
            t.kernels.push(Kernel { name: format!("k{i}"), duration_us: 1.0, layer: None });
        }
        t.tensors.push(Tensor {
            id: TensorId(0),
            name: "w".into(),
            bytes: 8,
            kind: TensorKind::Weight,
            global: true,
            created_by: None,
            accesses: vec![1, 2, 4],
            dies_after: None,
            writes: None,
            producer: None,
        });
        t.validate().unwrap();
        let iv = inactive_intervals(&t);
        assert_eq!(iv.len(), 2);
        assert_eq!((iv[0].last_access, iv[0].next_access, iv[0].wraps), (2, 4, false));
        assert_eq!((iv[1].last_access, iv[1].next_access, iv[1].wraps), (4, 7, true));
        assert_eq!(iv[1].span.duration_us(), 2.0);
        let lt = lifetimes(&t);
        assert_eq!(lt[0].active.len(), 2); // [1,3) and [4,5)
        assert_eq!(lt[0].active[0].end_kernel, 3);
        let s = summarize(&t);
        assert_eq!(s.inactive_intervals, 2);
        assert!((s.mean_active_fraction - 0.5).abs() < 1e-9);
        // Every access writes (no `writes`): each interval is an epoch of its own.
        assert_eq!((iv[0].last_write, iv[0].reads_since_write), (Some(2), 0));
        assert_eq!((iv[1].last_write, iv[1].reads_since_write), (Some(4), 0));
    }

    #[test]
    fn epochs_follow_writes_cyclically() {
        let mut t = Trace::new("w");
        for i in 0..8 {
            t.kernels.push(Kernel { name: format!("k{i}"), duration_us: 1.0, layer: None });
        }
        // Read at 1, 3, 5; written at 7 (an optimizer step): one epoch from the write at 7 of
        // the previous iteration over the wrap gap (7, 9) and the gaps (1, 3), (3, 5).
        t.tensors.push(Tensor {
            id: TensorId(0),
            name: "w".into(),
            bytes: 8,
            kind: TensorKind::Weight,
            global: true,
            created_by: None,
            accesses: vec![1, 3, 5, 7],
            dies_after: None,
            writes: Some(vec![7]),
            producer: None,
        });
        // Created (written) at 0, read at 2, written at 4, read at 6.
        t.tensors.push(Tensor {
            id: TensorId(1),
            name: "g".into(),
            bytes: 8,
            kind: TensorKind::Gradient,
            global: false,
            created_by: Some(0),
            accesses: vec![0, 2, 4, 6],
            dies_after: Some(6),
            writes: Some(vec![0, 4]),
            producer: None,
        });
        t.validate().unwrap();
        let got: Vec<(u32, usize, Option<usize>, usize)> = inactive_intervals(&t)
            .iter()
            .map(|iv| (iv.tensor.0, iv.last_access, iv.last_write, iv.reads_since_write))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 1, Some(7), 1),
                (0, 3, Some(7), 2),
                (0, 5, Some(7), 3),
                (0, 7, Some(7), 0),
                (1, 0, Some(0), 0),
                (1, 2, Some(0), 1),
                (1, 4, Some(4), 0),
            ]
        );
        t.tensors[0].writes = Some(Vec::new());
        assert!(
            inactive_intervals(&t)
                .iter()
                .filter(|iv| iv.tensor.0 == 0)
                .all(|iv| iv.last_write.is_none())
        );
    }
}
