"""The last transformer block computed for the class token(s) only.

A classifier ViT with ``global_pool="token"`` reads nothing of its last block's output but the
class token (distilled DeiT: the class and distillation tokens). Every other token of that block
is computed and thrown away: its queries, its attention rows, its projection and its MLP. With
n tokens, T kept query tokens, width D, H heads, head dims d_qk / d_v and MLP hidden D_mlp the
block costs (FLOPs = 2 x MACs; ``edgeprune.flops``)::

    qkv   2 n D H (d_qk + d_v)  +  2 T D H d_qk      (keys and values of every token, T queries)
    attn  2 T n H (d_qk + d_v)
    proj  2 T H d_v D
    mlp   4 T D D_mlp

instead of the full block's ``T = n`` (DINOv2 ViT-S/14 at 224 px, n = 257, T = 1: 0.155 of the
1.011 GFLOPs of a block, 7.0% of the whole model). The output of the model is unchanged up to
floating-point rounding: the class token's attention row, residual, norm and MLP are the same
operations on the same inputs (docs/methods.md "Class-token last block"; our addition, none of the
three papers does it). Tokens that only the last block discards are not "pruned" in the sense of
a ranking: no information the output uses is removed.

:class:`ClassTokenBlock` holds the timm ``Block``'s own submodules under the same names, so the
state dict keys are those of the timm model (``blocks.11.attn.qkv.weight`` ...).

Whether a prune ends with this block (:func:`class_token_plan`, ``CorpConfig.last_block``,
``--last-block``):

* ``"auto"`` (default) -- the class-token last block when a budget is given (``--flops`` / ``--params``) and the
  model is a classifier whose output
  reads only the class token(s) (timm ``VisionTransformer`` with ``global_pool="token"`` and an
  affine ``head``); the full block otherwise (plain CORP with ``--sparsity`` stays as the paper
  defines it; a headless backbone keeps every token, since its users may read the patch tokens).
* ``"cls"`` -- the class-token last block for any model whose output reads only the class
  token(s), classifier or not; an error for others.
* ``"full"`` -- never.

The allocator prices the planned block (``edgeprune.budget``): pruning its MLP or its
queries saves almost nothing there, so a budget is spent on the other blocks. The conversion is
exact (the output changes by float rounding only) and is applied after the compensation and the
output bias correction (``edgeprune.api.prune``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from edgeprune.settings import SettingError
from edgeprune.solve.output_bias import classifier_head

__all__ = ["ClassTokenBlock", "output_query_tokens", "to_class_token_block", "to_full_block", "class_token_plan",
           "LAST_BLOCK_CHOICES"]

_PARTS = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")


def _head_dims(attn: nn.Module) -> tuple[int, int, int]:
    """(H, d_qk, d_v) of a timm ``Attention`` or edgeprune ``PrunedAttention``."""
    H = int(attn.num_heads)
    dq = int(getattr(attn, "qk_dim", attn.head_dim))
    dv = int(getattr(attn, "v_dim", attn.head_dim))
    return H, dq, dv


def query_attention(attn: nn.Module, x: torch.Tensor, query_tokens: int) -> torch.Tensor:
    """Multi-head attention of the first ``query_tokens`` tokens over all tokens.

    Same weights and scale as ``attn`` (timm ``Attention`` or ``PrunedAttention``: fused ``qkv``
    rows ``[q; k; v]``, head-major); queries are projected for the first T tokens only, keys and
    values for every token.

    Args:
        attn: the block's attention module.
        x: (B, n, D) normed tokens.
        query_tokens: T, 1 <= T <= n.

    Returns:
        (B, T, D): rows 0..T-1 of ``attn(x)``.
    """
    B, n, _ = x.shape
    T = int(query_tokens)
    H, dq, dv = _head_dims(attn)
    w, b = attn.qkv.weight, attn.qkv.bias
    q = F.linear(x[:, :T], w[:H * dq], None if b is None else b[:H * dq])
    kv = F.linear(x, w[H * dq:], None if b is None else b[H * dq:])
    k, v = kv.split([H * dq, H * dv], dim=-1)
    q = q.reshape(B, T, H, dq).transpose(1, 2)
    k = k.reshape(B, n, H, dq).transpose(1, 2)
    v = v.reshape(B, n, H, dv).transpose(1, 2)
    rotate = getattr(attn, "rotate", None)
    if rotate is not None:  # RotaryAttention: the first T tokens' tables for q, all for k
        q, k = rotate(q), rotate(k)
    drop = getattr(attn, "attn_drop", None)
    p = float(drop.p) if isinstance(drop, nn.Dropout) and attn.training else 0.0
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=float(attn.scale))
    out = attn.proj(out.transpose(1, 2).reshape(B, T, H * dv))
    proj_drop = getattr(attn, "proj_drop", None)
    return proj_drop(out) if proj_drop is not None else out


class ClassTokenBlock(nn.Module):
    """A pre-norm ViT block that outputs only its first ``query_tokens`` tokens.

    ``y = x[:, :T] + ls1(attn_T(norm1(x)));  y = y + ls2(mlp(norm2(y)))`` where ``attn_T`` is
    :func:`query_attention` (queries of the first T tokens over all n keys/values).

    Args:
        block: a timm ``Block`` (its submodules are taken over, not copied).
        query_tokens: T >= 1.

    Shapes:
        forward: x (B, n, D) -> (B, T, D).
    """

    def __init__(self, block: nn.Module, query_tokens: int) -> None:
        super().__init__()
        if int(query_tokens) < 1:
            raise ValueError(f"query_tokens must be >= 1, got {query_tokens}")
        for name in _PARTS:
            part = getattr(block, name, None)
            setattr(self, name, nn.Identity() if part is None else part)
        self.query_tokens = int(query_tokens)

    def forward(self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if attn_mask is not None:
            raise ValueError("ClassTokenBlock does not take an attention mask")
        T = self.query_tokens
        y = x[:, :T] + self.drop_path1(self.ls1(query_attention(self.attn, self.norm1(x), T)))
        return y + self.drop_path2(self.ls2(self.mlp(self.norm2(y))))

    def extra_repr(self) -> str:
        return f"query_tokens={self.query_tokens}"


def output_query_tokens(model: nn.Module) -> int | None:
    """How many leading tokens of the last block's output ``model(x)`` reads, or None for "all".

    1 for a timm ``VisionTransformer`` with ``global_pool="token"`` (the class token) and no
    attention pooling, 2 for a distilled DeiT (class and distillation token) with token pooling;
    None for average / max pooling, attention pooling, or a wrapper around the ViT (whose head may
    read the patch tokens, e.g. the ``dinov2-s14`` saliency decoder).
    """
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.vision_transformer import VisionTransformer

    if type(model) not in (VisionTransformer, VisionTransformerDistilled):
        return None
    if getattr(model, "attn_pool", None) is not None or getattr(model, "global_pool", None) != "token":
        return None
    return 2 if type(model) is VisionTransformerDistilled else 1


def to_class_token_block(model: nn.Module, query_tokens: int) -> int:
    """Replace the last block of ``model`` (a timm ViT) by a :class:`ClassTokenBlock`, in place.

    Returns:
        the block's index.

    Raises:
        ValueError: the model has no ``blocks`` or its last block is already converted.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        raise ValueError("the model has no blocks")
    i = len(blocks) - 1
    if isinstance(blocks[i], ClassTokenBlock):
        raise ValueError(f"block {i} already computes only {blocks[i].query_tokens} token(s)")
    blocks[i] = ClassTokenBlock(blocks[i], query_tokens)
    return i


