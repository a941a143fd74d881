//! `teraio._teraio`: the native half of the Python package. It translates types and errors and
//! nothing else; the public API (`teraio.Engine`, buffers, exceptions, dataclasses) is the pure
//! Python layer in `python/teraio/__init__.py`, documented in docs/PYTHON.md.
//!
//! Caller memory arrives as the Python object itself; its address, length and layout are read
//! here (export.rs: the buffer protocol, `__array_interface__`, `__cuda_array_interface__`,
//! `teraio.DeviceMemory`), never through a call back into the `teraio` package. Every call that
//! blocks or copies releases the GIL.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use pyo3::exceptions::{PyMemoryError, PyTimeoutError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};
use teraio_bindings_core::{self as core, ConfigSource, Error, HostBuffer as CoreBuffer, Op};
use teraio_engine::Engine as CoreEngine;
use teraio_engine::executor::{AllocFor, Event, Executor, ExecutorConfig, TensorAllocator};
use teraio_engine::store::OffloadOptions;
use teraio_engine::tier::TensorMem;
use teraio_scheduler::TensorId;

mod export;

/// The package's exception classes by name (`teraio._errors`), handed down by the package when
/// it is imported (`set_error_classes`): the native module never imports the package above it.
static ERROR_CLASSES: Mutex<Option<Py<PyDict>>> = Mutex::new(None);

/// Raise `e` as the `teraio` exception of its status (`teraio._errors`).
pub(crate) fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let class = e.status().python_class();
    let cls = ERROR_CLASSES.lock().as_ref().and_then(|d| d.bind(py).get_item(class).ok().flatten());
    match cls.map(|c| c.cast_into::<PyType>()) {
        Some(Ok(t)) => PyErr::from_type(t, e.to_string()),
        _ => pyo3::exceptions::PyRuntimeError::new_err(format!(
            "{e} (teraio.{class}: the package's exception classes were not handed to the native \
             module; import teraio, not teraio._teraio alone)"
        )),
    }
}

/// The package's exception classes, `{class name: class}` for every name of `status_codes()`
/// (`teraio/__init__.py` calls this once when imported).
#[pyfunction]
fn set_error_classes(classes: Bound<'_, PyDict>) -> PyRes<()> {
    for (name, _) in status_codes() {
        let ok = classes.get_item(name)?.is_some_and(|c| c.is_instance_of::<PyType>());
        if !ok {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "set_error_classes: no exception class {name:?}"
            )));
        }
    }
    *ERROR_CLASSES.lock() = Some(classes.unbind());
    Ok(())
}

fn err(e: Error) -> PyErr {
    Python::attach(|py| to_py(py, &e))
}

type PyRes<T> = PyResult<T>;

/// Run `f` (the call `what`) with the GIL released; a panic becomes `teraio.InternalError`
/// (never pyo3's `PanicException`, a `BaseException`), and nothing is printed.
fn run<R: Send>(
    py: Python<'_>,
    what: &str,
    f: impl FnOnce() -> core::Result<R> + Send,
) -> PyRes<R> {
    py.detach(|| core::catch(what, f)).map_err(err)
}

fn json_arg(text: Option<&str>, what: &str) -> core::Result<Option<serde_json::Value>> {
    text.map(|t| {
        serde_json::from_str(t).map_err(|e| Error::InvalidArgument(format!("{what}: {e}")))
    })
    .transpose()
}

/// The native engine (wrapped by `teraio.Engine`).
#[pyclass(frozen, module = "teraio._teraio")]
struct NativeEngine {
    engine: RwLock<Option<CoreEngine>>,
}

impl NativeEngine {
    /// Run `f` on the open engine with the GIL released.
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&CoreEngine) -> core::Result<R> + Send,
    ) -> PyRes<R> {
        run(py, "teraio.Engine", || {
            let g = self.engine.read_recursive();
            let e = g.as_ref().ok_or_else(|| Error::Closed("the engine was closed".into()))?;
            f(e)
        })
    }
}

/// (device address, bytes) of the device memory an `*_device` call (`call`: `offload` or
/// `prefetch`) was given, or a clear error.
fn device_arg(mem: &Bound<'_, PyAny>, call: &str) -> core::Result<(u64, u64)> {
    export::device(mem, "mem")?.ok_or_else(|| {
        Error::InvalidArgument(format!(
            "mem: device memory (DeviceMemory or a CUDA array) is required, not {}; host buffers \
             go through {call}()",
            mem.get_type().name().map(|n| n.to_string()).unwrap_or_default()
        ))
    })
}

fn options(
    name: Option<String>,
    destination: &str,
    priority: &str,
) -> core::Result<OffloadOptions> {
    Ok(OffloadOptions {
        destination: core::parse_destination(destination)?,
        priority: core::parse_priority(priority)?,
        name,
    })
}

#[pymethods]
impl NativeEngine {
    /// Open an engine. `source` is `"default"`, `"toml"`, `"json"` or `"file"`; `text` the
    /// configuration text or path; `overrides_json` a JSON object of configuration keys.
    #[new]
    #[pyo3(signature = (source, text=None, overrides_json=None))]
    fn new(
        py: Python<'_>,
        source: &str,
        text: Option<String>,
        overrides_json: Option<String>,
    ) -> PyRes<Self> {
        let engine = run(py, "teraio.Engine", || {
            let over = json_arg(overrides_json.as_deref(), "engine options")?;
            let t = text.as_deref().unwrap_or("");
            let src = match source {
                "default" => ConfigSource::Default,
                "toml" => ConfigSource::Toml(t),
                "json" => ConfigSource::Json(t),
                "file" => ConfigSource::File(std::path::Path::new(t)),
                other => {
                    return Err(Error::InvalidArgument(format!("configuration source {other:?}")));
                }
            };
            core::open_engine(src, over.as_ref())
        })?;
        Ok(NativeEngine { engine: RwLock::new(Some(engine)) })
    }

