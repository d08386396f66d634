"""``edgeprune.deploy(...)`` and the job functions (issue 53, item 3): the Python face of ``edgeprune deploy``
runs without the CLI and writes the numbers the command writes; each job through its Python face.

One CLI deploy and one Python deploy of fmnist-vit (32 calibration images, 64 evaluation images, --sparsity
0.5, int8 on the cpu profile, 2 bench iterations) are made once per module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import edgeprune
from edgeprune.errors import UserError
from exporters.onnx import read_metadata
from runners.registry import backend_available
from tests.conftest import needs_fmnist, run_cli
from tests.test_deploy import CPU_INT8

SETTINGS = {"model_name": "fmnist-vit", "calib_size": 32, "eval_size": 64, "bench_iterations": 2, "quiet": True,
            "sparsity": 0.5, "precision": "int8", "device": "cpu"}


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> tuple[Path, Path, object]:
    root = tmp_path_factory.mktemp("deploy_api")
    r = run_cli(["deploy", *CPU_INT8, "-o", root / "cli"])
    assert r.exit_code == 0, r.output
    result = edgeprune.deploy(root / "py", **SETTINGS)
    return root / "cli", root / "py", result


def _numbers(rep: dict) -> dict:
    """report.json without what differs between two runs of the same settings: timings and paths."""
    stages = [{k: v for k, v in s.items() if k != "seconds"} for s in rep["stages"]]
    quantize = {k: v for k, v in (rep["quantize"] or {}).items()}
    return {"deploy": rep["deploy"], "stages": stages, "table": rep["table"], "verify": rep["verify"],
            "quantize": quantize, "left": rep["left"], "heal": rep["heal"],
            "bench_rows": [(b.get("batch_size"), sorted(b)) for b in rep["bench"] or []]}


def test_the_deploy_package_imports_no_cli_module():
    code = ("import edgeprune.deploy, sys; print([m for m in sys.modules if m.startswith('edgeprune.cli')], "
            "'click' in sys.modules, callable(edgeprune.deploy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[] False True", out.stdout + out.stderr


@needs_fmnist
def test_python_deploy_writes_the_numbers_of_the_command(both):
    cli, py, result = both
    a, b = (json.loads((d / "report.json").read_text()) for d in (cli, py))
    na, nb = _numbers(a), _numbers(b)
    # the CLI's quantize stage also writes the recipe file of `edgeprune quantize` (a Python deploy: none)
    for s in na["stages"]:
        s["outputs"] = [o for o in s["outputs"] if not o.endswith(".recipe.toml")]
    assert na == nb
    ra, rb = (json.loads((d / "run" / "run.json").read_text()) for d in (cli, py))
    for key in ("params", "flops", "dense_params", "dense_flops", "evaluation", "achieved_sparsity"):
        assert ra[key] == rb[key], key
    assert result.report == b and result.report_json == py / "report.json" and result.report_md.is_file()
    assert result.stages == {s["stage"]: s["status"] for s in b["stages"]} and result.stopped is None
    assert (cli / "run" / "recipe.toml").is_file() and not (py / "run" / "recipe.toml").exists()


@needs_fmnist
def test_python_deploy_rerun_reuses_every_stage(both, capsys):
    _cli, py, _result = both
    stages = (py / "stages.json").read_text()
    edgeprune.deploy(py, **SETTINGS)
    assert capsys.readouterr().out.count("unchanged, reused") == 5  # prune, export, verify, quantize, bench
    assert (py / "stages.json").read_text() == stages


def test_python_deploy_refuses_bad_settings_in_one_line(tmp_path):
    with pytest.raises(UserError, match="two budgets") as err:
        edgeprune.deploy(tmp_path / "out", device="cpu", sparsity=0.5, flops="0.5")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="no budget"):
        edgeprune.deploy(tmp_path / "out", device="cpu")


@needs_fmnist
def test_export_equals_the_commands_onnx_file(both, tmp_path):
    cli, _py, _result = both
    got = edgeprune.export(tmp_path / "a.onnx", run_dir=cli / "run", echo=lambda *a, **k: None)
    r = run_cli(["export", cli / "run", "-o", tmp_path / "b.onnx"])
    assert r.exit_code == 0, r.output
    assert got.path == tmp_path / "a.onnx" and got.check["passed"]
    meta = read_metadata(got.path)
    assert meta == read_metadata(tmp_path / "b.onnx") and meta["base_model"] == got.metadata["base_model"]
    assert got.path.read_bytes() == (tmp_path / "b.onnx").read_bytes()
    with pytest.raises(UserError, match="exists"):
        edgeprune.export(got.path, run_dir=cli / "run")


@needs_fmnist
def test_verify_returns_the_agreement(both, tmp_path):
    cli, _py, _result = both
    res = edgeprune.verify(cli / "model.onnx", run_dir=cli / "run", n=64, json_out=tmp_path / "v.json")
    recorded = json.loads((cli / "verify.json").read_text())
    assert res.passed and res.report["max_abs_diff"] == recorded["max_abs_diff"] and res.report["n"] == 64
    assert json.loads((tmp_path / "v.json").read_text())["passed"] is True


@needs_fmnist
def test_quantize_writes_the_int8_file(both, tmp_path):
    cli, _py, _result = both
    res = edgeprune.quantize(cli / "model.onnx", tmp_path / "q.onnx", precision="int8", mode="dynamic",
                             eval_size=64, json_out=tmp_path / "q.json")
    assert res.path == tmp_path / "q.onnx" and read_metadata(res.path)["precision"] == "int8"
    expected = json.loads((cli / "quantize.json").read_text())
    assert res.report["agreement"] == expected["agreement"] and res.report["n"] == expected["n"]
    assert json.loads((tmp_path / "q.json").read_text())["output"] == str(res.path)
    assert not (tmp_path / "q.onnx.recipe.toml").exists()  # the recipe file is the CLI's


@needs_fmnist
def test_bench_returns_a_result(both, tmp_path):
    cli, _py, _result = both
    res = edgeprune.bench(cli / "model.onnx", device="cpu", batch_sizes=[1], iterations=1, warmup=0, memory=False,
                          json_out=tmp_path / "b.json")
    assert res.results and res.results[0].batch_size == 1 and res.profile.name == "cpu"
    assert res.written == [tmp_path / "b.json"] and "edgeprune bench" in (tmp_path / "b.json").read_text()


@needs_fmnist
def test_build_without_tensorrt_is_one_line(both):
    cli, _py, _result = both
    with pytest.raises(UserError, match="not TensorRT"):
        edgeprune.build(cli / "model.onnx", device="cpu")
    if backend_available("tensorrt") is None:
        pytest.skip("TensorRT is usable here")
    with pytest.raises(UserError) as err:
        edgeprune.build(cli / "model.onnx", device="orin-nx", output=cli / "x.engine", echo=lambda *a, **k: None)
    assert "\n" not in str(err.value) and not (cli / "x.engine").exists()
