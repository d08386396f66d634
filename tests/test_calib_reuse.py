"""Reuse what the run recorded (issue 42 item 5): the calibration folder, size, seed and content hash
are fields of the run record; ``quantize RUN``, ``heal RUN`` and ``eval RUN`` reuse the folder while
it is there and unchanged; without labels a timm run's quantized model is checked by its agreement
with the float model on held-out images of the folder (images the calibration did not use).

One small run: ``deit_tiny`` (1 block, 32 px, seeded random weights as a user's checkpoint: heal
needs real weights) calibrated on 8 of 24 random PNGs (an ImageFolder with one class folder: no labels that mean anything).
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

import pytest
import torch

from edgeprune.artifact import read_record
from edgeprune.jobs.calib_reuse import folder_sha256, heldout_source
from edgeprune.errors import UserError
from tests.conftest import assert_one_line_error, run_cli
from tests.test_bad_input import _checkpoint

MODEL = ["--model", "deit_tiny_patch16_224", "--random-init", "--model-kwargs", "depth=1", "--img-size", "32"]


def _pngs(root: Path, n: int, seed: int = 0) -> Path:
    from PIL import Image

    (root / "cls").mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        Image.fromarray((torch.rand(40, 40, 3, generator=g) * 255).byte().numpy()).save(root / "cls" / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib_reuse")
    imgs = _pngs(root / "imgs", 24)
    model = ["--model", "deit_tiny_patch16_224", "--checkpoint", _checkpoint(root), "--model-kwargs", "depth=1",
             "--img-size", "32"]
    res = run_cli(["prune", *model, "--calib", imgs, "--calib-size", "8", "--seed", "2", "--no-eval", "--quiet",
                   "--torch-device", "cpu", "-o", root / "run"])
    assert res.exit_code == 0, res.output
    return root / "run", imgs


def _copy(run, tmp_path):
    """A copy of the run and of its folder, the record pointing at the copy (tests that change it)."""
    src, imgs = run
    shutil.copytree(imgs, tmp_path / "imgs")
    shutil.copytree(src, tmp_path / "run")
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    rec["calibration"]["folder"] = str((tmp_path / "imgs").resolve())
    (tmp_path / "run" / "run.json").write_text(json.dumps(rec))
    return tmp_path / "run", tmp_path / "imgs"


def test_the_record_holds_folder_size_seed_and_hash(run):
    path, imgs = run
    cal = read_record(path)["calibration"]  # the record schema accepts the new fields
    assert cal["folder"] == str(imgs.resolve()) and cal["num_images"] == 8 and cal["seed"] == 2
    assert len(cal["folder_sha256"]) == 64
    files = sorted((imgs / "cls").iterdir())
    from edgeprune.data.sources import subset

    used = subset(files, [0] * len(files), 8, 2)[0]
    assert cal["folder_sha256"] == folder_sha256(imgs, [f.resolve() for f in used])
    assert (path / "recipe.toml").is_file()


def test_folder_hash_sees_content_names_and_new_files(tmp_path):
    imgs = _pngs(tmp_path / "a", 4)
    files = sorted((imgs / "cls").iterdir())
    h = folder_sha256(imgs, files[:2])
    assert folder_sha256(imgs, files[:2]) == h
    (imgs / "cls" / "new.png").write_bytes(files[3].read_bytes())  # a new file: the listing changes
    assert folder_sha256(imgs, files[:2]) != h
    (imgs / "cls" / "new.png").unlink()
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 1  # same size, other bytes: a used file changed
    files[0].write_bytes(bytes(data))
    assert folder_sha256(imgs, files[:2]) != h


def test_heldout_images_are_the_ones_the_calibration_did_not_use(run, tmp_path):
    from edgeprune.data.sources import subset
    from edgeprune.zoo.registry import spec_from_record

    path, imgs = run
    spec = spec_from_record(read_record(path)["base_model"])
    ev = heldout_source(spec, str(imgs), 8, 2)
    files = sorted((imgs / "cls").iterdir())
    used = set(subset(files, [0] * 24, 8, 2)[0])
    assert len(ev) == 16 and not used & set(ev.files) and not ev.labeled
    assert len(heldout_source(spec, str(imgs), 8, 2, eval_size=5)) == 5
    with pytest.raises(UserError, match="no held-out images: the calibration uses all 24 images"):
        heldout_source(spec, str(imgs), 24, 2)


def test_quantize_run_reuses_the_folder_and_reports_agreement_on_heldout_images(run, tmp_path):
    path, imgs = run
    out = tmp_path / "q.onnx"
    res = run_cli(["quantize", path, "--precision", "int8", "-o", out, "--json", tmp_path / "q.json"])
    assert res.exit_code == 0, res.output
    assert f"calibration: the run's folder {imgs.resolve()} (unchanged)" in res.stdout
    assert "8 images (seed 2)" in res.stdout  # the recorded size and seed
    rep = json.loads((tmp_path / "q.json").read_text())
    assert rep["n"] == 16 and rep.get("top1") is None and 0 <= rep["agreement"] <= 1  # no labels: no top-1
    assert "held-out images" in rep["eval_source"] and "top-1 on" not in res.stdout
    assert "agreement with the float model on 16 held-out images" in res.stdout
    assert (tmp_path / "q.onnx.recipe.toml").is_file()


def test_calib_overrides_and_a_missing_folder_says_so(run, tmp_path):
    path, imgs = _copy(run, tmp_path)
    other = _pngs(tmp_path / "other", 12, seed=5)
    res = run_cli(["quantize", path, "--precision", "fp16", "-o", tmp_path / "a.onnx", "--calib", other])
    assert res.exit_code == 0, res.output
    assert "the run's folder" not in res.stdout and "12 - 8" not in res.stdout
    shutil.rmtree(imgs)
    res = run_cli(["quantize", path, "--precision", "int8", "-o", tmp_path / "b.onnx"])
    assert_one_line_error(res, f"the run's calibration folder {imgs.resolve()} is gone (moved or deleted): "
                               "pass --calib DIR")  # issue 52: one line, the refusal itself


def test_a_changed_folder_is_said_in_one_line_and_used(run, tmp_path):
    path, imgs = _copy(run, tmp_path)
    _pngs(tmp_path / "more", 2, seed=9)
    shutil.copy(tmp_path / "more" / "cls" / "0.png", imgs / "cls" / "extra.png")
    res = run_cli(["eval", path, "--eval-size", "4"])
    assert res.exit_code == 0, res.output
    warn = [ln for ln in res.stderr.splitlines() + res.stdout.splitlines() if "changed since the run" in ln]
    assert len(warn) == 1 and warn[0].startswith("warning: the run's calibration folder")
    assert "agreement" in res.stdout and "top-1" not in res.stdout and "held-out images" in res.stdout


def test_eval_and_heal_reuse_the_folder(run, tmp_path):
    path, imgs = run
    res = run_cli(["eval", path, "--json", tmp_path / "m.json"])
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "m.json").read_text())
    assert "top1" not in m and 0 <= m["agreement"] <= 1
    res = run_cli(["heal", path, "--epochs", "1", "--no-eval", "--quiet", "--torch-device", "cpu",
                   "-o", tmp_path / "healed"])
    assert res.exit_code == 0, res.output
    assert f"calibration: the run's folder {imgs.resolve()} (unchanged)" in res.stdout
    cal = read_record(tmp_path / "healed")["calibration"]
    assert cal["seed"] == 2 and cal["size_requested"] == 8 and cal["folder"] == str(imgs.resolve())
    recipe = tomllib.loads((tmp_path / "healed" / "recipe.toml").read_text())  # the values used
    assert recipe["data"]["seed"] == 2 and recipe["data"]["calib"] == str(imgs.resolve())
    assert recipe["model"]["run-dir"] == str(path)


def test_quantize_without_any_folder_still_asks_for_calib(tmp_path):
    res = run_cli(["prune", *MODEL, "--calib", _pngs(tmp_path / "i", 6), "--calib-size", "4", "--no-eval",
                   "--quiet", "--torch-device", "cpu", "-o", tmp_path / "r"])
    assert res.exit_code == 0, res.output
    rec = json.loads((tmp_path / "r" / "run.json").read_text())
    del rec["calibration"]["folder"]  # a run of an older edgeprune
    (tmp_path / "r" / "run.json").write_text(json.dumps(rec))
    assert_one_line_error(run_cli(["quantize", tmp_path / "r", "--precision", "int8", "-o", tmp_path / "q.onnx"]),
                          "pass --calib DIR")
