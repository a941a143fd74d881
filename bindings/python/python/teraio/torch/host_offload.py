"""The optimizer step on the host for a model on the GPU (``Session(optimizer_on="host")``).

AdamW keeps 16 bytes a parameter in float32 (the parameter, its gradient and two states); a
plan that steps on the GPU brings all of them to the GPU and back when they do not fit beside
the activations. With :func:`offload_optimizer` the states never touch the GPU: they live in
page-locked host memory with a float32 master copy of each parameter, and each step copies the
gradient down (4 bytes a parameter), updates on the host with teraio's kernels
(``teraio.adamw_step`` / ``teraio.sgd_step``: SIMD, every core, the GIL released) and copies the
parameter back (4 bytes): 8 bytes over PCIe a parameter instead of up to 32, at the cost of the
host's memory bandwidth (about 28 bytes a parameter of host traffic).

The optimizer object stays the user's: its ``param_groups`` (read at every step, so LR
schedulers and per-group settings work), step hooks, ``state_dict()`` / ``load_state_dict()``
(the states are in ``optimizer.state`` under PyTorch's keys, as host tensors; a loaded state
that PyTorch put on the GPU is moved back to the host at the next step). Gradients are read when
``step()`` runs, so clipping by the global norm and gradient accumulation before it work as
ever. A parameter written between steps (a checkpoint loaded into the model, an EMA swap) is
seen through its version counter and its master copy is read again.

The update is PyTorch's single-tensor rule (``foreach=False``), every operation correctly
rounded (docs/TORCH.md, "Host optimizer"). Supported: ``torch.optim.AdamW``, ``Adam`` and
``SGD`` (and teraio's ``HostAdamW``/``HostAdam``/``HostSGD``) over float32 parameters, dense
gradients, without ``capturable`` or ``differentiable``.

A subset (``offload_optimizer(opt, params=[...])``, what ``Session(optimizer_on="auto")`` makes
from the planner's choice): only those parameters update on the host; the others stay with the
optimizer's own step (its class's ``step`` over the same groups with those parameters alone, on
the GPU, with their states where PyTorch keeps them). Both halves read the same ``param_groups``,
so schedulers and per-group settings reach both, and ``state_dict()`` holds every parameter's
state (host tensors for the host ones). A parameter that leaves the host subset gets its states
back beside it.

Under FSDP2 (``fully_shard``) the parameters are ``DTensor`` shards: each rank updates its own
local shard on the host (master copy, gradient buffer and states of the local shard's shape, as
plain host tensors), reads the local gradient FSDP's reduce-scatter made (the hook fires after
it, on FSDP's stream) and writes the local shard back in place, where FSDP's next all-gather reads
it. Each rank's shards end bitwise as the matching rows of one unsharded process with the same
host optimizer (``tests/torch/test_fsdp.py``). Its states being plain host tensors, a DCP
checkpoint of such an optimizer holds local shards, not ``DTensor``s.

The pipeline per step: every gradient's copy to the host is queued on the current stream at
once; the host then updates parameter after parameter as its gradient arrives, queuing each
parameter's copy back right after its update, so copies in both directions overlap the host's
work. The current stream, not the host, waits for the last copy: the next operators on the
GPU are ordered after it.
"""

from __future__ import annotations

import types
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

import teraio

from ._storages import local_tensor
from .host_optim import _check_threads, _grad, _scalar_dtype, _written

__all__ = ["offload_optimizer", "HostOffload"]


@dataclass
class _Host:
    """One parameter's host side: its float32 master copy and the buffer its gradient arrives in."""

    master: torch.Tensor
    grad: torch.Tensor
    # the parameter's version counter after the master was last written to it (None: never)
    version: Optional[int] = None
    # the gradient's arrival (CUDA event; None on the CPU)
    arrived: Any = None
    # the parameter's copy back from the master (CUDA event): the master is not written again
    # before it is done
    sent: Any = None
    # the gradient copied in backward (a weak reference) and its version then: the copy holds
    # for the step only while the parameter's gradient is still that tensor at that version
    source: Any = None
    source_version: int = -1
    # update_in_backward: the update made in backward (a future), or None
    updated: Any = None
    # whether the optimizer's states of the parameter are ours (host tensors this object made
    # or copied): until its first update here they may be tensors a Session moves (on a CPU
    # model those are host tensors too, and their storage may be away)
    adopted: bool = False


def _kind(optimizer: torch.optim.Optimizer) -> str:
    if isinstance(optimizer, torch.optim.AdamW):
        return "adamw"
    if isinstance(optimizer, torch.optim.Adam):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    raise TypeError(
        f"optimizer_on='host' supports torch.optim.AdamW, Adam and SGD; got {type(optimizer).__name__}: "
        "keep optimizer_on='gpu' for it")


