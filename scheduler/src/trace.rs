//! One training iteration as data: kernels (the clock) and tensors (what occupies memory).
//!
//! The JSON schema is documented in `docs/TRACE.md`. [`Trace::from_json`] checks every field
//! and names the bad one by its JSON path (`tensors[3].accesses[1]`); [`Trace::validate`]
//! checks the cross-field rules (ids dense, accesses sorted and in range, lifetimes sane).

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Error, Result};

/// Format tag written in every trace file.
pub const TRACE_FORMAT: &str = "teraio-trace";
/// Version of the trace schema this crate reads and writes.
pub const TRACE_VERSION: u64 = 1;

/// The most bytes of JSON text a trace (or plan) file may hold, decompressed, unless the
/// environment variable [`TRACE_TEXT_BYTES_MAX_ENV`] says more: 256 MiB. Readers stop at the
/// limit instead of decompressing (and parsing) whatever a small gzip file expands to. The
/// largest preset trace (`llama3-70b`, 14,619 kernels) is 6.8 MB of JSON; a generated trace of
/// a million kernels is about 270 MB.
pub const TRACE_TEXT_BYTES_MAX: u64 = 256 << 20;

/// The environment variable that raises (or lowers) [`TRACE_TEXT_BYTES_MAX`]: a number of bytes.
pub const TRACE_TEXT_BYTES_MAX_ENV: &str = "TERAIO_TRACE_BYTES_MAX";

/// The limit on a trace file's text: [`TRACE_TEXT_BYTES_MAX_ENV`] when set, else
/// [`TRACE_TEXT_BYTES_MAX`]. A value that is not a number of bytes is an error naming it.
pub fn trace_text_bytes_max() -> Result<u64> {
    match std::env::var(TRACE_TEXT_BYTES_MAX_ENV) {
        Err(_) => Ok(TRACE_TEXT_BYTES_MAX),
        Ok(v) => v.trim().parse::<u64>().map_err(|_| {
            Error::InvalidArgument(format!(
                "{TRACE_TEXT_BYTES_MAX_ENV}={v:?}: a number of bytes is required (e.g. \
                 1073741824 for 1 GiB; unset: {TRACE_TEXT_BYTES_MAX})"
            ))
        }),
    }
}

/// Identifier of a tensor: its index in [`Trace::tensors`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TensorId(pub u32);

impl TensorId {
    /// The index of this tensor in [`Trace::tensors`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for TensorId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "t{}", self.0)
    }
}

/// What a tensor holds. Only used for reporting and by policies that treat kinds differently
/// (`zero-infinity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// Model parameters.
    Weight,
    /// Gradients of parameters.
    Gradient,
    /// Optimizer states (AdamW first and second moments).
    OptimizerState,
    /// Activations saved for backward, and activation gradients.
    Activation,
    /// Scratch memory of one or a few kernels.
    Workspace,
}

impl TensorKind {
    /// All kinds, in reporting order.
    pub const ALL: [TensorKind; 5] = [
        TensorKind::Weight,
        TensorKind::Gradient,
        TensorKind::OptimizerState,
        TensorKind::Activation,
        TensorKind::Workspace,
    ];

    /// The JSON spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TensorKind::Weight => "weight",
            TensorKind::Gradient => "gradient",
            TensorKind::OptimizerState => "optimizer_state",
            TensorKind::Activation => "activation",
            TensorKind::Workspace => "workspace",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        TensorKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// One GPU kernel (operator) of the iteration. Kernels run one after another; kernel `i`'s
/// position in [`Trace::kernels`] is its id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Kernel {
    /// Operator name, e.g. `mb0.L3.fwd.qkv`.
    pub name: String,
    /// Execution time on the GPU with every tensor resident, in microseconds.
    pub duration_us: f64,
    /// Transformer layer the kernel belongs to, if any (used by layer-granular policies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u32>,
}

impl Kernel {
    /// The longest a kernel (or a producer's recomputation) may take, in microseconds: 10^12
    /// (11.6 days). Longer ones are refused when a trace is validated: sums of such times lose
    /// the short kernels' microseconds, and near `f64::MAX` they overflow to infinity.
    pub const DURATION_US_MAX: f64 = 1e12;
}

