"""examples/train_gpt.py on the CPU: every torch mode trains, and the losses match ideal's."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--device", "cpu", "--layers", "2", "--hidden", "32", "--heads", "2", "--vocab", "97",
        "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1"]


def drive(tmp_path, modes, *extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    out = tmp_path / "out"
    subprocess.run([sys.executable, SCRIPT, "--modes", modes, *TINY, *extra, "--out", str(out)],
                   check=True, env=env, timeout=600)
    return {m: json.loads((out / f"{m}.json").read_text()) for m in modes.split(",")}, out


def test_torch_modes_match_ideal(tmp_path):
    res, out = drive(tmp_path, "ideal,save_on_cpu,checkpointing")
    ideal = res["ideal"]
    assert ideal["outcome"] == "ok" and len(ideal["losses"]) == 3
    for m in ("save_on_cpu", "checkpointing"):
        assert res[m]["outcome"] == "ok", res[m].get("error")
        assert res[m]["losses"] == ideal["losses"]
    assert res["save_on_cpu"]["host_bytes_moved_per_step"] > 0
    table = (out / "table.md").read_text()
    assert "| save_on_cpu | ok |" in table and "| yes |" in table
    assert (out / "losses.csv").read_text().count("\n") == 1 + 3 * 3


def test_teraio_mode_pages_through_the_engine_and_matches_ideal(tmp_path):
    teraio = pytest.importorskip("teraio")
    if not hasattr(teraio, "Engine"):
        pytest.fail("the teraio package has no Engine: the bindings are not installed")
    # a 150 KiB budget: far below the tiny model's iteration, so the pager must move storages
    res, _ = drive(tmp_path, "ideal,teraio-ssd,teraio-noop", "--cap-gib", str(150 / 2**20),
                   "--ssd-dir", str(tmp_path / "ssd"), "--ssd-file-gib", "0.0625", "--ssd-alloc-kib", "4",
                   "--page-min-kib", "0")
    t = res["teraio-ssd"]
    assert t["outcome"] == "ok", t.get("error")
    assert t["losses"] == res["ideal"]["losses"]
    assert t["teraio"]["bytes_moved_per_step"] > 0
    # teraio-noop: a plan that moves nothing under a budget nothing reaches (teraio.torch's own
    # cost); its steps after the profiled ones run planned
    n = res["teraio-noop"]
    assert n["outcome"] == "ok", n.get("error")
    assert n["losses"] == res["ideal"]["losses"]
    assert n["teraio"]["steps"][-1]["mode"] == "planned", n["teraio"]["steps"]


def test_two_ranks_under_torchrun_ddp_each_its_own_engine(tmp_path):
    # the driver starts each mode under torchrun (gloo on the CPU): DDP, each rank its own data
    # and its own engine folder; rank 0's result carries every rank's figures and the total
    teraio = pytest.importorskip("teraio")
    if not hasattr(teraio, "Engine"):
        pytest.fail("the teraio package has no Engine: the bindings are not installed")
    ssd = tmp_path / "ssd"
    res, out = drive(tmp_path, "ideal,teraio-ssd", "--nproc-per-node", "2", "--cap-gib", str(150 / 2**20),
                     "--ssd-dir", str(ssd), "--ssd-file-gib", "0.0625", "--ssd-alloc-kib", "4",
                     "--page-min-kib", "0")
    ideal, t = res["ideal"], res["teraio-ssd"]
    assert ideal["world_size"] == 2 and t["outcome"] == "ok", t.get("error")
    for r in (ideal, t):
        assert [x["rank"] for x in r["ranks"]] == [0, 1]
        assert r["tokens_per_s_total"] == pytest.approx(sum(x["tokens_per_s"] for x in r["ranks"]))
    # each rank's losses equal ideal's same rank; the ranks' data differ
    for mine, base in zip(t["ranks"], ideal["ranks"]):
        assert mine["losses"] == base["losses"]
        assert mine["bytes_moved_per_step"] > 0
    assert ideal["ranks"][0]["losses"] != ideal["ranks"][1]["losses"]
    assert sorted(os.listdir(ssd)) == ["rank0", "rank1"]
    assert "(2 ranks)" in (out / "table.md").read_text()
