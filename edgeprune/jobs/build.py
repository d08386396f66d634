"""The job of ``edgeprune build``: a TensorRT engine from an ONNX file for a device profile.

Run it on the target device (an engine is specific to the GPU's compute capability and the TensorRT
version). Without TensorRT, :func:`build` raises a :class:`~edgeprune.errors.RuntimeFault` (one line). Its settings
(``precision``, ``force_device``, ``timing_cache``) are declared once in
:class:`exporters.tensorrt_settings.BuildSection`.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Any

from devices import load_profile
from edgeprune.errors import UserError
from edgeprune.jobs.echo import Echo, echo as _echo
from exporters.tensorrt import build_engine, read_sidecar
from exporters.tensorrt_settings import builder_settings, onnx_input, onnx_precision
from exporters.trtexec import trtexec_args
from runners.tensorrt.inspect import attention_fusion_report


@dataclasses.dataclass
class BuildResult:
    """Outcome of :func:`build`: the engine (None with ``print_trtexec``), its sidecar's content, the
    equivalent trtexec command line."""

    engine: Path | None
    sidecar: dict[str, Any]
    trtexec: str


def default_engine_path(onnx_path: Path, device_name: str) -> Path:
    """``model.onnx`` + ``orin-nx`` -> ``model.orin-nx.engine`` next to the ONNX file."""
    return onnx_path.with_name(f"{onnx_path.stem}.{device_name}.engine")


def build(onnx_path: str | Path, *, device: str, output: str | Path | None = None, precision: str | None = None,
          force_device: bool = False, timing_cache: str | Path | None = None, print_trtexec: bool = False,
          echo: Echo = _echo) -> BuildResult:
    """Build a TensorRT engine from ``onnx_path`` for the device profile ``device`` (a name or a .toml file).

    ``print_trtexec``: only print the equivalent trtexec line, build nothing (no TensorRT needed).

    Raises:
        UserError: a bad profile, a profile that does not run TensorRT.
        RuntimeFault: TensorRT is not usable here.
    """
    onnx_path = Path(onnx_path)
    timing_cache = Path(timing_cache) if timing_cache is not None else None
    profile = load_profile(device)
    if not profile.uses_tensorrt:
        raise UserError(f"device profile {profile.name!r} runs {profile.backend}, not TensorRT: "
                        "nothing to build (benchmark the .onnx file directly)")
    out = Path(output) if output is not None else default_engine_path(onnx_path, profile.name)
    name, shape = onnx_input(onnx_path)
    settings = builder_settings(profile, shape, input_name=name, timing_cache=timing_cache,
                                precision=precision, model_precision=onnx_precision(onnx_path))
    cmd = shlex.join(trtexec_args(onnx_path, settings, out))
    if print_trtexec:
        echo(cmd)
        return BuildResult(engine=None, sidecar={}, trtexec=cmd)
    echo(f"trtexec equivalent:\n  {cmd}")
    echo(f"building {out} for {profile.name} ({settings['precision']}, batch "
         f"{settings['shapes']['min'][0]}..{settings['shapes']['max'][0]}) ...")
    engine = build_engine(onnx_path, profile, out, force_device=force_device, timing_cache=timing_cache,
                          precision=precision)
    meta = read_sidecar(engine) or {}
    size_mb = engine.stat().st_size / 2**20
    gpu = meta.get("gpu", {})
    echo(f"wrote {engine} ({size_mb:.1f} MiB) in {meta.get('build_time_s', float('nan')):.1f} s "
         f"on {gpu.get('name', '?')} (compute capability {gpu.get('compute_capability', '?')}), "
         f"TensorRT {meta.get('tensorrt_version', '?')}; sidecar {engine.name}.json")
    try:
        echo(attention_fusion_report(engine).summary())
    except Exception as err:  # the build succeeded; the report is a bonus
        echo(f"(attention fusion report unavailable: {err})", err=True)
    return BuildResult(engine=Path(engine), sidecar=meta, trtexec=cmd)


__all__ = ["BuildResult", "build", "default_engine_path"]
