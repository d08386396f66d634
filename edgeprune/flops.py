"""Analytic parameter and FLOPs counts of a (pruned) ViT.

FLOPs = 2 x multiply-accumulates of the matrix products for one image (norms, softmax, GELU and
additions are ignored; they are < 1% for these models). Per block, with n tokens, width D, H heads
(the kept heads after head pruning), Q/K head dim d_qk, V head dim d_v (d_qk != d_v after Q/K-only
or V-only pruning) and MLP hidden D_mlp:

    qkv   2 n D H (2 d_qk + d_v)
    attn  2 n^2 H d_qk  (logits)  +  2 n^2 H d_v  (weights x values)
    proj  2 n H d_v D
    mlp   2 n D D_mlp x 2       (a gated MLP, METHODS.md §6: x 3 -- gate, up and fc2 are three matmuls)

A rotary block (RoPE, METHODS.md §6) adds only elementwise work (3 operations per query and key element),
ignored like the norms; its latency is measured, with the rotation, by the latency tables' chains.

which is NuWa's suppl. eq. 13 (``(2 N d + N^2) h (d_qk + d_vo) + 2 N d d_mlp`` counts MACs with
fc1+fc2 folded into one term). Patch embedding and the head are added once.

Parameters of a block (:func:`block_params`): qkv ``(D + b) H (2 d_qk + d_v)``, proj ``H d_v D + b``,
fc1 ``(D + b) D_mlp`` (a gated MLP: twice, gate ``fc1_g`` and up ``fc1_x``), fc2 ``D_mlp D + b``
(``b`` = 1 where the layer has a bias). These two
functions are the one place the formulas live: the budget cost models
(``edgeprune.budget``, shared by prune and derive) evaluate them at candidate dims through
:func:`with_dims`.

Token merging (ToMe, ``edgeprune.tokens``): block i receives n_i = n - r_0 - ... - r_{i-1} tokens and merges
r_i of them between its attention and its MLP, so its qkv, attention and proj use n_i tokens and its MLP n_i - r_i
(:func:`block_tokens`). The merge itself adds ``2 |A| |B| d_qk`` (the cosine similarities of the keys averaged over
heads; |A|, |B| the two halves of the n_i - prefix tokens) and ``2 |B| r (D + 1)`` (the one-hot assignment MatMul of
the weighted tokens and their sizes) -- the matrix products of the exported graph (``merge`` below).
A block that merges inside its branches and unmerges (``edgeprune.tokens.unmerge``, networks with a dense head)
keeps n tokens: its qkv, attention, proj and MLP run on n - r tokens, and its two merges (one per branch, the
similarity on the D-dim normed tokens) cost ``2 (2 |A| |B| D + 2 |B| r (D + 1))``; the unmerge is a gather.

A wrapper model with a head of its own outside the ViT (the dinov2-s14 saliency decoder) counts it
by defining ``head_flops(img_size: tuple[int, int]) -> int``; any other network with a ViT inside has its head
counted by PyTorch's FLOP counter (:func:`network_head_flops`); :func:`model_flops` adds it, so the
FLOPs ratio of a pruned wrapper compares whole models, not backbones.

Checked against ``torch.utils.flop_counter.FlopCounterMode`` for dense models (tests/test_anatomy.py)
and for pruned blocks with d_qk != d_v, pruned heads and the fused layout (tests/test_vo_heads.py;
the counter does not see PyTorch's fused CPU attention kernel, so those tests run SDPA's math path).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from types import SimpleNamespace

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.backbone import backbone_path
from edgeprune.tokens.merge import split_sizes


def count_params(model: nn.Module) -> int:
    """Number of parameters (trainable or not)."""
    return sum(p.numel() for p in model.parameters())


def block_flops(b: BlockAnatomy, n: int, prefix: int = 0) -> dict[str, int]:
    """FLOPs of one block for one image of n tokens: keys qkv, attn, proj, mlp, total, and merge for a block that
    merges ``b.merge_r`` tokens (``prefix``: the tokens a merge sets aside; module doc).

    A block that computes only its first T tokens (``b.query_tokens``, the class-token last block,
    ``edgeprune.layers.class_token_block``) projects queries, attention rows, ``proj`` and the MLP
    for T tokens and keys/values for all n: ``qkv 2 n D H (d_qk + d_v) + 2 T D H d_qk``, ``attn
    2 T n H (d_qk + d_v)``, ``proj 2 T H d_v D``, ``mlp 4 T D D_mlp`` (T = n: the formulas above;
    ``6 T D D_mlp`` for a gated MLP, ``b.fc1_gate`` set).
    """
    D, H = b.qkv.in_features, b.num_heads
    mats = 3 if getattr(b, "fc1_gate", None) is not None else 2  # the MLP's matmuls: (gate,) up, fc2
    m = n if getattr(b, "query_tokens", None) is None else min(int(b.query_tokens), n)
    out = {
        "qkv": 2 * n * D * H * (b.qk_dim + b.v_dim) + 2 * m * D * H * b.qk_dim,
        "attn": 2 * m * n * H * (b.qk_dim + b.v_dim),
        "proj": 2 * m * H * b.v_dim * D,
        "mlp": 2 * mats * m * D * b.mlp_hidden,
    }
    r = int(getattr(b, "merge_r", 0))
    if r and getattr(b, "unmerge", False):  # merged inside both branches, unmerged: every product at n - r tokens
        out = block_flops(dataclasses.replace(b, merge_r=0, unmerge=False), n - r, prefix)
        out.pop("total")
        na, nb = split_sizes(n, prefix)
        out["merge"] = 2 * (2 * na * nb * b.qkv.in_features + 2 * nb * r * (b.qkv.in_features + 1))
    elif r:
        na, nb = split_sizes(n, prefix)
        out["mlp"] = 2 * mats * (m - r) * D * b.mlp_hidden
        out["merge"] = 2 * na * nb * b.qk_dim + 2 * nb * r * (D + 1)
    out["total"] = sum(out.values())
    return out


def block_tokens(anatomy: ViTAnatomy) -> list[int]:
    """The tokens each block receives: n, less the tokens the earlier blocks merged away (a block that unmerges
    returns all it received)."""
    out, n = [], anatomy.num_tokens
    for b in anatomy.blocks:
        out.append(n)
        n -= 0 if b.unmerge else b.merge_r
    return out


def _mlp_inputs(b: BlockAnatomy) -> list[nn.Linear]:
    """The Linears with one output row per hidden channel: fc1, and a gated MLP's gate."""
    gate = getattr(b, "fc1_gate", None)
    return [b.fc1] if gate is None else [gate, b.fc1]


