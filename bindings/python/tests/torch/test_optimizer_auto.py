"""Session(optimizer_on="auto") and what it is made of: a subset of the optimizer's parameters
updated on the host (offload_optimizer(params=...)), the others by the optimizer's own step, and
the planner's choice of that subset (teraio.place_optimizer) on a profiled trace.

The reference for a split optimizer is two optimizers: teraio's HostAdamW / HostAdam / HostSGD
over the host subset (the same kernels, on the parameters themselves: test_host_offload.py) and
the same torch.optim class over the rest, each with the same groups' settings. Losses,
parameters and every state must be bitwise equal over generated cases (optimizer,
hyperparameters, two groups, schedules, clipping, accumulation, parameters written between
steps, chunked steps).
"""

import copy
import random

import pytest
import torch

import teraio.torch as tt
from teraio.torch import make_plannable, offload_optimizer
from teraio.torch.host_offload import HostOffload

from models import batches as gpt_batches
from models import make, train_step
from test_host_offload import HOST, TORCH, assert_same, batches, hyper, model_for, train
from teraio.torch.session import _TestHooks as Hooks
from test_session import MemStore, engine_store


def split_groups(model, two, on_host):
    """The test's groups (one or two, the second with its own lr and weight decay) cut into the
    host subset and the rest, each keeping its group's settings."""
    ps = list(model.parameters())
    if two:
        groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.1}]
    else:
        groups = [{"params": ps}]
    host, rest = [], []
    for g in groups:
        for side, keep in ((host, True), (rest, False)):
            ids = {id(q) for q in g["params"]}
            sel = [p for i, p in enumerate(ps) if id(p) in ids and (i in on_host) == keep]
            if sel:
                side.append({**g, "params": sel})
    return groups, host, rest


def assert_all_states_same(ref_opts, opt, ref_model, model):
    """Every parameter and every state of ``opt`` equals those of whichever reference optimizer
    holds the parameter."""
    for pr, p in zip(ref_model.parameters(), model.parameters()):
        assert_same(pr, p, "parameter")
        held = [o.state[pr] for o in ref_opts if pr in o.state]
        s = opt.state[p]
        if not held:  # (SGD without momentum keeps no state)
            assert not any(isinstance(v, torch.Tensor) for v in s.values()), s.keys()
            continue
        (sr,) = held
        assert sr.keys() == s.keys()
        for k in sr:
            if k == "step":
                assert float(sr[k]) == float(s[k])
            else:
                assert_same(sr[k], s[k], f"state {k}")


class _Both:
    """Two optimizers stepped and zeroed together (the reference of a split one)."""

    def __init__(self, *opts):
        self.opts = [o for o in opts if o is not None]

    def step(self):
        for o in self.opts:
            o.step()

    def zero_grad(self):
        for o in self.opts:
            o.zero_grad()


