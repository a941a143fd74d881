"""Measure what the trace generator's roofline assumes, on a real GPU (PyTorch).

For fp32 (CUDA cores, TF32 off), tf32 (TF32 tensor cores) and bf16:
  - dense matmul throughput at Llama3-8B shapes (16384 tokens);
  - one Llama3-8B decoder layer (RMSNorm, GQA attention via SDPA, SwiGLU MLP), forward and
    backward, micro-batch 4 x 4096 tokens: milliseconds per layer;
and the host's AdamW throughput (torch, CPU, foreach) in parameters per second.
Prints one JSON object. Usage: python3 calibrate_roofline.py [--quick]
"""
import json
import sys
import time

import torch
from gpu_timing import timeit
from llama import Layer

quick = "--quick" in sys.argv
dev = "cuda"
H, FFN, HEADS, KV = 4096, 14336, 32, 8
B, S = (1, 1024) if quick else (4, 4096)
T = B * S




def set_precision(p):
    torch.backends.cuda.matmul.allow_tf32 = p == "tf32"
    torch.backends.cudnn.allow_tf32 = p == "tf32"


def dtype_of(p):
    return torch.bfloat16 if p == "bf16" else torch.float32


def matmul_tflops(p, m, k, n):
    set_precision(p)
    a = torch.randn(m, k, device=dev, dtype=dtype_of(p))
    b = torch.randn(k, n, device=dev, dtype=dtype_of(p))
    s = timeit(lambda: a @ b, reps=10, warm=3)
    return 2 * m * k * n / s / 1e12


def layer_ms(p):
    set_precision(p)
    layer = Layer(H, HEADS, KV, FFN).to(dev, dtype_of(p))
    x = torch.randn(B, S, H, device=dev, dtype=dtype_of(p), requires_grad=True)
    dy = torch.randn(B, S, H, device=dev, dtype=dtype_of(p))

    def fwd():
        with torch.no_grad():
            layer(x)

    def fwd_bwd():
        layer(x).backward(dy)

    return {"forward_ms": timeit(fwd, reps=5) * 1e3, "forward_backward_ms": timeit(fwd_bwd, reps=5) * 1e3}


def cpu_adamw_params_per_s(n):
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
    opt.step()
    t0 = time.perf_counter()
    reps = 3
    for _ in range(reps):
        opt.step()
    return n * reps / (time.perf_counter() - t0)


out = {
    "gpu": torch.cuda.get_device_name(),
    "torch": torch.__version__,
    "tokens": T,
    "cpu_threads": torch.get_num_threads(),
}
for p in ["fp32", "tf32", "bf16"]:
    out[p] = {
        "matmul_tflops_up": matmul_tflops(p, T, H, 2 * FFN),
        "matmul_tflops_down": matmul_tflops(p, T, FFN, H),
        "matmul_tflops_qkvo": matmul_tflops(p, T, H, H),
        **layer_ms(p),
    }
    torch.cuda.empty_cache()
out["cpu_adamw_params_per_s"] = cpu_adamw_params_per_s(50_000_000 if quick else 500_000_000)
print(json.dumps(out, indent=1))