def block_params(b: BlockAnatomy) -> dict[str, int]:
    """Parameters of one block's linear layers: keys qkv, proj, mlp (fc1 + fc2; a gated MLP's fc1_g too),
    out_bias, total.

    ``qkv``, ``proj`` and ``mlp`` count weights and the biases of the pruned outputs (qkv, fc1, fc1_g);
    ``out_bias`` counts the biases of the unpruned outputs (proj, fc2: D each where present),
    which no kept dim changes; ``total`` is the sum of all four (norm parameters and the layer
    scale are not counted: they sit outside the block's pruned linears).
    """
    D, H = b.qkv.in_features, b.num_heads
    qkv_out = H * (2 * b.qk_dim + b.v_dim)
    out = {
        "qkv": (D + (b.qkv.bias is not None)) * qkv_out,
        "proj": H * b.v_dim * b.proj.out_features,
        "mlp": sum(D + (lin.bias is not None) for lin in _mlp_inputs(b)) * b.mlp_hidden
        + b.mlp_hidden * b.fc2.out_features,
        "out_bias": (b.proj.out_features if b.proj.bias is not None else 0)
        + (b.fc2.out_features if b.fc2.bias is not None else 0),
    }
    out["total"] = sum(out.values())
    return out


def with_dims(b: BlockAnatomy, dims: dict[str, int], query_tokens: int | None = None) -> SimpleNamespace:
    """A view of block ``b`` with kept dims ``dims`` (keys heads, qk, v, mlp; all present) for
    :func:`block_flops` / :func:`block_params`: the same layers (in/out widths, biases), the given
    head count and dims, and ``query_tokens`` (None = every token)."""
    return SimpleNamespace(qkv=b.qkv, proj=b.proj, fc1=b.fc1, fc1_gate=getattr(b, "fc1_gate", None), fc2=b.fc2,
                           num_heads=dims["heads"], qk_dim=dims["qk"], v_dim=dims["v"], mlp_hidden=dims["mlp"],
                           query_tokens=query_tokens)


