"""The linter runs in the test command (issue 39): ``ruff check .`` with the rules of pyproject.toml
(pyflakes, pycodestyle errors, library lines <= 120 characters) finds nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = shutil.which("ruff")
    if exe:
        return [exe]
    pytest.importorskip("ruff", reason="ruff is in the [dev] extra")
    return [sys.executable, "-m", "ruff"]


def test_ruff_finds_nothing():
    r = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_sees_a_long_library_line(tmp_path):
    """The rule set catches what it should: a 121-character line in a library file (a copy of pyproject.toml's
    settings in a scratch tree)."""
    (tmp_path / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    pkg = tmp_path / "edgeprune"
    pkg.mkdir()
    (pkg / "long.py").write_text("X = '" + "a" * 115 + "'\n")  # 121 characters
    r = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", "."], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "E501" in r.stdout, r.stdout
