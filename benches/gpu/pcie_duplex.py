"""PCIe copies between pinned host memory and the GPU, one direction at a time and both at once,
and fp32 matmuls alone and beside copies: the figures a hardware model (`--hw`) needs for a
training step that offloads and prefetches while it computes.

    python3 benches/gpu/pcie_duplex.py [--mib 256] [--rounds 5] [--json OUT.json]

Prints GB/s per direction (median of rounds, CUDA events), the duplex figures, and how much
slower a 4096^3 fp32 matmul runs while copies run beside it. Needs a CUDA GPU and PyTorch.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def timed(fn, stream_list):
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    for s in stream_list:
        torch.cuda.current_stream().wait_stream(s)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per copy, MiB")
    ap.add_argument("--copies", type=int, default=24,
                    help="copies per direction per round (enough to outlast the matmuls)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    n = args.mib << 20
    dev = torch.device("cuda")
    host_src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_src = torch.empty(n, dtype=torch.uint8, device=dev)
    dev_dst = torch.empty(n, dtype=torch.uint8, device=dev)
    h2d_s, d2h_s = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=dev)
    b = torch.randn(4096, 4096, device=dev)

    def h2d():
        with torch.cuda.stream(h2d_s):
            for _ in range(args.copies):
                dev_dst.copy_(host_src, non_blocking=True)

    def d2h():
        with torch.cuda.stream(d2h_s):
            for _ in range(args.copies):
                host_dst.copy_(dev_src, non_blocking=True)

    def both():
        h2d()
        d2h()

    mm_n = 40

    def mm():
        for _ in range(mm_n):
            torch.mm(a, b)

    def mm_beside(copy):
        def run():
            copy()
            mm()
        return run

    bytes_moved = args.copies * n
    res: dict[str, list[float]] = {k: [] for k in ("h2d", "d2h", "duplex_s", "mm", "mm_h2d", "mm_duplex")}
    for _ in range(1 + args.rounds):  # the first round warms up, not counted
        r = {
            "h2d": timed(h2d, [h2d_s]),
            "d2h": timed(d2h, [d2h_s]),
            "duplex_s": timed(both, [h2d_s, d2h_s]),
            "mm": timed(mm, []),
            # the matmuls' own span on their stream, the copies queued first on theirs
            "mm_h2d": timed(mm_beside(h2d), []),
            "mm_duplex": timed(mm_beside(both), []),
        }
        for k, v in r.items():
            res[k].append(v)
    med = {k: statistics.median(v[1:]) for k, v in res.items()}
    out = {
        "copy_bytes": n,
        "h2d_GBps": bytes_moved / med["h2d"] / 1e9,
        "d2h_GBps": bytes_moved / med["d2h"] / 1e9,
        "duplex_each_way_GBps": bytes_moved / med["duplex_s"] / 1e9,
        "mm_s": med["mm"] / mm_n,
        "mm_slowdown": {"h2d": med["mm_h2d"] / med["mm"], "duplex": med["mm_duplex"] / med["mm"]},
    }
    print(f"copies of {args.mib} MiB x {args.copies}, median of {args.rounds} rounds:")
    print(f"  H2D alone {out['h2d_GBps']:.1f} GB/s, D2H alone {out['d2h_GBps']:.1f} GB/s, "
          f"both at once {out['duplex_each_way_GBps']:.1f} GB/s each way")
    print(f"  {mm_n} fp32 4096^3 matmuls: alone {med['mm']:.4f} s, beside H2D copies {med['mm_h2d']:.4f} s "
          f"({med['mm_h2d'] / med['mm']:.3f}x), beside copies both ways {med['mm_duplex']:.4f} s "
          f"({med['mm_duplex'] / med['mm']:.3f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
