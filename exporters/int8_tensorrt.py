"""The default static int8 for TensorRT: searched smoothing, searched clipping, measured fallback.

Pipeline of :func:`quantize_tensorrt` (``QuantizeConfig(recipe="tensorrt")``, the default for
static symmetric int8; ``recipe="ort"`` is the earlier ONNX Runtime ``quantize_static`` path)::

    float ONNX
      -> activation statistics of every GEMM input on the calibration images  [act_stats]
      -> SmoothQuant folded into LayerNorm -> qkv / fc1 weights, alpha per site chosen by the
         measured GEMM output error (smooth_alpha=None), or one fixed alpha     [int8_search]
      -> activation ranges: MinMax; for the kinds in ``clip_kinds`` (default fc2: after GELU no
         scale folds exactly) the clipping ratio with the smallest GEMM output error
      -> sensitivity on ``sensitivity_images`` calibration images: each GEMM int8 alone with
         those ranges, relative logit error                                     [sensitivity]
      -> fallback: the fewest GEMMs kept float -- costliest first, while one GEMM carries more
         than ``fallback_share`` of the summed error, and never more than ``max_float_flops``
         of the GEMM FLOPs
      -> Q/DQ the TensorRT way on the remaining GEMMs                           [qdq]

Every fold changes initializers only: before the Q/DQ nodes go in, the smoothed float model
computes the same function (tested to 1e-5 on the logits). The plan (each GEMM's precision,
alpha, clip ratio, FLOPs, measured error) and the share of GEMM FLOPs left in int8 go to the
metadata (``int8_plan``) and the CLI report.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from edgeprune.errors import UserError
from exporters.act_stats import ActStats
from exporters.int8 import match_patterns
from exporters.int8_search import choose_clip
from exporters.qdq import GemmNode, find_gemms, insert_qdq
from exporters.quant_config import QuantizeConfig
from exporters import sensitivity as sens


@dataclasses.dataclass
class Int8Plan:
    """What :func:`quantize_tensorrt` chose.

    Attributes:
        gemms: one ``{"node", "kind", "block", "precision" ("int8" or "float"), "reason",
            "flops", "clip", "rel_err"}`` per weighted GEMM, graph order (``flops`` per image;
            ``rel_err``: relative logit error with this GEMM alone int8, on calibration images).
        smoothing: one ``{"norm", "alpha", "errors"}`` per smoothed site.
        int8_flops_share: GEMM FLOPs in int8 / all weighted GEMM FLOPs.
    """

    gemms: list[dict[str, Any]]
    smoothing: list[dict[str, Any]]
    int8_flops_share: float

    def to_record(self) -> dict[str, Any]:
        """JSON-ready dict (metadata ``int8_plan``)."""
        return {"gemms": self.gemms, "smoothing": [{k: v for k, v in s.items() if k != "errors"}
                                                   for s in self.smoothing],
                "int8_flops_share": self.int8_flops_share}


def weights_of(model: Any, gemms: Sequence[GemmNode]) -> dict[str, np.ndarray]:
    """GEMM name -> its weight as (K, O) float32 (``Gemm`` with ``transB`` transposed back)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for g in gemms:
        w = numpy_helper.to_array(inits[g.w]).astype(np.float32)
        if g.op_type in ("MatMul", "Gemm"):
            out[g.name] = w if g.axis == 1 else w.T
    return out


