"""Session: training under a budget gives the same losses and parameters as without teraio."""


import contextlib
import os

import pytest
import torch

import teraio.torch as tt
from teraio.torch.session import _TestHooks as Hooks

from models import batches, hf_llama, make, train_step


class _Done:
    def __init__(self, value=None):
        self.value = value

    def wait(self, timeout=None):
        return self.value


class MemStore:
    """The engine's offload/prefetch/free over a dict (the PyTorch side alone); the same tests
    run on a real file-backed teraio.Engine below when the package is built."""

    def __init__(self):
        self.d = {}

    def offload(self, tid, data, **kw):
        assert tid not in self.d
        self.d[tid] = bytes(memoryview(data).cast("B"))
        return _Done("ssd")

    def prefetch(self, tid, out, **kw):
        src = self.d[tid]
        mv = memoryview(out).cast("B")
        assert len(mv) == len(src)
        mv[:] = src
        return _Done(out)

    def free(self, tid):
        del self.d[tid]
        return _Done()


def engine_store(tmp_path, device=False):
    teraio = pytest.importorskip("teraio")
    if not hasattr(teraio, "Engine"):
        pytest.fail("the teraio package has no Engine: the bindings are not installed")
    # the tiny model's storages are small: a 4 KiB allocation unit (the default is 1 MiB)
    kw = {"gpu": {"device": 0, "emulated": True}} if device else {}
    return teraio.Engine(dir=str(tmp_path), files=2, file_size="64M", alloc_unit="4k", stripe_unit="64k", **kw)


def reference(n, **kw):
    model, opt = make(**kw)
    data = batches(n, **{k: v for k, v in kw.items() if k in ("vocab", "seq")})
    return [train_step(model, opt, t) for t in data], model


def trained(store, budget, n, data=None, **kw):
    model, opt = make(**kw)
    data = data if data is not None else batches(n)
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, page_min_bytes=0, log=lambda _: None)
    losses = []
    for t in data:
        with s.step():
            losses.append(train_step(model, opt, t))
    return losses, model, s


def params_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# "engine-device": the planned steps hand storages to the executor as device memory of the
# engine's GPU emulation (the path CUDA storages take on a GPU: stream-ordered, bounce pipeline)
@pytest.mark.parametrize("store_kind", ["mem", "engine", "engine-device"])
def test_paged_training_is_bitwise_identical(tmp_path, store_kind):
    store = MemStore() if store_kind == "mem" else engine_store(tmp_path, device=store_kind == "engine-device")
    ref_losses, ref_model = reference(4)
    # a budget below what one iteration holds: parameters alone are over a third of it
    budget = 3 * params_bytes(ref_model)
    losses, model, s = trained(store, budget, 4)
    assert losses == ref_losses
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    rep = s.report()
    assert rep["evictions"] > 0 and rep["fetches"] > 0, "the budget must force paging"
    assert rep["bytes_moved_per_step"] > 0
    s.close()
    if store_kind == "mem":
        assert store.d == {}, "every paged copy is freed once read back"


# Planned steps: the engine's plan executor runs steps 2 to 4 with the same losses. After each
# planned step every global tensor is gathered back (resident, complete): parameters are equal
# after the steps, and parameters written between two planned steps (as loading a checkpoint
# would) reach the next step, written to the store again rather than dropped as clean.
def _halve(model, opt):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
            for k, v in opt.state[p].items():
                if k != "step":
                    v.mul_(0.5)


@pytest.mark.parametrize("store_kind", ["engine", "engine-device"])
def test_planned_steps_run_on_the_engines_executor_with_the_same_losses(tmp_path, store_kind):
    store = engine_store(tmp_path, device=store_kind == "engine-device")
    ref_model, ref_opt = make()
    ref_losses = []
    for i, t in enumerate(batches(5)):
        ref_losses.append(train_step(ref_model, ref_opt, t))
        if i == 2:
            _halve(ref_model, ref_opt)
    budget = 3 * params_bytes(ref_model)
    model, opt = make()
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, page_min_bytes=0,
                   log=lambda _: None)
    losses = []
    for i, t in enumerate(batches(5)):
        with s.step():
            losses.append(train_step(model, opt, t))
        if i == 2:
            _halve(model, opt)
    assert losses == ref_losses
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    assert [r["mode"] for r in s.steps] == ["paged", "paged", "planned", "planned", "planned"], s.steps
    for r in s.steps[2:]:
        ex = r["executor"]
        assert "diverged" not in r and ex["diverged"] is None
        assert ex["offloads"] > 0 and ex["prefetches"] > 0 and r["bytes_moved"] > 0
        # within the budget, or within what the previous gather left resident (boundary 0 puts
        # those back where the plan starts them; allocations wait for the budget)
        assert ex["peak_bytes"] <= max(budget, s.steps[2]["gathered"]["used_bytes"])
    (entry,) = [e for e in s.plans.values() if e.run]
    run = entry.run
    # between steps every global storage holds its bytes (none shrunk by an offload)
    for tid, x in run._globals:
        assert x.untyped_storage().nbytes() == run.tensors[tid]["bytes"], run.tensors[tid]["name"]
    assert any(g["read_back"] + g["kept_in_flight"] > 0 for g in run.gathers), run.gathers
    held = [run.ex.resident(t) for t, x in enumerate(run.tensors) if x["global"]]
    kinds = {type(m).__name__ for m in held if m is not None}
    if store_kind == "engine-device":
        assert kinds == {"DeviceMemory"}, kinds
    else:
        assert kinds and "DeviceMemory" not in kinds, kinds
    assert run.device_memory == (store_kind == "engine-device")
    s.close()


@pytest.mark.parametrize("store_kind", ["engine", "engine-device"])
def test_a_budgeted_gather_keeps_the_budget_and_gathered_brings_back_the_rest(tmp_path, store_kind):
    """gather_between_steps="budget": between steps at most the budget is resident (the rest
    stays stored, said once in the log), ``gathered()`` brings every tensor back for code that
    touches them, and the training is plain training's, bitwise."""
    ref_model, ref_opt = make()
    ref_losses = []
    for i, t in enumerate(batches(6)):
        ref_losses.append(train_step(ref_model, ref_opt, t))
        if i in (2, 4):
            _halve(ref_model, ref_opt)
    budget = 3 * params_bytes(ref_model)  # parameters, gradients and two AdamW states do not fit
    model, opt = make()
    lines = []
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path, device=store_kind == "engine-device")),
                   gpu_budget_bytes=budget, page_min_bytes=0, gather_between_steps="budget", log=lines.append)
    losses, left_off = [], []
    for i, t in enumerate(batches(6)):
        with s.step():
            losses.append(train_step(model, opt, t))
        rec = s.steps[-1]
        if rec["mode"] == "planned":
            g = rec["gathered"]
            assert g["used_bytes"] <= budget, g
            left_off.append(g["left_off"])
            # the record says where the plan's bytes went: this engine has no host tier
            st = rec["store"]
            assert st["ssd_write"]["bytes"] > 0 and st["ssd_write"]["busy_s"] > 0, st
            assert "host_write" not in st and st["host_fallbacks"] == 0, st
            assert sum(v["bytes"] for k, v in st.items() if k != "host_fallbacks") <= rec["bytes_moved"], rec
        if i in (2, 4):
            with s.gathered():
                (run,) = [e.run for e in s.plans.values() if e.run]
                for tid, x in run._globals:  # every one back, with its bytes
                    assert x.untyped_storage().nbytes() == run.tensors[tid]["bytes"], run.tensors[tid]["name"]
                _halve(model, opt)
    assert losses == ref_losses
    with s.gathered():  # (outside it, the tensors left stored have empty storages)
        for p, q in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(p, q)
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ref_opt.state[p][k], opt.state[q][k])
    assert left_off and all(n > 0 for n in left_off), left_off
    said = [ln for ln in lines if "stay in the store to keep the budget" in ln]
    assert len(said) == 1 and "session.gathered()" in said[0], lines
    s.close()


