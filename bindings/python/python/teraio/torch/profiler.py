"""Record a real PyTorch training iteration as a teraio trace (``teraio-trace`` version 1).

A :class:`torch.utils._python_dispatch.TorchDispatchMode` sees every aten operator of the
iteration, forward, backward (the autograd engine's threads inherit the mode) and the optimizer
step alike. Each operator is one *kernel* of the trace; each storage lifetime one *tensor*
(see :mod:`teraio.torch._storages`):

- every tensor argument and result of an operator is an *access* of its storage;
- a result whose storage did not exist before the operator *creates* a tensor (and writes it);
- the arguments the operator's schema marks ``(a!)`` (in-place and ``out=`` operators) are
  *writes*;
- a storage's death (its last reference dropped) sets ``dies_after`` to the operator that
  ran last;
- storages alive both when the iteration starts and when it ends are *global* (parameters,
  gradients kept across steps, optimizer states, buffers); those the iteration creates and
  frees are not.

Kinds: a parameter's storage is ``weight``, ``param.grad`` ``gradient``, the optimizer's state
``optimizer_state``, short-lived results of one operator's neighbour ``workspace``, everything
else ``activation``. Durations: on CUDA an event right before and one right after each
operator's launch, so a kernel's duration is its GPU time (not the profiler's own Python time
between operators, nor paging stalls); on the CPU the operator's wall time.

Use::

    prof = Profiler(model, optimizer)
    for step in range(3):
        with prof.record() if step == 2 else contextlib.nullcontext():
            loss = model(x); loss.backward(); opt.step(); opt.zero_grad()
    trace = prof.trace()          # a dict in the documented JSON schema
    prof.save("step.trace.json")
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._storages import (foreign, iter_tensors, op_name, remakeable, run_op, signature, storage_key, storage_of,
                        written_tensors)
from .fsdp import named_parameters

TRACE_FORMAT = "teraio-trace"
TRACE_VERSION = 1
# the spin kernel a ``gpu_time`` profile queues where the GPU caught up with the host (about
# twice the host's time per operator while recording, so the queue stays ahead for a while),
# and the short one before every other operator: the GPU may finish what is queued between the
# check and the operator's launch (tens of microseconds of host time under the profiler)
SLEEP_US = 200
SPIN_US = 40


@dataclass
class _Storage:
    """One storage lifetime seen during the recorded iteration."""

    key: int
    bytes: int
    preexisting: bool  # first seen as an argument, not created by a recorded operator
    accesses: list[int] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)
    created_by: int | None = None
    dies_after: int | None = None  # None: still alive at the end
    name: str = ""
    kind: str | None = None
    phase: str = "fwd"

    def touch(self, op: int, write: bool) -> None:
        if not self.accesses or self.accesses[-1] != op:
            self.accesses.append(op)
        if write and (not self.writes or self.writes[-1] != op):
            self.writes.append(op)


@dataclass
class OpRecord:
    """One recorded operator."""

    name: str  # phase-qualified, e.g. ``bwd.mm``
    signature: tuple  # see :func:`teraio.torch._storages.signature`
    layer: int | None
    created: list[int]  # trace-order indices of the storages first seen at this op
    # the storages it read, when running it again makes its results again (``remakeable``)
    remake_inputs: list[Any] | None = None  # their ``_Storage`` records
    # where each of ``created`` was found: its index among the operator's tensor arguments
    # (``flat_args`` order: first seen there, made outside the recorded operators, such as the
    # input batch), or the number of those plus its index among the results
    created_at: list[int] = field(default_factory=list)


class _Mode(TorchDispatchMode):
    def __init__(self, rec: "Profiler") -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.rec.dispatch(func, args, kwargs or {})


class Profiler:
    """Records one training iteration (the code inside :meth:`record`) as a teraio trace.

    ``model`` and ``optimizer`` are optional; with them the trace names parameters, gradients
    and optimizer states and marks their kinds, and kernels get the transformer layer they run
    in (the index of the innermost ``ModuleList`` entry on the module path, forward only).
    ``device``: the memory to trace (default: the model's parameters' device, else CPU);
    storages elsewhere (CPU scalars of a CUDA model) are left out.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        device: torch.device | str | None = None,
        name: str = "torch",
        pager: Any = None,
        producers: bool = True,
        gpu_time: bool = False,
    ) -> None:
        self.model = model
        # on a GPU, ``gpu_time``: each operator's duration is its kernels' own time. Without it,
        # an operator launched while the GPU waits for the host (the profiler's bookkeeping
        # between operators keeps it waiting) also counts its launch (the host's time from the
        # event before it to its kernels), which makes durations of short kernels several times
        # their GPU time. With it, where the GPU has caught up with the host (the last
        # operator's end event done), a spin kernel of SLEEP_US is queued first, elsewhere one
        # of SPIN_US, so the operator's start event and kernels wait in the queue behind it and
        # the events measure the kernels alone. The spins cost no wall time where the host sets
        # the pace anyway (a profiled step's bookkeeping does). ``sleeps``: the long spins
        # queued in the last recorded iteration.
        self.gpu_time = gpu_time
        self._sleep_cycles = self._spin_cycles = 0
        self.producers = producers
        # operators whose recomputation did not reproduce their bytes on this device (a
        # session's check, ``PlannedRun.unstable``): their results get no producer
        self.unstable_ops: set[str] = set()
        self.optimizer = optimizer
        if device is None:
            p = next(model.parameters(), None) if model is not None else None
            device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.name = name
        self.pager = pager
        # called after each recorded operator (a Session under FSDP2 samples the memory of
        # FSDP's unsharded parameters there: teraio.torch.fsdp)
        self.after_op: Callable[[], None] | None = None
        # module id -> transformer layer, read from the model once
        self._layer_of: dict[int, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self.ops: list[OpRecord] = []
        self._storages: list[_Storage] = []
        self._live: dict[int, _Storage] = {}
        self._finalizers: list[weakref.finalize] = []
        self._events: list[Any] = []
        self._ends: list[Any] = []
        self._times: list[float] = []
        self._phase = "fwd"
        self._layer: list[int | None] = [None]
        self._lock = threading.Lock()
        self._trace: dict | None = None
        self._hooks: list[Any] = []
        self._t0 = 0.0
        # every module hook that fired, in order: (operators recorded before it, 0 before the
        # module's forward / 1 after it, the module's id, whether it fired inside backward);
        # a planned step finds its place by them when it stops watching operators for a while
        self.marks: list[tuple[int, int, int, bool]] = []
        self.created_ids: list[list[int]] = []
        # per op: where each of ``created_ids`` was found (see ``OpRecord.created_at``)
        self.created_positions: list[list[int]] = []
        self.wall_s = 0.0
        self.gpu_span_s = 0.0
        self.sleeps = 0

    # ---- recording -------------------------------------------------------------------

    @contextlib.contextmanager
    def record(self) -> Iterator["Profiler"]:
        """Record the iteration run inside the ``with`` block (replaces any earlier one)."""
        self.begin()
        try:
            with _Mode(self):
                yield self
        finally:
            self.end()

    def begin(self, seed_pager: bool = True) -> None:
        """Start recording an iteration; operators then go through :meth:`dispatch` (what
        :meth:`record`'s dispatch mode does; a caller with its own mode calls it). With
        ``seed_pager=False`` the caller calls :meth:`seed_pager` before the first operator if
        the iteration is recorded after all (a caller that may :meth:`abort` at its first
        operator does not pay for it)."""
        self._reset()
        self._hooks = self._install_hooks()
        if self.device.type == "cuda":
            if self.gpu_time and not self._sleep_cycles:
                self._sleep_cycles, self._spin_cycles = self._calibrate_sleep()
            torch.cuda.synchronize(self.device)
        self._t0 = time.perf_counter()
        if seed_pager:
            self.seed_pager()

    def _calibrate_sleep(self) -> tuple[int, int]:
        """Clock cycles of ``torch.cuda._sleep`` that spin about SLEEP_US and SPIN_US on this GPU."""
        cycles = 1 << 20
        with torch.cuda.device(self.device):
            torch.cuda._sleep(cycles)  # (a first launch: the clock up, the kernel loaded)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(cycles)
            b.record()
            b.synchronize()
            us = a.elapsed_time(b) * 1000.0
        per_us = cycles / max(us, 1e-3)
        return max(1, int(per_us * SLEEP_US)), max(1, int(per_us * SPIN_US))

    def _start(self, ev: Any) -> None:
        """Record an operator's start event ``ev``; with ``gpu_time``, behind a spin kernel (a
        long one where the GPU has caught up with the host), so the event and the operator's
        kernels queue behind it."""
        if self.gpu_time:
            ends = self._ends
            if not ends or ends[-1].query():
                torch.cuda._sleep(self._sleep_cycles)
                self.sleeps += 1
            else:
                torch.cuda._sleep(self._spin_cycles)
        ev.record()

    def seed_pager(self) -> None:
        """The pager learns the global tensors' storages (before the first operator)."""
        if self.pager is not None:
            for s in self._global_storages():
                self.pager.seen(s, -1)

    def end(self) -> None:
        """Stop recording and build the trace."""
        try:
            if self.device.type == "cuda":
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._events.append(end)
                torch.cuda.synchronize(self.device)
            self.wall_s = time.perf_counter() - self._t0
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
        self._finish()

    def abort(self) -> None:
        """Stop recording without building a trace (the iteration runs otherwise)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for f in self._finalizers:
            f.detach()
        self._reset()

    def dispatch(self, func: Any, args: tuple, kwargs: dict, run: Callable[[], Any] | None = None) -> Any:
        """Run and record one operator (``run``: what runs it, instead of ``func`` itself; a
        planned run that retries an operator after making room)."""
        return self._dispatch(func, args, kwargs, run)

    def _global_storages(self, stored_too: bool = False) -> list[torch.UntypedStorage]:
        """Parameters, gradients, buffers and optimizer states on the traced device
        (``stored_too``: also those whose bytes are elsewhere now, of size 0)."""
        ts: list[torch.Tensor] = []
        if self.model is not None:
            for _, p in named_parameters(self.model):
                ts.append(p)
                if p.grad is not None:
                    ts.append(p.grad)
            ts.extend(self.model.buffers())
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                ts.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        out = []
        for t in ts:
            s = storage_of(t) if t.device == self.device else None
            if s is not None and (stored_too or s.nbytes() > 0):
                out.append(s)
        return out

    def _install_hooks(self) -> list[Any]:
        hooks: list[Any] = []
        if self.optimizer is not None:

            def pre(*_a: Any, **_k: Any) -> None:
                self._phase = "opt"
                self._name_grads()

            def post(*_a: Any, **_k: Any) -> None:
                self._phase = "fwd"

            hooks.append(self.optimizer.register_step_pre_hook(pre))
            hooks.append(self.optimizer.register_step_post_hook(post))
        if self.model is not None:
            # the model's ModuleLists, read once (a session installs these hooks every step and
            # removes them at the first operator of a planned one)
            if self._layer_of is None:
                self._layer_of = _layer_indices(self.model)
            layer_of = self._layer_of
            stack = self._layer
            marks, ops = self.marks, self.ops
            in_backward = torch._C._current_graph_task_id

            def fpre(mod: torch.nn.Module, _inp: Any) -> None:
                li = layer_of.get(id(mod))
                stack.append(li if li is not None else stack[-1])
                marks.append((len(ops), 0, id(mod), in_backward() != -1))

            def fpost(mod: torch.nn.Module, _inp: Any, _out: Any) -> None:
                if len(stack) > 1:
                    stack.pop()
                marks.append((len(ops), 1, id(mod), in_backward() != -1))

            # global module hooks: two registrations, not two per module (a module outside the
            # model pushes the current layer again and pops it)
            hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(fpre))
            hooks.append(torch.nn.modules.module.register_module_forward_hook(fpost))
        return hooks

    def _storage(self, t: torch.Tensor, op: int, created: list[int], new_ok: bool) -> _Storage | None:
        if t.device != self.device:
            return None
        s = storage_of(t)
        if s is None:
            return None
        nbytes = s.nbytes()
        key = storage_key(s)
        st = self._live.get(key)
        if st is None:
            if nbytes == 0:
                return None
            st = _Storage(key=key, bytes=nbytes, preexisting=not new_ok, phase=self._phase)
            if new_ok:
                st.created_by = op
            idx = len(self._storages)
            self._storages.append(st)
            self._live[key] = st
            created.append(idx)
            self._finalizers.append(weakref.finalize(s, self._died, key, st))
        elif nbytes > st.bytes:
            st.bytes = nbytes
        return st

    def _died(self, key: int, st: _Storage) -> None:
        with self._lock:
            if self._live.get(key) is st:
                del self._live[key]
            if st.dies_after is None:
                st.dies_after = max(len(self.ops) - 1, st.accesses[-1] if st.accesses else 0)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict, run: Callable[[], Any] | None = None) -> Any:
        op = len(self.ops)
        phase = self._phase
        if phase == "fwd" and torch._C._current_graph_task_id() != -1:
            phase = "bwd"
        created: list[int] = []
        in_tensors = list(iter_tensors((args, kwargs)))
        pager = self.pager
        if pager is not None:
            # resident first: a storage paged out (0 bytes) when first seen would go unrecorded
            stor = [s for s in (storage_of(t) for t in in_tensors if t.device == self.device) if s is not None]
            pager.before(stor, op, op_name(func))
        created_at: list[int] = []
        ins = []
        for i, t in enumerate(in_tensors):
            ins.append(self._storage(t, op, created, False))
            if len(created) > len(created_at):
                created_at.append(i)
        written = {id(t) for t in written_tensors(func, args, kwargs)}
        cuda = self.device.type == "cuda"
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            self._start(ev)
            self._events.append(ev)
            # an operator the pager runs again after paging out: its clock restarts there
            out = pager.run_op(func, args, kwargs, stor, op, again=lambda: self._start(ev)) if pager is not None \
                else run() if run is not None else run_op(func, args, kwargs)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._ends.append(end)
        else:
            t0 = [time.perf_counter()]

            def again() -> None:
                t0[0] = time.perf_counter()

            out = pager.run_op(func, args, kwargs, stor, op, again=again) if pager is not None \
                else run() if run is not None else run_op(func, args, kwargs)
            self._times.append((time.perf_counter() - t0[0]) * 1e6)
        for t, st in zip(in_tensors, ins):
            if st is not None:
                st.touch(op, id(t) in written)
        for j, t in enumerate(iter_tensors(out)):
            st = self._storage(t, op, created, True)
            if len(created) > len(created_at):
                created_at.append(len(in_tensors) + j)
            if st is not None:
                st.touch(op, st.created_by == op or id(t) in written)
        for idx in created:
            self._storages[idx].phase = phase
        remake = None
        if self.producers and created and phase == "fwd" and remakeable(func, args, kwargs) \
                and op_name(func) not in self.unstable_ops and not any(foreign(t) for t in in_tensors):
            # (not an operator that reads FSDP's unsharded parameters: FSDP may have freed them
            # by the time a recomputation would run)
            remake = [st for st in ins if st is not None]
        if pager is not None:
            outs = [s for s in (storage_of(t) for t in iter_tensors(out) if t.device == self.device) if s is not None]
            for s in stor + outs:
                pager.seen(s, op)
            pager.after(stor + outs, op, name=f"{phase}.{op_name(func)}")
        self.ops.append(
            OpRecord(
                name=f"{phase}.{op_name(func)}",
                signature=signature(func, args, kwargs),
                layer=self._layer[-1] if phase == "fwd" else None,
                created=created,
                remake_inputs=remake,
                created_at=created_at,
            )
        )
        if self.after_op is not None:
            self.after_op()
        return out

    # ---- naming ------------------------------------------------------------------------

    def _name_grads(self) -> None:
        """Called when the optimizer step starts: the gradients are the ``.grad``s now."""
        if self.model is None:
            return
        for n, p in named_parameters(self.model):
            if p.grad is not None:
                self._label(p.grad, f"grad:{n}", "gradient")

    def _label(self, t: torch.Tensor, name: str, kind: str) -> None:
        s = storage_of(t)
        if s is None or t.device != self.device:
            return
        st = self._live.get(storage_key(s))
        if st is not None and not st.name:
            st.name = name
            st.kind = kind

    def _label_globals(self) -> None:
        if self.model is not None:
            for n, p in named_parameters(self.model):
                self._label(p, f"param:{n}", "weight")
            for n, b in self.model.named_buffers():
                self._label(b, f"buffer:{n}", "weight")
            self._name_grads()
        if self.optimizer is not None:
            names = {}
            if self.model is not None:
                names = {id(p): n for n, p in named_parameters(self.model)}
            for p, state in self.optimizer.state.items():
                pn = names.get(id(p), f"p{id(p):x}")
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        self._label(v, f"state:{pn}.{k}", "optimizer_state")

    # ---- building the trace ------------------------------------------------------------

    def _finish(self) -> None:
        self._label_globals()
        n = len(self.ops)
        if self.device.type == "cuda":
            # GPU time from an event recorded right before the operator's launch to one right
            # after it: the operator's kernels (and their launch, when the GPU was waiting),
            # not the profiler's own bookkeeping between operators nor any paging stall
            ev, ends = self._events, self._ends
            durations = [ev[i].elapsed_time(ends[i]) * 1000.0 for i in range(n)]
            self.gpu_span_s = ev[0].elapsed_time(ev[n]) / 1000.0 if n else 0.0
        else:
            durations = list(self._times)
        kernels = []
        for i, r in enumerate(self.ops):
            k: dict[str, Any] = {"name": r.name, "duration_us": max(0.0, durations[i])}
            if r.layer is not None:
                k["layer"] = r.layer
            kernels.append(k)
        tensors = []
        self.tensor_of_storage: dict[int, int] = {}
        for idx, st in enumerate(self._storages):
            if not st.accesses:
                continue
            alive_at_end = st.dies_after is None
            # global: alive across the iteration and known by name (parameters, gradients,
            # buffers, optimizer states), so the session can find it before the iteration starts;
            # other storages alive across (a cached input batch) are traced as created at their
            # first use and dying at the end
            is_global = st.preexisting and alive_at_end and bool(st.name)
            kind = st.kind
            if kind is None:
                if st.phase == "opt":
                    kind = "optimizer_state" if is_global else "workspace"
                elif not is_global and st.created_by is not None and st.dies_after is not None \
                        and st.dies_after - st.created_by <= 1:
                    kind = "workspace"
                else:
                    kind = "activation"
            tid = len(tensors)
            self.tensor_of_storage[idx] = tid
            name = st.name or f"{self.ops[st.accesses[0]].name}#{st.accesses[0]}.{idx}"
            if is_global:
                tensors.append({
                    "id": tid, "name": name, "bytes": st.bytes, "kind": kind, "global": True,
                    "created_by": None, "accesses": st.accesses, "dies_after": None,
                    "writes": st.writes,
                })
            else:
                created = st.accesses[0]
                writes = st.writes if st.writes and st.writes[0] == created else [created] + st.writes
                dies = st.dies_after if st.dies_after is not None else n - 1
                dies = max(dies, st.accesses[-1])
                tensors.append({
                    "id": tid, "name": name, "bytes": st.bytes, "kind": kind, "global": False,
                    "created_by": created, "accesses": st.accesses, "dies_after": dies,
                    "writes": writes,
                })
        self.created_ids = [
            [self.tensor_of_storage[i] for i in r.created if i in self.tensor_of_storage] for r in self.ops
        ]
        self.created_positions = [
            [p for i, p in zip(r.created, r.created_at) if i in self.tensor_of_storage] for r in self.ops
        ]
        if self.producers:
            self._add_producers(tensors)
        self._trace = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "name": self.name,
            "kernels": kernels,
            "tensors": tensors,
        }
        for f in self._finalizers:
            f.detach()
        self._finalizers = []
        self._live = {}

    def _add_producers(self, tensors: list[dict]) -> None:
        """How to make an activation again (the trace's ``producer``): its creating operator, run
        again on the tensors it read, when that operator is ``remakeable``. The executor may then
        drop the activation and recompute it instead of moving it (the planner decides)."""
        tid_of = {id(st): self.tensor_of_storage[i] for i, st in enumerate(self._storages)
                  if i in self.tensor_of_storage}
        for idx, tid in self.tensor_of_storage.items():
            t = tensors[tid]
            if t["global"] or t["kind"] != "activation" or t["writes"] != [t["created_by"]]:
                continue
            r = self.ops[t["created_by"]]
            # an operator's result (not an input first seen there, such as a batch), unless
            # the operator's recomputation was found not to reproduce its bytes meanwhile
            if r.remake_inputs is None or self._storages[idx].created_by != t["created_by"] \
                    or r.name.split(".", 1)[1] in self.unstable_ops:
                continue
            inputs: list[int] = []
            for st in r.remake_inputs:
                x = tid_of.get(id(st))
                if x is not None and x != tid and x not in inputs:
                    inputs.append(x)
            t["producer"] = {"inputs": inputs}

    def trace(self) -> dict:
        """The recorded iteration as a trace dict (``teraio-trace`` version 1)."""
        if self._trace is None:
            raise RuntimeError("nothing recorded yet: run one iteration inside Profiler.record()")
        return self._trace

    def save(self, path: str) -> None:
        """Write the trace as JSON."""
        with open(path, "w") as f:
            json.dump(self.trace(), f)

    def op_signatures(self) -> list[tuple]:
        """What each recorded operator was (for divergence checks)."""
        return [r.signature for r in self.ops]


def _layer_indices(model: torch.nn.Module) -> dict[int, int]:
    """Module id -> layer index for the entries of the model's ``ModuleList``s (the
    innermost list wins, as modules nest)."""
    out: dict[int, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList):
            for i, child in enumerate(m):
                out[id(child)] = i
    return out


def peak_bytes(trace: dict) -> int:
    """Peak of the all-resident memory curve of a trace dict (the same rule as the Rust
    ``Trace::resident_memory_per_kernel``)."""
    curve = memory_curve(trace)
    return max(curve) if curve else 0


def memory_curve(trace: dict) -> list[int]:
    """Bytes in use while each kernel runs if every tensor stays resident."""
    n = len(trace["kernels"])
    diff = [0] * (n + 1)
    for t in trace["tensors"]:
        a = t["created_by"] if t["created_by"] is not None else 0
        d = t["dies_after"] if t["dies_after"] is not None else n - 1
        diff[a] += t["bytes"]
        diff[d + 1] -= t["bytes"]
    out, acc = [], 0
    for x in diff[:n]:
        acc += x
        out.append(acc)
    return out

