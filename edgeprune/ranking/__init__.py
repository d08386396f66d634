"""Importance criteria for structured pruning (higher score = more important = kept).

``registry`` (the :class:`Criterion` interface and ``register_criterion`` / ``get_criterion`` /
``list_criteria``), ``builtin`` (combined, energy, magnitude, active), ``scores`` (scoring through
the registry, Q/K ``logit``, top-k).
"""

from edgeprune.ranking import builtin  # noqa: F401  (registers the built-in criteria)
from edgeprune.ranking.registry import (KINDS, STATISTICS, Criterion, get_criterion, list_criteria,
                                        register_criterion, unregister_criterion)
from edgeprune.ranking.scores import QK_CRITERIA, mlp_scores, qk_scores, top_k_indices, vo_scores

#: the built-in criteria per channel kind (the registry may hold more: ``list_criteria``)
MLP_CRITERIA = list_criteria("mlp")
VO_CRITERIA = list_criteria("vo")

__all__ = ["Criterion", "register_criterion", "unregister_criterion", "get_criterion", "list_criteria", "KINDS",
           "STATISTICS",
           "mlp_scores", "vo_scores", "qk_scores", "top_k_indices", "MLP_CRITERIA", "VO_CRITERIA",
           "QK_CRITERIA"]
