//! Activation checkpointing as a choice of the plan: which layers a trainer checkpoints (their
//! forward run again in backward, as `torch.utils.checkpoint` does) so that the plan of the
//! rest, moves and single-tensor recomputations, runs fastest.
//!
//! A plan remakes a tensor from inputs still alive ([`crate::trace::Producer`]); checkpointing
//! remakes a whole layer from its input, including tensors whose inputs died during forward
//! (attention probabilities from the scores, for one). So the two are combined here at the
//! trace: [`rewrite`] makes the trace a checkpointed layer would give (its activations that
//! backward reads die at their last forward use, and a copy of the layer's forward kernels,
//! same durations, runs right before the first backward kernel that reads one, making them
//! anew), and [`choose_layers`] plans such traces through [`crate::choose`] for a few layer
//! sets and keeps the one that simulates fastest, or none. A front end then checkpoints those
//! layers, profiles the iteration as it now runs, and plans that trace.
//!
//! Layers are the trace's [`Kernel::layer`]s: a layer's forward is its first run of kernels
//! with that layer before the first backward kernel (a name starting with `bwd.`, as
//! teraio.torch's profiler names them, or holding `.bwd.` or ending in `.bwd`, as generated
//! traces do).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::hardware::Hardware;
use crate::select::{SelectOptions, choose};
use crate::sim::Outcome;
use crate::trace::{Kernel, Tensor, TensorId, Trace};
use crate::{Error, Result};

/// Name prefix of the kernels [`rewrite`] adds (each a copy of a forward kernel).
pub const RECOMPUTED_PREFIX: &str = "bwd.ckpt:";

fn is_backward(name: &str) -> bool {
    name.starts_with("bwd.") || name.contains(".bwd.") || name.ends_with(".bwd")
}

/// Where a trace's layers run forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardLayers {
    /// Each layer's forward: `layer -> (first kernel, last kernel)`.
    pub spans: BTreeMap<u32, (usize, usize)>,
    /// The last forward kernel (the one before the first backward kernel).
    pub end: usize,
}

/// Each layer's forward and the last forward kernel; `None` without a backward kernel (or
/// with one first).
pub fn forward_layers(trace: &Trace) -> Option<ForwardLayers> {
    let boundary = trace.kernels.iter().position(|k| is_backward(&k.name))?;
    let mut spans = BTreeMap::new();
    let mut k = 0;
    while k < boundary {
        let Some(l) = trace.kernels[k].layer else {
            k += 1;
            continue;
        };
        let a = k;
        while k + 1 < boundary && trace.kernels[k + 1].layer == Some(l) {
            k += 1;
        }
        spans.entry(l).or_insert((a, k));
        k += 1;
    }
    Some(ForwardLayers { spans, end: boundary.checked_sub(1)? })
}

/// [`forward_layers`], or the error that says why none can be checkpointed.
fn layers_of(trace: &Trace) -> Result<ForwardLayers> {
    forward_layers(trace).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "trace {:?}: no backward kernel (a name starting with `bwd.`, or holding `.bwd.` or \
             ending in `.bwd`), so no layer can be checkpointed",
            trace.name
        ))
    })
}

