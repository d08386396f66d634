"""The built-in criteria (corp-v2 §3.3, App. E; METHODS.md §5), registered on import.

MLP hidden channels and V dims, from the input statistics and the consuming weight W:

* ``combined``:   sqrt(E[h_j^2]) * ||W[:, j]||_2  (Wanda-style activation x weight; the RMS norm of
  channel j's contribution ``W[:, j] h_j`` to the layer output). Default.
* ``energy``:     E[h_j^2]
* ``magnitude``:  ||W[:, j]||_2  (no statistics)
* ``active``:     P(h_j > 0)  (MLP only: z, proj's input, is not post-GELU)
"""

from __future__ import annotations

import torch

from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.ranking.registry import Criterion, register_criterion


@register_criterion("combined")
class Combined(Criterion):
    """sqrt(E[h_j^2]) * ||W[:, j]||_2."""

    needs = frozenset({"energy"})

    def scores(self, stats: MLPStatistics | None, weight: torch.Tensor) -> torch.Tensor:
        return stats.energy.clamp_min(0).sqrt() * weight.double().norm(dim=0)


@register_criterion("energy")
class Energy(Criterion):
    """E[h_j^2]."""

    needs = frozenset({"energy"})

    def scores(self, stats: MLPStatistics | None, weight: torch.Tensor) -> torch.Tensor:
        return stats.energy


@register_criterion("magnitude")
class Magnitude(Criterion):
    """||W[:, j]||_2 (the weight alone)."""

    needs = frozenset()

    def scores(self, stats: MLPStatistics | None, weight: torch.Tensor) -> torch.Tensor:
        return weight.double().norm(dim=0)


@register_criterion("active")
class Active(Criterion):
    """P(h_j > 0) (post-GELU MLP channels only)."""

    needs = frozenset({"energy", "positive"})
    applies_to = frozenset({"mlp"})

    def scores(self, stats: MLPStatistics | None, weight: torch.Tensor) -> torch.Tensor:
        return stats.active_prob
