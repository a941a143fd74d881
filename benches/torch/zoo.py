#!/usr/bin/env python3
"""A model zoo under memory-saving methods: models of Hugging Face transformers, each trained for a
few steps without a memory cap (ideal) and under caps by teraio and by the usual ways to fit.

Models are built from configs with random weights (nothing is downloaded):

  llama   LlamaForCausalLM: GQA, RoPE, RMSNorm, SwiGLU, untied head
  gpt2    GPT2LMHeadModel: learned positions, LayerNorm, GELU, tied head (dropout 0)
  neox    GPTNeoXForCausalLM (Pythia): parallel attention and MLP, partial RoPE, untied head

in three sizes: tiny (a CPU test), 200m (about 200 M parameters) and 1b (about 1 B: TinyLlama-1.1B's
shape, GPT-2 of hidden 2048 and 20 layers, Pythia-1B's shape). Every run trains the same model from
the same seed on the same random tokens (AdamW, lr 1e-4, weight decay 0.1), in bf16 autocast or
fp32, so losses compare step by step.

For each model, size and precision the driver first runs `ideal` (no cap) to measure its peak
memory (torch.cuda.max_memory_allocated over the run; on the CPU the peak of the traced bytes of
one extra step, teraio.torch's profiler), then each other method under cap = peak x fraction for
every --fractions. Methods (--methods), each run in its own process (`zoo.py --one SPEC`):

  ideal          plain training, no cap (always run: it sets the caps and the baseline)
  teraio         teraio.torch.Session(gpu_budget_bytes=cap), a host tier of --host-gib and an
                 engine in --engine-dir; the cap is teraio's budget (not a process limit)
  checkpointing  the model's own gradient_checkpointing_enable(use_reentrant=False)
  save_on_cpu    torch.autograd.graph.save_on_cpu(pin_memory=True) around forward (needs CUDA)
  torchtune      torchtune's OffloadActivations around forward (needs CUDA and torchtune)
  zero-offload   DeepSpeed ZeRO-2, optimizer offloaded to the CPU (CPUAdam) (needs CUDA, deepspeed)
  zero-infinity  DeepSpeed ZeRO-3, parameters and optimizer states offloaded to NVMe under
                 --engine-dir (--zero-infinity-to cpu: to host memory) (needs CUDA, deepspeed)
  fsdp2-cpu      torch.distributed.fsdp.fully_shard with CPUOffloadPolicy, world size 1

On a GPU the cap binds the peers through torch.cuda.set_per_process_memory_fraction; DeepSpeed's
bf16 is its own (bf16 weights, not autocast). Out of memory is a result ("oom": true); another
failure records its message; a run past --timeout is killed. Per run: tokens/s and the median step
time over the steps after --warmup, % of ideal's speed, peak memory (and whether it is within the
cap), bytes moved per step where the method tells (teraio's step records, save_on_cpu's saved
tensors), every step's loss and whether the losses equal ideal's bitwise (and the largest
difference). --deterministic turns on torch.use_deterministic_algorithms (and
CUBLAS_WORKSPACE_CONFIG) and builds every model with eager attention (SDPA's flash and
memory-efficient backward kernels have no deterministic variant) in every run, for that
comparison on a GPU; its speeds are then those of eager attention.

Writes OUT/results.jsonl (one JSON object per run), OUT/table.md, OUT/plot.svg (% of ideal) and
each run's log in OUT/logs/. docs/ZOO.md describes the columns.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import importlib.util
import json
import math
import os
import shutil
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

# model -> (transformers classes, what it is)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "Llama: GQA, RoPE, RMSNorm, SwiGLU"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "GPT-2: learned positions, LayerNorm, GELU, tied head"),
    "neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "GPT-NeoX (Pythia): parallel attention+MLP, partial RoPE"),
}
# each model's configs (random init; dropout off everywhere, so runs compare step by step)
CONFIGS = {
    "llama": {
        "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     tie_word_embeddings=False),
        # 200.8 M parameters
        "200m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                     tie_word_embeddings=False),
        # TinyLlama-1.1B's shape: 1.100 B
        "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                   num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                   tie_word_embeddings=False),
    },
    "gpt2": {
        "tiny": dict(vocab_size=512, n_positions=512, n_embd=64, n_layer=2, n_head=4),
        # 204.7 M (GPT-2 small is 124 M, medium 355 M)
        "200m": dict(vocab_size=50257, n_positions=4096, n_embd=1024, n_layer=12, n_head=16),
        # 1.114 B
        "1b": dict(vocab_size=50257, n_positions=4096, n_embd=2048, n_layer=20, n_head=16),
    },
    "neox": {
        "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=512),
        # 205.9 M
        "200m": dict(vocab_size=50304, hidden_size=896, intermediate_size=3584, num_hidden_layers=12,
                     num_attention_heads=14, max_position_embeddings=4096),
        # Pythia-1B's shape: 1.012 B
        "1b": dict(vocab_size=50304, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                   num_attention_heads=8, max_position_embeddings=4096),
    },
}
SIZES = ["tiny", "200m", "1b"]
DTYPES = ["bf16", "fp32"]
METHODS = ["ideal", "teraio", "checkpointing", "save_on_cpu", "torchtune", "zero-offload", "zero-infinity",
           "fsdp2-cpu"]
# methods that cannot run on the CPU: pinned memory, DeepSpeed's GPU engine, CUDA streams
NEEDS_CUDA = {"save_on_cpu", "torchtune", "zero-offload", "zero-infinity"}
# methods that need a package beyond torch and transformers
PACKAGE = {"teraio": "teraio", "torchtune": "torchtune", "zero-offload": "deepspeed", "zero-infinity": "deepspeed"}
# per size, when --batch / --seq are not given
DEFAULT_SHAPE = {"tiny": (2, 32), "200m": (8, 1024), "1b": (8, 1024)}

EXAMPLES = """examples:
  # on a CPU (seconds; what CI runs): the tiny models, teraio against ideal and checkpointing
  python benches/torch/zoo.py --device cpu --sizes tiny --dtypes fp32 --methods ideal,teraio,checkpointing \\
      --fractions 1/2 --steps 2 --warmup 3 --out zoo-cpu

  # the issue's grid on one GPU: 3 models x 2 sizes x 2 precisions x 2 caps x every method
  python benches/torch/zoo.py --device cuda --models llama,gpt2,neox --sizes 200m,1b --dtypes bf16,fp32 \\
      --fractions 1/2,1/2.5 --engine-dir /mnt/nvme/teraio-zoo --host-gib 32 --deterministic --out zoo-gpu

  # one cell again, printing its rows as JSON lines
  python benches/torch/zoo.py --models llama --sizes 200m --dtypes bf16 --fractions 1/2 \\
      --methods ideal,teraio,checkpointing --json --out zoo-llama

  # teraio with and without an option, alternated three times against one ideal run
  python benches/torch/zoo.py --models llama --sizes 200m --dtypes fp32 --fractions 1/2.5 --methods ideal,teraio \
      --variants 'gpu:--teraio-optimizer-on gpu;auto:--teraio-optimizer-on auto' --rounds 3 --out zoo-ab
