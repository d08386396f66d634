"""Every script in benchmarks/ imports and prints its --help, run the way the docs run it
(``python benchmarks/X.py`` from the repository root, in a subprocess); and the shared helper
module reads and writes what the scripts rely on. Fast: no model is built, nothing is timed."""

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


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_shows_help(script):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds the checkout itself
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and "--help" in proc.stdout
    assert "Traceback" not in proc.stderr


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
