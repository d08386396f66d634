"""Cost models of budgets (one interface for ``edgeprune prune`` and ``edgeprune derive``).

A budget has a kind (``--flops``, ``--params``; ``--latency`` next) and each kind is a registered
cost model: ``block_cost(block, dims)`` -- the part of the model's cost that depends on the block's
kept dims ``{"mlp", "qk", "v", "heads"}`` -- and ``fixed_cost()`` (everything else: patch
embedding, head, norms, biases of unpruned outputs). The model's total at an allocation is
``fixed_cost() + sum_i block_cost(block_i, dims_i)`` (:func:`total_cost`; :func:`dense_cost` at the
model's own dims). Both consumers call only these two methods: the budgeted allocation of prune
(``edgeprune.allocation.greedy``, which needs no linearity: it evaluates ``block_cost`` at the
candidate dims) and NuWa's plan search (``edgeprune.nuwa.budget``). Two are built in, both exact for
edgeprune's surgery (tests/test_allocation.py checks them against the pruned model's
``edgeprune.flops.model_flops`` / ``count_params``); their formulas live in ``edgeprune.flops``:

* ``flops`` -- FLOPs per image (= 2 x MACs), :func:`edgeprune.flops.block_flops`:
  ``2 n D H (2 d_qk + d_v) + 2 n^2 H (d_qk + d_v) + 2 n H d_v D + 4 n D D_mlp``.
* ``params`` -- parameters, :func:`edgeprune.flops.block_params` (less the biases of the unpruned
  outputs, which are fixed): qkv ``(D + bias) H (2 d_qk + d_v)``, proj ``H d_v D``, fc1
  ``(D + bias) D_mlp``, fc2 ``D_mlp D``.

A new kind (e.g. a measured latency table for a device) is one class with the two methods (the
:class:`CostModel` protocol) and one registration::

    @register_cost_model("latency")
    class LatencyCost:
        name = "latency"
        def __init__(self, anatomy, query_tokens=None): ...
        def block_cost(self, b, dims): ...
        def fixed_cost(self): ...

after which ``--latency``-style budgets ``{"kind": "latency", "value": v}`` are accepted by
:func:`edgeprune.allocation.budget.validate_budget` and parsed by
:func:`edgeprune.allocation.budget.make_budget`.
"""

from __future__ import annotations

from typing import Callable, Protocol

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.errors import UserError
from edgeprune.flops import block_flops, block_params, count_params, model_flops, with_dims


class CostModel(Protocol):
    """What the allocator and NuWa's plan search need from a cost model (see module doc)."""

    name: str

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        """Cost of block ``b`` with kept dims ``dims`` (keys mlp, qk, v, heads; all present)."""

    def fixed_cost(self) -> float:
        """Cost that does not depend on any block's kept dims."""


#: name -> factory ``factory(anatomy)`` / ``factory(anatomy, query_tokens)`` (see :func:`register_cost_model`)
COST_MODELS: dict[str, Callable[..., CostModel]] = {}


def register_cost_model(name: str, factory: Callable[..., CostModel] | None = None):
    """Make ``factory`` the cost model of budgets of kind ``name``; usable as a decorator
    (``@register_cost_model("latency")``) or a call (``register_cost_model("latency", factory)``).

    ``factory(anatomy)`` builds the model's cost model. When the pruned model will have blocks that
    compute only their first T tokens (the class-token last block) it is called as
    ``factory(anatomy, query_tokens)`` with ``query_tokens = {block index: T}`` (see
    :class:`FlopsCost`). Registering a name again replaces the earlier factory.

    Returns:
        the factory (decorator form) or None.
    """
    if factory is None:
        def deco(f: Callable[..., CostModel]) -> Callable[..., CostModel]:
            COST_MODELS[name] = f
            return f

        return deco
    COST_MODELS[name] = factory
    return None


