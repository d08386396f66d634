"""``edgeprune deploy`` (issue 42), the rest: the heal stage (resume, a changed heal setting, its
report row, its recipe section, its bad values), per-model memory (``bench --vs`` and the deploy
report: each model's weights and its own peak, each measured in its own process), the
latency/accuracy plot ``OUT/report.png``, and Ctrl-C during the prune stage.

One healed deploy of fmnist-vit (32 calibration images, 64 evaluation images, --sparsity 0.5, fp32,
1 heal epoch) is made once per module; the other tests work on copies of its folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgeprune.deploy.plot import write_plot
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli
from tests.test_deploy import _copy, _mtimes, _stages

FAST = ["--model", "fmnist-vit", "--calib-size", "32", "--eval-size", "64", "--bench-iterations", "2", "--quiet"]
HEALED = FAST + ["--sparsity", "0.5", "--precision", "fp32", "--device", "cpu", "--heal", "--heal-epochs", "1"]




@pytest.fixture(scope="module")
def healed(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("deploy-heal") / "out"
    r = run_cli(["deploy", *HEALED, "-o", out])
    assert r.exit_code == 0, r.output
    return out



@needs_fmnist
def test_heal_stage_heals_the_pruned_run_and_reports_it(healed):
    rec = json.loads((healed / "healed" / "run.json").read_text())
    rep = json.loads((healed / "report.json").read_text())
    status = {s["stage"]: s["status"] for s in rep["stages"]}
    assert status["heal"] == "done" and status["export"] == "done" and status["quantize"] == "skipped"
    heal_row = next(s for s in rep["stages"] if s["stage"] == "heal")
    assert heal_row["seconds"] > 0 and "1 epochs" in heal_row["what"]
    h = rep["heal"]  # the numbers `edgeprune heal` records and prints
    assert (h["initial_loss"], h["final_loss"]) == (rec["healing"]["initial_loss"], rec["healing"]["final_loss"])
    assert h["epochs"] == 1 == rec["healing"]["config"]["epochs"]
    assert rep["table"]["pruned"]["top1"] == rec["evaluation"]["pruned"]["top1"]  # the healed model's
    assert rep["table"]["unhealed"]["top1"] == rec["evaluation"]["before_healing"]["top1"]
    assert rec["healing"]["input_run"].endswith("run")  # healed from the prune's run
    md = (healed / "report.md").read_text()
    assert "Healed (STARFISH): alignment loss (cosine)" in md and f"{h['initial_loss']:.5f} ->" in md
    assert json.loads((healed / "verify.json").read_text())["passed"]


@needs_fmnist
def test_recipe_heal_section_replays_the_healed_deploy(healed, tmp_path):
    out = _copy(healed, tmp_path)
    recipe = tmp_path / "deploy.toml"
    recipe.write_text('[model]\nmodel = "fmnist-vit"\n[data]\ncalib-size = 32\neval-size = 64\n'
                      '[budget]\nsparsity = 0.5\n[method]\nprecision = "fp32"\n[heal]\nheal = true\nheal-epochs = 1\n'
                      '[runtime]\ndevice = "cpu"\nbench-iterations = 2\nquiet = true\n')
    before = _mtimes(out)
    r = run_cli(["deploy", "--config", recipe, "-o", out])
    assert r.exit_code == 0, r.output
    assert r.stdout.count("unchanged, reused") == 5 and _mtimes(out) == before  # prune heal export verify bench


@needs_fmnist
def test_changed_heal_setting_redoes_heal_and_after_and_an_interrupted_heal_resumes(healed, tmp_path, monkeypatch):
    """--heal-epochs 2: Ctrl-C inside the heal (exit 130, prune kept); the rerun reuses the prune and
    redoes heal, export, verify and bench."""
    import edgeprune.jobs.heal_run as heal_mod

    out = _copy(healed, tmp_path)
    old = _stages(out)
    args = [a if a != "1" else "2" for a in HEALED]

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(heal_mod, "heal", interrupt)
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 130 and "interrupted" in r.stderr
    assert _stages(out)["prune"] == old["prune"] and not (out / "healed").exists()
    monkeypatch.undo()
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 0, r.output
    assert "== prune: unchanged, reused" in r.stdout
    for stage in ("heal", "export", "verify", "bench"):
        assert f"== {stage}: unchanged" not in r.stdout, stage
    new = _stages(out)
    assert new["prune"] == old["prune"] and new["heal"]["settings"] != old["heal"]["settings"]
    assert json.loads((out / "healed" / "run.json").read_text())["healing"]["config"]["epochs"] == 2
    assert new["export"]["outputs"]["model.onnx"] != old["export"]["outputs"]["model.onnx"]  # the new weights
    assert not (out / "healed.partial").exists() and not (out / "healed.partial.json").exists()


@needs_fmnist
def test_deploy_report_has_each_models_own_memory_and_the_plot(healed):
    rep = json.loads((healed / "report.json").read_text())
    mem = rep["memory"]
    assert mem["deployed"]["model"] == "model.onnx" and mem["dense"]["model"] == "dense.onnx"
    for m in mem.values():
        assert m["peak_rss_mib"] > 0 and m["baseline_rss_mib"] > 0 and m["weights_source"] == "file"
    assert mem["dense"]["weights_mib"] > mem["deployed"]["weights_mib"] > 0  # x0.59 params
    assert mem["deployed"]["weights_mib"] == pytest.approx((healed / "model.onnx").stat().st_size / 2**20)
    md = (healed / "report.md").read_text()
    assert "Memory of the deployed model (`model.onnx`, in its own process)" in md
    assert "](report.png)" in md and (healed / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_fmnist
def test_plot_is_skipped_in_one_line_without_matplotlib(healed, tmp_path, monkeypatch):
    import sys

    data = json.loads((healed / "report.json").read_text())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    line = write_plot(tmp_path, data)
    assert "plot skipped: matplotlib is not installed" in line and not (tmp_path / "report.png").exists()
    monkeypatch.undo()
    assert write_plot(tmp_path, data).endswith("(report.png)") and (tmp_path / "report.png").is_file()
    assert write_plot(tmp_path, {**data, "bench": None}).startswith("No latency") and not (
        tmp_path / "report.png").exists()


def _matmul_onnx(path: Path, k: int, n: int, external: bool = False) -> Path:
    """(B, 1, 1, k) @ W (k, n): one float32 constant, in the file or in ``<name>.data`` beside it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n), dtype=np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "m",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 1, 1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 1, 1, n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    if external:
        onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    else:
        onnx.save(model, path)
    return path


