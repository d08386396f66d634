"""Which last block a prune produces: the full block, or the class-token block.

``CorpConfig.last_block`` (``--last-block``):

* ``"auto"`` (default) -- the class-token last block (``edgeprune.layers.class_token_block``)
  when a budget is given (``--flops`` / ``--params``) and the model is a classifier whose output
  reads only the class token(s) (timm ``VisionTransformer`` with ``global_pool="token"`` and an
  affine ``head``); the full block otherwise (plain CORP with ``--sparsity`` stays as the paper
  defines it; a headless backbone keeps every token, since its users may read the patch tokens).
* ``"cls"`` -- the class-token last block for any model whose output reads only the class
  token(s), classifier or not; an error for others.
* ``"full"`` -- never.

The allocator prices the planned block (``edgeprune.allocation.cost``): pruning its MLP or its
queries saves almost nothing there, so a budget is spent on the other blocks. The conversion is
exact (the output changes by float rounding only) and is applied after the compensation and the
output bias correction (``edgeprune.api.prune``).
"""

from __future__ import annotations

from edgeprune.anatomy import ViTAnatomy
from edgeprune.errors import UserError

LAST_BLOCK_CHOICES = ("auto", "cls", "full")


def class_token_plan(cfg, anatomy: ViTAnatomy) -> dict[int, int]:
    """``{last block index: T}`` when the prune ends with a class-token last block, else ``{}``.

    Args:
        cfg: a :class:`~edgeprune.corp.CorpConfig` (``last_block``, ``budget``).
        anatomy: the model before pruning.

    Raises:
        UserError: ``last_block="cls"`` for a model whose output reads more than the leading tokens
            (average/attention pooling, a wrapper such as the ``dinov2-s14`` saliency decoder).
    """
    from edgeprune.layers.class_token_block import output_query_tokens
    from edgeprune.solve.output_bias import classifier_head

    mode = getattr(cfg, "last_block", "full")
    last = anatomy.blocks[-1]
    if mode == "full" or last.query_tokens is not None:
        return {}
    model = anatomy.model
    t = output_query_tokens(model) if model is anatomy.vit else None
    if mode == "cls":
        if t is None:
            raise UserError("--last-block cls needs a timm ViT whose output reads only the class token "
                            "(global_pool='token', no attention pooling, no wrapper around the ViT)")
        return {last.index: t}
    if t is None or cfg.budget is None or classifier_head(model) is None:
        return {}
    return {last.index: t}
