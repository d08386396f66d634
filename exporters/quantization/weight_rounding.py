"""How int8 weights are rounded: nearest, or GPTQ's error-compensating order (a registry).

Both keep TensorRT's weight format (``exporters.quantization.qdq``): symmetric int8, one scale per output
channel, ``scale_j = max_k |W_kj| / 127`` of the float weight -- only the integer values differ.

* ``nearest`` -- ``q = clip(round(W / scale), -127, 127)`` (round to nearest).
* ``gptq`` -- GPTQ (Frantar et al., ICLR 2023, Algorithm 1; the optimal-brain-quantizer update of
  Frantar & Alistarh 2022): quantize the input rows ``k = 0 .. K-1`` of ``W`` (K, O) one at a time
  and spread each row's rounding error over the rows not yet quantized so that the GEMM *output*
  error on the calibration activations, ``||X (Q - W)||_F^2`` with ``H = X^T X``, is minimised
  greedily::

      H <- H + damp * mean(diag H) * I            (dead inputs: H_kk = 1, W_k = 0)
      U  = chol(H^-1)^T                          (upper triangular, H^-1 = U^T U)
      for k in 0 .. K-1:
          Q_k  = clip(round(W_k / scale), -127, 127) * scale
          E_k  = (W_k - Q_k) / U_kk
          W_{k+1:} -= U_{k, k+1:}^T E_k

  With ``H`` proportional to the identity (white inputs) no error moves and GPTQ equals nearest
  rounding exactly. ``H`` is the Gram matrix of the GEMM's input over every calibration token
  (:class:`exporters.quantization.stats.ActStats` ``gram``), after any smoothing of that input.

The float model is unchanged: only the int8 copy of each weight behind its ``DequantizeLinear``
differs. What it buys on DINOv2: docs/quantization.md (``benchmarks/quant_sensitivity.py --variants``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from edgeprune.registry import Registry
from exporters.quantization.stats import ActStats
from exporters.quantization.qdq import GemmNode, quantize_weight

QMAX = 127
#: GPTQ's dampening: this share of the mean diagonal of H added to the diagonal (Frantar et al.: 1%)
DAMP = 0.01

#: name -> fn(w (K, O) float, gram (K, K) float64 or None) -> (q int8 (K, O), scale float32 (O,));
#: registering a name again replaces it
WEIGHT_ROUNDING: Registry[Callable[[np.ndarray, np.ndarray | None], tuple[np.ndarray, np.ndarray]]] = Registry(
    "weight rounding")


def register_weight_rounding(name: str):
    """Decorator: register ``fn(w, gram) -> (q, scale)`` under ``name`` (``--weight-rounding``; replacing one
    of that name)."""
    return WEIGHT_ROUNDING.decorator(name, replace=True)


def get_weight_rounding(name: str) -> Callable[[np.ndarray, np.ndarray | None], tuple[np.ndarray, np.ndarray]]:
    """The registered rounding ``name``.

    Raises:
        UserError: an unknown name; one line listing the known ones.
    """
    return WEIGHT_ROUNDING.get(name)


def round_nearest(w: np.ndarray, gram: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Round to nearest: ``(q int8 (K, O), scale (O,))`` of ``w`` (K, O), exactly
    :func:`exporters.quantization.qdq.quantize_weight` on the output axis; ``gram`` is ignored."""
    return quantize_weight(w, 1)


def round_gptq(w: np.ndarray, gram: np.ndarray | None, damp: float = DAMP) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ rounding (module docstring) of ``w`` (K, O) for inputs with Gram matrix ``gram`` (K, K).

    Args:
        w: float weight, reduction axis first (``x @ w``).
        gram: ``X^T X`` of the GEMM's input rows (float64); None falls back to nearest rounding.
        damp: relative dampening of ``gram``'s diagonal.

    Returns:
        ``(q int8 (K, O), scale float32 (O,))`` with the same scales as :func:`round_nearest`.

    Raises:
        ValueError: ``gram`` not (K, K).
    """
    if gram is None:
        return round_nearest(w)
    k_in = w.shape[0]
    if gram.shape != (k_in, k_in):
        raise ValueError(f"gram {gram.shape} does not match a weight with {k_in} input rows")
    _, s = quantize_weight(w, 1)
    s64 = s.astype(np.float64)
    work = np.array(w, dtype=np.float64)
    h = np.array(gram, dtype=np.float64)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0
    work[dead] = 0.0
    h[np.diag_indices(k_in)] += damp * float(np.mean(np.diag(h)))
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: H^-1 = U^T U
    q = np.zeros(w.shape, dtype=np.int8)
    for k in range(k_in):
        qk = np.clip(np.rint(work[k] / s64), -QMAX, QMAX)
        q[k] = qk.astype(np.int8)
        err = (work[k] - qk * s64) / u[k, k]
        work[k + 1:] -= np.outer(u[k, k + 1:], err)
    return q, s


# registered by a call, not a decorator: mutmut (tools/mutation_check.py) skips decorated functions
register_weight_rounding("nearest")(round_nearest)
register_weight_rounding("gptq")(round_gptq)


def round_weights(model: Any, gemms: Sequence[GemmNode], stats: ActStats,
                  method: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Int8 weights of ``gemms`` rounded by ``method``, for :func:`exporters.quantization.qdq.insert_qdq`.

    Args:
        model: the float ``ModelProto`` (weights as they will be quantized: after smoothing).
        stats: statistics of the GEMM inputs; ``stats.gram`` (after smoothing) feeds GPTQ, a GEMM
            whose input has none (a ``Conv`` on images) is rounded to nearest.
        method: a registered rounding (``nearest``, ``gptq``).

    Returns:
        GEMM node name -> ``(W_q int8, scales)`` in the weight's own layout (scales on ``g.axis``).

    Raises:
        UserError: an unknown method.
    """
    from onnx import numpy_helper

    fn = get_weight_rounding(method)
    inits = {t.name: t for t in model.graph.initializer}
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for g in gemms:
        if g.op_type == "Conv" or g.w not in inits:
            continue
        w = numpy_helper.to_array(inits[g.w]).astype(np.float32)
        wk = w if g.axis == 1 else w.T  # (K, O)
        q, s = fn(wk, stats.gram.get(g.x))
        out[g.name] = (q if g.axis == 1 else np.ascontiguousarray(q.T), s)
    return out
