#!/usr/bin/env python3
"""Is teraio's host AdamW bitwise PyTorch's AdamW on the GPU? Element counts that differ.

One float32 parameter of --params elements (odd length) takes --steps AdamW steps with the same
gradients (a fresh random gradient each step, some zeros and tiny values among them) five ways:
teraio's host kernels (`teraio.adamw_step` on CPU tensors) and `torch.optim.AdamW` on CUDA with
foreach=False, foreach=True and fused=True, and on the CPU (foreach=False). The script prints, for
each PyTorch variant, how many elements of the parameter and of each state differ from teraio's
bit for bit, and the largest difference in ulps. PyTorch's CPU float32 `sqrt` is not correctly
rounded (teraio's is: docs/TORCH.md, "Host optimizer"); CUDA's is, so the CUDA rows tell whether
an update moved to the host changes a GPU run's numbers.

Usage: scripts/optim-parity.py [--params 1000003] [--steps 20] [--amsgrad] [--json]
"""
import argparse
import json

import torch

import teraio


def ulps(a, b):
    ia = a.contiguous().view(torch.int32).to(torch.int64)
    ib = b.contiguous().view(torch.int32).to(torch.int64)
    # order-preserving map of float bits onto integers
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1_000_003)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--amsgrad", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    n = a.params
    p0 = torch.randn(n, generator=gen)
    grads = []
    for _ in range(a.steps):
        g = torch.randn(n, generator=gen) * 1e-2
        mask = torch.rand(n, generator=gen)
        g[mask < 0.01] = 0.0
        g[(mask >= 0.01) & (mask < 0.02)] *= 1e-30
        grads.append(g)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad=a.amsgrad)

    # teraio's host kernels
    p = p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    vmax = torch.zeros(n) if a.amsgrad else None
    for s, g in enumerate(grads, 1):
        teraio.adamw_step(p, g, m, v, step=s, lr=hp["lr"], beta1=hp["betas"][0], beta2=hp["betas"][1],
                          eps=hp["eps"], weight_decay=hp["weight_decay"], amsgrad=a.amsgrad,
                          max_exp_avg_sq=vmax)
    ours = {"param": p, "exp_avg": m, "exp_avg_sq": v}

    variants = [("cpu", dict(foreach=False))]
    if torch.cuda.is_available():
        variants = [("cuda", dict(foreach=False)), ("cuda", dict(foreach=True)),
                    ("cuda", dict(fused=True))] + variants
    rows = []
    for device, kw in variants:
        q = torch.nn.Parameter(p0.clone().to(device))
        opt = torch.optim.AdamW([q], **hp, **kw)
        for g in grads:
            q.grad = g.to(device)
            opt.step()
        st = opt.state[q]
        theirs = {"param": q.detach(), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
        row = {"torch": f"{device} {','.join(f'{k}={v}' for k, v in kw.items())}"}
        for k in ours:
            t = theirs[k].cpu()
            row[f"{k}_differ"] = int((t.view(torch.int32) != ours[k].view(torch.int32)).sum())
            row[f"{k}_max_ulps"] = ulps(t, ours[k])
        rows.append(row)
    doc = {"params": n, "steps": a.steps, "amsgrad": a.amsgrad, "torch": torch.__version__,
           "teraio_isa": teraio.optimizer_info()["isa"], "rows": rows}
    if a.json:
        print(json.dumps(doc))
        return
    print(f"AdamW, {n} elements, {a.steps} steps, torch {torch.__version__}: elements differing from "
          f"teraio's host step (max ulps)")
    for r in rows:
        print(f"  {r['torch']:<28} param {r['param_differ']:>8} ({r['param_max_ulps']})  "
              f"exp_avg {r['exp_avg_differ']:>8} ({r['exp_avg_max_ulps']})  "
              f"exp_avg_sq {r['exp_avg_sq_differ']:>8} ({r['exp_avg_sq_max_ulps']})")


if __name__ == "__main__":
    main()
