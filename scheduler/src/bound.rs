//! A lower bound on the iteration time of every plan for a trace, a hardware model and a GPU
//! budget: how far any planner could still get, so a plan's time can be judged against it.
//!
//! # The relaxation
//! Cut the iteration at kernel boundaries into consecutive windows `[s, e)`. In any plan the
//! time from the start of kernel `s` to the start of kernel `e` is at least
//! - the kernels' time of the window, plus the recomputations that run in it;
//! - the bytes that must come back to the GPU within it, over the fastest prefetch paths: at
//!   the start of kernel `s` at least `excess(s)` = (all-resident memory at `s`) - (GPU
//!   budget) bytes of live tensors are not in GPU memory (a prefetch holds its memory from
//!   issue, so these reads have not started); those whose next access falls before `e` must
//!   be read back, or recomputed, before it. The plan chooses which tensors are away: the
//!   bound takes the choice that needs the fewest reads (tensors used again latest first);
//! - the bytes that must leave within it, over the fastest offload paths: at the start of
//!   kernel `e - 1`, `excess(e - 1)` bytes are away, and those last written by a kernel in
//!   `[s, e - 1)` were copied after that write (a GPU write invalidates every copy; a
//!   recomputable tensor needs no copy, so it counts as free);
//! - reads and writes together over the SSD array's combined budget plus host memory's.
//!
//! Recomputation trades reads for GPU time: `x` bytes remade cost at least `x` times the
//! cheapest producer's time per byte in the trace; the bound takes the best `x`. The sum over
//! a partition of the iteration is a bound; a dynamic program picks the best partition among
//! windows cut at up to [`MAX_CUTS`] boundaries (evenly spaced in time, plus where the excess
//! starts, ends and peaks).
//!
//! It holds for plans that run every kernel on the GPU (every policy but `zero-infinity`,
//! whose CPU optimizer step is not a GPU kernel) and for one iteration measured from its start,
//! whatever state the previous iteration left: it needs no steady state. It ignores
//! bandwidth shared by the two directions of PCIe (separate resources), transfer latencies,
//! and the tiers' capacities beyond an up-front check, so it is optimistic, never pessimistic.

use serde::{Deserialize, Serialize};

use crate::Result;
use crate::analysis::largest_working_set;
use crate::hardware::{Hardware, Resource, Tier};
use crate::trace::Trace;

/// Largest number of window boundaries the dynamic program cuts at.
pub const MAX_CUTS: usize = 768;

/// The lower bound of a trace on a hardware model (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bound {
    /// No plan runs an iteration faster than this, microseconds (infinite when none runs it
    /// at all: see `infeasible`).
    pub iteration_us: f64,
    /// The kernels' time alone (the ideal iteration), microseconds.
    pub compute_us: f64,
    /// Least GPU memory any plan needs: the largest working set, bytes.
    pub min_gpu_bytes: u64,
    /// The kernel with that working set.
    pub min_gpu_kernel: usize,
    /// Why no plan can run the trace on this hardware, if none can.
    pub infeasible: Option<String>,
}

impl Bound {
    /// How much slower than the bound an iteration of `iteration_us` is, percent (0: at
    /// the bound). `None` for an infinite bound.
    pub fn gap_percent(&self, iteration_us: f64) -> Option<f64> {
        self.iteration_us
            .is_finite()
            .then(|| 100.0 * (iteration_us / self.iteration_us - 1.0).max(0.0))
    }
}

/// One tensor as seen from a cut: its bytes and how far (in kernels) its next access, or its
/// last write, is; `usize::MAX` for never.
#[derive(Clone, Copy)]
struct Seen {
    dist: usize,
    bytes: u64,
    recomputable: bool,
}

/// Per cut: the tensors away-able there, sorted by distance, with prefix sums.
struct Cut {
    dist: Vec<usize>,
    /// Bytes of the first `i` entries (all, and recomputable only).
    prefix: Vec<u64>,
    prefix_rc: Vec<u64>,
}

impl Cut {
    fn new(mut seen: Vec<Seen>) -> Cut {
        seen.sort_unstable_by_key(|s| s.dist);
        let mut prefix = Vec::with_capacity(seen.len() + 1);
        let mut prefix_rc = Vec::with_capacity(seen.len() + 1);
        let (mut a, mut r) = (0u64, 0u64);
        prefix.push(0);
        prefix_rc.push(0);
        for s in &seen {
            a = a.saturating_add(s.bytes);
            r = r.saturating_add(if s.recomputable { s.bytes } else { 0 });
            prefix.push(a);
            prefix_rc.push(r);
        }
        Cut { dist: seen.into_iter().map(|s| s.dist).collect(), prefix, prefix_rc }
    }

    /// (bytes, recomputable bytes) of the entries closer than `d`.
    fn closer_than(&self, d: usize) -> (u64, u64) {
        let i = self.dist.partition_point(|&x| x < d);
        (self.prefix[i], self.prefix_rc[i])
    }

