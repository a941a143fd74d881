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
  --checkpoint-layers LAYERS
                 the trace as activation checkpointing would make it for those layers ("all",
                 or a list such as 0-5,8): each one's activations that its backward reads die at
                 their last forward use, and a copy of the layer's forward kernels (named
                 `bwd.ckpt:NAME`, same durations) runs again right before the first backward
                 kernel that reads one, making them anew: what a plan that combines
                 checkpointing some layers with moving the rest could reach (`teraio simulate`)
  --out OUT      write the trace (scaled, revived, checkpointed) to OUT

  python3 scripts/segment-report.py TRACE.json[.gz] [--scale-to 0.271] [--revive]
      [--checkpoint-layers 0-5] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
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
    ap.add_argument("--checkpoint-layers", default=None, metavar="LAYERS")
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
    if args.checkpoint_layers:
        known = sorted({L for L in layer if L is not None})
        try:
            chosen = parse_layers(args.checkpoint_layers, known)
        except ValueError as e:
            ap.error(f"--checkpoint-layers: {e}")
        if args.revive:
            ap.error("--checkpoint-layers: give it without --revive (a checkpointed layer remakes "
                     "its dead inputs itself)")
        t = checkpoint_layers(t, chosen)
        extra = sum(k["duration_us"] for k in t["kernels"]) / 1e6 - sum(k["duration_us"] for k in kernels) / 1e6
        print(f"checkpointed {len(chosen)} layers: {len(t['kernels']) - n} kernels run again "
              f"({extra:.4f} s), {len(t['tensors']) - len(tensors)} tensors made again")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(t, f)
        print(f"wrote {args.out}")
    return 0


def parse_layers(spec: str, known: list[int]) -> list[int]:
    """``all`` or ``0-5,8`` -> the sorted layers, each one the trace has."""
    if spec == "all":
        return list(known)
    out: set[int] = set()
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise ValueError(f"{part!r} is not a layer or a range such as 0-5 (or give all)")
        lo, hi = int(m[1]), int(m[2] or m[1])
        out.update(range(lo, hi + 1))
    missing = sorted(out - set(known))
    if missing:
        raise ValueError(f"layers {missing} are not in the trace (it has {known[0]}-{known[-1]})")
    return sorted(out)


def checkpoint_layers(t: dict, chosen: list[int]) -> dict:
    """The trace as checkpointing ``chosen`` layers makes it (see --checkpoint-layers)."""
    kernels, tensors = t["kernels"], t["tensors"]
    n = len(kernels)
    end = next(i for i, k in enumerate(kernels) if k["name"].startswith("bwd.")) - 1  # forward's last
    span: dict[int, tuple[int, int]] = {}
    for i, k in enumerate(kernels):
        L = k.get("layer")
        if L in chosen:
            a, b = span.get(L, (i, i))
            span[L] = (min(a, i), max(b, i))
    made = {L: [x for x in tensors if not x["global"] and x.get("created_by") is not None
                and a <= x["created_by"] <= b] for L, (a, b) in span.items()}

    def kept(x: dict, b: int) -> bool:  # read by the forward after its layer: the next one's input
        return any(b < a <= end for a in x["accesses"])

    # each layer's forward runs again before the first backward kernel that reads what it saved
    at: dict[int, list[int]] = collections.defaultdict(list)
    for L, (a, b) in sorted(span.items()):
        reads = [acc for x in made[L] if not kept(x, b) for acc in x["accesses"] if acc > end]
        if reads:
            at[min(reads)].append(L)
    new_of = [0] * n
    copy_of: dict[int, dict[int, int]] = {}
    out_kernels = []
    for j in range(n):
        for L in at.get(j, []):
            a, b = span[L]
            copy_of[L] = {}
            for i in range(a, b + 1):
                copy_of[L][i] = len(out_kernels)
                out_kernels.append(dict(kernels[i], name="bwd.ckpt:" + kernels[i]["name"], layer=None))
        new_of[j] = len(out_kernels)
        out_kernels.append(kernels[j])
    out_tensors = []
    for x in tensors:
        x = dict(x, accesses=[new_of[a] for a in x["accesses"]])
        if x.get("created_by") is not None:
            x["created_by"] = new_of[x["created_by"]]
        if x.get("dies_after") is not None:
            x["dies_after"] = new_of[x["dies_after"]]
        if x.get("writes") is not None:
            x["writes"] = [new_of[w] for w in x["writes"]]
        out_tensors.append(x)
    for L, copies in copy_of.items():
        a, b = span[L]
        ours = {x["id"] for x in made[L]}
        for x in tensors:
            inside = [acc for acc in x["accesses"] if a <= acc <= b]
            if not inside:
                continue
            y = out_tensors[x["id"]]
            if x["id"] not in ours:
                # read (or written) by the layer, made before it: read again by the copies
                y["accesses"] = sorted(set(y["accesses"]) | {copies[acc] for acc in inside})
                if y.get("dies_after") is not None:
                    y["dies_after"] = max(y["dies_after"], max(copies[acc] for acc in inside))
                if y.get("writes") is not None:
                    y["writes"] = sorted(set(y["writes"]) | {copies[w] for w in x["writes"] if a <= w <= b})
                continue
            # made by the layer: a new tensor made by the copies; what backward reads moves to it
            later = [] if kept(x, b) else [acc for acc in x["accesses"] if acc > end]
            z = dict(x, id=len(out_tensors), name="ckpt:" + x["name"], producer=None,
                     created_by=copies[x["created_by"]],
                     accesses=[copies[acc] for acc in inside] + [new_of[acc] for acc in later])
            z["dies_after"] = z["accesses"][-1]
            if x.get("writes") is not None:
                z["writes"] = [copies[w] for w in x["writes"] if a <= w <= b] + \
                              [new_of[w] for w in x["writes"] if w > end and not kept(x, b)]
            out_tensors.append(z)
            if later:
                y["accesses"] = [new_of[acc] for acc in x["accesses"] if acc <= end]
                y["dies_after"] = y["accesses"][-1]
                if y.get("writes") is not None:
                    y["writes"] = [new_of[w] for w in x["writes"] if w <= end]
    return dict(t, kernels=out_kernels, tensors=out_tensors)


if __name__ == "__main__":
    sys.exit(main())
