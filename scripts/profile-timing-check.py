"""The profiler's operator durations on a GPU, with and without ``gpu_time`` (teraio.torch
``Profiler(gpu_time=)``, ``Session(profile_gpu_time=)``): a model of many short kernels (a
transformers-free MLP stack of small matrices, so the host's time per operator, not the GPU,
sets the pace), one step profiled each way, against the same step's GPU time unprofiled (CUDA
events around it, the host far ahead of the GPU). With ``gpu_time`` the durations must add up
to within 25% of that GPU time (neither more nor less), and be less than without it (where each operator's launch
counts too). Prints the figures and PASS or FAIL (exit status 1 on FAIL). Run on the GPU
machine:

    python3 scripts/profile-timing-check.py
"""
import sys

import torch

from teraio.torch import Profiler

assert torch.cuda.is_available(), "this check needs a CUDA device"
torch.manual_seed(0)
dev = torch.device("cuda")
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.LayerNorm(256))
                              for _ in range(24)]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(64, 256, device=dev)


def step():
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


for _ in range(3):  # (the optimizer's state, the kernels loaded)
    step()
torch.cuda.synchronize()
# the step's GPU time: the host queues it behind a spin kernel, so the GPU never waits for it
runs = []
for _ in range(5):
    torch.cuda._sleep(50_000_000)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    step()
    b.record()
    b.synchronize()
    runs.append(a.elapsed_time(b) / 1000.0)
gpu_s = sorted(runs)[len(runs) // 2]

sums = {}
for gpu_time in (False, True):
    prof = Profiler(model, opt, gpu_time=gpu_time)
    with prof.record():
        step()
    kernels = prof.trace()["kernels"]
    sums[gpu_time] = (sum(k["duration_us"] for k in kernels) / 1e6, len(kernels), prof.sleeps, prof.wall_s)

launch, timed = sums[False], sums[True]
print(f"step's GPU time (unprofiled, median of 5): {gpu_s * 1e3:.2f} ms")
print(f"profiled, launches counted: {launch[1]} operators add up to {launch[0] * 1e3:.2f} ms (wall {launch[3] * 1e3:.0f} ms)")
print(f"profiled, gpu_time: {timed[1]} operators add up to {timed[0] * 1e3:.2f} ms "
      f"({timed[2]} spin kernels; wall {timed[3] * 1e3:.0f} ms)")
ok = 0.75 * gpu_s <= timed[0] <= 1.25 * gpu_s and timed[0] < launch[0] and timed[1] == launch[1] and timed[2] > 0
print("PROFILE GPU TIME", "PASS" if ok else "FAIL", flush=True)
sys.exit(0 if ok else 1)
