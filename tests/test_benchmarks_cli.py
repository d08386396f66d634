"""Every script in benchmarks/ imports and prints its --help, run the way the docs run it
(``python benchmarks/X.py`` from the repository root, in a subprocess); and the shared helper
module reads and writes what the scripts rely on. Fast: no model is built, nothing is timed.

The scripts' ``--help`` runs in one subprocess (issue 43: 13 fresh interpreters importing torch took 34 s of the
suite): :data:`DRIVER` runs each script as ``python benchmarks/X.py --help`` would -- ``__main__``, ``sys.argv``,
``sys.path[0]`` the script's folder, and none of the checkout's modules imported (they are dropped between
scripts, so each script must find the checkout itself); only third-party imports (torch, timm) are shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name not in ("__init__.py", "common.py"))

sys.path.insert(0, str(ROOT))
from benchmarks import common  # noqa: E402


def test_the_scripts_are_found():
    assert "bench_latency.py" in SCRIPTS and "accuracy_table.py" in SCRIPTS and len(SCRIPTS) >= 10


DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
root = os.getcwd()
base_path, base_modules = list(sys.path[1:]), set(sys.modules)
out = {}
for script in sys.argv[1:]:  # a name in benchmarks/ or a path
    for name in [n for n in sys.modules if n not in base_modules]:  # the checkout's modules: imported afresh
        f = os.path.abspath(getattr(sys.modules[name], "__file__", None) or os.sep)
        if f.startswith(root + os.sep) and not f.startswith(sys.prefix + os.sep):  # not a venv inside it
            del sys.modules[name]
    path = os.path.join(root, "benchmarks", script)  # an absolute script path stays as it is
    sys.path[:] = [os.path.dirname(path), *base_path]  # as `python benchmarks/X.py` starts
    sys.argv = [path, "--help"]
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    out[script] = {"returncode": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
sys.__stdout__.write("\n@@" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    """Each script's ``--help`` (returncode, stdout, stderr), all run by :data:`DRIVER` in one subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the checkout itself
    proc = subprocess.run([sys.executable, "-c", DRIVER, *SCRIPTS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "\n@@" in proc.stdout, proc.stderr[-2000:]
    return json.loads(proc.stdout.rsplit("\n@@", 1)[1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_shows_help(script, helps):
    res = helps[script]
    assert res["returncode"] == 0, res["stderr"][-2000:]
    assert res["stdout"].startswith("usage:") and "--help" in res["stdout"]
    assert "Traceback" not in res["stderr"]


def test_the_help_driver_sees_a_script_that_does_not_find_the_checkout(tmp_path):
    """The driver's isolation is real: a script that imports ``benchmarks.common`` without putting the checkout
    on ``sys.path`` fails in it, after a script that did (the module it imported is not reused)."""
    bad = tmp_path / "probe_no_path.py"
    bad.write_text("import argparse\nfrom benchmarks import common  # noqa: F401\n"
                   "argparse.ArgumentParser().parse_args()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, "pareto.py", str(bad)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    res = json.loads(proc.stdout.rsplit("\n@@", 1)[1])
    assert res["pareto.py"]["returncode"] == 0
    assert res[str(bad)]["returncode"] == 1 and "ModuleNotFoundError" in res[str(bad)]["stderr"]


def test_lists_top1_and_ratios():
    assert common.floats("0.3, 0.5,") == [0.3, 0.5] and common.ints("1,8") == [1, 8]
    assert common.names(" a ,, b") == ["a", "b"]

    class Pick(torch.nn.Module):  # logits = the input: the prediction is the argmax of x
        def forward(self, x):
            return x

    x = torch.eye(4)
    batches = [(x[:2], torch.tensor([0, 0])), (x[2:], torch.tensor([2, 3]))]
    dense = common.top1(Pick(), batches)
    assert dense["top1"] == 0.75 and dense["agreement"] == 1.0
    other = common.top1(Pick(), [(x[:2], torch.tensor([0, 1])), (x[[3, 3]], torch.tensor([2, 3]))], dense["preds"])
    assert other["top1"] == 0.75 and other["agreement"] == 0.75
    assert common.ratios({"flops": 5, "dense_flops": 10, "params": 3, "dense_params": 4}) == (0.5, 0.75)


def test_noise_is_seeded_and_shaped():
    class Spec:
        name, input_size = "deit_tiny_patch16_224", (3, 8, 8)

    a, b = common.noise(Spec, 2, 0), common.noise(Spec, 2, 0)
    assert a.shape == (2, 3, 8, 8) and torch.equal(a, b) and not torch.equal(a, common.noise(Spec, 2, 1))
    assert torch.equal(common.calibration(Spec, 2, 0), a)  # not a zoo model: noise


def test_write_json_and_write_between(tmp_path):
    path = common.write_json(tmp_path / "sub" / "r.json", {"rows": [1]}, "tool_x", ["--a", "1"])
    doc = json.loads(path.read_text())
    assert doc["rows"] == [1] and doc["tool"] == "tool_x" and doc["argv"] == ["--a", "1"] and doc["machine"]
    md = tmp_path / "d.md"
    md.write_text("# T\n\ntext\n")
    common.write_between(md, "<!-- s -->", "<!-- e -->", "one", heading="## m")
    common.write_between(md, "<!-- s -->", "<!-- e -->", "two", heading="## m")
    assert md.read_text() == "# T\n\ntext\n\n## m\n\n<!-- s -->\ntwo\n<!-- e -->\n"
