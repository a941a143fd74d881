"""The teraio.torch tests need PyTorch. `.ci/torch.sh` runs them in an environment that has it;
the package's own tests (`.ci/bindings.sh`, `pytest bindings/python/tests`) run where PyTorch is
not installed, and there this folder is not collected (rather than failing on `import torch`).
Set TERAIO_REQUIRE_TORCH=1 to make a missing PyTorch an error instead (`.ci/torch.sh` does)."""

import importlib.util
import os

# (this folder is itself named torch: when its parent is on sys.path and PyTorch is missing, it
# would be found as a namespace package, which has no origin)
_spec = importlib.util.find_spec("torch")
if _spec is None or _spec.origin in (None, "namespace"):
    if os.environ.get("TERAIO_REQUIRE_TORCH") == "1":
        raise RuntimeError("TERAIO_REQUIRE_TORCH=1 but PyTorch is not installed")
    collect_ignore_glob = ["test_*.py"]
