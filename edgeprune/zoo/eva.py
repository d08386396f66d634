"""timm ``Eva`` (DINOv3, EVA-02, ``vit_*rope*``) converted exactly into a timm ``VisionTransformer``
with :class:`~edgeprune.layers.rotary_attention.RotaryAttention` (issue 54, METHODS.md §6).

What the conversion keeps, exactly (in eval mode, at the model's fixed image size):

* the token layout ``[class, registers, patches]``, the learned position embedding (or none, DINOv3),
  LayerScale (``gamma_1`` / ``gamma_2`` -> timm ``LayerScale``), the norms, pooling and head;
* the attention: q/k/v (fused with ``q_bias`` / zero ``k_bias`` / ``v_bias``, fused with one bias, or
  separate ``q_proj`` / ``k_proj`` / ``v_proj``) -> one fused ``qkv`` Linear; the RoPE sin/cos timm computes
  for the patch grid -> per-head table buffers (prefix tokens unrotated); interleaved pairs (EVA-02) are
  permuted into the ``rotate_half`` layout, the same permutation on q and k, so every logit is unchanged;
  per-depth tables (``rope_type='mixed'``) go to their block;
* the MLP module as it is (a gated one is the gated-MLP conversion's business).

Refused, one line naming the feature: post-norm blocks, q/k norm, the attention's scale norm (EVA-02 B/L
``scale_attn_inner``), gated attention, grouped-query attention, attention pooling (``global_pool='map'``),
patch dropout, dynamic padding. ``dynamic_img_size`` is turned off: the converted model runs at the
image size it was built for (its RoPE tables are those of that grid).

The conversion checks itself: it runs both models on one random image and refuses (naming the largest
difference) if the outputs differ by more than float32 round-off.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from edgeprune.anatomy import UnsupportedModelError, is_eva
from edgeprune.layers.pruned_attention import PrunedAttention
from edgeprune.layers.rotary_attention import RotaryAttention
from edgeprune.zoo.converters import CONVERTERS, Converter


def eva_features(eva: nn.Module) -> list[str]:
    """Features of a timm ``Eva`` its exact conversion (:mod:`edgeprune.zoo.eva`) cannot keep (empty: convertible)."""
    out = []
    if getattr(eva, "attn_pool", None) is not None:
        out.append("attention pooling (global_pool='map')")
    if getattr(eva, "patch_drop", None) is not None:
        out.append("patch dropout")
    if getattr(eva.patch_embed, "dynamic_img_pad", False):
        out.append("dynamic image padding")
    for blk in eva.blocks:
        name = type(blk).__name__
        if "PostNorm" in name:
            out.append(f"post-norm blocks ({name})")
            break
        attn = blk.attn
        for norm in ("q_norm", "k_norm"):
            if not isinstance(getattr(attn, norm, nn.Identity()), nn.Identity):
                out.append("q/k norm")
        if not isinstance(getattr(attn, "norm", nn.Identity()), nn.Identity):
            out.append("attention scale norm (scale_attn_inner)")
        if getattr(attn, "gate", None) is not None:
            out.append("gated attention")
        if int(getattr(attn, "num_kv_groups", 1)) != 1:
            out.append("grouped-query attention (num_kv_heads)")
    return list(dict.fromkeys(out))


def _rope_embed(eva: nn.Module) -> torch.Tensor | None:
    """The RoPE tensor timm's ``Eva`` hands its blocks at the fixed grid (None without RoPE)."""
    rope = getattr(eva, "rope", None)
    if rope is None:
        return None
    if getattr(rope, "feat_shape", None) is not None:
        return rope.get_embed()
    return rope.get_embed(shape=tuple(eva.patch_embed.grid_size))


def _half_perm(d: int) -> torch.Tensor:
    """The permutation taking interleaved pairs (2j, 2j + 1) to the rotate_half layout (j, j + d/2)."""
    return torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])


