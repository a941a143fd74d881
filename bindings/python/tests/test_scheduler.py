"""The scheduler from Python: traces, plans, simulations, comparisons, bad input."""

import json

import pytest

import teraio


@pytest.fixture(scope="module")
def trace():
    return teraio.generate_trace("gpt2-small", layers=2, micro_batch=2)


def test_plan_and_simulate_under_a_squeezed_gpu(trace):
    assert trace.kernel_count > 0 and trace.tensor_count > 0
    cap = trace.peak_resident_bytes * 3 // 4
    p = teraio.plan(trace, "teraio", gpu_memory_bytes=cap)
    assert p.policy == "teraio" and len(p.instructions) > 0
    assert p.stats["planned_peak_bytes"] <= cap
    r = teraio.simulate(trace, p, gpu_memory_bytes=cap)
    assert isinstance(r, teraio.SimReport) and r.completed
    assert r.peak_gpu_bytes <= cap and 0 < r.percent_of_ideal <= 100
    assert "ssd_write" in r.bytes_moved
    again = teraio.Plan.from_json(trace, p.to_json())
    assert again.to_dict() == p.to_dict()
    with_timeline = teraio.simulate(trace, p, gpu_memory_bytes=cap, timeline=True)
    assert with_timeline.timeline is not None and with_timeline.timeline["memory"]


def test_compare_policies_returns_dataclasses(trace):
    cap = trace.peak_resident_bytes * 3 // 4
    rs = teraio.compare_policies(trace, ["teraio", "none", "ideal"], gpu_memory_bytes=cap)
    assert [r.policy for r in rs] == ["teraio", "none", "ideal"]
    assert all(isinstance(r.report, teraio.SimReport) and r.plan_time_s >= 0 for r in rs)
    assert rs[2].report.percent_of_ideal == 100
    assert not rs[1].report.completed  # nothing moves: out of memory
    assert set(teraio.POLICIES) >= {"teraio", "g10", "zero-infinity", "lru"}


def test_hardware_presets_and_overrides():
    hw = teraio.hardware("dev", ssd_count=7)
    assert hw["ssd_count"] == 7
    assert teraio.hardware(hw)["ssd_count"] == 7
    with pytest.raises(teraio.InvalidArgumentError, match="gpu_mem"):
        teraio.hardware("paper", gpu_mem=1)
    with pytest.raises(teraio.InvalidArgumentError, match="moon"):
        teraio.hardware("moon")


