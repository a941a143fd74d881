"""teraio: a tensor storage engine that lets LLM training use NVMe SSDs as an extension of GPU
memory, from Python.

>>> import numpy as np, teraio
>>> with teraio.Engine(dir="/tmp/teraio-doc", files=2, file_size="64M") as eng:
...     eng.offload(1, np.arange(1000, dtype=np.float32)).wait()
...     out = np.empty(1000, dtype=np.float32)
...     _ = eng.prefetch(1, out).wait()
'ssd'

- :class:`Engine`: the SSD array and tensor store (offload, prefetch, free, list).
- :class:`HostBuffer`: engine memory that moves without a copy (``Engine.alloc``/``empty``).
- :class:`PendingOp`: an operation in flight; ``wait()`` it.
- the scheduler: :func:`load_trace`, :func:`generate_trace`, :func:`plan`, :func:`simulate`,
  :func:`compare_policies`, :func:`hardware`.
- the host optimizer: :func:`adamw_step`, :func:`sgd_step` (PyTorch's AdamW/Adam/SGD update
  on CPU float32 buffers; ``teraio.torch.HostAdamW`` wraps them as a ``torch.optim``
  optimizer).
- errors: :class:`TeraioError` and its subclasses (``teraio._errors``).

The full API is in docs/PYTHON.md. All logic lives in the Rust engine; every call that blocks
or copies releases the GIL.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _teraio
from . import _errors
from ._errors import (
    ChecksumMismatchError,
    ClosedError,
    CorruptionError,
    DeviceError,
    DivergedError,
    InternalError,
    InvalidArgumentError,
    InvalidHandleError,
    InvalidStateError,
    IoError,
    NoSpaceError,
    OverwriteRefusedError,
    PlanError,
    SimulationError,
    TeraioError,
    TraceError,
    UnknownTensorError,
    UnsupportedError,
)

# The exception classes the native module raises, handed down to it (it never imports this
# package: no call goes from the native module back up into Python's teraio).
_teraio.set_error_classes({name: getattr(_errors, name) for name, _ in _teraio.status_codes()})

__version__: str = _teraio.__version__
POLICIES: Tuple[str, ...] = tuple(_teraio.POLICIES)
MODEL_PRESETS: Tuple[str, ...] = tuple(_teraio.MODEL_PRESETS)
#: The first tensor key of the callers' own key space (the engine's ``TensorKey::CALLER_FIRST``,
#: ``1 << 40``): the keys of an executor's trace tensors are all below it, so keys counted from
#: it never collide with an executor running on the same engine (teraio.torch's pager does so).
KEY_CALLER_FIRST: int = _teraio.KEY_CALLER_FIRST

PathLike = Union[str, "os.PathLike[str]"]


def version() -> str:
    """The teraio version these bindings were built from."""
    return __version__


# ----------------------------------------------------------------------------------------------
# Buffers

class HostBuffer(_teraio.NativeBuffer):
    """Engine host memory (4 KiB aligned; 2 MiB aligned from 2 MiB up) that offloads and
    prefetches move without a copy. Make one with :meth:`Engine.alloc` (or ``HostBuffer(n)``).

    Views: ``numpy.asarray(buf)`` (a uint8 array over the memory), :meth:`numpy`,
    ``buf.view()`` (a ctypes array: ``memoryview(buf.view()).cast("B")``,
    ``torch.frombuffer(buf.view(), dtype=...)``) and, on Python >= 3.12, ``memoryview(buf)`` itself. Any C-contiguous view that
    covers the whole buffer is recognized by ``offload``/``prefetch`` and moved without a copy.

    Attributes: ``nbytes``, ``address``, ``busy`` (the engine has the memory now),
    ``released``. The memory stays valid while the object or any view of it lives, also after
    the engine is closed.
    """

    def __new__(cls, nbytes: int) -> "HostBuffer":
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise InvalidArgumentError(f"a host buffer needs a positive int of bytes, not {nbytes!r}")
        return super().__new__(cls, nbytes)

    def _check(self) -> None:
        if self.released:
            raise InvalidArgumentError(f"the engine buffer at {self.address:#x} was released")

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        self._check()
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "version": 3}

    def view(self) -> "ctypes.Array[ctypes.c_ubyte]":
        """A ctypes array over the memory (supports the buffer protocol); it keeps the buffer
        alive."""
        self._check()
        arr = (ctypes.c_ubyte * self.nbytes).from_address(self.address)
        arr._teraio_owner = self  # type: ignore[attr-defined]
        return arr

    def __buffer__(self, flags: int) -> memoryview:  # Python >= 3.12 (PEP 688)
        return memoryview(self.view()).cast("B")

    def numpy(self, dtype: Any = "uint8", shape: Optional[Sequence[int]] = None) -> Any:
        """A numpy array over the memory (zero copy), of ``dtype`` and ``shape``."""
        import numpy as np

        a = np.asarray(self).view(dtype)
        return a if shape is None else a.reshape(tuple(shape))

    def release(self) -> None:
        """Stop using the buffer for I/O (refused with ``InvalidStateError`` while an operation
        has it). The memory itself goes when the object and its views are gone."""
        self._release_io()

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        state = "released" if self.released else ("busy" if self.busy else "idle")
        return f"HostBuffer(nbytes={self.nbytes}, address={self.address:#x}, {state})"


# ``nbytes`` of GPU memory at device address ``ptr`` that the caller owns (a native class, read by
# the engine without calling back into Python; its docstring is the documentation).
DeviceMemory = _teraio.DeviceMemory


def _stream_handle(stream: Any) -> int:
    """A CUDA stream as the integer the engine takes: an int, or a ``torch.cuda.Stream`` /
    CuPy stream (``cuda_stream`` / ``ptr``); None is the legacy default stream (0)."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        if stream < 0:
            raise InvalidArgumentError(f"stream: a CUstream handle >= 0, not {stream}")
        return stream
    for attr in ("cuda_stream", "ptr", "handle"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    raise InvalidArgumentError(f"stream: an int CUstream handle or a CUDA stream object, not {type(stream).__name__}")


def _tensor_id(tensor_id: Any) -> int:
    if not isinstance(tensor_id, int) or isinstance(tensor_id, bool) or not 0 <= tensor_id < 2**64:
        raise InvalidArgumentError(f"a tensor id is an int in [0, 2**64), not {tensor_id!r}")
    return tensor_id


# ----------------------------------------------------------------------------------------------
# Engine


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """What the engine knows of one tensor."""

    id: int
    name: Optional[str]
    size_bytes: int
    location: str
    host_copy: bool
    pending_ops: int
    checksummed_chunks: int


class PendingOp:
    """An offload, prefetch or free in flight. It keeps the memory it moves alive until it
    completed; a prefetch into caller memory copies the bytes there when it is waited (or
    polled done, or garbage collected)."""

    __slots__ = ("_op", "_out")

    def __init__(self, op: Any, out: Any) -> None:
        self._op = op
        self._out = out

    @property
    def kind(self) -> str:
        """``"offload"``, ``"prefetch"`` or ``"free"``."""
        return self._op.kind

    @property
    def tensor_id(self) -> int:
        """The tensor it concerns."""
        return self._op.tensor_id

    def done(self) -> bool:
        """Whether it finished (never blocks)."""
        return self._op.done()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Wait (at most ``timeout`` seconds; ``TimeoutError`` then, and it may be waited
        again; ``None``, ``math.inf`` or more seconds than a ``datetime.timedelta``-like
        duration holds (about 584 billion years): no limit; negative or NaN:
        :class:`InvalidArgumentError`) with the GIL released. Returns ``"ssd"``, ``"host"`` or ``"cancelled"`` for an
        offload, the destination for a prefetch, ``None`` for a free; raises the operation's
        error (a :class:`TeraioError`). Waiting twice returns or raises the same."""
        outcome = self._op.wait(timeout)
        if self._op.kind == "prefetch":
            return self._out
        if self._op.kind == "free":
            return None
        return outcome

    def __repr__(self) -> str:
        return f"PendingOp({self.kind}, tensor {self.tensor_id}, done={self.done()})"


def _jsonable(v: Any) -> Any:
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _overrides(options: Dict[str, Any]) -> Optional[str]:
    return json.dumps({k: _jsonable(v) for k, v in options.items()}) if options else None


class TeraioWarning(UserWarning):
    """What the engine had to say that is not the result of a call: a slower fallback it took
    (no io_uring, no O_DIRECT, a host buffer that could not be page-locked) or a cleanup that
    failed where no call could raise (a final checkpoint when an engine was dropped unclosed).
    teraio never prints; these are issued as warnings when an engine opens or closes and when
    an executor ends an iteration or finishes (``warnings.simplefilter("error", TeraioWarning)``
    makes them errors, ``"ignore"`` silences them), and :func:`notices` returns the waiting ones."""


@dataclasses.dataclass(frozen=True)
class Notice:
    """One notice: ``level`` is "notice", "warning" or "error"."""

    level: str
    message: str

    def __str__(self) -> str:
        return f"teraio: {self.level}: {self.message}"


def notices() -> List[Notice]:
    """The engine's notices not yet issued as :class:`TeraioWarning`, oldest first (taking
    them: each is returned once). When more than 256 waited, the oldest were dropped and a
    last notice says how many."""
    taken, dropped = _teraio.take_notices()
    out = [Notice(level, message) for level, message in taken]
    if dropped:
        out.append(Notice("warning", f"{dropped} earlier notices were dropped (more than 256 waited)"))
    return out


def _warn_notices() -> None:
    import warnings

    for n in notices():
        warnings.warn(str(n), TeraioWarning, stacklevel=3)


class Engine:
    """A teraio engine: the SSD array, the tensor store, the host tier and host buffers.

    ``Engine("teraio.toml", **options)`` reads a configuration file (JSON when it ends in
    ``.json``); ``Engine(**options)`` takes the keys of that file as keyword arguments
    (``targets``, ``dir``, ``files``, ``file_size``, ``backend``, ``persistent``,
    ``host_tier``, ...; sizes as ints or strings like ``"64G"`` or ``"1.5G"``; every key in
    docs/ENGINE.md); keyword options override the file's. ``dir`` or ``targets`` is required: an
    engine is never opened in the current folder by default. Also :meth:`from_toml` and
    :meth:`from_json`. Use it as a context manager or call :meth:`close`.
    """

    def __init__(self, path: Optional[PathLike] = None, /, **options: Any) -> None:
        over = _overrides(options)
        try:
            if path is None:
                self._native = _teraio.NativeEngine("default", None, over)
            else:
                self._native = _teraio.NativeEngine("file", os.fspath(path), over)
        finally:
            _warn_notices()

    @classmethod
    def _from(cls, source: str, text: str, options: Dict[str, Any]) -> "Engine":
        if not isinstance(text, str):
            raise InvalidArgumentError(f"a configuration text is a str, not {type(text).__name__}")
        e = cls.__new__(cls)
        try:
            e._native = _teraio.NativeEngine(source, text, _overrides(options))
        finally:
            _warn_notices()
        return e

    @classmethod
    def from_toml(cls, text: str, **options: Any) -> "Engine":
        """An engine from a TOML configuration text."""
        return cls._from("toml", text, options)

    @classmethod
    def from_json(cls, text: str, **options: Any) -> "Engine":
        """An engine from a JSON configuration text."""
        return cls._from("json", text, options)

    # -- tensors

    def offload(
        self,
        tensor_id: int,
        data: Any,
        *,
        name: Optional[str] = None,
        destination: str = "ssd",
        priority: str = "normal",
    ) -> PendingOp:
        """Store ``data`` (a C-contiguous buffer) as tensor ``tensor_id``.

        Caller memory is copied into engine memory before this returns (``data`` may be
        reused at once); a :class:`HostBuffer` (or a view covering one) moves without a copy
        and is busy until the operation completed. ``destination``: ``"ssd"`` or ``"host"``
        (the host tier; SSD when absent or full). ``priority``: ``"urgent"``, ``"normal"``,
        ``"background"``. ``name`` is recorded with the tensor (see :meth:`lookup`).
        """
        tid = _tensor_id(tensor_id)
        return PendingOp(self._native.offload(tid, data, name, destination, priority), None)

    def prefetch(self, tensor_id: int, out: Any, *, priority: str = "normal") -> PendingOp:
        """Read tensor ``tensor_id`` into ``out`` (a writable C-contiguous buffer of exactly
        the tensor's size). The bytes are in ``out`` once ``wait()`` returned (it returns
        ``out``); a :class:`HostBuffer` destination is filled without a copy."""
        tid = _tensor_id(tensor_id)
        return PendingOp(self._native.prefetch(tid, out, priority), out)

    def offload_device(
        self,
        tensor_id: int,
        mem: Any,
        *,
        stream: Any = None,
        name: Optional[str] = None,
        destination: str = "ssd",
        priority: str = "normal",
    ) -> PendingOp:
        """Store GPU memory ``mem`` (a :class:`DeviceMemory` or a CUDA array such as a
        contiguous ``torch.Tensor`` on the engine's GPU) as tensor ``tensor_id``, read after the
        work queued so far on ``stream`` (a ``torch.cuda.Stream``, a CUstream handle, or None for
        the default stream); the stream is not blocked. Keep the memory unwritten until the
        operation completed. Needs an engine with a GPU (``gpu={"device": 0}``)."""
        tid = _tensor_id(tensor_id)
        op = self._native.offload_device(tid, mem, _stream_handle(stream), name, destination, priority)
        return PendingOp(op, None)

    def prefetch_device(self, tensor_id: int, mem: Any, *, stream: Any = None, priority: str = "normal") -> PendingOp:
        """Read tensor ``tensor_id`` into GPU memory ``mem`` (exactly its size), written after
        the work queued so far on ``stream`` (a caching allocator's fresh block may still be
        read by it). Once ``wait()`` returned (it returns ``mem``), work queued on ``stream``
        afterwards sees the data; the host never waits for the stream."""
        tid = _tensor_id(tensor_id)
        op = self._native.prefetch_device(tid, mem, _stream_handle(stream), priority)
        return PendingOp(op, mem)

    def free(self, tensor_id: int) -> PendingOp:
        """Forget tensor ``tensor_id`` and release its space (after the operations issued
        before)."""
        return PendingOp(self._native.free(_tensor_id(tensor_id)), None)

    def alloc(self, nbytes: int) -> HostBuffer:
        """A :class:`HostBuffer` of ``nbytes`` bytes (contents undefined)."""
        if self._native.closed:
            raise ClosedError("engine closed: the engine was closed")
        return HostBuffer(nbytes)

    def empty(self, shape: Union[int, Sequence[int]], dtype: Any = "uint8") -> Any:
        """A numpy array of ``shape`` and ``dtype`` over a fresh :class:`HostBuffer`: offloads
        from it and prefetches into it (the whole array) move no extra copy."""
        import numpy as np

        dt = np.dtype(dtype)
        shp = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = dt.itemsize * math.prod(shp)
        return self.alloc(nbytes).numpy(dt, shp)

    def executor(
        self,
        trace: Union["Trace", Dict[str, Any], str],
        plan: Union["Plan", Dict[str, Any], str],
        *,
        gpu_budget_bytes: int,
        allocate_created: bool = False,
        allocator: Any = None,
        stream: Any = None,
        sizes_at_most: bool = False,
    ) -> "Executor":
        """A plan :class:`Executor` over this engine's store."""
        return Executor(
            self, trace, plan, gpu_budget_bytes=gpu_budget_bytes,
            allocate_created=allocate_created, allocator=allocator, stream=stream,
            sizes_at_most=sizes_at_most,
        )

    def tensors(self) -> List[TensorInfo]:
        """Every tensor, sorted by id."""
        return [TensorInfo(**t) for t in json.loads(self._native.tensors_json())]

    def info(self, tensor_id: int) -> Optional[TensorInfo]:
        """One tensor, or None."""
        t = self._native.tensor_json(_tensor_id(tensor_id))
        return None if t is None else TensorInfo(**json.loads(t))

    def lookup(self, name: str) -> Optional[int]:
        """The id of the tensor named ``name`` (persistent engines keep names), or None."""
        return self._native.lookup(name)

    def stats(self) -> Dict[str, Any]:
        """Migration statistics: per direction (``ssd_write``, ``ssd_read``, ``host_write``,
        ``host_read``) operations, bytes, errors, busy time; queue waits; checksums verified."""
        return json.loads(self._native.stats_json())

    def drain(self) -> None:
        """Wait until every queued operation finished."""
        self._native.drain()

    def checkpoint(self) -> None:
        """Persistent engines: write a metadata checkpoint now."""
        self._native.checkpoint()

    def measure_hardware(self, cache: bool = True, *, fresh: bool = False,
                         probe_bytes: Optional[int] = None) -> Dict[str, Any]:
        """This machine's hardware model, measured through the engine in a few seconds: the
        array's write, read and both-at-once bandwidth (through the store, O_DIRECT, striped),
        host memory copies, and with a GPU the pinned host <-> GPU copies (on a CPU-only engine
        the "GPU" is host memory). Returns ``{"hardware": {...}, "report": {...}, "source":
        "measured" or "cache", "cache_path", "key", "measured_unix_s", "summary"}``;
        ``["hardware"]`` is a model as :func:`hardware` returns it (``Session(hardware=...)``,
        :func:`plan`). ``cache`` (default True): read this machine and array's model from the
        cache when there is one, and keep a new measurement there (``$TERAIO_CACHE_DIR``, else
        ``$XDG_CACHE_HOME/teraio``, else ``~/.cache/teraio``; a damaged file is measured again
        with a :class:`TeraioWarning`); False: neither. ``fresh``: measure even when a model is
        cached, and replace it. ``probe_bytes``: bytes through the array each way (default 256
        MiB, at most a quarter of its free space; 0: the array is not measured)."""
        if probe_bytes is not None and probe_bytes < 0:
            raise InvalidArgumentError(f"probe_bytes must be >= 0, got {probe_bytes}")
        try:
            return json.loads(self._native.measure_hardware_json(bool(cache), bool(fresh), probe_bytes))
        finally:
            _warn_notices()

    # -- the engine

    def _info(self) -> Dict[str, Any]:
        return json.loads(self._native.info_json())

    @property
    def capacity_bytes(self) -> int:
        """Usable bytes of the array."""
        return self._info()["capacity_bytes"]

    @property
    def persistent(self) -> bool:
        """Whether the engine is persistent."""
        return self._info()["persistent"]

    @property
    def config(self) -> Dict[str, Any]:
        """The configuration it was opened with (the keys of a configuration file)."""
        return self._info()["config"]

    def describe(self) -> str:
        """E.g. "2 files in /tmp/t (uring, volatile)"."""
        return self._info()["describe"]

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._native.closed

    def close(self) -> None:
        """Drain, checkpoint (persistent engines) and release. Later calls raise
        :class:`ClosedError` (also those of its executors); closing twice does nothing. A failed
        final checkpoint is raised (e.g. :class:`IoError`); the engine is closed all the same
        and the journal still has every acknowledged change."""
        try:
            self._native.close()
        finally:
            _warn_notices()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        # A failed final checkpoint is raised, unless an exception already leaves the block
        # (that one says more; the engine is closed either way).
        try:
            self.close()
        except TeraioError:
            if exc[0] is None:
                raise

    def __repr__(self) -> str:
        return "Engine(closed)" if self.closed else f"Engine({self.describe()})"


class Executor:
    """The engine's plan executor (docs/EXECUTOR.md): executes a :class:`Plan` of a
    :class:`Trace` for a trainer that drives it with its own progress, with the simulator's
    semantics (boundaries in plan order, FIFO memory grants under ``gpu_budget_bytes``, clean
    drops, a prefetch that meets its own offload in flight keeps the copy, divergence and safe
    mode). Make one with :meth:`Engine.executor`.

    Memory: ``attach(tensor_id, mem)`` hands the executor a writable buffer holding a tensor
    (global tensors before :meth:`start`; created ones after ``before_kernel`` of their kernel
    unless ``allocate_created``). The executor offloads it and, once stored, gives it back
    through ``allocator.release(tensor_id, mem)``; for a prefetch it asks
    ``allocator.alloc(tensor_id, nbytes, why)`` (``why``: ``"prefetch"`` or ``"create"``) for a
    writable buffer of exactly ``nbytes`` and fills it. Buffers are read and written by the
    engine's threads while the executor holds them. Without an ``allocator`` the executor uses
    engine host memory.

    Device memory (a :class:`DeviceMemory`, or a CUDA array with ``__cuda_array_interface__``)
    may be attached and returned by ``alloc`` on an engine with a GPU; with ``stream`` (the
    trainer's CUDA stream) offloads read a tensor after the work queued on it when they are
    issued, prefetches write after it, and once ``before_kernel``/``kernel_ready`` says a kernel
    can run, the stream waits (on the GPU, not the host) for its tensors' prefetches.

    Driving it, per iteration: ``before_kernel(k)`` (issue boundary ``k``, wait until kernel
    ``k`` can run; returns the stall in seconds) or ``boundary(k)`` + ``kernel_ready(k)``;
    ``after_kernel(k)`` (or :meth:`leave`: the created tensors' memory and ``after_kernel`` in
    one call); then :meth:`end_iteration` (a dict report). :meth:`finish` at the end.
    A divergence raises :class:`DivergedError` once; the executor then runs in safe mode.
    Trace tensor ids are the indices of the trace's tensors.

    ``sizes_at_most``: the trace's tensor sizes are upper bounds: attached memory may be
    smaller (not larger), a prefetch asks for the size attached, the budget accounts the trace's
    (a plan of a larger shape of the same iteration runs a smaller one within its budget).
    """

    __slots__ = ("_native", "trace", "plan")

    def __init__(
        self,
        engine: "Engine",
        trace: Union["Trace", Dict[str, Any], str],
        plan: Union["Plan", Dict[str, Any], str, None] = None,
        *,
        gpu_budget_bytes: int,
        allocate_created: bool = False,
        allocator: Any = None,
        stream: Any = None,
        sizes_at_most: bool = False,
    ) -> None:
        if not isinstance(engine, Engine):
            raise InvalidArgumentError(
                "teraio.Executor(engine, trace, plan, ...): the first argument is the teraio.Engine "
                f"whose store executes the plan, not {type(engine).__name__} (or call "
                "engine.executor(trace, plan, ...))"
            )
        if plan is None:
            raise InvalidArgumentError("teraio.Executor(engine, trace, plan, ...): the plan is missing")
        if isinstance(trace, dict):
            trace = Trace.from_dict(trace)
        elif isinstance(trace, str):
            trace = Trace.from_json(trace)
        if not isinstance(plan, Plan):
            plan = Plan.from_json(trace, plan if isinstance(plan, str) else json.dumps(plan))
        if allocator is not None and not callable(getattr(allocator, "alloc", None)):
            raise InvalidArgumentError("the allocator needs an alloc(tensor_id, nbytes, why) method")
        self.trace = trace
        self.plan = plan
        self._native = _teraio.NativeExecutor(
            engine._native, trace._native, plan._native, int(gpu_budget_bytes),
            bool(allocate_created), allocator, None if stream is None else _stream_handle(stream),
            bool(sizes_at_most),
        )

    def attach(self, tensor_id: int, mem: Any) -> None:
        """Hand tensor ``tensor_id``'s memory (a writable buffer of the trace's size)."""
        self._native.attach(tensor_id, mem)

    def start(self) -> None:
        """Offload the plan's initially offloaded global tensors; ready for iteration 0."""
        self._native.start()

    def boundary(self, k: int) -> None:
        """Issue the plan's instructions up to boundary ``k`` (kernel ``k`` about to run)."""
        self._native.boundary(k)

    def boundary_named(self, k: int, name: str) -> None:
        """:meth:`boundary`, checking the caller's kernel name against the trace's."""
        self._native.boundary_named(k, name)

    def leave_plan(self, k: int, detail: str) -> None:
        """The iteration left the plan at kernel ``k`` (``detail``: why, in the caller's words):
        safe mode until it ends (nothing more offloaded, everything offloaded read back); the
        report's ``diverged`` says where and why."""
        self._native.leave_plan(k, detail)

    def kernel_ready(self, k: int) -> bool:
        """Non-blocking: whether kernel ``k`` can run now."""
        return self._native.kernel_ready(k)

    def before_kernel(self, k: int) -> float:
        """Issue boundary ``k`` and wait (GIL released) until kernel ``k`` can run; the
        seconds waited."""
        return self._native.before_kernel(k)

    def after_kernel(self, k: int) -> None:
        """Kernel ``k`` ran: tensors whose last use it was die."""
        self._native.after_kernel(k)

    def leave(self, k: int, created: List[Tuple[int, int, int, Any]], device: bool) -> int:
        """Kernel ``k`` ran: attach the tensors it created, ``[(tensor_id, address, nbytes,
        owner)]``, then :meth:`after_kernel`, in one call (what a dispatch mode calls once per
        operator: no buffer export per tensor); returns :meth:`quiet_until` ``(k)``.
        ``device``: the addresses are device memory (checked on a CUDA GPU, as :meth:`attach`
        checks it), else host memory. As for a :class:`DeviceMemory`, the caller vouches that
        ``owner`` (e.g. the PyTorch storage) keeps the bytes valid and unused by others while
        the executor holds them."""
        return self._native.leave(k, created, bool(device))

    def quiet_until(self, k: int) -> int:
        """After kernel ``k``: the last kernel the caller may run without calling the executor
        (``k``: the next one needs :meth:`before_kernel`). Those kernels are quiet: no migration
        before them and only tensors the plan never moves, which fit the budget left now; the
        next :meth:`before_kernel` accounts them. A caller that pays per call skips them."""
        return self._native.quiet_until(k)

    def movable(self) -> List[bool]:
        """Per tensor of the trace: whether the plan moves it (offloads, prefetches or drops
        it). Only these need :meth:`attach` / :meth:`leave`; the others stay in the caller's
        memory (the executor accounts their bytes, and never evicts them)."""
        return self._native.movable()

    def nothing_away(self) -> bool:
        """Whether nothing the plan moves is away from the GPU now: no migration in flight or
        waiting for memory, every tensor the plan moves resident or not alive. While it holds,
        every tensor the caller can reach has its memory (teraio.torch stops watching operators
        only then)."""
        return self._native.nothing_away()

    def make_room(self, k: int, nbytes: int) -> int:
        """The caller's allocator ran out of memory running kernel ``k`` within the budget
        (fragmentation, memory the trace does not see): tensors kernel ``k`` does not use leave
        GPU memory (furthest next use first) until ``nbytes`` went back, and come back on demand
        before their next use. The bytes handed back."""
        return self._native.make_room(k, nbytes)

    def free(self, tensor_id: int) -> None:
        """The caller freed tensor ``tensor_id`` before the trace says it dies."""
        self._native.free(tensor_id)

    def poll(self) -> bool:
        """Collect finished migrations without blocking; whether anything changed."""
        return self._native.poll()

    def events(self) -> List[Tuple[str, int]]:
        """``("arrived" | "released", tensor_id)`` since the last call, oldest first."""
        return self._native.events()

    def end_iteration(self, timeline: bool = True) -> Dict[str, Any]:
        """End the iteration; its report (time, stalls, peak bytes, migrations, divergence,
        memory timeline, store statistics). ``timeline=False``: ``memory_timeline`` is empty (a
        caller that ends an iteration every training step and does not plot it saves parsing
        thousands of points, and the Python objects they would become, each step)."""
        try:
            return json.loads(self._native.end_iteration_json(timeline))
        finally:
            _warn_notices()

    def gather_globals(self, limit_bytes: Optional[int] = None) -> Dict[str, Any]:
        """Between iterations (after :meth:`end_iteration`): every global tensor resident with
        its bytes in place until the next iteration's kernel 0, for the caller's own code
        between steps. Offloads still being written keep their memory, tensors already off the
        GPU are read back. With ``limit_bytes`` (e.g. the budget) only while the GPU bytes stay
        within it, those the iteration uses first first; the others stay stored. A dict:
        ``read_back``, ``read_back_bytes``, ``kept_in_flight``, ``kept_by_plan`` (in flight,
        kept by the plan's own prefetch), ``left_off``, ``left_off_bytes``, ``waited_s``,
        ``used_bytes``."""
        if limit_bytes is not None and (not isinstance(limit_bytes, int) or limit_bytes < 0):
            raise InvalidArgumentError(f"gather_globals(limit_bytes={limit_bytes!r}): a byte count >= 0, or None")
        return json.loads(self._native.gather_globals_json(limit_bytes))

    def modified(self, tensor_id: int) -> None:
        """The caller wrote global tensor ``tensor_id`` between iterations: its stored copy
        is stale, the next offload writes it."""
        self._native.modified(tensor_id)

    def finish(self) -> None:
        """Wait for migrations in flight and free the store's copies of the trace's tensors."""
        try:
            self._native.finish()
        finally:
            _warn_notices()

    def is_resident(self, tensor_id: int) -> bool:
        """Whether the tensor has GPU (budget) memory now."""
        return self._native.is_resident(tensor_id)

    def resident(self, tensor_id: int) -> Any:
        """The object holding a resident tensor's memory (attached or allocated), or None."""
        return self._native.resident(tensor_id)

    @property
    def used_bytes(self) -> int:
        """Budget bytes accounted now."""
        return self._native.state()[0]

    @property
    def in_flight(self) -> int:
        """Migrations in flight."""
        return self._native.state()[1]

    @property
    def next_kernel(self) -> int:
        """The next kernel the plan expects."""
        return self._native.state()[2]

    @property
    def diverged(self) -> Optional[Tuple[int, str]]:
        """(kernel, detail) once the iteration left the plan, else None."""
        return self._native.state()[3]


# ----------------------------------------------------------------------------------------------
# Scheduler


class Trace:
    """One training iteration: kernels (the clock) and tensors with their accesses
    (docs/TRACE.md). Make one with :func:`load_trace`, :func:`generate_trace`,
    :meth:`from_json` or :meth:`from_dict`."""

    __slots__ = ("_native", "_info")

    def __init__(self, native: Any) -> None:
        self._native = native
        self._info: Dict[str, Any] = json.loads(native.info_json())

    @classmethod
    def from_json(cls, text: str) -> "Trace":
        """A trace from its JSON text (validated; errors name the JSON path)."""
        if not isinstance(text, str):
            raise TraceError(f"invalid trace: JSON text is a str, not {type(text).__name__}")
        return cls(_teraio.NativeTrace.from_json(text))

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Trace":
        """A trace from a dict of the JSON schema."""
        return cls.from_json(json.dumps(d))

    name = property(lambda self: self._info["name"], doc="The trace's name.")
    kernel_count = property(lambda self: self._info["kernel_count"], doc="Kernels.")
    tensor_count = property(lambda self: self._info["tensor_count"], doc="Tensors.")
    iteration_time_us = property(
        lambda self: self._info["iteration_time_us"], doc="All-resident iteration time, us."
    )
    peak_resident_bytes = property(
        lambda self: self._info["peak_resident_bytes"], doc="Peak memory if nothing moves."
    )

    def to_json(self) -> str:
        """The trace as JSON."""
        return self._native.to_json()

    def to_dict(self) -> Dict[str, Any]:
        """The trace as a dict."""
        return json.loads(self.to_json())

    def save(self, path: PathLike) -> None:
        """Write the trace as JSON."""
        with open(os.fspath(path), "w") as f:
            f.write(self.to_json())

    def __repr__(self) -> str:
        return f"Trace({self.name!r}, {self.kernel_count} kernels, {self.tensor_count} tensors)"


def load_trace(path_or_spec: PathLike) -> Trace:
    """A trace from a JSON file, or generated from ``"preset:NAME[,KEY=VALUE...]"``."""
    return Trace(_teraio.NativeTrace.load(os.fspath(path_or_spec)))


def generate_trace(model: str = "gpt2-small", **options: Any) -> Trace:
    """A synthetic training trace of model preset ``model`` (:data:`MODEL_PRESETS`) with the
    options of ``teraio trace gen``: ``layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn``,
    ``vocab``, ``seq``, ``micro_batch``, ``micro_batches``, ``dtype``, ``tp``, ``pp``,
    ``stage``, ``gpu``, ``iteration_s``, ``checkpoint_layers``, and the flags
    ``activation_checkpointing``, ``selective_recompute``, ``optimizer_in_backward``,
    ``optimizer_in_forward`` (``=True``)."""
    opts: List[Tuple[str, Optional[str]]] = []
    for k, v in options.items():
        if v is True:
            opts.append((k, None))
        elif v is False or v is None:
            continue
        else:
            opts.append((k, str(v)))
    return Trace(_teraio.NativeTrace.generate(model, opts))


def _hw(hardware: Union[str, Dict[str, Any]]) -> str:
    return json.dumps(hardware) if isinstance(hardware, dict) else str(hardware)


def hardware(preset: Union[str, Dict[str, Any]] = "paper", **overrides: Any) -> Dict[str, Any]:
    """The hardware model of a preset (``"paper"``, ``"dev"``) or dict, with ``overrides`` of
    its fields (``gpu_memory_bytes``, ``ssd_count``, ``host_memory_cap_bytes``, ...)."""
    return json.loads(_teraio.hardware_json(_hw(preset), _overrides(overrides)))


class Plan:
    """The output of a planner: offload/prefetch instructions at kernel boundaries."""

    __slots__ = ("_native", "_dict")

    def __init__(self, native: Any) -> None:
        self._native = native
        self._dict: Optional[Dict[str, Any]] = None

    @classmethod
    def from_json(cls, trace: Trace, text: str) -> "Plan":
        """A plan from JSON, checked against ``trace``."""
        return cls(_teraio.NativePlan.from_json(trace._native, text))

    @property
    def policy(self) -> str:
        """The policy that made it."""
        return self._native.policy

    def to_json(self) -> str:
        """The plan as JSON (what ``teraio plan --json`` writes)."""
        return self._native.to_json()

    def to_dict(self) -> Dict[str, Any]:
        """The plan as a dict."""
        if self._dict is None:
            self._dict = json.loads(self.to_json())
        return self._dict

    @property
    def stats(self) -> Dict[str, Any]:
        """Planner figures (peaks, bytes offloaded, candidates)."""
        return self.to_dict()["stats"]

    @property
    def instructions(self) -> List[Dict[str, Any]]:
        """Instructions in issue order."""
        return self.to_dict()["instructions"]

    @property
    def initially_offloaded(self) -> List[Dict[str, Any]]:
        """Global tensors not in GPU memory at iteration start."""
        return self.to_dict()["initially_offloaded"]

    def __repr__(self) -> str:
        return f"Plan({self.policy!r}, {len(self.instructions)} instructions)"


@dataclasses.dataclass
class SimReport:
    """What the simulator reports for the last simulated iteration."""

    policy: str
    trace: str
    outcome: Dict[str, Any]
    iteration_time_us: float
    ideal_time_us: float
    percent_of_ideal: float
    stall_us: float
    host_step_us: float
    peak_gpu_bytes: int
    gpu_capacity_bytes: int
    peak_host_bytes: int
    host_cap_exceeded: bool
    bytes_moved: Dict[str, int]
    migrations: int
    clean_drops: int
    timeline: Optional[Dict[str, Any]] = None

    @property
    def completed(self) -> bool:
        """Whether every iteration ran (not out of memory)."""
        return self.outcome.get("outcome") == "completed"

    @classmethod
    def _from(cls, d: Dict[str, Any]) -> "SimReport":
        d = dict(d)
        d["bytes_moved"] = {r["resource"]: r["bytes"] for r in d.get("bytes_moved", [])}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass
class PolicyResult:
    """One policy of :func:`compare_policies`."""

    policy: str
    plan_time_s: float
    plan_stats: Dict[str, Any]
    report: SimReport


def plan(
    trace: Trace,
    policy: str = "teraio",
    hardware: Union[str, Dict[str, Any]] = "paper",
    *,
    checked: bool = False,
    **overrides: Any,
) -> Plan:
    """Plan ``trace`` with ``policy`` (:data:`POLICIES`) on ``hardware`` (a preset name or a
    dict), with ``overrides`` of hardware fields. ``checked=True`` refuses, as ``teraio plan``
    does, a plan that cannot run: a kernel larger than the GPU budget, a plan out of GPU memory
    in the simulator, or one needing more SSD or host space than the hardware's capacities
    (:class:`PlanError` / :class:`SimulationError` naming what is needed and what there is)."""
    return Plan(_teraio.plan(trace._native, policy, _hw(hardware), _overrides(overrides), bool(checked)))


class Selection:
    """What :func:`select` chose: ``plan`` (a :class:`Plan`) and the rest as a dict
    (``info``): ``choice`` (``"as_modelled"``, ``"slower_transfers"``, ``"paging"``), ``why``
    (a sentence), ``budgets`` (``executor_bytes``: what the executor runs the plan with;
    ``planning_bytes``; ``allowance_bytes``; the largest working set; ``raised_to_working_set``),
    ``alternatives`` (every plan considered, the chosen one marked), ``traffic`` (the second
    plan's figures, when one was made or tried)."""

    __slots__ = ("plan", "info")

    def __init__(self, plan: Plan, info: Dict[str, Any]) -> None:
        self.plan = plan
        self.info = info

    @property
    def choice(self) -> str:
        return self.info["choice"]

    @property
    def why(self) -> str:
        return self.info["why"]

    @property
    def budgets(self) -> Dict[str, Any]:
        return self.info["budgets"]

    def __repr__(self) -> str:
        return f"Selection({self.plan.policy!r}, {self.choice!r}: {self.why})"


def _select_options(policy: str, gpu_budget_bytes: Optional[int], allowance: Optional[Dict[str, Any]],
                    reserved_bytes: int, plan_margin: float, paging_fallback: Optional[bool]) -> Dict[str, Any]:
    """The scheduler's selection options as :func:`select` and :func:`choose_checkpoint` send
    them (``SelectRequest``)."""
    opts: Dict[str, Any] = {"policy": policy, "reserved_bytes": int(reserved_bytes), "plan_margin": float(plan_margin)}
    if gpu_budget_bytes is not None:
        opts["gpu_budget_bytes"] = int(gpu_budget_bytes)
    if allowance is not None:
        opts["allowance"] = allowance
    if paging_fallback is not None:
        opts["paging_fallback"] = bool(paging_fallback)
    return opts


def select(
    trace: Trace,
    policy: str = "auto",
    hardware: Union[str, Dict[str, Any]] = "paper",
    *,
    gpu_budget_bytes: Optional[int] = None,
    allowance: Optional[Dict[str, Any]] = None,
    reserved_bytes: int = 0,
    plan_margin: float = 0.0,
    traffic_margin: float = 0.0,
    paging_fallback: Optional[bool] = None,
    **overrides: Any,
) -> Selection:
    """Plan selection, the rules the CLI, the C ABI and teraio.torch share (the scheduler's
    ``select::choose``): the budget (``gpu_budget_bytes``, default the model's GPU memory,
    less ``allowance``: ``{"kind": "fixed", "keep_fraction": 0.85}`` or ``{"kind":
    "measured", "bytes": N}``, less ``reserved_bytes``; plans for ``plan_margin`` less), the
    working-set check (:class:`PlanError` naming a kernel that can never fit), ``policy``'s
    checked plan, a second plan for transfers at 0.7 of the model's rates taken when it moves
    less and simulates within ``traffic_margin`` (0: not made), and, where the policy's plan
    does not run, the pager's schedule as a plan (``paging_fallback``; default: with
    ``"auto"``). ``overrides``: hardware fields, as :func:`plan` takes them."""
    opts = _select_options(policy, gpu_budget_bytes, allowance, reserved_bytes, plan_margin, paging_fallback)
    opts["traffic_margin"] = float(traffic_margin)
    native, info = _teraio.select(trace._native, _hw(hardware), _overrides(overrides), json.dumps(opts))
    return Selection(Plan(native), json.loads(info))


def choose_checkpoint(
    trace: Trace,
    policy: str = "auto",
    hardware: Union[str, Dict[str, Any]] = "paper",
    *,
    gpu_budget_bytes: Optional[int] = None,
    allowance: Optional[Dict[str, Any]] = None,
    reserved_bytes: int = 0,
    plan_margin: float = 0.0,
    paging_fallback: Optional[bool] = None,
    **overrides: Any,
) -> Dict[str, Any]:
    """Which of the trace's layers to checkpoint (their forward run again in backward, as
    ``torch.utils.checkpoint`` does) so that the plan :func:`select` makes of the rest, with
    the same options, simulates fastest (the scheduler's ``checkpoint::choose_layers``): no
    layer, ``k`` layers spread evenly for each ``k``, then each layer toggled from the best.
    Returns ``{"layers": [...], "iteration_time_us", "without_us", "tried": [...], "why"}``;
    ``layers`` is empty unless checkpointing simulates at least 2% faster."""
    opts = _select_options(policy, gpu_budget_bytes, allowance, reserved_bytes, plan_margin, paging_fallback)
    return json.loads(_teraio.choose_checkpoint(trace._native, _hw(hardware), _overrides(overrides),
                                                json.dumps(opts)))


def select_budgets(gpu_budget_bytes: int, *, allowance: Optional[Dict[str, Any]] = None, reserved_bytes: int = 0,
                   plan_margin: float = 0.0, largest_tensor_bytes: int = 0,
                   trace: Optional[Trace] = None) -> Any:
    """:func:`select`'s budget rule without planning. Without ``trace``: ``(executor bytes,
    planning bytes)`` (``largest_tensor_bytes``: the trace's largest tensor, for the fixed
    allowance). With ``trace``: a dict (``executor_bytes``, ``planning_bytes``,
    ``allowance_bytes``, ``working_set_bytes``, ``working_set_kernel``,
    ``raised_to_working_set``), or ``{"never_fits": {"kernel", "name", "needed_bytes",
    "capacity_bytes", "message"}}`` for a kernel no plan can fit."""
    opts: Dict[str, Any] = {"gpu_budget_bytes": int(gpu_budget_bytes), "reserved_bytes": int(reserved_bytes),
                            "plan_margin": float(plan_margin)}
    if allowance is not None:
        opts["allowance"] = allowance
    if trace is not None:
        return json.loads(_teraio.select_trace_budgets(trace._native, json.dumps(opts)))
    return tuple(_teraio.select_budgets(json.dumps(opts), int(largest_tensor_bytes)))


def simulate(
    trace: Trace,
    plan: Plan,
    hardware: Union[str, Dict[str, Any]] = "paper",
    iterations: int = 2,
    timeline: bool = False,
    **overrides: Any,
) -> SimReport:
    """Replay ``plan`` of ``trace`` on ``hardware`` for ``iterations`` (the last one is
    reported); ``timeline=True`` records memory and bandwidth over time."""
    text = _teraio.simulate(
        trace._native, plan._native, _hw(hardware), _overrides(overrides), iterations, timeline
    )
    return SimReport._from(json.loads(text))


def compare_policies(
    trace: Trace,
    policies: Optional[Sequence[str]] = None,
    hardware: Union[str, Dict[str, Any]] = "paper",
    **overrides: Any,
) -> List[PolicyResult]:
    """Plan and simulate ``trace`` with each of ``policies`` (all when None)."""
    text = _teraio.compare_policies(
        trace._native, list(policies or []), _hw(hardware), _overrides(overrides)
    )
    return [
        PolicyResult(r["policy"], r["plan_time_s"], r["plan_stats"], SimReport._from(r["report"]))
        for r in json.loads(text)
    ]


def place_optimizer(
    trace: Trace,
    policy: str = "auto",
    hardware: Union[str, Dict[str, Any]] = "paper",
    *,
    candidates: int = 6,
    in_backward: bool = False,
    **overrides: Any,
) -> Dict[str, Any]:
    """Where each optimizer update of ``trace`` runs, on the GPU (its states moved by the plan)
    or on the host (states in host memory: gradient down, weight up, CPU time from the hardware
    model's ``cpu_adam_params_per_s``), chosen by simulated cost (``teraio simulate
    --optimizer-on auto``; docs/TORCH.md, "Where the optimizer runs"). ``policy`` plans each
    candidate; ``candidates`` grid points from all-GPU to all-host are simulated (at least 2).
    A host update's CPU work runs at the optimizer's step, where its kernels were (as
    :func:`teraio.torch.offload_optimizer` runs it); ``in_backward=True``: as soon as its
    gradients arrived (``offload_optimizer(update_in_backward=True)``).
    Returns a dict: ``summary`` (one line), ``host_weights`` (the trace's names of the weights
    updated on the host) and ``host_weight_ids``, ``host_params`` / ``total_params``, the
    simulated ``iteration_us`` of the choice, ``all_gpu_us`` and ``all_host_us`` (None where no
    plan runs), ``ideal_us``, ``bound_us``, ``candidates`` and per update its ``weights``,
    ``on_host``, ``eligible`` and ``reason``."""
    text = _teraio.place_optimizer(trace._native, policy, _hw(hardware), _overrides(overrides), int(candidates),
                                    bool(in_backward))
    return json.loads(text)


# -- the host optimizer


def _threads(threads: Optional[int]) -> int:
    if threads is None:
        return 0
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidArgumentError(f"threads = {threads!r}: a thread count is an int >= 1 (None: all)")
    return threads


def _step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        try:  # a 0-dim tensor, a numpy scalar, an integral float (PyTorch keeps 'step' as a float)
            f = float(step)
        except (TypeError, ValueError):
            f = math.nan
        if not f.is_integer():
            raise InvalidArgumentError(f"step = {step!r}: the step number is a whole number >= 1")
        step = int(f)
    if step < 1:
        raise InvalidArgumentError(
            f"step = {step}: steps count from 1 (the count after this update, PyTorch's state['step'])")
    return step


def adamw_step(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    *,
    step: int,
    lr: float,
    weight_decay: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    amsgrad: bool = False,
    max_exp_avg_sq: Any = None,
    maximize: bool = False,
    decoupled_weight_decay: bool = True,
    threads: Optional[int] = None,
) -> None:
    """One AdamW step in place, on the host: exactly ``torch.optim.AdamW``'s single-tensor CPU
    update (``decoupled_weight_decay=False``: ``torch.optim.Adam``'s L2 weight decay).

    ``param``, ``grad``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq``, required with
    ``amsgrad``) are C-contiguous float32 buffers of one length: CPU torch tensors, numpy
    arrays, buffer-protocol objects; all but ``grad`` are written, none may overlap another.
    ``step`` is the step number counting this one (1 first: PyTorch's ``state['step']`` after
    its increment). ``threads``: at most this many threads (None: all cores; a small tensor
    uses one). Runs with the GIL released; the buffers must not be resized meanwhile. A wrong
    length, dtype, layout or hyperparameter raises :class:`InvalidArgumentError` naming it,
    before anything is written."""
    # the buffers are read, checked and held in Rust (the native module's export.rs)
    _teraio.adam_step(
        param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq,
        _step(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
        bool(amsgrad), bool(maximize), bool(decoupled_weight_decay), _threads(threads),
    )


def sgd_step(
    param: Any,
    grad: Any,
    momentum_buffer: Any = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    fresh_buffer: bool = False,
    threads: Optional[int] = None,
) -> None:
    """One SGD step in place, on the host: exactly ``torch.optim.SGD``'s single-tensor CPU
    update. With ``momentum != 0``, ``momentum_buffer`` (param's length) is required;
    ``fresh_buffer=True`` on its first step (PyTorch's ``state['momentum_buffer']`` is None)
    sets it to the gradient instead of updating it. Buffers and threads as
    :func:`adamw_step`."""
    _teraio.sgd_step(
        param, grad, momentum_buffer, bool(fresh_buffer), float(lr), float(momentum),
        float(dampening), float(weight_decay), bool(nesterov), bool(maximize), _threads(threads),
    )


def optimizer_info() -> Dict[str, Any]:
    """What the host optimizer runs with here: ``{"isa": "avx512" | "avx2" | "portable",
    "threads": default thread count, "debug_build": bool}`` (a debug build, such as a wheel of
    maturin's dev profile, computes the same bits far more slowly: benchmark a release wheel)."""
    isa, threads, debug = _teraio.optim_info()
    return {"isa": isa, "threads": threads, "debug_build": debug}

__all__ = [
    "DeviceMemory",
    "__version__",
    "version",
    "POLICIES",
    "MODEL_PRESETS",
    "KEY_CALLER_FIRST",
    "Engine",
    "Executor",
    "HostBuffer",
    "PendingOp",
    "TensorInfo",
    "Trace",
    "Plan",
    "SimReport",
    "PolicyResult",
    "load_trace",
    "generate_trace",
    "hardware",
    "plan",
    "select",
    "choose_checkpoint",
    "select_budgets",
    "Selection",
    "simulate",
    "compare_policies",
    "place_optimizer",
    "adamw_step",
    "sgd_step",
    "optimizer_info",
    "TeraioWarning",
    "Notice",
    "notices",
] + _errors.__all__

if sys.version_info < (3, 9):  # pragma: no cover
    raise ImportError("teraio needs Python >= 3.9")
