//! Where each parameter's optimizer update runs: on the GPU, its states moved as the plan
//! moves them, or on the host CPU, its states in host memory (issue 32).
//!
//! # The two choices, per update
//! An *update* ([`Update`]) is the optimizer's work on a set of parameters stepped together.
//! The optimizer's kernels are those that access an optimizer state and, to a fixpoint, those
//! that access a temporary one of them accesses (a square root of the second moments has
//! kernels of its own); an update is what those kernels access together (weights, gradients,
//! states, temporaries), with every kernel from its first to its last that touches them (a
//! weight decay that reads the parameters alone). So one parameter per update where the
//! trainer steps parameter by parameter (a generated trace's `NAME.adamw`), one chunk where it
//! steps chunks. Groups of scalar states alone (step counts) update no parameter and stay.
//! - **On the GPU**: the trace as it is. The states (AdamW: two moments, plus the fp32 master
//!   in bf16) are tensors like any other; where memory is short the plan moves them over PCIe
//!   with the weights and gradients, up to 16 bytes a parameter each way.
//! - **On the host**: the states live in host memory and never reach the GPU. When the
//!   parameters' last GPU access before the optimizer is done, each gradient is copied down
//!   (its bytes: 4 a parameter in fp32, 2 in bf16), the CPU updates them in
//!   `parameters / hardware.cpu_adam_params_per_s` seconds, queued behind the other host
//!   updates (the CPU runs one at a time) and not before the optimizer's step reaches the
//!   update (where its kernels were; [`PlaceOptions::in_backward`]: as soon as its gradients
//!   arrived, a trainer that updates during backward), and each weight is copied up (its
//!   bytes); the GPU runs the rest of the step and the next forward meanwhile, and a kernel
//!   that uses a weight waits for its copy ([`crate::plan::HostUpdate`], simulated by
//!   [`crate::sim`]).
//!
//! [`host_trace`] makes the GPU's trace for a choice (the host updates' states and optimizer
//! kernels gone, those kernels kept as empty slots of no time so kernel indices stay) and
//! their [`HostUpdate`]s; the plan for it is made by the usual planner and simulated with the
//! host updates, so a choice's iteration time counts the plan's migrations, the updates'
//! copies on the same links, and the CPU's queue.
//!
//! # The decision
//! [`place`] ranks the updates by how early their gradients are final (those finished first
//! have the most backward and forward to hide their copies and CPU time behind), then
//! simulates putting the first `m` of that order on the host, for `m` on a grid from 0 (all on
//! the GPU) to every update (all on the host), refines around the best, and keeps the fastest
//! (the fewest on the host among equals). All-GPU and all-host are always among the
//! candidates, so the choice never simulates slower than either.
//!
//! Host memory for the states (and the master copies, and the gradients' buffers) is taken
//! outside the host tier, as `teraio.torch`'s host optimizer takes it; [`Placement`] says how
//! much ([`Placement::host_state_bytes`]).
//!
//! An update stays on the GPU (`eligible` false, with the reason) when its optimizer kernels
//! touch a tensor of another update or a tensor that other kernels also use, when a weight or
//! gradient has no access outside them, or when nothing accesses its weights or gradients
//! before them.
//!
//! ```
//! use teraio_scheduler::{Hardware, ModelConfig, generate};
//! use teraio_scheduler::optimizer::{PlaceOptions, place};
//! let mut cfg = ModelConfig::preset("gpt2-small").unwrap();
//! cfg.layers = 2;
//! cfg.micro_batch = 1;
//! let trace = generate(&cfg).unwrap();
//! let mut hw = Hardware::paper();
//! hw.gpu_memory_bytes = 800_000_000; // below the all-resident peak: the plan moves tensors
//! let p = place(&trace, &hw, &PlaceOptions::default()).unwrap();
//! assert!(p.iteration_us <= p.all_gpu_us.unwrap_or(f64::INFINITY));
//! assert!(p.iteration_us <= p.all_host_us.unwrap_or(f64::INFINITY));
//! println!("{}", p.summary());
//! ```

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::hardware::Hardware;
use crate::plan::{HostUpdate, Plan};
use crate::planner::{PlanOptions, Policy, plan_checked};
use crate::sim::{Outcome, SimOptions, SimReport, simulate};
use crate::trace::{TensorId, TensorKind, Trace};
use crate::{Error, Result};

