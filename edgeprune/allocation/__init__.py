"""Budgeted allocation (``--flops`` / ``--params``): kept dims per block and module under a budget.

``allocate(anatomy, stats, cfg) -> (dims, report)`` is what ``edgeprune.corp.corp_prune`` calls
when ``CorpConfig.budget`` is set (METHODS.md §5 "Budgeted allocation"; docs/allocation.md).
Submodules: ``budget`` (parsing), ``cost`` (cost models: FLOPs, params; a registry for latency
tables), ``errors`` (E(k) curves from the calibration statistics), ``greedy`` (the allocator).
"""

from edgeprune.allocation.budget import make_budget, parse_budget_value
from edgeprune.allocation.cost import COST_MODELS, CostModel, cost_model, register_cost_model
from edgeprune.allocation.greedy import allocate

__all__ = ["allocate", "make_budget", "parse_budget_value", "COST_MODELS", "CostModel", "cost_model",
           "register_cost_model"]
