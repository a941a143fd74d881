"""Planned steps: the engine's plan executor driven by the operator count of a real iteration.

All plan semantics (what is issued at which boundary, FIFO allocation under the budget, waiting
until a kernel's tensors are resident, clean drops, an offload met by its own prefetch,
divergence and safe mode) belong to the executor (docs/EXECUTOR.md). This module only
translates between PyTorch and it:

- a trace tensor is a storage; the executor gets a *borrowed* view of the storage's memory
  (``attach``) and calls back into :class:`PlannedRun` when it needs memory for a prefetch
  (``alloc``: the storage is regrown, its memory handed over) and when it gives memory back
  (``release``: after an offload is stored the storage shrinks to 0 bytes; when the trace says the
  tensor died nothing happens, PyTorch frees it when its references go);
- operator ``k`` of the iteration is kernel ``k``: before it runs, its signature (operator,
  shapes, dtypes) must be the profiled one, then ``before_kernel(k)`` (boundary ``k`` issued; the
  stall); after it ran, ``leave(k, created, device)``: the storages it created (matched to trace
  ids in the order the profiler discovered them, looked for among its arguments only where the
  profile found one there) are attached and ``after_kernel(k)`` runs, in one call. These two are
  the executor's only calls per operator (the host's time per operator sets the pace of a bf16
  step on a fast GPU);
- a tensor the plan recomputes: its creating operator, with its arguments, is kept from its
  creation until its last recomputation; the executor drops the tensor (``release``), grows it
  back (``alloc``) and asks for it (``recompute``) right before the kernel that needs it, and the
  operator runs again, its result copied into the storage;
- a mismatch, or the executor's ``Diverged`` error, ends planned execution for the step: the
  executor, told with ``leave_plan(k, detail)``, reads everything back (its safe mode), the rest of the step runs without moving
  anything, and the session profiles the next step again.

The executor is created with ``executor_factory(trace_dict, plan, budget_bytes, allocator)``
(:class:`teraio.torch.Session` passes its engine's ``executor``, with the current CUDA stream on a
GPU). Storages are handed over as ``teraio.DeviceMemory`` (CUDA storages; the engine's GPU data
paths, ordered after the trainer's stream) or as host buffers (CPU storages).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode

from ._storages import (byte_view, covers, flat_args, iter_tensors, local_tensor, op_name, run_op, signature,
                        storage_key, storage_of)
from . import _storages
from .fsdp import named_parameters
from .pager import host_view

_DIRECT_RESIZE = ("cpu", "cuda")

# how many of the latest steps' executor reports and gathers a run keeps (a run lives as long as
# the training: everything kept per step must be bounded)
KEEP_REPORTS = 16


def keep_last(items: list[Any], item: Any, keep: int = KEEP_REPORTS) -> None:
    """Append ``item``, keeping at least the ``keep`` latest (at most twice as many: the
    oldest are dropped in batches, not one per append)."""
    items.append(item)
    if len(items) > 2 * keep:
        del items[:-keep]


# the fewest operators a planned step stops watching for (leaving and re-entering the dispatch
# mode costs about what watching a few operators does)
UNWATCHED_MIN_OPS = 8


def _resize(s: torch.UntypedStorage, nbytes: int) -> None:
    """Resize a storage to ``nbytes``. CPU and CUDA storages resize without the dispatcher
    (``THPStorage_resize_`` calls ``resize_bytes_cpu``/``resize_bytes_cuda``), so no dispatch
    mode sees it and none needs disabling (the executor calls this thousands of times a step, and
    disabling the modes costs microseconds each time); other devices resize through a tensor
    operator, which the running modes must not see."""
    if s.device.type in _DIRECT_RESIZE:
        s.resize_(nbytes)
    else:
        with _disable_current_modes():
            s.resize_(nbytes)


class ResultView:
    """What the executor's bookkeeping reads of an operator's result tensor, without the tensor:
    its storage, device, layout, dtype, shape, stride and offset. (A step that holds on to a
    factory operator's result, ``arange(n)``, inside the dispatch mode makes PyTorch add a
    ``detach`` to the operator sequence; this holds the storage instead.)"""

    __slots__ = ("_storage", "device", "layout", "dtype", "shape", "_stride", "_offset")

    def __init__(self, t: torch.Tensor) -> None:
        self._storage = storage_of(t)
        self.device, self.layout, self.dtype, self.shape = t.device, t.layout, t.dtype, t.shape
        self._stride, self._offset = t.stride(), t.storage_offset()

    def untyped_storage(self) -> torch.UntypedStorage:
        if self._storage is None:
            raise RuntimeError("no storage")
        return self._storage

    def stride(self) -> tuple[int, ...]:
        return self._stride

    def storage_offset(self) -> int:
        return self._offset


class Results(list):
    """An operator's results as :class:`ResultView` s, in :func:`iter_tensors` order."""

    @classmethod
    def of(cls, out: Any) -> "Results":
        return cls(ResultView(t) for t in iter_tensors(out))


class Diverged(Exception):
    """The iteration left the profiled one at ``kernel``."""

    def __init__(self, kernel: int, detail: str) -> None:
        super().__init__(f"kernel {kernel}: {detail}")
        self.kernel = kernel
        self.detail = detail


