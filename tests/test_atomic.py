"""Atomic writes: complete outputs with ordinary permissions, nothing left behind on failure."""

import os
import stat

import pytest

from edgeprune.atomic import atomic_dir, atomic_path, atomic_write_bytes, atomic_write_text


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_write_replaces_and_gets_umask_permissions(tmp_path, umask_022):
    dest = tmp_path / "sub" / "report.json"
    atomic_write_text(dest, "first\n")
    atomic_write_bytes(dest, memoryview(b"second\n"))
    assert dest.read_text() == "second\n"
    assert _mode(dest) == 0o644  # not mkstemp's private 0600
    assert sorted(os.listdir(dest.parent)) == ["report.json"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    dest = tmp_path / "model.engine"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(dest) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("boom")
    assert dest.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.engine"]


def test_atomic_path_keeps_the_suffix_for_writers_that_read_it(tmp_path):
    with atomic_path(tmp_path / "plot.png", suffix=".png") as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path
        tmp.write_bytes(b"png")
    assert (tmp_path / "plot.png").read_bytes() == b"png"


def test_atomic_dir_renames_on_success_and_cleans_up_on_error(tmp_path, umask_022):
    out = tmp_path / "run"
    with atomic_dir(out) as tmp:
        (tmp / "run.json").write_text("{}")
    assert (out / "run.json").read_text() == "{}"
    assert _mode(out) == 0o755  # not mkdtemp's private 0700
    with pytest.raises(KeyboardInterrupt):
        with atomic_dir(tmp_path / "run2") as tmp:
            (tmp / "model.safetensors").write_bytes(b"x")
            raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["run"]