"""


# ---- arguments -----------------------------------------------------------------------------

def _names(kind: str, known: list[str]):
    """An argparse type: a comma-separated list of ``known`` names (unknown ones named)."""

    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"no {kind} given; one or more of {', '.join(known)}")
        bad = [x for x in items if x not in known]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {kind} {', '.join(repr(b) for b in bad)}; the {kind}s are {', '.join(known)}")
        return list(dict.fromkeys(items))  # (once each, in the order given)

    return parse


def _fractions(text: str) -> list[tuple[str, float]]:
    """``"1/2,1/2.5"`` or ``"0.5,0.4"`` -> [(label, value)], each in (0, 1]."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            if "/" in item:
                num, den = item.split("/", 1)
                value = float(num) / float(den)
            else:
                value = float(item)
        except (ValueError, ZeroDivisionError):
            raise argparse.ArgumentTypeError(f"fraction {item!r} is not a number (write 0.5 or 1/2)") from None
        if not (0 < value <= 1) or math.isnan(value):
            raise argparse.ArgumentTypeError(
                f"fraction {item!r} is {value:g}, not in (0, 1]: the cap is that share of ideal's peak")
        out.append((item, value))
    if not out:
        raise argparse.ArgumentTypeError("no fraction given (e.g. 1/2,1/2.5)")
    return out


def _positive(least: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"{v} is below {least}")
        return v

    return parse


def _allowance(text: str):
    """``auto``, ``measured``, ``fixed`` or a number of bytes >= 0 (Session(allocator_allowance=))."""
    t = text.strip()
    if t in ("auto", "measured", "fixed"):
        return t
    try:
        v = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"allowance {text!r}: auto, measured, fixed or a number of bytes") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"allowance {v} is below 0 bytes")
    return v


