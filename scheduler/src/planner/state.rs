//! The shared planning state of the bandwidth-aware policies (`teraio`, `g10`): the memory
//! curve over kernels, the per-slot bandwidth budgets with their skip lists, the host-tier and
//! SSD occupancy, and the intervals chosen so far (see the `planner` module documentation).

use std::collections::HashMap;

use super::tree::ExcessTree;
use crate::analysis::{InactiveInterval, time_at};
use crate::hardware::{Hardware, Resource, Tier};
use crate::plan::{InitialPlacement, Instruction, Plan, PlanStats, Recompute};
use crate::trace::{TensorId, Trace};

/// Where a chosen interval's transfers fall.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fit {
    pub tier: Tier,
    /// Last slot (unrolled kernel index) the offload uses.
    pub offload_end: usize,
    /// First slot (unrolled) the prefetch uses = its issue boundary.
    pub prefetch_start: usize,
    /// Offload time + prefetch time, microseconds.
    pub cost_us: f64,
    /// Area above capacity removed, byte-microseconds.
    pub benefit: f64,
    /// The offload is a clean drop (an SSD copy of this epoch exists): no write, the memory
    /// is free from slot `last_access + 1` (`offload_end` = `last_access`).
    pub clean: bool,
    /// Not moved but dropped and recomputed before `next_access` (`tier` is meaningless):
    /// the memory is free over the whole interval, `cost_us` is the producer's GPU time.
    pub recompute: bool,
}

/// Skip list over slots whose budget is exhausted (monotone: budgets only shrink).
#[derive(Clone)]
pub(super) struct Skip {
    pub(super) next: Vec<u32>,
    pub(super) prev: Vec<u32>,
}

impl Skip {
    pub(super) fn new(len: usize) -> Self {
        Skip { next: (0..len as u32 + 1).collect(), prev: (0..len as u32 + 1).collect() }
    }
    /// First live slot >= s (len if none).
    pub(super) fn next_live(&mut self, s: usize) -> usize {
        let mut r = s;
        while self.next[r] as usize != r {
            r = self.next[r] as usize;
        }
        let mut c = s;
        while self.next[c] as usize != r {
            let nx = self.next[c] as usize;
            self.next[c] = r as u32;
            c = nx;
        }
        r
    }
    /// Last live slot <= s, shifted by one (0 = none; slot i is stored at i+1).
    pub(super) fn prev_live(&mut self, s: usize) -> Option<usize> {
        let s1 = s + 1;
        let mut r = s1;
        while self.prev[r] as usize != r {
            r = self.prev[r] as usize;
        }
        let mut c = s1;
        while self.prev[c] as usize != r {
            let nx = self.prev[c] as usize;
            self.prev[c] = r as u32;
            c = nx;
        }
        if r == 0 { None } else { Some(r - 1) }
    }
    pub(super) fn kill(&mut self, s: usize) {
        self.next[s] = (s + 1) as u32;
        self.prev[s + 1] = s as u32;
    }
}

/// Shared planning state (see the module documentation).
#[derive(Clone)]
pub(crate) struct State<'a> {
    pub trace: &'a Trace,
    pub hw: &'a Hardware,
    pub n: usize,
    pub starts: Vec<f64>,
    pub dur: Vec<f64>,
    pub mem: ExcessTree,
    /// The same curve with every kernel weighted 1 instead of by its duration: the forced
    /// phase's benefit. Its aim is fitting, and a kernel of 1 us above capacity runs out of
    /// memory as surely as a long one; time-weighted area would rank it last.
    pub(super) mem_kernels: ExcessTree,
    pub host: ExcessTree,
    /// Remaining bytes per resource per slot (length n).
    pub(super) budget: [Vec<f64>; Resource::COUNT],
    /// Skip structure per resource over unrolled slots [0, 2n).
    pub(super) skip: Vec<Skip>,
    pub chosen: Vec<(InactiveInterval, Fit)>,
    pub evaluations: usize,
    /// Second phase: place transfers at nominal bandwidth, ignoring what earlier choices
    /// reserved (they will share bandwidth and stall), to resolve what the first phase could
    /// not.
    pub relaxed: bool,
    /// Third phase, when even nominal bandwidth leaves memory above capacity: intervals too
    /// short (in time) for their transfers are taken anyway, offloaded right after their last
    /// use and fetched right before their next one ([`State::fit`]). They stall, as on-demand
    /// swapping would, instead of the plan running out of memory.
    pub forced: bool,
    pub(super) retiming: bool,
    pub peak_resident: u64,
    /// Per (tensor, epoch = last write): the earliest position (`reads_since_write`) of a
    /// chosen SSD interval; later intervals of the epoch are clean drops.
    pub(super) ssd_epochs: HashMap<(TensorId, usize), usize>,
    /// SSD array occupancy by copies (`plan` module, "Tier space") minus its capacity, per
    /// kernel; planners keep it <= 0. `None`: unlimited.
    pub(super) ssd: Option<ExcessTree>,
    /// Per non-global tensor with a chosen SSD write: the boundary its copy is held from (to
    /// its death). A global tensor with one holds it all the time (value 0).
    pub(super) ssd_hold: HashMap<TensorId, usize>,
    /// Whether recomputation is a candidate in the current phase.
    pub recompute: bool,
    /// Remake a dropped input for a recomputation even where memory at that kernel has no
    /// room for it ([`super::RecomputeIn::Eager`]).
    pub eager_chains: bool,
    /// [`super::Mode::recompute_weight`].
    pub recompute_weight: f64,
    /// [`super::Mode::keep_ssd`].
    pub keep_ssd: bool,
    /// Relaxed phase: when above 0, its choices take their transfers off the budgets
    /// ([`State::reserve_nominal`]) and a transfer's cost counts the bytes it places beyond
    /// what is left of them, at their time at nominal bandwidth times this weight (they will
    /// wait). 0 (the paper's relaxed phase): neither.
    pub relaxed_load: f64,
    /// Kernels at which a tensor must be resident: an input of a chosen recomputation.
    pub(super) pins: HashMap<TensorId, Vec<usize>>,
    /// Chosen moves per tensor: (last access, next access unrolled).
    pub(super) moved: HashMap<TensorId, Vec<(usize, usize)>>,
    /// Chosen recomputations per tensor: (last access, next access).
    pub(super) dropped: HashMap<TensorId, Vec<(usize, usize)>>,
    /// Index in `chosen` of each chosen recomputation, by (tensor, last access).
    pub(super) dropped_at: HashMap<(TensorId, usize), usize>,
    /// Bytes each kernel needs resident while it runs: what it accesses, and the inputs of
    /// the recomputations before it.
    pub(super) working: Vec<u64>,
}

