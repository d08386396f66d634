"""``edgeprune quantize``'s settings, declared once (issue 53): the sections ``[quantize]`` and ``[evaluation]``.

``edgeprune quantize``'s setting options, its ``--help-all`` "Method" and "Evaluation" groups and its recipe tables are
generated from :class:`QuantizeSection` and :class:`QuantizeEvaluation` (``edgeprune.cli.generate``); the field names
are :func:`edgeprune.jobs.quantize.quantize`'s keywords (``--per-tensor`` = ``per_tensor``), which the job turns
into an :class:`exporters.quantization.QuantizeConfig` (``per_tensor`` -> ``per_channel=False``, ...) and validates
there (one line naming the option). The job's own inputs (the model, the output and its report, the calibration and
evaluation images, their counts, the seed, ``--force``) are not settings.

The sections live beside the job and not in ``exporters.quantization``: importing that package loads ONNX Runtime
(an optional dependency), and the command line's options are built whenever ``edgeprune`` starts. Their choices are
``exporters.quantization.config``'s (a test keeps them equal). Recipes of a9f53a4 had these keys in ``[method]`` and
``[runtime]`` (``threads``): still read there (``edgeprune.cli.recipe.LEGACY_SECTIONS``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprune.settings import Declared, Section, declared_of, setting

#: ``exporters.quantization.config``'s ``PRECISIONS``, ``MODES``, ``CALIB_METHODS``; the recipes a user picks
PRECISIONS = ("int8", "fp16")
MODES = ("static", "dynamic")
RECIPES = ("auto", "tensorrt", "ort")
WEIGHT_ROUNDINGS = ("gptq", "nearest")
CALIB_METHODS = ("minmax", "entropy", "percentile")


@dataclasses.dataclass(frozen=True)
class QuantizeSection(Section):
    """What the quantized copy is: the precision, the int8 mode and recipe, its calibration and float exceptions."""

    name: ClassVar[str] = "quantize"
    title: ClassVar[str] = "Method"  # the --help-all group of quantize's method options, as before

    precision: str | None = setting(None, "int8: ONNX Runtime quantization (--mode); fp16: float16 with fp32 "
                                    "inputs/outputs.", choices=PRECISIONS, essential=True)
    mode: str = setting("static", "int8: static = QDQ with activation ranges calibrated offline (TensorRT and ONNX "
                        "Runtime); dynamic = activation ranges computed at run time (ONNX Runtime CPU only, no "
                        "calibration set; the more accurate and faster choice for x86 CPUs).", choices=MODES,
                        essential=True)
    recipe: str = setting("auto", "static int8: tensorrt = searched SmoothQuant (LayerNorm folds, explicit scales "
                          "before fc2) + GPTQ weight rounding + measured float fallback, TensorRT's Q/DQ placement; "
                          "ort = ONNX Runtime quantize_static (the earlier default); auto = ort when an "
                          "ONNX-Runtime-only option is given, else tensorrt.", choices=RECIPES, essential=True)
    weight_rounding: str | None = setting(None, "static int8, tensorrt recipe: how int8 weights are rounded (gptq: "
                                          "error-compensating, Frantar et al. 2023; nearest: round to nearest)  "
                                          "[default: gptq]", choices=WEIGHT_ROUNDINGS)
    calib_method: str = setting("minmax", "How int8 activation ranges are calibrated.", choices=CALIB_METHODS)
    per_tensor: bool = setting(False, "One weight scale per tensor instead of per output channel.", switch="flag")
    asymmetric_activations: bool = setting(False, "Asymmetric uint8 activations (ONNX Runtime's x86 U8S8 kernels); "
                                           "TensorRT needs the symmetric int8 default.", switch="flag")
    exclude: tuple[str, ...] = setting((), "Keep nodes whose name matches this fnmatch pattern in float "
                                       "(repeatable).", metavar="PATTERN")
    quantize_attention: bool = setting(False, "Also quantize attention's activation x activation MatMuls (Q K^T, "
                                       "softmax V); by default they stay float (they hold no weights; int8 there "
                                       "costs most of the accuracy).", switch="flag")
    smooth_alpha: float | None = setting(None, "SmoothQuant: move this share (0-1, paper: 0.5) of LayerNorm outputs' "
                                         "per-channel range into the next MatMul weights before int8 calibration "
                                         "[off].", metavar="A")
    auto_exclude: int = setting(0, "Also keep the N most quantization-sensitive nodes in float (int8).", minimum=0,
                                metavar="N")


@dataclasses.dataclass(frozen=True)
class QuantizeEvaluation(Section):
    """How the quantized copy is checked on held-out images: the gate and ONNX Runtime's threads."""

    name: ClassVar[str] = "evaluation"
    title: ClassVar[str] = "Evaluation"

    max_drop: float | None = setting(None, "Fail (exit 1, nothing written) if top-1 drops by more than POINTS on the "
                                     "held-out images (without labels: if more than POINTS percent of predictions "
                                     "disagree).", metavar="POINTS", essential=True)
    threads: int | None = setting(None, "ONNX Runtime intra-op threads for the evaluation [ORT's default].",
                                  minimum=1, metavar="N")


#: the sections of a quantize, in help / recipe order
QUANTIZE_SECTIONS: tuple[type[Section], ...] = (QuantizeSection, QuantizeEvaluation)


def quantize_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every quantize setting (``edgeprune.settings.declared_of``)."""
    return declared_of(QUANTIZE_SECTIONS)


__all__ = ["CALIB_METHODS", "MODES", "PRECISIONS", "QUANTIZE_SECTIONS", "QuantizeEvaluation", "QuantizeSection",
           "RECIPES", "WEIGHT_ROUNDINGS", "quantize_declared"]
