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
   (:class:`teraio.torch.runtime.Pager`: demand paging through the engine, so even the first
   iterations fit the budget).
3. After ``profile_steps`` profiled steps of the same shapes, the last trace (each operator
   timed by its median over those steps that ran the same operators) is checked
   (:func:`teraio.torch.check_working_sets`: a kernel that alone exceeds the budget is named)
   and planned by the scheduler (``teraio.plan``, the planner of ``teraio plan``), and the plan
   is cached by the iteration's first operator's shapes (its input), so a small set of shapes
   (variable sequence lengths) is planned once each.
4. At a step's first operator a cached plan for its shapes runs
   (:class:`teraio.torch.planned.PlannedRun`: the engine's plan executor, docs/EXECUTOR.md,
   driven by the operator count); where this build of the Python package has no executor,
   such steps run paged without recording, and :meth:`Session.report` says so (``"mode":
   "paged"``, the reason in ``planned_failed``).

:meth:`Session.report` gives per-step figures (time, stall, bytes moved, peak memory); with
``report_every=N`` a one-line report is printed every N steps.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._storages import signature
from .optimizer import auto_chunk_bytes, check_working_sets, make_plannable
from .planned import Diverged, PlannedRun, keep_last
from .profiler import Profiler, peak_bytes
from .runtime import Pager, StorageMover, Store


def _open_engine(engine: Any) -> Any:
    import teraio

    if isinstance(engine, dict):
        # a retaining store keeps a copy after a prefetch: a tensor the step did not change
        # (a weight, a tensor gathered between steps) leaves the GPU again without a write
        return teraio.Engine(**{"retain_on_prefetch": True, **engine})
    if isinstance(engine, str):
        return teraio.Engine(engine)
    return engine


