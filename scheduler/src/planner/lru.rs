//! On-demand swapping with least-recently-used eviction, as a static plan.
//!
//! Kernels are walked in order. Before kernel `k`, the memory it needs (tensors it creates,
//! accessed tensors that are swapped out) is made room for by evicting the least recently
//! used resident tensors that `k` does not access (urgent offloads to SSD, or host memory when
//! there is no SSD); swapped-out tensors `k` accesses are fetched at boundary `k` (urgent).
//! One warm-up pass finds the steady state the iteration starts in; the measured pass then
//! ends with fix-up migrations at the iteration boundary that restore that state.
//!
//! Host tier (no SSD): an eviction is only made where the host tier has room for it. A
//! prefetch at boundary `k` gives its host bytes back before kernel `k` runs (the kernel
//! waits for it), so before boundary `k + 1`. The fix-ups do not: they are issued at the same
//! moment as boundary 0 of the next iteration, and a fix-up prefetch holds its host copy
//! until it completes, at the latest before its tensor's first access. So the measured pass
//! reserves the bytes of the tensors it will prefetch in the fix-up (`reserved`) at every
//! boundary up to and including their first access, and the fix-up's own peak (the end
//! state's host bytes plus the fix-up offloads) must fit. The fix-up prefetches are only known
//! at the end of the pass: it is planned again with them reserved until the reservation covers
//! them (it only grows); where the host tier cannot hold them at all, the pass instead keeps
//! those tensors from being evicted after their last access (`pinned`), so that they need
//! no fix-up prefetch.
//!
//! The *paging* variant ([`plan_paging`]) is teraio.torch's pager as a plan: it also moves
//! out tensors that have no access left but are not freed yet (the pager does not know the
//! future: it evicts by last use alone), which then die on their tier. It leaves alone those
//! that live to the iteration's last kernel (a trainer may still hold them after the step).

use std::collections::BTreeSet;

use crate::hardware::{Hardware, Tier};
use crate::plan::{InitialPlacement, Instruction, Move, Plan, PlanStats};
use crate::trace::{Tensor, TensorId, Trace};

#[derive(Clone)]
struct Pass {
    resident: Vec<bool>,
    last_use: Vec<usize>,
    lru: BTreeSet<(usize, u32)>,
    used: u64,
    /// Host-tier bytes held (only when the tier is host).
    host_used: u64,
}

/// What the trace and hardware fix for every pass.
struct Walk<'a> {
    trace: &'a Trace,
    hw: &'a Hardware,
    tier: Tier,
    per_kernel: Vec<Vec<TensorId>>,
    created: Vec<Vec<TensorId>>,
    dying: Vec<Vec<TensorId>>,
    /// Also evict tensors with no access left that die before the last kernel ([`plan_paging`]).
    paging: bool,
}

/// Host-tier constraints of the measured pass beyond the cap.
#[derive(Default)]
struct Guard {
    /// Per boundary: host bytes still held there by the previous iteration's fix-up
    /// prefetches (empty: none).
    pending: Vec<u64>,
    /// Globals resident at the start that may not be evicted after their last access (empty:
    /// none).
    pinned: Vec<bool>,
}

