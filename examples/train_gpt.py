"""Train a GPT-style model for a few steps in several modes, under one GPU memory cap, and compare.

The model is built from a config in plain PyTorch (no downloads): token and position embeddings,
pre-LayerNorm blocks (causal scaled-dot-product attention, GELU MLP), a final LayerNorm and an
untied head; AdamW. Every mode trains the same model from the same seed on the same random
tokens, so their losses can be compared exactly:

  ideal            no memory cap (the upper bound)
  ideal-repeat     ideal again in a fresh process (are ideal's own losses reproducible?)
  plain            plain PyTorch under the cap (expected: out of memory, showing the cap binds)
  teraio-ssd       teraio.torch under the cap, offloading to the SSD array only
  teraio-host      teraio.torch under the cap, SSD array plus a host-memory tier (--host-gib)
  teraio-noop      teraio.torch with no cap and a plan that moves nothing (teraio.torch's own overhead)
  dispatch-noop    a bare Python dispatch mode around the step (the floor of any such wrapper)
  save_on_cpu      torch.autograd.graph.save_on_cpu(pin_memory=True) under the cap
  checkpointing    torch.utils.checkpoint around every block under the cap
  zero-infinity    DeepSpeed ZeRO-3, parameters and optimizer states on NVMe, every block
                   checkpointed (as DeepSpeed trains models that do not fit), under the cap

One mode per process (`--mode`), or a driver (`--modes a,b,c`) that runs each in a fresh
process, collects their JSON results and writes a table, the loss curves and memory over time as
CSV, and PNG plots when matplotlib is there. Out of memory is a result (`"outcome": "oom"`).

Several ranks: `--nproc-per-node N` makes the driver start each mode under `torchrun` (N ranks
on this host), or run one mode under torchrun yourself. Each rank trains its own data (seeded by
its rank) on its own GPU (`LOCAL_RANK`, NCCL; gloo on `--device cpu`, and where ranks outnumber
GPUs and share them, a check of the path, not a timing) with the model wrapped in
DistributedDataParallel (DeepSpeed distributes zero-infinity itself), under the same cap per
rank; teraio modes open one engine per rank (`teraio.torch.rank_engine`: `--ssd-dir`/rankN).
Rank 0 writes the result: its own figures, every rank's (`ranks`) and the total tokens/s.

  python3 examples/train_gpt.py --modes ideal,plain,teraio-ssd,save_on_cpu,checkpointing \
      --layers 12 --hidden 1024 --heads 16 --seq 1024 --batch 8 --steps 6 --cap-gib 8 \
      --ssd-dir /var/tmp/teraio --out results/

On a machine without CUDA `--device cpu` runs the same code (no cap, no GPU timings): the CI
smoke test of this script.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

MODES = ["ideal", "ideal-repeat", "plain", "teraio-ssd", "teraio-host", "teraio-noop", "dispatch-noop",
         "save_on_cpu", "checkpointing", "zero-infinity"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, help="run one mode in this process")
    ap.add_argument("--modes", help="comma-separated modes, each in a fresh process (the driver)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="fp32 (TF32 off: the paper's setting) or bf16 autocast")
    ap.add_argument("--steps", type=int, default=6, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed steps first (teraio: the profiled ones among them)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True): without it a GPU run's losses "
                         "vary between processes in the last bits (measured: ideal vs ideal)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cap-gib", type=float, default=0.0,
                    help="GPU memory cap for every mode but ideal, teraio-noop and dispatch-noop "
                         "(set_per_process_memory_fraction); 0: none")
    ap.add_argument("--ssd-dir", default="/var/tmp/teraio-train", help="teraio's and DeepSpeed's files")
    ap.add_argument("--ssd-files", type=int, default=1)
    ap.add_argument("--ssd-file-gib", type=float, default=48.0)
    ap.add_argument("--ssd-alloc-kib", type=int, default=0,
                    help="teraio: the engine's allocation unit (0: its default, 1 MiB)")
    ap.add_argument("--page-min-kib", type=int, default=64,
                    help="teraio: storages the pager leaves in place when smaller")
    ap.add_argument("--host-gib", type=float, default=0.0, help="teraio-host: host tier cap")
    ap.add_argument("--teraio-policy", default="auto", help="teraio: the planner (auto: the best of the teraio variants)")
    ap.add_argument("--page-fraction", type=float, default=0.85,
                    help="teraio: the share of the cap that paging and plans use on a GPU (the rest: workspaces, allocator slack)")
    ap.add_argument("--teraio-no-gather", action="store_true",
                    help="teraio: keep the plan's steady state between steps (no gather of parameters and optimizer states)")
    ap.add_argument("--profile-host", action="store_true",
                    help="run the second timed step under cProfile and write the host's top functions "
                         "to OUT/host-profile-MODE.txt (where the host's time goes per step)")
    ap.add_argument("--teraio-plan-margin", type=float, default=0.0,
                    help="plans are made for this fraction less GPU memory than the executor runs with "
                         "(slack for the host running ahead of the GPU; Session(plan_margin=))")
    ap.add_argument("--teraio-ahead", type=int, default=0,
                    help="teraio: the host runs at most this many operators ahead of the GPU (0: no limit)")
    ap.add_argument("--teraio-no-recompute", action="store_true",
                    help="teraio: plans only move tensors (no activation is dropped and recomputed)")
    ap.add_argument("--teraio-save-trace", metavar="PREFIX",
                    help="teraio: write each planned iteration's trace and plan to PREFIX.N.trace.json.gz / .plan.json")
    ap.add_argument("--teraio-host-waits", action="store_true",
                    help="teraio: offloads to the host tier are copied by the engine's workers and the host "
                         "waits for them before their memory is reused (the engine before 2026-12-02; "
                         "default: queued on the GPU, the trainer's stream waits where the memory is needed)")
    ap.add_argument("--teraio-time-gpu", action="store_true",
                    help="teraio: CUDA events around every operator of planned steps (where the GPU waited)")
    ap.add_argument("--teraio-workers", type=int, default=0,
                    help="teraio: the engine's transfer worker threads (0: the engine's default)")
    ap.add_argument("--profile-steps", type=int, default=1,
                    help="teraio: steps profiled before the plan is made; with more than one each operator "
                         "takes its median time over them (the plans of processes vary less)")
    ap.add_argument("--cuda-alloc-conf", metavar="CONF",
                    help="PyTorch's caching allocator settings for every mode (PYTORCH_CUDA_ALLOC_CONF, e.g. "
                         "expandable_segments:True,garbage_collection_threshold:0.8; scripts/torch-gpu-eval.sh "
                         "runs with expandable_segments:True): the allocator's out-of-memory retries, each a "
                         "device synchronization, depend on them")
    ap.add_argument("--hw", help="teraio: hardware model JSON for the planner (default: this machine's, measured "
                    "through the engine on the first plan and cached: `teraio hw measure`)")
    ap.add_argument("--chunk-mib", type=float, default=None,
                    help="teraio: optimizer step chunk in MiB of parameters (0: one parameter at a "
                         "time; default: teraio.torch's, a 32nd of the GPU budget)")
    ap.add_argument("--nproc-per-node", type=int, default=1,
                    help="driver: run each mode under torchrun with this many ranks (DDP, one GPU each)")
    ap.add_argument("--mode-timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default="train_gpt_results", help="driver: output folder")
    ap.add_argument("--result", help="one mode: write the JSON result here (else stdout)")
    ap.add_argument("--profile-dir",
                    help="ideal mode: after the timed steps, time steps under a no-op dispatch mode "
                         "and under teraio's profiler, record one step's trace into this folder and "
                         "compare its peak with torch.cuda.max_memory_allocated")
    return ap.parse_args(argv)


# ---- the model ---------------------------------------------------------------------------

def build(args, torch):
    import torch.nn.functional as F

    class Block(torch.nn.Module):
        def __init__(self, d, heads):
            super().__init__()
            self.heads = heads
            self.ln1 = torch.nn.LayerNorm(d)
            self.qkv = torch.nn.Linear(d, 3 * d)
            self.proj = torch.nn.Linear(d, d)
            self.ln2 = torch.nn.LayerNorm(d)
            self.fc = torch.nn.Linear(d, 4 * d)
            self.out = torch.nn.Linear(4 * d, d)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(args.vocab, args.hidden)
            self.pos = torch.nn.Embedding(args.seq, args.hidden)
            self.blocks = torch.nn.ModuleList(Block(args.hidden, args.heads) for _ in range(args.layers))
            self.ln = torch.nn.LayerNorm(args.hidden)
            self.head = torch.nn.Linear(args.hidden, args.vocab, bias=False)
            self.checkpointing = False

        def forward(self, tokens):
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.tok(tokens) + self.pos(pos)
            for blk in self.blocks:
                if self.checkpointing:
                    x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
                else:
                    x = blk(x)
            logits = self.head(self.ln(x))
            return F.cross_entropy(logits[:, :-1].reshape(-1, args.vocab).float(),
                                   tokens[:, 1:].reshape(-1))

    torch.manual_seed(args.seed)
    return GPT()


def batches(args, torch, n, rank=0):
    g = torch.Generator().manual_seed(args.seed + 1 + 1000 * rank)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(n)]


# ---- one mode ----------------------------------------------------------------------------

class MemorySampler:
    """torch.cuda.memory_allocated() every `period_s` in a thread (host-side counter, no sync)."""

    def __init__(self, torch, period_s=0.002):
        self.torch, self.period_s = torch, period_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def __enter__(self):
        t0 = time.perf_counter()

        def loop():
            while not self._stop.is_set():
                self.samples.append((time.perf_counter() - t0, self.torch.cuda.memory_allocated()))
                time.sleep(self.period_s)

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._t:
            self._t.join()


def disk_bytes(path):
    """(read, written) bytes so far of the disk holding `path`, from /proc/diskstats."""
    try:
        dev = os.stat(path).st_dev
        name = None
        with open("/proc/partitions") as f:
            for line in f.read().split("\n")[2:]:
                p = line.split()
                if len(p) == 4 and os.makedev(int(p[0]), int(p[1])) == dev:
                    name = p[3]
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if p[2] == name:
                    return int(p[5]) * 512, int(p[9]) * 512
    except OSError:
        pass
    return 0, 0


def dist_setup(args, torch):
    """Under torchrun (WORLD_SIZE > 1): the process group (NCCL on a GPU, gloo on the CPU, a
    mode's timeout for collectives, so a rank that failed does not hang the others forever) and
    this rank's device; (rank, world size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dev = torch.device(args.device)
    if world <= 1:
        return 0, 1, dev
    import datetime

    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "gloo"
    if dev.type == "cuda":
        # one GPU per rank with NCCL; with fewer GPUs than ranks they share them and gloo
        # carries the all-reduce (through the host: a check of the code path, not a timing)
        n = torch.cuda.device_count()
        backend = "nccl" if n >= int(os.environ.get("LOCAL_WORLD_SIZE", world)) else "gloo"
        dev = torch.device("cuda", local % n)
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.mode_timeout_s))
    return dist.get_rank(), world, dev


