"""int8 with ONNX Runtime static quantization (QDQ), and the per-node sensitivity pass.

Quantization
------------
``onnxruntime.quantization.quantize_static`` in QDQ format: every quantized op gets
``QuantizeLinear``/``DequantizeLinear`` pairs on its inputs (the explicit-quantization form that
TensorRT and ONNX Runtime both fuse into int8 kernels). Weights are symmetric int8, per output
channel by default (one scale per row of a ``Gemm``/``Conv`` weight, per column of a ``MatMul``
weight stored (in, out)); activations are int8 with ranges from the calibration images (MinMax,
Entropy or Percentile), symmetric int8 by default because TensorRT requires zero points of 0
(``activation_symmetric=False``: asymmetric uint8 activations, the U8S8 kernels ONNX Runtime
prefers on x86 CPUs; ONNX Runtime only). Only the
matrix products (``MatMul``, ``Gemm``, ``Conv``) are quantized; LayerNorm, Softmax, GELU and the
residual adds stay float between Q/DQ pairs. Activation ranges are computed once and kept in a
calibration cache (``calibration_cache_path``), so later passes (sensitivity, the final model)
reuse them instead of recalibrating.

Dynamic quantization (``--mode dynamic``)
-----------------------------------------
:func:`quantize_dynamic_int8`: ``onnxruntime.quantization.quantize_dynamic``. Weights of the
``MatMul`` nodes are stored symmetric int8 (per output channel by default); each quantized
MatMul's input is quantized at run time by ``DynamicQuantizeLinear`` (asymmetric uint8, one range
per tensor, i.e. per batch), then ``MatMulInteger``; ONNX Runtime's CPU provider fuses the chain
into ``DynamicQuantizeMatMul``. No calibration set and no range mismatch between calibration and
deployment images -- but an image's result depends slightly on the other images in its batch, and
TensorRT cannot build it (no Q/DQ nodes: ``exporters.tensorrt_settings.onnx_precision`` refuses it
for builds). ``MatMul`` and ``Gemm`` nodes are quantized (ONNX Runtime rewrites each ``Gemm`` as
``<name>_MatMul`` + ``<name>_Add`` first; exclusions by the ``Gemm``'s name follow it); ``Conv``
(``ConvInteger``, the patch embedding) stays float.

Sensitivity (``--auto-exclude N``)
----------------------------------
:func:`rank_sensitivity` quantizes *one candidate node at a time* (``nodes_to_quantize=[node]``,
everything else float, the cached ranges) and runs each variant on ``sensitivity_images``
calibration images (default 64). A node's cost is the loss of top-1 agreement with the float
model, ties broken by the relative squared logit error ``||q - f||^2 / ||f||^2`` (with 64 images
most single nodes flip no prediction, so the logit error carries the ranking), both from
``exporters.quantization.gemm_error.output_cost`` (why this pass and the TensorRT recipe's
``gemm_sensitivity`` both exist: that module's docstring). The N costliest
nodes stay float. Isolating nodes ignores interactions between them, but costs one quantizer pass
plus one small inference per candidate: about 40 candidates and well under a minute for
fmnist-vit on one CPU core, versus a full calibration per candidate for exclusion-based search.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import logging
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from edgeprune.errors import RuntimeFault, UserError
from exporters.ort_session import load_session
from exporters.quantization.config import QuantizeConfig
from exporters.quantization.gemm_error import output_cost
from exporters.verify import check_input_shape, run_onnx

_METHODS = {"minmax": "MinMax", "entropy": "Entropy", "percentile": "Percentile"}


def preprocess(src: Path, dst: Path) -> Path:
    """``quant_pre_process``: symbolic shape inference and ORT's basic optimisations (constant
    folding of shape arithmetic), as ONNX Runtime recommends before static quantization.

    Returns ``dst``, or ``src`` when pre-processing fails (the model is then quantized as it is).
    """
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        quant_pre_process(str(src), str(dst), skip_symbolic_shape=False)
    except Exception as err:  # noqa: BLE001 - optional step; the plain model quantizes too
        logging.getLogger(__name__).info("quant_pre_process failed (%s); quantizing as exported", err)
        return src
    return dst


def quantizable_nodes(model_path: Path, op_types: Sequence[str]) -> list[str]:
    """Names of the nodes of ``op_types`` in graph order (unnamed nodes cannot be excluded)."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    return [n.name for n in m.graph.node if n.op_type in op_types and n.name]