def _pinned(like: torch.Tensor) -> torch.Tensor:
    """A float32 host tensor of ``like``'s shape on this rank (a ``DTensor``'s local shard's)."""
    pin = torch.cuda.is_available()
    return torch.empty(local_tensor(like).shape, dtype=torch.float32, device="cpu", pin_memory=pin)


def _off_host(v: torch.Tensor) -> bool:
    """Whether a state tensor is not (yet) one of ours: on a device, or a ``DTensor`` (a loaded
    ``state_dict``, PyTorch's own step)."""
    return v.device.type != "cpu" or local_tensor(v) is not v


def _beside(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A host state ``v`` back beside its parameter ``p``: on ``p``'s device, and a ``DTensor``
    laid out as ``p`` when ``p`` is one (FSDP2's sharded parameters: PyTorch's own step takes
    their states as DTensors)."""
    local = local_tensor(p)
    moved = v.to(local.device)
    if local is p:
        return moved
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(moved, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                              run_check=False)


class HostOffload:
    """The raw step (over the optimizer's current ``param_groups``) that runs on the host; made
    by :func:`offload_optimizer`, called by the optimizer's ``step`` (and by
    :func:`teraio.torch.make_plannable` per chunk). ``params``: the parameters updated on the
    host (None: all); the others are stepped by the optimizer's own class ``step``."""

    def __init__(self, optimizer: torch.optim.Optimizer, threads: Optional[int] = None,
                 params: Optional[Iterable[torch.Tensor]] = None) -> None:
        self.kind = _kind(optimizer)
        self.threads = _check_threads(threads)
        self.hosts: dict[int, _Host] = {}
        self.update_in_backward = False
        self._worker: Optional[ThreadPoolExecutor] = None
        self._optimizer = weakref.ref(optimizer)
        cls_step = type(optimizer).step
        # the optimizer's own step for the parameters that stay (as make_plannable calls it)
        self._own_step: Callable[..., Any] = getattr(cls_step, "__wrapped__", cls_step)
        # ids of the parameters updated on the host (None: every parameter)
        self.on_host: Optional[set[int]] = None
        self._hooks: list[Any] = []
        self.set_params(params)

    def set_params(self, params: Optional[Iterable[torch.Tensor]]) -> None:
        """Update these parameters on the host from now on (None: all of the optimizer's), the
        others with the optimizer's own step; a parameter leaving the host gets its states back
        on its device."""
        optimizer = self._optimizer()
        mine = [p for g in optimizer.param_groups for p in g["params"]]
        if params is None:
            chosen = mine
        else:
            chosen = list(params)
            known = {id(p) for p in mine}
            for p in chosen:
                if id(p) not in known:
                    raise ValueError(f"offload_optimizer(params=...): a tensor of shape {tuple(p.shape)} is not "
                                     "a parameter of this optimizer")
        ids = {id(p) for p in chosen}
        for group in optimizer.param_groups:
            if not any(id(p) in ids for p in group["params"]):
                continue
            for opt in ("capturable", "differentiable"):
                if group.get(opt):
                    raise ValueError(f"optimizer_on='host': the optimizer's {opt}=True cannot step on the "
                                     f"host; make it with {opt}=False")
            for p in group["params"]:
                if id(p) in ids and p.dtype != torch.float32:
                    raise TypeError(
                        f"optimizer_on='host' steps float32 parameters; a parameter of shape "
                        f"{tuple(p.shape)} is {p.dtype}: keep optimizer_on='gpu' for this model")
        for h in self._hooks:
            h.remove()
        # parameters leaving the host: their states back beside them, their host side dropped
        for p in mine:
            if id(p) in ids or id(p) not in self.hosts:
                continue
            h = self.hosts.pop(id(p))
            if h.sent is not None:
                h.sent.synchronize()
            state = optimizer.state.get(p)
            for k, v in list((state or {}).items()):
                if isinstance(v, torch.Tensor) and k != "step" and v.device != local_tensor(p).device:
                    state[k] = _beside(v, p)
        self.on_host = None if params is None else ids
        # every gradient starts down as soon as backward has accumulated it
        self._hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                       for p in chosen if p.requires_grad]

    def _here(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is updated on the host."""
        return self.on_host is None or id(p) in self.on_host

    def _step_the_others(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's own step over the parameters not on the host (the same groups with
        those parameters alone)."""
        groups = optimizer.param_groups
        subs = []
        for g in groups:
            ps = [p for p in g["params"] if not self._here(p)]
            if ps:
                sub = dict(g)
                sub["params"] = ps
                subs.append((g, sub))
        if not subs:
            return
        optimizer.param_groups = [sub for _, sub in subs]
        try:
            self._own_step(optimizer)
        finally:
            optimizer.param_groups = groups
        # hyperparameters an optimizer writes back into its group (none of torch's do)
        for g, sub in subs:
            for k, v in sub.items():
                if k != "params":
                    g[k] = v

    def remove(self) -> None:
        """Remove the backward hooks (the optimizer keeps stepping on the host, copying each
        gradient when ``step()`` runs)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _fresh(self, p: torch.Tensor, h: _Host) -> bool:
        """Whether the gradient copied in backward is still ``p.grad`` as it is now."""
        src = h.source() if h.source is not None else None
        return src is not None and src is p.grad and local_tensor(p.grad)._version == h.source_version

    @torch.no_grad()
    def _accumulated(self, p: torch.Tensor) -> None:
        """Backward finished ``p``'s gradient: queue its copy to the host (on the current
        stream, after the kernel that made it) and, with ``update_in_backward``, its update."""
        if p.grad is None or p.grad.is_sparse:
            return
        h = self._host(p)
        if self.update_in_backward and h.updated is not None:
            raise RuntimeError(
                f"offload_optimizer(update_in_backward=True): a parameter of shape {tuple(p.shape)} got a "
                "second gradient before optimizer.step(): with gradient accumulation, update at step() "
                "(update_in_backward=False)")
        grad = local_tensor(p.grad)
        cuda = grad.is_cuda
        h.grad.copy_(grad, non_blocking=cuda)
        if cuda:
            h.arrived = torch.cuda.Event()
            h.arrived.record(torch.cuda.current_stream(grad.device))
        h.source = weakref.ref(p.grad)
        h.source_version = grad._version
        if self.update_in_backward:
            opt = self._optimizer()
            group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
            local = local_tensor(p)
            if h.version != local._version:
                h.master.copy_(local.detach())
                h.version = local._version
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, thread_name_prefix="teraio-host-optimizer")
            h.updated = self._worker.submit(self._update_when_arrived, opt, group, p, h)

    def _update_when_arrived(self, optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor,
                             h: _Host) -> None:
        if h.sent is not None:
            h.sent.synchronize()
        if h.arrived is not None:
            h.arrived.synchronize()
        with torch.no_grad():
            self._update(optimizer, group, p, h)

    def _host(self, p: torch.Tensor) -> _Host:
        h = self.hosts.get(id(p))
        if h is None:
            h = self.hosts[id(p)] = _Host(master=_pinned(p), grad=_pinned(p))
        return h

    def _state_to_host(self, state: dict[str, Any], every: bool = False) -> None:
        """States PyTorch put beside the parameter (a loaded ``state_dict``) back to the host;
        ``every``: each state copied into a host tensor of ours (the first update here: the
        states the optimizer's own step made)."""
        for k, v in list(state.items()):
            if isinstance(v, torch.Tensor) and k != "step" and (every or _off_host(v)):
                host = _pinned(v)
                host.copy_(local_tensor(v))
                state[k] = host

    @torch.no_grad()
    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        if self.on_host is not None:
            # those not on the host first: their kernels are queued on the GPU while the host
            # works on its share
            with torch.enable_grad():
                self._step_the_others(optimizer)
        todo = [(g, p) for g in optimizer.param_groups for p in g["params"]
                if p.grad is not None and self._here(p)]
        if not todo:
            return
        first = local_tensor(todo[0][1])
        cuda = first.is_cuda
        stream = torch.cuda.current_stream(first.device) if cuda else None
        # every gradient not copied in backward (or changed since: clipped, accumulated, set by
        # hand) on its way down at once (the copies queue on the current stream)
        for _, p in todo:
            h = self._host(p)
            if h.updated is not None:
                if not self._fresh(p, h):
                    h.updated.result()
                    h.updated = None
                    raise RuntimeError(
                        "offload_optimizer(update_in_backward=True): a gradient changed between backward "
                        "and optimizer.step() (clipping, scaling or accumulation): the update already ran "
                        "with the gradient backward made; use update_in_backward=False")
                continue
            if not self._fresh(p, h):
                h.grad.copy_(local_tensor(_grad(p, "optimizer_on='host'")), non_blocking=cuda)
                if cuda:
                    h.arrived = torch.cuda.Event()
                    h.arrived.record(stream)
            h.source = None
        for group, p in todo:
            h = self.hosts[id(p)]
            local = local_tensor(p)
            if h.updated is not None:
                h.updated.result()  # made in backward (raises what the update raised)
                h.updated = None
                h.source = None
            else:
                if h.sent is not None:
                    h.sent.synchronize()  # the last step's copy back is done with the master
                if h.version != local._version:
                    # first step, or the parameter was written since our last copy: read it again
                    h.master.copy_(local.detach())
                if cuda:
                    h.arrived.synchronize()
                self._update(optimizer, group, p, h)
            local.detach().copy_(h.master, non_blocking=cuda)
            h.version = local._version
            if cuda:
                h.sent = torch.cuda.Event()
                h.sent.record(stream)

    def _update(self, optimizer: torch.optim.Optimizer, group: dict[str, Any], p: torch.Tensor, h: _Host) -> None:
        state = optimizer.state[p]
        if self.kind == "sgd":
            momentum = float(group["momentum"])
            buf = None
            fresh = False
            if momentum != 0:
                buf = state.get("momentum_buffer")
                if buf is not None and (_off_host(buf) or not h.adopted):
                    self._state_to_host(state, every=not h.adopted)
                    buf = state["momentum_buffer"]
                if buf is None:
                    fresh = True
                    buf = _pinned(p)
            h.adopted = True
            teraio.sgd_step(
                h.master, h.grad, buf, lr=float(group["lr"]), momentum=momentum,
                dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
                nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]),
                fresh_buffer=fresh, threads=self.threads,
            )
            if fresh:
                state["momentum_buffer"] = buf
            _written(buf)
            return
        amsgrad = bool(group["amsgrad"])
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            state["exp_avg"] = _pinned(p).zero_()
            state["exp_avg_sq"] = _pinned(p).zero_()
        else:
            self._state_to_host(state, every=not h.adopted)
        h.adopted = True
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = _pinned(p).zero_()
        decoupled = True if self.kind == "adamw" else bool(group.get("decoupled_weight_decay", False))
        beta1, beta2 = group["betas"]
        step_t = state["step"]
        step = float(step_t) + 1
        max_sq = state["max_exp_avg_sq"] if amsgrad else None
        teraio.adamw_step(
            h.master, h.grad, state["exp_avg"], state["exp_avg_sq"],
            step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
            eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
            amsgrad=amsgrad, max_exp_avg_sq=max_sq, maximize=bool(group["maximize"]),
            decoupled_weight_decay=decoupled, threads=self.threads,
        )
        if torch.is_tensor(step_t) and step_t.device.type == "cpu":
            step_t += 1
        else:
            state["step"] = torch.tensor(step, dtype=_scalar_dtype())
        _written(state["exp_avg"], state["exp_avg_sq"], max_sq)