class Session:
    """Profile, plan and run a training loop's iterations under a GPU memory budget.

    ``engine``: a ``teraio.Engine``, its configuration as a dict of keyword options, or a
    configuration file path (docs/PYTHON.md). ``gpu_budget_bytes``: the memory the iteration's
    tensors may use (None: no budget, nothing is paged). ``host_budget_bytes``: the host tier
    the planner may use (0: SSD only). ``policy``/``hardware``: the planner's (``teraio plan``).
    ``store`` (tests): any object with the engine's ``offload``/``prefetch``/``free``.
    ``page_min_bytes``: the pager leaves smaller storages in place; ``page_fraction``: on the
    GPU it pages down to this share of the budget (and plans keep it, and keep at least twice the
    trace's largest tensor free: the caching allocator's room to place it). ``planned`` (default
    True): steps with a plan run it on the engine's executor (False: every step pages).
    ``gather_between_steps`` (default True): after a planned step every parameter, gradient and
    optimizer state is resident and complete, and writes to them before the next step are seen
    (version counters); False keeps the plan's steady state between steps, for loops whose code
    between steps touches none of them. ``max_ahead`` (GPU, planned steps; 0: no limit): the host
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
    ``plan_margin`` (default 0): plans are made for this fraction less than the executor's
    budget. On a GPU the host runs ahead of the device, so the executor sees an offload's memory
    freed later than the plan's timing does; the margin is the slack that keeps the host from
    waiting for it (the plan moves or recomputes a little more instead).
    ``time_gpu`` (GPU, planned steps): CUDA events around every operator, so each step reports
    the GPU's own busy time and where it waited (``gpu_busy_s``, ``gpu_gap_s``, ``top_gaps``).
    ``host_waits`` (GPU, planned steps; default False): the engine's workers wait for the GPU
    and copy an offload to the host tier themselves, and the executor waits on the host until
    the copy is done before the memory is reused (as before 2026-12-02); by default the copy is
    queued on the device and the trainer's stream, not the host, waits for it where the memory
    is needed again.
    ``keep_steps`` (default 1000): :attr:`steps` keeps the records of at least this many latest
    steps (at most twice as many: older ones are dropped, the training may run for millions).
    ``executor_factory``
    (tests): ``f(trace_dict, plan, budget_bytes, allocator)`` making the plan executor (default:
    ``teraio.Executor``). ``planner`` (tests): ``f(trace_dict, gpu_budget_bytes,
    host_budget_bytes)`` returning a plan (default: ``teraio.plan`` with ``policy``/``hardware``).
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
        profile_steps: int = 1,
        warmup_steps: int = 0,
        report_every: int = 0,
        device: torch.device | str | None = None,
        store: Store | None = None,
        page_min_bytes: int = 1 << 16,
        page_fraction: float = 0.85,
        executor_factory: Callable[..., Any] | None = None,
        planned: bool = True,
        gather_between_steps: bool = True,
        max_ahead: int = 0,
        recompute: bool = True,
        time_gpu: bool = False,
        host_waits: bool = False,
        traffic_margin: float = 0.03,
        plan_margin: float = 0.0,
        planner: Callable[[dict, int, int], Any] | None = None,
        keep_steps: int = 1000,
        log: Callable[[str], None] = print,
    ) -> None:
        if gpu_budget_bytes is not None and gpu_budget_bytes <= 0:
            raise ValueError(f"gpu_budget_bytes must be > 0 or None, got {gpu_budget_bytes}")
        if host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be >= 0, got {host_budget_bytes}")
        if profile_steps < 1:
            raise ValueError(f"profile_steps must be >= 1, got {profile_steps}")
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        self.keep_steps = keep_steps
        if not 0.0 <= plan_margin < 0.5:
            raise ValueError(f"plan_margin must be in [0, 0.5), got {plan_margin}")
        self.plan_margin = plan_margin

        self.model = model
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
        self.gather_between_steps = gather_between_steps
        if max_ahead < 0:
            raise ValueError(f"max_ahead must be >= 0, got {max_ahead}")
        self.max_ahead = max_ahead
        self.time_gpu = time_gpu
        self.host_waits = host_waits
        if not 0 <= traffic_margin < 1:
            raise ValueError(f"traffic_margin must be in [0, 1), got {traffic_margin}")
        self.traffic_margin = traffic_margin
        self.planner = planner
        self._engine = None
        if store is None and gpu_budget_bytes is not None:
            store = self._engine = _open_engine(engine)
        self.store = store
        self.profiler = Profiler(model, optimizer, device=device, producers=recompute)
        self.device = self.profiler.device
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
            self.profiler.pager = self.pager
        # what plans and the executor account against: on a GPU the trace's tensors are not all
        # the memory a step allocates (cuBLAS workspaces, the allocator's rounding), so plans
        # keep `page_fraction` of the budget, as the pager does
        self._plan_fraction = page_fraction if cuda else 1.0
        # and below the budget by twice the trace's largest tensor: the caching allocator must
        # find room for it beside everything else, its blocks rounded and scattered (bf16 GPT on
        # an H200, 4 GiB cap: plans at 0.85 of it ran out of memory on a 512 MiB allocation at
        # 3.43 GiB allocated; at 0.75 they run, docs/BENCHMARKS.md)
        self._headroom = 0
        # first operator's signature -> {"trace", "plan", "signatures", "profiles"}
        self.plans: dict[Any, dict[str, Any]] = {}
        self._profiled: dict[Any, int] = {}
        self._profiled_times: dict[Any, list[tuple[Any, list[float]]]] = {}
        self.steps: list[dict[str, Any]] = []
        self._alloc_counts: dict[str, int] | None = None
        self.step_count = 0  # steps begun (``steps`` keeps the latest ``keep_steps``)
        self.closed = False

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
        t0 = time.perf_counter()
        mode = _StepMode(self, n)
        # the pager learns the global storages at the first operator, if the step is profiled
        self.profiler.begin(seed_pager=False)
        mode.__enter__()
        try:
            yield self
        finally:
            # (a planned step may have left the mode for its last operators: unwatched)
            mode.close()
            if mode.run is None:
                if not mode.paged_only:
                    self.profiler.end()
                if self.pager is not None:
                    self.pager.restore_all()
        rec: dict[str, Any] = {"step": n}
        if mode.run is not None:
            run = mode.run
            rep = run.end_iteration()
            rec["mode"] = "planned"
            rec["executor"] = rep
            if run.gather and run.gathers:
                rec["gathered"] = run.gathers[-1]
            rec["top_stalls"] = run.top_stalls()
            if run.recomputed:
                rec["recomputed"] = run.recomputed
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
                rec["planned_bytes_moved"] = sum(
                    st.get(d, {}).get("bytes", 0) for d in ("ssd_write", "ssd_read", "host_write", "host_read"))
            if run.diverged is not None:
                rec["diverged"] = str(run.diverged)
                self._drop_plan(mode.key)
        else:
            rec["mode"] = "paged" if self.pager is not None else "profiled"
            rec["stall_s"] = (self.pager.wait_s - wait0) if self.pager else 0.0
            if mode.fallback:
                rec["planned_failed"] = mode.fallback
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
        if mode.run is None and not mode.paged_only:
            self._after_profile(n, rec, mode.state0)
        # a session lives as long as the training: its records are bounded (every object kept
        # is one more for Python's garbage collector to walk in a full collection)
        keep_last(self.steps, rec, self.keep_steps)
        if cuda:
            self._alloc_counts = counts
        if self.report_every and (n + 1) % self.report_every == 0:
            self.log(self.line(rec))

    def _planned_run(self, key: Any, n: int) -> Any:
        """The executor run for this key's plan, or None (no plan, or no executor here)."""
        entry = self.plans.get(key)
        if n < self.warmup_steps or entry is None or entry.get("plan") is None or entry.get("run") is False:
            return None
        if entry.get("run") is None:
            try:
                entry["run"] = PlannedRun(entry, self.model, self.optimizer, self.plan_budget, self.device,
                                          self.executor_factory or self._planned_executor,
                                          device_memory=self._device_memory(),
                                          gather=self.gather_between_steps, max_ahead=self.max_ahead,
                                          time_gpu=self.time_gpu, host_waits=self.host_waits)
            except (NotImplementedError, Diverged, _teraio_error()) as e:
                entry["run"] = False
                entry["no_run"] = str(e)
                return None
        return entry["run"]

    @property
    def plan_budget(self) -> int | None:
        """The bytes plans and the executor account against (``page_fraction`` of the budget on
        a GPU, the budget on the CPU), on a GPU also at least twice the profiled trace's largest
        tensor below the budget (room for the caching allocator to place it)."""
        if self.budget is None:
            return None
        b = int(self.budget * self._plan_fraction)
        if 0 < self._headroom < self.budget // 2:
            b = min(b, self.budget - self._headroom)
        return b

    @property
    def planning_budget(self) -> int | None:
        """The GPU bytes plans are made for: :attr:`plan_budget` less ``plan_margin``."""
        b = self.plan_budget
        return None if b is None else int(b * (1.0 - self.plan_margin))

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
            stream = torch.cuda.current_stream(self.device).cuda_stream
        elif self._device_memory():
            stream = 0  # the emulation's fences
        return executor(trace, plan, gpu_budget_bytes=budget, allocate_created=False, allocator=allocator,
                        stream=stream)

    def _drop_plan(self, key: Any) -> None:
        entry = self.plans.pop(key, None)
        if entry and entry.get("run"):
            _finish_run(entry["run"])

    def _after_profile(self, n: int, rec: dict[str, Any], state_before: int | None) -> None:
        if n < self.warmup_steps or not self.profiler.ops:
            return
        key = self.profiler.ops[0].signature
        entry = self.plans.get(key)
        if entry is not None and entry["signatures"] == self.profiler.op_signatures():
            rec["plan"] = "cached"
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
        if self._profiled[key] < self.profile_steps:
            return
        _median_durations(trace, times)
        del self._profiled_times[key]
        rec["trace_peak_bytes"] = peak_bytes(trace)
        entry = {"trace": trace, "signatures": self.profiler.op_signatures(), "plan": None,
                 "created": self.profiler.created_ids, "created_at": self.profiler.created_positions,
                 "marks": list(self.profiler.marks)}
        self.plans[key] = entry
        if self.budget is None:
            return
        if self.device.type == "cuda":
            self._headroom = 2 * max((t["bytes"] for t in trace["tensors"]), default=0)
        check_working_sets(trace, self.plan_budget)
        try:
            import teraio
        except ImportError:
            teraio = None
        if self.planner is not None:
            t0 = time.perf_counter()
            entry["plan"] = self.planner(trace, self.planning_budget, self.host_budget)
            rec["plan_s"] = time.perf_counter() - t0
        elif teraio is not None and hasattr(teraio, "plan"):
            hw = self.hardware if self.hardware is not None else "paper"
            over: dict[str, Any] = {"gpu_memory_bytes": self.planning_budget,
                                    "host_memory_cap_bytes": self.host_budget}
            capacity = getattr(self.store, "capacity_bytes", None)
            if isinstance(capacity, int) and capacity > 0:
                # the plan must fit the engine's array: the planner keeps its SSD footprint under
                # the capacity (per SSD of the hardware model) or refuses the plan
                over["ssd_capacity_bytes"] = capacity // max(1, int(teraio.hardware(hw).get("ssd_count", 1)))
            t0 = time.perf_counter()
            try:
                tr = teraio.Trace.from_dict(trace)
                entry["plan"] = teraio.plan(tr, self.policy, hw, checked=True, **over)
                if self.traffic_margin > 0:
                    entry["plan"], entry["traffic"] = _less_traffic(teraio, tr, entry["plan"], self.policy, hw,
                                                                    over, self.traffic_margin)
            except teraio.TeraioError as e:
                # no plan fits (the array, the host tier): steps keep paging, and say why
                entry["plan"] = None
                rec["plan"] = (f"refused: {e} (more or larger engine files, a host tier with "
                               "host_budget_bytes, or a larger gpu_budget_bytes change it)")
                self.log(f"teraio: no plan for this iteration ({e}); steps page through the engine")
                return
            rec["plan_s"] = time.perf_counter() - t0
        rec["plan"] = _plan_summary(entry["plan"]) if entry["plan"] is not None \
            else "profiled (no planner in this build)"
        t = entry.get("traffic") or {}
        if t.get("chosen") == "planned for slower transfers":
            rec["plan"] += (f", planned for slower transfers: {(t['modelled_moved_bytes'] - t['slower_transfers_moved_bytes']) / 1e9:.2f}"
                            f" GB less moved for {100 * (t['slower_transfers_s'] / t['modelled_s'] - 1):+.1f}% in the model")

    # ---- reporting ---------------------------------------------------------------------

    @staticmethod
    def line(rec: dict[str, Any]) -> str:
        """A one-line report of a step."""
        s = (f"teraio step {rec['step']}: {rec['mode']}, {rec['time_s']:.3f} s, stall "
             f"{rec['stall_s']:.3f} s")
        ex = rec.get("executor")
        if isinstance(ex, dict) and ex.get("stall_memory_s"):
            s += f" ({ex['stall_memory_s']:.3f} s for memory)"
        if isinstance(ex, dict) and ex.get("released_on_stream_bytes"):
            s += f", {ex['released_on_stream_bytes'] / 1e9:.2f} GB freed behind queued copies"
        s += f", moved {rec['bytes_moved'] / 1e9:.2f} GB"
        if "peak_allocated_bytes" in rec:
            s += f", peak {rec['peak_allocated_bytes'] / 2**30:.2f} GiB"
        if rec.get("diverged"):
            s += f", diverged ({rec['diverged']}): the plan is dropped, the next step profiles"
        if rec.get("unwatched_ops"):
            s += f", {rec['unwatched_ops']} of {rec['ops']} operators unwatched"
        if rec.get("recomputed"):
            s += f", recomputed {rec['recomputed']}"
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
            s += f", plan {rec['plan']}"
        if rec.get("top_stalls"):
            s += ", waited longest before " + ", ".join(
                f"{k} {name} {t * 1e3:.1f} ms" for k, name, t in rec["top_stalls"][:3])
        return s

    def report(self) -> dict[str, Any]:
        """Figures of every step so far, and totals."""
        steps = self.steps
        out: dict[str, Any] = {"steps": steps, "budget_bytes": self.budget, "plans": len(self.plans)}
        if self.pager is not None:
            out["evictions"] = self.pager.evictions
            out["fetches"] = self.pager.fetches
        if steps:
            out["mode"] = steps[-1]["mode"]
            out["stall_s_per_step"] = steps[-1]["stall_s"]
            out["bytes_moved_per_step"] = steps[-1]["bytes_moved"]
        return out

    def close(self) -> None:
        """Bring every paged-out tensor back and close the engine the session opened."""
        if self.closed:
            return
        for entry in self.plans.values():
            if entry.get("run"):
                _finish_run(entry["run"])
        if self.pager is not None:
            self.pager.restore_all()
        if self._engine is not None and hasattr(self._engine, "close"):
            self._engine.close()
        self.closed = True

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _teraio_error() -> type:
    """The package's base exception (a class nothing raises when the package is missing)."""
    try:
        import teraio

        return teraio.TeraioError
    except (ImportError, AttributeError):
        return type("_NoTeraio", (Exception,), {})