def activation_matmuls(model_path: Path, names: Sequence[str]) -> list[str]:
    """The ``MatMul`` nodes among ``names`` whose two operands are both computed at run time (no
    initializer or ``Constant`` operand): attention's ``Q K^T`` and ``softmax V`` in a ViT."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    const = {t.name for t in m.graph.initializer}
    const.update(o for n in m.graph.node if n.op_type == "Constant" for o in n.output)
    wanted = set(names)
    return [n.name for n in m.graph.node
            if n.op_type == "MatMul" and n.name in wanted and not any(i in const for i in n.input[:2])]


def match_patterns(patterns: Sequence[str], names: Sequence[str], what: str = "quantizable node",
                   result: str = "nothing would be quantized") -> list[str]:
    """Node names matching any fnmatch pattern, in graph order.

    ``what`` / ``result``: how the message names the nodes and what excluding them all would leave
    (fp16: every node, nothing converted).

    Raises:
        UserError: a pattern that matches no node (the message shows example names); the patterns
            together match every node (issue 52: the "quantized" file would be the float model).
    """
    out: list[str] = []
    for pat in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
        if not hits:
            example = ", ".join(names[:2])
            raise UserError(f"--exclude {pat!r} matches no {what} (names look like {example})")
        out.extend(h for h in hits if h not in out)
    if names and len(out) == len(set(names)):
        given = " ".join(f"--exclude {p!r}" for p in patterns)
        verb = "matches" if len(patterns) == 1 else "together match"
        raise UserError(f"{given} {verb} every {what} ({len(set(names))}): {result} (exclude fewer nodes)")
    return [n for n in names if n in out]


def chunk_batches(num_batches: int, batch_size: int, chunk_images: int) -> int:
    """Batches per calibration chunk: the largest divisor of ``num_batches`` (ONNX Runtime's
    ``CalibStridedMinMax`` needs one) holding at most ``chunk_images`` images, at least 1.

    ONNX Runtime's calibrators keep every intermediate output of the batches they are given
    before reducing them (min/max, or histograms): all at once, a DINOv2 ViT-S/14 needs ~48 MB
    per image (18 GB at 256 images: killed for memory on a 24 GB machine). Chunks bound that
    to ``chunk_images`` images; min/max ranges merge exactly across chunks, histograms are
    merged (re-binned when the range grows).
    """
    most = max(1, int(chunk_images) // max(1, int(batch_size)))
    return max(d for d in range(1, max(1, num_batches) + 1) if num_batches % d == 0 and d <= most) \
        if num_batches > 0 else 1


@contextlib.contextmanager
def ort_errors() -> Iterator[None]:
    """Turn an ONNX Runtime quantizer failure into one :class:`RuntimeFault` line (user errors and
    Ctrl-C pass through)."""
    try:
        yield
    except (UserError, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001 - report ORT failures in one line
        msg = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise RuntimeFault(f"ONNX Runtime quantization failed: {msg}") from None


def quantize_static_qdq(src: Path, dst: Path, config: QuantizeConfig, *, reader: Any = None,
                        cache: Path, nodes_to_exclude: Sequence[str] = (),
                        nodes_to_quantize: Sequence[str] | None = None) -> Path:
    """Run ``quantize_static`` (QDQ, symmetric int8 weights) with ``config``'s settings.

    Args:
        src, dst: float model in, QDQ model out.
        reader: a ``CalibrationDataReader``; ``None`` to reuse the ranges in ``cache``.
        cache: calibration cache file (written on the first call, read afterwards).
        nodes_to_exclude: node names kept float; ``nodes_to_quantize``: only these (None = all).

    Raises:
        RuntimeFault: ONNX Runtime fails on a valid model.
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    extra: dict[str, Any] = {
        "WeightSymmetric": True,
        "ActivationSymmetric": bool(config.ort.activation_symmetric),
        # (no CalibMaxIntermediateOutputs: ORT 1.32 fails with "No data is collected" when the
        # batch count is a multiple of it)
    }
    if config.ort.calib_method == "percentile":
        extra["CalibPercentile"] = 99.999
    if reader is not None and hasattr(reader, "set_range"):
        stride = chunk_batches(len(reader), getattr(reader, "batch_size", 1), config.ort.calib_chunk_images)
        if stride < len(reader):
            extra["CalibStridedMinMax"] = stride
    with ort_errors():
        # the histogram calibrators print progress with print(); keep the command's output clean
        with contextlib.redirect_stdout(io.StringIO()):
            quantize_static(
                str(src), str(dst), reader, quant_format=QuantFormat.QDQ,
                op_types_to_quantize=list(config.ort.op_types), per_channel=bool(config.ort.per_channel),
                reduce_range=False, weight_type=QuantType.QInt8,
                activation_type=QuantType.QInt8 if config.ort.activation_symmetric else QuantType.QUInt8,
                nodes_to_quantize=list(nodes_to_quantize) if nodes_to_quantize is not None else None,
                nodes_to_exclude=list(nodes_to_exclude),
                calibrate_method=getattr(CalibrationMethod, _METHODS[config.ort.calib_method]),
                calibration_cache_path=str(cache), extra_options=extra,
            )
    return dst