def test_a_prefetch_the_allocator_has_no_room_for_waits_for_room_and_the_math_is_plain(tmp_path, monkeypatch):
    """The caching allocator refuses memory the plan's budget has (its blocks rounded and
    scattered, memory the trace does not see): the executor's prefetch waits, the executor moves
    out what the waiting operator does not use and asks again, and the step completes with plain
    training's losses and parameters, bitwise; the step's executor report counts the refusals."""
    n = 6
    ref_losses, ref_model = reference(n)
    model, opt = make()
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)),
                   gpu_budget_bytes=2 * params_bytes(ref_model), page_min_bytes=0, log=lambda _: None)
    real = tt.planned._resize
    refuse = {"left": 0, "seen": 0}

    def short(st, nbytes):
        # every other growth while refusals are left: a prefetch's storage regrown
        if nbytes > 0 and refuse["left"] > 0 and refuse["seen"] % 2 == 0:
            refuse["left"] -= 1
            refuse["seen"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        refuse["seen"] += nbytes > 0
        return real(st, nbytes)

    monkeypatch.setattr(tt.planned, "_resize", short)
    losses = []
    for i, t in enumerate(batches(n)):
        refuse["left"] = 3 if s.steps and s.steps[-1]["mode"] == "planned" else 0
        with s.step():
            losses.append(train_step(model, opt, t))
    modes = [r["mode"] for r in s.steps]
    refused = [(r.get("executor") or {}).get("allocator_refusals", 0) for r in s.steps]
    assert modes.count("planned") >= 3, modes
    assert sum(refused) > 0, (modes, refused)
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    s.close()


def test_a_budgeted_session_goes_on_with_its_plan_where_shapes_are_told_late(tmp_path, monkeypatch):
    """A model that makes tensors before it reads its input (rotary tables: its plan is told
    from another shape's only at the embedding) under a budget its parameters and AdamW states
    pass together (gather_between_steps="budget"): each planned step goes on with the live run
    from its first operator instead of retiring it, which would bring every global back at once
    (more than the budget: on a GPU capped at it, out of memory). Plain training's math."""
    from models import make_llama

    n = 7
    data = batches(n)
    ref, ref_opt = make_llama()
    ref_losses = [train_step(ref, ref_opt, t) for t in data]
    model, opt = make_llama()
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=5 * params_bytes(ref) // 2,
                   page_min_bytes=0, gather_between_steps="budget", log=lambda _: None)
    full = []
    real = tt.planned.PlannedRun.gather_globals

    def gather(run, limit=None):
        full.append(limit is None)
        return real(run, limit)

    monkeypatch.setattr(tt.planned.PlannedRun, "gather_globals", gather)
    losses = [0.0] * n
    for i, t in enumerate(data):
        with s.step():
            losses[i] = train_step(model, opt, t)
    modes = [r["mode"] for r in s.steps]
    assert modes.count("planned") >= 3, modes
    assert full and not any(full), (modes, full)
    assert losses == ref_losses
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    s.close()


def test_a_budgeted_session_holds_at_most_the_budget_from_its_first_step(tmp_path):
    """gather_between_steps="budget" from the first step on: parameters, gradients and AdamW
    states that together pass the budget are never all resident at once: not at the end of the
    paged and profiled steps (the pager leaves stored what does not fit), and not when the first
    planned step starts (the stored ones come back one at a time, the executor moving those its
    plan starts on a tier there as soon as it holds more than the budget), so a GPU whose
    allocator is capped at the budget runs it. The training is plain training's, bitwise."""
    ref_losses, ref_model = reference(6)
    # between steps the parameters and two AdamW states (gradients are set to None) take 3x the
    # parameters: they do not fit
    budget = 5 * params_bytes(ref_model) // 2
    model, opt = make()
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=budget,
                   page_min_bytes=0, gather_between_steps="budget", log=lambda _: None)

    def held():  # bytes of the parameters, gradients and optimizer states resident now
        seen = {}
        for p in model.parameters():
            for t in [p, p.grad, *opt.state.get(p, {}).values()]:
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    st = t.untyped_storage()
                    seen[st._cdata] = st.nbytes()
        return sum(seen.values())

    most = [0]
    bring = None
    losses, modes = [], []
    for t in batches(6):
        with s.step():
            losses.append(train_step(model, opt, t))
        modes.append(s.steps[-1]["mode"])
        assert held() <= budget, (modes, held(), budget)
        if s.pager is not None and bring is None:
            bring = s.pager.bring_back

            def counted(st, _bring=bring):
                r = _bring(st)
                most[0] = max(most[0], held())
                return r

            s.pager.bring_back = counted
    assert modes[0] == "paged" and "planned" in modes, modes
    with s.gathered():
        assert held() == 3 * params_bytes(ref_model)  # (all of them: more than the budget)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < most[0] <= budget + largest, (most[0], budget)  # the first plan's start, one at a time
    assert losses == ref_losses
    with s.gathered():
        for p, q in zip(ref_model.parameters(), model.parameters()):
            assert torch.equal(p, q)
    s.close()


@pytest.mark.parametrize("gather", [True, "budget"])
def test_what_the_trainer_holds_after_a_paged_step_is_readable(tmp_path, gather):
    """The loss (and any tensor besides parameters, gradients and optimizer states that the
    trainer holds past the step) is readable after every step, also where the pager stored it
    in the step's backward and gather_between_steps="budget" leaves globals stored: only those
    may stay in the store between steps. The losses are plain training's, bitwise."""
    ref_losses, _ = reference(4)
    model, opt = make()
    budget = 5 * params_bytes(model) // 2  # (the states do not fit beside the parameters)
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=budget,
                   page_min_bytes=0, gather_between_steps=gather, log=lambda _: None)
    losses = []
    for t in batches(4):
        with s.step():
            loss = model(t)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # (after the step: the pager may have stored it)
    assert s.pager is not None and s.pager.evictions > 0
    assert losses == ref_losses
    s.close()


def test_a_full_gather_past_the_budget_is_said_once(tmp_path):
    model, opt = make()
    lines = []
    budget = 3 * params_bytes(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=budget, page_min_bytes=0,
                   log=lines.append)
    for t in batches(5):
        with s.step():
            train_step(model, opt, t)
    planned = [r for r in s.steps if r["mode"] == "planned"]
    assert planned and all(r["gathered"]["used_bytes"] > budget and r["gathered"]["left_off"] == 0
                           for r in planned), planned
    said = [ln for ln in lines if "past the budget" in ln]
    assert len(said) == 1 and "gather_between_steps='budget'" in said[0], lines
    s.close()


def test_the_trace_peak_exceeds_the_budget_it_ran_under():
    ref_losses, ref_model = reference(3)
    budget = 3 * params_bytes(ref_model)
    losses, model, s = trained(MemStore(), budget, 3)
    assert losses == ref_losses
    peaks = [r["trace_peak_bytes"] for r in s.steps if "trace_peak_bytes" in r]
    # the trace is of the iteration as if nothing moved: paging does not shorten lifetimes
    assert peaks and peaks[-1] > budget


