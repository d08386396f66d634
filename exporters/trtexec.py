"""The ``trtexec`` command line equivalent to :func:`exporters.tensorrt.build_engine`.

Useful on a device where the Python bindings are missing but ``trtexec`` is there
(JetPack: ``/usr/src/tensorrt/bin/trtexec``), and to reproduce a build by hand. The flags come
from the same :func:`~exporters.tensorrt.builder_settings` dict as the Python build.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, Sequence

from devices import DeviceProfile, load_profile
from exporters.tensorrt_settings import builder_settings, onnx_input, onnx_precision


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(int(d)) for d in shape)


def trtexec_args(onnx_path: str | os.PathLike[str], settings: dict[str, Any],
                 engine_path: str | os.PathLike[str], *, trtexec: str = "trtexec") -> list[str]:
    """argv for ``trtexec`` from a :func:`~exporters.tensorrt.builder_settings` dict."""
    args = [trtexec, f"--onnx={os.fspath(onnx_path)}", f"--saveEngine={os.fspath(engine_path)}"]
    if settings["fp16"]:
        args.append("--fp16")
    if settings.get("int8"):
        args.append("--int8")  # with Q/DQ nodes in the ONNX: explicit quantization
    if settings["dynamic_batch"]:
        name = settings["input_name"]
        for flag, key in (("--minShapes", "min"), ("--optShapes", "opt"), ("--maxShapes", "max")):
            args.append(f"{flag}={name}:{_dims(settings['shapes'][key])}")
    args += [
        f"--memPoolSize=workspace:{int(settings['workspace_mib'])}M",
        f"--builderOptimizationLevel={int(settings['builder_optimization_level'])}",
        f"--timingCacheFile={settings['timing_cache']}",
        "--profilingVerbosity=detailed",
    ]
    return args


def trtexec_command(onnx_path: str | os.PathLike[str], profile: DeviceProfile | str | os.PathLike[str],
                    engine_path: str | os.PathLike[str], *, input_name: str | None = None,
                    input_shape: Sequence[int | str] | None = None,
                    trtexec: str = "trtexec", precision: str | None = None) -> str:
    """The ``trtexec`` command line (a shell-quoted string) that builds the same engine.

    Args:
        onnx_path: the ONNX model; read for its input name and shape unless both
            ``input_name`` and ``input_shape`` are given.
        profile: device profile (object, shipped name or TOML path).
        engine_path: where trtexec saves the engine.
        input_name, input_shape: the ONNX input, to skip reading the file.
        trtexec: the executable to name.
        precision: instead of the profile's build precision (int8 needs a Q/DQ model).

    Raises:
        UserError: as :func:`~exporters.tensorrt.builder_settings` and
            :func:`~exporters.tensorrt.onnx_input`.
    """
    prof = load_profile(profile)
    if input_name is None or input_shape is None:
        name, shape = onnx_input(onnx_path)
        input_name = input_name or name
        input_shape = input_shape if input_shape is not None else shape
    model_precision = onnx_precision(onnx_path) if Path(onnx_path).is_file() else "fp32"
    settings = builder_settings(prof, input_shape, input_name=input_name, precision=precision,
                                model_precision=model_precision)
    return shlex.join(trtexec_args(onnx_path, settings, engine_path, trtexec=trtexec))
