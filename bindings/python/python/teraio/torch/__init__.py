"""teraio inside PyTorch training: profile an iteration, plan it, run it with the plan.

- :class:`Profiler` records a real iteration (every aten operator) as a teraio trace.
- :func:`make_plannable` / :func:`step_in_backward` give the optimizer a step a plan can
  schedule, with the optimizer's own math; :func:`check_working_sets` names a kernel that no
  plan can fit.

See docs/TORCH.md.
"""

from .optimizer import WorkingSetTooLarge, check_working_sets, make_plannable, step_in_backward
from .profiler import Profiler, memory_curve, peak_bytes

__all__ = [
    "Profiler",
    "memory_curve",
    "peak_bytes",
    "make_plannable",
    "step_in_backward",
    "check_working_sets",
    "WorkingSetTooLarge",
]

from .runtime import Pager, StorageMover  # noqa: E402
from .session import Session  # noqa: E402

__all__ += ["Pager", "StorageMover", "Session"]
