#!/usr/bin/env bash
# The planner against its lower bound and the other policies, on the regimes of issue 14:
# - the paper's presets on the paper's hardware (fp32);
# - weak SSD: one SSD at 1/5 of PCIe (10 GB/s each way), a host tier 3x the GPU budget, peak
#   memory 2.5-5x the GPU budget (bf16 and tf32, batch and sequence sweeps);
# - PyTorch-step-like: ~2-3 s iterations, ~100-200 GB peak, 25-50% of it as GPU budget, the
#   paper's hardware;
# - small GPU budgets, down to the largest working set (below it: refused).
# For each case: ideal, the lower bound, `auto` (the default) with its gap to the bound, the
# best other policy, and SSD bytes written by `auto` and `teraio`. Then the presets' wear
# figures and the plan time of llama3-70b.
# Usage: bash benches/planner-sweep.sh [OUT_DIR]   (builds the release binary first)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p teraio-cli
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
export T=target/release/teraio OUT
python3 - <<'EOF'
import json, os, subprocess, time

T, OUT = os.environ["T"], os.environ["OUT"]
# A hardware file of the paper's machine with one SSD at 10 GB/s each way (1/5 of PCIe Gen5).
weak = {
    "gpu_memory_bytes": 94000000000, "ssd_count": 1, "ssd_read_bytes_per_s": 10e9,
    "ssd_write_bytes_per_s": 10e9, "ssd_latency_us": 80.0, "pcie_h2d_bytes_per_s": 50e9,
    "pcie_d2h_bytes_per_s": 50e9, "host_memory_cap_bytes": 128000000000,
    "host_memory_bytes_per_s": 100e9, "gpudirect": True, "ssd_duplex_bytes_per_s": None,
    "ssd_capacity_bytes": 4000000000000, "ssd_endurance_tbw": 2400.0,
}
weak_path = os.path.join(OUT, "weak-ssd.json")
json.dump(weak, open(weak_path, "w"))

def peak_of(spec):
    v = json.loads(subprocess.run([T, "analyze", "preset:" + spec, "--policy", "none", "--json"],
                                  capture_output=True, text=True, check=True).stdout)
    return v["peak_resident_bytes"], v["min_gpu_bytes"]

OTHERS = ["teraio", "teraio-hybrid", "g10", "lru", "zero-infinity"]

def run(spec, hw, gpu_gb, host_gb=None):
    args = [T, "simulate", "preset:" + spec, "--hw", hw, "--gpu-mem-gb", "%.3f" % gpu_gb,
            "--policy", ",".join(["auto"] + OTHERS), "--json"]
    if host_gb is not None:
        args += ["--host-gb", "%.3f" % host_gb]
    t0 = time.time()
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[0]}
    rows = json.loads(out.stdout)
    rows = rows if isinstance(rows, list) else [rows]
    return {"rows": rows, "wall_s": time.time() - t0}

cases = []
for spec in ["llama3-8b", "granite-8b", "llama3-70b"]:
    cases.append(("presets", spec, "paper", 94.0, None))
for spec, frac in [("llama3-8b,dtype=bf16", 3.6), ("llama3-8b,dtype=bf16,seq=2048,micro-batch=8", 3.0),
                   ("llama3-8b,dtype=tf32", 3.6), ("llama3-8b,dtype=tf32,seq=8192,micro-batch=2", 4.5),
                   ("gpt2-xl,dtype=bf16", 3.0), ("gpt2-xl,dtype=bf16,micro-batch=16", 5.0),
                   ("gpt2-xl,dtype=tf32,micro-batch=16", 2.5)]:
    peak, _ = peak_of(spec)
    gpu = peak / frac / 1e9
    cases.append(("weak SSD", spec, weak_path, gpu, 3 * gpu))
for spec, fracs in [("llama3-8b,layers=8,dtype=tf32,micro-batches=2", [0.25, 0.35, 0.5]),
                    ("llama3-8b,layers=8,micro-batches=2", [0.25, 0.5]),
                    ("gpt2-xl,dtype=tf32,micro-batch=32", [0.25, 0.5]),
                    ("llama3-8b,layers=8,dtype=bf16,micro-batches=2", [0.35])]:
    peak, _ = peak_of(spec)
    for f in fracs:
        cases.append(("PyTorch-like", spec, "paper", peak * f / 1e9, None))
for spec in ["llama3-8b,dtype=bf16"]:
    peak, ws = peak_of(spec)
    for gpu in [ws / 1e9 * 1.05, ws / 1e9 * 1.5, ws / 1e9 * 0.95]:
        cases.append(("small GPU", spec, "paper", gpu, None))

print("| regime | trace | GPU GB | ideal s | bound s (% ideal) | auto s (% ideal) | gap to bound | best other | auto / best other | SSD GB written: auto / teraio | sim wall s |")
print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
for regime, spec, hw, gpu, host in cases:
    r = run(spec, hw, gpu, host)
    if "error" in r:
        print(f"| {regime} | {spec} | {gpu:.1f} | | | refused: {r['error']} | | | | | |")
        continue
    rows = r["rows"]
    ran = [x for x in rows if "refused" not in x and x["outcome"]["outcome"] == "completed"]
    auto = next((x for x in rows if x["policy"].startswith("auto")), None)
    if auto is None or "refused" in auto:
        why = auto["refused"] if auto else "?"
        print(f"| {regime} | {spec} | {gpu:.1f} | | | refused: {why} | | | | | |")
        continue
    ideal = auto["ideal_time_us"] / 1e6
    bound = auto["lower_bound_us"] / 1e6
    a = auto["iteration_time_us"] / 1e6
    others = [x for x in ran if not x["policy"].startswith("auto")]
    best = min(others, key=lambda x: x["iteration_time_us"]) if others else None
    wr = lambda x: next(b["bytes"] for b in x["bytes_moved"] if b["resource"] == "ssd_write") / 1e9
    ter = next((x for x in ran if x["policy"] == "teraio"), None)
    best_s = f"{best['policy']} {best['iteration_time_us']/1e6:.3f} s" if best else "-"
    ratio = f"{a / (best['iteration_time_us']/1e6):.3f}" if best else "-"
    ter_wr = f"{wr(ter):.1f}" if ter else "-"
    print(f"| {regime} | {spec} | {gpu:.1f} | {ideal:.3f} | {bound:.3f} ({100*ideal/bound:.1f}%) | "
          f"{a:.3f} ({auto['percent_of_ideal']:.1f}%) | {auto['gap_to_bound_percent']:.1f}% | {best_s} | "
          f"{ratio} | {wr(auto):.1f} / {ter_wr} | {r['wall_s']:.1f} |")
EOF
echo
echo "plan time of llama3-70b (auto, with the check and the lower bound):"
/usr/bin/time -f "%e s wall, %U s user" $T plan preset:llama3-70b | grep -E "policy|plan time|simulated"
