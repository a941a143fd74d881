import os

import pytest

import teraio


@pytest.fixture(scope="session", autouse=True)
def _hardware_cache_of_the_tests(tmp_path_factory):
    """Hardware models measured by the tests (``Session(hardware=None)``,
    ``Engine.measure_hardware``) are kept in a folder of this test session, never the user's
    ``~/.cache/teraio``; subprocesses (examples, torchrun) inherit it."""
    old = os.environ.get("TERAIO_CACHE_DIR")
    os.environ["TERAIO_CACHE_DIR"] = str(tmp_path_factory.mktemp("teraio-cache"))
    yield
    if old is None:
        os.environ.pop("TERAIO_CACHE_DIR", None)
    else:
        os.environ["TERAIO_CACHE_DIR"] = old


@pytest.fixture
def engine(tmp_path):
    """A volatile engine over two 64 MiB files."""
    with teraio.Engine(dir=tmp_path / "array", files=2, file_size="64M", workers=2) as e:
        yield e