def named_tensors(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """The tensors the profiler names (``param:``, ``grad:``, ``buffer:``, ``state:``)."""
    out: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}
    if model is not None:
        for n, p in named_parameters(model):
            names[id(p)] = n
            out[f"param:{n}"] = p
            if p.grad is not None:
                out[f"grad:{n}"] = p.grad
        for n, b in model.named_buffers():
            out[f"buffer:{n}"] = b
    if optimizer is not None:
        for p, state in optimizer.state.items():
            pn = names.get(id(p), f"p{id(p):x}")
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    out[f"state:{pn}.{k}"] = v
    return out


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place write counter (shared with its views), None when it has none (a
    DTensor's: its local shard's, which every write of this rank's bytes bumps)."""
    try:
        return local_tensor(t)._version
    except (RuntimeError, AttributeError):  # inference tensors have no version counter
        return None


def _default_factory(trace: dict, plan: Any, budget: int, allocator: Any) -> Any:
    raise NotImplementedError(
        "PlannedRun needs an executor_factory (teraio.torch.Session passes its engine's "
        "executor); without one, steps page through the engine instead"
    )


@dataclass
class PlanEntry:
    """A plan of a :class:`~teraio.torch.Session` (``Session.plans``, by the iteration's operator
    sequence): the profile of the shapes it is for, its plan, and the state of the run made of
    it. :class:`PlannedRun` reads the profile and the plan."""

    #: the profiled trace (the dict of ``teraio.Trace.from_dict``)
    trace: dict[str, Any]
    #: per operator: its signature (what tells one iteration's operators from another's)
    signatures: list[Any]
    #: per operator: the trace ids first seen there, in order
    created: list[list[int]]
    #: per operator: where the profile found each storage it created (an index among the tensor
    #: arguments, or past them among the results)
    created_at: list[list[int]]
    #: the profiler's marks (module hooks: where unwatched stretches may end)
    marks: list[Any] = field(default_factory=list)
    #: the first operator that reads the input batch (0 if none)
    input_op: int = 0
    #: the plan (None: none yet, or none fits)
    plan: Any = None
    #: the traffic margin's comparison of two plans, when it ran
    traffic: dict[str, Any] | None = None
    #: the run executing the plan: a :class:`PlannedRun`, None (none yet), False (none can be made)
    run: Any = None
    #: why no run could be made
    no_run: str | None = None
    #: the plan's recomputations were checked bitwise (its first step, ``verify_recompute``)
    verified: bool = False
    #: diverged steps in a row
    diverged_n: int = 0
    #: runs started of it
    runs_started: int = 0
    #: why no plan was made (the selection's refusal), when none was
    refused: str | None = None
    #: the bytes the plan's executor runs with (the selection's), None: the Session's plan budget
    budget: int | None = None
    #: how the plan was selected (``teraio.Selection.info``)
    selection: dict[str, Any] | None = None

    @functools.cached_property
    def global_bytes(self) -> int:
        """Bytes of the trace's global tensors (parameters, gradients, optimizer states)."""
        return sum(t["bytes"] for t in self.trace["tensors"] if t["global"])


class PlannedRun:
    """One plan executed over many iterations of the same shapes (one executor)."""

    def __init__(self, entry: PlanEntry, model: torch.nn.Module | None, optimizer: Any, budget: int,
                 device: torch.device, executor_factory: Callable[..., Any] | None = None,
                 device_memory: bool | None = None, gather: bool = True, max_ahead: int = 0,
                 time_gpu: bool = False, host_waits: bool = False,
                 record: Callable[[Any, tuple, dict], Any] | None = None, verify_remakes: bool = False,
                 bring: Callable[[torch.UntypedStorage], bool] | None = None) -> None:
        self.trace = entry.trace
        # ``record`` (a profiler's dispatch): the run is *bounded*: the plan is another, larger
        # shape's of the same iteration (every operator's tensors at most as large as the
        # profile's, the executor taking the trace's sizes as upper bounds), run for one step
        # while ``record`` runs and records every operator (the profile of this shape); no
        # operator is skipped or run unwatched
        self.bounded = record is not None
        self._record = record
        self.signatures = entry.signatures
        self.created = entry.created  # per op: the trace ids first seen there, in order
        self.device = device
        # storages go to the executor as device memory (teraio.DeviceMemory: the engine's GPU
        # data paths, stream-ordered) or as host buffers; CUDA storages always as device memory
        self.device_memory = device.type == "cuda" if device_memory is None else device_memory
        # memory given back (a storage shrunk to 0 bytes) goes to PyTorch's caching allocator,
        # which reuses it only for work queued later on the trainer's stream: the executor
        # orders that stream after an engine copy still reading the memory instead of waiting,
        # and offloads to the host tier are queued on the device (``host_waits``: the engine's
        # workers wait for the GPU and copy, the executor waits for them)
        self.stream_ordered = device.type == "cuda" and not host_waits
        self.tensors = self.trace["tensors"]
        # per op: where the profile found each storage it created (an index among the tensor
        # arguments, or past them among the results)
        self._created_at = entry.created_at
        self._device_mem = self.device_memory or device.type == "cuda"
        self.refs: dict[int, Any] = {}  # trace id -> weakref to its storage
        self.tid_of: dict[int, int] = {}  # storage key -> trace id, this iteration
        self._releasing_deaths = False
        self.poisoned = False  # a global's storage moved outside the plan (_check_globals)
        self.diverged: Diverged | None = None
        self.stall_s = 0.0
        self.stalls: dict[int, float] = {}  # kernel -> seconds waited before it, this step
        self.reports: list[Any] = []  # the last KEEP_REPORTS steps' executor reports
        # between steps every global tensor resident (the executor's gather_globals; True: every
        # one; "budget": those that fit the budget, the others stay stored), and what the
        # caller's code wrote meanwhile told to the executor (the tensors' version counters)
        self.gather = gather
        self.left_off = 0  # global tensors the last gather left stored (they did not fit)
        self.gathers: list[Any] = []
        self._versions: dict[int, tuple[torch.Tensor, int | None]] = {}
        # on a GPU, the host runs at most ``max_ahead`` operators ahead of the GPU (0: no limit):
        # the executor's view of what is stored and free is the host's, and memory a prefetch
        # gets is ordered after everything queued before it, so a host far ahead of the GPU
        # starts prefetches later than the plan's timing assumes
        self.max_ahead = max_ahead if device.type == "cuda" else 0
        self._marks: list[Any] = []
        self.ahead_wait_s = 0.0
        # on a GPU, with ``time_gpu``: an event right before and right after each operator's
        # launch, so a step reports where the GPU itself waited (host-side waits overstate it:
        # the host runs ahead of the GPU)
        self.time_gpu = time_gpu and device.type == "cuda"
        self._starts: list[Any] = []
        self._ends: list[Any] = []
        self._timed = 0
        self._remade: list[tuple[Any, Any, int]] = []  # events around each recomputation, this step
        self._remade_n = 0
        self._stream: Any = None
        self._k = 0  # the operator about to run
        self._flat: list[torch.Tensor] = []  # its tensor arguments
        # recomputations: tensor -> how many times the plan remakes it per iteration, and the
        # operator (func, args, kwargs, which result) that made it this iteration
        self._remakes: dict[int, int] = {}
        plan = entry.plan
        to_dict = getattr(plan, "to_dict", None)
        for r in (to_dict().get("recomputations", []) if to_dict is not None else []):
            self._remakes[r["tensor"]] = self._remakes.get(r["tensor"], 0) + 1
        self._producers: dict[int, tuple[Any, tuple, dict, int, tuple]] = {}
        self._left: dict[int, int] = {}
        self.recomputed = 0
        self.recomputed_in_place = 0  # of them, written by the operator's ``out=`` form
        # ``verify_remakes``: in this run's first step, each tensor dropped for a recomputation
        # is copied (to the host) first and its recomputation compared with it bitwise; one that
        # differs (a kernel not bitwise reproducible on this device) gets its original bytes
        # back, so the step's math stays plain training's, and its operator is named in
        # ``unstable`` (the session then plans without recomputing it)
        self._verify = verify_remakes and bool(self._remakes)
        self._saved: dict[int, torch.Tensor] = {}
        self.verified = 0
        self.unstable: list[str] = []
        # an operator that runs out of memory within the budget (the caching allocator's blocks
        # rounded and scattered) is run again once the executor made room (``call``)
        self.budget = budget
        self._largest = max((t["bytes"] for t in self.tensors), default=0)
        self.made_room_bytes = 0
        self.oom_retries = 0
        factory = executor_factory or _default_factory
        self.ex = factory(self.trace, plan, budget, self)
        # the two calls made for every operator, bound once (the engine's executor's native
        # methods, without its Python wrapper's frame)
        calls = getattr(self.ex, "_native", self.ex)
        self._native_ex = calls is not self.ex  # the engine's executor (not a test's stand-in)
        self._before_kernel = calls.before_kernel
        self._leave = calls.leave
        # only the tensors the plan moves go to the executor (the others stay the trainer's,
        # accounted from the trace): per op, those it creates with where the profile found them
        movable = getattr(calls, "movable", None)
        self._movable = list(movable()) if movable is not None else [True] * len(self.tensors)
        self._want = [[(t, at) for t, at in zip(c, where)
                       if not self.tensors[t]["global"] and self._movable[t]]
                      for c, where in zip(self.created, self._created_at)]
        # the executor says after each operator how many next ones need no call (quiet ones:
        # nothing moves around them); with ``max_ahead`` or ``time_gpu`` every one is called
        self._skips = self.max_ahead <= 0 and not self.time_gpu and not self.bounded
        self._quiet_until = -1
        self._funcs: list[Any] = [None] * len(self.signatures)  # the operators matched so far
        # unwatched stretches: where nothing the plan moves is away and the next operators are
        # quiet up to a module hook, the step leaves its dispatch mode and re-enters it at that
        # hook (its place known from the profile's module hooks, ``Profiler.marks``); see
        # :meth:`watch`
        marks = entry.marks or ()
        self._mark_at = [m[0] for m in marks]
        self._mark_key = [(m[1], m[2]) for m in marks]
        self._mark_bwd = [m[3] for m in marks]
        self._nothing_away = getattr(calls, "nothing_away", None)
        self._t = 0  # the next module hook expected
        self._away: Any = None  # the mode left (unwatched), until re-entered
        self._wake_at: int | None = None  # the hook that re-enters it (None: the step's end)
        self._away_from = 0  # the operator it was left before
        self.unwatched_ops = 0  # operators run unwatched this step
        named = named_tensors(model, optimizer)
        self._globals: list[tuple[int, torch.Tensor]] = []
        self._moved_globals: list[tuple[int, torch.Tensor]] = []
        # ``bring``: globals a pager holds stored (parameters, gradients and optimizer states
        # that together pass the budget) are brought back one at a time, after the resident
        # ones: the executor moves those its plan starts on a tier there as soon as what it
        # holds passes the budget, so they never need to fit at once
        stored: list[tuple[int, torch.Tensor, torch.UntypedStorage]] = []
        for tid, t in enumerate(self.tensors):
            if not t["global"]:
                continue
            x = named.get(t["name"])
            s = storage_of(x) if x is not None else None
            if s is not None and s.nbytes() == 0 and t["bytes"] > 0 and bring is not None:
                stored.append((tid, x, s))
                continue
            self._attach_global(tid, t, x, s)
        for tid, x, s in stored:
            bring(s)
            self._attach_global(tid, self.tensors[tid], x, s)
        self.ex.start()

    def _attach_global(self, tid: int, t: dict, x: torch.Tensor | None, s: torch.UntypedStorage | None) -> None:
        if s is None or s.nbytes() != t["bytes"]:
            raise Diverged(0, f"global tensor {t['name']} ({t['bytes']} bytes) not found as such")
        self._globals.append((tid, x))
        if self._movable[tid]:
            # (only a global the plan moves has a stored copy a write can make stale)
            self._moved_globals.append((tid, x))
        self._bind(tid, s)
        self.ex.attach(tid, self._mem(s, t["bytes"]))

    # ---- memory callbacks (called by the executor) ------------------------------------

    def _mem(self, s: torch.UntypedStorage, nbytes: int) -> Any:
        if self.device_memory or s.device.type == "cuda":
            import teraio

            return teraio.DeviceMemory(s.data_ptr(), nbytes, s)
        return host_view(s, nbytes)

    def _bind(self, tid: int, s: torch.UntypedStorage) -> None:
        self.refs[tid] = weakref.ref(s)
        self.tid_of[storage_key(s)] = tid

    def alloc(self, tid: int, nbytes: int, why: Any = None) -> Any:
        """Memory for a prefetch of ``tid``: its storage, grown back. Where the caching allocator
        has no room although the plan's budget has (its blocks rounded and scattered, memory the
        trace does not see): ``MemoryError``, and the executor makes room and asks again."""
        s = self.refs[tid]()
        if s is None:
            raise RuntimeError(f"tensor {tid} ({self.tensors[tid]['name']}) has no storage any more")
        try:
            _resize(s, nbytes)
        except torch.OutOfMemoryError as e:
            raise MemoryError(f"no room for {nbytes} bytes of {self.tensors[tid]['name']}: "
                              f"{str(e).splitlines()[0]}") from None
        return self._mem(s, nbytes)

    def release(self, tid: int, mem: Any = None) -> None:
        """The executor gave ``tid``'s memory back: after an offload (or a drop before a
        recomputation), shrink the storage."""
        if self._releasing_deaths:
            self._producers.pop(tid, None)  # it died: nothing will remake it
            return
        s = self.refs[tid]()
        if s is not None:
            if self._verify and tid in self._producers:
                # (a drop before a recomputation: its bytes, to compare the recomputation with)
                self._saved[tid] = byte_view(s).to("cpu", copy=True)
            _resize(s, 0)

    def recompute(self, tid: int, mem: Any = None) -> None:
        """Make ``tid`` again in its (regrown) storage: its creating operator runs once more on
        the same arguments (the executor made them resident), the result copied in."""
        s = self.refs[tid]()
        p = self._producers.get(tid)
        if s is None or p is None:
            raise RuntimeError(f"tensor {tid} ({self.tensors[tid]['name']}) cannot be recomputed: "
                               "its storage or its operator is gone")
        func, args, kwargs, which, (shape, stride, offset, dtype, n_out) = p
        timed = self._remade_mark() if self.time_gpu else None
        with _disable_current_modes(), torch.no_grad(), torch.autocast(s.device.type, enabled=False):
            # an operator with one result and an ``out=`` form writes straight into the storage
            # (no second copy of the tensor in memory meanwhile); others run and are copied
            out_form = getattr(func.overloadpacket, "out", None) if n_out == 1 else None
            in_place = False
            if out_form is not None:
                dst = torch.empty(0, dtype=dtype, device=s.device).set_(s, offset, shape, stride)
                try:
                    out_form(*args, **kwargs, out=dst)
                    in_place = True
                except (RuntimeError, TypeError):
                    pass  # another signature: the functional form below rewrites it all
            if in_place:
                self.recomputed_in_place += 1
            else:
                out = func(*args, **kwargs)
                src = storage_of(list(iter_tensors(out))[which])
                byte_view(s).copy_(byte_view(src))
        if timed is not None:
            timed[1].record(self._stream)
        saved = self._saved.pop(tid, None)
        if saved is not None:
            self._check_remake(func, s, saved, (shape, stride, offset, dtype))
        self.recomputed += 1
        self._left[tid] -= 1
        if self._left[tid] <= 0:  # the last recomputation: let its arguments go
            del self._producers[tid]

    def _check_remake(self, func: Any, s: torch.UntypedStorage, saved: torch.Tensor, meta: tuple) -> None:
        """Compare a recomputed tensor (its region of storage ``s``) with its bytes from before
        the drop (``saved``, the whole storage on the host); where they differ, put the saved
        bytes back and name the operator in ``unstable``."""
        shape, stride, offset, dtype = meta

        def region(storage: Any, device: Any) -> torch.Tensor:
            t = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, shape, stride)
            return t.contiguous().reshape(-1).view(torch.uint8)

        self.verified += 1
        now = region(s, s.device).cpu()
        if not torch.equal(now, region(saved.untyped_storage(), "cpu")):
            byte_view(s).copy_(saved.to(s.device))
            name = op_name(func)
            if name not in self.unstable:
                self.unstable.append(name)

    # ---- one iteration -----------------------------------------------------------------

    def begin_iteration(self) -> None:
        """A new iteration: only the global tensors' storages are known; the global tensors the
        caller's code wrote since the last step are told to the executor (their stored copies
        are stale)."""
        self.tid_of = {k: v for k, v in self.tid_of.items() if self.tensors[v]["global"]}
        self.stalls = {}
        self.ahead_wait_s = 0.0
        self.made_room_bytes = 0
        self.oom_retries = 0
        self._quiet_until = -1
        self._producers = {}
        self.recomputed = 0
        self.verified = 0  # (this step's checks: only a run's first step makes any)
        self.recomputed_in_place = 0
        self._timed = 0
        self._remade_n = 0
        self._t = 0
        self._away = None
        self._wake_at = None
        self.unwatched_ops = 0
        # the trainer's stream, looked up once a step (events record on it; a lookup per
        # operator cost more host time than the events themselves)
        self._stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self._check_globals()
        modified = getattr(self.ex, "modified", None)
        if modified is not None:
            for tid, (t, v) in self._versions.items():
                if v is None or _version(t) != v:
                    modified(tid)
        self._versions = {}

    def replay(self, prefix: list[tuple[Any, tuple, dict, Any]]) -> None:
        """The step's first operators ran before this run was chosen (``prefix``: each one's
        operator, arguments and :class:`Results`, in order, every tensor holding its bytes): the executor
        is told them now, as if each had run under the plan (its boundary issued, the storages
        it created attached, the deaths after it), so the rest of the step runs planned."""
        for i, (func, args, kwargs, out) in enumerate(prefix):
            self.before(i, func, args, kwargs)
            self.after(i, args, kwargs, out, func)
            if self.diverged is not None:
                return

    def _check_globals(self) -> None:
        """Before the executor touches a global tensor again: the memory it holds for each one is
        still its storage's (the same address and size). Code outside the plan that resized or
        replaced a global's storage since (``resize_``, ``set_``, another executor or pager moving
        it) would otherwise have the engine read and write memory that is no longer the tensor's.
        A mismatch poisons the run (its executor is never used again, not even to read back) and
        raises, naming the tensor."""
        resident = getattr(self.ex, "resident", None)
        if resident is None or not self._native_ex:
            return
        for tid, x in self._globals:
            mem = resident(tid)
            if mem is None:
                continue
            s = storage_of(x)
            addr = mem.ptr if hasattr(mem, "ptr") else ctypes.addressof(mem)
            size = mem.nbytes if hasattr(mem, "ptr") else ctypes.sizeof(mem)
            if s is None or s.data_ptr() != addr or s.nbytes() != size:
                self.poisoned = True
                got = "no storage" if s is None else f"{s.nbytes()} bytes at {s.data_ptr():#x}"
                raise RuntimeError(
                    f"teraio: global tensor {self.tensors[tid]['name']} (trace tensor {tid}) was moved "
                    f"outside the plan: the executor holds {size} bytes at {addr:#x}, its storage now has "
                    f"{got}. Code between steps must not resize or replace parameters, gradients or "
                    "optimizer states under a Session (write into them in place); this plan's executor is "
                    "dropped without touching that memory")

    # ---- unwatched stretches ---------------------------------------------------------

    def watch(self, mode: TorchDispatchMode) -> list[Any]:
        """Called by the step's dispatch mode at the iteration's first operator: module hooks
        (two global ones) that check each hook against the profile's and let the step run
        stretches of operators without ``mode``. Returns the hooks' handles (the caller removes
        them at the step's end, after :meth:`unwatch_end`).

        A stretch starts at a module hook when the plan has nothing to do for a while: the
        executor said the next operators are quiet (:meth:`op`), nothing the plan moves is away
        from the GPU (``nothing_away``: every tensor the trainer can reach has its memory, so
        even an operator that is not the profiled one reads real bytes), the hook runs outside
        backward (the autograd engine restores the modes at every node) and ``mode`` is the
        innermost one. It ends at the last forward module hook at or before the first operator
        that is not quiet, where ``mode`` is entered again with the operator count the profile
        had there; the executor accounts the skipped operators at its next call. When every
        operator left is quiet (a plan that moves nothing), the rest of the step, backward and
        optimizer included, runs unwatched. A hook other than the profiled one is a divergence
        (the mode re-entered, the executor told); the operators of a stretch are not checked
        one by one. Under FSDP2 on a GPU every operator is watched (``run_op`` orders the ones
        FSDP runs on its own streams against the trainer's)."""
        if self._nothing_away is None or not self._skips or not self._mark_at \
                or _storages._TRAINER_STREAM is not None:
            return []
        # the hooks before the first operator fired before these were installed
        self._t = bisect.bisect_right(self._mark_at, 0)
        landmark = self.landmark
        return [torch.nn.modules.module.register_module_forward_pre_hook(lambda m, _i: landmark(0, m, mode)),
                torch.nn.modules.module.register_module_forward_hook(lambda m, _i, _o: landmark(1, m, mode))]

    def landmark(self, kind: int, module: torch.nn.Module, mode: TorchDispatchMode) -> None:
        """A module hook fired (``kind`` 0: before its forward, 1: after it)."""
        t = self._t
        self._t = t + 1
        if self.diverged is not None:
            return
        keys = self._mark_key
        main = torch._C._current_graph_task_id() == -1  # (not inside backward)
        if t >= len(keys) or keys[t] != (kind, id(module)) or (t == self._wake_at and not main):
            want = f"{'before' if keys[t][0] == 0 else 'after'} module {keys[t][1]:#x}" if t < len(keys) \
                else "none"
            # (the mode is entered again on the thread that left it, never inside backward:
            # then the step's end finds it left)
            k = self._rewatch(mode, None) if main else mode.k
            self._diverge(k, Diverged(k, f"module hook {t} is {'before' if kind == 0 else 'after'} "
                                         f"{type(module).__name__} {id(module):#x} where the profile has {want}"))
            return
        at = self._mark_at[t]
        if self._away is not None:
            if t == self._wake_at:
                self._rewatch(mode, at)
            return
        if mode.k != at:
            self._diverge(mode.k, Diverged(mode.k, f"module hook {t} ({type(module).__name__}) after {mode.k} "
                                                   f"operators where the profile had {at}"))
            return
        q = self._quiet_until
        if q < at:
            return
        n = len(self.signatures)
        if q + 1 >= n:
            wake, span = None, n - at
        else:
            j = bisect.bisect_right(self._mark_at, q + 1) - 1
            while j > t and self._mark_bwd[j]:
                j -= 1
            if j <= t:
                return
            wake, span = j, self._mark_at[j] - at
        if span < UNWATCHED_MIN_OPS or not main or _get_current_dispatch_mode() is not mode \
                or not self._nothing_away():
            return
        mode.__exit__(None, None, None)
        self._away, self._wake_at, self._away_from = mode, wake, at

    def _rewatch(self, mode: TorchDispatchMode, at: int | None) -> int:
        """End an unwatched stretch (if one runs) at operator ``at`` (None: where it started);
        the operator count now."""
        if self._away is None:
            return mode.k
        self._away = None
        mode.__enter__()
        if at is not None:
            self.unwatched_ops += at - self._away_from
            mode.k = at
        return mode.k

    def unwatch_end(self, mode: TorchDispatchMode) -> bool:
        """The step's end: whether ``mode`` is still entered (the caller leaves it then). An
        unwatched stretch that was to end at a hook that never fired is a divergence; one that
        ran to the step's end counts the profile's operators."""
        if self._away is None:
            return True
        self._away = None
        if self._wake_at is None:
            n = len(self.signatures)
            self.unwatched_ops += n - self._away_from
            mode.k = n
        elif self.diverged is None:
            self._diverge(mode.k, Diverged(mode.k, f"the step ended before module hook {self._wake_at} of the "
                                                   "profile (unwatched since operator "
                                                   f"{self._away_from})"))
        return False

    def mode(self) -> "_PlannedMode":
        """A dispatch mode that runs one iteration under the plan."""
        self.begin_iteration()
        return _PlannedMode(self)

    def _hold_back(self, k: int) -> None:
        """Wait until the GPU finished the operator ``max_ahead`` before ``k``; mark ``k``."""
        n = self.max_ahead
        if n <= 0:
            return
        if len(self._marks) < n:
            self._marks = [torch.cuda.Event() for _ in range(n)]
        ev = self._marks[k % n]
        if k >= n:
            t0 = time.perf_counter()
            ev.synchronize()
            self.ahead_wait_s += time.perf_counter() - t0
        ev.record(self._stream)

    def op(self, k: int, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run operator ``k`` under the plan: checked against the profile; the executor called
        before and after it unless it is quiet (the executor said so after an earlier one)."""
        if k <= self._quiet_until:
            try:
                self._check(k, func, args, kwargs)
            except Exception as e:
                self._diverge(k, e)
                return self._invoke(func, args, kwargs)
            try:
                return run_op(func, args, kwargs)
            except torch.OutOfMemoryError:
                pass  # the executor makes room: the operator runs again the planned way
        self.before(k, func, args, kwargs)
        out = self.call(k, func, args, kwargs)
        self.after(k, args, kwargs, out, func)
        return out

    def _check(self, k: int, func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """Operator ``k``'s tensor arguments, once it is checked to be the profile's (the same
        operator, shapes and dtypes); else :class:`Diverged`."""
        if k >= len(self.signatures):
            raise Diverged(k, f"more operators than the {len(self.signatures)} profiled")
        flat = flat_args(args, kwargs)
        # the signature compared in place (no tuple built per operator: this runs for every
        # operator, and in bf16 the host's time per operator is the step's limit); the operator
        # by identity once its name matched
        name, shapes = self.signatures[k]
        same = len(flat) == len(shapes) and (self._funcs[k] is func or op_name(func) == name)
        if same:
            for t, (shape, dtype) in zip(flat, shapes):
                if t.dtype != dtype or t.shape != shape:
                    same = False
                    break
        if not same:
            sig = signature(func, args, kwargs, flat)
            if self.bounded and covers(self.signatures[k], sig):
                self._funcs[k] = func
                return flat
            if sig[0] != name or len(sig[1]) != len(shapes):
                raise Diverged(k, f"{sig[0]} with {len(sig[1])} tensors where the profile has "
                                  f"{name} with {len(shapes)}")
            i, (got, want) = next((i, x) for i, x in enumerate(zip(sig[1], shapes)) if x[0] != x[1])
            raise Diverged(k, f"{name}: tensor argument {i} has shape {list(got[0])} {got[1]} where "
                              f"the profile has {list(want[0])} {want[1]}")
        self._funcs[k] = func
        return flat

    def before(self, k: int, func: Any, args: tuple, kwargs: dict) -> None:
        if self.diverged is not None:
            return
        try:
            if self.max_ahead > 0:
                self._hold_back(k)
            self._flat = self._check(k, func, args, kwargs)
            self._k = k
            # the operator checked above: issue boundary k and wait until it can run
            dt = self._before_kernel(k)
            if dt:
                self.stall_s += dt
                if dt > 1e-4:
                    self.stalls[k] = self.stalls.get(k, 0.0) + dt
            if self.time_gpu:
                self._mark(self._starts, k)
        except Exception as e:  # a divergence: the executor's own or ours
            self._diverge(k, e)

    def call(self, k: int, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run operator ``k``. When the caching allocator runs out of memory although the plan
        keeps its tensors within the budget (its blocks rounded and scattered, memory the trace
        does not see), the executor makes room (``make_room``: tensors the operator does not use
        leave and come back before their next use) and the operator runs again: up to three
        times, asking for twice as much each time; then the error is raised. (PyTorch's
        operators allocate their results before they write them; the pager retries the same
        way.) A bounded run's profiler records the operator once, around all the tries."""
        if self._record is not None:
            return self._record(func, args, kwargs, lambda: self._retrying(k, func, args, kwargs))
        return self._retrying(k, func, args, kwargs)

    def _retrying(self, k: int, func: Any, args: tuple, kwargs: dict) -> Any:
        tries = 0
        while True:
            try:
                return self._invoke(func, args, kwargs)
            except torch.OutOfMemoryError:
                make_room = getattr(self.ex, "make_room", None)
                if self.diverged is not None or make_room is None or tries >= 3:
                    raise
                want = max(self._largest, (self.budget or 0) // 16, 1) << tries
                tries += 1
                freed = make_room(k, want)
                if not freed:
                    raise
                self.made_room_bytes += freed
                self.oom_retries += 1

    @staticmethod
    def _invoke(func: Any, args: tuple, kwargs: dict) -> Any:
        return run_op(func, args, kwargs)

    def _mark(self, events: list[Any], k: int) -> None:
        while len(events) <= k:
            events.append(torch.cuda.Event(enable_timing=True))
        events[k].record(self._stream)
        self._timed = max(self._timed, k + 1)

    def _remade_mark(self) -> tuple[Any, Any]:
        """A pair of events for the next recomputation (before the operator about to run), the
        first recorded now."""
        if len(self._remade) <= self._remade_n:
            self._remade.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), 0))
        a, b, _ = self._remade[self._remade_n]
        self._remade[self._remade_n] = (a, b, self._k)
        self._remade_n += 1
        a.record(self._stream)
        return a, b

    def gpu_gaps(self) -> dict[str, Any] | None:
        """Where the GPU waited this step (``time_gpu``): the time between one operator's end
        and the next one's start on the trainer's stream (a prefetch or memory not there yet,
        a recomputation before it, the host's own pace), in total and the longest five."""
        n = self._timed
        if not self.time_gpu or n < 2 or self.diverged is not None:
            return None
        torch.cuda.synchronize(self.device)
        gaps = [(k, self._ends[k - 1].elapsed_time(self._starts[k]) / 1e3) for k in range(1, n)]
        busy = sum(self._starts[k].elapsed_time(self._ends[k]) for k in range(n)) / 1e3
        span = self._starts[0].elapsed_time(self._ends[n - 1]) / 1e3
        top = sorted(gaps, key=lambda g: -g[1])[:5]
        # of the gaps, the GPU time the recomputations took (they run between two operators);
        # the rest of a gap the GPU had nothing to run (idle)
        remade: dict[int, float] = {}
        for a, b, k in self._remade[:self._remade_n]:
            remade[k] = remade.get(k, 0.0) + a.elapsed_time(b) / 1e3
        idle = sorted(((k, max(0.0, g - remade.get(k, 0.0))) for k, g in gaps), key=lambda g: -g[1])
        return {"gpu_span_s": span, "gpu_busy_s": busy, "gpu_gap_s": sum(g for _, g in gaps),
                "gpu_recompute_s": sum(remade.values()), "gpu_idle_s": sum(g for _, g in idle),
                "top_idle": [(k, self.trace["kernels"][k]["name"], round(g, 6)) for k, g in idle[:5]],
                "top_gaps": [(k, self.trace["kernels"][k]["name"], round(g, 6)) for k, g in top]}

    def after(self, k: int, args: tuple, kwargs: dict, out: Any, func: Any = None) -> None:
        if self.diverged is not None:
            return
        if self.time_gpu:
            self._mark(self._ends, k)
        try:
            created = []
            want = self._want[k]
            if want:
                flat = self._flat
                n_in = len(flat)
                outs = out if isinstance(out, Results) else iter_tensors(out)
                tid_of, refs = self.tid_of, self.refs
                for tid, at in want:
                    # the storage where the profile found this one new
                    if at >= n_in + len(outs):
                        raise Diverged(k, f"{len(outs)} results where the profile made tensor {tid} "
                                          f"from result {at - n_in}")
                    x = flat[at] if at < n_in else outs[at - n_in]
                    s = storage_of(x) if x.device == self.device else None
                    if s is None or s.nbytes() == 0:
                        raise Diverged(k, f"no storage on {self.device} where the profile made tensor {tid}")
                    old = tid_of.get(s._cdata)
                    # (a key of a storage that died since, its address reused, is not this one)
                    if old is not None and refs[old]() is s:
                        raise Diverged(k, f"tensor {old}'s storage where the profile made a new one "
                                          f"(tensor {tid})")
                    self._bind(tid, s)
                    if tid in self._remakes and func is not None:
                        # a remade tensor is one of its operator's results (the profiler gives
                        # producers to those only): the result where the profile found it
                        which = at - n_in
                        meta = (tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, len(outs))
                        self._producers[tid] = (func, args, kwargs, which, meta)
                        self._left[tid] = self._remakes[tid]
                    created.append((tid, s.data_ptr(), s.nbytes(), s))
            # attached, and the deaths after k, in one call; memory the executor gives back
            # meanwhile (a death, or a created tensor refused in a divergence) is kept: the
            # storage stays as it is
            self._releasing_deaths = True
            try:
                until = self._leave(k, created, self._device_mem)
            finally:
                self._releasing_deaths = False
            if self._skips and until is not None:
                self._quiet_until = until
        except Exception as e:
            self._diverge(k, e)

    def _diverge(self, k: int, e: Exception) -> None:
        d = e if isinstance(e, Diverged) else Diverged(k, str(e))
        self.diverged = d
        self._quiet_until = -1
        # the executor enters safe mode: nothing more offloaded, everything offloaded read back
        try:
            self.ex.leave_plan(k, d.detail)
        except Exception as err:  # (a closed engine, an executor already in trouble: say so)
            d.detail += f"; telling the executor failed too: {err}"
        try:
            self.ex.before_kernel(k)
        except Exception:
            pass

    def end_iteration(self) -> Any:
        try:
            # (no memory timeline: thousands of points a step, each a Python list kept as long
            # as the report is, for the garbage collector to walk)
            rep = self.ex.end_iteration(timeline=False) if self._native_ex else self.ex.end_iteration()
        except Exception as e:
            if self.diverged is None:
                self.diverged = Diverged(-1, str(e))
            rep = None
        keep_last(self.reports, rep)
        self._verify = False  # (the first step checks its recomputations; see __init__)
        self._saved.clear()
        if self.gather:
            self.gather_globals(self.budget if self.gather == "budget" else None)
        return rep

    def top_stalls(self, n: int = 5) -> list[tuple[int, str, float]]:
        """The kernels this step waited longest before: (kernel, name, seconds)."""
        top = sorted(self.stalls.items(), key=lambda kv: -kv[1])[:n]
        return [(k, self.trace["kernels"][k]["name"], round(s, 6)) for k, s in top]

    def gather_globals(self, limit: int | None = None) -> Any:
        """Every global tensor resident with its bytes until the next step (the executor's
        ``gather_globals``; with ``limit``, as many as fit those bytes, the others stay stored);
        the tensors' version counters noted, so writes by the caller's code between steps reach
        the executor at the next step."""
        gather = getattr(self.ex, "gather_globals", None)
        if gather is None:
            return None
        g = gather(limit) if limit is not None else gather()
        self.left_off = g.get("left_off", 0) if isinstance(g, dict) else 0
        keep_last(self.gathers, g)
        self._versions = {tid: (t, _version(t)) for tid, t in self._moved_globals}
        return g

    def finish(self) -> None:
        """Every global tensor back (gathered), then the executor lets go of them. When a global
        tensor cannot be read back the error is raised and the executor is left as it is: its
        copies are not freed."""
        if self.poisoned:
            return  # the memory it holds is not the tensors' any more: leave it untouched
        if not self._versions or self.left_off:
            self.gather_globals()
        self._releasing_deaths = True  # memory handed back at the end is resident, keep it
        try:
            self.ex.finish()
        finally:
            self._releasing_deaths = False


class _PlannedMode(TorchDispatchMode):
    def __init__(self, run: PlannedRun) -> None:
        super().__init__()
        self.run = run
        self.k = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        k = self.k
        self.k += 1
        return self.run.op(k, func, args, kwargs or {})
