"""Two ranks under torch.distributed (gloo, CPU), each with its own engine and files: offloads
and prefetches checked per rank, a budget-paged training on each rank with losses equal to a
plain run, and a rank that cannot open its engine stopping every rank with a message naming it."""

import os

import pytest
import torch
import torch.distributed as dist

import teraio.torch as tt
from ranks import init_rank, models_importable, spawn_ranks  # noqa: F401 (an autouse fixture)


def _rank_job(rank, world, port, results, base):
    init_rank(rank, world, port)
    try:
        import numpy as np

        from models import batches, make, train_step

        cfg = {"dir": str(base), "files": 2, "file_size": "64M", "alloc_unit": "4k", "stripe_unit": "64k"}
        eng = tt.rank_engine(cfg)
        info = eng.config
        # this rank's tensors, its own pattern, through its own files
        for i in range(8):
            a = ((np.arange(100_003, dtype=np.uint64) * (rank + 3) + i) % 251).astype(np.uint8)
            eng.offload(i, a).wait()
            out = np.empty_like(a)
            eng.prefetch(i, out).wait()
            assert np.array_equal(out, a), (rank, i)
        model, opt = make()
        budget = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
        s = tt.Session(model, opt, engine=eng, gpu_budget_bytes=budget, page_min_bytes=0, log=lambda _: None)
        losses = []
        for t in batches(3):
            with s.step():
                losses.append(train_step(model, opt, t))
        rep = s.report()
        s.close()
        results[rank] = {"dir": info["dir"], "losses": losses, "fetches": rep["fetches"]}
    finally:
        dist.destroy_process_group()


def _failing_job(rank, world, port, results, base):
    init_rank(rank, world, port)
    try:
        cfg = {"dirs": [str(base / "ok"), str(base / "not-a-dir")], "files": 1, "file_size": "16M"}
        (base / "not-a-dir").write_text("a file where rank 1's folder should be")
        try:
            tt.rank_engine(cfg)
            results[rank] = "opened"
        except RuntimeError as e:
            results[rank] = str(e)
    finally:
        dist.destroy_process_group()


def test_two_ranks_each_own_engine_files_and_training(tmp_path):
    pytest.importorskip("teraio")
    from models import batches, make, train_step

    ref_model, ref_opt = make()
    ref = [train_step(ref_model, ref_opt, t) for t in batches(3)]
    res = spawn_ranks(_rank_job, tmp_path)
    assert sorted(res) == [0, 1]
    dirs = {res[r]["dir"] for r in res}
    assert len(dirs) == 2 and all(d.endswith(f"rank{r}") for r, d in ((r, res[r]["dir"]) for r in res))
    for r in res:
        assert res[r]["losses"] == ref, r
        assert res[r]["fetches"] > 0, "the budget must force paging on every rank"


def test_a_rank_that_cannot_open_its_engine_stops_every_rank(tmp_path):
    res = spawn_ranks(_failing_job, tmp_path)
    for r in (0, 1):
        assert "rank 1 could not open its engine" in res[r], res[r]
        assert "rank 0" not in res[r]


def test_rank_config_gives_each_rank_its_own_place():
    cfg = {"dir": "/d", "gpu": {"budget": "1G"}}
    assert tt.rank_config(cfg, 1)["dir"] == os.path.join("/d", "rank1")
    assert tt.rank_config(cfg, 1, local_rank=3)["gpu"]["device"] == 3
    assert cfg == {"dir": "/d", "gpu": {"budget": "1G"}}, "the shared description is not changed"
    assert tt.rank_config({"dirs": ["/a", "/b"]}, 1)["dir"] == "/b"
    assert tt.rank_config({"targets": [["/dev/a"], ["/dev/b", "/dev/c"]]}, 1)["targets"] == ["/dev/b", "/dev/c"]
    with pytest.raises(ValueError, match="one per rank"):
        tt.rank_config({"dirs": ["/a"]}, 1)
    with pytest.raises(ValueError, match="needs `dir`"):
        tt.rank_config({"files": 2}, 0)


def _ddp_job(rank, world, port, results, base):
    """TinyGPT under DistributedDataParallel (gradients all-reduced in backward), trained plainly
    (``base`` None) or by a session on this rank's own engine under a budget."""
    init_rank(rank, world, port)
    try:
        from models import batches, make, train_step

        model, _ = make()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        s = None
        if base is not None:
            eng = tt.rank_engine({"dir": str(base), "files": 2, "file_size": "64M", "alloc_unit": "4k",
                                  "stripe_unit": "64k"})
            budget = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
            s = tt.Session(ddp, opt, engine=eng, gpu_budget_bytes=budget, page_min_bytes=0, log=lambda _: None)
        losses = []
        for t in batches(6, seed=rank):  # each rank its own data: the all-reduce matters
            if s is None:
                losses.append(train_step(ddp, opt, t))
                continue
            with s.step():
                losses.append(train_step(ddp, opt, t))
        steps = s.steps if s is not None else []
        if s is not None:
            s.close()
        results[rank] = {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
                         "modes": [(r["mode"], "diverged" in r) for r in steps]}
    finally:
        dist.destroy_process_group()


def test_ddp_ranks_each_with_a_session_train_as_plain_ddp(tmp_path):
    # DDP's all-reduce runs inside backward, through the session's dispatch mode; each rank
    # profiles, plans and pages on its own engine, and every loss and parameter equals plain DDP's
    plain = spawn_ranks(_ddp_job, None)
    with_teraio = spawn_ranks(_ddp_job, tmp_path)
    for rank in (0, 1):
        assert with_teraio[rank]["losses"] == plain[rank]["losses"], rank
        for p, q in zip(with_teraio[rank]["params"], plain[rank]["params"]):
            assert torch.equal(p, q)
        modes = with_teraio[rank]["modes"]
        # (DDP rebuilds its gradient buckets after its first iterations: the first plan may
        # diverge once, the session profiles again)
        assert ("planned", False) in modes, modes
    assert plain[0]["losses"] != plain[1]["losses"]  # different data per rank
    assert with_teraio[0]["params"][0].equal(with_teraio[1]["params"][0])  # kept in sync by DDP
