"""SmoothQuant where no LayerNorm can take the scale: an explicit per-channel ``Mul`` before the GEMM.

SmoothQuant (Xiao et al., ICML 2023, eq. 4) divides activation channel ``j`` by ``s_j`` and
multiplies row ``j`` of the weight by it, so that ``(X / s)(s W) = X W``. Before ``qkv`` and
``fc1`` the division folds into the preceding LayerNorm's gamma and beta (``exporters.quantization.smoothing``).
``fc2`` reads GELU's output: no scale folds through GELU, so here the division is a node of its
own, ``Mul(x, 1 / s)``, between GELU and the GEMM's ``QuantizeLinear`` -- as Intel Neural
Compressor's ONNX SmoothQuant inserts a ``Mul`` where no producer can absorb the scale, and as
NVIDIA ModelOpt's ``pre_quant_scale`` multiplies a quantizer's input. On TensorRT it is a
pointwise layer between GELU and the quantize layer (TensorRT fuses pointwise chains; whether this
one fuses into GELU's kernel is not checked here -- no TensorRT on this machine); the GEMM stays
int8.

``s`` comes from the same per-site search as the LayerNorm sites
(:func:`exporters.quantization.smoothing.choose_alpha`: the alpha with the smallest GEMM output error on the
sampled calibration rows; "no smoothing" is a candidate, and then no node is added).

The float model computes the same function (up to float32 rounding of ``x / s`` and ``s W``): the
tests check the logits to 1e-5.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from exporters.quantization.stats import ActStats
from exporters.quantization.smoothing import ALPHAS, choose_alpha
from exporters.quantization.qdq import GemmNode, _safe


def explicit_sites(model: Any, gemms: Sequence[GemmNode], kinds: Sequence[str]) -> list[GemmNode]:
    """GEMMs of ``kinds`` that take an explicit scale: ``MatMul`` with a (K, O) weight used by this
    node alone and a token activation input."""
    users: dict[str, int] = {}
    for node in model.graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    return [g for g in gemms if g.kind in kinds and g.op_type == "MatMul" and g.axis == 1 and users.get(g.w) == 1]


def smooth_explicit(model: Any, stats: ActStats, gemms: Sequence[GemmNode], kinds: Sequence[str],
                    alphas: Sequence[float | None] = ALPHAS) -> list[dict[str, Any]]:
    """Insert ``Mul(x, 1 / s)`` before each GEMM of :func:`explicit_sites` and scale its weight rows
    by ``s`` (``model`` edited in place; ``stats`` gains the new tensors' statistics).

    Args:
        model: float ``ModelProto``; ``stats``: statistics of its GEMM inputs (``rows``,
            ``chan_amax``, optionally ``gram``).
        gemms: from :func:`exporters.quantization.qdq.find_gemms` on ``model`` (call it again afterwards: the
            smoothed GEMMs read the new tensors).
        kinds: GEMM kinds to smooth (``("fc2",)`` in the TensorRT recipe).
        alphas: candidate strengths (one value: that alpha everywhere).

    Returns:
        one ``{"gemm", "alpha", "errors"}`` per site (alpha None: left as it was).
    """
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    before: dict[str, Any] = {}
    report: list[dict[str, Any]] = []
    for g in explicit_sites(model, gemms, kinds):
        if g.x not in stats.rows:
            continue
        w = numpy_helper.to_array(inits[g.w])
        alpha, s, errors = choose_alpha(stats.rows[g.x], stats.chan_amax[g.x], [w.astype(np.float32)], alphas)
        report.append({"gemm": g.name, "alpha": alpha, "errors": errors})
        if alpha is None:
            continue
        base = _safe(g.name)
        inv, out = f"{base}_smooth_inv_scale", f"{g.x}_smoothed_{base}"
        model.graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), inv))
        inits[g.w].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(w.dtype), g.w))
        before[g.name] = helper.make_node("Mul", [g.x, inv], [out], name=f"{base}_smooth_Mul")
        stats.alias(g.x, out, s)
    if before:
        nodes = []
        for node in model.graph.node:
            mul = before.get(node.name)
            if mul is not None:
                nodes.append(mul)
                node.input[0] = mul.output[0]
            nodes.append(node)
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return report
