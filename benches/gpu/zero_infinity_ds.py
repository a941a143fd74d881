"""Real DeepSpeed ZeRO-Infinity on a real GPU, to check the simulator's `zero-infinity` baseline.

Trains a Llama-shaped decoder (RMSNorm, GQA attention via SDPA, SwiGLU MLP, untied head) in
fp32 (TF32 off unless --tf32) on random tokens, two ways:
  ideal: everything in GPU memory, torch AdamW on the GPU, no recomputation;
  zero:  DeepSpeed ZeRO-3 with parameters and optimizer states on NVMe (ZeRO-Infinity:
         `offload_param` and `offload_optimizer` to `nvme_path`, CPU-Adam, DeepSpeed's
         default aio settings) and activation checkpointing of every layer, as DeepSpeed
         trains models that do not fit.
It also measures DeepSpeed's aio handle on the same folder (O_DIRECT, its default block size
and queue depth) and DeepSpeed's CPU-Adam alone, so the simulator's hardware model can be
given this machine's figures. Prints one JSON object.

Usage (one GPU; no launcher needed):
  python3 zero_infinity_ds.py --nvme /tmp/dsnvme [--hidden 1024 --layers 8 ...] [--tf32]
The simulator's side: benches/zero-validate.sh.
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from llama import Layer

ap = argparse.ArgumentParser()
ap.add_argument("--hidden", type=int, default=1024)
ap.add_argument("--layers", type=int, default=8)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--kv-heads", type=int, default=8)
ap.add_argument("--ffn", type=int, default=2816)
ap.add_argument("--vocab", type=int, default=32000)
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--micro-batch", type=int, default=4)
ap.add_argument("--micro-batches", type=int, default=2)
ap.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
ap.add_argument("--nvme", default="/tmp/dsnvme")
ap.add_argument("--tf32", action="store_true")
ap.add_argument("--modes", default="aio,cpuadam,ideal,zero")
ap.add_argument("--log-trace", action="store_true",
                help="let ZeRO-3 print when its module trace is invalidated (no prefetching then)")
ap.add_argument("--param-buffers", type=int, default=5,
                help="offload_param.buffer_count (DeepSpeed's default 5 runs out on models over "
                "about 1e9 parameters: 'Not enough buffers 0 for swapping 1')")
args = ap.parse_args()

torch.backends.cuda.matmul.allow_tf32 = args.tf32
torch.backends.cudnn.allow_tf32 = args.tf32
dev = "cuda"
H, L, HEADS, KV, FFN, V = args.hidden, args.layers, args.heads, args.kv_heads, args.ffn, args.vocab
B, S = args.micro_batch, args.seq


class Model(torch.nn.Module):
    def __init__(self, checkpointing):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.layers = torch.nn.ModuleList(Layer(H, HEADS, KV, FFN) for _ in range(L))
        self.norm = torch.nn.RMSNorm(H)
        self.head = torch.nn.Linear(H, V, bias=False)
        self.checkpointing = checkpointing

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            if self.checkpointing:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, V).float(), tokens.view(-1))


def batches():
    g = torch.Generator(device=dev).manual_seed(0)
    return [torch.randint(0, V, (B, S), device=dev, generator=g) for _ in range(args.micro_batches)]


def sync_time():
    torch.cuda.synchronize()
    return time.perf_counter()


def disk_bytes():
    """(read, written) bytes of the disk holding --nvme so far, from /proc/diskstats."""
    dev = os.stat(args.nvme).st_dev
    name = None
    with open("/proc/partitions") as f:
        for line in f.read().split("\n")[2:]:
            parts = line.split()
            if len(parts) == 4 and os.makedev(int(parts[0]), int(parts[1])) == dev:
                name = parts[3]
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if parts[2] == name:
                return int(parts[5]) * 512, int(parts[9]) * 512
    return 0, 0


def run_ideal():
    model = Model(checkpointing=False).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    data = batches()
    steps = []
    for _ in range(1 + args.steps):
        t0 = sync_time()
        for tokens in data:
            model(tokens).backward()
        t1 = sync_time()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = sync_time()
        steps.append({"step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "optimizer_s": t2 - t1})
    params = sum(p.numel() for p in model.parameters())
    del model, opt
    torch.cuda.empty_cache()
    return params, steps[1:]


def ds_config():
    return {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": args.nvme, "pin_memory": True,
                              "buffer_count": args.param_buffers},
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme, "pin_memory": True},
            "log_trace_cache_warnings": args.log_trace,
        },
        "steps_per_print": 1 << 30,
    }


def run_zero():
    import deepspeed

    model = Model(checkpointing=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    data = batches()
    steps = []
    for _ in range(1 + args.steps):
        t0, d0 = sync_time(), disk_bytes()
        for i, tokens in enumerate(data):
            loss = engine(tokens)
            engine.backward(loss)
            if i + 1 < len(data):
                engine.step()  # no optimizer step inside the accumulation
        t1, d1 = sync_time(), disk_bytes()
        engine.step()  # the accumulation boundary: the CPU optimizer step
        t2, d2 = sync_time(), disk_bytes()
        steps.append({"step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "optimizer_s": t2 - t1,
                      "fwd_bwd_disk_read_gb": (d1[0] - d0[0]) / 1e9,
                      "fwd_bwd_disk_write_gb": (d1[1] - d0[1]) / 1e9,
                      "optimizer_disk_read_gb": (d2[0] - d1[0]) / 1e9,
                      "optimizer_disk_write_gb": (d2[1] - d1[1]) / 1e9})
    return steps[1:]


def run_aio():
    """DeepSpeed's aio handle with ZeRO-Infinity's defaults (1 MiB blocks, depth 8, 1 thread)."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = AsyncIOBuilder().load(verbose=False)
    h = aio.aio_handle(1 << 20, 8, False, True, 1)
    size = 2 << 30
    buf = h.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
    buf.random_(0, 255)
    path = os.path.join(args.nvme, "aio-probe")
    out = []
    for _ in range(3):
        t = time.perf_counter()
        h.async_pwrite(buf, path)
        h.wait()
        w = size / (time.perf_counter() - t) / 1e9
        t = time.perf_counter()
        h.async_pread(buf, path)
        h.wait()
        r = size / (time.perf_counter() - t) / 1e9
        out.append({"write_gb_s": w, "read_gb_s": r})
    os.remove(path)
    h.free_cpu_locked_tensor(buf)
    return out


def run_cpuadam(n=200_000_000):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.01, adamw_mode=True)
    opt.step()
    reps = 3
    t0 = time.perf_counter()
    for _ in range(reps):
        opt.step()
    return n * reps / (time.perf_counter() - t0)


os.makedirs(args.nvme, exist_ok=True)
for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
    os.environ.setdefault(k, v)
modes = args.modes.split(",")
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cpu_threads": torch.get_num_threads(), "args": vars(args)}
if "aio" in modes:
    out["aio"] = run_aio()
if "cpuadam" in modes:
    out["cpu_adam_params_per_s"] = run_cpuadam()
if "ideal" in modes:
    out["params"], out["ideal"] = run_ideal()
if "zero" in modes:
    out["zero"] = run_zero()
for m in ("ideal", "zero"):
    if m in out:
        out[m + "_median_step_s"] = statistics.median(s["step_s"] for s in out[m])
print(json.dumps(out, indent=1))
