"""Activation checkpointing of chosen layers, as a Session's plan decides (``checkpoint_layers``).

A model's layers are the entries of its outermost ``ModuleList`` (``model.layers``,
``model.model.layers``, ``transformer.h``): the ones the profiler numbers (a kernel's ``layer``).
Checkpointing layer ``i`` runs its forward under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``: its activations are not kept for backward but made again there, from its
inputs, by running its forward once more (the random number generators' states restored, so the
results are the same bits). A layer of Hugging Face transformers (``GradientCheckpointingLayer``)
is switched by its own per-layer attributes (``gradient_checkpointing`` and
``_gradient_checkpointing_func``, as ``gradient_checkpointing_enable`` sets them for every layer),
so the library's own rules hold (a key-value cache is not used while checkpointing); any other
layer's ``forward`` is replaced on the instance (the class is untouched) by one that calls the
original under ``checkpoint``, with the keyword arguments ``use_cache`` set to False and
``past_key_values``, ``past_key_value``, ``layer_past`` to None where given (a cache the forward
appends to would be appended to again by the recomputation). Which layers: the scheduler's
``checkpoint::choose_layers`` (``teraio.choose_checkpoint``) from the profiled trace, or the
caller's list.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def layer_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's layers: the entries of its one outermost ``ModuleList``; ``ValueError``
    saying why where there is none, or more than one, or its layers hold lists of their own
    (then the profiler's layer numbers are not the entries')."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError("the model has no torch.nn.ModuleList of layers: there is no layer to checkpoint")
    outer = [(n, m) for n, m in lists if not any(n != o and n.startswith(o + ".") for o, _ in lists)]
    if len(outer) != 1:
        names = ", ".join(repr(n) for n, _ in outer)
        raise ValueError(f"the model has {len(outer)} outermost ModuleLists ({names}): which one holds the "
                         "layers to checkpoint is not clear")
    name, layers = outer[0]
    inner = [n for n, _ in lists if n.startswith(name + ".")]
    if inner:
        raise ValueError(f"the layers of {name!r} hold ModuleLists of their own ({inner[0]!r}): the profiler "
                         "numbers kernels by the innermost list, so its layers are not these")
    return list(layers)


def checked_layers(model: torch.nn.Module, layers: list[int]) -> list[torch.nn.Module]:
    """The model's layers (:func:`layer_modules`), once every one of ``layers`` is one of them;
    else ``ValueError`` naming the first that is not."""
    mods = layer_modules(model)
    bad = [i for i in layers if not 0 <= i < len(mods)]
    if bad:
        raise ValueError(f"checkpoint_layers: layer {bad[0]} is not one of the model's {len(mods)} layers "
                         f"(0 to {len(mods) - 1})")
    return mods


class Checkpointed:
    """Layers of a model checkpointed (their ``forward`` wrapped) until :meth:`undo`."""

    def __init__(self, model: torch.nn.Module, layers: list[int]) -> None:
        mods = checked_layers(model, layers)
        self.layers = sorted(set(layers))
        # (module, attribute, the instance's own value before or _ABSENT)
        self._undo: list[tuple[torch.nn.Module, str, Any]] = []
        from torch.utils.checkpoint import checkpoint

        for i in self.layers:
            m = mods[i]
            if _library_switch(m):
                self._set(m, "gradient_checkpointing", True)
                self._set(m, "_gradient_checkpointing_func", functools.partial(checkpoint, use_reentrant=False))
                continue
            orig = m.forward

            def forward(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
                for k in _NO_CACHE:
                    if kwargs.get(k) is not None:
                        kwargs[k] = None
                if kwargs.get("use_cache"):
                    kwargs["use_cache"] = False
                return checkpoint(_orig, *args, use_reentrant=False, **kwargs)

            self._set(m, "forward", forward)

    def _set(self, m: torch.nn.Module, name: str, value: Any) -> None:
        self._undo.append((m, name, m.__dict__.get(name, _ABSENT)))
        setattr(m, name, value)

    def undo(self) -> None:
        """Every checkpointed layer as it was."""
        for m, name, before in reversed(self._undo):
            if before is _ABSENT:
                m.__dict__.pop(name, None)
            else:
                setattr(m, name, before)
        self._undo.clear()


_ABSENT = object()
# keyword arguments of a layer's forward that hand it a key-value cache it appends to
_NO_CACHE = ("past_key_values", "past_key_value", "layer_past")


def _library_switch(m: torch.nn.Module) -> bool:
    """Whether the layer checkpoints itself when told (transformers' ``GradientCheckpointingLayer``:
    the class attribute ``gradient_checkpointing`` and a ``_gradient_checkpointing_func`` slot)."""
    return isinstance(getattr(type(m), "gradient_checkpointing", None), bool) \
        and hasattr(type(m), "_can_checkpoint_with_cache")
