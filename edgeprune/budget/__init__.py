"""Budgets (issue 39): the :class:`Budget` object, its one parser, and the registered cost models.

* :mod:`.budget` -- :class:`Budget` (kind, value, unit, table), owning its cost model (built once per model shape);
* :mod:`.parse` -- :func:`make_budget` / :func:`validate_budget`: CLI text or Python values -> :class:`Budget`;
* :mod:`.base` -- :class:`CostModel`, the base class declaring every hook the allocator and the record use;
* :mod:`.registry` -- :func:`register_cost_model`, :func:`total_cost`, :func:`dense_dims`;
* one file per kind: :mod:`.flops`, :mod:`.params`, :mod:`.latency` (a measured latency table).

A new kind is one file with a :class:`CostModel` subclass and ``@register_cost_model("name")``, plus its import
line below (or in the caller's code, as tests/test_budget_kinds.py does with a toy kind).
"""

from edgeprune.budget.base import CostModel
from edgeprune.budget.budget import Budget
from edgeprune.budget.registry import (COST_MODELS, dense_dims, get_cost_model, list_cost_models,
                                       register_cost_model, total_cost, unregister_cost_model)
from edgeprune.budget import flops, params, latency  # noqa: F401,E402  (register the built-in kinds, in order)
from edgeprune.budget.parse import budget_kinds, kind_unit, make_budget, parse_budget_value, validate_budget

__all__ = ["Budget", "CostModel", "COST_MODELS", "budget_kinds", "dense_dims", "get_cost_model", "kind_unit",
           "list_cost_models", "make_budget", "parse_budget_value", "register_cost_model", "total_cost",
           "unregister_cost_model", "validate_budget"]
