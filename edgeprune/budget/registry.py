"""The registry of budget kinds (cost models), and the totals every consumer computes from them.

One interface for ``edgeprune prune`` (the budgeted allocation, ``edgeprune.allocation``) and ``edgeprune derive``
(NuWa's plan search, ``edgeprune.nuwa.budget``): a kind is a :class:`~edgeprune.budget.base.CostModel` subclass
registered under its name (``flops`` in ``edgeprune/budget/flops.py``, ``params`` in ``params.py``, ``latency`` in
``latency.py``); the model's total at an allocation is ``fixed_cost() + sum_i block_cost(block_i, dims_i)``
(:func:`total_cost`; :func:`dense_cost` at the model's own dims). A new kind::

    @register_cost_model("energy")
    class EnergyCost(CostModel):
        def block_cost(self, b, dims): ...
        def fixed_cost(self): ...

after which ``Budget(kind="energy", value=0.5)`` (``edgeprune.budget.make_budget(energy=0.5)``, ``energy=0.5`` on
``edgeprune.prune``) is parsed, checked and allocated like the built-in kinds.
"""

from __future__ import annotations

from typing import Any, Callable

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.budget.base import CostModel
from edgeprune.registry import Registry

#: name -> cost-model class (or factory ``f(anatomy, query_tokens=None, *, budget=None)`` with the class attributes)
COST_MODELS: Registry[Callable[..., CostModel]] = Registry("budget kind")


def register_cost_model(name: str, factory: Callable[..., CostModel] | None = None):
    """Make ``factory`` (a :class:`CostModel` subclass) the cost model of budgets of kind ``name``; usable as a
    decorator (``@register_cost_model("latency")``) or a call. Sets the class's ``name``. Registering a name again
    replaces the earlier one.

    Returns:
        the factory (decorator form) or None.
    """
    def put(f: Callable[..., CostModel]) -> Callable[..., CostModel]:
        try:
            f.name = name  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            pass
        return COST_MODELS.register(name, f, replace=True)

    if factory is None:
        return put
    put(factory)
    return None


def unregister_cost_model(name: str) -> None:
    """Remove a registered kind (tests that register a toy kind clean up with this; no error if there is none)."""
    COST_MODELS.unregister(name, missing_ok=True)


def list_cost_models() -> list[str]:
    """The registered budget kinds, in registration order (``flops``, ``params``, ``latency`` first)."""
    return list(COST_MODELS.names())


def get_cost_model(kind: str) -> Callable[..., CostModel]:
    """The class registered for ``kind``.

    Raises:
        UserError: unknown kind; one line listing the registered ones.
    """
    return COST_MODELS.get(kind)


def kind_attr(kind: str, attr: str, default: Any = None) -> Any:
    """A class attribute of ``kind``'s cost model (``unit``, ``needs_table`` ...), ``default`` for a factory
    that is not a :class:`CostModel` subclass and lacks it; ``default`` for an unknown kind."""
    return getattr(COST_MODELS.find(kind), attr, default)


def dense_dims(b: BlockAnatomy) -> dict[str, int]:
    """The block's current dims as an allocation dict."""
    return {"mlp": b.mlp_hidden, "qk": b.qk_dim, "v": b.v_dim, "heads": b.num_heads}


def total_cost(model: CostModel, anatomy: ViTAnatomy, dims: list[dict[str, int]]) -> float:
    """``fixed_cost() + sum_i block_cost(block_i, dims_i)``."""
    return model.fixed_cost() + sum(model.block_cost(b, d) for b, d in zip(anatomy.blocks, dims))
