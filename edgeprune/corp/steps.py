"""The CORP steps: kept indices from the statistics (plan), then the closed-form fold and the
surgery (apply) -- corp-v1 Alg. 2-3. Used by the one-shot pipeline (``edgeprune.pruning.corp``),
the budgeted allocation (``edgeprune.allocation``) and sequential calibration
(``edgeprune.sequential``).
"""

from __future__ import annotations

from edgeprune.anatomy import ViTAnatomy
from edgeprune.calibration.collect import CalibrationStatistics
from edgeprune.corp.config import CorpConfig
from edgeprune.corp.qk_solvers import QKSolve
from edgeprune.errors import UserError
from edgeprune.plan import BlockPlan, dims_override, kept_dim, pruned_indices, pruned_modules
from edgeprune.ranking import mlp_scores, top_k_indices
from edgeprune.solve import mlp_ridge
from edgeprune.surgery import shrink_mlp
from edgeprune.vo import plan_attention, prune_attention


def plan_corp(anatomy: ViTAnatomy, stats: CalibrationStatistics, cfg: CorpConfig) -> list[BlockPlan]:
    """Kept indices per block from the calibration statistics (ranking + rounding)."""
    plans = []
    for b in anatomy.blocks:
        plan = BlockPlan(index=b.index)
        k = mlp_kept(b, cfg)
        if k < b.mlp_hidden:
            scores = mlp_scores(stats.mlp[b.index], b.fc2.weight.detach(), cfg.mlp_criterion)
            plan.mlp_keep = top_k_indices(scores, k)
        if prunes_attention(cfg):
            vo = stats.vo[b.index] if stats.vo else None
            plan_attention(b, plan, cfg, stats.qk[b.index], vo)
        plans.append(plan)
    return plans


def prunes_attention(cfg: CorpConfig) -> bool:
    """Whether ``cfg`` prunes any attention dims (Q/K, V or heads)."""
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
            bias2 = None if b.fc2.bias is None else b.fc2.bias.detach()
            w2, b2 = mlp_ridge.fold_into_linear(b.fc2.weight.detach(), bias2, keep, prune, bmat, cvec)
            shrink_mlp(b, keep, w2, b2)
        if plan.prunes_attention:
            vo = vo_stats[b.index] if vo_stats else None
            rec.update(prune_attention(b, plan, cfg, vo, qk_solve))
        info.append(rec)
    return info
