"""Surgery: replace a block's modules by physically smaller ones.

Pure module plumbing -- the weights come from ``edgeprune.solve``. Two operations:

* :func:`shrink_mlp` -- ``fc1`` (and a gated MLP's gate ``fc1_g``) keeps output rows S, ``fc2`` becomes
  Linear(|S|, D) with given weights.
* :func:`replace_attention` -- the block's attention becomes a :class:`PrunedAttention` with the
  given fused qkv / proj weights, number of heads and per-head qk_dim / v_dim.

:func:`apply_structure` rebuilds the pruned shapes (random weights) from the per-block dims of a
run record, so a saved state dict can be loaded strictly; :func:`apply_head_structure` does the same
for a classifier head that NuWa sliced to its target classes (:mod:`edgeprune.nuwa.head` cuts it).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from edgeprune.backbone import BackboneError, backbone_of

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy, find_anatomy
from edgeprune.errors import UserError
from edgeprune.layers.class_token_block import to_class_token_block
from edgeprune.layers.pruned_attention import PrunedAttention
from edgeprune.layers.rotary_attention import RotaryAttention, is_rotary

_HEAD_NAMES = ("head", "head_dist")  # classifier heads: timm's, and the distilled DeiT's


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                    device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def shrink_mlp(block: BlockAnatomy, keep: torch.Tensor, fc2_weight: torch.Tensor,
               fc2_bias: torch.Tensor | None) -> None:
    """Keep hidden channels ``keep`` of the block's MLP, in place.

    A gated MLP (``block.fc1_gate``, METHODS.md §6 "Gated MLPs"): hidden channel j is row j of the gate
    ``fc1_g`` *and* of the up projection ``fc1_x`` (D_mlp, D) each; both keep rows ``keep``.

    Args:
        block: the block's anatomy (its ``mlp.fc1`` -- or ``mlp.fc1_g`` / ``mlp.fc1_x`` -- and
            ``mlp.fc2`` are replaced).
        keep: (D_mlp',) int64 kept channel indices.
        fc2_weight: new fc2 weight (D, D_mlp'); fc2_bias: (D,) or None.
    """
    new = {}
    for attr, lin in block.mlp_inputs:
        new[attr] = _linear(lin.weight.detach()[keep], None if lin.bias is None else lin.bias.detach()[keep])
        setattr(block.mlp, attr, new[attr])
    block.mlp.fc2 = _linear(fc2_weight, fc2_bias)
    block.fc1 = new["fc1" if block.fc1_gate is None else "fc1_x"]
    block.fc1_gate = new.get("fc1_g")
    block.fc2, block.mlp_hidden = block.mlp.fc2, len(keep)


def qkv_parts(block: BlockAnatomy) -> dict[str, torch.Tensor | None]:
    """Split the fused qkv into per-head parts.

    Returns:
        dict with ``wq``, ``wk`` (H, qk_dim, D), ``wv`` (H, v_dim, D) and biases ``bq``, ``bk``
        (H, qk_dim), ``bv`` (H, v_dim) or None.
    """
    H, dq, dv = block.num_heads, block.qk_dim, block.v_dim
    w = block.qkv.weight.detach()
    D = w.shape[1]
    wq, wk, wv = w.split([H * dq, H * dq, H * dv], dim=0)
    out: dict[str, torch.Tensor | None] = {
        "wq": wq.reshape(H, dq, D), "wk": wk.reshape(H, dq, D), "wv": wv.reshape(H, dv, D)}
    if block.qkv.bias is not None:
        bq, bk, bv = block.qkv.bias.detach().split([H * dq, H * dq, H * dv])
        out.update(bq=bq.reshape(H, dq), bk=bk.reshape(H, dq), bv=bv.reshape(H, dv))
    else:
        out.update(bq=None, bk=None, bv=None)
    return out


def replace_attention(block: BlockAnatomy, wq: torch.Tensor, bq: torch.Tensor | None,
                      wk: torch.Tensor, bk: torch.Tensor | None, wv: torch.Tensor,
                      bv: torch.Tensor | None, proj_weight: torch.Tensor,
                      proj_bias: torch.Tensor | None,
                      rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> PrunedAttention:
    """Install a :class:`PrunedAttention` in the block, in place, and return it.

    Args:
        wq, wk: (H', qk_dim', D); bq, bk: (H', qk_dim') or None. H' (the kept heads) may be
            smaller than the block's H.
        wv: (H', v_dim', D); bv: (H', v_dim') or None.
        proj_weight: (D, H'*v_dim'); proj_bias: (D,) or None.
        The query weights must already carry any logit-scale fold (the module uses 1/sqrt(qk_dim')).
        rope: ``(cos, sin)`` (H', n, qk_dim') RoPE tables of the kept heads and pairs: the new module is a
            :class:`RotaryAttention`; None: a :class:`PrunedAttention`.
    """
    H, dq, D = wq.shape
    dv = wv.shape[1]
    if rope is None:
        attn = PrunedAttention(D, H, dq, dv, qkv_bias=bq is not None, proj_bias=proj_bias is not None,
                               dense_head_dim=block.head_dim)
    else:
        attn = RotaryAttention(D, H, dq, dv, rope[0].shape[1], qkv_bias=bq is not None,
                               proj_bias=proj_bias is not None, dense_head_dim=block.head_dim)
        attn.set_tables(*rope)
    attn = attn.to(device=wq.device, dtype=wq.dtype)
    with torch.no_grad():
        attn.qkv.weight.copy_(torch.cat([wq.reshape(H * dq, D), wk.reshape(H * dq, D),
                                         wv.reshape(H * dv, D)]))
        if bq is not None:
            attn.qkv.bias.copy_(torch.cat([bq.reshape(-1), bk.reshape(-1), bv.reshape(-1)]))
        attn.proj.weight.copy_(proj_weight)
        if proj_bias is not None:
            attn.proj.bias.copy_(proj_bias)
    block.block.attn = attn
    block.attn, block.qkv, block.proj = attn, attn.qkv, attn.proj
    block.qk_dim, block.v_dim, block.num_heads = dq, dv, H
    return attn


def block_dims(anatomy: ViTAnatomy) -> list[dict[str, int]]:
    """Per-block dims for the run record: index, num_heads (the current, i.e. kept, heads), head_dim
    (the dense model's), qk_dim, v_dim, mlp_hidden, ``query_tokens`` for a block that
    computes only its first T tokens (the class-token last block), and for a model with token merging
    (``edgeprune.tokens``) ``tokens`` (the tokens the block receives) and ``merge`` (the tokens it merges away; a
    block that unmerges, inside a network with a dense head, passes all its tokens on)."""
    merged = any(b.merge_r for b in anatomy.blocks)
    n = anatomy.num_tokens
    out = []
    for b in anatomy.blocks:
        out.append(dict(index=b.index, num_heads=b.num_heads, head_dim=b.head_dim, qk_dim=b.qk_dim,
                        v_dim=b.v_dim, mlp_hidden=b.mlp_hidden,
                        **({} if b.query_tokens is None else {"query_tokens": int(b.query_tokens)}),
                        **({"tokens": n, "merge": b.merge_r} if merged else {})))
        n -= 0 if b.unmerge else b.merge_r
    return out


def apply_structure(model: nn.Module, dims: Sequence[dict[str, int]]) -> nn.Module:
    """Give a dense model the pruned shapes in ``dims`` (from :func:`block_dims`), in place.

    Weights of resized modules are left uninitialised-random; load a state dict afterwards.

    Raises:
        ValueError: ``dims`` does not match the model's number of blocks, or has more heads than
            the model.
    """
    anatomy = find_anatomy(model)
    if len(dims) != len(anatomy.blocks):
        raise ValueError(f"record has {len(dims)} blocks, model has {len(anatomy.blocks)}")
    for b, d in zip(anatomy.blocks, dims):
        heads = int(d["num_heads"])
        if not 1 <= heads <= b.num_heads:
            raise ValueError(f"block {b.index}: record has {d['num_heads']} heads, model {b.num_heads}")
        if int(d["mlp_hidden"]) != b.mlp_hidden:
            D = b.fc1.in_features
            for attr, lin in b.mlp_inputs:  # fc1, or a gated MLP's fc1_g and fc1_x
                setattr(b.mlp, attr, nn.Linear(D, int(d["mlp_hidden"]), bias=lin.bias is not None))
            b.mlp.fc2 = nn.Linear(int(d["mlp_hidden"]), b.fc2.out_features, bias=b.fc2.bias is not None)
        if ((heads, int(d["qk_dim"]), int(d["v_dim"])) != (b.num_heads, b.qk_dim, b.v_dim)
                or isinstance(b.attn, PrunedAttention)):
            D = b.qkv.in_features
            shape = dict(qkv_bias=b.qkv.bias is not None, proj_bias=b.proj.bias is not None,
                         dense_head_dim=int(d.get("head_dim", b.head_dim)))
            if is_rotary(b.attn):  # the tables are buffers of the weights file: loaded with them
                b.block.attn = RotaryAttention(D, heads, int(d["qk_dim"]), int(d["v_dim"]), b.attn.num_tokens, **shape)
            else:
                b.block.attn = PrunedAttention(D, heads, int(d["qk_dim"]), int(d["v_dim"]), **shape)
    t = dims[-1].get("query_tokens")
    if t is not None and anatomy.blocks[-1].query_tokens is None:
        to_class_token_block(anatomy.vit, int(t))
    return model


# -- the classifier head (NuWa slices it; load_run rebuilds the sliced shape) -----------------

def backbone_vit(model: nn.Module) -> nn.Module:
    """The timm ViT itself: ``model``, or the ViT inside a network (:func:`edgeprune.backbone.backbone_of`; the
    model itself when it holds none)."""
    try:
        return backbone_of(model)
    except BackboneError:
        return model


def classifier_heads(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(owner, attribute, Linear) of every classifier head.

    Raises:
        UserError: the model has no Linear classifier head (e.g. a saliency model).
    """
    vit = backbone_vit(model)
    heads = [(vit, n, getattr(vit, n)) for n in _HEAD_NAMES if isinstance(getattr(vit, n, None), nn.Linear)]
    if not heads:
        raise UserError(f"{type(model).__name__} has no Linear classifier head; NuWa derives classifiers")
    return heads


def apply_head_structure(model: nn.Module, head: dict | None) -> nn.Module:
    """Give a freshly built base model the head shape of a run record's ``head`` entry, in place.

    For ``load_run``: call after ``apply_structure`` and before ``load_state_dict``. A no-op
    without a ``head`` entry or when the shape already matches. Weights are left random.
    """
    if not head or head.get("num_classes") is None:
        return model
    k = int(head["num_classes"])
    try:
        heads = classifier_heads(model)
    except UserError:
        return model
    for owner, name, lin in heads:
        if lin.out_features != k:
            setattr(owner, name, nn.Linear(lin.in_features, k, bias=lin.bias is not None))
    vit = backbone_vit(model)
    if hasattr(vit, "num_classes"):
        vit.num_classes = k
    return model