def _device(text: str) -> str:
    t = text.strip()
    if t == "cpu" or t == "cuda" or (t.startswith("cuda:") and t[5:].isdigit()):
        return t
    raise argparse.ArgumentTypeError(f"device {text!r}: cpu, cuda or cuda:N")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="zoo.py", description=__doc__, epilog=EXAMPLES,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", type=_names("model", list(MODELS)), default=list(MODELS),
                    help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--sizes", type=_names("size", SIZES), default=None,
                    help="comma-separated, of tiny, 200m, 1b (default: 200m,1b on a GPU, tiny on the CPU)")
    ap.add_argument("--dtypes", type=_names("dtype", DTYPES), default=DTYPES,
                    help="bf16 (autocast) and/or fp32 (TF32 off) (default: both)")
    ap.add_argument("--fractions", type=_fractions, default=_fractions("1/2,1/2.5"),
                    help="caps as shares of ideal's peak, each in (0, 1], as 0.5 or 1/2 (default: 1/2,1/2.5)")
    ap.add_argument("--methods", type=_names("method", METHODS), default=METHODS,
                    help=f"comma-separated, of {', '.join(METHODS)} (default: all; ideal always runs)")
    ap.add_argument("--steps", type=_positive(1), default=6, help="timed steps (default 6)")
    ap.add_argument("--warmup", type=_positive(0), default=3,
                    help="untimed steps first (default 3; teraio: the first creates AdamW's state, the "
                         "second is profiled and planned, so give at least 2 for planned timed steps)")
    ap.add_argument("--batch", type=_positive(1), default=None, help="sequences per step (default: 8; tiny 2)")
    ap.add_argument("--seq", type=_positive(2), default=None, help="tokens per sequence (default: 1024; tiny 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", type=_device, default=None, help="cpu, cuda or cuda:N (default: cuda when there is one)")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8 and eager "
                         "attention in every run (a GPU's losses otherwise vary between processes in the last "
                         "bits; SDPA's fused backward kernels are not deterministic)")
    ap.add_argument("--engine-dir", default=None,
                    help="teraio's engine files and DeepSpeed's NVMe swap go in a folder per method under it "
                         "(zoo-METHOD), removed after each run (default: a temporary folder)")
    ap.add_argument("--host-gib", type=float, default=None,
                    help="teraio's host tier in GiB (default: 32 on a GPU, 0 on the CPU; 0: SSD only)")
    ap.add_argument("--engine-files", type=_positive(1), default=4, help="teraio: engine files (default 4)")
    ap.add_argument("--engine-file-gib", type=float, default=8.0,
                    help="teraio: each engine file's size in GiB (default 8; tiny models: 64 MiB)")
    ap.add_argument("--hw", default=None,
                    help="teraio: the hardware model its plans use (a preset such as dev or paper, or a JSON "
                         "file); default: this machine's, measured through the engine and cached")
    ap.add_argument("--teraio-gather", choices=["budget", "all", "none"], default="budget",
                    help="teraio: what is resident between steps (Session(gather_between_steps=)): budget "
                         "(default: as much as the cap holds; the loop touches no tensor between steps), all, none")
    ap.add_argument("--teraio-allowance", type=_allowance, default="auto",
                    help="teraio: what plans leave free for the caching allocator (Session(allocator_allowance=)): "
                         "auto (default), measured (the profiled step's figures), fixed (page_fraction and "
                         "twice the largest tensor), or a number of bytes")
    ap.add_argument("--teraio-optimizer-on", choices=["gpu", "host", "auto"], default="gpu",
                    help="teraio: where AdamW steps (Session(optimizer_on=)): gpu (default: the states moved "
                         "by the plan), host (every update on the CPU), auto (chosen per parameter by cost)")
    ap.add_argument("--teraio-checkpoint", choices=["none", "auto"], default="none",
                    help="teraio: layers checkpointed (Session(checkpoint_layers=)): none (default), or auto (the "
                         "layers whose checkpointing makes the plan of the rest simulate fastest, chosen from the "
                         "first profiled step)")
    ap.add_argument("--teraio-time-gpu", action="store_true",
                    help="teraio (GPU): CUDA events around every operator of planned steps (Session(time_gpu=)); "
                         "each step's record then says how long the GPU was busy, recomputing and idle, and "
                         "before which operators it waited longest (a little host time per operator)")
    ap.add_argument("--teraio-profile-gpu-time", action="store_true",
                    help="teraio (GPU): profiled operators timed by their kernels alone (Session(profile_gpu_time=)); "
                         "without it an operator launched while the GPU waited counts its launch too")
    ap.add_argument("--save-traces", metavar="DIR", default=None,
                    help="teraio: save each profiled trace (RUN-N.trace.json.gz) with the hardware model and "
                         "budget its plan was made for (RUN-N.plan.json), to study plans offline with "
                         "`teraio simulate`")
    ap.add_argument("--variants", type=_variants, default=None, metavar="NAME:FLAGS;NAME:FLAGS",
                    help="teraio runs of each capped cell under several sets of teraio options, e.g. "
                         "'plain:;ckpt:--teraio-checkpoint auto' (each NAME's FLAGS are added to the command "
                         "line for its runs); with --rounds they alternate, so machine noise falls on each alike")
    ap.add_argument("--rounds", type=_positive(1), default=1,
                    help="teraio runs of each capped cell (each variant, in turn) this many times (default 1)")
    ap.add_argument("--zero-infinity-to", choices=["nvme", "cpu"], default="nvme",
                    help="zero-infinity: where parameters and optimizer states go (default nvme, under --engine-dir)")
    ap.add_argument("--zero-checkpointing", action="store_true",
                    help="zero-offload and zero-infinity also checkpoint activations (as DeepSpeed runs models "
                         "that do not fit); default: the method alone")
    ap.add_argument("--cuda-alloc-conf", default="expandable_segments:True",
                    help="PYTORCH_CUDA_ALLOC_CONF of every run (default expandable_segments:True; '' for PyTorch's)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed (default 1800)")
    ap.add_argument("--out", default="zoo-results", help="output folder: results.jsonl, table.md, plot.svg, logs/")
    ap.add_argument("--json", action="store_true", help="print every run's JSON line on stdout at the end")
    ap.add_argument("--one", metavar="SPEC", help=argparse.SUPPRESS)  # (one run, in this process)
    args = ap.parse_args(argv)
    if args.variants:
        # each variant's options: the command line with its flags added (they win)
        base = list(sys.argv[1:] if argv is None else argv)
        got = []
        for name, flags in args.variants:
            extra = shlex.split(flags)
            bad = [f for f in extra if f.startswith("--") and not f.startswith("--teraio-")]
            if bad:
                ap.error(f"argument --variants: variant {name!r} sets {bad[0]}: a variant sets only --teraio-* "
                         "options (the cell, methods and steps are the command's)")
            got.append((name, ap.parse_args(base + extra)))
        args.variants = got
    if args.host_gib is not None and args.host_gib < 0:
        ap.error(f"argument --host-gib: {args.host_gib:g} is negative")
    if args.engine_file_gib <= 0:
        ap.error(f"argument --engine-file-gib: {args.engine_file_gib:g} must be positive")
    if args.timeout <= 0:
        ap.error(f"argument --timeout: {args.timeout:g} must be positive")
    return args


