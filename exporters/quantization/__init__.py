"""Quantization of exported ONNX models: int8 for TensorRT and ONNX Runtime, fp16 (``edgeprune quantize``).

The public face: :func:`quantize_onnx` (one entry point for every recipe), :class:`QuantizeConfig`
(a common section and one section per recipe; ``exporters.quantization.config``), the recipe
registry (:class:`Recipe`, :func:`register_recipe`; ``exporters.quantization.registry``).

Layout (docs/quantization.md walks through the recipes)::

    quantize.py            the entry point: inputs, data, recipe, measurement, gate, metadata
    config.py              QuantizeConfig: CommonSettings, OrtSettings, TensorRTSettings
    registry.py            Recipe, RecipeJob, Converted, register_recipe / get_recipe
    recipe_tensorrt.py     tensorrt: searched SmoothQuant, GPTQ, clipping, fallback, Q/DQ by hand
    recipe_ort.py          ort: ONNX Runtime quantize_static / quantize_dynamic
    recipe_fp16.py         fp16: ONNX Runtime's float16 conversion
    calibration.py         the one calibration set and reader (ArrayCalibrationReader)
    stats.py               the one statistics pass (absmax, per-channel absmax, row sample, Gram)
    smoothing.py           SmoothQuant: sites, scales, alpha search, folding (both recipes)
    smoothing_explicit.py  SmoothQuant through an explicit Mul (fc2, TensorRT recipe)
    search.py              GEMM output error, clipping search
    qdq.py                 TensorRT's Q/DQ placement, GEMM discovery, int8 weights
    weight_rounding.py     nearest / GPTQ rounding (a registry)
    gemm_error.py          per-GEMM / per-group sensitivity, the shared output cost
    ort_int8.py            ONNX Runtime quantizer calls, node selection, --auto-exclude ranking
    metadata.py            the quantized file's metadata

Importing the package registers the built-in recipes (tensorrt, ort, fp16).
"""

from exporters.quantization import recipe_fp16, recipe_ort, recipe_tensorrt  # noqa: F401  (register the recipes)
from exporters.quantization.config import QuantizeConfig
from exporters.quantization.quantize import QualityGateError, QuantizeResult, quantize_onnx
from exporters.quantization.registry import RECIPES, Converted, Recipe, RecipeJob, get_recipe, register_recipe

__all__ = ["Converted", "QualityGateError", "QuantizeConfig", "QuantizeResult", "RECIPES", "Recipe", "RecipeJob",
           "get_recipe", "quantize_onnx", "register_recipe"]