/// Bytes of one element of an optimizer state (fp32 in every optimizer teraio models).
const STATE_ELEMENT_BYTES: u64 = 4;

/// State tensors this small or smaller are scalars (a step count on the device), not one
/// element per parameter: left out of the parameter count.
const SCALAR_STATE_BYTES: u64 = 64;

/// The most candidates [`place`] simulates.
pub const CANDIDATES_MAX: usize = 64;

/// Fraction by which a placement with updates on the host must simulate faster than all-GPU to
/// be chosen ([`place`]). The host's side rests on a modelled CPU throughput and copies that
/// contend with the GPU's own transfers: on an H100 (2026-12-07, docs/BENCHMARKS.md) a
/// placement the model found 1.7% faster (25 of 111 parameters of a Llama 200 M in fp32) ran
/// 10% slower than all-GPU, and one it found 5.2% faster (all 111, when the model still ran
/// host updates during backward while teraio.torch runs them at the optimizer's step) 12%
/// slower: the model finds all-host about 18% faster against all-GPU than it runs there. With
/// the updates at the step modelled, all-host still simulated 4.9% faster on that machine. So
/// a placement must win by more than that error.
pub const HOST_MIN_GAIN: f64 = 0.20;

/// The optimizer's work on a set of parameters stepped together (see the module).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Update {
    /// Weights it writes (the parameters).
    pub weights: Vec<TensorId>,
    /// Their gradients.
    pub gradients: Vec<TensorId>,
    /// Optimizer states (moments, master copies).
    pub states: Vec<TensorId>,
    /// Its kernels on the GPU: those from the first to the last kernel accessing its states
    /// that access any of its tensors.
    pub kernels: Vec<usize>,
    /// Tensors only its kernels use (the step's scratch): gone with it on the host.
    pub temporaries: Vec<TensorId>,
    /// The last kernel before its first one that accesses one of its weights or gradients:
    /// on the host the update starts when this one finishes (0 when not eligible and none).
    pub after_kernel: usize,
    /// Parameters it updates (state elements per parameter tensor).
    pub params: u64,
    /// Bytes its gradients take (copied down on the host).
    pub gradient_bytes: u64,
    /// Bytes its weights take (copied up on the host).
    pub weight_bytes: u64,
    /// Bytes its states take (in host memory on the host, besides a fp32 master copy of each
    /// parameter and a gradient buffer).
    pub state_bytes: u64,
    /// GPU time of its kernels, microseconds.
    pub gpu_us: f64,
    /// CPU time on the host, microseconds (`params / cpu_adam_params_per_s`).
    pub cpu_us: f64,
    /// Whether it can run on the host.
    pub eligible: bool,
    /// Why not, when it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Union-find over tensor indices.
struct Sets(Vec<usize>);

impl Sets {
    fn find(&mut self, mut x: usize) -> usize {
        while self.0[x] != x {
            self.0[x] = self.0[self.0[x]];
            x = self.0[x];
        }
        x
    }
    fn union(&mut self, a: usize, b: usize) {
        let (a, b) = (self.find(a), self.find(b));
        if a != b {
            self.0[b] = a;
        }
    }
}

