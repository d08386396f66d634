"""Analytic parameter and FLOPs counts of a (pruned) ViT.

FLOPs = 2 x multiply-accumulates of the matrix products for one image (norms, softmax, GELU and
additions are ignored; they are < 1% for these models). Per block, with n tokens, width D, H heads
(the kept heads after head pruning), Q/K head dim d_qk, V head dim d_v (d_qk != d_v after Q/K-only
or V-only pruning) and MLP hidden D_mlp:

    qkv   2 n D H (2 d_qk + d_v)
    attn  2 n^2 H d_qk  (logits)  +  2 n^2 H d_v  (weights x values)
    proj  2 n H d_v D
    mlp   2 n D D_mlp x 2

which is NuWa's suppl. eq. 13 (``(2 N d + N^2) h (d_qk + d_vo) + 2 N d d_mlp`` counts MACs with
fc1+fc2 folded into one term). Patch embedding and the head are added once.

A wrapper model with a head of its own outside the ViT (the dinov2-s14 saliency decoder) counts it
by defining ``head_flops(img_size: tuple[int, int]) -> int``; :func:`model_flops` adds it, so the
FLOPs ratio of a pruned wrapper compares whole models, not backbones.

Checked against ``torch.utils.flop_counter.FlopCounterMode`` for dense models (tests/test_anatomy.py)
and for pruned blocks with d_qk != d_v, pruned heads and the fused layout (tests/test_vo_heads.py;
the counter does not see PyTorch's fused CPU attention kernel, so those tests run SDPA's math path).
"""

from __future__ import annotations

import torch.nn as nn

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy


def count_params(model: nn.Module) -> int:
    """Number of parameters (trainable or not)."""
    return sum(p.numel() for p in model.parameters())


def block_flops(b: BlockAnatomy, n: int) -> dict[str, int]:
    """FLOPs of one block for one image of n tokens: keys qkv, attn, proj, mlp, total.

    A block that computes only its first T tokens (``b.query_tokens``, the class-token last block,
    ``edgeprune.layers.class_token_block``) projects queries, attention rows, ``proj`` and the MLP
    for T tokens and keys/values for all n: ``qkv 2 n D H (d_qk + d_v) + 2 T D H d_qk``, ``attn
    2 T n H (d_qk + d_v)``, ``proj 2 T H d_v D``, ``mlp 4 T D D_mlp`` (T = n: the formulas above).
    """
    D, H = b.qkv.in_features, b.num_heads
    m = n if getattr(b, "query_tokens", None) is None else min(int(b.query_tokens), n)
    out = {
        "qkv": 2 * n * D * H * (b.qk_dim + b.v_dim) + 2 * m * D * H * b.qk_dim,
        "attn": 2 * m * n * H * (b.qk_dim + b.v_dim),
        "proj": 2 * m * H * b.v_dim * D,
        "mlp": 2 * 2 * m * D * b.mlp_hidden,
    }
    out["total"] = sum(out.values())
    return out


def model_flops(anatomy: ViTAnatomy) -> dict[str, object]:
    """FLOPs of the whole model for one image.

    Returns:
        dict with ``total`` (int), ``blocks`` (list of :func:`block_flops` dicts),
        ``patch_embed`` and ``head`` (int): the ViT's linear head, or the wrapper's own head
        (``anatomy.model.head_flops``) when the ViT sits inside one.
    """
    n = anatomy.num_tokens
    ph, pw = anatomy.patch_size
    pe = 2 * anatomy.num_patches * anatomy.in_chans * ph * pw * anatomy.embed_dim
    head = 0
    vit_head = getattr(anatomy.vit, "head", None)
    if isinstance(vit_head, nn.Linear):
        head = 2 * vit_head.in_features * vit_head.out_features
    wrapper_head = getattr(anatomy.model, "head_flops", None)
    if anatomy.model is not anatomy.vit and callable(wrapper_head):
        head += int(wrapper_head(anatomy.img_size))
    blocks = [block_flops(b, n) for b in anatomy.blocks]
    total = pe + head + sum(b["total"] for b in blocks)
    return {"total": total, "blocks": blocks, "patch_embed": pe, "head": head}