/// One tensor of the iteration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    /// Must equal the tensor's index in [`Trace::tensors`].
    pub id: TensorId,
    /// Human-readable name, e.g. `L3.wqkv`.
    pub name: String,
    /// Size in bytes (> 0).
    pub bytes: u64,
    /// What it holds.
    pub kind: TensorKind,
    /// Global tensors live across iterations: resident (or offloaded, per the plan) at
    /// iteration start, never die. Non-global tensors live from `created_by` to `dies_after`.
    pub global: bool,
    /// Kernel that creates (allocates and first writes) the tensor; `None` for global tensors.
    pub created_by: Option<usize>,
    /// Every kernel that reads or writes the tensor, strictly ascending, at least one. For a
    /// non-global tensor the first is `created_by`.
    pub accesses: Vec<usize>,
    /// Kernel after which the tensor is freed (>= its last access); `None` for global tensors.
    pub dies_after: Option<usize>,
    /// The accesses that write (modify) the tensor, a strictly ascending subset of
    /// `accesses`; the others only read it. `None` (JSON: field absent, as in traces made
    /// before the field existed) means every access writes, the conservative reading: no copy
    /// of the tensor is ever known to be up to date after an access. For a non-global tensor
    /// it must contain `created_by`. Written accesses decide when a tier copy stays valid
    /// (see [`crate::plan`](mod@crate::plan): clean drops).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writes: Option<Vec<usize>>,
    /// How to make the tensor again instead of keeping or moving it (recomputation): its
    /// creating kernel run once more, from `inputs`. `None` (JSON: absent): it cannot be
    /// recomputed. Only a non-global tensor can have one, and it is used only while nothing
    /// writes the tensor after its creation ([`Tensor::recomputable`]); see [`Producer`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub producer: Option<Producer>,
}

/// What recomputing a tensor takes: the op that created it (kernel [`Tensor::created_by`]),
/// run again on the same inputs. A plan may drop such a tensor after an access and remake it
/// right before a later one ([`crate::plan::Recompute`]); the result is the same tensor as
/// long as no input was written in between (planners check).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Producer {
    /// Tensors the op reads, each accessed by the creating kernel (the tensor itself and
    /// duplicates excluded). They must be resident when the op runs again.
    pub inputs: Vec<TensorId>,
    /// GPU time of the op alone, microseconds. `None` (JSON: absent): the creating kernel's
    /// duration (it makes nothing else); see [`Trace::recompute_us`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_us: Option<f64>,
}

impl Tensor {
    /// How to recompute the tensor, if it can be: it has a [`Producer`] and only its creating
    /// kernel writes it (with `writes` absent every access counts as a write: not
    /// recomputable, the op would not make the current value).
    pub fn recomputable(&self) -> Option<&Producer> {
        let c = self.created_by?;
        let only_created = self.writes.as_deref() == Some(&[c][..]);
        self.producer.as_ref().filter(|_| only_created && !self.global)
    }

    /// First kernel at which the tensor occupies memory in an all-resident run.
    pub fn alloc_kernel(&self) -> usize {
        self.created_by.unwrap_or(0)
    }

    /// Last kernel (inclusive) at which the tensor occupies memory in an all-resident run.
    pub fn free_kernel(&self, kernel_count: usize) -> usize {
        self.dies_after.unwrap_or(kernel_count.saturating_sub(1))
    }

    /// Whether the tensor occupies memory while kernel `k` runs in an all-resident run (a
    /// global tensor always does).
    pub fn alive_at(&self, k: usize, kernel_count: usize) -> bool {
        self.global || (self.alloc_kernel() <= k && k <= self.free_kernel(kernel_count))
    }

    /// Whether kernel `k` writes the tensor (false if `k` does not access it at all).
    pub fn writes_at(&self, k: usize) -> bool {
        match &self.writes {
            None => self.accesses.binary_search(&k).is_ok(),
            Some(w) => w.binary_search(&k).is_ok(),
        }
    }

    /// Whether any access writes the tensor.
    pub fn is_ever_written(&self) -> bool {
        self.writes.as_ref().is_none_or(|w| !w.is_empty())
    }
}