/// The trace's optimizer updates, in the order of their first kernel (module documentation).
/// A trace without optimizer states has none.
pub fn updates(trace: &Trace, hw: &Hardware) -> Result<Vec<Update>> {
    trace.validate()?;
    hw.validate()?;
    let per_kernel = trace.accesses_per_kernel();
    let kind = |t: TensorId| trace.tensor(t).kind;
    let is_state = |t: TensorId| kind(t) == TensorKind::OptimizerState;
    // Scratch: what a step computes in between (not global, neither weight nor gradient).
    let scratch = |t: TensorId| {
        !trace.tensor(t).global && !matches!(kind(t), TensorKind::Weight | TensorKind::Gradient)
    };
    // The optimizer's kernels: those that access a state and, to a fixpoint, those that access
    // the scratch of one of them (a step's temporaries, e.g. a square root of the second
    // moments, go through kernels of their own). Each kernel and tensor is visited once.
    let mut optimizer_kernel = vec![false; trace.kernel_count()];
    let mut stack: Vec<usize> = Vec::new();
    for (k, ts) in per_kernel.iter().enumerate() {
        if ts.iter().any(|&t| is_state(t)) {
            optimizer_kernel[k] = true;
            stack.push(k);
        }
    }
    let mut member = vec![false; trace.tensors.len()];
    while let Some(k) = stack.pop() {
        for &t in &per_kernel[k] {
            if member[t.index()] {
                continue;
            }
            member[t.index()] = true;
            if scratch(t) {
                for &a in &trace.tensor(t).accesses {
                    if !optimizer_kernel[a] {
                        optimizer_kernel[a] = true;
                        stack.push(a);
                    }
                }
            }
        }
    }
    // Updates: what the optimizer's kernels access together.
    let mut sets = Sets((0..trace.tensors.len()).collect());
    for (k, ts) in per_kernel.iter().enumerate() {
        if let (true, Some(first)) = (optimizer_kernel[k], ts.first()) {
            for t in &ts[1..] {
                sets.union(first.index(), t.index());
            }
        }
    }
    let mut by_root: HashMap<usize, usize> = HashMap::new();
    let mut groups: Vec<Vec<TensorId>> = Vec::new();
    for t in trace.tensors.iter().filter(|t| member[t.id.index()]) {
        let root = sets.find(t.id.index());
        let g = *by_root.entry(root).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(t.id);
    }
    let mut out: Vec<Update> = groups
        .into_iter()
        // (a group of scalar states alone, step counts a kernel of their own increments,
        // updates no parameter: it stays as it is)
        .filter(|g| {
            g.iter().any(|&t| is_state(t) && trace.tensor(t).bytes > SCALAR_STATE_BYTES)
                || g.iter().any(|&t| kind(t) == TensorKind::Weight)
        })
        .map(|g| update_of(trace, hw, &per_kernel, &optimizer_kernel, &mut sets, g))
        .collect();
    out.sort_by_key(|u| (u.kernels.first().copied().unwrap_or(usize::MAX), u.states[0]));
    debug_assert!(out.iter().all(|u| !u.states.is_empty()));
    // A kernel or scratch tensor two updates share: neither can leave the GPU alone.
    let mut owner: HashMap<usize, usize> = HashMap::new();
    let mut shared = vec![false; out.len()];
    for (i, u) in out.iter().enumerate() {
        for &k in &u.kernels {
            if let Some(&j) = owner.get(&k) {
                shared[i] = true;
                shared[j] = true;
            }
            owner.insert(k, i);
        }
    }
    for (u, s) in out.iter_mut().zip(shared) {
        if s && u.eligible {
            u.eligible = false;
            u.reason = Some("a kernel of it also steps another update".into());
        }
    }
    Ok(out)
}

