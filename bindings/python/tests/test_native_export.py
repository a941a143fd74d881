"""The native module reads caller memory itself (bindings/python/src/export.rs: the buffer
protocol, ``__array_interface__``, ``__cuda_array_interface__``, ``teraio.DeviceMemory``) and
never calls back into the ``teraio`` package above it: with the package sealed off (its modules
replaced by ones that fail on any attribute, and any import of it recorded), offloads,
prefetches, errors, device memory and an executor whose allocator hands out buffer-protocol
memory all work."""

import builtins
import ctypes
import sys
import types

import numpy as np
import pytest

import teraio

from test_device import aligned, gpu_engine
from test_executor import drive, fill, planned  # noqa: F401 (planned: a fixture)


class Sealed(types.ModuleType):
    """A module that fails on any attribute: what the native module would get if it imported
    the package."""

    def __getattr__(self, name):
        raise AssertionError(f"the native module looked up {self.__name__}.{name}")


@pytest.fixture
def sealed(monkeypatch):
    """The package sealed off from the native module for the test; the imports of it made
    meanwhile (none expected)."""
    imports = []
    real = builtins.__import__

    def spy(name, *args, **kwargs):
        if name == "teraio" or name.startswith("teraio."):
            imports.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", spy)
    for name in [m for m in sys.modules if m == "teraio" or m.startswith("teraio.")]:
        monkeypatch.setitem(sys.modules, name, Sealed(name))
    yield imports
    assert imports == [], imports


def sources():
    """Host memory of every kind the package takes, 4096 bytes each."""
    data = fill(1, 4096)
    ct = (ctypes.c_uint8 * 4096)()
    ctypes.memmove(ct, data.ctypes.data, 4096)
    return {
        "numpy": data.copy(),
        "numpy float32": data.view(np.float32).copy(),
        "bytes": data.tobytes(),
        "bytearray": bytearray(data.tobytes()),
        "memoryview": memoryview(bytearray(data.tobytes())).cast("I"),
        "ctypes": ct,
    }


def test_offload_prefetch_and_errors_never_call_back_into_the_package(tmp_path, sealed):
    with teraio.Engine(dir=tmp_path, files=2, file_size="64M", retain_on_prefetch=True) as e:
        want = fill(1, 4096).tobytes()
        for i, (kind, src) in enumerate(sources().items()):
            assert e.offload(i, src, name=kind).wait() == "ssd", kind
            for out in (bytearray(4096), np.zeros(1024, np.float32), (ctypes.c_uint8 * 4096)()):
                assert e.prefetch(i, out).wait() is out
                assert bytes(memoryview(out).cast("B")) == want, (kind, type(out))
        buf = e.alloc(4096)
        buf.numpy()[:] = fill(1, 4096)
        assert e.offload(100, buf.numpy(np.float32)).wait() == "ssd"
        # errors are the package's classes, handed down when it was imported
        with pytest.raises(teraio.InvalidArgumentError, match="read-only"):
            e.prefetch(0, b"\0" * 4096)
        with pytest.raises(teraio.InvalidArgumentError, match="object"):
            e.offload(101, np.array([None] * 8, dtype=object))
        with pytest.raises(teraio.UnknownTensorError):
            e.prefetch(102, bytearray(8)).wait()


class CudaArray:
    """An object with a ``__cuda_array_interface__`` (as a CUDA tensor has) over ``a``."""

    def __init__(self, a, readonly=False, strides=None):
        self.a = a
        self.__cuda_array_interface__ = {
            "version": 3, "shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, readonly),
            "strides": strides,
        }


def test_device_memory_and_cuda_arrays_are_read_natively(tmp_path, sealed):
    with gpu_engine(tmp_path, retain_on_prefetch=True) as e:
        src = aligned(1 << 16)
        src[:] = fill(2, src.nbytes)
        assert e.offload_device(1, teraio.DeviceMemory(src.ctypes.data, src.nbytes, src)).wait() == "ssd"
        assert e.offload_device(2, CudaArray(src.view(np.float32))).wait() == "ssd"
        for tid in (1, 2):
            out = aligned(1 << 16)
            assert isinstance(e.prefetch_device(tid, CudaArray(out)).wait(), CudaArray)
            assert np.array_equal(out, src), tid
        with pytest.raises(teraio.InvalidArgumentError, match="read-only"):
            e.prefetch_device(1, CudaArray(aligned(1 << 16), readonly=True))
        with pytest.raises(teraio.InvalidArgumentError, match="contiguous"):
            e.offload_device(3, CudaArray(src.view(np.uint32)[::2], strides=(8,)))
        with pytest.raises(teraio.InvalidArgumentError, match="host buffers go through prefetch"):
            e.prefetch_device(1, bytearray(1 << 16))


class CtypesAllocator:
    """Host memory as ctypes arrays: buffer-protocol objects without an array interface (what
    teraio.torch hands the executor for CPU storages)."""

    def __init__(self):
        self.live = {}
        self.allocs = 0

    def alloc(self, tid, nbytes, why):
        self.allocs += 1
        self.live[tid] = (ctypes.c_uint8 * nbytes)()
        return self.live[tid]

    def release(self, tid, mem):
        self.live.pop(tid, None)


def test_an_executor_allocates_through_the_buffer_protocol_without_the_package(tmp_path, planned, sealed):
    trace, plan, budget = planned
    tensors = trace.to_dict()["tensors"]
    alloc = CtypesAllocator()
    with teraio.Engine(dir=tmp_path, files=2, file_size="128M", retain_on_prefetch=True) as e:
        ex = e.executor(trace, plan, gpu_budget_bytes=budget, allocate_created=True, allocator=alloc)
        globals_ = [i for i, t in enumerate(tensors) if t["global"]]
        for i in globals_:
            mem = (ctypes.c_uint8 * tensors[i]["bytes"])()
            memoryview(mem).cast("B")[:] = fill(i, len(mem)).tobytes()
            ex.attach(i, mem)
        ex.start()
        drive(ex, trace, budget)
        assert alloc.allocs > 0
        for i in globals_:
            mem = ex.resident(i)
            if mem is not None:
                assert bytes(mem) == fill(i, len(mem)).tobytes(), i
        ex.finish()


def test_the_native_module_needs_the_package_only_for_its_exception_classes():
    """Without the classes handed down (a bare ``teraio._teraio``), an error still says what
    went wrong and how to fix it."""
    from teraio import _errors, _teraio

    with pytest.raises(TypeError, match="no exception class"):
        _teraio.set_error_classes({})
    _teraio.set_error_classes({name: RuntimeError for name, _ in _teraio.status_codes()})
    try:
        with pytest.raises(RuntimeError, match="device address"):
            _teraio.DeviceMemory(0, 1)
    finally:
        _teraio.set_error_classes({name: getattr(_errors, name) for name, _ in _teraio.status_codes()})
    with pytest.raises(teraio.InvalidArgumentError, match="device address"):
        teraio.DeviceMemory(0, 1)