impl Walk<'_> {
    /// One iteration from `pass`'s state; `iteration` numbers the LRU clock.
    fn iterate(
        &self,
        pass: &mut Pass,
        iteration: usize,
        guard: &Guard,
        instructions: &mut Vec<Instruction>,
    ) {
        let (trace, tier) = (self.trace, self.tier);
        let n = trace.kernel_count();
        let cap = self.hw.gpu_memory_bytes;
        for k in 0..n {
            let clock = iteration * n + k;
            let need_fetch: Vec<TensorId> = self.per_kernel[k]
                .iter()
                .copied()
                .filter(|t| !pass.resident[t.index()] && !self.created[k].contains(t))
                .collect();
            let need: u64 = need_fetch
                .iter()
                .chain(self.created[k].iter())
                .map(|t| trace.tensor(*t).bytes)
                .sum();
            let pending = guard.pending.get(k).copied().unwrap_or(0);
            // Evict LRU tensors not used by this kernel until the need fits.
            let mut skipped = Vec::new();
            while pass.used + need > cap {
                let Some(&(lu, id)) = pass.lru.iter().next() else { break };
                pass.lru.remove(&(lu, id));
                let tid = TensorId(id);
                let t = trace.tensor(tid);
                let no_access_left = t.accesses.last().is_some_and(|&l| l < k);
                // Keep tensors this kernel uses, and non-global ones with no access left
                // (they are only waiting to be freed; an offload would never come back).
                let done =
                    !t.global && no_access_left && !(self.paging && t.free_kernel(n) + 1 < n);
                let pinned = no_access_left && guard.pinned.get(tid.index()) == Some(&true);
                let no_room = tier == Tier::Host
                    && pass.host_used + pending + t.bytes > self.hw.host_memory_cap_bytes;
                if done || pinned || no_room || self.per_kernel[k].binary_search(&tid).is_ok() {
                    skipped.push((lu, id));
                    continue;
                }
                pass.resident[tid.index()] = false;
                pass.used -= t.bytes;
                if tier == Tier::Host {
                    pass.host_used += t.bytes;
                }
                instructions.push(Instruction::offload(k, tid, tier, true));
            }
            pass.lru.extend(skipped);
            for &t in &need_fetch {
                instructions.push(Instruction::prefetch(k, t, true));
            }
            // These prefetches complete before kernel `k` runs: their host bytes are free for
            // the evictions of boundary `k + 1`.
            for &t in &need_fetch {
                if tier == Tier::Host {
                    pass.host_used -= trace.tensor(t).bytes;
                }
            }
            for &t in need_fetch.iter().chain(self.created[k].iter()) {
                if !pass.resident[t.index()] {
                    pass.resident[t.index()] = true;
                    pass.used += trace.tensor(t).bytes;
                }
            }
            for &t in &self.per_kernel[k] {
                let i = t.index();
                pass.lru.remove(&(pass.last_use[i], t.0));
                pass.last_use[i] = clock;
                pass.lru.insert((clock, t.0));
            }
            for &t in &self.dying[k] {
                let i = t.index();
                pass.lru.remove(&(pass.last_use[i], t.0));
                if pass.resident[i] {
                    pass.resident[i] = false;
                    pass.used -= trace.tensor(t).bytes;
                } else if tier == Tier::Host {
                    // Paged out after its last use: its host copy goes with it.
                    pass.host_used -= trace.tensor(t).bytes;
                }
            }
        }
    }
}

pub(super) fn plan(trace: &Trace, hw: &Hardware) -> Plan {
    plan_walk(trace, hw, false)
}

/// The paging variant (see the module documentation): policy name `paging`.
pub(crate) fn plan_paging(trace: &Trace, hw: &Hardware) -> Plan {
    let mut p = plan_walk(trace, hw, true);
    p.policy = "paging".into();
    p
}

