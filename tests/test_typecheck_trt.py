"""Type-check the TensorRT code against tensorrt-stubs with mypy (``mypy-trt.ini``).

TensorRT itself cannot be installed here, so its API is checked statically: a misspelt
method, a wrong argument type or a TensorRT 8 call removed in 10 (``build_engine``,
``get_binding_shape``, ...) fails this test.

tensorrt-stubs installs ``tensorrt/__init__.pyi`` with no ``py.typed`` marker (mypy skips such a
package in site-packages) and with two syntax errors (a parameter named ``in``; a required
parameter after defaulted ones). :func:`prepare_stubs` copies the stubs into a folder, fixes
exactly those, and the test runs mypy with ``MYPYPATH`` pointing there.

Run by hand: ``python tests/test_typecheck_trt.py [extra files]``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "mypy-trt.ini"
# The TensorRT API users first; the rest of the deployment code rides along (seconds more).
TARGETS = ["exporters/tensorrt.py", "exporters/tensorrt_settings.py", "exporters/trtexec.py",
           "runners/tensorrt/__init__.py", "runners/tensorrt/cuda.py", "runners/tensorrt/engine.py",
           "runners/tensorrt/runner.py", "runners/tensorrt/inspect.py", "runners/tensorrt/check.py",
           "runners/tensorrt/bench.py", "devices/gpu.py", "runners/registry.py", "runners/bench.py",
           "devices/__init__.py", "devices/fields.py", "devices/profile.py", "edgeprune/cli/device.py"]
STUB_PACKAGES = ("tensorrt", "tensorrt_bindings")


def _stub_files() -> list[tuple[str, Path]]:
    """(relative path, absolute path) of the .pyi files tensorrt-stubs installed."""
    dist = importlib.metadata.distribution("tensorrt-stubs")
    out = []
    for f in dist.files or []:
        rel = str(f)
        if rel.endswith(".pyi") and rel.split("/", 1)[0] in STUB_PACKAGES:
            out.append((rel, Path(str(dist.locate_file(f)))))
    return out


def _fix(text: str) -> str:
    # `def f(self, in: list[...], out: ...)`: `in` is a keyword.
    text = re.sub(r"([(,]\s*)in(\s*:)", r"\1in_\2", text)
    # A parameter without default after defaulted ones (add_scale_nd's channel_axis).
    text = text.replace("power: Weights = None, channel_axis: int)", "power: Weights = None, channel_axis: int = ...)")
    return text


def prepare_stubs(dest: Path) -> Path:
    """Copy and fix tensorrt-stubs under ``dest``; returns ``dest``."""
    files = _stub_files()
    if not files:
        raise FileNotFoundError("tensorrt-stubs has no .pyi files")
    for rel, src in files:
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_fix(src.read_text(encoding="utf-8")), encoding="utf-8")
    return dest


def run_mypy(stub_dir: Path, targets: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["MYPYPATH"] = str(stub_dir)
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(CONFIG), "--no-incremental",
           *(targets or TARGETS)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _skip_reason() -> str | None:
    if importlib.util.find_spec("mypy") is None:
        return "mypy is not installed (pip install mypy)"
    try:
        importlib.metadata.distribution("tensorrt-stubs")
    except importlib.metadata.PackageNotFoundError:
        return "tensorrt-stubs is not installed (pip install --no-deps tensorrt-stubs)"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_tensorrt_code_typechecks(tmp_path: Path) -> None:
    stubs = prepare_stubs(tmp_path / "stubs")
    res = run_mypy(stubs)
    assert res.returncode == 0, f"mypy failed:\n{res.stdout}\n{res.stderr}"


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_mypy_catches_tensorrt_api_misuse(tmp_path: Path) -> None:
    """The check is real: TensorRT 8-era and misspelt calls in a scratch module fail it."""
    stubs = prepare_stubs(tmp_path / "stubs")
    bad = tmp_path / "bad_trt_usage.py"
    bad.write_text(
        "import tensorrt as trt\n"
        "def f(builder: trt.Builder, network: trt.INetworkDefinition) -> None:\n"
        "    config = builder.create_builder_config()\n"
        "    config.max_workspace_size = 1 << 30\n"          # removed in TensorRT 10
        "    builder.build_engine(network, config)\n"          # removed in TensorRT 10
        "    config.set_flag(trt.BuilderFlag.FP17)\n"          # no such flag
        "    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, '1G')\n"  # wrong type
    )
    res = run_mypy(stubs, [str(bad)])
    out = res.stdout
    assert res.returncode == 1, out
    assert '"IBuilderConfig" has no attribute "max_workspace_size"' in out
    assert '"Builder" has no attribute "build_engine"' in out
    assert 'has no attribute "FP17"' in out
    assert 'Argument 2 to "set_memory_pool_limit"' in out


if __name__ == "__main__":
    reason = _skip_reason()
    if reason:
        sys.exit(f"cannot run: {reason}")
    with tempfile.TemporaryDirectory() as d:
        res = run_mypy(prepare_stubs(Path(d)), sys.argv[1:] or None)
    sys.stdout.write(res.stdout + res.stderr)
    sys.exit(res.returncode)
