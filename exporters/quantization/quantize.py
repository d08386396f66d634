"""``edgeprune quantize``: int8 / fp16 copies of an exported ONNX model, verified by task metric.

Pipeline of :func:`quantize_onnx` (all checks come before any expensive step)::

    exported fp32 ONNX (or a run directory, exported first into a temporary file)
      -> int8: quant_pre_process -> quantize_static (QDQ, per-channel symmetric weights,
               calibration on the run's own calibration set)  [exporters/int8.py]
               or, --mode dynamic, quantize_dynamic (MatMul/Gemm weights int8, activation ranges at
               run time; ONNX Runtime CPU only, no calibration set)
         fp16: convert_float_to_float16 (fp32 I/O, LayerNorm/Softmax/... kept fp32) [exporters/fp16.py]
      -> top-1 and top-1 agreement with the float model on held-out images [exporters/verify.py]
      -> gate (--max-drop) -> metadata -> atomic move into place

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
import onnx
import onnxruntime

from edgeprune.errors import UserError
from edgeprune.loading import load_run_or_model
from edgeprune.zoo.entries import zoo_entry
from exporters.quantization import ort_int8 as int8
from exporters.quantization.calibration import (ArrayCalibrationReader, calibration_for, calibration_sha256, eval_for,
                                          source_to_array)
from exporters.quantization.recipe_fp16 import convert_fp16
from exporters.quantization.recipe_tensorrt import quantize_tensorrt
from exporters.onnx import build_metadata, export_onnx, read_metadata
from exporters.quantization.config import QuantizeConfig
from exporters.quantization.metadata import output_metadata, write_with_metadata
from exporters.quantization.smoothing import smooth_onnx
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
            bad settings (all before any quantization work).
        QualityGateError: the measured drop exceeds ``config.max_drop`` (exit status 1); nothing
            is written.
        RuntimeFault: ONNX Runtime fails on a valid model.
    """
    cfg = (config or QuantizeConfig()).validate()
    say = log or (lambda _msg: None)
    src, out = Path(model), Path(output)
    _check_output(out, src, overwrite)
    meta, to_export = _load_input(src)
    data = _gather_data(meta, cfg, calibration, eval_source, say)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        float_path, meta = _float_model(src, to_export, meta, tmp, say)
        quant_path = tmp / "quantized.onnx"
        if cfg.precision == "int8":
            done = _quantize_int8(src, float_path, quant_path, data.calib, cfg, tmp, say)
        else:
            done = _convert_fp16(float_path, quant_path, cfg, say)
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
    say(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB, {cfg.precision})")
    return QuantizeResult(path=out, report=report, config=cfg)


@dataclasses.dataclass
class _Data:
    """Calibration and held-out evaluation images of one quantization (gathered before any work)."""

    calib: np.ndarray | None
    calib_info: dict[str, Any] | None
    x_eval: np.ndarray | None
    labels: np.ndarray | None
    eval_desc: str | None


@dataclasses.dataclass
class _Converted:
    """What the int8 / fp16 step did: node lists for the metadata and the report, the tool used."""

    tool: str
    excluded: list[str]
    attention: list[str] = dataclasses.field(default_factory=list)
    smoothing: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sensitivity: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    auto: list[str] = dataclasses.field(default_factory=list)
    plan: dict[str, Any] | None = None