def unregister_cost_model(name: str) -> None:
    """Remove a registered kind (tests that register a toy kind clean up with this)."""
    COST_MODELS.pop(name, None)


def list_cost_models() -> list[str]:
    """The registered budget kinds, in registration order (``flops``, ``params`` first)."""
    return list(COST_MODELS)


def get_cost_model(kind: str) -> Callable[..., CostModel]:
    """The factory registered for ``kind``.

    Raises:
        UserError: unknown kind (the message lists the registered ones).
    """
    if kind not in COST_MODELS:
        raise UserError(f"unknown budget kind {kind!r} (choose from {', '.join(COST_MODELS)})")
    return COST_MODELS[kind]


def dense_dims(b: BlockAnatomy) -> dict[str, int]:
    """The block's current dims as an allocation dict."""
    return {"mlp": b.mlp_hidden, "qk": b.qk_dim, "v": b.v_dim, "heads": b.num_heads}


@register_cost_model("flops")
class FlopsCost:
    """FLOPs per image (2 x MACs) of the matrix products (:func:`edgeprune.flops.block_flops`).

    Args:
        anatomy: the model.
        query_tokens: ``{block index: T}`` for blocks that will compute only their first T tokens
            (the class-token last block, ``edgeprune.layers.class_token_block``); other blocks
            count as they are (``BlockAnatomy.query_tokens``, None = every token).
    """

    name = "flops"

    def __init__(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None) -> None:
        self.n = anatomy.num_tokens
        self.query_tokens = {b.index: b.query_tokens for b in anatomy.blocks if b.query_tokens is not None}
        self.query_tokens.update(query_tokens or {})
        dense = model_flops(anatomy)
        self._fixed = float(dense["patch_embed"]) + float(dense["head"])  # type: ignore[arg-type]

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        return float(block_flops(with_dims(b, dims, self.query_tokens.get(b.index)), self.n)["total"])

    def fixed_cost(self) -> float:
        return self._fixed


@register_cost_model("params")
class ParamsCost:
    """Number of parameters (:func:`edgeprune.flops.block_params`; the biases of the unpruned
    outputs and everything outside the blocks' linears are the fixed cost)."""

    name = "params"

    def __init__(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None) -> None:
        self._fixed = float(count_params(anatomy.model)) - sum(self.block_cost(b, dense_dims(b))
                                                              for b in anatomy.blocks)

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        p = block_params(with_dims(b, dims))
        return float(p["total"] - p["out_bias"])

    def fixed_cost(self) -> float:
        return self._fixed


def cost_model(kind: str, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None,
               budget: dict | None = None) -> CostModel:
    """The registered cost model for ``kind`` of the model as it will be after pruning
    (``query_tokens``: see :class:`FlopsCost`). A factory that declares ``needs_table`` (the
    latency cost model) is also given the budget dict (``budget=``: its table's path).

    Raises:
        UserError: unknown kind (or the factory's own errors: a missing table, another model's).
    """
    factory = get_cost_model(kind)
    extra = {"budget": budget} if getattr(factory, "needs_table", False) else {}
    return factory(anatomy, query_tokens, **extra) if query_tokens else factory(anatomy, **extra)


def total_cost(model: CostModel, anatomy: ViTAnatomy, dims: list[dict[str, int]]) -> float:
    """``fixed_cost() + sum_i block_cost(block_i, dims_i)``."""
    return model.fixed_cost() + sum(model.block_cost(b, d) for b, d in zip(anatomy.blocks, dims))


def dense_cost(kind: str, anatomy: ViTAnatomy) -> float:
    """The cost of the model as it is (every block at its own dims) in the units of ``kind``: for
    ``flops`` it equals ``edgeprune.flops.model_flops(anatomy)["total"]``, for ``params``
    ``count_params(anatomy.model)``.

    Raises:
        UserError: unknown kind.
    """
    return total_cost(cost_model(kind, anatomy), anatomy, [dense_dims(b) for b in anatomy.blocks])