fn update_of(
    trace: &Trace,
    hw: &Hardware,
    per_kernel: &[Vec<TensorId>],
    optimizer_kernel: &[bool],
    sets: &mut Sets,
    group: Vec<TensorId>,
) -> Update {
    let kind = |t: TensorId| trace.tensor(t).kind;
    let of = |k: TensorKind| group.iter().copied().filter(|&t| kind(t) == k).collect::<Vec<_>>();
    let (weights, gradients, states) =
        (of(TensorKind::Weight), of(TensorKind::Gradient), of(TensorKind::OptimizerState));
    let temporaries: Vec<TensorId> = group
        .iter()
        .copied()
        .filter(|&t| {
            !matches!(
                kind(t),
                TensorKind::Weight | TensorKind::Gradient | TensorKind::OptimizerState
            )
        })
        .collect();
    let root = sets.find(group[0].index());
    let mine = |t: TensorId, sets: &mut Sets| sets.find(t.index()) == root;
    // Its optimizer kernels, and the kernels between the first and the last of them that
    // touch its weights or gradients (a weight decay that reads the parameters alone).
    let own: Vec<usize> = (0..per_kernel.len())
        .filter(|&k| optimizer_kernel[k] && per_kernel[k].iter().any(|&t| mine(t, sets)))
        .collect();
    let lo = own.first().copied().unwrap_or(0);
    let hi = own.last().copied().unwrap_or(0);
    let kernels: Vec<usize> =
        (lo..=hi).filter(|&k| per_kernel[k].iter().any(|&t| mine(t, sets))).collect();
    let in_kernels = |k: usize| kernels.binary_search(&k).is_ok();
    let bytes = |v: &[TensorId]| v.iter().map(|&t| trace.tensor(t).bytes).sum::<u64>();
    let sized: Vec<u64> =
        states.iter().map(|&s| trace.tensor(s).bytes).filter(|&b| b > SCALAR_STATE_BYTES).collect();
    let per_param = sized.len().div_ceil(weights.len().max(1)).max(1) as u64;
    let params = sized.iter().sum::<u64>() / STATE_ELEMENT_BYTES / per_param;
    let mut u = Update {
        weights,
        gradients,
        states,
        kernels: kernels.clone(),
        temporaries,
        after_kernel: 0,
        params,
        gradient_bytes: 0,
        weight_bytes: 0,
        state_bytes: 0,
        gpu_us: kernels.iter().map(|&k| trace.kernels[k].duration_us).sum(),
        cpu_us: params as f64 / hw.cpu_adam_params_per_s * 1e6,
        eligible: true,
        reason: None,
    };
    u.gradient_bytes = bytes(&u.gradients);
    u.weight_bytes = bytes(&u.weights);
    u.state_bytes = bytes(&u.states);
    if u.weights.is_empty() || u.gradients.is_empty() {
        refuse(&mut u, "its optimizer kernels access no weight or no gradient".into());
    }
    // What else its kernels touch must be its own.
    for &k in &kernels {
        for &t in &per_kernel[k] {
            if !mine(t, sets) {
                let name = &trace.tensor(t).name;
                refuse(
                    &mut u,
                    format!("its kernel {k} also accesses {t} ({name}) of another update"),
                );
            }
        }
    }
    for &t in &u.temporaries.clone() {
        let x = trace.tensor(t);
        if let Some(&a) = x.accesses.iter().find(|&&a| !in_kernels(a)) {
            let name = &x.name;
            refuse(
                &mut u,
                format!("{t} ({name}), scratch of its step, is also used by kernel {a}"),
            );
        }
    }
    let own: Vec<TensorId> = u.weights.iter().chain(&u.gradients).copied().collect();
    for t in own {
        let x = trace.tensor(t);
        if x.accesses.iter().all(|&a| in_kernels(a)) {
            refuse(&mut u, format!("{t} ({}) has no access outside the optimizer", x.name));
        }
        if x.created_by.is_some_and(in_kernels) {
            refuse(&mut u, format!("{t} ({}) is created by the optimizer", x.name));
        }
    }
    let before = u
        .weights
        .iter()
        .chain(&u.gradients)
        .flat_map(|&t| trace.tensor(t).accesses.iter().copied())
        .filter(|&a| a < lo)
        .max();
    match before {
        Some(a) => u.after_kernel = a,
        None => refuse(&mut u, "nothing uses its weights or gradients before its step".into()),
    }
    u
}

