"""teraio under FSDP2 (``fully_shard``) with two gloo ranks on the CPU: each rank a Session on
its own engine over its shards, its gradients, optimizer states and activations; FSDP's
unsharded parameters left to FSDP. Every loss and every shard (parameters and Adam states)
bitwise equal to plain FSDP2's, with paged and planned steps moving bytes under a small budget,
with ``reshard_after_forward`` on and off and with bf16 mixed precision (fp32 reduce); a rank
that cannot open its engine stops both; DCP checkpoints saved under a Session load into a new
one and training continues bitwise."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import teraio.torch as tt
from ranks import init_rank, models_importable, spawn_ranks  # noqa: F401 (an autouse fixture)

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):  # (PyTorch before 2.6 has no public FSDP2)
    pytest.skip("this PyTorch has no torch.distributed.fsdp.fully_shard", allow_module_level=True)

STEPS = 6
TIMEOUT = datetime.timedelta(seconds=120)  # a collective waiting for a rank that failed


def _sharded(reshard, bf16, seed=0):
    """The tests' Llama-style model (same weights on every rank), each layer and the root
    sharded by FSDP2, and foreach AdamW over the shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from models import make_llama

    model, _ = make_llama(seed=seed, layers=3, d=32, ffn=96)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp_policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=mp_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    return model, opt


