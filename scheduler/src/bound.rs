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
//! Recomputation trades reads for GPU time: `x` bytes remade within a window cost at least
//! what the window's cheapest `x` recomputable bytes cost (those it may remake: away at its
//! start and used again before its end), each tensor at its producer's time per byte rounded
//! down to a cost class (a factor of [`CLASS_STEP`] apart, [`CLASSES`] of them); the bound
//! takes the best `x`. The sum over
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
use crate::planner::PlanOptions;
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

/// Recomputation cost classes: class 0 costs nothing, class `c >= 1` at least the trace's
/// cheapest positive cost per byte times `CLASS_STEP^(c - 1)` (the last class takes every
/// dearer tensor at its floor).
const CLASSES: usize = 24;
const CLASS_STEP: f64 = 1.5;

/// One tensor as seen from a cut: its bytes and how far (in kernels) its next access, or its
/// last write, is; `usize::MAX` for never; its recomputation cost class if it can be remade.
#[derive(Clone, Copy)]
struct Seen {
    dist: usize,
    bytes: u64,
    class: Option<usize>,
}

/// Per cut: the tensors away-able there, sorted by distance, with prefix sums; the same for
/// the recomputable ones per cost class.
struct Cut {
    dist: Vec<usize>,
    /// Bytes of the first `i` entries.
    prefix: Vec<u64>,
    /// Bytes of the recomputable entries.
    total_rc: u64,
    /// Per cost class: distances of its entries (sorted) and prefix sums of their bytes.
    classes: Vec<(Vec<usize>, Vec<u64>)>,
}

impl Cut {
    fn new(mut seen: Vec<Seen>) -> Cut {
        seen.sort_unstable_by_key(|s| s.dist);
        let mut prefix = Vec::with_capacity(seen.len() + 1);
        let mut classes: Vec<(Vec<usize>, Vec<u64>)> = vec![(Vec::new(), vec![0]); CLASSES];
        let (mut a, mut total_rc) = (0u64, 0u64);
        prefix.push(0);
        for s in &seen {
            a = a.saturating_add(s.bytes);
            prefix.push(a);
            if let Some(c) = s.class {
                total_rc = total_rc.saturating_add(s.bytes);
                let (d, p) = &mut classes[c];
                let last = *p.last().unwrap_or(&0);
                d.push(s.dist);
                p.push(last.saturating_add(s.bytes));
            }
        }
        Cut { dist: seen.into_iter().map(|s| s.dist).collect(), prefix, total_rc, classes }
    }

    /// Bytes of the entries closer than `d`.
    fn closer_than(&self, d: usize) -> u64 {
        self.prefix[self.dist.partition_point(|&x| x < d)]
    }

    /// Bytes of the recomputable entries closer than `d`, per cost class.
    fn rc_closer_than(&self, d: usize) -> [u64; CLASSES] {
        let mut out = [0u64; CLASSES];
        for (o, (dist, p)) in out.iter_mut().zip(&self.classes) {
            *o = p[dist.partition_point(|&x| x < d)];
        }
        out
    }

    fn total(&self) -> u64 {
        *self.prefix.last().unwrap_or(&0)
    }
}

/// Per tensor, its recomputation cost class (`None`: not recomputable); and per class, the
/// floor of its cost, microseconds per byte.
fn cost_classes(trace: &Trace) -> (Vec<Option<usize>>, [f64; CLASSES]) {
    let rho: Vec<Option<f64>> = trace
        .tensors
        .iter()
        .map(|t| trace.recompute_us(t.id).map(|us| (us / t.bytes.max(1) as f64).max(0.0)))
        .collect();
    let base = rho.iter().flatten().copied().filter(|&r| r > 0.0).fold(f64::INFINITY, f64::min);
    let mut rate = [0.0; CLASSES];
    for (c, r) in rate.iter_mut().enumerate().skip(1) {
        *r = base * CLASS_STEP.powi(c as i32 - 1);
    }
    let class = rho
        .iter()
        .map(|r| {
            r.map(|r| {
                if r <= 0.0 || !base.is_finite() {
                    0
                } else {
                    // The largest class whose floor is at most r (rounding kept safe).
                    let mut c = 1 + ((r / base).ln() / CLASS_STEP.ln()).floor().max(0.0) as usize;
                    c = c.min(CLASSES - 1);
                    while c > 1 && rate[c] > r {
                        c -= 1;
                    }
                    c
                }
            })
        })
        .collect();
    (class, rate)
}