/// Mark `u` as staying on the GPU, for `why` (the first reason found is kept).
fn refuse(u: &mut Update, why: String) {
    if u.eligible {
        u.eligible = false;
        u.reason = Some(why);
    }
}

/// The GPU's trace when the updates marked in `on_host` run on the host, and their host
/// updates (with tensor ids of that trace), and for each tensor of that trace its id in
/// `trace`. `on_host[i]` refers to `updates[i]` (of [`updates`]); an update that is not
/// eligible cannot be put on the host (an error naming it).
pub fn host_trace(
    trace: &Trace,
    updates: &[Update],
    on_host: &[bool],
) -> Result<(Trace, Vec<HostUpdate>, Vec<TensorId>)> {
    if on_host.len() != updates.len() {
        return Err(Error::InvalidArgument(format!(
            "on_host has {} entries for {} updates",
            on_host.len(),
            updates.len()
        )));
    }
    let n = trace.kernel_count();
    let mut gone_kernel = vec![false; n];
    let mut gone_tensor = vec![false; trace.tensors.len()];
    for (i, u) in updates.iter().enumerate().filter(|(i, _)| on_host[*i]) {
        if !u.eligible {
            return Err(Error::InvalidArgument(format!(
                "on_host[{i}]: update {i} (weights {:?}) cannot run on the host: {}",
                u.weights,
                u.reason.as_deref().unwrap_or("not eligible")
            )));
        }
        for &k in &u.kernels {
            gone_kernel[k] = true;
        }
        for &t in u.states.iter().chain(&u.temporaries) {
            gone_tensor[t.index()] = true;
        }
    }
    let mut new_id = vec![None; trace.tensors.len()];
    let mut old_id = Vec::new();
    for t in &trace.tensors {
        if !gone_tensor[t.id.index()] {
            new_id[t.id.index()] = Some(TensorId(old_id.len() as u32));
            old_id.push(t.id);
        }
    }
    let mut out = Trace::new(trace.name.clone());
    out.kernels = trace.kernels.clone();
    for (k, kernel) in out.kernels.iter_mut().enumerate() {
        if gone_kernel[k] {
            kernel.duration_us = 0.0;
        }
    }
    for &old in &old_id {
        let mut t = trace.tensor(old).clone();
        t.id = new_id[old.index()].expect("kept");
        t.accesses.retain(|&k| !gone_kernel[k]);
        if let Some(w) = &mut t.writes {
            w.retain(|&k| !gone_kernel[k]);
        }
        if let Some(p) = &t.producer {
            let inputs: Option<Vec<TensorId>> =
                p.inputs.iter().map(|x| new_id[x.index()]).collect();
            match inputs {
                Some(inputs) => t.producer.as_mut().expect("some").inputs = inputs,
                None => t.producer = None,
            }
        }
        out.tensors.push(t);
    }
    let map = |v: &[TensorId]| v.iter().map(|t| new_id[t.index()].expect("kept")).collect();
    let mut host: Vec<HostUpdate> = updates
        .iter()
        .zip(on_host)
        .filter(|(_, h)| **h)
        .map(|(u, _)| HostUpdate {
            after_kernel: u.after_kernel,
            gradients: map(&u.gradients),
            weights: map(&u.weights),
            cpu_us: u.cpu_us,
            // (at the optimizer's step: when the GPU reached its slots)
            cpu_after_kernel: u.kernels.first().map(|&k| k.saturating_sub(1).max(u.after_kernel)),
        })
        .collect();
    host.sort_by_key(|h| h.after_kernel);
    out.validate()?;
    Ok((out, host, old_id))
}

