"""Scores through the criterion registry, and the top-k choice (higher score = kept).

Attention Q/K dims (corp-v1 §3.3, eq. 13): ``logit`` = E_image[ ||q_j||^2 ||k_j||^2 ] per head.
Whole heads are ranked by their removal error (``edgeprune.vo.rank_heads``).
"""

from __future__ import annotations

import torch

from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.calibration.qk_stats import QKStatistics
from edgeprune.errors import UserError
from edgeprune.ranking.registry import get_criterion
from edgeprune.solve.topk import stable_top_k

QK_CRITERIA = ("logit",)


def mlp_scores(stats: MLPStatistics | None, fc2_weight: torch.Tensor, criterion: str = "combined") -> torch.Tensor:
    """Channel scores (D_mlp,) float64 of the criterion registered as ``criterion``.

    Args:
        stats: hidden statistics of this MLP; fc2_weight: (D, D_mlp).

    Raises:
        UserError: unknown criterion.
    """
    return get_criterion(criterion, "mlp").scores(stats, fc2_weight)


def vo_scores(stats: MLPStatistics, proj_weight: torch.Tensor, num_heads: int,
              criterion: str = "combined") -> torch.Tensor:
    """V-dim scores per head (H, d_v) float64, from proj-input statistics (METHODS.md §5).

    Args:
        stats: statistics of z, proj's input (H*d_v channels, head-major).
        proj_weight: W_O (D, H*d_v).
        num_heads: H.
        criterion: a criterion registered for "vo".

    Raises:
        UserError: unknown criterion.
    """
    return get_criterion(criterion, "vo").scores(stats, proj_weight).reshape(num_heads, -1)


def qk_scores(stats: QKStatistics, criterion: str = "logit") -> torch.Tensor:
    """Per-head dim scores (H, d) float64.

    Raises:
        UserError: unknown criterion.
    """
    if criterion == "logit":
        return stats.logit_energy
    raise UserError(f"unknown Q/K criterion {criterion!r} (choose from {', '.join(QK_CRITERIA)})")


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim, sorted ascending (int64, on the CPU).

    Selected by :func:`edgeprune.solve.topk.stable_top_k`, the one tie-break rule: scores in
    float64 on the CPU, stable sort, an exact tie goes to the lower index (device-independent).
    Near ties (scores closer than their float32 round-off, ~1e-6 relative) are not merged and
    may rank differently on another device; ``edgeprune.solve.topk`` says why.
    """
    return stable_top_k(scores, k)
