"""Arguments at the edges of what the buffer protocol and the API accept: item sizes read as
bytes (a unicode array is stored whole), object arrays refused, impossible array interface
claims and timeouts refused (never a PanicException), an executor whose engine was closed,
simulations of too many iterations."""

import math
import os
import time

import numpy as np
import pytest

import teraio


def round_trip(engine, tid, a):
    assert engine.offload(tid, a).wait() == "ssd"
    out = np.empty_like(a)
    engine.prefetch(tid, out).wait()
    return out


def test_a_unicode_array_is_stored_whole(engine):
    a = np.array([f"elt{i:05d}" for i in range(100)], dtype="U10")
    assert a.nbytes == 4000
    engine.offload(1, a).wait()
    assert engine.info(1).size_bytes == 4000
    out = np.empty_like(a)
    engine.prefetch(1, out).wait()
    assert np.array_equal(out, a), int((out != a).sum())


@pytest.mark.parametrize(
    "a",
    [
        np.arange(1000).astype("datetime64[ns]"),
        np.arange(1000).astype("timedelta64[s]"),
        np.array([b"ab", b"cdefg"] * 50, dtype="S7"),
        np.arange(300, dtype=np.complex128) * (1 + 2j),
        np.zeros(50, dtype=[("x", "<i4"), ("y", "<f8"), ("s", "S3")]),
    ],
    ids=["datetime64", "timedelta64", "bytes", "complex", "structured"],
)
def test_arrays_of_every_fixed_size_dtype_round_trip(engine, a):
    if a.dtype.names:
        a["x"] = np.arange(len(a))
        a["y"] = np.arange(len(a)) * 0.5
        a["s"] = b"abc"
    out = round_trip(engine, 2, a)
    assert out.tobytes() == a.tobytes()
    assert engine.info(2).size_bytes == a.nbytes


def test_object_arrays_are_refused_clearly(engine):
    with pytest.raises(teraio.InvalidArgumentError, match="object"):
        engine.offload(3, np.array([1, "a", None], dtype=object))
    with pytest.raises(teraio.InvalidArgumentError, match="object"):
        engine.offload(3, np.zeros(4, dtype=[("a", "<i4"), ("o", "O")]))
    with pytest.raises(teraio.InvalidArgumentError, match="object"):
        engine.prefetch(3, np.empty(3, dtype=object))
    assert engine.info(3) is None


class Claims:
    """An object whose array interface claims whatever it is given."""

    def __init__(self, **ai):
        self.__array_interface__ = {"version": 3, "typestr": "|u1", **ai}


@pytest.mark.parametrize(
    "ai",
    [
        {"shape": (2**64 - 1,), "data": (4096, False)},
        {"shape": (2**63,), "data": (4096, False)},
        {"shape": (2**40, 2**40), "data": (4096, False)},
        {"shape": (2**62,), "typestr": "<U4", "data": (4096, False)},
        {"shape": (10,), "data": (2**64 - 4, False)},
        {"shape": (-1,), "data": (4096, False)},
        {"shape": (10,), "data": ("x", False)},
        {"shape": (10,), "data": (4096, False), "typestr": "|O8"},
        {"shape": (10,), "data": (4096, False), "typestr": "rubbish"},
        {"shape": (10,), "data": (4096, False), "strides": (1, 1)},
        {"shape": (10,)},
    ],
)
def test_impossible_array_interface_claims_are_invalid_arguments(engine, ai):
    with pytest.raises(teraio.InvalidArgumentError):
        engine.offload(4, Claims(**ai))
    with pytest.raises(teraio.InvalidArgumentError):
        engine.prefetch(4, Claims(**ai))


def test_wait_timeouts_huge_mean_no_limit_and_bad_ones_are_invalid(engine):
    data = np.arange(1 << 16, dtype=np.uint8)
    assert engine.offload(5, data).wait(timeout=1e20) == "ssd"
    assert engine.offload(6, data).wait(timeout=math.inf) == "ssd"
    op = engine.offload(7, data)
    for bad in (-1.0, math.nan, -math.inf):
        with pytest.raises(teraio.InvalidArgumentError, match="timeout"):
            op.wait(timeout=bad)
    assert op.wait(timeout=1e300) == "ssd"


def test_an_executor_whose_engine_was_closed_raises_closed(tmp_path):
    trace = teraio.generate_trace(
        "gpt2-small", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=100, seq=16,
        micro_batch=1,
    )
    plan = teraio.plan(trace, "none")
    eng = teraio.Engine(dir=tmp_path, files=1, file_size="32M")
    ex = eng.executor(trace, plan, gpu_budget_bytes=1 << 30, allocate_created=True)
    eng.close()
    with pytest.raises(teraio.ClosedError, match="closed"):
        ex.start()
    with pytest.raises(teraio.ClosedError, match="closed"):
        ex.after_kernel(0)
    with pytest.raises(teraio.ClosedError):
        ex.finish()


