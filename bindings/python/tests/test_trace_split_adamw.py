"""scripts/trace-split-adamw.py: a trace's one fused AdamW step rewritten into the per-parameter
steps teraio.torch runs; the result must be a valid trace the planner takes."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

import teraio

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "trace-split-adamw.py"
TRACE = REPO / "docs" / "torch-eval" / "traces" / "gpt-12l-1024h-b16x1024-bf16.trace.json.gz"


def test_the_fused_step_becomes_one_step_per_parameter(tmp_path):
    out = tmp_path / "split.trace.json"
    subprocess.run([sys.executable, str(SCRIPT), str(TRACE), str(out), "--step-s", "0.05"], check=True)
    before = json.load(gzip.open(TRACE))
    after = json.loads(out.read_text())
    params = [t["name"][len("param:"):] for t in before["tensors"] if t["name"].startswith("param:")]
    assert len(after["kernels"]) == len(before["kernels"]) + 2 * len(params) - 2
    assert sum(k["duration_us"] for k in after["kernels"]) == pytest.approx(0.05e6)
    by_name = {t["name"]: t for t in after["tensors"]}
    names = [k["name"] for k in after["kernels"]]
    for x in params:
        adam = names.index(f"opt._fused_adamw_#{x}")
        step = names.index(f"opt._foreach_add_.Scalar#{x}")
        assert step == adam - 1
        # the kernel touches its parameter's five tensors and no other parameter's
        mine = {n for n, t in by_name.items() if adam in t["accesses"]}
        assert mine == {f"param:{x}", f"grad:{x}", f"state:{x}.step", f"state:{x}.exp_avg",
                        f"state:{x}.exp_avg_sq"}, mine
        assert adam in by_name[f"param:{x}"]["writes"]
        assert step in by_name[f"state:{x}.step"]["accesses"]
    # a valid trace: the planner plans it
    trace = teraio.Trace.from_dict(after)
    p = teraio.plan(trace, "teraio", "paper", gpu_memory_bytes=6 << 30)
    assert p is not None


def test_a_trace_without_a_fused_step_is_refused(tmp_path):
    t = json.load(gzip.open(TRACE))
    t["kernels"] = [k for k in t["kernels"] if k["name"] != "opt._fused_adamw_"]
    src = tmp_path / "nofused.trace.json"
    src.write_text(json.dumps(t))
    r = subprocess.run([sys.executable, str(SCRIPT), str(src), str(tmp_path / "out.json")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "no single fused AdamW step" in r.stderr, r.stderr
