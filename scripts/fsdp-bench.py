#!/usr/bin/env python3
"""FSDP2 (``fully_shard``) with world size 1 on a Llama-style model at a memory cap: plain FSDP2
vs FSDP2's own ``CPUOffloadPolicy`` vs a teraio Session (issue 35). Each mode runs in its own
process (one JSON line each on stdout): seconds per step (median of the steps after
``--warmup``), peak GPU memory, every step's loss.

The model is transformers' ``LlamaForCausalLM`` built from a config (no download): by default
the TinyLlama-1.1B shape (hidden 2048, 22 layers, 32 heads / 4 KV heads, SwiGLU 5632, vocabulary
32000: 1.1 B parameters); ``--tiny`` a small one that runs on the CPU in seconds (what CI runs).
Every decoder layer and the root are ``fully_shard``-ed; ``--bf16`` adds
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.

Modes (``--modes``, default all three):

- ``plain``: FSDP2 alone. On a GPU the cap is enforced for every mode
  (``torch.cuda.set_per_process_memory_fraction``): plain FSDP2 runs out of memory when the step
  does not fit, and its line says so (``"error"``).
- ``cpu-offload``: ``fully_shard(..., offload_policy=CPUOffloadPolicy())``: every shard and its
  gradient on the CPU, the optimizer step there, parameters copied to the GPU per layer.
- ``teraio``: ``teraio.torch.Session(gpu_budget_bytes=cap, host_budget_bytes=--host)`` on an
  engine in ``--engine-dir`` (default: a temporary folder): shards, gradients, Adam states and
  activations paged, then planned; FSDP's all-gathered parameters stay FSDP's. With
  ``--optimizer-on host`` (and ``--update-in-backward``) AdamW steps each shard on the host with
  teraio's kernels, as CPU offload does with PyTorch's: the measured one-GPU comparison
  (docs/BENCHMARKS.md, 2026-12-06, H200: 1.61x CPU offload's speed at 11.25 GiB) ran so.

On the GPU (the issue's target: teraio at least 1.5x faster than CPU offload at the same cap,
losses equal)::

    python scripts/fsdp-bench.py --cap 24G --host 64G --steps 12 --warmup 4 > fsdp.jsonl

With ``--nproc N`` each mode runs N ranks (one GPU each, each rank its own shard, micro-batches
and engine: ``--engine-dirs`` one folder per rank, e.g. each GPU's own NVMe array), rank 0's line
carrying every rank's figures (``ranks``) and the slowest rank's s/step: the N-GPU evaluation::

    python scripts/fsdp-bench.py --nproc 8 --cap 24G --host 64G \\
        --engine-dirs /mnt/nvme0/t,/mnt/nvme1/t,/mnt/nvme2/t,/mnt/nvme3/t,/mnt/nvme4/t,/mnt/nvme5/t,/mnt/nvme6/t,/mnt/nvme7/t

On the CPU (CI): ``python scripts/fsdp-bench.py --tiny`` (and ``--nproc 2``: two gloo ranks);
there the cap is teraio's budget only (plain FSDP2 on the CPU has none to enforce).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

MODES = ("plain", "cpu-offload", "teraio")


def parse_bytes(s: str) -> int:
    """``"24G"``, ``"512M"``, ``"3.5G"``, ``"1048576"`` -> bytes (binary units)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(s)


def config(tiny: bool, deterministic: bool = False):
    from transformers import LlamaConfig

    # --deterministic: eager attention (SDPA's flash and memory-efficient backward kernels have no
    # deterministic variant, only a warning under warn_only)
    attn = {"attn_implementation": "eager"} if deterministic else {}

    if tiny:
        return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                           tie_word_embeddings=False, **attn)
    # TinyLlama-1.1B's shape
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                       num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                       tie_word_embeddings=False, **attn)


