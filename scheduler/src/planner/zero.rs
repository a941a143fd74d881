//! A ZeRO-Infinity-like baseline: layer-granular, not bandwidth-aware.
//!
//! Parameters, gradients and optimizer states are offloaded to NVMe after every use and
//! fetched back at the start of the layer block before the one that uses them (one layer of
//! lookahead), as ZeRO-3/Infinity's parameter partitioning does whether or not memory is short.
//! Activations saved across layers are offloaded to host memory (activation checkpoint
//! offload) while the host tier has room, else to NVMe, with the same one-layer lookahead.
//! Workspace and within-layer activations stay on the GPU. Layer blocks are maximal runs of
//! consecutive kernels with the same `layer` tag.

use super::plan_from_moves;
use super::tree::ExcessTree;
use crate::analysis::inactive_intervals;
use crate::hardware::{Hardware, Tier};
use crate::plan::{Plan, PlanStats};
use crate::trace::{TensorKind, Trace};

pub(super) fn plan(trace: &Trace, hw: &Hardware) -> Plan {
    let n = trace.kernel_count();
    let mut block_start = vec![0usize; n];
    for k in 1..n {
        block_start[k] = if trace.kernels[k].layer == trace.kernels[k - 1].layer {
            block_start[k - 1]
        } else {
            k
        };
    }
    // Unrolled block start of unrolled kernel x.
    let bs = |x: usize| (x / n) * n + block_start[x % n];
    let layer_of = |x: usize| trace.kernels[x % n].layer;
    let dur: Vec<f64> = trace.kernels.iter().map(|k| k.duration_us).collect();
    let host_cap = hw.host_memory_cap_bytes.min(i64::MAX as u64 / 2) as i64;
    let mut host = ExcessTree::new(&vec![-host_cap; n], &dur);
    let mut moves = Vec::new();
    let (mut ssd, mut host_bytes) = (0u64, 0u64);
    let ivs = inactive_intervals(trace);
    for iv in &ivs {
        let t = trace.tensor(iv.tensor);
        let (a, b) = (iv.last_access, iv.next_access);
        let state_like = matches!(
            t.kind,
            TensorKind::Weight | TensorKind::Gradient | TensorKind::OptimizerState
        );
        let crosses_layers = layer_of(a) != layer_of(b) || bs(a) != bs(b);
        if !(state_like || (t.kind == TensorKind::Activation && crosses_layers)) {
            continue;
        }
        let s = bs(b);
        let prefetch_at = if s == 0 { 0 } else { bs(s - 1) };
        if prefetch_at < a + 2 {
            continue; // gap shorter than the lookahead: keep it resident
        }
        let mut tier = Tier::Ssd;
        if !state_like || !hw.has_ssd() {
            let ranges: Vec<(usize, usize)> =
                if b < n { vec![(a + 1, b + 1)] } else { vec![(a + 1, n), (0, b + 1 - n)] };
            let worst = ranges.iter().map(|&(l, r)| host.range_max(l, r)).max().unwrap_or(i64::MIN);
            if worst + t.bytes as i64 <= 0 {
                tier = Tier::Host;
                for (l, r) in ranges {
                    host.add(l, r, t.bytes as i64);
                }
            } else if !hw.has_ssd() {
                continue;
            }
        }
        match tier {
            Tier::Ssd => ssd += t.bytes,
            Tier::Host => host_bytes += t.bytes,
        }
        moves.push((iv.tensor, a + 1, prefetch_at, tier, false));
    }
    let stats = PlanStats {
        peak_resident_bytes: trace.resident_memory_per_kernel().into_iter().max().unwrap_or(0),
        ssd_offload_bytes: ssd,
        host_offload_bytes: host_bytes,
        candidates: ivs.len(),
        ..PlanStats::default()
    };
    plan_from_moves(trace, "zero-infinity", &moves, stats)
}