/// The trace as checkpointing `layers` makes it (see the module's doc). Layers that backward
/// reads nothing of are left as they are. An error names a layer the trace has no forward of.
pub fn rewrite(trace: &Trace, layers: &[u32]) -> Result<Trace> {
    let ForwardLayers { spans, end } = layers_of(trace)?;
    let n = trace.kernels.len();
    let mut chosen = Vec::new();
    for &l in layers {
        let Some(&span) = spans.get(&l) else {
            let have: Vec<u32> = spans.keys().copied().collect();
            return Err(Error::InvalidArgument(format!(
                "checkpoint layer {l}: the trace has no forward kernels of it (its layers: {have:?})"
            )));
        };
        if !chosen.iter().any(|&(m, _)| m == l) {
            chosen.push((l, span));
        }
    }
    // (read by the forward after the layer: the next layer's input, kept as it is)
    let kept = |t: &Tensor, b: usize| t.accesses.iter().any(|&a| b < a && a <= end);
    let made = |a: usize, b: usize| {
        trace
            .tensors
            .iter()
            .filter(move |t| !t.global && t.created_by.is_some_and(|c| (a..=b).contains(&c)))
    };
    // each layer's forward runs again before the first backward kernel reading what it saved
    let mut at: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
    for &(_, (a, b)) in &chosen {
        let first = made(a, b)
            .filter(|t| !kept(t, b))
            .filter_map(|t| t.accesses.iter().copied().find(|&x| x > end))
            .min();
        if let Some(j) = first {
            at.entry(j).or_default().push((a, b));
        }
    }
    let mut new_of = vec![0; n];
    let mut copies: Vec<((usize, usize), Vec<usize>)> = Vec::new();
    let mut kernels = Vec::with_capacity(n);
    for (j, kernel) in trace.kernels.iter().enumerate() {
        for &(a, b) in at.get(&j).into_iter().flatten() {
            let mut map = Vec::with_capacity(b - a + 1);
            for k in &trace.kernels[a..=b] {
                map.push(kernels.len());
                kernels.push(Kernel {
                    name: format!("{RECOMPUTED_PREFIX}{}", k.name),
                    duration_us: k.duration_us,
                    layer: None,
                });
            }
            copies.push(((a, b), map));
        }
        new_of[j] = kernels.len();
        kernels.push(kernel.clone());
    }
    let remap = |v: &[usize]| v.iter().map(|&k| new_of[k]).collect::<Vec<_>>();
    let mut tensors: Vec<Tensor> = trace
        .tensors
        .iter()
        .map(|t| Tensor {
            accesses: remap(&t.accesses),
            created_by: t.created_by.map(|c| new_of[c]),
            dies_after: t.dies_after.map(|d| new_of[d]),
            writes: t.writes.as_deref().map(remap),
            ..t.clone()
        })
        .collect();
    for ((a, b), map) in &copies {
        let (a, b) = (*a, *b);
        let copy = |k: usize| map[k - a];
        for t in &trace.tensors {
            let inside: Vec<usize> =
                t.accesses.iter().copied().filter(|k| (a..=b).contains(k)).collect();
            if inside.is_empty() {
                continue;
            }
            let ours = !t.global && t.created_by.is_some_and(|c| (a..=b).contains(&c));
            let written_inside = |w: &Vec<usize>| {
                w.iter().copied().filter(|k| (a..=b).contains(k)).map(copy).collect::<Vec<_>>()
            };
            if !ours {
                // made before the layer (its input, weights, tables): read again by the copy
                let y = &mut tensors[t.id.index()];
                y.accesses.extend(inside.iter().map(|&k| copy(k)));
                y.accesses.sort_unstable();
                y.accesses.dedup();
                if let Some(d) = y.dies_after.as_mut() {
                    *d = (*d).max(copy(*inside.last().expect("not empty")));
                }
                if let (Some(w), Some(orig)) = (y.writes.as_mut(), t.writes.as_ref()) {
                    w.extend(written_inside(orig));
                    w.sort_unstable();
                    w.dedup();
                }
                continue;
            }
            // made by the layer: the copy makes it anew, and what backward reads moves there
            let later: Vec<usize> = if kept(t, b) {
                Vec::new()
            } else {
                t.accesses.iter().copied().filter(|&k| k > end).collect()
            };
            let mut accesses: Vec<usize> = inside.iter().map(|&k| copy(k)).collect();
            accesses.extend(later.iter().map(|&k| new_of[k]));
            let writes = t.writes.as_ref().map(|w| {
                let mut v = written_inside(w);
                v.extend(w.iter().copied().filter(|k| later.contains(k)).map(|k| new_of[k]));
                v
            });
            let id = TensorId(tensors.len() as u32);
            tensors.push(Tensor {
                id,
                name: format!("ckpt:{}", t.name),
                bytes: t.bytes,
                kind: t.kind,
                global: false,
                created_by: Some(copy(t.created_by.expect("made by the layer"))),
                dies_after: accesses.last().copied(),
                accesses,
                writes,
                producer: None,
            });
            if !later.is_empty() {
                let y = &mut tensors[t.id.index()];
                y.accesses =
                    t.accesses.iter().copied().filter(|&k| k <= end).map(|k| new_of[k]).collect();
                y.dies_after = y.accesses.last().copied();
                if let Some(w) = t.writes.as_ref() {
                    y.writes =
                        Some(w.iter().copied().filter(|&k| k <= end).map(|k| new_of[k]).collect());
                }
            }
        }
    }
    let out = Trace { kernels, tensors, ..trace.clone() };
    out.validate()?;
    Ok(out)
}

/// One layer set [`choose_layers`] planned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tried {
    /// The layers checkpointed (none: the trace as it is).
    pub layers: Vec<u32>,
    /// The selected plan's simulated iteration, us; `None`: no plan ran.
    pub iteration_time_us: Option<f64>,
    /// Why no plan ran, if none did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

