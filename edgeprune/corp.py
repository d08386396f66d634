"""CORP end to end: statistics -> plan -> closed-form solve -> surgery (corp-v1 Alg. 1-3).

:func:`corp_prune` prunes a model in place: MLP hidden channels (ridge-compensated affine fold,
``edgeprune.solve.mlp_ridge``), attention Q/K head dims (exact per-image logit compensation,
``edgeprune.solve.qk_logit``), and -- beyond CORP (corp-v1 §3.4 keeps V) -- V/O head dims and
whole heads with the same ridge fold on ``proj`` (METHODS.md §5, ``edgeprune.vo``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import torch

from edgeprune.anatomy import ViTAnatomy
from edgeprune.calibration.collect import CalibrationStatistics, collect_statistics
from edgeprune.errors import UserError
from edgeprune.plan import BlockPlan, check_dims, dims_override, kept_dim, pruned_indices, pruned_modules
from edgeprune.ranking import MLP_CRITERIA, VO_CRITERIA, mlp_scores, top_k_indices
from edgeprune.solve import mlp_ridge, qk_logit, qk_logit_cg
from edgeprune.solve.head_refit import check_refit_request
from edgeprune.solve.qk_choice import cg_is_cheaper
from edgeprune.surgery import shrink_mlp
from edgeprune.vo import LAYOUTS, attention_dims, attention_sparsities, plan_attention, prune_attention


QK_SOLVERS = ("auto", "direct", "cg")


# f(block, head) -> (M (d', d') float64, ridge lambda, solve info dict)
QKSolve = Callable[[int, int], "tuple[torch.Tensor, float, dict]"]


@dataclasses.dataclass
class CorpConfig:
    """CORP settings.

    Attributes:
        mlp_sparsity, attn_sparsity: fraction of MLP hidden channels / Q/K head dims removed, [0, 1).
        v_sparsity: fraction of V head dims removed (per head, same count in every head), [0, 1).
        head_sparsity: fraction of whole heads removed per layer (kept = round(H (1 - s)) >= 1).
        layout: "default", or "fused": Q/K and V are pruned to the same kept dim per head (the
            Q/K or V sparsity given applies to both), so every block ends with qk_dim == v_dim
            and the attention is an ordinary multi-head attention (fused/flash kernels).
        vo_criterion: V-dim ranking, "combined" (default), "energy" or "magnitude" (ranking.py).
        dims: per-block kept dims overriding the sparsities: one dict per block with any of the
            keys "mlp" (hidden channels), "qk" (Q/K dims per head), "v" (V dims per head),
            "heads" (whole heads); a missing key follows the sparsity. Set by the budgeted
            allocation (``edgeprune.allocation``) or given directly.
        budget: ``{"kind": "flops" | "params", "value": v}`` (v a fraction of the dense model in
            (0, 1], or an absolute count > 1): the allocator chooses ``dims`` after the
            calibration pass so that the pruned model meets the budget (METHODS.md §5,
            "Budgeted allocation"); the modules it may prune are those ``target`` selects.
        sequential: sequential calibration (METHODS.md §5): statistics of block i are taken on
            the output of the already pruned blocks 0..i-1, fits target the dense outputs
            (``edgeprune.sequential``).
        allocation_check_images: with a budget, candidate allocations are compared by the
            measured output error on this many calibration images (``edgeprune.allocation.select``;
            0 = trust the allocator's proxy alone).
        allocation_sensitivity: with the check on, also measure each allocation unit's output
            error when it alone is pruned (on the same images) and add the greedy allocation on
            curves rescaled to those measurements as a candidate (``edgeprune.allocation.select``).
        allocation_anchors: 1 = each unit's curve is rescaled to one measurement (at the uniform
            candidate's size); 2 = also measured where the first measured allocation puts the
            unit, the curve through both, and that greedy allocation is one more candidate.
        sequential_memory_gb: sequential calibration keeps its two token streams (N x n x D
            float32 each) in memory up to this many GiB, the rest in temporary disk memmaps.
        compensation: fold the closed-form compensation (False = plain removal, same ranking).
        mlp_criterion: "combined" (default), "energy", "magnitude" or "active" (see ranking.py).
        ridge_alpha: scale-free ridge strength of the MLP and proj (V/O, heads) fits
            (lam = alpha * tr(Sigma_SS)/|S|).
        qk_ridge_alpha: scale-free ridge strength of the Q/K fit (lam = alpha * mean diag of K).
        round_to: kept dims are multiples of this.
        gram_dtype: dtype of the per-batch Gram products ("float32" default, or "float64").
        gram_tokens: MLP statistics (ranking energy, mean and covariance for the ridge fit) from
            this many tokens per image instead of all n (0 = all tokens, exact). The MLP Gram is
            the largest cost of the calibration pass (~0.75 of a dense forward pass on
            deit_small); k tokens cost k/n of it. An estimator, not the exact all-token
            statistics (a random subset per image, seeded by the image's index:
            ``edgeprune.calibration.mlp_stats.token_positions``). ``None`` (default) = auto:
            ``mlp_stats.auto_gram_tokens`` (>= 64 tokens per image and >= 32 samples per hidden
            channel, else all tokens: large calibration sets only; all tokens for an unknown
            calibration size and with ``sequential``). docs/prune_cost.md measures speed and accuracy. An
            explicit K > 0 is refused with ``sequential``.
        bias_correction_images: output bias correction (``edgeprune.solve.output_bias``,
            docs/methods.md "Output bias correction"): after pruning, the mean output shift of the
            pruned model against the dense one over the first this many calibration images is
            folded into the classifier bias (models with an affine ``head`` only; others are left
            as they are). 0 = off; ``None`` (default) = auto: every calibration image with a
            budget (``budget``), off with sparsities (:func:`bias_correction_used`). The dense
            outputs come from the calibration pass (a separate pass for ``sequential``); the
            pruned model's cost one forward pass over those images.
        head_refit: with the output correction on, re-fit the whole classifier head to the dense
            outputs instead of its bias only (``edgeprune.solve.head_refit``: ridge toward the
            dense head, strength by cross-validation over the same images, the bias correction
            itself among the candidates). ``None`` (default) = auto = on whenever the output
            correction runs; False = the bias correction alone.
        last_block: "auto" (default), "cls" or "full": whether the pruned model's last block
            computes only the class token(s) its output reads (``edgeprune.last_block``,
            ``edgeprune.layers.class_token_block``; exact, saves 7% of a ViT-S/14's FLOPs at
            224 px). auto = with a budget, for classifiers with ``global_pool="token"``.
        qk_memory_limit_gb: above this, per-image Q/K Grams are not stored; a second calibration
            pass accumulates the exact system instead (same result, one more forward pass).
        qk_solver: how the exact Q/K system is solved from per-image Grams: "direct" (float64
            Cholesky of the d'^2 x d'^2 matrix), "cg" (matrix-free preconditioned conjugate
            gradients, ``edgeprune.solve.qk_logit_cg``; falls back to direct if it does not
            converge) or "auto" (the cheaper by :func:`cg_is_cheaper`; direct if alpha = 0). The
            second-pass (memory-limited) route always solves directly. Same system, same answer
            to ~1e-8 relative either way.
    """

    mlp_sparsity: float = 0.0
    attn_sparsity: float = 0.0
    compensation: bool = True
    mlp_criterion: str = "combined"
    ridge_alpha: float = mlp_ridge.DEFAULT_ALPHA
    qk_ridge_alpha: float = qk_logit.DEFAULT_ALPHA
    round_to: int = 8
    gram_dtype: str = "float32"
    gram_tokens: int | None = None
    qk_memory_limit_gb: float = 4.0
    qk_solver: str = "auto"
    target: str = "custom"
    v_sparsity: float = 0.0
    head_sparsity: float = 0.0
    layout: str = "default"
    vo_criterion: str = "combined"
    dims: list | None = None
    budget: dict | None = None
    sequential: bool = False
    sequential_memory_gb: float = 4.0
    allocation_check_images: int = 32
    allocation_sensitivity: bool = True
    allocation_anchors: int = 1
    bias_correction_images: int | None = None
    head_refit: bool | None = None
    last_block: str = "auto"

    @classmethod
    def from_target(cls, target: str = "both", sparsity: float | None = 0.5, *,
                    mlp_sparsity: float | None = None, attn_sparsity: float | None = None,
                    v_sparsity: float | None = None, head_sparsity: float | None = None,
                    **settings) -> "CorpConfig":
        """The config the CLI and the Python API build: one sparsity for every module of
        ``target``, with optional per-module overrides, then any other field by name.

        Args:
            target: which modules to prune (``edgeprune.plan.TARGETS``).
            sparsity: fraction of each targeted module's dims removed, [0, 1).
            mlp_sparsity, attn_sparsity, v_sparsity, head_sparsity: per-module overrides (they also
                select that module).
            **settings: any other :class:`CorpConfig` field (compensation, mlp_criterion, ...).

        Raises:
            UserError: unknown target or field, sparsity out of range, invalid settings.
        """
        from edgeprune.plan import resolve_sparsities

        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - fields)
        if unknown:
            raise UserError(f"unknown CORP setting(s) {', '.join(unknown)} (known: {', '.join(sorted(fields))})")
        sp = resolve_sparsities(target, sparsity, mlp_sparsity, attn_sparsity, v_sparsity, head_sparsity)
        cfg = cls(mlp_sparsity=sp["mlp"], attn_sparsity=sp["attn"], v_sparsity=sp["v"],
                  head_sparsity=sp["heads"], target=target, **settings)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raises UserError for out-of-range settings."""
        from edgeprune.plan import check_sparsity

        check_sparsity(self.mlp_sparsity)
        check_sparsity(self.attn_sparsity)
        check_sparsity(self.v_sparsity)
        check_sparsity(self.head_sparsity)
        if self.layout not in LAYOUTS:
            raise UserError(f"unknown layout {self.layout!r} (choose from {', '.join(LAYOUTS)})")
        attention_sparsities(self)
        if self.vo_criterion not in VO_CRITERIA:
            raise UserError(f"unknown V/O criterion {self.vo_criterion!r} (choose from {', '.join(VO_CRITERIA)})")
        if self.mlp_criterion not in MLP_CRITERIA:
            raise UserError(f"unknown MLP criterion {self.mlp_criterion!r} "
                            f"(choose from {', '.join(MLP_CRITERIA)})")
        if self.ridge_alpha < 0 or self.qk_ridge_alpha < 0:
            raise UserError("ridge alpha must be >= 0")
        if self.round_to < 1:
            raise UserError(f"--round-to must be >= 1, got {self.round_to}")
        if self.gram_dtype not in ("float64", "float32"):
            raise UserError("gram dtype must be float64 or float32")
        if self.gram_tokens is not None and (isinstance(self.gram_tokens, bool) or not isinstance(self.gram_tokens, int)
                                             or self.gram_tokens < 0):
            raise UserError(f"gram tokens must be an int >= 0 (0 = every token), got {self.gram_tokens!r}")
        if self.gram_tokens and self.sequential:
            raise UserError("--gram-tokens does not apply to --sequential calibration (it uses every token)")
        if self.qk_solver not in QK_SOLVERS:
            raise UserError(f"unknown Q/K solver {self.qk_solver!r} (choose from {', '.join(QK_SOLVERS)})")
        if self.qk_solver == "cg" and self.qk_ridge_alpha == 0:
            raise UserError("the cg Q/K solver needs a ridge alpha > 0 (use --qk-solver direct)")
        check_dims(self.dims)
        if self.allocation_anchors not in (1, 2) or isinstance(self.allocation_anchors, bool):
            raise UserError(f"allocation anchors must be 1 or 2, got {self.allocation_anchors!r}")
        if isinstance(self.allocation_check_images, bool) or not isinstance(self.allocation_check_images, int) \
                or self.allocation_check_images < 0:
            raise UserError(f"allocation check images must be an int >= 0, got {self.allocation_check_images!r}")
        k = self.bias_correction_images
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise UserError(f"bias correction images must be an int >= 0 (0 = off), got {k!r}")
        if self.head_refit is not None and not isinstance(self.head_refit, bool):
            raise UserError(f"head refit must be True, False or None (auto), got {self.head_refit!r}")
        check_refit_request(self.head_refit, bias_correction_used(self))  # issue 32
        from edgeprune.last_block import LAST_BLOCK_CHOICES

        if self.last_block not in LAST_BLOCK_CHOICES:
            raise UserError(f"unknown last block {self.last_block!r} (choose from {', '.join(LAST_BLOCK_CHOICES)})")
        if not self.sequential_memory_gb >= 0:
            raise UserError(f"the sequential stream memory limit must be >= 0 GiB, got {self.sequential_memory_gb!r}")
        if self.budget is not None:
            if not isinstance(self.budget, dict) or self.budget.get("kind") not in ("flops", "params"):
                raise UserError(f"budget must be {{'kind': 'flops' | 'params', 'value': v}}, got {self.budget!r}")
            v = self.budget.get("value")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise UserError(f"the {self.budget['kind']} budget must be > 0, got {v!r}")


#: "every calibration image" for the output bias correction (more than any calibration set)
ALL_IMAGES = 2 ** 62


def bias_correction_used(cfg: CorpConfig) -> int:
    """Calibration images of the output bias correction: ``cfg.bias_correction_images``, or for
    ``None`` (auto) :data:`ALL_IMAGES` with a budget and 0 without. Measured on the pretrained
    DINOv2 of ``dinov2-s14-fmnist`` at FLOPs x0.5 with 256 calibration images: +0.7 to +1.2 points
    of top-1 over 3 seeds, none measurable with 1024 images (docs/accuracy.md);
    with a budget the allocation's measured selection already costs several forward passes, so
    the one extra pass of the pruned model is small there; plain CORP (sparsities) stays as the
    paper defines it unless asked."""
    if cfg.bias_correction_images is not None:
        return int(cfg.bias_correction_images)
    return ALL_IMAGES if cfg.budget is not None else 0


def plan_corp(anatomy: ViTAnatomy, stats: CalibrationStatistics, cfg: CorpConfig) -> list[BlockPlan]:
    """Kept indices per block from the calibration statistics (ranking + rounding)."""
    plans = []
    for b in anatomy.blocks:
        plan = BlockPlan(index=b.index)
        k = mlp_kept(b, cfg)
        if k < b.mlp_hidden:
            scores = mlp_scores(stats.mlp[b.index], b.fc2.weight.detach(), cfg.mlp_criterion)
            plan.mlp_keep = top_k_indices(scores, k)
        if _prunes_attention(cfg):
            vo = stats.vo[b.index] if stats.vo else None
            plan_attention(b, plan, cfg, stats.qk[b.index], vo)
        plans.append(plan)
    return plans


def _prunes_attention(cfg: CorpConfig) -> bool:
    return bool(pruned_modules(cfg) & {"qk", "v", "heads"})


def mlp_kept(b, cfg: CorpConfig) -> int:
    """Kept MLP hidden channels of block ``b``: ``cfg.dims`` if it says, else from the sparsity.

    Raises:
        UserError: rounding leaves no channels, or a kept count above the block's hidden dim.
    """
    k = dims_override(cfg, b.index, "mlp")
    if k is not None:
        if k > b.mlp_hidden:
            raise UserError(f"block {b.index}: {k} MLP channels asked, the block has {b.mlp_hidden}")
        return k
    if cfg.mlp_sparsity > 0:
        return kept_dim(b.mlp_hidden, cfg.mlp_sparsity, cfg.round_to, f"block {b.index} MLP")
    return b.mlp_hidden


def apply_corp(anatomy: ViTAnatomy, plans: list[BlockPlan], cfg: CorpConfig,
               mlp_stats: list, qk_solve: QKSolve | None, vo_stats: list | None = None) -> list[dict]:
    """Solve and fold the compensation, then shrink the modules (in place).

    Args:
        anatomy: the model's anatomy (updated in place).
        plans: from :func:`plan_corp`.
        cfg: settings.
        mlp_stats: per-block :class:`MLPStatistics` (or None).
        qk_solve: ``f(block, head) -> (M, lam, info)`` solving that head's exact Q/K system (see
            :func:`qk_solver_from_grams`); None without compensation.
        vo_stats: per-block statistics of proj's input (V/O dims and heads); None if not pruned.

    Returns:
        per-block solve info: ridge lambdas actually used (``mlp_lambda``, ``vo_lambda``,
        ``qk_lambda`` list) and the Q/K solver per head (``qk_solver``: "direct" or "cg:<iterations>").
    """
    info = []
    for b, plan in zip(anatomy.blocks, plans):
        rec: dict = {"index": b.index}
        if plan.mlp_keep is not None:
            keep = plan.mlp_keep
            prune = pruned_indices(keep, b.mlp_hidden)
            bmat = cvec = None
            if cfg.compensation and len(prune) > 0:
                st = mlp_stats[b.index]
                bmat, cvec, lam = mlp_ridge.ridge_affine_map(st.mean, st.cov, keep, prune, cfg.ridge_alpha)
                rec["mlp_lambda"] = lam
            w2, b2 = mlp_ridge.fold_into_linear(b.fc2.weight.detach(), None if b.fc2.bias is None else b.fc2.bias.detach(),
                                                keep, prune, bmat, cvec)
            shrink_mlp(b, keep, w2, b2)
        if plan.prunes_attention:
            vo = vo_stats[b.index] if vo_stats else None
            rec.update(prune_attention(b, plan, cfg, vo, qk_solve))
        info.append(rec)
    return info


def qk_solver_from_grams(qk_stats: list, plans: list[BlockPlan], cfg: CorpConfig,
                         rhs_fn: Callable | None = None) -> QKSolve:
    """Per-head solver of the exact Q/K system from the stored per-image Grams.

    Args:
        qk_stats: per-block :class:`~edgeprune.calibration.qk_stats.QKStatistics` with Grams
            (anything indexable by block index).
        plans: kept Q/K dims per block (``plan.qk_keep``, (H, d')), indexable by block index.
        cfg: ``qk_solver`` ("auto" / "direct" / "cg") and ``qk_ridge_alpha``.
        rhs_fn: ``f(block, head, keep, prune) -> (d', d') float64`` replacing the system's right
            side (the two-stream system of ``edgeprune.solve.qk_logit_cross``); None = CORP's.

    Returns:
        ``f(block, head) -> (M (d', d') float64, lam, {"solver": "direct" | "cg:<iters>"})``.
        Both routes solve the same system (same lambda); CG falls back to Cholesky if it does
        not reach its tolerance.
    """
    grams: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def solve(i: int, h: int) -> tuple[torch.Tensor, float, dict]:
        if i not in grams:
            grams.clear()  # blocks are solved in order: hold one block's Grams at a time
            grams[i] = qk_stats[i].grams()
        gq, gk = grams[i]
        keep = plans[i].qk_keep[h]
        prune = pruned_indices(keep, gq.shape[-1])
        use_cg = cfg.qk_solver == "cg" or (cfg.qk_solver == "auto" and cfg.qk_ridge_alpha > 0
                                          and cg_is_cheaper(gq.shape[0], len(keep)))
        if use_cg:
            gq_ss, gk_ss, rhs = qk_logit.kept_blocks(gq[:, h], gk[:, h], keep, prune)
            if rhs_fn is not None:
                rhs = rhs_fn(i, h, keep, prune)
            res = qk_logit_cg.solve_logit_compensation_cg(gq_ss, gk_ss, rhs, cfg.qk_ridge_alpha)
            if res.converged:
                return res.m, res.lam, {"solver": f"cg:{res.iterations}"}
        k_sys, rhs = qk_logit.kronecker_system(gq[:, h], gk[:, h], keep, prune)
        if rhs_fn is not None:
            rhs = rhs_fn(i, h, keep, prune)
        m, lam = qk_logit.solve_logit_compensation(k_sys, rhs, cfg.qk_ridge_alpha)
        return m, lam, {"solver": "direct"}

    return solve


def _qk_gram_bytes(anatomy: ViTAnatomy, num_images: int) -> int:
    return num_images * sum(b.num_heads * 2 * b.qk_dim ** 2 * 4 for b in anatomy.blocks)


def gram_tokens_used(cfg: CorpConfig, anatomy: ViTAnatomy, num_images: int | None) -> int:
    """Tokens per image of the MLP statistics (0 = all): ``cfg.gram_tokens``, or for ``None``
    :func:`~edgeprune.calibration.mlp_stats.auto_gram_tokens` (all tokens with ``sequential``)."""
    from edgeprune.calibration.mlp_stats import auto_gram_tokens

    if cfg.gram_tokens is not None:
        return cfg.gram_tokens
    if cfg.sequential:
        return 0
    tokens = anatomy.num_patches + anatomy.num_prefix_tokens
    return auto_gram_tokens(num_images, max(b.mlp_hidden for b in anatomy.blocks), tokens)


def corp_prune(anatomy: ViTAnatomy, batches: Callable[[], Iterable[torch.Tensor]], cfg: CorpConfig,
               num_images: int | None = None, progress: bool = True) -> dict:
    """Prune the model of ``anatomy`` in place with CORP.

    Args:
        anatomy: anatomy of the model to prune (modified in place).
        batches: a callable returning a fresh iterable of calibration batches (B, C, H, W); called
            once, or twice when the Q/K Grams would exceed ``cfg.qk_memory_limit_gb``.
        cfg: :class:`CorpConfig`.
        num_images: calibration size, if known (for the memory estimate and progress bar).
        progress: show progress bars.

    Returns:
        info dict: ``calibration_seconds``, ``solve_seconds``, ``passes``, ``num_images``,
        ``blocks`` (per-block lambdas), ``output_sums`` (``(sum, count)`` of the dense model's
        outputs over the first :func:`bias_correction_used` images, taken in the calibration
        pass; None when not asked for or not available, e.g. sequential calibration) and
        ``output_rows`` (those outputs, this process's images in order: the classifier refit's
        targets).

    Raises:
        UserError: invalid settings, empty or mis-shaped calibration data.
    """
    cfg.validate()
    if cfg.dims is not None and len(cfg.dims) != len(anatomy.blocks):
        raise UserError(f"dims has {len(cfg.dims)} entries, the model has {len(anatomy.blocks)} blocks")
    for b in anatomy.blocks:  # rounding and fused-layout errors before the calibration pass
        attention_dims(b, cfg)
        mlp_kept(b, cfg)
    if cfg.budget is not None:  # an unreachable budget fails before the calibration pass
        from edgeprune.allocation.greedy import check_budget

        check_budget(anatomy, cfg)
    if cfg.sequential:
        from edgeprune.sequential import sequential_prune

        return sequential_prune(anatomy, batches, cfg, num_images=num_images, progress=progress)
    modules = pruned_modules(cfg)
    prune_mlp = "mlp" in modules
    prune_qk = "qk" in modules
    prune_vo = bool(modules & {"v", "heads"})
    two_pass = bool(prune_qk and cfg.compensation and num_images is not None
                    and _qk_gram_bytes(anatomy, num_images) > cfg.qk_memory_limit_gb * 2 ** 30)
    keep_grams = prune_qk and cfg.compensation and not two_pass
    mlp_tokens = gram_tokens_used(cfg, anatomy, num_images)
    gram_dtype = torch.float64 if cfg.gram_dtype == "float64" else torch.float32
    from edgeprune.solve.output_bias import classifier_head

    output_images = bias_correction_used(cfg) if classifier_head(anatomy.model) is not None else 0
    stats = collect_statistics(anatomy, batches(), mlp=prune_mlp and (cfg.compensation or cfg.mlp_criterion != "magnitude"),
                               qk=prune_qk, qk_grams=keep_grams, gram_dtype=gram_dtype,
                               mlp_second_order=cfg.compensation, vo=prune_vo,
                               mlp_active=cfg.mlp_criterion == "active",
                               progress=progress, mlp_tokens=mlp_tokens,
                               first_image=getattr(batches, "first_image", 0), output_images=output_images)
    seconds = stats.seconds
    t0 = time.perf_counter()
    allocation = None
    if cfg.budget is not None:
        from edgeprune.allocation.select import select_allocation

        dims, allocation = select_allocation(anatomy, stats, cfg, batches)
        cfg = dataclasses.replace(cfg, dims=dims)
    plans = plan_corp(anatomy, stats, cfg)
    passes = 1
    qk_solve = None
    if prune_qk and cfg.compensation:
        if keep_grams:
            qk_solve = qk_solver_from_grams(stats.qk, plans, cfg)
        else:
            solve_time = time.perf_counter() - t0
            second = collect_statistics(anatomy, batches(), mlp=False, qk=True,
                                        qk_keep=[p.qk_keep for p in plans], progress=progress)
            seconds += second.seconds
            passes = 2
            t0 = time.perf_counter() - solve_time

            def qk_solve(i: int, h: int, _second=second):
                st = _second.qk[i]
                m, lam = qk_logit.solve_logit_compensation(st.k_sys[h], st.rhs[h], cfg.qk_ridge_alpha)
                return m, lam, {"solver": "direct"}
    info = apply_corp(anatomy, plans, cfg, stats.mlp, qk_solve, stats.vo)
    return {"calibration_seconds": seconds, "solve_seconds": time.perf_counter() - t0,
            "passes": passes, "num_images": stats.num_images, "blocks": info, "allocation": allocation,
            "gram_tokens_used": mlp_tokens,
            "output_sums": (stats.output_sum, stats.output_count) if stats.output_sum is not None else None,
            "output_rows": stats.output_rows}