def test_bench_vs_reports_each_models_weights_and_own_peak(tmp_path):
    big = _matmul_onnx(tmp_path / "big.onnx", 1024, 16384)  # 64 MiB of weights
    small = _matmul_onnx(tmp_path / "small.onnx", 1024, 16)  # 64 KiB
    r = run_cli(["bench", big, "--vs", small, "--device", "cpu", "--batch-sizes", "1", "--iterations", "1",
                 "--warmup", "0", "--json", tmp_path / "b.json"])
    assert r.exit_code == 0, r.output
    mem = json.loads((tmp_path / "b.json").read_text())["memory"]
    a, b = mem["a"], mem["b"]
    assert a["weights_mib"] == pytest.approx(big.stat().st_size / 2**20) and a["weights_mib"] > 64
    assert 0 < b["weights_mib"] < 1
    for m in (a, b):
        assert m["peak_rss_mib"] >= m["baseline_rss_mib"] > 0
    # each process holds only its own model: the 64 MiB constant is resident in A's process only
    assert (a["peak_rss_mib"] - a["baseline_rss_mib"]) > (b["peak_rss_mib"] - b["baseline_rss_mib"]) + 32
    assert "| A = big.onnx | 64.0 |" in r.stdout and "| B = small.onnx | 0.1 |" in r.stdout
    r = run_cli(["bench", big, "--vs", small, "--device", "cpu", "--batch-sizes", "1", "--iterations", "1",
                 "--warmup", "0", "--no-memory", "--json", tmp_path / "c.json"])
    assert r.exit_code == 0, r.output
    assert "memory" not in json.loads((tmp_path / "c.json").read_text()) and "own process" not in r.stdout


