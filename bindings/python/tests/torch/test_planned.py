"""The planned mode's PyTorch side, against a scripted stand-in for the engine's executor.

The stand-in only replays a script (offload tensor t at boundary a, bring it back at boundary
b) through the same calls the real executor makes (attach, allocator.alloc/release, events); it
checks nothing a plan means. What is tested is the translation: storages shrink to 0 bytes when
their offload is done and grow back with their bytes before the operator that needs them,
created storages are matched to the trace's ids, deaths do not shrink anything, a divergence
brings everything back and the next step is profiled again, and the losses stay bitwise those of
plain training.
"""

import pytest
import torch

import teraio.torch as tt
from teraio.torch.pager import host_view
from teraio.torch.session import _TestHooks as Hooks

from models import Block, batches, make, train_step


class ScriptedExecutor:
    def __init__(self, trace, plan, budget, allocator):
        self.trace, self.plan, self.alloc = trace, plan, allocator
        self.mem, self.saved, self.off = {}, {}, set()
        self.shrunk = 0
        self.diverged = False
        self.finished = False
        self.calls = []

    def attach(self, t, mem):
        self.mem[t] = mem

    def start(self):
        self.calls.append("start")

    def boundary_named(self, k, name):
        if name != self.trace["kernels"][k]["name"]:
            self.diverged = True
            for t in list(self.off):  # safe mode: everything back
                self._back(t)
            raise RuntimeError(f"Diverged at kernel {k}")

    def leave_plan(self, k, detail):
        self.calls.append(("leave_plan", k, detail))
        self.diverged = True
        for t in list(self.off):  # safe mode: everything back
            self._back(t)

    def _back(self, t):
        n = self.trace["tensors"][t]["bytes"]
        mem = self.alloc.alloc(t, n, "prefetch")
        memoryview(mem).cast("B")[:] = self.saved.pop(t)
        self.mem[t] = mem
        self.off.discard(t)

    def before_kernel(self, k):
        if self.diverged:
            return 0.0
        for at, t, op in self.plan:
            if at != k:
                continue
            if op == "offload":
                self.saved[t] = bytes(memoryview(self.mem[t]).cast("B"))
                self.alloc.release(t, self.mem.pop(t))
                assert self.alloc.refs[t]().nbytes() == 0, "the storage is shrunk once its copy is stored"
                self.shrunk += 1
                self.off.add(t)
            else:
                self._back(t)
        return 0.0

    def make_room(self, k, nbytes):
        self.calls.append(("make_room", k, nbytes))
        return nbytes

    def leave(self, k, created, device):
        assert not device, "CPU storages go as host memory"
        for t, addr, n, owner in created:
            assert addr == owner.data_ptr() and n == owner.nbytes() == self.trace["tensors"][t]["bytes"]
            self.attach(t, host_view(owner, n))
        self.after_kernel(k)

    def after_kernel(self, k):
        if self.diverged:
            return
        for t, x in enumerate(self.trace["tensors"]):
            if x["dies_after"] == k and t in self.mem:
                self.alloc.release(t, self.mem.pop(t))  # a death: nothing may shrink

    def end_iteration(self):
        self.diverged = False
        return {"stall_s": 0.0}

    def finish(self):
        assert not self.off
        self.finished = True


def script_for(trace, budget, host):
    """Offload every activation of >= 4 KiB with a gap of >= 3 kernels between two uses."""
    plan = []
    for t, x in enumerate(trace["tensors"]):
        if x["global"] or x["kind"] != "activation" or x["bytes"] < 4096:
            continue
        acc = x["accesses"]
        for a, b in zip(acc, acc[1:]):
            if b - a >= 3:
                plan += [(a + 1, t, "offload"), (b, t, "prefetch")]
                break
    return sorted(plan, key=lambda p: (p[0], p[2] == "prefetch"))


