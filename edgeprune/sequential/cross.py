"""Streaming cross covariance of the dense and the pruned token stream (sequential calibration)."""

from __future__ import annotations

import torch


class CrossStatistics:
    """Streaming cross covariance ``Cov(h, h~)`` of two paired activation streams.

    Sums in float64 over shifted data (each stream shifted by its first batch's mean, as in
    :class:`~edgeprune.calibration.mlp_stats.MLPStatistics`); per-batch products in ``gram_dtype``.
    Memory: D^2 float64.

    Args:
        dim: D (channels of both streams); gram_dtype: dtype of the per-batch product.
    """

    def __init__(self, dim: int, gram_dtype: torch.dtype = torch.float32) -> None:
        self.dim, self.gram_dtype = dim, gram_dtype
        self.count = 0
        self._shift_d: torch.Tensor | None = None
        self._shift_p: torch.Tensor | None = None
        self._sum_d = torch.zeros(dim, dtype=torch.float64)
        self._sum_p = torch.zeros(dim, dtype=torch.float64)
        self._gram = torch.zeros(dim, dim, dtype=torch.float64)

    @torch.no_grad()
    def add_batch(self, dense: torch.Tensor, pruned: torch.Tensor) -> None:
        """Add paired activations (..., D) of the dense and the pruned stream (same tokens).

        Raises:
            ValueError: shapes differ or the last dim is not D.
        """
        if dense.shape != pruned.shape or dense.shape[-1] != self.dim:
            raise ValueError(f"expected two (..., {self.dim}) tensors of one shape, got "
                             f"{tuple(dense.shape)} and {tuple(pruned.shape)}")
        xd, xp = dense.reshape(-1, self.dim), pruned.reshape(-1, self.dim)
        if xd.shape[0] == 0:
            return
        if self._shift_d is None:
            # stored as subtracted below (rounded to gram_dtype), so the means add back exactly it
            self._shift_d = xd.double().mean(0).to(self.gram_dtype).double()
            self._shift_p = xp.double().mean(0).to(self.gram_dtype).double()
        cd = xd.to(self.gram_dtype) - self._shift_d.to(self.gram_dtype)
        cp = xp.to(self.gram_dtype) - self._shift_p.to(self.gram_dtype)
        self._sum_d += cd.sum(0)
        self._sum_p += cp.sum(0)
        self._gram += cd.T @ cp
        self.count += xd.shape[0]

    def _check(self) -> None:
        if self.count == 0:
            raise RuntimeError("CrossStatistics: no activations were added")

    @property
    def mean_dense(self) -> torch.Tensor:
        """mu (D,) float64 of the dense stream."""
        self._check()
        return self._shift_d + self._sum_d / self.count

    @property
    def mean_pruned(self) -> torch.Tensor:
        """mu~ (D,) float64 of the pruned stream."""
        self._check()
        return self._shift_p + self._sum_p / self.count

    @property
    def cov(self) -> torch.Tensor:
        """Cov(h, h~) (D, D) float64 (1/N), rows dense channels, columns pruned channels."""
        self._check()
        md, mp = self._sum_d / self.count, self._sum_p / self.count
        return self._gram / self.count - torch.outer(md, mp)
