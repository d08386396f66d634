"""SmoothQuant scale migration on an exported ONNX graph, before int8 quantization.

Why
---
Per-tensor int8 activations lose the small channels of a tensor that has a few huge ones. After a
LayerNorm, pretrained ViTs (DINOv2 especially) carry such outlier channels: the LayerNorm's
affine weight ``gamma_j`` is tens of times larger in a few channels ``j``. SmoothQuant (Xiao et
al., 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models", eq. 4) divides activation channel ``j`` by ``s_j`` and multiplies row ``j`` of the next
weight by ``s_j``; the product is unchanged in exact arithmetic, and the activation's range is
flattened at the price of a (per-channel-quantized, hence cheap) wider weight range::

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)        (eq. 4; alpha = 0.5 as in the paper)

Where it applies
----------------
Only where the division can be folded into constants, so the graph keeps its nodes and ops
(nothing is inserted; TensorRT and ONNX Runtime see the same graph with other numbers):
a ``LayerNormalization`` whose scale (and bias) are initializers used by no other node, and whose
output is read only by ``MatMul`` nodes with an initializer weight ``(C, out)`` as second input
(the fused ``qkv`` and ``fc1`` projections of a ViT block) or by value-independent ops
(``Shape``). ``gamma_j``, ``beta_j`` are divided by ``s_j`` and row ``j`` of every consuming
weight is multiplied by ``s_j``. ``max|X_j|`` is the largest magnitude of channel ``j`` (last
axis) over the calibration images and tokens, measured with ONNX Runtime on the float graph.

Fixed alpha or searched
-----------------------
:func:`smooth_onnx` (ONNX Runtime recipe, ``--smooth-alpha A``) folds one alpha everywhere;
:func:`apply_smoothing` (TensorRT recipe) folds one alpha or, by default, the alpha of
:func:`choose_alpha` per site: the candidate of :data:`ALPHAS` with the smallest int8 GEMM output
error on sampled calibration rows (as Intel Neural Compressor's and ModelOpt's auto-alpha
SmoothQuant choose alpha per layer). Both fold through :func:`fold_sites`, on statistics of
:func:`exporters.quantization.stats.collect_stats`.

The float model's outputs change only by rounding (tested: relative error ~1e-6).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edgeprune.settings import SettingError
from exporters.quantization.search import output_error
from exporters.quantization.stats import ActStats, collect_stats

#: Consumers of a LayerNorm output that read only its shape, never its values.
_SHAPE_ONLY_OPS = ("Shape",)
#: Bounds on s_j: a channel that is (numerically) zero everywhere must not blow up its weight row.
_S_MIN, _S_MAX = 1e-4, 1e4
#: candidate SmoothQuant strengths of the per-site search (None = no smoothing)
ALPHAS: tuple[float | None, ...] = (None, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


@dataclass(frozen=True)
class SmoothSite:
    """One LayerNorm -> MatMul(s) pair that can be smoothed.

    Attributes:
        norm: the LayerNormalization node name; ``output``: its output tensor (the activation X).
        scale, bias: initializer names of gamma and beta (``bias`` None when absent).
        weights: initializer names of the consuming MatMuls' (C, out) weights.
    """

    norm: str
    output: str
    scale: str
    bias: str | None
    weights: tuple[str, ...]


def find_sites(model: Any) -> list[SmoothSite]:
    """The LayerNorm -> MatMul pairs of an ONNX ``ModelProto`` where smoothing folds into constants
    (see the module docstring for the rule), in graph order."""
    inits = {t.name: t for t in model.graph.initializer}
    consumers: dict[str, list[Any]] = defaultdict(list)
    for node in model.graph.node:
        for name in node.input:
            consumers[name].append(node)
    graph_outputs = {o.name for o in model.graph.output}
    sites: list[SmoothSite] = []
    for node in model.graph.node:
        if node.op_type != "LayerNormalization" or len(node.input) < 2 or node.input[1] not in inits:
            continue
        scale = node.input[1]
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        if bias is not None and bias not in inits:
            continue
        if any(len(consumers[p]) != 1 for p in (scale, bias) if p is not None):
            continue  # gamma / beta shared with another node: cannot rescale them for this one alone
        out = node.output[0]
        readers = consumers[out]
        weights: list[str] = []
        ok = out not in graph_outputs and bool(readers)
        for r in readers:
            if r.op_type in _SHAPE_ONLY_OPS:
                continue
            if (r.op_type == "MatMul" and r.input[0] == out and r.input[1] in inits
                    and len(inits[r.input[1]].dims) == 2 and len(consumers[r.input[1]]) == 1):
                weights.append(r.input[1])
            else:
                ok = False
        if ok and weights:
            sites.append(SmoothSite(node.name, out, scale, bias, tuple(weights)))
    return sites


def smoothing_scales(x_absmax: np.ndarray, w_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """SmoothQuant's per-channel factors ``s = x^alpha / w^(1 - alpha)`` (eq. 4), clipped to
    [1e-4, 1e4]; channels with a zero activation or weight range get 1.

    Args:
        x_absmax: (C,) max |X_j| over the calibration set; ``w_absmax``: (C,) max_k |W_jk| over
            every consuming weight; ``alpha`` in [0, 1].
    """
    x = np.asarray(x_absmax, dtype=np.float64)
    w = np.asarray(w_absmax, dtype=np.float64)
    s = np.ones_like(x)
    ok = (x > 0) & (w > 0)
    s[ok] = x[ok] ** alpha / w[ok] ** (1.0 - alpha)
    return np.clip(s, _S_MIN, _S_MAX)


def site_weight_absmax(inits: dict[str, Any], site: SmoothSite) -> np.ndarray:
    """(C,) max over every consuming weight of ``max_k |W_jk|`` (row j = input channel j)."""
    from onnx import numpy_helper

    ws = [np.abs(numpy_helper.to_array(inits[name])).max(axis=1) for name in site.weights]
    return np.max(np.stack(ws), axis=0).astype(np.float64)


def fold_site(inits: dict[str, Any], site: SmoothSite, s: np.ndarray) -> None:
    """Fold the per-channel factors ``s`` (C,) into one site, editing the initializers in place:
    ``gamma / s``, ``beta / s`` and row ``j`` of every consuming weight times ``s_j``. The
    LayerNorm's output becomes ``x / s`` and every product ``(x / s) (s W) = x W`` is unchanged."""
    from onnx import numpy_helper

    gamma = numpy_helper.to_array(inits[site.scale])
    inits[site.scale].CopyFrom(numpy_helper.from_array((gamma / s).astype(gamma.dtype), site.scale))
    if site.bias is not None:
        beta = numpy_helper.to_array(inits[site.bias])
        inits[site.bias].CopyFrom(numpy_helper.from_array((beta / s).astype(beta.dtype), site.bias))
    for name in site.weights:
        w = numpy_helper.to_array(inits[name])
        inits[name].CopyFrom(numpy_helper.from_array((w * s[:, None]).astype(w.dtype), name))