def test_shapes_change_each_shape_profiled_once():
    model, opt = make()
    ref_model, ref_opt = make()
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 97, (4, 16 if i % 2 == 0 else 8), generator=g) for i in range(6)]
    # the very first step creates the optimizer's state (other operators): a warm-up step
    from test_planned import ScriptedExecutor, script_for

    exs = []

    def factory(*a):
        # one executor holds the global tensors at a time: the last one finished first
        assert all(ex.finished for ex in exs), "an executor started while another holds the globals"
        exs.append(ScriptedExecutor(*a))
        return exs[-1]

    s = tt.Session(model, opt, gpu_budget_bytes=3 * params_bytes(model), page_min_bytes=0, warmup_steps=1,
                   log=lambda _: None, _hooks=Hooks(store=MemStore(), planner=script_for, executor_factory=factory))
    for t in data:
        with s.step():
            a = train_step(model, opt, t)
        b = train_step(ref_model, ref_opt, t)
        assert a == b
    assert len(s.plans) == 2  # one per sequence length
    assert [r.get("plan") for r in s.steps[:3]] == [None, "made", "made"]
    assert [r["mode"] for r in s.steps] == ["paged"] * 3 + ["planned"] * 3
    # a new executor at each change of shape (16, 8, 16), each of its plan's shape
    assert len(exs) == 3 and all(ex.shrunk > 0 for ex in exs)
    assert exs[0].trace is exs[2].trace and exs[1].trace is not exs[0].trace
    assert all(ex.finished for ex in exs[:2])


def test_report_line_and_bad_arguments():
    model, opt = make()
    lines = []
    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 30, report_every=1, log=lines.append)
    with s.step():
        train_step(model, opt, batches(1)[0])
    assert lines and lines[0].startswith("teraio step 0: paged,") and "moved 0.00 GB" in lines[0]
    with pytest.raises(ValueError, match="gpu_budget_bytes"):
        tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=0)
    with pytest.raises(ValueError, match="profile_steps"):
        tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1, profile_steps=0)


def test_a_plan_without_an_executor_pages_without_recording():
    ref_losses, ref_model = reference(5)
    model, opt = make()

    def no_executor(*a):
        raise NotImplementedError("no executor in this build")

    s = tt.Session(model, opt, gpu_budget_bytes=3 * params_bytes(ref_model), page_min_bytes=0,
                   warmup_steps=1, log=lambda _: None,
                   _hooks=Hooks(store=MemStore(), planner=lambda tr, b, h: {"policy": "scripted"},
                                executor_factory=no_executor))
    losses = []
    for t in batches(5):
        with s.step():
            losses.append(train_step(model, opt, t))
        assert s.steps[-1]["mode"] == "paged"
    assert losses == ref_losses
    assert s.steps[1].get("plan") == "made"
    assert all(r.get("planned_failed") == "no executor in this build" for r in s.steps[2:])
    assert not s.profiler.ops, "steps after the plan are not recorded"
    assert all(r["bytes_moved"] > 0 for r in s.steps[2:])


def test_plans_take_each_operators_median_time_over_the_profiled_steps():
    model, opt = make()
    planned = []
    s = tt.Session(model, opt, gpu_budget_bytes=3 * params_bytes(model), page_min_bytes=0,
                   warmup_steps=1, profile_steps=3, log=lambda _: None,
                   _hooks=Hooks(store=MemStore(), executor_factory=lambda *a: None,
                                planner=lambda tr, b, h: planned.append(tr) or {"policy": "scripted"}))
    # the profiled steps' operator times, scripted: step 1 all 1 us, step 2 all 100 us, step 3
    # kernel i 2 + i us (even i) or 150 + i us (odd i): the medians are min(2 + i, 100) and 100,
    # where the last step's times alone would be 2 + i and 150 + i
    real = s.profiler.trace
    calls = []

    def scripted():
        tr = real()
        for i, k in enumerate(tr["kernels"]):
            k["duration_us"] = [1.0, 100.0, 2.0 + i if i % 2 == 0 else 150.0 + i][len(calls)]
        calls.append(1)
        return tr

    s.profiler.trace = scripted
    for t in batches(5):
        with s.step():
            train_step(model, opt, t)
        if planned:
            break
    assert len(calls) == 3 and len(planned) == 1, (len(calls), s.steps)
    got = [k["duration_us"] for k in planned[0]["kernels"]]
    assert got == [min(2.0 + i, 100.0) if i % 2 == 0 else 100.0 for i in range(len(got))], got[:6]


def test_pager_pages_while_storages_die_in_a_garbage_collection():
    """A storage held only by a reference cycle dies when a garbage collection runs, which any
    allocation may start, also while the pager picks what to page out or bring back: its
    finalizer leaves the pager's table meanwhile (it used to raise "dictionary changed size during
    iteration", seen once in CI). Here an entry of the table runs a storage's finalizer when it is
    read, as such a collection would."""
    store = MemStore()
    pager = tt.Pager(tt.StorageMover(store), budget_bytes=4 * 4096, min_bytes=0)
    xs = [torch.full((1024,), float(i)) for i in range(8)]
    for i, x in enumerate(xs):
        pager.seen(x.untyped_storage(), i)
    dying = torch.full((1024,), -1.0)
    pager.seen(dying.untyped_storage(), 8)
    key = next(k for k, p in pager.known.items() if p.last_use == 8)
    reads = []

    class Collecting:
        """A table entry whose read finalizes the storage ``key`` (a collection mid-loop)."""
        bytes = 0
        last_use = -1

        @property
        def resident(self):
            reads.append(1)
            p = pager.known.get(key)
            if p is not None:
                pager._died(key, p)
            return False

        def ref(self):
            return None

    pager.known = {-1: Collecting(), **pager.known}
    out = torch.full((1024,), 9.0)
    pager.seen(out.untyped_storage(), 100)
    pager.after([out.untyped_storage()], 100)  # over the budget: pages out
    assert reads and key not in pager.known
    assert [x.untyped_storage().nbytes() for x in xs].count(0) >= 4, "paged out to the budget"
    pager.restore_all()
    assert all(torch.equal(x, torch.full((1024,), float(i))) for i, x in enumerate(xs))


def test_pager_makes_room_before_an_operator_for_what_its_like_made_the_last_time():
    """An operator's outputs land beside its inputs before :meth:`after` can page anything out:
    the first time an operator of its name and input sizes runs the pager cannot know their
    size and memory goes over the budget until the operator ends; after that the room is made
    before it runs (seen on GPT-2's paged steps: 7.49 GiB in use under a 7.02 GiB cap at the
    logits' backward), also where the step's operators shifted (a step with checkpointed layers
    runs more of them) and for a model's later layers in its first step."""
    store = MemStore()
    kib4 = 4096
    pager = tt.Pager(tt.StorageMover(store), budget_bytes=4 * kib4, min_bytes=0)
    a, b, c = (torch.full((1024,), float(i)) for i in range(3))  # the step's globals, 4 KiB each
    for x in (a, b, c):
        pager.seen(x.untyped_storage(), -1)
    peaks = []
    after = pager.after

    def measured_after(storages, op, name=""):
        peaks[-1] = max(peaks[-1], pager.used_bytes())  # the operator's outputs are in
        after(storages, op, name)

    pager.after = measured_after

    def step(shift, layers=1):
        peaks.append(0)
        op = 0
        if shift:  # an operator more first: every later index moves
            pager.dispatch(torch.ops.aten.neg.default, (torch.ones(2),), {}, op, a.device)
            op += 1
        total = 0.0
        for _ in range(layers):
            d = pager.dispatch(torch.ops.aten.add.Tensor, (a, b), {}, op, a.device)  # makes 4 KiB
            e = pager.dispatch(torch.ops.aten.cat.default, ([c, d],), {}, op + 1, a.device)  # 8 KiB
            total += float(pager.dispatch(torch.ops.aten.sum.default, (e,), {}, op + 2, a.device))
            op += 3
            del d, e
        return total

    losses = [step(False), step(False), step(True)]
    assert peaks[0] > pager.budget, "the first time, the pager cannot know what the operator makes"
    assert peaks[1:] == [pager.budget, pager.budget], peaks
    assert pager.made[("cat", (kib4, kib4))] == 2 * kib4
    assert losses == [3072.0] * 3  # sum(cat([c, a + b])): 1024 * 2 + 1024 * (0 + 1)
    # a fresh pager, three layers in its first step: only the first layer goes over
    pager.restore_all()
    pager.made.clear()
    seen_peaks = []

    def per_op_after(storages, op, name=""):
        seen_peaks.append(pager.used_bytes())
        after(storages, op, name)

    pager.after = per_op_after
    assert step(False, layers=3) == 3 * 3072.0
    after_first = seen_peaks[3:]
    assert max(seen_peaks[:3]) > pager.budget and max(after_first) <= pager.budget, seen_peaks
    pager.restore_all()
    assert [x.tolist() for x in (a, b, c)] == [[float(i)] * 1024 for i in range(3)]


