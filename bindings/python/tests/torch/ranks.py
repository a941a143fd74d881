"""What the multi-rank tests (test_distributed.py, test_fsdp.py) share: spawning two gloo ranks
on the CPU and the preamble each rank process runs first.

A rank job is ``job(rank, world, port, results, *args)``: it calls :func:`init_rank` first and
``dist.destroy_process_group()`` last, and leaves what the test checks in ``results[rank]``.
The test modules import :func:`models_importable`, an autouse fixture: the spawned ranks import
the tests' modules (``models``, this one, the test module itself)."""

import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    """A TCP port free on the loopback now (the ranks' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank, world, port, timeout=None):
    """The rank's environment as torchrun sets it, then its gloo process group (``timeout``:
    how long a collective waits for a rank that failed; None: PyTorch's default)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    kw = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group("gloo", rank=rank, world_size=world, **kw)


def spawn_ranks(job, *args, world=2):
    """Run ``job(rank, world, port, results, *args)`` in ``world`` processes; their results by
    rank."""
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(job, args=(world, free_port(), results, *args), nprocs=world, join=True)
    return dict(results)


@pytest.fixture(autouse=True)
def models_importable(monkeypatch):
    # spawned ranks import the tests' models module
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", here + os.pathsep + os.environ.get("PYTHONPATH", ""))