def choose_alpha(x: np.ndarray, chan_amax: np.ndarray, ws: Sequence[np.ndarray],
                 alphas: Sequence[float | None] = ALPHAS) -> tuple[float | None, np.ndarray, dict[str, float]]:
    """SmoothQuant strength with the smallest int8 GEMM output error for one site
    (:func:`exporters.quantization.search.output_error`, summed over the site's GEMMs).

    Args:
        x: (R, K) sampled activations; ``chan_amax``: (K,) their per-channel max |x| over all
            calibration tokens; ``ws``: the site's weights, each (K, O).
        alphas: the candidates (None = no smoothing).

    Returns:
        ``(alpha or None, s (K,), {str(alpha): error})`` -- ``s`` is all ones for None.
    """
    w_amax = np.max(np.stack([np.abs(w).max(axis=1) for w in ws]), axis=0).astype(np.float64)
    errors: dict[str, float] = {}
    best: tuple[float, float | None, np.ndarray] | None = None
    for a in alphas:
        s = np.ones_like(chan_amax) if a is None else smoothing_scales(chan_amax, w_amax, a)
        err = output_error(x, ws, float((chan_amax / s).max()), None if a is None else s)
        errors[str(a)] = err
        if best is None or err < best[0]:
            best = (err, a, s)
    assert best is not None
    return best[1], best[2], errors