def choose_ranges(model: Any, gemms: Sequence[GemmNode], stats: ActStats,
                  clip_kinds: Sequence[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Per-tensor activation ranges: MinMax, or for a tensor read by a GEMM of ``clip_kinds`` the
    clipping ratio of :func:`exporters.int8_search.choose_clip` (error summed over its readers).

    Returns:
        ``(amax by tensor, clip ratio by tensor)``.
    """
    ws = weights_of(model, gemms)
    ranges = dict(stats.amax)
    clips: dict[str, float] = {}
    readers: dict[str, list[GemmNode]] = {}
    for g in gemms:
        readers.setdefault(g.x, []).append(g)
    for x, gs in readers.items():
        if any(g.kind in clip_kinds for g in gs) and x in stats.rows and all(g.name in ws for g in gs):
            r, _ = choose_clip(stats.rows[x], stats.amax[x], [ws[g.name] for g in gs])
            clips[x] = r
            ranges[x] = r * stats.amax[x]
    return ranges, clips


def choose_fallback(rows: Sequence[Mapping[str, Any]], share: float, max_float_flops: float) -> list[str]:
    """The GEMMs kept float: costliest first (by isolated ``rel_err``) while the costliest left
    carries more than ``share`` of the summed error of those left, within ``max_float_flops``
    (a fraction of the total GEMM FLOPs)."""
    total_flops = sum(float(r["flops"]) for r in rows) or 1.0
    left = sorted(rows, key=lambda r: -float(r["rel_err"]))
    kept: list[str] = []
    used = 0.0
    while left:
        err_sum = sum(float(r["rel_err"]) for r in left)
        top = left[0]
        if err_sum <= 0 or float(top["rel_err"]) <= share * err_sum:
            break
        if (used + float(top["flops"])) / total_flops > max_float_flops:
            break
        kept.append(str(top["node"]))
        used += float(top["flops"])
        left = left[1:]
    return kept


def quantize_tensorrt(src: Path, dst: Path, calib: np.ndarray, cfg: QuantizeConfig, *,
                      log: Callable[[str], None] | None = None) -> Int8Plan:
    """Write the int8 QDQ model of ``src`` to ``dst`` (module docstring) and return the plan.

    Args:
        calib: (N, C, H, W) float32 calibration images (preprocessed).
        cfg: settings (``smooth_alpha``, ``clip_kinds``, ``fallback_share``, ``max_float_flops``,
            ``sensitivity_images``, ``exclude``, ``batch_size``, ``threads``).

    Raises:
        UserError: an ``--exclude`` pattern matching no GEMM, or no GEMM at all.
    """
    import onnx

    say = log or (lambda _m: None)
    model = onnx.load(str(src))
    gemms = find_gemms(model)
    if not gemms:
        raise UserError(f"{src} has no MatMul/Gemm/Conv with a constant weight to quantize")
    excluded = set(match_patterns(cfg.exclude, [g.name for g in gemms]))
    stats = sens.calibrate(model, calib, gemms, threads=cfg.threads)
    smoothing = sens.apply_smoothing(model, stats, "search" if cfg.smooth_alpha is None else cfg.smooth_alpha)
    say(f"int8 (TensorRT): smoothing {len(smoothing)} LayerNorm -> GEMM sites (alpha "
        + ", ".join(str(s["alpha"]) for s in smoothing) + ")")
    ranges, clips = choose_ranges(model, gemms, stats, cfg.clip_kinds)
    ranged = dataclasses.replace(stats, amax=ranges)
    rows = _sensitivity(model, ranged, calib[:cfg.sensitivity_images], gemms, excluded, cfg, say)
    fallback = choose_fallback([r for r in rows if r["node"] not in excluded], cfg.fallback_share,
                               cfg.max_float_flops) if cfg.fallback_share < 1 else []
    float_set = excluded | set(fallback)
    insert_qdq(model, [g for g in gemms if g.name not in float_set], ranges)
    onnx.save_model(model, str(dst))
    plan = _plan(gemms, rows, stats, clips, excluded, fallback, smoothing)
    say(f"int8 (TensorRT): {sum(g['precision'] == 'int8' for g in plan.gemms)} of {len(gemms)} GEMMs int8, "
        f"{plan.int8_flops_share * 100:.1f}% of GEMM FLOPs; float: {', '.join(sorted(float_set)) or 'none'}")
    return plan


def _sensitivity(model: Any, stats: ActStats, imgs: np.ndarray, gemms: Sequence[GemmNode], excluded: set[str],
                 cfg: QuantizeConfig, say: Callable[[str], None]) -> list[dict[str, Any]]:
    todo = [g for g in gemms if g.name not in excluded]
    if cfg.fallback_share >= 1 or not len(imgs):
        return [{"node": g.name, "flops": g.flops_per_image(stats.shapes.get(g.x, (1, 1, g.k))),
                 "rel_err": float("nan")} for g in todo]
    say(f"int8 (TensorRT): sensitivity of {len(todo)} GEMMs on {len(imgs)} calibration images")
    ev = sens.prepare_eval(model, imgs, None, list(sens.block_cuts(model, todo).values()),
                           batch_size=cfg.batch_size, threads=cfg.threads)
    return sens.gemm_sensitivity(model, stats, ev, todo, batch_size=cfg.batch_size, threads=cfg.threads)


def _plan(gemms: Sequence[GemmNode], rows: Sequence[Mapping[str, Any]], stats: ActStats, clips: Mapping[str, float],
          excluded: set[str], fallback: Sequence[str], smoothing: list[dict[str, Any]]) -> Int8Plan:
    by_node = {r["node"]: r for r in rows}
    out = []
    for g in gemms:
        flops = g.flops_per_image(stats.shapes.get(g.x, (1, 1, g.k)))
        reason = "--exclude" if g.name in excluded else "sensitivity" if g.name in fallback else ""
        err = by_node.get(g.name, {}).get("rel_err")
        out.append({"node": g.name, "kind": g.kind, "block": g.block,
                    "precision": "float" if reason else "int8", "reason": reason, "flops": flops,
                    "clip": clips.get(g.x, 1.0), "rel_err": None if err is None or err != err else float(err)})
    total = sum(r["flops"] for r in out) or 1.0
    share = sum(r["flops"] for r in out if r["precision"] == "int8") / total
    return Int8Plan(out, smoothing, float(share))
