"""The residual stream of a timm ViT: where it is written and read, and the surgery that changes its width.

A ViT's residual stream is written by the patch embedding (conv + bias), the position embedding, the
prefix tokens (class / register / distillation) and every block's ``proj`` and ``fc2`` (after their
LayerScale), and read only through LayerNorms: ``norm1`` -> ``qkv``, ``norm2`` -> ``fc1``, and the final
``norm`` (or ``fc_norm`` after average pooling) -> the head(s).

:func:`stream_parts` finds the writers and readers (and refuses what it cannot fold);
:func:`map_writers` / :func:`map_readers` apply a matrix to every writer's output / reader's input (new
modules of the new width replace the old ones); :func:`resize_stream` gives the norms and attention
modules a new width. The embed slice (``edgeprune.embed``, issue 33) is built on them, and
:func:`apply_embed_structure` gives a freshly built model a run record's sliced width for
``edgeprune.artifact.load_run`` -- model surgery, like ``edgeprune.surgery.apply_structure``, so the
run loader needs nothing from the embed package above it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from edgeprune.anatomy import ViTAnatomy, find_anatomy
from edgeprune.errors import UserError
from edgeprune.layers.pruned_attention import PrunedAttention


#: prefix-token parameters of a timm ViT that write the stream
PREFIX_TOKENS = ("cls_token", "reg_token", "dist_token")
#: classifier heads that read the final norm
HEADS = ("head", "head_dist")


@dataclasses.dataclass
class StreamParts:
    """Where the residual stream of a ViT is written and read.

    Attributes:
        final_norm_name: "norm" or "fc_norm" (the LayerNorm the head reads).
        final_norm: that LayerNorm; token_pool: the head reads the first token only.
        heads: the Linear heads (names in :data:`HEADS`) after the final norm.
        tokens: names of the prefix-token parameters present (:data:`PREFIX_TOKENS`).
    """

    final_norm_name: str
    final_norm: nn.LayerNorm
    token_pool: bool
    heads: list[str]
    tokens: list[str]


def _is_layernorm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1


def stream_parts(anatomy: ViTAnatomy) -> StreamParts:
    """The stream's final norm, heads and prefix tokens, after checking that every piece can be folded.

    Raises:
        UserError: a wrapper model with a head of its own (the saliency decoder), a pre-norm
            (``norm_pre``), attention pooling, a non-LayerNorm norm, no Linear head after the final
            norm, or a block without LayerNorms.
    """
    vit = anatomy.vit
    if anatomy.model is not vit:
        raise UserError(f"--embed-sparsity: {type(anatomy.model).__name__} reads the stream with a head of its "
                        "own; embed slicing supports timm ViT classifiers")
    if not isinstance(getattr(vit, "norm_pre", nn.Identity()), nn.Identity):
        raise UserError("--embed-sparsity: the model has a pre-norm (norm_pre), not supported")
    if getattr(vit, "attn_pool", None) is not None:
        raise UserError("--embed-sparsity: attention pooling (global_pool='map') is not supported")
    fc_norm, norm = getattr(vit, "fc_norm", nn.Identity()), getattr(vit, "norm", nn.Identity())
    if _is_layernorm(fc_norm) and isinstance(norm, nn.Identity):
        name, final = "fc_norm", fc_norm
    elif _is_layernorm(norm) and isinstance(fc_norm, nn.Identity):
        name, final = "norm", norm
    else:
        raise UserError("--embed-sparsity: the model needs exactly one final LayerNorm (norm or fc_norm)")
    heads = [h for h in HEADS if isinstance(getattr(vit, h, None), nn.Linear)]
    if "head" not in heads:
        raise UserError("--embed-sparsity: the model has no Linear classifier head after its final norm "
                        "(the pruned stream's basis must be folded into a reader)")
    for b in anatomy.blocks:
        if not (_is_layernorm(b.block.norm1) and _is_layernorm(b.block.norm2)):
            raise UserError(f"--embed-sparsity: block {b.index}'s norms are not LayerNorms")
    tokens = [t for t in PREFIX_TOKENS if isinstance(getattr(vit, t, None), nn.Parameter)]
    return StreamParts(name, final, getattr(vit, "global_pool", "token") == "token", heads, tokens)


def _new_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def fold_layerscale(anatomy: ViTAnatomy) -> None:
    """Fold every block's LayerScale ``diag(g)`` into ``proj`` / ``fc2`` (rows and bias) and replace
    it by Identity, in place (exact)."""
    for b in anatomy.blocks:
        for ls_name, lin in (("ls1", b.proj), ("ls2", b.fc2)):
            ls = getattr(b.block, ls_name, None)
            if ls is None or isinstance(ls, nn.Identity):
                continue
            g = ls.gamma.detach()
            with torch.no_grad():
                lin.weight.mul_(g[:, None])
                if lin.bias is not None:
                    lin.bias.mul_(g)
            setattr(b.block, ls_name, nn.Identity())
        b.ls1 = b.ls2 = None


def map_writers(anatomy: ViTAnatomy, parts: StreamParts, q: torch.Tensor) -> None:
    """Replace every stream writer's output ``y`` by ``q @ y``, in place (LayerScales folded first).

    Args:
        q: (D', D) float64; the writers then write a D'-wide stream. The patch-embedding conv,
            position embedding, prefix tokens, every ``proj`` and ``fc2`` are replaced / resized.
    """
    fold_layerscale(anatomy)
    vit = anatomy.vit
    conv = vit.patch_embed.proj
    new = nn.Conv2d(conv.in_channels, q.shape[0], conv.kernel_size, conv.stride, conv.padding,
                    bias=conv.bias is not None)
    with torch.no_grad():
        new.weight.copy_(torch.einsum("ed,dchw->echw", q, conv.weight.double()).float())
        if conv.bias is not None:
            new.bias.copy_((q @ conv.bias.double()).float())
    vit.patch_embed.proj = new
    for name in ["pos_embed"] + parts.tokens:
        p = getattr(vit, name, None)
        if isinstance(p, nn.Parameter):
            setattr(vit, name, nn.Parameter((p.detach().double() @ q.T).float()))
    for b in anatomy.blocks:
        for owner, attr in ((b.attn, "proj"), (b.mlp, "fc2")):
            lin = getattr(owner, attr)
            bias = None if lin.bias is None else (q @ lin.bias.detach().double()).float()
            setattr(owner, attr, _new_linear((q @ lin.weight.detach().double()).float(), bias))
        b.proj, b.fc2 = b.attn.proj, b.mlp.fc2


def map_readers(anatomy: ViTAnatomy, parts: StreamParts, r: torch.Tensor) -> None:
    """Replace every stream reader's input ``u`` (a norm's output) by ``r @ u``: ``W <- W r``, in place.

    Args:
        r: (D, D') float64; ``qkv``, ``fc1`` (a gated MLP's ``fc1_g`` and ``fc1_x``) and the heads then
            read a D'-wide norm output.
    """
    vit = anatomy.vit
    for b in anatomy.blocks:
        for owner, attr in ((b.attn, "qkv"), *((b.mlp, a) for a, _ in b.mlp_inputs)):
            lin = getattr(owner, attr)
            bias = None if lin.bias is None else lin.bias.detach()
            setattr(owner, attr, _new_linear((lin.weight.detach().double() @ r).float(), bias))
        b.qkv = b.attn.qkv
        b.fc1 = b.mlp.fc1 if b.fc1_gate is None else b.mlp.fc1_x
        b.fc1_gate = None if b.fc1_gate is None else b.mlp.fc1_g
    for h in parts.heads:
        lin = getattr(vit, h)
        setattr(vit, h, _new_linear((lin.weight.detach().double() @ r).float(),
                                    None if lin.bias is None else lin.bias.detach()))


def _replace_norm(norm: nn.LayerNorm, dim: int, dense_dim: int) -> nn.LayerNorm:
    new = nn.LayerNorm(dim, eps=float(norm.eps) * dense_dim / dim, elementwise_affine=norm.weight is not None,
                       bias=norm.bias is not None)
    return new


def resize_stream(anatomy: ViTAnatomy, parts: StreamParts, dim: int) -> None:
    """Give the model a ``dim``-wide stream's norms, attention modules and width attributes, in place
    (the writers / readers are resized by :func:`map_writers` / :func:`map_readers`). Attention
    modules become :class:`PrunedAttention` (weights copied) reading ``dim``."""
    dense = anatomy.embed_dim
    vit = anatomy.vit
    for b in anatomy.blocks:
        b.block.norm1 = _replace_norm(b.block.norm1, dim, dense)
        b.block.norm2 = _replace_norm(b.block.norm2, dim, dense)
        old = b.attn
        if not isinstance(old, PrunedAttention):
            new = PrunedAttention(old.qkv.in_features, b.num_heads, b.qk_dim, b.v_dim,
                                  qkv_bias=old.qkv.bias is not None, proj_bias=old.proj.bias is not None,
                                  dense_head_dim=b.head_dim)
            new.qkv, new.proj = old.qkv, old.proj
            b.block.attn = b.attn = new
    setattr(vit, parts.final_norm_name, _replace_norm(parts.final_norm, dim, dense))
    parts.final_norm = getattr(vit, parts.final_norm_name)
    for attr in ("embed_dim", "num_features", "head_hidden_size"):
        if hasattr(vit, attr):
            setattr(vit, attr, dim)
    anatomy.embed_dim = dim


def apply_embed_structure(model: nn.Module, embed: dict | None) -> nn.Module:
    """Give a freshly built dense model the sliced stream of a run record's ``embed`` entry, in place
    (random weights; for ``load_run`` before ``apply_structure`` and ``load_state_dict``).

    A no-op without an entry.
    """
    if not embed:
        return model
    anatomy = find_anatomy(model)
    parts = stream_parts(anatomy)
    dim = int(embed["embed_dim"])
    fold_layerscale(anatomy)
    resize_stream(anatomy, parts, dim)
    eye = torch.zeros(dim, anatomy.blocks[0].proj.out_features, dtype=torch.float64)
    map_writers(anatomy, parts, eye)
    map_readers(anatomy, parts, torch.zeros(eye.shape[1], dim, dtype=torch.float64))
    return model