def test_pager_retries_an_operator_that_ran_out_of_memory():
    store = MemStore()
    pager = tt.Pager(tt.StorageMover(store), budget_bytes=1 << 30, min_bytes=0)
    xs = [torch.full((1024,), float(i)) for i in range(4)]
    for i, x in enumerate(xs):
        pager.seen(x.untyped_storage(), i)
    calls = []

    def op(a):
        calls.append(1)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("scripted")
        return a * 2

    restarts = []  # the profiler restarts the operator's clock there: paging is not its time
    out = pager.run_op(op, (xs[0],), {}, [xs[0].untyped_storage()], 4,
                       again=lambda: restarts.append(sum(x.untyped_storage().nbytes() for x in xs)))
    assert len(calls) == 2 and torch.equal(out, xs[0] * 2)
    assert restarts == [4096], "called once, after the paging out, before the second attempt"
    # everything the operator did not use went out, and comes back intact
    assert [x.untyped_storage().nbytes() for x in xs] == [4096, 0, 0, 0]
    pager.restore_all()
    assert all(torch.equal(x, torch.full((1024,), float(i))) for i, x in enumerate(xs))
    assert store.d == {}


def test_a_plan_that_does_not_fit_the_array_is_refused_and_steps_keep_paging(tmp_path):
    engine = engine_store(tmp_path)

    class SmallArray:
        """The engine, saying its array holds 64 KiB: less than the copies any plan under this
        budget needs (the session reads the capacity from the store)."""

        capacity_bytes = 64 << 10

        def __getattr__(self, name):
            return getattr(engine, name)

    ref_losses, ref_model = reference(4)
    budget = 3 * params_bytes(ref_model)
    model, opt = make()
    lines = []
    s = tt.Session(model, opt, _hooks=Hooks(store=SmallArray()), gpu_budget_bytes=budget, page_min_bytes=0,
                   log=lines.append)
    losses = []
    for t in batches(4):
        with s.step():
            losses.append(train_step(model, opt, t))
    assert losses == ref_losses
    refused = [r["plan"] for r in s.steps if str(r.get("plan", "")).startswith("refused")]
    assert refused and "on the SSD array" in refused[0] and "holds 65536" in refused[0], \
        [r.get("plan") for r in s.steps]
    assert all(r["mode"] == "paged" for r in s.steps)
    assert any("no plan for this iteration" in line for line in lines)
    # every step's log line from the one that was to plan on says it pages, and why (the first
    # step made the optimizer's state: no plan was tried)
    step_lines = [line for line in lines if line.startswith("teraio step")]
    assert len(step_lines) == 4 and "no plan:" not in step_lines[0]
    assert all("paged (no plan: " in line and "holds 65536" in line for line in step_lines[1:]), step_lines
    s.close()
    engine.close()


# Recomputation: with a slow disk and PCIe in the hardware model, plans drop activations and
# make them again (their operator run once more) instead of moving them; the losses and the
# parameters stay bitwise those of plain training.
_SLOW = {"ssd_count": 1, "ssd_read_bytes_per_s": 1e7, "ssd_write_bytes_per_s": 1e7, "ssd_latency_us": 80.0,
         "pcie_h2d_bytes_per_s": 1e8, "pcie_d2h_bytes_per_s": 1e8, "host_memory_cap_bytes": 0,
         "host_memory_bytes_per_s": 1e9, "gpudirect": False}


@pytest.mark.parametrize("store_kind", ["engine", "engine-device"])
def test_planned_steps_recompute_activations_with_the_same_losses(tmp_path, store_kind):
    store = engine_store(tmp_path, device=store_kind == "engine-device")
    data = batches(5, batch=16, seq=64)
    ref_model, ref_opt = make(seq=64)
    ref_losses = [train_step(ref_model, ref_opt, t) for t in data]
    model, opt = make(seq=64)
    budget = 10 * params_bytes(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, page_min_bytes=0,
                   hardware=dict(_SLOW, gpu_memory_bytes=budget), log=lambda _: None)
    losses = []
    for t in data:
        with s.step():
            losses.append(train_step(model, opt, t))
    assert losses == ref_losses
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    (entry,) = s.plans.values()
    planned = len(entry.plan.to_dict()["recomputations"])
    assert planned > 0, "the plan recomputes activations"
    assert [r["mode"] for r in s.steps][2:] == ["planned"] * 3, s.steps
    for r in s.steps[2:]:
        assert r["recomputed"] == planned and r["executor"]["recomputations"] == planned
        assert r["executor"]["lost"] is None and "diverged" not in r
    # written in place by the operator's out= form where it has one (else run and copied)
    assert 0 < entry.run.recomputed_in_place <= planned
    # every recomputed tensor is an activation the profiler said how to make again
    tensors = entry.trace["tensors"]
    for rc in entry.plan.to_dict()["recomputations"]:
        t = tensors[rc["tensor"]]
        assert t["kind"] == "activation" and "producer" in t, t
    s.close()


class _Flaky:
    """An operator whose recomputation does not give back the bytes it made the first time (as
    a kernel that picks its algorithm by where its memory lies may): the real one, its result
    nudged."""

    def __init__(self, real):
        self.real, self.__name__ = real, real.__name__
        self.overloadpacket = None  # (no out= form: the recomputation runs it and copies)

    def __call__(self, *args, **kwargs):
        out = self.real(*args, **kwargs)
        many = isinstance(out, (tuple, list))
        nudged = [o.clone() for o in (out if many else (out,))]
        for o in nudged:
            if o.is_floating_point() and o.numel():
                o.view(-1)[0] += 1.0
        return type(out)(nudged) if many else nudged[0]


def _flaky_recompute(monkeypatch):
    """Make the first recomputed operator (and every later recomputation of it) flaky; returns
    the list its name is put in."""
    from teraio.torch import planned

    flaky: list[str] = []
    real = planned.PlannedRun.recompute

    def recompute(self, tid, mem=None):
        p = self._producers.get(tid)
        if p is not None:
            func = p[0].real if isinstance(p[0], _Flaky) else p[0]
            if not flaky:
                flaky.append(planned.op_name(func))
            if planned.op_name(func) == flaky[0]:
                self._producers[tid] = (_Flaky(func),) + p[1:]
        return real(self, tid, mem)

    monkeypatch.setattr(planned.PlannedRun, "recompute", recompute)
    return flaky