/// One training iteration on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trace {
    /// Always [`TRACE_FORMAT`].
    pub format: String,
    /// Always [`TRACE_VERSION`].
    pub version: u64,
    /// Free-form name (model preset, source).
    pub name: String,
    /// Kernels in execution order.
    pub kernels: Vec<Kernel>,
    /// Tensors, `tensors[i].id == TensorId(i)`.
    pub tensors: Vec<Tensor>,
}

impl Trace {
    /// An empty trace with the given name (add kernels and tensors, then [`Trace::validate`]).
    pub fn new(name: impl Into<String>) -> Self {
        Trace {
            format: TRACE_FORMAT.into(),
            version: TRACE_VERSION,
            name: name.into(),
            kernels: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Number of kernels.
    pub fn kernel_count(&self) -> usize {
        self.kernels.len()
    }

    /// The tensor with this id.
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.index()]
    }

    /// Iteration time with every tensor resident (the ideal), in microseconds.
    pub fn iteration_time_us(&self) -> f64 {
        self.kernels.iter().map(|k| k.duration_us).sum()
    }

    /// Start time of every kernel in an all-resident run, plus the iteration time at the end
    /// (`kernel_count + 1` entries), in microseconds.
    pub fn kernel_starts_us(&self) -> Vec<f64> {
        let mut t = 0.0;
        let mut v = Vec::with_capacity(self.kernels.len() + 1);
        for k in &self.kernels {
            v.push(t);
            t += k.duration_us;
        }
        v.push(t);
        v
    }

    /// Memory in use while each kernel runs if every tensor stays resident (bytes per kernel).
    pub fn resident_memory_per_kernel(&self) -> Vec<u64> {
        let n = self.kernels.len();
        let mut diff = vec![0i128; n + 1];
        for t in &self.tensors {
            diff[t.alloc_kernel()] += i128::from(t.bytes);
            diff[t.free_kernel(n) + 1] -= i128::from(t.bytes);
        }
        let mut acc = 0i128;
        diff[..n]
            .iter()
            .map(|d| {
                acc += d;
                acc as u64
            })
            .collect()
    }

    /// Tensors accessed by each kernel (ids per kernel, ascending).
    pub fn accesses_per_kernel(&self) -> Vec<Vec<TensorId>> {
        let mut v = vec![Vec::new(); self.kernels.len()];
        for t in &self.tensors {
            for &k in &t.accesses {
                v[k].push(t.id);
            }
        }
        v
    }

    /// GPU time to recompute tensor `id` ([`Producer`]), if it is recomputable.
    pub fn recompute_us(&self, id: TensorId) -> Option<f64> {
        let t = self.tensors.get(id.index())?;
        let p = t.recomputable()?;
        Some(p.duration_us.unwrap_or_else(|| self.kernels[t.created_by.unwrap_or(0)].duration_us))
    }

