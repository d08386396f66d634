"""CORP (corp-v1): the settings, the low-level steps and the one-shot pipeline.

Modules: ``config`` (:class:`CorpConfig`, validated once; derived settings), ``qk_solvers`` (the
Q/K solver registry), ``steps`` (plan / apply: the steps the strategies share). The one-shot
pipeline that puts them together with the budgeted allocation and sequential calibration,
:func:`edgeprune.pruning.corp.corp_prune`, sits above ``edgeprune.allocation`` and
``edgeprune.sequential``, which use these steps: dependencies point one way
(pipeline -> allocation / sequential -> corp steps). This file only hands names on.
"""

from edgeprune.corp.config import ALL_IMAGES, CorpConfig, bias_correction_used, gram_tokens_used
from edgeprune.corp.qk_solvers import (QKHeadSystem, QKSolve, get_qk_solver, list_qk_solvers, qk_solver_from_grams,
                                       register_qk_solver, unregister_qk_solver)
from edgeprune.corp.steps import apply_corp, mlp_kept, plan_corp, prunes_attention
from edgeprune.solve.qk_choice import cg_is_cheaper
from edgeprune.vo import LAYOUTS

#: the registered Q/K solver names
QK_SOLVERS = list_qk_solvers()

__all__ = ["CorpConfig", "ALL_IMAGES", "bias_correction_used", "gram_tokens_used", "QKHeadSystem", "QKSolve",
           "register_qk_solver", "unregister_qk_solver", "get_qk_solver", "list_qk_solvers", "qk_solver_from_grams",
           "QK_SOLVERS",
           "apply_corp", "mlp_kept", "plan_corp", "prunes_attention", "cg_is_cheaper", "LAYOUTS"]
