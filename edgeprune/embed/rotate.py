"""Rotate the (folded, centred) residual stream into its principal subspace and slice it to D' (issue 33).

After ``edgeprune.embed.fold`` the stream ``x_c`` is centred and every LayerNorm is
``x_c / sqrt(|x_c|^2 / D + eps)`` (affine in the readers). With ``V`` (D, D'-1) the top eigenvectors
of the readers' moment (``edgeprune.embed.covariance``), orthogonal to ``1``, and ``B`` (D', D'-1)
orthonormal columns orthogonal to ``1_{D'}`` (:func:`ones_complement`), the new stream is

    x' = B V^T x_c            (mean(x') = 0, |x'| = |V^T x_c| = |x_c| when x_c lies in span V)

so a *standard* LayerNorm of width D' with ``eps' = eps D / D'`` and no affine gives
``sqrt(D'/D) B V^T x_c / sqrt(|x_c|^2/D + eps)``. Hence (our derivation, SliceGPT §3.3-3.4 with an
embedding ``B`` that keeps LayerNorm instead of RMSNorm):

* writers: ``W_w <- B V^T W_w``, ``b_w <- B V^T b_w`` (patch conv, position embedding, prefix
  tokens, ``proj``, ``fc2``; the centring ``C`` is already in them and ``V^T C = V^T``);
* readers: ``W_r <- sqrt(D/D') W_r V B^T`` (``qkv``, ``fc1``, the heads; gamma already folded);
* norms: ``LayerNorm(D', eps D / D')`` with weight 1, bias 0.

At D' = D, ``V V^T = C`` and the model is unchanged (the centred stream has D-1 dims). The model
stays a timm ViT of width D': ONNX exports LayerNormalization of width D'. Attention becomes
edgeprune's :class:`PrunedAttention` (timm's ``Attention`` ties its input width to heads x head_dim).
"""

from __future__ import annotations

import math

import torch

from edgeprune.anatomy import ViTAnatomy
from edgeprune.errors import UserError
from edgeprune.residual import StreamParts, map_readers, map_writers, resize_stream  # noqa: F401 (handed on)


def ones_complement(dim: int) -> torch.Tensor:
    """(dim, dim-1) float64 orthonormal columns orthogonal to the all-ones vector (QR of
    ``[1, e_1 .. e_{dim-1}]`` without its first column)."""
    if dim < 2:
        raise UserError(f"the embedding dim must keep at least 2 channels, got {dim}")
    a = torch.eye(dim, dtype=torch.float64)[:, : dim - 1]
    a = torch.cat([torch.ones(dim, 1, dtype=torch.float64) / math.sqrt(dim), a], dim=1)
    qm, _ = torch.linalg.qr(a)
    return qm[:, 1:].contiguous()


def principal_basis(moment: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` eigenvectors of ``moment`` restricted to the zero-mean subspace.

    Args:
        moment: (D, D) symmetric PSD float64; k: 1 <= k <= D-1.

    Returns:
        (V (D, k) float64 orthonormal, orthogonal to 1 to round-off; all D-1 eigenvalues, descending).
    """
    u = ones_complement(moment.shape[0])
    s = u.T @ moment.double() @ u
    s = (s + s.T) / 2
    evals, evecs = torch.linalg.eigh(s)
    order = torch.argsort(evals, descending=True)
    v = u @ evecs[:, order[:k]]
    return v, evals[order]


def rotate_and_slice(anatomy: ViTAnatomy, parts: StreamParts, v: torch.Tensor, dim: int) -> None:
    """Rotate the folded stream into ``V`` and embed it in ``dim`` channels (module doc), in place.

    Args:
        anatomy, parts: a model after :func:`~edgeprune.embed.fold.fold_centring_and_affine`.
        v: (D, dim-1) float64 orthonormal, orthogonal to 1.
        dim: D', 2 <= D' <= D.

    Raises:
        UserError: ``v`` has the wrong shape.
    """
    dense = anatomy.embed_dim
    if v.shape != (dense, dim - 1):
        raise UserError(f"embed rotation: basis {tuple(v.shape)} does not fit D={dense}, D'={dim}")
    b = ones_complement(dim)
    resize_stream(anatomy, parts, dim)
    map_writers(anatomy, parts, b @ v.T)
    map_readers(anatomy, parts, math.sqrt(dense / dim) * (v @ b.T))
