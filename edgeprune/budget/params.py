"""The ``params`` budget kind: number of parameters (:func:`edgeprune.flops.block_params`), exact for edgeprune's
surgery. Per block: qkv ``(D + bias) H (2 d_qk + d_v)``, proj ``H d_v D``, fc1 ``(D + bias) D_mlp`` (twice for a
gated MLP: gate and up), fc2 ``D_mlp D``; the biases of the unpruned outputs and everything outside the blocks' linears
are the fixed cost.
"""

from __future__ import annotations

from typing import Any

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.budget.base import CostModel
from edgeprune.budget.registry import dense_dims, register_cost_model
from edgeprune.flops import block_params, count_params, with_dims


@register_cost_model("params")
class ParamsCost(CostModel):
    """Number of parameters (module doc)."""

    def __init__(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None, *,
                 budget: Any = None) -> None:
        super().__init__(anatomy, query_tokens)
        self._fixed = float(count_params(anatomy.model)) - sum(self.block_cost(b, dense_dims(b))
                                                              for b in anatomy.blocks)

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        p = block_params(with_dims(b, dims))
        return float(p["total"] - p["out_bias"])

    def fixed_cost(self) -> float:
        return self._fixed
