"""``edgeprune export``: a run (or a dense model) to ONNX, with the deployer's metadata.

The command is a face over :func:`edgeprune.jobs.export.export`: its setting options are generated from the
declared section ``[export]`` of ``exporters.export_settings`` (``edgeprune.cli.generate``); the job's own
inputs (the run or model, the output file, ``--force``) are the shared options of ``edgeprune.cli.options`` /
``edgeprune.cli.device_options``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from edgeprune.cli import generate
from edgeprune.cli.help import SettingsCommand
from edgeprune.cli.options import file_out_option, force_option, model_options
from edgeprune import export
from exporters.export_settings import EXPORT_SECTIONS


@click.command("export", cls=SettingsCommand, settings_sections=EXPORT_SECTIONS)
@click.argument("run_dir", required=False, type=click.Path(path_type=Path))
@model_options()
@file_out_option("output", "FILE", "The .onnx file to write.", path_type=Path)
@generate.options(EXPORT_SECTIONS)
@force_option("Overwrite an existing output file.")
def export_cmd(**opts: Any) -> None:
    """Export a run or a dense model to ONNX.

    RUN_DIR (a pruned, healed or derived run) or --model NAME (dense).
    The file holds everything a deployer needs as metadata (base model, method, sparsities,
    per-block dims, input name/shape, preprocessing); read it with onnx or `edgeprune verify`.
    """
    export(opts.pop("output"), echo=click.echo, **opts)


__all__ = ["export_cmd"]