def test_after_kernel_out_of_range_or_order_is_an_invalid_argument(tmp_path):
    trace = teraio.generate_trace(
        "gpt2-small", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=100, seq=16,
        micro_batch=1,
    )
    plan = teraio.plan(trace, "none")
    tensors = trace.to_dict()["tensors"]
    with teraio.Engine(dir=tmp_path, files=1, file_size="32M") as eng:
        ex = eng.executor(trace, plan, gpu_budget_bytes=1 << 30, allocate_created=True)
        for i, t in enumerate(tensors):
            if t["global"]:
                ex.attach(i, np.zeros(t["bytes"], dtype=np.uint8))
        ex.start()
        with pytest.raises(teraio.InvalidArgumentError, match=str(2**64 - 1)):
            ex.after_kernel(2**64 - 1)
        ex.before_kernel(0)
        with pytest.raises(teraio.InvalidArgumentError, match="expected kernel 0"):
            ex.after_kernel(3)
        ex.after_kernel(0)
        ex.finish()


def test_simulating_too_many_iterations_is_refused_at_once():
    trace = teraio.generate_trace(
        "gpt2-small", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=100, seq=16,
        micro_batch=1,
    )
    plan = teraio.plan(trace, "teraio")
    start = time.monotonic()
    for n in (1001, 2**32, 2**64 - 1):
        with pytest.raises(teraio.InvalidArgumentError, match="at most 1000"):
            teraio.simulate(trace, plan, iterations=n)
    assert time.monotonic() - start < 5
    assert teraio.simulate(trace, plan, iterations=3).iteration_time_us > 0


def test_a_trace_or_plan_with_a_byte_order_mark_loads(tmp_path):
    trace = teraio.generate_trace(
        "gpt2-small", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=100, seq=16,
        micro_batch=1,
    )
    p = tmp_path / "t.json"
    p.write_text("\ufeff" + trace.to_json(), encoding="utf-8")
    back = teraio.load_trace(p)
    assert back.kernel_count == trace.kernel_count
    plan = teraio.plan(trace, "teraio")
    assert teraio.Plan.from_json(back, "\ufeff" + plan.to_json()).to_json() == plan.to_json()
    bad = tmp_path / "bad.json"
    bad.write_text("\ufeff{", encoding="utf-8")
    with pytest.raises(teraio.TraceError, match="bad.json"):
        teraio.load_trace(bad)


def test_a_native_panic_is_an_internal_error_and_prints_nothing(capfd):
    with pytest.raises(teraio.InternalError, match="a panic for the tests") as e:
        teraio._teraio._panic_for_tests()
    assert isinstance(e.value, Exception) and "lib.rs" in str(e.value)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


CLOSE_CHILD = """
import os, subprocess, sys
import numpy as np
import teraio
e = teraio.Engine(dir=sys.argv[1], files=1, file_size="32M", persistent=True, backend="psync")
e.offload(7, np.full(100000, 0x5A, dtype=np.uint8), name="kept").wait()
# From now on this process may not write past 4 KiB of any file: the checkpoint fails.
subprocess.run(["prlimit", "--pid", str(os.getpid()), "--fsize=4096:4096"], check=True)
try:
    e.close()
except teraio.IoError as x:
    print("RAISED", x)
else:
    print("NOT RAISED")
assert e.closed
"""


def test_close_raises_a_failed_final_checkpoint(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # SIGXFSZ ignored (survives exec): a write past the limit fails with EFBIG.
    r = subprocess.run(
        ["sh", "-c", "trap '' XFSZ; exec \"$0\" -c \"$1\" \"$2\"", sys.executable, CLOSE_CHILD,
         str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "RAISED" in r.stdout, r.stdout + r.stderr
    with teraio.Engine(dir=tmp_path, files=1, file_size="32M", persistent=True,
                       backend="psync") as e:
        assert e.lookup("kept") == 7


def test_a_wait_timeout_beyond_the_clock_waits(engine):
    # Found by the buffer fuzz: 2^63 seconds fit a duration but not the clock (a panic before).
    data = np.arange(1 << 16, dtype=np.uint8)
    for i, t in enumerate((9.223372036854773e18, 2.0**63, 1.7e308)):
        assert engine.offload(20 + i, data).wait(timeout=t) == "ssd"