def run_mode(args):
    import torch

    mode = args.mode
    rank, world, dev = dist_setup(args, torch)
    cuda = dev.type == "cuda"
    if cuda and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    res = {"mode": mode, "config": {k: v for k, v in vars(args).items() if k not in ("modes",)}}
    if world > 1:
        import torch.distributed as dist

        res.update(rank=rank, world_size=world, dist_backend=dist.get_backend(), device=str(dev))
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        total = torch.cuda.get_device_properties(dev).total_memory
        capped = mode not in ("ideal", "ideal-repeat", "teraio-noop", "dispatch-noop") and args.cap_gib > 0
        if capped:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), dev)
        res["gpu"] = torch.cuda.get_device_name(dev)
        res["cap_bytes"] = int(args.cap_gib * 2**30) if capped else None
    res["torch"] = torch.__version__
    model = build(args, torch)
    res["params"] = sum(p.numel() for p in model.parameters())
    # on a GPU one more step after the timed ones samples the memory curve (a sampling thread
    # would take the GIL from a timed step)
    data = batches(args, torch, args.warmup + args.steps + (1 if cuda else 0), rank)
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16) if args.dtype == "bf16"
                else contextlib.nullcontext())
    losses, step_s = [], []
    sampler = None
    extra = {}
    disk0 = disk1 = None

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    try:
        if mode == "zero-infinity":
            step, finish = setup_zero(args, torch, model, autocast)
        else:
            model.to(dev)
            if world > 1:
                model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if cuda else None)
            fused = {"fused": True} if cuda else {"foreach": True}
            opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, **fused)
            step, finish = setup_torch(args, torch, mode, model, opt, autocast, dev, extra)
        for i, tokens in enumerate(data):
            tokens = tokens.to(dev)
            timed = args.warmup <= i < args.warmup + args.steps
            if timed and disk0 is None:
                disk0 = disk_bytes(args.ssd_dir if os.path.exists(args.ssd_dir) else "/")
                if cuda:
                    torch.cuda.reset_peak_memory_stats(dev)
            last = i == args.warmup + args.steps
            if last and cuda:
                sampler = MemorySampler(torch).__enter__()
            prof = None
            if args.profile_host and i == args.warmup + 1:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t0 = sync()
            loss = step(tokens)
            t1 = sync()
            if prof is not None:
                prof.disable()
                import io
                import pstats
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(os.environ.get("TERAIO_PROFILE_SORT", "tottime")).print_stats(30)
                with open(os.path.join(os.path.dirname(os.path.abspath(args.result)) if args.result else args.out,
                                       f"host-profile-{mode}.txt"), "w") as f:
                    f.write(buf.getvalue())
            if sampler is not None:
                sampler.__exit__()
            losses.append(loss)
            if timed:
                step_s.append(t1 - t0)
                if len(step_s) == args.steps and disk0 is not None:
                    disk1 = disk_bytes(args.ssd_dir if os.path.exists(args.ssd_dir) else "/")
            print(f"[{mode}] step {i} loss {loss:.6f} {t1 - t0:.3f} s", file=sys.stderr, flush=True)
        res.update(finish() or {})
        if args.profile_dir and mode == "ideal":
            res["profile"] = profile_check(args, torch, model, opt, autocast, dev, data[-1].to(dev))
        res["outcome"] = "ok"
    except torch.cuda.OutOfMemoryError as e:
        res["outcome"] = "oom"
        res["error"] = str(e).split("\n")[0][:300]
    except Exception as e:  # a result too: the table says which mode failed and why
        res["outcome"] = "error"
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-4000:]
    res.update(extra)
    res["losses"] = losses
    res["step_s"] = step_s
    if step_s:
        med = statistics.median(step_s)
        res["median_step_s"] = med
        res["tokens_per_s"] = args.batch * args.seq / med
    if cuda:
        res["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        res["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    if disk0 is not None and disk1 is not None:
        d1 = disk1
        n = max(1, len(step_s))
        res["disk_read_bytes_per_step"] = (d1[0] - disk0[0]) / n
        res["disk_write_bytes_per_step"] = (d1[1] - disk0[1]) / n
    if sampler is not None:
        res["memory_samples"] = sampler.samples[::max(1, len(sampler.samples) // 2000)]
    if world > 1:
        gather_ranks(torch, res)
    return res


def gather_ranks(torch, res):
    """Every rank's figures into ``res["ranks"]`` (on every rank), the total tokens/s when all
    ranks ran; then the process group ends."""
    import torch.distributed as dist

    keys = ("rank", "outcome", "error", "median_step_s", "tokens_per_s", "peak_allocated_bytes",
            "peak_reserved_bytes", "losses", "teraio_dir")
    mine = {k: res.get(k) for k in keys}
    tio = res.get("teraio") or {}
    mine["bytes_moved_per_step"] = tio.get("bytes_moved_per_step")
    mine["stall_s_per_step"] = tio.get("stall_s_per_step")
    ranks = [None] * res["world_size"]
    try:
        dist.all_gather_object(ranks, mine)
        res["ranks"] = ranks
        if all(r and r.get("tokens_per_s") for r in ranks):
            res["tokens_per_s_total"] = sum(r["tokens_per_s"] for r in ranks)
    except Exception as e:  # a rank gone: its figures are missing, this rank's stand
        res["ranks_error"] = f"{type(e).__name__}: {e}"[:500]
    finally:
        dist.destroy_process_group()


def profile_check(args, torch, model, opt, autocast, dev, tokens):
    """The profiler's cost and accuracy on this model (ideal mode only). Losses of these extra
    steps are not reported (the timed steps are done)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from teraio.torch import Profiler, peak_bytes

    class Noop(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, a=(), kw=None):
            return func(*a, **(kw or {}))

    cuda = dev.type == "cuda"

    def one(ctx):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with ctx:
            with autocast:
                loss = model(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()
        if cuda:
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    out = {"plain_s": [one(contextlib.nullcontext()) for _ in range(3)],
           "noop_mode_s": [one(Noop()) for _ in range(3)]}
    prof = Profiler(model, opt, name=f"gpt-{args.layers}l-{args.hidden}h-b{args.batch}x{args.seq}-{args.dtype}")
    rec = []
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        rec.append(one(prof.record()))
        if cuda:
            out.setdefault("max_memory_allocated", []).append(torch.cuda.max_memory_allocated(dev))
            out.setdefault("allocated_before", []).append(base)
    out["profiled_s"] = rec
    tr = prof.trace()
    out["trace_peak_bytes"] = peak_bytes(tr)
    out["kernels"] = len(tr["kernels"])
    out["tensors"] = len(tr["tensors"])
    out["trace_kernel_time_s"] = sum(k["duration_us"] for k in tr["kernels"]) / 1e6
    out["profiled_gpu_span_s"] = prof.gpu_span_s
    if cuda:
        out["peak_ratio"] = out["trace_peak_bytes"] / out["max_memory_allocated"][-1]
    os.makedirs(args.profile_dir, exist_ok=True)
    path = os.path.join(args.profile_dir, tr["name"] + ".trace.json")
    prof.save(path)
    out["trace_path"] = path
    med = statistics.median
    out["noop_overhead"] = med(out["noop_mode_s"]) / med(out["plain_s"]) - 1
    out["profiler_overhead"] = med(rec) / med(out["plain_s"]) - 1
    return out


def setup_torch(args, torch, mode, model, opt, autocast, dev, extra):
    """The step function of every mode but zero-infinity."""
    moved = {"bytes": 0, "steps": 0}
    pack_ctx = contextlib.nullcontext
    if mode == "save_on_cpu":
        class Counting(torch.autograd.graph.save_on_cpu):
            def __init__(self):
                super().__init__(pin_memory=True)
                pack = self.pack_hook

                def counted(t):
                    moved["bytes"] += t.numel() * t.element_size()
                    return pack(t)

                self.pack_hook = counted

        pack_ctx = Counting
    if mode == "checkpointing":
        getattr(model, "module", model).checkpointing = True  # (the model inside DDP)
    session = None
    if mode.startswith("teraio"):
        session = make_session(args, torch, mode, model, opt, dev)
    step_ctx = contextlib.nullcontext
    if mode == "dispatch-noop":
        # the floor of any wrapper that is a Python dispatch mode: one that only runs each
        # operator (what teraio-noop costs beyond it is teraio's own bookkeeping)
        from torch.utils._python_dispatch import TorchDispatchMode

        class Bare(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        step_ctx = Bare

    def step(tokens):
        moved["steps"] += 1
        ctx = session.step() if session is not None else step_ctx()
        with ctx:
            with pack_ctx():
                with autocast:
                    loss = model(tokens)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()

    def finish():
        out = {}
        if mode == "save_on_cpu":
            n = max(1, moved["steps"])
            out["host_bytes_moved_per_step"] = 2 * moved["bytes"] / n  # copied out and back in
        if session is not None:
            out["teraio"] = session.report()
            if args.teraio_save_trace:
                # the profiled trace and the plan of the planned steps, for `teraio simulate`
                for i, e in enumerate(e for e in session.plans.values() if e.plan is not None):
                    base = f"{args.teraio_save_trace}.{i}"
                    with gzip.open(base + ".trace.json.gz", "wt") as f:
                        json.dump(e.trace, f)
                    with open(base + ".plan.json", "w") as f:
                        f.write(e.plan.to_json())
            session.close()
        return out

    return step, finish


def make_session(args, torch, mode, model, opt, dev):
    import teraio.torch as tt

    os.makedirs(args.ssd_dir, exist_ok=True)
    engine = dict(dir=args.ssd_dir, files=args.ssd_files, file_size=int(args.ssd_file_gib * 2**30),
                  overwrite="anything")
    if args.ssd_alloc_kib:
        engine.update(alloc_unit=args.ssd_alloc_kib * 1024, stripe_unit=max(64, args.ssd_alloc_kib) * 1024)
    if args.teraio_workers:
        engine["workers"] = args.teraio_workers
    if mode == "teraio-host":
        engine["host_tier"] = int(args.host_gib * 2**30)
    if dev.type == "cuda":
        # planned steps hand CUDA storages to the engine as device memory (its GPU data paths);
        # the tier's own allocations are few (the budget caps them, not the trainer's memory)
        engine["gpu"] = {"device": dev.index or 0, "budget": "256M"}
    # teraio-noop: a budget nothing reaches and the `none` policy: a plan that moves nothing,
    # so the step pays only teraio.torch's own overhead
    # (the GPU's whole memory: a budget above it is refused)
    whole = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 1 << 50
    budget = whole if mode == "teraio-noop" else int(args.cap_gib * 2**30) if args.cap_gib else None
    host = int(args.host_gib * 2**30) if mode == "teraio-host" else 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        engine = tt.rank_engine(engine)  # this rank's own folder (--ssd-dir/rankN) and GPU
    return tt.Session(model, opt, engine=engine, gpu_budget_bytes=budget, host_budget_bytes=host,
                      policy="none" if mode == "teraio-noop" else args.teraio_policy,
                      hardware=json.load(open(args.hw)) if args.hw else None, optimizer_chunk_bytes=None if args.chunk_mib is None else int(args.chunk_mib * 2**20),
                      profile_steps=args.profile_steps, warmup_steps=max(0, args.warmup - 1), report_every=1,
                      page_min_bytes=args.page_min_kib * 1024,
                      gather_between_steps=not args.teraio_no_gather, page_fraction=args.page_fraction,
                      max_ahead=args.teraio_ahead, plan_margin=args.teraio_plan_margin, recompute=not args.teraio_no_recompute,
                      time_gpu=args.teraio_time_gpu, host_waits=args.teraio_host_waits,
                      log=lambda line: print(line, file=sys.stderr, flush=True))


def setup_zero(args, torch, model, autocast):
    import deepspeed

    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29512"}.items():
        os.environ.setdefault(k, v)
    os.makedirs(args.ssd_dir, exist_ok=True)
    model.checkpointing = True
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": args.ssd_dir, "pin_memory": True,
                              "buffer_count": 48},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.ssd_dir, "pin_memory": True},
        },
        "steps_per_print": 1 << 30,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(tokens):
        with autocast:
            loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, lambda: {"deepspeed": deepspeed.__version__}


# ---- the driver --------------------------------------------------------------------------

def drive(args):
    os.makedirs(args.out, exist_ok=True)
    results = []
    base = [a for a in sys.argv[1:]]
    # drop --modes X and --out X from the child's arguments
    child_args, skip = [], False
    for a in base:
        if skip:
            skip = False
            continue
        if a in ("--modes", "--out", "--nproc-per-node"):
            skip = True
            continue
        if a.startswith(("--modes=", "--out=", "--nproc-per-node=")):
            continue
        child_args.append(a)
    for mode in args.modes.split(","):
        path = os.path.join(args.out, f"{mode}.json")
        launch = [sys.executable]
        if args.nproc_per_node > 1:
            launch += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc_per_node)]
        cmd = [*launch, os.path.abspath(__file__), *child_args, "--mode", mode, "--result", path]
        print(f"== {mode}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=args.mode_timeout_s)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if os.path.exists(path):
            with open(path) as f:
                r = json.load(f)
        else:
            r = {"mode": mode, "outcome": "crashed" if rc != "timeout" else "timeout", "returncode": rc}
        r["process_s"] = time.perf_counter() - t0
        with open(path, "w") as f:
            json.dump(r, f)
        results.append(r)
        summarize(results, args.out)
    return results


def summarize(results, out):
    ideal = next((r for r in results if r["mode"] == "ideal" and r.get("outcome") == "ok"), None)
    lines = ["| mode | outcome | step s | tokens/s | % of ideal | peak alloc GiB | peak reserved GiB "
             "| moved GB/step | stall s/step | losses = ideal |", "|" + "---|" * 10]
    for r in results:
        ok = r.get("outcome") == "ok"
        step = r.get("median_step_s")
        pct = f"{100 * ideal['median_step_s'] / step:.1f}" if ideal and ok and step else "-"
        tio = r.get("teraio") or {}
        moved = tio.get("bytes_moved_per_step")
        if moved is None and "host_bytes_moved_per_step" in r:
            moved = r["host_bytes_moved_per_step"]
        if moved is None and r.get("mode") == "zero-infinity" and "disk_read_bytes_per_step" in r:
            moved = r["disk_read_bytes_per_step"] + r["disk_write_bytes_per_step"]
        same = "-"
        if ideal and ok and r["mode"] != "ideal":
            # every rank's losses against ideal's same rank (rank 0's alone without ranks)
            pairs = [(x.get("losses") or [], y.get("losses") or []) for x, y in
                     zip(r.get("ranks") or [r], ideal.get("ranks") or [ideal])]
            diffs = [abs(a - b) for mine, base in pairs for a, b in zip(mine, base)]
            n = min(len(r["losses"]), len(ideal["losses"]))
            same = "-" if not n else "yes" if all(
                mine[:len(base)] == base[:len(mine)] for mine, base in pairs) else f"no (max diff {max(diffs):.2e})"
            if len(pairs) > 1 and same == "yes":
                same = f"yes ({len(pairs)} ranks)"
        def gib(k):
            return f"{r[k] / 2**30:.2f}" if r.get(k) is not None else "-"

        if ok and step:
            stall = tio.get("stall_s_per_step")
            tps = f"{r['tokens_per_s']:.0f}"
            if r.get("world_size", 1) > 1:
                # several ranks: the total over them (step s and memory are rank 0's)
                tps = (f"{r['tokens_per_s_total']:.0f} ({r['world_size']} ranks)" if r.get("tokens_per_s_total")
                       else f"{tps} (rank 0 of {r['world_size']})")
            lines.append(
                f"| {r['mode']} | ok | {step:.3f} | {tps} | {pct} | "
                f"{gib('peak_allocated_bytes')} | {gib('peak_reserved_bytes')} | "
                f"{'-' if moved is None else f'{moved / 1e9:.2f}'} | "
                f"{'-' if stall is None else f'{stall:.3f}'} | {same} |")
        else:
            lines.append(
                f"| {r['mode']} | {r.get('outcome')}: {str(r.get('error', ''))[:80]} | - | - | - | "
                f"{gib('peak_allocated_bytes')} | {gib('peak_reserved_bytes')} | - | - | - |")
    table = "\n".join(lines)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(out, "losses.csv"), "w") as f:
        f.write("mode,step,loss\n")
        for r in results:
            for i, l in enumerate(r.get("losses", [])):
                f.write(f"{r['mode']},{i},{l!r}\n")
    with open(os.path.join(out, "memory.csv"), "w") as f:
        f.write("mode,t_s,allocated_bytes\n")
        for r in results:
            for t, b in r.get("memory_samples", []):
                f.write(f"{r['mode']},{t:.4f},{b}\n")
    print(table, file=sys.stderr, flush=True)
    plot(results, out)


def plot(results, out):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, c, b) = plt.subplots(1, 3, figsize=(16, 4))
    ideal = next((r for r in results if r["mode"] == "ideal" and r.get("losses")), None)
    for r in results:
        if r.get("losses"):
            a.plot(r["losses"], label=r["mode"], marker="o", markersize=3)
            if ideal is not None:
                n = min(len(r["losses"]), len(ideal["losses"]))
                c.plot([r["losses"][i] - ideal["losses"][i] for i in range(n)], label=r["mode"],
                       marker="o", markersize=3)
        if r.get("memory_samples"):
            t, m = zip(*r["memory_samples"])
            span = max(t) or 1.0
            b.plot([x / span for x in t], [x / 2**30 for x in m], label=f"{r['mode']} ({span:.2f} s)")
    a.set_xlabel("step"), a.set_ylabel("loss"), a.legend(fontsize=7), a.set_title("loss")
    c.set_xlabel("step"), c.set_ylabel("loss - ideal loss"), c.legend(fontsize=7)
    c.set_title("difference to ideal (0: identical)")
    b.set_xlabel("fraction of the last step"), b.set_ylabel("GiB allocated"), b.legend(fontsize=7)
    b.set_title("GPU memory over the last step")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "train_gpt.png"), dpi=120)


def main(argv=None):
    args = parse_args(argv)
    if args.cuda_alloc_conf:
        # before the first CUDA allocation of this process and of the mode processes it starts
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = args.cuda_alloc_conf
    if args.modes:
        drive(args)
        return
    if not args.mode:
        raise SystemExit("give --mode MODE or --modes A,B,C (see --help)")
    res = run_mode(args)
    if res.get("rank", 0) != 0:
        return  # rank 0 writes the result, with every rank's figures
    text = json.dumps(res)
    if args.result:
        with open(args.result, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
