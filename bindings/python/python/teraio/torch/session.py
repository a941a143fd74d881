"""The three-line wrapper around an existing training loop.

::

    import teraio.torch
    session = teraio.torch.Session(model, optimizer, engine={"dir": "/mnt/nvme/teraio", "files": 4,
                                   "file_size": "64G"}, gpu_budget_bytes=40 << 30)
    for batch in loader:
        with session.step():
            loss = model(batch); loss.backward(); optimizer.step(); optimizer.zero_grad()

What each step does:

1. The optimizer is made plannable (:func:`teraio.torch.make_plannable`: the same math in
   chunks), so no kernel touches every parameter at once.
2. Until a plan exists for the iteration's shapes, a step is *profiled*
   (:class:`teraio.torch.Profiler`) and, when a GPU budget is given, *paged*
   (:class:`teraio.torch.pager.Pager`: demand paging through the engine, so even the first
   iterations fit the budget).
3. After ``profile_steps`` profiled steps of the same shapes, the last trace (each operator
   timed by its median over those steps that ran the same operators) goes to the scheduler's
   plan selection (``teraio.select``, what ``teraio plan`` runs: the budget and what the
   allocator needs beside it, the working-set check, the policy's plan, the second plan for
   slower transfers, and the pager's schedule where no other plan runs); a kernel that alone
   exceeds the budget is named (:class:`teraio.torch.WorkingSetTooLarge`), in the first
   profiled step already. The plan is cached by the iteration's first operator's shapes (its
   input), so a small set of shapes (variable sequence lengths) is planned once each.
4. At a step's first operator a cached plan for its shapes runs
   (:class:`teraio.torch.planned.PlannedRun`: the engine's plan executor, docs/EXECUTOR.md,
   driven by the operator count); where this build of the Python package has no executor,
   such steps run paged without recording, and :meth:`Session.report` says so (``"mode":
   "paged"``, the reason in ``planned_failed``).

:meth:`Session.report` gives per-step figures (time, stall, bytes moved, peak memory); with
``report_every=N`` (default 1) a one-line report is printed every N steps (``log``, default print).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._storages import covers, flat_args, run_op, set_trainer_stream, signature, storage_key, storage_of
from .fsdp import claim as claim_fsdp
from .fsdp import named_parameters
from .checkpoint import Checkpointed, checked_layers, layer_modules
from .host_offload import offload_optimizer
from .optimizer import WorkingSetTooLarge, auto_chunk_bytes, make_plannable, working_sets
from .planned import Diverged, PlanEntry, PlannedRun, Results, keep_last
from .profiler import Profiler, peak_bytes
from .pager import Pager, StorageMover, Store


def _open_engine(engine: Any, device: torch.device) -> Any:
    """The Session's engine: a ``teraio.Engine`` as given, or opened from a dict of keyword
    options or a configuration file. For CUDA tensors an engine the Session opens gets the
    model's GPU (``gpu={"device": N}``) unless its configuration names one; an engine given
    without a GPU is refused, saying what to add."""
    import teraio

    gpu = {"device": device.index if device.index is not None else torch.cuda.current_device()} \
        if device.type == "cuda" else None
    if engine is None:
        raise ValueError(
            "Session(engine=...) is required with gpu_budget_bytes: where the engine keeps what leaves the "
            "GPU, e.g. engine={\"dir\": \"/mnt/nvme/teraio\", \"files\": 4, \"file_size\": \"64G\"} "
            "(docs/TORCH.md)")
    if isinstance(engine, dict):
        # a retaining store keeps a copy after a prefetch: a tensor the step did not change
        # (a weight, a tensor gathered between steps) leaves the GPU again without a write
        opts = {"retain_on_prefetch": True, **engine}
        if gpu is not None and not opts.get("gpu"):
            opts["gpu"] = gpu
        return teraio.Engine(**opts)
    if isinstance(engine, str):
        eng = teraio.Engine(engine)
        if gpu is not None and not (eng.config or {}).get("gpu"):
            eng.close()
            eng = teraio.Engine(engine, gpu=gpu)
        return eng
    if gpu is not None and isinstance(engine, teraio.Engine) and not (engine.config or {}).get("gpu"):
        raise ValueError(
            f"Session(engine=...): the model's tensors are on {device} and the engine given has no GPU: "
            f"open it with gpu={gpu!r} (or [gpu] device = {gpu['device']} in its configuration file), or "
            "pass the engine's options as a dict and the Session adds it")
    return engine


_HARDWARE_FORMS = ("None (this machine's model: measured on first use through the engine, and cached per machine "
                   "and array), \"measure\" (measured again now), a preset name (\"paper\", \"dev\"), a dict of "
                   "hardware fields (teraio.hardware()), or the path of a JSON hardware model (what `teraio simulate "
                   "--hw` and `teraio hw measure -o` write)")


def _hardware(hardware: Any) -> Any:
    """``hardware=`` as the planner takes it: None or ``"measure"`` (this machine's model,
    measured when the first plan is made), a preset name, a dict, or the path of a JSON hardware
    model (what ``teraio simulate --hw`` reads), checked now rather than at the first plan
    minutes later."""
    import os

    if hardware is None or hardware == "measure":
        return hardware
    if not isinstance(hardware, (str, os.PathLike, dict)):
        raise ValueError(f"Session(hardware={hardware!r}): a {type(hardware).__name__} is not a hardware model; "
                         f"pass {_HARDWARE_FORMS}")
    try:
        import teraio
    except ImportError:
        return hardware
    if isinstance(hardware, (str, os.PathLike)) and (os.sep in str(hardware) or str(hardware).endswith(".json")
                                                     or os.path.isfile(hardware)):
        import json

        path = os.fspath(hardware)
        try:
            with open(path) as f:
                hardware = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"Session(hardware={path!r}): cannot read a JSON hardware model there ({e}); "
                             f"pass {_HARDWARE_FORMS}") from None
        if not isinstance(hardware, dict):
            raise ValueError(f"Session(hardware={path!r}): the file holds a JSON {type(hardware).__name__}, not an "
                             "object of hardware fields (what `teraio simulate --hw` reads)")
    if hasattr(teraio, "hardware"):
        try:
            teraio.hardware(hardware)
        except Exception as e:
            raise ValueError(f"Session(hardware={_short(hardware)}): {e}; pass {_HARDWARE_FORMS}") from None
    return hardware


def _short(value: Any) -> str:
    """``repr(value)``, cut short when long (a dict of every hardware field)."""
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def _given(hardware: Any) -> str:
    """How the step log names a hardware model the caller gave."""
    import os

    if isinstance(hardware, dict):
        return "given (a dict of hardware fields)"
    if isinstance(hardware, os.PathLike) or (isinstance(hardware, str) and (
            os.sep in hardware or hardware.endswith(".json") or os.path.isfile(hardware))):
        return f"given (the JSON file {os.fspath(hardware)})"
    return f"given (preset {hardware!r})"


@dataclass
class _TestHooks:
    """What a test puts in a :class:`Session` in place of its engine, executor and planner
    (``Session(..., _hooks=_TestHooks(...))``; not part of the API)."""

    #: any object with the engine's ``offload``/``prefetch``/``free``, used instead of an engine
    store: Store | None = None
    #: ``f(trace_dict, plan, budget_bytes, allocator)`` making the plan executor (default:
    #: ``teraio.Executor``)
    executor_factory: Callable[..., Any] | None = None
    #: ``f(trace_dict, gpu_budget_bytes, host_budget_bytes)`` returning a plan (default:
    #: ``teraio.plan`` with ``policy``/``hardware``)
    planner: Callable[[dict, int, int], Any] | None = None


class Session:
    """Profile, plan and run a training loop's iterations under a GPU memory budget.

    ``engine``: a ``teraio.Engine``, its configuration as a dict of keyword options, or a
    configuration file path (docs/PYTHON.md). ``gpu_budget_bytes``: the memory the iteration's
    tensors may use (None: no budget, nothing is paged). ``host_budget_bytes``: the host tier
    the planner may use (0: SSD only). ``policy``: the planner's (``teraio plan``). ``hardware``: the
    model of the machine plans are made for. None (the default): this machine's, measured through
    the engine when the first plan is made (its array's write and read bandwidth, host memory
    copies, the GPU's pinned copies; a few seconds) and cached per machine and array, so a later
    Session on the same machine and array reads it at once (``teraio.Engine.measure_hardware``;
    ``$TERAIO_CACHE_DIR``, else ``$XDG_CACHE_HOME/teraio``, else ``~/.cache/teraio``);
    ``"measure"``: measured again now (and cached); a preset name (``"paper"``, ``"dev"``), a dict
    of hardware fields, or the path of a JSON model (``teraio hw measure -o``, ``teraio simulate
    --hw``): as given. The step that makes the first plan says in the log which model the plans
    use (:attr:`hardware_source`). A Session given a store that cannot measure (tests) plans for
    ``"paper"`` and says so.
    ``page_min_bytes``: the pager leaves smaller storages in place; ``page_fraction``: on the
    GPU it pages down to this share of the budget (and plans keep it, and keep at least twice the
    trace's largest tensor free: the caching allocator's room to place it; the scheduler's fixed
    allowance). ``allocator_allowance``: what plans leave free beside their tensors for the
    allocator. ``"auto"`` (default): measured where it can be (the CPU path: the memory in use is
    the traced storages, so nothing), the fixed rule of ``page_fraction`` on a GPU;
    ``"measured"``: on a GPU too, from the profiled step's caching-allocator figures (its reserved
    minus allocated peak, and the memory in use the trace does not hold:
    :func:`measured_allowance`); ``"fixed"``: the ``page_fraction`` rule everywhere; an int: that
    many bytes. A kernel whose working set fits the budget is planned whatever the allowance
    (the plan then takes the room the allowance would have kept). ``planned`` (default
    True): steps with a plan run it on the engine's executor (False: every step pages).
    ``gather_between_steps`` (default True): after a planned step every parameter, gradient and
    optimizer state is resident and complete, and writes to them before the next step are seen
    (version counters); when they do not fit the budget together this passes it between steps
    (said once in the log). ``"budget"``: they come back as far as the budget allows (those the
    next step uses first first), the others stay stored with empty storages until the next step
    or :meth:`gathered`; code between steps that touches any of them then runs inside
    ``with session.gathered():`` (PyTorch does not check a storage's size: a kernel reading an
    empty one may crash the process). False keeps the plan's steady state between steps, for
    loops whose code between steps touches none of them (or does so inside ``gathered()``). ``max_ahead`` (GPU, planned steps; 0: no limit): the host
    runs at most this many operators ahead of the GPU, so the executor sees memory freed and
    transfers done close to when the GPU does (a prefetch into memory granted late is ordered
    after all work queued before it). ``recompute`` (default True): traces say how activations
    are made again (their operator, when it is deterministic), so plans may drop and recompute
    some instead of moving them (the planner chooses); False: plans only move tensors.
    ``traffic_margin`` (default 0.03; 0: off): the trace is also planned as if every transfer
    were 30% slower, and that plan is taken when it moves fewer bytes and simulates (on the
    hardware model as given) within this fraction of the first one: on a GPU the copies slow the
    kernels beside them and the host's waits add up, so of two plans the model finds about as
    fast, the one that moves less runs faster (measured on an H200: docs/BENCHMARKS.md).
    ``optimizer_chunk_bytes``: the optimizer steps chunks of at most this many bytes of
    parameters (:func:`make_plannable`; 0: one parameter at a time); default (None): a 32nd of
    the GPU budget (:func:`auto_chunk_bytes`: an AdamW chunk's parameters, gradients and two
    states then take an eighth), no split without a budget. Each chunk is one more call of the
    optimizer's step, tens of microseconds of host time: one parameter at a time costs a bf16
    step on a fast GPU several percent.
    ``optimizer_on`` (default ``"gpu"``): where the optimizer's update runs. ``"gpu"``: where the
    parameters are, its states moved by the plan like any tensor. ``"host"`` (a model on a GPU;
    AdamW, Adam or SGD over float32 parameters): the states and a float32 master copy of each
    parameter stay in page-locked host memory and the update runs there in teraio's kernels
    (:func:`offload_optimizer`): each step moves the gradient down and the parameter up, 8 bytes a
    parameter, and never the states; the host's memory bandwidth sets the update's time. The
    optimizer object, its groups, schedulers, clipping and ``state_dict()`` work as before.
    ``"auto"`` (a model on a GPU, with a ``gpu_budget_bytes``): the first profiled step's trace
    and the hardware model decide, per update of the step (a parameter, or a chunk of
    ``optimizer_chunk_bytes``), where it runs (``teraio.place_optimizer``: each choice planned and
    simulated, the CPU a resource the host updates queue on); the chosen parameters go to the
    host as with ``"host"`` (:func:`offload_optimizer` with ``params=``), the others stay with the
    optimizer's own step; the next step makes their host side (buffers, the states copied off
    the GPU) and is not profiled, the one after it is, with the updates where they now run.
    The step's log line says the choice and the model's times (all-GPU, all-host). Where
    "auto" cannot choose it leaves every update on the GPU and says why once: a model on the CPU
    (the optimizer already runs there), no budget (no plan to weigh), an optimizer or parameters
    the host step does not take (not AdamW/Adam/SGD, not float32, ``capturable``).
    ``placer`` (tests, or a rule of one's own): ``f(trace_dict, gpu_budget_bytes,
    host_budget_bytes)`` returning the placement dict (``teraio.place_optimizer``'s) that "auto"
    applies (default: ``teraio.place_optimizer`` with ``policy`` and ``hardware``); given, it
    is applied on a CPU model too.
    ``checkpoint_layers`` (default None: none): layers (the entries of the model's outermost
    ``ModuleList``) whose activations are not kept but made again in backward by running the
    layer's forward once more (``torch.utils.checkpoint``, non-reentrant; the results are the same
    bits), the plan moving or recomputing the rest. A list: those layers, from the first step.
    ``"auto"`` (with a ``gpu_budget_bytes``): the first profiled step's trace decides
    (``teraio.choose_checkpoint``: the trace rewritten as checkpointing each of a few layer sets
    would make it, each planned and simulated on the hardware model; chosen only where that is
    at least 2% faster than the plan without); the chosen layers are checkpointed from the next
    step, which is profiled and planned. The step's record says the choice (``"checkpoint"``),
    the log says it once; :attr:`checkpointed_layers` holds the layers.
    ``plan_margin`` (default 0): plans are made for this fraction less than the executor's
    budget. On a GPU the host runs ahead of the device, so the executor sees an offload's memory
    freed later than the plan's timing does; the margin is the slack that keeps the host from
    waiting for it (the plan moves or recomputes a little more instead).
    ``time_gpu`` (GPU, planned steps): CUDA events around every operator, so each step reports
    the GPU's own busy time and where it waited (``gpu_busy_s``, ``gpu_gap_s``, ``top_gaps``).
    ``profile_gpu_time`` (GPU, profiled steps): each operator's duration in the trace is its
    kernels' own GPU time (a spin kernel queued where the GPU caught up with the host keeps the
    launch out of it); False: an operator launched while the GPU waited for the host counts its
    launch too, so plans see the profiler's host pace. Default (None): on with
    ``checkpoint_layers="auto"``, whose choice it makes on the GPU's time (on an H100, the
    zoo's Llama 200 M in fp32 at 1/2.5 of its peak: 6 layers instead of 2, 1.24x faster).
    ``host_waits`` (GPU, planned steps; default False): the engine's workers wait for the GPU
    and copy an offload to the host tier themselves, and the executor waits on the host until
    the copy is done before the memory is reused (as before 2026-12-02); by default the copy is
    queued on the device and the trainer's stream, not the host, waits for it where the memory
    is needed again.
    ``bounded_shapes`` (default True): the first step of a new input shape, when a larger shape
    of the same iteration has a plan (every operator's tensors at least as large), runs under
    that plan while it is profiled (its executor takes the trace's sizes as upper bounds: the
    budget holds), instead of paging; the new shape's own plan is made from that step's profile
    (the step's report says ``bounded``). False: a new shape's first step pages.
    ``verify_recompute`` (default True): the first step of each plan (and each bounded step)
    copies every tensor it drops for a recomputation to the host first and compares the
    recomputation with it bitwise (the step's record counts them, ``recomputations_checked``);
    an operator whose kernel does not reproduce its bytes on this device (e.g. one that picks
    its algorithm by where its memory lies) gets the first bytes back, is never recomputed
    again, and the plans recomputing it are made again (said once in the log). False: no copy.
    ``keep_steps`` (default 1000): :attr:`steps` keeps the records of at least this many latest
    steps (at most twice as many: older ones are dropped, the training may run for millions).
    ``_hooks`` (tests): a :class:`_TestHooks`, what a test puts in place of the engine, the
    executor and the planner.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        engine: Any = None,
        gpu_budget_bytes: int | None = None,
        host_budget_bytes: int = 0,
        policy: str = "auto",
        hardware: Any = None,
        optimizer_chunk_bytes: int | None = None,
        optimizer_on: str = "gpu",
        placer: Callable[[dict, int, int], dict] | None = None,
        profile_steps: int = 1,
        warmup_steps: int = 0,
        report_every: int = 1,
        device: torch.device | str | None = None,
        page_min_bytes: int = 1 << 16,
        page_fraction: float = 0.85,
        allocator_allowance: Any = "auto",
        planned: bool = True,
        gather_between_steps: bool = True,
        max_ahead: int = 0,
        recompute: bool = True,
        time_gpu: bool = False,
        profile_gpu_time: bool | None = None,
        host_waits: bool = False,
        traffic_margin: float = 0.03,
        plan_margin: float = 0.0,
        checkpoint_layers: Any = None,
        keep_steps: int = 1000,
        bounded_shapes: bool = True,
        verify_recompute: bool = True,
        log: Callable[[str], None] = print,
        _hooks: _TestHooks | None = None,
    ) -> None:
        hooks = _hooks if _hooks is not None else _TestHooks()
        store, executor_factory, planner = hooks.store, hooks.executor_factory, hooks.planner
        if gpu_budget_bytes is not None and gpu_budget_bytes <= 0:
            raise ValueError(f"gpu_budget_bytes must be > 0 or None, got {gpu_budget_bytes}")
        if host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
        if profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {profile_steps}")
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        self.keep_steps = keep_steps
        self.bounded_shapes = bounded_shapes
        self.verify_recompute = verify_recompute
        if not 0.0 <= plan_margin < 0.5:
            raise ValueError(f"plan_margin must be in [0, 0.5), got {plan_margin}")
        self.plan_margin = plan_margin
        if not (allocator_allowance in ("auto", "measured", "fixed")
                or (isinstance(allocator_allowance, int) and not isinstance(allocator_allowance, bool)
                    and allocator_allowance >= 0)):
            raise ValueError(f"allocator_allowance must be 'auto', 'measured', 'fixed' or a number of bytes >= 0, "
                             f"got {allocator_allowance!r}")
        self.allocator_allowance = allocator_allowance

        self.model = model
        if optimizer_on not in ("gpu", "host", "auto"):
            raise ValueError(f"optimizer_on must be 'gpu' (the step runs where the parameters are; the plan "
                             f"moves the optimizer's states), 'host' (the states stay in host memory and the "
                             f"step runs there) or 'auto' (the planner chooses per parameter), got {optimizer_on!r}")
        self.optimizer_on = optimizer_on
        self.placer = placer
        # optimizer_on="auto": the placement chosen (teraio.place_optimizer's dict), once made;
        # and why "auto" leaves every update on the GPU, when it cannot choose
        self.placement: dict[str, Any] | None = None
        self._auto_off: str | None = None
        # the step after a placement makes the host side of the updates it moved (buffers, the
        # states copied off the GPU) once: it is not the iteration that repeats
        self._settling = False
        if optimizer_on == "auto":
            self._auto_off = _auto_unavailable(optimizer, device, gpu_budget_bytes, placer is not None)
            if self._auto_off is not None:
                log(f"teraio: optimizer_on='auto': every optimizer update stays on the GPU ({self._auto_off})")
        if optimizer_on == "host":
            first = next((p for g in optimizer.param_groups for p in g["params"]), None)
            where = torch.device(device) if device is not None else (first.device if first is not None else None)
            if where is None or where.type != "cuda":
                raise ValueError(f"optimizer_on='host' moves the optimizer's step off the GPU; this model is on "
                                 f"{where}: leave optimizer_on='gpu' (on the CPU, teraio.torch.HostAdamW runs "
                                 "teraio's host kernels)")
            offload_optimizer(optimizer)
        if optimizer_chunk_bytes is None:
            optimizer_chunk_bytes = auto_chunk_bytes(gpu_budget_bytes)
        self.optimizer = make_plannable(optimizer, optimizer_chunk_bytes)
        self.budget = gpu_budget_bytes
        self.host_budget = host_budget_bytes
        self.policy = policy
        self.hardware = hardware
        self.profile_steps = profile_steps
        self.warmup_steps = warmup_steps
        self.report_every = report_every
        self.log = log
        self.executor_factory = executor_factory
        # planned steps run on the engine's executor (False: every step pages); after each
        # planned step every global tensor is gathered back (resident, complete) so code between
        # steps sees them all; without it the plan's steady state stays (faster, and then only
        # the next step may touch parameters, gradients and optimizer states)
        self.planned = planned
        if gather_between_steps not in (True, False, "budget"):
            raise ValueError("gather_between_steps must be True (every parameter, gradient and optimizer "
                             "state back between steps), 'budget' (as many as the budget allows) or False "
                             f"(none), got {gather_between_steps!r}")
        self.gather_between_steps = gather_between_steps
        self._left_off_said = False
        if max_ahead < 0:
            raise ValueError(f"max_ahead must be >= 0, got {max_ahead}")
        self.max_ahead = max_ahead
        self.time_gpu = time_gpu
        self.host_waits = host_waits
        if not 0 <= traffic_margin < 1:
            raise ValueError(f"traffic_margin must be in [0, 1), got {traffic_margin}")
        self.traffic_margin = traffic_margin
        self.planner = planner
        if profile_gpu_time is None:
            # (measured where checkpoint_layers="auto" chooses: docs/BENCHMARKS.md, "Profiles
            # timed by the GPU")
            profile_gpu_time = checkpoint_layers == "auto"
        if not isinstance(profile_gpu_time, bool):
            raise ValueError(f"profile_gpu_time must be True, False or None (on with checkpoint_layers='auto'), "
                             f"got {profile_gpu_time!r}")
        self.profiler = Profiler(model, optimizer, device=device, producers=recompute, gpu_time=profile_gpu_time)
        self.device = self.profiler.device
        # checkpoint_layers: the layers checkpointed (a Checkpointed, undone at close), and
        # whether "auto" still has to choose (at the first profiled step)
        self._checkpointed: Checkpointed | None = None
        self._choose_checkpoint = False
        ckpt_now: list[int] = []
        if checkpoint_layers == "auto":
            if gpu_budget_bytes is None:
                raise ValueError("checkpoint_layers='auto' weighs plans under a budget: give gpu_budget_bytes, "
                                 "or a list of layers")
            layer_modules(model)  # (a model without a clear list of layers: said now)
            self._choose_checkpoint = True
        elif checkpoint_layers is not None:
            if isinstance(checkpoint_layers, (str, bytes)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in checkpoint_layers):
                raise ValueError(f"checkpoint_layers must be None, 'auto' or a list of layer numbers, "
                                 f"got {checkpoint_layers!r}")
            ckpt_now = list(checkpoint_layers)
            if ckpt_now:
                checked_layers(model, ckpt_now)  # (wrapped at the end, once nothing else can fail)
        # under FSDP2 (teraio.torch.fsdp): FSDP's unsharded parameter storages are FSDP's, not
        # traced nor moved; their peak, sampled in profiled steps, is kept out of plans' budget
        self.fsdp = claim_fsdp(model)
        self._trainer_stream: Any = None
        if self.fsdp is not None:
            self.profiler.after_op = self.fsdp.sample
        if planner is None:
            self.hardware = _hardware(hardware)
            _check_policy(policy)
        self._hardware_given = hardware
        # the model plans are made for, once known (the first plan), and what the log said of it
        self._hardware_model: Any = None
        self.hardware_source: str | None = None
        if _compiled(model):
            # (the dispatch mode sees the compiled graph's operators only eagerly: TorchDynamo
            # runs the model's Python under teraio's mode, which falls back to eager)
            log("teraio: the model is compiled (torch.compile); under a Session its steps run eagerly, "
                "with the same results")
        self._engine = None
        if store is None and gpu_budget_bytes is not None:
            store = self._engine = _open_engine(engine, self.device)
        self.store = store
        if self.hardware == "measure" and planner is None and store is not None \
                and not hasattr(store, "measure_hardware"):
            raise ValueError("Session(hardware='measure'): measuring this machine needs a teraio engine "
                             "(engine=...); the store given cannot measure: pass another hardware model")
        cuda = self.device.type == "cuda"
        if cuda and gpu_budget_bytes is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            if gpu_budget_bytes > total:
                raise ValueError(
                    f"gpu_budget_bytes {gpu_budget_bytes} is above {self.device}'s memory ({total} bytes): "
                    "lower gpu_budget_bytes (the memory the iteration's tensors may use)")
        # paging (warm-up and profiled steps) uses the host tier when the planner may
        self.mover = StorageMover(store, destination="host" if host_budget_bytes > 0 else "ssd") \
            if store is not None else None
        self.pager = None
        if gpu_budget_bytes is not None and self.mover is not None:
            used = (lambda: torch.cuda.memory_allocated(self.device)) if cuda else None
            # on the GPU the next operator's results must fit beside what stays: page down to
            # `page_fraction` of the budget (an operator that still runs out is retried after
            # everything it does not use went out)
            target = int(gpu_budget_bytes * (page_fraction if cuda else 1.0))
            self.pager = Pager(self.mover, target, min_bytes=page_min_bytes, used_bytes=used)
            # an operator whose own storages exceed the budget stops the first step, named
            self.pager.limit_bytes = gpu_budget_bytes
            self.profiler.pager = self.pager
        # what plans and the executor account against: on a GPU the trace's tensors are not all
        # the memory a step allocates (cuBLAS workspaces, the allocator's rounding), so plans
        # keep `page_fraction` of the budget, as the pager does
        self._plan_fraction = page_fraction if cuda else 1.0
        # and (the scheduler's fixed allowance) below the budget by twice the trace's largest
        # tensor, set from the profiled trace on a GPU
        self._largest_tensor = 0
        # what the allocator needed beside the traced tensors in the last profiled step
        # (_measure_allowance), once measured
        self._measured_allowance: int | None = None
        # plan key (_plan_key: the whole operator sequence) -> its profile, plan and run
        self.plans: dict[Any, PlanEntry] = {}
        # the plan whose run holds the global tensors now (at most one: see _planned_run)
        self._live_key: Any = None
        # the iteration's first operator's signature -> the plans that start with it, and the
        # operator from which on one step can be told from another (_Group)
        self._groups: dict[Any, _Group] = {}
        self._profiled: dict[Any, int] = {}
        self._profiled_times: dict[Any, list[tuple[Any, list[float]]]] = {}
        self.steps: list[dict[str, Any]] = []
        self._alloc_counts: dict[str, int] | None = None
        self.step_count = 0  # steps begun (``steps`` keeps the latest ``keep_steps``)
        self.closed = False
        if ckpt_now:
            self._checkpointed = Checkpointed(model, ckpt_now)

    # ---- the step ----------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self) -> Iterator["Session"]:
        """One training iteration (forward, backward, optimizer step)."""
        if self.closed:
            raise RuntimeError("the session is closed")
        n = self.step_count
        self.step_count += 1
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            # (the counters at the last step's end, unless something ran in between)
            alloc0 = self._alloc_counts if self._alloc_counts is not None else _allocator_counts(self.device)
        moved0 = (self.mover.bytes_out + self.mover.bytes_in) if self.mover else 0
        wait0 = self.pager.wait_s if self.pager else 0.0
        if cuda and self.fsdp is not None:
            # (FSDP runs operators on its own streams: ordered against this one, see run_op)
            self._trainer_stream = torch.cuda.current_stream(self.device)
            set_trainer_stream(self._trainer_stream)
        t0 = time.perf_counter()
        mode = _StepMode(self, n)
        # the pager learns the global storages at the first operator, if the step is profiled
        self.profiler.begin(seed_pager=False)
        mode.__enter__()
        failed = False
        try:
            yield self
        except BaseException:
            failed = True
            raise
        finally:
            # (a planned step may have left the mode for its last operators: unwatched)
            try:
                mode.close()
            finally:
                set_trainer_stream(None)
            if failed:
                # the loop's own error surfaces as itself: the step is abandoned, nothing of it
                # recorded, every tensor brought back, and the next step starts afresh
                self._abandon(mode)
            elif mode.run is None:
                if not mode.paged_only:
                    self.profiler.end()
                self._restore_paged()
        rec: dict[str, Any] = {"step": n}
        if mode.run is not None:
            run = mode.run
            rep = run.end_iteration()
            rec["mode"] = "planned"
            rec["executor"] = rep
            if run.gather and run.gathers:
                rec["gathered"] = run.gathers[-1]
                g = rec["gathered"] if isinstance(rec["gathered"], dict) else {}
                self._say_gather(run, g)
            rec["top_stalls"] = run.top_stalls()
            if run.recomputed:
                rec["recomputed"] = run.recomputed
            if run.verified:
                rec["recomputations_checked"] = run.verified
            if run.unstable:
                rec["unstable_recompute"] = list(run.unstable)
                self._unstable(run.unstable)
            elif not run.bounded and mode.key in self.plans:
                self.plans[mode.key].verified = True
            if run.oom_retries:
                # operators that ran out of memory within the budget and ran again
                rec["oom_retries"] = run.oom_retries
                rec["made_room_bytes"] = run.made_room_bytes
            gaps = run.gpu_gaps()
            if gaps is not None:
                rec.update(gaps)
            if run.max_ahead:
                rec["ahead_wait_s"] = run.ahead_wait_s
            # the executor's own figure when its report has one, else the time in before_kernel
            rec["stall_s"] = rep["stall_s"] if isinstance(rep, dict) and "stall_s" in rep \
                else run.stall_s - mode.stall0
            if isinstance(rep, dict) and isinstance(rep.get("store"), dict):
                st = rep["store"]
                ways = ("ssd_write", "ssd_read", "host_write", "host_read")
                rec["planned_bytes_moved"] = sum(st.get(d, {}).get("bytes", 0) for d in ways)
                # where the plan's bytes went and how long the store was busy moving them, and the
                # host-tier offloads that found the tier full and went to SSD
                rec["store"] = {d: {"bytes": st[d].get("bytes", 0), "busy_s": st[d].get("busy_ns", 0) / 1e9}
                                for d in ways if isinstance(st.get(d), dict) and st[d].get("ops")}
                rec["store"]["host_fallbacks"] = st.get("host_fallbacks", 0)
            if run.diverged is not None:
                rec["diverged"] = str(run.diverged)
                self._diverged(mode.key, run.diverged)
            elif mode.key in self.plans:
                self.plans[mode.key].diverged_n = 0
            if mode.decided_at is not None:
                rec["decided_at"] = mode.decided_at
            if run.bounded:
                # (its executor let go, every global back, then the profile is built)
                rec["mode"] = "bounded"
                # (the operator that reads the input: where shapes tell plans apart)
                rec["bounded_by"] = _shapes(self.plans[mode.bound_key].signatures[self._input_op(mode.bound_key)]) \
                    if mode.bound_key in self.plans else "a plan dropped since"
                self._end_bounded(mode)
        else:
            rec["mode"] = "paged" if self.pager is not None else "profiled"
            rec["stall_s"] = (self.pager.wait_s - wait0) if self.pager else 0.0
            if mode.fallback:
                rec["planned_failed"] = mode.fallback
                rec["paging"] = f"its plan cannot run here: {mode.fallback}"
        chosen = self.plans.get(mode.key)
        if rec["mode"] == "planned" and chosen is not None and (chosen.selection or {}).get("choice") == "paging":
            rec["paging"] = "the pager's schedule as a plan: no other plan runs in the budget"
        if cuda:
            torch.cuda.synchronize(self.device)
        rec["time_s"] = time.perf_counter() - t0
        rec["bytes_moved"] = ((self.mover.bytes_out + self.mover.bytes_in) - moved0) if self.mover else 0
        rec["bytes_moved"] += rec.pop("planned_bytes_moved", 0)
        rec["ops"] = mode.k
        if mode.run is not None and mode.run.unwatched_ops:
            # operators run without the dispatch mode (the plan had nothing to do there)
            rec["unwatched_ops"] = mode.run.unwatched_ops
        if cuda:
            rec["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
            # the caching allocator's work since the last step ended (this step, and whatever
            # the loop ran between them): cudaMalloc/cudaFree calls, and retries after freeing
            # its cache (each one synchronizes the device); one read of its counters a step
            counts = _allocator_counts(self.device)
            rec["allocator"] = {k: v - alloc0[k] for k, v in counts.items()}
        if (mode.run is None or mode.run.bounded) and not mode.paged_only:
            self._after_profile(n, rec, mode.state0)
        # a session lives as long as the training: its records are bounded (every object kept
        # is one more for Python's garbage collector to walk in a full collection)
        keep_last(self.steps, rec, self.keep_steps)
        if cuda:
            self._alloc_counts = counts
        if self.report_every and (n + 1) % self.report_every == 0:
            self.log(self.line(rec))

    def _say_gather(self, run: PlannedRun, g: dict[str, Any]) -> None:
        """Once per session: the gather between steps passed the budget, or left tensors
        stored to keep it."""
        if self._left_off_said or run.bounded or not g:
            return
        if g.get("left_off"):
            self._left_off_said = True
            self.log(f"teraio: between steps {g['left_off']} parameter, gradient and optimizer-state "
                     f"tensors ({g['left_off_bytes'] / 1e9:.2f} GB) stay in the store to keep the budget "
                     "(gather_between_steps='budget'); code between steps that reads or writes them runs "
                     "inside `with session.gathered():`")
        elif run.gather is True and g.get("used_bytes", 0) > run.budget:
            self._left_off_said = True
            self.log(f"teraio: between steps the parameters, gradients and optimizer states take "
                     f"{g['used_bytes'] / 1e9:.2f} GB, past the budget of {run.budget / 1e9:.2f} GB; "
                     "Session(gather_between_steps='budget') keeps the budget (code between steps that "
                     "touches them then runs inside `with session.gathered():`)")

    @contextlib.contextmanager
    def gathered(self) -> Iterator["Session"]:
        """Between steps: every parameter, gradient and optimizer state resident and complete
        inside the block, past the budget if they do not fit it (evaluation, a checkpoint, code
        that reads or writes them all); writes inside it are seen by the next step. The next
        planned step puts them back where its plan starts them. (Also with
        ``gather_between_steps=False``.)"""
        key = self._live_key
        entry = self.plans.get(key) if key is not None else None
        run = entry.run if entry else None
        if run and (run.gather is False or run.left_off):
            run.gather_globals(None)
        if self.pager is not None:
            self.pager.restore_all()  # (what a paged step left stored)
        yield self

    def _restore_paged(self) -> None:
        """A paged or profiled step's end: what the pager stored comes back as
        ``gather_between_steps`` says (True: all of it; "budget": parameters, gradients and
        optimizer states while they fit the budget; False: none of those). What the trainer
        holds besides them (the loss, outputs) always comes back. What stays stored comes back
        when an operator needs it, or one at a time when the next step's plan starts (so
        parameters, gradients and optimizer states that together pass the budget never have
        to fit at once)."""
        if self.pager is None:
            return
        if self.gather_between_steps is True:
            self.pager.restore_all()
            return
        stay = {storage_key(s) for s in self.profiler._global_storages(stored_too=True)}
        self.pager.restore_all(self.budget if self.gather_between_steps == "budget" else 0, may_stay=stay)

    def _bring(self) -> Any:
        """For a plan's run starting: a stored global comes back through the pager that holds it."""
        return self.pager.bring_back if self.pager is not None else None

    def _abandon(self, mode: "_StepMode") -> None:
        """A step whose body raised: a planned one ends in the executor's safe mode (everything
        it moved read back) and its run is retired; a profiled one is not recorded. Errors of
        this cleanup are secondary: the body's error is the one raised."""
        run = mode.run
        try:
            if run is not None:
                if run.diverged is None:
                    run._diverge(mode.k, Diverged(mode.k, "the step raised an exception"))
                run.end_iteration()
                if run.bounded:
                    self._end_bounded(mode, record=False)
                elif self._live_key == mode.key:
                    self._retire_live_run()
            else:
                self.profiler.abort()
                self._restore_paged()
        except Exception:
            pass

    def _planned_run(self, key: Any, n: int) -> Any:
        """The executor run for this key's plan, or None (no plan, or no executor here).

        At most one run is live at a time: a run's executor holds the global tensors (their
        memory, their stored copies, what it knows of their versions), so before a step runs
        anything else (another shape's plan, a profiled or paged step) the live run finishes:
        every global tensor gathered back and let go, its store copies freed. The next step of
        its shape starts a new executor over the globals as they are then."""
        entry = self.plans.get(key)
        if n < self.warmup_steps or entry is None or entry.plan is None or entry.run is False:
            self._retire_live_run()
            return None
        if self._live_key is not None and self._live_key != key:
            self._retire_live_run()
        if entry.run is None:
            try:
                entry.run = PlannedRun(entry, self.model, self.optimizer, self._entry_budget(entry), self.device,
                                          self.executor_factory or self._planned_executor,
                                          device_memory=self._device_memory(),
                                          gather=self.gather_between_steps, max_ahead=self.max_ahead,
                                          time_gpu=self.time_gpu, host_waits=self.host_waits,
                                          verify_remakes=self.verify_recompute and not entry.verified,
                                          bring=self._bring())
            except (NotImplementedError, Diverged, _teraio_error()) as e:
                entry.run = False
                entry.no_run = str(e)
                return None
            entry.runs_started = entry.runs_started + 1
        self._live_key = key
        return entry.run

    def _input_op(self, key: Any) -> int:
        """The operator of ``key``'s profile that reads the input batch (found when the plan's
        entry was made)."""
        return self.plans[key].input_op

    def _bounding_plan(self, sigs: list[tuple], n: int) -> Any:
        """The plan a step whose first operators have signatures ``sigs`` may run bounded, or
        None: of the plans whose first operators cover them (:func:`covers`: a larger shape of
        the same iteration), the one whose trace holds the fewest bytes. It is taken only once
        ``sigs`` reach past its operator that reads the input batch (:meth:`_input_op`): before
        it, a shorter shape's plan covers a longer one's first operators too (tables a model
        builds from a length given as a number)."""
        if not self.bounded_shapes or n < self.warmup_steps or self.budget is None or not self.planned \
                or self.executor_factory is not None:
            return None
        best = None
        for key, e in self.plans.items():
            if e.plan is None or e.run is False or len(e.signatures) < len(sigs) \
                    or not all(covers(b, g) for b, g in zip(e.signatures, sigs)):
                continue
            size = sum(t["bytes"] for t in e.trace["tensors"])
            if best is None or size < best[0]:
                best = (size, key)
        return None if best is None else best[1]

    def _bounded_run(self, key: Any) -> PlannedRun:
        """A one-step run of ``key``'s plan for a smaller shape, the profiler recording it."""
        return PlannedRun(self.plans[key], self.model, self.optimizer, self._entry_budget(self.plans[key]), self.device,
                          self._planned_executor, device_memory=self._device_memory(), gather=True,
                          max_ahead=self.max_ahead, time_gpu=self.time_gpu, host_waits=self.host_waits,
                          record=self.profiler.dispatch, verify_remakes=self.verify_recompute,
                          bring=self._bring())

    def _end_bounded(self, mode: "_StepMode", record: bool = True) -> None:
        """A bounded step's end: its executor finished (every global tensor back), the pager
        given back to the profiler, the profile built (``record``) or dropped."""
        try:
            _finish_run(mode.run)
        finally:
            self.profiler.pager = mode.bound_pager
            if record:
                self.profiler.end()
            else:
                self.profiler.abort()

    def _retire_live_run(self) -> None:
        """Finish the live run, if any (see :meth:`_planned_run`)."""
        key, self._live_key = self._live_key, None
        entry = self.plans.get(key) if key is not None else None
        if entry is not None and entry.run:
            run, entry.run = entry.run, None
            _finish_run(run)

    def _allowance(self) -> dict[str, Any]:
        """What plans leave free for the allocator beside their tensors, as the scheduler takes
        it (``allocator_allowance``): measured bytes, or the fixed rule of ``page_fraction``."""
        mode = self.allocator_allowance
        if not isinstance(mode, str):
            return {"kind": "measured", "bytes": int(mode)}
        measured = self._measured_allowance
        if measured is not None and (mode == "measured" or (mode == "auto" and self.device.type != "cuda")):
            return {"kind": "measured", "bytes": measured}
        return {"kind": "fixed", "keep_fraction": self._plan_fraction}

    def _budget_options(self) -> dict[str, Any]:
        """The budget part of the scheduler's selection options (``teraio.select``)."""
        return {"allowance": self._allowance(), "plan_margin": self.plan_margin,
                "reserved_bytes": self.fsdp.peak_bytes if self.fsdp is not None else 0}

    @property
    def plan_budget(self) -> int | None:
        """The bytes plans and the executor account against: the budget less what the allocator
        needs beside them (the scheduler's rule, ``teraio.select_budgets``: ``allocator_allowance``),
        less FSDP's unsharded parameters. A plan whose largest working set needs more (but fits
        the budget) runs with more: its entry's ``budget``."""
        if self.budget is None:
            return None
        import teraio

        return teraio.select_budgets(self.budget, largest_tensor_bytes=self._largest_tensor,
                                     **self._budget_options())[0]

    @property
    def planning_budget(self) -> int | None:
        """The GPU bytes plans are made for: :attr:`plan_budget` less ``plan_margin``."""
        if self.budget is None:
            return None
        import teraio

        return teraio.select_budgets(self.budget, largest_tensor_bytes=self._largest_tensor,
                                     **self._budget_options())[1]

    def _measure_allowance(self) -> None:
        """After a profiled step: what the allocator needed beside the traced tensors
        (:func:`measured_allowance`; the hook where a GPU's figures come in: the caching
        allocator's peaks since the step began, ``torch.cuda.memory_stats``)."""
        untraced = 0
        if self.pager is not None:
            untraced, self.pager.untraced_peak_bytes = self.pager.untraced_peak_bytes, 0
        stats = torch.cuda.memory_stats(self.device) if self.device.type == "cuda" else {}
        self._measured_allowance = measured_allowance(stats, untraced)

    def _entry_budget(self, entry: PlanEntry) -> int | None:
        """The bytes a plan's executor runs with: what its selection chose (raised to the
        trace's largest working set where the allowance would leave less), else
        :attr:`plan_budget`."""
        return entry.budget or self.plan_budget

    def _device_memory(self) -> bool:
        """Whether storages go to the executor as device memory: on a GPU, and on an engine whose
        GPU is the host-memory emulation (CPU tests of the GPU path)."""
        if self.device.type == "cuda":
            return True
        gpu = (getattr(self.store, "config", None) or {}).get("gpu") or {}
        return bool(gpu.get("emulated")) and gpu.get("device") is not None

    def _planned_executor(self, trace: dict, plan: Any, budget: int, allocator: Any) -> Any:
        if not self.planned:
            raise NotImplementedError(
                "planned steps are off (Session(planned=False)): steps page through the engine")
        return self._engine_executor(trace, plan, budget, allocator)

    def _engine_executor(self, trace: dict, plan: Any, budget: int, allocator: Any) -> Any:
        """The engine's plan executor over the session's store (a ``teraio.Engine``), ordered
        after the current CUDA stream on a GPU."""
        executor = getattr(self.store, "executor", None)
        if executor is None:
            raise NotImplementedError(
                f"the store ({type(self.store).__name__}) has no plan executor: steps page instead")
        stream = None
        if self.device.type == "cuda":
            # (the step's stream: under FSDP2 the first operator may run on one of FSDP's)
            s = self._trainer_stream or torch.cuda.current_stream(self.device)
            stream = s.cuda_stream
        elif self._device_memory():
            stream = 0  # the emulation's fences
        # (a bounded run's trace is a larger shape's: its sizes are upper bounds)
        return executor(trace, plan, gpu_budget_bytes=budget, allocate_created=False, allocator=allocator,
                        stream=stream, sizes_at_most=bool(getattr(allocator, "bounded", False)))

    def _diverged(self, key: Any, d: Diverged) -> None:
        """A planned step left its plan at kernel ``d.kernel``. It may have been another shape
        that starts like this one (the plan is chosen by the first operator): steps starting so
        are then told apart at least one operator past that kernel before a plan runs. A plan
        that diverges twice in a row is dropped (the next step profiles again)."""
        entry = self.plans.get(key)
        if entry is None:
            return
        group = self._groups.get(entry.signatures[0])
        if group is not None and d.kernel >= 0:
            group.decide_at = max(group.decide_at, d.kernel + 1)
        # (the run is in its safe mode: a new executor for the plan's next step)
        if self._live_key == key:
            self._retire_live_run()
        entry.diverged_n = entry.diverged_n + 1
        if entry.diverged_n >= 2:
            self._drop_plan(key)

    def _unstable(self, ops: list[str]) -> None:
        """Operators whose recomputation did not give back the bytes they made (the step kept
        the first ones): from now on their results are not recomputed, and the plans that
        recompute them are dropped (their shapes are profiled again)."""
        new = [o for o in ops if o not in self.profiler.unstable_ops]
        self.profiler.unstable_ops.update(ops)
        for o in new:
            self.log(f"teraio: recomputing {o} did not give back the bytes it made (its kernel is not bitwise "
                     "reproducible here); the step kept the bytes made first, and from now on its results "
                     "are moved, not recomputed (the plans recomputing them are made again)")
        for key, e in list(self.plans.items()):
            to_dict = getattr(e.plan, "to_dict", None)
            remade = to_dict().get("recomputations", []) if to_dict is not None else []
            kernels, tensors = e.trace["kernels"], e.trace["tensors"]
            if any(kernels[tensors[r["tensor"]]["created_by"]]["name"].split(".", 1)[-1] in ops for r in remade):
                self._drop_plan(key)

    def _candidates(self, first: Any, n: int) -> tuple[list[Any], int]:
        """The plans a step whose first operator has signature ``first`` may run, and the
        operator from which on one of them can be chosen (0: at once)."""
        group = self._groups.get(first)
        if group is None or n < self.warmup_steps:
            return [], 0
        keys = [k for k in group.keys if k in self.plans and self.plans[k].plan is not None]
        return keys, group.decide_at

    def _drop_plan(self, key: Any) -> None:
        if self._live_key == key:
            self._live_key = None
        entry = self.plans.pop(key, None)
        if entry is not None:
            group = self._groups.get(entry.signatures[0])
            if group is not None:
                group.remove(key, self.plans)
        if entry and entry.run:
            _finish_run(entry.run)

    def _after_profile(self, n: int, rec: dict[str, Any], state_before: int | None) -> None:
        if n < self.warmup_steps or not self.profiler.ops:
            return
        sigs = self.profiler.op_signatures()
        key = _plan_key(sigs)
        entry = self.plans.get(key)
        if entry is not None and entry.signatures == sigs:
            rec["plan"] = "cached"
            if entry.plan is None and entry.refused:
                rec["paging"] = _no_plan(entry)
            return
        if self._settling:
            self._settling = False
            rec["plan"] = ("not yet (this step made the host optimizer's side of the updates placed there: "
                           "its buffers, their states copied off the GPU)")
            return
        if state_before != _state_count(self.optimizer):
            # the optimizer's first step makes its state; later steps only update it, so this
            # one is not the iteration that repeats (a plan of it diverges at the next step)
            rec["plan"] = "not yet (this step created the optimizer's state)"
            return
        self._profiled[key] = self._profiled.get(key, 0) + 1
        trace = self.profiler.trace()
        # each profiled step's operator times, for the median the plan is made with
        times = self._profiled_times.setdefault(key, [])
        times.append((self.profiler.op_signatures(), [k["duration_us"] for k in trace["kernels"]]))
        # what the profile measured: its operators' durations added up against the step's wall
        # time (profile_gpu_time: the spin kernels it queued)
        rec["profile"] = {"kernels_s": sum(times[-1][1]) / 1e6, "wall_s": self.profiler.wall_s,
                          "sleeps": self.profiler.sleeps}
        if self._profiled[key] < self.profile_steps:
            return
        _median_durations(trace, times)
        del self._profiled_times[key]
        if self.optimizer_on == "auto" and self.placement is None and self._auto_off is None \
                and self._place_optimizer(trace, rec):
            # the next steps run another optimizer step (the host's share gone from the GPU):
            # profiled again, then planned
            return
        rec["trace_peak_bytes"] = peak_bytes(trace)
        if self.budget is not None:
            if self.device.type == "cuda":
                # (the fixed allowance keeps twice it free: the caching allocator must place it)
                self._largest_tensor = max((t["bytes"] for t in trace["tensors"]), default=0)
            self._measure_allowance()
            if self._choose_checkpoint and self._checkpoint_some(trace, rec):
                # the next step runs those layers checkpointed: profiled again, then planned
                return
        entry = PlanEntry(trace=trace, signatures=sigs, plan=None,
                          created=self.profiler.created_ids, created_at=self.profiler.created_positions,
                          marks=list(self.profiler.marks))
        entry.input_op = _first_input_op(entry)
        self.plans[key] = entry
        group = self._groups.setdefault(sigs[0], _Group())
        group.add(key, sigs, self.plans)
        # a step is told from another shape no earlier than where it first reads its input (a
        # model that makes its rotary tables first looks the same for every shape until then)
        group.decide_at = max(group.decide_at, entry.input_op)
        if self.budget is None:
            return
        import teraio

        t0 = time.perf_counter()
        tr = teraio.Trace.from_dict(trace)
        budgets = teraio.select_budgets(self.budget, trace=tr, **self._budget_options())
        if "never_fits" in budgets:
            nf = budgets["never_fits"]
            entry.refused = nf["message"]
            raise WorkingSetTooLarge(nf["kernel"], nf["name"], nf["needed_bytes"], nf["capacity_bytes"],
                                     working_sets(trace)[nf["kernel"]][1])
        entry.budget = budgets["executor_bytes"]
        if self.planner is not None:
            entry.plan = self.planner(trace, budgets["planning_bytes"], self.host_budget)
        else:
            hw = self._plan_hardware(rec)
            over = self._tier_overrides(hw)
            try:
                sel = teraio.select(tr, self.policy, hw, gpu_budget_bytes=self.budget,
                                    traffic_margin=self.traffic_margin, paging_fallback=True,
                                    **self._budget_options(), **over)
            except teraio.TeraioError as e:
                # no plan fits (the array, the host tier), not even the pager's schedule: steps
                # keep paging, and say why
                entry.plan = None
                entry.refused = str(e)
                rec["plan_budget"] = _budget_summary(entry.budget, self.budget, self._allowance())
                rec["plan"] = (f"refused: {e} (more or larger engine files, a host tier with "
                               "host_budget_bytes, or a larger gpu_budget_bytes change it)")
                rec["paging"] = _no_plan(entry)
                self.log(f"teraio: no plan for this iteration ({e}); steps page through the engine")
                return
            entry.plan, entry.selection = sel.plan, sel.info
            entry.budget = sel.budgets["executor_bytes"]
            if "traffic" in sel.info:
                entry.traffic = sel.info["traffic"]
        rec["plan_s"] = time.perf_counter() - t0
        rec["plan"] = _plan_summary(entry.plan)
        rec["plan_budget"] = _budget_summary(entry.budget, self.budget, self._allowance())
        if rec.get("mode") == "bounded":
            rec["plan"] += ", from this step's profile (run under a larger shape's plan)"
        t = entry.traffic or {}
        if t.get("chosen") == "planned for slower transfers":
            rec["plan"] += (f", planned for slower transfers: {(t['modelled_moved_bytes'] - t['slower_transfers_moved_bytes']) / 1e9:.2f}"
                            f" GB less moved for {100 * (t['slower_transfers_s'] / t['modelled_s'] - 1):+.1f}% in the model")
        sel_info = entry.selection or {}
        if sel_info.get("choice") == "paging":
            rec["plan"] += f", the pager's schedule as a plan: {sel_info['why']}"
            self.log(f"teraio: no plan of policy {self.policy!r} runs in the budget; the steps run the pager's "
                     f"schedule as a plan ({sel_info['why']})")

    def _checkpoint_some(self, trace: dict[str, Any], rec: dict[str, Any]) -> bool:
        """checkpoint_layers="auto": choose the layers to checkpoint from ``trace`` (once) and
        checkpoint them; whether any are. ``rec`` (the step's record) says the choice."""
        import teraio

        self._choose_checkpoint = False
        hw = self._plan_hardware(rec)
        over = self._tier_overrides(hw)
        try:
            c = teraio.choose_checkpoint(teraio.Trace.from_dict(trace), self.policy, hw,
                                         gpu_budget_bytes=self.budget, paging_fallback=True,
                                         **self._budget_options(), **over)
        except teraio.TeraioError as e:
            c = {"layers": [], "why": f"no checkpointing ({e})"}
        rec["checkpoint"] = c["why"]
        self.log(f"teraio: checkpoint_layers='auto': {c['why']}")
        if not c["layers"]:
            return False
        self._checkpointed = Checkpointed(self.model, c["layers"])
        rec["plan"] = "not yet (the next step runs with those layers checkpointed: profiled again, then planned)"
        return True

    @property
    def checkpointed_layers(self) -> list[int]:
        """The layers checkpointed now (``checkpoint_layers``), ascending."""
        return list(self._checkpointed.layers) if self._checkpointed is not None else []

    def _place_optimizer(self, trace: dict[str, Any], rec: dict[str, Any]) -> bool:
        """optimizer_on="auto": choose where each update runs from ``trace`` and apply it (the
        chosen parameters' updates to the host); whether any moved. ``rec`` (the step's record)
        says the choice (``"optimizer"``)."""
        import teraio

        if self.placer is not None:
            placement = self.placer(trace, self.planning_budget, self.host_budget)
        else:
            hw = self._plan_hardware(rec)
            over = dict(self._tier_overrides(hw), gpu_memory_bytes=self.planning_budget)
            try:
                placement = teraio.place_optimizer(teraio.Trace.from_dict(trace), self.policy, hw, **over)
            except teraio.TeraioError as e:
                placement = {"summary": f"optimizer: every update stays on the GPU (no placement: {e})",
                             "host_weights": []}
        self.placement = placement
        by_name = {f"param:{n}": p for n, p in named_parameters(self.model)}
        params = [by_name[w] for w in placement.get("host_weights", []) if w in by_name]
        rec["optimizer"] = placement["summary"]
        if not params:
            return False
        offload_optimizer(self.optimizer, params=params)
        self._settling = True
        rec["optimizer"] += ("; the next step moves their states to the host, the one after is profiled with the "
                             "updates where they run now")
        return True

    def _tier_overrides(self, hw: Any) -> dict[str, Any]:
        """The hardware fields plans take from this Session beside the model ``hw``: the host
        tier's cap, and the engine's array as each SSD's capacity (the planner keeps a plan's SSD
        footprint under it or refuses the plan)."""
        import teraio

        over: dict[str, Any] = {"host_memory_cap_bytes": self.host_budget}
        capacity = getattr(self.store, "capacity_bytes", None)
        if isinstance(capacity, int) and capacity > 0:
            over["ssd_capacity_bytes"] = capacity // max(1, int(teraio.hardware(hw).get("ssd_count", 1)))
        return over

    def _plan_hardware(self, rec: dict[str, Any]) -> Any:
        """The hardware model plans are made for: as given, or this machine's (measured, or read
        from the cache) the first time a plan needs it; that first time ``rec`` (the step's
        record) says which (``"hardware"``)."""
        if self._hardware_model is None:
            self._hardware_model, self.hardware_source = self._resolve_hardware()
            rec["hardware"] = self.hardware_source
        return self._hardware_model

    def _resolve_hardware(self) -> tuple[Any, str]:
        hw = self.hardware
        if hw is not None and hw != "measure":
            return hw, _given(self._hardware_given)
        measure = getattr(self.store, "measure_hardware", None)
        if measure is None:
            return "paper", ("the paper's machine (preset \"paper\": 4 SSDs, PCIe 5), not this one: the Session's "
                             "store cannot measure it; pass hardware=...")
        try:
            m = measure(cache=True, fresh=hw == "measure")
        except _teraio_error() as e:
            return "paper", (f"the paper's machine (preset \"paper\"), not this one: measuring it failed ({e}); "
                             "pass hardware=...")
        return m["hardware"], m["summary"]

    # ---- reporting ---------------------------------------------------------------------

    @staticmethod
    def line(rec: dict[str, Any]) -> str:
        """A one-line report of a step."""
        s = f"teraio step {rec['step']}: {rec['mode']}"
        if rec.get("paging"):
            s += f" ({rec['paging']})"
        if rec.get("bounded_by"):
            s += f" (a new shape, profiled under the plan of {rec['bounded_by']})"
        s += f", {rec['time_s']:.3f} s, stall {rec['stall_s']:.3f} s"
        ex = rec.get("executor")
        if isinstance(ex, dict) and ex.get("stall_memory_s"):
            s += f" ({ex['stall_memory_s']:.3f} s for memory)"
        if isinstance(ex, dict) and ex.get("allocator_refusals"):
            s += (f", {ex['allocator_refusals']} grants the caching allocator had no room for waited "
                  f"while {ex.get('made_room', 0)} tensors moved out")
        if isinstance(ex, dict) and ex.get("released_on_stream_bytes"):
            s += f", {ex['released_on_stream_bytes'] / 1e9:.2f} GB freed behind queued copies"
        s += f", moved {rec['bytes_moved'] / 1e9:.2f} GB"
        if "peak_allocated_bytes" in rec:
            s += f", peak {rec['peak_allocated_bytes'] / 2**30:.2f} GiB"
        if rec.get("decided_at"):
            s += f", plan chosen at operator {rec['decided_at']}"
        if rec.get("diverged"):
            s += f", diverged ({rec['diverged']}): this step finished without its plan"
        if rec.get("unwatched_ops"):
            s += f", {rec['unwatched_ops']} of {rec['ops']} operators unwatched"
        if rec.get("recomputed"):
            s += f", recomputed {rec['recomputed']}"
            if rec.get("recomputations_checked"):
                s += f" ({rec['recomputations_checked']} checked bitwise)"
        if rec.get("oom_retries"):
            s += (f", {rec['oom_retries']} operators out of memory ran again after "
                  f"{rec['made_room_bytes'] / 1e9:.2f} GB moved out")
        if "gpu_gap_s" in rec:
            s += (f", GPU busy {rec['gpu_busy_s']:.3f} s, waited {rec['gpu_gap_s']:.3f} s"
                  + (f" (recomputing {rec['gpu_recompute_s']:.3f} s, idle {rec['gpu_idle_s']:.3f} s, longest "
                     "idle before " + ", ".join(f"{k} {name} {t * 1e3:.1f} ms" for k, name, t in rec["top_idle"][:3])
                     + ")" if rec.get("gpu_recompute_s") else "")
                  + " (longest before "
                  + ", ".join(f"{k} {name} {t * 1e3:.1f} ms" for k, name, t in rec["top_gaps"][:3]) + ")")
        a = rec.get("allocator") or {}
        if any(a.values()):
            s += (f", allocator: {a['num_device_alloc']} cudaMalloc, {a['num_device_free']} cudaFree, "
                  f"{a['num_alloc_retries']} retries")
        if rec.get("ahead_wait_s"):
            s += f", held back {rec['ahead_wait_s']:.3f} s"
        if "plan" in rec:
            s += f", plan {rec['plan']}{rec.get('plan_budget', '')}"
        if rec.get("optimizer"):
            s += f", {rec['optimizer']}"
        if rec.get("hardware"):
            s += f", hardware model: {rec['hardware']}"
        if rec.get("top_stalls"):
            s += ", waited longest before " + ", ".join(
                f"{k} {name} {t * 1e3:.1f} ms" for k, name, t in rec["top_stalls"][:3])
        return s

    def report(self) -> dict[str, Any]:
        """Figures of every step so far, and totals."""
        steps = self.steps
        out: dict[str, Any] = {"steps": steps, "budget_bytes": self.budget, "plans": len(self.plans),
                               "hardware": self.hardware_source}
        if self.pager is not None:
            out["evictions"] = self.pager.evictions
            out["fetches"] = self.pager.fetches
        if self.fsdp is not None:
            # FSDP's unsharded parameters (not moved by teraio): their peak in profiled steps,
            # and their bytes were every parameter unsharded at once
            out["fsdp"] = {"unsharded_storages": len(self.fsdp), "unsharded_peak_bytes": self.fsdp.peak_bytes,
                           "unsharded_full_bytes": self.fsdp.full_bytes}
        if steps:
            out["mode"] = steps[-1]["mode"]
            out["stall_s_per_step"] = steps[-1]["stall_s"]
            out["bytes_moved_per_step"] = steps[-1]["bytes_moved"]
        return out

    def close(self) -> None:
        """Bring every paged-out tensor back and close the engine the session opened."""
        if self.closed:
            return
        self._retire_live_run()
        for entry in self.plans.values():
            if entry.run:
                _finish_run(entry.run)
        if self.pager is not None:
            self.pager.restore_all()
        if self._engine is not None and hasattr(self._engine, "close"):
            self._engine.close()
        if self.fsdp is not None:
            self.fsdp.release()
        if self._checkpointed is not None:
            self._checkpointed.undo()
        self.closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_policy(policy: str) -> None:
    try:
        import teraio
    except ImportError:
        return
    known = getattr(teraio, "POLICIES", None)
    if known is not None and policy not in known:
        raise ValueError(f"Session(policy={policy!r}): unknown planning policy; one of {', '.join(known)}")


def _compiled(model: Any) -> bool:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return False
    return isinstance(model, OptimizedModule)


def _teraio_error() -> type:
    """The package's base exception (a class nothing raises when the package is missing)."""
    try:
        import teraio

        return teraio.TeraioError
    except (ImportError, AttributeError):
        return type("_NoTeraio", (Exception,), {})


def _median_durations(trace: dict[str, Any], times: list[tuple[Any, list[float]]]) -> None:
    """Each kernel of ``trace`` (the last profiled step, ``times[-1]``) takes the median of its
    durations over the profiled steps in ``times`` (operator signatures, durations) that ran the
    same operators: one step's times vary (the paging of a profiled step, the host's pace), and
    so does the plan made from them."""
    last = times[-1][0]
    same = [d for sig, d in times if sig == last and len(d) == len(trace["kernels"])]
    if len(same) < 2:
        return
    for i, k in enumerate(trace["kernels"]):
        k["duration_us"] = statistics.median(t[i] for t in same)


def measured_allowance(stats: dict[str, Any], untraced_peak_bytes: int) -> int:
    """What the allocator needed beside the traced tensors in a profiled step, in bytes: on a
    GPU the caching allocator's slack at its peak (``torch.cuda.memory_stats``'s
    ``reserved_bytes.all.peak`` less ``allocated_bytes.all.peak``, since the step began) plus
    the most memory in use that the trace's storages did not hold (library workspaces; the
    pager's ``untraced_peak_bytes``). On the CPU (``stats`` empty) the memory in use is the
    traced storages: 0. The scheduler keeps this much of the budget free
    (``allocator_allowance``)."""
    slack = int(stats.get("reserved_bytes.all.peak", 0)) - int(stats.get("allocated_bytes.all.peak", 0))
    return max(0, slack) + max(0, int(untraced_peak_bytes))


def _no_plan(entry: dict[str, Any]) -> str:
    """Why a step pages, for its log line: its shape's plan was refused."""
    return f"no plan: {entry.refused}"


def _plan_summary(plan: Any) -> str:
    """``made (policy, what it moves and recomputes)`` for the step's report line."""
    to_dict = getattr(plan, "to_dict", None)
    if to_dict is None:
        return "made"
    d = to_dict()
    st = d.get("stats", {})
    moved = (st.get("ssd_offload_bytes", 0) + st.get("host_offload_bytes", 0)) / 1e9
    return (f"made ({d.get('policy', '?')}: {moved:.2f} GB offloaded, "
            f"{len(d.get('recomputations', []))} tensors recomputed "
            f"({st.get('recompute_bytes', 0) / 1e9:.2f} GB))")


def _budget_summary(executor_bytes: int | None, budget: int, allowance: dict[str, Any]) -> str:
    """``, for its tensors X of the Y GiB budget (allowance ...)`` for the step's plan line."""
    if not executor_bytes:
        return ""
    how = (f"measured {_size(allowance['bytes'])}" if allowance["kind"] == "measured"
           else f"fixed: {allowance['keep_fraction']:g} of the budget, twice the largest tensor free")
    return f", for its tensors {_size(executor_bytes)} of the {_size(budget)} budget (allowance {how})"


def _size(n: int) -> str:
    """``n`` bytes in GiB, or MiB below a quarter GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 1 << 28 else f"{n / 2**20:.1f} MiB"


def _allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's counters that cost the trainer time."""
    st = torch.cuda.memory_stats(device)
    return {k: int(st.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def _auto_unavailable(optimizer: torch.optim.Optimizer, device: Any, budget: int | None,
                      placer: bool = False) -> str | None:
    """Why ``optimizer_on="auto"`` cannot move any update to the host (None: it can choose).
    ``placer``: a placer of one's own decides (on a CPU model too)."""
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    where = torch.device(device) if device is not None else (first.device if first is not None else None)
    if (where is None or where.type != "cuda") and not placer:
        return f"the model is on {where}: its optimizer already runs on the host"
    if budget is None:
        return "no gpu_budget_bytes: nothing is planned, so there is no cost to weigh"
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)):
        return f"the host step takes AdamW, Adam and SGD, not {type(optimizer).__name__}"
    for g in optimizer.param_groups:
        for opt in ("capturable", "differentiable"):
            if g.get(opt):
                return f"the optimizer's {opt}=True cannot step on the host"
        for p in g["params"]:
            if p.dtype != torch.float32:
                return f"the host step takes float32 parameters, a parameter is {p.dtype}"
    return None


def _state_count(optimizer: Any) -> int:
    """How many tensors the optimizer's state holds."""
    return sum(sum(isinstance(v, torch.Tensor) for v in st.values()) for st in optimizer.state.values())


def _first_input_op(entry: PlanEntry) -> int:
    """The first operator of a profile that takes a tensor made outside the iteration that is
    not a global one (the input batch), 0 if none."""
    tensors = entry.trace["tensors"]
    for k, (ids, where) in enumerate(zip(entry.created, entry.created_at)):
        n_in = len(entry.signatures[k][1])
        if any(at < n_in and not tensors[t]["global"] for t, at in zip(ids, where)):
            return k
    return 0


def _shapes(sig: tuple) -> str:
    """A signature's tensor shapes, for a report: ``embedding [32000, 1024] [8, 512]``."""
    return sig[0] + " " + " ".join(str(list(shape)) for shape, _ in sig[1])


def _plan_key(sigs: list[tuple]) -> tuple:
    """A plan's key: its iteration's first operator's signature, operator count and a hash of
    every operator's signature (two shapes whose first operators look alike get two plans)."""
    return (sigs[0], len(sigs), hash(tuple(sigs)))


class _Group:
    """The plans whose iterations start with the same operator signature, and ``decide_at``:
    the operator from which on a step can be told from the others (their first difference, or
    one past a kernel where a step of this group left the plan it ran)."""

    def __init__(self) -> None:
        self.keys: list[Any] = []
        self.decide_at = 0

    def add(self, key: Any, sigs: list[tuple], plans: dict[Any, PlanEntry]) -> None:
        for other in self.keys:
            o = plans[other].signatures if other in plans else None
            if o is None:
                continue
            first = next((i for i, (a, b) in enumerate(zip(sigs, o)) if a != b), min(len(sigs), len(o)))
            self.decide_at = max(self.decide_at, first)
        if key not in self.keys:
            self.keys.append(key)

    def remove(self, key: Any, plans: dict[Any, PlanEntry]) -> None:
        """``key``'s plan is gone: ``decide_at`` is made again from the plans left (where a
        step left the dropped plan says nothing about the others; kept, it would hold every
        later step of the group in the deciding prefix up to there)."""
        if key in self.keys:
            self.keys.remove(key)
        left = [k for k in self.keys if k in plans]
        self.keys, self.decide_at = [], 0
        for k in left:
            e = plans[k]
            self.add(k, e.signatures, plans)
            self.decide_at = max(self.decide_at, e.input_op)


def _finish_run(run: PlannedRun) -> None:
    run.finish()  # every global tensor gathered back first


class _StepMode(TorchDispatchMode):
    """Decides which plan a step runs, or that it is profiled (and paged).

    The plans whose iterations start with the step's first operator are its candidates. When
    one of them can be told at once (the usual case: the first operator takes the input, whose
    shape differs from one plan to another), its run starts at the first operator. Otherwise
    (several shapes start alike, e.g. a model that makes its rotary tables before it reads its
    input) the step is *deciding*: its operators are profiled while the candidates whose
    operators (signatures, and the sizes of what they create) differ drop out; once one is left
    and the operator where they can be told apart is passed, that plan's run starts there, the
    executor is told the operators that already ran (:meth:`PlannedRun.replay`), and the rest of
    the step is planned. If none is left, the step is profiled as any new shape is. The live run
    stays live through a deciding prefix only when nothing it moves is away (its tensors hold
    their bytes); the prefix then runs without paging."""

    def __init__(self, session: Session, n: int) -> None:
        super().__init__()
        self.session = session
        self.n = n
        self.k = 0
        self.key: Any = None
        self.run: PlannedRun | None = None
        self.stall0 = 0.0
        self.fallback = ""
        self.paged_only = False
        self.hooks: list[Any] = []
        # the optimizer's state count before a profiled step (counted at its first operator:
        # a planned step does not need it)
        self.state0: int | None = None
        # deciding: the candidate plans left, the operator to pass before one is taken, the
        # operators run so far (for the executor's replay), whether the live run stays live
        self.cands: list[Any] | None = None
        self.decide_at = 0
        self.prefix: list[tuple[Any, tuple, dict, Any]] | None = None
        self.keep_live = False
        self._pager: Any = None
        self.decided_at: int | None = None
        # a bounded step (Session.bounded_shapes): the plan it runs under, the profiler's pager
        # set aside meanwhile
        self.bound_key: Any = None
        self.bound_pager: Any = None
        # no candidate is left, but a larger shape's plan may bound the step once the operator
        # that reads the input has run (until then the operators are profiled and kept)
        self.bounding = False

    def close(self) -> None:
        """The step's end: the planned run's module hooks removed, the mode left (unless the
        run left it already for an unwatched stretch); a step still deciding is a profiled one."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.run is None or self.run.unwatch_end(self):
            self.__exit__(None, None, None)
        if self.cands is not None:
            self._profiled_after_all()

    def _start(self, key: Any) -> None:
        """At the first operator: ``key``'s plan runs, or the step is profiled."""
        session = self.session
        self.key = key
        run = session._planned_run(key, self.n)
        entry = session.plans.get(key)
        if entry is not None and entry.no_run:
            self.fallback = entry.no_run
        if run is not None:
            session.profiler.abort()
            self.run = run
            self.stall0 = run.stall_s
            run.begin_iteration()
            self.hooks = run.watch(self)
        else:
            self._profile()

    def _start_bounded(self, first: Any) -> bool:
        """A new shape at its first operator: when a larger shape's plan covers it, the step runs
        under that plan (bounded) and is profiled; False: it is profiled and paged."""
        session = self.session
        key = session._bounding_plan([first], self.n)
        if key is None:
            return False
        if session._input_op(key) >= 1:
            # the input is read later: decide there (a bounding prefix, as a deciding one)
            self._begin_deciding([], 0)
            self.bounding = True
            return True
        prof = session.profiler
        self.state0 = _state_count(session.optimizer)
        # (the run moves the tensors: the pager must not)
        self.bound_pager, prof.pager = prof.pager, None
        try:
            run = session._bounded_run(key)
        except (NotImplementedError, Diverged, _teraio_error()):
            prof.pager, self.bound_pager = self.bound_pager, None
            return False
        self.bound_key = key
        self.run = run
        run.begin_iteration()
        self.hooks = run.watch(self)
        return True

    def _profile(self) -> None:
        session = self.session
        self.state0 = _state_count(session.optimizer)
        if self.fallback and session.pager is not None:
            # a plan exists but cannot run here: page without recording
            session.profiler.abort()
            self.paged_only = True
        session.profiler.seed_pager()

    def _goes_on(self, key: Any) -> bool:
        """Whether the live run goes on from the step's first operator although its plan is
        told from other shapes only later: it is the only candidate, and it cannot wait for the
        decision (tensors it holds are off the GPU, ``gather_between_steps`` "budget" or
        False), and retiring it, which brings every global back, would pass the budget (the
        globals pass it together). A step of another shape then leaves the plan where it differs:
        the run's checks of each operator and of each new tensor's size catch it (a divergence;
        where the globals fit, retiring keeps such a step profiled, or bounded, at once)."""
        session = self.session
        if key != session._live_key or session.gather_between_steps is True or session.budget is None:
            return False
        entry = session.plans.get(key)
        run = entry.run if entry is not None else None
        away = getattr(run, "_nothing_away", None) if run is not None else None
        if away is None or away():
            return False
        return entry.global_bytes > session.budget

    def _begin_deciding(self, cands: list[Any], decide_at: int) -> None:
        session = self.session
        live = session._live_key
        run = session.plans[live].run if live in cands else None
        away = getattr(run, "_nothing_away", None) if run else None
        self.keep_live = away is not None and bool(away())
        if not self.keep_live:
            session._retire_live_run()
        self.cands, self.decide_at, self.prefix = cands, decide_at, []
        self.state0 = _state_count(session.optimizer)
        prof = session.profiler
        if self.keep_live:
            # (the pager would move the live run's tensors behind its back)
            self._pager, prof.pager = prof.pager, None
        else:
            prof.seed_pager()

    def _profiled_after_all(self) -> None:
        """No candidate is this step: it is profiled (from its first operator, as recorded)."""
        session = self.session
        self.cands, self.prefix, self.bounding = None, None, False
        if self.keep_live:
            # the step ran operators its executor did not see (they may write its tensors)
            session._retire_live_run()
            session.profiler.pager = self._pager
            session.profiler.seed_pager()
            self.keep_live = False

    def _decide(self, k: int, func: Any, args: tuple, kwargs: dict) -> Any:
        session = self.session
        plans = session.plans
        sig = signature(func, args, kwargs)
        if self.bounding:
            return self._bounding_op(k, func, args, kwargs, sig)
        self.cands = [c for c in self.cands
                      if c in plans and len(plans[c].signatures) > k and plans[c].signatures[k] == sig]
        if len(self.cands) == 1 and k >= self.decide_at:
            if self._commit(self.cands[0], k):
                return self.run.op(k, func, args, kwargs)
            if self.paged_only:
                return session.pager.dispatch(func, args, kwargs, k, session.device)
            return run_op(func, args, kwargs)
        if not self.cands:
            self.bounding = True
            return self._bounding_op(k, func, args, kwargs, sig)
        out = session.profiler.dispatch(func, args, kwargs)
        res = Results.of(out)
        self.prefix.append((func, args, kwargs, res))
        self.cands = [c for c in self.cands if _created_fit(plans[c], k, args, kwargs, res, session.device)]
        if not self.cands:
            self.bounding = True
            if self._try_bounded(None) == "none":
                self._profiled_after_all()
        return out

    def _bounding_op(self, k: int, func: Any, args: tuple, kwargs: dict, sig: tuple) -> Any:
        """No plan is this step's, but a larger shape's may bound it: operator ``k`` runs under
        it once the operators so far (``sig`` included) reach past its input operator; until
        then it is profiled and kept for the replay; with none left, the step is profiled."""
        session = self.session
        r = self._try_bounded(sig)
        if r == "committed":
            return self.run.op(k, func, args, kwargs)
        if r == "none":
            self._profiled_after_all()
            return session.profiler.dispatch(func, args, kwargs)
        out = session.profiler.dispatch(func, args, kwargs)
        self.prefix.append((func, args, kwargs, Results.of(out)))
        return out

    def _try_bounded(self, sig: tuple | None) -> str:
        """"committed": the step goes on under a larger shape's plan (:meth:`_commit_bounded`);
        "waiting": one covers the operators so far (and ``sig``, the one about to run) but its
        input operator is still ahead; "none": none does (the step is a profiled one)."""
        session = self.session
        sigs = [op.signature for op in session.profiler.ops] + ([sig] if sig is not None else [])
        key = session._bounding_plan(sigs, self.n)
        if key is None:
            return "none"
        if len(sigs) <= session._input_op(key):
            return "waiting"
        return "committed" if self._commit_bounded(key) else "none"

    def _commit_bounded(self, key: Any) -> bool:
        """The step (a new shape) goes on under ``key``'s plan, a larger shape's that covers its
        operators so far (:meth:`_try_bounded`): bounded, the executor told the operators that
        ran; False: that run could not start (nothing changed)."""
        session = self.session
        prof = session.profiler
        pager = self._pager if self.keep_live else prof.pager
        # (one executor over the global tensors; what the prefix paged out comes back)
        session._retire_live_run()
        if session.pager is not None:
            session.pager.restore_all()
        prof.pager = None
        try:
            run = session._bounded_run(key)
        except (NotImplementedError, Diverged, _teraio_error()):
            prof.pager = None if self.keep_live else pager
            return False
        prefix, self.prefix, self.cands, self.keep_live = self.prefix, None, None, False
        self.bounding = False
        self.bound_pager, self.bound_key, self.run = pager, key, run
        run.begin_iteration()
        run.replay(prefix)
        self.hooks = run.watch(self)
        return True

    def _commit(self, key: Any, k: int) -> bool:
        """Operator ``k`` is about to run and ``key``'s plan is the step's: its run starts, told
        the operators before ``k``. False: it has no run (the rest of the step runs unrecorded,
        paged if there is a pager)."""
        session = self.session
        prof = session.profiler
        prof.abort()
        if self.keep_live:
            prof.pager = self._pager
        prefix, self.prefix, self.cands = self.prefix, None, None
        self.key, self.decided_at = key, k
        run = session._planned_run(key, self.n)
        if not self.keep_live and session.pager is not None:
            # what the prefix paged out comes back (the run brought the globals it holds)
            session.pager.restore_all()
        if run is None:
            entry = session.plans.get(key)
            self.fallback = (entry or {}).get("no_run", "") or "no run for the plan"
            self.paged_only = session.pager is not None
            return False
        self.run = run
        self.stall0 = run.stall_s
        run.begin_iteration()
        run.replay(prefix)
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        k = self.k
        self.k += 1
        if k == 0:
            session = self.session
            sig0 = signature(func, args, kwargs)
            cands, decide_at = session._candidates(sig0, self.n)
            if not sig0[1]:
                # an operator without tensor arguments (``arange(n)``) tells shapes apart only by
                # what it makes: a plan is chosen after it
                decide_at = max(decide_at, 1)
            if len(cands) == 1 and (decide_at == 0 or self._goes_on(cands[0])):
                self._start(cands[0])
            elif cands:
                self._begin_deciding(cands, decide_at)
            else:
                session._retire_live_run()
                if not self._start_bounded(sig0):
                    self._profile()
        if self.cands is not None:
            return self._decide(k, func, args, kwargs)
        if self.run is not None:
            return self.run.op(k, func, args, kwargs)
        if self.paged_only:
            return self.session.pager.dispatch(func, args, kwargs, k, self.session.device)
        return self.session.profiler.dispatch(func, args, kwargs)


def _created_fit(entry: dict[str, Any], k: int, args: tuple, kwargs: dict, outs: Results,
                 device: torch.device) -> bool:
    """Whether operator ``k`` made its new storages where and as large as the plan's profile
    did (an operator without tensor arguments, ``arange(n)``, tells shapes apart only so)."""
    want = entry.created[k] if k < len(entry.created) else ()
    if not want:
        return True
    flat = flat_args(args, kwargs)
    n_in = len(flat)
    tensors = entry.trace["tensors"]
    for tid, at in zip(want, entry.created_at[k]):
        if at >= n_in + len(outs):
            return False
        x = flat[at] if at < n_in else outs[at - n_in]
        st = storage_of(x) if x.device == device else None
        if st is None or st.nbytes() != tensors[tid]["bytes"]:
            return False
    return True
