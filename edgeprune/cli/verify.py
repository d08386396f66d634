"""``edgeprune verify``: the check that an ONNX file computes what its PyTorch model computes.

The command is a face over :func:`edgeprune.jobs.verify.verify`: its setting options are generated from the
declared section ``[verify]`` of ``exporters.export_settings`` (``edgeprune.cli.generate``); the job's own
inputs (the file, the run or model, the data, the JSON report, the devices) are the shared options of
``edgeprune.cli.options`` / ``edgeprune.cli.device_options``. A failed check exits 1 (not a usage error).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from edgeprune.cli import generate
from edgeprune.cli.help import SettingsCommand
from edgeprune.cli.device_options import against_option, data_option
from edgeprune.cli.options import device_option, json_option, model_options
from edgeprune import verify
from exporters.export_settings import VERIFY_SECTIONS


@click.command("verify", cls=SettingsCommand, settings_sections=VERIFY_SECTIONS)
@click.argument("onnx_file", type=click.Path(path_type=Path))
@against_option
@model_options()
@data_option("Evaluation data (Fashion-MNIST dir or ImageFolder) [the model's own].")
@generate.options(VERIFY_SECTIONS)
@json_option("Also write the report as JSON.")
@device_option
def verify_cmd(**opts: Any) -> None:
    """Check an ONNX file against its PyTorch model.

    Runs ONNX_FILE and the model of --against RUN_DIR (or --model NAME) on real inputs. A float file
    must match within --atol/--rtol; a quantized one (int8/fp16) is judged by metric: top-1 and
    top-1 agreement with the float model on held-out images, gated by --max-drop.

    The PyTorch side runs on --torch-device (TF32 off on CUDA, so the comparison is with float32
    arithmetic); ONNX Runtime runs on the CPU.

    Exits 1 when the check fails.
    """
    # --device is the deployment profile; the PyTorch side runs on --torch-device
    result = verify(opts.pop("onnx_file"), echo=click.echo, **opts)
    if not result.passed:
        sys.exit(1)


__all__ = ["verify_cmd"]
