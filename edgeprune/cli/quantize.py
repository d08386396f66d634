"""``edgeprune quantize``: int8 (ONNX Runtime static QDQ, or dynamic for CPUs) or fp16 copies of an exported model.

The command parses options into an :class:`exporters.quantization.QuantizeConfig`, calls
:func:`exporters.quantization.quantize_onnx` and prints the measured top-1 / agreement. Errors are
raised as :class:`~edgeprune.errors.UserError` and printed by the one error handler
(:func:`edgeprune.cli.main.main`): user mistakes exit 2; a failed ``--max-drop`` gate
(:class:`exporters.quantization.QualityGateError`) exits 1 and writes nothing.
"""

from __future__ import annotations

from pathlib import Path

import click

from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import FINITE, eval_options
from edgeprune.cli.recipe import follow_output, write_recipe


@click.command("quantize", cls=RecipeCommand)
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--precision", required=True, type=click.Choice(["int8", "fp16"]),
              help="int8: ONNX Runtime quantization (--mode); fp16: float16 with fp32 inputs/outputs.")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), metavar="FILE",
              help="The .onnx file to write.")
@click.option("--mode", type=click.Choice(["static", "dynamic"]), default="static", show_default=True,
              help="int8: static = QDQ with activation ranges calibrated offline (TensorRT and ONNX Runtime); "
                   "dynamic = activation ranges computed at run time (ONNX Runtime CPU only, no calibration "
                   "set; the more accurate and faster choice for x86 CPUs).")
@click.option("--recipe", type=click.Choice(["auto", "tensorrt", "ort"]), default="auto", show_default=True,
              help="static int8: tensorrt = searched SmoothQuant (LayerNorm folds, explicit scales before fc2) + "
                   "GPTQ weight rounding + measured float fallback, "
                   "TensorRT's Q/DQ placement; ort = ONNX Runtime quantize_static (the earlier default); auto = "
                   "ort when an ONNX-Runtime-only option is given, else tensorrt.")
@click.option("--weight-rounding", type=click.Choice(["gptq", "nearest"]), default=None,
              help="static int8, tensorrt recipe: how int8 weights are rounded (gptq: error-compensating, "
                   "Frantar et al. 2023; nearest: round to nearest)  [default: gptq]")
@click.option("--calib", "calib_dir", type=click.Path(), default=None, metavar="DIR",
              help="Calibration data: the Fashion-MNIST dir (fmnist-vit) or an ImageFolder dir (timm models) "
                   "[the model's own, as for prune].")
@click.option("--calib-size", type=click.IntRange(min=1), default=None, metavar="N",
              help="Calibration images (without a recorded size: fmnist-vit 512, dinov2-s14 64, timm 256) "
                   "[the run's own].")
@click.option("--seed", type=int, default=None,
              help="Seed of the calibration sampling [the run's recorded seed, else 0].")
@click.option("--calib-method", type=click.Choice(["minmax", "entropy", "percentile"]), default="minmax",
              show_default=True, help="How int8 activation ranges are calibrated.")
@click.option("--per-tensor", is_flag=True, help="One weight scale per tensor instead of per output channel.")
@click.option("--asymmetric-activations", is_flag=True,
              help="Asymmetric uint8 activations (ONNX Runtime's x86 U8S8 kernels); TensorRT needs the "
                   "symmetric int8 default.")
@click.option("--exclude", "exclude", multiple=True, metavar="PATTERN",
              help="Keep nodes whose name matches this fnmatch pattern in float (repeatable).")
@click.option("--quantize-attention", is_flag=True,
              help="Also quantize attention's activation x activation MatMuls (Q K^T, softmax V); by default "
                   "they stay float (they hold no weights; int8 there costs most of the accuracy).")
@click.option("--smooth-alpha", type=FINITE, default=None, metavar="A",
              help="SmoothQuant: move this share (0-1, paper: 0.5) of LayerNorm outputs' per-channel range "
                   "into the next MatMul weights before int8 calibration [off].")
@click.option("--auto-exclude", type=click.IntRange(min=0), default=0, show_default=True, metavar="N",
              help="Also keep the N most quantization-sensitive nodes in float (int8).")
@eval_options
@click.option("--max-drop", type=FINITE, default=None, metavar="POINTS",
              help="Fail (exit 1, nothing written) if top-1 drops by more than POINTS on the held-out "
                   "images (without labels: if more than POINTS percent of predictions disagree).")
@click.option("--threads", type=click.IntRange(min=1), default=None, metavar="N",
              help="ONNX Runtime intra-op threads for the evaluation [ORT's default].")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), metavar="FILE",
              help="Also write the report as JSON.")
def quantize_cmd(model: Path, precision: str, mode: str, recipe: str, weight_rounding: str | None, output: Path,
                 calib_dir: str | None, calib_size: int | None,
                 seed: int | None, calib_method: str, per_tensor: bool, asymmetric_activations: bool,
                 exclude: tuple[str, ...], quantize_attention: bool, smooth_alpha: float | None,
                 auto_exclude: int, eval_data: str | None, eval_size: int | None,
                 max_drop: float | None, threads: int | None, force: bool, json_out: Path | None) -> None:
    """Quantize an ONNX model to int8 or fp16, checked by accuracy.

    MODEL is an exported .onnx file or a run directory (exported first).

    int8 calibrates on the run's own calibration set (as recorded in the ONNX metadata) with the
    model's preprocessing; the report is measured on held-out images, never calibration images.
    The output keeps the exported metadata and adds precision, calibration hash, excluded nodes
    and the measured agreement.
    """
    from edgeprune.jobs.quantize import quantize  # onnxruntime: imported when quantizing

    ctx = click.get_current_context()
    moved = follow_output(ctx, "json_out", "output", ".json")  # issue 52: a replay's -o moves its report too
    if moved is not None:
        click.echo(f"--json {moved} (the recipe's {json_out} follows -o {output})")
        json_out = moved
    quantize(model, output, precision=precision, mode=mode, recipe=recipe, weight_rounding=weight_rounding,
             calib_dir=calib_dir, calib_size=calib_size, seed=seed, calib_method=calib_method, per_tensor=per_tensor,
             asymmetric_activations=asymmetric_activations, exclude=tuple(exclude),
             quantize_attention=quantize_attention, smooth_alpha=smooth_alpha, auto_exclude=auto_exclude,
             eval_data=eval_data, eval_size=eval_size, max_drop=max_drop, threads=threads, force=force,
             json_out=json_out, echo=click.echo, write_recipe=lambda path, values: write_recipe(ctx, path, values))


__all__ = ["quantize_cmd"]
