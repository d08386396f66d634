"""``edgeprune quantize``: int8 / fp16 copies of an exported ONNX model, verified by task metric.

Pipeline of :func:`quantize_onnx` (all checks come before any expensive step)::

    exported fp32 ONNX (or a run directory, exported first into a temporary file)
      -> calibration images (the run's own set, one array for every recipe)    [calibration.py]
         and held-out evaluation images
      -> the recipe that QuantizeConfig.recipe_name() picks                     [registry.py]
           tensorrt: searched SmoothQuant, GPTQ rounding, clipping, fallback   [recipe_tensorrt.py]
           ort: quantize_static (QDQ) or quantize_dynamic                      [recipe_ort.py]
           fp16: convert_float_to_float16 (fp32 I/O, LayerNorm/Softmax/... kept fp32) [recipe_fp16.py]
      -> top-1 and top-1 agreement with the float model on held-out images     [exporters/verify.py]
      -> gate (--max-drop) -> metadata -> atomic move into place                [metadata.py]

The output keeps every ``metadata_props`` entry of the exported model (preprocessing, model
identity, pruning record) and adds ``precision``, ``quantization`` (the :class:`QuantizeConfig`
plus the ONNX Runtime version), ``quant_calibration`` (source, size, seed, ``sha256``),
``calibration_sha256``, ``excluded_nodes``, ``sensitivity`` (``--auto-exclude``: every candidate's
isolated cost, costliest first) and ``auto_excluded_nodes``, ``quant_eval``
(the measured metrics) and ``agreement``. Everything is written in a temporary folder next to
the destination and moved into place with ``os.replace`` only after the gate passed; on any
error nothing is left behind and an existing destination is untouched.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edgeprune.errors import UserError
from edgeprune.settings import SettingError
from edgeprune.loading import load_run_or_model
from edgeprune.zoo.entries import zoo_entry
from exporters.onnx import build_metadata, export_onnx, read_metadata
from exporters.quantization.calibration import calibration_for, calibration_sha256, eval_for, source_to_array
from exporters.quantization.config import QuantizeConfig
from exporters.quantization.metadata import output_metadata, write_with_metadata
from exporters.quantization.ort_int8 import run_model
from exporters.quantization.registry import Recipe, RecipeJob, get_recipe
from exporters.verify import quantized_metrics

__all__ = ["QuantizeConfig", "QuantizeResult", "QualityGateError", "quantize_onnx"]


class QualityGateError(UserError):
    """The quantized model lost more than ``max_drop`` points; nothing was written (exit 1)."""

    exit_code = 1


@dataclasses.dataclass
class QuantizeResult:
    """Outcome of :func:`quantize_onnx`.

    Attributes:
        path: the written file.
        report: measured metrics (see ``exporters.verify.quantized_metrics``; empty without
            evaluation data), plus ``excluded_nodes``, ``calibration`` and ``size_bytes``.
        config: the validated settings.
    """

    path: Path
    report: dict[str, Any]
    config: QuantizeConfig


def _check_output(out: Path, src: Path, overwrite: bool) -> None:
    if out.suffix != ".onnx":
        raise UserError(f"output must be a .onnx file, got {out}")
    if out.is_dir():
        raise UserError(f"{out} is a directory")
    if out.exists() and not overwrite:
        raise UserError(f"{out} exists (use --force to overwrite)")
    if out.exists() and src.exists() and out.resolve() == src.resolve():
        raise UserError(f"output {out} is the input file; write the quantized model elsewhere")


def _load_input(src: Path) -> tuple[dict[str, Any], Any]:
    """Metadata of the input, and for a run directory the ``(model, record, spec)`` to export."""
    if not src.exists():
        raise UserError(f"no such ONNX file or run directory: {src}")
    if src.is_dir():
        model, record, spec = load_run_or_model(src, None)
        return build_metadata(record=record, spec=spec, model=model), (model, spec)
    meta = read_metadata(src)
    precision = meta.get("precision")
    if precision in ("int8", "fp16"):
        raise UserError(f"{src} is already {precision}; quantize the fp32 export")
    return meta, None


def _eval_arrays(eval_source: Any) -> tuple[np.ndarray, np.ndarray | None, str]:
    if isinstance(eval_source, tuple):
        x, y = eval_source
        x = np.ascontiguousarray(np.asarray(x.numpy() if hasattr(x, "numpy") else x, dtype=np.float32))
        y = None if y is None else np.asarray(y.numpy() if hasattr(y, "numpy") else y)
        return x, y, f"array {tuple(x.shape)}"
    x, y = source_to_array(eval_source)
    return x, y, getattr(eval_source, "description", type(eval_source).__name__)


def quantize_onnx(model: str | os.PathLike, output: str | os.PathLike, config: QuantizeConfig | None = None, *,
                  calibration: np.ndarray | None = None, eval_source: Any = None, overwrite: bool = False,
                  log: Callable[[str], None] | None = None) -> QuantizeResult:
    """Quantize an exported ONNX model (or a run directory) to int8 or fp16, and verify it.

    The quantization itself is the registered recipe that ``config.recipe_name()`` names
    (``exporters.quantization.registry``); everything else here is shared by every recipe.

    Args:
        model: an fp32 ``.onnx`` file written by ``edgeprune export`` (its metadata names the
            model, preprocessing and calibration set), or a run directory (exported first).
        output: the ``.onnx`` file to write.
        config: settings (validated here); default int8, MinMax, per-channel.
        calibration: (N, C, H, W) float32 preprocessed calibration images (static int8, smoothing,
            the sensitivity pass; dynamic int8 alone reads none); default: the run's own
            calibration set (``exporters.quantization.calibration.calibration_for``).
        eval_source: held-out images (a data source or an ``(images, labels|None)`` pair);
            default: the model's evaluation split (Fashion-MNIST test for fmnist-vit). Without
            any (a foreign ONNX file), no metrics are measured.
        overwrite: replace an existing ``output``.
        log: called with one progress line per step (the CLI passes ``click.echo``).

    Returns:
        :class:`QuantizeResult`.

    Raises:
        UserError: not an ONNX file / run directory, an existing output without ``overwrite``,
            missing calibration or evaluation data, an ``--exclude`` pattern matching nothing,
            bad settings, an unregistered recipe (all before any quantization work).
        QualityGateError: the measured drop exceeds ``config.max_drop`` (exit status 1); nothing
            is written.
        RuntimeFault: ONNX Runtime fails on a valid model.
    """
    cfg = (config or QuantizeConfig()).validate()
    recipe = get_recipe(cfg.recipe_name())
    say = log or (lambda _msg: None)
    src, out = Path(model), Path(output)
    _check_output(out, src, overwrite)
    meta, to_export = _load_input(src)
    data = _gather_data(meta, cfg, recipe, calibration, eval_source, say)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        float_path, meta = _float_model(src, to_export, meta, tmp, say)
        quant_path = tmp / "quantized.onnx"
        done = recipe.run(RecipeJob(src, float_path, quant_path, data.calib, cfg, tmp, say))
        report = _measure(float_path, quant_path, meta, data, cfg, out)
        md = output_metadata(meta, cfg, src, float_path, done, data.calib_info, report)
        write_with_metadata(quant_path, md, tmp / out.name, out)
        float_size = float_path.stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report = dict(report)
    report.update({"excluded_nodes": done.excluded, "float_attention_nodes": done.attention,
                   "smoothing": done.smoothing, "calibration": data.calib_info,
                   "size_bytes": out.stat().st_size, "float_size_bytes": float_size,
                   "sensitivity": done.sensitivity, "int8_plan": done.plan})
    say(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB, {cfg.common.precision})")
    return QuantizeResult(path=out, report=report, config=cfg)


@dataclasses.dataclass
class _Data:
    """Calibration and held-out evaluation images of one quantization (gathered before any work)."""

    calib: np.ndarray | None
    calib_info: dict[str, Any] | None
    x_eval: np.ndarray | None
    labels: np.ndarray | None
    eval_desc: str | None


def _gather_data(meta: dict[str, Any], cfg: QuantizeConfig, recipe: Recipe, calibration: np.ndarray | None,
                 eval_source: Any, say: Callable[[str], None]) -> _Data:
    """Step 1: calibration images (when the recipe needs them) and evaluation images (cheap; every
    user mistake surfaces here)."""
    c = cfg.common
    base = meta.get("base_model")
    entry = zoo_entry(base.get("name", "")) if isinstance(base, dict) else None
    eval_data = c.eval_data or (c.calib_data if entry is not None and entry.data_holds_both_splits else None)
    calib = calib_info = None
    if recipe.needs_calibration(cfg):
        if calibration is not None:
            calib = np.ascontiguousarray(np.asarray(calibration, dtype=np.float32))
            if calib.ndim != 4 or not len(calib):
                raise UserError(f"calibration must be a non-empty (N, C, H, W) array, got {calib.shape}")
            calib_info = {"source": f"array {tuple(calib.shape)}", "num_images": len(calib), "seed": None,
                          "sha256": calibration_sha256(calib)}
        else:
            calib, calib_info = calibration_for(meta, c.calib_size, c.calib_seed, c.calib_data, eval_data)
        say(f"calibration: {calib_info['source']} (sha256 {calib_info['sha256'][:12]})")
    if eval_source is None:
        eval_source = eval_for(meta, c.eval_size, eval_data)
    if eval_source is None:
        if c.max_drop is not None:
            raise SettingError("{max_drop} needs evaluation images, but the ONNX file names no edgeprune model")
        return _Data(calib, calib_info, None, None, None)
    x_eval, labels, eval_desc = _eval_arrays(eval_source)
    return _Data(calib, calib_info, x_eval, labels, eval_desc)


def _float_model(src: Path, to_export: Any, meta: dict[str, Any], tmp: Path,
                 say: Callable[[str], None]) -> tuple[Path, dict[str, Any]]:
    """Step 2: the fp32 ONNX file to quantize (a run directory is exported into ``tmp`` first)."""
    if to_export is None:
        return src, meta
    fmodel, spec = to_export
    float_path = export_onnx(fmodel, tmp / "float.onnx", tuple(spec.input_size), meta)
    say(f"exported {src} to fp32 ONNX")
    return float_path, read_metadata(float_path)


def _measure(float_path: Path, quant_path: Path, meta: dict[str, Any], data: _Data, cfg: QuantizeConfig,
             out: Path) -> dict[str, Any]:
    """Step 4: metrics against the float model on held-out images, and the ``max_drop`` gate.

    Raises:
        QualityGateError: the drop exceeds ``cfg.max_drop``.
    """
    if data.x_eval is None:
        return {}
    c = cfg.common
    f_out = run_model(float_path, data.x_eval, c.batch_size, c.threads)
    q_out = run_model(quant_path, data.x_eval, c.batch_size, c.threads)
    kind = meta.get("output_kind") if meta.get("output_kind") in ("logits", "saliency") else None
    report = quantized_metrics(q_out, f_out, data.labels, kind)
    report["eval_source"] = data.eval_desc
    report["max_drop"] = c.max_drop
    if c.max_drop is not None and report["drop_points"] > c.max_drop + 1e-9:
        what = "top-1" if report["drop_metric"] == "top1_points" else "agreement"
        raise QualityGateError(
            f"{c.precision} model loses {report['drop_points']:.2f} points of {what} on "
            f"{report['n']} held-out images (max {c.max_drop:g}); {out} not written "
            f"(try --auto-exclude N, --exclude PATTERN or --calib-method percentile)")
    return report
