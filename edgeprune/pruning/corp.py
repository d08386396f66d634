"""CORP end to end: statistics -> plan -> closed-form solve -> surgery (corp-v1 Alg. 1-3).

:func:`corp_prune` prunes a model in place: MLP hidden channels (ridge-compensated affine fold,
``edgeprune.solve.mlp_ridge``), attention Q/K head dims (exact per-image logit compensation,
``edgeprune.solve.qk_logit``), and -- beyond CORP (corp-v1 §3.4 keeps V) -- V/O head dims and
whole heads with the same ridge fold on ``proj`` (METHODS.md §5, ``edgeprune.vo``).

This is the ``corp`` stage of the one-shot prune (``edgeprune.pruning.stages``). It sits above the strategies it
chooses between (the budgeted allocation, ``edgeprune.allocation``; sequential calibration,
``edgeprune.sequential``); they and it share the low-level steps of ``edgeprune.corp.steps`` /
``edgeprune.corp.qk_solvers``.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from edgeprune.allocation.greedy import check_budget
from edgeprune.allocation.select import select_allocation
from edgeprune.allocation.unit_curves import CURVE_SECONDS
from edgeprune.anatomy import ViTAnatomy
from edgeprune.allocation.rules import heads_allocated
from edgeprune.calibration.collect import CalibrationStatistics, StatisticsRequest, collect_statistics
from edgeprune.calibration.stream import STREAM_BYTES, stream_bytes
from edgeprune.budget.correction import Correction
from edgeprune.corp.config import CorpConfig, bias_correction_used, gram_tokens_used
from edgeprune.corp.qk_solvers import qk_solver_from_grams
from edgeprune.corp.steps import apply_corp, mlp_kept, plan_corp
from edgeprune.errors import UserError
from edgeprune.head_compensation import RefitCache, compensate_heads_through_mlp, prepare_refit
from edgeprune.plan import pruned_modules
from edgeprune.pruning.config import check_config
from edgeprune.ranking import get_criterion
from edgeprune.sequential import sequential_prune
from edgeprune.layers.rotary_attention import is_rotary
from edgeprune.solve import qk_logit, qk_rope
from edgeprune.solve.output_bias import classifier_head
from edgeprune.vo import attention_dims


def _qk_gram_bytes(anatomy: ViTAnatomy, num_images: int) -> int:
    return num_images * sum(b.num_heads * 2 * b.qk_dim ** 2 * 4 for b in anatomy.blocks)


def check_prunable(anatomy: ViTAnatomy, cfg: CorpConfig) -> CorpConfig:
    """Every check that needs no calibration pass: the config (every section, once:
    :func:`edgeprune.pruning.config.check_config`),
    ``dims`` against the model, rounding and fused-layout errors, and a reachable budget.

    Returns:
        the checked ``cfg`` (``check_config``'s: itself once it is in canonical form).

    Raises:
        UserError: as the checks.
    """
    cfg = check_config(cfg)
    if cfg.dims is not None and len(cfg.dims) != len(anatomy.blocks):
        raise UserError(f"dims has {len(cfg.dims)} entries, the model has {len(anatomy.blocks)} blocks")
    for b in anatomy.blocks:
        _, qk, _ = attention_dims(b, cfg)
        if qk < b.qk_dim and is_rotary(b.attn):  # whole RoPE pairs, refused before the pass
            qk_rope.check_pairs(qk)
        mlp_kept(b, cfg)
    if cfg.budget is not None:
        check_budget(anatomy, cfg)
    return cfg


def statistics_request(cfg: CorpConfig, anatomy: ViTAnatomy, num_images: int | None, *, qk_grams: bool,
                       first_image: int = 0, output_images: int = 0) -> StatisticsRequest:
    """What CORP's calibration pass collects under ``cfg``: MLP statistics when the compensation or
    the MLP criterion needs them (``Criterion.needs``), positive counts when the criterion needs
    "positive", Q/K statistics (per-image Grams when ``qk_grams``), proj-input statistics for V/O
    and heads."""
    modules = pruned_modules(cfg)
    needs = get_criterion(cfg.mlp_criterion, "mlp").needs
    return StatisticsRequest(
        mlp="mlp" in modules and (cfg.compensation or bool(needs)), qk="qk" in modules, qk_grams=qk_grams,
        gram_dtype=torch.float64 if cfg.gram_dtype == "float64" else torch.float32,
        mlp_second_order=cfg.compensation, vo=bool(modules & {"v", "heads"}), mlp_active="positive" in needs,
        mlp_tokens=gram_tokens_used(cfg, anatomy, num_images), first_image=first_image,
        output_images=output_images, stream_bytes=_stream_request(cfg, anatomy, num_images))


def _stream_request(cfg: CorpConfig, anatomy: ViTAnatomy, num_images: int | None) -> int:
    """``StatisticsRequest.stream_bytes``: the memory bound when whole heads may be removed and refit through the
    MLP (``edgeprune.head_compensation``: it then reads the pass's dense stream instead of running the dense
    model again) and the stream fits in it (where the number of images is known), else 0."""
    may_lose_heads = "heads" in pruned_modules(cfg) or heads_allocated(cfg)
    if not (cfg.compensation and may_lose_heads) or cfg.sequential or not anatomy.blocks:
        return 0
    size = stream_bytes(num_images, anatomy.num_tokens, anatomy.blocks[0].fc2.out_features, len(anatomy.blocks))
    return 0 if size is not None and size > STREAM_BYTES else STREAM_BYTES


def _second_pass_solver(anatomy: ViTAnatomy, batches, plans, cfg: CorpConfig, progress: bool):
    """The memory-limited Q/K route: a second pass accumulating each head's exact system.

    Returns:
        (solver ``f(block, head)``, seconds of the pass).
    """
    request = StatisticsRequest(mlp=False, qk=True, qk_keep=[p.qk_keep for p in plans])
    second = collect_statistics(anatomy, batches(), request, progress=progress)

    def qk_solve(i: int, h: int):
        st = second.qk[i]
        if is_rotary(anatomy.blocks[i].attn):  # rotated q, k: the pair form (METHODS.md §6)
            m, lam = qk_rope.solve_rope_pairs(st.k_sys[h], st.rhs[h], cfg.qk_ridge_alpha)
            return m, lam, {"solver": "rope-pair"}
        m, lam = qk_logit.solve_logit_compensation(st.k_sys[h], st.rhs[h], cfg.qk_ridge_alpha)
        return m, lam, {"solver": "direct"}

    return qk_solve, second.seconds


def _rope_general_solver(anatomy: ViTAnatomy, batches, plans, cfg: CorpConfig, progress: bool, fallback):
    """``rope_compensation="general"``: one more pass accumulating the general-form system of every rotary block
    whose Q/K dims are pruned (METHODS.md §6); other blocks keep ``fallback``.

    Returns:
        (solver ``f(block, head) -> (M, lam, {"solver": "rope-general"})``, seconds of the pass; 0 when no
        rotary block prunes Q/K).
    """
    keep = [p.qk_keep if p.qk_keep is not None and is_rotary(b.attn) else None
            for b, p in zip(anatomy.blocks, plans)]
    if all(k is None for k in keep):
        return fallback, 0.0
    request = StatisticsRequest(mlp=False, qk=True, qk_keep=keep, rope_general=True)
    second = collect_statistics(anatomy, batches(), request, progress=progress)

    def qk_solve(i: int, h: int):
        if keep[i] is None:
            return fallback(i, h)
        st = second.qk[i]
        m, lam = qk_rope.solve_rope_general(st.k_sys[h], st.rhs[h], cfg.qk_ridge_alpha)
        return m, lam, {"solver": "rope-general"}

    return qk_solve, second.seconds


def refit_cache(stats: CalibrationStatistics, cfg: CorpConfig) -> RefitCache | None:
    """The heads' refit pass's :class:`~edgeprune.head_compensation.RefitCache` on these statistics when a
    latency correction may prune again from them (a measured budget, verified, correction rounds allowed:
    issue 40 item 4), else None (nothing kept)."""
    b = cfg.budget
    if b is None or not b.model_class.verifiable or not Correction.of(cfg).replans:
        return None
    return stats.derived.setdefault("head_refit", RefitCache())


def corp_prune(anatomy: ViTAnatomy, batches: Callable[[], Iterable[torch.Tensor]], cfg: CorpConfig,
               num_images: int | None = None, progress: bool = True, *, checked: bool = False,
               statistics: CalibrationStatistics | None = None) -> dict:
    """Prune the model of ``anatomy`` in place with CORP.

    Args:
        anatomy: anatomy of the model to prune (modified in place).
        batches: a callable returning a fresh iterable of calibration batches (B, C, H, W); called
            once, or twice when the Q/K Grams would exceed ``cfg.qk_memory_limit_gb``.
        cfg: :class:`CorpConfig`.
        num_images: calibration size, if known (for the memory estimate and progress bar).
        progress: show progress bars.
        checked: the caller already ran :func:`check_prunable` on this model and config.
        statistics: the statistics of an earlier call on the same dense model and config (but the budget's
            value): reused instead of a calibration pass (the latency correction's rounds,
            ``edgeprune.budget.correction_loop``); not for sequential calibration.

    Returns:
        info dict: ``calibration_seconds``, ``solve_seconds``, ``passes``, ``num_images``,
        ``blocks`` (per-block lambdas), ``output_sums`` (``(sum, count)`` of the dense model's
        outputs over the first :func:`bias_correction_used` images, taken in the calibration
        pass; None when not asked for or not available, e.g. sequential calibration) and
        ``output_rows`` (those outputs, this process's images in order: the classifier refit's
        targets), ``statistics`` (the pass's :class:`CalibrationStatistics`, for reuse) and
        ``statistics_reused``.

    Raises:
        UserError: invalid settings, empty or mis-shaped calibration data.
    """
    if not checked:
        cfg = check_prunable(anatomy, cfg)
    if cfg.sequential:
        return sequential_prune(anatomy, batches, cfg, num_images=num_images, progress=progress, checked=True)
    prune_qk = "qk" in pruned_modules(cfg)
    two_pass = bool(prune_qk and cfg.compensation and num_images is not None
                    and _qk_gram_bytes(anatomy, num_images) > cfg.qk_memory_limit_gb * 2 ** 30)
    keep_grams = prune_qk and cfg.compensation and not two_pass
    output_images = bias_correction_used(cfg) if classifier_head(anatomy.model) is not None else 0
    request = statistics_request(cfg, anatomy, num_images, qk_grams=keep_grams,
                                 first_image=getattr(batches, "first_image", 0), output_images=output_images)
    reused = statistics is not None
    stats = statistics if reused else collect_statistics(anatomy, batches(), request, progress=progress)
    seconds = 0.0 if reused else stats.seconds
    t0 = time.perf_counter()
    allocation = None
    if cfg.budget is not None:
        dims, allocation = select_allocation(anatomy, stats, cfg, batches)
        cfg = cfg.with_dims(dims)
    plans = plan_corp(anatomy, stats, cfg)
    passes = 0 if reused else 1
    qk_solve = None
    if prune_qk and cfg.compensation:
        if keep_grams:
            qk_solve = qk_solver_from_grams(stats.qk, plans, cfg)
        else:
            solve_time = time.perf_counter() - t0
            qk_solve, pass_seconds = _second_pass_solver(anatomy, batches, plans, cfg, progress)
            seconds += pass_seconds
            passes = 2
            t0 = time.perf_counter() - solve_time
    if qk_solve is not None and cfg.rope_compensation == "general":
        qk_solve, pass_seconds = _rope_general_solver(anatomy, batches, plans, cfg, progress, qk_solve)
        seconds += pass_seconds
        passes += pass_seconds > 0
    cache = refit_cache(stats, cfg)
    if stats.stream is not None:  # the pass kept the dense stream: the refit pass needs no dense forward
        cache = cache or RefitCache()
        cache.stream, stats.stream = stats.stream, None
    refit = prepare_refit(anatomy, plans, cfg, cache)  # blocks that lose heads: fc2 refit, one more pass
    info = apply_corp(anatomy, plans, cfg, stats.mlp, qk_solve, stats.vo)
    for i, rec in compensate_heads_through_mlp(refit, anatomy, cfg, batches, cache).items():
        info[i].update(rec)
    passes += refit is not None
    return {"calibration_seconds": seconds, "solve_seconds": time.perf_counter() - t0,
            "passes": passes, "num_images": stats.num_images, "blocks": info, "allocation": allocation,
            "gram_tokens_used": request.mlp_tokens,
            "output_sums": (stats.output_sum, stats.output_count) if stats.output_sum is not None else None,
            "output_rows": stats.output_rows, "statistics": stats, "statistics_reused": reused,
            "curve_seconds": stats.derived.get(CURVE_SECONDS, 0.0) if not reused else 0.0}