class Switchable(torch.nn.Module):
    """TinyGPT-like, with a branch the loop can turn on (a different operator sequence)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(97, 32)
        self.layers = torch.nn.ModuleList(Block(32) for _ in range(2))
        self.head = torch.nn.Linear(32, 97)
        self.extra = False

    def forward(self, tok):
        x = self.emb(tok)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.extra and i == 0:
                x = x * 1.0 + 0.0
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 97), tok.reshape(-1))


def session(model, opt, executors):
    def factory(trace, plan, budget, allocator):
        ex = ScriptedExecutor(trace, plan, budget, allocator)
        executors.append(ex)
        return ex

    return tt.Session(model, opt, gpu_budget_bytes=None, warmup_steps=1, log=lambda _: None,
                      _hooks=Hooks(store=None, executor_factory=factory, planner=script_for))


def test_planned_steps_move_storages_and_keep_losses():
    model, opt = make()
    ref, ref_opt = make()
    exs = []
    s = session(model, opt, exs)
    s.budget = 1 << 30  # plan (the scripted planner ignores it); nothing is paged: no store
    for t in batches(5):
        with s.step():
            a = train_step(model, opt, t)
        assert a == train_step(ref, ref_opt, t)
    modes = [r["mode"] for r in s.steps]
    assert modes[:2] == ["profiled", "profiled"] and modes[2:] == ["planned"] * 3
    assert len(exs) == 1 and exs[0].shrunk >= 3 * 5
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    s.close()


def beside_reference(cls, steps, setup):
    """A session trains ``cls()`` beside a plain ``cls()`` for ``steps`` steps, ``setup(i, m)``
    setting both models up before step ``i``; every loss must be equal."""
    model, ref = cls(), cls()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    exs = []
    s = session(model, opt, exs)
    s.budget = 1 << 30
    for i, t in enumerate(batches(steps)):
        setup(i, model)
        setup(i, ref)
        with s.step():
            a = train_step(model, opt, t)
        assert a == train_step(ref, ref_opt, t)
    return s, exs, model, ref


def test_divergence_brings_everything_back_and_profiles_again():
    # a new branch in step 4 only
    s, exs, model, ref = beside_reference(Switchable, 7, lambda i, m: setattr(m, "extra", i == 4))
    modes = [r["mode"] for r in s.steps]
    # the plan is kept through one divergence (a step of another shape may start like this one's):
    # the next steps run it again, chosen once they passed the kernel where step 4 left it
    assert modes == ["profiled", "profiled", "planned", "planned", "planned", "planned", "planned"]
    assert "diverged" in s.steps[4] and "diverged" not in s.steps[3]
    left_at = int(s.steps[4]["diverged"].split(":")[0].removeprefix("kernel "))
    assert s.steps[5]["decided_at"] > left_at and s.steps[6]["decided_at"] > left_at
    # the executor was told, with an explicit call (not a made-up kernel name)
    told = [c for ex in exs for c in ex.calls if isinstance(c, tuple) and c[0] == "leave_plan"]
    assert len(told) == 1 and told[0][1] == left_at and told[0][2], told
    # the executor after the divergence is a new one, and so is each one after a step that was
    # told apart by its first operators (this stand-in cannot say that nothing it moves is away,
    # so no run stays live through them)
    assert len(exs) == 3
    assert len(s.plans) == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    s.close()


class Narrowing(Switchable):
    """The same operators every step; with ``cut`` the sequence is one token shorter after the
    embedding (the first operator, which names the plan, sees the same shapes)."""

    def __init__(self):
        super().__init__()
        self.cut = False

    def forward(self, tok):
        x = self.emb(tok)
        # the same operators whatever the length (a slice of everything would be an alias)
        x = x.index_select(1, torch.arange(x.shape[1] - self.cut, device=x.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        n = x.shape[1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 97), tok[:, :n].reshape(-1))


def test_a_shape_change_after_the_first_operator_is_a_divergence():
    # profiled and planned with the short sequence; step 4: the full one, same first operator
    s, exs, model, ref = beside_reference(Narrowing, 6, lambda i, m: setattr(m, "cut", i != 4))
    modes = [r["mode"] for r in s.steps]
    assert modes[2:4] == ["planned", "planned"], modes
    assert "diverged" in s.steps[4] and "diverged" not in s.steps[3], s.steps[4]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    s.close()


def test_an_operator_that_runs_out_of_memory_runs_again_once_the_executor_made_room(monkeypatch):
    model, opt = make()
    ref, ref_opt = make()
    exs = []
    s = session(model, opt, exs)
    s.budget = 1 << 30
    real = tt.planned.PlannedRun._invoke
    failures = {"left": 0, "seen": 0, "skip": 0}

    def flaky(func, args, kwargs):
        if failures["left"] > 0 and failures["skip"] > 0:
            failures["skip"] -= 1  # an operator some way into the step
        elif failures["left"] > 0:
            failures["left"] -= 1
            failures["seen"] += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
        return real(func, args, kwargs)

    monkeypatch.setattr(tt.planned.PlannedRun, "_invoke", staticmethod(flaky))
    for i, t in enumerate(batches(5)):
        # two in a row, of one operator in the second planned step; in the third more than
        # teraio.torch tries: the error reaches the caller
        failures["left"], failures["skip"] = {3: (2, 20), 4: (10, 20)}.get(i, (0, 0))
        if i == 4:
            with pytest.raises(torch.OutOfMemoryError):
                with s.step():
                    train_step(model, opt, t)
            assert failures["seen"] == 2 + 4, "three tries, then the fourth error is raised"
            break
        with s.step():
            a = train_step(model, opt, t)
        assert a == train_step(ref, ref_opt, t)
    assert [r["mode"] for r in s.steps[:4]] == ["profiled", "profiled", "planned", "planned"]
    rooms = [c for c in exs[0].calls if isinstance(c, tuple) and c[0] == "make_room"]
    assert len(rooms) == 2 + 3
    assert rooms[0][1] == rooms[1][1] and rooms[1][2] == 2 * rooms[0][2], "the same operator, twice the bytes"
    assert s.steps[3]["oom_retries"] == 2 and s.steps[3]["made_room_bytes"] == 3 * rooms[0][2]
    assert "2 operators out of memory ran again" in tt.Session.line(s.steps[3])


def test_a_storage_resizes_without_the_dispatcher():
    """The executor's alloc/release resize CPU and CUDA storages with no dispatch mode disabled:
    that holds only while no mode sees the resize (a mode that saw it would count an operator)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from teraio.torch.planned import _resize

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    s = torch.arange(1000, dtype=torch.float32).untyped_storage()
    with Watch():
        _resize(s, 0)
        assert s.nbytes() == 0
        _resize(s, 4000)
        torch.zeros(1)  # the mode is live: it sees this one
    assert s.nbytes() == 4000 and len(seen) == 1, seen


