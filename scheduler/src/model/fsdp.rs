//! FSDP2 in a generated trace: one rank's shards, FSDP's gathered parameters and its
//! collectives ([`ModelConfig::fsdp_ranks`], the module documentation's "FSDP2").
//!
//! The generator calls these at the edges of each *segment* (a unit's forward or backward
//! kernels); without FSDP every call is a no-op returning `None`, and the trace is the one it
//! always was.

use std::collections::HashMap;
use std::ops::Range;

use super::{Builder, FsdpCpuOffload, ModelConfig};
use crate::trace::{TensorId, TensorKind, Trace};

/// Bytes of one element on the link in a reduce-scatter: fp32, as FSDP2 reduces with
/// `MixedPrecisionPolicy(reduce_dtype=float32)` and in fp32 training.
const REDUCE_ELEMENT_BYTES: u64 = 4;

/// The generator's FSDP state.
pub(super) struct Fsdp {
    ranks: u64,
    overlap: bool,
    link_bytes_per_s: f64,
    /// `CPUOffloadPolicy`: the shards in host memory, copied in the collectives' streams.
    cpu_offload: Option<FsdpCpuOffload>,
    /// Per parameter: the tensor its compute kernels read now (its unit's gathered copy).
    read_as: Vec<Option<TensorId>>,
    /// Per parameter: the gradient its backward kernels write now (this micro-batch's
    /// unsharded one, until the reduce-scatter).
    grad_as: Vec<Option<TensorId>>,
    /// Every gathered unit, in gathering order.
    gathered: Vec<GatheredUnit>,
    /// Every collective, in kernel order.
    collectives: Vec<Collective>,
}

/// One all-gather's result: the unit's parameters whole, one tensor per parameter.
struct GatheredUnit {
    params: Vec<usize>,
    tensors: Vec<TensorId>,
    /// The kernel after which FSDP frees them (reshards): the last of the segment they were
    /// gathered for. Set by [`Builder::fsdp_release`].
    until: Option<usize>,
}

/// An all-gather or reduce-scatter kernel: its time on the link, its copy over PCIe (CPU
/// offload: an all-gather's shards up before, a reduce-scatter's down after, in its own
/// stream), and the compute kernels running meanwhile (they hide it).
struct Collective {
    kernel: usize,
    gather: bool,
    link_us: f64,
    copy_us: f64,
    hidden_by: Option<Range<usize>>,
}

impl Collective {
    /// Its time in its stream: the copy and the link transfer, one after the other.
    fn own_us(&self) -> f64 {
        self.link_us + self.copy_us
    }
}

/// A gathered unit, as the generator holds it between the all-gather and the release.
pub(super) struct Gathered {
    unit: usize,
    collective: usize,
}

/// A reduce-scatter whose link time the next segment hides.
pub(super) struct Scattered {
    collective: usize,
}

impl Fsdp {
    /// The state for `cfg`, or `None` without FSDP.
    pub(super) fn new(cfg: &ModelConfig) -> Option<Fsdp> {
        let ranks = u64::from(cfg.fsdp_ranks?);
        Some(Fsdp {
            ranks,
            overlap: !cfg.fsdp_no_overlap,
            link_bytes_per_s: cfg.link_bytes_per_s(),
            cpu_offload: cfg.fsdp_cpu_offload,
            read_as: Vec::new(),
            grad_as: Vec::new(),
            gathered: Vec::new(),
            collectives: Vec::new(),
        })
    }

    /// Size the per-parameter state for `params` parameters (once they are all made).
    pub(super) fn sized(&mut self, params: usize) {
        self.read_as = vec![None; params];
        self.grad_as = vec![None; params];
    }

    /// Link time of a ring collective moving `bytes` of whole tensors: each rank sends and
    /// receives `(ranks - 1) / ranks` of them.
    fn link_us(&self, bytes: u64) -> f64 {
        let n = self.ranks as f64;
        (n - 1.0) / n * bytes as f64 / self.link_bytes_per_s * 1e6
    }

    /// The CPU offload's rates, if the shards live in host memory.
    pub(super) fn cpu_offload(&self) -> Option<FsdpCpuOffload> {
        self.cpu_offload
    }

    /// Take out the tensors no kernel accesses (under CPU offload: the shards and optimizer
    /// states, which live in host memory), renumbering the others. Before producers are set.
    pub(super) fn drop_unaccessed(&mut self, trace: &mut Trace) {
        let mut new_id = vec![None; trace.tensors.len()];
        let mut kept = Vec::with_capacity(trace.tensors.len());
        for mut t in std::mem::take(&mut trace.tensors) {
            if t.accesses.is_empty() {
                continue;
            }
            debug_assert!(t.producer.is_none(), "{}: producers are set later", t.name);
            let id = TensorId(kept.len() as u32);
            new_id[t.id.index()] = Some(id);
            t.id = id;
            kept.push(t);
        }
        trace.tensors = kept;
        for g in &mut self.gathered {
            for t in &mut g.tensors {
                *t = new_id[t.index()].expect("a gathered tensor is accessed");
            }
        }
    }