/// Options of [`place`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlaceOptions {
    /// The policy that plans each candidate's GPU trace.
    pub policy: Policy,
    /// Its options.
    pub plan: PlanOptions,
    /// Grid points simulated (including all-GPU and all-host), at least 2 and at most
    /// [`CANDIDATES_MAX`]; up to 4 more refine around the best.
    pub candidates: usize,
    /// Whether the trainer runs a host update as soon as its gradients arrived, during
    /// backward (teraio.torch's `offload_optimizer(update_in_backward=True)`); false (the
    /// default): at the optimizer's step, where its kernels were ([`HostUpdate::cpu_after_kernel`]).
    pub in_backward: bool,
}

impl Default for PlaceOptions {
    fn default() -> Self {
        PlaceOptions {
            policy: Policy::Auto,
            plan: PlanOptions::default(),
            candidates: 6,
            in_backward: false,
        }
    }
}

/// One simulated choice: the first `host_updates` updates of [`place`]'s order on the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// Updates on the host.
    pub host_updates: usize,
    /// Their parameters.
    pub host_params: u64,
    /// Simulated iteration, microseconds (`None`: no plan runs it; see `error`).
    pub iteration_us: Option<f64>,
    /// Why no plan runs it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// What [`place`] chose, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// The trace's updates ([`updates`]).
    pub updates: Vec<Update>,
    /// Per update: whether it runs on the host.
    pub on_host: Vec<bool>,
    /// The weights updated on the host (ids of the trace given).
    pub host_weights: Vec<TensorId>,
    /// Parameters updated on the host, and in all.
    pub host_params: u64,
    /// Parameters of every update.
    pub total_params: u64,
    /// Host memory the host updates' states, master copies and gradient buffers take, bytes.
    pub host_state_bytes: u64,
    /// The chosen placement's simulated iteration, microseconds.
    pub iteration_us: f64,
    /// Every update on the GPU (`None`: no plan runs it).
    pub all_gpu_us: Option<f64>,
    /// Every eligible update on the host (`None`: no plan runs it, or none is eligible).
    pub all_host_us: Option<f64>,
    /// The all-resident iteration of the trace, microseconds.
    pub ideal_us: f64,
    /// No plan of any placement is faster, microseconds ([`lower_bound`]).
    pub bound_us: f64,
    /// Every choice simulated, by updates on the host.
    pub candidates: Vec<Candidate>,
    /// The GPU's trace of the choice ([`host_trace`]), its plan (with the host updates) and
    /// that plan's simulation.
    pub trace: Trace,
    /// The plan.
    pub plan: Plan,
    /// Its simulation.
    pub report: SimReport,
}

impl Placement {
    /// One line: how many parameter tensors (and parameters) update on the host, and the
    /// model's iteration times of the choice, all-GPU, all-host and the lower bound.
    pub fn summary(&self) -> String {
        let s =
            |us: Option<f64>| us.map_or("no plan".to_string(), |u| format!("{:.3} s", u * 1e-6));
        let all: usize = self.updates.iter().map(|u| u.weights.len()).sum();
        format!(
            "optimizer: {} of {all} parameters ({:.3} G of {:.3} G) on the host, model {} vs {} \
             all-GPU vs {} all-host (bound {})",
            self.host_weights.len(),
            self.host_params as f64 / 1e9,
            self.total_params as f64 / 1e9,
            s(Some(self.iteration_us)),
            s(self.all_gpu_us),
            s(self.all_host_us),
            s(Some(self.bound_us)),
        )
    }
}

/// A choice simulated: its GPU trace, checked plan with host updates, and simulation.
type Simulated = (Trace, Plan, SimReport);

