"""The host tier's cost of fresh memory: offloads from GPU memory into the engine's host tier,
timed in three passes over tensors of many sizes, to tell whether mapping, zeroing and
page-locking new host regions is what makes a Session's first planned step slow (16-29 s where
later steps take 0.6 s on the 1.1 B model: docs/BENCHMARKS.md, "The optimizer on the host for a
GPU model").

1. ``fresh``: each size for the first time: every offload maps, zeroes and page-locks a region.
2. ``reused``: the same sizes again: the regions freed by pass 1 are reused.
3. ``other sizes``: every size one huge page larger (none of pass 1's sizes), with the pool
   full of pass 1's regions: offloads unmap (unpin) cached regions and map new ones, as a plan's
   first step does after paged steps filled the tier with regions of their own sizes.

Each pass prints its GB/s (offload and wait, then free). On the GPU machine:

    SSD=/var/tmp python3 scripts/host-tier-bench.py --gib 8
    python3 scripts/host-tier-bench.py --emulated --gib 0.25    # any machine: the emulated GPU
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=8.0, help="bytes offloaded a pass, and the host tier's size (GiB)")
    ap.add_argument("--tensors", type=int, default=64, help="tensors a pass, of as many sizes")
    ap.add_argument("--size-mib", type=float, default=None,
                    help="every tensor this size (MiB) instead of --tensors distinct sizes: a model's "
                         "activations are many tensors of a few sizes (pass 3: each one huge page larger)")
    ap.add_argument("--emulated", action="store_true",
                    help="the engine's host-memory emulation of a GPU (no CUDA needed; nothing is page-locked)")
    ap.add_argument("--json", action="store_true", help="one JSON line with every pass")
    args = ap.parse_args()
    if args.gib <= 0 or args.tensors < 1:
        ap.error(f"--gib must be > 0 and --tensors >= 1 (got {args.gib}, {args.tensors})")
    huge = 2 << 20
    total = int(args.gib * (1 << 30))
    if args.size_mib is not None:
        size = int(args.size_mib * (1 << 20))
        if size <= 0 or size > total:
            ap.error(f"--size-mib must be > 0 and at most --gib (got {args.size_mib} MiB, {args.gib} GiB)")
        n = total // size
        return report(args, [size] * n, [size + huge] * n, huge)
    # n distinct sizes, each an even number of huge pages (base, base + 4 MiB, base + 8 MiB, ...),
    # and for pass 3 each one huge page more: no size of pass 3 is one of pass 1 (the pool reuses a
    # cached region of the same capacity only)
    n = args.tensors
    while n > 1 and huge * n * (n - 1) > total // 2:
        n -= 1
    base = max(2 * huge, (total - huge * n * (n - 1)) // n // (2 * huge) * (2 * huge))
    sizes = [base + 2 * i * huge for i in range(n)]
    return report(args, sizes, [b + huge for b in sizes], huge)


def report(args, sizes: list[int], other: list[int], huge: int) -> int:
    """Run the passes in a fresh engine folder (removed after) and print them."""
    d = tempfile.mkdtemp(dir=os.environ.get("SSD", "/var/tmp"))
    try:
        passes = measure(args, d, sizes, other, huge)
    finally:
        shutil.rmtree(d, ignore_errors=True)  # the engine's file: nothing stays behind
    if args.json:
        print(json.dumps({"emulated": args.emulated, "passes": passes}))
    return 0


def measure(args, d: str, sizes: list[int], other: list[int], huge: int) -> list[dict]:
    """The three passes in an engine on folder ``d``."""
    import teraio

    gpu = {"device": 0, "emulated": True} if args.emulated else {"device": 0}
    # the tier holds one pass of the larger sizes: pass 3 fills it only by unmapping pass 1's regions
    eng = teraio.Engine(dir=d, files=1, file_size="1G", host_tier=sum(other) + 8 * huge, gpu=gpu,
                        overwrite="anything")
    try:
        return passes_of(eng, args.emulated, sizes, other)
    finally:
        eng.close()


def passes_of(eng, emulated: bool, sizes: list[int], other: list[int]) -> list[dict]:
    import numpy as np

    import teraio

    n = len(sizes)
    if emulated:
        bufs = [np.ones(k, dtype=np.uint8) for k in sizes + other]
        mems_all = [teraio.DeviceMemory(b.ctypes.data, b.nbytes, b) for b in bufs]
        mems, mems_other = mems_all[:n], mems_all[n:]
        sync = lambda: None  # noqa: E731
    else:
        import torch

        mems = [torch.ones(k, dtype=torch.uint8, device="cuda") for k in sizes]
        mems_other = [torch.ones(k, dtype=torch.uint8, device="cuda") for k in other]
        sync = torch.cuda.synchronize
    passes = []

    def run(label: str, ms: list) -> None:
        sync()
        fallbacks = eng.stats()["host_fallbacks"]
        t0 = time.perf_counter()
        nbytes = 0
        for i, m in enumerate(ms):
            eng.offload_device(i, m, destination="host").wait()
            nbytes += m.nbytes
        t1 = time.perf_counter()
        for i in range(len(ms)):
            eng.free(i).wait()
        to_ssd = eng.stats()["host_fallbacks"] - fallbacks
        passes.append({"pass": label, "tensors": len(ms), "bytes": nbytes, "offload_s": t1 - t0,
                       "gb_per_s": nbytes / (t1 - t0) / 1e9, "to_ssd": to_ssd})
        print(f"{label:12s} {len(ms)} tensors, {nbytes / 1e9:.2f} GB: {t1 - t0:.3f} s, "
              f"{nbytes / (t1 - t0) / 1e9:.2f} GB/s ({to_ssd} went to SSD: the tier was full)", flush=True)

    print(f"engine: {eng.describe()}", flush=True)
    run("fresh", mems)
    run("reused", mems)
    run("other sizes", mems_other)
    return passes


if __name__ == "__main__":
    sys.exit(main())