# ---- the driver ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drive(args: argparse.Namespace) -> list[dict]:
    from importlib.metadata import PackageNotFoundError, version

    for pkg in ("torch", "transformers"):
        if importlib.util.find_spec(pkg) is None:
            raise SystemExit(f"zoo.py: error: {pkg} is not installed (pip install torch transformers): "
                             "the zoo's models are transformers' models trained with PyTorch")
    device = args.device
    if device != "cpu":  # (importing torch takes seconds; the CPU needs no question asked)
        import torch

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise SystemExit(f"zoo.py: error: --device {device}: this PyTorch sees no CUDA device "
                             "(use --device cpu --sizes tiny)")
    cuda = device.startswith("cuda")
    sizes = args.sizes or (["200m", "1b"] if cuda else ["tiny"])
    host_gib = args.host_gib if args.host_gib is not None else (32.0 if cuda else 0.0)
    methods = ["ideal"] + [m for m in args.methods if m != "ideal"]
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    own_engine_dir = args.engine_dir is None
    engine_root = os.path.abspath(args.engine_dir) if args.engine_dir else tempfile.mkdtemp(prefix="teraio-zoo-")
    meta = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device, "device_name": torch.cuda.get_device_name(torch.device(device)) if cuda else "CPU",
            "host_gib": host_gib, "deterministic": args.deterministic}
    for pkg in ("torch", "transformers"):
        try:
            meta[pkg] = version(pkg)
        except PackageNotFoundError:
            meta[pkg] = "?"
    cells = [(m, s, d) for m in args.models for s in sizes for d in args.dtypes]
    # the runs of each capped cell, in order: (method, its options, variant, round)
    variants = args.variants or [(None, args)]
    order = []
    for r in range(args.rounds):
        for method in methods[1:]:
            if method == "teraio":
                order += [(method, a, name, r + 1 if args.rounds > 1 else None) for name, a in variants]
            elif r == 0:
                order.append((method, args, None, None))
    total = len(cells) * (1 + len(args.fractions) * len(order))
    print(f"zoo: {total} runs ({len(cells)} model/size/precision cells) on {meta['device_name']}; "
          f"logs in {os.path.join(args.out, 'logs')}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    n = 0
    try:
        for model, size, dtype in cells:
            batch, seq = args.batch or DEFAULT_SHAPE[size][0], args.seq or DEFAULT_SHAPE[size][1]
            base = {"model": model, "arch": MODELS[model][2], "size": size, "dtype": dtype, "device": device,
                    "steps": args.steps, "warmup": args.warmup, "batch": batch, "seq": seq, "seed": args.seed,
                    "deterministic": args.deterministic}
            n += 1
            ideal = run(args, dict(base, method="ideal", fraction=None, fraction_label=None, cap_bytes=None),
                        engine_root, host_gib)
            finish_row(ideal, None)
            rows.append(ideal)
            progress(n, total, ideal)
            _write(args.out, rows, meta)
            peak = ideal.get("peak_bytes")
            for label, frac in args.fractions:
                for method, margs, variant, rnd in order:
                    n += 1
                    spec = dict(base, method=method, fraction=frac, fraction_label=label,
                                ideal_peak_bytes=peak, cap_bytes=int(peak * frac) if peak else None)
                    if variant is not None:
                        spec["variant"] = variant
                    if rnd is not None:
                        spec["round"] = rnd
                    skip = _skip(method, cuda, ideal, peak)
                    if skip:
                        row = dict(spec, run=_run_id(spec), status=skip[0], reason=skip[1], oom=False,
                                   params=ideal.get("params"))
                    else:
                        row = run(margs, spec, engine_root, host_gib)
                    finish_row(row, ideal)
                    rows.append(row)
                    progress(n, total, row)
                    _write(args.out, rows, meta)
    finally:
        if own_engine_dir:
            shutil.rmtree(engine_root, ignore_errors=True)
    if args.json:
        for r in rows:
            print(json.dumps(r), flush=True)
    return rows


def _skip(method: str, cuda: bool, ideal: dict, peak) -> tuple[str, str] | None:
    """(status, reason) of a run that cannot be made, else None."""
    reasons = []
    if method in NEEDS_CUDA and not cuda:
        reasons.append(("needs CUDA", f"{method} needs a CUDA device"))
    pkg = PACKAGE.get(method)
    if pkg and importlib.util.find_spec(pkg) is None:
        reasons.append(("not installed", f"{pkg} is not installed"))
    if not peak and not reasons:
        why = ideal.get("error") or ideal.get("reason") or ideal.get("status")
        reasons.append(("no cap", f"ideal's peak is unknown (ideal: {why})"))
    if not reasons:
        return None
    return reasons[0][0], "; ".join(r for _, r in reasons)


def _run_id(spec: dict) -> str:
    rid = f"{spec['model']}-{spec['size']}-{spec['dtype']}-{spec['method']}"
    if spec.get("variant"):
        rid += f"-{spec['variant']}"
    if spec.get("fraction") is not None:
        rid += f"-cap{spec['fraction']:.4g}"
    if spec.get("round"):
        rid += f"-r{spec['round']}"
    return rid


def _variants(text: str) -> list[tuple[str, str]]:
    """``NAME:FLAGS;NAME:FLAGS`` -> [(name, flags)] (names unique, letters, digits, - and _)."""
    out = []
    for part in text.split(";"):
        name, sep, flags = part.strip().partition(":")
        if not sep or not name or not all(c.isalnum() or c in "-_" for c in name):
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not NAME:FLAGS (e.g. 'ckpt:--teraio-checkpoint "
                                             "auto'; NAME of letters, digits, - and _)")
        if name in (n for n, _ in out):
            raise argparse.ArgumentTypeError(f"variant {name!r} is named twice")
        out.append((name, flags))
    return out


def run(args, spec: dict, engine_root: str, host_gib: float) -> dict:
    """One run in its own process; its row (the process's result, or what went wrong)."""
    rid = _run_id(spec)
    # one folder per method, emptied after each run: teraio's cached hardware model is keyed by
    # the engine's files, so one measurement serves every teraio run of the grid
    run_dir = os.path.join(engine_root, "zoo-" + spec["method"])
    result = os.path.join(args.out, "logs", rid + ".json")
    log = os.path.join(args.out, "logs", rid + ".log")
    tiny = spec["size"] == "tiny"
    spec = dict(spec, run=rid, result=os.path.abspath(result), engine_dir=run_dir, port=_free_port(),
                host_bytes=int(host_gib * 2**30), engine_files=2 if tiny else args.engine_files,
                engine_file_bytes=(64 << 20) if tiny else int(args.engine_file_gib * 2**30),
                page_min_bytes=0 if tiny else 64 << 10, hw=args.hw, teraio_gather=args.teraio_gather,
                teraio_allowance=args.teraio_allowance, teraio_optimizer_on=args.teraio_optimizer_on,
                teraio_time_gpu=args.teraio_time_gpu,
                teraio_profile_gpu_time=args.teraio_profile_gpu_time, teraio_checkpoint=args.teraio_checkpoint,
                save_traces=os.path.abspath(args.save_traces) if args.save_traces else None,
                zero_infinity_to=args.zero_infinity_to, zero_checkpointing=args.zero_checkpointing)
    env = dict(os.environ)
    if args.deterministic:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.cuda_alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = args.cuda_alloc_conf
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps(spec)]
    t0 = time.perf_counter()
    status = None
    with open(log, "w") as lf:
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            p.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            status = "timeout"
        except BaseException:  # (Ctrl-C: the run goes with the driver)
            _kill(p)
            raise
        finally:
            if p.poll() is None:
                _kill(p)
    shutil.rmtree(run_dir, ignore_errors=True)
    if status is None and os.path.exists(result):
        with open(result) as f:
            row = json.load(f)
    else:
        row = dict(spec, oom=False)
        if status == "timeout":
            row.update(status="timeout", error=f"killed after --timeout {args.timeout:g} s")
        else:
            rc = p.returncode
            why = f"killed by signal {-rc}" if rc < 0 else f"exited with {rc}"
            if rc == -signal.SIGKILL:
                why += " (the host's out-of-memory killer?)"
            row.update(status="error", error=f"the run's process {why} without a result: {_tail(log)}")
    row["process_s"] = time.perf_counter() - t0
    row["log"] = os.path.abspath(log)
    # (the settings of other methods)
    drop = {"result", "port", "engine_dir"}
    if spec["method"] != "teraio":
        drop |= {"host_bytes", "engine_files", "engine_file_bytes", "page_min_bytes", "hw", "teraio_gather", "teraio_allowance",
                 "teraio_optimizer_on", "teraio_time_gpu", "teraio_profile_gpu_time", "teraio_checkpoint",
                 "save_traces"}
    if not spec["method"].startswith("zero-"):
        drop |= {"zero_checkpointing", "zero_infinity_to"}
    if spec["method"] != "zero-infinity":
        drop.add("zero_infinity_to")
    for k in drop:
        row.pop(k, None)
    return row