def _fixed_durations(monkeypatch, us=10.0):
    """Plans made from operators of ``us`` microseconds each instead of the CPU's measured times:
    what a plan recomputes then follows from the bytes alone, the same on every machine and
    under any load (with measured times a loaded CPU made some plans recompute nothing)."""
    from teraio.torch import session

    real = session._median_durations

    def fixed(trace, times):
        real(trace, times)
        for k in trace["kernels"]:
            k["duration_us"] = us

    monkeypatch.setattr(session, "_median_durations", fixed)


@pytest.mark.parametrize("verify", [True, False])
def test_a_recomputation_that_does_not_reproduce_its_bytes_is_caught_and_never_planned_again(
        tmp_path, monkeypatch, verify):
    flaky = _flaky_recompute(monkeypatch)
    _fixed_durations(monkeypatch)
    store = engine_store(tmp_path)
    data = batches(6, batch=16, seq=64)
    ref_model, ref_opt = make(seq=64)
    ref_losses = [train_step(ref_model, ref_opt, t) for t in data]
    model, opt = make(seq=64)
    budget = 10 * params_bytes(model)
    lines = []
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, page_min_bytes=0, verify_recompute=verify,
                   hardware=dict(_SLOW, gpu_memory_bytes=budget), log=lines.append)
    losses = []
    for t in data:
        with s.step():
            losses.append(train_step(model, opt, t))
    assert flaky, "a plan recomputed something"
    if not verify:
        # unchecked, the flaky operator's bytes reach the training (what the check is for)
        assert losses != ref_losses
        s.close()
        return
    assert losses == ref_losses
    for p, q in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    caught = [r for r in s.steps if r.get("unstable_recompute")]
    assert len(caught) == 1 and caught[0]["unstable_recompute"] == flaky, s.steps
    assert caught[0]["recomputations_checked"] > 0
    assert flaky[0] in s.profiler.unstable_ops
    assert sum(f"recomputing {flaky[0]} did not give back" in line for line in lines) == 1, lines
    # made again without recomputing it: no later step recomputes it, and the newer plan's
    # trace gives its results no producer
    later = s.steps[s.steps.index(caught[0]) + 1:]
    assert later and all("unstable_recompute" not in r for r in later)
    # the newer plan's recomputations are checked in its first step only
    again = [r for r in later if r["mode"] == "planned"]
    assert len(again) >= 2 and again[0].get("recomputations_checked", 0) > 0, s.steps
    assert all("recomputations_checked" not in r for r in again[1:]), s.steps
    for e in s.plans.values():
        kernels, tensors = e.trace["kernels"], e.trace["tensors"]
        for t in tensors:
            if "producer" in t:
                assert kernels[t["created_by"]]["name"].split(".", 1)[-1] != flaky[0]
    s.close()


def test_chains_remade_under_a_longer_shapes_plan_are_bitwise_in_bf16(tmp_path):
    """Found on the H200 (bf16 losses leaving plain training's after the first step under a
    recomputing plan) and then here: a kernel's recomputations ran in the plan's order, so a
    result (an RMSNorm's product) was remade before its input (the embedding) was, reading
    memory the input had not been made in yet; the bitwise check of recomputations caught it
    (``unstable_recompute``). A transformers Llama under bf16 autocast, four lengths, a slow
    disk and PCIe in the hardware model (plans recompute chains)."""
    pytest.importorskip("transformers")
    import random

    def build():
        m = hf_llama(vocab=1000, hidden=128, ffn=344, layers=2, max_len=512)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)

    rng = random.Random(0)
    lens = rng.sample([48, 64, 80, 96, 112, 128], 4)
    order = [rng.choice(lens) for _ in range(14)]
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 1000, (4, n), generator=g) for n in order]

    def train(m, opt, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=t, labels=t).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    ref_m, ref_opt = build()
    ref = [train(ref_m, ref_opt, t) for t in data]
    m, opt = build()
    budget = 3 * params_bytes(m)
    s = tt.Session(m, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=budget, page_min_bytes=0,
                   hardware=dict(_SLOW, gpu_memory_bytes=1 << 30), log=lambda _: None)
    got = []
    for t in data:
        with s.step():
            got.append(train(m, opt, t))
    modes = [r["mode"] for r in s.steps]
    assert "bounded" in modes and "planned" in modes, modes
    assert sum(r.get("recomputed", 0) for r in s.steps) > 0
    assert sum(r.get("recomputations_checked", 0) for r in s.steps) > 0
    assert [r.get("unstable_recompute") for r in s.steps if r.get("unstable_recompute")] == []
    assert got == ref
    for p, q in zip(ref_m.parameters(), m.parameters()):
        assert torch.equal(p, q)
    s.close()


def test_recompute_off_leaves_producers_out_and_plans_only_move(tmp_path):
    store = engine_store(tmp_path)
    model, opt = make(seq=64)
    budget = 10 * params_bytes(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, page_min_bytes=0, recompute=False,
                   hardware=dict(_SLOW, gpu_memory_bytes=budget), log=lambda _: None)
    for t in batches(3, batch=16, seq=64):
        with s.step():
            train_step(model, opt, t)
    (entry,) = s.plans.values()
    assert not any("producer" in t for t in entry.trace["tensors"])
    assert entry.plan.to_dict().get("recomputations", []) == []
    assert "recomputed" not in s.steps[2]
    s.close()


@pytest.mark.parametrize("margin", [0.03, 0.5])
def test_of_two_close_plans_the_one_that_moves_less_is_taken(tmp_path, margin):
    store = engine_store(tmp_path)
    model, opt = make(seq=64)
    budget = 10 * params_bytes(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, page_min_bytes=0,
                   traffic_margin=margin, hardware=dict(_SLOW, gpu_memory_bytes=budget), log=lambda _: None)
    for t in batches(3, batch=16, seq=64):
        with s.step():
            train_step(model, opt, t)
    (entry,) = s.plans.values()
    t = entry.traffic
    moved = lambda p: p.to_dict()["stats"]["ssd_offload_bytes"] + p.to_dict()["stats"]["host_offload_bytes"]  # noqa: E731
    take = (t["slower_transfers_moved_bytes"] < t["modelled_moved_bytes"]
            and t["slower_transfers_s"] <= t["modelled_s"] * (1 + margin))
    assert t["chosen"] == ("planned for slower transfers" if take else "as modelled"), t
    assert moved(entry.plan) == (t["slower_transfers_moved_bytes"] if take else t["modelled_moved_bytes"])
    assert ("planned for slower transfers" in s.steps[1]["plan"]) == take
    assert s.steps[2]["mode"] == "planned" and "diverged" not in s.steps[2]
    s.close()


# (the rule that takes the second plan, with the cases that were tested here against a scripted
# planner, is the scheduler's now: scheduler/src/select.rs, `the_second_plan_rule`)


def test_traffic_margin_zero_plans_once(tmp_path):
    store = engine_store(tmp_path)
    model, opt = make(seq=64)
    budget = 10 * params_bytes(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, page_min_bytes=0, traffic_margin=0,
                   hardware=dict(_SLOW, gpu_memory_bytes=budget), log=lambda _: None)
    for t in batches(2, batch=16, seq=64):
        with s.step():
            train_step(model, opt, t)
    (entry,) = s.plans.values()
    assert entry.traffic is None
    with pytest.raises(ValueError, match="traffic_margin"):
        tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, traffic_margin=1.5)


