//! On-demand swapping with least-recently-used eviction, as a static plan.
//!
//! Kernels are walked in order. Before kernel `k`, the memory it needs (tensors it creates,
//! accessed tensors that are swapped out) is made room for by evicting the least recently
//! used resident tensors that `k` does not access (urgent offloads to SSD, or host memory when
//! there is no SSD); swapped-out tensors `k` accesses are fetched at boundary `k` (urgent).
//! One warm-up pass finds the steady state the iteration starts in; the measured pass then
//! ends with fix-up migrations at the iteration boundary that restore that state.

use std::collections::BTreeSet;

use crate::hardware::{Hardware, Tier};
use crate::plan::{InitialPlacement, Instruction, Op, Plan, PlanStats};
use crate::trace::{TensorId, Trace};

struct Pass {
    resident: Vec<bool>,
    last_use: Vec<usize>,
    lru: BTreeSet<(usize, u32)>,
    used: u64,
    /// Host-tier bytes held (only when the tier is host).
    host_used: u64,
}

pub(super) fn plan(trace: &Trace, hw: &Hardware) -> Plan {
    let n = trace.kernel_count();
    let cap = hw.gpu_memory_bytes;
    let tier = if hw.has_ssd() { Tier::Ssd } else { Tier::Host };
    let per_kernel = trace.accesses_per_kernel();
    let mut created: Vec<Vec<TensorId>> = vec![Vec::new(); n];
    let mut dying: Vec<Vec<TensorId>> = vec![Vec::new(); n];
    for t in &trace.tensors {
        if !t.global {
            created[t.alloc_kernel()].push(t.id);
            dying[t.free_kernel(n)].push(t.id);
        }
    }
    let mut pass = Pass {
        resident: trace.tensors.iter().map(|t| t.global).collect(),
        last_use: vec![0; trace.tensors.len()],
        lru: BTreeSet::new(),
        used: 0,
        host_used: 0,
    };
    for t in trace.tensors.iter().filter(|t| t.global) {
        pass.used += t.bytes;
        pass.lru.insert((0, t.id.0));
    }
    let mut initial_state = Vec::new();
    let mut instructions = Vec::new();
    for iteration in 0..2 {
        if iteration == 1 {
            initial_state = pass.resident.clone();
            instructions.clear();
        }
        for k in 0..n {
            let clock = iteration * n + k;
            let need_fetch: Vec<TensorId> = per_kernel[k]
                .iter()
                .copied()
                .filter(|t| !pass.resident[t.index()] && !created[k].contains(t))
                .collect();
            let need: u64 =
                need_fetch.iter().chain(created[k].iter()).map(|t| trace.tensor(*t).bytes).sum();
            // Evict LRU tensors not used by this kernel until the need fits.
            let mut skipped = Vec::new();
            while pass.used + need > cap {
                let Some(&(lu, id)) = pass.lru.iter().next() else { break };
                pass.lru.remove(&(lu, id));
                let tid = TensorId(id);
                let t = trace.tensor(tid);
                // Keep tensors this kernel uses, and non-global ones with no access left
                // (they are only waiting to be freed; an offload would never come back).
                let done = !t.global && t.accesses.last().is_some_and(|&l| l < k);
                let no_room =
                    tier == Tier::Host && pass.host_used + t.bytes > hw.host_memory_cap_bytes;
                if done || no_room || per_kernel[k].binary_search(&tid).is_ok() {
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
            for &t in &need_fetch {
                if tier == Tier::Host {
                    pass.host_used -= trace.tensor(t).bytes;
                }
            }
            for &t in need_fetch.iter().chain(created[k].iter()) {
                if !pass.resident[t.index()] {
                    pass.resident[t.index()] = true;
                    pass.used += trace.tensor(t).bytes;
                }
            }
            for &t in &per_kernel[k] {
                let i = t.index();
                pass.lru.remove(&(pass.last_use[i], t.0));
                pass.last_use[i] = clock;
                pass.lru.insert((clock, t.0));
            }
            for &t in &dying[k] {
                let i = t.index();
                pass.lru.remove(&(pass.last_use[i], t.0));
                if pass.resident[i] {
                    pass.resident[i] = false;
                    pass.used -= trace.tensor(t).bytes;
                }
            }
        }
    }
    // Restore the state the iteration began in.
    let mut initial = Vec::new();
    for t in trace.tensors.iter().filter(|t| t.global) {
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
        .filter(|i| matches!(i.op, Op::Offload { .. }))
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
        recomputations: Vec::new(),
        stats: PlanStats {
            peak_resident_bytes: trace.resident_memory_per_kernel().into_iter().max().unwrap_or(0),
            ssd_offload_bytes: ssd,
            host_offload_bytes: host,
            ..PlanStats::default()
        },
    }
}
