"""``export`` / ``verify`` commands (edgeprune/cli/deploy.py) through the ``edgeprune`` entry point
and its one error handler (bench: tests/test_bench_cli.py)."""

from __future__ import annotations

import json

import pytest
import torch

from edgeprune.errors import UserError
from exporters.onnx import read_metadata
from tests.conftest import assert_one_line_error, run_cli


def _fmnist_data_available() -> bool:
    try:
        from edgeprune.data.fashion_mnist import dataset_dir

        dataset_dir()
        return True
    except UserError:
        return False


needs_fmnist = pytest.mark.skipif(not _fmnist_data_available(), reason="Fashion-MNIST not installed")


def invoke(*args: str):
    """``edgeprune ARGS`` through :func:`edgeprune.cli.main` (the one error handler)."""
    return run_cli(list(args))


def assert_user_error(result, pattern: str, code: int = 2) -> None:
    """Non-zero exit, exactly one line on stderr, no traceback."""
    assert_one_line_error(result, pattern, code)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A pruned fmnist-vit run directory and dense + pruned ONNX exports."""
    from edgeprune.api import prune
    from edgeprune.artifact import save_run
    from edgeprune.loading import RANDOM_INIT_SEED
    from edgeprune.zoo.registry import get_model_spec

    d = tmp_path_factory.mktemp("cli")
    spec = get_model_spec("fmnist-vit", random_init=True)
    torch.manual_seed(RANDOM_INIT_SEED)
    model = spec.create(pretrained=False)
    res = prune(model, torch.randn(16, 1, 28, 28), target="both", sparsity=0.5, spec=spec)
    save_run(d / "run", res.model, res.record)
    r1 = invoke("export", d / "run", "-o", d / "pruned.onnx")
    assert r1.exit_code == 0, r1.output
    r2 = invoke("export", "--model", "fmnist-vit", "--random-init", "-o", d / "dense.onnx")
    assert r2.exit_code == 0, r2.output
    return d, r1, r2, res.record


# ---------------------------------------------------------------------------------------------
# export


def test_export_run_dir_and_dense(work):
    d, r_pruned, r_dense, record = work
    assert "wrote" in r_pruned.stdout and "max abs diff" in r_pruned.stdout
    md = read_metadata(d / "pruned.onnx")
    assert md["method"] == record["method"] and md["blocks"] == record["blocks"]
    assert md["sparsity"] == record["sparsity"] and md["base_model"]["name"] == "fmnist-vit"
    assert md["input_shape"] == ["batch", 1, 28, 28] and md["input_name"] == "input"
    assert md["mean"] == [pytest.approx(0.2860)] and md["output_kind"] == "logits"
    dense = read_metadata(d / "dense.onnx")
    assert dense["method"] == "dense" and dense["blocks"][0]["mlp_hidden"] == 512
    assert sorted(p.name for p in d.iterdir()) == ["dense.onnx", "pruned.onnx", "run"]


def test_export_refuses_to_overwrite(work):
    d = work[0]
    before = (d / "dense.onnx").read_bytes()
    r = invoke("export", "--model", "fmnist-vit", "--random-init", "-o", d / "dense.onnx")
    assert_user_error(r, "exists")
    assert (d / "dense.onnx").read_bytes() == before


def test_export_force_and_static_batch(tmp_path):
    out = tmp_path / "s.onnx"
    out.write_bytes(b"old")
    r = invoke("export", "--model", "fmnist-vit", "--random-init", "-o", out, "--force",
               "--static-batch", "2")
    assert r.exit_code == 0, r.output
    assert read_metadata(out)["input_shape"] == [2, 1, 28, 28]


def test_export_user_errors(tmp_path):
    out = tmp_path / "x.onnx"
    assert_user_error(invoke("export", tmp_path / "no_run", "-o", out), "not found")
    assert_user_error(invoke("export", "-o", out), "either")
    assert_user_error(invoke("export", tmp_path, "--model", "fmnist-vit", "-o", out), "either")
    assert_user_error(invoke("export", tmp_path, "-o", out), "not an edgeprune run directory")
    assert_user_error(invoke("export", "--model", "no_such_model_xyz", "-o", out), "unknown model")
    assert_user_error(invoke("export", "--model", "fmnist-vit", "--random-init", "-o", tmp_path / "x.txt"),
                      ".onnx")
    assert_user_error(invoke("export", "--model", "fmnist-vit", "--random-init", "-o", out,
                             "--opset", "23"), "opset")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# verify


@needs_fmnist
def test_verify_passes_on_real_inputs(work, tmp_path):
    d = work[0]
    r = invoke("verify", d / "pruned.onnx", "--against", d / "run", "--n", "24",
               "--json", tmp_path / "v.json")
    assert r.exit_code == 0, r.output
    assert "PASS" in r.stdout and "max abs diff" in r.stdout and "top1_agreement: 100.00%" in r.stdout
    rep = json.loads((tmp_path / "v.json").read_text())
    assert rep["passed"] and rep["n"] == 24 and rep["max_abs_diff"] <= 1e-4
    r2 = invoke("verify", d / "dense.onnx", "--model", "fmnist-vit", "--random-init", "--n", "8")
    assert r2.exit_code == 0, r2.output


@needs_fmnist
def test_verify_exits_1_above_tolerance(work):
    d = work[0]
    # the pruned export against the dense model: a real mismatch, not a user error
    r = invoke("verify", d / "pruned.onnx", "--model", "fmnist-vit", "--random-init", "--n", "8")
    assert r.exit_code == 1 and "FAIL" in r.stdout
    assert "Traceback" not in r.output
    # and with an absurd tolerance it passes
    r2 = invoke("verify", d / "pruned.onnx", "--model", "fmnist-vit", "--random-init", "--n", "8",
                "--atol", "1e6")
    assert r2.exit_code == 0


def test_verify_user_errors(work, tmp_path):
    d = work[0]
    assert_user_error(invoke("verify", tmp_path / "missing.onnx", "--against", d / "run"), "not found")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\x01garbage")
    assert_user_error(invoke("verify", bad, "--against", d / "run"), "not a valid ONNX model")
    assert_user_error(invoke("verify", d / "dense.onnx"), "either")
    assert_user_error(invoke("verify", d / "dense.onnx", "--against", tmp_path / "nope"), "not found")
    r = invoke("verify", d / "dense.onnx", "--model", "deit_tiny_patch16_224", "--random-init", "--n", "1")
    assert r.exit_code == 2 and "input shape mismatch" in r.stderr and "Traceback" not in r.output


# bench tests: tests/test_bench_cli.py


# ---------------------------------------------------------------------------------------------
# shared model options


def test_export_dense_timm_model_with_num_classes(tmp_path):
    """A 10-class random-init timm model exports dense (export takes --num-classes like every
    model command), and the ONNX output has 10 logits equal to the seeded PyTorch model's."""
    import numpy as np
    import onnxruntime as ort

    from edgeprune.loading import load_run_or_model

    out = tmp_path / "d10.onnx"
    r = invoke("export", "--model", "deit_tiny_patch16_224", "--random-init", "--num-classes", "10",
               "-o", out, "--no-check")
    assert r.exit_code == 0, r.output
    md = read_metadata(out)
    assert md["base_model"]["name"] == "deit_tiny_patch16_224" and md["base_model"]["num_classes"] == 10
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    y = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert y.shape == (1, 10)
    model = load_run_or_model(None, "deit_tiny_patch16_224", None, True, 10)[0]
    with torch.no_grad():
        ref = model(x).numpy()
    assert np.abs(y - ref).max() < 1e-4


def test_export_to_an_unwritable_place_is_one_line(tmp_path, monkeypatch):
    import errno
    import tempfile

    def refuse(*a, dir=None, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(dir))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    r = invoke("export", "--model", "fmnist-vit", "--random-init", "-o", tmp_path / "ro" / "m.onnx")
    assert_user_error(r, "cannot write", code=1)
    assert not (tmp_path / "ro" / "m.onnx").exists()
