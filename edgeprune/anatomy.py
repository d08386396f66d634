"""Model anatomy: where a ViT's blocks, heads and MLPs are.

:func:`find_anatomy` walks a timm ``VisionTransformer`` (DeiT, ViT, DeiT3, distilled DeiT,
DINOv2-style) -- or a network that holds one (``dinov2-s14``, :mod:`edgeprune.backbone`) -- and returns, for
every block, the fused ``qkv`` and ``proj`` Linears, ``num_heads``, the dense ``head_dim``, the
current ``qk_dim`` and ``v_dim``, ``fc1``/``act``/``fc2`` and the LayerScales, plus the number of
prefix tokens. Everything downstream (calibration hooks, planning, surgery, FLOPs) reads the
model only through this record.

Only what edgeprune reproduces *exactly* is accepted (issue 12, defect 1): the model class must be
timm's ``VisionTransformer`` (or the distilled DeiT subclass), every block timm's pre-norm ``Block``
with timm's standard ``Attention`` (or edgeprune's :class:`PrunedAttention`) and a plain ``Mlp`` or
a split gated ``SwiGLU`` (``fc1_g``/``fc1_x``; a packed ``GluMlp`` is split first by
:mod:`edgeprune.zoo.glu`), the patch embedding timm's ``PatchEmbed``. Anything else -- relative-position
bias, RoPE, separate q/v biases, q/k or scale norm, gated attention, post-norm or parallel blocks, unconverted
packed GLU MLPs, MLP hidden norms, hybrid CNN stems, unknown attention classes -- raises
:class:`UnsupportedModelError` naming the feature, before any work. The supported and refused families
are listed in :mod:`edgeprune.zoo.families`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.nn as nn
from edgeprune.backbone import BackboneError, backbone_of

from edgeprune._compat import import_timm
from edgeprune.errors import UserError
from edgeprune.layers.class_token_block import ClassTokenBlock
from edgeprune.layers.pruned_attention import PrunedAttention
from edgeprune.layers.rotary_attention import RotaryAttention
from edgeprune.tokens.model import TokenMergeBlock
from edgeprune.tokens.unmerge import TokenUnmergeBlock


class UnsupportedModelError(UserError):
    """The model is not a ViT edgeprune can prune; the message names what is missing."""


@dataclasses.dataclass
class BlockAnatomy:
    """One transformer block ``x = x + ls1(attn(norm1(x))); x = x + ls2(mlp(norm2(x)))``.

    Attributes:
        index: block index (0-based).
        block: the block module.
        attn: the attention module (timm ``Attention`` or :class:`PrunedAttention`).
        qkv: fused Linear(D, H*(2*qk_dim + v_dim)); rows ``[q; k; v]``, head-major.
        proj: Linear(H*v_dim, D).
        num_heads: H.
        head_dim: the dense model's head dim d_h (its logit scale is ``d_h ** -0.5``).
        qk_dim: current per-head query/key dim (== head_dim unless pruned).
        v_dim: current per-head value dim (== head_dim unless pruned).
        mlp: the MLP module; fc1: Linear(D, D_mlp); act: activation; fc2: Linear(D_mlp, D). For a gated
            MLP (timm ``SwiGLU``, METHODS.md §6 "Gated MLPs") ``fc1`` is the up projection ``fc1_x``.
        mlp_hidden: current D_mlp.
        ls1, ls2: LayerScale modules or ``None`` (Identity).
        query_tokens: ``None`` for a full block; T for a block that computes only its first T
            tokens' outputs (:class:`~edgeprune.layers.class_token_block.ClassTokenBlock`, the last
            block of a class-token classifier).
        merge_r: tokens the block merges away between its attention and its MLP
            (:class:`~edgeprune.tokens.model.TokenMergeBlock`, ToMe); 0 for a block without a merge. With
            ``unmerge`` (:class:`~edgeprune.tokens.unmerge.TokenUnmergeBlock`, a network with a dense head): the
            tokens merged inside each branch, which the block unmerges again (it returns all its tokens).
        unmerge: the block merges inside its branches and unmerges (above).
        fc1_gate: the gate projection Linear(D, D_mlp) of a gated MLP (timm ``SwiGLU``'s ``fc1_g``):
            hidden channel j is ``h_j = act(u w_g,j) * (u w_u,j)`` with ``w_g,j`` row j of ``fc1_gate`` and
            ``w_u,j`` row j of ``fc1`` (u the ``norm2`` output, (B, N, D) -> h (B, N, D_mlp)), so pruning j
            removes that row of both and column j of ``fc2``; ``None`` for a plain MLP ``act(fc1(u))``.
    """

    index: int
    block: nn.Module
    attn: nn.Module
    qkv: nn.Linear
    proj: nn.Linear
    num_heads: int
    head_dim: int
    qk_dim: int
    v_dim: int
    mlp: nn.Module
    fc1: nn.Linear
    act: nn.Module
    fc2: nn.Linear
    mlp_hidden: int
    ls1: Optional[nn.Module]
    ls2: Optional[nn.Module]
    query_tokens: Optional[int] = None
    merge_r: int = 0
    fc1_gate: Optional[nn.Linear] = None
    unmerge: bool = False

    @property
    def mlp_inputs(self) -> list[tuple[str, nn.Linear]]:
        """``(attribute on mlp, Linear)`` of every Linear that reads the MLP's input ``u`` (D wide) and has
        one output row per hidden channel: ``[("fc1", fc1)]`` for a plain MLP, ``[("fc1_g", gate),
        ("fc1_x", up)]`` for a gated one (what surgery slices by rows and the embed slice by columns)."""
        if self.fc1_gate is None:
            return [("fc1", self.fc1)]
        return [("fc1_g", self.fc1_gate), ("fc1_x", self.fc1)]


@dataclasses.dataclass
class ViTAnatomy:
    """A whole ViT.

    Attributes:
        model: the module passed to :func:`find_anatomy`.
        vit: the timm ``VisionTransformer`` inside it (``model`` itself or its backbone, :mod:`edgeprune.backbone`).
        blocks: one :class:`BlockAnatomy` per block, in order.
        embed_dim: token width D.
        num_prefix_tokens: class (+ distillation / register) tokens before the patch tokens.
        num_patches: patch tokens for the model's fixed image size.
        img_size: (H, W) in pixels; in_chans: input channels; patch_size: (ph, pw).
    """

    model: nn.Module
    vit: nn.Module
    blocks: list[BlockAnatomy]
    embed_dim: int
    num_prefix_tokens: int
    num_patches: int
    img_size: tuple[int, int]
    in_chans: int
    patch_size: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        """Sequence length n = prefix tokens + patch tokens."""
        return self.num_prefix_tokens + self.num_patches


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _timm_classes() -> dict[str, tuple[type, ...]]:
    """The exact classes edgeprune reproduces (looked up in the installed timm)."""
    import_timm()
    from timm.layers import Mlp, PatchEmbed, SwiGLU
    from timm.layers.attention import Attention
    from timm.models.deit import VisionTransformerDistilled
    from timm.models.vision_transformer import Block, VisionTransformer

    return {"vit": (VisionTransformer, VisionTransformerDistilled), "block": (Block, ClassTokenBlock, TokenMergeBlock,
                                                                                   TokenUnmergeBlock),
            "attn": (Attention, PrunedAttention, RotaryAttention), "mlp": (Mlp, SwiGLU), "patch_embed": (PatchEmbed,)}


def _has(module: nn.Module, attr: str) -> bool:
    return getattr(module, attr, None) is not None


def _module_features(kind: str, module: nn.Module) -> list[str]:
    """Features of one module (model, block, attention or MLP) that edgeprune cannot reproduce."""
    cls = type(module).__name__
    low = cls.lower()
    out = []
    if (any(_has(module, a) for a in ("rel_pos", "shared_rel_pos", "relative_position_bias_table",
                                      "relative_position_index", "rel_pos_bias"))
            or "relpos" in low or "rel_pos" in low):
        out.append("relative-position bias")
    if any(_has(module, a) for a in ("rope", "rotary_emb", "rotary_pos_emb", "freqs_cis")) or "rope" in low:
        out.append("RoPE (rotary position embedding)")
    if kind == "attn":
        if _has(module, "q_bias") or _has(module, "v_bias"):
            out.append("separate q_bias/v_bias (BEiT/EVA qkv layout)")
        if any(not isinstance(getattr(module, a, nn.Identity()), nn.Identity) for a in ("q_norm", "k_norm")):
            out.append("q/k norm")
        if not isinstance(getattr(module, "norm", nn.Identity()), nn.Identity):
            out.append("attention scale norm")
        if _has(module, "gate"):
            out.append("gated attention")
        if not isinstance(getattr(module, "attn_drop", nn.Identity()), (nn.Identity, nn.Dropout)):
            out.append(f"attention dropout {type(module.attn_drop).__name__}")
    if kind == "block":
        if "respost" in low or "post" in low:
            out.append(f"post-norm blocks ({cls})")
        if "parallel" in low or (not _has(module, "attn") and _has(module, "attns")):
            out.append(f"parallel attention/MLP blocks ({cls})")
    if kind == "mlp" and "glu" in low and not (_has(module, "fc1_g") and _has(module, "fc1_x")):
        out.append(f"packed gated (GLU) MLP {cls} (not converted: edgeprune.zoo.canonical.canonical_model splits it)")
    if kind == "mlp" and not isinstance(getattr(module, "norm", nn.Identity()), nn.Identity):
        out.append(f"MLP hidden norm (mlp.norm {type(module.norm).__name__}, e.g. EVA-02 B/L scale_mlp)")
    return out


def is_eva(model: nn.Module) -> bool:
    """True for a timm ``Eva`` (DINOv3, EVA/EVA-02, ``vit_*rope*``), which the pipeline reads once converted."""
    import_timm()
    try:
        from timm.models.eva import Eva
    except ImportError:  # a timm without Eva
        return False
    return isinstance(model, Eva)


def unsupported_features(vit: nn.Module) -> list[str]:
    """Everything in ``vit`` (a timm ViT-like module) that edgeprune cannot prune exactly.

    Returns:
        Distinct feature descriptions in the order found; empty when the model is supported.
    """
    classes = _timm_classes()
    if is_eva(vit):  # read once converted (edgeprune.zoo.eva names what its conversion refuses)
        return ["a timm Eva not yet converted (edgeprune.prune and --model convert it; call "
                "edgeprune.zoo.canonical.canonical_model first)"]
    found = _module_features("model", vit)
    pe = getattr(vit, "patch_embed", None)
    if pe is not None and not isinstance(pe, classes["patch_embed"]):
        found.append("hybrid CNN patch embedding" if "hybrid" in type(pe).__name__.lower()
                     else f"patch embedding {type(pe).__name__}")
    for blk in getattr(vit, "blocks", None) or []:
        found += _module_features("block", blk)
        attn, mlp = getattr(blk, "attn", None), getattr(blk, "mlp", None)
        if attn is not None:
            found += _module_features("attn", attn)
        if mlp is not None:
            found += _module_features("mlp", mlp)
    if not found:  # no named feature: check the classes themselves
        if type(vit) not in classes["vit"]:
            found.append(f"model class {type(vit).__module__}.{type(vit).__name__} "
                         "(only timm VisionTransformer / distilled DeiT)")
        for blk in getattr(vit, "blocks", None) or []:
            attn, mlp = getattr(blk, "attn", None), getattr(blk, "mlp", None)
            if type(blk) not in classes["block"]:
                found.append(f"block class {type(blk).__name__} (only timm's pre-norm Block)")
            elif type(attn) not in classes["attn"]:
                found.append(f"unknown attention class {type(attn).__module__}.{type(attn).__name__}")
            elif type(mlp) not in classes["mlp"]:
                found.append(f"MLP class {type(mlp).__name__} (only timm's Mlp or SwiGLU)")
    return list(dict.fromkeys(found))


def _dense_head_dim(attn: nn.Module) -> int:
    # PrunedAttention remembers nothing about the dense model; the caller passes it via
    # `dense_head_dims` when re-reading a pruned model. timm Attention: head_dim.
    return int(getattr(attn, "dense_head_dim", getattr(attn, "head_dim")))


def find_anatomy(model: nn.Module) -> ViTAnatomy:
    """Locate blocks, heads and MLPs of a timm VisionTransformer-family model.

    Args:
        model: a timm ``VisionTransformer`` (``deit_*``, ``vit_*``, ``deit3_*``, distilled DeiT,
            ``vit_*_dinov2``), possibly already pruned by edgeprune, or a network with one inside
            (:mod:`edgeprune.backbone`: the named, or the only, ViT).

    Returns:
        :class:`ViTAnatomy`.

    Raises:
        UnsupportedModelError: the model lacks a piece edgeprune needs, or uses a feature edgeprune
            cannot reproduce exactly after pruning (relative-position bias, RoPE, q_bias/v_bias,
            q/k or scale norm, post-norm/parallel blocks, packed GLU MLPs, MLP hidden norms, hybrid stems, unknown
            attention classes: :func:`unsupported_features`); the one-line message names it.
    """
    try:
        vit = backbone_of(model)
    except BackboneError as err:
        if not hasattr(model, "blocks") and not hasattr(model, "patch_embed") and "holds no timm ViT" in str(err):
            _check_vit(model, type(model).__name__)  # the classic "missing blocks, patch_embed" line
        raise UnsupportedModelError(str(err)) from None
    name = type(model).__name__
    _check_vit(vit, name)
    pe = vit.patch_embed
    in_chans = int(pe.proj.in_channels) if hasattr(pe, "proj") else 3
    blocks = [_block_anatomy(i, blk, len(vit.blocks), name) for i, blk in enumerate(vit.blocks)]
    if not blocks:
        raise UnsupportedModelError(f"{name} has no transformer blocks")
    return ViTAnatomy(
        model=model, vit=vit, blocks=blocks,
        embed_dim=int(vit.embed_dim) if hasattr(vit, "embed_dim") else blocks[0].qkv.in_features,
        num_prefix_tokens=int(getattr(vit, "num_prefix_tokens", 1)),
        num_patches=int(pe.num_patches), img_size=_pair(pe.img_size), in_chans=in_chans,
        patch_size=_pair(pe.patch_size),
    )


def _check_vit(vit: nn.Module, name: str) -> None:
    """Model-level checks of :func:`find_anatomy`: blocks and a patch embedding with a fixed image
    size, no unsupported feature (:func:`unsupported_features`).

    Raises:
        UnsupportedModelError: naming the first problem (``name``: the model's class name).
    """
    missing = [a for a in ("blocks", "patch_embed") if not hasattr(vit, a)]
    if missing:
        raise UnsupportedModelError(
            f"{name} is not a supported ViT: missing {', '.join(missing)} "
            "(edgeprune supports timm VisionTransformer models: deit_*, vit_*, deit3_*, dinov2)")
    features = unsupported_features(vit)
    if features:
        raise UnsupportedModelError(
            f"{name} uses {'; '.join(features[:3])}, which edgeprune cannot prune exactly "
            "(supported: timm ViT/DeiT/DeiT3/DINOv2 with standard attention; see edgeprune.zoo.families)")
    pe = vit.patch_embed
    for attr in ("img_size", "patch_size", "num_patches"):
        if getattr(pe, attr, None) is None:
            raise UnsupportedModelError(
                f"{name}: patch_embed has no fixed {attr} (dynamic image size is not supported)")


def _block_anatomy(i: int, blk: nn.Module, num_blocks: int, name: str) -> BlockAnatomy:
    """The :class:`BlockAnatomy` of block ``i`` of ``num_blocks`` (a class-token block only last).

    Raises:
        UnsupportedModelError: a missing or unsupported attention or MLP piece, named.
    """
    where = f"{name} block {i}"
    if getattr(blk, "query_tokens", None) is not None and i != num_blocks - 1:
        raise UnsupportedModelError(f"{where} computes only the class token but is not the last block")
    attn = getattr(blk, "attn", None)
    mlp = getattr(blk, "mlp", None)
    if attn is None:
        raise UnsupportedModelError(f"{where} has no attn module")
    if mlp is None:
        raise UnsupportedModelError(f"{where} has no mlp module")
    qkv, proj, num_heads, qk_dim, v_dim = _attention_parts(attn, where)
    fc1, gate, act, fc2 = _mlp_parts(mlp, where)
    ls1 = getattr(blk, "ls1", None)
    ls2 = getattr(blk, "ls2", None)
    return BlockAnatomy(
        index=i, block=blk, attn=attn, qkv=qkv, proj=proj, num_heads=num_heads,
        head_dim=_dense_head_dim(attn), qk_dim=qk_dim, v_dim=v_dim, mlp=mlp,
        fc1=fc1, act=act, fc2=fc2, mlp_hidden=fc1.out_features, fc1_gate=gate,
        ls1=None if isinstance(ls1, (nn.Identity, type(None))) else ls1,
        ls2=None if isinstance(ls2, (nn.Identity, type(None))) else ls2,
        query_tokens=blk.query_tokens if isinstance(blk, (ClassTokenBlock, TokenMergeBlock)) else None,
        merge_r=blk.r if isinstance(blk, (TokenMergeBlock, TokenUnmergeBlock)) else 0,
        unmerge=isinstance(blk, TokenUnmergeBlock),
    )


def _attention_parts(attn: nn.Module, where: str) -> tuple[nn.Linear, nn.Linear, int, int, int]:
    """``(qkv, proj, num_heads, qk_dim, v_dim)`` of a block's attention (timm's fused-qkv
    ``Attention`` or a :class:`PrunedAttention`).

    Raises:
        UnsupportedModelError: no fused qkv / proj Linear, a q/k/scale norm, a gate, no heads, or a
            qkv width that does not match the heads.
    """
    qkv = getattr(attn, "qkv", None)
    proj = getattr(attn, "proj", None)
    if not isinstance(qkv, nn.Linear):
        raise UnsupportedModelError(f"{where} has no fused attn.qkv Linear")
    if not isinstance(proj, nn.Linear):
        raise UnsupportedModelError(f"{where} has no attn.proj Linear")
    for norm in ("q_norm", "k_norm", "norm"):
        if not isinstance(getattr(attn, norm, nn.Identity()), nn.Identity):
            raise UnsupportedModelError(f"{where} uses attn.{norm} (QK/scale norm is not supported)")
    if getattr(attn, "gate", None) is not None:
        raise UnsupportedModelError(f"{where} uses a gated attention (not supported)")
    num_heads = int(getattr(attn, "num_heads", 0))
    if num_heads < 1:
        raise UnsupportedModelError(f"{where}: attn has no num_heads")
    if isinstance(attn, PrunedAttention):
        qk_dim, v_dim = attn.qk_dim, attn.v_dim
    else:
        qk_dim = v_dim = int(attn.head_dim)
        if qkv.out_features != 3 * num_heads * qk_dim:
            raise UnsupportedModelError(f"{where}: attn.qkv has {qkv.out_features} outputs, "
                                        f"expected 3*num_heads*head_dim")
    return qkv, proj, num_heads, qk_dim, v_dim


def _mlp_parts(mlp: nn.Module, where: str) -> tuple[nn.Linear, Optional[nn.Linear], nn.Module, nn.Linear]:
    """``(fc1, gate, act, fc2)`` of a block's MLP: a plain ``Mlp`` (``gate`` None) or a gated ``SwiGLU``
    (``fc1`` = ``fc1_x`` the up projection, ``gate`` = ``fc1_g``; METHODS.md §6 "Gated MLPs").

    Raises:
        UnsupportedModelError: a packed gated MLP (``GluMlp``, not converted), missing Linears or
            activation, mismatched hidden dims, or a hidden norm.
    """
    gated = isinstance(getattr(mlp, "fc1_g", None), nn.Linear) or isinstance(getattr(mlp, "fc1_x", None), nn.Linear)
    if "glu" in type(mlp).__name__.lower() and not gated:
        raise UnsupportedModelError(f"{where}: mlp is a packed gated (GLU) MLP {type(mlp).__name__} (not converted: "
                                    "edgeprune.zoo.canonical.canonical_model splits it)")
    gate = getattr(mlp, "fc1_g", None) if gated else None
    fc1 = getattr(mlp, "fc1_x" if gated else "fc1", None)
    fc2 = getattr(mlp, "fc2", None)
    act = getattr(mlp, "act", None)
    if (not isinstance(fc1, nn.Linear) or not isinstance(fc2, nn.Linear) or act is None
            or (gated and not isinstance(gate, nn.Linear))):
        raise UnsupportedModelError(
            f"{where}: mlp is {type(mlp).__name__}, needs fc1/act/fc2 Linears (or fc1_g/fc1_x/act/fc2 when gated)")
    if fc1.out_features != fc2.in_features or (gate is not None and gate.out_features != fc1.out_features):
        raise UnsupportedModelError(f"{where}: the MLP's input projections and fc2 disagree on the hidden dim")
    if gate is not None and gate.in_features != fc1.in_features:
        raise UnsupportedModelError(f"{where}: mlp.fc1_g and mlp.fc1_x read different widths")
    if not isinstance(getattr(mlp, "norm", nn.Identity()), nn.Identity):
        raise UnsupportedModelError(f"{where}: mlp has a hidden norm (mlp.norm {type(mlp.norm).__name__}, e.g. "
                                    "EVA-02 B/L scale_mlp: it couples every hidden channel; not supported)")
    return fc1, gate, act, fc2