    /// Drain, checkpoint (persistent engines) and release; a failed final checkpoint is
    /// raised (the engine is closed anyway). Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyRes<()> {
        run(py, "Engine.close", || {
            let e = self.engine.write().take();
            if let Some(e) = e {
                e.close()?;
            }
            Ok(())
        })
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.engine.read().is_none()
    }

    /// What the engine is (JSON).
    fn info_json(&self, py: Python<'_>) -> PyRes<String> {
        self.with(py, |e| Ok(core::engine_json(e).to_string()))
    }

    /// Migration statistics (JSON).
    fn stats_json(&self, py: Python<'_>) -> PyRes<String> {
        self.with(py, |e| Ok(core::stats_json(e).to_string()))
    }

    /// Every tensor (JSON array).
    fn tensors_json(&self, py: Python<'_>) -> PyRes<String> {
        self.with(py, |e| Ok(core::tensors_json(e).to_string()))
    }

    /// One tensor (JSON) or None.
    fn tensor_json(&self, py: Python<'_>, tensor_id: u64) -> PyRes<Option<String>> {
        self.with(py, |e| Ok(e.store().info(tensor_id).map(|t| core::tensor_json(&t).to_string())))
    }

    /// The id of the tensor named `name`, or None.
    fn lookup(&self, py: Python<'_>, name: String) -> PyRes<Option<u64>> {
        self.with(py, |e| Ok(e.store().lookup(&name)))
    }

    /// Wait until every queued operation finished.
    fn drain(&self, py: Python<'_>) -> PyRes<()> {
        self.with(py, |e| {
            e.store().drain();
            Ok(())
        })
    }

    /// This machine's hardware model measured through the engine (or read from the cache),
    /// as JSON (`teraio_bindings_core::measure_hardware`).
    #[pyo3(signature = (cache=true, fresh=false, probe_bytes=None))]
    fn measure_hardware_json(
        &self,
        py: Python<'_>,
        cache: bool,
        fresh: bool,
        probe_bytes: Option<u64>,
    ) -> PyRes<String> {
        self.with(py, |e| Ok(core::measure_hardware(e, cache, fresh, probe_bytes).to_string()))
    }

    /// Persistent engines: write a checkpoint now.
    fn checkpoint(&self, py: Python<'_>) -> PyRes<()> {
        self.with(py, |e| Ok(e.store().checkpoint()?))
    }

    /// Offload `data`: the whole of an engine buffer (or a view covering one) without a copy,
    /// other memory copied before this returns (`data` may be reused at once).
    fn offload(
        &self,
        py: Python<'_>,
        tensor_id: u64,
        data: Bound<'_, PyAny>,
        name: Option<String>,
        destination: &str,
        priority: &str,
    ) -> PyRes<NativeOp> {
        let src = export::host(&data, false, "data").map_err(err)?;
        let opts = options(name, destination, priority).map_err(err)?;
        if let Some(buf) = src.engine {
            let op = self.with(py, |e| Op::offload_buffer(e, tensor_id, &buf, opts))?;
            return Ok(NativeOp::new(op, None, Some(src.keep)));
        }
        let (addr, len) = (src.addr, src.len);
        let op = self.with(py, |e| {
            let data: &[u8] = if len == 0 {
                &[]
            } else {
                // SAFETY: [addr, addr + len) is the object's memory as its buffer export or
                // array interface gives it (export::host), held by `src.keep` until this call
                // returns; the bytes are copied before then.
                unsafe { std::slice::from_raw_parts(addr as *const u8, len) }
            };
            Op::offload_copy(e, tensor_id, data, opts)
        })?;
        drop(src.keep);
        Ok(NativeOp::new(op, None, None))
    }

    /// Prefetch into `out` (writable, exactly the tensor's size): an engine buffer (or a view
    /// covering one) is filled without a copy; other memory when the op is collected, the op
    /// keeping `out`'s export until then.
    fn prefetch(
        &self,
        py: Python<'_>,
        tensor_id: u64,
        out: Bound<'_, PyAny>,
        priority: &str,
    ) -> PyRes<NativeOp> {
        let dst = export::host(&out, true, "out").map_err(err)?;
        let prio = core::parse_priority(priority).map_err(err)?;
        if let Some(buf) = dst.engine {
            let op = self.with(py, |e| Op::prefetch_buffer(e, tensor_id, &buf, prio))?;
            return Ok(NativeOp::new(op, None, Some(dst.keep)));
        }
        let len = dst.len;
        let op = self.with(py, |e| Op::prefetch_copy(e, tensor_id, len as u64, prio))?;
        Ok(NativeOp::new(op, Some((dst.addr, len)), Some(dst.keep)))
    }

    /// Offload the caller's GPU memory `mem` (`teraio.DeviceMemory` or a CUDA array) after the
    /// work queued on CUDA stream `stream`; the op keeps `mem` until it finished.
    #[allow(clippy::too_many_arguments)] // the Python signature, one argument per option
    #[pyo3(signature = (tensor_id, mem, stream, name, destination, priority))]
    fn offload_device(
        &self,
        py: Python<'_>,
        tensor_id: u64,
        mem: Bound<'_, PyAny>,
        stream: u64,
        name: Option<String>,
        destination: &str,
        priority: &str,
    ) -> PyRes<NativeOp> {
        let (ptr, nbytes) = device_arg(&mem, "offload").map_err(err)?;
        let opts = options(name, destination, priority).map_err(err)?;
        let op = self.with(py, |e| {
            // SAFETY: `ptr`/`nbytes` are `mem`'s device memory (export::device), which the op
            // keeps alive until it finished.
            let m = unsafe { e.wrap_caller_gpu(ptr, nbytes) }?;
            Op::offload_device(e, tensor_id, m, stream, opts)
        })?;
        Ok(NativeOp::new(op, None, Some(mem.unbind())))
    }

    /// Prefetch into the caller's GPU memory `mem`, written after the work queued on `stream`;
    /// work queued on `stream` after the op finished sees the data.
    fn prefetch_device(
        &self,
        py: Python<'_>,
        tensor_id: u64,
        mem: Bound<'_, PyAny>,
        stream: u64,
        priority: &str,
    ) -> PyRes<NativeOp> {
        let (ptr, nbytes) = device_arg(&mem, "prefetch").map_err(err)?;
        let prio = core::parse_priority(priority).map_err(err)?;
        let op = self.with(py, |e| {
            // SAFETY: as in offload_device; nobody else writes the memory meanwhile (the
            // caller's contract, docs/PYTHON.md).
            let m = unsafe { e.wrap_caller_gpu(ptr, nbytes) }?;
            Op::prefetch_device(e, tensor_id, m, stream, prio)
        })?;
        Ok(NativeOp::new(op, None, Some(mem.unbind())))
    }

    /// Free a tensor.
    fn free(&self, py: Python<'_>, tensor_id: u64) -> PyRes<NativeOp> {
        let op = self.with(py, |e| Op::free(e, tensor_id))?;
        Ok(NativeOp::new(op, None, None))
    }
}

/// A pending operation (wrapped by `teraio.PendingOp`).
#[pyclass(frozen, module = "teraio._teraio")]
struct NativeOp {
    op: Mutex<Op>,
    /// A prefetch into caller memory: where the bytes go.
    dest: Option<(usize, usize)>,
    /// What must live until the operation completed: the destination, or the engine buffer.
    keepalive: Mutex<Option<Py<PyAny>>>,
    kind: &'static str,
    tensor: u64,
}

