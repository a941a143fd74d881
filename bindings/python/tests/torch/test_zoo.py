"""benches/torch/zoo.py on the CPU: the tiny model zoo (transformers' Llama, GPT-2 and GPT-NeoX)
under ideal, teraio and checkpointing, each run its own process; teraio's losses bitwise ideal's
under a cap of half ideal's traced peak, its planned steps within the cap, every row in the table,
the methods that need CUDA recorded as such, and bad arguments refused by name."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", ".."))
SCRIPT = os.path.join(ROOT, "benches", "torch", "zoo.py")
MODELS = ["llama", "gpt2", "neox"]
RUN = ["ideal", "teraio", "checkpointing"]
CUDA_ONLY = ["save_on_cpu", "zero-offload"]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    teraio = pytest.importorskip("teraio")
    if not hasattr(teraio, "Engine"):
        pytest.fail("the teraio package has no Engine: the bindings are not installed")
    tmp = tmp_path_factory.mktemp("zoo")
    out = tmp / "out"
    # warmup 2: the first step creates AdamW's state, the second is profiled and planned, so
    # teraio's two timed steps run its plan
    p = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--sizes", "tiny", "--dtypes", "fp32",
                        "--models", ",".join(MODELS), "--methods", ",".join(RUN + CUDA_ONLY),
                        "--fractions", "1/2", "--steps", "2", "--warmup", "2", "--engine-dir", str(tmp / "engine"),
                        "--out", str(out), "--save-traces", str(tmp / "traces"), "--json"],
                       capture_output=True, text=True, env=_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return {"rows": rows, "out": out, "stderr": p.stderr, "engine": tmp / "engine", "traces": tmp / "traces"}


def _row(zoo, model, method):
    (r,) = [r for r in zoo["rows"] if r["model"] == model and r["method"] == method]
    return r


def test_every_run_has_its_row_in_the_jsonl_and_a_progress_line(zoo):
    rows = zoo["rows"]
    assert sorted((r["model"], r["method"]) for r in rows) == sorted(
        (m, x) for m in MODELS for x in RUN + CUDA_ONLY)
    # the file holds the same rows as the JSON printed
    saved = [json.loads(ln) for ln in (zoo["out"] / "results.jsonl").read_text().splitlines()]
    assert saved == rows
    assert zoo["stderr"].count("zoo [") == len(rows)
    # each run's engine folder is removed after it
    assert not any(zoo["engine"].iterdir()) if zoo["engine"].exists() else True
    for m in MODELS:
        ideal = _row(zoo, m, "ideal")
        assert ideal["status"] == "ok", ideal.get("error")
        assert len(ideal["losses"]) == 4 and ideal["tokens_per_s"] > 0 and ideal["pct_of_ideal"] == 100.0
        # on the CPU ideal's peak is the traced bytes of one step; the caps are half of it
        assert ideal["peak_bytes"] > 0 and ideal["peak_source"].startswith("traced")
        for x in RUN[1:]:
            r = _row(zoo, m, x)
            assert r["cap_bytes"] == int(ideal["peak_bytes"] * 0.5) and r["ideal_peak_bytes"] == ideal["peak_bytes"]


def test_teraio_trains_bitwise_like_ideal_within_its_cap(zoo):
    for m in MODELS:
        ideal, t = _row(zoo, m, "ideal"), _row(zoo, m, "teraio")
        assert t["status"] == "ok" and not t["oom"], t.get("error")
        assert t["losses"] == ideal["losses"], m
        assert t["losses_equal_ideal"] is True and t["max_abs_loss_diff"] == 0.0
        tio = t["teraio"]
        # the timed steps ran the plan, under the budget the cap set, and moved bytes
        assert tio["step_modes"][2:] == ["planned", "planned"], tio["step_modes"]
        assert tio["budget_bytes"] == t["cap_bytes"]
        assert t["peak_source"].startswith("traced: the executor's peak")
        assert 0 < t["peak_bytes"] <= t["cap_bytes"], (t["peak_bytes"], t["cap_bytes"])
        assert t["within_cap"] is True
        # the iteration as if nothing moved needs more than the cap: the cap binds
        assert tio["trace_peak_bytes"] > t["cap_bytes"]
        assert t["bytes_moved_per_step"] > 0
        assert t["median_step_s"] > 0 and t["pct_of_ideal"] > 0
        # the profiled step's record: its operators' durations added up within its wall time
        (prof,) = tio["profiles"]
        assert 0 < prof["kernels_s"] <= prof["wall_s"] and prof["sleeps"] == 0, prof


def test_saved_traces_are_the_profiles_the_plans_were_made_of(zoo):
    import gzip

    import teraio
    from teraio.torch import peak_bytes

    saved = sorted(os.listdir(zoo["traces"]))
    # teraio's runs alone save, each its one profile (one shape) beside its plan's settings
    assert saved == sorted(f"{m}-tiny-fp32-teraio-cap0.5-0.{x}" for m in MODELS
                           for x in ("trace.json.gz", "plan.json")), saved
    for m in MODELS:
        t = _row(zoo, m, "teraio")
        base = zoo["traces"] / f"{m}-tiny-fp32-teraio-cap0.5-0"
        assert t["saved_traces"] == [str(base) + ".trace.json.gz", str(base) + ".plan.json"]
        with gzip.open(str(base) + ".trace.json.gz", "rt") as f:
            trace = json.load(f)
        assert peak_bytes(trace) == t["teraio"]["trace_peak_bytes"]
        assert len(teraio.Trace.from_dict(trace).to_dict()["kernels"]) == len(trace["kernels"])
        meta = json.loads((zoo["traces"] / f"{m}-tiny-fp32-teraio-cap0.5-0.plan.json").read_text())
        assert meta["gpu_budget_bytes"] == t["cap_bytes"] and meta["refused"] is None
        assert meta["hardware"]["pcie_h2d_bytes_per_s"] > 0 and meta["plan"].startswith("auto")


def test_checkpointing_runs_and_cuda_only_methods_say_so(zoo):
    for m in MODELS:
        c = _row(zoo, m, "checkpointing")
        assert c["status"] == "ok", c.get("error")
        assert c["losses_equal_ideal"] is True  # (the CPU's recomputation is exact)
        assert c["cap_enforced_by"] is None and c["bytes_moved_per_step"] is None
        for x in CUDA_ONLY:
            r = _row(zoo, m, x)
            assert r["status"] == "needs CUDA" and "needs a CUDA device" in r["reason"], r
            assert not r["oom"] and "losses" not in r


def test_the_table_lists_every_row(zoo):
    text = (zoo["out"] / "table.md").read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| model")]
    assert len(lines) == len(zoo["rows"])
    for r in zoo["rows"]:
        mine = [ln for ln in lines if ln.startswith(f"| {r['model']} |") and f"| {r['method']} |" in ln]
        assert len(mine) == 1, (r["model"], r["method"])
        if r["method"] == "teraio":
            assert "| yes (bitwise) |" in mine[0] and "| ok |" in mine[0]
        if r["method"] in CUDA_ONLY:
            assert "needs CUDA" in mine[0]
    svg = (zoo["out"] / "plot.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<rect") >= 1 + 2 * len(MODELS)


@pytest.mark.parametrize("argv, named", [
    (["--models", "llama,mamba"], "'mamba'"),
    (["--methods", "ideal,magic"], "'magic'"),
    (["--sizes", "7b"], "'7b'"),
    (["--dtypes", "fp8"], "'fp8'"),
    (["--fractions", "1/2,1.5"], "'1.5'"),
    (["--fractions", "0"], "'0'"),
    (["--fractions", "1/0"], "'1/0'"),
    (["--device", "tpu"], "'tpu'"),
    (["--steps", "0"], "--steps"),
    (["--variants", "plain"], "'plain'"),
    (["--variants", "a:;a:--teraio-gather all"], "'a'"),
    (["--variants", "a:--steps 3"], "--steps"),
    (["--rounds", "0"], "--rounds"),
])
def test_bad_arguments_exit_with_an_error_naming_them(argv, named):
    p = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, env=_env(), timeout=60)
    assert p.returncode == 2, p.stderr
    assert "error" in p.stderr and named in p.stderr, p.stderr


@pytest.mark.parametrize("model", MODELS)
def test_deterministic_runs_build_eager_attention(model):
    """--deterministic: eager attention (SDPA's fused backward kernels are not deterministic
    under warn_only); otherwise the library's default."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("zoo_script", SCRIPT)
    zoo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zoo)
    run = {"model": model, "size": "tiny", "seed": 0}
    _, cfg = zoo.build_model(dict(run, deterministic=True), torch)
    assert cfg._attn_implementation == "eager"
    _, cfg = zoo.build_model(dict(run, deterministic=False), torch)
    assert cfg._attn_implementation != "eager"