/// What [`choose_layers`] found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerChoice {
    /// The layers to checkpoint, ascending; empty: none (the trace's own plan is as fast).
    pub layers: Vec<u32>,
    /// Their plan's simulated iteration, us (`None`: no layer set gave a plan that runs).
    pub iteration_time_us: Option<f64>,
    /// The simulated iteration without checkpointing, us (`None`: its plan did not run).
    pub without_us: Option<f64>,
    /// Every set planned, in order.
    pub tried: Vec<Tried>,
    /// The choice in a sentence, for a log line.
    pub why: String,
}

/// Fraction by which a checkpointed plan must simulate faster than the trace's own to be
/// chosen (the rewrite's copies only estimate the recomputation).
pub const MIN_GAIN: f64 = 0.02;

/// The layers to checkpoint so that the plan [`choose`] selects for the rest runs fastest in
/// the simulator: no checkpointing, then `k` layers spread evenly for every `k`, then from the
/// fastest of those each layer toggled in turn (kept where it helps). A set is chosen only
/// when it simulates [`MIN_GAIN`] faster than no checkpointing (or that does not run).
/// Errors: only the trace's own (invalid) or a trace without layers or backward.
pub fn choose_layers(trace: &Trace, hw: &Hardware, opts: &SelectOptions) -> Result<LayerChoice> {
    trace.validate()?;
    let ForwardLayers { spans, .. } = layers_of(trace)?;
    let all: Vec<u32> = spans.keys().copied().collect();
    if all.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "trace {:?}: no kernel names a layer (Kernel::layer), so no layer can be checkpointed",
            trace.name
        )));
    }
    // (one plan each: the second plan for slower transfers is for the chosen trace's own)
    let opts = SelectOptions { traffic_margin: 0.0, ..opts.clone() };
    let mut tried: Vec<Tried> = Vec::new();
    let mut eval = |layers: &[u32]| -> Result<Option<f64>> {
        if let Some(t) = tried.iter().find(|t| t.layers == layers) {
            return Ok(t.iteration_time_us);
        }
        let rewritten;
        let t = if layers.is_empty() {
            trace
        } else {
            rewritten = rewrite(trace, layers)?;
            &rewritten
        };
        let (us, refused) = match choose(t, hw, &opts) {
            Ok(sel) if sel.report.outcome == Outcome::Completed => {
                (Some(sel.report.iteration_time_us), None)
            }
            Ok(sel) => {
                (None, Some(format!("its plan does not complete: {:?}", sel.report.outcome)))
            }
            Err(e) => (None, Some(e.to_string())),
        };
        tried.push(Tried { layers: layers.to_vec(), iteration_time_us: us, refused });
        Ok(us)
    };
    let faster = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(x), Some(y)) => x < y,
        (Some(_), None) => true,
        _ => false,
    };
    let without = eval(&[])?;
    let (mut best, mut best_us) = (Vec::new(), without);
    let n = all.len();
    for k in 1..=n {
        let set: Vec<u32> = (0..k).map(|i| all[i * n / k]).collect();
        let us = eval(&set)?;
        if faster(us, best_us) {
            (best, best_us) = (set, us);
        }
    }
    if !best.is_empty() {
        for &l in &all {
            let mut set = best.clone();
            match set.binary_search(&l) {
                Ok(i) => {
                    set.remove(i);
                }
                Err(i) => set.insert(i, l),
            }
            if set.is_empty() {
                continue;
            }
            let us = eval(&set)?;
            if faster(us, best_us) {
                (best, best_us) = (set, us);
            }
        }
    }
    let gain = match (best_us, without) {
        (Some(b), Some(w)) => b < w * (1.0 - MIN_GAIN),
        (Some(_), None) => true,
        _ => false,
    };
    let s = |us: Option<f64>| us.map_or("no plan".to_string(), |u| format!("{:.3} s", u / 1e6));
    let (layers, iteration_time_us, why) = if !best.is_empty() && gain {
        let why = format!(
            "checkpointing {} of {} layers ({best:?}) and planning the rest simulates {} against {} \
             without checkpointing",
            best.len(),
            n,
            s(best_us),
            s(without)
        );
        (best, best_us, why)
    } else if best_us.is_none() && without.is_none() {
        // (say why no plan runs, as the plan without checkpointing found it)
        let refused = tried[0].refused.as_deref().unwrap_or("no plan");
        let why = format!(
            "no checkpointing: none of the {} layer sets has a plan, nor the trace without \
             checkpointing: {refused}",
            tried.len() - 1
        );
        (Vec::new(), None, why)
    } else {
        let why = format!(
            "no checkpointing: the fastest of {} layer sets ({}) is not {:.0}% faster than the \
             plan without ({})",
            tried.len() - 1,
            s(best_us),
            MIN_GAIN * 100.0,
            s(without)
        );
        (Vec::new(), without, why)
    };
    Ok(LayerChoice { layers, iteration_time_us, without_us: without, tried, why })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{PlanOptions, Policy};
    use crate::trace::TensorKind;

    const GB: u64 = 1_000_000_000;

    /// `layers` layers of three forward kernels each: scores `s` (dies at the next kernel),
    /// probabilities `p` made from them (read again in the layer's backward: a saved
    /// activation, 1 GB) and the layer's output `h` (the next layer's input, read in backward
    /// too); an embedding kernel first, a loss after the layers, then one backward kernel per
    /// layer in reverse. No tensor has a producer: only checkpointing remakes anything.
    fn toy(layers: usize) -> Trace {
        let mut t = Trace::new("toy");
        let kernel = |t: &mut Trace, name: String, us: f64, layer: Option<u32>| {
            t.kernels.push(Kernel { name, duration_us: us, layer });
            t.kernels.len() - 1
        };
        let tensor =
            |t: &mut Trace, name: String, bytes: u64, global: bool, accesses: Vec<usize>| {
                let id = TensorId(t.tensors.len() as u32);
                let created_by = (!global).then(|| accesses[0]);
                t.tensors.push(Tensor {
                    id,
                    name,
                    bytes,
                    kind: if global { TensorKind::Weight } else { TensorKind::Activation },
                    global,
                    created_by,
                    dies_after: (!global).then(|| *accesses.last().unwrap()),
                    writes: Some(created_by.into_iter().collect()),
                    producer: None,
                    accesses,
                });
                id.index()
            };
        let emb = kernel(&mut t, "fwd.embedding".into(), 100.0, None);
        let mut fwd = Vec::new();
        for l in 0..layers as u32 {
            let k: Vec<usize> =
                (0..3).map(|i| kernel(&mut t, format!("fwd.op{i}"), 1_000.0, Some(l))).collect();
            fwd.push(k);
        }
        let loss = kernel(&mut t, "fwd.loss".into(), 100.0, None);
        let bwd: Vec<usize> = (0..layers)
            .map(|l| kernel(&mut t, format!("bwd.layer{}", layers - 1 - l), 2_000.0, None))
            .collect();
        let bwd_of = |l: usize| bwd[layers - 1 - l];
        // weights (global), read by their layer's forward and backward
        for (l, f) in fwd.iter().enumerate() {
            tensor(&mut t, format!("w{l}"), GB / 10, true, vec![f[0], bwd_of(l)]);
        }
        // the layers' inputs: h0 made by the embedding
        let mut input_accesses = vec![emb];
        for (l, f) in fwd.iter().enumerate() {
            let [k0, k1, k2] = [f[0], f[1], f[2]];
            input_accesses.extend([k0, bwd_of(l)]);
            input_accesses.sort_unstable();
            tensor(&mut t, format!("h{l}"), GB / 100, false, std::mem::take(&mut input_accesses));
            tensor(&mut t, format!("s{l}"), GB, false, vec![k0, k1]);
            tensor(&mut t, format!("p{l}"), GB, false, vec![k1, k2, bwd_of(l)]);
            input_accesses = vec![k2];
        }
        input_accesses.push(loss);
        tensor(&mut t, format!("h{layers}"), GB / 100, false, input_accesses);
        t.validate().unwrap();
        t
    }

    fn named<'a>(t: &'a Trace, name: &str) -> &'a Tensor {
        t.tensors.iter().find(|x| x.name == name).unwrap()
    }

    #[test]
    fn a_checkpointed_layer_makes_its_saved_activations_again_before_its_backward() {
        let t = toy(3);
        let c = rewrite(&t, &[1]).unwrap();
        assert_eq!(c.kernels.len(), t.kernels.len() + 3);
        // the copy runs right before layer 1's backward
        let b = c.kernels.iter().position(|k| k.name == "bwd.layer1").unwrap();
        let names: Vec<&str> = c.kernels[b - 3..b].iter().map(|k| k.name.as_str()).collect();
        assert_eq!(names, ["bwd.ckpt:fwd.op0", "bwd.ckpt:fwd.op1", "bwd.ckpt:fwd.op2"]);
        // p1 dies in forward; its copy is made by the copied op1 and read by the backward
        let p = named(&c, "p1");
        assert_eq!(p.dies_after, Some(*p.accesses.last().unwrap()));
        assert!(p.accesses.iter().all(|&k| !c.kernels[k].name.starts_with("bwd")));
        let q = named(&c, "ckpt:p1");
        assert_eq!(q.created_by, Some(b - 2));
        assert_eq!(q.accesses, vec![b - 2, b - 1, b]);
        // the scores live only within the copy; the layer's input is read by the copy
        let s = named(&c, "ckpt:s1");
        assert_eq!((s.created_by, s.dies_after), (Some(b - 3), Some(b - 2)));
        assert!(named(&c, "h1").accesses.contains(&(b - 3)));
        assert!(named(&c, "w1").accesses.contains(&(b - 3)));
        // the layer's output is the next layer's input: kept, the copy's is a temporary
        assert_eq!(named(&c, "h2").accesses.len(), named(&t, "h2").accesses.len());
        assert_eq!(named(&c, "ckpt:h2").accesses, vec![b - 1]);
        // layers 0 and 2 untouched: p0 still read in backward
        assert!(named(&c, "p0").accesses.iter().any(|&k| c.kernels[k].name == "bwd.layer0"));
        // one layer's saved 1 GB fewer at the forward's end
        let peak = |t: &Trace| *t.resident_memory_per_kernel().iter().max().unwrap();
        assert_eq!(peak(&t) - peak(&c), GB);
        // every layer: the peak is down to one layer's saved activations and the scores
        let all = rewrite(&t, &[0, 1, 2]).unwrap();
        assert_eq!(all.kernels.len(), t.kernels.len() + 9);
        assert!(peak(&all) < 3 * GB, "{}", peak(&all));
    }

    #[test]
    fn a_layer_the_trace_does_not_have_is_named() {
        let t = toy(2);
        let e = rewrite(&t, &[5]).unwrap_err().to_string();
        assert!(e.contains("checkpoint layer 5") && e.contains("[0, 1]"), "{e}");
        let mut no_bwd = t.clone();
        for k in &mut no_bwd.kernels {
            k.name = k.name.replace("bwd.", "other.");
        }
        let e = rewrite(&no_bwd, &[0]).unwrap_err().to_string();
        assert!(e.contains("no backward kernel"), "{e}");
        assert!(choose_layers(&no_bwd, &Hardware::paper(), &opts(GB)).is_err());
    }

    fn opts(budget: u64) -> SelectOptions {
        SelectOptions::cli(Policy::Auto, PlanOptions::default(), budget)
    }

    /// Slow transfers (1 GB/s), cheap forward kernels: a layer's saved gigabyte takes 1 s to
    /// move out and back, 3 ms to make again. Under a budget that holds two layers' saved
    /// activations of eight, checkpointing some layers wins; with memory for everything,
    /// nothing is checkpointed (it only costs).
    #[test]
    fn layers_are_checkpointed_where_that_simulates_faster_and_only_there() {
        let t = toy(8);
        let mut hw = Hardware::paper();
        hw.pcie_h2d_bytes_per_s = 1e9;
        hw.pcie_d2h_bytes_per_s = 1e9;
        hw.pcie_duplex_bytes_per_s = Some(2e9);
        let tight = 3 * GB;
        let c = choose_layers(&t, &hw, &opts(tight)).unwrap();
        assert!(!c.layers.is_empty(), "{}", c.why);
        let best = c.iteration_time_us.unwrap();
        assert!(c.without_us.is_none_or(|w| best < w * (1.0 - MIN_GAIN)), "{c:?}");
        // its figure is the plan of the rewritten trace, as `choose` selects it
        let again = choose(&rewrite(&t, &c.layers).unwrap(), &hw, &opts(tight)).unwrap();
        assert_eq!(again.report.iteration_time_us, best);
        assert!(c.tried.len() > 8 && c.tried[0].layers.is_empty());
        assert!(c.why.contains("checkpointing"), "{}", c.why);
        let roomy = choose_layers(&t, &hw, &opts(100 * GB)).unwrap();
        assert!(roomy.layers.is_empty(), "{roomy:?}");
        assert_eq!(roomy.iteration_time_us, roomy.without_us);
        assert!(roomy.why.starts_with("no checkpointing"), "{}", roomy.why);
        // a budget no plan fits: no layers, and the reason the plan without gave
        let none = choose_layers(&t, &hw, &opts(GB / 100)).unwrap();
        assert!(none.layers.is_empty() && none.iteration_time_us.is_none(), "{none:?}");
        let refused = none.tried[0].refused.clone().unwrap();
        assert!(none.tried.iter().all(|x| x.iteration_time_us.is_none()), "{none:?}");
        assert!(
            none.why.starts_with("no checkpointing: none of the") && none.why.ends_with(&refused),
            "{}",
            none.why
        );
    }
}