impl NativeOp {
    fn new(op: Op, dest: Option<(usize, usize)>, keepalive: Option<Py<PyAny>>) -> Self {
        let (kind, tensor) = (op.kind().name(), op.tensor());
        NativeOp { op: Mutex::new(op), dest, keepalive: Mutex::new(keepalive), kind, tensor }
    }

    /// Collect the result (at most `timeout`); `None` when still running. Call without the GIL.
    fn collect(&self, timeout: Option<Duration>) -> Option<core::Result<&'static str>> {
        let dest = self.dest;
        let mut op = self.op.lock();
        let r = op.wait(timeout, |bytes| {
            let (addr, len) = dest.expect("a prefetch into caller memory has a destination");
            if bytes.len() != len {
                return Err(Error::InvalidArgument(format!(
                    "prefetch read {} bytes for a destination of {len}",
                    bytes.len()
                )));
            }
            // SAFETY: (addr, len) is a writable buffer export (or array interface) that
            // export::host read and this op keeps alive (`keepalive`) until now; nothing else
            // writes it meanwhile.
            let out = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
            out.copy_from_slice(bytes);
            Ok(())
        })?;
        Some(match r {
            Ok(o) => Ok(o.name()),
            Err(e) => Err(e.duplicate()),
        })
    }
}

impl Drop for NativeOp {
    fn drop(&mut self) {
        // A prefetch into caller memory that nobody waited for still delivers its bytes: the
        // store already consumed the tensor for it. The GIL is released while waiting.
        if self.dest.is_some() && self.op.get_mut().result().is_none() {
            Python::attach(|py| py.detach(|| drop(self.collect(None))));
        }
    }
}

#[pymethods]
impl NativeOp {
    /// `"offload"`, `"prefetch"` or `"free"`.
    #[getter]
    fn kind(&self) -> &'static str {
        self.kind
    }

    /// The tensor it concerns.
    #[getter]
    fn tensor_id(&self) -> u64 {
        self.tensor
    }

    /// Whether it finished (never blocks). A finished prefetch into caller memory has its
    /// bytes copied by this call.
    fn done(&self, py: Python<'_>) -> bool {
        let finished = {
            let Some(op) = self.op.try_lock() else { return false };
            op.result().is_some() || op.is_done()
        };
        if finished {
            let _ = run(py, "teraio.PendingOp.done", || {
                drop(self.collect(Some(Duration::ZERO)));
                Ok(())
            });
        }
        finished
    }

    /// Wait (at most `timeout` seconds; None, infinity, or more seconds than a `Duration`
    /// holds (about 584 billion years): as long as it takes) with the GIL released; the outcome
    /// name (`ssd`, `host`, `cancelled`, `prefetched`, `freed`), or the op's error. A negative or
    /// NaN timeout is an `InvalidArgumentError`.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyRes<&'static str> {
        let t = wait_timeout(timeout).map_err(err)?;
        let collected = run(py, "teraio.PendingOp.wait", || Ok(self.collect(t)))?;
        match collected {
            None => Err(PyTimeoutError::new_err(format!(
                "{} of tensor {} still running after {} s",
                self.kind,
                self.tensor,
                timeout.unwrap_or(0.0)
            ))),
            Some(r) => {
                // Finished: what it kept alive may go.
                if let Some(k) = self.keepalive.lock().take() {
                    drop(k);
                }
                r.map_err(|e| to_py(py, &e))
            }
        }
    }
}

/// A `wait` timeout in seconds as a `Duration` (`None`: no limit). Negative and NaN are errors;
/// infinity and values beyond `Duration::MAX` mean no limit.
fn wait_timeout(seconds: Option<f64>) -> core::Result<Option<Duration>> {
    match seconds {
        None => Ok(None),
        Some(s) if s.is_nan() || s < 0.0 => Err(Error::InvalidArgument(format!(
            "timeout {s}: a number of seconds >= 0 is required (None waits as long as it takes)"
        ))),
        Some(s) => Ok(Duration::try_from_secs_f64(s).ok()),
    }
}

/// Engine host memory with a stable address (wrapped by `teraio.HostBuffer`). While it lives,
/// a view covering the whole of it moves without a copy (export.rs keeps them by address).
#[pyclass(frozen, subclass, module = "teraio._teraio")]
struct NativeBuffer {
    buf: Arc<CoreBuffer>,
}

impl Drop for NativeBuffer {
    fn drop(&mut self) {
        export::unregister(&self.buf);
    }
}

#[pymethods]
impl NativeBuffer {
    #[new]
    fn new(py: Python<'_>, nbytes: u64) -> PyRes<Self> {
        let buf = run(py, "teraio.HostBuffer", || CoreBuffer::new(nbytes))?;
        export::register(&buf);
        Ok(NativeBuffer { buf })
    }

    /// Bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.buf.len()
    }

    /// Address of the first byte (stable while the object lives).
    #[getter]
    fn address(&self) -> usize {
        self.buf.addr()
    }

    /// Whether the engine has the memory now.
    #[getter]
    fn busy(&self) -> bool {
        self.buf.is_busy()
    }

    /// Whether `release` was called.
    #[getter]
    fn released(&self) -> bool {
        self.buf.is_released()
    }

    /// Stop using the memory for I/O (refused while the engine has it).
    fn _release_io(&self) -> PyRes<()> {
        self.buf.release().map_err(err)
    }
}

/// A training-iteration trace (wrapped by `teraio.Trace`).
#[pyclass(frozen, module = "teraio._teraio")]
struct NativeTrace {
    trace: Arc<teraio_scheduler::Trace>,
}

#[pymethods]
impl NativeTrace {
    /// From a file or `preset:` spec.
    #[staticmethod]
    fn load(py: Python<'_>, path_or_spec: String) -> PyRes<Self> {
        let t = run(py, "teraio.load_trace", || core::sched::load_trace(&path_or_spec))?;
        Ok(NativeTrace { trace: Arc::new(t) })
    }

    /// From JSON text.
    #[staticmethod]
    fn from_json(py: Python<'_>, text: String) -> PyRes<Self> {
        let t = run(py, "teraio.trace_from_json", || core::sched::trace_from_json(&text))?;
        Ok(NativeTrace { trace: Arc::new(t) })
    }