def rope_tables(embed: torch.Tensor, num_heads: int, head_dim: int, num_prefix_tokens: int,
                rotate_half: bool, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head, per-token RoPE tables in the rotate_half layout, from timm's RoPE tensor.

    Args:
        embed: timm's ``cat([sin, cos], -1)`` for the patch tokens: (Np, 2d), (H, Np, 2d) or (1, H, Np, 2d).
        num_heads: H; head_dim: d (even); num_prefix_tokens: tokens before the patches (unrotated).
        rotate_half: timm's layout flag (False: interleaved pairs, permuted here).
        where: the block, for the error.

    Returns:
        ``(cos, sin)``, each (H, num_prefix_tokens + Np, d) float32; prefix rows cos = 1, sin = 0.

    Raises:
        UnsupportedModelError: a table whose two halves of a pair differ (not a pairwise rotation).
    """
    sin, cos = embed.detach().float().chunk(2, dim=-1)
    while sin.dim() > 3:
        sin, cos = sin.squeeze(0), cos.squeeze(0)
    if sin.shape[-1] != head_dim or head_dim % 2:
        raise UnsupportedModelError(f"{where}: RoPE tables of width {sin.shape[-1]} for head_dim {head_dim}")
    sin = sin.expand(num_heads, *sin.shape[-2:]) if sin.dim() == 2 or sin.shape[0] == 1 else sin
    cos = cos.expand(num_heads, *cos.shape[-2:]) if cos.dim() == 2 or cos.shape[0] == 1 else cos
    if not rotate_half:
        perm = _half_perm(head_dim)
        sin, cos = sin[..., perm], cos[..., perm]
    p = head_dim // 2
    for t in (sin, cos):
        if not torch.allclose(t[..., :p], t[..., p:], atol=1e-6):
            raise UnsupportedModelError(f"{where}: a RoPE table whose pair halves differ (not a pairwise rotation)")
    n_pre = int(num_prefix_tokens)
    h, np_ = sin.shape[0], sin.shape[1]
    cos_full = torch.cat([torch.ones(h, n_pre, head_dim), cos], dim=1).contiguous()
    sin_full = torch.cat([torch.zeros(h, n_pre, head_dim), sin], dim=1).contiguous()
    assert cos_full.shape == (h, n_pre + np_, head_dim)
    return cos_full, sin_full


def _qkv(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """timm Eva/AttentionRope q/k/v as one fused weight (3A, D) and bias (3A,) or None."""
    if getattr(attn, "qkv", None) is not None:
        w = attn.qkv.weight.detach()
        if getattr(attn, "q_bias", None) is not None:
            k_bias = getattr(attn, "k_bias", None)
            k_bias = torch.zeros_like(attn.q_bias) if k_bias is None else k_bias
            return w, torch.cat([attn.q_bias.detach(), k_bias.detach(), attn.v_bias.detach()])
        return w, None if attn.qkv.bias is None else attn.qkv.bias.detach()
    lins = (attn.q_proj, attn.k_proj, attn.v_proj)
    w = torch.cat([lin.weight.detach() for lin in lins])
    if all(lin.bias is None for lin in lins):
        return w, None
    return w, torch.cat([lin.bias.detach() if lin.bias is not None else torch.zeros(lin.out_features)
                         for lin in lins])


def _attention(attn: nn.Module, dim: int, num_tokens: int, embed: torch.Tensor | None,
               num_prefix_tokens: int, where: str) -> PrunedAttention:
    """The edgeprune attention computing what timm's ``EvaAttention`` / ``AttentionRope`` computes."""
    H, d = int(attn.num_heads), int(attn.head_dim)
    w, b = _qkv(attn)
    proj = attn.proj
    if embed is None:
        new: PrunedAttention = PrunedAttention(dim, H, d, d, qkv_bias=b is not None,
                                               proj_bias=proj.bias is not None, dense_head_dim=d)
    else:
        half = bool(getattr(attn, "rotate_half", False))
        cos, sin = rope_tables(embed, H, d, num_prefix_tokens, half, where)
        if not half:  # permute the q and k rows of every head the same way: q.k unchanged
            perm = _half_perm(d)
            rows = torch.cat([(part * H + h) * d + perm for part in (0, 1) for h in range(H)]
                             + [torch.arange(2 * H * d, 3 * H * d)])
            w = w[rows]
            b = None if b is None else b[rows]
        new = RotaryAttention(dim, H, d, d, num_tokens, qkv_bias=b is not None,
                              proj_bias=proj.bias is not None, dense_head_dim=d)
        new.set_tables(cos, sin)
    with torch.no_grad():
        new.qkv.weight.copy_(w)
        if b is not None:
            new.qkv.bias.copy_(b)
        new.proj.weight.copy_(proj.weight)
        if proj.bias is not None:
            new.proj.bias.copy_(proj.bias)
    new.scale = float(attn.scale)
    return new


def _layer_scale(gamma: torch.Tensor | None) -> nn.Module:
    from timm.layers import LayerScale

    if gamma is None:
        return nn.Identity()
    ls = LayerScale(gamma.numel())
    with torch.no_grad():
        ls.gamma.copy_(gamma)
    return ls


def convert_eva(eva: nn.Module) -> nn.Module:
    """A timm ``VisionTransformer`` computing what ``eva`` computes (see the module docstring).

    Args:
        eva: a timm ``Eva`` (left unchanged; the result holds copies of its weights).

    Returns:
        The converted model, in the input's train/eval mode.

    Raises:
        UnsupportedModelError: a feature the conversion cannot keep (named), or outputs that differ.
    """
    from timm.models.vision_transformer import Block, VisionTransformer
    name = type(eva).__name__
    bad = eva_features(eva)
    if bad:
        raise UnsupportedModelError(f"{name} uses {'; '.join(bad[:3])}, which edgeprune cannot prune exactly")
    src = copy.deepcopy(eva).eval()
    pe = src.patch_embed
    grid = tuple(int(g) for g in pe.grid_size)
    D, npt = int(src.embed_dim), int(src.num_prefix_tokens)
    embed = _rope_embed(src)
    mixed = bool(getattr(src, "rope_mixed", False))
    first = src.blocks[0]
    vit = VisionTransformer(
        img_size=tuple(pe.img_size), patch_size=tuple(pe.patch_size), in_chans=int(pe.proj.in_channels),
        num_classes=int(getattr(src, "num_classes", 0)), global_pool=src.global_pool or "",
        embed_dim=D, depth=len(src.blocks), num_heads=int(first.attn.num_heads),
        class_token=src.cls_token is not None, reg_tokens=0 if src.reg_token is None else src.reg_token.shape[1],
        no_embed_class=bool(src.no_embed_class), pos_embed="learn" if src.pos_embed is not None else "none",
        init_values=None, weight_init="skip")
    # the embedding, exactly as Eva's (static grid: flatten to (B, Np, D))
    from timm.layers import Format

    pe.flatten, pe.output_fmt, pe.strict_img_size = True, Format.NCHW, True
    vit.patch_embed = pe
    vit.cls_token, vit.reg_token, vit.pos_embed = src.cls_token, src.reg_token, src.pos_embed
    vit.norm_pre, vit.norm, vit.fc_norm, vit.head_drop, vit.head = (src.norm_pre, src.norm, src.fc_norm,
                                                                    src.head_drop, src.head)
    n = npt + grid[0] * grid[1]
    blocks = []
    for i, eb in enumerate(src.blocks):
        blk = Block(D, int(eb.attn.num_heads), qkv_bias=True)
        blk.norm1, blk.norm2, blk.mlp = eb.norm1, eb.norm2, eb.mlp
        e = None if embed is None else (embed[i] if mixed else embed)
        blk.attn = _attention(eb.attn, D, n, e, npt, f"{name} block {i}")
        blk.ls1, blk.ls2 = _layer_scale(eb.gamma_1), _layer_scale(getattr(eb, "gamma_2", None))
        blocks.append(blk)
    vit.blocks = nn.Sequential(*blocks)
    vit.eval()
    _check_same(eva, vit, name)
    return vit.train(eva.training)


@torch.no_grad()
def _check_same(eva: nn.Module, vit: nn.Module, name: str) -> None:
    """Refuse a conversion whose output differs from the original's on one random image."""
    was = eva.training
    eva.eval()
    pe = vit.patch_embed
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, int(pe.proj.in_channels), *pe.img_size, generator=gen)
    a, b = eva(x), vit(x)
    eva.train(was)
    err = float((a - b).abs().max())
    scale = float(a.abs().max()) + 1e-6
    if not err <= 1e-4 * scale + 1e-5:
        raise UnsupportedModelError(f"{name}: the converted model differs from timm's by {err:.3g} "
                                    f"(output scale {scale:.3g}); this Eva variant is not supported")


CONVERTERS.register("eva", Converter(applies=is_eva, convert=convert_eva,
                                     what="timm Eva -> VisionTransformer with fixed RoPE tables"),
                    replace=True)
