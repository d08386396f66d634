"""CORP (corp-v1): the settings, the low-level steps and the one-shot pipeline.

Modules: ``config`` (:class:`CorpConfig`, validated once; derived settings), ``qk_solvers`` (the
Q/K solver registry), ``steps`` (plan / apply: the steps the strategies share), ``pipeline``
(:func:`corp_prune`, above ``edgeprune.allocation`` and ``edgeprune.sequential``). This file only
hands names on; library code imports the step modules, not this package, so that dependencies
point one way (``edgeprune.corp.pipeline`` -> allocation / sequential -> the steps).

The pipeline's names are handed on lazily (module ``__getattr__``): importing a step module runs
this file first, and an eager import of the pipeline here would import ``edgeprune.allocation``
from inside whatever imported the step (an import loop through this file).
"""

from edgeprune.corp.config import ALL_IMAGES, CorpConfig, bias_correction_used, gram_tokens_used
from edgeprune.corp.qk_solvers import (QKHeadSystem, QKSolve, get_qk_solver, list_qk_solvers, qk_solver_from_grams,
                                       register_qk_solver)
from edgeprune.corp.steps import apply_corp, mlp_kept, plan_corp, prunes_attention
from edgeprune.solve.qk_choice import cg_is_cheaper
from edgeprune.vo import LAYOUTS

_PIPELINE = ("check_prunable", "corp_prune", "statistics_request")


def __getattr__(name: str):
    """``corp_prune`` & co. from ``edgeprune.corp.pipeline`` (loaded on first use, module doc)."""
    if name in _PIPELINE:
        from edgeprune.corp import pipeline  # lazy: the pipeline sits above allocation/sequential

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: the registered Q/K solver names
QK_SOLVERS = list_qk_solvers()

__all__ = ["CorpConfig", "ALL_IMAGES", "bias_correction_used", "gram_tokens_used", "QKHeadSystem", "QKSolve",
           "register_qk_solver", "get_qk_solver", "list_qk_solvers", "qk_solver_from_grams", "QK_SOLVERS",
           "apply_corp", "mlp_kept", "plan_corp", "prunes_attention", "cg_is_cheaper", "LAYOUTS",
           "check_prunable", "corp_prune", "statistics_request"]