    /// Generated: a model preset and `(key, value or None)` options.
    #[staticmethod]
    fn generate(
        py: Python<'_>,
        model: String,
        options: Vec<(String, Option<String>)>,
    ) -> PyRes<Self> {
        let t = run(py, "teraio.generate_trace", || core::sched::generate_trace(&model, &options))?;
        Ok(NativeTrace { trace: Arc::new(t) })
    }

    /// Summary (JSON).
    fn info_json(&self) -> String {
        core::sched::trace_json(&self.trace).to_string()
    }

    /// The whole trace (JSON).
    fn to_json(&self, py: Python<'_>) -> String {
        py.detach(|| self.trace.to_json())
    }
}

/// A plan (wrapped by `teraio.Plan`).
#[pyclass(frozen, module = "teraio._teraio")]
struct NativePlan {
    plan: Arc<teraio_scheduler::Plan>,
}

#[pymethods]
impl NativePlan {
    /// From JSON text, checked against `trace`.
    #[staticmethod]
    fn from_json(py: Python<'_>, trace: &NativeTrace, text: String) -> PyRes<Self> {
        let t = trace.trace.clone();
        let p = run(py, "teraio.plan_from_json", || core::sched::plan_from_json(&t, &text))?;
        Ok(NativePlan { plan: Arc::new(p) })
    }

    /// The plan (JSON).
    fn to_json(&self, py: Python<'_>) -> String {
        py.detach(|| self.plan.to_json())
    }

    /// Its policy.
    #[getter]
    fn policy(&self) -> String {
        self.plan.policy.clone()
    }
}

fn hw(
    preset_or_json: &str,
    overrides_json: Option<&str>,
) -> core::Result<teraio_scheduler::Hardware> {
    let over = json_arg(overrides_json, "hardware overrides")?;
    core::sched::hardware(preset_or_json, over.as_ref())
}

/// The hardware model (JSON) of a preset or JSON object, with overrides (JSON object).
#[pyfunction]
#[pyo3(signature = (preset_or_json, overrides_json=None))]
fn hardware_json(preset_or_json: String, overrides_json: Option<String>) -> PyRes<String> {
    let h = hw(&preset_or_json, overrides_json.as_deref()).map_err(err)?;
    Ok(serde_json::to_string(&h).expect("hardware serializes"))
}

/// Plan a trace.
#[pyfunction]
#[pyo3(signature = (trace, policy, hardware, overrides_json=None, checked=false))]
fn plan(
    py: Python<'_>,
    trace: &NativeTrace,
    policy: String,
    hardware: String,
    overrides_json: Option<String>,
    checked: bool,
) -> PyRes<NativePlan> {
    let t = trace.trace.clone();
    let p = run(py, "teraio.plan", || {
        let h = hw(&hardware, overrides_json.as_deref())?;
        let policy = core::sched::policy(&policy)?;
        if checked {
            core::sched::plan_checked(&t, &h, policy)
        } else {
            core::sched::plan(&t, &h, policy)
        }
    })?;
    Ok(NativePlan { plan: Arc::new(p) })
}

/// Plan selection (the scheduler's `choose`): the plan and the selection (JSON), options as
/// JSON (`teraio_bindings_core::sched::SelectRequest`).
#[pyfunction]
#[pyo3(signature = (trace, hardware, overrides_json=None, options_json=None))]
fn select(
    py: Python<'_>,
    trace: &NativeTrace,
    hardware: String,
    overrides_json: Option<String>,
    options_json: Option<String>,
) -> PyRes<(NativePlan, String)> {
    let t = trace.trace.clone();
    let (p, v) = run(py, "teraio.select", || {
        let h = hw(&hardware, overrides_json.as_deref())?;
        let req = core::sched::SelectRequest::from_json(options_json.as_deref().unwrap_or("{}"))?;
        core::sched::select(&t, &h, &req)
    })?;
    Ok((NativePlan { plan: Arc::new(p) }, v.to_string()))
}

/// The layers to checkpoint (the scheduler's `checkpoint::choose_layers`) as JSON; options
/// as `select` takes them.
#[pyfunction]
#[pyo3(signature = (trace, hardware, overrides_json=None, options_json=None))]
fn choose_checkpoint(
    py: Python<'_>,
    trace: &NativeTrace,
    hardware: String,
    overrides_json: Option<String>,
    options_json: Option<String>,
) -> PyRes<String> {
    let t = trace.trace.clone();
    let v = run(py, "teraio.choose_checkpoint", || {
        let h = hw(&hardware, overrides_json.as_deref())?;
        let req = core::sched::SelectRequest::from_json(options_json.as_deref().unwrap_or("{}"))?;
        core::sched::choose_checkpoint(&t, &h, &req)
    })?;
    Ok(v.to_string())
}

/// The budgets of a selection (executor bytes, planning bytes) for a trace whose largest
/// tensor is `largest_tensor_bytes`; options as JSON, as `select` takes them.
#[pyfunction]
#[pyo3(signature = (options_json, largest_tensor_bytes=0))]
fn select_budgets(options_json: String, largest_tensor_bytes: u64) -> PyRes<(u64, u64)> {
    core::sched::SelectRequest::from_json(&options_json)
        .and_then(|req| core::sched::budgets(&req, largest_tensor_bytes))
        .map_err(err)
}

/// The budgets of a selection for a trace (JSON; a kernel that can never fit is reported as
/// `never_fits`, not raised), options as `select` takes them.
#[pyfunction]
fn select_trace_budgets(
    py: Python<'_>,
    trace: &NativeTrace,
    options_json: String,
) -> PyRes<String> {
    let t = trace.trace.clone();
    run(py, "teraio.select_budgets", || {
        let req = core::sched::SelectRequest::from_json(&options_json)?;
        Ok(core::sched::resolve_budgets(&t, &req)?.to_string())
    })
}

/// Simulate a plan; the report (JSON).
#[pyfunction]
#[pyo3(signature = (trace, plan, hardware, overrides_json=None, iterations=2, timeline=false))]
fn simulate(
    py: Python<'_>,
    trace: &NativeTrace,
    plan: &NativePlan,
    hardware: String,
    overrides_json: Option<String>,
    iterations: usize,
    timeline: bool,
) -> PyRes<String> {
    let (t, p) = (trace.trace.clone(), plan.plan.clone());
    run(py, "teraio.simulate", || {
        let h = hw(&hardware, overrides_json.as_deref())?;
        let r = core::sched::simulate(&t, &p, &h, iterations, timeline)?;
        Ok(serde_json::to_string(&r).expect("a report serializes"))
    })
}