def test_traces_round_trip_and_corrupt_ones_are_named(tmp_path, trace):
    path = tmp_path / "t.json"
    trace.save(path)
    back = teraio.load_trace(path)
    assert (back.name, back.kernel_count) == (trace.name, trace.kernel_count)
    assert teraio.Trace.from_dict(trace.to_dict()).tensor_count == trace.tensor_count
    assert teraio.load_trace("preset:gpt2-small,layers=1").kernel_count > 0
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "kernels": [')
    with pytest.raises(teraio.TraceError, match="bad.json"):
        teraio.load_trace(bad)
    d = trace.to_dict()
    d["tensors"][0]["bytes"] = "lots"
    with pytest.raises(teraio.TraceError):
        teraio.Trace.from_json(json.dumps(d))
    with pytest.raises(teraio.TraceError):
        teraio.Trace.from_json(b"{}")
    with pytest.raises(teraio.IoError):
        teraio.load_trace(tmp_path / "missing.json")
    with pytest.raises(teraio.InvalidArgumentError, match="wings"):
        teraio.generate_trace("gpt2-small", wings=2)
    with pytest.raises(teraio.InvalidArgumentError, match="magic"):
        teraio.plan(trace, "magic")
    with pytest.raises(teraio.PlanError):
        teraio.Plan.from_json(trace, '{"policy": "x"}')


def test_select_is_the_checked_plan_with_its_budgets_and_names_a_kernel_that_never_fits(trace):
    cap = trace.peak_resident_bytes * 3 // 4
    sel = teraio.select(trace, "teraio", gpu_budget_bytes=cap, traffic_margin=0.03)
    checked = teraio.plan(trace, "teraio", checked=True, gpu_memory_bytes=cap)
    assert sel.choice in ("as_modelled", "slower_transfers") and sel.why
    if sel.choice == "as_modelled":
        assert sel.plan.to_dict()["instructions"] == checked.to_dict()["instructions"]
    assert sel.budgets["executor_bytes"] == cap and sel.budgets["planning_bytes"] == cap
    assert sel.info["traffic"]["chosen"] in ("as modelled", "planned for slower transfers")
    assert sum(a["chosen"] for a in sel.info["alternatives"]) == 1
    # the fixed allowance: a fraction of the budget, and twice the largest tensor below it
    assert teraio.select_budgets(1_000_000, allowance={"kind": "fixed", "keep_fraction": 0.85},
                                 largest_tensor_bytes=200_000) == (600_000, 600_000)
    got = teraio.select_budgets(1000, trace=trace)
    nf = got["never_fits"]
    assert nf["needed_bytes"] > 1000 and nf["capacity_bytes"] == 1000 and f"kernel {nf['kernel']}" in nf["message"]
    with pytest.raises(teraio.TeraioError, match="GPU memory too small: kernel"):
        teraio.select(trace, gpu_budget_bytes=1000)
    with pytest.raises(teraio.InvalidArgumentError, match="traffic_margin"):
        teraio.select(trace, gpu_budget_bytes=cap, traffic_margin=2.0)


def test_choose_checkpoint_weighs_layer_sets_with_the_select_options(trace):
    # slow transfers and a squeezed GPU: remaking a layer beats moving its activations
    slow = dict(pcie_h2d_bytes_per_s=1e8, pcie_d2h_bytes_per_s=1e8, ssd_read_bytes_per_s=1e7,
                ssd_write_bytes_per_s=1e7, host_memory_cap_bytes=0)
    cap = trace.peak_resident_bytes * 3 // 4
    c = teraio.choose_checkpoint(trace, "auto", "paper", gpu_budget_bytes=cap, **slow)
    assert c["layers"] and set(c["layers"]) <= {0, 1}, c["why"]
    assert c["why"].startswith("checkpointing") and c["tried"][0]["layers"] == []
    assert c["without_us"] is None or c["iteration_time_us"] < c["without_us"]
    # room for everything: nothing to gain
    roomy = teraio.choose_checkpoint(trace, "auto", "paper", gpu_budget_bytes=trace.peak_resident_bytes * 4)
    assert roomy["layers"] == [] and roomy["iteration_time_us"] == roomy["without_us"], roomy["why"]
    # no set runs in 1000 bytes: none is chosen, and each one's refusal names the kernel
    bad = teraio.choose_checkpoint(trace, "auto", "paper", gpu_budget_bytes=1000)
    assert bad["layers"] == [] and bad["without_us"] is None and bad["iteration_time_us"] is None
    assert all("GPU memory too small: kernel" in t["refused"] for t in bad["tried"]), bad["tried"]


def test_host_updates_run_at_the_step_unless_in_backward():
    """place_optimizer: a host update's CPU work starts at the optimizer's step (where
    offload_optimizer runs it) by default, as soon as its gradients arrived with
    ``in_backward=True`` (update_in_backward): there all-host hides behind backward."""
    t = teraio.load_trace("preset:gpt2-small,dtype=bf16,micro-batch=1,layers=2")
    hw = teraio.hardware("paper", gpu_memory_bytes=int(0.8e9), cpu_adam_params_per_s=1e8)
    at_step = teraio.place_optimizer(t, "teraio", hw, candidates=2)
    early = teraio.place_optimizer(t, "teraio", hw, candidates=2, in_backward=True)
    assert early["all_host_us"] < at_step["all_host_us"], (early["summary"], at_step["summary"])
    assert early["all_gpu_us"] == at_step["all_gpu_us"]
