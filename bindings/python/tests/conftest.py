import pytest

import teraio


@pytest.fixture
def engine(tmp_path):
    """A volatile engine over two 64 MiB files."""
    with teraio.Engine(dir=tmp_path / "array", files=2, file_size="64M", workers=2) as e:
        yield e