pub(super) const EXHAUSTED_BYTES: f64 = 1.0;

impl<'a> State<'a> {
    pub fn new(trace: &'a Trace, hw: &'a Hardware) -> Self {
        let n = trace.kernel_count();
        let starts = trace.kernel_starts_us();
        let dur: Vec<f64> = trace.kernels.iter().map(|k| k.duration_us).collect();
        let resident = trace.resident_memory_per_kernel();
        let cap = hw.gpu_memory_bytes.min(i64::MAX as u64) as i64;
        let excess: Vec<i64> = resident.iter().map(|&m| m as i64 - cap).collect();
        let host_cap = hw.host_memory_cap_bytes.min(i64::MAX as u64 / 2) as i64;
        let budget = Resource::ALL.map(|r| {
            let bw = if r.is_ssd() && !hw.has_ssd() { 0.0 } else { hw.bandwidth(r) };
            dur.iter().map(|d| bw * d * 1e-6).collect::<Vec<f64>>()
        });
        let mut skip: Vec<Skip> = (0..Resource::COUNT).map(|_| Skip::new(2 * n)).collect();
        for (ri, b) in budget.iter().enumerate() {
            for (s, &v) in b.iter().enumerate() {
                if v < EXHAUSTED_BYTES {
                    skip[ri].kill(s);
                    skip[ri].kill(s + n);
                }
            }
        }
        State {
            trace,
            hw,
            n,
            mem: ExcessTree::new(&excess, &dur),
            mem_kernels: ExcessTree::new(&excess, &vec![1.0; n]),
            host: ExcessTree::new(&vec![-host_cap; n], &dur),
            starts,
            dur,
            budget,
            skip,
            chosen: Vec::new(),
            evaluations: 0,
            relaxed: false,
            forced: false,
            retiming: false,
            peak_resident: resident.iter().copied().max().unwrap_or(0),
            ssd_epochs: HashMap::new(),
            ssd: hw.ssd_array_capacity_bytes().filter(|_| hw.has_ssd()).map(|c| {
                let c = c.min(i64::MAX as u64 / 2) as i64;
                ExcessTree::new(&vec![-c; n], &vec![1.0; n])
            }),
            ssd_hold: HashMap::new(),
            recompute: false,
            eager_chains: false,
            recompute_weight: 1.0,
            keep_ssd: false,
            relaxed_load: 0.0,
            pins: HashMap::new(),
            moved: HashMap::new(),
            dropped: HashMap::new(),
            dropped_at: HashMap::new(),
            working: {
                let mut w = vec![0u64; n];
                for t in &trace.tensors {
                    for &k in &t.accesses {
                        w[k] = w[k].saturating_add(t.bytes);
                    }
                }
                w
            },
        }
    }

    pub(super) fn avail(&self, path: &[Resource], slot: usize) -> f64 {
        let s = slot % self.n;
        if self.relaxed {
            let bw = path.iter().map(|&r| self.hw.bandwidth(r)).fold(f64::INFINITY, f64::min);
            return bw * self.dur[s] * 1e-6;
        }
        self.budget_left(path, slot)
    }

    /// Bytes every resource of `path` can still carry in `slot` by the reserved budgets.
    pub(super) fn budget_left(&self, path: &[Resource], slot: usize) -> f64 {
        let s = slot % self.n;
        path.iter().map(|r| self.budget[r.index()][s]).fold(f64::INFINITY, f64::min)
    }

