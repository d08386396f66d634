"""``edgeprune deploy`` (issue 42): every stage's output, a report equal to the separate commands'
outputs, reruns that redo nothing, a changed setting that redoes that stage and the later ones, an
interrupted deploy that resumes, the stop before ``build`` without TensorRT, and bad input in one line.

One deploy of fmnist-vit (32 calibration images, 64 evaluation images, --sparsity 0.5, int8) is made
once per module; the other tests work on copies of its folder (``copytree`` keeps the mtimes).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from edgeprune.artifact import read_record
from exporters.onnx import read_metadata
from runners.registry import backend_available
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli
from tests.test_help import _shown

FAST = ["--model", "fmnist-vit", "--calib-size", "32", "--eval-size", "64", "--bench-iterations", "2", "--quiet"]
CPU_INT8 = FAST + ["--sparsity", "0.5", "--precision", "int8", "--device", "cpu"]


def _mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*")) if p.is_file()}


def _stages(folder: Path) -> dict:
    return json.loads((folder / "stages.json").read_text())["stages"]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deploy") / "out"
    r = run_cli(["deploy", *CPU_INT8, "-o", out])
    assert r.exit_code == 0, r.output
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)  # copy2: the mtimes are kept
    return dst


@needs_fmnist
def test_deploy_writes_every_stage_and_a_report_of_their_numbers(deployed):
    for f in ("run/run.json", "model.onnx", "dense.onnx", "verify.json", "model-int8.onnx", "quantize.json",
              "bench.json", "bench.md", "report.md", "report.json", "stages.json"):
        assert (deployed / f).is_file(), f
    rep = json.loads((deployed / "report.json").read_text())
    rec = read_record(deployed / "run")
    assert rep["table"]["pruned"]["params"] == rec["params"] and rep["table"]["pruned"]["flops"] == rec["flops"]
    assert rep["table"]["dense"]["flops"] == rec["dense_flops"] and rec["flops"] < rec["dense_flops"]
    assert rep["table"]["pruned"]["top1"] == rec["evaluation"]["pruned"]["top1"]
    meta = read_metadata(deployed / "model-int8.onnx")
    assert meta["precision"] == "int8" and meta["quantization"]["mode"] == "dynamic"  # the cpu profile's int8
    assert rep["quantize"]["agreement"] == meta["quant_eval"]["agreement"]
    assert rep["quantize"]["top1"] == meta["quant_eval"]["top1"]
    assert rep["verify"] == {k: json.loads((deployed / "verify.json").read_text())[k]
                             for k in ("passed", "n", "max_abs_diff", "atol")}
    status = {s["stage"]: s["status"] for s in rep["stages"]}
    assert status == {"prune": "done", "heal": "skipped", "export": "done", "verify": "done", "quantize": "done",
                      "build": "skipped", "bench": "done"}
    assert rep["left"] == [] and "| pruned |" in (deployed / "report.md").read_text()


@needs_fmnist
def test_report_equals_the_separate_quantize_command(deployed, tmp_path):
    """`edgeprune quantize` of the exported file with the same settings measures the same agreement."""
    r = run_cli(["quantize", deployed / "model.onnx", "--precision", "int8", "--mode", "dynamic", "--eval-size",
                 "64", "--calib-size", "32", "-o", tmp_path / "q.onnx", "--json", tmp_path / "q.json"])
    assert r.exit_code == 0, r.output
    alone = json.loads((tmp_path / "q.json").read_text())
    rep = json.loads((deployed / "report.json").read_text())["quantize"]
    assert (rep["agreement"], rep["top1"], rep["n"]) == (alone["agreement"], alone["top1"], alone["n"])


@needs_fmnist
def test_rerun_redoes_nothing(deployed, tmp_path):
    out = _copy(deployed, tmp_path)
    before, stages = _mtimes(out), (out / "stages.json").read_bytes()
    r = run_cli(["deploy", *CPU_INT8, "-o", out])
    assert r.exit_code == 0, r.output
    assert r.stdout.count("unchanged, reused") == 5
    assert (out / "stages.json").read_bytes() == stages and _mtimes(out) == before


@needs_fmnist
def test_changed_precision_redoes_quantize_and_after_only(deployed, tmp_path):
    out = _copy(deployed, tmp_path)
    before, old = _mtimes(out), _stages(out)
    args = [a if a != "int8" else "fp16" for a in CPU_INT8]
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 0, r.output
    after, new = _mtimes(out), _stages(out)
    for name in ("prune", "export", "verify"):
        assert new[name] == old[name], name
    kept = [f for f in before if f.startswith("run/") or f in ("model.onnx", "dense.onnx", "verify.json")]
    assert kept and all(after[f] == before[f] for f in kept)
    assert new["quantize"]["settings"] != old["quantize"]["settings"] and after["bench.json"] != before["bench.json"]
    assert read_metadata(out / "model-fp16.onnx")["precision"] == "fp16"
    assert not (out / "model-int8.onnx").exists()  # the earlier stage's output went with it


@needs_fmnist
def test_interrupted_deploy_resumes(deployed, tmp_path, monkeypatch):
    """Ctrl-C in the bench stage (after a redone quantize): exit 130; the rerun reuses quantize."""
    import edgeprune.deploy.plan as deploy_mod

    out = _copy(deployed, tmp_path)
    args = [a if a != "int8" else "fp16" for a in CPU_INT8]
    real = deploy_mod.bench

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(deploy_mod, "bench", interrupt)
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 130 and "interrupted" in r.stderr
    quantized = _stages(out)["quantize"]
    assert quantized["status"] == "done" and (out / "model-fp16.onnx").is_file()
    monkeypatch.setattr(deploy_mod, "bench", real)
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 0, r.output
    assert "== quantize: unchanged, reused" in r.stdout and "== bench: bench" in r.stdout
    assert _stages(out)["quantize"] == quantized and _stages(out)["bench"]["status"] == "done"


@needs_fmnist
@pytest.mark.skipif(backend_available("tensorrt") is None, reason="TensorRT is usable here")
def test_tensorrt_profile_without_tensorrt_stops_before_build(deployed, tmp_path):
    out = _copy(deployed, tmp_path)
    args = [a for a in FAST] + ["--sparsity", "0.5", "--device", "orin-nx", "--torch-device", "cpu"]
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 0, r.output
    last = r.stdout.strip().splitlines()[-1]
    assert f"edgeprune build {out / 'model-fp16.onnx'} --device orin-nx -o {out / 'model.engine'}" in last
    assert "== prune: unchanged, reused" in r.stdout  # the prune does not depend on the profile
    rep = json.loads((out / "report.json").read_text())
    assert rep["left"] == ["build", "bench"] and rep["deploy"]["precision"] == "fp16"  # orin-nx builds fp16
    assert read_metadata(out / "model-fp16.onnx")["precision"] == "fp16"
    assert not (out / "bench.json").exists() and not (out / "model.engine").exists()
    assert "Left to do on the device: build, bench" in (out / "report.md").read_text()


@needs_fmnist
def test_config_file_replays_the_deploy(deployed, tmp_path):
    out = _copy(deployed, tmp_path)
    recipe = tmp_path / "deploy.toml"
    recipe.write_text('[model]\nmodel = "fmnist-vit"\n[data]\ncalib-size = 32\neval-size = 64\n'
                      '[budget]\nsparsity = 0.5\n[method]\nprecision = "int8"\n[runtime]\ndevice = "cpu"\n'
                      f'bench-iterations = 2\nquiet = true\n[output]\nout = "{out}"\n')
    before = _mtimes(out)
    r = run_cli(["deploy", "--config", recipe])
    assert r.exit_code == 0, r.output
    assert r.stdout.count("unchanged, reused") == 5 and _mtimes(out) == before


def test_deploy_help_is_grouped():
    r = run_cli(["deploy", "--help"])
    assert r.exit_code == 0, r.output
    shown = _shown(r.stdout)
    assert 10 <= len(shown) <= 15 and "--bench-iterations" not in shown and "--help-all" in shown, shown
    every = _shown(run_cli(["deploy", "--help-all"]).stdout)
    assert set(shown) < set(every) and {"--bench-iterations", "--torch-device", "--seed"} <= set(every)


@pytest.mark.parametrize("args, pattern", [
    (["--sparsity", "0.5", "--flops", "0.6", "--device", "cpu"], "two budgets"),
    (["--flops", "0.6", "--latency", "0.5", "--device", "cpu"], "two budgets"),
    (["--device", "cpu"], "no budget"),
    (["--sparsity", "0.5", "--device", "no-such-profile"], "no-such-profile"),
    (["--sparsity", "0.5"], "--device"),
    (["--sparsity", "0.5", "--device", "cpu", "--latency-table", "t.json"], "--latency-table goes with --latency"),
    (["--sparsity", "0.5", "--device", "cpu", "--precision", "int4"], "int4"),
    (["--sparsity", "0.5", "--device", "cpu", "--calib", "/no/such/dir"], "/no/such/dir"),
    (["--sparsity", "0.5", "--device", "cpu", "--bench-iterations", "0"], "bench-iterations"),
])
def test_bad_values_and_conflicts_are_one_line(args, pattern, tmp_path):
    assert_one_line_error(run_cli(["deploy", *args, "-o", tmp_path / "out"]), pattern)
    assert not (tmp_path / "out").exists()


def test_out_must_be_a_new_or_deploy_folder(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line_error(run_cli(["deploy", "--sparsity", "0.5", "--device", "cpu", "-o", f]), "is a file")
    d = tmp_path / "d"
    d.mkdir()
    (d / "mine.txt").write_text("x")
    assert_one_line_error(run_cli(["deploy", "--sparsity", "0.5", "--device", "cpu", "-o", d]), "not a deploy folder")
    assert os.listdir(d) == ["mine.txt"]


def test_recipe_with_two_budgets_or_an_unknown_key_is_one_line(tmp_path):
    bad = tmp_path / "two.toml"
    bad.write_text('[budget]\nsparsity = 0.5\nflops = "0.6"\n[runtime]\ndevice = "cpu"\n')
    assert_one_line_error(run_cli(["deploy", "--config", bad, "-o", tmp_path / "o"]), "two budgets")
    bad.write_text('[method]\nprecison = "int8"\n')
    assert_one_line_error(run_cli(["deploy", "--config", bad, "-o", tmp_path / "o"]), "precison")
