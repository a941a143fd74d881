//! The paper's Algorithm 1 (TERAIO, arXiv 2506.06472).
//!
//! ```text
//! candidates <- every inactive interval of every tensor
//! while some kernel needs more than GPU capacity and candidates remain:
//!     for each candidate: place its offload as early as the SSD/PCIe write budget allows
//!         (bandwidth-aware real offload end) and its prefetch as late as the read budget
//!         allows (real prefetch start); benefit = area above capacity removed between them;
//!         cost = offload time + prefetch time
//!     take the candidate with the best benefit/cost; SSD first, host tier when the SSD
//!         placement does not fit and host memory (up to its cap) does
//!     reserve its bandwidth, lower the memory curve
//! ```
//! Scores only fall as choices are made (capacity excess shrinks, bandwidth is consumed), so a
//! stale score is an upper bound: candidates sit in a max-heap and are re-evaluated lazily
//! when popped; a candidate whose fresh score still beats the next stale score is optimal
//! and taken. Memory is an [`super::tree::ExcessTree`]; bandwidth budgets skip exhausted
//! slots. With `hybrid`, a candidate also tries the host tier and takes it when it removes
//! more area per unit cost than the SSD placement (the `teraio-hybrid` improvement).
//!
//! Clean drops break "scores only fall" in one place: the first SSD choice in an epoch of a
//! tensor (intervals between two writes) makes the later intervals of that epoch free to
//! offload (no write), so their scores rise. Those intervals are re-evaluated and pushed again
//! when that happens (including ones that did not fit before).
//!
//! Phases, each run only while memory is still above capacity: bandwidth budgets as
//! reserved; nominal bandwidth (`relaxed`: transfers share and stall); and, when the plan
//! still runs out of memory in the simulator, a second planning with a `forced` phase that
//! takes intervals too short for their transfers as on-demand fetches, ranked by bytes above
//! capacity per kernel. If that fails too, [`super::plan`] falls back to `lru`'s plan.
//!
//! Recomputation (`Mode::recompute`): an interval of a recomputable tensor may instead be
//! dropped and remade before its next access ([`crate::plan::Recompute`]); its benefit is the
//! area of the whole interval, its cost the producer's GPU time, and it competes with the
//! moves by the same score in every phase (a transfer's cost is its time on its path; `auto`
//! compares the plan with the one that does not recompute, by simulation). With
//! `Mode::keep_ssd` (hybrid only), an interval whose tensor is read again later in the same
//! epoch takes the SSD whenever that fits, even where the host tier scores better: the SSD copy
//! stays and makes the epoch's later offloads clean drops (no PCIe write), a host copy is
//! gone once read back. A chosen recomputation pins the producer's inputs in GPU memory at the kernel it
//! runs before: their intervals across that kernel are split there (both halves stay
//! candidates; the first may itself be recomputed there, a chain). The wear pass (`Mode::wear`, [`State::reduce_writes`]) runs last.
//!
//! Anticipating rounds (`Mode::anticipate`): the relaxed phase places its transfers at
//! nominal bandwidth over slots whose budgets the first phase already gave away, so in the
//! simulator they share PCIe with the transfers planned there, and both arrive late (stalls
//! where memory or a prefetch waits). A round plans again from scratch with the transfers of
//! every earlier round's relaxed phase taken off the budgets first
//! ([`State::reserve_nominal`]): the bandwidth-aware phase no longer counts on that bandwidth
//! and chooses around it (other moves, other times, or recomputation); in its own relaxed
//! phase, each choice takes its transfers off the budgets too and a transfer's cost counts
//! the bytes it places beyond them ([`State::relaxed_load`]). Each round's plan is a
//! candidate of `auto`, which simulates it like every other candidate.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::{Fit, Mode, RecomputeIn, State};
use crate::analysis::{InactiveInterval, Span, inactive_intervals, time_at};
use crate::hardware::{Hardware, Tier};
use crate::plan::Plan;
use crate::trace::{TensorId, Trace};

/// Interval indices per (tensor, epoch), by position in the epoch.
type Epochs = HashMap<(TensorId, usize), Vec<usize>>;

#[derive(PartialEq)]
struct Entry {
    score: f64,
    idx: usize,
    version: u64,
    /// Index into `State::chosen` when this entry re-times a chosen interval.
    retime: Option<usize>,
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.idx.cmp(&self.idx))
    }
}

fn evaluate(st: &mut State<'_>, iv: &InactiveInterval, hybrid: bool) -> Option<Fit> {
    let moved = evaluate_move(st, iv, hybrid);
    let rc = st.fit_recompute(iv);
    match (moved, rc) {
        (Some(m), Some(r)) => {
            Some(if r.benefit / (r.cost_us * st.recompute_weight) > m.benefit / m.cost_us {
                r
            } else {
                m
            })
        }
        (m, r) => m.or(r),
    }
}