def test_variants_alternate_their_teraio_runs_against_one_ideal(tmp_path):
    """--variants and --rounds: each capped cell's teraio runs under each variant's options in
    turn, round after round, beside one ideal run; every row names its variant and round, runs
    its own options (here the gathering between steps) and trains bitwise like ideal."""
    pytest.importorskip("teraio")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--sizes", "tiny", "--dtypes", "fp32",
                        "--models", "llama", "--methods", "ideal,teraio", "--fractions", "1/2", "--steps", "1",
                        "--warmup", "2", "--engine-dir", str(tmp_path / "engine"), "--out", str(out),
                        "--variants", "all:--teraio-gather all;none:--teraio-gather none", "--rounds", "2",
                        "--json"], capture_output=True, text=True, env=_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [(r["method"], r.get("variant"), r.get("round")) for r in rows] == [
        ("ideal", None, None), ("teraio", "all", 1), ("teraio", "none", 1), ("teraio", "all", 2),
        ("teraio", "none", 2)]
    assert len({r["run"] for r in rows}) == len(rows)  # (each its own log)
    for r in rows[1:]:
        assert r["status"] == "ok" and r["losses_equal_ideal"] is True, r.get("error")
        assert r["teraio_gather"] == r["variant"]
    table = (out / "table.md").read_text()
    for name, rnd in (("all", 1), ("none", 1), ("all", 2), ("none", 2)):
        assert table.count(f"| teraio [{name}] #{rnd} |") == 1, table
    assert "zoo [5/5]" in p.stderr
