"""Importance scores for structured pruning (higher = more important = kept).

MLP hidden channels (corp-v2 §3.3, App. E), from :class:`MLPStatistics` and ``fc2.weight``:

* ``energy``:     E[h_j^2]
* ``magnitude``:  ||W2[:, j]||_2
* ``combined``:   sqrt(E[h_j^2]) * ||W2[:, j]||_2  (Wanda-style activation x weight; it is the RMS
  norm of channel j's contribution ``W2[:, j] h_j`` to the fc2 output, so it ranks channels by how
  much output they carry). Default.
* ``active``:     P(h_j > 0)

Attention Q/K dims (corp-v1 §3.3, eq. 13): ``logit`` = E_image[ ||q_j||^2 ||k_j||^2 ] per head.

Attention V dims (METHODS.md §5), from the statistics of ``proj``'s input z (an
:class:`MLPStatistics` over H*d_v channels) and ``proj.weight``: the same ``combined`` / ``energy``
/ ``magnitude`` criteria as the MLP (``active`` is meaningless for z, which is not post-GELU).
Whole heads are ranked by their removal error (``edgeprune.vo.rank_heads``).
"""

from __future__ import annotations

import torch

from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.calibration.qk_stats import QKStatistics
from edgeprune.errors import UserError
from edgeprune.solve.topk import stable_top_k

MLP_CRITERIA = ("combined", "energy", "magnitude", "active")
QK_CRITERIA = ("logit",)
VO_CRITERIA = ("combined", "energy", "magnitude")


def mlp_scores(stats: MLPStatistics, fc2_weight: torch.Tensor, criterion: str = "combined") -> torch.Tensor:
    """Channel scores (D_mlp,) float64.

    Args:
        stats: hidden statistics of this MLP.
        fc2_weight: (D, D_mlp).
        criterion: one of :data:`MLP_CRITERIA`.

    Raises:
        UserError: unknown criterion.
    """
    if criterion == "energy":
        return stats.energy
    if criterion == "magnitude":
        return fc2_weight.double().norm(dim=0)
    if criterion == "combined":
        return stats.energy.clamp_min(0).sqrt() * fc2_weight.double().norm(dim=0)
    if criterion == "active":
        return stats.active_prob
    raise UserError(f"unknown MLP criterion {criterion!r} (choose from {', '.join(MLP_CRITERIA)})")


def vo_scores(stats: MLPStatistics, proj_weight: torch.Tensor, num_heads: int,
              criterion: str = "combined") -> torch.Tensor:
    """V-dim scores per head (H, d_v) float64, from proj-input statistics (METHODS.md §5).

    Args:
        stats: statistics of z, proj's input (H*d_v channels, head-major).
        proj_weight: W_O (D, H*d_v).
        num_heads: H.
        criterion: one of :data:`VO_CRITERIA`.

    Raises:
        UserError: unknown criterion.
    """
    if criterion not in VO_CRITERIA:
        raise UserError(f"unknown V/O criterion {criterion!r} (choose from {', '.join(VO_CRITERIA)})")
    return mlp_scores(stats, proj_weight, criterion).reshape(num_heads, -1)


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
