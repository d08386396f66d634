"""Token merging that keeps every token: merge, compute, unmerge (issue 55, item 2; ToMe for Stable Diffusion,
Bolya & Hoffman, CVPRW 2023, §3 "Unmerging").

A dense head (a DPT decoder, a saliency or segmentation head, a head reading intermediate blocks) reads every patch
token, so the classifier merge of :mod:`edgeprune.tokens.model` -- fewer tokens from block to block -- does not fit
it. Here each block keeps its N tokens in the residual stream and merges only inside its two branches::

    y = norm1(x);  y', s = merge_r(y)                 bipartite soft matching on y itself (cosine), size-weighted
    x = x + ls1(unmerge(attn_prop(y', s)))            proportional attention on the N - r merged tokens
    z = norm2(x);  z', _ = merge_r(z)
    x = x + ls2(unmerge(mlp(z')))

``unmerge`` copies each merged token's output back to every position it stands for (:func:`unmerge`), so every
block output, every tap and the network's output keep all N tokens in their order. Where merged tokens are equal,
nothing changes (the merged token equals each of them, and proportional attention weighs it as its copies).

The matching (:func:`~edgeprune.tokens.merge.bipartite_soft_matching`, prefix tokens never merged), the merge
(:func:`~edgeprune.tokens.merge.merge_wavg`) and the unmerge use only TopK, Gather(Elements), Where, MatMul and
Concat -- no scatter; every shape is fixed by N and r, so the exported graph is static.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from edgeprune.tokens.attention import proportional_attention
from edgeprune.tokens.merge import MergePlan, bipartite_soft_matching, merge_wavg, split_sizes

__all__ = ["TokenUnmergeBlock", "unmerge"]

_PARTS = ("norm1", "attn", "ls1", "drop_path1", "norm2", "mlp", "ls2", "drop_path2")


def unmerge(y: torch.Tensor, plan: MergePlan, tokens: int) -> torch.Tensor:
    """The inverse of :func:`~edgeprune.tokens.merge.merge_wavg`'s layout: every position gets the output of the
    token it was merged into.

    Args:
        y: (B, N - r, D) outputs of the merged tokens, order ``[prefix, unmerged A (plan order), B]``.
        plan: the merge's plan on N = ``tokens`` tokens.
        tokens: N (a Python int: the shapes stay constant in an exported graph).

    Returns:
        (B, N, D) in the original token order (prefix, then A and B interleaved: A at even, B at odd positions).
    """
    p, nb = plan.num_prefix, plan.num_b
    na, _ = split_sizes(int(tokens), p)
    r = int(plan.src.shape[1])
    order = torch.cat([plan.src, plan.unmerged], dim=1)  # (B, |A|): A positions, merged ones first
    inv = torch.topk(order, na, dim=-1, largest=False).indices  # inv[i] = j with order[j] = i (TopK as argsort)
    if r:
        dst = plan.dst.gather(-1, inv.clamp(max=r - 1))  # B slot of a merged A token (ignored where unmerged)
        src_idx = torch.where(inv >= r, p + inv - r, p + (na - r) + dst)
    else:
        src_idx = p + inv
    a = y.gather(1, src_idx.unsqueeze(-1).expand(-1, -1, y.shape[-1]))  # (B, |A|, D)
    b = y[:, p + na - r:]  # (B, |B|, D)
    pairs = torch.stack([a[:, :nb], b], dim=2).flatten(1, 2)  # a0 b0 a1 b1 ...
    return torch.cat([y[:, :p], pairs, a[:, nb:]], dim=1)


class TokenUnmergeBlock(nn.Module):
    """A pre-norm ViT block that merges ``r`` tokens inside its attention and MLP branches and unmerges their
    outputs before each residual add (module doc).

    Args:
        block: a timm ``Block`` (its submodules are taken over under the same names: state dict keys unchanged).
        r: tokens merged away inside each branch, ``0 <= r <= (N - num_prefix) // 2``.
        num_prefix: leading tokens never merged (class / register tokens).
        tokens: N, the tokens the block receives and returns.

    Shapes:
        forward: x (B, N, D) -> (B, N, D).

    Raises:
        ValueError: ``r`` out of range.
    """

    def __init__(self, block: nn.Module, r: int, num_prefix: int, tokens: int) -> None:
        super().__init__()
        for name in _PARTS:
            part = getattr(block, name, None)
            setattr(self, name, nn.Identity() if part is None else part)
        most = split_sizes(int(tokens), int(num_prefix))[1]
        if not 0 <= int(r) <= most:
            raise ValueError(f"a block of {tokens} tokens ({num_prefix} prefix) merges 0..{most} tokens, got {r}")
        self.r, self.num_prefix, self.tokens = int(r), int(num_prefix), int(tokens)
        self.query_tokens = None  # every token is computed (anatomy reads this attribute)

    def _plan(self, y: torch.Tensor) -> MergePlan:
        return bipartite_soft_matching(y, self.r, self.num_prefix, self.tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, m = self.tokens, self.tokens - self.r
        y = self.norm1(x)
        plan = self._plan(y)
        ym, size = merge_wavg(y, None, plan)
        out, _ = proportional_attention(self.attn, ym, size, None, m)
        x = x + self.drop_path1(self.ls1(unmerge(out, plan, n)))
        z = self.norm2(x)
        plan = self._plan(z)
        zm, _ = merge_wavg(z, None, plan)
        return x + self.drop_path2(self.ls2(unmerge(self.mlp(zm), plan, n)))

    def extra_repr(self) -> str:
        return f"r={self.r}, num_prefix={self.num_prefix}, tokens={self.tokens} (merged inside, unmerged)"
