"""teraio never prints: what the engine has to say outside a call's result (a fallback it took,
a cleanup that failed where nothing could raise) comes as ``teraio.TeraioWarning`` at the next
engine open or close (or executor step end), and ``teraio.notices()`` takes what waits."""

import json
import subprocess
import sys
import textwrap

import teraio

# A child process: a persistent engine dropped without close() while the process may not write
# past 4 KiB of a file, so its final checkpoint fails inside a destructor (no call to raise it).
CHILD = textwrap.dedent(
    """
    import gc, json, resource, signal, sys, warnings
    import numpy as np
    import teraio

    root = sys.argv[1]
    e = teraio.Engine(dir=root + "/a", files=1, file_size="64M", persistent=True)
    e.offload(7, np.full(100_000, 0x5a, dtype=np.uint8), name="kept").wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    del e
    gc.collect()
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other = teraio.Engine(dir=root + "/b", files=1, file_size="16M")
        other.close()
    print("RESULT " + json.dumps({
        "warnings": [(w.category.__name__, str(w.message)) for w in caught],
        "left": [str(n) for n in teraio.notices()],
    }))
    """
)


def test_a_failure_inside_a_destructor_is_a_warning_not_a_print(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    got = json.loads(line[len("RESULT "):])
    mine = [m for c, m in got["warnings"] if c == "TeraioWarning" and "checkpoint at close failed" in m]
    assert len(mine) == 1, got
    assert mine[0].startswith("teraio: error: "), mine
    assert got["left"] == [], "each notice is issued once"
    # nothing on the process's stderr: the library does not print
    assert "checkpoint" not in out.stderr, out.stderr


def test_notices_are_taken_once_and_empty_when_none_wait():
    teraio.notices()  # whatever an earlier test left
    assert teraio.notices() == []
    n = teraio.Notice("warning", "x")
    assert str(n) == "teraio: warning: x"
    assert issubclass(teraio.TeraioWarning, UserWarning)
