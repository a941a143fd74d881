"""Run training iterations with teraio: profile, plan, execute the plan; page when there is none.

How bytes leave and come back without PyTorch noticing: a tensor of the trace is a *storage*
(see :mod:`teraio.torch._storages`). Offloading it copies the storage's bytes to the engine
and then shrinks the storage to 0 bytes (``UntypedStorage.resize_(0)``): the memory goes back
to PyTorch's allocator at once, while every tensor and view over that storage (the autograd
graph's saved tensors, ``param.data``, the optimizer's references) stays the same Python and C++
object. Bringing it back grows the storage again (``resize_(nbytes)``, fresh memory from the
allocator) and reads the bytes into it. No reference is swapped, so autograd's saved tensors,
views and the optimizer keep working (this is how FSDP frees and restores parameters).

Safety net: every operator runs inside a ``TorchDispatchMode`` that, before the operator
starts, makes every storage it touches resident (waiting if a transfer is in flight). So a
plan that is wrong, or an iteration that differs from the profiled one, can cost time but never
hand an operator missing or stale bytes.

Modes of one iteration (``Session.step()``):
- *paged* (no plan yet: warm-up and profiling iterations, and after a divergence): when GPU
  memory in use passes the budget after an operator, the least recently used storages that the
  operator did not touch are offloaded (synchronously) until it fits; a storage is read back
  when an operator needs it. Slow, but it runs any iteration under the budget, so the first,
  profiled iterations fit too.
- *planned*: the plan's instructions are executed by the engine's plan executor
  (docs/EXECUTOR.md), driven by the operator count; see :mod:`teraio.torch.planned`.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

import teraio

from ._storages import iter_tensors, op_name, run_op, storage_key, storage_of

# storage keys from the engine's callers' key space: clear of a session's executor's keys
_ids = itertools.count(teraio.KEY_CALLER_FIRST)


class Store(Protocol):
    """What the pager needs from an engine (``teraio.Engine`` has it)."""

    def offload(self, tensor_id: int, data: Any, **kw: Any) -> Any: ...
    def prefetch(self, tensor_id: int, out: Any, **kw: Any) -> Any: ...
    def free(self, tensor_id: int) -> Any: ...


def host_view(s: torch.UntypedStorage, nbytes: int | None = None) -> Any:
    """A writable buffer-protocol object over a CPU storage's bytes (no copy, no aten op)."""
    n = s.nbytes() if nbytes is None else nbytes
    return (ctypes.c_uint8 * n).from_address(s.data_ptr())