def fold_sites(model: Any, stats: ActStats, smooth: float | str,
               alphas: Sequence[float | None] = ALPHAS) -> list[tuple[SmoothSite, float | None, np.ndarray, dict]]:
    """Fold SmoothQuant into every site of ``model`` (in place) and rescale ``stats`` to match: the
    one folding loop of both recipes (:func:`apply_smoothing`, :func:`smooth_onnx`).

    Args:
        stats: ``chan_amax`` of every site output (and ``rows`` for ``"search"``).
        smooth: an alpha in [0, 1] for every site, or ``"search"`` (per site,
            :func:`choose_alpha` on ``stats.rows``).

    Returns:
        one ``(site, alpha (None: left alone), s (C,), errors by alpha ({} unless searched))`` per site.
    """
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    done: list[tuple[SmoothSite, float | None, np.ndarray, dict]] = []
    for site in find_sites(model):
        x_amax = stats.chan_amax[site.output]
        if smooth == "search":
            ws = [numpy_helper.to_array(inits[w]).astype(np.float32) for w in site.weights]
            alpha, s, errors = choose_alpha(stats.rows[site.output], x_amax, ws, alphas)
        else:
            alpha, errors = float(smooth), {}
            s = smoothing_scales(x_amax, site_weight_absmax(inits, site), alpha)
        if alpha is not None:
            fold_site(inits, site, s)
            stats.rescale(site.output, s)
        done.append((site, alpha, s, errors))
    return done


def apply_smoothing(model: Any, stats: ActStats, smooth: float | str | None,
                    alphas: Sequence[float | None] = ALPHAS) -> list[dict[str, Any]]:
    """The TensorRT recipe's smoothing: :func:`fold_sites` on a ``ModelProto`` whose GEMM-input
    statistics are already gathered (``stats``, rescaled here).

    Args:
        smooth: None (nothing), an alpha in [0, 1] for every site, or ``"search"``.
        alphas: the candidates of ``"search"`` (:data:`ALPHAS`).

    Returns:
        one ``{"norm", "alpha", "errors"}`` per site (``errors`` only for ``"search"``): the
        chosen strength, recorded in the TensorRT plan.
    """
    if smooth is None:
        return []
    return [{"norm": site.norm, "alpha": alpha, "errors": errors}
            for site, alpha, _, errors in fold_sites(model, stats, smooth, alphas)]


def smooth_onnx(src: Path, dst: Path, images: np.ndarray, alpha: float = 0.5, batch_size: int = 32,
                threads: int | None = None) -> list[dict[str, Any]]:
    """The ONNX Runtime recipe's smoothing: write ``dst``, ``src`` with one fixed alpha folded into
    every smoothable LayerNorm and its MatMul weights (module docstring), the statistics taken by
    :func:`exporters.quantization.stats.collect_stats` (per-channel max only).

    Its report differs from :func:`apply_smoothing`'s on purpose: with one fixed alpha there is no
    choice to record, so it records how uneven the channels were before and after.

    Args:
        src, dst: float ONNX in / out (``dst`` is written whole; callers write it in a temp dir).
        images: (N, C, H, W) float32 calibration images, preprocessed.
        alpha: migration strength in [0, 1], the share of the activations' range moved into the
            weights (SmoothQuant's default 0.5).

    Returns:
        one ``{"norm", "channels", "x_range_before", "x_range_after", "s_max", "s_min"}`` per site
        (ranges = max/median of the per-channel max |X_j|: how uneven the channels are).

    Raises:
        UserError: alpha outside [0, 1].
    """
    import onnx

    if not 0.0 <= float(alpha) <= 1.0:
        raise SettingError(f"{{smooth_alpha}} must be in [0, 1], got {alpha}")
    model = onnx.load(str(src))
    sites = find_sites(model)
    if not sites:
        onnx.save_model(model, str(dst))
        return []
    stats = collect_stats(src, [s.output for s in sites], images, batch_size=batch_size, rows=0, threads=threads)
    before = {s.output: stats.chan_amax[s.output] for s in sites}
    report: list[dict[str, Any]] = []
    for site, _, s, _ in fold_sites(model, stats, float(alpha)):
        x, after = before[site.output], stats.chan_amax[site.output]
        report.append({"norm": site.norm, "channels": int(len(s)),
                       "x_range_before": float(x.max() / max(np.median(x), 1e-30)),
                       "x_range_after": float(after.max() / max(np.median(after), 1e-30)),
                       "s_min": float(s.min()), "s_max": float(s.max())})
    onnx.save_model(model, str(dst))
    return report
