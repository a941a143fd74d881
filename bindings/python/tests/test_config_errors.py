"""Engine options from Python (issue 33): decimal sizes, errors that name the key, the value and
what to write, no engine without a location, nothing left on disk by a failed open."""

import os

import pytest

import teraio


def test_decimal_sizes_are_sizes(tmp_path):
    with teraio.Engine(dir=tmp_path, files=1, file_size="64M", host_tier="1.5G") as e:
        assert e is not None
    assert os.path.getsize(tmp_path / "dev0") == 64 << 20


@pytest.mark.parametrize(
    "options, key, value, form",
    [
        ({"host_tier": "1.5x"}, "host_tier", '"1.5x"', "1.5G"),
        ({"file_size": -1}, "file_size", "-1", "positive"),
        ({"file_size": 1.5}, "file_size", "1.5", "whole number of bytes"),
        ({"gpu": {"budget": "lots"}}, "[gpu] budget", '"lots"', "64M"),
    ],
)
def test_a_bad_option_names_its_key_its_value_and_the_form(tmp_path, options, key, value, form):
    with pytest.raises(teraio.InvalidArgumentError) as ei:
        teraio.Engine(dir=tmp_path / "array", **options)
    msg = str(ei.value)
    assert f"{key} = {value}" in msg and form in msg, msg
    assert "untagged" not in msg and "column" not in msg, msg
    assert not (tmp_path / "array").exists()


def test_an_engine_without_a_location_is_refused_and_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for make in (teraio.Engine, lambda: teraio.Engine.from_json("{}"), lambda: teraio.Engine.from_toml("")):
        with pytest.raises(teraio.InvalidArgumentError) as ei:
            make()
        assert "`dir`" in str(ei.value) and "`targets`" in str(ei.value), str(ei.value)
    assert os.listdir(tmp_path) == []


def test_files_that_do_not_fit_are_refused_before_anything_is_created(tmp_path):
    with pytest.raises(teraio.NoSpaceError) as ei:
        teraio.Engine(dir=tmp_path / "a" / "b", files=2, file_size="1048576T")
    msg = str(ei.value)
    assert "dev0" in msg and "free" in msg and "file_size" in msg, msg
    assert not (tmp_path / "a").exists()