def test_an_operators_tensors_are_flattened_in_the_profilers_order():
    from teraio.torch._storages import flat_args, iter_tensors

    t = [torch.zeros(1) for _ in range(6)]
    cases = [((t[0], 1, [t[1], (t[2],)], {"a": t[3]}), {"out": t[4], "x": [t[5]], "n": None}),
             ((), {}), ((t[0],), {}), (([t[1], t[2]],), {"w": {"q": t[3]}})]
    for args, kwargs in cases:
        assert [id(x) for x in flat_args(args, kwargs)] == [id(x) for x in iter_tensors((args, kwargs))]


class QuietScripted(ScriptedExecutor):
    """The scripted executor, saying what the engine's says about quiet operators: after kernel
    ``k``, the next ones up to the first with a scripted migration, or creating a tensor the
    script moves, need no call (``leave`` returns the last of them); and whether anything
    scripted is off the storage now (``nothing_away``). Calls are counted per kernel."""

    def __init__(self, trace, plan, budget, allocator):
        super().__init__(trace, plan, budget, allocator)
        moved = {t for _, t, _ in plan}
        n = len(trace["kernels"])
        loud = {at for at, _, _ in plan} | {x["created_by"] for t, x in enumerate(trace["tensors"])
                                            if t in moved and x["created_by"] is not None}
        # per kernel k: the last kernel after it that needs no call
        self.until = [min([j for j in loud if j > k] + [n]) - 1 for k in range(n)]
        self.called = []
        self.away_asked = 0

    def movable(self):
        moved = {t for _, t, _ in self.plan}
        return [t in moved for t in range(len(self.trace["tensors"]))]

    def before_kernel(self, k):
        self.called.append(k)
        return super().before_kernel(k)

    def leave(self, k, created, device):
        super().leave(k, created, device)
        return self.until[k]

    def nothing_away(self):
        self.away_asked += 1
        return not self.off