def test_plan_margin_plans_for_less_than_the_executor_runs_with(tmp_path):
    store = engine_store(tmp_path)
    model, opt = make(seq=64)
    budget = 10 * params_bytes(model)
    seen = {}
    from test_planned import script_for

    def planner(trace, gpu_bytes, host_bytes):
        seen["planned"] = gpu_bytes
        return script_for(trace, gpu_bytes, host_bytes)

    def factory(trace, plan, executor_bytes, allocator):
        seen["executor"] = executor_bytes
        raise NotImplementedError("only the budgets are checked here")

    s = tt.Session(model, opt, gpu_budget_bytes=budget, page_min_bytes=0, plan_margin=0.1,
                   log=lambda _: None, _hooks=Hooks(store=store, planner=planner, executor_factory=factory))
    for t in batches(3, batch=16, seq=64):
        with s.step():
            train_step(model, opt, t)
    assert s.plan_budget == budget  # on the CPU the executor keeps the whole budget
    assert seen == {"planned": int(budget * 0.9), "executor": budget}
    for bad in (-0.1, 0.5):
        with pytest.raises(ValueError, match="plan_margin"):
            tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, plan_margin=bad)


def test_on_a_gpu_plans_leave_room_for_the_largest_tensor(tmp_path):
    """On a GPU the plan budget is ``page_fraction`` of the budget and at least twice the
    profiled trace's largest tensor below it; on the CPU the whole budget (the rule is set from
    the trace when a step is profiled, here as a GPU session would)."""
    store = engine_store(tmp_path)
    model, opt = make(seq=64)
    budget = 10 * params_bytes(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, log=lambda _: None)
    assert s.plan_budget == budget
    s._plan_fraction = 0.85
    s._largest_tensor = budget // 20  # a small largest tensor: the fraction decides
    assert s.plan_budget == int(budget * 0.85)
    s._largest_tensor = budget // 5  # a large one: twice it stays free
    assert s.plan_budget == budget - 2 * (budget // 5)
    s._largest_tensor = budget // 2  # no room for it at all: the fraction, and the plan says what fails
    assert s.plan_budget == int(budget * 0.85)


class _Selecting(torch.nn.Module):
    """TinyGPT whose loss is over the positions a data-dependent ``nonzero`` picks: the same
    operators and argument shapes every step, a result whose size changes with the batch."""

    def __init__(self):
        super().__init__()
        self.gpt = make()[0]

    def forward(self, tokens):
        x = self.gpt.emb(tokens) + self.gpt.pos[: tokens.shape[1]]
        for layer in self.gpt.layers:
            x = layer(x)
        logits = self.gpt.head(self.gpt.ln(x)).reshape(-1, 97)
        picked = (tokens.reshape(-1) < 40).nonzero().squeeze(1)
        return torch.nn.functional.cross_entropy(logits[picked], tokens.reshape(-1)[picked])


def test_a_result_of_another_size_than_profiled_diverges_and_keeps_its_bytes(tmp_path):
    # the result of another size is found where it is used (the next operator's argument shape,
    # or the executor refusing the created storage when the plan moves it and giving it back);
    # the storage must stay as it is (it used to be shrunk like an offloaded one: the next
    # operator read an empty tensor)
    store = engine_store(tmp_path)
    data = batches(6)
    counts = [int((t < 40).sum()) for t in data]
    assert len(set(counts[2:])) > 1 and counts[1] != counts[2], counts
    torch.manual_seed(0)
    ref = _Selecting()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    ref_losses = [train_step(ref, ref_opt, t) for t in data]
    torch.manual_seed(0)
    model = _Selecting()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=3 * params_bytes(model), page_min_bytes=0,
                   log=lambda _: None)
    losses = []
    for t in data:
        with s.step():
            losses.append(train_step(model, opt, t))
    assert losses == ref_losses
    diverged = [r for r in s.steps if r["mode"] == "planned" and "diverged" in r]
    assert diverged, s.steps
    assert all("squeeze" in r["diverged"] and "shape" in r["diverged"] or "bytes" in r["diverged"]
               for r in diverged), diverged
    s.close()


# Quiet operators (nothing moves around them, only tensors the plan never moves) run without a
# call to the executor: a plan that moves nothing calls it for the first operator only, a
# squeezed plan for some; the executor accounts the skipped ones, the losses stay bitwise equal.
# A plan that moves nothing runs all but the first operator unwatched (no dispatch mode).
@pytest.mark.parametrize("store_kind", ["engine", "engine-device"])
def test_quiet_operators_skip_the_executor_and_keep_the_losses(tmp_path, store_kind):
    ref_losses, ref_model = reference(5)
    seen = {}
    for name, budget, policy in [("none", 100 * params_bytes(ref_model), "none"),
                                 ("squeezed", 3 * params_bytes(ref_model), "auto")]:
        store = engine_store(tmp_path / name, device=store_kind == "engine-device")
        model, opt = make()
        s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=budget, policy=policy, page_min_bytes=0,
                       log=lambda _: None)
        losses = []
        for t in batches(5):
            with s.step():
                losses.append(train_step(model, opt, t))
        assert losses == ref_losses, name
        planned = [r for r in s.steps if r["mode"] == "planned"]
        assert planned and not any("diverged" in r for r in planned), s.steps
        seen[name] = [(r["executor"]["quiet_kernels"], r["ops"], r["executor"]["offloads"], r.get("unwatched_ops", 0))
                      for r in planned]
        n = len(s.plans[next(iter(s.plans))].signatures)
        assert all(r["ops"] == n for r in planned), (n, planned)
        s.close()
    for quiet, ops, offloads, unwatched in seen["none"]:
        assert (quiet, offloads) == (ops - 1, 0), seen
        # after the first operator (the embedding) nothing is left to do: the rest of the step,
        # backward and optimizer included, runs without the dispatch mode
        assert unwatched == ops - 1, seen
    for quiet, ops, offloads, unwatched in seen["squeezed"]:
        assert 0 < quiet < ops - 1 and offloads > 0 and unwatched < ops - 1, seen


class _Doubling(torch.nn.Module):
    """TinyGPT whose forward, on request, runs plain operators the profile does not have
    between two module calls (no module hook of its own)."""

    def __init__(self):
        super().__init__()
        self.gpt, _ = make()
        self.twice = False

    def forward(self, tokens):
        g = self.gpt
        x = g.emb(tokens) + g.pos[: tokens.shape[1]]
        for layer in g.layers:
            x = layer(x)
            if self.twice:
                x = (x * 2.0) * 0.5
        logits = g.head(g.ln(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))


def test_operators_an_unwatched_stretch_does_not_check_still_train_right(tmp_path):
    # a plan that moves nothing runs unwatched after its first operator; extra operators there
    # are not checked one by one (documented): nothing the plan moves is ever away, so the
    # losses stay those of plain training
    data = batches(6)
    torch.manual_seed(0)
    ref = _Doubling()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    torch.manual_seed(0)
    model = _Doubling()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=100 * params_bytes(model),
                   policy="none", page_min_bytes=0, log=lambda _: None)
    for i, t in enumerate(data):
        model.twice = ref.twice = i == 4
        with s.step():
            a = train_step(model, opt, t)
        assert a == train_step(ref, ref_opt, t), i
    assert [r["mode"] for r in s.steps][2:] == ["planned"] * 4, s.steps
    assert all(r["unwatched_ops"] == r["ops"] - 1 for r in s.steps[2:]), s.steps
    s.close()


def test_a_long_training_keeps_the_latest_step_records():
    model, opt = make()
    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=3 * params_bytes(model), page_min_bytes=0,
                   keep_steps=2, log=lambda _: None)
    for t in batches(7):
        with s.step():
            train_step(model, opt, t)
    assert s.step_count == 7 and 2 <= len(s.steps) <= 4
    assert [r["step"] for r in s.steps] == list(range(7 - len(s.steps), 7))
    with pytest.raises(ValueError, match="keep_steps"):
        tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=None, keep_steps=0)
    s.close()