def offload_optimizer(optimizer: torch.optim.Optimizer, threads: Optional[int] = None, *,
                      update_in_backward: Optional[bool] = None,
                      params: Optional[Iterable[torch.Tensor]] = None) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` update on the host (see the module). Returns the same object;
    its step hooks still run once per step. ``threads``: at most this many threads per tensor
    (None: every core).

    Each gradient is copied to the host as soon as backward has accumulated it (a hook on the
    parameter); ``step()`` copies again any gradient changed since (clipping, accumulation).
    ``update_in_backward=True`` also runs each parameter's update on a host thread as soon as its
    gradient has arrived, overlapping the host's work with the rest of backward; ``step()``
    then only copies the parameters back. It is for loops that step after every backward and
    do not change gradients in between (no clipping, no accumulation): ``step()`` raises if a
    gradient changed, a second backward before ``step()`` raises.

    ``params``: only these parameters update on the host (None: all of them); the others keep
    the optimizer's own step, over the same groups (see the module).

    Calling it again on the same optimizer changes ``threads`` and, when given,
    ``update_in_backward`` and ``params``.

    On an optimizer :func:`teraio.torch.make_plannable` already chunks, the chunked step stays
    and calls the host step per chunk."""
    raw = getattr(optimizer, "_teraio_raw_step", None)
    if isinstance(raw, HostOffload):
        raw.threads = _check_threads(threads)
        if update_in_backward is not None:
            raw.update_in_backward = bool(update_in_backward)
        if params is not None:
            raw.set_params(params)
        return optimizer
    host = HostOffload(optimizer, threads, params)
    host.update_in_backward = bool(update_in_backward)
    if getattr(optimizer, "_teraio_chunked", None) is not None:
        # (make_plannable's step calls _teraio_raw_step per chunk)
        optimizer._teraio_raw_step = host  # type: ignore[attr-defined]
        return optimizer

    def step(self: torch.optim.Optimizer, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            host(self)
        return loss

    optimizer._teraio_raw_step = host  # type: ignore[attr-defined]
    optimizer.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(step), optimizer)  # type: ignore[method-assign]
    return optimizer