/// Where each optimizer update of a trace runs (host or GPU), chosen by simulated cost; the
/// placement (JSON object, `core::sched::place_optimizer`).
#[pyfunction]
#[pyo3(signature = (trace, policy, hardware, overrides_json=None, candidates=6, in_backward=false))]
fn place_optimizer(
    py: Python<'_>,
    trace: &NativeTrace,
    policy: String,
    hardware: String,
    overrides_json: Option<String>,
    candidates: usize,
    in_backward: bool,
) -> PyRes<String> {
    let t = trace.trace.clone();
    run(py, "teraio.place_optimizer", || {
        let h = hw(&hardware, overrides_json.as_deref())?;
        let policy = core::sched::policy(&policy)?;
        let v = core::sched::place_optimizer(&t, &h, policy, candidates, in_backward)?;
        Ok(v.to_string())
    })
}

/// Plan and simulate with several policies (empty: all); a JSON array.
#[pyfunction]
#[pyo3(signature = (trace, policies, hardware, overrides_json=None))]
fn compare_policies(
    py: Python<'_>,
    trace: &NativeTrace,
    policies: Vec<String>,
    hardware: String,
    overrides_json: Option<String>,
) -> PyRes<String> {
    let t = trace.trace.clone();
    run(py, "teraio.compare_policies", || {
        let h = hw(&hardware, overrides_json.as_deref())?;
        let ps =
            policies.iter().map(|p| core::sched::policy(p)).collect::<core::Result<Vec<_>>>()?;
        let r = core::sched::compare(&t, &h, &ps)?;
        Ok(serde_json::to_string(&r).expect("results serialize"))
    })
}

/// tensor -> the Python object holding its memory now (attached or allocated).
type Table = Arc<Mutex<HashMap<u32, Py<PyAny>>>>;

/// `obj` as the executor's memory: device memory when it is (a `teraio.DeviceMemory`, an
/// object with `__cuda_array_interface__`; `bytes`, when given, is its size), else a writable
/// host buffer (of `bytes` bytes, when given).
fn any_mem(
    py: Python<'_>,
    engine: &Py<NativeEngine>,
    obj: &Bound<'_, PyAny>,
    bytes: Option<u64>,
    what: &str,
) -> PyRes<TensorMem> {
    let Some((ptr, len)) = export::device(obj, what).map_err(|e| to_py(py, &e))? else {
        return host_mem(py, obj, bytes, what);
    };
    if bytes.is_some_and(|b| b != len) {
        let b = bytes.unwrap_or(len);
        return Err(to_py(
            py,
            &Error::InvalidArgument(format!("{what}: device memory of {len} bytes for {b}")),
        ));
    }
    engine.get().with(py, move |e| {
        // SAFETY: the executor's table holds `obj` (the owner of the memory) for as long as
        // the executor holds the memory; on the host emulation it is a host buffer the caller
        // does not use meanwhile (the executor's contract, docs/EXECUTOR.md).
        Ok(unsafe { e.wrap_caller_gpu(ptr, len) }?)
    })
}

/// `obj`'s writable host memory (of `bytes` bytes, when given) as the executor's memory.
fn host_mem(
    py: Python<'_>,
    obj: &Bound<'_, PyAny>,
    bytes: Option<u64>,
    what: &str,
) -> PyRes<TensorMem> {
    let x = export::host(obj, true, what).map_err(|e| to_py(py, &e))?;
    if bytes.is_some_and(|b| x.len as u64 != b || x.addr == 0) {
        let b = bytes.unwrap_or(x.len as u64);
        return Err(to_py(
            py,
            &Error::InvalidArgument(format!("{what}: a buffer of {} bytes for {b}", x.len)),
        ));
    }
    let keep: Box<dyn Send> = Box::new(x.keep);
    // SAFETY: [addr, addr + len) is a writable buffer export (or array interface) of `obj`
    // that `keep` holds until the executor drops the memory (export::host).
    Ok(unsafe { TensorMem::caller(x.addr, x.len, Some(keep)) })
}

/// The executor's memory from a Python object's `alloc(tensor_id, nbytes, why)` (a writable
/// buffer of exactly `nbytes`) and, when it has one, `release(tensor_id, obj)`; with a
/// `recompute(tensor_id, obj)` it runs the plan's recomputations (the object `alloc` returned
/// for the tensor, to fill by running its producer again). A true `stream_ordered` attribute
/// says memory given back is reused only by work queued later on the executor's stream (PyTorch's
/// caching allocator): the executor then never waits on the host for a copy still reading it.
struct PyAllocator {
    obj: Py<PyAny>,
    table: Table,
    engine: Py<NativeEngine>,
    /// The object's `stream_ordered` attribute (memory it is given back is reused only by work
    /// queued later on the caller's stream: PyTorch's caching allocator).
    stream_ordered: bool,
}

impl TensorAllocator for PyAllocator {
    fn alloc(
        &mut self,
        t: TensorId,
        bytes: u64,
        why: AllocFor,
    ) -> teraio_engine::Result<TensorMem> {
        let why = match why {
            AllocFor::Create => "create",
            AllocFor::Prefetch => "prefetch",
            AllocFor::Recompute => "recompute",
        };
        Python::attach(|py| {
            let r = self.obj.bind(py).call_method1("alloc", (t.0, bytes, why))?;
            let mem = any_mem(py, &self.engine, &r, Some(bytes), "allocator.alloc(...)")?;
            self.table.lock().insert(t.0, r.unbind());
            Ok::<_, PyErr>(mem)
        })
        .map_err(|e| {
            let words = format!("the allocator's alloc({t}, {bytes}, {why:?}) failed: {e}");
            // A MemoryError is the allocator having no room now: the executor makes room and
            // asks again; anything else is the allocator's fault.
            if Python::attach(|py| e.is_instance_of::<PyMemoryError>(py)) {
                teraio_engine::Error::NoSpace(words)
            } else {
                teraio_engine::Error::InvalidArgument(words)
            }
        })
    }

    fn release(&mut self, t: TensorId, mem: TensorMem) {
        drop(mem);
        Python::attach(|py| {
            let obj = self.table.lock().remove(&t.0);
            let a = self.obj.bind(py);
            if a.hasattr("release").unwrap_or(false)
                && let Err(e) = a.call_method1("release", (t.0, obj))
            {
                e.write_unraisable(py, Some(a));
            }
        });
    }

    fn can_recompute(&self) -> bool {
        Python::attach(|py| self.obj.bind(py).hasattr("recompute").unwrap_or(false))
    }

    fn stream_ordered(&self) -> bool {
        self.stream_ordered
    }