    /// Multiply every kernel duration by `factor` (> 0, finite). Used to make a trace replay
    /// in a chosen wall time on slower hardware.
    pub fn scale_durations(&mut self, factor: f64) -> Result<()> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "duration scale factor must be finite and > 0, got {factor}"
            )));
        }
        for k in &mut self.kernels {
            k.duration_us *= factor;
        }
        for d in self.tensors.iter_mut().filter_map(|t| t.producer.as_mut()?.duration_us.as_mut()) {
            *d *= factor;
        }
        Ok(())
    }

    /// Scale durations so the all-resident iteration takes `target_us` microseconds.
    pub fn scale_to_iteration_time(&mut self, target_us: f64) -> Result<()> {
        let now = self.iteration_time_us();
        if now <= 0.0 {
            return Err(Error::InvalidArgument("trace has zero total kernel time".into()));
        }
        self.scale_durations(target_us / now)
    }

    /// Check the cross-field rules. Errors name the field by its JSON path.
    pub fn validate(&self) -> Result<()> {
        if self.format != TRACE_FORMAT {
            return Err(Error::trace("format", format!("expected {TRACE_FORMAT:?}")));
        }
        if self.version != TRACE_VERSION {
            return Err(Error::trace(
                "version",
                format!("unsupported version {}, this build reads {TRACE_VERSION}", self.version),
            ));
        }
        let n = self.kernels.len();
        if n == 0 {
            return Err(Error::trace("kernels", "a trace needs at least one kernel"));
        }
        for (i, k) in self.kernels.iter().enumerate() {
            if !(k.duration_us.is_finite()
                && (0.0..=Kernel::DURATION_US_MAX).contains(&k.duration_us))
            {
                return Err(Error::trace(
                    format!("kernels[{i}].duration_us"),
                    format!(
                        "kernel {:?}: must be finite, >= 0 and at most {:e} (Kernel::DURATION_US_MAX), got {}",
                        k.name,
                        Kernel::DURATION_US_MAX,
                        k.duration_us
                    ),
                ));
            }
        }
        if self.tensors.len() > u32::MAX as usize {
            return Err(Error::trace("tensors", "more than 2^32 tensors"));
        }
        for (i, t) in self.tensors.iter().enumerate() {
            let p = |f: &str| format!("tensors[{i}].{f}");
            if t.id.index() != i {
                return Err(Error::trace(p("id"), format!("must equal its index {i}")));
            }
            if t.bytes == 0 {
                return Err(Error::trace(p("bytes"), "must be > 0"));
            }
            if t.accesses.is_empty() {
                return Err(Error::trace(p("accesses"), "a tensor needs at least one access"));
            }
            for (j, &a) in t.accesses.iter().enumerate() {
                if a >= n {
                    return Err(Error::trace(
                        format!("tensors[{i}].accesses[{j}]"),
                        format!("kernel {a} out of range (trace has {n} kernels)"),
                    ));
                }
                if j > 0 && a <= t.accesses[j - 1] {
                    return Err(Error::trace(
                        format!("tensors[{i}].accesses[{j}]"),
                        "accesses must be strictly ascending",
                    ));
                }
            }
            if let Some(w) = &t.writes {
                for (j, &k) in w.iter().enumerate() {
                    let path = format!("tensors[{i}].writes[{j}]");
                    if j > 0 && k <= w[j - 1] {
                        return Err(Error::trace(path, "writes must be strictly ascending"));
                    }
                    if t.accesses.binary_search(&k).is_err() {
                        return Err(Error::trace(
                            path,
                            format!("kernel {k} writes the tensor but is not one of its accesses"),
                        ));
                    }
                }
                if let Some(c) = t.created_by
                    && w.binary_search(&c).is_err()
                {
                    return Err(Error::trace(
                        p("writes"),
                        format!("must contain created_by {c}: the creating kernel writes it"),
                    ));
                }
            }
            let last = *t.accesses.last().unwrap_or(&0);
            if t.global {
                if t.created_by.is_some() {
                    return Err(Error::trace(p("created_by"), "must be null for a global tensor"));
                }
                if t.dies_after.is_some() {
                    return Err(Error::trace(p("dies_after"), "must be null for a global tensor"));
                }
            } else {
                let Some(c) = t.created_by else {
                    return Err(Error::trace(p("created_by"), "required for a non-global tensor"));
                };
                if c != t.accesses[0] {
                    return Err(Error::trace(
                        p("created_by"),
                        format!("must equal the first access {} (got {c})", t.accesses[0]),
                    ));
                }
                let Some(d) = t.dies_after else {
                    return Err(Error::trace(p("dies_after"), "required for a non-global tensor"));
                };
                if d < last || d >= n {
                    return Err(Error::trace(
                        p("dies_after"),
                        format!(
                            "must be in [{last}, {}] (last access .. last kernel), got {d}",
                            n - 1
                        ),
                    ));
                }
            }
            if let Some(pr) = &t.producer {
                self.validate_producer(i, t, pr)?;
            }
        }
        self.validate_byte_sums()
    }

    /// Every sum of sizes the scheduler takes (memory per kernel, bytes per inactive interval,
    /// traffic per access) is at most the sum over tensors of `bytes x accesses`: check that it
    /// fits in a `u64`, so none of them wraps. The error names the tensor where it overflows.
    fn validate_byte_sums(&self) -> Result<()> {
        let mut total = 0u64;
        for (i, t) in self.tensors.iter().enumerate() {
            let weight = (t.accesses.len() as u64).saturating_add(1);
            total = t.bytes.checked_mul(weight).and_then(|b| total.checked_add(b)).ok_or_else(
                || {
                    Error::trace(
                        format!("tensors[{i}].bytes"),
                        format!(
                            "tensor {:?} ({} bytes, {} accesses): the trace's sizes times their \
                             accesses add up to more than 2^64 - 1 bytes here; no sum over the \
                             trace could be computed",
                            t.name,
                            t.bytes,
                            t.accesses.len()
                        ),
                    )
                },
            )?;
        }
        Ok(())
    }

    /// The rules of [`Producer`] for tensor `i` (after its own fields were checked).
    fn validate_producer(&self, i: usize, t: &Tensor, pr: &Producer) -> Result<()> {
        let p = |f: &str| format!("tensors[{i}].producer{f}");
        let Some(c) = t.created_by.filter(|_| !t.global) else {
            return Err(Error::trace(p(""), "only a non-global tensor can be recomputed"));
        };
        if let Some(d) = pr.duration_us
            && !(d.is_finite() && (0.0..=Kernel::DURATION_US_MAX).contains(&d))
        {
            return Err(Error::trace(
                p(".duration_us"),
                format!(
                    "tensor {:?}: must be finite, >= 0 and at most {:e} (Kernel::DURATION_US_MAX), got {d}",
                    t.name,
                    Kernel::DURATION_US_MAX
                ),
            ));
        }
        for (j, &x) in pr.inputs.iter().enumerate() {
            let path = p(&format!(".inputs[{j}]"));
            let Some(input) = self.tensors.get(x.index()) else {
                return Err(Error::trace(path, format!("no tensor {x}")));
            };
            if x == t.id || pr.inputs[..j].contains(&x) {
                return Err(Error::trace(
                    path,
                    format!("{x} is the tensor itself or listed twice"),
                ));
            }
            if input.accesses.binary_search(&c).is_err() {
                return Err(Error::trace(
                    path,
                    format!("{x} is not accessed by the creating kernel {c}"),
                ));
            }
        }
        Ok(())
    }

    /// Parse and validate a trace from JSON text. Errors name the bad field by JSON path.
    pub fn from_json(text: &str) -> Result<Trace> {
        // A UTF-8 byte order mark (some Windows editors write one) is not JSON: skip it.
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let v: Value = serde_json::from_str(text)?;
        let trace = decode_trace(&v)?;
        trace.validate()?;
        Ok(trace)
    }

    /// Serialize to pretty JSON (the documented schema).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(unreachable_json)
    }
}