    /// Give each collective kernel its exposed time. The collectives that overlap the same
    /// compute kernels keep the all-gather stream, the reduce-scatter stream and the link busy
    /// for the longest of: the all-gathers' copies and transfers, the reduce-scatters'
    /// transfers and copies, and every transfer on the link (the two streams share it); what
    /// that exceeds the compute's time is exposed, shared among them in proportion to their own
    /// time. Without overlap (or with no compute to hide behind) each takes its own time.
    pub(super) fn set_durations(&self, trace: &mut Trace) {
        let mut is_comm = vec![false; trace.kernel_count()];
        for c in &self.collectives {
            is_comm[c.kernel] = true;
        }
        let mut groups: HashMap<(usize, usize), Vec<&Collective>> = HashMap::new();
        for c in &self.collectives {
            match (&c.hidden_by, self.overlap) {
                (Some(r), true) => groups.entry((r.start, r.end)).or_default().push(c),
                _ => trace.kernels[c.kernel].duration_us = c.own_us(),
            }
        }
        for ((start, end), group) in groups {
            let compute: f64 =
                (start..end).filter(|&k| !is_comm[k]).map(|k| trace.kernels[k].duration_us).sum();
            let stream = |gather: bool| -> f64 {
                group.iter().filter(|c| c.gather == gather).map(|c| c.own_us()).sum()
            };
            let link: f64 = group.iter().map(|c| c.link_us).sum();
            let busy = stream(true).max(stream(false)).max(link);
            let exposed = (busy - compute).max(0.0);
            let own: f64 = group.iter().map(|c| c.own_us()).sum();
            for c in group {
                let share = if own > 0.0 { c.own_us() / own } else { 0.0 };
                trace.kernels[c.kernel].duration_us = exposed * share;
            }
        }
    }

    /// Make every gathered tensor one the planner keeps: accessed by every kernel from its
    /// all-gather to the end of its segment (no inactive interval to move it in, no
    /// producer), as teraio.torch leaves FSDP's unsharded parameters alone; and take the
    /// producer from every activation whose operator read one (FSDP may have freed it where a
    /// recomputation would run, so teraio.torch does not recompute those either).
    pub(super) fn keep_gathered(&self, trace: &mut Trace) {
        let mut gathered = vec![false; trace.tensors.len()];
        for g in &self.gathered {
            let until = g.until.expect("every gathered unit is released");
            for &t in &g.tensors {
                gathered[t.index()] = true;
                let x = &mut trace.tensors[t.index()];
                let from = x.accesses[0];
                debug_assert!(x.accesses.iter().all(|&k| k <= until), "{}", x.name);
                x.accesses = (from..=until).collect();
                x.created_by = Some(from);
                x.dies_after = Some(until);
            }
        }
        for t in &mut trace.tensors {
            if t.producer.as_ref().is_some_and(|p| p.inputs.iter().any(|i| gathered[i.index()])) {
                t.producer = None;
            }
        }
    }
}

impl Builder {
    /// The tensor a compute kernel reads for parameter `p`: its gathered copy under FSDP,
    /// else the weight.
    pub(super) fn weight(&self, p: usize) -> TensorId {
        match &self.fsdp {
            Some(f) => f.read_as[p].expect("an FSDP parameter is read while gathered"),
            None => self.params[p].weight,
        }
    }

    /// The gradient a backward kernel writes for parameter `p`: this micro-batch's unsharded
    /// one under FSDP, else the (accumulated) gradient.
    pub(super) fn grad(&self, p: usize) -> TensorId {
        match &self.fsdp {
            Some(f) => f.grad_as[p].expect("an FSDP gradient is written before its reduce-scatter"),
            None => self.params[p].grad,
        }
    }

    /// All-gather the parameters `ps` (one FSDP unit) of micro-batch `mb` in kernel `kernel`:
    /// one tensor per parameter, whole, in the parameters' dtype, named
    /// `mb{mb}.{weight}.unsharded{suffix}`. The copies are not read until [`Builder::fsdp_use`].
    pub(super) fn fsdp_all_gather(
        &mut self,
        mb: u32,
        kernel: String,
        layer: Option<u32>,
        ps: &[usize],
        suffix: &str,
    ) -> Option<Gathered> {
        self.fsdp.as_ref()?;
        let e = self.cfg.dtype.bytes();
        let mut tensors = Vec::new();
        let mut bytes = 0;
        for &p in ps {
            let full = self.params[p].elements * e;
            let name = &self.trace.tensors[self.params[p].weight.index()].name;
            let name = format!("mb{mb}.{name}.unsharded{suffix}");
            tensors.push(self.tensor(name, full, TensorKind::Weight, false));
            bytes += full;
        }
        // (under CPU offload the shards are in host memory: copied up first, fp32)
        let offload = self.fsdp.as_ref().and_then(Fsdp::cpu_offload);
        let mut uses: Vec<TensorId> = match offload {
            Some(_) => Vec::new(),
            None => ps.iter().map(|&p| self.params[p].weight).collect(),
        };
        uses.extend(&tensors);
        let kernel = self.kernel(kernel, layer, 0.0, &uses, Some(0.0));
        let shard_bytes: u64 = ps.iter().map(|&p| self.params[p].step_elements * 4).sum();
        let f = self.fsdp.as_mut().expect("fsdp");
        let copy_us = offload.map_or(0.0, |c| shard_bytes as f64 / c.h2d_bytes_per_s * 1e6);
        let link_us = f.link_us(bytes);
        f.collectives.push(Collective { kernel, gather: true, link_us, copy_us, hidden_by: None });
        f.gathered.push(GatheredUnit { params: ps.to_vec(), tensors, until: None });
        Some(Gathered { unit: f.gathered.len() - 1, collective: f.collectives.len() - 1 })
    }