/// One window of the partition that gives the bound (see the module documentation): what
/// any plan spends at least between the start of kernel `start` and that of kernel `end`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BoundWindow {
    /// First kernel of the window.
    pub start: usize,
    /// The kernel after the window's last.
    pub end: usize,
    /// The window's share of the bound, microseconds.
    pub bound_us: f64,
    /// Its kernels' time, microseconds.
    pub kernels_us: f64,
    /// Bytes that must come back to the GPU within it (before recomputation).
    pub read_bytes: f64,
    /// Bytes that must leave the GPU within it.
    pub write_bytes: f64,
    /// Bytes of `read_bytes` the bound lets recomputation remake instead.
    pub recompute_bytes: f64,
}

/// The lower bound of `trace` on `hw` (see the module documentation).
pub fn lower_bound(trace: &Trace, hw: &Hardware) -> Result<Bound> {
    Ok(lower_bound_windows(trace, hw)?.0)
}

/// [`lower_bound`] over the plans `opts` allows: without recomputation (`opts.recompute`
/// false) no plan remakes a tensor, so neither does the bound (it is taken on the trace without
/// producers). The recomputing bound holds for those plans too, but loosely: it remakes an
/// activation for its producer's time and does not ask whether the producer's inputs are
/// resident.
pub fn lower_bound_for(trace: &Trace, hw: &Hardware, opts: &PlanOptions) -> Result<Bound> {
    if opts.recompute {
        return lower_bound(trace, hw);
    }
    let mut moved_only = trace.clone();
    for t in &mut moved_only.tensors {
        t.producer = None;
    }
    lower_bound(&moved_only, hw)
}