    /// First slot >= s where every resource of `path` has budget left.
    pub(super) fn next_live(&mut self, path: &[Resource], mut s: usize) -> usize {
        if self.relaxed {
            return s.min(2 * self.n);
        }
        loop {
            let mut m = s;
            for r in path {
                m = m.max(self.skip[r.index()].next_live(s.min(2 * self.n)));
            }
            if m == s || m >= 2 * self.n {
                return m;
            }
            s = m;
        }
    }

    /// Last slot <= s where every resource of `path` has budget left.
    pub(super) fn prev_live(&mut self, path: &[Resource], mut s: usize) -> Option<usize> {
        if self.relaxed {
            return Some(s);
        }
        loop {
            let mut m = s;
            for r in path {
                m = m.min(self.skip[r.index()].prev_live(s)?);
            }
            if m == s {
                return Some(m);
            }
            s = m;
        }
    }

    /// Split unrolled `[l, r)` into at most two ranges within `[0, n)`.
    pub fn ranges(&self, l: usize, r: usize) -> [(usize, usize); 2] {
        let n = self.n;
        if r <= n {
            [(l, r), (0, 0)]
        } else if l >= n {
            [(l - n, r - n), (0, 0)]
        } else {
            [(l, n), (0, r - n)]
        }
    }

    /// Where an interval's offload and prefetch would go on `tier` given the budgets so far,
    /// and the area it would remove; `None` if it does not fit or saves nothing. In the
    /// [`State::forced`] phase an interval too short for its transfers still fits (see there).
    pub fn fit(&mut self, iv: &InactiveInterval, tier: Tier) -> Option<Fit> {
        self.evaluations += 1;
        if tier == Tier::Ssd && !self.hw.has_ssd() {
            return None;
        }
        if self.pinned_inside(iv) {
            return None;
        }
        let timed = self.fit_timed(iv, tier);
        if timed.is_none() && self.forced { self.fit_forced(iv, tier) } else { timed }
    }

    /// [`State::fit`] for the forced phase: the offload is issued at `a + 1` and the memory
    /// counted free from there, the prefetch issued at boundary `b` (urgent: kernel `b` waits
    /// for it). The kernels of the interval wait for the offload when they need its memory
    /// and kernel `b` for the prefetch: stalls, but the iteration fits.
    pub(super) fn fit_forced(&mut self, iv: &InactiveInterval, tier: Tier) -> Option<Fit> {
        let (a, b) = (iv.last_access, iv.next_access);
        if !self.host_room(iv, tier) {
            return None;
        }
        let benefit = self.benefit(iv, a + 1, b)?;
        let clean = tier == Tier::Ssd && self.is_clean(iv);
        let rate = |path: &[Resource]| {
            path.iter().map(|&r| self.hw.bandwidth(r)).fold(f64::INFINITY, f64::min)
        };
        let size = iv.bytes as f64;
        let off_us = if clean { 0.0 } else { size / rate(&self.hw.offload_path(tier)) * 1e6 };
        let pre_us = size / rate(&self.hw.prefetch_path(tier)) * 1e6;
        if tier == Tier::Ssd && !clean && !self.ssd_room(iv, a) {
            return None;
        }
        Some(Fit {
            tier,
            offload_end: a,
            prefetch_start: b,
            cost_us: (off_us + pre_us).max(1e-3),
            benefit,
            clean,
            recompute: false,
        })
    }

    /// [`State::fit`] with transfers placed by bandwidth (budgets, or nominal when relaxed).
    pub(super) fn fit_timed(&mut self, iv: &InactiveInterval, tier: Tier) -> Option<Fit> {
        // Cheapest test first: a full host tier rules the placement out.
        if !self.host_room(iv, tier) {
            return None;
        }
        let (a, b) = (iv.last_access, iv.next_access);
        let size = iv.bytes as f64;
        let off_path = self.hw.offload_path(tier);
        let pre_path = self.hw.prefetch_path(tier);
        let clean = tier == Tier::Ssd && self.is_clean(iv);
        let load = self.relaxed && self.relaxed_load > 0.0;
        let mut over = 0.0;
        let mut left;
        let (e, off_end_us) = if clean {
            // A clean drop: no write, the memory is free from boundary a+1.
            (a, time_at(&self.starts, a + 1))
        } else {
            // Offload: forward from slot a+1.
            left = size;
            let mut s = a + 1;
            loop {
                s = self.next_live(&off_path, s);
                if s + 1 >= b {
                    return None; // needs at least one slot for the prefetch and one saved kernel
                }
                let av = self.avail(&off_path, s);
                if load {
                    over += (av.min(left) - self.budget_left(&off_path, s)).max(0.0);
                }
                if av >= left {
                    break (s, time_at(&self.starts, s) + self.dur[s % self.n] * (left / av));
                }
                left -= av;
                s += 1;
            }
        };
        // Prefetch: backward from slot b-1, strictly after e+1 (one saved kernel at least).
        left = size;
        let mut p = b - 1;
        let pre_start_us;
        loop {
            let q = self.prev_live(&pre_path, p)?;
            if q <= e + 1 {
                return None;
            }
            p = q;
            let av = self.avail(&pre_path, p);
            if load {
                over += (av.min(left) - self.budget_left(&pre_path, p)).max(0.0);
            }
            if av >= left {
                pre_start_us = time_at(&self.starts, p + 1) - self.dur[p % self.n] * (left / av);
                break;
            }
            left -= av;
            p -= 1;
        }
        if tier == Tier::Ssd && !clean && !self.ssd_room(iv, e) {
            return None;
        }
        let benefit = self.benefit(iv, e + 1, p)?;
        let mut cost_us =
            (off_end_us - time_at(&self.starts, a + 1)) + (time_at(&self.starts, b) - pre_start_us);
        if load && over > 0.0 {
            let rate = |path: &[Resource]| {
                path.iter().map(|&r| self.hw.bandwidth(r)).fold(f64::INFINITY, f64::min)
            };
            let bw = rate(&off_path).min(rate(&pre_path));
            cost_us += self.relaxed_load * over / bw * 1e6;
        }
        Some(Fit {
            tier,
            offload_end: e,
            prefetch_start: p,
            cost_us: cost_us.max(1e-3),
            benefit,
            clean,
            recompute: false,
        })
    }