@pytest.mark.parametrize("fail_at", [0, 3])
def test_an_error_inside_a_step_surfaces_as_itself_and_the_next_steps_train_right(tmp_path, fail_at):
    # (step 0 is profiled and paged, step 3 planned: either way the loop's own error comes out,
    # and the session goes on as if the failed step had run without teraio)
    def loop(s, model, opt):
        losses = []
        for i, t in enumerate(batches(6)):
            try:
                with s.step() if s is not None else contextlib.nullcontext():
                    loss = model(t)
                    if i == fail_at:
                        raise KeyError("the loop's own error")
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
            except KeyError as e:
                assert "the loop's own error" in str(e)
                losses.append("raised")
        return losses

    ref_model, ref_opt = make()
    ref = loop(None, ref_model, ref_opt)
    model, opt = make()
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=3 * params_bytes(model),
                   page_min_bytes=0, log=lambda _: None)
    assert loop(s, model, opt) == ref
    assert ref.count("raised") == 1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert "planned" in [r["mode"] for r in s.steps]
    s.close()


def test_session_arguments_are_checked_when_it_is_made(tmp_path):
    model, opt = make()
    with pytest.raises(ValueError, match="hardware"):
        tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 20, hardware="no-such-preset")
    with pytest.raises(ValueError, match=r"hardware='.*hw\.json'.*cannot read"):
        tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 20, hardware=str(tmp_path / "hw.json"))
    with pytest.raises(ValueError, match="policy"):
        tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 20, policy="fastest")
    with pytest.raises(ValueError, match=r"gather_between_steps must be True .*'budget'.*got 'all'"):
        tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 20, gather_between_steps="all")
    with pytest.raises(ValueError, match="engine"):
        tt.Session(model, opt, gpu_budget_bytes=1 << 20)
    teraio = pytest.importorskip("teraio")
    # a JSON hardware model by path, as `teraio simulate --hw` reads it
    hw = tmp_path / "dev.json"
    hw.write_text(__import__("json").dumps(teraio.hardware("dev")))
    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 20, hardware=str(hw))
    assert s.hardware == teraio.hardware("dev")


def _planned_session(store, log, **kw):
    """A Session on ``store`` trained until its first plan is made."""
    model, opt = make()
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=3 * params_bytes(model), page_min_bytes=0, log=log, **kw)
    for t in batches(3):
        with s.step():
            train_step(model, opt, t)
    assert any("plan" in r and r["plan"].startswith("made") for r in s.steps), s.steps
    return s


def test_without_a_hardware_model_a_session_measures_this_machine_once_and_the_next_reads_it(tmp_path, monkeypatch):
    teraio = pytest.importorskip("teraio")
    cache = tmp_path / "cache"
    monkeypatch.setenv("TERAIO_CACHE_DIR", str(cache))
    lines = []
    eng = engine_store(tmp_path / "array")
    s = _planned_session(eng, lines.append)
    said = [ln for ln in lines if "hardware model" in ln]
    assert len(said) == 1 and "measured now" in said[0] and str(cache) in said[0], lines
    assert s.hardware_source in said[0] and s.report()["hardware"] == s.hardware_source
    (kept,) = os.listdir(cache)
    assert kept.startswith("hardware-") and kept.endswith(".json")
    model = s._hardware_model
    assert model["ssd_count"] == 2 and model == teraio.hardware(model)
    s.close()
    eng.close()
    # a later Session on the same machine and array: the model from the cache, not measured again
    measured = []
    eng = engine_store(tmp_path / "array")
    orig = eng.measure_hardware
    eng.measure_hardware = lambda **kw: measured.append(kw) or orig(**kw)
    lines = []
    s = _planned_session(eng, lines.append)
    said = [ln for ln in lines if "hardware model" in ln]
    assert len(said) == 1 and "from the cache" in said[0] and kept in said[0], lines
    assert measured == [{"cache": True, "fresh": False}]
    assert s._hardware_model == model
    s.close()
    # hardware="measure": measured again now, and the cache replaced
    lines = []
    s = _planned_session(eng, lines.append, hardware="measure")
    said = [ln for ln in lines if "hardware model" in ln]
    assert len(said) == 1 and "measured now" in said[0], lines
    assert measured[-1] == {"cache": True, "fresh": True}
    assert os.listdir(cache) == [kept]
    s.close()
    # a model given is used as given, and the log says so
    lines = []
    s = _planned_session(eng, lines.append, hardware="dev")
    assert [ln for ln in lines if "hardware model" in ln][0].endswith("hardware model: given (preset 'dev')")
    assert len(measured) == 2
    s.close()
    eng.close()


def test_a_store_that_cannot_measure_plans_for_the_paper_and_says_so():
    lines = []
    s = _planned_session(MemStore(), lines.append)
    said = [ln for ln in lines if "hardware model" in ln]
    assert len(said) == 1 and "the paper's machine" in said[0] and "hardware=" in said[0], lines
    assert s._hardware_model == "paper"


def test_a_bad_hardware_value_is_an_error_naming_the_argument(tmp_path):
    model, opt = make()
    kw = dict(_hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"Session\(hardware=42\): a int is not a hardware model; pass None .*\"measure\""):
        tt.Session(model, opt, hardware=42, **kw)
    with pytest.raises(ValueError, match=r"Session\(hardware='no-such-preset'\): .*unknown hardware preset.*pass None"):
        tt.Session(model, opt, hardware="no-such-preset", **kw)
    with pytest.raises(ValueError, match=r"Session\(hardware=\{'ssd_count': 'four'\}\)"):
        tt.Session(model, opt, hardware={"ssd_count": "four"}, **kw)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"hardware='.*list\.json'\): the file holds a JSON list"):
        tt.Session(model, opt, hardware=str(listed), **kw)
    with pytest.raises(ValueError, match=r"Session\(hardware='measure'\): measuring this machine needs a teraio engine"):
        tt.Session(model, opt, hardware="measure", **kw)


def test_a_step_line_is_logged_by_default():
    model, opt = make()
    lines = []
    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 30, log=lines.append)
    for t in batches(2):
        with s.step():
            train_step(model, opt, t)
    assert [ln.split(":")[0] for ln in lines] == ["teraio step 0", "teraio step 1"]


def test_a_global_whose_storage_was_replaced_between_steps_is_an_error_naming_it(tmp_path):
    # (the executor must never write into memory that is no longer the tensor's)
    model, opt = make()
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=3 * params_bytes(model),
                   page_min_bytes=0, log=lambda _: None)
    data = batches(6)
    for t in data[:4]:
        with s.step():
            train_step(model, opt, t)
    assert s.steps[-1]["mode"] == "planned"
    with torch.no_grad():
        model.head.weight.data = model.head.weight.data.clone()  # a new storage, outside the plan
    with pytest.raises(RuntimeError, match=r"global tensor param:head\.weight .*was moved outside the plan"):
        with s.step():
            train_step(model, opt, data[4])


