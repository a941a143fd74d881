"""Fine-tuning with many sequence lengths under a teraio Session, against plain training.

A Llama-style model from Hugging Face transformers, built from a config (no download), trains
on batches whose sequence length is one of ``--lengths`` distinct values, in a random order, for
``--steps`` steps. ``--mode ideal`` trains plainly (no cap), ``--mode teraio`` under a Session
with a GPU budget and a host tier, ``--mode zero-offload`` (a peer) with DeepSpeed's ZeRO-Offload
(ZeRO-2, AdamW on the CPU: DeepSpeed's CPUAdam, bf16 weights with ``--dtype bf16``) under the same
cap (``torch.cuda.set_per_process_memory_fraction``); ``--checkpointing`` turns on the model's own
activation checkpointing in any mode. Prints a JSON line with every step's loss, time and mode, and
the totals a reader compares: the whole loop's time against ``steps x`` the mean planned step
(issue 30's target: within 1.3x), how many steps were profiled, and how each shape's plan was
obtained.

    python examples/finetune_lengths.py --mode ideal  --out ideal.json
    python examples/finetune_lengths.py --mode teraio --out teraio.json --cap-gib 5.5
    python examples/finetune_lengths.py --compare ideal.json teraio.json
    python examples/finetune_lengths.py --mode zero-offload --cap-gib 11.25 --checkpointing --out ds.json

On a CPU it runs a small model (``--small``) in seconds: what CI would run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if args.small:
        cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=False)
    elif args.size == "1b":
        # TinyLlama-1.1B's shape: 1.1 B parameters
        cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                          num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                          tie_word_embeddings=False)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                          tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    return model, opt, cfg


def lengths(args) -> list[int]:
    rng = random.Random(args.seed)
    lo, hi = args.min_len, args.max_len
    pool = sorted(rng.sample(range(lo // 8, hi // 8 + 1), args.lengths))
    return [8 * p for p in pool]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["ideal", "teraio", "zero-offload"], default="teraio",
                    help="ideal: plain training, no cap; teraio: under a Session at --cap-gib; zero-offload: "
                         "DeepSpeed ZeRO-2 with the optimizer on the CPU at --cap-gib (needs deepspeed)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lengths", type=int, default=16, help="distinct sequence lengths (default 16)")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--cap-gib", type=float, default=5.5, help="the GPU budget (teraio mode)")
    ap.add_argument("--host-gib", type=float, default=11.0, help="the host tier (teraio mode; 0: SSD only)")
    ap.add_argument("--engine-dir", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="a tiny model (CPU)")
    ap.add_argument("--size", choices=["200m", "1b"], default="200m",
                    help="the model: 200m (hidden 1024, 12 layers) or 1b (TinyLlama-1.1B's shape: hidden 2048, "
                         "22 layers, 32/4 heads)")
    ap.add_argument("--optimizer-on", choices=["gpu", "host", "auto"], default="gpu",
                    help="teraio mode: where AdamW steps (Session(optimizer_on=...); auto: the planner "
                         "chooses per parameter); ideal mode: host offloads the optimizer without a "
                         "Session (teraio.torch.offload_optimizer)")
    ap.add_argument("--update-in-backward", action="store_true",
                    help="with --optimizer-on host: each parameter's update runs on the host during backward "
                         "(offload_optimizer(update_in_backward=True))")
    ap.add_argument("--checkpointing", action="store_true",
                    help="the model's own activation checkpointing (gradient_checkpointing_enable), any mode")
    ap.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    ap.add_argument("--no-bounded", action="store_true",
                    help="a new shape's first step pages (Session(bounded_shapes=False)) instead of running "
                         "under a longer shape's plan while it is profiled")
    ap.add_argument("--no-recompute", action="store_true",
                    help="plans move tensors only (Session(recompute=False)), never recompute them")
    ap.add_argument("--hw", default=None,
                    help="the hardware model the plans use: a preset (paper, dev), a JSON file "
                         "(teraio hw measure -o), or this machine measured (default)")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    ap.add_argument("--gather", choices=["true", "budget", "false"], default="true",
                    help="teraio mode: Session(gather_between_steps=...): true (the default) brings every "
                         "parameter, gradient and optimizer state back after each step, past the budget "
                         "where they do not fit; budget: as far as the budget allows; false: they stay where "
                         "the plan has them (this loop touches none of them between steps)")
    ap.add_argument("--no-verify-recompute", action="store_true",
                    help="teraio mode: Session(verify_recompute=False): a plan's first step does not copy "
                         "the tensors it drops for a recomputation to the host to compare the recomputation "
                         "with (the default checks them bitwise, once per plan)")
    ap.add_argument("--session-records", default=None, metavar="FILE",
                    help="teraio mode: every step's whole Session record (session.steps: the executor's "
                         "and the store's figures, the plan, stalls), one JSON line a step")
    ap.add_argument("--compare", nargs=2, metavar=("IDEAL", "TERAIO"), help="compare two results")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)

    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.optimizer_on == "auto" and (args.mode != "teraio" or args.update_in_backward):
        ap.error("--optimizer-on auto is the Session's choice: it needs --mode teraio and no --update-in-backward")
    if args.mode == "zero-offload" and (args.optimizer_on != "gpu" or args.update_in_backward):
        ap.error("--mode zero-offload puts the optimizer on the CPU itself (DeepSpeed's CPUAdam): "
                 "leave out --optimizer-on and --update-in-backward")
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    model, opt, cfg = build(args)
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ds = None
    if args.mode == "zero-offload":
        ds = zero_offload(args, model)
    lens = lengths(args)
    rng = random.Random(args.seed + 1)
    order = [rng.choice(lens) for _ in range(args.steps)]
    g = torch.Generator().manual_seed(args.seed + 2)
    session = None
    if args.optimizer_on == "host" and args.update_in_backward:
        import teraio.torch as tt

        tt.offload_optimizer(opt, update_in_backward=True)
    if args.mode == "teraio":
        import teraio.torch as tt

        d = args.engine_dir or tempfile.mkdtemp(prefix="teraio-ft-")
        host = int(args.host_gib * 2**30)
        engine = {"dir": d, "files": 4, "file_size": "8G" if not args.small else "256M"}
        if host:
            engine["host_tier"] = host
        session = tt.Session(model, opt, engine=engine, gpu_budget_bytes=int(args.cap_gib * 2**30),
                             host_budget_bytes=host, report_every=0, bounded_shapes=not args.no_bounded,
                             recompute=not args.no_recompute, hardware=args.hw,
                             optimizer_on=args.optimizer_on, verify_recompute=not args.no_verify_recompute,
                             gather_between_steps={"true": True, "budget": "budget", "false": False}[args.gather])
    elif args.optimizer_on == "host":
        import teraio.torch as tt

        tt.offload_optimizer(opt)
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    steps = []
    cuda = args.device.startswith("cuda")
    # the peak of GPU memory over the run (each step's own: its record's peak_bytes)
    run_peak = torch.cuda.max_memory_allocated() if cuda else 0
    t_all = time.perf_counter()
    for i, n in enumerate(order):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, n), generator=g).to(args.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        ctx = session.step() if session is not None else _null()
        if ds is not None:
            loss = ds(input_ids=tokens, labels=tokens).loss
            ds.backward(loss)
            ds.step()
        else:
            with ctx:
                with autocast:
                    loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        lv = loss.item()
        if cuda:
            torch.cuda.synchronize()
        rec = {"step": i, "len": n, "loss": lv, "time_s": time.perf_counter() - t0}
        if cuda:
            # this step's peak (the run's stays torch's max_memory_allocated: see the end)
            rec["peak_bytes"] = torch.cuda.max_memory_allocated()
            run_peak = max(run_peak, rec["peak_bytes"])
        if session is not None:
            r = session.steps[-1]
            rec["mode"] = r["mode"]
            for k in ("plan", "decided_at", "diverged", "stall_s", "bounded_by", "recomputed",
                      "recomputations_checked", "unstable_recompute", "bytes_moved", "top_stalls"):
                if k in r:
                    rec[k] = r[k]
        steps.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
    total = time.perf_counter() - t_all
    out = {"mode": args.mode, "dtype": args.dtype, "size": "small" if args.small else args.size,
           "optimizer_on": args.optimizer_on, "update_in_backward": args.update_in_backward, "steps": steps, "total_s": total, "lengths": lens,
           "checkpointing": args.checkpointing, "gather": args.gather if args.mode == "teraio" else None,
           "cap_gib": args.cap_gib if args.mode != "ideal" else None, "device": args.device}
    if session is not None:
        planned = [s["time_s"] for s in steps if s.get("mode") == "planned"]
        out["planned_steps"] = len(planned)
        out["profiled_steps"] = sum(1 for s in steps if s.get("mode") != "planned")
        # of them, run under a longer shape's plan (the others paged)
        out["bounded_steps"] = sum(1 for s in steps if s.get("mode") == "bounded")
        out["profiled_s"] = sum(s["time_s"] for s in steps if s.get("mode") != "planned")
        out["mean_planned_s"] = statistics.mean(planned) if planned else None
        out["total_over_steps_x_mean_planned"] = total / (len(steps) * statistics.mean(planned)) if planned else None
        out["plans"] = len(session.plans)
        if args.session_records:
            with open(args.session_records, "w") as f:
                for r in session.steps:
                    f.write(json.dumps(r, default=str) + "\n")
        session.close()
    else:
        out["mean_step_s"] = statistics.mean(s["time_s"] for s in steps[3:]) if len(steps) > 3 else None
    if args.device.startswith("cuda"):
        out["max_memory_allocated"] = max(torch.cuda.max_memory_allocated(), run_peak)
    if len(steps) > 3:
        out["median_step_s"] = statistics.median(s["time_s"] for s in steps[3:])
    text = json.dumps(out)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps({k: v for k, v in out.items() if k != "steps"}))
    return 0


def zero_offload(args, model):
    """DeepSpeed ZeRO-2 with the optimizer on the CPU (ZeRO-Offload), one process, at the cap:
    AdamW with the same hyperparameters as :func:`build`'s, DeepSpeed's CPUAdam."""
    import os

    import deepspeed
    import torch

    if args.device.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "LOCAL_RANK": "0",
                 "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(verbose=False)
    cfg = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
           "bf16": {"enabled": args.dtype == "bf16"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "overlap_comm": True, "contiguous_gradients": True},
           "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def compare(a: str, b: str) -> int:
    ideal, ter = json.load(open(a)), json.load(open(b))
    la = [s["loss"] for s in ideal["steps"]]
    lb = [s["loss"] for s in ter["steps"]]
    diffs = [abs(x - y) for x, y in zip(la, lb)]
    print(json.dumps({"steps": len(la), "bitwise_equal_losses": la == lb, "max_abs_loss_diff": max(diffs),
                      "ideal_total_s": ideal["total_s"], "teraio_total_s": ter["total_s"],
                      "teraio_profiled_steps": ter.get("profiled_steps"),
                      "teraio_bounded_steps": ter.get("bounded_steps"),
                      "teraio_total_over_steps_x_mean_planned": ter.get("total_over_steps_x_mean_planned")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
