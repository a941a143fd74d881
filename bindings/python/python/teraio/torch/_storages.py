"""What the profiler and the pager both need to know about PyTorch tensors and storages.

A trace tensor is one *storage lifetime*: one ``StorageImpl`` from its allocation to its death.
Views share their base's storage, so every view of a storage is the same trace tensor. A
storage is named by the address of its ``StorageImpl`` (``UntypedStorage._cdata``), which is
unique while it lives; when it dies (observed through ``weakref.finalize`` on the storage's
Python object, which PyTorch preserves for as long as the ``StorageImpl`` lives) the address
may be reused by a new storage, which is then a new trace tensor.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch


def iter_tensors(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (a tensor, or lists/tuples/dicts of them), in order (appended to
    ``out`` when given). A list, not a generator: this runs for every operator of a planned step."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                iter_tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            iter_tensors(x, out)
    return out


def flat_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """``iter_tensors((args, kwargs))`` without the recursion through the outer tuple and the
    dict: the tensors of an operator's arguments, in the same order (once per operator)."""
    out: list[torch.Tensor] = []
    tensor = torch.Tensor
    for xs in (args, kwargs.values()) if kwargs else (args,):
        for x in xs:
            if isinstance(x, tensor):
                out.append(x)
            elif isinstance(x, (list, tuple, dict)):
                iter_tensors(x, out)
    return out


# tensor types whose storage is their own (a DTensor's is its local shard's, see storage_of)
_PLAIN = (torch.Tensor, torch.nn.Parameter)

