"""Cost models for the budgeted allocation: what a block costs at given kept dims.

A cost model answers ``block_cost(block, dims)`` -- the part of the model's cost that depends on
the block's kept dims ``{"mlp", "qk", "v", "heads"}`` -- and ``fixed_cost()`` (everything else:
patch embedding, head, norms, biases of unpruned outputs). The model's total at an allocation is
``fixed_cost() + sum_i block_cost(block_i, dims_i)``. Two are built in, both exact for edgeprune's
surgery (tests/test_allocation.py checks them against the pruned model's
``edgeprune.flops.model_flops`` / ``count_params``):

* ``flops`` -- FLOPs per image (= 2 x MACs), the formula of ``edgeprune.flops.block_flops``:
  ``2 n D H (2 d_qk + d_v) + 2 n^2 H (d_qk + d_v) + 2 n H d_v D + 4 n D D_mlp``.
* ``params`` -- parameters: qkv ``(D + bias) H (2 d_qk + d_v)``, proj ``H d_v D``, fc1
  ``(D + bias) D_mlp``, fc2 ``D_mlp D``.

A measured latency table for a device can replace them later: write a class with the same two
methods (the :class:`CostModel` protocol) and :func:`register_cost_model` it under a name; the
allocator only calls these two methods (it needs no linearity: it evaluates ``block_cost`` at the
candidate dims).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Protocol

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.errors import UserError


class CostModel(Protocol):
    """What the allocator needs from a cost model (see module doc)."""

    name: str

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        """Cost of block ``b`` with kept dims ``dims`` (keys mlp, qk, v, heads; all present)."""

    def fixed_cost(self) -> float:
        """Cost that does not depend on any block's kept dims."""


def dense_dims(b: BlockAnatomy) -> dict[str, int]:
    """The block's current dims as an allocation dict."""
    return {"mlp": b.mlp_hidden, "qk": b.qk_dim, "v": b.v_dim, "heads": b.num_heads}


class FlopsCost:
    """FLOPs per image (2 x MACs) of the matrix products (``edgeprune.flops``).

    Args:
        anatomy: the model.
        query_tokens: ``{block index: T}`` for blocks that will compute only their first T tokens
            (the class-token last block, ``edgeprune.layers.class_token_block``); other blocks
            count as they are (``BlockAnatomy.query_tokens``, None = every token).
    """

    name = "flops"

    def __init__(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None) -> None:
        from edgeprune.flops import model_flops

        self.n = anatomy.num_tokens
        self.query_tokens = {b.index: b.query_tokens for b in anatomy.blocks if b.query_tokens is not None}
        self.query_tokens.update(query_tokens or {})
        dense = model_flops(anatomy)
        self._fixed = float(dense["patch_embed"]) + float(dense["head"])  # type: ignore[arg-type]

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        from edgeprune.flops import block_flops

        shape = SimpleNamespace(qkv=b.qkv, num_heads=dims["heads"], qk_dim=dims["qk"], v_dim=dims["v"],
                                mlp_hidden=dims["mlp"], query_tokens=self.query_tokens.get(b.index))
        return float(block_flops(shape, self.n)["total"])  # type: ignore[arg-type]

    def fixed_cost(self) -> float:
        return self._fixed


class ParamsCost:
    """Number of parameters."""

    name = "params"

    def __init__(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None) -> None:
        from edgeprune.flops import count_params

        self._fixed = float(count_params(anatomy.model)) - sum(self.block_cost(b, dense_dims(b))
                                                              for b in anatomy.blocks)

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        D = b.qkv.in_features
        h, qk, v, m = dims["heads"], dims["qk"], dims["v"], dims["mlp"]
        qkv = (D + (b.qkv.bias is not None)) * h * (2 * qk + v)
        proj = h * v * b.proj.out_features
        mlp = (D + (b.fc1.bias is not None)) * m + m * b.fc2.out_features
        return float(qkv + proj + mlp)

    def fixed_cost(self) -> float:
        return self._fixed


COST_MODELS: dict[str, Callable[..., CostModel]] = {"flops": FlopsCost, "params": ParamsCost}


def register_cost_model(name: str, factory: Callable[..., CostModel]) -> None:
    """Make ``factory(anatomy)`` the cost model of budgets of kind ``name`` (e.g. a latency
    table). When the pruned model will have blocks that compute only their first T tokens (the
    class-token last block) it is called as ``factory(anatomy, query_tokens)`` with
    ``query_tokens = {block index: T}`` (see :class:`FlopsCost`)."""
    COST_MODELS[name] = factory


def cost_model(kind: str, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None) -> CostModel:
    """The registered cost model for ``kind`` of the model as it will be after pruning
    (``query_tokens``: see :class:`FlopsCost`).

    Raises:
        UserError: unknown kind.
    """
    if kind not in COST_MODELS:
        raise UserError(f"unknown budget kind {kind!r} (choose from {', '.join(COST_MODELS)})")
    factory = COST_MODELS[kind]
    return factory(anatomy, query_tokens) if query_tokens else factory(anatomy)


def total_cost(model: CostModel, anatomy: ViTAnatomy, dims: list[dict[str, int]]) -> float:
    """``fixed_cost() + sum_i block_cost(block_i, dims_i)``."""
    return model.fixed_cost() + sum(model.block_cost(b, d) for b, d in zip(anatomy.blocks, dims))
