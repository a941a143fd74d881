//! A ZeRO-Infinity-like baseline (DeepSpeed ZeRO-3 with `offload_param` and
//! `offload_optimizer` on NVMe; Rajbhandari et al., SC'21): static, not bandwidth-aware;
//! parameters move as ZeRO-3's prefetcher moves them, activations and gradients by layer.
//!
//! What it models, per tensor kind, following DeepSpeed 0.19's code and checked against real
//! DeepSpeed runs on an H200 (`benches/gpu/zero_infinity_ds.py`, docs/BENCHMARKS.md):
//! - **Optimizer step on the CPU.** Every kernel that accesses an optimizer state (the AdamW
//!   kernels) and creates no tensor becomes a [`HostKernel`]: DeepSpeed's CPU-Adam updates the
//!   parameter in host memory at [`Hardware::cpu_adam_params_per_s`] while its states stream
//!   NVMe -> host -> NVMe. Parameters of the step = bytes of one optimizer state / 4 (AdamW
//!   moments are fp32). The step reads the moments and the fp32 master (an optimizer state
//!   of its own in bf16; for an fp32 weight DeepSpeed still keeps a separate fp32 partition)
//!   and the gradient, which DeepSpeed swaps out to NVMe at the start of the step (its
//!   gradient swapper) and back in with the states; it writes the gradient, the moments and
//!   the master, and the updated parameter copy where that lives on NVMe: 16 bytes read and
//!   16 (20 with the parameter copy) written per fp32 parameter, as the disk counters of a
//!   real DeepSpeed step showed (29.05 GB read, 35 GB written for 1.82 B parameters; the
//!   model 29.05 and 32.3). Read, compute and write run one after the other, as with
//!   DeepSpeed's default (`pipeline_read`/`pipeline_write` off); `zero-infinity-pipelined`
//!   overlaps them perfectly instead. The GPU runs nothing meanwhile.
//! - **Optimizer states** never enter GPU memory: they live on NVMe.
//! - **Parameters** on NVMe are released after every use and read again, even when the next
//!   use is within the prefetch lookahead (the swap buffer goes with the release), unless
//!   that use is the very next kernel: DeepSpeed re-read them on every use in the runs we
//!   measured (7.1 passes over its NVMe parameters per step, 2 micro-batches with forward,
//!   recomputation and backward each; the model reads 5.9), although its reuse rule would
//!   keep some. Those held in host memory are kept when used again before
//!   `stage3_max_reuse_distance` (10^9) parameter elements have been used in between (that
//!   rule, as DeepSpeed's code has it). Parameters are fetched back ahead of their next use
//!   by elements, as ZeRO-3's prefetcher does: from `stage3_prefetch_bucket_size` (5 x 10^7)
//!   elements ahead, twice that for those on NVMe
//!   (the NVMe prefetch reads up to twice what is being gathered), and at the latest when the
//!   kernel before them is fetched. The first `offload_param.max_in_cpu` (10^9) elements live
//!   in host memory, the rest on NVMe; parameters under `stage3_param_persistence_threshold`
//!   (10^5 elements: the norms) stay on the GPU but for the CPU step. A release to NVMe writes
//!   nothing: the parameter is unchanged since the CPU step updated its NVMe copy, so it is a
//!   clean drop ([`crate::plan`]), as in real ZeRO-3, which only rereads. A release of a
//!   parameter held in host memory is a write in the plan (a host copy does not outlive a
//!   prefetch there), which DeepSpeed does not do: that device-to-host traffic is the one
//!   place where the model charges ZeRO-Infinity more than DeepSpeed pays.
//! - **Gradients** are offloaded after every use to host memory (NVMe when the host tier is
//!   full), fetched back one layer ahead for the next micro-batch's accumulation; after the
//!   last backward use they stay off the GPU, go through NVMe in the CPU step (above) and
//!   die there.
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
use super::{Migration, plan_from_moves};
use crate::hardware::{Hardware, Tier};
use crate::plan::{HostKernel, InitialPlacement, Plan, PlanStats};
use crate::trace::{TensorId, TensorKind, Trace};

/// Bytes per element of the AdamW moments (fp32 in every precision the generator makes).
const MOMENT_BYTES: u64 = 4;

/// DeepSpeed's `stage3_max_reuse_distance` default, parameter elements: a parameter is not
/// released after a use when it is used again before this many parameter elements have been
/// used in between (`PartitionedParameterCoordinator::__params_to_release`). Applied to
/// parameters held in host memory only: measured, DeepSpeed re-read its NVMe parameters on
/// every use.
const MAX_REUSE_DISTANCE_ELEMENTS: u64 = 1_000_000_000;

/// DeepSpeed's `stage3_param_persistence_threshold` default, elements: smaller parameters
/// (the norms) are never partitioned, they stay in GPU memory (but for the CPU step, which
/// updates their fp32 master copy on the host).
const PERSISTENCE_THRESHOLD_ELEMENTS: u64 = 100_000;

/// DeepSpeed's `stage3_prefetch_bucket_size` default, parameter elements: how far ahead of
/// their use parameters are fetched to the GPU.
const PREFETCH_BUCKET_ELEMENTS: u64 = 50_000_000;

/// How far ahead parameters on NVMe are read: DeepSpeed swaps in the NVMe partitions of
/// upcoming parameters up to twice the elements being prefetched to the GPU at the time
/// (`__prefetch_nvme_param_partitions`), i.e. at most twice the prefetch bucket.
const NVME_LOOKAHEAD_ELEMENTS: u64 = 2 * PREFETCH_BUCKET_ELEMENTS;