#: the attribute a network keeps its measured head FLOPs in (``{"C,H,W": flops}``; survives deepcopy)
_HEAD_FLOPS_ATTR = "_edgeprune_head_flops"


def network_head_flops(anatomy: ViTAnatomy) -> int:
    """FLOPs of a network's own modules outside its ViT (issue 55: a DPT head, a decoder), for one image.

    Counted by ``torch.utils.flop_counter.FlopCounterMode`` on one zero image: the network's total minus what the
    modules inside the ViT count (the outermost ones under the backbone's path). Pruning edits only the ViT, so the
    value is measured once per network and input size and kept on the network (``_edgeprune_head_flops``).
    0 when the forward cannot be counted.
    """
    model = anatomy.model
    size = (anatomy.in_chans, *anatomy.img_size)
    key = ",".join(map(str, size))
    known = getattr(model, _HEAD_FLOPS_ATTR, None) or {}
    if key in known:
        return int(known[key])
    path = backbone_path(model)
    prefix = type(model).__name__ + (f".{path}" if path else "")
    param = next(model.parameters(), None)
    x = torch.zeros(1, *size, device=param.device if param is not None else "cpu")
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            model(x)
    except Exception:  # noqa: BLE001 -- a forward the counter cannot follow: no head FLOPs
        return 0
    counts = {k: int(sum(v.values())) for k, v in fc.get_flop_counts().items()}
    inside = [k for k in counts if k == prefix or k.startswith(prefix + ".")]
    outer = [k for k in inside if not any(k != o and k.startswith(o + ".") for o in inside)]
    flops = max(0, counts.get("Global", 0) - sum(counts[k] for k in outer))
    object.__setattr__(model, _HEAD_FLOPS_ATTR, {**known, key: flops})
    return flops


def model_flops(anatomy: ViTAnatomy) -> dict[str, object]:
    """FLOPs of the whole model for one image.

    Returns:
        dict with ``total`` (int), ``blocks`` (list of :func:`block_flops` dicts),
        ``patch_embed`` and ``head`` (int): the ViT's linear head, or the wrapper's own head
        (``anatomy.model.head_flops``) when the ViT sits inside one.
    """
    ph, pw = anatomy.patch_size
    pe = 2 * anatomy.num_patches * anatomy.in_chans * ph * pw * anatomy.embed_dim
    head = 0
    vit_head = getattr(anatomy.vit, "head", None)
    if isinstance(vit_head, nn.Linear):
        head = 2 * vit_head.in_features * vit_head.out_features
    wrapper_head = getattr(anatomy.model, "head_flops", None)
    if anatomy.model is not anatomy.vit and callable(wrapper_head):
        head += int(wrapper_head(anatomy.img_size))
    elif anatomy.model is not anatomy.vit:
        head += network_head_flops(anatomy)
    blocks = [block_flops(b, t, anatomy.num_prefix_tokens) for b, t in zip(anatomy.blocks, block_tokens(anatomy))]
    total = pe + head + sum(b["total"] for b in blocks)
    return {"total": total, "blocks": blocks, "patch_embed": pe, "head": head}