def _shards(model, opt):
    """This rank's bytes: every parameter's local shard and every optimizer state's."""
    out = {f"param:{n}": (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
           for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"state:{names[id(p)]}.{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    return out


def _engine_cfg(base):
    return {"dir": str(base), "files": 2, "file_size": "64M", "alloc_unit": "4k", "stripe_unit": "64k"}


def _session(model, opt, base, **kw):
    eng = tt.rank_engine(_engine_cfg(base))
    # the rank's shards of the parameters: with gradients, two Adam states and activations
    # the step needs several times as much, so paging and the plans move bytes every step
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    return tt.Session(model, opt, engine=eng, gpu_budget_bytes=kw.pop("budget", 4 * shard), page_min_bytes=0,
                      log=lambda _: None, **kw)


def _train_job(rank, world, port, results, base, reshard, bf16):
    init_rank(rank, world, port, TIMEOUT)
    try:
        from models import batches, train_step

        model, opt = _sharded(reshard, bf16)
        s = _session(model, opt, base) if base is not None else None
        losses = []
        for t in batches(STEPS, seed=rank):  # each rank its own micro-batches
            if s is None:
                losses.append(train_step(model, opt, t))
                continue
            with s.step():
                losses.append(train_step(model, opt, t))
        out = {"losses": losses, "shards": _shards(model, opt)}
        if s is not None:
            rep = s.report()
            out["steps"] = [{"mode": r["mode"], "diverged": "diverged" in r, "bytes_moved": r["bytes_moved"]}
                            for r in s.steps]
            out["fetches"] = rep["fetches"]
            out["fsdp"] = rep["fsdp"]
            # what teraio traced: the rank's shards by name, FSDP's unsharded storages not at all
            trace = next(iter(s.plans.values())).trace if s.plans else None
            out["globals"] = sorted(t["name"] for t in trace["tensors"] if t["global"]) if trace else []
            out["traced_bytes"] = {t["name"]: t["bytes"] for t in trace["tensors"] if t["global"]} if trace else {}
            s.close()
        out["local_bytes"] = {f"param:{n}": p.to_local().untyped_storage().nbytes()
                              for n, p in model.named_parameters()}
        results[rank] = out
    finally:
        dist.destroy_process_group()


def _check_equal(plain, with_teraio):
    for rank in (0, 1):
        assert with_teraio[rank]["losses"] == plain[rank]["losses"], rank
        a, b = with_teraio[rank]["shards"], plain[rank]["shards"]
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (rank, k)


@pytest.mark.parametrize("reshard,bf16", [(True, False), (False, True)], ids=["reshard-fp32", "no-reshard-bf16"])
def test_fsdp2_ranks_with_sessions_train_as_plain_fsdp2(tmp_path, reshard, bf16):
    plain = spawn_ranks(_train_job, None, reshard, bf16)
    with_teraio = spawn_ranks(_train_job, tmp_path, reshard, bf16)
    _check_equal(plain, with_teraio)
    assert plain[0]["losses"] != plain[1]["losses"]  # different data per rank
    for rank in (0, 1):
        r = with_teraio[rank]
        assert r["fetches"] > 0, "the budget must force paging on every rank"
        modes = [(x["mode"], x["diverged"]) for x in r["steps"]]
        planned = [x for x in r["steps"] if x["mode"] == "planned" and not x["diverged"]]
        assert planned, modes
        assert all(x["bytes_moved"] > 0 for x in planned), r["steps"]
        # the shards are traced under the parameters' names (the same on both ranks: plans hold
        # across ranks), as large as this rank's local shard; FSDP's unsharded storages are not
        assert r["globals"] == with_teraio[1 - rank]["globals"]
        for name, nbytes in r["local_bytes"].items():
            assert r["traced_bytes"][name] == nbytes, name
        assert any(g.startswith("state:") for g in r["globals"])
        assert r["fsdp"]["unsharded_storages"] == len(r["local_bytes"])
        full = r["fsdp"]["unsharded_full_bytes"]
        assert 0 < r["fsdp"]["unsharded_peak_bytes"] <= full
        if reshard:
            # (layers are freed after their forward: never all unsharded at once)
            assert r["fsdp"]["unsharded_peak_bytes"] < full
        else:
            assert r["fsdp"]["unsharded_peak_bytes"] == full


def _failing_job(rank, world, port, results, base):
    init_rank(rank, world, port, TIMEOUT)
    try:
        model, opt = _sharded(True, False)
        (base / "not-a-dir").write_text("a file where rank 1's folder should be")
        cfg = {"dirs": [str(base / "ok"), str(base / "not-a-dir")], "files": 1, "file_size": "16M"}
        try:
            eng = tt.rank_engine(cfg)
            tt.Session(model, opt, engine=eng, gpu_budget_bytes=1 << 20)
            results[rank] = "opened"
        except RuntimeError as e:
            results[rank] = str(e)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_cannot_open_its_engine_stops_the_fsdp2_job(tmp_path):
    res = spawn_ranks(_failing_job, tmp_path)
    for r in (0, 1):
        assert "rank 1 could not open its engine" in res[r], res[r]
        assert "rank 0 could not" not in res[r]


def _dcp_job(rank, world, port, results, base, ckpt, resume):
    """``resume`` False: train STEPS steps under a Session, saving a DCP checkpoint after step 2
    (between steps, under the Session). True: a new model and optimizer load it, a new Session
    trains the steps after it."""
    init_rank(rank, world, port, TIMEOUT)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from models import batches, train_step

        model, opt = _sharded(True, False, seed=1 if resume else 0)  # (resumed: other weights until loaded)
        data = batches(STEPS, seed=rank)
        first = 0
        if resume:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=str(ckpt))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            first = 3
        s = _session(model, opt, base)
        losses = []
        for i in range(first, STEPS):
            with s.step():
                losses.append(train_step(model, opt, data[i]))
            if i == 2 and not resume:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(ckpt))
        modes = [r["mode"] for r in s.steps]
        fetches = s.report()["fetches"]
        s.close()
        results[rank] = {"losses": losses, "shards": _shards(model, opt), "modes": modes, "fetches": fetches}
    finally:
        dist.destroy_process_group()


def test_dcp_checkpoint_saved_under_a_session_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    whole = spawn_ranks(_dcp_job, tmp_path / "a", ckpt, False)
    resumed = spawn_ranks(_dcp_job, tmp_path / "b", ckpt, True)
    for rank in (0, 1):
        assert whole[rank]["fetches"] > 0 and resumed[rank]["fetches"] > 0
        assert "planned" in whole[rank]["modes"], whole[rank]["modes"]
        assert resumed[rank]["losses"] == whole[rank]["losses"][3:], rank
        a, b = resumed[rank]["shards"], whole[rank]["shards"]
        assert sorted(a) == sorted(b)
        for k in a:
            assert torch.equal(a[k], b[k]), (rank, k)