fn unreachable_json(e: serde_json::Error) -> String {
    // Serializing plain structs of numbers and strings cannot fail; keep the message if it does.
    format!("{{\"error\": {:?}}}", e.to_string())
}

fn obj<'a>(v: &'a Value, path: &str) -> Result<&'a Map<String, Value>> {
    v.as_object().ok_or_else(|| Error::trace(path, format!("expected an object, got {}", kind(v))))
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn field<'a>(o: &'a Map<String, Value>, path: &str, name: &str) -> Result<&'a Value> {
    o.get(name).ok_or_else(|| Error::trace(format!("{path}.{name}"), "missing field"))
}

fn u64_of(v: &Value, path: &str) -> Result<u64> {
    v.as_u64().ok_or_else(|| {
        Error::trace(path, format!("expected a non-negative integer, got {}", show(v)))
    })
}

fn usize_of(v: &Value, path: &str) -> Result<usize> {
    usize::try_from(u64_of(v, path)?).map_err(|_| Error::trace(path, "integer too large"))
}

fn opt_usize_of(v: &Value, path: &str) -> Result<Option<usize>> {
    if v.is_null() { Ok(None) } else { usize_of(v, path).map(Some) }
}

fn str_of<'a>(v: &'a Value, path: &str) -> Result<&'a str> {
    v.as_str().ok_or_else(|| Error::trace(path, format!("expected a string, got {}", show(v))))
}

fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 40 { format!("{} {}...", kind(v), &s[..s.floor_char_boundary(37)]) } else { s }
}

fn arr<'a>(v: &'a Value, path: &str) -> Result<&'a Vec<Value>> {
    v.as_array().ok_or_else(|| Error::trace(path, format!("expected an array, got {}", kind(v))))
}

fn decode_trace(v: &Value) -> Result<Trace> {
    let o = obj(v, "$")?;
    let format = str_of(field(o, "$", "format")?, "format")?.to_string();
    if format != TRACE_FORMAT {
        return Err(Error::trace("format", format!("expected {TRACE_FORMAT:?}, got {format:?}")));
    }
    let version = u64_of(field(o, "$", "version")?, "version")?;
    let name = match o.get("name") {
        Some(v) => str_of(v, "name")?.to_string(),
        None => String::new(),
    };
    let mut kernels = Vec::new();
    for (i, kv) in arr(field(o, "$", "kernels")?, "kernels")?.iter().enumerate() {
        let path = format!("kernels[{i}]");
        let ko = obj(kv, &path)?;
        let name = str_of(field(ko, &path, "name")?, &format!("{path}.name"))?.to_string();
        let dv = field(ko, &path, "duration_us")?;
        let duration_us = dv.as_f64().ok_or_else(|| {
            Error::trace(
                format!("{path}.duration_us"),
                format!("expected a number, got {}", show(dv)),
            )
        })?;
        let layer = match ko.get("layer") {
            None | Some(Value::Null) => None,
            Some(l) => Some(
                u32::try_from(u64_of(l, &format!("{path}.layer"))?)
                    .map_err(|_| Error::trace(format!("{path}.layer"), "integer too large"))?,
            ),
        };
        kernels.push(Kernel { name, duration_us, layer });
    }
    let mut tensors = Vec::new();
    for (i, tv) in arr(field(o, "$", "tensors")?, "tensors")?.iter().enumerate() {
        let path = format!("tensors[{i}]");
        let to = obj(tv, &path)?;
        let f = |name: &str| field(to, &path, name);
        let p = |name: &str| format!("{path}.{name}");
        let id = u64_of(f("id")?, &p("id"))?;
        let id = TensorId(u32::try_from(id).map_err(|_| Error::trace(p("id"), "id too large"))?);
        let name = str_of(f("name")?, &p("name"))?.to_string();
        let bytes = u64_of(f("bytes")?, &p("bytes"))?;
        let ks = str_of(f("kind")?, &p("kind"))?;
        let kind = TensorKind::parse(ks).ok_or_else(|| {
            Error::trace(
                p("kind"),
                format!(
                    "unknown kind {ks:?}, expected one of weight, gradient, optimizer_state, \
                     activation, workspace"
                ),
            )
        })?;
        let gv = f("global")?;
        let global = gv.as_bool().ok_or_else(|| {
            Error::trace(p("global"), format!("expected a boolean, got {}", show(gv)))
        })?;
        let created_by = match to.get("created_by") {
            None => None,
            Some(v) => opt_usize_of(v, &p("created_by"))?,
        };
        let dies_after = match to.get("dies_after") {
            None => None,
            Some(v) => opt_usize_of(v, &p("dies_after"))?,
        };
        let mut accesses = Vec::new();
        for (j, a) in arr(f("accesses")?, &p("accesses"))?.iter().enumerate() {
            accesses.push(usize_of(a, &format!("{path}.accesses[{j}]"))?);
        }
        let writes = match to.get("writes") {
            None | Some(Value::Null) => None,
            Some(v) => {
                let mut w = Vec::new();
                for (j, a) in arr(v, &p("writes"))?.iter().enumerate() {
                    w.push(usize_of(a, &format!("{path}.writes[{j}]"))?);
                }
                Some(w)
            }
        };
        let producer = match to.get("producer") {
            None | Some(Value::Null) => None,
            Some(v) => Some(decode_producer(v, &p("producer"))?),
        };
        tensors.push(Tensor {
            id,
            name,
            bytes,
            kind,
            global,
            created_by,
            accesses,
            dies_after,
            writes,
            producer,
        });
    }
    Ok(Trace { format, version, name, kernels, tensors })
}

