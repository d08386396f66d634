"""The CLI end to end on fmnist-vit, and one-line errors for bad input."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from edgeprune.cli import main
from tests.conftest import needs_fmnist


def run(argv, capsys):
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code, err, pattern):
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    assert pattern in lines[0], lines[0]


@needs_fmnist
def test_prune_info_eval_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err = run(["prune", "--calib-size", "64", "--eval-size", "300", "--quiet", "-o", str(out)], capsys)
    assert code == 0, err
    assert "dense" in stdout and "pruned" in stdout and "top-1" in stdout
    rec = json.loads((out / "run.json").read_text())
    assert rec["method"] == "corp" and rec["sparsity"] == {"mlp": 0.5, "attn": 0.5}
    assert rec["calibration"]["num_images"] == 64
    assert rec["base_model"]["name"] == "fmnist-vit"
    assert all(b["mlp_hidden"] == 256 and b["qk_dim"] == 32 for b in rec["blocks"])
    assert 0 <= rec["evaluation"]["pruned"]["top1"] <= 1
    code, stdout, _ = run(["info", str(out)], capsys)
    assert code == 0 and "| 0 | 2 | 64 | 32 | 64 | 256 |" in stdout
    code, stdout, _ = run(["eval", str(out), "--eval-size", "200", "--quiet"], capsys)
    assert code == 0 and "top-1" in stdout and "agreement" in stdout
    for cmd in ("eval", "info"):  # a run and a model at once: one-line error, not a silent choice
        code, _, err = run([cmd, str(out), "--model", "fmnist-vit"], capsys)
        assert_one_line_error(code, err, "either a run directory or --model")
    code, _, err = run(["eval", str(tmp_path / "missing")], capsys)
    assert_one_line_error(code, err, "run directory not found")


@needs_fmnist
@pytest.mark.parametrize("args,pattern", [
    (["--sparsity", "1.0"], "sparsity must be in [0, 1)"),
    (["--sparsity", "-0.2"], "sparsity must be in [0, 1)"),
    (["--sparsity", "0.9", "--round-to", "64"], "leaves no dims"),
    (["--calib-size", "0"], "calibration size must be >= 1"),
    (["--model", "resnet_nope"], "unknown model"),
    (["--round-to", "0"], "--round-to must be >= 1"),
])
def test_prune_bad_input(tmp_path, capsys, args, pattern):
    out = tmp_path / "run"
    code, _, err = run(["prune", "--quiet", "--calib-size", "8", "--no-eval", "-o", str(out), *args], capsys)
    assert_one_line_error(code, err, pattern)
    assert not out.exists()


@needs_fmnist
def test_prune_refuses_existing_output(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run(["prune", "--quiet", "-o", str(out)], capsys)
    assert_one_line_error(code, err, "already exists")
    assert (out / "keep.txt").read_text() == "mine"


def test_corrupt_calibration_data(tmp_path, capsys):
    bad = tmp_path / "fm"
    bad.mkdir()
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        with gzip.open(bad / f"{stem}.gz", "wb") as fh:
            fh.write(b"\x00\x00\x08\x03" + b"\x00\x00\x00\x05" * 3 + b"\x01\x02")  # truncated
    code, _, err = run(["prune", "--quiet", "--calib", str(bad), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "truncated")
    code, _, err = run(["prune", "--quiet", "--calib", str(tmp_path / "nothing"), "-o", str(tmp_path / "r2")], capsys)
    assert_one_line_error(code, err, "dataset-fashion-mnist")


def _image_folder(root, n=4, size=32):
    from PIL import Image

    (root / "cls").mkdir(parents=True)
    for i in range(n):
        Image.fromarray((torch.rand(size, size, 3) * 255).byte().numpy()).save(root / "cls" / f"{i}.png")
    return root


def test_checkpoint_that_does_not_fit(tmp_path, capsys):
    from safetensors.torch import save_file

    calib = _image_folder(tmp_path / "calib")
    ck = tmp_path / "wrong.safetensors"
    save_file({"head.weight": torch.zeros(3, 3)}, str(ck))
    code, _, err = run(["prune", "--quiet", "--no-eval", "--model", "deit_tiny_patch16_224", "--checkpoint", str(ck),
                        "--calib", str(calib), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "does not fit deit_tiny_patch16_224")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    code, _, err = run(["prune", "--quiet", "--no-eval", "--model", "deit_tiny_patch16_224", "--checkpoint",
                        str(corrupt), "--calib", str(calib), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "cannot read checkpoint")


def test_calibration_and_evaluation_must_be_disjoint(tmp_path, capsys):
    calib = _image_folder(tmp_path / "imgs")
    code, _, err = run(["prune", "--quiet", "--model", "deit_tiny_patch16_224", "--random-init",
                        "--calib", str(calib), "--eval-data", str(calib), "-o", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, err, "overlap")


@needs_fmnist
def test_interrupted_prune_leaves_no_run_directory(tmp_path, capsys, monkeypatch):
    import edgeprune.api

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(edgeprune.api, "corp_prune", interrupted)
    out = tmp_path / "run"
    code, _, err = run(["prune", "--quiet", "--calib-size", "8", "-o", str(out)], capsys)
    assert code == 130 and "interrupted" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []
