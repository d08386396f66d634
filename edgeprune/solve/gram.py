"""The Gram matrix ``X^T X`` of streamed activations, formed from its upper block triangle (the largest
product of the calibration statistics and of the heads' refit: ``edgeprune.calibration.mlp_stats``,
``edgeprune.solve.attn_heads``)."""

from __future__ import annotations

import torch


def _mirror_upper(g: torch.Tensor) -> torch.Tensor:
    """A square (b, b) matrix with its strict lower triangle replaced by the upper one's mirror.

    ``x^T x`` from a GEMM is symmetric only up to rounding (BLAS kernels may sum the two
    triangles in different orders, depending on the CPU); mirroring makes it exactly symmetric.
    """
    return torch.triu(g) + torch.triu(g, 1).T


def symmetric_gram(x: torch.Tensor, block: int = 384, out: torch.Tensor | None = None) -> torch.Tensor:
    """X^T X for x (T, D), computing only the upper block triangle and mirroring it.

    One GEMM per block row (``x[:, i:i+b]^T x[:, i:]``): k = ceil(D / block) block rows cost
    (k + 1) / (2k) of a full GEMM (62% for D = 1536, block 384), each still one large GEMM
    (fewer, wider products run closer to peak than k(k+1)/2 square blocks).

    Args:
        x: (T, D) activations, any float dtype; the products are formed in x's dtype.
        block: rows of the Gram per GEMM.
        out: optional (D, D) accumulator (e.g. float64) to which X^T X is *added* in place
            (the float32 block products are summed into it, no (D, D) temporary).

    Returns:
        (D, D) X^T X (``out`` when given), exactly symmetric.
    """
    d = x.shape[1]
    if out is None:
        out = torch.zeros(d, d, dtype=x.dtype, device=x.device)
    if d <= block:
        out += _mirror_upper(x.T @ x)
        return out
    for i in range(0, d, block):
        g = x[:, i:i + block].T @ x[:, i:]  # (b, D - i): rows i..i+b of the upper triangle
        b = g.shape[0]
        g[:, :b] = _mirror_upper(g[:, :b])  # a GEMM's diagonal block need not be bitwise symmetric
        out[i:i + block, i:] += g
        if i + block < d:
            out[i + block:, i:i + block] += g[:, block:].T
    return out