    fn total(&self) -> u64 {
        *self.prefix.last().unwrap_or(&0)
    }
}

/// The lower bound of `trace` on `hw` (see the module documentation).
pub fn lower_bound(trace: &Trace, hw: &Hardware) -> Result<Bound> {
    trace.validate()?;
    hw.validate()?;
    let n = trace.kernel_count();
    let starts = trace.kernel_starts_us();
    let compute_us = starts[n];
    let (ws_kernel, ws_bytes) = largest_working_set(trace);
    let cap = hw.gpu_memory_bytes;
    let mut bound = Bound {
        iteration_us: compute_us,
        compute_us,
        min_gpu_bytes: ws_bytes,
        min_gpu_kernel: ws_kernel,
        infeasible: None,
    };
    if ws_bytes > cap {
        bound.iteration_us = f64::INFINITY;
        bound.infeasible = Some(format!(
            "kernel {ws_kernel} ({}) accesses {ws_bytes} bytes at once, more than the {cap} \
             bytes of GPU memory",
            trace.kernels[ws_kernel].name
        ));
        return Ok(bound);
    }
    let mem = trace.resident_memory_per_kernel();
    let excess: Vec<u64> = mem.iter().map(|&m| m.saturating_sub(cap)).collect();
    if excess.iter().all(|&e| e == 0) {
        return Ok(bound);
    }
    let has_host = hw.host_memory_cap_bytes > 0;
    let path_bw = |has: bool, path: Vec<Resource>| if has { hw.path_bandwidth(&path) } else { 0.0 };
    let bw_read = hw.pcie_h2d_bytes_per_s.min(
        path_bw(hw.has_ssd(), hw.prefetch_path(Tier::Ssd))
            + path_bw(has_host, hw.prefetch_path(Tier::Host)),
    );
    let bw_write = hw.pcie_d2h_bytes_per_s.min(
        path_bw(hw.has_ssd(), hw.offload_path(Tier::Ssd))
            + path_bw(has_host, hw.offload_path(Tier::Host)),
    );
    let bw_both = if hw.has_ssd() { hw.bandwidth(Resource::SsdDuplex) } else { 0.0 }
        + if has_host { hw.bandwidth(Resource::HostMemory) } else { 0.0 };
    // Cheapest recomputation, microseconds per byte.
    let rho = trace
        .tensors
        .iter()
        .filter_map(|t| trace.recompute_us(t.id).map(|us| us / t.bytes as f64))
        .fold(f64::INFINITY, f64::min);

    // Tier capacity: what is away at a kernel and cannot be remade sits on a tier.
    let tiers =
        hw.host_memory_cap_bytes.saturating_add(hw.ssd_array_capacity_bytes().unwrap_or(u64::MAX));
    let cuts = cut_points(&starts, &excess);
    let reads: Vec<Cut> = cuts.iter().map(|&s| read_cut(trace, s)).collect();
    let writes: Vec<Cut> = cuts.iter().map(|&e| write_cut(trace, e.saturating_sub(1))).collect();
    for (i, &s) in cuts.iter().enumerate() {
        if s < n {
            let rc = reads[i].prefix_rc.last().copied().unwrap_or(0);
            if excess[s].saturating_sub(rc) > tiers {
                bound.iteration_us = f64::INFINITY;
                bound.infeasible = Some(format!(
                    "at kernel {s} ({}) {} bytes must be off the GPU, more than the host tier \
                     and the SSD array hold ({tiers} bytes)",
                    trace.kernels[s].name, excess[s]
                ));
                return Ok(bound);
            }
        }
    }
    let window = |i: usize, j: usize| -> f64 {
        let (s, e) = (cuts[i], cuts[j]);
        let kernels_us = starts[e] - starts[s];
        let r = &reads[i];
        let (close, close_rc) = r.closer_than(e - s);
        let far = r.total() - close;
        let need_read = excess[s].saturating_sub(far) as f64;
        let w = &writes[j];
        let need_write = if e > s + 1 {
            let (recent, _) = w.closer_than(e - s);
            excess[e - 1].saturating_sub(w.total() - recent) as f64
        } else {
            0.0
        };
        let time = |bytes: f64, bw: f64| {
            if bytes <= 0.0 {
                0.0
            } else if bw > 0.0 {
                bytes / bw * 1e6
            } else {
                f64::INFINITY
            }
        };
        let io = |x: f64| {
            time(need_read - x, bw_read)
                .max(time(need_write, bw_write))
                .max(time(need_read - x + need_write, bw_both))
        };
        let x_max = (close_rc as f64).min(need_read);
        if x_max <= 0.0 || !rho.is_finite() {
            return kernels_us.max(io(0.0));
        }
        let f = |x: f64| (kernels_us + rho * x).max(io(x));
        if rho <= 0.0 {
            // Free recomputation: remake all it may (io is non-increasing in x).
            return f(x_max);
        }
        // max(kernels + rho x, io(x)) over x in [0, x_max]: the first term increases, io is
        // the max of non-increasing linear pieces. Below the largest x where the first term
        // meets a piece, that piece alone is above it; above it, the first term is the max:
        // the minimum is at that x (clamped to the range).
        let meet = |slope_us_per_byte: f64, at_zero_us: f64| {
            // kernels + rho x = at_zero - slope x
            (at_zero_us - kernels_us) / (rho + slope_us_per_byte)
        };
        let mut x = (time(need_write, bw_write) - kernels_us) / rho;
        for (bw, bytes) in [(bw_read, need_read), (bw_both, need_read + need_write)] {
            if bytes <= 0.0 {
                continue;
            }
            x = x.max(if bw > 0.0 { meet(1e6 / bw, bytes / bw * 1e6) } else { need_read });
        }
        let x = if x.is_nan() { 0.0 } else { x.clamp(0.0, x_max) };
        f(x).min(f(0.0)).min(f(x_max))
    };
    // best[j]: the largest sum over partitions of [cuts[0], cuts[j]).
    let m = cuts.len();
    let mut best = vec![0.0f64; m];
    for j in 1..m {
        best[j] = best[..j]
            .iter()
            .enumerate()
            .map(|(i, &b)| b + window(i, j))
            .fold(f64::NEG_INFINITY, f64::max);
    }
    bound.iteration_us = best[m - 1].max(compute_us);
    if !bound.iteration_us.is_finite() {
        bound.infeasible = Some(
            "some bytes must leave or return to the GPU and there is neither an SSD nor a host \
             tier to hold them"
                .into(),
        );
    }
    Ok(bound)
}