/// Plan and simulate the GPU's trace with the updates marked in `on_host` on the host.
/// `Ok(Err(why))` where no plan runs it (GPU or tier too small, out of memory).
pub fn simulate_choice(
    trace: &Trace,
    hw: &Hardware,
    updates: &[Update],
    on_host: &[bool],
    opts: &PlaceOptions,
) -> Result<std::result::Result<Simulated, String>> {
    let (gpu_trace, mut host, _) = host_trace(trace, updates, on_host)?;
    if opts.in_backward {
        for h in &mut host {
            h.cpu_after_kernel = None;
        }
    }
    let checked = match plan_checked(&gpu_trace, hw, opts.policy, &opts.plan) {
        Ok(c) => c,
        Err(
            e @ (Error::GpuMemoryTooSmall { .. }
            | Error::PlanOutOfMemory { .. }
            | Error::TierTooSmall { .. }),
        ) => return Ok(Err(e.to_string())),
        Err(e) => return Err(e),
    };
    let mut plan = checked.plan;
    if host.is_empty() {
        return Ok(Ok((gpu_trace, plan, checked.report)));
    }
    plan.host_updates = host;
    let report = simulate(&gpu_trace, &plan, hw, &SimOptions::default())?;
    if let Outcome::OutOfMemory { kernel, needed_bytes, .. } = report.outcome {
        return Ok(Err(format!(
            "with its host updates the plan runs out of GPU memory at kernel {kernel} \
             (needs {needed_bytes} more bytes)"
        )));
    }
    if report.ssd_cap_exceeded || report.host_cap_exceeded {
        return Ok(
            Err("with its host updates the plan needs more tier space than there is".into()),
        );
    }
    Ok(Ok((gpu_trace, plan, report)))
}

/// The order in which [`place`] moves updates to the host: eligible ones whose gradients are
/// final first (earliest `after_kernel`), the others never.
pub fn host_order(updates: &[Update]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..updates.len()).filter(|&i| updates[i].eligible).collect();
    order.sort_by_key(|&i| (updates[i].after_kernel, i));
    order
}

/// A lower bound on the iteration of every plan of every placement: [`crate::lower_bound`] of
/// the trace with every eligible update on the host and nothing charged for the host's work
/// (no state on the GPU, no optimizer kernel, no copy, no CPU time). Any placement's GPU trace
/// has at least these tensors and kernels, and its host updates only add work, so no plan of
/// it is faster.
pub fn lower_bound(trace: &Trace, hw: &Hardware) -> Result<f64> {
    let ups = updates(trace, hw)?;
    let all: Vec<bool> = ups.iter().map(|u| u.eligible).collect();
    let (t, _, _) = host_trace(trace, &ups, &all)?;
    Ok(crate::bound::lower_bound(&t, hw)?.iteration_us)
}

