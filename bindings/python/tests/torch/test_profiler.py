"""teraio.torch.Profiler on CPU: structure, lifetimes, writes, kinds, and the Rust parser."""

import contextlib
import json

import pytest
import torch

from teraio.torch.profiler import Profiler, memory_curve, peak_bytes

from models import batches, make, train_step


def record(fn, **kw):
    prof = Profiler(**kw)
    with prof.record():
        fn()
    return prof.trace()


def by_name(trace, prefix):
    return [t for t in trace["tensors"] if t["name"].startswith(prefix)]


def test_lifetimes_and_writes_of_a_small_sequence():
    x = torch.randn(64, 64)
    w = torch.randn(64, 64)

    def fn():
        a = x @ w  # op 0 creates a
        b = a.relu()  # op 1 reads a, creates b
        del a  # a dies after op 1
        b.add_(1.0)  # op 2 writes b
        c = b.sum()  # op 3 reads b, creates c
        del b, c

    tr = record(fn)
    names = [k["name"] for k in tr["kernels"]]
    assert names == ["fwd.mm", "fwd.relu", "fwd.add_.Tensor", "fwd.sum"]
    t = {tuple(s["accesses"]): s for s in tr["tensors"]}
    a = t[(0, 1)]
    assert (a["created_by"], a["dies_after"], a["writes"], a["global"]) == (0, 1, [0], False)
    assert a["bytes"] == 64 * 64 * 4
    b = t[(1, 2, 3)]
    assert (b["created_by"], b["dies_after"], b["writes"]) == (1, 3, [1, 2])
    # x and w exist before and after the window but are not parameters, gradients, buffers or
    # optimizer states (teraio.torch could not find them by name): traced from their first use to
    # the end
    xs = [s for s in tr["tensors"] if s["accesses"] == [0]]
    assert len(xs) == 2
    assert all((s["global"], s["created_by"], s["dies_after"]) == (False, 0, 3) for s in xs)


def test_views_share_their_storage_and_reuse_is_a_new_tensor():
    base = torch.randn(1024)

    def fn():
        for _ in range(3):
            y = base * 2  # a fresh storage each time, likely at the same address
            v = y.view(32, 32)  # a view: the same trace tensor
            v.sum()
            del y, v

    tr = record(fn)
    base_t = [t for t in tr["tensors"] if t["accesses"] == [0, 3, 6]]
    assert len(base_t) == 1  # base, read by the three multiplications
    made = [t for t in tr["tensors"] if t is not base_t[0] and t["bytes"] == 4096]
    assert len(made) == 3  # three lifetimes, three tensors
    for t in made:
        assert len(t["accesses"]) == 3  # mul, view, sum
        assert t["dies_after"] == t["accesses"][-1]


def test_training_step_kinds_and_globals():
    model, opt = make()
    data = batches(3)
    prof = Profiler(model, opt)
    for i, tok in enumerate(data):
        with prof.record() if i == 2 else contextlib.nullcontext():
            train_step(model, opt, tok)
    tr = prof.trace()
    params = dict(model.named_parameters())
    weights = by_name(tr, "param:")
    assert {t["name"][6:] for t in weights} == set(params)
    for t in weights:
        p = params[t["name"][6:]]
        assert t["global"] and t["kind"] == "weight"
        assert t["bytes"] == p.numel() * p.element_size()
        assert t["writes"], "the optimizer writes every parameter"
        assert all(tr["kernels"][k]["name"].startswith("opt.") for k in t["writes"])
    states = by_name(tr, "state:")
    assert len(states) == 3 * len(params)  # step, exp_avg, exp_avg_sq
    assert all(t["global"] and t["kind"] == "optimizer_state" for t in states)
    grads = by_name(tr, "grad:")
    assert len(grads) == len(params)
    for t in grads:  # created by backward, freed by zero_grad(set_to_none=True)
        assert not t["global"] and t["kind"] == "gradient"
        assert tr["kernels"][t["created_by"]]["name"].startswith("bwd.")
    phases = [k["name"].split(".")[0] for k in tr["kernels"]]
    # forward, then backward, then the optimizer step, then the loss read-out
    first_bwd, first_opt = phases.index("bwd"), phases.index("opt")
    assert 0 < first_bwd < first_opt
    assert set(phases[first_bwd:first_opt]) <= {"bwd", "fwd"}
    layers = {k.get("layer") for k in tr["kernels"] if k["name"].startswith("fwd.")}
    assert {0, 1, 2} <= layers
    assert all(k["duration_us"] >= 0 for k in tr["kernels"])


