"""Per-kernel-class timings on a real GPU, to check the trace generator's roofline:
causal SDPA (Llama3-8B heads, GQA expanded) forward and forward+backward, and two
memory-bound kernels (RMSNorm, SiLU-gate), for fp32 (TF32 off and on) and bf16.
Prints one JSON object with milliseconds and achieved TFLOP/s or GB/s."""
import json

import torch
import torch.nn.functional as F
from gpu_timing import timeit

dev = "cuda"
B, S, HEADS, HD, H, FFN = 4, 4096, 32, 128, 4096, 14336
T = B * S




out = {"gpu": torch.cuda.get_device_name()}
for name, dt, tf32 in [("fp32", torch.float32, False), ("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)]:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    q, k, v = (torch.randn(B, HEADS, S, HD, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    dy = torch.randn(B, HEADS, S, HD, device=dev, dtype=dt)
    # Causal attention FLOPs: QK^T and PV, half the square: 2 * 2 * B * H * S^2 * D / 2.
    f_fwd = 2 * B * HEADS * S * S * HD
    fwd = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    both = timeit(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dy))
    x = torch.randn(T, H, device=dev, dtype=dt)
    norm = torch.nn.RMSNorm(H).to(dev, dt)
    g = torch.randn(T, FFN, device=dev, dtype=dt)
    u = torch.randn(T, FFN, device=dev, dtype=dt)
    with torch.no_grad():
        t_norm = timeit(lambda: norm(x), reps=20)
        t_act = timeit(lambda: F.silu(g) * u, reps=20)
    e = x.element_size()
    out[name] = {
        "sdpa_fwd_ms": fwd * 1e3,
        "sdpa_fwd_tflops": f_fwd / fwd / 1e12,
        "sdpa_fwd_bwd_ms": both * 1e3,
        "sdpa_fwd_bwd_tflops": 3.5 * f_fwd / both / 1e12,
        "rmsnorm_ms": t_norm * 1e3,
        "rmsnorm_gbps": 2 * T * H * e / t_norm / 1e9,
        "silu_gate_ms": t_act * 1e3,
        "silu_gate_gbps": 3 * T * FFN * e / t_act / 1e9,
    }
    del q, k, v, dy, x, g, u
    torch.cuda.empty_cache()
print(json.dumps(out, indent=1))
