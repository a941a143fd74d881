"""A fuzz of what offload and prefetch accept as memory (hypothesis): numpy arrays of every
fixed-size dtype (integers, floats, complex, bytes and unicode strings, datetimes, timedeltas,
structured, nested), their views (slices, transposes, reshapes: contiguous or not), sizes from 0
up, memoryviews, bytes and bytearrays, and objects whose ``__array_interface__`` claims any
shape, typestr, strides and address (real memory, or claims no memory can hold). The contract:
an input is stored whole and comes back byte for byte (its size exactly its ``nbytes``), or it is
refused with a :class:`teraio.TeraioError` (never a PanicException, TypeError, or a truncated
tensor); ``wait`` takes any float timeout.

CI runs ``TERAIO_PY_FUZZ_EXAMPLES`` examples (default 150); a long run sets it higher, e.g.
``TERAIO_PY_FUZZ_EXAMPLES=400000`` (docs/BENCHMARKS.md)."""

import math
import os
import sys

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="the buffer fuzz needs hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

import teraio  # noqa: E402

EXAMPLES = int(os.environ.get("TERAIO_PY_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    derandomize="TERAIO_PY_FUZZ_SEED" not in os.environ,
)

LEAF_DTYPES = st.one_of(
    hnp.integer_dtypes(),
    hnp.unsigned_integer_dtypes(),
    hnp.floating_dtypes(),
    hnp.complex_number_dtypes(),
    hnp.boolean_dtypes(),
    hnp.byte_string_dtypes(max_len=12),
    hnp.unicode_string_dtypes(max_len=12),
    hnp.datetime64_dtypes(),
    hnp.timedelta64_dtypes(),
)
DTYPES = st.one_of(LEAF_DTYPES, hnp.array_dtypes(LEAF_DTYPES, min_size=1, max_size=4),
                   hnp.nested_dtypes(LEAF_DTYPES, max_leaves=4))
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40)


@st.composite
def arrays_and_views(draw):
    """An array of random dtype and shape, or a view of one (slices, transposes, reshapes)."""
    a = draw(hnp.arrays(DTYPES, SHAPES, elements=None, fill=None, unique=False))
    # Deterministic bytes whatever the dtype (NaT and NaN payloads included).
    raw = a.view(np.uint8) if a.dtype.itemsize and a.ndim and a.flags.c_contiguous else None
    if raw is not None:
        raw.reshape(-1)[:] = np.arange(raw.size, dtype=np.uint64).astype(np.uint8)
    view = draw(st.sampled_from(["whole", "step", "transpose", "reshape", "tail"]))
    if view == "step" and a.ndim:
        a = a[::2]
    elif view == "transpose" and a.ndim > 1:
        a = a.T
    elif view == "reshape" and a.size:
        a = a.reshape(-1)
    elif view == "tail" and a.ndim and a.shape[0] > 1:
        a = a[1:]
    return a


class Claims:
    """An object whose array interface claims what it is given."""

    def __init__(self, ai, keep=None):
        self.__array_interface__ = ai
        self.keep = keep


