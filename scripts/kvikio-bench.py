#!/usr/bin/env python3
"""KvikIO, the peer teraio's GPU paths are measured against, on the same files.

A tensor of --bs bytes in GPU memory (CuPy) is split evenly over the N files (one pwrite/pread
future per file, as teraio stripes a tensor over its array), --iodepth tensors in flight,
--size bytes per file per phase. Write phase (timed up to fsync of every file, so buffered
writes are not counted as done), then the page cache is dropped, then the read phase; the
first and last byte of every tensor read back are checked. Prints one JSON object.

Usage: kvikio-bench.py --files F0 F1 F2 F3 --bs 64M --iodepth 8 --size 1G [--threads 16]
"""
import argparse
import json
import os
import time


def size(text):
    t = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    return int(t[:-1] if t[-1:] in "KMGT" else t) * mult


def drop_caches():
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", nargs="+", required=True)
    p.add_argument("--bs", type=size, default=64 << 20)
    p.add_argument("--iodepth", type=int, default=8)
    p.add_argument("--size", type=size, default=1 << 30)
    p.add_argument("--threads", type=int, default=16)
    a = p.parse_args()

    import cupy
    import kvikio
    import kvikio.defaults

    kvikio.defaults.set({"num_threads": a.threads, "auto_direct_io_read": True,
                         "auto_direct_io_write": True})
    n = len(a.files)
    per = a.bs // n
    if per * n != a.bs or per % 4096:
        raise SystemExit(f"--bs must split into {n} multiples of 4096")
    for f in a.files:
        if not os.path.exists(f) or os.path.getsize(f) < a.size + per:
            with open(f, "ab") as h:
                h.truncate(a.size + per)
    handles = [kvikio.CuFile(f, "r+") for f in a.files]
    tensors = max(1, a.size * n // a.bs)
    depth = min(a.iodepth, tensors)
    bufs = [cupy.random.randint(0, 256, a.bs, dtype=cupy.uint8) for _ in range(depth)]
    marks = [(int(b[0]), int(b[-1])) for b in bufs]
    cupy.cuda.runtime.deviceSynchronize()

    def phase(write, owner):
        # A buffer goes to the next tensor as soon as any tensor in flight is done (as teraio's
        # benchmark, fio and gdsio keep --iodepth in flight), not the oldest.
        inflight, free = [], list(range(depth))
        start = time.perf_counter()

        def take_done():
            while True:
                for j, (_, futs) in enumerate(inflight):
                    if all(f.done() for f in futs):
                        b, futs = inflight.pop(j)
                        for f in futs:
                            f.get()
                        return b
                time.sleep(2e-5)

        for t in range(tensors):
            if not free:
                free.append(take_done())
            b = free.pop()
            owner[t] = b
            futs = []
            for i, h in enumerate(handles):
                view = bufs[b][i * per:(i + 1) * per]
                op = h.pwrite if write else h.pread
                futs.append(op(view, per, file_offset=(t * per)))
            inflight.append((b, futs))
        while inflight:
            take_done()
        if write:
            for f in a.files:
                fd = os.open(f, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
        cupy.cuda.runtime.deviceSynchronize()
        return time.perf_counter() - start

    # Warm-up (thread pool, bounce buffers, cuFile handles), as teraio's benchmark does.
    for i, h in enumerate(handles):
        h.pwrite(bufs[0][i * per:(i + 1) * per], per, file_offset=0).get()
        h.pread(bufs[0][i * per:(i + 1) * per], per, file_offset=0).get()
    wrote_from = [0] * tensors
    wt = phase(True, wrote_from)
    dropped = drop_caches()
    read_into = [0] * tensors
    rt = phase(False, read_into)
    # Each buffer holds the last tensor read into it, which went out of the buffer marks name.
    last = {b: t for t, b in enumerate(read_into)}
    ok = all((int(bufs[b][0]), int(bufs[b][-1])) == marks[wrote_from[t]] for b, t in last.items())
    total = tensors * a.bs
    print(json.dumps({
        "peer": "kvikio",
        "version": kvikio.__version__,
        "compat_mode": str(kvikio.defaults.get("compat_mode")),
        "direct_io": [h.is_direct_io_supported() for h in handles][:1],
        "threads": a.threads,
        "task_size": kvikio.defaults.get("task_size"),
        "bs": a.bs, "iodepth": depth, "tensors": tensors, "files": n,
        "write_bw": total / wt, "read_bw": total / rt, "write_s": wt, "read_s": rt,
        "page_cache_dropped": dropped, "verified": ok,
    }))
    for h in handles:
        h.close()


if __name__ == "__main__":
    main()
