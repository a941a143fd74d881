"""One engine per rank under ``torchrun`` (DDP, FSDP): each rank opens its own engine, on its
own files, so nothing is shared by accident (devices, files, plan caches), and a rank that
cannot open its engine stops the whole job with a message naming it instead of leaving the other
ranks waiting in a collective.

::

    import teraio.torch
    engine = teraio.torch.rank_engine({"dir": "/mnt/nvme/teraio", "files": 4, "file_size": "64G"})
    session = teraio.torch.Session(model, optimizer, engine=engine, gpu_budget_bytes=...)

``dir`` gets a ``rank{N}`` subfolder per rank; ``dirs`` (a list, one entry per rank: e.g. each
GPU's own NVMe) picks the rank's own folder instead; ``targets`` (a list of lists) gives each rank
its own block devices or files. A ``[gpu]`` section without a device names the rank's
``LOCAL_RANK`` GPU.
"""

from __future__ import annotations

import copy
import os
from typing import Any


def rank_and_world() -> tuple[int, int, int]:
    """(rank, local rank, world size) from ``torch.distributed`` when initialized, else from
    torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``); (0, 0, 1) alone."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), local, dist.get_world_size()
    return int(os.environ.get("RANK", "0")), local, int(os.environ.get("WORLD_SIZE", "1"))


def rank_config(config: dict[str, Any], rank: int, local_rank: int | None = None) -> dict[str, Any]:
    """The engine configuration of ``rank`` from one shared description (see the module doc)."""
    cfg = copy.deepcopy(config)
    local_rank = rank if local_rank is None else local_rank
    if "dirs" in cfg:
        dirs = cfg.pop("dirs")
        if rank >= len(dirs):
            raise ValueError(f"rank {rank}: `dirs` names {len(dirs)} folders, one per rank is needed")
        cfg["dir"] = str(dirs[rank])
    elif "targets" in cfg and cfg["targets"] and isinstance(cfg["targets"][0], (list, tuple)):
        per_rank = cfg["targets"]
        if rank >= len(per_rank):
            raise ValueError(f"rank {rank}: `targets` has {len(per_rank)} lists, one per rank is needed")
        cfg["targets"] = list(per_rank[rank])
    elif "dir" in cfg:
        cfg["dir"] = os.path.join(str(cfg["dir"]), f"rank{rank}")
    else:
        raise ValueError("a rank's engine needs `dir`, `dirs` (one per rank) or `targets` (one list per rank)")
    gpu = cfg.get("gpu")
    if isinstance(gpu, dict) and gpu.get("device") is None and not gpu.get("emulated"):
        gpu["device"] = local_rank
    return cfg


def rank_engine(config: dict[str, Any], rank: int | None = None) -> Any:
    """Open this rank's ``teraio.Engine``. Under an initialized process group every rank learns
    whether every other rank opened its engine; if one did not, every rank raises the same
    ``RuntimeError`` naming the ranks that failed and why (a rank alone raises its own error)."""
    import teraio
    import torch.distributed as dist

    r, local, world = rank_and_world()
    if rank is not None:
        r = rank
    engine, error = None, None
    try:
        cfg = rank_config(config, r, local)
        if "dir" in cfg:
            os.makedirs(cfg["dir"], exist_ok=True)
        engine = teraio.Engine(**cfg)
    except Exception as e:  # any failure to open: reported to every rank below
        error = f"{type(e).__name__}: {e}"
    if dist.is_available() and dist.is_initialized() and world > 1:
        errors: list[Any] = [None] * world
        dist.all_gather_object(errors, error)
        failed = [(i, e) for i, e in enumerate(errors) if e is not None]
        if failed:
            if engine is not None:
                engine.close()
            raise RuntimeError("teraio: the job stops: " + "; ".join(
                f"rank {i} could not open its engine ({e})" for i, e in failed))
    elif error is not None:
        raise RuntimeError(f"teraio: rank {r} could not open its engine ({error})")
    return engine