@st.composite
def claims(draw):
    """Array interfaces over real memory (a claim within it) or claiming the impossible."""
    real = draw(st.booleans())
    typestr = draw(st.sampled_from(["|u1", "<f4", "<f8", "<U3", "|S5", "<M8[ns]", "|V6", "<c16", "|O", "|O8", "zz", "<i", ""]))
    if real:
        backing = np.zeros(4096, dtype=np.uint8)
        itemsize = {"<U3": 12, "|S5": 5, "|V6": 6, "<c16": 16, "<f4": 4, "<f8": 8, "<M8[ns]": 8}.get(typestr, 1)
        n = draw(st.integers(0, 4096 // itemsize))
        shape = (n,) if draw(st.booleans()) or n == 0 else (1, n)
        strides = draw(st.sampled_from([None, "c", "bad"]))
        ai = {"version": 3, "typestr": typestr, "shape": shape, "data": (backing.ctypes.data, False)}
        if strides == "c":
            ai["strides"] = tuple(itemsize * math.prod(shape[i + 1:]) for i in range(len(shape)))
        elif strides == "bad":
            ai["strides"] = tuple(2 * itemsize for _ in shape)
        return Claims(ai, backing), (n * itemsize if typestr not in ("|O", "|O8", "zz", "<i", "") else None)
    big = draw(st.sampled_from([2**64 - 1, 2**63, 2**63 - 1, 2**62, 2**80, -1, -(2**63)]))
    shape = draw(st.sampled_from([(big,), (big, 2), (2**32, 2**32), (3, big)]))
    addr = draw(st.sampled_from([4096, 0, 2**64 - 1, -5, 2**70, "x", None]))
    ai = {"version": 3, "typestr": typestr, "shape": shape, "data": (addr, False)}
    return Claims(ai), None


@pytest.fixture(scope="module")
def fuzz_engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    with teraio.Engine(dir=d, files=2, file_size="64M", workers=2, host_buffers="64M") as e:
        yield e


def check_round_trip(engine, tid, src, nbytes, expect, out=None):
    """Offload `src`; when accepted, it comes back whole (into `out`, or a bytearray), and the
    engine forgets it. `expect`: its bytes."""
    try:
        op = engine.offload(tid, src)
    except teraio.TeraioError:
        return False
    assert nbytes > 0, "an empty buffer was accepted"
    assert op.wait() == "ssd"
    info = engine.info(tid)
    assert info.size_bytes == nbytes, (info.size_bytes, nbytes)
    out = bytearray(nbytes) if out is None else out
    engine.prefetch(tid, out).wait()
    assert (bytes(out) if isinstance(out, bytearray) else out.tobytes()) == expect
    engine.free(tid).wait()
    return True


@FUZZ
@given(a=arrays_and_views(), tid=st.integers(0, 2**64 - 1))
def test_any_array_is_stored_whole_or_refused(fuzz_engine, a, tid):
    contiguous = a.flags.c_contiguous
    # Back into an array of the same dtype and shape, or into plain bytes.
    out = np.empty_like(a, order="C") if tid % 2 else None
    accepted = check_round_trip(fuzz_engine, tid, a, a.nbytes,
                                a.tobytes() if contiguous else None, out)
    if accepted:
        assert contiguous and a.nbytes > 0
    else:
        assert not contiguous or a.nbytes == 0 or a.dtype.hasobject


@FUZZ
@given(src=st.one_of(st.binary(max_size=3000), st.binary(max_size=3000).map(bytearray)),
       cast=st.sampled_from([None, "B", "b", "c", "H", "I", "d"]))
def test_bytes_and_memoryviews_round_trip(fuzz_engine, src, cast):
    mv = memoryview(src)
    if cast is not None:
        usable = len(src) - len(src) % struct_size(cast)
        mv = mv[:usable].cast(cast)
    check_round_trip(fuzz_engine, 7, mv, mv.nbytes, mv.tobytes())


def struct_size(fmt):
    import struct
    return struct.calcsize(fmt)


@FUZZ
@given(c=claims())
def test_array_interface_claims_are_refused_or_honoured(fuzz_engine, c):
    obj, nbytes = c
    try:
        op = fuzz_engine.offload(9, obj)
    except teraio.TeraioError:
        return
    assert nbytes, "only a real claim of at least one byte is accepted"
    op.wait()
    assert fuzz_engine.info(9).size_bytes == nbytes
    fuzz_engine.free(9).wait()


@FUZZ
@given(timeout=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)))
def test_wait_takes_any_float_timeout(fuzz_engine, timeout):
    op = fuzz_engine.offload(11, np.arange(4096, dtype=np.uint8))
    try:
        r = op.wait(timeout=timeout)
        assert r == "ssd"
    except TimeoutError:
        assert timeout is not None and timeout < 1
    except teraio.InvalidArgumentError:
        assert timeout is not None and (math.isnan(timeout) or timeout < 0)
    assert op.wait() == "ssd"


@FUZZ
@given(dtype=DTYPES, n=st.integers(0, 64))
def test_prefetch_into_any_destination_is_whole_or_refused(fuzz_engine, dtype, n):
    src = np.arange(256, dtype=np.uint8)
    fuzz_engine.offload(12, src).wait()
    out = np.zeros(n, dtype=dtype)
    try:
        fuzz_engine.prefetch(12, out).wait()
    except teraio.TeraioError:
        assert out.nbytes != 256 or out.dtype.hasobject
        fuzz_engine.free(12).wait()
        return
    assert out.nbytes == 256 and out.tobytes() == src.tobytes()
