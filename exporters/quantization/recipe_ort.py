"""The ONNX Runtime recipe: ``quantize_static`` (QDQ) or ``quantize_dynamic``, with its options.

Steps of :meth:`OrtRecipe.run` (``--recipe ort``, the static int8 chosen when an
ONNX-Runtime-only option is set, and every ``--mode dynamic``)::

    float ONNX
      -> --smooth-alpha A: SmoothQuant with one alpha folded into every LayerNorm -> MatMul site
         (exporters/quantization/smoothing.py: smooth_onnx)
      -> quant_pre_process (symbolic shape inference, basic graph optimisations; OrtSettings.preprocess)
      -> node selection: op types, --exclude, attention's activation x activation MatMuls kept float
      -> quantize_static (calibrated on the one calibration array through ArrayCalibrationReader)
         or quantize_dynamic                                       (exporters/quantization/ort_int8.py)
      -> --auto-exclude N: each node quantized alone by ONNX Runtime, the N costliest kept float,
         quantized again from the cached ranges                    (ort_int8.rank_sensitivity)

Its settings: :class:`exporters.quantization.config.OrtSettings` (and the common section).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import onnxruntime

from edgeprune.errors import UserError
from exporters.quantization import ort_int8 as int8
from exporters.quantization.calibration import ArrayCalibrationReader
from exporters.quantization.config import QuantizeConfig
from exporters.quantization.registry import Converted, Recipe, RecipeJob, register_recipe
from exporters.quantization.smoothing import smooth_onnx


class OrtRecipe(Recipe):
    """ONNX Runtime's quantizers (module docstring): static QDQ or dynamic int8."""

    name = "ort"
    modes = ("static", "dynamic")

    def needs_calibration(self, cfg: QuantizeConfig) -> bool:
        """Static mode calibrates; dynamic int8 reads images only for smoothing and ``--auto-exclude``."""
        return (cfg.common.mode == "static" or cfg.common.smooth_alpha is not None
                or cfg.ort.auto_exclude > 0)

    def run(self, job: RecipeJob) -> Converted:
        """Smoothing, pre-processing, node selection, quantization, sensitivity pass (module docstring).

        Raises:
            UserError: no node of the quantized op types; an ``--exclude`` pattern matching nothing, or nothing left
                to quantize; ``--auto-exclude`` at least the number of nodes left to quantize.
        """
        cfg, c, tmp, say = job.cfg, job.cfg.common, job.workdir, job.say
        smoothing: list[dict[str, Any]] = []
        to_quantize = job.float_path
        if c.smooth_alpha is not None:
            smoothing = smooth_onnx(job.float_path, tmp / "smooth.onnx", job.calib, c.smooth_alpha,
                                    c.batch_size, c.threads)
            to_quantize = tmp / "smooth.onnx"
            say(f"smoothing (alpha {c.smooth_alpha:g}): {len(smoothing)} LayerNorm -> MatMul sites")
        pre = int8.preprocess(to_quantize, tmp / "pre.onnx") if cfg.ort.preprocess else to_quantize
        names, excluded, attention = _select(job.src, pre, cfg)
        left = len(names) - len(excluded)
        if left == 0:  # issue 52: --exclude alone is refused when it matches all (match_patterns); with attention:
            raise UserError(f"nothing would be quantized: --exclude and the attention products (float unless "
                            f"--quantize-attention) cover all {len(names)} quantizable nodes (exclude fewer nodes)")
        if cfg.ort.auto_exclude >= left:  # issue 41: else every node stays float and the "int8" file is float
            raise UserError(f"--auto-exclude {cfg.ort.auto_exclude} would keep all {left} quantizable nodes in float "
                            f"(nothing quantized): give --auto-exclude below {left}")
        cache = tmp / "calibration.json"
        reader = None
        if c.mode == "static":
            assert job.calib is not None  # static int8 always gathers calibration images
            fixed = _fixed_batch(pre)
            reader = ArrayCalibrationReader(job.calib, _input_name(pre), fixed or c.batch_size,
                                            fixed_batch=bool(fixed))
        doing = (f"calibrating ({cfg.ort.calib_method}) and quantizing" if c.mode == "static"
                 else "quantizing (dynamic: activation ranges at run time)")
        say(f"int8: {doing} {len(names) - len(excluded)} of {len(names)} "
            f"{'/'.join(int8.quantizable_op_types(cfg))} nodes"
            + (f" ({len(attention)} attention products kept float; --quantize-attention to include them)"
               if attention else ""))
        int8.quantize_int8(pre, job.quant_path, cfg, reader=reader, cache=cache, nodes_to_exclude=excluded)
        sensitivity: list[dict[str, Any]] = []
        auto: list[str] = []
        if cfg.ort.auto_exclude:
            assert job.calib is not None  # gathered whenever auto_exclude > 0
            cand = [n for n in names if n not in excluded]
            imgs = job.calib[:c.sensitivity_images]
            say(f"sensitivity: quantizing each of {len(cand)} nodes alone on {len(imgs)} calibration images")
            ref = int8.run_model(pre, imgs, c.batch_size, c.threads)
            sensitivity = int8.rank_sensitivity(pre, cand, imgs, ref, cfg, cache, tmp)
            auto = [r["node"] for r in sensitivity[:cfg.ort.auto_exclude]]
            excluded = [n for n in names if n in excluded or n in auto]
            say("keeping in float: " + ", ".join(auto))
            int8.quantize_int8(pre, job.quant_path, cfg, cache=cache, nodes_to_exclude=excluded)
        tool = (f"onnxruntime {onnxruntime.__version__} quantize_static (QDQ)" if c.mode == "static"
                else f"onnxruntime {onnxruntime.__version__} quantize_dynamic (DynamicQuantizeLinear + MatMulInteger)")
        return Converted(tool, excluded, attention, smoothing, sensitivity, auto)


def _select(src: Path, pre: Path, cfg: QuantizeConfig) -> tuple[list[str], list[str], list[str]]:
    """``(quantizable node names, the ones kept float, attention products among them)``."""
    op_types = int8.quantizable_op_types(cfg)
    names = int8.quantizable_nodes(pre, op_types)
    if not names:
        dynamic = " in --mode dynamic (MatMul/Gemm only)" if cfg.common.mode == "dynamic" else ""
        raise UserError(f"{src} has no {'/'.join(op_types) or '/'.join(cfg.ort.op_types)} nodes to quantize{dynamic}")
    excluded = int8.match_patterns(cfg.common.exclude, names)
    attention: list[str] = []
    if not cfg.ort.quantize_attention:
        attention = int8.activation_matmuls(pre, names)
        excluded = [n for n in names if n in excluded or n in attention]
    return names, excluded, attention


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


register_recipe(OrtRecipe())