def test_fsdp_bench_tiny_runs_every_mode_with_equal_losses(tmp_path):
    # scripts/fsdp-bench.py (the GPU comparison of issue 35) on the CPU: each mode its own
    # process, one JSON line each; plain FSDP2, FSDP2's CPUOffloadPolicy and a teraio Session
    # under its budget train to the same losses, the Session's planned steps moving bytes
    pytest.importorskip("transformers")
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "scripts", "fsdp-bench.py")
    p = subprocess.run([sys.executable, script, "--tiny", "--engine-dir", str(tmp_path)], stdout=subprocess.PIPE,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert [x["mode"] for x in lines] == ["plain", "cpu-offload", "teraio"]
    by = {x["mode"]: x for x in lines}
    for x in lines:
        assert "error" not in x, x
        assert len(x["losses"]) == x["steps"] == 5 and x["s_per_step"] > 0
    assert by["teraio"]["losses"] == by["plain"]["losses"] == by["cpu-offload"]["losses"]
    t = by["teraio"]
    assert t["planned_steps"] >= 2, t["step_modes"]
    assert all(b > 0 for m, b in zip(t["step_modes"], t["bytes_moved"]) if m == "planned"), t
    assert 0 < t["fsdp"]["unsharded_peak_bytes"] < t["fsdp"]["unsharded_full_bytes"]


def test_fsdp_bench_deterministic_without_an_engine_dir_leaves_no_folder_behind(tmp_path):
    # --deterministic (the GPU bitwise check's flags: deterministic algorithms, eager attention)
    # on the CPU: plain and teraio train to the same losses; with no --engine-dir the teraio
    # process makes its engine folder in TMPDIR and removes it at its end
    pytest.importorskip("transformers")
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "scripts", "fsdp-bench.py")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.run([sys.executable, script, "--tiny", "--deterministic", "--modes", "plain,teraio", "--steps", "4"],
                       stdout=subprocess.PIPE, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout
    by = {x["mode"]: x for x in (json.loads(x) for x in p.stdout.splitlines() if x.startswith("{"))}
    assert sorted(by) == ["plain", "teraio"], by
    for x in by.values():
        assert "error" not in x and x["deterministic"], x
    assert by["teraio"]["losses"] == by["plain"]["losses"]
    assert by["teraio"]["planned_steps"] >= 1, by["teraio"]["step_modes"]
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith("teraio-fsdp-")]
    assert left == [], left


def test_fsdp_bench_tiny_two_ranks_each_with_its_own_engine(tmp_path):
    # the N-GPU command's path on two gloo ranks: each rank its own data and engine folder
    # (--engine-dirs), every rank's losses equal to plain FSDP2's same rank
    pytest.importorskip("transformers")
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "scripts", "fsdp-bench.py")
    dirs = [tmp_path / "r0", tmp_path / "r1"]
    p = subprocess.run([sys.executable, script, "--tiny", "--nproc", "2", "--modes", "plain,teraio",
                        "--engine-dirs", ",".join(map(str, dirs))], stdout=subprocess.PIPE, text=True, timeout=600)
    assert p.returncode == 0, p.stdout
    by = {x["mode"]: x for x in (json.loads(x) for x in p.stdout.splitlines() if x.startswith("{"))}
    assert sorted(by) == ["plain", "teraio"] and "error" not in by["teraio"], by
    plain, t = by["plain"]["ranks"], by["teraio"]["ranks"]
    assert [r["rank"] for r in t] == [0, 1]
    assert plain[0]["losses"] != plain[1]["losses"]  # each rank its own micro-batches
    for r in (0, 1):
        assert t[r]["losses"] == plain[r]["losses"], r
        assert t[r]["planned_steps"] >= 2, t[r]
        assert any(dirs[r].iterdir()), f"rank {r}'s engine folder is unused"


def test_a_session_refuses_fsdp2_cpu_offload_naming_the_parameter(tmp_path):
    # CPUOffloadPolicy moves the shards itself: a Session over the same shards is refused when
    # it is made, not after steps of two owners moving the same bytes
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from models import make_llama

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, _ = make_llama(layers=1)
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with pytest.raises(ValueError, match=r"parameter [\w.]+weight is sharded with CPUOffloadPolicy"):
            tt.Session(model, opt, engine={"dir": str(tmp_path), "files": 1, "file_size": "16M"},
                       gpu_budget_bytes=1 << 20)
        # a Session claims FSDP's unsharded storages while it is open, and lets them go at close
        from teraio.torch import _storages

        model2, _ = make_llama(layers=1)
        fully_shard(model2)
        s = tt.Session(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), log=lambda _: None)
        n = len(list(model2.parameters()))
        assert s.report()["fsdp"]["unsharded_storages"] == n and len(_storages._FOREIGN) == n
        s.close()
        assert not _storages._FOREIGN
    finally:
        dist.destroy_process_group()