    /// Whether `iv`'s tensor must be resident at a kernel strictly inside the interval (an
    /// input of a chosen recomputation there): then it can be neither moved nor dropped over
    /// the whole interval.
    pub(super) fn pinned_inside(&self, iv: &InactiveInterval) -> bool {
        let n = self.n;
        self.pins.get(&iv.tensor).is_some_and(|pins| {
            pins.iter().any(|&p| {
                (iv.last_access < p && p < iv.next_access)
                    || (iv.last_access < p + n && p + n < iv.next_access)
            })
        })
    }

    /// The chosen recomputation gap of `x` strictly around kernel `k`, if any.
    pub(super) fn dropped_across(&self, x: TensorId, k: usize) -> Option<(usize, usize)> {
        self.dropped.get(&x)?.iter().copied().find(|&(a, b)| a < k && k < b)
    }

    /// What remaking `x`, dropped across kernel `k`, right before `k` costs (GPU time, bytes
    /// more in memory at `k`: `x` and the inputs `k` does not hold anyway), if its own inputs
    /// are alive, unchanged and not away there (one level: no input of `x` is itself remade).
    pub(super) fn remake_at(&self, x: TensorId, k: usize) -> Option<(f64, u64)> {
        let n = self.n;
        let xt = self.trace.tensor(x);
        let (p, c) = (xt.recomputable()?, xt.created_by?);
        let mut bytes = xt.bytes;
        for &y in &p.inputs {
            let yt = self.trace.tensor(y);
            if !yt.alive_at(k, n)
                || yt.accesses.iter().any(|&j| c < j && j < k && yt.writes_at(j))
                || self.away_at(y, k)
            {
                return None;
            }
            let pinned = self.pins.get(&y).is_some_and(|v| v.contains(&k));
            if yt.accesses.binary_search(&k).is_err() && !pinned {
                bytes += yt.bytes;
            }
        }
        Some((self.trace.recompute_us(x)?, bytes))
    }

    /// Pin `x` in GPU memory at kernel `k` (an input of a recomputation there), counting its
    /// bytes in `k`'s working set the first time.
    pub(super) fn pin(&mut self, x: TensorId, k: usize) {
        let accessed = self.trace.tensor(x).accesses.binary_search(&k).is_ok();
        let pins = self.pins.entry(x).or_default();
        if !accessed && !pins.contains(&k) {
            self.working[k] = self.working[k].saturating_add(self.trace.tensor(x).bytes);
        }
        pins.push(k);
    }

    /// Whether a chosen move or recomputation of `x` keeps it away at kernel `k`.
    pub(super) fn away_at(&self, x: TensorId, k: usize) -> bool {
        let n = self.n;
        let across = |&(a, b): &(usize, usize)| (a < k && k < b) || (a < k + n && k + n < b);
        self.moved.get(&x).is_some_and(|v| v.iter().any(across))
            || self.dropped.get(&x).is_some_and(|v| v.iter().any(across))
    }

    /// Ranges (within `[0, n)`) over which an SSD write of `iv` ending at slot `e` adds the
    /// tensor's bytes to the array's occupancy ("Tier space" in the `plan` module): a first
    /// copy held to the tensor's death (for a global tensor, always), an earlier start of the
    /// hold, or a second copy while a new one is written over the old.
    pub(super) fn ssd_adds(&self, iv: &InactiveInterval, e: usize) -> Vec<(usize, usize)> {
        let n = self.n;
        let t = self.trace.tensor(iv.tensor);
        let start = iv.last_access + 1;
        let hold = self.ssd_hold.get(&iv.tensor).copied();
        let mut out = Vec::new();
        if t.global {
            match hold {
                None => out.push((0, n)),
                Some(_) => out.extend(self.ranges(start, e + 1)),
            }
        } else {
            let death = t.free_kernel(n) + 1;
            match hold {
                None => out.push((start.min(death), death)),
                Some(h) if h > start => out.push((start, h)),
                Some(_) => out.push((start.min(death), (e + 1).min(death))),
            }
        }
        out.retain(|&(l, r)| l < r);
        out
    }

