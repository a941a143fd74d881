"""The engine's plan executor from Python: a scripted trainer drives a planned iteration under
a squeezed budget; every tensor that comes back holds its bytes."""

import numpy as np
import pytest

import teraio


class Allocator:
    """Memory as numpy arrays; remembers what it handed out and got back."""

    def __init__(self):
        self.live = {}
        self.allocs = 0
        self.releases = 0

    def alloc(self, tid, nbytes, why):
        assert why in ("prefetch", "create")
        self.allocs += 1
        a = np.zeros(nbytes, dtype=np.uint8)
        self.live[tid] = a
        return a

    def release(self, tid, mem):
        self.releases += 1
        self.live.pop(tid, None)


def fill(tid, n):
    return ((np.arange(n, dtype=np.uint64) * 7 + tid) % 251).astype(np.uint8)


def drive(ex, trace, budget, iterations=2, make_room_at=None):
    """A scripted trainer: every kernel in order, `iterations` times; the reports, checked. With
    `make_room_at=(iteration, kernel)` it asks the executor there for all the room it can make
    (as a trainer whose allocator ran out of memory) and records what came back."""
    reports = []
    for it in range(iterations):
        for k in range(trace.kernel_count):
            ex.before_kernel(k)
            assert ex.used_bytes <= budget
            if make_room_at == (it, k):
                used = ex.used_bytes
                freed = ex.make_room(k, 1 << 62)
                assert freed > 0 and ex.used_bytes == used - freed
            ex.after_kernel(k)
        # the memory timeline of the first iteration only (the others' left out)
        rep = ex.end_iteration(timeline=it == 0)
        assert bool(rep["memory_timeline"]) == (it == 0)
        assert rep["iteration"] == it and rep["diverged"] is None
        assert rep["peak_bytes"] <= budget
        assert rep["offloads"] > 0 and rep["prefetches"] > 0
        reports.append(rep)
    return reports


@pytest.fixture(scope="module")
def planned():
    trace = teraio.generate_trace(
        "gpt2-small", layers=2, hidden=256, heads=4, kv_heads=4, ffn=1024, vocab=2000, seq=128,
        micro_batch=2,
    )
    budget = trace.peak_resident_bytes * 3 // 4
    return trace, teraio.plan(trace, "teraio", gpu_memory_bytes=budget), budget


def test_a_planned_iteration_runs_under_the_budget_and_tensors_come_back_intact(tmp_path, planned):
    trace, plan, budget = planned
    tensors = trace.to_dict()["tensors"]
    alloc = Allocator()
    with teraio.Engine(dir=tmp_path, files=2, file_size="128M", retain_on_prefetch=True) as eng:
        ex = eng.executor(trace, plan, gpu_budget_bytes=budget, allocate_created=True,
                          allocator=alloc)
        globals_ = [i for i, t in enumerate(tensors) if t["global"]]
        for i in globals_:
            ex.attach(i, fill(i, tensors[i]["bytes"]))
        ex.start()
        reports = drive(ex, trace, budget, iterations=3, make_room_at=(1, trace.kernel_count // 2))
        assert reports[1]["made_room"] > 0 and reports[1]["demand_fetches"] > 0
        assert reports[0]["made_room"] == reports[2]["made_room"] == 0
        assert ex.events(), "arrivals and releases were reported"
        for i in globals_:
            mem = ex.resident(i)
            if mem is not None:
                assert np.array_equal(np.asarray(mem), fill(i, tensors[i]["bytes"])), i
        assert alloc.allocs > 0 and alloc.releases > 0
        ex.finish()
        with pytest.raises(teraio.InvalidStateError):
            ex.before_kernel(0)


def test_divergence_and_bad_input_are_clear(tmp_path, planned):
    trace, plan, budget = planned
    tensors = trace.to_dict()["tensors"]
    with teraio.Engine(dir=tmp_path, files=2, file_size="128M", retain_on_prefetch=True) as eng:
        with pytest.raises(teraio.InvalidArgumentError, match="teraio.Engine"):
            teraio.Executor(trace.to_dict(), plan, gpu_budget_bytes=budget)
        with pytest.raises(teraio.InvalidArgumentError, match="alloc"):
            eng.executor(trace, plan, gpu_budget_bytes=budget, allocator=object())
        with pytest.raises(teraio.PlanError):
            eng.executor(trace, '{"policy": 3}', gpu_budget_bytes=budget)
        ex = eng.executor(trace, plan, gpu_budget_bytes=budget, allocate_created=True,
                          allocator=Allocator())
        g = next(i for i, t in enumerate(tensors) if t["global"])
        with pytest.raises(teraio.DivergedError, match="bytes"):
            ex.attach(g, np.zeros(tensors[g]["bytes"] + 1, dtype=np.uint8))
        assert ex.diverged is not None
        ro = np.zeros(tensors[g]["bytes"], dtype=np.uint8)
        ro.flags.writeable = False
        with pytest.raises(teraio.InvalidArgumentError, match="read-only"):
            ex.attach(g, ro)
        ex.finish()


def test_sizes_at_most_takes_smaller_tensors_and_reads_them_back_at_their_size(tmp_path, planned):
    """A plan of a larger shape runs a smaller one (teraio.torch's first step of a new shape):
    with ``sizes_at_most`` the trace's sizes are upper bounds, each tensor comes back at the
    size it was attached with and its bytes intact; without it a smaller tensor diverges, and a
    larger one always does."""
    trace, plan, budget = planned
    tensors = trace.to_dict()["tensors"]
    globals_ = [i for i, t in enumerate(tensors) if t["global"]]
    size = {i: max(1, tensors[i]["bytes"] - tensors[i]["bytes"] // 3) for i in globals_}

    class Sized(Allocator):
        asked = {}

        def alloc(self, tid, nbytes, why):
            self.asked.setdefault(tid, set()).add(nbytes)
            return super().alloc(tid, nbytes, why)

    with teraio.Engine(dir=tmp_path, files=2, file_size="128M", retain_on_prefetch=True) as eng:
        ex = eng.executor(trace, plan, gpu_budget_bytes=budget, allocate_created=False, allocator=Allocator())
        g = globals_[0]
        with pytest.raises(teraio.DivergedError, match="bytes"):
            ex.attach(g, fill(g, size[g]))
        ex.finish()
        alloc = Sized()
        ex = eng.executor(trace, plan, gpu_budget_bytes=budget, allocate_created=True, allocator=alloc,
                          sizes_at_most=True)
        with pytest.raises(teraio.DivergedError, match="at most"):
            ex.attach(g, fill(g, tensors[g]["bytes"] + 1))
        ex.finish()
        alloc = Sized()
        ex = eng.executor(trace, plan, gpu_budget_bytes=budget, allocate_created=True, allocator=alloc,
                          sizes_at_most=True)
        for i in globals_:
            ex.attach(i, fill(i, size[i]))
        ex.start()
        drive(ex, trace, budget, iterations=2)
        moved = [i for i in globals_ if i in alloc.asked]
        assert moved, "the plan moves global tensors"
        for i in moved:
            assert alloc.asked[i] == {size[i]}, (i, alloc.asked[i], size[i])
        ex.gather_globals()
        # (a global whose write is still in flight keeps its memory with the store meanwhile)
        back = [i for i in moved if ex.resident(i) is not None]
        assert back, "the gather read moved globals back"
        for i in back:
            assert np.array_equal(np.asarray(ex.resident(i)), fill(i, size[i])), i
        ex.finish()
