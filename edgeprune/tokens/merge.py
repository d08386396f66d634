"""Bipartite soft matching and the size-weighted merge of ToMe (Bolya et al., "Token Merging: Your ViT but
Faster", ICLR 2023, §3 "Bipartite Soft Matching" and "Tracking Token Size").

One merge step, between a block's attention and its MLP, takes N tokens to N - r:

1. the prefix tokens (class, distillation, register tokens: the first ``num_prefix``) are set aside, never merged
   and never merged into, and stay first in order;
2. the other tokens are split alternately into sets A (even positions) and B (odd positions);
3. each A token's most similar B token is found, by the cosine similarity of a *metric* (ToMe: the block's
   attention keys averaged over heads, §3 "Token Similarity");
4. the r A tokens with the most similar matches are merged into their B match by a size-weighted mean
   (``x_b <- (s_b x_b + sum s_a x_a) / (s_b + sum s_a)``, sizes ``s_b <- s_b + sum s_a``); the other A tokens stay.

The output is ``[prefix, unmerged A (most similar first), B]``. The order of the non-prefix tokens does not matter
to a ViT (its attention and MLP are permutation-equivariant and the positions were added at the input).

Written with the ops ONNX Runtime and TensorRT 10 both run (docs/tokens.md): a strided Slice for the split,
MatMul for the similarities, ReduceMax/ArgMax for the best match, TopK for the argsort, GatherElements to pick
tokens, and the merge itself as a MatMul with a one-hot assignment matrix (Equal of a Range against the
destination indices, Cast) -- no ScatterElements with a reduction, no ScatterND, no NonZero; every shape is fixed
by N and r.
"""

from __future__ import annotations

import dataclasses

import torch

from edgeprune.tokens.replay import active_replay


@dataclasses.dataclass
class MergePlan:
    """Which tokens one merge step merges (:func:`bipartite_soft_matching`), B the batch:

    Attributes:
        unmerged: (B, |A| - r) int64 positions in A of the A tokens that stay.
        src: (B, r) int64 positions in A of the merged A tokens.
        dst: (B, r) int64 positions in B of the token each merged A token goes into.
        num_prefix: tokens set aside before the split.
        num_b: |B|, the size of set B (a Python int: the merge's shapes stay constants in an exported graph).
    """

    unmerged: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    num_prefix: int
    num_b: int


def split_sizes(n: int, num_prefix: int) -> tuple[int, int]:
    """(|A|, |B|) for ``n`` tokens of which the first ``num_prefix`` are set aside: ``ceil`` and ``floor`` of
    ``(n - num_prefix) / 2``. At most ``|B| = (n - num_prefix) // 2`` tokens can merge in one step."""
    rest = n - num_prefix
    return (rest + 1) // 2, rest // 2


def bipartite_soft_matching(metric: torch.Tensor, r: int, num_prefix: int, num_tokens: int | None = None) -> MergePlan:
    """ToMe's bipartite soft matching (§3, "Bipartite Soft Matching"; the prefix tokens set aside).

    Args:
        metric: (B, N, C) the tokens' similarity features (the attention keys averaged over heads).
        r: tokens to merge, ``0 <= r <= (N - num_prefix) // 2``.
        num_prefix: leading tokens never merged (class / distillation / register tokens).
        num_tokens: N as a Python int (a merge block knows it: the TopK's k and the one-hot matrix's size are then
            constants when the model is traced for ONNX export); None: ``metric.shape[1]``.

    Returns:
        the :class:`MergePlan`; ties between equal similarities are broken by TopK's order.

    Raises:
        ValueError: ``r`` out of range (the callers check it first, with a user's message).
    """
    n = int(metric.shape[1]) if num_tokens is None else int(num_tokens)
    na, nb = split_sizes(n, num_prefix)
    if not 0 <= r <= nb:
        raise ValueError(f"cannot merge {r} of {n} tokens ({num_prefix} prefix): at most {nb}")
    m = metric[:, num_prefix:]
    m = m / m.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    a, b = m[:, 0::2], m[:, 1::2]
    scores = a @ b.transpose(-1, -2)  # (B, |A|, |B|) cosine similarities
    best, best_idx = scores.max(dim=-1)  # (B, |A|): each A token's most similar B token
    order = torch.topk(best, na, dim=-1).indices  # argsort, most similar first (TopK: TensorRT's sort)
    replay = active_replay()
    if replay is not None:  # another runtime's choices (verify of a merged export: edgeprune.tokens.replay)
        best_idx, order = replay.take(scores, best, best_idx, order, r)
    src = order[:, :r]
    return MergePlan(unmerged=order[:, r:], src=src, dst=best_idx.gather(-1, src), num_prefix=num_prefix, num_b=nb)


def _pick(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` (B, k) of x (B, M, C) -> (B, k, C) (GatherElements)."""
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def merge_wavg(x: torch.Tensor, size: torch.Tensor | None, plan: MergePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``plan``: the size-weighted mean of each merged A token into its B token (ToMe §3, "Tracking Token
    Size"), as a MatMul with a one-hot assignment matrix.

    ``sum_t size_t x_t`` over the tokens and ``sum_t size_t`` are unchanged by the merge (up to rounding).

    Args:
        x: (B, N, D) tokens.
        size: (B, N, 1) how many input patches each token stands for, or None (every token 1).
        plan: from :func:`bipartite_soft_matching` on the same N.

    Returns:
        ``(x', size')``: (B, N - r, D) and (B, N - r, 1), order ``[prefix, unmerged A, B]``.
    """
    p = plan.num_prefix
    if size is None:
        size = torch.ones_like(x[..., :1])
    xa, xb = x[:, p:][:, 0::2], x[:, p:][:, 1::2]
    sa, sb = size[:, p:][:, 0::2], size[:, p:][:, 1::2]
    src = _pick(torch.cat([xa * sa, sa], dim=-1), plan.src)  # (B, r, D + 1): weighted tokens and sizes
    slots = torch.arange(plan.num_b, device=x.device).view(1, plan.num_b, 1)
    onehot = (slots == plan.dst.unsqueeze(1)).to(x.dtype)  # (B, |B|, r): 1 where source j goes into slot b
    into = onehot @ src  # (B, |B|, D + 1)
    sb_new = sb + into[..., -1:]
    xb_new = (xb * sb + into[..., :-1]) / sb_new
    out_x = torch.cat([x[:, :p], _pick(xa, plan.unmerged), xb_new], dim=1)
    out_s = torch.cat([size[:, :p], _pick(sa, plan.unmerged), sb_new], dim=1)
    return out_x, out_s