    /// Whether the SSD array has room for an SSD write of `iv` ending at slot `e`.
    pub(super) fn ssd_room(&mut self, iv: &InactiveInterval, e: usize) -> bool {
        if self.retiming || self.ssd.is_none() {
            return true;
        }
        let adds = self.ssd_adds(iv, e);
        let Some(tree) = self.ssd.as_mut() else { return true };
        adds.iter().all(|&(l, r)| tree.range_max(l, r).saturating_add(iv.bytes as i64) <= 0)
    }

    /// Recomputing `iv`'s tensor instead of keeping it over the interval: `None` unless it is
    /// recomputable and allowed now, its next access is a kernel of its own or one where a
    /// chosen recomputation needs it (a chain), the producer's
    /// inputs are alive, unchanged since the creation and in GPU memory at that kernel (no
    /// chosen move or recomputation keeps them away), and the kernel's working set with the
    /// inputs still fits.
    pub fn fit_recompute(&mut self, iv: &InactiveInterval) -> Option<Fit> {
        if !self.recompute || iv.wraps || self.pinned_inside(iv) {
            return None;
        }
        self.evaluations += 1;
        let n = self.n;
        let t = self.trace.tensor(iv.tensor);
        let (p, c) = (t.recomputable()?, t.created_by?);
        let duration_us = self.trace.recompute_us(iv.tensor)?;
        let (a, b) = (iv.last_access, iv.next_access);
        // Remade for its own next access, or for a recomputation that needs it there (the
        // end of a half split at a pin: a chain).
        let pinned = self.pins.get(&iv.tensor).is_some_and(|v| v.contains(&b));
        if b >= n || (t.accesses.binary_search(&b).is_err() && !pinned) {
            return None;
        }
        let mut extra = 0u64;
        let mut cost_us = duration_us;
        for &x in &p.inputs {
            let xt = self.trace.tensor(x);
            if !xt.alive_at(b, n) {
                return None;
            }
            if xt.accesses.iter().any(|&k| c < k && k < b && xt.writes_at(k)) {
                return None;
            }
            if self.dropped_across(x, b).is_some() {
                // Dropped itself: remade at `b` too (a chain), if its own inputs are there
                // and the memory at `b` has room for it.
                let room = self.mem.range_max(b, b + 1).saturating_add(x_bytes(self.trace, x)) <= 0;
                if !room && !self.eager_chains {
                    return None;
                }
                let (more_us, more_bytes) = self.remake_at(x, b)?;
                cost_us += more_us;
                extra += more_bytes;
                continue;
            }
            if self.away_at(x, b) {
                return None;
            }
            let pinned = self.pins.get(&x).is_some_and(|v| v.contains(&b));
            if xt.accesses.binary_search(&b).is_err() && !pinned {
                extra += xt.bytes;
            }
        }
        if self.working[b].saturating_add(extra) > self.hw.gpu_memory_bytes {
            return None;
        }
        let benefit = self.benefit(iv, a + 1, b)?;
        Some(Fit {
            tier: Tier::Ssd,
            offload_end: a,
            prefetch_start: b,
            cost_us: cost_us.max(1e-3),
            benefit,
            clean: false,
            recompute: true,
        })
    }

    /// Cut the chosen recomputation gap `(a, b)` of `x` at kernel `k` (where another
    /// recomputation needs it): `x` is remade right before `k` (its inputs pinned there),
    /// holds memory while `k` runs, and is dropped again after it until `b`.
    pub(super) fn split_drop(&mut self, x: TensorId, (a, b): (usize, usize), k: usize) {
        let Some(&ci) = self.dropped_at.get(&(x, a)) else { return };
        let (iv, fit) = self.chosen[ci];
        let cost = self.trace.recompute_us(x).unwrap_or(0.0).max(1e-3);
        self.chosen[ci] = (
            InactiveInterval { next_access: k, ..iv },
            Fit { prefetch_start: k, cost_us: cost, ..fit },
        );
        if let Some(v) = self.dropped.get_mut(&x) {
            v.retain(|&g| g != (a, b));
            v.push((a, k));
        }
        self.shift_memory(x_bytes(self.trace, x), k, k + 1);
        if b > k + 1 {
            self.dropped.entry(x).or_default().push((k, b));
            self.dropped_at.insert((x, k), self.chosen.len());
            let rest = InactiveInterval { last_access: k, ..iv };
            self.chosen.push((rest, Fit { offload_end: k, prefetch_start: b, ..fit }));
        } else {
            // Used again right after: it stays.
            self.shift_memory(x_bytes(self.trace, x), k + 1, b);
        }
        let inputs = self.trace.tensor(x).producer.clone().map(|p| p.inputs);
        for y in inputs.unwrap_or_default() {
            self.pin(y, k);
        }
    }

    /// Whether the host tier has room for `iv` (always true for the SSD, and when re-timing
    /// a choice that already holds its room). Held from the offload's issue until the
    /// prefetch completes, which may be after boundary `b` issues (while kernel `b` waits):
    /// kernel `b` counts too.
    pub(super) fn host_room(&mut self, iv: &InactiveInterval, tier: Tier) -> bool {
        if tier != Tier::Host || self.retiming {
            return true;
        }
        let ranges = self.ranges(iv.last_access + 1, iv.next_access + 1);
        let worst = ranges.iter().map(|&(l, r)| self.host.range_max(l, r)).max();
        worst.unwrap_or(i64::MIN) + iv.bytes as i64 <= 0
    }

