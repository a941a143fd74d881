#!/usr/bin/env python3
"""The host AdamW step against its peers on the same buffers: teraio.adamw_step,
torch.optim.AdamW on the CPU (foreach=False and foreach=True) and, when it imports, DeepSpeed's
CPUAdam (`deepspeed.ops.adam.DeepSpeedCPUAdam`, AdamW mode).

One float32 parameter of --params elements, its gradient and the two Adam states are allocated
once; every optimizer steps those same tensors (torch's and DeepSpeed's optimizers are handed
them as their state), so each reads and writes the same 28 bytes a parameter. The optimizers
take turns, one step each per round (so drift in the machine's speed hits all alike), after
--warmup rounds; the script prints each one's median step time, its memory traffic in GB/s
(28 B/param over the median), and its time against teraio's. Two STREAM-like rows, in the same
rotation, measure what the host's memory gives with the same threads: a copy (`b.copy_(c)`, 8 B an
element) and a triad (`torch.add(b, c, alpha=3, out=a)`, 12 B an element) over arrays of the
same length; the report gives each optimizer's traffic as a share of the faster of the two
(`--no-stream` leaves them out). Threads: --threads for teraio and
for torch (torch.set_num_threads); DeepSpeed uses OpenMP's (OMP_NUM_THREADS, set to --threads
here when not set already).

Benchmark a release build (`maturin build --release`): a dev-profile wheel computes the same
bits several times more slowly; the script says so when it sees one.

Usage: scripts/optim-bench.py [--params 256M] [--steps 10] [--warmup 2] [--threads N] [--json]
"""
import argparse
import json
import os
import statistics
import sys
import time


def count(text):
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=count, default=count("256M"), help="elements (k, M, G: powers of 1024)")
    ap.add_argument("--steps", type=int, default=10, help="timed rounds")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every optimizer")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--no-stream", action="store_true", help="leave out the memory-bandwidth rows")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))

    import torch
    import teraio

    info = teraio.optimizer_info()
    if info["debug_build"]:
        print("optim-bench: this teraio is a debug build (maturin's dev profile): its loops are not "
              "vectorized; build a release wheel for figures", file=sys.stderr)
    torch.set_num_threads(a.threads)
    n = a.params
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n, generator=gen))
    param.grad = torch.randn(n, generator=gen) * 1e-2
    exp_avg = torch.zeros(n)
    exp_avg_sq = torch.zeros(n)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    def torch_opt(foreach):
        opt = torch.optim.AdamW([param], foreach=foreach, **hp)
        # the same buffers: the optimizer's state is ours
        opt.state[param] = {"step": torch.tensor(0.0), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        return opt.step

    steps = {"teraio": 0}

    def teraio_step():
        steps["teraio"] += 1
        teraio.adamw_step(param.data, param.grad, exp_avg, exp_avg_sq, step=steps["teraio"],
                          lr=hp["lr"], beta1=hp["betas"][0], beta2=hp["betas"][1], eps=hp["eps"],
                          weight_decay=hp["weight_decay"], threads=a.threads)

    candidates = {
        "teraio": teraio_step,
        "torch foreach=False": torch_opt(False),
        "torch foreach=True": torch_opt(True),
    }
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds = DeepSpeedCPUAdam([param], adamw_mode=True, **hp)
        ds.state[param] = {"step": 0, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        candidates["DeepSpeedCPUAdam"] = ds.step
    except Exception as e:  # not installed, or its extension does not build here
        print(f"optim-bench: DeepSpeed's CPUAdam is not available ({type(e).__name__}: {e}); "
              "skipped", file=sys.stderr)

    traffic = {name: 28 * n for name in candidates}
    if not a.no_stream:
        sa, sb, sc = torch.empty(n), torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        sa.zero_()
        candidates["stream copy"] = lambda: sb.copy_(sc)
        candidates["stream triad"] = lambda: torch.add(sb, sc, alpha=3.0, out=sa)
        traffic["stream copy"] = 8 * n
        traffic["stream triad"] = 12 * n

    times = {k: [] for k in candidates}
    with torch.no_grad():
        for r in range(a.warmup + a.steps):
            for name, step in candidates.items():
                t0 = time.perf_counter()
                step()
                dt = time.perf_counter() - t0
                if r >= a.warmup:
                    times[name].append(dt)

    base = statistics.median(times["teraio"])
    stream = max((traffic[k] / statistics.median(times[k]) for k in ("stream copy", "stream triad")
                  if k in times), default=None)
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        row = {"optimizer": name, "step_s_median": med, "step_s_min": min(ts),
               "bytes_per_s": traffic[name] / med, "time_vs_teraio": med / base}
        if stream:
            row["of_stream"] = row["bytes_per_s"] / stream
        rows.append(row)
    doc = {"params": n, "bytes_per_param": 28, "threads": a.threads, "steps": a.steps,
           "stream_bytes_per_s": stream, "teraio": info, "torch": torch.__version__, "results": rows}
    if a.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"AdamW over {n} parameters ({28 * n / 1e9:.2f} GB of traffic a step), {a.threads} threads, "
          f"median of {a.steps} alternating steps; teraio {info['isa']}, torch {torch.__version__}")
    print(f"  {'optimizer':<22} {'step ms':>9} {'(min)':>9} {'GB/s':>8} {'time / teraio':>14} {'of stream':>10}")
    for r in rows:
        share = f"{r['of_stream']:>9.0%}" if "of_stream" in r else f"{'-':>9}"
        print(f"  {r['optimizer']:<22} {r['step_s_median'] * 1e3:>9.2f} {r['step_s_min'] * 1e3:>9.2f} "
              f"{r['bytes_per_s'] / 1e9:>8.1f} {r['time_vs_teraio']:>14.2f} {share}")


if __name__ == "__main__":
    main()
