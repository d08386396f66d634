"""``edgeprune quantize``: int8 (ONNX Runtime static QDQ, or dynamic for CPUs) or fp16 copies of an exported model.

The command parses options into an :class:`exporters.quantization.QuantizeConfig`, calls
:func:`exporters.quantization.quantize_onnx` and prints the measured top-1 / agreement. Errors are
raised as :class:`~edgeprune.errors.UserError` and printed by the one error handler
(:func:`edgeprune.cli.main.main`): user mistakes exit 2; a failed ``--max-drop`` gate
(:class:`exporters.quantization.QualityGateError`) exits 1 and writes nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from edgeprune.artifact import read_record
from edgeprune.atomic import atomic_write_text
from edgeprune.cli.calib_reuse import heldout_source, recorded_eval_folder, recorded_folder
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import FINITE, eval_options
from edgeprune.cli.recipe import follow_output, output_recipe_path, write_recipe
from edgeprune.errors import UserError
from edgeprune.zoo.registry import spec_from_record
from exporters.onnx import read_metadata


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
    from exporters.quantization import QuantizeConfig, quantize_onnx

    for option, path in (("--calib", calib_dir), ("--eval-data", eval_data)):  # issue 41: before the calibration
        if path is not None and not Path(path).exists():
            raise UserError(f"{option} {path}: no such file or folder (the Fashion-MNIST folder or an ImageFolder)")
    def config(calib: str | None, evaluation: str | None = eval_data):
        return QuantizeConfig(
            precision=precision, mode=mode, calib_method=calib_method, calib_size=calib_size, calib_seed=seed,
            calib_data=str(calib) if calib else None, per_channel=not per_tensor,
            activation_symmetric=not asymmetric_activations, exclude=tuple(exclude), auto_exclude=auto_exclude,
            quantize_attention=quantize_attention, smooth_alpha=smooth_alpha,
            eval_size=eval_size or 1000, eval_data=str(evaluation) if evaluation else None, max_drop=max_drop,
            threads=threads, recipe=recipe, weight_rounding=weight_rounding or "gptq",
        ).validate()

    cfg = config(calib_dir)
    if weight_rounding is not None and cfg.resolved_recipe() != "tensorrt":
        raise UserError("--weight-rounding applies to static int8 with the tensorrt recipe (ONNX Runtime's "
                        "quantizer rounds to nearest)")
    ctx = click.get_current_context()
    moved = follow_output(ctx, "json_out", "output", ".json")  # issue 52: a replay's -o moves its report too
    if moved is not None:
        click.echo(f"--json {moved} (the recipe's {json_out} follows -o {output})")
        json_out = moved
    if json_out is not None and json_out.exists() and not force:
        raise UserError(f"{json_out} exists (use --force to overwrite)")
    calib_dir, eval_data, eval_source = _run_data(model, calib_dir, calib_size, seed, eval_data, eval_size)
    cfg = config(calib_dir, eval_data)
    result = quantize_onnx(model, output, cfg, overwrite=force, eval_source=eval_source, log=click.echo)
    write_recipe(ctx, output_recipe_path(result.path), {"calib": calib_dir, "eval-data": eval_data,
                                                        "json": json_out})
    rep = result.report
    if rep.get("n"):
        if rep.get("top1") is not None:
            click.echo(f"top-1 on {rep['n']} held-out images: {rep['top1'] * 100:.2f}% "
                       f"(float {rep['top1_float'] * 100:.2f}%, drop {rep['drop_points']:+.2f} points)")
        where = "" if rep.get("top1") is not None else f" on {rep['n']} held-out images ({rep.get('eval_source')})"
        click.echo(f"{rep['agreement_metric']} with the float model{where}: {rep['agreement'] * 100:.2f}%")
    else:
        click.echo("no evaluation data for this model: accuracy not measured")
    plan = rep.get("int8_plan")
    if plan:
        floats = [g["node"] for g in plan["gemms"] if g["precision"] != "int8"]
        click.echo(f"precision per GEMM: {len(plan['gemms']) - len(floats)} of {len(plan['gemms'])} int8, "
                   f"{plan['int8_flops_share'] * 100:.1f}% of GEMM FLOPs in int8"
                   + (f"; float (fp16 on TensorRT): {', '.join(floats)}" if floats else ""))
    if rep.get("float_size_bytes"):
        ratio = rep["size_bytes"] / rep["float_size_bytes"]
        click.echo(f"size: {rep['size_bytes'] / 2**20:.2f} MiB ({ratio:.2f}x fp32)")
    if json_out is not None:
        atomic_write_text(json_out, json.dumps({"output": str(result.path), "config": cfg.to_record(), **rep},
                                               indent=2, default=str) + "\n")
        click.echo(f"wrote {json_out}")


def _recorded(model: Path) -> tuple[dict | None, object | None]:
    """``(calibration entry, model spec)`` recorded by a run directory or an edgeprune ONNX export
    (``(None, None)`` when there is none: the quantizer says what is missing)."""
    if model.is_dir():
        rec = read_record(model)
        return rec.get("calibration"), spec_from_record(rec["base_model"])
    if model.is_file() and model.suffix == ".onnx":
        meta = read_metadata(model)
        base = meta.get("base_model")
        return meta.get("calibration"), (spec_from_record(dict(base)) if isinstance(base, dict) and base.get("name")
                                         else None)
    return None, None


def _run_data(model: Path, calib_dir: str | None, calib_size: int | None, seed: int | None, eval_data: str | None,
              eval_size: int | None) -> tuple[str | None, str | None, object | None]:
    """``(calibration folder, evaluation folder, held-out source)`` of a run or an edgeprune export
    (issue 42): ``--calib``, else the run's recorded calibration folder (gone: refused,
    :func:`~edgeprune.cli.calib_reuse.recorded_folder`); ``--eval-data``, else the run's recorded
    evaluation folder while it is there (issue 52: its calibration was checked disjoint from it);
    else, for a timm model, the held-out unlabeled images of the calibration folder.

    Raises:
        UserError: the recorded calibration folder is gone; no held-out image left (the calibration
            used the whole folder and no evaluation folder was recorded).
    """
    cal, spec = _recorded(model)
    if spec is None:
        return calib_dir, eval_data, None
    if calib_dir is None:
        calib_dir = recorded_folder(cal, spec)
    if eval_data is None:
        eval_data = recorded_eval_folder(cal)
    if eval_data is not None or spec.is_zoo or calib_dir is None:
        return calib_dir, eval_data, None
    cal = cal or {}
    n = calib_size or cal.get("num_images") or cal.get("size_requested") or spec.default_calib_size
    seed = seed if seed is not None else (cal.get("seed") or 0)
    return calib_dir, None, heldout_source(spec, str(calib_dir), int(n), int(seed), eval_size or 1000)


__all__ = ["quantize_cmd"]
