#!/usr/bin/env python3
"""Host time of the calls that hand caller memory to the native module, for two builds of the
Python package side by side (issue 34: the native module read buffers through a call back into
``teraio._export`` / ``teraio._device_export``; now it reads them itself, export.rs).

Each build runs in its own interpreter (``PYTHONPATH`` = a folder the wheel was installed into
with ``pip install --target``); the builds alternate, ``--rounds`` times, and each round times
every case ``--calls`` times. Printed: per case, the median over rounds of each round's median,
in microseconds, and the ratio after / before.

Cases:
- ``attach ctypes`` / ``attach numpy`` / ``attach DeviceMemory``: ``Executor.attach`` of a global
  tensor in safe mode (after ``leave_plan``): the memory is read as the executor's allocation
  path reads what ``allocator.alloc`` returns (device memory or a host buffer), then given back
  through ``allocator.release`` (a Python no-op). ctypes arrays are what teraio.torch hands over
  for CPU storages, DeviceMemory what it hands over on a GPU (here the engine's host-memory GPU
  emulation).
- ``offload 4 KiB`` / ``prefetch 4 KiB``: the ``Engine.offload`` / ``Engine.prefetch`` call of a
  4 KiB numpy array (submission only: the wait is outside the timing).

Usage (two wheels installed with ``pip install --no-deps --target DIR WHEEL``):

    python scripts/export-bench.py --before /tmp/site-before --after /tmp/site-after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(calls: int) -> dict[str, float]:
    import ctypes

    import numpy as np

    import teraio

    def median_ns(f, n=calls):
        ts = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            f()
            ts.append(time.perf_counter_ns() - t0)
        return statistics.median(ts)

    out: dict[str, float] = {}
    trace = teraio.generate_trace(
        "gpt2-small", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=100, seq=16,
        micro_batch=1,
    )
    tensors = trace.to_dict()["tensors"]
    plan = teraio.plan(trace, "none")

    class Allocator:
        def alloc(self, tid, nbytes, why):
            return np.zeros(nbytes, dtype=np.uint8)

        def release(self, tid, mem):
            pass

    with tempfile.TemporaryDirectory() as d:
        with teraio.Engine(dir=d, files=2, file_size="64M", gpu={"device": 0, "emulated": True},
                           retain_on_prefetch=True) as e:
            ex = e.executor(trace, plan, gpu_budget_bytes=1 << 30, allocator=Allocator())
            g = next(i for i, t in enumerate(tensors) if t["global"])
            keep = []
            for i, t in enumerate(tensors):
                if t["global"]:
                    a = np.zeros(t["bytes"], dtype=np.uint8)
                    keep.append(a)
                    ex.attach(i, a)
            ex.start()
            ex.leave_plan(0, "benchmark: attach gives the memory back")
            n = tensors[g]["bytes"]
            raw = np.zeros(n + 256, dtype=np.uint8)
            aligned = raw[(-raw.ctypes.data) % 256:][:n]
            ct = (ctypes.c_uint8 * n).from_address(aligned.ctypes.data)
            dev = teraio.DeviceMemory(aligned.ctypes.data, n, aligned)
            out["attach ctypes"] = median_ns(lambda: ex.attach(g, ct))
            out["attach numpy"] = median_ns(lambda: ex.attach(g, aligned))
            out["attach DeviceMemory"] = median_ns(lambda: ex.attach(g, dev))
            ex.finish()

            src = np.arange(1024, dtype=np.float32)
            dst = np.empty_like(src)
            ts_off, ts_pre = [], []
            for i in range(calls):
                t0 = time.perf_counter_ns()
                op = e.offload(i, src, destination="host")
                ts_off.append(time.perf_counter_ns() - t0)
                op.wait()
                t0 = time.perf_counter_ns()
                op = e.prefetch(i, dst)
                ts_pre.append(time.perf_counter_ns() - t0)
                op.wait()
                e.free(i).wait()
            out["offload 4 KiB"] = statistics.median(ts_off)
            out["prefetch 4 KiB"] = statistics.median(ts_pre)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="site folder of the build before")
    ap.add_argument("--after", help="site folder of the build after")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.calls)))
        return
    if not (args.before and args.after):
        ap.error("--before and --after are required")
    runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
            env = dict(os.environ, PYTHONPATH=getattr(args, name))
            p = subprocess.run([sys.executable, __file__, "--child", "--calls", str(args.calls)],
                               env=env, check=True, capture_output=True, text=True)
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(f"median of {args.rounds} rounds' medians ({args.calls} calls each), microseconds")
    print(f"{'case':24} {'before':>8} {'after':>8} {'after/before':>13}")
    for case in runs["before"][0]:
        b = statistics.median(x[case] for x in runs["before"]) / 1e3
        a = statistics.median(x[case] for x in runs["after"]) / 1e3
        print(f"{case:24} {b:8.2f} {a:8.2f} {a / b:13.2f}")


if __name__ == "__main__":
    main()
