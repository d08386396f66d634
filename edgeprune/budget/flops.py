"""The ``flops`` budget kind: FLOPs per image (= 2 x MACs) of the matrix products, exact for edgeprune's surgery
(tests/test_allocation.py checks it against ``edgeprune.flops.model_flops`` of the pruned model). Per block
(:func:`edgeprune.flops.block_flops`):
``2 n D H (2 d_qk + d_v) + 2 n^2 H (d_qk + d_v) + 2 n H d_v D + 4 n D D_mlp`` (``6 n D D_mlp`` for a gated MLP).
"""

from __future__ import annotations

from typing import Any

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.budget.base import CostModel
from edgeprune.budget.registry import register_cost_model
from edgeprune.flops import block_flops, model_flops, with_dims


@register_cost_model("flops")
class FlopsCost(CostModel):
    """FLOPs per image (2 x MACs) of the matrix products (:func:`edgeprune.flops.block_flops`); blocks listed in
    ``query_tokens`` count their first T query tokens only (:class:`~edgeprune.budget.base.CostModel`)."""

    def __init__(self, anatomy: ViTAnatomy, query_tokens: dict[int, int] | None = None, *,
                 budget: Any = None) -> None:
        super().__init__(anatomy, query_tokens)
        self.n = anatomy.num_tokens
        dense = model_flops(anatomy)
        self._fixed = float(dense["patch_embed"]) + float(dense["head"])  # type: ignore[arg-type]

    def block_cost(self, b: BlockAnatomy, dims: dict[str, int]) -> float:
        """FLOPs of block ``b`` at kept ``dims``, remembered per block, its layers' widths and the dims
        (:meth:`~edgeprune.budget.base.CostModel.remembered`)."""
        return self.remembered(b, dims, lambda: float(
            block_flops(with_dims(b, dims, self.query_tokens.get(b.index)), self.n)["total"]),
            b.qkv.in_features, b.fc2.out_features)

    def fixed_cost(self) -> float:
        return self._fixed