    /// Area above capacity removed by freeing `iv`'s bytes over unrolled kernels `[l, r)`;
    /// `None` if nothing.
    pub(super) fn benefit(&mut self, iv: &InactiveInterval, l: usize, r: usize) -> Option<f64> {
        let benefit = self.excess_removed(iv.bytes, l, r);
        (benefit > 0.0).then_some(benefit)
    }

    /// Excess removed by freeing `bytes` over unrolled kernels `[l, r)`: area (bytes x time)
    /// in the bandwidth-aware phases, bytes summed per kernel in the forced one.
    pub(super) fn excess_removed(&mut self, bytes: u64, l: usize, r: usize) -> f64 {
        let ranges = self.ranges(l, r);
        let tree = if self.forced { &mut self.mem_kernels } else { &mut self.mem };
        ranges.iter().map(|&(a, b)| tree.clamp_sum(a, b, bytes as i64)).sum()
    }

    /// Lower the memory curve by `bytes` over unrolled kernels `[l, r)`.
    pub(super) fn free_memory(&mut self, bytes: u64, l: usize, r: usize) {
        self.shift_memory(-(bytes as i64), l, r);
    }

    /// Add `delta` bytes to the memory curve over unrolled kernels `[l, r)`.
    pub(super) fn shift_memory(&mut self, delta: i64, l: usize, r: usize) {
        for (a, b) in self.ranges(l, r) {
            self.mem.add(a, b, delta);
            self.mem_kernels.add(a, b, delta);
        }
    }