@needs_fmnist
@pytest.mark.parametrize("where", ["computing", "writing the run"])
def test_ctrl_c_during_the_prune_stage_then_a_rerun_finishes(where, tmp_path, monkeypatch):
    """KeyboardInterrupt inside the prune stage (while it computes, or after it wrote run/ but before
    it finished): exit 130, no finished stage recorded, no temporary left; the rerun finishes."""
    import edgeprune.cli.deploy_cmd as deploy_cmd_mod
    import edgeprune.jobs.prune_run as prune_mod

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    if where == "computing":
        monkeypatch.setattr(prune_mod.api, "prune", interrupt)
    else:
        monkeypatch.setattr(deploy_cmd_mod, "write_recipe", interrupt)
    out = tmp_path / "out"
    args = FAST + ["--sparsity", "0.5", "--precision", "fp32", "--device", "cpu", "--no-bench"]
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 130 and "interrupted" in r.stderr
    stages = _stages(out) if (out / "stages.json").exists() else {}
    assert "prune" not in stages and not (out / "report.md").exists()
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert (out / "run").exists() == (where == "writing the run")  # atomic: all of run/ or nothing
    monkeypatch.undo()
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 0, r.output
    assert "== prune: prune fmnist-vit" in r.stdout and (out / "run" / "recipe.toml").is_file()
    assert _stages(out)["prune"]["status"] == "done" and (out / "report.md").is_file()
    r = run_cli(["deploy", *args, "-o", out])
    assert r.exit_code == 0 and r.stdout.count("unchanged, reused") == 3  # prune, export, verify


@pytest.mark.parametrize("args, pattern", [
    (["--heal-epochs", "2"], "--heal-epochs goes with --heal"),
    (["--heal-lr", "1e-4"], "--heal-lr goes with --heal"),
    (["--no-heal", "--heal-epochs", "2"], "--heal-epochs goes with --heal"),
    (["--heal", "--heal-epochs", "0"], "heal-epochs"),
    (["--heal", "--heal-epochs", "x"], "heal-epochs"),
    (["--heal", "--heal-lr", "0"], "--heal-lr (the heal's learning rate) must be > 0"),
    (["--heal", "--heal-lr", "-1e-3"], "must be > 0"),
    (["--heal", "--heal-lr", "nan"], "heal-lr"),
    (["--heal", "--heal-lr", "fast"], "heal-lr"),
])
def test_bad_heal_options_are_one_line(args, pattern, tmp_path):
    r = run_cli(["deploy", "--sparsity", "0.5", "--device", "cpu", *args, "-o", tmp_path / "out"])
    assert_one_line_error(r, pattern)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text, pattern", [
    ("[heal]\nheal-epochs = 0\n", "heal-epochs = 0"),
    ("[heal]\nheal-lr = \"fast\"\n", "heal-lr"),
    ("[heal]\nheal = \"yes\"\n", "heal = \"yes\": wants true or false"),
    ("[method]\nheal-epochs = 2\n", "belongs in [heal]"),
    ("[heal]\nepochs = 2\n", "epochs: unknown key"),
    ("[heal]\nheal-epochs = 2\n", "--heal-epochs goes with --heal"),
    ("[heal]\nheal = true\nheal-lr = -1.0\n", "must be > 0"),
])
def test_bad_heal_recipe_keys_are_one_line(text, pattern, tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[budget]\nsparsity = 0.5\n[runtime]\ndevice = "cpu"\n' + text)
    assert_one_line_error(run_cli(["deploy", "--config", recipe, "-o", tmp_path / "out"]), pattern)
    assert not (tmp_path / "out").exists()


def test_bench_memory_needs_no_value_and_no_memory_is_refused_a_value(tmp_path):
    assert_one_line_error(run_cli(["bench", "x.onnx", "--memory=yes"]), "memory", code=2)