/// Choose which updates run on the host (module documentation): the fastest simulated
/// placement among all-GPU, all-host and the first `m` of [`host_order`] for `m` on a grid of
/// `opts.candidates` points (refined around the best), unless it is within [`HOST_MIN_GAIN`]
/// of all-GPU (then all-GPU). An error where no placement has a plan that runs (the error of
/// all-GPU's), or for bad options.
pub fn place(trace: &Trace, hw: &Hardware, opts: &PlaceOptions) -> Result<Placement> {
    if !(2..=CANDIDATES_MAX).contains(&opts.candidates) {
        return Err(Error::InvalidArgument(format!(
            "candidates {}: at least 2 (all-GPU and all-host) and at most {CANDIDATES_MAX}",
            opts.candidates
        )));
    }
    let ups = updates(trace, hw)?;
    let order = host_order(&ups);
    let e = order.len();
    let choice = |m: usize| {
        let mut on = vec![false; ups.len()];
        for &i in &order[..m] {
            on[i] = true;
        }
        on
    };
    let mut tried: Vec<(usize, std::result::Result<Simulated, String>)> = Vec::new();
    let run = |m: usize, tried: &mut Vec<(usize, std::result::Result<Simulated, String>)>| {
        if tried.iter().any(|(x, _)| *x == m) {
            return Ok(());
        }
        let r = simulate_choice(trace, hw, &ups, &choice(m), opts)?;
        tried.push((m, r));
        Ok::<(), Error>(())
    };
    let points = opts.candidates.min(e + 1);
    for j in 0..points {
        let m = if points <= 1 { 0 } else { (j * e + (points - 1) / 2) / (points - 1) };
        run(m, &mut tried)?;
    }
    // Refine: halfway to each neighbour of the best, twice.
    let time = |r: &std::result::Result<Simulated, String>| {
        r.as_ref().map_or(f64::INFINITY, |(_, _, rep)| rep.iteration_time_us)
    };
    for _ in 0..2 {
        let best = best_of(&tried, &time);
        let mut ms: Vec<usize> = tried.iter().map(|(m, _)| *m).collect();
        ms.sort_unstable();
        let Some(b) = best else { break };
        let pos = ms.iter().position(|&m| m == b).expect("tried");
        let mut next = Vec::new();
        if pos > 0 {
            next.push((ms[pos - 1] + b) / 2);
        }
        if pos + 1 < ms.len() {
            next.push((b + ms[pos + 1]).div_ceil(2));
        }
        for m in next {
            run(m, &mut tried)?;
        }
    }
    let params_of = |m: usize| order[..m].iter().map(|&i| ups[i].params).sum::<u64>();
    let mut candidates: Vec<Candidate> = tried
        .iter()
        .map(|(m, r)| Candidate {
            host_updates: *m,
            host_params: params_of(*m),
            iteration_us: r.as_ref().ok().map(|(_, _, rep)| rep.iteration_time_us),
            error: r.as_ref().err().cloned(),
        })
        .collect();
    candidates.sort_by_key(|c| c.host_updates);
    let at =
        |m: usize| candidates.iter().find(|c| c.host_updates == m).and_then(|c| c.iteration_us);
    let (all_gpu_us, all_host_us) = (at(0), if e > 0 { at(e) } else { None });
    let Some(best) = best_of(&tried, &time) else {
        let why = tried
            .iter()
            .find(|(m, _)| *m == 0)
            .and_then(|(_, r)| r.as_ref().err().cloned())
            .unwrap_or_default();
        return Err(Error::InvalidArgument(format!(
            "no placement of the optimizer's updates has a plan that runs on this hardware \
             (all on the GPU: {why})"
        )));
    };
    // (a near tie stays on the GPU: HOST_MIN_GAIN)
    let best = match (all_gpu_us, at(best)) {
        (Some(g), Some(b)) if best > 0 && b > g * (1.0 - HOST_MIN_GAIN) => 0,
        _ => best,
    };
    let idx = tried.iter().position(|(m, _)| *m == best).expect("tried");
    let (_, r) = tried.swap_remove(idx);
    let (gpu_trace, plan, report) = r.expect("the best runs");
    let on_host = choice(best);
    let host_weights: Vec<TensorId> = ups
        .iter()
        .zip(&on_host)
        .filter(|(_, h)| **h)
        .flat_map(|(u, _)| u.weights.iter().copied())
        .collect();
    let host_state_bytes = ups
        .iter()
        .zip(&on_host)
        .filter(|(_, h)| **h)
        .map(|(u, _)| u.state_bytes + 2 * u.params * STATE_ELEMENT_BYTES)
        .sum();
    Ok(Placement {
        host_params: params_of(best),
        total_params: ups.iter().map(|u| u.params).sum(),
        host_state_bytes,
        host_weights,
        iteration_us: report.iteration_time_us,
        all_gpu_us,
        all_host_us,
        ideal_us: trace.iteration_time_us(),
        bound_us: lower_bound(trace, hw)?,
        candidates,
        on_host,
        updates: ups,
        trace: gpu_trace,
        plan,
        report,
    })
}

/// The choice of `tried` with the shortest iteration (the fewest on the host among equals);
/// `None` where none runs.
fn best_of<T>(tried: &[(usize, T)], time: &impl Fn(&T) -> f64) -> Option<usize> {
    tried
        .iter()
        .map(|(m, r)| (time(r), *m))
        .filter(|(t, _)| t.is_finite())
        .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
        .map(|(_, m)| m)
}
