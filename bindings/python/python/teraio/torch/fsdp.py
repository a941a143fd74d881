"""teraio under FSDP2 (``torch.distributed.fsdp.fully_shard``): one Session per rank.

Under FSDP2 a rank keeps its *shard* of every parameter (a ``DTensor`` whose local tensor is a
slice of the parameter), of its gradient and of its optimizer states; just before a module runs
(forward and backward), FSDP all-gathers the module's parameters into *unsharded* storages it
keeps for the whole training, and after it frees them again with ``UntypedStorage.resize_(0)``,
the same mechanism teraio uses to move a tensor. Two owners resizing one storage would disagree
on whose bytes it holds, so the two are kept apart:

- teraio moves what is the rank's own: the sharded parameters, gradients and optimizer states
  (through their local tensors: :func:`teraio.torch._storages.storage_of` of a ``DTensor`` is
  its local shard's storage, named ``param:NAME`` / ``grad:NAME`` / ``state:NAME.KEY`` by the
  parameter's name, the same on every rank, so a plan's names hold on every rank), and the
  activations of the rank's micro-batch, including FSDP's temporary all-gather and
  reduce-scatter buffers;
- FSDP's unsharded parameter storages are FSDP's: :func:`claim` makes them when the Session is
  made (as FSDP's first all-gather would) and registers them, so teraio neither traces, pages nor
  plans them, and no recomputation reads them (FSDP may have freed them by then). Their memory is
  accounted apart: the profiled steps sample it after every operator and plans are made for the
  budget less its peak (:attr:`FsdpStorages.peak_bytes`).

A collective on CPU tensors (gloo) is waited for right after its operator under a Session
(:func:`teraio.torch._storages.run_op`): gloo writes its buffers from a worker thread. On a GPU
the operators FSDP runs on its own streams are ordered against the trainer's stream (the one
the executor orders its copies after): before them the trainer's stream, after them theirs
(:func:`teraio.torch._storages.set_trainer_stream`).

::

    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), ...)
    session = teraio.torch.Session(model, optimizer, engine=teraio.torch.rank_engine({...}),
                                   gpu_budget_bytes=...)

Not supported: parameters with FSDP2's all-gather extensions (``fsdp_pre_all_gather``, e.g.
float8 training) and ``CPUOffloadPolicy`` together with a Session (both move the same shards):
:func:`claim` refuses them, naming the parameter.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ._storages import _FOREIGN, storage_key

# model -> its claim (while a Session over it is open)
_CLAIMS: "weakref.WeakKeyDictionary[torch.nn.Module, FsdpStorages]" = weakref.WeakKeyDictionary()


def named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` as between steps: under FSDP2 (a claimed model) the sharded
    parameters, also while FSDP has the unsharded ones registered on the modules (from a
    module's forward to its backward)."""
    claim = _CLAIMS.get(model) if _CLAIMS else None
    return list(claim.params) if claim is not None else list(model.named_parameters())


def fsdp_params(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(module name, FSDPParam)`` for every parameter FSDP2 manages in ``model`` (empty when
    the model has no ``fully_shard`` module, or this PyTorch has no FSDP2). FSDP's lazy
    initialization (what its root's first forward does: which module is the root, the mixed
    precision dtypes) is run now, once per outermost ``fully_shard`` module."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out = []
    roots: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        if not any(r == "" or name.startswith(r + ".") for r in roots):
            roots.append(name)
            state._lazy_init()
        group = getattr(state, "_fsdp_param_group", None)
        for p in getattr(group, "fsdp_params", None) or ():
            out.append((name, p))
    return out


class FsdpStorages:
    """FSDP's unsharded parameter storages of one model, registered as another owner's (see the
    module doc), and the peak of their bytes over the operators the profiler sampled."""

    def __init__(self, storages: list[torch.UntypedStorage], names: list[str],
                 params: list[tuple[str, torch.nn.Parameter]] | None = None) -> None:
        # the model's parameters between steps (the sharded ones): named_parameters()
        self.params = params or []
        self._refs = [weakref.ref(s) for s in storages]
        self._keys = [storage_key(s) for s in storages]
        self.names = names
        # the most bytes they held at once (sampled after each profiled operator)
        self.peak_bytes = 0
        # their bytes with every parameter unsharded at once
        self.full_bytes = 0
        self._finalizers = []
        for s, k in zip(storages, self._keys):
            _FOREIGN.add(k)
            # (a storage that dies lets its key go: a new storage at its address is teraio's)
            self._finalizers.append(weakref.finalize(s, _FOREIGN.discard, k))

    def __len__(self) -> int:
        return len(self._keys)

    def bytes_now(self) -> int:
        """Bytes FSDP's unsharded storages hold now."""
        n = 0
        for r in self._refs:
            s = r()
            if s is not None:
                n += s.nbytes()
        return n

    def sample(self) -> None:
        """Update :attr:`peak_bytes` (the profiler calls it after each operator)."""
        n = self.bytes_now()
        if n > self.peak_bytes:
            self.peak_bytes = n

    def release(self) -> None:
        """teraio gives them up (the Session closes): their keys are no longer foreign."""
        for f in self._finalizers:
            f()
        self._finalizers = []
        for m, c in list(_CLAIMS.items()):
            if c is self:
                del _CLAIMS[m]


def claim(model: torch.nn.Module) -> FsdpStorages | None:
    """Under FSDP2: make every FSDP-managed parameter's unsharded storage now (as FSDP's first
    all-gather would, then freed as FSDP frees it) and register it as FSDP's, so teraio leaves it
    alone. None when ``model`` has no FSDP2 module. Raises ``ValueError`` for what a Session
    cannot run under (see the module doc), naming the parameter."""
    params = fsdp_params(model)
    if not params:
        return None
    storages: list[torch.UntypedStorage] = []
    names: list[str] = []
    full = 0
    name_of = {id(p): n for n, p in model.named_parameters()}
    for module_name, fp in params:
        pname = name_of.get(id(fp.sharded_param), f"a parameter of module {module_name or '(root)'}")
        if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            raise ValueError(
                f"teraio under FSDP2: parameter {pname} has all-gather extensions (fsdp_pre_all_gather, e.g. "
                "float8 training); a Session does not run with them yet: shard it without them")
        if getattr(fp, "offload_to_cpu", False):
            raise ValueError(
                f"teraio under FSDP2: parameter {pname} is sharded with CPUOffloadPolicy, which moves the shards "
                "to the CPU itself; a Session moves them too: shard without offload_policy and give the Session "
                "the budget (or use CPUOffloadPolicy without a Session)")
        if not fp.all_gather_outputs:
            inputs = fp.all_gather_inputs
            fp.init_all_gather_outputs([t.numel() for t in inputs], [t.dtype for t in inputs],
                                       fp.mesh_info.shard_mesh_size, fp.device)
            # (as FSDP leaves them between its all-gathers; its next one refills them; older
            # PyTorch has no free_all_gather_outputs: its body, free_storage of each)
            for t in fp.all_gather_outputs:
                if t.untyped_storage().size() != 0:
                    t.untyped_storage().resize_(0)
        for t in fp.all_gather_outputs:
            s = t.untyped_storage()
            storages.append(s)
            names.append(pname)
            full += t.numel() * t.element_size()
    out = FsdpStorages(storages, names, list(model.named_parameters()))
    out.full_bytes = full
    _CLAIMS[model] = out
    return out
