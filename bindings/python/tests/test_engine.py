"""The engine from Python: round trips, threads, every bad input a clear exception."""

import gc
import os
import threading

import numpy as np
import pytest

import teraio

ODD_SIZES = [1, 7, 4095, 4097, (1 << 20) + 3, (5 << 20) + 77]


def pattern(seed, n):
    return (np.arange(n, dtype=np.uint64) * 31 + seed).astype(np.uint8)


@pytest.mark.parametrize("n", ODD_SIZES)
def test_numpy_round_trip_with_odd_sizes(engine, n):
    data = pattern(n, n)
    assert engine.offload(5, data).wait() == "ssd"
    out = np.zeros(n, dtype=np.uint8)
    assert engine.prefetch(5, out).wait() is out
    np.testing.assert_array_equal(out, data)


def test_the_callers_key_space_starts_at_the_engines_constant(engine):
    # the engine's TensorKey::CALLER_FIRST: every executor key is below it
    assert teraio.KEY_CALLER_FIRST == 1 << 40
    data = pattern(3, 4097)
    key = teraio.KEY_CALLER_FIRST + 1
    assert engine.offload(key, data).wait() == "ssd"
    out = np.zeros_like(data)
    engine.prefetch(key, out).wait()
    np.testing.assert_array_equal(out, data)


def test_every_buffer_kind_round_trips(engine):
    f32 = np.linspace(0, 1, 3001, dtype=np.float32)
    sources = {
        1: b"hello teraio",
        2: bytearray(b"\x01\x02\x03" * 1000),
        3: memoryview(bytearray(range(256)) * 17),
        4: f32,
        5: np.arange(24, dtype=np.int16).reshape(2, 3, 4),
        6: np.asfortranarray(np.ones((4, 4))).T,  # C-contiguous view of a Fortran array
    }
    ops = [engine.offload(i, d, name=f"t{i}") for i, d in sources.items()]
    assert [op.wait() for op in ops] == ["ssd"] * len(ops)
    for i, d in sources.items():
        want = bytes(memoryview(d).cast("B")) if not isinstance(d, np.ndarray) else d.tobytes()
        out = bytearray(len(want))
        engine.prefetch(i, out).wait()
        assert bytes(out) == want, i
    assert sorted(t.name for t in engine.tensors()) == [f"t{i}" for i in range(1, 7)]
    assert engine.lookup("t4") == 4 and engine.lookup("nope") is None


def test_engine_buffers_move_without_copies_and_stay_valid(tmp_path):
    with teraio.Engine(dir=tmp_path, files=2, file_size="64M") as e:
        a = e.empty((1000, 33), np.float32)
        a[:] = np.arange(33, dtype=np.float32)
        buf = np.asarray(a).base
        op = e.offload(1, a)
        assert op.kind == "offload" and op.tensor_id == 1
        assert op.wait() == "ssd"
        a[:] = 0
        assert e.prefetch(1, a).wait() is a
        np.testing.assert_array_equal(a[7], np.arange(33, dtype=np.float32))
        raw = e.alloc(10_000)
        assert raw.nbytes == len(raw) == 10_000 and raw.address % 4096 == 0
        raw.numpy()[:] = 3
        e.offload(2, raw).wait()
        assert not raw.busy
        view = raw.view()
        memoryview(view).cast("B")[:] = b"\0" * 10_000
        e.prefetch(2, raw).wait()
        assert bytes(memoryview(view)) == b"\x03" * 10_000
        assert buf is not None
    # Valid after the engine closed.
    assert raw.numpy()[9999] == 3


def test_prefetch_dropped_without_wait_still_delivers(engine):
    data = pattern(1, 3 << 20)
    engine.offload(9, data).wait()
    out = np.zeros_like(data)
    op = engine.prefetch(9, out)
    del op
    gc.collect()
    np.testing.assert_array_equal(out, data)


def test_done_polls_and_wait_timeout(engine):
    data = pattern(2, 8 << 20)
    op = engine.offload(1, data)
    try:
        op.wait(timeout=0)
    except TimeoutError:
        pass
    while not op.done():
        pass
    assert op.wait() == "ssd" and op.wait() == "ssd"
    with pytest.raises(teraio.InvalidArgumentError):
        op.wait(timeout=-1)


