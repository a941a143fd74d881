"""GPU-only checks of Session(optimizer_on="host"); not collected by CI (no GPU there). On the GPU
machine: ``pytest bindings/python/tests/torch/gpu_host_offload.py`` (docs/BENCHMARKS.md)."""

import copy

import torch

from teraio.torch import Session, offload_optimizer
from test_host_offload import assert_same, assert_states_same, batches, model_for, train


def test_a_session_on_the_gpu_with_the_optimizer_on_the_host_trains_as_plain_training(tmp_path):
    """The GPU model under a Session (planned steps, budget below the peak) against the same
    model without a Session, both with the optimizer offloaded: bitwise (deterministic
    algorithms)."""
    torch.use_deterministic_algorithms(True)
    try:
        data = batches(5, 8, "cuda")
        plain = model_for(5, "cuda")
        opt_plain = offload_optimizer(torch.optim.AdamW(plain.parameters(), lr=1e-2))
        want = train(plain, opt_plain, data, clip=True, accumulate=1, sched=None, write_at=-1)
        model = model_for(5, "cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine = {"dir": str(tmp_path), "files": 1, "file_size": "64M"}
        lines = []
        with Session(model, opt, engine=engine, gpu_budget_bytes=1 << 20, optimizer_on="host",
                     hardware="paper", log=lines.append) as session:
            got = []
            for x, y in data:
                with session.step():
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                    opt.step()
                    opt.zero_grad()
                got.append(loss.detach().cpu())
        for a, b in zip(want, got):
            assert_same(a, b, "loss")
        assert_states_same(opt_plain, opt, plain, model)
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_loaded_state_dict_goes_back_to_the_host():
    """load_state_dict puts states beside the parameters (on the GPU); the next step moves them
    back to the host and continues as the optimizer that saved them."""
    data = batches(6, 6, "cuda")
    a = model_for(6, "cuda")
    opt_a = offload_optimizer(torch.optim.AdamW(a.parameters(), lr=1e-2))
    train(a, opt_a, data[:3], clip=False, accumulate=1, sched=None, write_at=-1)
    b = model_for(7, "cuda")
    b.load_state_dict(a.state_dict())
    opt_b = offload_optimizer(torch.optim.AdamW(b.parameters(), lr=1e-2))
    # a checkpoint's copy: PyTorch's load_state_dict keeps a CPU "step" tensor as it is given, so
    # loading a live optimizer's state_dict would share one step counter between the two
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    assert all(opt_b.state[p]["exp_avg"].device.type == "cuda" for p in b.parameters())
    la = train(a, opt_a, data[3:], clip=False, accumulate=1, sched=None, write_at=-1)
    lb = train(b, opt_b, data[3:], clip=False, accumulate=1, sched=None, write_at=-1)
    for x, y in zip(la, lb):
        assert_same(x, y, "loss")
    assert_states_same(opt_a, opt_b, a, b)
    assert all(opt_b.state[p]["exp_avg"].device.type == "cpu" for p in b.parameters())


def test_the_host_step_against_torchs_cuda_adamw():
    """The same GPU model with torch's AdamW on the GPU (foreach=False) and offloaded: prints how
    many parameter elements differ (scripts/optim-parity.py measures the kernels alone)."""
    torch.use_deterministic_algorithms(True)
    try:
        data = batches(8, 6, "cuda")
        a, b = model_for(8, "cuda"), model_for(8, "cuda")
        opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2, foreach=False)
        opt_b = offload_optimizer(torch.optim.AdamW(b.parameters(), lr=1e-2))
        la = train(a, opt_a, data, clip=False, accumulate=1, sched=None, write_at=-1)
        lb = train(b, opt_b, data, clip=False, accumulate=1, sched=None, write_at=-1)
        differ = sum(int((pa.detach().view(torch.int32) != pb.detach().view(torch.int32)).sum())
                     for pa, pb in zip(a.parameters(), b.parameters()))
        print(f"\ncuda AdamW vs offloaded: losses equal {[bool(torch.equal(x, y)) for x, y in zip(la, lb)]}, "
              f"parameter elements differing {differ} of {sum(p.numel() for p in a.parameters())}")
        assert all(abs(float(x) - float(y)) <= 1e-4 * abs(float(x)) for x, y in zip(la, lb))
    finally:
        torch.use_deterministic_algorithms(False)
