"""Shared by the calibration scripts: wall time of a CUDA call, synchronized."""
import time

import torch


def timeit(fn, reps=5, warm=2):
    """Mean seconds per call of `fn` over `reps` calls, after `warm` untimed ones."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps
