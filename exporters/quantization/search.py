"""Per-layer int8 choices measured on calibration activations: the output error, and clipping ranges.

Both searches of the TensorRT recipe minimise a GEMM's *output* error on a sample of calibration
rows (:class:`exporters.quantization.stats.ActStats`), with the exact int8 arithmetic TensorRT runs
(per-tensor symmetric activations ``amax / 127``, per-channel symmetric weights;
``exporters.quantization.qdq``)::

    err(X, W) = ||Q(X) Q(W) - X W||_F^2 / ||X W||_F^2          (:func:`output_error`)

* SmoothQuant's alpha per LayerNorm -> GEMM site (Xiao et al. 2023, eq. 4):
  :func:`exporters.quantization.smoothing.choose_alpha`, with the other smoothing code;
* :func:`choose_clip` -- the activation range ``r x max|X|`` for ``r`` on a grid: a smaller range
  rounds the many small values finer and saturates the few large ones. For ``fc2`` inputs (after
  GELU) no smoothing scale folds exactly, so clipping is what is left; the measured error decides
  (``r = 1`` is MinMax). This is the MSE calibration of TensorRT's / ModelOpt's tooling on the
  GEMM output instead of the tensor itself.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from exporters.quantization.qdq import fake_quant_act, fake_quant_weight

#: candidate clipping ratios of the MinMax range
CLIP_RATIOS: tuple[float, ...] = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.33, 0.25, 0.2, 0.15, 0.1)


def output_error(x: np.ndarray, ws: Sequence[np.ndarray], amax: float, s: np.ndarray | None = None) -> float:
    """Relative squared output error of int8 ``x @ W`` summed over ``ws`` (each (K, O) float32).

    Args:
        x: (R, K) sampled float activations (before any smoothing).
        amax: per-tensor range of the quantized activation (of ``x / s`` when ``s`` is given).
        s: (K,) smoothing factors, or None.
    """
    xs = x if s is None else x / s.astype(np.float32)
    xq = fake_quant_act(xs, amax)
    num = den = 0.0
    for w in ws:
        ref = x @ w
        wq = fake_quant_weight(w if s is None else w * s[:, None].astype(np.float32), axis=1)
        num += float(np.sum((xq @ wq - ref) ** 2, dtype=np.float64))
        den += float(np.sum(ref ** 2, dtype=np.float64))
    return num / max(den, 1e-30)


def choose_clip(x: np.ndarray, amax: float, ws: Sequence[np.ndarray],
                ratios: Sequence[float] = CLIP_RATIOS) -> tuple[float, dict[str, float]]:
    """Clipping ratio ``r`` (range ``r x amax``) with the smallest output error of ``x @ W``.

    Returns:
        ``(r, {str(r): error})``.
    """
    errors = {str(r): output_error(x, ws, r * amax) for r in ratios}
    r = min(ratios, key=lambda v: errors[str(v)])
    return float(r), errors
