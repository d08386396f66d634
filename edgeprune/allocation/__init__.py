"""Budgeted allocation (``--flops`` / ``--params``): kept dims per block and module under a budget.

``greedy.allocate(anatomy, stats, cfg) -> (dims, report)`` is what ``edgeprune.pipeline.corp_prune``
calls when ``CorpConfig.budget`` is set (METHODS.md §5 "Budgeted allocation"; docs/allocation.md).
Submodules: ``budget`` (the one budget parser, prune and derive), ``cost`` (the cost-model
registry: FLOPs, params; ``latency_cost``: latency from a measured table), ``rules`` (the candidate
grid: ``round_to`` or a latency table's rules), ``curves`` (E(k) error curves from the calibration
statistics), ``greedy`` (the allocator), ``select`` / ``measure`` (candidates checked on images).

This file hands on only the budget and cost names, which sit below the CORP steps; the allocator
is imported from ``edgeprune.allocation.greedy`` (it uses the CORP steps, which use the budget
check: importing it here would loop).
"""

from edgeprune.allocation.budget import make_budget, parse_budget_value, validate_budget
from edgeprune.allocation.cost import COST_MODELS, CostModel, cost_model, register_cost_model
from edgeprune.allocation import latency_cost  # noqa: F401  (registers the "latency" budget kind)

__all__ = ["make_budget", "parse_budget_value", "validate_budget", "COST_MODELS", "CostModel", "cost_model",
           "register_cost_model"]