def _gather_data(meta: dict[str, Any], cfg: QuantizeConfig, calibration: np.ndarray | None,
                 eval_source: Any, say: Callable[[str], None]) -> _Data:
    """Step 1: calibration and evaluation images (cheap; every user mistake surfaces here)."""
    base = meta.get("base_model")
    entry = zoo_entry(base.get("name", "")) if isinstance(base, dict) else None
    eval_data = cfg.eval_data or (cfg.calib_data if entry is not None and entry.data_holds_both_splits else None)
    calib = calib_info = None
    # dynamic int8 computes activation ranges at run time: calibration images only for smoothing
    # and the sensitivity pass
    needs_calib = cfg.precision == "int8" and (cfg.mode == "static" or cfg.smooth_alpha is not None
                                               or cfg.auto_exclude > 0)
    if needs_calib:
        if calibration is not None:
            calib = np.ascontiguousarray(np.asarray(calibration, dtype=np.float32))
            if calib.ndim != 4 or not len(calib):
                raise UserError(f"calibration must be a non-empty (N, C, H, W) array, got {calib.shape}")
            calib_info = {"source": f"array {tuple(calib.shape)}", "num_images": len(calib), "seed": None,
                          "sha256": calibration_sha256(calib)}
        else:
            calib, calib_info = calibration_for(meta, cfg.calib_size, cfg.calib_seed, cfg.calib_data, eval_data)
        say(f"calibration: {calib_info['source']} (sha256 {calib_info['sha256'][:12]})")
    if eval_source is None:
        eval_source = eval_for(meta, cfg.eval_size, eval_data)
    if eval_source is None:
        if cfg.max_drop is not None:
            raise UserError("--max-drop needs evaluation images, but the ONNX file names no edgeprune model")
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


def _quantize_int8(src: Path, float_path: Path, quant_path: Path, calib: np.ndarray | None,
                   cfg: QuantizeConfig, tmp: Path, say: Callable[[str], None]) -> _Converted:
    """Step 3 (int8): smoothing, pre-processing, node selection, quantization, sensitivity pass."""
    if cfg.resolved_recipe() == "tensorrt":
        assert calib is not None  # static int8 always gathers calibration images
        plan = quantize_tensorrt(float_path, quant_path, calib, cfg, log=say)
        rec = plan.to_record()
        return _Converted(f"edgeprune exporters.quantization.recipe_tensorrt (TensorRT Q/DQ), onnx {onnx.__version__}",
                          [g["node"] for g in rec["gemms"] if g["precision"] != "int8"],
                          smoothing=rec["smoothing"], plan=rec)
    to_quantize = float_path
    smoothing: list[dict[str, Any]] = []
    if cfg.smooth_alpha is not None:
        smoothing = smooth_onnx(float_path, tmp / "smooth.onnx", calib, cfg.smooth_alpha,
                                cfg.batch_size, cfg.threads)
        to_quantize = tmp / "smooth.onnx"
        say(f"smoothing (alpha {cfg.smooth_alpha:g}): {len(smoothing)} LayerNorm -> MatMul sites")
    pre = int8.preprocess(to_quantize, tmp / "pre.onnx") if cfg.preprocess else to_quantize
    op_types = int8.quantizable_op_types(cfg)
    names = int8.quantizable_nodes(pre, op_types)
    if not names:
        raise UserError(f"{src} has no {'/'.join(op_types) or '/'.join(cfg.op_types)} nodes to "
                        f"quantize{' in --mode dynamic (MatMul/Gemm only)' if cfg.mode == 'dynamic' else ''}")
    excluded = int8.match_patterns(cfg.exclude, names)
    attention: list[str] = []
    if not cfg.quantize_attention:
        attention = int8.activation_matmuls(pre, names)
        excluded = [n for n in names if n in excluded or n in attention]
    cache = tmp / "calibration.json"
    reader = None
    if cfg.mode == "static":
        fixed = _fixed_batch(pre)
        reader = ArrayCalibrationReader(calib, _input_name(pre), fixed or cfg.batch_size, fixed_batch=bool(fixed))
    doing = (f"calibrating ({cfg.calib_method}) and quantizing" if cfg.mode == "static"
             else "quantizing (dynamic: activation ranges at run time)")
    say(f"int8: {doing} {len(names) - len(excluded)} of {len(names)} {'/'.join(op_types)} nodes"
        + (f" ({len(attention)} attention products kept float; --quantize-attention to include them)"
           if attention else ""))
    int8.quantize_int8(pre, quant_path, cfg, reader=reader, cache=cache, nodes_to_exclude=excluded)
    sensitivity: list[dict[str, Any]] = []
    auto: list[str] = []
    if cfg.auto_exclude:
        assert calib is not None  # gathered whenever auto_exclude > 0
        cand = [n for n in names if n not in excluded]
        imgs = calib[:cfg.sensitivity_images]
        say(f"sensitivity: quantizing each of {len(cand)} nodes alone on {len(imgs)} calibration images")
        ref = int8.run_model(pre, imgs, cfg.batch_size, cfg.threads)
        sensitivity = int8.rank_sensitivity(pre, cand, imgs, ref, cfg, cache, tmp)
        auto = [r["node"] for r in sensitivity[:cfg.auto_exclude]]
        excluded = [n for n in names if n in excluded or n in auto]
        say("keeping in float: " + ", ".join(auto))
        int8.quantize_int8(pre, quant_path, cfg, cache=cache, nodes_to_exclude=excluded)
    tool = (f"onnxruntime {onnxruntime.__version__} quantize_static (QDQ)" if cfg.mode == "static"
            else f"onnxruntime {onnxruntime.__version__} quantize_dynamic (DynamicQuantizeLinear + MatMulInteger)")
    return _Converted(tool, excluded, attention, smoothing, sensitivity, auto)