    fn recompute(&mut self, t: TensorId, mem: &mut TensorMem) -> teraio_engine::Result<()> {
        let _ = mem; // the memory `alloc` returned, which `obj` owns
        Python::attach(|py| {
            let obj = self.table.lock().get(&t.0).map(|o| o.clone_ref(py));
            self.obj.bind(py).call_method1("recompute", (t.0, obj)).map(|_| ())
        })
        .map_err(|e| {
            teraio_engine::Error::InvalidArgument(format!(
                "the allocator's recompute({t}) failed: {e}"
            ))
        })
    }
}

fn closed_under_executor() -> Error {
    Error::Closed(
        "the engine this executor runs on was closed: finish() the executor before closing the \
         engine"
            .into(),
    )
}

/// (used_bytes, in_flight, next_kernel, diverged (kernel, detail)).
type ExecutorState = (u64, usize, usize, Option<(usize, String)>);

/// The plan executor (wrapped by `teraio.Executor`; docs/EXECUTOR.md).
#[pyclass(frozen, module = "teraio._teraio")]
struct NativeExecutor {
    ex: Mutex<Option<Executor>>,
    table: Table,
    engine: Py<NativeEngine>,
}

impl NativeExecutor {
    /// Run `f` on the executor with the GIL released (its allocator callbacks take the GIL:
    /// never lock the executor while holding it).
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Executor) -> teraio_engine::Result<R> + Send,
    ) -> PyRes<R> {
        let engine = self.engine.get();
        run(py, "teraio.Executor", || {
            // The engine stays open for the call (its close waits for it).
            let open = engine.engine.read_recursive();
            if open.is_none() {
                return Err(closed_under_executor());
            }
            let mut g = self.ex.lock();
            let ex = g.as_mut().ok_or_else(|| {
                Error::InvalidState("the executor was finished (finish() was called)".into())
            })?;
            f(ex).map_err(Error::from)
        })
    }
}

#[pymethods]
impl NativeExecutor {
    #[new]
    #[allow(clippy::too_many_arguments)] // the Python signature
    #[pyo3(signature = (engine, trace, plan, gpu_budget_bytes, allocate_created, allocator=None, stream=None, sizes_at_most=false))]
    fn new(
        py: Python<'_>,
        engine: Py<NativeEngine>,
        trace: &NativeTrace,
        plan: &NativePlan,
        gpu_budget_bytes: u64,
        allocate_created: bool,
        allocator: Option<Py<PyAny>>,
        stream: Option<u64>,
        sizes_at_most: bool,
    ) -> PyRes<Self> {
        let table: Table = Arc::default();
        let (t, p) = ((*trace.trace).clone(), (*plan.plan).clone());
        let cfg = ExecutorConfig { gpu_budget_bytes, allocate_created, stream };
        let custom = allocator.map(|obj| PyAllocator {
            stream_ordered: obj
                .bind(py)
                .getattr("stream_ordered")
                .and_then(|v| v.is_truthy())
                .unwrap_or(false),
            obj,
            table: table.clone(),
            engine: engine.clone_ref(py),
        });
        let ex = engine.get().with(py, move |e| {
            let alloc: Box<dyn TensorAllocator> = match custom {
                Some(a) => Box::new(a),
                None => e.host_allocator(),
            };
            let mut ex = e.executor(t, p, cfg, alloc)?;
            ex.set_sizes_at_most(sizes_at_most);
            Ok(ex)
        })?;
        Ok(NativeExecutor { ex: Mutex::new(Some(ex)), table, engine })
    }

    /// Hand tensor `tensor`'s memory `obj` (device memory, or a writable host buffer, read
    /// here: export.rs; `obj` is what `resident` returns and the allocator's `release` gets)
    /// to the executor.
    fn attach(&self, py: Python<'_>, tensor: u32, obj: Py<PyAny>) -> PyRes<()> {
        let mem = any_mem(py, &self.engine, obj.bind(py), None, "mem")?;
        self.table.lock().insert(tensor, obj.clone_ref(py));
        self.with(py, move |ex| ex.attach(TensorId(tensor), mem))
    }

    fn start(&self, py: Python<'_>) -> PyRes<()> {
        self.with(py, |ex| ex.start())
    }

    fn boundary(&self, py: Python<'_>, k: usize) -> PyRes<()> {
        self.with(py, |ex| ex.boundary(k))
    }

    fn boundary_named(&self, py: Python<'_>, k: usize, name: String) -> PyRes<()> {
        self.with(py, move |ex| ex.boundary_named(k, &name))
    }

    fn leave_plan(&self, py: Python<'_>, k: usize, detail: String) -> PyRes<()> {
        self.with(py, move |ex| ex.leave_plan(k, &detail))
    }

    fn kernel_ready(&self, py: Python<'_>, k: usize) -> PyRes<bool> {
        self.with(py, |ex| ex.kernel_ready(k))
    }

    fn before_kernel(&self, py: Python<'_>, k: usize) -> PyRes<f64> {
        self.with(py, |ex| ex.before_kernel(k).map(|d| d.as_secs_f64()))
    }

    fn after_kernel(&self, py: Python<'_>, k: usize) -> PyRes<()> {
        self.with(py, |ex| ex.after_kernel(k))
    }

    /// Kernel `k` ran: attach the tensors it created, `[(tensor, address, nbytes, owner)]`,
    /// then `after_kernel(k)`, in one call (a trainer's dispatch mode calls this once per
    /// operator, so it does no Python-level export); returns `quiet_until(k)`. `device`: the addresses are device memory
    /// (checked on a CUDA GPU as `attach` checks it), else host memory. The caller vouches that
    /// `owner` keeps `[address, address + nbytes)` valid, writable and unused by others while
    /// the executor holds it, as for a `DeviceMemory`.
    fn leave(
        &self,
        py: Python<'_>,
        k: usize,
        created: Vec<(u32, u64, u64, Py<PyAny>)>,
        device: bool,
    ) -> PyRes<usize> {
        let mut mems = Vec::with_capacity(created.len());
        let mut wrap = Vec::new();
        {
            let mut table = self.table.lock();
            for (tensor, addr, len, owner) in created {
                if addr == 0 || len == 0 {
                    return Err(to_py(
                        py,
                        &Error::InvalidArgument(format!(
                            "tensor {tensor}: {len} bytes at address {addr:#x}"
                        )),
                    ));
                }
                if device {
                    wrap.push((tensor, addr, len));
                } else {
                    let keep: Box<dyn Send> = Box::new(owner.clone_ref(py));
                    // SAFETY: the caller vouches for the range (above); `owner`, kept with
                    // the memory, holds it for as long as the executor does.
                    let mem = unsafe { TensorMem::caller(addr as usize, len as usize, Some(keep)) };
                    mems.push((tensor, mem));
                }
                table.insert(tensor, owner);
            }
        }
        if !wrap.is_empty() {
            let wrapped = self.engine.get().with(py, move |e| {
                wrap.into_iter()
                    // SAFETY: the executor's table holds each owner for as long as the
                    // executor holds the memory; the caller vouches for the range (above).
                    .map(|(t, ptr, len)| Ok((t, unsafe { e.wrap_caller_gpu(ptr, len) }?)))
                    .collect::<core::Result<Vec<_>>>()
            })?;
            mems.extend(wrapped);
        }
        self.with(py, move |ex| {
            for (t, mem) in mems {
                ex.attach(TensorId(t), mem)?;
            }
            ex.after_kernel(k)?;
            Ok(ex.quiet_until(k))
        })
    }

