"""NuWa: derive lightweight class-specific ViTs from a base ViT under a FLOPs budget (nuwa §3).

* :mod:`.skp` -- self-knowledge purification: learnable MLP masks -> the anchor (§3.2).
* :mod:`.ofp_mha` -- data-free SVD truncation of the QK and VO products (§3.3 eq. 7-9).
* :mod:`.ofp_mlp` -- uniform MLP widths, mean-activation ranking, least-squares fc2 re-fit (eq. 10-12).
* :mod:`.budget` -- FLOPs / params / latency budget -> per-block dims, rho search (MLP fill by search
  under a measured latency table).
* :mod:`.head` -- non-target suppression or head slicing.
* :mod:`.svd_cache` -- the SVD factors, cached in memory and on disk.
* :mod:`.config` -- :class:`DeriveConfig`, the settings.
* :mod:`.inputs` -- target classes, budget, labeled split, target-class metric.
* :mod:`.derive` -- orchestration: :func:`derive`, :func:`prepare` + :func:`derive_from`.
"""

from edgeprune.nuwa.config import DeriveConfig
from edgeprune.nuwa.derive import DeriveResult, Prepared, derive, derive_from, prepare
from edgeprune.nuwa.inputs import evaluate_targets, resolve_budget, resolve_classes
from edgeprune.nuwa.head import apply_head_structure
from edgeprune.nuwa.skp import Anchor, SKPConfig

__all__ = ["Anchor", "DeriveConfig", "DeriveResult", "Prepared", "SKPConfig", "apply_head_structure",
           "derive", "derive_from", "evaluate_targets", "prepare", "resolve_budget", "resolve_classes"]
