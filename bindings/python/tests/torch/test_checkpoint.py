"""Session(checkpoint_layers=): layers checkpointed by the plan's choice (or the caller's) train
bitwise as plain training does, and the choice is made only where the model finds it faster."""

import pytest
import torch

import teraio.torch as tt
from teraio.torch.checkpoint import layer_modules
from teraio.torch.session import _TestHooks as Hooks

from models import batches, hf_llama, make, train_step
from test_session import _SLOW, engine_store, params_bytes


def _run(tmp_path, n=6, layers=4, mult=10, **kw):
    """(reference losses and model, the Session's losses, model and session) over ``n`` steps
    of the tiny GPT at a budget of ``mult`` times its parameters' bytes."""
    data = batches(n, batch=16, seq=64)
    ref_m, ref_o = make(seq=64, layers=layers)
    ref = [train_step(ref_m, ref_o, t) for t in data]
    m, o = make(seq=64, layers=layers)
    budget = int(mult * params_bytes(m))
    s = tt.Session(m, o, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=budget, page_min_bytes=0,
                   hardware=dict(_SLOW, gpu_memory_bytes=budget), log=lambda _: None, **kw)
    got = []
    for t in data:
        with s.step():
            got.append(train_step(m, o, t))
    return ref, ref_m, got, m, s


def _gelus_in_backward(entry):
    """The forward GELUs a plan's trace runs during backward: one per checkpointed layer of the
    tiny GPT (plain backward runs ``gelu_backward`` only)."""
    return sum(k["name"] == "bwd.gelu" for k in entry.trace["kernels"])


def _same(ref_m, m):
    return all(torch.equal(p, q) for p, q in zip(ref_m.parameters(), m.parameters()))


def test_with_room_for_everything_no_layer_is_checkpointed(tmp_path):
    ref, ref_m, got, m, s = _run(tmp_path, n=4, mult=1000, checkpoint_layers="auto")
    assert s.checkpointed_layers == []
    (said,) = [r["checkpoint"] for r in s.steps if r.get("checkpoint")]
    assert said.startswith("no checkpointing"), said
    assert got == ref and _same(ref_m, m)
    s.close()


def test_layers_the_caller_names_are_checkpointed_from_the_first_step(tmp_path):
    ref, ref_m, got, m, s = _run(tmp_path, n=5, layers=3, checkpoint_layers=[0, 2])
    assert s.checkpointed_layers == [0, 2]
    mods = layer_modules(m)
    assert "forward" in mods[0].__dict__ and "forward" not in mods[1].__dict__
    assert got == ref and _same(ref_m, m)
    assert [r["mode"] for r in s.steps][-2:] == ["planned"] * 2
    (entry,) = [e for e in s.plans.values() if e.plan is not None]
    assert _gelus_in_backward(entry) == 2
    s.close()
    assert all("forward" not in mod.__dict__ for mod in mods)


def test_a_transformers_llama_chooses_layers_checkpoints_them_from_the_next_step_and_trains_bitwise(tmp_path):
    """A model nobody here wrote: a transformers Llama (GQA, RoPE, RMSNorm, SwiGLU)."""
    pytest.importorskip("transformers")

    def build():
        m = hf_llama(vocab=512, hidden=64, ffn=172, layers=4, max_len=256, eager=True)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)

    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 512, (8, 64), generator=g) for _ in range(6)]

    def train(m, opt, t):
        loss = m(input_ids=t, labels=t).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    ref_m, ref_o = build()
    ref = [train(ref_m, ref_o, t) for t in data]
    m, o = build()
    budget = 5 * params_bytes(m)
    s = tt.Session(m, o, _hooks=Hooks(store=engine_store(tmp_path)), gpu_budget_bytes=budget, page_min_bytes=0,
                   hardware=dict(_SLOW, gpu_memory_bytes=budget), checkpoint_layers="auto", log=lambda _: None)
    got = []
    for t in data:
        with s.step():
            got.append(train(m, o, t))
    # slow transfers, and a budget that holds little more than the weights and states: the
    # model finds remaking layers far cheaper than moving their activations (by 4x here, so
    # the choice does not hang on the CPU's timing of the operators)
    assert s.checkpointed_layers, [r.get("checkpoint") for r in s.steps]
    said = [r["checkpoint"] for r in s.steps if r.get("checkpoint")]
    assert len(said) == 1 and said[0].startswith("checkpointing"), said
    # the step that chose is not planned; the next is profiled with the layers checkpointed,
    # then planned
    modes = [r["mode"] for r in s.steps]
    assert modes[-3:] == ["planned"] * 3, modes
    (entry,) = [e for e in s.plans.values() if e.plan is not None]
    # the planned trace runs each checkpointed layer's forward again in backward (its SiLU;
    # plain backward runs silu_backward only)
    assert sum(k["name"] == "bwd.silu" for k in entry.trace["kernels"]) == len(s.checkpointed_layers)
    assert got == ref and _same(ref_m, m)
    # the library's own per-layer switch was used (its rules: no key-value cache while
    # checkpointing), and is off again after the session
    mods = layer_modules(m)
    assert all(mods[i].gradient_checkpointing for i in s.checkpointed_layers)
    s.close()
    assert all("forward" not in mod.__dict__ and not mod.gradient_checkpointing for mod in mods)


def test_bad_checkpoint_layers_are_errors_naming_the_argument():
    m, o = make()
    with pytest.raises(ValueError, match=r"layer 7 is not one of the model's 3 layers"):
        tt.Session(m, o, checkpoint_layers=[7], log=lambda _: None)
    with pytest.raises(ValueError, match=r"'auto' weighs plans under a budget"):
        tt.Session(m, o, checkpoint_layers="auto", log=lambda _: None)
    with pytest.raises(ValueError, match=r"None, 'auto' or a list of layer numbers"):
        tt.Session(m, o, checkpoint_layers="all", log=lambda _: None)
    flat = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no torch.nn.ModuleList of layers"):
        tt.Session(flat, torch.optim.SGD(flat.parameters(), lr=0.1), checkpoint_layers=[0], log=lambda _: None)
    # nothing was wrapped by the refused sessions
    assert all("forward" not in mod.__dict__ for mod in layer_modules(m))


def test_auto_profiles_by_the_gpus_time_unless_told(tmp_path):
    """profile_gpu_time's default follows checkpoint_layers="auto" (its choice is made on the
    GPU's time); given, it is kept; anything but a bool or None is an error naming it."""
    made = []

    def session(**kw):
        m, o = make()
        d = tmp_path / f"s{len(made)}"
        d.mkdir()
        made.append(d)
        return tt.Session(m, o, _hooks=Hooks(store=engine_store(d)), gpu_budget_bytes=1 << 30,
                          log=lambda _: None, **kw)

    for kw, want in [({}, False), ({"checkpoint_layers": "auto"}, True), ({"checkpoint_layers": [0]}, False),
                     ({"checkpoint_layers": "auto", "profile_gpu_time": False}, False),
                     ({"profile_gpu_time": True}, True)]:
        s = session(**kw)
        assert s.profiler.gpu_time is want, kw
        s.close()
    with pytest.raises(ValueError, match=r"profile_gpu_time must be True, False or None.*got 'yes'"):
        session(profile_gpu_time="yes")