@pytest.mark.parametrize("case", range(12))
def test_a_host_subset_steps_as_teraios_host_optimizer_and_the_rest_as_torch(case):
    rng = random.Random(100 + case)
    kind = ["adamw", "adam", "sgd"][case % 3]
    hp = hyper(kind, rng)
    two = rng.random() < 0.5
    clip = rng.random() < 0.5
    accumulate = rng.choice([1, 2])
    write_at = rng.choice([-1, 1])
    scheduled = rng.random() < 0.5
    chunk = rng.choice([None, 0, 600])
    # a proper, non-empty subset of the four parameters
    on_host = set(rng.sample(range(4), rng.choice([1, 2, 3])))
    data = batches(case, 5, "cpu")

    ref = model_for(case, "cpu")
    ours = model_for(case, "cpu")
    _, ref_host, ref_rest = split_groups(ref, two, on_host)
    ref_a = HOST[kind](ref_host, **hp)
    ref_b = TORCH[kind](ref_rest, **hp)
    groups, _, _ = split_groups(ours, two, on_host)
    opt = TORCH[kind](groups, **hp)
    ps = list(ours.parameters())
    offload_optimizer(opt, params=[ps[i] for i in sorted(on_host)])
    if chunk is not None:
        make_plannable(opt, chunk)
    scheds = []
    if scheduled:
        scheds = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (ref_a, ref_b, opt)]

    class _Sched:
        def __init__(self, ss):
            self.ss = ss

        def step(self):
            for s in self.ss:
                s.step()

    kw = dict(clip=clip, accumulate=accumulate, write_at=write_at)
    want = train(ref, _Both(ref_a, ref_b), data, sched=_Sched(scheds[:2]) if scheduled else None, **kw)
    got = train(ours, opt, data, sched=_Sched(scheds[2:]) if scheduled else None, **kw)
    for a, b in zip(want, got):
        assert_same(a, b, "loss")
    assert_all_states_same([ref_a, ref_b], opt, ref, ours)
    raw = opt._teraio_raw_step
    assert isinstance(raw, HostOffload) and raw.on_host == {id(ps[i]) for i in on_host}
    # the host side exists for the subset alone
    assert set(raw.hosts) == {id(ps[i]) for i in on_host}


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_split_optimizers_state_dict_round_trips(kind):
    rng = random.Random(7)
    hp = hyper(kind, rng)
    if kind == "sgd":
        hp["momentum"] = 0.9
    data = batches(7, 6, "cpu")
    on_host = [0, 3]

    def split(model):
        opt = TORCH[kind](model.parameters(), **hp)
        ps = list(model.parameters())
        return offload_optimizer(opt, params=[ps[i] for i in on_host])

    a = model_for(7, "cpu")
    opt_a = split(a)
    train(a, opt_a, data[:3], clip=False, accumulate=1, sched=None, write_at=-1)
    saved = copy.deepcopy(opt_a.state_dict())
    # PyTorch's layout: every parameter's state under its index, the groups as a plain one's
    plain = TORCH[kind](model_for(7, "cpu").parameters(), **hp)
    assert saved["param_groups"] == plain.state_dict()["param_groups"]
    assert sorted(saved["state"]) == [0, 1, 2, 3]
    keys = {"momentum_buffer"} if kind == "sgd" else {"step", "exp_avg", "exp_avg_sq"}
    assert all(set(v) == keys for v in saved["state"].values()), saved["state"]

    # into a fresh split optimizer: the same continuation, bit for bit
    c = copy.deepcopy(a)
    opt_c = split(c)
    opt_c.load_state_dict(copy.deepcopy(saved))
    # and into a plain optimizer (every update by torch): it loads and steps
    d = copy.deepcopy(a)
    opt_d = TORCH[kind](d.parameters(), **hp)
    opt_d.load_state_dict(copy.deepcopy(saved))
    la = train(a, opt_a, data[3:], clip=False, accumulate=1, sched=None, write_at=-1)
    lc = train(c, opt_c, data[3:], clip=False, accumulate=1, sched=None, write_at=-1)
    train(d, opt_d, data[3:], clip=False, accumulate=1, sched=None, write_at=-1)
    for x, z in zip(la, lc):
        assert_same(x, z, "loss a/c")
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert_same(pa, pc, "parameter a/c")
        for k in opt_a.state[pa]:
            if k != "step":
                assert_same(opt_a.state[pa][k], opt_c.state[pc][k], f"state {k} a/c")
    assert all(opt_d.state[p] for p in d.parameters())


def test_a_parameter_leaving_the_host_keeps_its_states_and_steps_with_the_optimizer():
    model = model_for(5, "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ps = list(model.parameters())
    offload_optimizer(opt, params=ps[:2])
    data = batches(5, 4, "cpu")
    train(model, opt, data[:2], clip=False, accumulate=1, sched=None, write_at=-1)
    before = {k: v.clone() for k, v in opt.state[ps[0]].items()}
    offload_optimizer(opt, params=ps[1:2])
    raw = opt._teraio_raw_step
    assert raw.on_host == {id(ps[1])} and set(raw.hosts) == {id(ps[1])}
    for k, v in before.items():
        assert_same(v, opt.state[ps[0]][k], k)
    train(model, opt, data[2:], clip=False, accumulate=1, sched=None, write_at=-1)
    assert float(opt.state[ps[0]]["step"]) == 4.0
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        offload_optimizer(opt, params=[torch.nn.Parameter(torch.zeros(2))])


def _profiled_trace():
    """A profiled step of the tiny GPT (chunked foreach AdamW) and the model."""
    model, opt = make()
    budget = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=budget, page_min_bytes=0,
                   log=lambda _: None)
    for t in gpt_batches(2):
        with s.step():
            train_step(model, opt, t)
    (entry,) = s.plans.values()
    s.close()
    return entry.trace, model, budget