def late_script(trace, budget, host):
    """Offload one activation made in the last block's forward, bring it back before its next
    use: the operators before its creation have nothing to do."""
    fwd = [k for k, x in enumerate(trace["kernels"]) if x["name"].startswith("fwd.")]
    cands = [(t, x) for t, x in enumerate(trace["tensors"])
             if not x["global"] and x["kind"] == "activation" and x["bytes"] >= 4096
             and x["created_by"] is not None and x["created_by"] > len(fwd) // 2
             and x["accesses"][1] - x["accesses"][0] >= 3]
    t, x = cands[0]
    a, b = x["accesses"][0], x["accesses"][1]
    return [(a + 1, t, "offload"), (b, t, "prefetch")]


def quiet_session(model, opt, executors):
    """A session whose plans are ``late_script``'s, run by :class:`QuietScripted` executors."""
    def factory(trace, plan, budget, allocator):
        ex = QuietScripted(trace, plan, budget, allocator)
        executors.append(ex)
        return ex

    s = tt.Session(model, opt, gpu_budget_bytes=None, warmup_steps=1, log=lambda _: None,
                   _hooks=Hooks(store=None, executor_factory=factory, planner=late_script))
    s.budget = 1 << 30
    return s


def test_quiet_forward_operators_run_unwatched_and_the_mode_comes_back_before_the_first_loud_one():
    model, opt = make()
    ref, ref_opt = make()
    exs = []
    s = quiet_session(model, opt, exs)
    for t in batches(5):
        with s.step():
            a = train_step(model, opt, t)
        assert a == train_step(ref, ref_opt, t)
    planned = [r for r in s.steps if r["mode"] == "planned"]
    assert len(planned) == 3 and not any("diverged" in r for r in planned), s.steps
    (ex,) = exs
    n = len(ex.trace["kernels"])
    first_loud = min(at for at, _, _ in ex.plan)
    created = min(ex.trace["tensors"][t]["created_by"] for _, t, _ in ex.plan)
    for r in planned:
        # every operator counted (those run unwatched by the profile's hooks), the stretch
        # before the moved tensor's creation run unwatched
        assert r["ops"] == n
        assert 8 <= r["unwatched_ops"] < created, (r["unwatched_ops"], created)
    # the executor was called before the creation and at the scripted migrations, each step
    per_step = len(ex.called) // 3
    for i in range(3):
        calls = ex.called[i * per_step:(i + 1) * per_step]
        assert first_loud in calls and created in calls
    assert ex.shrunk == 3
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    s.close()


class Branching(Switchable):
    """Switchable whose branch is a module call (a module hook the profile does not have)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, tok):
        x = self.emb(tok)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.extra and i == 0:
                x = x + 0.0 * self.norm(x)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 97), tok.reshape(-1))


def test_a_module_hook_the_profile_does_not_have_ends_the_unwatched_stretch_as_a_divergence():
    model, ref = Branching(), Branching()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    exs = []
    s = quiet_session(model, opt, exs)
    for i, t in enumerate(batches(6)):
        model.extra = ref.extra = i == 3
        with s.step():
            a = train_step(model, opt, t)
        assert a == train_step(ref, ref_opt, t)
    modes = [r["mode"] for r in s.steps]
    # (the plan is kept: the steps after the divergence run it, chosen past where step 3 left it)
    assert modes[2:6] == ["planned", "planned", "planned", "planned"], modes
    assert s.steps[2]["unwatched_ops"] > 0
    assert "module hook" in s.steps[3]["diverged"] and "LayerNorm" in s.steps[3]["diverged"], s.steps[3]
    left_at = int(s.steps[3]["diverged"].split(":")[0].removeprefix("kernel "))
    assert s.steps[4]["decided_at"] > left_at and "diverged" not in s.steps[4]
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    s.close()
