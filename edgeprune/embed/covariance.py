"""Streaming second moment of the residual stream as its LayerNorms read it (issue 33).

Every reader of the stream sees ``u = x_c / sqrt(|x_c|^2 / D + eps)`` (the centred token ``x_c``
scaled to RMS ~1; after ``edgeprune.embed.fold`` the norm's affine sits in the reader). Slicing the
stream to a subspace ``V`` changes that input by ``(I - V V^T) u``, so the subspace that loses the
least, summed over readers, is the top eigenspace of

    M = sum_r  E_r[ u u^T ]        (r over norm1 / norm2 of every block and the final norm)

the normalised second moment (uncentred over tokens: the slice cannot restore a dropped mean), each
reader weighted equally (``E_r`` averages over its rows). SliceGPT (Ashkboos et al. 2024, §3.4)
uses the same RMSNorm outputs per layer. The final norm contributes the rows the head reads: the
class token with ``global_pool="token"``, otherwise every row it normalises (the pooled token for
``fc_norm``).

Sums are float32 products per batch added into float64 accumulators (like
``edgeprune.calibration``); activations are never kept.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.nn as nn

from edgeprune.anatomy import ViTAnatomy
from edgeprune.embed.fold import StreamParts


class ReaderMoment:
    """``sum u u^T`` (D, D) float64 and the row count of one reader (a LayerNorm's input)."""

    def __init__(self, norm: nn.LayerNorm, first_token_only: bool = False) -> None:
        self.eps = float(norm.eps)
        self.first_token_only = first_token_only
        self.sum: torch.Tensor | None = None
        self.count = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """Accumulate one LayerNorm input ``x`` (B, n, D) or (B, D)."""
        if self.first_token_only and x.dim() == 3:
            x = x[:, 0]
        rows = x.detach().reshape(-1, x.shape[-1]).float()
        rows = rows - rows.mean(dim=1, keepdim=True)
        d = rows.shape[1]
        u = rows / torch.sqrt(rows.pow(2).sum(dim=1, keepdim=True) / d + self.eps)
        g = (u.T @ u).double().cpu()
        self.sum = g if self.sum is None else self.sum + g
        self.count += rows.shape[0]

    def moment(self) -> torch.Tensor:
        """``E[u u^T]`` (D, D) float64.

        Raises:
            RuntimeError: nothing was accumulated.
        """
        if self.sum is None or self.count == 0:
            raise RuntimeError("stream moment: no rows accumulated")
        return self.sum / self.count


def stream_moment(anatomy: ViTAnatomy, parts: StreamParts, batches: Iterable[torch.Tensor],
                  per_reader: bool = False) -> tuple[torch.Tensor | list[torch.Tensor], dict]:
    """One pass over ``batches`` collecting :class:`ReaderMoment` at every stream reader.

    Args:
        anatomy: the model (folded or not: the rows are centred here).
        parts: its :func:`~edgeprune.embed.fold.stream_parts`.
        batches: (B, C, H, W) calibration images.
        per_reader: return the list of per-reader moments (norm1, norm2 per block, then the final
            norm) instead of their sum.

    Returns:
        (``M`` (D, D) float64 or the list, info dict with ``images``, ``seconds``, ``readers``).

    Raises:
        UserError: (from the data) mis-shaped input; RuntimeError: no batches.
    """
    readers: list[tuple[nn.Module, ReaderMoment]] = []
    for b in anatomy.blocks:
        readers += [(b.block.norm1, ReaderMoment(b.block.norm1)), (b.block.norm2, ReaderMoment(b.block.norm2))]
    readers.append((parts.final_norm, ReaderMoment(parts.final_norm,
                                                   parts.token_pool and parts.final_norm_name == "norm")))
    handles = [m.register_forward_pre_hook(lambda _m, args, acc=acc: acc.add_batch(args[0])) for m, acc in readers]
    t0 = time.perf_counter()
    images = 0
    model = anatomy.model
    try:
        with torch.no_grad():
            for x in batches:
                model(x)
                images += x.shape[0]
    finally:
        for h in handles:
            h.remove()
    moments = [acc.moment() for _, acc in readers]
    info = {"images": images, "seconds": time.perf_counter() - t0, "readers": len(readers)}
    return (moments if per_reader else torch.stack(moments).sum(0)), info