def test_the_planner_places_the_updates_of_a_profiled_pytorch_step():
    teraio = pytest.importorskip("teraio")
    trace, model, budget = _profiled_trace()
    # (the operators' times as one microsecond each, not the CPU's: the choice then rests on
    # the bytes each placement moves alone, the same on every machine; a profile's own times
    # put the host's gain near optimizer::HOST_MIN_GAIN on one machine and past it on another)
    for k in trace["kernels"]:
        k["duration_us"] = 1.0
    tr = teraio.Trace.from_dict(trace)
    names = {f"param:{n}" for n, _ in model.named_parameters()}

    def place(cpu):
        hw = teraio.hardware("paper", gpu_memory_bytes=budget, host_memory_cap_bytes=0, cpu_adam_params_per_s=cpu,
                             pcie_h2d_bytes_per_s=1e8, pcie_d2h_bytes_per_s=1e8)
        return teraio.place_optimizer(tr, "teraio", hw, candidates=3)

    fast = place(1e13)
    # every parameter found in one update, counted by its elements
    weights = [w for u in fast["updates"] for w in u["weights"]]
    assert sorted(weights) == sorted(names)
    assert all(u["eligible"] for u in fast["updates"]), [u["reason"] for u in fast["updates"]]
    assert fast["total_params"] == sum(p.numel() for p in model.parameters())
    assert fast["host_weights"] and set(fast["host_weights"]) <= names
    assert fast["iteration_us"] <= min(x for x in (fast["all_gpu_us"], fast["all_host_us"]) if x is not None)
    assert fast["iteration_us"] < fast["all_gpu_us"], fast["summary"]
    slow = place(1e3)
    assert slow["host_weights"] == [] and slow["iteration_us"] == slow["all_gpu_us"], slow["summary"]
    assert slow["summary"].startswith(f"optimizer: 0 of {len(names)} parameters")


def _steps(s, model, opt, data):
    """The losses of training steps under Session ``s``, closed after them."""
    got = []
    for t in data:
        with s.step():
            got.append(train_step(model, opt, t))
    s.close()
    return got


def test_auto_on_a_cpu_model_leaves_the_optimizer_and_says_why():
    ref_model, ref_opt = make()
    data = gpt_batches(4)
    want = [train_step(ref_model, ref_opt, t) for t in data]
    model, opt = make()
    lines = []
    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=1 << 30, page_min_bytes=0,
                   optimizer_on="auto", log=lines.append)
    assert _steps(s, model, opt, data) == want
    assert any("optimizer_on='auto': every optimizer update stays on the GPU (the model is on cpu" in x
               for x in lines), lines
    assert getattr(opt, "_teraio_raw_step", None) is None
    with pytest.raises(ValueError, match="'auto'.*got 'somewhere'"):
        tt.Session(model, opt, optimizer_on="somewhere", _hooks=Hooks(planner=lambda *a: None))


def test_auto_hands_the_chosen_parameters_to_the_host_and_logs_the_choice():
    """The step that decides (here through a placer, as on a GPU through teraio.place_optimizer):
    the parameters the placement names update on the host, the others stay, and the step's
    line says so."""
    teraio = pytest.importorskip("teraio")
    trace, _, budget = _profiled_trace()
    model, opt = make()
    chosen = ["param:layers.1.fc1.weight", "param:head.weight"]
    seen = []

    def placer(tr, gpu, host):
        seen.append((gpu, host))
        hw = teraio.hardware("paper", gpu_memory_bytes=gpu, host_memory_cap_bytes=host)
        real = teraio.place_optimizer(teraio.Trace.from_dict(tr), "teraio", hw, candidates=2)
        return {**real, "host_weights": chosen, "summary": "optimizer: 2 of 41 parameters on the host"}

    s = tt.Session(model, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=budget, page_min_bytes=0,
                   optimizer_on="auto", placer=placer, log=lambda _: None)
    rec = {"step": 1, "mode": "paged", "time_s": 0.1, "stall_s": 0.0, "bytes_moved": 0}
    assert s._place_optimizer(trace, rec)
    assert seen == [(s.planning_budget, 0)]
    by_name = dict(model.named_parameters())
    raw = opt._teraio_raw_step
    assert raw.on_host == {id(by_name["layers.1.fc1.weight"]), id(by_name["head.weight"])}
    # the chunked step stays, calling the split step per chunk
    assert opt._teraio_chunked is not None
    assert "optimizer: 2 of 41 parameters on the host" in tt.Session.line(rec)
    assert s.placement["host_weights"] == chosen
    s.close()