# the hardware model's transfer rates, and how much slower the second plan assumes them
_TRANSFER_RATES = ("ssd_read_bytes_per_s", "ssd_write_bytes_per_s", "pcie_h2d_bytes_per_s",
                   "pcie_d2h_bytes_per_s", "host_memory_bytes_per_s", "ssd_duplex_bytes_per_s",
                   "pcie_duplex_bytes_per_s")
_DERATE = 0.7


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


def _moved(plan: Any) -> int:
    st = plan.to_dict().get("stats", {})
    return int(st.get("ssd_offload_bytes", 0)) + int(st.get("host_offload_bytes", 0))


def _less_traffic(teraio: Any, trace: Any, plan: Any, policy: str, hw: Any, over: dict,
                  margin: float) -> tuple[Any, dict[str, Any]]:
    """``plan``, or the plan made for transfers ``_DERATE`` times as fast when that one moves
    fewer bytes and simulates on the real model within ``margin`` of ``plan``; and the figures
    the choice was made on."""
    base = teraio.hardware(hw, **over)
    slow = {k: base[k] * _DERATE for k in _TRANSFER_RATES if isinstance(base.get(k), (int, float))}
    try:
        alt = teraio.plan(trace, policy, hw, checked=True, **{**over, **slow})
    except teraio.TeraioError as e:
        return plan, {"chosen": "as modelled", "alternative": f"none ({e})"}
    t_plan = teraio.simulate(trace, plan, hw, **over)
    t_alt = teraio.simulate(trace, alt, hw, **over)
    info = {"modelled_s": t_plan.iteration_time_us / 1e6, "modelled_moved_bytes": _moved(plan),
            "slower_transfers_s": t_alt.iteration_time_us / 1e6, "slower_transfers_moved_bytes": _moved(alt)}
    take = (t_alt.completed and _moved(alt) < _moved(plan)
            and t_alt.iteration_time_us <= t_plan.iteration_time_us * (1 + margin))
    info["chosen"] = "planned for slower transfers" if take else "as modelled"
    return (alt if take else plan), info


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