/// [`lower_bound`] and the windows of the partition that gives it, in order (empty when the
/// bound is the kernels' time alone or infinite): where the bound says time must go.
pub fn lower_bound_windows(trace: &Trace, hw: &Hardware) -> Result<(Bound, Vec<BoundWindow>)> {
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
        return Ok((bound, Vec::new()));
    }
    let mem = trace.resident_memory_per_kernel();
    let excess: Vec<u64> = mem.iter().map(|&m| m.saturating_sub(cap)).collect();
    if excess.iter().all(|&e| e == 0) {
        return Ok((bound, Vec::new()));
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
    let bw_both = (if hw.has_ssd() { hw.bandwidth(Resource::SsdDuplex) } else { 0.0 }
        + if has_host { hw.bandwidth(Resource::HostMemory) } else { 0.0 })
    .min(hw.bandwidth(Resource::PcieDuplex));
    // Recomputation cost classes (cheapest first).
    let (class, rate) = cost_classes(trace);

    // Tier capacity: what is away at a kernel and cannot be remade sits on a tier.
    let tiers =
        hw.host_memory_cap_bytes.saturating_add(hw.ssd_array_capacity_bytes().unwrap_or(u64::MAX));
    let cuts = cut_points(&starts, &excess);
    let reads: Vec<Cut> = cuts.iter().map(|&s| read_cut(trace, s, &class)).collect();
    let writes: Vec<Cut> = cuts.iter().map(|&e| write_cut(trace, e.saturating_sub(1))).collect();
    for (i, &s) in cuts.iter().enumerate() {
        if s < n {
            let rc = reads[i].total_rc;
            if excess[s].saturating_sub(rc) > tiers {
                bound.iteration_us = f64::INFINITY;
                bound.infeasible = Some(format!(
                    "at kernel {s} ({}) {} bytes must be off the GPU, more than the host tier \
                     and the SSD array hold ({tiers} bytes)",
                    trace.kernels[s].name, excess[s]
                ));
                return Ok((bound, Vec::new()));
            }
        }
    }
    // (the window's share, bytes to read, to write, to recompute)
    let window = |i: usize, j: usize| -> (f64, f64, f64, f64) {
        let (s, e) = (cuts[i], cuts[j]);
        let kernels_us = starts[e] - starts[s];
        let r = &reads[i];
        let close = r.closer_than(e - s);
        let far = r.total() - close;
        let need_read = excess[s].saturating_sub(far) as f64;
        let w = &writes[j];
        let need_write = if e > s + 1 {
            let recent = w.closer_than(e - s);
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
        let rc = r.rc_closer_than(e - s);
        let x_max = (rc.iter().sum::<u64>() as f64).min(need_read);
        if x_max <= 0.0 {
            return (kernels_us.max(io(0.0)), need_read, need_write, 0.0);
        }
        // Remaking x bytes costs at least g(x): the close recomputable bytes taken cheapest
        // class first, each at its class's floor (convex, piecewise linear, increasing).
        // max(kernels + g(x), io(x)) over x in [0, x_max]: the first term increases, io is
        // the max of non-increasing linear pieces, so their difference increases and the
        // minimum is where they cross (clamped to the range). Walk g's pieces to the one
        // where the difference turns >= 0, and solve there.
        let f_at = |x: f64, g: f64| (kernels_us + g).max(io(x));
        let (mut x0, mut g0) = (0.0, 0.0);
        let mut best = (f_at(0.0, 0.0), 0.0);
        for (c, &bytes) in rc.iter().enumerate() {
            if bytes == 0 || x0 >= x_max {
                continue;
            }
            let x1 = (x0 + bytes as f64).min(x_max);
            let g1 = g0 + rate[c] * (x1 - x0);
            if kernels_us + g1 >= io(x1) {
                // The crossing is in [x0, x1]: kernels + g0 + rate (x - x0) against each
                // piece of io, the largest meeting point.
                let a = kernels_us + g0 - rate[c] * x0;
                let meet = |slope: f64, at_zero: f64| {
                    if rate[c] + slope > 0.0 { (at_zero - a) / (rate[c] + slope) } else { x0 }
                };
                let mut x = meet(0.0, time(need_write, bw_write));
                for (bw, bytes) in [(bw_read, need_read), (bw_both, need_read + need_write)] {
                    if bytes > 0.0 {
                        x = x.max(if bw > 0.0 {
                            meet(1e6 / bw, bytes / bw * 1e6)
                        } else {
                            need_read
                        });
                    }
                }
                let x = if x.is_nan() { x0 } else { x.clamp(x0, x1) };
                for (xx, gg) in [(x, g0 + rate[c] * (x - x0)), (x0, g0), (x1, g1)] {
                    let v = f_at(xx, gg);
                    if v < best.0 {
                        best = (v, xx);
                    }
                }
                return (best.0, need_read, need_write, best.1);
            }
            let v = f_at(x1, g1);
            if v < best.0 {
                best = (v, x1);
            }
            (x0, g0) = (x1, g1);
        }
        (best.0, need_read, need_write, best.1)
    };
    // best[j]: the largest sum over partitions of [cuts[0], cuts[j]), from cut from[j].
    let m = cuts.len();
    let mut best = vec![0.0f64; m];
    let mut from = vec![0usize; m];
    for j in 1..m {
        let (i, b) = best[..j]
            .iter()
            .enumerate()
            .map(|(i, &b)| (i, b + window(i, j).0))
            .fold((0, f64::NEG_INFINITY), |a, c| if c.1 > a.1 { c } else { a });
        best[j] = b;
        from[j] = i;
    }
    bound.iteration_us = best[m - 1].max(compute_us);
    let mut windows = Vec::new();
    let mut j = m - 1;
    while j > 0 {
        let i = from[j];
        let (bound_us, read_bytes, write_bytes, recompute_bytes) = window(i, j);
        windows.push(BoundWindow {
            start: cuts[i],
            end: cuts[j],
            bound_us,
            kernels_us: starts[cuts[j]] - starts[cuts[i]],
            read_bytes,
            write_bytes,
            recompute_bytes,
        });
        j = i;
    }
    windows.reverse();
    if !bound.iteration_us.is_finite() {
        bound.infeasible = Some(
            "some bytes must leave or return to the GPU and there is neither an SSD nor a host \
             tier to hold them"
                .into(),
        );
    }
    Ok((bound, windows))
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
fn read_cut(trace: &Trace, s: usize, class: &[Option<usize>]) -> Cut {
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
        seen.push(Seen { dist, bytes: t.bytes, class: class[t.id.0 as usize] });
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
        seen.push(Seen { dist, bytes: t.bytes, class: None });
    }
    Cut::new(seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every recomputable tensor's class floor is at most its cost per byte (so the bound
    /// never charges a recomputation more than it costs), and within a class step of it
    /// below the last class.
    #[test]
    fn cost_classes_are_floors() {
        let trace = crate::model::generate(
            &crate::ModelConfig::from_spec("llama3-8b,layers=2,dtype=bf16").unwrap(),
        )
        .unwrap();
        let (class, rate) = cost_classes(&trace);
        let mut seen = 0;
        for t in &trace.tensors {
            let Some(c) = class[t.id.index()] else {
                assert!(trace.recompute_us(t.id).is_none());
                continue;
            };
            let rho = trace.recompute_us(t.id).unwrap() / t.bytes as f64;
            assert!(rate[c] <= rho, "{}: floor {} above {rho}", t.name, rate[c]);
            if c + 1 < CLASSES && c > 0 {
                assert!(rho < rate[c] * CLASS_STEP * (1.0 + 1e-9), "{}: class {c} too low", t.name);
            }
            seen += 1;
        }
        assert!(seen > 0);
    }
}