def test_the_step_after_a_placement_is_not_the_profile(monkeypatch, tmp_path):
    """optimizer_on="auto" through whole steps: the first step with the chosen updates on the
    host makes their host side once (on a GPU: page-locked buffers, the states copied off the
    GPU; here an operator of its own in that step alone). That step is not the iteration that
    repeats: it is not profiled, the plan made from the next one runs every later step without
    diverging, and losses and parameters stay plain training's, bitwise. (Made from the
    one-off step, the plan diverged at the next step and, dropped, left every later step of its
    shape in the deciding prefix up to where it had diverged: 17 s a step instead of 0.5 on an
    H100, llama 200 M fp32.)"""
    teraio = pytest.importorskip("teraio")
    import teraio.torch.session as session_mod

    data = gpt_batches(9)
    ref_model, ref_opt = make()
    want = [train_step(ref_model, ref_opt, t) for t in data]
    model, opt = make()
    budget = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    chosen = ["param:layers.1.fc1.weight", "param:head.weight"]
    handed = []

    def placer(tr, gpu, host):
        hw = teraio.hardware("paper", gpu_memory_bytes=gpu, host_memory_cap_bytes=host)
        real = teraio.place_optimizer(teraio.Trace.from_dict(tr), "teraio", hw, candidates=2)
        return {**real, "host_weights": chosen, "summary": "optimizer: 2 of 41 parameters on the host"}

    def offload(optimizer, params):
        # the host side made in the next step alone (the updates themselves stay: on the CPU the
        # host step is the same arithmetic, tested in test_host_offload.py)
        handed.append([p.shape for p in params])
        step = optimizer.step
        first = [True]

        def once(*a, **k):
            if first[0]:
                first[0] = False
                torch.ones(64).mul_(2).sum()
            return step(*a, **k)

        optimizer.step = once
        return optimizer

    monkeypatch.setattr(session_mod, "offload_optimizer", offload)
    s = tt.Session(model, opt, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=budget,
                   page_min_bytes=0, optimizer_on="auto", placer=placer, log=lambda _: None)
    assert _steps(s, model, opt, data) == want
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), n
    assert len(handed) == 1
    recs = s.steps
    placed = [i for i, r in enumerate(recs) if "optimizer" in r]
    assert len(placed) == 1, [r.get("optimizer") for r in recs]
    settling = recs[placed[0] + 1]
    assert settling["mode"] != "planned" and "host optimizer" in settling["plan"], settling
    assert not any(r.get("diverged") for r in recs), [r.get("diverged") for r in recs]
    planned = [r["step"] for r in recs if r["mode"] == "planned"]
    assert planned and planned == list(range(planned[0], len(data))), [r["mode"] for r in recs]
    assert planned[0] == placed[0] + 3, [r["mode"] for r in recs]


def test_a_dropped_plan_no_longer_holds_its_group_to_where_it_was_left():
    """Where a step left a plan raises the operator from which steps of its group are told apart
    (it may have been another shape starting alike); once that plan is dropped, the operator is
    made again from the plans left: their first difference and where they read the input."""
    from teraio.torch.planned import PlanEntry
    from teraio.torch.session import _Group

    def entry(sigs, input_op):
        return PlanEntry(trace={}, signatures=sigs, created=[[] for _ in sigs], created_at=[[] for _ in sigs],
                         input_op=input_op)

    a = [("embedding", ()), ("mm", ()), ("add", ()), ("mul", ())]
    b = [("embedding", ()), ("mm", ()), ("sub", ()), ("mul", ())]
    c = [("embedding", ()), ("mm", ()), ("add", ()), ("div", ())]
    plans = {"a": entry(a, 1), "b": entry(b, 1), "c": entry(c, 0)}
    g = _Group()
    for k in ("a", "b", "c"):
        g.add(k, plans[k].signatures, plans)
    assert g.decide_at == 3  # a and c part at the fourth operator
    g.decide_at = 40  # a step left plan c at operator 39
    del plans["c"]
    g.remove("c", plans)
    assert g.keys == ["a", "b"] and g.decide_at == 2
    del plans["b"]
    g.remove("b", plans)
    assert g.keys == ["a"] and g.decide_at == 1  # a alone: told at its input
    del plans["a"]
    g.remove("a", plans)
    assert g.keys == [] and g.decide_at == 0
