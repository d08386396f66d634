"""The job of ``edgeprune quantize``: an int8 (ONNX Runtime static QDQ, or dynamic for CPUs) or fp16 copy of
an exported model, checked by accuracy on held-out images (:func:`exporters.quantization.quantize_onnx`).

A failed ``max_drop`` gate raises :class:`exporters.quantization.QualityGateError` (exit 1, nothing written).
The command's recipe file (``<output>.recipe.toml``) is the CLI's: :func:`quantize` calls ``recipe(path,
values)`` when given (the resolved values it used), else writes none.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

from edgeprune.artifact import read_record
from edgeprune.atomic import atomic_write_text
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.jobs.calib_reuse import heldout_source, recorded_eval_folder, recorded_folder
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.zoo.registry import spec_from_record
from exporters.onnx import read_metadata
from exporters.quantization import QuantizeConfig, quantize_onnx


@dataclasses.dataclass
class QuantizeResult:
    """Outcome of :func:`quantize`: the file written, the measured report (``quantize.json``'s content
    without ``output`` / ``config``), the config used and the JSON file written (or None)."""

    path: Path
    report: dict[str, Any]
    config: Any
    json_path: Path | None


def output_recipe_path(output: str | Path) -> Path:
    """``<output>.recipe.toml`` beside a file output (quantize, latency-table)."""
    o = Path(output)
    return o.with_name(o.name + ".recipe.toml")


def quantize(model: str | Path, output: str | Path, *, precision: str, mode: str = "static", recipe: str = "auto",
             weight_rounding: str | None = None, calib_dir: str | None = None, calib_size: int | None = None,
             seed: int | None = None, calib_method: str = "minmax", per_tensor: bool = False,
             asymmetric_activations: bool = False, exclude: tuple[str, ...] = (), quantize_attention: bool = False,
             smooth_alpha: float | None = None, auto_exclude: int = 0, eval_data: str | None = None,
             eval_size: int | None = None, max_drop: float | None = None, threads: int | None = None,
             force: bool = False, json_out: str | Path | None = None, echo: Echo = _echo,
             write_recipe: Callable[[Path, dict[str, Any]], Any] | None = None) -> QuantizeResult:
    """Quantize ``model`` (an exported .onnx file or a run directory) to ``precision`` ("int8" / "fp16").

    int8 calibrates on the run's own calibration set (recorded in the ONNX metadata) unless ``calib_dir``;
    the report is measured on held-out images. ``write_recipe(path, values)``: the CLI's recipe writer.

    Raises:
        UserError: a missing data folder, bad settings, ``weight_rounding`` without the tensorrt recipe,
            ``json_out`` or ``output`` existing without ``force``, the recorded calibration folder gone.
    """
    model, json_out = Path(model), Path(json_out) if json_out is not None else None
    for option, path in (("--calib", calib_dir), ("--eval-data", eval_data)):  # issue 41: before the calibration
        if path is not None and not Path(path).exists():
            raise UserError(f"{option} {path}: no such file or folder (the Fashion-MNIST folder or an ImageFolder)")

    def config(calib: str | None, evaluation: str | None = eval_data) -> QuantizeConfig:
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
    if json_out is not None and json_out.exists() and not force:
        raise SettingError(f"{SettingError.literal(json_out)} exists (use {{force}} to overwrite)")
    calib_dir, eval_data, eval_source = run_data(model, calib_dir, calib_size, seed, eval_data, eval_size)
    cfg = config(calib_dir, eval_data)
    result = quantize_onnx(model, output, cfg, overwrite=force, eval_source=eval_source, log=echo)
    if write_recipe is not None:
        write_recipe(output_recipe_path(result.path), {"calib": calib_dir, "eval-data": eval_data, "json": json_out})
    rep = result.report
    _say_report(rep, echo)
    if json_out is not None:
        atomic_write_text(json_out, json.dumps({"output": str(result.path), "config": cfg.to_record(), **rep},
                                               indent=2, default=str) + "\n")
        echo(f"wrote {json_out}")
    return QuantizeResult(path=Path(result.path), report=rep, config=cfg, json_path=json_out)


def _say_report(rep: dict[str, Any], echo: Echo) -> None:
    """The lines of the measured report: top-1, agreement, the precision per GEMM, the size."""
    if rep.get("n"):
        if rep.get("top1") is not None:
            echo(f"top-1 on {rep['n']} held-out images: {rep['top1'] * 100:.2f}% "
                 f"(float {rep['top1_float'] * 100:.2f}%, drop {rep['drop_points']:+.2f} points)")
        where = "" if rep.get("top1") is not None else f" on {rep['n']} held-out images ({rep.get('eval_source')})"
        echo(f"{rep['agreement_metric']} with the float model{where}: {rep['agreement'] * 100:.2f}%")
    else:
        echo("no evaluation data for this model: accuracy not measured")
    plan = rep.get("int8_plan")
    if plan:
        floats = [g["node"] for g in plan["gemms"] if g["precision"] != "int8"]
        echo(f"precision per GEMM: {len(plan['gemms']) - len(floats)} of {len(plan['gemms'])} int8, "
             f"{plan['int8_flops_share'] * 100:.1f}% of GEMM FLOPs in int8"
             + (f"; float (fp16 on TensorRT): {', '.join(floats)}" if floats else ""))
    if rep.get("float_size_bytes"):
        ratio = rep["size_bytes"] / rep["float_size_bytes"]
        echo(f"size: {rep['size_bytes'] / 2**20:.2f} MiB ({ratio:.2f}x fp32)")


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


def run_data(model: Path, calib_dir: str | None, calib_size: int | None, seed: int | None, eval_data: str | None,
             eval_size: int | None) -> tuple[str | None, str | None, object | None]:
    """``(calibration folder, evaluation folder, held-out source)`` of a run or an edgeprune export
    (issue 42): ``calib_dir``, else the run's recorded calibration folder (gone: refused,
    :func:`~edgeprune.jobs.calib_reuse.recorded_folder`); ``eval_data``, else the run's recorded
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


__all__ = ["QuantizeResult", "output_recipe_path", "quantize", "run_data"]