fn evaluate_move(st: &mut State<'_>, iv: &InactiveInterval, hybrid: bool) -> Option<Fit> {
    let ssd = st.fit(iv, Tier::Ssd);
    if !hybrid {
        // SSD first; host tier only when the SSD placement does not fit.
        return ssd.or_else(|| {
            if st.hw.host_memory_cap_bytes >= iv.bytes { st.fit(iv, Tier::Host) } else { None }
        });
    }
    let host = if st.hw.host_memory_cap_bytes >= iv.bytes { st.fit(iv, Tier::Host) } else { None };
    match (ssd, host) {
        (Some(s), Some(_)) if st.keep_ssd && !s.clean && epoch_continues(st, iv) => Some(s),
        (Some(s), Some(h)) => {
            if h.benefit / h.cost_us > s.benefit / s.cost_us {
                Some(h)
            } else {
                Some(s)
            }
        }
        (s, h) => s.or(h),
    }
}

/// Whether `iv`'s tensor is read again after the interval's end within the same epoch (no
/// write at its next access, and an access after it): an SSD copy made now would make the
/// next interval's offload a clean drop, a host copy would not.
fn epoch_continues(st: &State<'_>, iv: &InactiveInterval) -> bool {
    let t = st.trace.tensor(iv.tensor);
    let b = iv.next_access;
    !iv.wraps && b < st.n && !t.writes_at(b) && t.accesses.last().is_some_and(|&l| l > b)
}

/// The candidates of one planning: every inactive interval, and the halves of those split
/// where a recomputation pins their tensor.
#[derive(Clone)]
struct Candidates {
    ivs: Vec<InactiveInterval>,
    taken: Vec<bool>,
    epochs: Epochs,
    by_tensor: HashMap<TensorId, Vec<usize>>,
}

impl Candidates {
    fn push(&mut self, iv: InactiveInterval) -> usize {
        let i = self.ivs.len();
        self.ivs.push(iv);
        self.taken.push(false);
        if let Some(w) = iv.last_write {
            let list = self.epochs.entry((iv.tensor, w)).or_default();
            list.push(i);
            list.sort_by_key(|&j| self.ivs[j].reads_since_write);
        }
        self.by_tensor.entry(iv.tensor).or_default().push(i);
        i
    }

    /// Split every untaken interval of `x` that spans kernel `k` (an input pinned there by a
    /// recomputation) into the halves before and after `k`; returns the new candidates.
    fn split(&mut self, x: TensorId, k: usize, n: usize, starts: &[f64]) -> Vec<usize> {
        let list = self.by_tensor.get(&x).cloned().unwrap_or_default();
        let mut out = Vec::new();
        for i in list {
            let iv = self.ivs[i];
            let p = if iv.last_access < k && k < iv.next_access {
                k
            } else if iv.last_access < k + n && k + n < iv.next_access {
                k + n
            } else {
                continue;
            };
            if self.taken[i] {
                continue;
            }
            self.taken[i] = true;
            let half = |a: usize, b: usize| {
                // Normalise an interval that starts in the next iteration.
                let (a, b) = if a >= n { (a - n, b - n) } else { (a, b) };
                InactiveInterval {
                    last_access: a,
                    next_access: b,
                    span: Span {
                        start_kernel: a + 1,
                        end_kernel: b,
                        start_us: time_at(starts, a + 1),
                        end_us: time_at(starts, b),
                    },
                    wraps: b >= n,
                    ..iv
                }
            };
            for (a, b) in [(iv.last_access, p), (p, iv.next_access)] {
                if b > a + 1 {
                    out.push(self.push(half(a, b)));
                }
            }
        }
        out
    }
}

/// A planning after its bandwidth-aware and relaxed phases, before the wear pass: the plans
/// are taken from it, with or without the forced phase on top ([`Planning::finish`]).
#[derive(Clone)]
pub(super) struct Planning<'a> {
    st: State<'a>,
    c: Candidates,
    mode: Mode,
    count: usize,
}

impl<'a> Planning<'a> {
    /// The mode it was planned with.
    pub(super) fn mode(&self) -> Mode {
        self.mode
    }