def test_peak_of_a_known_curve():
    def fn():
        a = torch.empty(1000, dtype=torch.uint8).fill_(1)  # ops 0,1
        b = torch.empty(3000, dtype=torch.uint8).fill_(2)  # ops 2,3
        del a
        c = b.sum()  # op 4
        del b, c

    tr = record(fn)
    curve = memory_curve(tr)
    assert curve[:4] == [1000, 1000, 4000, 4000]
    assert peak_bytes(tr) == 4000


def test_trace_loads_with_the_rust_parser(tmp_path):
    teraio = pytest.importorskip("teraio")
    if not hasattr(teraio, "Trace"):
        pytest.fail("the teraio package has no Trace: the bindings are not installed")
    model, opt = make()
    data = batches(2)
    prof = Profiler(model, opt)
    train_step(model, opt, data[0])
    with prof.record():
        train_step(model, opt, data[1])
    tr = teraio.Trace.from_dict(prof.trace())
    assert tr.kernel_count == len(prof.trace()["kernels"])
    assert tr.peak_resident_bytes == peak_bytes(prof.trace())
    path = tmp_path / "t.json"
    prof.save(str(path))
    assert json.loads(path.read_text())["format"] == "teraio-trace"


def test_producers_of_deterministic_results_only():
    import teraio.torch as tt

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    prof = tt.Profiler(lin, None)
    with prof.record():
        h = torch.nn.functional.gelu(lin(x))
        d = torch.nn.functional.dropout(h, 0.5, training=True)
        (d.sum() + h.sum()).backward()
    tr = prof.trace()
    local = [t for t in tr["tensors"] if not t["global"]]
    name = lambda t: tr["kernels"][t["created_by"]]["name"]  # noqa: E731
    (gelu,) = [t for t in local if name(t) == "fwd.gelu"]
    # gelu of the linear's result: made again from it
    (inp,) = gelu["producer"]["inputs"]
    assert name(tr["tensors"][inp]) == "fwd.addmm" and "producer" in tr["tensors"][inp]
    # the input batch x, first seen at the linear (not made by it), has no producer
    assert any(name(t) == "fwd.addmm" and "producer" not in t for t in local)
    # dropout's mask is filled with random numbers after it is made (bernoulli_ on the CPU,
    # native_dropout on a GPU): never recomputed; nothing made in backward is either
    masks = [t for t in local if len(t["writes"]) > 1 or "dropout" in name(t)]
    assert masks and all("producer" not in t for t in masks)
    assert all("producer" not in t for t in local if name(t).startswith("bwd."))


class _Event:
    """A stand-in for a CUDA event: done or not, recorded in order with the spins."""

    def __init__(self, log, done=False, ms=0.0):
        self.log, self.done, self.ms = log, done, ms

    def query(self):
        return self.done

    def record(self):
        self.log.append("record")

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.ms


def test_gpu_time_queues_a_long_spin_where_the_gpu_caught_up_and_a_short_one_elsewhere(monkeypatch):
    """Profiler(gpu_time=True) (the CUDA path, its logic on stand-ins): the spin kernel's cycles
    calibrated from one timed spin, SLEEP_US of them before an operator whose predecessor is
    done (the GPU idle: its launch would count), SPIN_US of them before every other one (the GPU
    may drain what is queued before the launch), the start event recorded after the spin;
    without gpu_time no spin at all."""
    from teraio.torch import profiler as P

    log = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("spin", cycles)))
    # a spin of 2**20 cycles timed at 0.5 ms: 2097 cycles a microsecond
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _Event(log, ms=0.5))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    prof = Profiler(gpu_time=True)
    long, short = prof._calibrate_sleep()
    per_us = (1 << 20) / 500.0
    assert long == int(per_us * P.SLEEP_US) and short == int(per_us * P.SPIN_US) and long > short > 0
    prof._sleep_cycles, prof._spin_cycles = long, short
    log.clear()
    prof._start(_Event(log))  # the first operator: nothing queued before it
    prof._ends = [_Event(log, done=False)]
    prof._start(_Event(log))  # its predecessor still queued
    prof._ends = [_Event(log, done=True)]
    prof._start(_Event(log))  # its predecessor done: the GPU waits
    assert log == [("spin", long), "record", ("spin", short), "record", ("spin", long), "record"]
    assert prof.sleeps == 2
    off = Profiler(gpu_time=False)
    log.clear()
    off._start(_Event(log))
    assert log == ["record"] and off.sleeps == 0
