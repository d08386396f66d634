"""The torchvision-on-CPU-torch workaround (pytorch/vision#9085), tested in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_import_edgeprune_then_timm_works():
    r = _run("import edgeprune, timm; from edgeprune import _compat; "
             "m = timm.create_model('deit_tiny_patch16_224', pretrained=False); "
             "print('ok', _compat.TORCHVISION_OPS_MISSING)")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok")


def test_workaround_applies_exactly_when_plain_import_fails():
    plain = _run("import torchvision")
    ours = _run("from edgeprune import _compat; _compat.import_torchvision(); "
                "import torchvision.transforms; print(_compat.TORCHVISION_OPS_MISSING)")
    assert ours.returncode == 0, ours.stderr[-2000:]
    missing = ours.stdout.strip() == "True"
    if plain.returncode != 0:
        assert "torchvision::" in plain.stderr and "does not exist" in plain.stderr
        assert missing
    else:
        assert not missing


def test_cli_help_runs():
    r = subprocess.run([sys.executable, "-m", "edgeprune.cli", "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for cmd in ("prune", "eval", "info"):
        assert cmd in r.stdout