    /// Run the phases that every plan of `mode` shares: bandwidth budgets as reserved, then
    /// nominal bandwidth while memory is still above capacity.
    #[cfg(test)]
    pub(super) fn new(trace: &'a Trace, hw: &'a Hardware, mode: Mode) -> Planning<'a> {
        let (st, c, count) = first_phases(trace, hw, mode);
        Planning { st, c, mode, count }
    }

    /// The plannings of every round of `mode` ([`Mode::anticipate`]): round `r`'s with
    /// `anticipate` `r` in its mode (as planned from scratch with it).
    pub(super) fn rounds(trace: &'a Trace, hw: &'a Hardware, mode: Mode) -> Vec<Planning<'a>> {
        rounds(trace, hw, mode)
            .into_iter()
            .enumerate()
            .map(|(r, (st, c, count))| Planning {
                st,
                c,
                mode: Mode { anticipate: r, ..mode },
                count,
            })
            .collect()
    }

    /// The plan, and with [`Mode::wear`] also the same plan after the wear pass (second).
    /// With `forced`, a third phase first takes intervals too short for their transfers as
    /// on-demand fetches when nominal bandwidth still leaves memory above capacity
    /// (`State::forced`). The same as planning from scratch with `forced` (the first two
    /// phases do not depend on it), without doing them again.
    pub(super) fn finish(&self, forced: bool) -> (Plan, Option<Plan>) {
        let mut st = self.st.clone();
        if forced && st.mem.max() > 0 {
            let mut c = self.c.clone();
            st.forced = true;
            greedy(&mut st, &mut c, self.mode.hybrid);
        }
        let worn = self.mode.wear.then(|| {
            let mut w = st.clone();
            w.reduce_writes();
            w.into_plan(&self.mode.name(), self.count)
        });
        (st.into_plan(&Mode { wear: false, ..self.mode }.name(), self.count), worn)
    }
}

/// Plan with `mode` from scratch (see [`Planning::finish`]); the reference [`Planning`]
/// must agree with.
#[cfg(test)]
pub(super) fn plan(trace: &Trace, hw: &Hardware, mode: Mode, forced: bool) -> (Plan, Option<Plan>) {
    let (mut st, mut c, count) = first_phases(trace, hw, mode);
    if forced && st.mem.max() > 0 {
        st.forced = true;
        greedy(&mut st, &mut c, mode.hybrid);
    }
    let worn = mode.wear.then(|| {
        let mut w = st.clone();
        w.reduce_writes();
        w.into_plan(&mode.name(), count)
    });
    (st.into_plan(&Mode { wear: false, ..mode }.name(), count), worn)
}

/// The phases every plan of `mode` shares: bandwidth budgets as reserved, then nominal
/// bandwidth while memory is still above capacity (transfers share and stall, but the
/// iteration fits in memory where that is possible at all); with [`Mode::anticipate`] `k`,
/// planned again `k` times, each time with the bandwidth that the previous planning's
/// relaxed phase used taken off the budgets first ([`State::reserve_nominal`]) and its
/// relaxed phase counting the bytes it places beyond what is left
/// ([`State::relaxed_load`]). Returns the state after each round (`k + 1`), with the
/// candidates and how many intervals there were.
fn rounds<'a>(
    trace: &'a Trace,
    hw: &'a Hardware,
    mode: Mode,
) -> Vec<(State<'a>, Candidates, usize)> {
    let mut out: Vec<(State<'a>, Candidates, usize)> = Vec::new();
    let mut reserved: Vec<(InactiveInterval, super::Fit)> = Vec::new();
    for round in 0..=mode.anticipate {
        let (mut st, mut c, count) = fresh(trace, hw, mode);
        if round > 0 {
            st.relaxed_load = RELAXED_LOAD_WEIGHT;
            for (iv, f) in &reserved {
                st.reserve_nominal(iv, f);
            }
        }
        greedy(&mut st, &mut c, mode.hybrid);
        let first = st.chosen.len();
        if st.mem.max() > 0 {
            st.relaxed = true;
            greedy(&mut st, &mut c, mode.hybrid);
        }
        let done = st.chosen.len() == first;
        reserved.extend(st.chosen[first..].iter().filter(|(_, f)| !f.recompute).copied());
        out.push((st, c, count));
        if done {
            // Nothing in the relaxed phase: another round would plan the same.
            break;
        }
    }
    out
}

/// [`rounds`]' last state.
#[cfg(test)]
fn first_phases<'a>(
    trace: &'a Trace,
    hw: &'a Hardware,
    mode: Mode,
) -> (State<'a>, Candidates, usize) {
    rounds(trace, hw, mode).pop().expect("at least one round")
}

/// [`State::relaxed_load`] in the rounds after the first: a byte placed beyond what is left
/// of a slot's budget waits, and delays one that an earlier choice placed there, so it counts
/// twice its time at nominal bandwidth. (On the sweep's row that needed this, the PyTorch-like
/// llama3-8b tf32 trace at 34.5 GB, weights 1.5 to 3 give 85.1-85.8% of ideal, 1 and 4 give
/// 84.8% and 84.9%.)
const RELAXED_LOAD_WEIGHT: f64 = 2.0;

