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

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::{Fit, State};
use crate::analysis::{InactiveInterval, inactive_intervals};
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
    let ssd = st.fit(iv, Tier::Ssd);
    if !hybrid {
        // SSD first; host tier only when the SSD placement does not fit.
        return ssd.or_else(|| {
            if st.hw.host_memory_cap_bytes >= iv.bytes { st.fit(iv, Tier::Host) } else { None }
        });
    }
    let host = if st.hw.host_memory_cap_bytes >= iv.bytes { st.fit(iv, Tier::Host) } else { None };
    match (ssd, host) {
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

/// With `forced`, a third phase takes intervals too short for their transfers as on-demand
/// fetches when nominal bandwidth still leaves memory above capacity (`State::forced`).
pub(super) fn plan(trace: &Trace, hw: &Hardware, hybrid: bool, forced: bool) -> Plan {
    let name = if hybrid { "teraio-hybrid" } else { "teraio" };
    let mut st = State::new(trace, hw);
    let ivs = inactive_intervals(trace);
    let mut taken = vec![false; ivs.len()];
    let mut epochs: Epochs = HashMap::new();
    for (i, iv) in ivs.iter().enumerate() {
        if let Some(w) = iv.last_write {
            epochs.entry((iv.tensor, w)).or_default().push(i);
        }
    }
    for list in epochs.values_mut() {
        list.sort_by_key(|&i| ivs[i].reads_since_write);
    }
    greedy(&mut st, &ivs, &epochs, &mut taken, hybrid);
    if st.mem.max() > 0 {
        // Bandwidth-feasible choices were not enough: place the rest at nominal bandwidth
        // (they will stall, but the iteration fits in memory where that is possible at all).
        st.relaxed = true;
        greedy(&mut st, &ivs, &epochs, &mut taken, hybrid);
    }
    if forced && st.mem.max() > 0 {
        // Still above capacity: intervals too short for their transfers at any bandwidth,
        // fetched on demand (stalls rather than running out of memory).
        st.forced = true;
        greedy(&mut st, &ivs, &epochs, &mut taken, hybrid);
    }
    st.into_plan(name, ivs.len())
}

/// Lazy greedy by benefit/cost over the intervals not yet taken.
fn greedy(
    st: &mut State<'_>,
    ivs: &[InactiveInterval],
    epochs: &Epochs,
    taken: &mut [bool],
    hybrid: bool,
) {
    if st.mem.max() <= 0 {
        return;
    }
    let mut heap = BinaryHeap::with_capacity(ivs.len());
    for (idx, iv) in ivs.iter().enumerate() {
        if !taken[idx]
            && let Some(f) = evaluate(st, iv, hybrid)
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
    // an epoch opens at most once per interval. Bound the loop anyway.
    let max_steps = 64 * ivs.len() + 1024;
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
        if taken[top.idx] {
            continue; // pushed again when its epoch opened, and taken since
        }
        let iv = ivs[top.idx];
        let Some(fit) = evaluate(st, &iv, hybrid) else { continue };
        let score = fit.benefit / fit.cost_us;
        let best_other = heap.peek().map_or(f64::NEG_INFINITY, |e| e.score);
        if top.version == version || score >= best_other {
            let opened = st.accept(iv, fit);
            taken[top.idx] = true;
            version += 1;
            if opened && let Some(w) = iv.last_write {
                // Later intervals of this epoch are clean drops now: their scores rose.
                for &j in &epochs[&(iv.tensor, w)] {
                    if !taken[j]
                        && ivs[j].reads_since_write > iv.reads_since_write
                        && let Some(f) = evaluate(st, &ivs[j], hybrid)
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
