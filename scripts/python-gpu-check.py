"""The Python package's GPU path on a machine with a GPU: CUDA tensors offloaded right after a
kernel on a side stream writes them, and prefetched into tensors a kernel just filled, with no
synchronization: the engine's stream ordering must make every byte come back (prints a line per
size and PASS or FAIL; exit status 1 on FAIL). Run on the GPU machine:

    SSD=/var/tmp python3 scripts/python-gpu-check.py

(docs/BENCHMARKS.md, "Device pointers through the Python package", 2026-12-02: PASS on an H200.)"""
import os, sys, time, tempfile
import torch, teraio

d = tempfile.mkdtemp(dir=os.environ.get("SSD", "/var/tmp"))
eng = teraio.Engine(dir=d, files=4, file_size="2G", gpu={"device": 0, "budget": "256M"}, overwrite="anything")
print("engine:", eng.describe(), flush=True)
s = torch.cuda.Stream()
ok = True
with torch.cuda.stream(s):
    for n in (1 << 20, (64 << 20) + 4096 + 48, 256 << 20):
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        # a kernel queued on the stream writes x; the offload must read after it (no sync here)
        x.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda"))
        ref = x.clone()
        t0 = time.perf_counter()
        eng.offload_device(n, x, stream=s).wait()
        t1 = time.perf_counter()
        y = torch.full((n,), 7, dtype=torch.uint8, device="cuda")  # queued: must land before the prefetch writes
        eng.prefetch_device(n, y, stream=s).wait()
        t2 = time.perf_counter()
        same = bool(torch.equal(y, ref))  # queued on s after the prefetch's fence
        ok &= same
        print(f"device round trip {n} bytes: equal={same} offload {n / (t1 - t0) / 1e9:.2f} GB/s "
              f"prefetch {n / (t2 - t1) / 1e9:.2f} GB/s", flush=True)
print("DEVICE API", "PASS" if ok else "FAIL", flush=True)
eng.close()
sys.exit(0 if ok else 1)