class _Repeating(torch.nn.Module):
    """A TinyGPT whose hidden states, for length 12 only, are repeated three times along the
    sequence (36 positions: more than any length-16 plan holds) right after the input is read."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inner = __import__("models").TinyGPT()

    def forward(self, tokens):
        m = self.inner
        x = m.emb(tokens) + m.pos[: tokens.shape[1]]
        if tokens.shape[1] == 12:
            x = torch.cat([x, x, x], dim=1)
        for layer in m.layers:
            x = layer(x)
        logits = m.head(m.ln(x))[:, : tokens.shape[1]]
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("store_kind", ["engine", "engine-device"])
def test_a_bounded_step_that_leaves_its_plan_trains_as_plain_training(tmp_path, store_kind):
    """A new shorter shape starts under a longer shape's plan (bounded) and then does what no
    plan of the longer shape covers: the step leaves the plan (safe mode) and its loss, and the
    training after it, are plain training's, bitwise."""
    g = torch.Generator().manual_seed(3)
    lengths = [16, 16, 12, 12, 16, 12, 16]
    data = [torch.randint(0, 97, (3, n), generator=g) for n in lengths]

    def opt_of(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)

    ref = _Repeating()
    ref_opt = opt_of(ref)
    ref_losses = [train_step(ref, ref_opt, t) for t in data]
    model = _Repeating()
    opt = opt_of(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path, device=store_kind == "engine-device")),
                   gpu_budget_bytes=3 * params_bytes(model), page_min_bytes=0, hardware="dev", log=lambda _: None)
    losses = []
    for t in data:
        with s.step():
            losses.append(train_step(model, opt, t))
    left = [r for r in s.steps if r["mode"] == "bounded" and r.get("diverged")]
    assert left, [(r["mode"], r.get("diverged")) for r in s.steps]
    assert losses == ref_losses, [(r["mode"], r.get("diverged")) for r in s.steps]
    for p, q in zip(ref.parameters(), model.parameters()):
        assert torch.equal(p, q)
    s.close()


def test_a_step_that_can_never_fit_stops_at_the_operator_naming_it(tmp_path):
    """An operator whose inputs and outputs alone exceed the budget stops the first step there
    (before the step goes on, before any plan), naming the kernel, its bytes, the budget and what
    to do; nothing of the step is recorded."""
    model, opt = make()
    budget = params_bytes(model) // 8
    lines = []
    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=budget, page_min_bytes=0, log=lines.append)
    ran = []
    hook = model.register_forward_hook(lambda *a: ran.append(1))
    with pytest.raises(tt.WorkingSetTooLarge) as e:
        for t in batches(2):
            with s.step():
                train_step(model, opt, t)
    hook.remove()
    assert e.value.bytes_needed > budget and e.value.budget == budget
    msg = str(e.value)
    assert f"kernel {e.value.kernel} (" in msg and "more than the GPU budget" in msg and str(budget) in msg, msg
    assert "gpu_budget_bytes" in msg, msg
    assert e.value.kernel_name.startswith("fwd."), e.value.kernel_name
    assert ran == [], "stopped inside the first step's forward, before the model's forward returned"
    assert s.steps == [] and s.plans == {}
    s.close()


def test_a_kernel_that_fits_the_budget_is_planned_whatever_the_allowance(tmp_path):
    """The allowance would leave less than the largest working set: the plan and its executor get
    that working set and 1% of it (the scheduler's WORKING_SET_SLACK; the budget holds it),
    where the Session used to refuse it."""
    store = engine_store(tmp_path)
    model, opt = make(seq=64)
    seen = {}
    from test_planned import script_for

    def planner(trace, gpu_bytes, host_bytes):
        seen["trace"], seen["planned"] = trace, gpu_bytes
        return script_for(trace, gpu_bytes, host_bytes)

    def factory(trace, plan, executor_bytes, allocator):
        seen["executor"] = executor_bytes
        raise NotImplementedError("only the budgets are checked here")

    budget = 10 * params_bytes(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=store, planner=planner, executor_factory=factory),
                   gpu_budget_bytes=budget, page_min_bytes=0, allocator_allowance="fixed", log=lambda _: None)
    s._plan_fraction = 0.01  # (as a GPU session whose allowance would leave almost nothing)
    for t in batches(3, batch=16, seq=64):
        with s.step():
            train_step(model, opt, t)
    ws = max(sum(t["bytes"] for t in seen["trace"]["tensors"] if k in t["accesses"])
             for k in range(len(seen["trace"]["kernels"])))
    assert s.plan_budget < ws <= budget
    raised = min(ws + int(ws * 0.01), budget)
    assert seen["planned"] == raised and seen["executor"] == raised
    (entry,) = s.plans.values()
    assert entry.budget == raised
    s.close()


def test_the_measured_allowance_and_the_rule_that_uses_it():
    """What the allocator needs beside the plan: from a profiled step's figures (the GPU's come
    from ``torch.cuda.memory_stats``, given here), and which allowance the plan budget takes."""
    from teraio.torch.session import measured_allowance

    stats = {"reserved_bytes.all.peak": 10_000, "allocated_bytes.all.peak": 7_000}
    assert measured_allowance(stats, 500) == 3_500
    assert measured_allowance({}, 0) == 0  # the CPU: nothing beside the traced storages
    assert measured_allowance({"reserved_bytes.all.peak": 1, "allocated_bytes.all.peak": 9}, -3) == 0

    model, opt = make()
    budget = 10 * params_bytes(model)
    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=budget, page_min_bytes=0,
                   allocator_allowance="measured", log=lambda _: None)
    s._plan_fraction = 0.85
    assert s.plan_budget == int(budget * 0.85), "no measurement yet: the fixed rule"
    # the GPU hook, fed a caching allocator's figures
    real_stats, real_device = torch.cuda.memory_stats, s.device
    try:
        torch.cuda.memory_stats = lambda device=None: stats
        s.device = torch.device("cuda")
        s.pager.untraced_peak_bytes = 500
        s._measure_allowance()
    finally:
        torch.cuda.memory_stats, s.device = real_stats, real_device
    assert s._measured_allowance == 3_500 and s.pager.untraced_peak_bytes == 0
    assert s.plan_budget == budget - 3_500
    s.allocator_allowance = "fixed"
    assert s.plan_budget == int(budget * 0.85)
    s.allocator_allowance = 1_234
    assert s.plan_budget == budget - 1_234
    s.close()
    # "auto" on the CPU path: measured in the profiled step (nothing beside the traced storages)
    model, opt = make()
    s = tt.Session(model, opt, gpu_budget_bytes=budget, page_min_bytes=0, log=lambda _: None,
                   _hooks=Hooks(store=MemStore(), planner=lambda tr, b, h: {"policy": "scripted"},
                                executor_factory=lambda *a: None))
    for t in batches(2):
        with s.step():
            train_step(model, opt, t)
    assert s._measured_allowance == 0 and s.plan_budget == budget
    s.close()
    for bad in ("some", -1, 0.5, True):
        with pytest.raises(ValueError, match="allocator_allowance"):
            tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=budget, allocator_allowance=bad)


def test_steps_that_run_the_pagers_schedule_say_so(tmp_path, monkeypatch):
    """Where no plan of the policy runs, the scheduler's selection falls back to the pager's
    schedule as a plan (scheduler/src/select.rs tests when); the Session's log says so, once, and
    in every step line that runs it."""
    import teraio

    real = teraio.select

    def paging(*a, **kw):
        assert kw["paging_fallback"] is True
        sel = real(*a, **kw)
        sel.info["choice"] = "paging"
        sel.info["why"] = "scripted: the auto plan does not run"
        return sel

    monkeypatch.setattr(teraio, "select", paging)
    store = engine_store(tmp_path)
    model, opt = make()
    lines = []
    s = tt.Session(model, opt, _hooks=Hooks(store=store), gpu_budget_bytes=3 * params_bytes(model),
                   page_min_bytes=0, log=lines.append)
    for t in batches(4):
        with s.step():
            train_step(model, opt, t)
    step_lines = [line for line in lines if line.startswith("teraio step")]
    assert "the pager's schedule as a plan: scripted" in step_lines[1], step_lines[1]
    assert [r["mode"] for r in s.steps] == ["paged", "paged", "planned", "planned"]
    assert all("planned (the pager's schedule as a plan" in line for line in step_lines[2:]), step_lines
    assert sum("runs the pager's schedule" in line or "steps run the pager's schedule" in line for line in lines) == 1
    s.close()
