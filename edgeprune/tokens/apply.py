"""Turning a timm ViT into its merged form in place (:func:`apply_token_merge`) and the models it refuses
(:func:`check_mergeable`).

In a classifier ViT merging changes the number of tokens after each merging block, so it fits a model whose output
reads only what a merge keeps well defined: the class token(s) (``global_pool="token"``; the prefix tokens are never
merged) or the average of the tokens (``global_pool="avg"``, made size-weighted by
:class:`~edgeprune.tokens.model.MergedBlocks`). In a network with a ViT inside (a dense head reading patch tokens or
intermediate blocks) each block merges inside its branches and unmerges (:mod:`edgeprune.tokens.unmerge`), so every
tap keeps all its tokens.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from edgeprune.backbone import backbone_of, is_vit, keep_hooks
from edgeprune.errors import UserError
from edgeprune.layers.rotary_attention import is_rotary
from edgeprune.tokens.model import MergedBlocks, TokenMergeBlock
from edgeprune.tokens.schedule import OPTION, plan_merges
from edgeprune.tokens.unmerge import TokenUnmergeBlock


def check_mergeable(model: nn.Module) -> tuple[nn.Module, int | None]:
    """The ViT to merge in ``model`` and its pool's first token (``MergedBlocks.pool_from``: None for a class-token
    pool, or for a network with a ViT inside, which merges and unmerges: :func:`unmerges`).

    Raises:
        UserError: one line saying where the model does not fit: merged already, rotary attention, an attention
            pool, a pool other than 'token' / 'avg', ``global_pool='token'`` without a
            class token, or a final norm before an average pool.
    """
    name = type(model).__name__
    if not is_vit(model):  # a network with a ViT inside: its head may read any token; merge inside, unmerge
        vit = backbone_of(model)
        if any(isinstance(b, TokenUnmergeBlock) for b in vit.blocks):
            raise UserError(f"{OPTION}: the network is merged already (r per block "
                            f"{[getattr(b, 'r', 0) for b in vit.blocks]})")
        _refuse_rotary(vit, name)
        return vit, None
    if isinstance(model.blocks, MergedBlocks):
        raise UserError(f"{OPTION}: the model is merged already (r per block {model.blocks.merges()})")
    _refuse_rotary(model, name)
    if getattr(model, "attn_pool", None) is not None:
        raise UserError(f"{OPTION}: {name} pools with attention (global_pool='map'); merging needs a class-token "
                        "or an average pool")
    pool = getattr(model, "global_pool", None)
    prefix = int(getattr(model, "num_prefix_tokens", 0))
    if pool == "token":
        if prefix < 1 or getattr(model, "cls_token", None) is None:
            raise UserError(f"{OPTION}: {name} pools token 0 (global_pool='token') but has no class token, so "
                            "token 0 is a patch token a merge would change")
        return model, None
    if pool == "avg":
        if not isinstance(getattr(model, "norm", nn.Identity()), nn.Identity):
            raise UserError(f"{OPTION}: {name} normalizes each token before its average pool (fc_norm=False); the "
                            "size-weighted average needs the norm after the pool (timm's default for 'avg')")
        return model, 0 if getattr(model, "pool_include_prefix", False) else prefix
    raise UserError(f"{OPTION}: {name} pools with global_pool={pool!r}; merging supports 'token' (class token) "
                    "and 'avg' (size-weighted average)")


def _refuse_rotary(vit: nn.Module, name: str) -> None:
    if any(is_rotary(getattr(b, "attn", None)) for b in vit.blocks):
        raise UserError(f"{OPTION}: {name} rotates its queries and keys by each patch's position (RoPE); a merged "
                        "token stands for several positions, so its rotation is undefined: merging is not supported "
                        "for rotary models (prune their widths instead)")


def unmerges(model: nn.Module) -> bool:
    """Whether a merge of ``model`` keeps every token (a network with a ViT inside: merge inside each block's
    branches and unmerge, :mod:`edgeprune.tokens.unmerge`) rather than dropping tokens from block to block (a
    classifier ViT, :mod:`edgeprune.tokens.model`)."""
    return not is_vit(model)


def num_tokens(vit: nn.Module) -> int:
    """Tokens entering the first block: prefix + patches (fixed image size)."""
    return int(getattr(vit, "num_prefix_tokens", 0)) + int(vit.patch_embed.num_patches)


def merge_plan(model: nn.Module, value: Any, class_token_last: bool | None = None) -> tuple[list[int], list[int]]:
    """``(r per block, tokens per block)`` of schedule ``value`` on ``model`` (checked: :func:`check_mergeable`,
    :func:`edgeprune.tokens.schedule.plan_merges`). ``class_token_last``: whether the last block computes only the
    class token (None: whether it does now).

    Raises:
        UserError: a model that does not fit or a schedule it cannot take.
    """
    vit, _ = check_mergeable(model)
    blocks = vit.blocks
    if class_token_last is None:
        class_token_last = getattr(blocks[-1], "query_tokens", None) is not None
    return plan_merges(value, len(blocks), num_tokens(vit), int(getattr(vit, "num_prefix_tokens", 0)),
                       class_token_last and not unmerges(model), unmerges(model))


def apply_token_merge(model: nn.Module, r: list[int]) -> list[int]:
    """Merge ``r[i]`` tokens in block i of ``model`` (a timm ViT), in place: ``vit.blocks`` becomes a
    :class:`MergedBlocks` whose blocks from the first merge on are :class:`TokenMergeBlock` (the state dict keys
    do not change). For a network with a ViT inside (:func:`unmerges`) each block with ``r[i] > 0`` becomes a
    :class:`~edgeprune.tokens.unmerge.TokenUnmergeBlock` (the same keys, its forward hooks kept): every block keeps
    all its tokens. All zeros leaves the model untouched (its outputs exactly as before).

    Returns:
        the tokens each block receives.

    Raises:
        UserError: a model that does not fit, an already merged one, a bad ``r`` (as :func:`merge_plan`).
    """
    vit, pool_from = check_mergeable(model)
    blocks = list(vit.blocks)
    prefix = int(getattr(vit, "num_prefix_tokens", 0))
    if unmerges(model):
        r_checked, tokens = plan_merges(list(r), len(blocks), num_tokens(vit), prefix, False, True)
        for i, ri in enumerate(r_checked):
            if ri:
                vit.blocks[i] = keep_hooks(blocks[i], TokenUnmergeBlock(blocks[i], ri, prefix, tokens[i]))
        return tokens
    ctb = getattr(blocks[-1], "query_tokens", None) is not None
    if ctb and r and r[-1]:
        raise UserError(f"{OPTION}: the last block computes only the class token and merges nothing; r = {r[-1]}")
    r_checked, tokens = plan_merges(list(r), len(blocks), num_tokens(vit), prefix, ctb)
    if not any(r_checked):
        return tokens
    first = next(i for i, ri in enumerate(r_checked) if ri)
    vit.blocks = MergedBlocks([blk if i < first else TokenMergeBlock(blk, r_checked[i], prefix, tokens[i])
                               for i, blk in enumerate(blocks)], pool_from)
    return tokens
