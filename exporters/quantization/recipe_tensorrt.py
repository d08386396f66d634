"""The default static int8 for TensorRT: searched smoothing, searched clipping, measured fallback.

Pipeline of :func:`quantize_tensorrt` (the ``tensorrt`` recipe, :class:`TensorRTRecipe`: the default
for static symmetric int8; ``recipe="ort"`` is the ONNX Runtime path, ``recipe_ort.py``)::

    float ONNX
      -> activation statistics of every GEMM input on the calibration images  [stats]
      -> SmoothQuant folded into LayerNorm -> qkv / fc1 weights, alpha per site chosen by the
         measured GEMM output error (smooth_alpha=None), or one fixed alpha     [smoothing]
      -> activation ranges: MinMax; for the kinds in ``clip_kinds`` (default fc2: after GELU no
         scale folds exactly) the clipping ratio with the smallest GEMM output error
      -> sensitivity on ``sensitivity_images`` calibration images: each GEMM int8 alone with
         those ranges, relative logit error                                     [gemm_error]
      -> fallback: GEMMs kept float, each carrying at least the mean isolated error (or
         ``fallback_share`` of the summed isolated error), most error per FLOP first, within
         ``max_float_flops`` of the GEMM FLOPs
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
from exporters.quantization import gemm_error as sens
from exporters.quantization.config import QuantizeConfig
from exporters.quantization.ort_int8 import match_patterns
from exporters.quantization.qdq import GemmNode, find_gemms, insert_qdq
from exporters.quantization.registry import Converted, Recipe, RecipeJob, register_recipe
from exporters.quantization.search import choose_clip
from exporters.quantization.smoothing import ALPHAS, apply_smoothing
from exporters.quantization.smoothing_explicit import smooth_explicit
from exporters.quantization.stats import ActStats, gemm_input_stats
from exporters.quantization.weight_rounding import get_weight_rounding, round_weights


@dataclasses.dataclass
class Int8Plan:
    """What :func:`quantize_tensorrt` chose.

    Attributes:
        gemms: one ``{"node", "kind", "block", "precision" ("int8" or "float"), "reason",
            "flops", "clip", "rel_err"}`` per weighted GEMM, graph order (``flops`` per image;
            ``rel_err``: relative logit error with this GEMM alone int8, on calibration images).
        smoothing: one ``{"norm", "alpha", "errors"}`` per smoothed site.
        int8_flops_share: GEMM FLOPs in int8 / all weighted GEMM FLOPs.
        weight_rounding: how the int8 weights were rounded (``exporters.quantization.weight_rounding``).
    """

    gemms: list[dict[str, Any]]
    smoothing: list[dict[str, Any]]
    int8_flops_share: float
    weight_rounding: str = "nearest"

    def to_record(self) -> dict[str, Any]:
        """JSON-ready dict (metadata ``int8_plan``)."""
        return {"gemms": self.gemms, "smoothing": [{k: v for k, v in s.items() if k != "errors"}
                                                   for s in self.smoothing],
                "int8_flops_share": self.int8_flops_share, "weight_rounding": self.weight_rounding}


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
    clipping ratio of :func:`exporters.quantization.search.choose_clip` (error summed over its readers).

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


def choose_fallback(rows: Sequence[Mapping[str, Any]], share: float | None, max_float_flops: float) -> list[str]:
    """The GEMMs kept float, chosen like a knapsack by error per FLOP.

    A GEMM is a candidate when its isolated error (``rel_err``: the relative logit error with it
    alone int8) is at least ``share`` of the summed isolated error of all GEMMs (``share=None``: at
    least their mean, a share of ``1 / len(rows)``: more error than the average GEMM); candidates go
    float in order of error per FLOP (the cheapest accuracy first: a class-token block, the head
    and the patch embedding carry visible error at a few % of the FLOPs) while the float GEMMs'
    FLOPs stay within ``max_float_flops`` of the total (a candidate that does not fit is skipped,
    a smaller one after it may still fit).

    Args:
        rows: one ``{"node", "rel_err", "flops"}`` per GEMM.
        share: candidate threshold in (0, 1]; 1 keeps nothing float unless one GEMM carries all;
            None: the mean (``1 / len(rows)``).
        max_float_flops: cap on the float share of the GEMM FLOPs, in [0, 1].

    Returns:
        node names, in the order chosen.
    """
    total_flops = sum(float(r["flops"]) for r in rows) or 1.0
    err_sum = sum(max(0.0, float(r["rel_err"])) for r in rows)
    if err_sum <= 0:
        return []
    share = 1.0 / len(rows) if share is None else share
    cands = [r for r in rows if float(r["rel_err"]) >= share * err_sum]
    cands.sort(key=lambda r: -float(r["rel_err"]) / max(float(r["flops"]), 1.0))
    kept: list[str] = []
    used = 0.0
    for r in cands:
        if (used + float(r["flops"])) / total_flops <= max_float_flops:
            kept.append(str(r["node"]))
            used += float(r["flops"])
    return kept


@dataclasses.dataclass
class Prepared:
    """The smoothed float model and everything the Q/DQ step needs (:func:`prepare_int8`).

    Attributes:
        model: the float ``ModelProto`` with every smoothing applied (same function as before).
        gemms: its weighted GEMMs (after the explicit scales: they read the scaled tensors).
        stats: statistics of their inputs (rescaled by the smoothing).
        smoothing: one report entry per LayerNorm site and per explicit site.
        ranges: per-tensor activation ranges; clips: clipping ratio by tensor (clipped ones only).
        weights: GEMM name -> ``(W_q int8, scales)`` (``cfg.tensorrt.weight_rounding``).
    """

    model: Any
    gemms: list[GemmNode]
    stats: ActStats
    smoothing: list[dict[str, Any]]
    ranges: dict[str, float]
    clips: dict[str, float]
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


def prepare_int8(model: Any, calib: np.ndarray, cfg: QuantizeConfig,
                 say: Callable[[str], None] = lambda _m: None, smooth: float | str | None = "config",
                 alphas: Sequence[float | None] = ALPHAS) -> Prepared:
    """Statistics, smoothing (LayerNorm folds, then explicit scales before
    ``cfg.tensorrt.explicit_smooth_kinds``), activation ranges and rounded weights of ``model``
    (edited in place) -- every step of the recipe before the sensitivity fallback, shared by
    :func:`quantize_tensorrt` and ``benchmarks/quant_sensitivity.py``. ``smooth``: ``"config"`` (alpha
    searched, or ``cfg.common.smooth_alpha``), or
    :func:`exporters.quantization.smoothing.apply_smoothing`'s argument (None: no smoothing at all,
    for comparisons). ``alphas``: the SmoothQuant strengths searched (default
    :data:`exporters.quantization.smoothing.ALPHAS`; a tool compares others).

    Raises:
        UserError: no GEMM in ``model``; an unknown ``cfg.tensorrt.weight_rounding``.
    """
    get_weight_rounding(cfg.tensorrt.weight_rounding)
    gemms = find_gemms(model)
    if not gemms:
        raise UserError("the model has no MatMul/Gemm/Conv with a constant weight to quantize")
    stats = gemm_input_stats(model, calib, gemms, threads=cfg.common.threads,
                             gram=cfg.tensorrt.weight_rounding != "nearest")
    if smooth == "config":
        smooth = "search" if cfg.common.smooth_alpha is None else cfg.common.smooth_alpha
    smoothing = apply_smoothing(model, stats, smooth, alphas)
    if cfg.tensorrt.explicit_smooth_kinds and smooth is not None:
        explicit = alphas if cfg.common.smooth_alpha is None else (float(cfg.common.smooth_alpha),)
        smoothing += smooth_explicit(model, stats, gemms, cfg.tensorrt.explicit_smooth_kinds, explicit)
        gemms = find_gemms(model)
    say("int8 (TensorRT): smoothing " + ", ".join(
        f"{s.get('norm') or s.get('gemm')}: {s['alpha']}" for s in smoothing))
    ranges, clips = choose_ranges(model, gemms, stats, cfg.tensorrt.clip_kinds)
    weights = round_weights(model, gemms, stats, cfg.tensorrt.weight_rounding)
    return Prepared(model, gemms, stats, smoothing, ranges, clips, weights)


def quantize_tensorrt(src: Path, dst: Path, calib: np.ndarray, cfg: QuantizeConfig, *,
                      log: Callable[[str], None] | None = None) -> Int8Plan:
    """Write the int8 QDQ model of ``src`` to ``dst`` (module docstring) and return the plan.

    Args:
        calib: (N, C, H, W) float32 calibration images (preprocessed).
        cfg: settings (``smooth_alpha``, ``explicit_smooth_kinds``, ``clip_kinds``,
            ``weight_rounding``, ``fallback_share``, ``max_float_flops``, ``sensitivity_images``,
            ``exclude``, ``batch_size``, ``threads``).

    Raises:
        UserError: an ``--exclude`` pattern matching no GEMM (or the patterns every GEMM), or no GEMM at all.
    """
    import onnx

    say = log or (lambda _m: None)
    model = onnx.load(str(src))
    names = [g.name for g in find_gemms(model)]
    if not names:
        raise UserError(f"{src} has no MatMul/Gemm/Conv with a constant weight to quantize")
    excluded = set(match_patterns(cfg.common.exclude, names))
    p = prepare_int8(model, calib, cfg, say)
    rows, fallback = measured_fallback(p, calib, cfg, excluded, say)
    float_set = excluded | set(fallback)
    insert_qdq(model, [g for g in p.gemms if g.name not in float_set], p.ranges, p.weights)
    onnx.save_model(model, str(dst))
    plan = _plan(p.gemms, rows, p.stats, p.clips, excluded, fallback, p.smoothing, cfg.tensorrt.weight_rounding)
    say(f"int8 (TensorRT): {sum(g['precision'] == 'int8' for g in plan.gemms)} of {len(p.gemms)} GEMMs int8, "
        f"{plan.int8_flops_share * 100:.1f}% of GEMM FLOPs; float: {', '.join(sorted(float_set)) or 'none'}")
    return plan


def measured_fallback(p: Prepared, calib: np.ndarray, cfg: QuantizeConfig, excluded: set[str],
                      say: Callable[[str], None] = lambda _m: None) -> tuple[list[dict[str, Any]], list[str]]:
    """Each GEMM's isolated error on ``cfg.common.sensitivity_images`` calibration images (with the
    prepared ranges and rounded weights) and the GEMMs :func:`choose_fallback` keeps float
    (none when ``cfg.tensorrt.fallback_share`` is 1)."""
    ranged = dataclasses.replace(p.stats, amax=p.ranges)
    imgs = calib[:cfg.common.sensitivity_images]
    rows = _sensitivity(p.model, ranged, imgs, p.gemms, excluded, cfg, say, p.weights)
    fallback = choose_fallback([r for r in rows if r["node"] not in excluded], cfg.tensorrt.fallback_share,
                               cfg.tensorrt.max_float_flops) if not _no_fallback(cfg) else []
    return rows, fallback


def _no_fallback(cfg: QuantizeConfig) -> bool:
    """``fallback_share`` 1: the sensitivity pass is skipped and every GEMM stays int8."""
    return cfg.tensorrt.fallback_share is not None and cfg.tensorrt.fallback_share >= 1


def _sensitivity(model: Any, stats: ActStats, imgs: np.ndarray, gemms: Sequence[GemmNode], excluded: set[str],
                 cfg: QuantizeConfig, say: Callable[[str], None],
                 weights: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None) -> list[dict[str, Any]]:
    todo = [g for g in gemms if g.name not in excluded]
    if _no_fallback(cfg) or not len(imgs):
        return [{"node": g.name, "flops": g.flops_per_image(stats.shapes.get(g.x, (1, 1, g.k))),
                 "rel_err": float("nan")} for g in todo]
    say(f"int8 (TensorRT): sensitivity of {len(todo)} GEMMs on {len(imgs)} calibration images")
    ev = sens.prepare_eval(model, imgs, None, list(sens.block_cuts(model, todo).values()),
                           batch_size=cfg.common.batch_size, threads=cfg.common.threads)
    return sens.gemm_sensitivity(model, stats, ev, todo, batch_size=cfg.common.batch_size,
                                 threads=cfg.common.threads, weights=weights)


def _plan(gemms: Sequence[GemmNode], rows: Sequence[Mapping[str, Any]], stats: ActStats, clips: Mapping[str, float],
          excluded: set[str], fallback: Sequence[str], smoothing: list[dict[str, Any]],
          weight_rounding: str = "nearest") -> Int8Plan:
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
    return Int8Plan(out, smoothing, float(share), weight_rounding)


class TensorRTRecipe(Recipe):
    """The default static int8 (module docstring); settings: ``exporters.quantization.config.TensorRTSettings``."""

    name = "tensorrt"

    def check(self, cfg: QuantizeConfig) -> None:
        """Raises: UserError: an ONNX-Runtime-only option (this recipe is symmetric int8 with
        per-channel weights and chooses its own ranges; ``--smooth-alpha`` fixes its alpha)."""
        bad = [k for k in cfg.ort_only_options() if k != "--smooth-alpha"]
        if bad:
            raise UserError(f"{', '.join(bad)} need --recipe ort (the tensorrt recipe is symmetric int8 with "
                            f"per-channel weights and chooses its own ranges)")

    def run(self, job: RecipeJob) -> Converted:
        """:func:`quantize_tensorrt` on the calibration images; the plan goes to the metadata."""
        import onnx

        assert job.calib is not None  # needs_calibration: always
        plan = quantize_tensorrt(job.float_path, job.quant_path, job.calib, job.cfg, log=job.say)
        rec = plan.to_record()
        return Converted(f"edgeprune exporters.quantization.recipe_tensorrt (TensorRT Q/DQ), onnx {onnx.__version__}",
                         [g["node"] for g in rec["gemms"] if g["precision"] != "int8"],
                         smoothing=rec["smoothing"], plan=rec)


register_recipe(TensorRTRecipe())