/// A state with nothing chosen and every inactive interval a candidate.
fn fresh<'a>(trace: &'a Trace, hw: &'a Hardware, mode: Mode) -> (State<'a>, Candidates, usize) {
    let mut st = State::new(trace, hw);
    let ivs = inactive_intervals(trace);
    let count = ivs.len();
    let mut c = Candidates {
        ivs: Vec::with_capacity(count),
        taken: Vec::with_capacity(count),
        epochs: HashMap::new(),
        by_tensor: HashMap::new(),
    };
    for iv in ivs {
        c.push(iv);
    }
    st.recompute = mode.recompute != RecomputeIn::Never;
    st.eager_chains = mode.recompute == RecomputeIn::Eager;
    st.recompute_weight = f64::from(mode.recompute_weight.max(1));
    st.keep_ssd = mode.keep_ssd;
    (st, c, count)
}

/// Lazy greedy by benefit/cost over the intervals not yet taken.
fn greedy(st: &mut State<'_>, c: &mut Candidates, hybrid: bool) {
    if st.mem.max() <= 0 {
        return;
    }
    let mut heap = BinaryHeap::with_capacity(c.ivs.len());
    for idx in 0..c.ivs.len() {
        if !c.taken[idx]
            && let Some(f) = evaluate(st, &c.ivs[idx], hybrid)
        {
            heap.push(Entry { score: f.benefit / f.cost_us, idx, version: 0, retime: None });
        }
    }
    if st.relaxed {
        for ci in 0..st.chosen.len() {
            if let Some((f, extra)) = st.retime(ci) {
                heap.push(Entry {
                    score: extra / f.cost_us,
                    idx: usize::MAX,
                    version: 0,
                    retime: Some(ci),
                });
            }
        }
    }
    let mut version = 0u64;
    // Each pop either accepts (at most once per interval) or re-scores at a newer version;
    // an epoch opens at most once per interval; a split adds at most two intervals per
    // accepted recomputation input. Bound the loop anyway.
    let max_steps = 64 * c.ivs.len() + 1024;
    for _ in 0..max_steps {
        if st.mem.max() <= 0 {
            break;
        }
        let Some(top) = heap.pop() else { break };
        if let Some(ci) = top.retime {
            let Some((fit, extra)) = st.retime(ci) else { continue };
            let score = extra / fit.cost_us;
            let best_other = heap.peek().map_or(f64::NEG_INFINITY, |e| e.score);
            if top.version == version || score >= best_other {
                st.accept_retime(ci, fit);
                version += 1;
            } else {
                heap.push(Entry { score, idx: usize::MAX, version, retime: Some(ci) });
            }
            continue;
        }
        if c.taken[top.idx] {
            continue; // pushed again when its epoch opened, and taken since
        }
        let iv = c.ivs[top.idx];
        let Some(fit) = evaluate(st, &iv, hybrid) else { continue };
        let score = fit.benefit / fit.cost_us;
        let best_other = heap.peek().map_or(f64::NEG_INFINITY, |e| e.score);
        if top.version == version || score >= best_other {
            let opened = st.accept(iv, fit);
            c.taken[top.idx] = true;
            version += 1;
            if fit.recompute {
                // The producer's inputs must be resident before the next access: split
                // their intervals across it; the halves are candidates.
                let inputs = st.trace.tensor(iv.tensor).producer.clone().map(|p| p.inputs);
                for x in inputs.unwrap_or_default() {
                    for j in c.split(x, iv.next_access, st.n, &st.starts) {
                        if let Some(f) = evaluate(st, &c.ivs[j], hybrid) {
                            heap.push(Entry {
                                score: f.benefit / f.cost_us,
                                idx: j,
                                version,
                                retime: None,
                            });
                        }
                    }
                }
            }
            if opened && let Some(w) = iv.last_write {
                // Later intervals of this epoch are clean drops now: their scores rose.
                for &j in &c.epochs[&(iv.tensor, w)] {
                    if !c.taken[j]
                        && c.ivs[j].reads_since_write > iv.reads_since_write
                        && let Some(f) = evaluate(st, &c.ivs[j], hybrid)
                    {
                        heap.push(Entry {
                            score: f.benefit / f.cost_us,
                            idx: j,
                            version,
                            retime: None,
                        });
                    }
                }
            }
        } else {
            heap.push(Entry { score, idx: top.idx, version, retime: None });
        }
    }
}
