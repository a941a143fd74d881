//! G10 (MICRO'23) as a baseline in the same state machinery.
//!
//! Differences from `teraio`: candidates are ranked once, statically, by area (bytes x
//! inactive time) rather than by bandwidth-aware benefit/cost; an interval qualifies for the
//! SSD only if it is longer than `2 x (latency + bytes / ssd bandwidth) x 1.5`, otherwise it
//! goes to host memory if there is room, else it is skipped. Transfers respect the same
//! per-kernel-slot bandwidth budgets, and a candidate is taken only if it lowers memory above
//! capacity somewhere. G10 runs on unified memory: what its plan leaves above capacity is
//! migrated on demand by page faults, modelled as on-demand evictions and fetches of the
//! remaining intervals (the `forced` phase of the shared state).

use super::State;
use crate::analysis::inactive_intervals;
use crate::hardware::{Hardware, Tier};
use crate::plan::Plan;
use crate::trace::Trace;

pub(super) fn plan(trace: &Trace, hw: &Hardware) -> Plan {
    let mut st = State::new(trace, hw);
    let mut ivs = inactive_intervals(trace);
    let count = ivs.len();
    ivs.sort_by(|a, b| {
        let area = |x: &crate::analysis::InactiveInterval| x.bytes as f64 * x.span.duration_us();
        area(b).total_cmp(&area(a))
    });
    let ssd_bw = hw
        .path_bandwidth(&hw.offload_path(Tier::Ssd))
        .min(hw.path_bandwidth(&hw.prefetch_path(Tier::Ssd)));
    let mut taken = vec![false; ivs.len()];
    for relaxed in [false, true] {
        st.relaxed = relaxed;
        for (i, &iv) in ivs.iter().enumerate() {
            if st.mem.max() <= 0 {
                break;
            }
            if taken[i] {
                continue;
            }
            let move_us = hw.ssd_latency_us + iv.bytes as f64 / ssd_bw * 1e6;
            let qualifies = hw.has_ssd() && iv.span.duration_us() > 2.0 * move_us * 1.5;
            let fit = if qualifies { st.fit(&iv, Tier::Ssd) } else { None };
            let fit = fit.or_else(|| {
                if hw.host_memory_cap_bytes >= iv.bytes { st.fit(&iv, Tier::Host) } else { None }
            });
            if let Some(f) = fit {
                // Static order: intervals that became clean drops are not re-ranked.
                st.accept(iv, f);
                taken[i] = true;
            }
        }
    }
    // What G10 leaves unplanned its unified memory migrates on demand (page faults): each
    // remaining interval that lowers memory above capacity is evicted right after its last use
    // and fetched right before its next one, in the same static order.
    st.forced = true;
    let tier = if hw.has_ssd() { Tier::Ssd } else { Tier::Host };
    for (i, &iv) in ivs.iter().enumerate() {
        if st.mem.max() <= 0 {
            break;
        }
        if !taken[i]
            && let Some(f) = st.fit(&iv, tier)
        {
            st.accept(iv, f);
            taken[i] = true;
        }
    }
    st.into_plan("g10", count)
}
