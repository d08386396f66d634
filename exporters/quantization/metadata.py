"""The quantized file's metadata: the float model's entries plus what ``quantize`` did and measured.

Steps 5 and 6 of ``exporters.quantization.quantize.quantize_onnx``: :func:`output_metadata` builds the dict
(``precision``, ``quantization``, ``excluded_nodes``, ``float_attention_nodes``, ``smoothing``,
``quant_calibration``, ``calibration_sha256``, ``sensitivity``/``auto_excluded_nodes``,
``int8_plan``/``int8_flops_share`` (TensorRT recipe: each GEMM's precision and the share of GEMM
FLOPs left in int8), ``quant_eval``, ``agreement``); :func:`write_with_metadata` stores it and moves
the checked file into place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import onnx

from edgeprune.atomic import file_sha256
from exporters.onnx import encode_metadata
from exporters.quantization.config import QuantizeConfig
from exporters.quantization.registry import Converted


def output_metadata(meta: dict[str, Any], cfg: QuantizeConfig, src: Path, float_path: Path,
                    done: Converted, calib_info: dict[str, Any] | None,
                    report: dict[str, Any]) -> dict[str, Any]:
    """Step 5: the output's metadata: the float model's, plus what was done and measured."""
    md = dict(meta)
    md.update({
        "precision": cfg.common.precision,
        "quantization": {**cfg.to_record(), "tool": done.tool, "float_model": src.name,
                         "float_sha256": file_sha256(float_path)},
        "excluded_nodes": done.excluded,
    })
    if done.attention:
        md["float_attention_nodes"] = done.attention
    if done.smoothing:
        md["smoothing"] = done.smoothing
    if calib_info is not None:
        md["quant_calibration"] = calib_info
        md["calibration_sha256"] = calib_info["sha256"]
    if done.sensitivity:
        md["sensitivity"] = done.sensitivity
        md["auto_excluded_nodes"] = done.auto
    if done.plan:
        md["int8_plan"] = done.plan
        md["int8_flops_share"] = done.plan["int8_flops_share"]
    if report:
        md["quant_eval"] = report
        md["agreement"] = report["agreement"]
    return md


def write_with_metadata(quant_path: Path, md: dict[str, Any], final: Path, out: Path) -> None:
    """Step 6: replace the quantized model's metadata with ``md``, check it, move it to ``out``."""
    proto = onnx.load(str(quant_path))
    del proto.metadata_props[:]
    for key, value in encode_metadata(md).items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save_model(proto, str(final))
    del proto
    onnx.checker.check_model(str(final))
    os.replace(final, out)
