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


# ---- deterministic safetensors (issue 12, defect 7) -------------------------------------------


def _tensors(order):
    import torch

    g = torch.Generator().manual_seed(0)
    full = {"blocks.0.w": torch.randn(3, 4, generator=g), "a.bias": torch.randn(5, generator=g).half(),
            "idx": torch.arange(6), "flag": torch.tensor([True, False]), "scalar": torch.tensor(2.5),
            "bf": torch.randn(2, 2, generator=g).bfloat16(), "t": torch.randn(4, 3, generator=g).t()}
    return {k: full[k] for k in order}


def test_safetensors_writes_are_byte_identical_whatever_the_insertion_order(tmp_path):
    import torch
    from safetensors.torch import load_file

    from edgeprune.atomic import atomic_save_safetensors

    keys = ["blocks.0.w", "a.bias", "idx", "flag", "scalar", "bf", "t"]
    meta_items = [(f"key{i:02d}", f"value {i}") for i in range(20)]
    atomic_save_safetensors(tmp_path / "a.safetensors", _tensors(keys), dict(meta_items))
    atomic_save_safetensors(tmp_path / "b.safetensors", _tensors(keys[::-1]), dict(meta_items[::-1]))
    for _ in range(3):  # the old writer's HashMap order changed between calls
        atomic_save_safetensors(tmp_path / "c.safetensors", _tensors(keys), dict(reversed(meta_items)))
        assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    loaded = load_file(str(tmp_path / "a.safetensors"))  # safetensors itself reads the file
    for k, v in _tensors(keys).items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), k
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a.safetensors"), "pt") as fh:
        assert fh.metadata() == dict(meta_items)


def test_safetensors_writer_refuses_non_string_metadata(tmp_path):
    import torch

    from edgeprune.atomic import atomic_save_safetensors

    with pytest.raises(TypeError, match="str -> str"):
        atomic_save_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(1)}, {"n": 3})
    assert os.listdir(tmp_path) == []
