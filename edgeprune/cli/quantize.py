"""``edgeprune quantize``: int8 (ONNX Runtime static QDQ, or dynamic for CPUs) or fp16 copies of an exported model.

The command is a face over :func:`edgeprune.jobs.quantize.quantize` (an :class:`exporters.quantization.QuantizeConfig`,
:func:`exporters.quantization.quantize_onnx`, the measured top-1 / agreement): its setting options are generated from
the declared sections ``[quantize]`` and ``[evaluation]`` of ``edgeprune.jobs.quantize_settings``
(``edgeprune.cli.generate``), the job's own options (model, output, data, ``--force``, ``--json``) are the shared ones
of ``edgeprune.cli.options``. Errors are :class:`~edgeprune.errors.UserError` (exit 2); a failed ``--max-drop`` gate
(:class:`exporters.quantization.QualityGateError`) exits 1 and writes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

import edgeprune
from edgeprune.cli import generate
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import eval_options, file_out_option, force_option, json_option, recorded_calibration_options
from edgeprune.cli.recipe import follow_output, write_recipe
from edgeprune.jobs.quantize_settings import QUANTIZE_SECTIONS


@click.command("quantize", cls=RecipeCommand, settings_sections=QUANTIZE_SECTIONS)
@click.argument("model", type=click.Path(path_type=Path))
@file_out_option("output", "FILE", "The .onnx file to write.", path_type=Path)
@recorded_calibration_options
@generate.options(QUANTIZE_SECTIONS, required=("precision",))
@eval_options
@force_option("Overwrite an existing output file.")
@json_option("Also write the report as JSON.")
def quantize_cmd(model: Path, output: Path, json_out: str | None, **opts: Any) -> None:
    """Quantize an ONNX model to int8 or fp16, checked by accuracy.

    MODEL is an exported .onnx file or a run directory (exported first).

    int8 calibrates on the run's own calibration set (as recorded in the ONNX metadata) with the
    model's preprocessing; the report is measured on held-out images, never calibration images.
    The output keeps the exported metadata and adds precision, calibration hash, excluded nodes
    and the measured agreement.
    """
    ctx = click.get_current_context()
    moved = follow_output(ctx, "json_out", "output", ".json")  # issue 52: a replay's -o moves its report too
    if moved is not None:
        click.echo(f"--json {moved} (the recipe's {json_out} follows -o {output})")
        json_out = str(moved)
    edgeprune.quantize(model, output, json_out=json_out, echo=click.echo,  # onnxruntime: imported here, on first use
                       write_recipe=lambda path, values: write_recipe(ctx, path, values), **opts)


__all__ = ["quantize_cmd"]
