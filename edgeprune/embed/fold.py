"""Folds that make a ViT's LayerNorms commute with a rotation of the residual stream (issue 33).

A timm ViT's residual stream is written by the patch embedding (conv + bias), the position
embedding, the prefix tokens (class / register / distillation) and every block's ``proj`` and
``fc2`` (after their LayerScale), and read only through LayerNorms: ``norm1`` -> ``qkv``,
``norm2`` -> ``fc1``, and the final ``norm`` (or ``fc_norm`` after average pooling) -> the head(s).

* Mean fold (SliceGPT, Ashkboos et al. 2024, §3.3): a LayerNorm reads only the centred stream
  ``x_c = C x`` with ``C = I - 1 1^T / D``. Centring every writer (``W <- C W``, ``b <- C b``; the
  LayerScale ``diag(g)`` folded in first) makes the stream itself centred, exactly -- the model's
  outputs do not change, and each LayerNorm is then ``gamma * x / sqrt(|x|^2 / D + eps) + beta``.
* Affine fold: ``gamma`` / ``beta`` move into the readers, ``W_r <- W_r diag(gamma)``,
  ``b_r <- b_r + W_r beta`` (the norm keeps ``gamma = 1``, ``beta = 0``), again exact.

``edgeprune.residual`` (model surgery, below this package) finds the writers and readers
(:func:`~edgeprune.residual.stream_parts`, refusing what it cannot fold) and applies a matrix to every
writer's output / reader's input (:func:`~edgeprune.residual.map_writers` /
:func:`~edgeprune.residual.map_readers`; the rotation of ``edgeprune.embed.rotate`` uses them with
non-square matrices: new modules of the new width replace the old ones); they are handed on here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from edgeprune.anatomy import ViTAnatomy
from edgeprune.errors import UserError
from edgeprune.residual import (HEADS, PREFIX_TOKENS, StreamParts, fold_layerscale,  # noqa: F401 (handed on)
                                map_readers, map_writers, stream_parts)


def _fold_affine(norm: nn.LayerNorm, readers: list[nn.Linear]) -> None:
    g = norm.weight.detach().double() if norm.weight is not None else None
    beta = norm.bias.detach().double() if norm.bias is not None else None
    with torch.no_grad():
        for lin in readers:
            w = lin.weight.double()
            if beta is not None:
                shift = w @ beta
                if lin.bias is None:
                    raise UserError("--embed-sparsity: a reader of a LayerNorm with a bias has no bias")
                lin.bias.copy_((lin.bias.double() + shift).float())
            if g is not None:
                lin.weight.copy_((w * g[None, :]).float())
        if norm.weight is not None:
            norm.weight.fill_(1.0)
        if norm.bias is not None:
            norm.bias.zero_()


def fold_norm_affine(anatomy: ViTAnatomy, parts: StreamParts) -> None:
    """Fold each LayerNorm's ``gamma`` / ``beta`` into its readers (``qkv``, ``fc1``, the heads) and
    set them to 1 / 0, in place (exact)."""
    for b in anatomy.blocks:
        _fold_affine(b.block.norm1, [b.qkv])
        _fold_affine(b.block.norm2, [lin for _, lin in b.mlp_inputs])  # fc1 (a gated MLP: fc1_g, fc1_x)
    _fold_affine(parts.final_norm, [getattr(anatomy.vit, h) for h in parts.heads])


def centring(dim: int) -> torch.Tensor:
    """``C = I - 1 1^T / D`` (D, D) float64: the projection onto the zero-mean subspace."""
    return torch.eye(dim, dtype=torch.float64) - 1.0 / dim


def fold_centring_and_affine(anatomy: ViTAnatomy) -> StreamParts:
    """Mean fold (writers centred) and affine fold (gamma/beta into the readers), in place; exact.

    Returns:
        the model's :class:`StreamParts`.

    Raises:
        UserError: as :func:`stream_parts`.
    """
    parts = stream_parts(anatomy)
    map_writers(anatomy, parts, centring(anatomy.embed_dim))
    fold_norm_affine(anatomy, parts)
    return parts
