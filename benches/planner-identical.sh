#!/usr/bin/env bash
# Whether two `teraio` binaries make identical `auto` plans (the plan's JSON, every field) on
# the paper's presets and the cases of benches/planner-sweep.sh, and how long each takes to
# plan (wall seconds, the two binaries alternated per case). For changes meant to make
# planning faster without changing its plans.
# Usage: bash benches/planner-identical.sh OLD_BINARY NEW_BINARY [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
export A=$1 B=$2 ROUNDS=${3:-1}
python3 - <<'PY'
import hashlib, json, os, statistics, subprocess, tempfile, time

A, B, ROUNDS = os.environ["A"], os.environ["B"], int(os.environ["ROUNDS"])
weak = {
    "gpu_memory_bytes": 94000000000, "ssd_count": 1, "ssd_read_bytes_per_s": 10e9,
    "ssd_write_bytes_per_s": 10e9, "ssd_latency_us": 80.0, "pcie_h2d_bytes_per_s": 50e9,
    "pcie_d2h_bytes_per_s": 50e9, "host_memory_cap_bytes": 128000000000,
    "host_memory_bytes_per_s": 100e9, "gpudirect": True, "ssd_duplex_bytes_per_s": None,
    "ssd_capacity_bytes": 4000000000000, "ssd_endurance_tbw": 2400.0,
}
weak_path = os.path.join(tempfile.mkdtemp(), "weak-ssd.json")
json.dump(weak, open(weak_path, "w"))

def peak_of(spec):
    v = json.loads(subprocess.run([A, "analyze", "preset:" + spec, "--policy", "none", "--json"],
                                  capture_output=True, text=True, check=True).stdout)
    return v["peak_resident_bytes"]

cases = [(s, "paper", None, None) for s in ["llama3-8b", "granite-8b", "llama3-70b"]]
for spec, frac in [("llama3-8b,dtype=bf16", 3.6), ("llama3-8b,dtype=tf32", 3.6),
                   ("gpt2-xl,dtype=bf16,micro-batch=16", 5.0), ("gpt2-xl,dtype=tf32,micro-batch=16", 2.5)]:
    g = peak_of(spec) / frac / 1e9
    cases.append((spec, weak_path, g, 3 * g))
for spec, f in [("llama3-8b,layers=8,dtype=tf32,micro-batches=2", 0.25),
                ("gpt2-xl,dtype=tf32,micro-batch=32", 0.25),
                ("llama3-8b,layers=8,dtype=bf16,micro-batches=2", 0.35)]:
    cases.append((spec, "paper", peak_of(spec) * f / 1e9, None))

def plan(binary, spec, hw, gpu, host):
    args = [binary, "plan", "preset:" + spec, "--hw", hw, "--json"]
    if gpu is not None:
        args += ["--gpu-mem-gb", "%.3f" % gpu]
    if host is not None:
        args += ["--host-gb", "%.3f" % host]
    t0 = time.time()
    out = subprocess.run(args, capture_output=True, text=True)
    wall = time.time() - t0
    text = out.stdout if out.returncode == 0 else "error: " + out.stderr
    return hashlib.sha256(text.encode()).hexdigest()[:12], wall

print("| trace | GPU GB | plans identical | old wall s (median) | new wall s (median) |")
print("|---|---:|---|---:|---:|")
for spec, hw, gpu, host in cases:
    ta, tb, ha, hb = [], [], set(), set()
    for _ in range(ROUNDS):
        h, t = plan(A, spec, hw, gpu, host); ha.add(h); ta.append(t)
        h, t = plan(B, spec, hw, gpu, host); hb.add(h); tb.append(t)
    same = "yes" if ha == hb and len(ha) == 1 else f"NO ({sorted(ha)} vs {sorted(hb)})"
    g = "paper" if gpu is None else "%.1f" % gpu
    print(f"| {spec} | {g} | {same} | {statistics.median(ta):.2f} | {statistics.median(tb):.2f} |", flush=True)
PY