fn decode_producer(v: &Value, path: &str) -> Result<Producer> {
    let o = obj(v, path)?;
    let mut inputs = Vec::new();
    for (j, x) in arr(field(o, path, "inputs")?, &format!("{path}.inputs"))?.iter().enumerate() {
        let p = format!("{path}.inputs[{j}]");
        let id = u32::try_from(u64_of(x, &p)?).map_err(|_| Error::trace(&p, "id too large"))?;
        inputs.push(TensorId(id));
    }
    let duration_us = match o.get("duration_us") {
        None | Some(Value::Null) => None,
        Some(dv) => Some(dv.as_f64().ok_or_else(|| {
            Error::trace(
                format!("{path}.duration_us"),
                format!("expected a number, got {}", show(dv)),
            )
        })?),
    };
    Ok(Producer { inputs, duration_us })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Trace {
        let mut t = Trace::new("small");
        for i in 0..4 {
            t.kernels.push(Kernel { name: format!("k{i}"), duration_us: 10.0, layer: None });
        }
        t.tensors.push(Tensor {
            id: TensorId(0),
            name: "w".into(),
            bytes: 100,
            kind: TensorKind::Weight,
            global: true,
            created_by: None,
            accesses: vec![0, 3],
            dies_after: None,
            writes: Some(vec![3]),
            producer: None,
        });
        t.tensors.push(Tensor {
            id: TensorId(1),
            name: "a".into(),
            bytes: 50,
            kind: TensorKind::Activation,
            global: false,
            created_by: Some(1),
            accesses: vec![1, 2],
            dies_after: Some(2),
            writes: None,
            producer: None,
        });
        t
    }

    #[test]
    fn json_round_trip() {
        let t = small();
        t.validate().unwrap();
        let back = Trace::from_json(&t.to_json()).unwrap();
        assert_eq!(back, t);
    }

    /// A generated trace read back from its JSON is the same trace to the last bit, so
    /// `preset:NAME` and the file `teraio trace gen` wrote plan and simulate identically.
    #[test]
    fn generated_durations_survive_json_exactly() {
        let mut cfg = crate::ModelConfig::preset("gpt2-small").unwrap();
        cfg.dtype = crate::Dtype::Tf32;
        let t = crate::generate(&cfg).unwrap();
        let back = Trace::from_json(&t.to_json()).unwrap();
        for (a, b) in t.kernels.iter().zip(&back.kernels) {
            assert_eq!(a.duration_us.to_bits(), b.duration_us.to_bits(), "{}", a.name);
        }
        assert_eq!(back, t);
    }

    #[test]
    fn bad_field_is_named_by_path() {
        let mut v: Value = serde_json::from_str(&small().to_json()).unwrap();
        v["tensors"][1]["bytes"] = Value::String("lots".into());
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[1].bytes"), "{e}");

        let mut v: Value = serde_json::from_str(&small().to_json()).unwrap();
        v["tensors"][0]["accesses"] = serde_json::json!([3, 1]);
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[0].accesses[1]"), "{e}");

        let mut v: Value = serde_json::from_str(&small().to_json()).unwrap();
        v["kernels"][2].as_object_mut().unwrap().remove("duration_us");
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("kernels[2].duration_us"), "{e}");

        let mut v: Value = serde_json::from_str(&small().to_json()).unwrap();
        v["tensors"][1]["kind"] = Value::String("ram".into());
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[1].kind"), "{e}");

        let mut v: Value = serde_json::from_str(&small().to_json()).unwrap();
        v["tensors"][1]["dies_after"] = serde_json::json!(1);
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[1].dies_after"), "{e}");
    }

    #[test]
    fn writes_default_to_every_access_and_are_checked() {
        let mut v: Value = serde_json::from_str(&small().to_json()).unwrap();
        assert!(v["tensors"][1].get("writes").is_none(), "None is not written out");
        assert_eq!(v["tensors"][0]["writes"], serde_json::json!([3]));
        let t = Trace::from_json(&v.to_string()).unwrap();
        assert!(t.tensors[1].writes_at(1) && t.tensors[1].writes_at(2));
        assert!(!t.tensors[0].writes_at(0) && t.tensors[0].writes_at(3));
        assert!(!t.tensors[0].writes_at(1), "not an access");

        v["tensors"][0]["writes"] = serde_json::json!([3, 1]);
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[0].writes[1]") && e.contains("ascending"), "{e}");
        v["tensors"][0]["writes"] = serde_json::json!([2]);
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[0].writes[0]") && e.contains("not one of"), "{e}");
        v["tensors"][0]["writes"] = serde_json::json!("all");
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[0].writes"), "{e}");
        v["tensors"][0]["writes"] = serde_json::json!([]);
        v["tensors"][1]["writes"] = serde_json::json!([2]);
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[1].writes") && e.contains("created_by 1"), "{e}");
        v["tensors"][1]["writes"] = serde_json::json!([1]);
        let t = Trace::from_json(&v.to_string()).unwrap();
        assert!(!t.tensors[0].is_ever_written());
        assert_eq!(Trace::from_json(&t.to_json()).unwrap(), t);
    }

    /// A producer round-trips through JSON, scales with the kernels, and every rule names the
    /// field: global tensors, inputs the creating kernel does not read, the tensor itself as
    /// input. A tensor written after its creation keeps its producer but is not recomputable.
    #[test]
    fn producers_are_checked_and_scaled() {
        let mut t = small();
        t.tensors[1].writes = Some(vec![1]);
        // Kernel 1 creates `a`; let it read `w` too, the input of the recomputation.
        t.tensors[0].accesses = vec![0, 1, 3];
        t.tensors[1].producer =
            Some(Producer { inputs: vec![TensorId(0)], duration_us: Some(4.0) });
        t.validate().unwrap();
        let back = Trace::from_json(&t.to_json()).unwrap();
        assert_eq!(back, t);
        let mut s = t.clone();
        s.scale_durations(2.0).unwrap();
        assert_eq!(s.recompute_us(TensorId(1)), Some(8.0));
        // Without a duration: the creating kernel's.
        s.tensors[1].producer.as_mut().unwrap().duration_us = None;
        assert_eq!(s.recompute_us(TensorId(1)), Some(20.0));
        assert_eq!(Trace::from_json(&s.to_json()).unwrap(), s);
        let err = |f: &dyn Fn(&mut Trace)| {
            let mut x = t.clone();
            f(&mut x);
            x.validate().unwrap_err().to_string()
        };
        assert!(t.tensors[1].recomputable().is_some());
        // Written after its creation (here: every access writes), it is not recomputable.
        let mut x = t.clone();
        x.tensors[1].writes = None;
        x.validate().unwrap();
        assert!(x.tensors[1].recomputable().is_none());
        let e = err(&|x| x.tensors[1].producer.as_mut().unwrap().inputs = vec![TensorId(1)]);
        assert!(e.contains("producer.inputs[0]") && e.contains("itself"), "{e}");
        let e = err(&|x| x.tensors[0].accesses = vec![0, 3]);
        assert!(e.contains("producer.inputs[0]") && e.contains("creating kernel 1"), "{e}");
        let e = err(&|x| x.tensors[1].producer.as_mut().unwrap().duration_us = Some(f64::NAN));
        assert!(e.contains("producer.duration_us"), "{e}");
        let e =
            err(&|x| x.tensors[0].producer = Some(Producer { inputs: vec![], duration_us: None }));
        assert!(e.contains("tensors[0].producer") && e.contains("non-global"), "{e}");
        let mut v: Value = serde_json::from_str(&t.to_json()).unwrap();
        v["tensors"][1]["producer"]["inputs"] = serde_json::json!(["w"]);
        let e = Trace::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("tensors[1].producer.inputs[0]"), "{e}");
    }

    #[test]
    fn memory_curve_and_scaling() {
        let mut t = small();
        assert_eq!(t.resident_memory_per_kernel(), vec![100, 150, 150, 100]);
        t.scale_to_iteration_time(80.0).unwrap();
        assert!((t.iteration_time_us() - 80.0).abs() < 1e-9);
        assert!(t.scale_durations(0.0).is_err());
    }
}
