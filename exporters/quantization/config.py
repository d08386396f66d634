"""Settings of ``edgeprune quantize``: a common section and one section per recipe, validated once.

:class:`QuantizeConfig` holds three frozen sections:

* :class:`CommonSettings` -- what every recipe reads: precision, mode, recipe, calibration set,
  ``--exclude``, SmoothQuant strength, evaluation and gate, batch and threads;
* :class:`OrtSettings` -- the ONNX Runtime recipe (``exporters.quantization.recipe_ort``);
* :class:`TensorRTSettings` -- the TensorRT recipe (``exporters.quantization.recipe_tensorrt``).

The fp16 recipe has no settings of its own (it reads ``exclude``). ``QuantizeConfig(**flat)``
takes every field by its own name (``QuantizeConfig(calib_size=64, weight_rounding="nearest")``)
and routes it to its section, and ``cfg.<field>`` reads it back, so the CLI and the callers of
:func:`exporters.quantization.quantize.quantize_onnx` name fields as before; library code reads
``cfg.common.<field>``, ``cfg.ort.<field>``, ``cfg.tensorrt.<field>``.

The quantized file's metadata holds :meth:`QuantizeConfig.to_record` under ``quantization`` (the
flat record, keys in :data:`RECORD_ORDER`), so a deployed file says how it was made.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgeprune.errors import UserError
from edgeprune.settings import SettingError
from exporters.quantization.registry import RECIPES, get_recipe
from exporters.quantization.weight_rounding import get_weight_rounding

PRECISIONS = ("int8", "fp16")
#: int8 modes: ``static`` = QDQ with activation ranges calibrated offline (TensorRT and ONNX
#: Runtime), ``dynamic`` = ONNX Runtime dynamic quantization (DynamicQuantizeLinear +
#: MatMulInteger: each MatMul input's uint8 range is computed at run time, per tensor and batch;
#: ONNX Runtime CPU only, no calibration set needed).
MODES = ("static", "dynamic")
CALIB_METHODS = ("minmax", "entropy", "percentile")
#: Ops that ONNX Runtime quantizes by default here: the matrix products (linear layers, attention
#: products, patch-embedding conv, classifier). Elementwise ops stay float between Q/DQ pairs.
DEFAULT_OP_TYPES = ("MatMul", "Gemm", "Conv")
#: Ops kept in fp32 by the fp16 conversion (numerically sensitive reductions and exponentials),
#: added to ``onnxruntime.transformers.float16.DEFAULT_OP_BLOCK_LIST``.
FP16_KEEP_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                 "Softmax", "ReduceMean", "ReduceSum", "Pow", "Sqrt", "Exp", "Log")


@dataclasses.dataclass(frozen=True)
class CommonSettings:
    """Settings every recipe reads.

    Attributes:
        precision: ``"int8"`` or ``"fp16"`` (ONNX Runtime's transformer float16 conversion, fp32
            inputs/outputs).
        mode: int8 only: ``"static"`` (QDQ, calibrated activation ranges; what TensorRT builds)
            or ``"dynamic"`` (ranges computed at run time by ONNX Runtime's CPU kernels; no
            calibration set; ``MatMul`` and ``Gemm`` weights -- ``Conv`` stays float). On the
            pruned DINOv2 ViT-S/14 (FLOPs x0.5) dynamic lost 0.5 points of top-1 where static
            MinMax lost 2.1, at 0.26x the dense fp32 batch-8 latency (docs/quantization.md).
        recipe: ``"auto"`` or a registered recipe (``exporters.quantization.registry``; built in:
            ``tensorrt``, ``ort``, ``fp16``); see :meth:`QuantizeConfig.recipe_name`.
        calib_size: calibration images; ``None`` = the run's own set size (run record), else
            the ``prune`` default for the model (fmnist-vit 512, dinov2-s14 64, timm 256).
        calib_seed: calibration selection seed; ``None`` = the run's recorded seed, else 0.
        calib_data: calibration directory (Fashion-MNIST idx dir / ImageFolder); ``None`` = the
            model's default data.
        exclude: fnmatch patterns over node names kept in float (every recipe).
        smooth_alpha: SmoothQuant migration strength (``exporters.quantization.smoothing``) of
            every LayerNorm -> MatMul pair before int8; ``None`` = none (ONNX Runtime recipe) or
            alpha searched per site (TensorRT recipe).
        sensitivity_images: calibration images the sensitivity pass evaluates on (ONNX Runtime's
            ``auto_exclude``, the TensorRT recipe's fallback).
        eval_size: held-out evaluation images for the report and the gate.
        eval_data: evaluation directory; ``None`` = the model's default (Fashion-MNIST test split).
        max_drop: gate in points (top-1 loss with labels, else disagreement %); ``None`` = no gate.
        batch_size: images per ONNX Runtime call (calibration and evaluation).
        threads: ONNX Runtime intra-op threads (``None``: ORT's default).
    """

    precision: str = "int8"
    mode: str = "static"
    calib_size: int | None = None
    calib_seed: int | None = None
    calib_data: str | None = None
    exclude: tuple[str, ...] = ()
    smooth_alpha: float | None = None
    sensitivity_images: int = 64
    eval_size: int = 1000
    eval_data: str | None = None
    max_drop: float | None = None
    batch_size: int = 32
    threads: int | None = None
    recipe: str = "auto"

    def validate(self) -> None:
        """Raises: UserError: an unknown precision / mode / recipe, a bad size, count or range."""
        if self.precision not in PRECISIONS:
            raise UserError(f"unknown precision {self.precision!r} (use {' or '.join(PRECISIONS)})")
        if self.mode not in MODES:
            raise UserError(f"unknown int8 mode {self.mode!r} (use {' or '.join(MODES)})")
        if self.mode == "dynamic" and self.precision != "int8":
            raise SettingError("{mode} dynamic applies to int8 (fp16 has no activation ranges)")
        for name in ("calib_size", "eval_size", "sensitivity_images", "batch_size", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name.replace('_', '-')} must be >= 1, got {value}")
        if self.max_drop is not None and not self.max_drop >= 0:
            raise SettingError(f"{{max_drop}} must be >= 0 points, got {self.max_drop}")
        if self.smooth_alpha is not None and not 0.0 <= self.smooth_alpha <= 1.0:
            raise SettingError(f"{{smooth_alpha}} must be in [0, 1], got {self.smooth_alpha}")
        if self.smooth_alpha is not None and self.precision != "int8":
            raise SettingError("{smooth_alpha} applies to int8 (fp16 needs no range migration)")
        if self.recipe != "auto":
            get_recipe(self.recipe)
        if any(not p for p in self.exclude):
            raise SettingError("{exclude} patterns must not be empty")


@dataclasses.dataclass(frozen=True)
class OrtSettings:
    """Settings of the ONNX Runtime recipe (``quantize_static`` / ``quantize_dynamic``).

    Attributes:
        calib_method: activation ranges (static mode): ``"minmax"``, ``"entropy"`` (KL) or
            ``"percentile"`` (99.999 %).
        per_channel: per-output-channel weight scales (symmetric int8 weights always).
        activation_symmetric: symmetric int8 activations (zero point 0) -- what TensorRT's
            explicit-quantization path requires; ``False`` = asymmetric uint8 activations
            (ONNX Runtime's U8S8 CPU kernels; not for TensorRT). Static mode only: dynamic
            activations are always asymmetric uint8.
        op_types: op types to quantize.
        quantize_attention: also quantize the activation x activation ``MatMul`` nodes (attention's
            ``Q K^T`` and ``softmax V``: no constant operand). Off by default: per-tensor int8 of
            the softmax output keeps ~1/127 resolution where most probabilities are ~1/n_tokens;
            on DINOv2 (pruned both@0.5, 1000 test images) keeping them float cut int8's top-1
            drop from 3.2 to 1.9 points (docs/quantization.md); TensorRT runs its fused attention
            in fp16 either way. They have no weights, so the file size does not change.
        auto_exclude: additionally keep the N most quantization-sensitive nodes in float
            (``exporters.quantization.ort_int8.rank_sensitivity``).
        calib_chunk_images: images whose intermediate outputs ONNX Runtime's calibrator holds at
            once (``exporters.quantization.ort_int8.chunk_batches``; ~48 MB per image for DINOv2
            ViT-S).
        preprocess: run ``onnxruntime.quantization.shape_inference.quant_pre_process`` (symbolic
            shape inference + ORT's basic graph optimisations) before int8 quantization.
    """

    calib_method: str = "minmax"
    per_channel: bool = True
    activation_symmetric: bool = True
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    quantize_attention: bool = False
    auto_exclude: int = 0
    calib_chunk_images: int = 32
    preprocess: bool = True

    def validate(self, common: CommonSettings) -> None:
        """Raises: UserError: an unknown method, a bad count, an option the precision / mode lacks."""
        if common.mode == "dynamic" and self.calib_method != "minmax":
            raise SettingError("{calib_method} applies to {mode} static (dynamic int8 computes activation "
                               "ranges at run time)")
        if self.calib_method not in CALIB_METHODS:
            raise UserError(f"unknown calibration method {self.calib_method!r} (use {', '.join(CALIB_METHODS)})")
        if self.calib_chunk_images < 1:
            raise UserError(f"calib-chunk-images must be >= 1, got {self.calib_chunk_images}")
        if self.auto_exclude < 0:
            raise SettingError(f"{{auto_exclude}} must be >= 0, got {self.auto_exclude}")
        if self.auto_exclude and common.precision != "int8":
            raise SettingError("{auto_exclude} applies to int8 (fp16 keeps sensitive ops in fp32 already)")
        if not self.op_types:
            raise UserError("op_types must name at least one op type to quantize")


@dataclasses.dataclass(frozen=True)
class TensorRTSettings:
    """Settings of the TensorRT recipe (``exporters.quantization.recipe_tensorrt``).

    Attributes:
        clip_kinds: GEMM kinds whose input range is clipped by searched output error
            (``exporters.quantization.qdq.KIND_PATTERNS``; others MinMax).
        explicit_smooth_kinds: GEMM kinds smoothed through an explicit per-channel ``Mul`` (no
            LayerNorm to fold into: ``fc2`` after GELU; ``exporters.quantization.smoothing_explicit``);
            ``()``: none.
        weight_rounding: ``gptq`` (error-compensating order, needs the inputs' Gram matrices) or
            ``nearest`` (``exporters.quantization.weight_rounding``).
        fallback_share: a GEMM whose isolated error is at least this share of the summed isolated
            error may be kept float (most error per FLOP first,
            ``exporters.quantization.recipe_tensorrt.choose_fallback``; 1 = no fallback); ``None``
            (default): at least the mean isolated error, i.e. a share of 1 / (number of GEMMs).
        max_float_flops: at most this share of GEMM FLOPs kept float by the fallback.
    """

    clip_kinds: tuple[str, ...] = ()
    explicit_smooth_kinds: tuple[str, ...] = ("fc2",)
    weight_rounding: str = "gptq"
    fallback_share: float | None = None
    max_float_flops: float = 0.10

    def validate(self) -> None:
        """Raises: UserError: a share outside its range, an unknown weight rounding."""
        share_ok = self.fallback_share is None or 0.0 < self.fallback_share <= 1.0
        if not 0.0 <= self.max_float_flops <= 1.0 or not share_ok:
            raise UserError("max_float_flops must be in [0, 1] and fallback_share in (0, 1] (or None: the mean)")
        get_weight_rounding(self.weight_rounding)


_SECTIONS = (("common", CommonSettings), ("ort", OrtSettings), ("tensorrt", TensorRTSettings))
#: section name -> its field names (the flat names ``QuantizeConfig`` routes)
SECTION_FIELDS = {name: tuple(f.name for f in dataclasses.fields(cls)) for name, cls in _SECTIONS}
#: key order of :meth:`QuantizeConfig.to_record` (the order of the one flat dataclass this replaced:
#: stored files and ``--json`` reports keep their layout)
RECORD_ORDER = ("precision", "mode", "calib_method", "calib_size", "calib_seed", "calib_data", "per_channel",
                "activation_symmetric", "op_types", "exclude", "quantize_attention", "smooth_alpha",
                "auto_exclude", "sensitivity_images", "eval_size", "eval_data", "max_drop", "batch_size",
                "calib_chunk_images", "preprocess", "threads", "recipe", "clip_kinds", "explicit_smooth_kinds",
                "weight_rounding", "fallback_share", "max_float_flops")


@dataclasses.dataclass(frozen=True, init=False)
class QuantizeConfig:
    """How to quantize an exported ONNX model: :class:`CommonSettings`, :class:`OrtSettings`,
    :class:`TensorRTSettings` (module docstring).

    Args:
        common, ort, tensorrt: the sections (defaults: each section's defaults).
        **flat: any section field by its own name, applied over the sections
            (``QuantizeConfig(threads=1, weight_rounding="nearest")``).

    Raises:
        TypeError: a keyword that names no field.
    """

    common: CommonSettings
    ort: OrtSettings
    tensorrt: TensorRTSettings

    def __init__(self, common: CommonSettings | None = None, ort: OrtSettings | None = None,
                 tensorrt: TensorRTSettings | None = None, **flat: Any) -> None:
        given = {"common": common, "ort": ort, "tensorrt": tensorrt}
        for name, cls in _SECTIONS:
            section = given[name] if given[name] is not None else cls()
            mine = {k: flat.pop(k) for k in SECTION_FIELDS[name] if k in flat}
            object.__setattr__(self, name, dataclasses.replace(section, **mine) if mine else section)
        if flat:
            raise TypeError(f"QuantizeConfig got unexpected keyword argument(s): {', '.join(sorted(flat))}")

    def __getattr__(self, name: str) -> Any:
        """``cfg.<field>``: a section field by its flat name (read only)."""
        for section, fields in SECTION_FIELDS.items():
            if name in fields and section in self.__dict__:
                return getattr(self.__dict__[section], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def ort_only_options(self) -> list[str]:
        """The options set away from their default that only the ONNX Runtime recipe honours."""
        c, o = self.common, self.ort
        flags = {"--asymmetric-activations": not o.activation_symmetric,
                 "--calib-method": o.calib_method != "minmax", "--smooth-alpha": c.smooth_alpha is not None,
                 "--auto-exclude": o.auto_exclude > 0, "--quantize-attention": o.quantize_attention,
                 "--per-tensor": not o.per_channel, "op_types": tuple(o.op_types) != DEFAULT_OP_TYPES}
        return [k for k, v in flags.items() if v]

    def recipe_name(self) -> str:
        """The registered recipe that runs: ``recipe`` when it serves this precision and mode (for
        the built-ins: ``tensorrt`` static int8, ``ort`` int8, ``fp16`` fp16); otherwise (``auto``,
        or a recipe for another precision / mode) ``fp16`` for fp16, ``ort`` for dynamic int8, and
        for static int8 ``ort`` when an ONNX-Runtime-only option is set
        (:meth:`ort_only_options`), else ``tensorrt``."""
        c = self.common
        chosen = RECIPES.find(c.recipe) if c.recipe != "auto" else None
        if chosen is not None and chosen.serves(c.precision, c.mode):
            return c.recipe
        if c.precision != "int8":
            return "fp16"
        if c.mode != "static":
            return "ort"
        return "ort" if self.ort_only_options() else "tensorrt"

    def resolved_recipe(self) -> str:
        """The static int8 recipe (:meth:`recipe_name`); ``""`` for fp16 and dynamic int8 (recorded as
        ``recipe_used``)."""
        if self.common.precision != "int8" or self.common.mode != "static":
            return ""
        return self.recipe_name()

    def validate(self) -> "QuantizeConfig":
        """Check every field once, before any work; returns ``self``.

        Raises:
            UserError: an unknown precision / method / recipe, a negative size, count or threshold,
                an option the named recipe does not honour.
        """
        self.common.validate()
        self.ort.validate(self.common)
        if self.common.recipe != "auto":
            get_recipe(self.common.recipe).check(self)
        self.tensorrt.validate()
        return self

    def to_record(self) -> dict[str, Any]:
        """JSON-ready flat dict of the settings (stored as ``quantization`` metadata), keys in
        :data:`RECORD_ORDER`, then ``recipe_used``."""
        flat: dict[str, Any] = {}
        for name, _ in _SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, name)))
        rec = {k: list(flat[k]) if isinstance(flat[k], tuple) else flat[k] for k in RECORD_ORDER}
        rec["recipe_used"] = self.resolved_recipe()
        return rec
