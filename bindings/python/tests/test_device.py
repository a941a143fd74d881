"""Device memory from Python: `Engine.offload_device` / `prefetch_device` and the executor with
device memory and a stream, run on the engine's host-memory GPU emulation (the same data paths
as a CUDA GPU: chunked bounce pipeline, fences, checksums), so they run on any machine. The
same calls with CUDA tensors run on the GPU machine (scripts/torch-gpu-eval.sh)."""

import numpy as np
import pytest

import teraio

from test_executor import Allocator, drive, fill


def aligned(n, value=0):
    """A numpy array of n bytes at a 256-byte aligned address (as cudaMalloc aligns)."""
    raw = np.full(n + 256, value, dtype=np.uint8)
    off = (-raw.ctypes.data) % 256
    return raw[off:off + n]


def dev(a):
    return teraio.DeviceMemory(a.ctypes.data, a.nbytes, a)


def gpu_engine(tmp_path, **kw):
    opts = {"files": 2, "file_size": "64M", **kw}
    return teraio.Engine(dir=tmp_path, gpu={"device": 0, "emulated": True}, **opts)


def test_device_offload_and_prefetch_round_trip(tmp_path):
    with gpu_engine(tmp_path) as eng:
        n = (3 << 20) + 4096 + 48  # chunks of the bounce pipeline, and a ragged tail
        src = aligned(n)
        src[:] = fill(1, n)
        assert eng.offload_device(1, dev(src), stream=0).wait() == "ssd"
        out = aligned(n, 0xEE)
        got = eng.prefetch_device(1, dev(out)).wait()
        assert isinstance(got, teraio.DeviceMemory)
        assert np.array_equal(out, src)
        # a stream object is accepted where it has a handle attribute
        class Stream:
            cuda_stream = 0
        assert eng.offload_device(2, dev(src), stream=Stream(), destination="host").wait() in ("host", "ssd")


def test_device_memory_errors_are_clear(tmp_path):
    with pytest.raises(teraio.InvalidArgumentError, match="device address"):
        teraio.DeviceMemory(0, 16)
    with pytest.raises(teraio.InvalidArgumentError, match="nbytes"):
        teraio.DeviceMemory(4096, 0)
    with gpu_engine(tmp_path / "a") as eng:
        a = aligned(4096)
        with pytest.raises(teraio.InvalidArgumentError, match="host buffers go through offload"):
            eng.offload_device(1, a)
        with pytest.raises(teraio.InvalidArgumentError, match="align"):
            eng.offload_device(1, teraio.DeviceMemory(a.ctypes.data + 1, 100, a))
        with pytest.raises(teraio.InvalidArgumentError, match="stream"):
            eng.offload_device(1, dev(a), stream="zero")
        with pytest.raises(teraio.UnknownTensorError):
            eng.prefetch_device(99, dev(a)).wait()
    # an engine without a GPU says how to name one
    with teraio.Engine(dir=tmp_path / "b", files=1, file_size="16M") as eng:
        a = aligned(4096)
        with pytest.raises(teraio.InvalidArgumentError, match=r"\[gpu\]"):
            eng.offload_device(1, dev(a))


class DeviceAllocator(Allocator):
    """The scripted trainer's memory as (emulated) device memory."""

    def alloc(self, tid, nbytes, why):
        super().alloc(tid, nbytes, why)
        a = aligned(nbytes)
        self.live[tid] = a
        return dev(a)


def test_the_executor_moves_device_memory_in_stream_order(tmp_path):
    trace = teraio.generate_trace(
        "gpt2-small", layers=2, hidden=256, heads=4, kv_heads=4, ffn=1024, vocab=2000, seq=128,
        micro_batch=2,
    )
    budget = trace.peak_resident_bytes * 3 // 4
    plan = teraio.plan(trace, "teraio", gpu_memory_bytes=budget)
    tensors = trace.to_dict()["tensors"]
    alloc = DeviceAllocator()
    with gpu_engine(tmp_path, file_size="128M", retain_on_prefetch=True) as eng:
        ex = eng.executor(trace, plan, gpu_budget_bytes=budget, allocate_created=True,
                          allocator=alloc, stream=0)
        globals_ = [i for i, t in enumerate(tensors) if t["global"]]
        mems = {}
        for i in globals_:
            a = aligned(tensors[i]["bytes"])
            a[:] = fill(i, a.nbytes)
            mems[i] = a
            ex.attach(i, dev(a))
        ex.start()
        for rep in drive(ex, trace, budget):
            assert rep["store"]["ssd_read"]["bytes"] > 0
        for i in globals_:
            mem = ex.resident(i)
            if mem is not None:
                assert isinstance(mem, teraio.DeviceMemory)
                got = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * mem.nbytes).from_address(mem.ptr))
                assert np.array_equal(got, fill(i, mem.nbytes)), i
        assert alloc.allocs > 0 and alloc.releases > 0
        ex.finish()


def test_the_host_tier_bench_runs_its_three_passes_on_the_emulated_gpu(tmp_path):
    """scripts/host-tier-bench.py (the fresh / reused / other-size host regions measurement for
    the GPU machine) as a user runs it on any machine: every pass offloads all its tensors into
    the host tier, none to the SSD, the third pass one huge page more each."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "scripts" / "host-tier-bench.py"
    env = dict(os.environ, SSD=str(tmp_path))
    out = subprocess.run([sys.executable, str(script), "--emulated", "--gib", "0.06", "--tensors", "8", "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    passes = json.loads(out.stdout.splitlines()[-1])["passes"]
    assert [p["pass"] for p in passes] == ["fresh", "reused", "other sizes"]
    n = passes[0]["tensors"]
    assert n > 1 and all(p["tensors"] == n and p["to_ssd"] == 0 for p in passes), passes
    assert passes[0]["bytes"] == passes[1]["bytes"] == passes[2]["bytes"] - n * (2 << 20)
    # one size for every tensor, as a model's activations are: 0.0625 GiB in 4 MiB tensors
    same = subprocess.run([sys.executable, str(script), "--emulated", "--gib", "0.0625", "--size-mib", "4", "--json"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert same.returncode == 0, same.stderr
    passes = json.loads(same.stdout.splitlines()[-1])["passes"]
    assert [(p["tensors"], p["bytes"], p["to_ssd"]) for p in passes] == \
        [(16, 16 << 22, 0), (16, 16 << 22, 0), (16, 16 * (6 << 20), 0)], passes
    assert os.listdir(tmp_path) == [], "the engine's folder is removed"
    bad = subprocess.run([sys.executable, str(script), "--gib", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--gib must be > 0" in bad.stderr
    big = subprocess.run([sys.executable, str(script), "--gib", "0.01", "--size-mib", "64"],
                         capture_output=True, text=True, timeout=60)
    assert big.returncode == 2 and "--size-mib must be > 0 and at most --gib" in big.stderr