def _allocator_counts(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's counters that cost the trainer time."""
    st = torch.cuda.memory_stats(device)
    return {k: int(st.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def _state_count(optimizer: Any) -> int:
    """How many tensors the optimizer's state holds."""
    return sum(sum(isinstance(v, torch.Tensor) for v in st.values()) for st in optimizer.state.values())


def _finish_run(run: PlannedRun) -> None:
    run.finish()  # every global tensor gathered back first


class _StepMode(TorchDispatchMode):
    """Decides at the step's first operator whether a cached plan runs (by that operator's
    signature: the iteration's input shapes) or the step is profiled (and paged)."""

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

    def close(self) -> None:
        """The step's end: the planned run's module hooks removed, the mode left (unless the
        run left it already for an unwatched stretch)."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        if self.run is None or self.run.unwatch_end(self):
            self.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        k = self.k
        self.k += 1
        if k == 0:
            self.key = signature(func, args, kwargs)
            run = self.session._planned_run(self.key, self.n)
            entry = self.session.plans.get(self.key)
            if entry is not None and entry.get("no_run"):
                self.fallback = entry["no_run"]
            if run is not None:
                self.session.profiler.abort()
                self.run = run
                self.stall0 = run.stall_s
                run.begin_iteration()
                self.hooks = run.watch(self)
            else:
                self.state0 = _state_count(self.session.optimizer)
                if self.fallback and self.session.pager is not None:
                    # a plan exists but cannot run here: page without recording
                    self.session.profiler.abort()
                    self.paged_only = True
                self.session.profiler.seed_pager()
        if self.run is not None:
            return self.run.op(k, func, args, kwargs)
        if self.paged_only:
            return self.session.pager.dispatch(func, args, kwargs, k, self.session.device)
        return self.session.profiler.dispatch(func, args, kwargs)
