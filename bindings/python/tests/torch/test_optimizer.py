"""The plannable optimizer: the same math as the user's optimizer, bit for bit."""

import contextlib

import pytest
import torch

import teraio.torch as tt
from teraio.torch import (Profiler, WorkingSetTooLarge, auto_chunk_bytes, check_working_sets, make_plannable,
                          step_in_backward)
from teraio.torch.optimizer import NO_SPLIT
from teraio.torch.session import _TestHooks as Hooks

from models import batches, make, train_step
from test_session import MemStore


def run(model, opt, data):
    return [train_step(model, opt, t) for t in data]


@pytest.mark.parametrize("impl", [dict(foreach=True), dict(fused=True), dict(foreach=False)])
@pytest.mark.parametrize("chunk", [0, 4096, 1 << 30])
def test_chunked_step_is_bitwise_identical(impl, chunk):
    data = batches(4)
    ref, _ = make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, **impl)
    m, _ = make()
    opt = make_plannable(torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, **impl), chunk)
    assert run(ref, ref_opt, data) == run(m, opt, data)
    for p, q in zip(ref.parameters(), m.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(ref.parameters(), m.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref_opt.state[p][k], opt.state[q][k])


def test_step_in_backward_is_bitwise_identical():
    data = batches(4)
    ref, ref_opt = make()
    m, opt = make()
    undo = step_in_backward(opt)
    assert run(ref, ref_opt, data) == run(m, opt, data)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), m.parameters()))
    assert all(p.grad is None for p in m.parameters())
    undo()
    assert run(ref, ref_opt, data[:1]) == run(m, opt, data[:1])


def test_hooks_run_once_per_step():
    m, opt = make()
    make_plannable(opt, 0)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    train_step(m, opt, batches(1)[0])
    assert calls == ["pre", "post"]


def profile(opt_factory):
    m, _ = make()
    opt = opt_factory(m)
    data = batches(2)
    prof = Profiler(m, opt)
    for i, t in enumerate(data):
        with prof.record() if i == 1 else contextlib.nullcontext():
            train_step(m, opt, t)
    return prof.trace()


def test_working_set_check_names_the_foreach_kernel_and_chunking_fixes_it():
    whole = profile(lambda m: torch.optim.AdamW(m.parameters(), foreach=True))
    params = sum(t["bytes"] for t in whole["tensors"] if t["name"].startswith("param:"))
    budget = 2 * params  # far above any forward or backward kernel, below the foreach step
    with pytest.raises(WorkingSetTooLarge) as e:
        check_working_sets(whole, budget)
    assert e.value.kernel_name.startswith("opt._foreach_")
    assert e.value.bytes_needed > budget
    assert f"kernel {e.value.kernel} (opt._foreach_" in str(e.value)
    assert "make_plannable" in str(e.value)
    chunked = profile(lambda m: make_plannable(torch.optim.AdamW(m.parameters(), foreach=True), 0))
    check_working_sets(chunked, budget)  # passes: no kernel touches more than one parameter


def test_bad_arguments():
    m, opt = make()
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        make_plannable(opt, -1)
    with pytest.raises(ValueError, match="LBFGS"):
        make_plannable(torch.optim.LBFGS(m.parameters()))



def test_a_session_chunks_the_step_by_its_budget():
    assert auto_chunk_bytes(None) == NO_SPLIT
    assert auto_chunk_bytes(64 << 20) == 2 << 20
    assert auto_chunk_bytes(31) == 1  # at least a byte: one parameter at a time
    m, opt = make()
    sizes = [p.numel() * p.element_size() for p in m.parameters()]
    budget = 32 * 3 * max(sizes)  # chunks of three of the largest parameter
    s = tt.Session(m, opt, _hooks=Hooks(store=MemStore()), gpu_budget_bytes=budget, log=lambda _: None)
    try:
        assert opt._teraio_chunked == 3 * max(sizes)
        chunks, size = 1, 0
        for b in sizes:  # what make_plannable does: parameters in order, a chunk full at the limit
            if size and size + b > 3 * max(sizes):
                chunks, size = chunks + 1, 0
            size += b
        assert 1 < chunks < len(sizes)
        prof = Profiler(m, opt)
        data = batches(2)
        train_step(m, opt, data[0])
        with prof.record():
            train_step(m, opt, data[1])
        lerps = [k for k in prof.trace()["kernels"] if k["name"].startswith("opt._foreach_lerp_")]
        assert len(lerps) == chunks  # one exp_avg update per chunk
    finally:
        s.close()
    m2, opt2 = make()
    s2 = tt.Session(m2, opt2, _hooks=Hooks(store=None), gpu_budget_bytes=None, log=lambda _: None)
    assert opt2._teraio_chunked == NO_SPLIT  # no budget: one step, unsplit
    s2.close()
