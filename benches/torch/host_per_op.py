#!/usr/bin/env python3
"""The host's time per operator in teraio.torch's planned steps (issue 31, item 5).

Trains a small Llama-style model of Hugging Face transformers (built from a config, random
weights, eager attention) for a few steps plainly (`ideal`), then under a teraio Session at each
--budgets (GPU budget in bytes, a host tier beside it), each in this one process, and prints
per run one line: the median step, the executor's stall, the operators of a step and how many
of them needed no call into the executor (quiet), the bytes moved, and

    host us/op = (median step - ideal's median step - stall) / operators

the time the planned step spends beyond the computation and the waits for transfers, per
operator: the dispatch mode, the profile check and the executor's calls. On a GPU the kernels
run asynchronously and the figure is only the part the GPU did not hide.

  python benches/torch/host_per_op.py --device cpu --budgets 2.2e6,1.8e6 --steps 8
  OMP_NUM_THREADS=1 is advisable on the CPU (less noise). --json prints one JSON object per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (default 64; heads: hidden/16)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    ap.add_argument("--budgets", default="2.2e6,1.8e6",
                    help="comma-separated GPU budgets in bytes for teraio's runs (default 2.2e6,1.8e6: "
                         "a plan that moves, for the default model)")
    ap.add_argument("--host-mib", type=int, default=64, help="the host tier, MiB (default 64)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run (default 8)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first (default 4)")
    ap.add_argument("--json", action="store_true", help="one JSON object per run instead of a line")
    args = ap.parse_args()

    import torch
    import teraio.torch as tt
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        budgets = [int(float(b)) for b in args.budgets.split(",") if b]
    except ValueError:
        ap.error(f"--budgets: {args.budgets!r} is not a comma-separated list of byte counts (e.g. 2.2e6,1.8e6)")
    if not budgets or min(budgets) <= 0:
        ap.error(f"--budgets: {args.budgets!r}: give at least one budget > 0")
    dev = torch.device(args.device)
    heads = max(1, args.hidden // 16)

    def build():
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                          num_hidden_layers=args.layers, num_attention_heads=heads,
                          num_key_value_heads=max(1, heads // 2), max_position_embeddings=max(256, args.seq))
        cfg._attn_implementation = "eager"
        model = LlamaForCausalLM(cfg).to(dev)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    tokens = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(dev)

    def run(budget: int | None) -> dict:
        model, opt = build()
        folder = tempfile.mkdtemp(prefix="teraio-host-per-op-")
        session = None
        if budget is not None:
            engine = {"dir": folder, "files": 2, "file_size": 64 << 20, "alloc_unit": "4k", "stripe_unit": "64k",
                      "host_tier": args.host_mib << 20}
            session = tt.Session(model, opt, engine=engine, gpu_budget_bytes=budget,
                                 host_budget_bytes=args.host_mib << 20, page_min_bytes=0, log=lambda line: None)
        try:
            def step() -> None:
                with session.step() if session is not None else contextlib.nullcontext():
                    loss = model(input_ids=tokens, labels=tokens).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)

            for _ in range(args.warmup):
                step()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            out = {"budget_bytes": budget, "step_s": statistics.median(times)}
            if session is not None:
                recs = list(session.steps)[-args.steps:]
                out["modes"] = sorted({r["mode"] for r in recs})
                out["stall_s"] = statistics.median(r.get("stall_s", 0.0) for r in recs)
                out["ops"] = recs[-1].get("ops")
                ex = [r.get("executor") or {} for r in recs]
                out["quiet_ops"] = statistics.median(e.get("quiet_kernels", 0) for e in ex)
                out["bytes_moved"] = statistics.median(r.get("bytes_moved", 0) for r in recs)
            return out
        finally:
            if session is not None:
                session.close()
            shutil.rmtree(folder, ignore_errors=True)

    ideal = run(None)
    rows = [dict(ideal, method="ideal")]
    for b in budgets:
        r = dict(run(b), method="teraio")
        if r.get("ops"):
            r["host_us_per_op"] = (r["step_s"] - ideal["step_s"] - r["stall_s"]) / r["ops"] * 1e6
        rows.append(r)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        elif r["method"] == "ideal":
            print(f"ideal: {r['step_s'] * 1e3:.2f} ms a step")
        else:
            print(f"teraio at {r['budget_bytes']} bytes ({','.join(r['modes'])}): {r['step_s'] * 1e3:.2f} ms a step, "
                  f"stall {r['stall_s'] * 1e3:.2f} ms, {r['ops']} operators ({r['quiet_ops']:.0f} quiet), "
                  f"{r['bytes_moved'] / 1e6:.2f} MB moved, host {r.get('host_us_per_op', float('nan')):.1f} us/op")
    return 0


if __name__ == "__main__":
    sys.exit(main())