def run_mode(args, rank: int = 0, world: int = 1) -> dict:
    """One mode, this process being rank ``rank`` of ``world`` (each rank its own GPU, engine
    folder and micro-batches)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import LlamaForCausalLM

    cuda = args.device.startswith("cuda")
    device = f"cuda:{rank}" if args.device == "cuda" else args.device  # set_device needs an index
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    if args.deterministic:
        # (cuBLAS reads its workspace setting when its first handle is made, after this line;
        # warn_only: an operator without a deterministic kernel warns in the log)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    if cuda:
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    out: dict = {"mode": args.mode, "device": device, "rank": rank, "world": world, "tiny": args.tiny,
                 "bf16": args.bf16, "optimizer_on": args.optimizer_on if args.mode == "teraio" else None,
                 "update_in_backward": args.update_in_backward and args.mode == "teraio",
                 "cap_bytes": args.cap, "cap_enforced": cuda, "batch": args.batch, "seq": args.seq,
                 "deterministic": args.deterministic}
    own_dir = None  # a temporary engine folder this process made, removed at its end
    try:
        if cuda:
            total = torch.cuda.get_device_properties(torch.device(device)).total_memory
            if args.cap > total:
                raise SystemExit(f"--cap {args.cap} is above the GPU's memory ({total} bytes)")
            torch.cuda.set_per_process_memory_fraction(args.cap / total)
        cfg = config(args.tiny, args.deterministic)
        # the same weights in every mode: made on the CPU from the seed; fully_shard moves the
        # model to the mesh's device (CPUOffloadPolicy then keeps the shards on the CPU)
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(cfg)
        mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
        kw = {"mesh": mesh}
        if args.bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.mode == "cpu-offload":
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=cuda)  # (pinning needs a GPU)
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
        session = None
        if args.mode == "teraio":
            import teraio.torch as tt

            if args.update_in_backward:
                # each shard's update on the host as soon as FSDP has reduced its gradient
                tt.offload_optimizer(opt, update_in_backward=True)

            # each rank its own engine: --engine-dir's rank{N} subfolder, or the rank's own
            # folder of --engine-dirs (one SSD array per rank)
            engine = {"files": 4, "file_size": args.file_size, "retain_on_prefetch": True}
            if args.engine_dirs:
                engine["dirs"] = args.engine_dirs.split(",")
            else:
                own_dir = None if args.engine_dir else tempfile.mkdtemp(prefix="teraio-fsdp-")
                engine["dir"] = args.engine_dir or own_dir
            if args.host:
                engine["host_tier"] = args.host
            if cuda:
                engine["gpu"] = {}  # (the rank's GPU)
            session = tt.Session(model, opt, engine=tt.rank_engine(engine), gpu_budget_bytes=args.cap,
                                 host_budget_bytes=args.host, log=lambda m: print(m, file=sys.stderr),
                                 optimizer_on=args.optimizer_on,
                                 # (the cap is the allocator's too: between steps only what fits
                                 # it stays resident)
                                 gather_between_steps="budget",
                                 **({"page_min_bytes": 0} if args.tiny else {}))
        g = torch.Generator().manual_seed(args.seed + 1 + 1000 * rank)  # (each rank its own data)
        batches = [torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g)
                   for _ in range(args.steps)]
        losses, times, modes, moved = [], [], [], []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for tokens in batches:
            tokens = tokens.to(device)
            t0 = time.perf_counter()
            ctx = session.step() if session is not None else _Null()
            with ctx:
                loss = model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            lv = loss.item()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(lv)
            if session is not None:
                modes.append(session.steps[-1]["mode"])
                moved.append(session.steps[-1]["bytes_moved"])
        timed = times[args.warmup:] or times
        out.update({"steps": args.steps, "warmup": args.warmup, "s_per_step": statistics.median(timed),
                    "step_s": [round(t, 6) for t in times], "losses": losses,
                    "params": sum(p.numel() for p in model.parameters())})
        if cuda:
            out["peak_bytes"] = torch.cuda.max_memory_allocated()
        if session is not None:
            rep = session.report()
            out.update({"step_modes": modes, "bytes_moved": moved, "fsdp": rep.get("fsdp"),
                        "planned_steps": modes.count("planned")})
            if cuda:
                # (closing brings every tensor back to the GPU: the cap was the steps')
                torch.cuda.set_per_process_memory_fraction(1.0)
            session.close()
    except torch.OutOfMemoryError as e:
        out["error"] = f"out of memory at the cap: {str(e).splitlines()[0]}"
        traceback.print_exc(file=sys.stderr)  # (where, in the mode's log)
    finally:
        dist.destroy_process_group()
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)
    return out


def _rank(rank: int, args, world: int, results) -> None:
    results[rank] = run_mode(args, rank, world)


def run_ranks(args) -> dict:
    """One mode over ``--nproc`` ranks (spawned): rank 0's line, with every rank's figures in
    ``ranks`` and the step time of the slowest rank."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_rank, args=(args, args.nproc, results), nprocs=args.nproc, join=True)
    ranks = [results[r] for r in range(args.nproc)]
    out = dict(ranks[0])
    out.pop("rank", None)
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        out["error"] = "; ".join(f"rank {r['rank']}: {r['error']}" for r in ranks if "error" in r)
    else:
        out["s_per_step"] = max(r["s_per_step"] for r in ranks)
    out["ranks"] = [{k: r.get(k) for k in ("rank", "device", "s_per_step", "losses", "peak_bytes",
                                           "planned_steps", "error") if k in r} for r in ranks]
    return out


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # (one mode, in this process)
    ap.add_argument("--tiny", action="store_true", help="a small model that runs on the CPU in seconds")
    ap.add_argument("--device", default=None, help="default: cuda when there is a GPU, else cpu")
    ap.add_argument("--cap", default=None, help="memory cap, e.g. 24G (default: 24G on a GPU, 2M with --tiny)")
    ap.add_argument("--host", default="0", help="teraio's host tier, e.g. 64G (default 0: SSD only)")
    ap.add_argument("--file-size", default=None, help="each of the engine's 4 files (default 16G, 64M with --tiny)")
    ap.add_argument("--engine-dir", default=None, help="teraio's engine folder (a rank{N} subfolder per rank)")
    ap.add_argument("--engine-dirs", default=None,
                    help="one engine folder per rank, comma-separated (each rank its own SSD array)")
    ap.add_argument("--nproc", type=int, default=1,
                    help="ranks (one GPU each; gloo ranks on the CPU), each its own shard, engine and data")
    ap.add_argument("--steps", type=int, default=None, help="default 12 (5 with --tiny)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of s_per_step (default 4, 2 with --tiny)")
    ap.add_argument("--batch", type=int, default=None, help="default 2")
    ap.add_argument("--seq", type=int, default=None, help="default 2048 (32 with --tiny)")
    ap.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(bf16 params, fp32 reduce)")
    ap.add_argument("--optimizer-on", choices=["gpu", "host", "auto"], default="gpu",
                    help="teraio mode: where AdamW steps over the rank's shards (Session(optimizer_on=...); "
                         "host: teraio's host kernels, states in host memory; default gpu)")
    ap.add_argument("--update-in-backward", action="store_true",
                    help="teraio mode with --optimizer-on host: each shard's update runs on the host as soon "
                         "as FSDP has reduced its gradient (offload_optimizer(update_in_backward=True))")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8 and eager "
                         "attention: for the bitwise comparison of plain FSDP2 and teraio on a GPU")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per mode (default 3600)")
    args = ap.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.cap = parse_bytes(args.cap or ("2M" if args.tiny else "24G"))
    args.host = parse_bytes(args.host)
    args.file_size = args.file_size or ("64M" if args.tiny else "16G")
    args.steps = args.steps or (5 if args.tiny else 12)
    args.warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 4)
    args.batch = args.batch or 2
    args.seq = args.seq or (32 if args.tiny else 2048)
    if args.update_in_backward and args.optimizer_on != "host":
        ap.error("--update-in-backward is for --optimizer-on host")
    if args.nproc < 1:
        ap.error(f"--nproc {args.nproc}: at least 1 rank")
    if args.engine_dirs and len(args.engine_dirs.split(",")) != args.nproc:
        ap.error(f"--engine-dirs names {len(args.engine_dirs.split(','))} folders for --nproc {args.nproc}: "
                 "one per rank")
    if args.port == 0:
        args.port = _free_port()
    if args.mode is not None:
        print(json.dumps(run_ranks(args) if args.nproc > 1 else run_mode(args)), flush=True)
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        ap.error(f"--modes: unknown {bad}; the modes are {', '.join(MODES)}")
    failed = 0
    for m in modes:
        # each mode its own process: its own allocator, cap and peak
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", m, "--port", str(_free_port())]
        for k in ("device", "engine_dir", "engine_dirs", "nproc", "file_size", "steps", "warmup", "batch", "seq",
                  "seed", "optimizer_on"):
            v = getattr(args, k)
            if v is not None:
                cmd += [f"--{k.replace('_', '-')}", str(v)]
        cmd += ["--cap", str(args.cap), "--host", str(args.host)]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--bf16"] if args.bf16 else []
        cmd += ["--update-in-backward"] if args.update_in_backward else []
        cmd += ["--deterministic"] if args.deterministic else []
        p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout)
        line = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
        if p.returncode != 0 or not line.startswith("{"):
            failed += 1
            line = json.dumps({"mode": m, "error": f"the mode's process exited with {p.returncode}"})
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