fn plan_walk(trace: &Trace, hw: &Hardware, paging: bool) -> Plan {
    let n = trace.kernel_count();
    let tier = if hw.has_ssd() { Tier::Ssd } else { Tier::Host };
    let mut created: Vec<Vec<TensorId>> = vec![Vec::new(); n];
    let mut dying: Vec<Vec<TensorId>> = vec![Vec::new(); n];
    for t in &trace.tensors {
        if !t.global {
            created[t.alloc_kernel()].push(t.id);
            dying[t.free_kernel(n)].push(t.id);
        }
    }
    let walk =
        Walk { trace, hw, tier, per_kernel: trace.accesses_per_kernel(), created, dying, paging };
    let mut start = Pass {
        resident: trace.tensors.iter().map(|t| t.global).collect(),
        last_use: vec![0; trace.tensors.len()],
        lru: BTreeSet::new(),
        used: 0,
        host_used: 0,
    };
    for t in trace.tensors.iter().filter(|t| t.global) {
        start.used += t.bytes;
        start.lru.insert((0, t.id.0));
    }
    walk.iterate(&mut start, 0, &Guard::default(), &mut Vec::new());
    let initial_state = start.resident.clone();
    let globals: Vec<&Tensor> = trace.tensors.iter().filter(|t| t.global).collect();
    // The measured pass, planned again until the host tier holds its fix-ups (see the module
    // documentation). A round that does not end grows `reserved`, or `pinned` (emptying
    // `reserved`); past `MAX_ROUNDS`, every global resident at the start is pinned, and that
    // pass ends with no fix-up prefetch and the host bytes it started with.
    const MAX_ROUNDS: usize = 16;
    let mut reserved = vec![false; trace.tensors.len()];
    let mut guard = Guard::default();
    let mut round = 0;
    let (pass, mut instructions) = loop {
        round += 1;
        let mut pass = start.clone();
        let mut instructions = Vec::new();
        walk.iterate(&mut pass, 1, &guard, &mut instructions);
        if tier != Tier::Host {
            break (pass, instructions);
        }
        let cap = hw.host_memory_cap_bytes;
        let state = |t: &Tensor| (initial_state[t.id.index()], pass.resident[t.id.index()]);
        let fixup_offloads: u64 =
            globals.iter().filter(|t| state(t) == (false, true)).map(|t| t.bytes).sum();
        let mut covered = true;
        for t in globals.iter().filter(|t| state(t) == (true, false)) {
            covered &= std::mem::replace(&mut reserved[t.id.index()], true);
        }
        let fits = covered && pass.host_used + fixup_offloads <= cap;
        let all_pinned = guard.pinned == initial_state;
        debug_assert!(fits || !all_pinned, "lru: a pass with every global pinned overflows");
        if fits || all_pinned {
            break (pass, instructions);
        }
        let held: u64 = globals.iter().filter(|t| reserved[t.id.index()]).map(|t| t.bytes).sum();
        if round >= MAX_ROUNDS {
            reserved.fill(false);
            guard.pinned = initial_state.clone();
        } else if start.host_used + held > cap {
            // The host tier cannot hold these fix-up prefetches: keep their tensors resident
            // after their last access instead.
            guard.pinned.resize(trace.tensors.len(), false);
            for (p, r) in guard.pinned.iter_mut().zip(&mut reserved) {
                *p |= std::mem::take(r);
            }
        }
        // Held through boundary `first access`, released before the next one.
        let mut pending = vec![0u64; n + 1];
        for t in globals.iter().filter(|t| reserved[t.id.index()]) {
            pending[t.accesses[0]] += t.bytes;
        }
        for k in (0..n).rev() {
            pending[k] += pending[k + 1];
        }
        pending.truncate(n);
        guard.pending = pending;
    };
    // Restore the state the iteration began in.
    let mut initial = Vec::new();
    for t in &globals {
        let (start, end) = (initial_state[t.id.index()], pass.resident[t.id.index()]);
        if !start {
            initial.push(InitialPlacement { tensor: t.id, tier });
        }
        if start && !end {
            instructions.push(Instruction::prefetch(n, t.id, true));
        } else if !start && end {
            instructions.push(Instruction::offload(n, t.id, tier, true));
        }
    }
    let moved: u64 = instructions
        .iter()
        .filter(|i| matches!(i.op, Move::Offload { .. }))
        .map(|i| trace.tensor(i.tensor).bytes)
        .sum();
    let (ssd, host) = if tier == Tier::Ssd { (moved, 0) } else { (0, moved) };
    Plan {
        policy: "lru".into(),
        kernel_count: n,
        tensor_count: trace.tensors.len(),
        unlimited_memory: false,
        initially_offloaded: initial,
        instructions,
        host_kernels: Vec::new(),
        host_updates: Vec::new(),
        recomputations: Vec::new(),
        stats: PlanStats {
            peak_resident_bytes: trace.resident_memory_per_kernel().into_iter().max().unwrap_or(0),
            ssd_offload_bytes: ssd,
            host_offload_bytes: host,
            ..PlanStats::default()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{Outcome, SimOptions, simulate};
    use crate::trace::{Kernel, TensorKind};

    /// Three kernels of 100 us; `(bytes, global, accesses)` per tensor (an activation lives
    /// from its first access to its last); no SSD.
    fn case(gpu: u64, host: u64, tensors: &[(u64, bool, &[usize])]) -> (Trace, Hardware) {
        let mut trace = Trace::new("lru-host");
        for i in 0..3 {
            trace.kernels.push(Kernel { name: format!("k{i}"), duration_us: 100.0, layer: None });
        }
        for (i, &(bytes, global, accesses)) in tensors.iter().enumerate() {
            trace.tensors.push(Tensor {
                id: TensorId(i as u32),
                name: format!("t{i}"),
                bytes,
                kind: if global { TensorKind::Weight } else { TensorKind::Activation },
                global,
                created_by: (!global).then_some(accesses[0]),
                accesses: accesses.to_vec(),
                dies_after: (!global).then(|| *accesses.last().unwrap()),
                writes: None,
                producer: None,
            });
        }
        let mut hw = Hardware::paper();
        hw.ssd_count = 0;
        hw.gpu_memory_bytes = gpu;
        hw.host_memory_cap_bytes = host;
        (trace, hw)
    }

    fn bytes_at(trace: &Trace, p: &Plan, k: usize, prefetch: bool) -> u64 {
        let at = p.instructions.iter().filter(|i| i.issue_before_kernel == k);
        at.filter(|i| (i.op == Move::Prefetch) == prefetch)
            .map(|i| trace.tensor(i.tensor).bytes)
            .sum()
    }

    /// The fix-ups at the iteration boundary hold host bytes the measured pass did not count:
    /// a fix-up prefetch keeps its host copy until it completes, while the fix-up offloads
    /// and then boundary 0's evictions add theirs at once. Before the fix, `lru` evicted t2
    /// (40) at boundary 2, after its last access, which needed a fix-up prefetch of it next to
    /// the fix-up offload of t4 (20): 40 + 20 = 60, then 70 with boundary 0's eviction of t0
    /// (10), over the host cap of 50 (the plan completed, over the cap). Now t2 stays: t4 is
    /// evicted instead, no fix-up is needed, and the plan completes within the cap.
    #[test]
    fn fix_ups_fit_the_host_tier() {
        let (trace, hw) = case(
            80,
            50,
            &[
                (10, true, &[2]),
                (20, true, &[2]),
                (40, true, &[1]),
                (20, false, &[0]),
                (20, true, &[1]),
            ],
        );
        let p = plan(&trace, &hw);
        let r = simulate(&trace, &p, &hw, &SimOptions::default()).unwrap();
        assert_eq!(r.outcome, Outcome::Completed);
        assert!(!r.host_cap_exceeded, "peak host {}", r.peak_host_bytes);
        assert!(r.peak_host_bytes <= 50, "{}", r.peak_host_bytes);
        assert!(
            !p.instructions.iter().any(|i| i.issue_before_kernel == 2 && i.tensor == TensorId(2))
        );
    }

    /// A fix-up prefetch still holds its host copy when boundary 0's evictions are issued,
    /// although the fix-up alone fits. Before the fix: start 30 (t0) + fix-up prefetch of t2
    /// (20) = 50 = the cap, then boundary 0 evicted t3 (10) for 60. The fix-up prefetch's
    /// bytes are now reserved up to its tensor's first access.
    #[test]
    fn fix_up_prefetch_holds_the_host_through_boundary_0() {
        let (trace, hw) = case(
            90,
            50,
            &[
                (30, true, &[0]),
                (10, false, &[0, 1, 2]),
                (20, true, &[0]),
                (10, true, &[1, 2]),
                (30, true, &[2]),
            ],
        );
        let p = plan(&trace, &hw);
        let start: u64 = p.initially_offloaded.iter().map(|i| trace.tensor(i.tensor).bytes).sum();
        // Everything the host tier may hold at once around the iteration boundary.
        let n = trace.kernel_count();
        let wrap = start + bytes_at(&trace, &p, n, true) + bytes_at(&trace, &p, 0, false);
        assert!(wrap <= 50, "{wrap}");
        let r = simulate(&trace, &p, &hw, &SimOptions::default()).unwrap();
        assert!(!r.host_cap_exceeded, "peak host {}", r.peak_host_bytes);
    }
}
