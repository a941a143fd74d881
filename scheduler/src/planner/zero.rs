//! A ZeRO-Infinity-like baseline (DeepSpeed ZeRO-3 with `offload_param` and
//! `offload_optimizer` on NVMe; Rajbhandari et al., SC'21): layer-granular, not
//! bandwidth-aware.
//!
//! What it models, per tensor kind:
//! - **Optimizer step on the CPU.** Every kernel that accesses an optimizer state (the AdamW
//!   kernels) and creates no tensor becomes a [`HostKernel`]: DeepSpeed's CPU-Adam updates the parameter in host
//!   memory at [`Hardware::cpu_adam_params_per_s`] while the states stream NVMe -> host ->
//!   NVMe. Parameters of the step = bytes of one optimizer state / 4 (AdamW moments are fp32).
//!   The step reads every optimizer state (and the weight itself when it is fp32, i.e. its
//!   own master copy: same size as a moment) and the gradient when it sits on NVMe, and
//!   writes every optimizer state and the updated weight. Read, compute and write run one
//!   after the other, as with DeepSpeed's default (`pipeline_read`/`pipeline_write` off);
//!   `zero-infinity-pipelined` overlaps them perfectly instead. The GPU runs nothing
//!   meanwhile.
//! - **Optimizer states** never enter GPU memory: they live on NVMe.
//! - **Parameters** are offloaded to NVMe after every use and fetched back at the start of
//!   the layer block before the one that uses them (one layer of lookahead), as ZeRO-3's
//!   parameter partitioning does whether or not memory is short; they stay on NVMe across the
//!   CPU step. A release writes nothing: the parameter is unchanged since the CPU step
//!   updated its NVMe copy, so the release is a clean drop ([`crate::plan`]), as in real
//!   ZeRO-3, which only rereads.
//! - **Gradients** are offloaded after every use to host memory (NVMe when the host tier is
//!   full), fetched back one layer ahead for the next micro-batch's accumulation, and after the
//!   last backward use stay off the GPU: the CPU step consumes them and they die there.
//! - **Activations** saved across layers go to host memory (activation checkpoint offload,
//!   `cpu_checkpointing`) while the host tier has room, else to NVMe, with the same
//!   lookahead. DeepSpeed can offload only activation *checkpoints*, so ZeRO-Infinity runs
//!   these models with activation checkpointing: plan it on a trace generated with
//!   `--activation-checkpointing` (`teraio simulate --checkpointed-trace`), where the only
//!   activations crossing layers are the layer inputs and backward recomputes each layer.
//!   On a trace without checkpointing this policy offloads every saved activation instead,
//!   which DeepSpeed cannot do (generous to the baseline).
//! - Workspace and within-layer activations stay on the GPU.
//!
//! Layer blocks are maximal runs of consecutive kernels with the same `layer` tag. Without an
//! SSD tier there is no NVMe offload to model: the optimizer step then stays on the GPU.

use std::collections::HashMap;

use super::tree::ExcessTree;
use super::{Move, plan_from_moves};
use crate::hardware::{Hardware, Tier};
use crate::plan::{HostKernel, InitialPlacement, Plan, PlanStats};
use crate::trace::{TensorId, TensorKind, Trace};

/// Bytes per element of the AdamW moments (fp32 in every precision the generator makes).
const MOMENT_BYTES: u64 = 4;

