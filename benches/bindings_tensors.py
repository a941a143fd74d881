"""Offload+prefetch throughput of numpy buffers through the Python package, with the tensor
mix of `teraio bench --tensors` (log-uniform 1 MiB - 1 GiB, the same seeded draw, the same
total), on the same engine configuration file. Used by benches/bindings-vs-bench.sh.

    python benches/bindings_tensors.py CONFIG TOTAL_BYTES [SEED] [buffer|copy]

buffer: arrays from Engine.empty (engine memory, moved without a copy); copy: plain
numpy.empty arrays (copied into engine memory at offload, out of it at each wait).
Prints one JSON line like `teraio bench --tensors --json`.
"""

import json
import math
import sys
import time

import numpy as np

import teraio

M64 = (1 << 64) - 1


def tensor_mix(total, seed):
    """rand 0.8's SmallRng (xoshiro256++ whose seed rand_core 0.6's seed_from_u64 fills with
    PCG32 outputs) as the CLI draws its sizes."""
    state = seed

    def pcg32():
        nonlocal state
        state = (state * 6364136223846793005 + 11634580027462260723) & M64
        x = ((((state >> 18) ^ state) >> 27)) & 0xFFFFFFFF
        rot = state >> 59
        return ((x >> rot) | (x << ((32 - rot) & 31))) & 0xFFFFFFFF

    s = []
    for _ in range(4):
        lo = pcg32()
        s.append(lo | pcg32() << 32)

    def rotl(x, k):
        return ((x << k) | (x >> (64 - k))) & M64

    def next_u64():
        r = (rotl((s[0] + s[3]) & M64, 23) + s[0]) & M64
        t = (s[1] << 17) & M64
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return r

    lo, hi = math.log(1 << 20), math.log(1 << 30)
    sizes, acc = [], 0
    while acc < total:
        f = (next_u64() >> 11) * (1.0 / (1 << 53))
        n = int(math.exp(lo + f * (hi - lo)))
        n = max(min(n, total - acc), 1 << 20)
        sizes.append(n)
        acc += n
    return sizes


def main():
    config, total = sys.argv[1], int(sys.argv[2])
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    mode = sys.argv[4] if len(sys.argv) > 4 else "buffer"
    sizes = tensor_mix(total, seed)
    host = 2 * total + (len(sizes) + 128) * (2 << 20)
    with teraio.Engine(config, host_buffers=host) as eng:
        # Memory allocated and touched before the clock starts.
        if mode == "buffer":
            arrays = [eng.empty(n, np.uint8) for n in sizes]
        else:
            arrays = [np.empty(n, np.uint8) for n in sizes]
        for i, a in enumerate(arrays):
            a.fill(i & 0xFF)
        t0 = time.perf_counter()
        ops = [eng.offload(i, a) for i, a in enumerate(arrays)]
        for op in ops:
            op.wait()
        offload_s = time.perf_counter() - t0
        if mode != "buffer":
            for a in arrays:
                a[0] = 0xFF  # the prefetch must bring the byte back
        t0 = time.perf_counter()
        ops = [eng.prefetch(i, a) for i, a in enumerate(arrays)]
        for i, op in enumerate(ops):
            a = op.wait()
            if a[0] != (i & 0xFF):
                raise SystemExit(f"tensor {i} came back with wrong bytes")
        prefetch_s = time.perf_counter() - t0
    print(json.dumps({
        "workload": "tensors", "mode": mode, "tensors": len(sizes), "total_bytes": total,
        "min_tensor_bytes": min(sizes), "max_tensor_bytes": max(sizes),
        "offload": {"bw_bytes": total / offload_s, "runtime_s": offload_s},
        "prefetch": {"bw_bytes": total / prefetch_s, "runtime_s": prefetch_s},
    }))


if __name__ == "__main__":
    main()
