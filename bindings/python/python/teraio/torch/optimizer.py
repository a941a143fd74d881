"""An optimizer step that a plan can schedule, with the user's own optimizer's math.

PyTorch's default AdamW on CUDA is multi-tensor (``foreach``) or ``fused``: one operator reads
and writes every parameter, gradient and optimizer state at once. In a trace that operator's
working set is most of the model's memory, so below that size no plan can exist.
:func:`make_plannable` keeps the optimizer object (its hyperparameters, state, hooks and
``state_dict``) and only splits its ``step`` into chunks of parameters: each chunk is one call
of the optimizer's own step implementation on a subset of its parameters, so every element is
updated by the same kernels with the same scalars as in the unsplit step (the multi-tensor and
fused kernels are elementwise; their per-tensor scalars, step counts and bias corrections, are
per parameter). The tests check bitwise equality with the unsplit optimizer.

:func:`step_in_backward` goes one step further (PyTorch's optimizer-in-backward pattern): each
parameter is stepped as soon as its gradient is complete, and its gradient freed. The math is
the same per parameter, but gradient clipping by the global norm is impossible.

:func:`check_working_sets` is the plan-time check: it names the first kernel of a trace whose
tensors alone exceed the GPU budget.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Iterator

import torch

__all__ = ["make_plannable", "auto_chunk_bytes", "step_in_backward", "check_working_sets", "WorkingSetTooLarge"]

#: the share of the GPU budget :func:`auto_chunk_bytes` gives one chunk's parameters
AUTO_CHUNK_SHARE = 32
#: a chunk limit no model reaches: the step is not split
NO_SPLIT = 1 << 62


def auto_chunk_bytes(gpu_budget_bytes: int | None) -> int:
    """The chunk :class:`teraio.torch.Session` steps the optimizer in by default: a 32nd of the
    GPU budget of parameters (with AdamW's gradient and two states, an eighth of the budget at
    once); without a budget the step is not split. Fewer chunks cost less host
    time (each is a call of the optimizer's step); smaller ones give the plan finer pieces to
    move."""
    if gpu_budget_bytes is None:
        return NO_SPLIT
    return max(1, gpu_budget_bytes // AUTO_CHUNK_SHARE)


def _chunks(params: list[torch.Tensor], max_chunk_bytes: int) -> Iterator[list[torch.Tensor]]:
    chunk: list[torch.Tensor] = []
    size = 0
    for p in params:
        b = p.numel() * p.element_size()
        if chunk and size + b > max_chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += b
    if chunk:
        yield chunk


def make_plannable(optimizer: torch.optim.Optimizer, max_chunk_bytes: int = 0) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` run over chunks of at most ``max_chunk_bytes`` of parameters
    (0: one parameter at a time), in parameter order. Returns the same optimizer object.

    The optimizer's step hooks run once per step, as before; the closure, if any, is called
    once. Any ``torch.optim`` optimizer whose update is per parameter works (AdamW, Adam, SGD,
    ...); optimizers that couple parameters (LBFGS) must not be chunked.
    """
    if max_chunk_bytes < 0:
        raise ValueError(f"max_chunk_bytes must be >= 0, got {max_chunk_bytes}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS couples all parameters in one step: it cannot be chunked")
    if getattr(optimizer, "_teraio_chunked", None) is not None:
        optimizer._teraio_chunked = max_chunk_bytes
        return optimizer
    cls_step = type(optimizer).step
    raw: Callable[..., Any] = getattr(cls_step, "__wrapped__", cls_step)

    def chunked(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = self.param_groups
        limit = self._teraio_chunked
        # the class's step, or the host step of offload_optimizer (applied before or after)
        step = getattr(self, "_teraio_raw_step", None) or raw
        try:
            for group in groups:
                for chunk in _chunks(list(group["params"]), limit):
                    sub = dict(group)
                    sub["params"] = chunk
                    self.param_groups = [sub]
                    step(self)
                    # hyperparameters an optimizer writes back into its group (none of
                    # torch's do) are carried over
                    for k, v in sub.items():
                        if k != "params":
                            group[k] = v
        finally:
            self.param_groups = groups
        return loss

    optimizer._teraio_chunked = max_chunk_bytes
    optimizer.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(chunked), optimizer)
    return optimizer


def step_in_backward(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """Step each parameter of ``optimizer`` as soon as backward has accumulated its gradient,
    then free that gradient; ``optimizer.step()`` and ``optimizer.zero_grad()`` become no-ops
    (the loop can keep calling them). Returns a function that undoes all of it.

    Only for loops that step after every backward (no gradient accumulation) and do not clip
    by the global gradient norm.
    """
    make_plannable(optimizer, 0)
    step = optimizer.step
    params = [p for g in optimizer.param_groups for p in g["params"]]
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    cls_step = type(optimizer).step
    raw: Callable[..., Any] = getattr(cls_step, "__wrapped__", cls_step)

    def hook(p: torch.Tensor) -> None:
        groups = optimizer.param_groups
        sub = dict(group_of[id(p)])
        sub["params"] = [p]
        optimizer.param_groups = [sub]
        try:
            (getattr(optimizer, "_teraio_raw_step", None) or raw)(optimizer)
        finally:
            optimizer.param_groups = groups
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]
    zero = optimizer.zero_grad
    optimizer.step = lambda closure=None: None  # type: ignore[method-assign]
    optimizer.zero_grad = lambda set_to_none=True: None  # type: ignore[method-assign]

    def undo() -> None:
        for h in handles:
            h.remove()
        optimizer.step = step  # type: ignore[method-assign]
        optimizer.zero_grad = zero  # type: ignore[method-assign]

    return undo


class WorkingSetTooLarge(ValueError):
    """A kernel of the trace needs more memory at once than the GPU budget: no plan exists."""

    def __init__(self, kernel: int, name: str, bytes_needed: int, budget: int, tensors: int, detail: str = ""):
        self.kernel = kernel
        self.kernel_name = name
        self.bytes_needed = bytes_needed
        self.budget = budget
        if name.startswith("opt."):
            hint = (" It is an optimizer kernel: split the step with "
                    "teraio.torch.make_plannable(optimizer, max_chunk_bytes=...) or "
                    "step_in_backward(optimizer), or raise gpu_budget_bytes.")
        else:
            hint = (f" Raise gpu_budget_bytes above {_gib(bytes_needed)} (and what the allocator needs beside "
                    "it), or make this operator smaller (a smaller batch or sequence length).")
        why = f" ({detail})" if detail else ""
        super().__init__(
            f"kernel {kernel} ({name}) touches {tensors} tensors of {_gib(bytes_needed)} at once{why}, "
            f"more than the GPU budget of {_gib(budget)}: no plan can fit it.{hint}"
        )


def _gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB ({b} bytes)"


def working_sets(trace: dict) -> list[tuple[int, int]]:
    """Per kernel: (bytes of the tensors it accesses, how many tensors)."""
    n = len(trace["kernels"])
    ws = [0] * n
    cnt = [0] * n
    for t in trace["tensors"]:
        for k in t["accesses"]:
            ws[k] += t["bytes"]
            cnt[k] += 1
    return list(zip(ws, cnt))


def check_working_sets(trace: dict, gpu_budget_bytes: int) -> None:
    """Raise :class:`WorkingSetTooLarge` for the kernel with the largest working set if it
    exceeds ``gpu_budget_bytes`` (the scheduler's check, ``teraio.select_budgets``)."""
    import teraio

    if not trace["kernels"]:
        return
    got = teraio.select_budgets(gpu_budget_bytes, trace=teraio.Trace.from_dict(trace))
    nf = got.get("never_fits")
    if nf is not None:
        raise WorkingSetTooLarge(nf["kernel"], nf["name"], nf["needed_bytes"], nf["capacity_bytes"],
                                 working_sets(trace)[nf["kernel"]][1])
