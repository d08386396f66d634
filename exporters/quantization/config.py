"""Settings of ``edgeprune quantize``: one dataclass, validated once, stored with the result.

The quantized file's metadata holds :meth:`QuantizeConfig.to_record` under ``quantization``, so a
deployed file says how it was made.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgeprune.errors import UserError
from exporters.quantization.weight_rounding import get_weight_rounding

PRECISIONS = ("int8", "fp16")
#: int8 modes: ``static`` = ONNX Runtime static quantization in QDQ format (activation ranges
#: calibrated offline; TensorRT and ONNX Runtime), ``dynamic`` = ONNX Runtime dynamic quantization
#: (DynamicQuantizeLinear + MatMulInteger: each MatMul input's uint8 range is computed at run time,
#: per tensor and batch; ONNX Runtime CPU only, no calibration set needed).
MODES = ("static", "dynamic")
#: static int8 recipes: ``tensorrt`` = exporters.quantization.recipe_tensorrt (searched SmoothQuant, searched
#: clipping of fc2 inputs, measured fallback, TensorRT's Q/DQ placement; the default), ``ort`` =
#: ONNX Runtime ``quantize_static`` (the earlier default; every ONNX Runtime option), ``auto`` =
#: ``ort`` when an option only that path has is set (asymmetric activations, --calib-method other
#: than minmax, --smooth-alpha, --auto-exclude, --quantize-attention, --per-tensor, other op
#: types), else ``tensorrt``.
RECIPES = ("auto", "tensorrt", "ort")
CALIB_METHODS = ("minmax", "entropy", "percentile")
#: Ops that ONNX Runtime quantizes by default here: the matrix products (linear layers, attention
#: products, patch-embedding conv, classifier). Elementwise ops stay float between Q/DQ pairs.
DEFAULT_OP_TYPES = ("MatMul", "Gemm", "Conv")
#: Ops kept in fp32 by the fp16 conversion (numerically sensitive reductions and exponentials),
#: added to ``onnxruntime.transformers.float16.DEFAULT_OP_BLOCK_LIST``.
FP16_KEEP_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                 "Softmax", "ReduceMean", "ReduceSum", "Pow", "Sqrt", "Exp", "Log")


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """How to quantize an exported ONNX model.

    Attributes:
        precision: ``"int8"`` (ONNX Runtime static quantization, QDQ format) or ``"fp16"``
            (ONNX Runtime's transformer float16 conversion, fp32 inputs/outputs).
        mode: int8 only: ``"static"`` (QDQ, calibrated activation ranges; what TensorRT builds)
            or ``"dynamic"`` (ranges computed at run time by ONNX Runtime's CPU kernels; no
            calibration set; ``MatMul`` and ``Gemm`` weights -- ``Conv`` stays float). On the pruned DINOv2 ViT-S/14 (FLOPs x0.5) dynamic lost 0.5 points of
            top-1 where static MinMax lost 2.1, at 0.26x the dense fp32 batch-8 latency
            (docs/quantization.md).
        calib_method: int8 activation ranges (static mode): ``"minmax"``, ``"entropy"`` (KL) or
            ``"percentile"`` (99.999 %).
        calib_size: calibration images; ``None`` = the run's own set size (run record), else
            the ``prune`` default for the model (fmnist-vit 512, dinov2-s14 64, timm 256).
        calib_seed: calibration selection seed; ``None`` = the run's recorded seed, else 0.
        calib_data: calibration directory (Fashion-MNIST idx dir / ImageFolder); ``None`` = the
            model's default data.
        per_channel: per-output-channel weight scales (symmetric int8 weights always).
        activation_symmetric: symmetric int8 activations (zero point 0) -- what TensorRT's
            explicit-quantization path requires; ``False`` = asymmetric uint8 activations
            (ONNX Runtime's U8S8 CPU kernels; not for TensorRT). Static mode only: dynamic
            activations are always asymmetric uint8.
        op_types: op types to quantize (int8).
        exclude: fnmatch patterns over node names kept in float (both precisions).
        quantize_attention: also quantize the activation x activation ``MatMul`` nodes (attention's
            ``Q K^T`` and ``softmax V``: no constant operand). Off by default: per-tensor int8 of
            the softmax output keeps ~1/127 resolution where most probabilities are ~1/n_tokens;
            on DINOv2 (pruned both@0.5, 1000 test images) keeping them float cut int8's top-1
            drop from 3.2 to 1.9 points (docs/quantization.md);
            TensorRT runs its fused attention in fp16 either way. They have no weights, so the
            file size does not change.
        smooth_alpha: SmoothQuant migration strength (``exporters.quantization.smoothing``) applied to every
            LayerNorm -> MatMul pair before int8 calibration; ``None`` = no smoothing.
        auto_exclude: additionally keep the N most quantization-sensitive nodes in float (int8;
            see ``exporters.quantization.gemm_error``).
        sensitivity_images: calibration images the sensitivity pass evaluates on.
        eval_size: held-out evaluation images for the report and the gate.
        eval_data: evaluation directory; ``None`` = the model's default (Fashion-MNIST test split).
        max_drop: gate in points (top-1 loss with labels, else disagreement %); ``None`` = no gate.
        batch_size: images per ONNX Runtime call (calibration and evaluation).
        calib_chunk_images: images whose intermediate outputs ONNX Runtime's calibrator holds at
            once (``exporters.quantization.ort_int8.chunk_batches``; memory ~48 MB per image for DINOv2 ViT-S).
        preprocess: run ``onnxruntime.quantization.shape_inference.quant_pre_process`` (symbolic
            shape inference + ORT's basic graph optimisations) before int8 quantization.
        threads: ONNX Runtime intra-op threads for evaluation (``None``: ORT's default).
        recipe: static int8 recipe, :data:`RECIPES` (``auto`` picks ``tensorrt`` unless an
            ONNX-Runtime-only option is set). With ``tensorrt``, ``smooth_alpha`` None means
            alpha searched per site, a number one fixed alpha.
        explicit_smooth_kinds: ``tensorrt`` recipe: GEMM kinds smoothed through an explicit
            per-channel ``Mul`` (no LayerNorm to fold into: ``fc2`` after GELU;
            ``exporters.quantization.smoothing_explicit``); ``()``: none.
        weight_rounding: ``tensorrt`` recipe: ``gptq`` (error-compensating order, needs the inputs'
            Gram matrices) or ``nearest`` (``exporters.quantization.weight_rounding``).
        clip_kinds: ``tensorrt`` recipe: GEMM kinds whose input range is clipped by searched
            output error (``exporters.quantization.qdq.KIND_PATTERNS``; others MinMax).
        fallback_share: ``tensorrt`` recipe: a GEMM whose isolated error is at least this share of
            the summed isolated error may be kept float (most error per FLOP first,
            ``exporters.quantization.recipe_tensorrt.choose_fallback``; 1 = no fallback); ``None`` (default): at
            least the mean isolated error, i.e. a share of 1 / (number of GEMMs).
        max_float_flops: ``tensorrt`` recipe: at most this share of GEMM FLOPs kept float by the
            fallback.
    """

    precision: str = "int8"
    mode: str = "static"
    calib_method: str = "minmax"
    calib_size: int | None = None
    calib_seed: int | None = None
    calib_data: str | None = None
    per_channel: bool = True
    activation_symmetric: bool = True
    op_types: tuple[str, ...] = DEFAULT_OP_TYPES
    exclude: tuple[str, ...] = ()
    quantize_attention: bool = False
    smooth_alpha: float | None = None
    auto_exclude: int = 0
    sensitivity_images: int = 64
    eval_size: int = 1000
    eval_data: str | None = None
    max_drop: float | None = None
    batch_size: int = 32
    calib_chunk_images: int = 32
    preprocess: bool = True
    threads: int | None = None
    recipe: str = "auto"
    clip_kinds: tuple[str, ...] = ()
    explicit_smooth_kinds: tuple[str, ...] = ("fc2",)
    weight_rounding: str = "gptq"
    fallback_share: float | None = None
    max_float_flops: float = 0.10

    def resolved_recipe(self) -> str:
        """``tensorrt`` or ``ort`` for static int8 (see :data:`RECIPES`); ``""`` otherwise."""
        if self.precision != "int8" or self.mode != "static":
            return ""
        if self.recipe != "auto":
            return self.recipe
        return "ort" if self._ort_only_options() else "tensorrt"

    def _ort_only_options(self) -> list[str]:
        flags = {"--asymmetric-activations": not self.activation_symmetric,
                 "--calib-method": self.calib_method != "minmax", "--smooth-alpha": self.smooth_alpha is not None,
                 "--auto-exclude": self.auto_exclude > 0, "--quantize-attention": self.quantize_attention,
                 "--per-tensor": not self.per_channel, "op_types": tuple(self.op_types) != DEFAULT_OP_TYPES}
        return [k for k, v in flags.items() if v]

    def validate(self) -> "QuantizeConfig":
        """Check every field once, before any work; returns ``self``.

        Raises:
            UserError: an unknown precision / method, a negative size, count or threshold.
        """
        if self.precision not in PRECISIONS:
            raise UserError(f"unknown precision {self.precision!r} (use {' or '.join(PRECISIONS)})")
        if self.mode not in MODES:
            raise UserError(f"unknown int8 mode {self.mode!r} (use {' or '.join(MODES)})")
        if self.mode == "dynamic" and self.precision != "int8":
            raise UserError("--mode dynamic applies to int8 (fp16 has no activation ranges)")
        if self.mode == "dynamic" and self.calib_method != "minmax":
            raise UserError("--calib-method applies to --mode static (dynamic int8 computes activation "
                            "ranges at run time)")
        if self.calib_method not in CALIB_METHODS:
            raise UserError(f"unknown calibration method {self.calib_method!r} (use {', '.join(CALIB_METHODS)})")
        for name in ("calib_size", "eval_size", "sensitivity_images", "batch_size", "threads", "calib_chunk_images"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"{name.replace('_', '-')} must be >= 1, got {value}")
        if self.auto_exclude < 0:
            raise UserError(f"--auto-exclude must be >= 0, got {self.auto_exclude}")
        if self.auto_exclude and self.precision != "int8":
            raise UserError("--auto-exclude applies to int8 (fp16 keeps sensitive ops in fp32 already)")
        if self.max_drop is not None and not self.max_drop >= 0:
            raise UserError(f"--max-drop must be >= 0 points, got {self.max_drop}")
        if not self.op_types:
            raise UserError("op_types must name at least one op type to quantize")
        if self.smooth_alpha is not None and not 0.0 <= self.smooth_alpha <= 1.0:
            raise UserError(f"--smooth-alpha must be in [0, 1], got {self.smooth_alpha}")
        if self.smooth_alpha is not None and self.precision != "int8":
            raise UserError("--smooth-alpha applies to int8 (fp16 needs no range migration)")
        if self.recipe not in RECIPES:
            raise UserError(f"unknown int8 recipe {self.recipe!r} (use {', '.join(RECIPES)})")
        bad = [k for k in self._ort_only_options() if k != "--smooth-alpha"]
        if self.recipe == "tensorrt" and bad:
            raise UserError(f"{', '.join(bad)} need --recipe ort (the tensorrt recipe is symmetric int8 with "
                            f"per-channel weights and chooses its own ranges)")
        share_ok = self.fallback_share is None or 0.0 < self.fallback_share <= 1.0
        if not 0.0 <= self.max_float_flops <= 1.0 or not share_ok:
            raise UserError("max_float_flops must be in [0, 1] and fallback_share in (0, 1] (or None: the mean)")
        if any(not p for p in self.exclude):
            raise UserError("--exclude patterns must not be empty")
        get_weight_rounding(self.weight_rounding)
        return self

    def to_record(self) -> dict[str, Any]:
        """JSON-ready dict of the settings (stored as ``quantization`` metadata)."""
        rec = dataclasses.asdict(self)
        rec["op_types"] = list(self.op_types)
        rec["exclude"] = list(self.exclude)
        rec["clip_kinds"] = list(self.clip_kinds)
        rec["explicit_smooth_kinds"] = list(self.explicit_smooth_kinds)
        rec["recipe_used"] = self.resolved_recipe()
        return rec
