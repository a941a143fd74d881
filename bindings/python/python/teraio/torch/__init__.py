"""teraio inside PyTorch training: profile an iteration, plan it, run it with the plan.

- :class:`Session` wraps a training loop in three lines (docs/TORCH.md).
- :class:`Profiler` records a real iteration (every aten operator) as a teraio trace.
- :func:`make_plannable` / :func:`step_in_backward` give the optimizer a step a plan can
  schedule, with the optimizer's own math; :func:`check_working_sets` names a kernel that no
  plan can fit.
- :class:`Pager` and :class:`StorageMover` move storages through the engine without a plan;
  :class:`PlannedRun` drives the engine's plan executor.
- :class:`HostAdamW`, :class:`HostAdam`, :class:`HostSGD`: ``torch.optim`` optimizers whose step
  runs teraio's host kernels on CPU float32 parameters (state dicts interchangeable with
  PyTorch's).
- :func:`offload_optimizer`: a GPU model's optimizer (AdamW, Adam, SGD) updates on the host,
  its states in page-locked host memory (``Session(optimizer_on="host")``).
- :func:`rank_engine` opens one engine per rank under ``torchrun`` (own files, own GPU); under
  FSDP2 (``fully_shard``) a Session moves the rank's shards and leaves FSDP's all-gathered
  parameters to FSDP (:mod:`teraio.torch.fsdp`).
"""

from .distributed import rank_config, rank_engine
from .host_offload import offload_optimizer
from .host_optim import HostAdam, HostAdamW, HostSGD
from .optimizer import WorkingSetTooLarge, auto_chunk_bytes, check_working_sets, make_plannable, step_in_backward
from .planned import Diverged, PlannedRun
from .profiler import Profiler, memory_curve, peak_bytes
from .pager import Pager, StorageMover
from .session import Session

__all__ = [
    "Session",
    "rank_engine",
    "rank_config",
    "Profiler",
    "memory_curve",
    "peak_bytes",
    "make_plannable",
    "auto_chunk_bytes",
    "step_in_backward",
    "check_working_sets",
    "WorkingSetTooLarge",
    "Pager",
    "StorageMover",
    "PlannedRun",
    "Diverged",
    "HostAdamW",
    "HostAdam",
    "HostSGD",
    "offload_optimizer",
]
