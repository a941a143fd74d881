#!/usr/bin/env python3
"""Rewrite a teraio.torch trace whose optimizer step is PyTorch's one fused AdamW kernel over
every parameter (`opt._foreach_add_.Scalar` on the step counters, then `opt._fused_adamw_`) into
the per-parameter steps teraio.torch runs (`make_plannable`: a step-counter add and an AdamW
kernel per parameter, in the order of the parameters), and optionally scale every kernel's
duration so the trace's kernels add up to a measured step. Parameters, gradients and states are
matched by the profiler's names (`param:X`, `grad:X`, `state:X.step|exp_avg|exp_avg_sq`); the
two kernels' durations are split over the parameters by bytes (the add evenly).

    python3 scripts/trace-split-adamw.py IN.trace.json.gz OUT.trace.json [--step-s 0.0477]

An approximation of the trace of a planned run (its own trace, `train_gpt.py
--teraio-save-trace`, is the real thing), for the planner's bound and simulation."""
import argparse
import gzip
import json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--step-s", type=float, help="scale the kernels' durations to add up to this")
    a = ap.parse_args()
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        t = json.load(f)
    ks = t["kernels"]
    names = [k["name"] for k in ks]
    add = next((i for i, n in enumerate(names) if n == "opt._foreach_add_.Scalar"), None)
    if add is None or add + 1 >= len(ks) or names[add + 1] != "opt._fused_adamw_" or names.count("opt._fused_adamw_") != 1:
        raise SystemExit(f"{a.trace}: no single fused AdamW step (opt._foreach_add_.Scalar, opt._fused_adamw_) to split")
    fused = add + 1
    by_name = {x["name"]: x for x in t["tensors"]}
    params = [x["name"][len("param:"):] for x in t["tensors"]
              if x["name"].startswith("param:") and fused in x["accesses"]]
    if not params:
        raise SystemExit(f"{a.trace}: the fused step touches no `param:` tensor")
    p = len(params)
    # old kernel index -> new; the two optimizer kernels map per parameter below
    shift = 2 * p - 2

    def moved(i: int) -> int:
        return i if i < add else i + shift

    pbytes = [by_name[f"param:{x}"]["bytes"] for x in params]
    total = sum(pbytes)
    new_ks = ks[:add]
    for j, x in enumerate(params):
        new_ks.append({"name": f"opt._foreach_add_.Scalar#{x}", "duration_us": ks[add]["duration_us"] / p})
        new_ks.append({"name": f"opt._fused_adamw_#{x}", "duration_us": ks[fused]["duration_us"] * pbytes[j] / total})
    new_ks += ks[fused + 1:]
    owner = {}
    for j, x in enumerate(params):
        for n in (f"param:{x}", f"grad:{x}", f"state:{x}.exp_avg", f"state:{x}.exp_avg_sq"):
            owner[n] = (None, add + 2 * j + 1)
        owner[f"state:{x}.step"] = (add + 2 * j, add + 2 * j + 1)
    last = add + 2 * p - 1

    def remap(x: dict, i: int) -> list[int]:
        if i < add or i > fused:
            return [moved(i)]
        step_k, adam_k = owner.get(x["name"], (None, last))
        if i == add:
            return [step_k if step_k is not None else adam_k]
        return [adam_k]

    for x in t["tensors"]:
        x["accesses"] = sorted({j for i in x["accesses"] for j in remap(x, i)})
        x["writes"] = sorted({j for i in x.get("writes", []) for j in remap(x, i)})
        if x.get("created_by") is not None:
            x["created_by"] = min(remap(x, x["created_by"]))
        if x.get("dies_after") is not None:
            x["dies_after"] = max(remap(x, x["dies_after"]))
    t["kernels"] = new_ks
    if a.step_s:
        s = sum(k["duration_us"] for k in new_ks)
        for k in new_ks:
            k["duration_us"] *= a.step_s * 1e6 / s
    with open(a.out, "w") as f:
        json.dump(t, f)
    print(f"{a.out}: {len(ks)} -> {len(new_ks)} kernels ({p} parameters)")


if __name__ == "__main__":
    main()