class StorageMover:
    """Moves one storage's bytes to an engine and back, and frees / regrows its memory.

    CPU storages go to the engine straight from their memory. CUDA storages go through the
    engine's GPU data paths (``offload_device``/``prefetch_device``, ordered after the current
    stream) when the engine has a GPU, else through a pinned host staging tensor (one copy each
    way, synchronized). ``destination``: ``"ssd"``, or ``"host"`` for the engine's host tier
    (SSD when it is absent or full).
    """

    def __init__(self, store: Store, destination: str = "ssd") -> None:
        self.store = store
        self.destination = destination
        self.bytes_out = 0
        self.bytes_in = 0
        self.busy_s = 0.0
        # None: not tried yet; False: the engine has no GPU (staging through host memory)
        self._device_path: bool | None = None if hasattr(store, "offload_device") else False

    def _device_mem(self, s: torch.UntypedStorage, nbytes: int) -> Any:
        import teraio

        return teraio.DeviceMemory(s.data_ptr(), nbytes, s)

    def _try_device(self, s: torch.UntypedStorage, op: Callable[[], Any]) -> bool:
        """Run ``op`` (a device-path transfer) when the engine can; whether it did."""
        if s.device.type != "cuda" or self._device_path is False:
            return False
        try:
            op().wait()
        except Exception as e:  # the engine has no GPU: stage through host memory from now on
            if self._device_path is None and "Unsupported" in type(e).__name__ + str(e):
                self._device_path = False
                return False
            raise
        self._device_path = True
        return True

    def offload(self, s: torch.UntypedStorage, tensor_id: int, nbytes: int) -> None:
        """Copy the storage out, then release its memory (resize to 0)."""
        t0 = time.perf_counter()
        with _disable_current_modes(), torch.no_grad():
            if s.device.type == "cpu":
                self.store.offload(tensor_id, host_view(s, nbytes), destination=self.destination).wait()
            elif not self._try_device(s, lambda: self.store.offload_device(
                    tensor_id, self._device_mem(s, nbytes), stream=torch.cuda.current_stream(s.device),
                    destination=self.destination)):
                stage = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                src = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (nbytes,), (1,))
                stage.copy_(src)
                del src
                self.store.offload(tensor_id, stage.numpy(), destination=self.destination).wait()
            s.resize_(0)
        self.bytes_out += nbytes
        self.busy_s += time.perf_counter() - t0

    def fetch(self, s: torch.UntypedStorage, tensor_id: int, nbytes: int) -> None:
        """Regrow the storage and read its bytes back; the engine forgets its copy."""
        t0 = time.perf_counter()
        with _disable_current_modes(), torch.no_grad():
            s.resize_(nbytes)
            if s.device.type == "cpu":
                self.store.prefetch(tensor_id, host_view(s, nbytes)).wait()
            elif not self._try_device(s, lambda: self.store.prefetch_device(
                    tensor_id, self._device_mem(s, nbytes), stream=torch.cuda.current_stream(s.device))):
                stage = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.store.prefetch(tensor_id, stage.numpy()).wait()
                dst = torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (nbytes,), (1,))
                dst.copy_(stage)
                del dst
            self.store.free(tensor_id).wait()
        self.bytes_in += nbytes
        self.busy_s += time.perf_counter() - t0


@dataclass
class _Paged:
    ref: Any  # weakref to the UntypedStorage
    bytes: int
    last_use: int
    resident: bool = True
    tensor_id: int = 0


