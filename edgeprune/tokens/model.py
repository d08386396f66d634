"""The merged ViT: timm's blocks with a ToMe merge step, and the block sequence that carries the token sizes.

:class:`TokenMergeBlock` is a pre-norm ViT block with ToMe's merge between attention and MLP (Bolya et al., ICLR
2023, §3 "Strategy", Fig. 1)::

    x = x + ls1(attn_prop(norm1(x), size))           attn_prop: proportional attention (log size on the logits)
    x, size = merge_r(x, size; keys of attn_prop)    bipartite soft matching, size-weighted mean (r tokens fewer)
    x = x + ls2(mlp(norm2(x)))

It takes over the timm ``Block``'s (or the class-token last block's) submodules under the same names, so the state
dict keys stay those of the timm model (``blocks.3.attn.qkv.weight`` ...). A class-token last block keeps its
``query_tokens`` (only the first T tokens computed) with proportional attention and no merge.

:class:`MergedBlocks` replaces ``vit.blocks`` (an ``nn.Sequential`` subclass with the same indices): it runs the
blocks in order, hands each merge block the sizes the earlier merges made, and for a size-weighted average pool
(``global_pool="avg"``) scales each pooled token by ``size / mean(size)`` after the last block, so that timm's
plain mean over the tokens becomes ToMe's size-weighted mean ``sum(size x) / sum(size)`` (the final norm before
the pool is the identity for an average-pooled timm ViT; :func:`edgeprune.tokens.apply.check_mergeable`).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn as nn

from edgeprune.tokens.attention import proportional_attention
from edgeprune.tokens.merge import bipartite_soft_matching, merge_wavg

_PARTS = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")


class TokenMergeBlock(nn.Module):
    """A pre-norm ViT block with proportional attention and a merge of ``r`` tokens before its MLP.

    Args:
        block: a timm ``Block`` or a ``ClassTokenBlock`` (its submodules are taken over, not copied).
        r: tokens merged away in this block (0: proportional attention only); ``r = 0`` for a class-token block.
        num_prefix: leading tokens never merged (class / distillation / register tokens).
        tokens: N, the tokens the block receives (fixed by the image size; the merge's shapes are built from it, so
            an exported graph has constant token counts).

    Shapes:
        forward: x (B, N, D), size (B, N, 1) or None -> (B, N - r, D) (B, T, D for a class-token block with
        ``query_tokens`` T), size (B, N - r, 1) or (B, T, 1).
    """

    def __init__(self, block: nn.Module, r: int, num_prefix: int, tokens: int) -> None:
        super().__init__()
        for name in _PARTS:
            part = getattr(block, name, None)
            setattr(self, name, nn.Identity() if part is None else part)
        self.query_tokens: Optional[int] = getattr(block, "query_tokens", None)
        if int(r) < 0 or (self.query_tokens is not None and int(r) != 0):
            raise ValueError(f"a merge block merges r >= 0 tokens (0 in a class-token block), got {r}")
        self.r, self.num_prefix, self.tokens = int(r), int(num_prefix), int(tokens)

    def forward(self, x: torch.Tensor, size: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = self.query_tokens
        out, metric = proportional_attention(self.attn, self.norm1(x), size, T, self.tokens)
        x = (x if T is None else x[:, :T]) + self.drop_path1(self.ls1(out))
        if T is not None:
            size = None if size is None else size[:, :T]
        elif self.r:
            x, size = merge_wavg(x, size, bipartite_soft_matching(metric, self.r, self.num_prefix, self.tokens))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x)))), size

    def extra_repr(self) -> str:
        return f"r={self.r}, num_prefix={self.num_prefix}, tokens={self.tokens}" + (
            "" if self.query_tokens is None else f", query_tokens={self.query_tokens}")


class MergedBlocks(nn.Sequential):
    """``vit.blocks`` of a merged model: the blocks in order, the token sizes carried from merge to merge.

    Args:
        blocks: the blocks (timm ``Block`` / ``ClassTokenBlock`` before the first merge, :class:`TokenMergeBlock`
            from it on).
        pool_from: for a size-weighted average pool, the first token the pool reads (``num_prefix_tokens``, or 0
            when the pool includes the prefix); None for a pool that reads the class token(s) only.

    Shapes:
        forward: x (B, N, D) -> (B, N', D), N' the tokens after every merge.
    """

    def __init__(self, blocks: Iterable[nn.Module], pool_from: int | None = None) -> None:
        super().__init__(*blocks)
        self.pool_from = pool_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = None
        for blk in self:
            if isinstance(blk, TokenMergeBlock):
                x, size = blk(x, size)
            else:
                x = blk(x)
        if self.pool_from is not None and size is not None:
            s = size[:, self.pool_from:]
            scale = s / s.mean(dim=1, keepdim=True)  # mean(scale x) = sum(s x) / sum(s)
            x = torch.cat([x[:, :self.pool_from], x[:, self.pool_from:] * scale], dim=1)
        return x

    def merges(self) -> list[int]:
        """Tokens merged away per block (0 for the blocks without a merge)."""
        return [blk.r if isinstance(blk, TokenMergeBlock) else 0 for blk in self]

    def extra_repr(self) -> str:
        return f"merges={self.merges()}, pool_from={self.pool_from}"