def _kill(p: subprocess.Popen) -> None:
    """The run's process and its children (its own process group)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    p.wait()


def _tail(path: str, n: int = 400) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return "(no log)"
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-3:])[-n:] or "(empty log)"


def finish_row(row: dict, ideal: dict | None) -> None:
    """The figures relative to ideal's run, and whether the peak kept the cap."""
    row.setdefault("oom", False)
    cap, peak = row.get("cap_bytes"), row.get("peak_bytes")
    row["within_cap"] = (peak <= cap) if cap is not None and peak is not None and row.get("status") == "ok" else None
    row["pct_of_ideal"] = None
    row["losses_equal_ideal"] = None
    row["max_abs_loss_diff"] = None
    if ideal is None:
        if row.get("status") == "ok":
            row["pct_of_ideal"] = 100.0
        return
    if row.get("median_step_s") and ideal.get("median_step_s") and row.get("status") == "ok":
        row["pct_of_ideal"] = 100.0 * ideal["median_step_s"] / row["median_step_s"]
    mine, base = row.get("losses") or [], ideal.get("losses") or []
    k = min(len(mine), len(base))
    if k:
        # bitwise: the float64 of each step's loss.item() (exact for fp32 and bf16 losses)
        row["losses_equal_ideal"] = len(mine) == len(base) and all(
            a.hex() == b.hex() for a, b in zip(mine, base))
        diffs = [abs(a - b) for a, b in zip(mine[:k], base[:k])]
        row["max_abs_loss_diff"] = max(diffs)
        row["losses_compared"] = k


def _gib(n) -> str:
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB"


def _status_text(r: dict) -> str:
    s = r.get("status", "?")
    if s == "ok":
        return "ok"
    if r.get("oom"):
        return "out of memory"
    detail = r.get("reason") or r.get("error") or ""
    detail = " ".join(str(detail).split())
    return f"{s}: {detail[:90]}" if detail and not detail.startswith(s) else (detail[:90] or s)


def _cap_text(r: dict) -> str:
    if r.get("fraction") is None:
        return "none"
    if not r.get("cap_bytes"):
        return r["fraction_label"]
    # (a CPU process's memory has no limit to set: only teraio's budget binds there)
    free = "cap_enforced_by" in r and r["cap_enforced_by"] is None
    return f"{r['fraction_label']} ({_gib(r['cap_bytes'])}{', not enforced' if free else ''})"


def _params(n) -> str:
    if n is None:
        return ""
    if n >= 1e9:
        return f" ({n / 1e9:.2f} B)"
    if n >= 1e6:
        return f" ({n / 1e6:.0f} M)"
    return f" ({n / 1e3:.0f} K)"


def _same_text(r: dict) -> str:
    eq = r.get("losses_equal_ideal")
    if r.get("method") == "ideal" or eq is None:
        return "-"
    if eq:
        return "yes (bitwise)"
    return f"no (max diff {r['max_abs_loss_diff']:.2e})"


def _method(r: dict) -> str:
    """The method, with its variant and round (``--variants``, ``--rounds``) where it has them."""
    m = r["method"]
    if r.get("variant"):
        m += f" [{r['variant']}]"
    if r.get("round"):
        m += f" #{r['round']}"
    return m


def progress(i: int, total: int, r: dict) -> None:
    bits = [f"zoo [{i}/{total}] {r['model']} {r['size']} {r['dtype']} {_method(r)}",
            f"cap {_cap_text(r)}:" if r.get("fraction") is not None else "no cap:", _status_text(r)]
    if r.get("status") == "ok":
        bits.append(f"{r['median_step_s']:.3f} s/step")
        if r.get("pct_of_ideal") is not None and r["method"] != "ideal":
            bits.append(f"{r['pct_of_ideal']:.1f}% of ideal")
        bits.append(f"peak {_gib(r.get('peak_bytes'))}")
        if r["method"] != "ideal":
            bits.append(f"losses = ideal: {_same_text(r)}")
    if r.get("process_s") is not None:
        bits.append(f"{r['process_s']:.0f} s")
    print(", ".join([bits[0] + " " + bits[1] + " " + bits[2]] + bits[3:]), file=sys.stderr, flush=True)