pub(super) fn plan(trace: &Trace, hw: &Hardware, pipelined: bool) -> Plan {
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
    // Take host room over unrolled [l, r) if there is any.
    let mut take_host = |l: usize, r: usize, bytes: u64| -> bool {
        let ranges: Vec<(usize, usize)> =
            if r <= n { vec![(l, r)] } else { vec![(l, n), (0, r - n)] };
        let worst = ranges.iter().map(|&(a, b)| host.range_max(a, b)).max().unwrap_or(i64::MIN);
        if worst + bytes as i64 > 0 {
            return false;
        }
        for (a, b) in ranges {
            host.add(a, b, bytes as i64);
        }
        true
    };

    // Host kernels: those that access an optimizer state and create nothing (a tensor created
    // by a kernel is born in GPU memory, so that kernel cannot run on the CPU here).
    let per_kernel = trace.accesses_per_kernel();
    let on_host: Vec<bool> = per_kernel
        .iter()
        .enumerate()
        .map(|(k, ts)| {
            hw.has_ssd()
                && ts.iter().any(|&t| trace.tensor(t).kind == TensorKind::OptimizerState)
                && ts.iter().all(|&t| {
                    let t = trace.tensor(t);
                    t.global || t.alloc_kernel() != k
                })
        })
        .collect();

    let mut moves = Vec::new();
    let mut always = Vec::new();
    // Tier of a tensor while host kernel k reads it.
    let mut tier_at: HashMap<(usize, TensorId), Tier> = HashMap::new();
    let (mut ssd, mut host_bytes, mut candidates) = (0u64, 0u64, 0usize);
    for t in &trace.tensors {
        let gpu: Vec<usize> = t.accesses.iter().copied().filter(|&k| !on_host[k]).collect();
        let host_acc: Vec<usize> = t.accesses.iter().copied().filter(|&k| on_host[k]).collect();
        if gpu.is_empty() {
            // Never on the GPU (optimizer states): on NVMe for good. Host kernels exist only
            // with an SSD tier.
            if t.global {
                always.push(InitialPlacement { tensor: t.id, tier: Tier::Ssd });
                ssd += t.bytes;
                for &k in &host_acc {
                    tier_at.insert((k, t.id), Tier::Ssd);
                }
            }
            continue;
        }
        // (Optimizer states reach here only without an SSD tier: AdamW then runs on the GPU.)
        let state_like = matches!(
            t.kind,
            TensorKind::Weight | TensorKind::Gradient | TensorKind::OptimizerState
        );
        // Gaps between consecutive GPU accesses (unrolled for global tensors), and for a
        // non-global tensor last used by a host kernel, the tail to its death (`None`).
        let mut gaps: Vec<(usize, Option<usize>)> =
            gpu.windows(2).map(|w| (w[0], Some(w[1]))).collect();
        let last = gpu[gpu.len() - 1];
        if t.global {
            gaps.push((last, Some(gpu[0] + n)));
        } else if host_acc.last().is_some_and(|&h| h > last) {
            gaps.push((last, None));
        }
        for (a, b) in gaps {
            candidates += 1;
            let end = b.unwrap_or_else(|| t.free_kernel(n));
            // Host kernels in (a, end), unrolled.
            let hosted: Vec<usize> = host_acc
                .iter()
                .flat_map(|&h| [h, h + n])
                .filter(|&h| a < h && if b.is_some() { h < end } else { h <= end })
                .collect();
            let crosses = b.is_some_and(|b| layer_of(a) != layer_of(b) || bs(a) != bs(b));
            let wanted =
                state_like || (t.kind == TensorKind::Activation && crosses) || !hosted.is_empty();
            if !wanted {
                continue;
            }
            let prefetch_at = b.map(|b| {
                let s = bs(b);
                let look = if s == 0 { 0 } else { bs(s - 1) };
                // After the host kernels that need the tensor off the GPU.
                hosted.iter().map(|&h| h + 1).fold(look, usize::max).min(b)
            });
            if hosted.is_empty() && prefetch_at.is_some_and(|p| p < a + 2) {
                continue; // gap shorter than the lookahead: keep it resident
            }
            // Weights to NVMe; gradients and activations to host memory while it has room.
            let mut tier = Tier::Ssd;
            if t.kind != TensorKind::Weight || !hw.has_ssd() {
                // Held from the offload until the prefetch completes (by `b`) or until death.
                if take_host(a + 1, end + 1, t.bytes) {
                    tier = Tier::Host;
                } else if !hw.has_ssd() {
                    continue;
                }
            }
            match tier {
                Tier::Ssd => ssd += t.bytes,
                Tier::Host => host_bytes += t.bytes,
            }
            for &h in &hosted {
                tier_at.insert((h % n, t.id), tier);
            }
            moves.push(Move { tensor: t.id, offload_at: a + 1, prefetch_at, tier, urgent: false });
        }
    }

    let mut host_kernels = Vec::new();
    for (k, ts) in per_kernel.iter().enumerate() {
        if !on_host[k] {
            continue;
        }
        let moment = ts
            .iter()
            .map(|&t| trace.tensor(t))
            .find(|t| t.kind == TensorKind::OptimizerState)
            .map_or(0, |t| t.bytes);
        let params = moment / MOMENT_BYTES;
        let (mut read, mut write) = (0u64, 0u64);
        for &id in ts {
            let t = trace.tensor(id);
            let on_ssd = tier_at.get(&(k, id)) == Some(&Tier::Ssd);
            match t.kind {
                TensorKind::OptimizerState => {
                    read += t.bytes;
                    write += t.bytes;
                }
                // The updated weight goes back to NVMe; an fp32 weight is its own master
                // copy and is read too.
                TensorKind::Weight => {
                    write += t.bytes;
                    if t.bytes == moment && on_ssd {
                        read += t.bytes;
                    }
                }
                _ if on_ssd => read += t.bytes,
                _ => {}
            }
        }
        host_kernels.push(HostKernel {
            kernel: k,
            duration_us: params as f64 / hw.cpu_adam_params_per_s * 1e6,
            ssd_read_bytes: read,
            ssd_write_bytes: write,
            pipelined,
        });
    }
    let stats = PlanStats {
        peak_resident_bytes: trace.resident_memory_per_kernel().into_iter().max().unwrap_or(0),
        ssd_offload_bytes: ssd,
        host_offload_bytes: host_bytes,
        candidates,
        ..PlanStats::default()
    };
    let name = if pipelined { "zero-infinity-pipelined" } else { "zero-infinity" };
    plan_from_moves(trace, name, &moves, &always, host_kernels, stats)
}
