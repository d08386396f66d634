"""The cost-model base class of budgets: every hook the allocator, NuWa's plan search and the run record use.

A budget kind (``--flops``, ``--params``, ``--latency`` ...) is one :class:`CostModel` subclass in one file of
this package (or anywhere) plus one registration (``edgeprune.budget.registry.register_cost_model``). The model's
total cost at an allocation is ``fixed_cost() + sum_i block_cost(block_i, dims_i)``
(:func:`edgeprune.budget.registry.total_cost`). Nothing outside ``edgeprune.budget`` names a kind: what differs
between kinds is said by the class attributes and hooks below.
"""

from __future__ import annotations

from typing import Any, Callable

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy


class CostModel:
    """Base class of a budget kind's cost model, built for one model (its anatomy before pruning).

    Class attributes (the kind's description, read before any instance exists):
        name: the kind (``"flops"``); set by the registration.
        unit: the unit of absolute budgets when the kind has one (``"ms"``: ``--latency 12ms``), else None
            (absolute budgets are plain counts with an optional k/M/G/T suffix).
        needs_table: the budget carries the path of a measured table (``Budget.table``).
        missing_table: the one-line error when such a budget has no table.
        allocates_heads: whole heads are allocation units beside head dims by default
            (``edgeprune.allocation.rules.heads_allocated``).
        prices_sliced_models: the cost model can price a model whose embedding dim was sliced
            (``edgeprune.embed``); a table measured at the dense width cannot.
        verifiable: after a prune the cost can be measured on the machine (a latency table's backend), see
            :meth:`why_not_measured`.

    Args:
        anatomy: the model the budget applies to (dense dims).
        query_tokens: ``{block index: T}`` for blocks that will compute only their first T tokens (the class-token
            last block, ``edgeprune.layers.class_token_block``).
        budget: the :class:`~edgeprune.budget.Budget` (a table's path for kinds that need one).
    """

    name: str = ""
    unit: str | None = None
    needs_table: bool = False
    missing_table: str = "this budget needs a table"
    allocates_heads: bool = False
    prices_sliced_models: bool = True
    verifiable: bool = False

    def __init__(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None, *,
                 budget: Any = None) -> None:
        self.query_tokens = {b.index: b.query_tokens for b in anatomy.blocks if b.query_tokens is not None}
        self.query_tokens.update(query_tokens or {})

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        """Cost of block ``b`` with kept dims ``dims`` (keys mlp, qk, v, heads; all present)."""
        raise NotImplementedError

    def fixed_cost(self) -> float:
        """Cost that does not depend on any block's kept dims."""
        raise NotImplementedError

    def remembered(self, b: BlockAnatomy, dims: dict[str, int], price: Callable[[], float], *also: Any) -> float:
        """``price()``, computed once per block index, kept dims and ``also`` (whatever else the price depends on,
        e.g. the layer widths): the greedy allocation asks for the same few hundred prices ~10^5 times per prune
        (issue 40 item 4). For a kind's :meth:`block_cost`."""
        memo = self.__dict__.setdefault("_memo", {})
        key = (b.index, *also, tuple(sorted(dims.items())))
        got = memo.get(key)
        if got is None:
            got = memo[key] = price()
        return got

    @property
    def rules(self) -> dict[str, Any]:
        """Pruning rules the kind imposes on the allocation grid (``mlp_round_to``, ``head_dim_round_to``,
        ``qk_equals_v``); ``{}`` = the config's own rounding."""
        return {}

    def bounds(self) -> dict[str, int]:
        """The smallest kept size per module (``mlp``, ``qk``, ``v``, ``heads``) the cost model can price;
        ``{}`` = no bound."""
        return {}

    @classmethod
    def check_inputs(cls, budget: Any) -> None:
        """Check what the budget reads besides its value (a table file) before any model is built; no-op here.

        Raises:
            UserError: one line naming the file and what is wrong with it.
        """

    @classmethod
    def config_defaults(cls, budget: Any) -> dict[str, Any]:
        """CORP settings a budget of this kind implies where the user gave none (a latency table's fused
        layout), known before the model is built; ``{}`` = none.

        Raises:
            UserError: the kind's own input errors (a missing or malformed table).
        """
        return {}

    def record(self) -> dict[str, Any]:
        """What the run record says about the cost model beyond its kind (a table's path, key, rules)."""
        return {}