def to_full_block(model: nn.Module) -> int | None:
    """Undo :func:`to_class_token_block` in place (a timm ``Block`` with the same submodules).

    Returns:
        the T the block had, or None when no block was converted.
    """
    from timm.models.vision_transformer import Block

    blocks = getattr(model, "blocks", None)
    if not blocks or not isinstance(blocks[-1], ClassTokenBlock):
        return None
    ctb = blocks[-1]
    full = Block.__new__(Block)
    nn.Module.__init__(full)
    for name in _PARTS:
        setattr(full, name, getattr(ctb, name))
    blocks[len(blocks) - 1] = full
    return ctb.query_tokens


#: ``CorpConfig.last_block`` choices (module doc)
LAST_BLOCK_CHOICES = ("auto", "cls", "full")


def class_token_plan(cfg, anatomy) -> dict[int, int]:
    """``{last block index: T}`` when the prune ends with a class-token last block, else ``{}``.

    Args:
        cfg: a :class:`~edgeprune.corp.CorpConfig` (``last_block``, ``budget``).
        anatomy: the model's :class:`~edgeprune.anatomy.ViTAnatomy`, before pruning.

    Raises:
        UserError: ``last_block="cls"`` for a model whose output reads more than the leading tokens
            (average/attention pooling, a wrapper such as the ``dinov2-s14`` saliency decoder).
    """
    mode = cfg.last_block
    last = anatomy.blocks[-1]
    if mode == "full" or last.query_tokens is not None:
        return {}
    model = anatomy.model
    t = output_query_tokens(model) if model is anatomy.vit else None
    if mode == "cls":
        if t is None:
            raise SettingError("{last_block} cls needs a timm ViT whose output reads only the class token "
                               "(global_pool='token', no attention pooling, no wrapper around the ViT)")
        return {last.index: t}
    if t is None or cfg.budget is None or classifier_head(model) is None:
        return {}
    return {last.index: t}
