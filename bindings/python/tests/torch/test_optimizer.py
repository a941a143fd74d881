"""The plannable optimizer: the same math as the user's optimizer, bit for bit."""

import contextlib

import pytest
import torch

from teraio.torch import Profiler, WorkingSetTooLarge, check_working_sets, make_plannable, step_in_backward

from models import batches, make, train_step


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