def table(rows: list[dict], meta: dict) -> str:
    head = (f"Generated by benches/torch/zoo.py on {meta['device_name']} ({meta['device']}), "
            f"{meta['started']}; torch {meta['torch']}, transformers {meta.get('transformers')}"
            f"{', deterministic' if meta['deterministic'] else ''}.\n"
            f"Command: `{meta['command']}`\n\n")
    lines = ["| model | size | dtype | method | cap | result | step s | tokens/s | % of ideal | peak | "
             "within cap | moved GB/step | losses = ideal |", "|" + "---|" * 6 + "---:|" * 5 + "---|---|"]
    for r in rows:
        ok = r.get("status") == "ok"
        moved = r.get("bytes_moved_per_step")
        lines.append(" | ".join([
            f"| {r['model']}", r["size"] + _params(r.get("params")),
            r["dtype"], _method(r), _cap_text(r), _status_text(r).replace("|", "/"),
            f"{r['median_step_s']:.3f}" if ok and r.get("median_step_s") else "-",
            f"{r['tokens_per_s']:.0f}" if ok and r.get("tokens_per_s") else "-",
            f"{r['pct_of_ideal']:.1f}" if r.get("pct_of_ideal") is not None else "-",
            _gib(r.get("peak_bytes")) + (" (traced)" if r.get("peak_source", "").startswith("traced") else ""),
            {True: "yes", False: "no", None: "-"}[r.get("within_cap")],
            f"{moved / 1e9:.3f}" if moved is not None else "-",
            _same_text(r) + " |"]))
    return head + "\n".join(lines) + "\n"


def svg(rows: list[dict]) -> str:
    """% of ideal's speed per capped run, one bar each, grouped by model, size, precision and cap
    (no plotting library needed)."""
    capped = [r for r in rows if r.get("fraction") is not None]
    colors = {"teraio": "#d62728", "checkpointing": "#1f77b4", "save_on_cpu": "#2ca02c", "torchtune": "#9467bd",
              "zero-offload": "#8c564b", "zero-infinity": "#e377c2", "fsdp2-cpu": "#7f7f7f"}
    pcts = [r["pct_of_ideal"] for r in capped if r.get("pct_of_ideal") is not None]
    top = max([100.0] + pcts) * 1.08
    left, width, bar, gap = 300, 520, 14, 10
    y = 40
    out = []
    group = None
    for r in capped:
        g = (r["model"], r["size"], r["dtype"], r["fraction_label"])
        if g != group:
            if group is not None:
                y += gap
            group = g
            out.append(f'<text x="4" y="{y + 11}" font-weight="bold">{r["model"]} {r["size"]} {r["dtype"]}, '
                       f'cap {r["fraction_label"]} of ideal\'s peak</text>')
            y += bar + 2
        out.append(f'<text x="{left - 6}" y="{y + 11}" text-anchor="end">{_xml(_method(r))}</text>')
        if r.get("pct_of_ideal") is not None:
            w = width * r["pct_of_ideal"] / top
            out.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar}" '
                       f'fill="{colors.get(r["method"], "#17becf")}"/>')
            out.append(f'<text x="{left + w + 4:.1f}" y="{y + 11}">{r["pct_of_ideal"]:.1f}%</text>')
        else:
            out.append(f'<text x="{left + 4}" y="{y + 11}" fill="#888">{_xml(_status_text(r)[:60])}</text>')
        y += bar + 2
    x100 = left + width * 100.0 / top
    height = y + 20
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 80}" height="{height}" '
            f'font-family="sans-serif" font-size="11">',
            f'<rect width="100%" height="100%" fill="white"/>',
            f'<text x="4" y="16" font-size="13">step speed under a memory cap, % of ideal (no cap); '
            f'benches/torch/zoo.py</text>',
            f'<line x1="{x100:.1f}" y1="26" x2="{x100:.1f}" y2="{y}" stroke="#444" stroke-dasharray="4 3"/>',
            f'<text x="{x100:.1f}" y="{y + 14}" text-anchor="middle">100% (ideal)</text>',
            *out, "</svg>"]
    return "\n".join(body) + "\n"


def _xml(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _write(out: str, rows: list[dict], meta: dict) -> None:
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table(rows, meta))
    with open(os.path.join(out, "plot.svg"), "w") as f:
        f.write(svg(rows))


# ---- one run -------------------------------------------------------------------------------

def build_model(spec: dict, torch):
    import transformers

    cfg_cls, model_cls, _ = MODELS[spec["model"]]
    kw = dict(CONFIGS[spec["model"]][spec["size"]], use_cache=False)
    if spec.get("deterministic"):
        # SDPA's flash and memory-efficient backward kernels accumulate with atomics (no
        # deterministic variant, only a warning under warn_only): eager attention is matmuls
        kw["attn_implementation"] = "eager"
    if spec["model"] == "gpt2":
        kw.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    else:
        kw.update(attention_dropout=0.0)
        if spec["model"] == "neox":
            kw.update(hidden_dropout=0.0)
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(spec["seed"])
    model = getattr(transformers, model_cls)(cfg)
    model.train()
    return model, cfg


def decoder_layers(model, cfg):
    """The model's list of decoder layers (FSDP2 shards each)."""
    import torch

    n = cfg.num_hidden_layers
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return m
    raise RuntimeError(f"no ModuleList of {n} decoder layers found in {type(model).__name__}")