# keys (storage_key) of storages another owner frees and refills with ``resize_`` while they
# live (FSDP2's unsharded parameters, :mod:`teraio.torch.fsdp`): teraio neither traces nor
# moves them (storage_of is None), so the two never disagree on who holds the bytes
_FOREIGN: set[int] = set()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this rank: a ``DTensor``'s local shard
    (FSDP2's sharded parameters, their gradients and optimizer states), else ``t``."""
    if type(t) not in _PLAIN:
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            return local
    return t


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage, or ``None`` for tensors that have none we can track (sparse,
    nested, meta, tensor subclasses without real storage, storages another owner resizes:
    ``_FOREIGN``). A ``DTensor``'s storage is its local shard's."""
    if type(t) not in _PLAIN:
        t = local_tensor(t)
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    if _FOREIGN and s._cdata in _FOREIGN:
        return None
    return s


def foreign(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage belongs to another owner that resizes it (see ``_FOREIGN``)."""
    if not _FOREIGN or t.layout != torch.strided:
        return False
    try:
        return local_tensor(t).untyped_storage()._cdata in _FOREIGN
    except (RuntimeError, NotImplementedError):
        return False


def _on_cpu(args: tuple) -> bool:
    """Whether an operator's first tensor argument is on the CPU (on a GPU the collectives are
    ordered by streams, and waiting would take their overlap with compute away)."""
    ts = iter_tensors(args)
    return bool(ts) and ts[0].device.type == "cpu"


# Under FSDP2 on a GPU (set by a Session for its steps, :func:`set_trainer_stream`): the stream
# the training runs on. FSDP runs some operators on streams of its own (the all-gathers' copy-in
# and collective in forward and before backward, the reduce-scatter and what follows it), while
# teraio orders its copies (offloads, prefetches, the executor's fences) after the trainer's
# stream: such an operator first waits for the trainer's stream (what teraio brought back for
# it is there), and the trainer's stream then waits for it (an offload of what it wrote reads
# it complete). None: nothing to order (the CPU, or no FSDP).
_TRAINER_STREAM: Any = None


def set_trainer_stream(stream: Any) -> None:
    """Set (a ``torch.cuda.Stream``) or clear (None) the trainer's stream (see above)."""
    global _TRAINER_STREAM
    _TRAINER_STREAM = stream


def _wait_works(out: Any) -> None:
    """Wait for a collective's ``Work`` objects among an operator's results (with gloo: until its
    buffers are written; with NCCL: the current stream waits for the collective)."""
    for w in out if isinstance(out, (list, tuple)) else (out,):
        if not isinstance(w, torch.Tensor) and callable(getattr(w, "wait", None)):
            w.wait()


def run_op(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run an operator. A collective (``c10d`` namespace) on CPU tensors is waited for before
    this returns: with gloo a worker thread writes its buffers after the operator returned, and what
    runs after an operator under teraio (paging, a plan's offloads) must see them complete.
    (FSDP2's and ``torch.distributed``'s own ``wait()`` after it then returns at once.) Under
    FSDP2 on a GPU (``_TRAINER_STREAM``) a collective is waited for too (on the device: the
    current stream waits for it), and an operator on another stream than the trainer's is
    ordered after the trainer's stream and the trainer's stream after it."""
    trainer = _TRAINER_STREAM
    if trainer is not None:
        cur = torch.cuda.current_stream(trainer.device)
        side = cur != trainer
        if side:
            cur.wait_stream(trainer)
        out = func(*args, **kwargs)
        if getattr(func, "namespace", None) == "c10d":
            _wait_works(out)
        if side:
            trainer.wait_stream(cur)
        return out
    out = func(*args, **kwargs)
    if getattr(func, "namespace", None) == "c10d" and _on_cpu(args):
        _wait_works(out)
    return out


def storage_key(s: torch.UntypedStorage) -> int:
    """Identity of a live storage (address of its ``StorageImpl``)."""
    return s._cdata


def write_flags(func: Any) -> tuple[list[bool], dict[str, bool]]:
    """For an aten op overload: which positional and keyword arguments it writes (the
    schema's ``(a!)`` alias annotations)."""
    pos: list[bool] = []
    kw: dict[str, bool] = {}
    schema = getattr(func, "_schema", None)
    if schema is None:
        return pos, kw
    for a in schema.arguments:
        w = bool(a.alias_info is not None and a.alias_info.is_write)
        if a.kwarg_only:
            kw[a.name] = w
        else:
            pos.append(w)
            kw[a.name] = w
    return pos, kw


def written_tensors(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensor arguments the op writes, by its schema."""
    pos, kw = write_flags(func)
    for i, a in enumerate(args):
        if i < len(pos) and pos[i]:
            yield from iter_tensors(a)
    for name, a in kwargs.items():
        if kw.get(name, False):
            yield from iter_tensors(a)


_NAMES: dict[Any, str] = {}


def op_name(func: Any) -> str:
    """Short name of an aten op overload, e.g. ``mm`` or ``add_.Tensor``."""
    name = _NAMES.get(func)
    if name is None:
        name = getattr(func, "__name__", None) or str(func)
        if name.endswith(".default"):
            name = name[: -len(".default")]
        _NAMES[func] = name
    return name


def signature(func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor] | None = None) -> tuple:
    """What must match between the profiled iteration and a planned one at each op: the op and
    the shapes and dtypes of its tensor arguments (``tensors``: those already listed by
    :func:`iter_tensors` of ``(args, kwargs)``)."""
    if tensors is None:
        tensors = iter_tensors((args, kwargs))
    return (op_name(func), tuple((tuple(t.shape), t.dtype) for t in tensors))


def covers(bound: tuple, sig: tuple) -> bool:
    """Whether signature ``bound`` covers ``sig``: the same op with as many tensor arguments of
    the same dtypes and ranks, each at most as large in every dimension (a longer input's
    operator over a shorter one's)."""
    if bound[0] != sig[0] or len(bound[1]) != len(sig[1]):
        return False
    for (bs, bd), (s, d) in zip(bound[1], sig[1]):
        if bd != d or len(bs) != len(s) or any(x > y for x, y in zip(s, bs)):
            return False
    return True


def remakeable(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether running the op again on the same inputs makes the same bytes: no argument it
    writes, no random numbers (``nondeterministic_seeded``), no nondeterministic kernels
    (``nondeterministic_bitwise``: atomics)."""
    tags = getattr(func, "tags", ()) or ()
    if torch.Tag.nondeterministic_seeded in tags or torch.Tag.nondeterministic_bitwise in tags:
        return False
    return next(written_tensors(func, args, kwargs), None) is None


def byte_view(s: torch.UntypedStorage) -> torch.Tensor:
    """All bytes of a storage as a flat uint8 tensor (sharing it)."""
    return torch.empty(0, dtype=torch.uint8, device=s.device).set_(s, 0, (s.nbytes(),), (1,))
