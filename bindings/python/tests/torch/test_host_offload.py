"""offload_optimizer / Session(optimizer_on="host"): the user's torch.optim optimizer updates on
the host, states in host memory, with the same numbers as teraio's host optimizers.

The reference for each case is the same model trained with HostAdamW / HostAdam / HostSGD (the
same kernels on the parameters themselves): losses, parameters and every state must be bitwise
equal, over generated cases (optimizer, hyperparameters, several groups, schedules, clipping,
gradient accumulation, parameters written between steps, state dicts saved and loaded, chunked
steps). On a machine with a GPU the model also runs on CUDA (the states still on the host).
"""

import copy
import random

import pytest
import torch

from teraio.torch import HostAdam, HostAdamW, HostSGD, Session, make_plannable, offload_optimizer
from teraio.torch.session import _TestHooks as Hooks

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def model_for(seed, device):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 7))
    return m.to(device)


def batches(seed, n, device):
    g = torch.Generator().manual_seed(seed + 1000)
    return [(torch.randn(9, 13, generator=g).to(device), torch.randn(9, 7, generator=g).to(device))
            for _ in range(n)]


def groups(model, two):
    ps = list(model.parameters())
    if not two:
        return ps
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "weight_decay": 0.1}]


TORCH = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
HOST = {"adamw": HostAdamW, "adam": HostAdam, "sgd": HostSGD}


def hyper(kind, rng):
    if kind == "sgd":
        return {"lr": rng.choice([1e-2, 0.1]), "momentum": rng.choice([0.0, 0.9]),
                "weight_decay": rng.choice([0.0, 1e-2]), "nesterov": False}
    return {"lr": rng.choice([1e-3, 1e-2]), "weight_decay": rng.choice([0.0, 1e-2]),
            "amsgrad": rng.random() < 0.3, "betas": (0.9, rng.choice([0.999, 0.95]))}


def train(model, opt, data, *, clip, accumulate, sched, write_at, between=None):
    losses = []
    for i, (x, y) in enumerate(data):
        for _ in range(accumulate):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
        losses.append(loss.detach().cpu())
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        if i == write_at:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)
        if between is not None:
            between(i)
    return losses


def assert_same(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.detach().cpu().view(torch.int32), b.detach().cpu().view(torch.int32)), what


def assert_states_same(opt_a, opt_b, model_a, model_b):
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert_same(pa, pb, "parameter")
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            if k == "step":
                assert float(sa[k]) == float(sb[k])
            else:
                assert_same(sa[k], sb[k], f"state {k}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", range(12))
def test_the_offloaded_optimizer_steps_as_teraios_host_optimizer(device, case):
    rng = random.Random(case)
    kind = ["adamw", "adam", "sgd"][case % 3]
    hp = hyper(kind, rng)
    two = rng.random() < 0.5
    clip = rng.random() < 0.5
    accumulate = rng.choice([1, 2])
    write_at = rng.choice([-1, 1])
    scheduled = rng.random() < 0.5
    chunk = rng.choice([None, 0, 600])
    data = batches(case, 5, device)

    ref = model_for(case, "cpu")  # the reference steps on the host, its model on the CPU
    ours = model_for(case, device)
    ref_opt = HOST[kind](groups(ref, two), **hp)
    opt = offload_optimizer(TORCH[kind](groups(ours, two), **hp))
    if chunk is not None:
        make_plannable(opt, chunk)
    sched_ref = torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5) if scheduled else None
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if scheduled else None
    ref_data = [(x.cpu(), y.cpu()) for x, y in data]
    kw = dict(clip=clip, accumulate=accumulate, write_at=write_at)
    want = train(ref, ref_opt, ref_data, sched=sched_ref, **kw)
    got = train(ours, opt, data, sched=sched, **kw)
    if device == "cpu":
        # the same forward and backward on the same device: every number equal
        for a, b in zip(want, got):
            assert_same(a, b, "loss")
        assert_states_same(ref_opt, opt, ref, ours)
    else:
        # CUDA's forward and backward differ from the CPU's; the states still live on the host
        for p in ours.parameters():
            for k, v in opt.state[p].items():
                if isinstance(v, torch.Tensor):
                    assert v.device.type == "cpu", k
            assert p.device.type == "cuda"


def test_a_parameter_written_between_steps_is_read_again():
    """The master copy follows the parameter's version counter: without it the update would
    start from the old values and undo the write."""
    model, ref = model_for(0, "cpu"), model_for(0, "cpu")
    opt = offload_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    ref_opt = HostAdamW(ref.parameters(), lr=1e-2)
    data = batches(0, 4, "cpu")
    halve = {"step": 1}

    def loaded(m):
        def f(i):
            if i == halve["step"]:
                m.load_state_dict({k: v * 0.25 for k, v in m.state_dict().items()})
        return f

    want = train(ref, ref_opt, data, clip=False, accumulate=1, sched=None, write_at=-1, between=loaded(ref))
    got = train(model, opt, data, clip=False, accumulate=1, sched=None, write_at=-1, between=loaded(model))
    for a, b in zip(want, got):
        assert_same(a, b, "loss")
    assert_states_same(ref_opt, opt, ref, model)