class _Stream:
    """A stand-in for a CUDA stream: records what waits for what."""

    def __init__(self, name, log):
        self.name, self.log, self.device = name, log, torch.device("cpu")

    def __eq__(self, other):
        return isinstance(other, _Stream) and other.name == self.name

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


class _Work:
    def __init__(self, log):
        self.log = log

    def wait(self):
        self.log.append("collective waited")


def test_operators_on_fsdp_streams_are_ordered_against_the_trainers(monkeypatch):
    # under FSDP2 on a GPU, an operator FSDP runs on its own stream waits for the trainer's
    # stream (what teraio brought back for it) and the trainer's stream then waits for it (an
    # offload ordered after the trainer's stream reads what it wrote); a collective is waited
    # for before anything after it; operators on the trainer's stream are left alone
    from teraio.torch import _storages

    log = []
    trainer, side = _Stream("trainer", log), _Stream("all-gather", log)
    current = [side]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])

    def op(x):
        log.append("op")
        return x + 1

    def collective(x):
        log.append("collective")
        return [x], _Work(log)

    collective.namespace = "c10d"
    _storages.set_trainer_stream(trainer)
    try:
        assert _storages.run_op(op, (torch.ones(1),), {}).item() == 2
        assert log == ["all-gather waits for trainer", "op", "trainer waits for all-gather"]
        log.clear()
        _storages.run_op(collective, (torch.ones(1),), {})
        assert log == ["all-gather waits for trainer", "collective", "collective waited",
                       "trainer waits for all-gather"]
        log.clear()
        current[0] = trainer
        _storages.run_op(op, (torch.ones(1),), {})
        assert log == ["op"]
    finally:
        _storages.set_trainer_stream(None)
    log.clear()
    current[0] = side
    _storages.run_op(op, (torch.ones(1),), {})  # (no trainer's stream: the CPU, or no FSDP)
    assert log == ["op"]
    log.clear()
    # on the CPU (gloo writes from a worker thread) a collective is waited for at once
    _storages.run_op(collective, (torch.ones(1),), {})
    assert log == ["collective", "collective waited"]


def _host_optimizer_job(rank, world, port, results, update_in_backward):
    init_rank(rank, world, port, TIMEOUT)
    try:
        from models import batches, train_step

        model, opt = _sharded(True, False)
        tt.offload_optimizer(opt, update_in_backward=update_in_backward)
        # the same batches on both ranks: the averaged gradient is each rank's own, so every
        # shard must equal the matching rows of one unsharded process's training
        losses = [train_step(model, opt, t) for t in batches(STEPS, seed=0)]
        results[rank] = {"losses": losses, "shards": _shards(model, opt),
                         "states": sorted({f"{type(v).__name__}:{v.device.type}" for st in opt.state.values()
                                           for k, v in st.items() if k != "step"})}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("update_in_backward", [False, True], ids=["at-step", "in-backward"])
def test_the_host_optimizer_steps_fsdp2_shards_as_one_unsharded_process(update_in_backward):
    """offload_optimizer over FSDP2's sharded parameters (DTensors): each rank updates its own
    shard on the host (states of the local shard's shape, in host memory), bitwise as the
    unsharded model with the same host optimizer in one process."""
    from models import batches, make_llama, train_step

    ranks = spawn_ranks(_host_optimizer_job, update_in_backward)
    model, opt = make_llama(seed=0, layers=3, d=32, ffn=96)
    tt.offload_optimizer(opt, update_in_backward=update_in_backward)
    losses = [train_step(model, opt, t) for t in batches(STEPS, seed=0)]
    full = _shards(model, opt)
    for rank in (0, 1):
        r = ranks[rank]
        assert r["losses"] == losses, rank
        assert r["states"] == ["Tensor:cpu"], r["states"]  # plain host tensors, not DTensors
        assert sorted(r["shards"]) == sorted(full)
        for k, v in r["shards"].items():
            if full[k].dim() == 0:  # (a state's step count: the same on every rank)
                assert torch.equal(v, full[k]), (rank, k)
                continue
            # FSDP2 shards dim 0 in world-size chunks (the last may be short or empty)
            want = torch.chunk(full[k], 2, dim=0)
            want = want[rank] if rank < len(want) else full[k][:0]
            assert torch.equal(v, want), (rank, k)