def run_one(spec: dict) -> dict:
    import torch

    res = dict(spec, status="error", oom=False)
    method = spec["method"]
    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    if cuda:
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        res["device_name"] = torch.cuda.get_device_name(dev)
    if spec["deterministic"]:
        # (warn_only: an operator with no deterministic kernel warns in the run's log instead
        # of failing every run, ideal's included)
        torch.use_deterministic_algorithms(True, warn_only=True)
    res["torch"] = torch.__version__
    cap = spec.get("cap_bytes")
    if cuda and cap and method != "teraio":
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), dev)
        res["cap_enforced_by"] = "torch.cuda.set_per_process_memory_fraction"
    elif cap and method == "teraio":
        res["cap_enforced_by"] = "Session(gpu_budget_bytes)" + ("" if cuda else " on the traced bytes")
    elif cap:
        res["cap_enforced_by"] = None  # (nothing enforces a cap on a CPU process's memory)
    import transformers

    res["transformers"] = transformers.__version__
    model, cfg = build_model(spec, torch)
    res["params"] = sum(p.numel() for p in model.parameters())
    res["attn_implementation"] = getattr(cfg, "_attn_implementation", None)
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    n = spec["warmup"] + spec["steps"]
    data = [torch.randint(0, cfg.vocab_size, (spec["batch"], spec["seq"]), generator=g) for _ in range(n + 1)]
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if spec["dtype"] == "bf16" \
        else contextlib.nullcontext()
    losses, times = [], []
    finish = None
    dist_up = False

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    try:
        if method in ("zero-offload", "zero-infinity"):
            step, finish = setup_deepspeed(spec, torch, model, dev, res)
        else:
            if method == "fsdp2-cpu":
                setup_fsdp2(spec, torch, model, cfg, dev, res)
                dist_up = True
            else:
                model.to(dev)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
            step, finish = setup_torch(spec, torch, model, opt, autocast, dev, res)
        for i in range(n):
            tokens = data[i].to(dev)
            t0 = sync()
            loss = step(tokens)
            t1 = sync()
            losses.append(loss)
            times.append(t1 - t0)
            print(f"[{spec['run']}] step {i} loss {loss:.6f} {t1 - t0:.3f} s", file=sys.stderr, flush=True)
        if not cuda and method in ("ideal", "checkpointing"):
            # no allocator to ask on the CPU: the peak of the traced bytes of one more step
            # (after the timed ones, so nothing reported is changed by it)
            from teraio.torch import Profiler, peak_bytes

            prof = Profiler(model, opt)
            with prof.record():
                step(data[n].to(dev))
            res["peak_bytes"] = peak_bytes(prof.trace())
            res["peak_source"] = "traced: teraio.torch's profiler, one step after the timed ones"
        res["status"] = "ok"
    except torch.OutOfMemoryError as e:
        res.update(status="oom", oom=True, error=str(e).split("\n")[0][:500])
    except Exception as e:  # a result too: the row says which run failed and why
        text = f"{type(e).__name__}: {e}"
        # teraio's own "cannot fit" (an operator larger than the cap) and allocators' other words
        # for it are out of memory too
        oom = type(e).__name__ == "WorkingSetTooLarge" or "out of memory" in str(e).lower()
        res.update(status="oom" if oom else "error", oom=oom, error=text[:2000],
                   traceback=traceback.format_exc()[-4000:])
    finally:
        if finish is not None:
            try:
                res.update(finish(times) or {})
            except Exception as e:
                res.setdefault("finish_error", f"{type(e).__name__}: {e}"[:500])
        if dist_up:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    res["losses"] = losses
    res["step_s"] = times
    timed = times[spec["warmup"]:]
    if timed and res["status"] == "ok":
        res["median_step_s"] = statistics.median(timed)
        res["tokens_per_s"] = spec["batch"] * spec["seq"] / res["median_step_s"]
    if cuda:
        # (a Session resets the peak at each step's start and keeps each step's: the largest)
        steps_peak = max((p for p in (res.get("teraio") or {}).get("peak_allocated_bytes", []) if p), default=0)
        res["peak_bytes"] = max(torch.cuda.max_memory_allocated(dev), steps_peak)
        res["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
        res["peak_source"] = "torch.cuda.max_memory_allocated over the run"
    res.setdefault("bytes_moved_per_step", None)
    res.setdefault("peak_bytes", None)
    return res


def setup_torch(spec, torch, model, opt, autocast, dev, res):
    """The step of every method that trains with a torch optimizer."""
    method = spec["method"]
    cuda = dev.type == "cuda"
    moved = {"bytes": 0, "steps": 0}
    pack_ctx = contextlib.nullcontext
    if method == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif method == "save_on_cpu":
        class Counting(torch.autograd.graph.save_on_cpu):
            """save_on_cpu, counting the bytes it saves."""

            def __init__(self):
                super().__init__(pin_memory=True)
                pack = self.pack_hook

                def counted(t):
                    moved["bytes"] += t.numel() * t.element_size()
                    return pack(t)

                self.pack_hook = counted

        pack_ctx = Counting
    elif method == "torchtune":
        try:
            from torchtune.training import OffloadActivations
        except ImportError:
            from torchtune.training._activation_offloading import OffloadActivations
        import torchtune

        res["torchtune"] = getattr(torchtune, "__version__", None)

        def pack_ctx():
            return OffloadActivations(use_pin_memory=True, use_streams=True)
    session = None
    if method == "teraio":
        import teraio.torch as tt

        os.makedirs(spec["engine_dir"], exist_ok=True)
        engine = {"dir": spec["engine_dir"], "files": spec["engine_files"], "file_size": spec["engine_file_bytes"]}
        if spec["size"] == "tiny":
            # the tiny models' storages are small: a 4 KiB allocation unit (the default is 1 MiB)
            engine.update(alloc_unit="4k", stripe_unit="64k")
        if spec["host_bytes"]:
            engine["host_tier"] = spec["host_bytes"]
        hw = spec.get("hw")
        if hw and os.path.exists(hw):
            hw = os.path.abspath(hw)
        gather = {"budget": "budget", "all": True, "none": False}[spec["teraio_gather"]]
        # (given only when asked for: a wheel from before checkpoint_layers runs the others)
        more = {"checkpoint_layers": "auto"} if spec.get("teraio_checkpoint") == "auto" else {}
        if spec.get("teraio_profile_gpu_time") and cuda:
            more["profile_gpu_time"] = True
        session = tt.Session(model, opt, engine=engine, gpu_budget_bytes=spec["cap_bytes"],
                             host_budget_bytes=spec["host_bytes"], hardware=hw,
                             page_min_bytes=spec["page_min_bytes"], gather_between_steps=gather,
                             allocator_allowance=spec.get("teraio_allowance", "auto"),
                             optimizer_on=spec.get("teraio_optimizer_on", "gpu"),
                             time_gpu=bool(spec.get("teraio_time_gpu")) and cuda,
                             log=lambda line: print(line, file=sys.stderr, flush=True), **more)

    def step(tokens):
        moved["steps"] += 1
        ctx = session.step() if session is not None else contextlib.nullcontext()
        with ctx:
            with pack_ctx():
                with autocast:
                    loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss.item()

    def finish(times):
        out = {}
        timed = slice(spec["warmup"], None)
        if method == "save_on_cpu" and moved["steps"]:
            out["bytes_moved_per_step"] = 2 * moved["bytes"] / moved["steps"]  # out to the host and back
        if session is not None:
            recs = list(session.steps)
            rep = session.report()
            t = recs[timed]
            out["teraio"] = {
                "step_modes": [r["mode"] for r in recs],
                "bytes_moved": [r.get("bytes_moved") for r in recs],
                "stall_s": [r.get("stall_s") for r in recs],
                "executor_peak_bytes": [(r.get("executor") or {}).get("peak_bytes") for r in recs],
                "peak_allocated_bytes": [r.get("peak_allocated_bytes") for r in recs],
                # (time_gpu: where the GPU waited in each planned step)
                "gpu": [{k: r[k] for k in ("gpu_span_s", "gpu_busy_s", "gpu_recompute_s", "gpu_idle_s", "top_idle")
                         if k in r} or None for r in recs],
                "trace_peak_bytes": max((r["trace_peak_bytes"] for r in recs if "trace_peak_bytes" in r), default=None),
                "plans": rep.get("plans"), "hardware": rep.get("hardware"), "budget_bytes": rep.get("budget_bytes"),
                "evictions": rep.get("evictions"), "fetches": rep.get("fetches"),
                "plan": next((r["plan"] for r in recs if str(r.get("plan", "")).startswith("made")), None),
                "checkpoint": next((r["checkpoint"] for r in recs if r.get("checkpoint")), None),
                # each profiled step's operator durations added up, its wall time, spin kernels
                "profiles": [r["profile"] for r in recs if r.get("profile")],
                "checkpointed_layers": getattr(session, "checkpointed_layers", None),
            }
            if t:
                out["bytes_moved_per_step"] = statistics.mean(r.get("bytes_moved", 0) for r in t)
                out["teraio"]["timed_steps_planned"] = sum(r["mode"] == "planned" for r in t)
            if not cuda:
                peaks = [(r.get("executor") or {}).get("peak_bytes") for r in t if r["mode"] == "planned"]
                peaks = [p for p in peaks if p is not None]
                if peaks and len(peaks) == len(t):
                    out["peak_bytes"] = max(peaks)
                    out["peak_source"] = "traced: the executor's peak of the planned timed steps"
            if spec.get("save_traces"):
                out["saved_traces"] = save_traces(session, spec["save_traces"], spec["run"])
            session.close()
        return out

    return step, finish


def save_traces(session, folder, run):
    """Each profiled trace of `session` as FOLDER/RUN-N.trace.json.gz, beside RUN-N.plan.json: the
    hardware model, the budgets and the selection its plan was made with (`teraio simulate
    TRACE --hw HW.json --gpu-mem-gb ...` plans it again). Returns the paths written."""
    import teraio

    os.makedirs(folder, exist_ok=True)
    hw = getattr(session, "_hardware_model", None)
    paths = []
    for i, entry in enumerate(session.plans.values()):
        base = os.path.join(folder, f"{run}-{i}")
        with gzip.open(base + ".trace.json.gz", "wt") as f:
            json.dump(entry.trace, f)
        meta = {"hardware": teraio.hardware(hw) if hw is not None else None, "gpu_budget_bytes": session.budget,
                "executor_bytes": entry.budget, "selection": entry.selection, "refused": entry.refused,
                "plan": (entry.plan.to_dict().get("policy") if hasattr(entry.plan, "to_dict") else None)}
        with open(base + ".plan.json", "w") as f:
            json.dump(meta, f, indent=1, default=str)
        paths += [base + ".trace.json.gz", base + ".plan.json"]
    return paths


def setup_deepspeed(spec, torch, model, dev, res):
    """DeepSpeed ZeRO-2 with the optimizer on the CPU (zero-offload), or ZeRO-3 with parameters and
    optimizer states on NVMe or the CPU (zero-infinity); one process, world size 1. AdamW with the
    same hyperparameters as the others (DeepSpeed's CPUAdam). bf16: DeepSpeed's own (bf16 weights)."""
    import deepspeed

    res["deepspeed"] = deepspeed.__version__
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    deepspeed.init_distributed(verbose=False)
    if spec["zero_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec["method"] == "zero-offload":
        zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "overlap_comm": True, "contiguous_gradients": True}
    else:
        where = spec["zero_infinity_to"]
        largest = max(p.numel() for p in model.parameters())
        param = {"device": where, "pin_memory": True}
        optim = {"device": where, "pin_memory": True}
        if where == "nvme":
            nvme = os.path.join(spec["engine_dir"], "deepspeed")
            os.makedirs(nvme, exist_ok=True)
            # (DeepSpeed's 5 buffers run out on models of about 1e9 parameters; each buffer
            # must hold the largest parameter)
            param.update(nvme_path=nvme, buffer_count=48, buffer_size=max(int(1e8), largest))
            optim.update(nvme_path=nvme)
        zero = {"stage": 3, "offload_param": param, "offload_optimizer": optim}
    cfg = {"train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
           "bf16": {"enabled": spec["dtype"] == "bf16"},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
           "zero_optimization": zero, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}
    res["deepspeed_config"] = cfg
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)

    def step(tokens):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    return step, None


def setup_fsdp2(spec, torch, model, cfg, dev, res):
    """FSDP2 at world size 1: every decoder layer and the root fully_shard-ed with CPUOffloadPolicy
    (shards, gradients and the optimizer step on the CPU; parameters copied in per layer)."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    except ImportError:  # (PyTorch before 2.6)
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    cuda = dev.type == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(dev.type, (1,))
    kw = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=cuda)}  # (pinning needs a GPU)
    for layer in decoder_layers(model, cfg):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one is not None:
        spec = json.loads(args.one)
        res = run_one(spec)
        with open(spec["result"], "w") as f:
            json.dump(res, f)
        return 0
    drive(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