def test_state_dicts_move_between_the_offloaded_and_plain_optimizers():
    data = batches(3, 6, "cpu")
    a = model_for(3, "cpu")
    opt_a = offload_optimizer(torch.optim.AdamW(a.parameters(), lr=1e-2, amsgrad=True))
    train(a, opt_a, data[:3], clip=False, accumulate=1, sched=None, write_at=-1)
    saved = copy.deepcopy(opt_a.state_dict())
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}

    # into a plain HostAdamW (teraio's kernels on the parameters): the same continuation
    b = copy.deepcopy(a)
    opt_b = HostAdamW(b.parameters(), lr=1e-2, amsgrad=True)
    opt_b.load_state_dict(saved)
    # and back into a fresh offloaded optimizer
    c = copy.deepcopy(a)
    opt_c = offload_optimizer(torch.optim.AdamW(c.parameters(), lr=1e-2, amsgrad=True))
    opt_c.load_state_dict(copy.deepcopy(saved))
    lb = train(b, opt_b, data[3:], clip=False, accumulate=1, sched=None, write_at=-1)
    la = train(a, opt_a, data[3:], clip=False, accumulate=1, sched=None, write_at=-1)
    lc = train(c, opt_c, data[3:], clip=False, accumulate=1, sched=None, write_at=-1)
    for x, y, z in zip(la, lb, lc):
        assert_same(x, y, "loss a/b")
        assert_same(x, z, "loss a/c")
    assert_states_same(opt_a, opt_b, a, b)
    assert_states_same(opt_a, opt_c, a, c)


def test_step_hooks_run_once_per_step_and_closures_once():
    model = model_for(1, "cpu")
    opt = offload_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    make_plannable(opt, 0)  # one parameter a chunk: four raw steps a step
    pre, post = [], []
    opt.register_step_pre_hook(lambda o, a, k: pre.append(1))
    opt.register_step_post_hook(lambda o, a, k: post.append(1))
    x, y = batches(1, 1, "cpu")[0]
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and len(calls) == 1 and len(pre) == 1 and len(post) == 1
    assert all("momentum_buffer" in opt.state[p] for p in model.parameters())


def test_what_cannot_step_on_the_host_is_refused_by_name():
    model = model_for(0, "cpu")
    with pytest.raises(TypeError, match="RMSprop"):
        offload_optimizer(torch.optim.RMSprop(model.parameters()))
    with pytest.raises(TypeError, match="float64"):
        offload_optimizer(torch.optim.AdamW(model_for(0, "cpu").double().parameters()))
    with pytest.raises(ValueError, match="differentiable"):
        offload_optimizer(torch.optim.AdamW(model.parameters(), differentiable=True))
    with pytest.raises(ValueError, match="threads"):
        offload_optimizer(torch.optim.AdamW(model.parameters()), threads=0)
    with pytest.raises(ValueError, match="optimizer_on must be 'gpu'.*'cuda'"):
        Session(model, torch.optim.AdamW(model.parameters()), optimizer_on="cuda", _hooks=Hooks(planner=lambda *a: None))
    with pytest.raises(ValueError, match="optimizer_on='host'.*on cpu.*HostAdamW"):
        Session(model, torch.optim.AdamW(model.parameters()), optimizer_on="host", _hooks=Hooks(planner=lambda *a: None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_updates_in_backward_are_the_same_updates(device, kind):
    rng = random.Random(11)
    hp = hyper(kind, rng)
    data = batches(11, 5, device)
    ref = model_for(11, "cpu")
    ours = model_for(11, device)
    ref_opt = HOST[kind](groups(ref, True), **hp)
    opt = offload_optimizer(TORCH[kind](groups(ours, True), **hp), update_in_backward=True)
    sched_ref = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.7)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)
    kw = dict(clip=False, accumulate=1, write_at=2)
    want = train(ref, ref_opt, [(x.cpu(), y.cpu()) for x, y in data], sched=sched_ref, **kw)
    got = train(ours, opt, data, sched=sched, **kw)
    if device == "cpu":
        for a, b in zip(want, got):
            assert_same(a, b, "loss")
        assert_states_same(ref_opt, opt, ref, ours)


def test_updates_in_backward_refuse_a_changed_or_accumulated_gradient():
    model = model_for(2, "cpu")
    opt = offload_optimizer(torch.optim.AdamW(model.parameters()), update_in_backward=True)
    (x, y), (x2, y2) = batches(2, 2, "cpu")
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="gradient changed between backward and optimizer.step"):
        opt.step()
    opt.zero_grad()
    # accumulation: a second backward before the step
    model = model_for(2, "cpu")
    opt = offload_optimizer(torch.optim.AdamW(model.parameters()), update_in_backward=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="second gradient before optimizer.step"):
        torch.nn.functional.mse_loss(model(x2), y2).backward()
    # and the default (update at step) takes both
    model = model_for(2, "cpu")
    opt = offload_optimizer(torch.optim.AdamW(model.parameters()))
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.functional.mse_loss(model(x2), y2).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    opt.step()


def test_a_gradient_changed_after_backward_is_copied_again():
    """Gradients go to the host during backward; one changed later (here: replaced and scaled
    by hand) is copied again at step(), so the update uses the gradient step() sees."""
    a, b = model_for(4, "cpu"), model_for(4, "cpu")
    opt_a = offload_optimizer(torch.optim.AdamW(a.parameters(), lr=1e-2))
    opt_b = HostAdamW(b.parameters(), lr=1e-2)
    for m, o in ((a, opt_a), (b, opt_b)):
        for x, y in batches(4, 3, "cpu"):
            torch.nn.functional.mse_loss(m(x), y).backward()
            ps = list(m.parameters())
            ps[0].grad.mul_(3.0)                      # in place: a new version
            ps[1].grad = ps[1].grad * 0.5             # another tensor
            o.step()
            o.zero_grad()
    assert_states_same(opt_b, opt_a, b, a)