    /// The wear pass ([`super::Mode::wear`]), after planning: every chosen SSD write, largest
    /// first, is undone where the memory curve stays within capacity without it (the tensor
    /// stays resident), else moved to the host tier where that has room over the interval.
    /// A write whose copy later clean drops of its epoch rely on is kept.
    pub fn reduce_writes(&mut self) {
        let is_write = |f: &Fit| !f.recompute && f.tier == Tier::Ssd && !f.clean;
        let mut epochs: HashMap<(TensorId, usize), Vec<(usize, usize)>> = HashMap::new();
        for (ci, (iv, f)) in self.chosen.iter().enumerate() {
            if let (Some(w), false, Tier::Ssd) = (iv.last_write, f.recompute, f.tier) {
                epochs.entry((iv.tensor, w)).or_default().push((iv.reads_since_write, ci));
            }
        }
        let mut order: Vec<usize> =
            (0..self.chosen.len()).filter(|&i| is_write(&self.chosen[i].1)).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(self.chosen[i].0.bytes), i));
        let mut removed = vec![false; self.chosen.len()];
        for ci in order {
            let (iv, fit) = self.chosen[ci];
            let relied_on = iv.last_write.is_some_and(|w| {
                epochs[&(iv.tensor, w)]
                    .iter()
                    .any(|&(r, j)| j != ci && !removed[j] && r > iv.reads_since_write)
            });
            if relied_on {
                continue;
            }
            let before = self.mem.max().max(0);
            self.shift_memory(iv.bytes as i64, fit.offload_end + 1, fit.prefetch_start);
            if self.mem.max() <= before {
                removed[ci] = true;
                continue;
            }
            self.free_memory(iv.bytes, fit.offload_end + 1, fit.prefetch_start);
            if self.hw.host_memory_cap_bytes >= iv.bytes && self.host_room(&iv, Tier::Host) {
                for (l, r) in self.ranges(iv.last_access + 1, iv.next_access + 1) {
                    self.host.add(l, r, iv.bytes as i64);
                }
                self.chosen[ci].1.tier = Tier::Host;
            }
        }
        let mut i = 0;
        self.chosen.retain(|_| {
            i += 1;
            !removed[i - 1]
        });
    }

    /// Whether an SSD offload of `iv` would be a clean drop: an earlier interval of its epoch
    /// went to the SSD (or nothing ever writes the tensor: its copy never goes stale).
    pub(super) fn is_clean(&self, iv: &InactiveInterval) -> bool {
        match iv.last_write {
            None => true,
            Some(w) => {
                self.ssd_epochs.get(&(iv.tensor, w)).is_some_and(|&p| p < iv.reads_since_write)
            }
        }
    }

    /// Record an SSD choice of `iv` for its epoch; true if it is now the earliest SSD choice
    /// of the epoch (later intervals of the epoch just became clean drops).
    pub(super) fn note_ssd_epoch(&mut self, iv: &InactiveInterval) -> bool {
        let Some(w) = iv.last_write else { return false };
        let e = self.ssd_epochs.entry((iv.tensor, w)).or_insert(usize::MAX);
        let earliest = iv.reads_since_write < *e;
        *e = (*e).min(iv.reads_since_write);
        earliest
    }

    pub(super) fn consume(
        &mut self,
        path: &[Resource],
        from: usize,
        to_incl: usize,
        forward: bool,
        bytes: f64,
    ) {
        let mut left = bytes;
        let mut s = if forward { from } else { to_incl };
        let n = self.n;
        for _ in 0..=2 * n {
            let live = if forward {
                self.next_live(path, s)
            } else {
                match self.prev_live(path, s) {
                    Some(x) => x,
                    None => return,
                }
            };
            if live > to_incl || live < from {
                return;
            }
            s = live;
            let take = self.avail(path, s).min(left);
            self.spend(path, s, take);
            left -= take;
            if left <= 0.0 {
                return;
            }
            if forward {
                s += 1;
            } else if s == 0 {
                return;
            } else {
                s -= 1;
            }
        }
    }

    /// Take `take` bytes off unrolled slot `s`'s budget of every resource on `path` (down to
    /// zero); a budget used up is skipped from then on.
    pub(super) fn spend(&mut self, path: &[Resource], s: usize, take: f64) {
        let n = self.n;
        for r in path {
            let b = &mut self.budget[r.index()][s % n];
            if *b > 0.0 {
                *b = (*b - take).max(0.0);
                if *b < EXHAUSTED_BYTES {
                    *b = 0.0;
                    self.skip[r.index()].kill(s % n);
                    self.skip[r.index()].kill(s % n + n);
                }
            }
        }
    }

    /// Relaxed phase: take a transfer placed at nominal bandwidth over unrolled slots
    /// `[from, to_incl]` off the slots' budgets (down to zero), so that later choices see
    /// what it uses.
    pub(super) fn consume_nominal(
        &mut self,
        path: &[Resource],
        from: usize,
        to_incl: usize,
        forward: bool,
        bytes: f64,
    ) {
        let n = self.n;
        let mut left = bytes;
        let nominal = path.iter().map(|&r| self.hw.bandwidth(r)).fold(f64::INFINITY, f64::min);
        let mut s = if forward { from } else { to_incl };
        while left > 0.0 && from <= s && s <= to_incl {
            let take = (nominal * self.dur[s % n] * 1e-6).min(left);
            self.spend(path, s, take);
            left -= take;
            if forward {
                s += 1;
            } else if s == 0 {
                break;
            } else {
                s -= 1;
            }
        }
    }

    /// Take the transfers of a relaxed-phase choice (placed at nominal bandwidth) off the
    /// budgets without choosing it: of a choice of this phase (see [`State::relaxed_load`]),
    /// or of an earlier planning's before planning again ([`super::Mode::anticipate`]), so that the
    /// bandwidth those transfers will use is not offered to the bandwidth-aware phase.
    pub fn reserve_nominal(&mut self, iv: &InactiveInterval, fit: &Fit) {
        let off_path = self.hw.offload_path(fit.tier);
        let pre_path = self.hw.prefetch_path(fit.tier);
        let size = iv.bytes as f64;
        if !fit.clean {
            self.consume_nominal(&off_path, iv.last_access + 1, fit.offload_end, true, size);
        }
        self.consume_nominal(&pre_path, fit.prefetch_start, iv.next_access - 1, false, size);
    }

    /// Commit a fit: reserve bandwidth, lower the memory curve, raise host occupancy.
    /// Returns whether the choice made later intervals of the same epoch clean drops (their
    /// scores went up).
    pub fn accept(&mut self, iv: InactiveInterval, fit: Fit) -> bool {
        if fit.recompute {
            let (a, b) = (iv.last_access, iv.next_access);
            self.free_memory(iv.bytes, a + 1, b);
            self.dropped.entry(iv.tensor).or_default().push((a, b));
            self.dropped_at.insert((iv.tensor, a), self.chosen.len());
            let inputs = self.trace.tensor(iv.tensor).producer.clone().map(|p| p.inputs);
            for x in inputs.unwrap_or_default() {
                if let Some(gap) = self.dropped_across(x, b) {
                    self.split_drop(x, gap, b);
                }
                self.pin(x, b);
            }
            self.chosen.push((iv, fit));
            return false;
        }
        self.moved.entry(iv.tensor).or_default().push((iv.last_access, iv.next_access));
        if fit.tier == Tier::Ssd && !fit.clean && self.ssd.is_some() {
            let adds = self.ssd_adds(&iv, fit.offload_end);
            if let Some(tree) = self.ssd.as_mut() {
                for (l, r) in adds {
                    tree.add(l, r, iv.bytes as i64);
                }
            }
            let t = self.trace.tensor(iv.tensor);
            let start = if t.global { 0 } else { iv.last_access + 1 };
            let h = self.ssd_hold.entry(iv.tensor).or_insert(start);
            *h = (*h).min(start);
        }
        let off_path = self.hw.offload_path(fit.tier);
        let pre_path = self.hw.prefetch_path(fit.tier);
        let size = iv.bytes as f64;
        if !self.relaxed {
            if !fit.clean {
                self.consume(&off_path, iv.last_access + 1, fit.offload_end, true, size);
            }
            self.consume(&pre_path, fit.prefetch_start, iv.next_access - 1, false, size);
        } else if self.relaxed_load > 0.0 {
            // Seen by the later choices of this phase through `relaxed_load`.
            self.reserve_nominal(&iv, &fit);
        }
        let opened = fit.tier == Tier::Ssd && self.note_ssd_epoch(&iv);
        self.free_memory(iv.bytes, fit.offload_end + 1, fit.prefetch_start);
        if fit.tier == Tier::Host {
            for (l, r) in self.ranges(iv.last_access + 1, iv.next_access + 1) {
                self.host.add(l, r, iv.bytes as i64);
            }
        }
        self.chosen.push((iv, fit));
        opened
    }

    /// Relaxed and forced phases only: move chosen entry `ci`'s offload end earlier and its
    /// prefetch start later, to where nominal bandwidth would put them (forced: to the ends
    /// of its interval). Returns the new fit and the extra
    /// area it removes, or `None` if that removes nothing.
    pub fn retime(&mut self, ci: usize) -> Option<(Fit, f64)> {
        debug_assert!(self.relaxed);
        let (iv, old) = self.chosen[ci];
        if old.recompute {
            return None;
        }
        // The interval already holds its host room: do not count it against itself. In the
        // forced phase the choice may stretch to its whole interval (stalling).
        self.retiming = true;
        let new =
            if self.forced { self.fit_forced(&iv, old.tier) } else { self.fit(&iv, old.tier) };
        self.retiming = false;
        let new = new?;
        let (e, p) =
            (new.offload_end.min(old.offload_end), new.prefetch_start.max(old.prefetch_start));
        let extra = self.excess_removed(iv.bytes, e + 1, old.offload_end + 1)
            + self.excess_removed(iv.bytes, old.prefetch_start, p);
        if extra <= 0.0 {
            return None;
        }
        Some((Fit { offload_end: e, prefetch_start: p, benefit: extra, ..old }, extra))
    }

    /// Commit a [`State::retime`].
    pub fn accept_retime(&mut self, ci: usize, fit: Fit) {
        let (iv, old) = self.chosen[ci];
        self.free_memory(iv.bytes, fit.offload_end + 1, old.offload_end + 1);
        self.free_memory(iv.bytes, old.prefetch_start, fit.prefetch_start);
        self.chosen[ci].1 = fit;
    }

    /// Turn the chosen intervals into a plan.
    pub fn into_plan(mut self, policy: &str, candidates: usize) -> Plan {
        let n = self.n;
        let cap = self.hw.gpu_memory_bytes as i64;
        let planned_peak = (self.mem.max() + cap).max(0) as u64;
        let mut keyed: Vec<((usize, u8, usize), Instruction)> = Vec::new();
        let mut initial = Vec::new();
        let (mut ssd, mut host) = (0u64, 0u64);
        let mut recomputations = Vec::new();
        let (mut rc_bytes, mut rc_us) = (0u64, 0.0);
        for (iv, fit) in &self.chosen {
            if fit.recompute {
                if iv.last_access + 1 >= iv.next_access {
                    // A gap cut down to nothing ([`State::split_drop`] at the kernel right
                    // after the previous cut): the tensor never leaves between the two.
                    continue;
                }
                recomputations.push(Recompute {
                    tensor: iv.tensor,
                    drop_at: iv.last_access + 1,
                    before_kernel: iv.next_access,
                });
                rc_bytes += iv.bytes;
                rc_us += fit.cost_us;
                continue;
            }
            match fit.tier {
                Tier::Ssd => ssd += iv.bytes,
                Tier::Host => host += iv.bytes,
            }
            let off_at = iv.last_access + 1; // <= n
            // Clean flags are set by `Plan::mark_clean_drops` from the plan itself.
            keyed.push((
                (off_at, 0, iv.next_access),
                Instruction::offload(off_at, iv.tensor, fit.tier, fit.offload_end == off_at),
            ));
            let mut pre_at = fit.prefetch_start;
            if pre_at > n {
                pre_at -= n;
                initial.push(InitialPlacement { tensor: iv.tensor, tier: fit.tier });
            }
            let deadline = iv.next_access % n.max(1);
            keyed.push((
                (pre_at, 1, deadline),
                Instruction::prefetch(pre_at, iv.tensor, fit.prefetch_start + 1 >= iv.next_access),
            ));
        }
        keyed.sort_by_key(|(k, _)| *k);
        initial.sort_by_key(|p| p.tensor);
        recomputations.sort_by_key(|r| (r.before_kernel, r.drop_at, r.tensor));
        let evaluations = std::mem::take(&mut self.evaluations);
        Plan {
            policy: policy.into(),
            kernel_count: n,
            tensor_count: self.trace.tensors.len(),
            unlimited_memory: false,
            initially_offloaded: initial,
            instructions: keyed.into_iter().map(|(_, i)| i).collect(),
            host_kernels: Vec::new(),
            host_updates: Vec::new(),
            recomputations,
            stats: PlanStats {
                peak_resident_bytes: self.peak_resident,
                planned_peak_bytes: planned_peak,
                ssd_offload_bytes: ssd,
                host_offload_bytes: host,
                clean_drop_bytes: 0,
                recompute_bytes: rc_bytes,
                recompute_us: rc_us,
                candidates,
                evaluations,
                ..PlanStats::default()
            },
        }
    }
}

pub(super) fn x_bytes(trace: &Trace, x: TensorId) -> i64 {
    trace.tensor(x).bytes.min(i64::MAX as u64) as i64
}