    /// From here on the unit's compute kernels read its gathered copies.
    pub(super) fn fsdp_use(&mut self, g: &Option<Gathered>) {
        let (Some(f), Some(g)) = (self.fsdp.as_mut(), g) else { return };
        let unit = &f.gathered[g.unit];
        for (&p, &t) in unit.params.iter().zip(&unit.tensors) {
            f.read_as[p] = Some(t);
        }
    }

    /// FSDP frees (reshards) the unit's gathered copies after the kernel last generated.
    pub(super) fn fsdp_release(&mut self, g: &Option<Gathered>) {
        let last = self.trace.kernels.len().checked_sub(1);
        let (Some(f), Some(g)) = (self.fsdp.as_mut(), g) else { return };
        let unit = &mut f.gathered[g.unit];
        unit.until = last;
        for &p in &unit.params {
            f.read_as[p] = None;
        }
    }

    /// The kernels `since..` (those generated since) run while the collective of `g` is on
    /// the link: they hide its time.
    pub(super) fn fsdp_hide_gather(&mut self, g: &Option<Gathered>, since: usize) {
        if let Some(g) = g {
            self.hide(g.collective, since);
        }
    }

    /// [`Builder::fsdp_hide_gather`] for a reduce-scatter.
    pub(super) fn fsdp_hide_scatter(&mut self, s: &Option<Scattered>, since: usize) {
        if let Some(s) = s {
            self.hide(s.collective, since);
        }
    }

    fn hide(&mut self, collective: usize, since: usize) {
        let end = self.trace.kernels.len();
        if let Some(f) = self.fsdp.as_mut() {
            f.collectives[collective].hidden_by = Some(since..end);
        }
    }

    /// Micro-batch `mb`'s unsharded gradients of the parameters `ps`, for their backward
    /// kernels to write (named `mb{mb}.{gradient}.unsharded`, the parameters' dtype).
    pub(super) fn fsdp_unsharded_grads(&mut self, mb: u32, ps: &[usize]) {
        if self.fsdp.is_none() {
            return;
        }
        let e = self.cfg.dtype.bytes();
        for &p in ps {
            let name = &self.trace.tensors[self.params[p].grad.index()].name;
            let name = format!("mb{mb}.{name}.unsharded");
            let t = self.tensor(name, self.params[p].elements * e, TensorKind::Gradient, false);
            self.fsdp.as_mut().expect("fsdp").grad_as[p] = Some(t);
        }
    }

    /// Reduce-scatter the unsharded gradients of `ps` into the rank's gradient shards
    /// (created by the first micro-batch's, accumulated by the others') in kernel `kernel`;
    /// the unsharded gradients die after it.
    pub(super) fn fsdp_reduce_scatter(
        &mut self,
        kernel: String,
        layer: Option<u32>,
        ps: &[usize],
    ) -> Option<Scattered> {
        let f = self.fsdp.as_mut()?;
        let offload = f.cpu_offload;
        let mut uses = Vec::new();
        for &p in ps {
            uses.push(f.grad_as[p].take().expect("a gradient reduce-scattered once"));
        }
        // (under CPU offload the gradient shards go to host memory: copied down after, fp32)
        let shards: Vec<TensorId> = match offload {
            Some(_) => Vec::new(),
            None => ps.iter().map(|&p| self.params[p].grad).collect(),
        };
        uses.extend(&shards);
        let bytes: u64 = ps.iter().map(|&p| self.params[p].elements * REDUCE_ELEMENT_BYTES).sum();
        let kernel = self.kernel_writing(kernel, layer, 0.0, &uses, &shards, Some(0.0));
        let shard_bytes: u64 =
            ps.iter().map(|&p| self.params[p].step_elements * REDUCE_ELEMENT_BYTES).sum();
        let copy_us = offload.map_or(0.0, |c| shard_bytes as f64 / c.d2h_bytes_per_s * 1e6);
        let f = self.fsdp.as_mut().expect("fsdp");
        let link_us = f.link_us(bytes);
        f.collectives.push(Collective { kernel, gather: false, link_us, copy_us, hidden_by: None });
        Some(Scattered { collective: f.collectives.len() - 1 })
    }
}