def _convert_fp16(float_path: Path, quant_path: Path, cfg: QuantizeConfig,
                  say: Callable[[str], None]) -> _Converted:
    """Step 3 (fp16): convert, keeping the excluded nodes and the sensitive op types in fp32."""
    names = [n.name for n in onnx.load(str(float_path), load_external_data=False).graph.node if n.name]
    excluded = int8.match_patterns(cfg.exclude, names)
    say("fp16: converting (fp32 inputs/outputs; LayerNorm, Softmax, reductions kept fp32)")
    convert_fp16(float_path, quant_path, excluded)
    return _Converted(f"onnxruntime {onnxruntime.__version__} transformers.float16.convert_float_to_float16",
                      excluded)


def _measure(float_path: Path, quant_path: Path, meta: dict[str, Any], data: _Data, cfg: QuantizeConfig,
             out: Path) -> dict[str, Any]:
    """Step 4: metrics against the float model on held-out images, and the ``max_drop`` gate.

    Raises:
        QualityGateError: the drop exceeds ``cfg.max_drop``.
    """
    if data.x_eval is None:
        return {}
    f_out = int8.run_model(float_path, data.x_eval, cfg.batch_size, cfg.threads)
    q_out = int8.run_model(quant_path, data.x_eval, cfg.batch_size, cfg.threads)
    kind = meta.get("output_kind") if meta.get("output_kind") in ("logits", "saliency") else None
    report = quantized_metrics(q_out, f_out, data.labels, kind)
    report["eval_source"] = data.eval_desc
    report["max_drop"] = cfg.max_drop
    if cfg.max_drop is not None and report["drop_points"] > cfg.max_drop + 1e-9:
        what = "top-1" if report["drop_metric"] == "top1_points" else "agreement"
        raise QualityGateError(
            f"{cfg.precision} model loses {report['drop_points']:.2f} points of {what} on "
            f"{report['n']} held-out images (max {cfg.max_drop:g}); {out} not written "
            f"(try --auto-exclude N, --exclude PATTERN or --calib-method percentile)")
    return report


def _input_name(path: Path) -> str:
    m = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    inputs = [i for i in m.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise UserError(f"{path.name}: quantize handles models with one input, found {len(inputs)}")
    return inputs[0].name


def _fixed_batch(path: Path) -> int | None:
    m = onnx.load(str(path), load_external_data=False)
    dim = m.graph.input[0].type.tensor_type.shape.dim
    if dim and dim[0].HasField("dim_value") and dim[0].dim_value > 0:
        return int(dim[0].dim_value)
    return None