/// DeepSpeed's `offload_param.max_in_cpu` default, parameter elements: with parameters
/// offloaded to NVMe, the first this many (in parameter order) stay in host memory instead
/// (stage 3's CPU flat buffer).
const MAX_IN_CPU_ELEMENTS: u64 = 1_000_000_000;

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

    // Parameter elements per weight: an AdamW moment's bytes / 4 (bytes / 4 without one).
    let mut elements: HashMap<TensorId, u64> = HashMap::new();
    for ts in &per_kernel {
        let moment =
            ts.iter().map(|&t| trace.tensor(t)).find(|t| t.kind == TensorKind::OptimizerState);
        if let Some(m) = moment {
            for &w in ts.iter().filter(|&&t| trace.tensor(t).kind == TensorKind::Weight) {
                elements.insert(w, m.bytes / MOMENT_BYTES);
            }
        }
    }
    let elements_of =
        |t: &crate::trace::Tensor| elements.get(&t.id).copied().unwrap_or(t.bytes / MOMENT_BYTES);
    // Parameter elements used by GPU kernels [0, x) of the unrolled iteration.
    let mut used = vec![0u64; 2 * n + 1];
    for x in 0..2 * n {
        let k = x % n;
        let here: u64 = if on_host[k] {
            0
        } else {
            per_kernel[k]
                .iter()
                .map(|&t| trace.tensor(t))
                .filter(|t| t.kind == TensorKind::Weight)
                .map(elements_of)
                .filter(|&e| e >= PERSISTENCE_THRESHOLD_ELEMENTS)
                .sum()
        };
        used[x + 1] = used[x] + here;
    }
    // The weights DeepSpeed keeps in host memory rather than on NVMe.
    let mut in_cpu = vec![false; trace.tensors.len()];
    let mut cpu_elements = 0u64;
    for t in trace.tensors.iter().filter(|t| t.kind == TensorKind::Weight) {
        cpu_elements += elements_of(t);
        if cpu_elements > MAX_IN_CPU_ELEMENTS {
            break;
        }
        in_cpu[t.id.index()] = true;
    }

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
        let weight = t.kind == TensorKind::Weight;
        // Weights live on NVMe but the first `MAX_IN_CPU_ELEMENTS`, held in host memory;
        // persistent ones stay on the GPU (but for the CPU step).
        let on_nvme = weight && !in_cpu[t.id.index()];
        let persistent = weight && elements_of(t) < PERSISTENCE_THRESHOLD_ELEMENTS;
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
                let look = if weight {
                    // ZeRO-3 prefetches parameters by elements, not layers: from the first
                    // kernel after which at most the lookahead's elements are used before
                    // `b`, and at the latest when the kernel using the parameters before
                    // them is fetched (the next parameter in the queue is always taken).
                    let ahead =
                        if on_nvme { NVME_LOOKAHEAD_ELEMENTS } else { PREFETCH_BUCKET_ELEMENTS };
                    let within = used[..=b].partition_point(|&u| u + ahead < used[b]);
                    let previous = used[..=b].partition_point(|&u| u < used[b]).saturating_sub(1);
                    within.min(previous)
                } else {
                    let s = bs(b);
                    if s == 0 { 0 } else { bs(s - 1) }
                };
                // After the host kernels that need the tensor off the GPU.
                let at = hosted.iter().map(|&h| h + 1).fold(look, usize::max);
                // A released NVMe parameter is read again even when its next use is within
                // the lookahead (its swap buffer went with it), unless that use is the very
                // next kernel.
                if on_nvme && !persistent { at.max(a + 2) } else { at }.min(b)
            });
            if hosted.is_empty() && prefetch_at.is_some_and(|p| p < a + 2) {
                continue; // gap shorter than the lookahead: keep it resident
            }
            let reused_soon = weight
                && !on_nvme
                && b.is_some_and(|b| used[b] - used[a + 1] < MAX_REUSE_DISTANCE_ELEMENTS);
            if hosted.is_empty() && (persistent || reused_soon) {
                continue; // DeepSpeed does not release it
            }
            // Weights on NVMe there; everything else (host-held weights, gradients, and
            // activations) to host memory while it has room, else NVMe. The gradients the
            // CPU step consumes go through NVMe within the step (see the host kernels below).
            let mut tier = Tier::Ssd;
            if !on_nvme || !hw.has_ssd() {
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
            moves.push(Migration {
                tensor: t.id,
                offload_at: a + 1,
                prefetch_at,
                tier,
                urgent: false,
            });
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
                // The updated parameter copy is written where it lives on NVMe. An fp32
                // weight has no master tensor in the trace, but DeepSpeed keeps one beside
                // the parameter partition all the same (stage 3's fp32 partitions), with the
                // optimizer states: it is read and written with them.
                TensorKind::Weight => {
                    if on_ssd {
                        write += t.bytes;
                    }
                    if t.bytes == moment {
                        read += t.bytes;
                        write += t.bytes;
                    }
                }
                // DeepSpeed copies the final gradients to host memory, swaps them out to
                // NVMe at the start of the step and back in with the optimizer states.
                TensorKind::Gradient if !on_ssd => {
                    read += t.bytes;
                    write += t.bytes;
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