/// Window boundaries: 0 and `n`, evenly spaced times, and where the excess starts, ends and
/// peaks (subsampled to [`MAX_CUTS`] in all).
fn cut_points(starts: &[f64], excess: &[u64]) -> Vec<usize> {
    let n = excess.len();
    let total = starts[n];
    let mut v = vec![0, n];
    let even = MAX_CUTS / 3;
    for i in 1..even {
        let t = total * i as f64 / even as f64;
        v.push(starts.partition_point(|&x| x < t).min(n));
    }
    let mut events = Vec::new();
    for k in 0..n {
        let prev = if k == 0 { 0 } else { excess[k - 1] };
        let next = excess.get(k + 1).copied().unwrap_or(0);
        let edge = (excess[k] > 0) != (prev > 0);
        let peak = excess[k] > 0 && excess[k] >= prev && excess[k] >= next;
        if edge || peak {
            events.push(k);
        }
    }
    let room = MAX_CUTS.saturating_sub(v.len()).max(1);
    let step = events.len().div_ceil(room).max(1);
    v.extend(events.iter().step_by(step));
    if let Some(peak) = (0..n).max_by_key(|&k| excess[k]) {
        v.push(peak);
        v.push(peak + 1);
    }
    v.sort_unstable();
    v.dedup();
    v
}

/// The tensors that can be away at the start of kernel `s` (alive, not accessed by it), by
/// how many kernels later they are next accessed (`MAX`: not again before they die, or
/// for a global tensor not again in this iteration).
fn read_cut(trace: &Trace, s: usize) -> Cut {
    let n = trace.kernel_count();
    if s >= n {
        return Cut::new(Vec::new());
    }
    let mut seen = Vec::new();
    for t in &trace.tensors {
        if !t.alive_at(s, n) || t.accesses.binary_search(&s).is_ok() {
            continue;
        }
        let i = t.accesses.partition_point(|&k| k <= s);
        let dist = t.accesses.get(i).map_or(usize::MAX, |&k| k - s);
        seen.push(Seen { dist, bytes: t.bytes, recomputable: t.recomputable().is_some() });
    }
    Cut::new(seen)
}

/// The tensors that can be away at the start of kernel `p`, by how many kernels before `p`
/// they were last written (`MAX`: never in this iteration, never at all, or recomputable: a
/// copy needs no write within the window).
fn write_cut(trace: &Trace, p: usize) -> Cut {
    let n = trace.kernel_count();
    if p >= n {
        return Cut::new(Vec::new());
    }
    let mut seen = Vec::new();
    for t in &trace.tensors {
        if !t.alive_at(p, n) || t.accesses.binary_search(&p).is_ok() {
            continue;
        }
        let last_write = t.accesses[..t.accesses.partition_point(|&k| k < p)]
            .iter()
            .rev()
            .find(|&&k| t.writes_at(k));
        let recomputable = t.recomputable().is_some();
        let dist = match last_write {
            Some(&w) if !recomputable => p - w,
            _ => usize::MAX,
        };
        seen.push(Seen { dist, bytes: t.bytes, recomputable });
    }
    Cut::new(seen)
}