    /// After kernel `k`: the last kernel the caller may run before calling again.
    fn quiet_until(&self, py: Python<'_>, k: usize) -> PyRes<usize> {
        self.with(py, |ex| Ok(ex.quiet_until(k)))
    }

    /// Per tensor: whether the plan moves it (only these need attaching).
    fn movable(&self, py: Python<'_>) -> PyRes<Vec<bool>> {
        self.with(py, |ex| Ok(ex.movable().to_vec()))
    }

    /// Whether nothing the plan moves is away from the GPU (nothing in flight, every moved
    /// tensor resident or not alive): the executor's `nothing_away`.
    fn nothing_away(&self, py: Python<'_>) -> PyRes<bool> {
        self.with(py, |ex| Ok(ex.nothing_away()))
    }

    fn make_room(&self, py: Python<'_>, k: usize, nbytes: u64) -> PyRes<u64> {
        self.with(py, |ex| ex.make_room(k, nbytes))
    }

    fn free(&self, py: Python<'_>, tensor: u32) -> PyRes<()> {
        self.with(py, |ex| ex.free(TensorId(tensor)))
    }

    fn poll(&self, py: Python<'_>) -> PyRes<bool> {
        self.with(py, |ex| ex.poll())
    }

    /// `[("arrived" | "released", tensor), ...]` since the last call.
    fn events(&self, py: Python<'_>) -> PyRes<Vec<(&'static str, u32)>> {
        self.with(py, |ex| {
            Ok(ex
                .events()
                .into_iter()
                .map(|e| match e {
                    Event::Arrived(t) => ("arrived", t.0),
                    Event::Released(t) => ("released", t.0),
                })
                .collect())
        })
    }

    /// The iteration's report as JSON; without `timeline` its `memory_timeline` is empty (a
    /// trainer that ends an iteration every step need not parse thousands of points each time).
    #[pyo3(signature = (timeline = true))]
    fn end_iteration_json(&self, py: Python<'_>, timeline: bool) -> PyRes<String> {
        self.with(py, |ex| {
            let mut r = ex.end_iteration()?;
            if !timeline {
                r.memory_timeline = Vec::new();
            }
            Ok(serde_json::to_string(&r).expect("a report serializes"))
        })
    }

    #[pyo3(signature = (limit=None))]
    fn gather_globals_json(&self, py: Python<'_>, limit: Option<u64>) -> PyRes<String> {
        self.with(py, |ex| {
            let r = ex.gather_globals_within(limit.unwrap_or(u64::MAX))?;
            Ok(serde_json::to_string(&r).expect("a report serializes"))
        })
    }

    fn modified(&self, py: Python<'_>, tensor: u32) -> PyRes<()> {
        self.with(py, |ex| ex.modified(TensorId(tensor)))
    }

    fn finish(&self, py: Python<'_>) -> PyRes<()> {
        let engine = self.engine.get();
        run(py, "teraio.Executor.finish", || {
            let ex = self.ex.lock().take();
            let open = engine.engine.read_recursive();
            match ex {
                // After the engine's close the executor is only dropped.
                Some(_) if open.is_none() => Err(closed_under_executor()),
                Some(ex) => ex.finish().map_err(Error::from),
                None => Ok(()),
            }
        })
    }

    /// (used_bytes, in_flight, next_kernel, diverged (kernel, detail) or None).
    fn state(&self, py: Python<'_>) -> PyRes<ExecutorState> {
        self.with(py, |ex| {
            let d = ex.diverged().map(|d| (d.kernel, d.detail.clone()));
            Ok((ex.used_bytes(), ex.in_flight(), ex.next_kernel(), d))
        })
    }

    fn is_resident(&self, py: Python<'_>, tensor: u32) -> PyRes<bool> {
        self.with(py, |ex| Ok(ex.is_resident(TensorId(tensor))))
    }

    /// The object holding a resident tensor's memory (attached or allocated), or None.
    fn resident(&self, py: Python<'_>, tensor: u32) -> PyRes<Option<Py<PyAny>>> {
        let resident = self.with(py, |ex| Ok(ex.resident(TensorId(tensor)).is_some()))?;
        Ok(if resident { self.table.lock().get(&tensor).map(|o| o.clone_ref(py)) } else { None })
    }
}

/// A float32 slice of caller memory that [`core::optim::check_spans`] accepted.
///
/// # Safety
/// `s` passed `check_spans` together with every other span of the call, its export
/// ([`export::host_f32`]) is held for the call, it is writable, and nothing else reads or
/// writes it during the call.
unsafe fn f32_mut<'a>(s: core::optim::F32Span) -> &'a mut [f32] {
    if s.len == 0 {
        return &mut [];
    }
    // SAFETY: non-null, aligned, at most isize::MAX bytes, disjoint from the call's other
    // spans (check_spans), live and writable for the call (the caller's contract).
    unsafe { std::slice::from_raw_parts_mut(s.addr as *mut f32, s.len) }
}

/// As [`f32_mut`], read only.
///
/// # Safety
/// As [`f32_mut`], except that the memory is only read.
unsafe fn f32_ref<'a>(s: core::optim::F32Span) -> &'a [f32] {
    if s.len == 0 {
        return &[];
    }
    // SAFETY: as in f32_mut; only read.
    unsafe { std::slice::from_raw_parts(s.addr as *const f32, s.len) }
}

/// The span of `obj`, a float32 buffer named `name` (written when `writable`), and the export
/// that keeps its memory valid: the one place the optimizer's caller memory is read.
fn span(
    obj: &Bound<'_, PyAny>,
    name: &'static str,
    writable: bool,
) -> PyRes<(core::optim::F32Span, Py<PyAny>)> {
    let x = export::host_f32(obj, writable, name)?;
    Ok((core::optim::F32Span { name, addr: x.addr, len: x.len }, x.keep))
}

