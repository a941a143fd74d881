"""``torch.optim`` optimizers whose step runs teraio's host kernels (``teraio.adamw_step``,
``teraio.sgd_step``: SIMD, multi-threaded, in Rust) on CPU float32 parameters.

:class:`HostAdamW`, :class:`HostAdam` and :class:`HostSGD` are subclasses of
``torch.optim.AdamW``, ``Adam`` and ``SGD``: the constructor checks, ``param_groups``,
``state_dict()`` / ``load_state_dict()`` (same keys: ``step`` as a float32 tensor, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``), step hooks and LR schedulers are
PyTorch's own, so a checkpoint moves between them and PyTorch's optimizers in both directions.
Only ``step()`` differs: the hyperparameters are read from each group at every step and the
update is ``torch.optim``'s single-tensor (``foreach=False``) CPU rule, bitwise except where
Adam's denominator takes a square root (PyTorch's float32 ``sqrt`` is within 1 ulp, teraio's
correctly rounded; docs/TORCH.md, "Host optimizer").

Parameters, gradients and states must be CPU float32 tensors, dense and contiguous (an error
names the one that is not). ``threads``: at most this many threads per tensor (None: every
core; a tensor under 64 Ki elements per thread uses fewer).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import teraio

__all__ = ["HostAdamW", "HostAdam", "HostSGD"]


def _scalar_dtype() -> torch.dtype:
    """The dtype PyTorch's Adam keeps ``state['step']`` in (float32 unless the default dtype is
    float64)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _written(*tensors: Optional[torch.Tensor]) -> None:
    """Tell autograd the tensors were modified in place (the kernels write through their data
    pointers, which autograd does not see), as PyTorch's in-place operators do."""
    bump = getattr(torch.autograd.graph, "increment_version", None)
    if bump is not None:
        for t in tensors:
            if t is not None:
                bump(t)


def _check_threads(threads: Optional[int]) -> Optional[int]:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads = {threads!r}: a thread count is an int >= 1 (None: every core)")
    return threads


def _grad(p: torch.Tensor, who: str) -> torch.Tensor:
    grad = p.grad
    assert grad is not None
    if grad.is_sparse:
        raise RuntimeError(f"{who} does not support sparse gradients")
    return grad


class _HostAdamStep:
    """The step of :class:`HostAdamW` and :class:`HostAdam` (a mixin ahead of PyTorch's class)."""

    param_groups: list[dict[str, Any]]
    state: Any
    #: threads per tensor (None: every core); an instance attribute set by the constructor
    #: (class defaults here: an unpickled optimizer has only PyTorch's own attributes)
    _threads: Optional[int] = None
    #: AdamW (True), Adam (False) or the group's ``decoupled_weight_decay`` (None)
    _decoupled: Optional[bool] = None

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        who = type(self).__name__
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            amsgrad = bool(group["amsgrad"])
            decoupled = self._decoupled
            if decoupled is None:
                decoupled = bool(group.get("decoupled_weight_decay", False))
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = _grad(p, who)
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if amsgrad:
                        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad and "max_exp_avg_sq" not in state:  # amsgrad switched on later
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step_t = state["step"]
                step = float(step_t) + 1
                max_sq = state["max_exp_avg_sq"] if amsgrad else None
                teraio.adamw_step(
                    p, grad, state["exp_avg"], state["exp_avg_sq"],
                    step=step, lr=float(group["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                    amsgrad=amsgrad, max_exp_avg_sq=max_sq, maximize=bool(group["maximize"]),
                    decoupled_weight_decay=decoupled, threads=self._threads,
                )
                if torch.is_tensor(step_t):
                    step_t += 1
                else:
                    state["step"] = torch.tensor(step, dtype=_scalar_dtype())
                _written(p, state["exp_avg"], state["exp_avg_sq"], max_sq)
        return loss


class HostAdamW(_HostAdamStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs on the host in teraio's kernels (see the module).
    Same arguments and defaults, without ``foreach``/``fused``/``capturable``/``differentiable``
    (a host step is none of them); ``threads`` caps the threads per tensor."""

    _decoupled = True

    def __init__(
        self,
        params: Any,
        lr: Any = 1e-3,
        betas: tuple[Any, Any] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        threads: Optional[int] = None,
    ) -> None:
        self._threads = _check_threads(threads)
        self._decoupled = True
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=False,
        )


class HostAdam(_HostAdamStep, torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay) whose step runs on the host in teraio's kernels;
    as :class:`HostAdamW`. A group with ``decoupled_weight_decay=True`` (PyTorch >= 2.6's Adam
    option, or a loaded AdamW state) steps as AdamW."""

    _decoupled = None

    def __init__(
        self,
        params: Any,
        lr: Any = 1e-3,
        betas: tuple[Any, Any] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        threads: Optional[int] = None,
    ) -> None:
        self._threads = _check_threads(threads)
        self._decoupled = None
        super().__init__(
            params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            maximize=maximize, foreach=False,
        )


class HostSGD(torch.optim.SGD):
    """``torch.optim.SGD`` whose step runs on the host in teraio's kernels; as
    :class:`HostAdamW`."""

    _threads: Optional[int] = None

    def __init__(
        self,
        params: Any,
        lr: Any = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        threads: Optional[int] = None,
    ) -> None:
        self._threads = _check_threads(threads)
        super().__init__(
            params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
            nesterov=nesterov, maximize=maximize, foreach=False,
        )

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter that has a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            momentum = float(group["momentum"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = _grad(p, "HostSGD")
                buf = None
                fresh = False
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        fresh = True
                        buf = torch.empty_like(p, memory_format=torch.contiguous_format)
                teraio.sgd_step(
                    p, grad, buf, lr=float(group["lr"]), momentum=momentum,
                    dampening=float(group["dampening"]), weight_decay=float(group["weight_decay"]),
                    nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]),
                    fresh_buffer=fresh, threads=self._threads,
                )
                if fresh:
                    self.state[p]["momentum_buffer"] = buf
                _written(p, buf)
        return loss