def test_several_python_threads_share_one_engine_and_nothing_is_lost(engine):
    errors = []

    def worker(t):
        try:
            for k in range(8):
                tid = t * 100 + k
                n = 4096 * (k + 1) + 13 * t + 1
                data = pattern(tid, n)
                engine.offload(tid, data).wait()
                out = np.empty(n, dtype=np.uint8)
                engine.prefetch(tid, out).wait()
                if not np.array_equal(out, data):
                    errors.append(f"tensor {tid} differs")
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(engine.tensors()) == 32


def test_one_op_waited_from_several_threads(engine):
    op = engine.offload(1, pattern(3, 16 << 20))
    results = []
    threads = [threading.Thread(target=lambda: results.append(op.wait())) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == ["ssd"] * 4


def test_a_closed_engine_raises_closed_error(tmp_path):
    e = teraio.Engine(dir=tmp_path, files=1, file_size="32M")
    e.offload(1, b"x" * 100).wait()
    e.close()
    e.close()  # twice is fine
    assert e.closed
    for call in (
        lambda: e.offload(2, b"abc"),
        lambda: e.prefetch(1, bytearray(100)),
        lambda: e.free(1),
        lambda: e.tensors(),
        lambda: e.alloc(10),
        lambda: e.capacity_bytes,
    ):
        with pytest.raises(teraio.ClosedError):
            call()


def test_wrong_size_and_dtype_are_clear_and_lose_nothing(engine):
    data = np.arange(10, dtype=np.float32)  # 40 bytes
    engine.offload(1, data).wait()
    with pytest.raises(teraio.InvalidArgumentError, match="40 bytes"):
        engine.prefetch(1, np.empty(10, dtype=np.float64))  # wrong dtype: 80 bytes
    with pytest.raises(teraio.InvalidArgumentError, match="read-only"):
        engine.prefetch(1, b"\0" * 40)
    ro = np.empty(10, dtype=np.float32)
    ro.flags.writeable = False
    with pytest.raises(teraio.InvalidArgumentError, match="read-only"):
        engine.prefetch(1, ro)
    with pytest.raises(teraio.InvalidArgumentError, match="contiguous"):
        engine.prefetch(1, np.empty(20, dtype=np.float32)[::2])
    with pytest.raises(teraio.InvalidArgumentError, match="list"):
        engine.offload(2, [1, 2, 3])
    with pytest.raises(teraio.InvalidArgumentError, match="empty"):
        engine.offload(2, b"")
    with pytest.raises(teraio.InvalidArgumentError, match="tensor id"):
        engine.offload(-1, b"abc")
    with pytest.raises(teraio.InvalidArgumentError, match="priority"):
        engine.offload(2, b"abc", priority="asap")
    with pytest.raises(teraio.InvalidArgumentError, match="destination"):
        engine.offload(2, b"abc", destination="gpu")
    with pytest.raises(teraio.UnknownTensorError) as ei:
        engine.prefetch(77, bytearray(4))
    assert isinstance(ei.value, LookupError) and ei.value.status == -8
    # The tensor survived every refused call.
    out = np.empty(10, dtype=np.float32)
    engine.prefetch(1, out).wait()
    np.testing.assert_array_equal(out, data)


def test_released_buffers_are_refused(engine):
    engine.offload(1, b"abcd").wait()
    mv = memoryview(bytearray(4))
    mv.release()
    with pytest.raises(teraio.InvalidArgumentError, match="released"):
        engine.prefetch(1, mv)
    buf = engine.alloc(4)
    buf.release()
    assert buf.released
    with pytest.raises(teraio.InvalidArgumentError, match="released"):
        engine.prefetch(1, buf)
    with pytest.raises(teraio.InvalidArgumentError):
        np.asarray(buf)
    out = bytearray(4)
    engine.prefetch(1, out).wait()
    assert out == b"abcd"


def test_prefetch_of_a_freed_tensor_is_an_error(engine):
    engine.offload(1, b"abcd").wait()
    assert engine.free(1).wait() is None
    with pytest.raises(teraio.UnknownTensorError):
        engine.prefetch(1, bytearray(4))


def test_bad_configurations_name_the_problem(tmp_path):
    with pytest.raises(teraio.InvalidArgumentError, match="queue_depht"):
        teraio.Engine(dir=tmp_path, queue_depht=4)
    with pytest.raises(teraio.InvalidArgumentError, match="lots"):
        teraio.Engine(dir=tmp_path, file_size="lots")
    with pytest.raises(teraio.IoError, match="missing.toml"):
        teraio.Engine(tmp_path / "missing.toml")
    with pytest.raises(teraio.InvalidArgumentError, match="TOML"):
        teraio.Engine.from_toml("files = [")


def test_a_persistent_engine_reopens_with_its_tensors_by_name(tmp_path):
    cfg = tmp_path / "engine.toml"
    cfg.write_text('dir = "array"\nfiles = 2\nfile_size = "64M"\npersistent = true\n')
    data = {f"layer{i}.w": pattern(i, 100_000 + i) for i in range(3)}
    with teraio.Engine(cfg) as e:
        assert e.persistent
        for i, (name, d) in enumerate(data.items()):
            e.offload(i, d, name=name).wait()
    with teraio.Engine(cfg) as e:
        for name, d in data.items():
            tid = e.lookup(name)
            assert tid is not None, name
            out = np.empty_like(d)
            e.prefetch(tid, out).wait()
            np.testing.assert_array_equal(out, d)
        assert e.info(0).location == "on_ssd"
        st = e.stats()
        assert st["ssd_read"]["ops"] == 3


def test_the_exception_hierarchy_matches_the_stable_codes():
    codes = dict(teraio._teraio.status_codes())
    for name, code in codes.items():
        cls = getattr(teraio, name)
        assert issubclass(cls, teraio.TeraioError)
        if name != "TeraioError":
            assert cls.status == code, name
    assert issubclass(teraio.ChecksumMismatchError, teraio.CorruptionError)
    assert issubclass(teraio.IoError, OSError)
    assert issubclass(teraio.TraceError, ValueError)


def test_the_engine_measures_this_machine_and_keeps_the_model_per_array(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("TERAIO_CACHE_DIR", str(cache))
    with teraio.Engine(dir=tmp_path / "a", files=2, file_size="64M", workers=2) as e:
        m = e.measure_hardware(probe_bytes=8 << 20)
        assert m["source"] == "measured" and "measured now" in m["summary"], m
        a = m["report"]["array"]
        assert a["devices"] == 2 and a["write_bytes_per_s"] > 0 and a["read_bytes_per_s"] > 0, a
        assert m["report"]["gpu"]["kind"] == "none"
        hw = m["hardware"]
        assert hw == teraio.hardware(hw), "a model the planner takes as it is"
        assert hw["ssd_count"] == 2 and hw["ssd_write_bytes_per_s"] == pytest.approx(a["write_bytes_per_s"] / 2)
        path = m["cache_path"]
        assert path.startswith(str(cache)) and os.path.isfile(path)
        # read back at once; fresh=True measures again; cache=False touches nothing
        again = e.measure_hardware()
        assert again["source"] == "cache" and again["hardware"] == hw and again["cache_path"] == path
        assert "from the cache" in again["summary"]
        assert e.measure_hardware(fresh=True, probe_bytes=0)["source"] == "measured"
        off = e.measure_hardware(cache=False, probe_bytes=0)
        assert off["source"] == "measured" and off["cache_path"] is None
        # a damaged file is measured again, with a warning naming it
        with open(path, "w") as f:
            f.write("{\"ssd_count\": ")
        with pytest.warns(teraio.TeraioWarning, match="ignoring the hardware cache file .*not JSON"):
            assert e.measure_hardware(probe_bytes=0)["source"] == "measured"
        assert e.measure_hardware()["source"] == "cache"
        with pytest.raises(teraio.InvalidArgumentError, match="probe_bytes"):
            e.measure_hardware(probe_bytes=-1)
    # another array: another model
    with teraio.Engine(dir=tmp_path / "b", files=1, file_size="64M", workers=2) as e:
        other = e.measure_hardware(probe_bytes=0)
        assert other["source"] == "measured" and other["cache_path"] != path
        assert other["key"]["devices"] == 1
    assert len(os.listdir(cache)) == 2
