#!/usr/bin/env python3
"""What a trace's plans can recompute, layer by layer, against what activation checkpointing does
(issue 31, item 2: segment recomputation).

Checkpointing keeps a layer's input and remakes everything else the layer's backward reads. A
teraio plan remakes a tensor only from inputs alive at the remake (``Producer`` in the trace), so
an activation whose producer read a tensor that died during forward cannot be remade. For every
forward layer (kernels with ``layer``) this prints the bytes its backward reads, the bytes a plan
may remake, and each activation it may not with the reason. Options write variants of the trace
to study with ``teraio simulate`` / ``teraio plan``:

  --scale-to S   kernel durations scaled so that they add up to S seconds (a profiled step's
                 durations include the profiler's own host time; S: a measured plain step)
  --revive       the lifetimes of those dead inputs extended to the first backward use of the
                 activation they make (recursively, inputs made in the same layer's forward):
                 the plan space a revived input would open
  --out OUT      write the trace (scaled, revived) to OUT

  python3 scripts/segment-report.py TRACE.json[.gz] [--scale-to 0.271] [--revive] [--out OUT.json]

Checkpointing whole layers instead (their forward run again in backward) is `teraio simulate
TRACE --checkpoint-layers LAYERS|auto`.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys


def load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--scale-to", type=float, default=None, metavar="S")
    ap.add_argument("--revive", action="store_true")
    ap.add_argument("--out", default=None, metavar="OUT")
    ap.add_argument("--layer", type=int, default=0, help="the layer whose blocked activations are listed (default 0)")
    args = ap.parse_args()
    t = load(args.trace)
    kernels, tensors = t["kernels"], t["tensors"]
    n = len(kernels)
    total = sum(k["duration_us"] for k in kernels) / 1e6
    print(f"{n} kernels, durations add up to {total:.4f} s")
    if args.scale_to is not None:
        if args.scale_to <= 0:
            ap.error(f"--scale-to: {args.scale_to} must be > 0 seconds")
        f = args.scale_to / total
        for k in kernels:
            k["duration_us"] *= f
        for x in tensors:  # (the producers' own durations, where given, scale alike)
            p = x.get("producer")
            if p and p.get("duration_us") is not None:
                p["duration_us"] *= f
        print(f"scaled by {f:.4f} to {args.scale_to} s")
    layer = [k.get("layer") for k in kernels]
    bwd = [k["name"].startswith("bwd.") for k in kernels]
    fwd = [k["name"].startswith("fwd.") for k in kernels]

    def alive_at(x: dict, b: int) -> bool:
        if x["global"]:
            return True
        d = x.get("dies_after")
        return (x.get("created_by") or 0) <= b <= (n - 1 if d is None else d)

    def recomputable(x: dict) -> bool:
        c = x.get("created_by")
        return c is not None and not x["global"] and x.get("producer") is not None and x.get("writes") == [c]

    def first_bwd(x: dict) -> int | None:
        return next((a for a in x["accesses"] if bwd[a]), None)

    saved = collections.Counter()
    remade = collections.Counter()
    blocked: list[tuple[dict, str]] = []
    for x in tensors:
        c = x.get("created_by")
        b = first_bwd(x)
        if c is None or x["global"] or layer[c] is None or b is None:
            continue
        L = layer[c]
        saved[L] += x["bytes"]
        why = None
        if any(fwd[a] and layer[a] != L for a in x["accesses"]):
            why = "read by another layer's forward (a checkpoint: kept)"
        elif not recomputable(x):
            why = "no producer in the trace, or written after its creation"
        else:
            dead = [y for y in x["producer"]["inputs"] if not alive_at(tensors[y], b)]
            if dead:
                y = tensors[dead[0]]
                why = (f"input {y['name']} dies after kernel {y.get('dies_after')}, before the remake at {b}")
        if why is None:
            remade[L] += x["bytes"]
        elif L == args.layer:
            blocked.append((x, why))
    mib = 1 << 20
    for L in sorted(saved):
        print(f"layer {L}: backward reads {saved[L] / mib:.1f} MiB of its forward's activations; "
              f"a plan may remake {remade[L] / mib:.1f} MiB")
    print(f"all layers: {sum(saved.values()) / 2**30:.3f} GiB read in backward, "
          f"{sum(remade.values()) / 2**30:.3f} GiB remakeable")
    print(f"layer {args.layer}, not remakeable:")
    for x, why in blocked:
        print(f"  {x['name']} ({x['bytes'] / mib:.1f} MiB): {why}")

    if args.revive:
        revived: dict[int, int] = {}

        def revive(y: int, b: int, depth: int = 0) -> bool:
            x = tensors[y]
            if alive_at(x, b) or y in revived and revived[y] >= b:
                return True
            c = x.get("created_by")
            if not recomputable(x) or layer[c] is None or depth > 64:
                return False
            if not all(revive(z, b, depth + 1) for z in x["producer"]["inputs"]):
                return False
            revived[y] = max(revived.get(y, 0), b)
            return True

        unblocked = 0
        for x in tensors:
            c = x.get("created_by")
            b = first_bwd(x)
            if c is None or x["global"] or layer[c] is None or b is None or not recomputable(x):
                continue
            if all(alive_at(tensors[y], b) for y in x["producer"]["inputs"]):
                continue
            before = dict(revived)
            if all(revive(y, b) for y in x["producer"]["inputs"]):
                unblocked += 1
            else:
                revived.clear()
                revived.update(before)
        for y, b in revived.items():
            x = tensors[y]
            x["dies_after"] = max(x["dies_after"], b)
            if b not in x["accesses"]:
                x["accesses"] = sorted(x["accesses"] + [b])
        print(f"revived {len(revived)} inputs ({sum(tensors[y]['bytes'] for y in revived) / 2**30:.3f} GiB) "
              f"for {unblocked} activations")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(t, f)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