class Pager:
    """Demand paging of storages under a byte budget, for iterations that have no plan.

    The profiler (or any dispatch mode) calls :meth:`seen` for every storage an operator
    touches, :meth:`before` with the storages of the operator about to run (offloaded ones come
    back, after making room), and :meth:`after` when it ran (memory above the budget is paged
    out, least recently used first). Storages smaller than ``min_bytes`` stay. The room made
    before an operator also holds what the last operator of its name and input sizes made (the
    storages first seen there: its outputs), so that its outputs land within the budget instead
    of above it until :meth:`after`: from a model's second layer on, and in every later step
    (also one whose operators shifted, as checkpointing some layers shifts them).
    ``used_bytes``: how much memory is in use (default: the storages it knows, resident).
    ``limit_bytes`` (the Session's GPU budget): an operator whose own storages (inputs and
    outputs) take more can never fit any plan: :meth:`after` raises
    :class:`~teraio.torch.WorkingSetTooLarge` naming it, in the first step already, and on a GPU
    an operator that still runs out of memory with everything else paged out raises it too.
    ``untraced_peak_bytes``: the most memory in use beyond the storages it knows, after an
    operator (library workspaces on a GPU; 0 where ``used_bytes`` is its own count), for the
    Session's measured allowance.
    """

    def __init__(self, mover: StorageMover, budget_bytes: int, min_bytes: int = 1 << 16,
                 used_bytes: Callable[[], int] | None = None) -> None:
        self.mover = mover
        self.budget = budget_bytes
        self.min_bytes = min_bytes
        self._used = used_bytes
        self.known: dict[int, _Paged] = {}
        self.resident_bytes = 0
        self.evictions = 0
        self.fetches = 0
        self.wait_s = 0.0
        self.limit_bytes: int | None = None
        self.untraced_peak_bytes = 0
        # (operator name, its storages' bytes) -> the bytes such an operator made when it last ran
        self.made: dict[tuple[str, tuple[int, ...]], int] = {}
        self._running: tuple[int, tuple[str, tuple[int, ...]]] | None = None  # (index, key)
        self._made_now = 0  # the bytes the running operator made so far

    def used_bytes(self) -> int:
        return self._used() if self._used is not None else self.resident_bytes

    def seen(self, s: torch.UntypedStorage, op: int) -> None:
        import weakref

        key = storage_key(s)
        p = self.known.get(key)
        if p is None or p.ref() is None:
            n = s.nbytes()
            if n == 0:
                return
            p = _Paged(ref=weakref.ref(s), bytes=n, last_use=op)
            self.known[key] = p
            self.resident_bytes += n
            if self._running is not None and self._running[0] == op:
                self._made_now += n
            weakref.finalize(s, self._died, key, p)
        p.last_use = op

    def _died(self, key: int, p: _Paged) -> None:
        if self.known.get(key) is p:
            del self.known[key]
        if p.resident:
            self.resident_bytes -= p.bytes
        else:
            try:
                self.mover.store.free(p.tensor_id)
            except Exception:
                pass

    def before(self, storages: list[torch.UntypedStorage], op: int, name: str = "") -> None:
        """Make the operator's storages resident, with room beside them for what the last
        operator of its ``name`` and storages' sizes made."""
        want = {}
        sizes = []
        for s in storages:
            key = storage_key(s)
            p = self.known.get(key)
            sizes.append(p.bytes if p is not None else s.nbytes())
            if p is not None and not p.resident:
                want[key] = (s, p)  # once per storage, however often the operator names it
        want = list(want.values())
        like = (name, tuple(sizes))
        self._running, self._made_now = (op, like), 0
        made = self.made.get(like, 0)
        if not want and (made == 0 or self.used_bytes() + made <= self.budget):
            return
        t0 = time.perf_counter()
        need = sum(p.bytes for _, p in want)
        keep = {storage_key(s) for s in storages}
        self._evict(op, keep, extra=need + made)
        for s, p in want:
            self.mover.fetch(s, p.tensor_id, p.bytes)
            p.resident = True
            self.resident_bytes += p.bytes
            self.fetches += 1
        self.wait_s += time.perf_counter() - t0

    def after(self, storages: list[torch.UntypedStorage], op: int, name: str = "") -> None:
        """Page out least recently used storages while memory in use is above the budget
        (``storages``: the operator's inputs and outputs; ``name``: the operator's, for the error
        when they alone exceed ``limit_bytes``)."""
        if self.limit_bytes is not None:
            mine = {storage_key(s): s.nbytes() for s in storages}
            need = sum(mine.values())
            if need > self.limit_bytes:
                from .optimizer import WorkingSetTooLarge

                raise WorkingSetTooLarge(op, name or f"operator {op}", need, self.limit_bytes, len(mine))
        if self._running is not None and self._running[0] == op:
            self.made[self._running[1]] = self._made_now
            self._running = None
        if self._used is not None:
            self.untraced_peak_bytes = max(self.untraced_peak_bytes, self._used() - self.resident_bytes)
        t0 = time.perf_counter()
        n = self._evict(op, {storage_key(s) for s in storages}, extra=0)
        if n:
            self.wait_s += time.perf_counter() - t0

    def _evict(self, op: int, keep: set[int], extra: int) -> int:
        evicted = 0
        if self.used_bytes() + extra <= self.budget:
            return 0
        # (a snapshot: a storage dying meanwhile, its finalizer run by a garbage collection
        # that any allocation here may start, leaves ``known``)
        victims = sorted(
            (p.last_use, key) for key, p in self.known.copy().items()
            if p.resident and key not in keep and p.bytes >= self.min_bytes
        )
        for _, key in victims:
            if self.used_bytes() + extra <= self.budget:
                break
            p = self.known.get(key)
            s = p.ref() if p is not None else None
            if s is None or not s.resizable():
                continue
            p.tensor_id = next(_ids)
            self.mover.offload(s, p.tensor_id, p.bytes)
            p.resident = False
            self.resident_bytes -= p.bytes
            self.evictions += 1
            evicted += 1
        return evicted

    def make_room(self, keep: list[torch.UntypedStorage], op: int) -> int:
        """An operator ran out of memory: page out everything it does not use. Returns how many
        storages went."""
        budget, self.budget = self.budget, 0
        try:
            return self._evict(op, {storage_key(s) for s in keep}, extra=0)
        finally:
            self.budget = budget

    def run_op(self, func: Any, args: tuple, kwargs: dict, keep: list[torch.UntypedStorage], op: int,
               again: Callable[[], None] | None = None) -> Any:
        """Run an operator; if the GPU runs out of memory, page out everything it does not use and
        run it once more (an allocation fails before the operator writes anything). ``again`` is
        called right before that second attempt (the profiler restarts the operator's clock
        there, so the paging is not timed as the operator's)."""
        try:
            return run_op(func, args, kwargs)
        except torch.cuda.OutOfMemoryError as e:
            if not self.make_room(keep, op):
                self._cannot_fit(func, keep, op, e)
                raise
            torch.cuda.empty_cache()
            if again is not None:
                again()
            try:
                return run_op(func, args, kwargs)
            except torch.cuda.OutOfMemoryError as e2:
                self._cannot_fit(func, keep, op, e2)
                raise

    def _cannot_fit(self, func: Any, keep: list[torch.UntypedStorage], op: int, e: Exception) -> None:
        """An operator ran out of memory with everything it does not use paged out: with a
        ``limit_bytes``, :class:`~teraio.torch.WorkingSetTooLarge` naming it and its inputs'
        bytes (what it allocates besides is in the allocator's message)."""
        if self.limit_bytes is None:
            return
        from .optimizer import WorkingSetTooLarge

        mine = {storage_key(s): s.nbytes() for s in keep}
        raise WorkingSetTooLarge(op, op_name(func), sum(mine.values()), self.limit_bytes, len(mine),
                                 detail=f"with everything else paged out it still ran out of GPU memory "
                                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__}): its "
                                        "inputs, outputs and workspace do not fit") from e

    def restore_all(self, limit_bytes: int | None = None, may_stay: set | None = None) -> None:
        """Bring every paged-out storage back (the end of a paged iteration); with
        ``limit_bytes``, those whose keys are in ``may_stay`` (the parameters, gradients and
        optimizer states: the next step's pager or plan brings them back) only while memory in
        use stays within it and the allocator finds room, the most recently used first, the
        others staying stored until an operator or :meth:`bring_back` needs them. What is not
        in ``may_stay`` (a loss, outputs the trainer holds) always comes back, first."""
        stored = [(p.last_use, key) for key, p in self.known.copy().items() if not p.resident]
        limited = limit_bytes is not None
        stay = may_stay if limited and may_stay is not None else set()
        for must in (True, False):
            for _, key in sorted(stored, reverse=limited):
                p = self.known.get(key)
                s = p.ref() if p is not None else None
                if s is None or p.resident or (key not in stay) != must:
                    continue
                if must or not limited:
                    self._fetch(s, p)
                    continue
                if self.used_bytes() + p.bytes > limit_bytes:
                    return
                try:
                    self._fetch(s, p)
                except torch.cuda.OutOfMemoryError:
                    # (the allocator's cap counts its cached and rounded blocks too: a storage
                    # that found no room to regrow stays stored, unchanged)
                    if s.nbytes() != 0:
                        raise
                    return

    def bring_back(self, s: torch.UntypedStorage) -> bool:
        """Bring one storage back if this pager holds it paged out; whether it did."""
        p = self.known.get(storage_key(s))
        if p is None or p.resident or p.ref() is None:
            return False
        self._fetch(s, p)
        return True

    def _fetch(self, s: torch.UntypedStorage, p: _Paged) -> None:
        self.mover.fetch(s, p.tensor_id, p.bytes)
        p.resident = True
        self.resident_bytes += p.bytes
        self.fetches += 1

    def dispatch(self, func: Any, args: tuple, kwargs: dict, op: int, device: torch.device) -> Any:
        """Run one operator under the pager alone (no recording)."""
        stor = [s for s in (storage_of(t) for t in iter_tensors((args, kwargs)) if t.device == device)
                if s is not None]
        name = op_name(func)
        self.before(stor, op, name)
        out = self.run_op(func, args, kwargs, stor, op)
        outs = [s for s in (storage_of(t) for t in iter_tensors(out) if t.device == device) if s is not None]
        for s in stor + outs:
            self.seen(s, op)
        self.after(stor + outs, op, name=name)
        return out