/// One Adam(W) step over caller float32 buffers (C-contiguous: CPU tensors, numpy arrays,
/// buffer-protocol objects; read by [`export::host_f32`], writable where written, held for the
/// call). Runs with the GIL released.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the Python signature, one argument per hyperparameter
#[pyo3(signature = (param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay, threads))]
fn adam_step(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    exp_avg: &Bound<'_, PyAny>,
    exp_avg_sq: &Bound<'_, PyAny>,
    max_exp_avg_sq: Option<&Bound<'_, PyAny>>,
    step: u64,
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    threads: usize,
) -> PyRes<()> {
    let args = core::optim::AdamArgs {
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        amsgrad,
        maximize,
        decoupled_weight_decay,
        threads,
    };
    let (p, _p) = span(param, "param", true)?;
    let (g, _g) = span(grad, "grad", false)?;
    let (m, _m) = span(exp_avg, "exp_avg", true)?;
    let (v, _v) = span(exp_avg_sq, "exp_avg_sq", true)?;
    let x = max_exp_avg_sq.map(|o| span(o, "max_exp_avg_sq", true)).transpose()?;
    let (x, _x) = x.unzip();
    run(py, "teraio.adamw_step", move || {
        let mut spans = vec![p, g, m, v];
        spans.extend(x);
        core::optim::check_spans(&spans)?;
        // SAFETY: the spans passed check_spans together; their exports (`_p`.. `_x`) live until
        // the call returns, and host_f32 checked that param and the states are writable.
        let (p, g, m, v) = unsafe { (f32_mut(p), f32_ref(g), f32_mut(m), f32_mut(v)) };
        // SAFETY: as above.
        let x = x.map(|x| unsafe { f32_mut(x) });
        core::optim::adam_step(&args, p, g, m, v, x)
    })
}

/// One SGD step over caller float32 buffers (as [`adam_step`]).
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the Python signature, one argument per hyperparameter
#[pyo3(signature = (param, grad, momentum_buffer, fresh_buffer, lr, momentum, dampening, weight_decay, nesterov, maximize, threads))]
fn sgd_step(
    py: Python<'_>,
    param: &Bound<'_, PyAny>,
    grad: &Bound<'_, PyAny>,
    momentum_buffer: Option<&Bound<'_, PyAny>>,
    fresh_buffer: bool,
    lr: f64,
    momentum: f64,
    dampening: f64,
    weight_decay: f64,
    nesterov: bool,
    maximize: bool,
    threads: usize,
) -> PyRes<()> {
    let h = teraio_engine::optim::Sgd {
        lr,
        momentum,
        dampening,
        weight_decay,
        nesterov,
        maximize,
        threads,
    };
    let (p, _p) = span(param, "param", true)?;
    let (g, _g) = span(grad, "grad", false)?;
    let b = momentum_buffer.map(|o| span(o, "momentum_buffer", true)).transpose()?;
    let (b, _b) = b.unzip();
    run(py, "teraio.sgd_step", move || {
        let mut spans = vec![p, g];
        spans.extend(b);
        core::optim::check_spans(&spans)?;
        // SAFETY: the spans passed check_spans together; their exports (`_p`, `_g`, `_b`) live
        // until the call returns, and host_f32 checked that param and the buffer are writable.
        let (p, g) = unsafe { (f32_mut(p), f32_ref(g)) };
        // SAFETY: as above.
        let b = b.map(|b| unsafe { f32_mut(b) });
        core::optim::sgd_step(&h, p, g, b, fresh_buffer)
    })
}

/// The instruction set the host optimizer runs with (`avx512`, `avx2`, `portable`), the
/// threads it uses by default, and whether this is an unoptimized build (the dev profile's
/// wheels: correct, but their loops are not vectorized; benchmarks want a release wheel).
#[pyfunction]
fn optim_info() -> (&'static str, usize, bool) {
    let isa = teraio_engine::optim::isa().name();
    (isa, teraio_engine::optim::default_threads(), cfg!(debug_assertions))
}

/// Panic inside a native call (for the tests: the panic must arrive as `teraio.InternalError`,
/// with nothing printed).
#[pyfunction]
fn _panic_for_tests(py: Python<'_>) -> PyRes<()> {
    run(py, "teraio._panic_for_tests", || -> core::Result<()> { panic!("a panic for the tests") })
}

/// The stable status code of every exception class name.
#[pyfunction]
fn status_codes() -> Vec<(&'static str, i32)> {
    core::Status::ALL.iter().map(|s| (s.python_class(), s.code())).collect()
}

/// The engine's queued notices, oldest first, as (level, message), and how many were dropped
/// (the queue was full) since the last call; the package turns them into `TeraioWarning`s.
#[pyfunction]
fn take_notices() -> (Vec<(&'static str, String)>, u64) {
    let notices = teraio_engine::notice::take_all();
    (
        notices.into_iter().map(|n| (n.level.name(), n.message)).collect(),
        teraio_engine::notice::take_dropped(),
    )
}

/// The native module.
#[pymodule]
fn _teraio(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", core::VERSION)?;
    m.add("POLICIES", core::sched::policy_names())?;
    m.add("MODEL_PRESETS", core::sched::model_presets())?;
    m.add("KEY_CALLER_FIRST", teraio_engine::store::TensorKey::CALLER_FIRST.get())?;
    m.add_class::<NativeEngine>()?;
    m.add_class::<NativeOp>()?;
    m.add_class::<NativeBuffer>()?;
    m.add_class::<NativeTrace>()?;
    m.add_class::<NativePlan>()?;
    m.add_class::<NativeExecutor>()?;
    m.add_class::<export::DeviceMemory>()?;
    m.add_function(wrap_pyfunction!(adam_step, m)?)?;
    m.add_function(wrap_pyfunction!(sgd_step, m)?)?;
    m.add_function(wrap_pyfunction!(optim_info, m)?)?;
    m.add_function(wrap_pyfunction!(hardware_json, m)?)?;
    m.add_function(wrap_pyfunction!(_panic_for_tests, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(select, m)?)?;
    m.add_function(wrap_pyfunction!(choose_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(select_budgets, m)?)?;
    m.add_function(wrap_pyfunction!(select_trace_budgets, m)?)?;
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(compare_policies, m)?)?;
    m.add_function(wrap_pyfunction!(place_optimizer, m)?)?;
    m.add_function(wrap_pyfunction!(status_codes, m)?)?;
    m.add_function(wrap_pyfunction!(set_error_classes, m)?)?;
    m.add_function(wrap_pyfunction!(take_notices, m)?)?;
    Ok(())
}
