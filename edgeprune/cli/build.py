"""``edgeprune build``: a TensorRT engine from an ONNX file for a device profile.

The command is a face over :func:`edgeprune.jobs.build.build`: its setting options are generated from the declared
section ``[build]`` of ``exporters.tensorrt_settings`` (``edgeprune.cli.generate``); the job's own inputs (the ONNX
file, the profile, the engine file, ``--print-trtexec``) are the shared options of ``edgeprune.cli.device_options``.
Without TensorRT the build is one line, exit 1 (``edgeprune.cli.main``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from edgeprune.cli import generate
from edgeprune.cli.help import SettingsCommand
from edgeprune.cli.device_options import print_trtexec_option
from edgeprune.cli.options import file_out_option, profile_option
from edgeprune import build
from exporters.tensorrt_settings import BUILD_SECTIONS


@click.command("build", cls=SettingsCommand, settings_sections=BUILD_SECTIONS)
@click.argument("onnx_path", metavar="MODEL.onnx", type=click.Path(path_type=Path))
@profile_option("Device profile (not a torch device): a shipped name such as orin-nx (see `edgeprune devices`) or "
                "a .toml file.", required=True)
@file_out_option("output", "FILE", "Engine file [MODEL.<device>.engine]; a JSON sidecar <engine>.json is written next "
                 "to it.", path_type=Path, required=False)
@generate.options(BUILD_SECTIONS)
@print_trtexec_option
def build_cmd(**opts: Any) -> None:
    """Build a TensorRT engine from MODEL.onnx for a device profile (--device PROFILE).

    Here --device names a device profile (e.g. orin-nx), not the torch device that prune, heal
    and derive take.

    Run it on the target device (engines are specific to the GPU's compute capability and the
    TensorRT version). The equivalent trtexec command is printed first. An explicitly quantized
    (Q/DQ) model is built with INT8 + FP16 (TensorRT's explicit quantization).
    """
    build(opts.pop("onnx_path"), echo=click.echo, **opts)


__all__ = ["build_cmd"]