#: op types ``quantize_dynamic`` quantizes here (see the module docstring).
DYNAMIC_OP_TYPES = ("MatMul", "Gemm")


def quantize_dynamic_int8(src: Path, dst: Path, config: QuantizeConfig, *, reader: Any = None,
                          cache: Path | None = None, nodes_to_exclude: Sequence[str] = (),
                          nodes_to_quantize: Sequence[str] | None = None) -> Path:
    """Run ``quantize_dynamic`` (MatMul/Gemm weights int8, activations quantized at run time).

    Same signature as :func:`quantize_static_qdq` (``reader`` and ``cache`` are unused: dynamic
    quantization needs no calibration), so :func:`quantize_int8` can pick either by mode.

    Raises:
        RuntimeFault: ONNX Runtime fails on a valid model.
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    gemms = {n.name for n in onnx.load(str(src), load_external_data=False).graph.node
             if n.op_type == "Gemm" and n.name}

    def follow(names: Sequence[str]) -> list[str]:  # a Gemm is quantized as "<name>_MatMul"
        return [m for n in names for m in ((n, f"{n}_MatMul") if n in gemms else (n,))]

    ops = ["MatMul"] if any(op in config.ort.op_types for op in DYNAMIC_OP_TYPES) else []
    if "Gemm" not in config.ort.op_types:
        nodes_to_exclude = [*nodes_to_exclude, *sorted(gemms)]
    if "MatMul" not in config.ort.op_types:  # Gemms only
        nodes_to_quantize = sorted(gemms) if nodes_to_quantize is None else \
            [n for n in nodes_to_quantize if n in gemms]
    with ort_errors():
        quantize_dynamic(
            str(src), str(dst), per_channel=bool(config.ort.per_channel), reduce_range=False,
            weight_type=QuantType.QInt8, op_types_to_quantize=ops,
            nodes_to_quantize=follow(nodes_to_quantize) if nodes_to_quantize is not None else None,
            nodes_to_exclude=follow(nodes_to_exclude),
            # attention's activation x activation MatMuls are excluded by name unless asked for
            extra_options={"MatMulConstBOnly": not config.ort.quantize_attention},
        )
    return dst


#: int8 quantizers by ``QuantizeConfig.mode``; each takes ``(src, dst, config, *, reader, cache,
#: nodes_to_exclude, nodes_to_quantize)``.
QUANTIZERS = {"static": quantize_static_qdq, "dynamic": quantize_dynamic_int8}


def quantize_int8(src: Path, dst: Path, config: QuantizeConfig, **kwargs: Any) -> Path:
    """Quantize with the quantizer of ``config.common.mode`` (:data:`QUANTIZERS`)."""
    return QUANTIZERS[config.common.mode](src, dst, config, **kwargs)


def quantizable_op_types(config: QuantizeConfig) -> tuple[str, ...]:
    """The op types the chosen mode quantizes: ``config.ort.op_types`` (static), their ``MatMul`` /
    ``Gemm`` part (dynamic, :data:`DYNAMIC_OP_TYPES`)."""
    if config.common.mode == "dynamic":
        return tuple(op for op in config.ort.op_types if op in DYNAMIC_OP_TYPES)
    return tuple(config.ort.op_types)


def run_model(path: Path, x: np.ndarray, batch_size: int = 64, threads: int | None = None) -> np.ndarray:
    """Outputs of an ONNX file on ``x`` (N, C, H, W) with ONNX Runtime CPU, float32."""
    sess = load_session(path, providers=["cpu"], threads=threads)
    fixed = check_input_shape(sess, x.shape)
    return run_onnx(sess, x, fixed, batch_size).astype(np.float32)


def rank_sensitivity(src: Path, candidates: Sequence[str], images: np.ndarray, float_out: np.ndarray,
                     config: QuantizeConfig, cache: Path, workdir: Path) -> list[dict[str, Any]]:
    """Quantize each candidate node alone and measure what it costs (see module docstring).

    Args:
        src: the (pre-processed) float model; ``cache``: its calibration cache (already written).
        candidates: node names; ``images``: (n, C, H, W) calibration images; ``float_out``: the
            float model's outputs on them.

    Returns:
        ``[{"node", "agreement", "rel_err"}]`` sorted costliest first (lowest agreement, then
        largest relative error).
    """
    rows: list[dict[str, Any]] = []
    variant = workdir / "sensitivity.onnx"
    for name in candidates:
        quantize_int8(src, variant, config, cache=cache, nodes_to_quantize=[name])
        out = run_model(variant, images, config.common.batch_size, config.common.threads)
        cost = output_cost(out, float_out)
        rows.append({"node": name, "agreement": cost["agreement"], "rel_err": cost["rel_err"]})
    variant.unlink(missing_ok=True)
    rows.sort(key=lambda r: (float(r["agreement"]), -float(r["rel_err"])))
    return rows
