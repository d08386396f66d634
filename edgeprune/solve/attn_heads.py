"""Removed attention heads compensated through the MLP that follows them: the closed-form refit
of ``fc2`` to the dense block's output (METHODS.md §5, "V/O dims and whole heads"; docs/heads.md).

The ``proj`` fold (``edgeprune.solve.mlp_ridge``) predicts the removed heads' outputs ``z_P`` from
the kept heads' ``z_S``: one token's kept value channels, the only thing ``proj`` sees. The MLP of
the same block sees more: its hidden ``h~ = act(fc1(norm2(x + attn~(x))))`` is a nonlinear function
of the token's whole residual state after the (pruned) attention, and ``fc2`` adds to the same
residual stream as ``proj``. So after the attention of block i is pruned (and its ``proj`` folded),
``fc2`` is refit so that the pruned block reproduces the *dense* block's output:

    y = x + ls1(attn(x)) + ls2(W2 h + b2)          (dense block, input x)
    y~ = x + ls1(attn~(x)) + ls2(W2' h~_S + b2')   (pruned block, same input)

    min_{W, b}  E || t - W h~_S - b ||^2 + lam || W - W0 ||_F^2,
    t = o~ + ls2^-1 (y - y~_0)

where ``o~`` / ``y~_0`` are fc2's output and the block's output before the refit (``W0``, ``b0``:
fc2 after the CORP MLP fold), so ``t`` is what fc2 must output for ``y~ = y``. ``ls2^-1`` divides
by LayerScale's gamma (identity without one). The solution is

    W' = W0 + (C_th - W0 Sigma_hh) (Sigma_hh + lam I)^-1,     b' = mu_t - W' mu_h,

with ``Sigma_hh`` the centred covariance of ``h~_S``, ``C_th = Cov(t, h~_S)`` and the scale-free
ridge ``lam = alpha tr(Sigma_hh) / |S|`` (``mlp_ridge.ridge_lambda``). Invariant: when the pruned
block already equals the dense one (nothing removed) ``t = W0 h~ + b0`` exactly, so
``C_th = W0 Sigma_hh``, ``W' = W0`` and ``b' = b0``. The refit is never worse on the calibration
set than keeping W0 (W0 is a feasible point of the objective it minimises; with lam > 0 up to
the ridge term). All solves are float64 Cholesky.
"""

from __future__ import annotations

import torch

from edgeprune.solve.gram import symmetric_gram
from edgeprune.solve.mlp_ridge import ridge_lambda


class OutputFitStatistics:
    """Streaming statistics of paired rows (h, t) for the linear fit ``t ~ W h + b``.

    Sums in float64 over shifted data (each stream shifted by its first batch's mean, as in
    :class:`~edgeprune.calibration.mlp_stats.MLPStatistics`); per-batch products in ``gram_dtype``.
    Memory: (m^2 + D m) float64.

    Args:
        in_dim: m (channels of h); out_dim: D (channels of t); gram_dtype: per-batch product dtype.
    """

    def __init__(self, in_dim: int, out_dim: int, gram_dtype: torch.dtype = torch.float32) -> None:
        self.in_dim, self.out_dim, self.gram_dtype = in_dim, out_dim, gram_dtype
        self.count = 0
        self._shift_h: torch.Tensor | None = None
        self._shift_t: torch.Tensor | None = None
        self._sum_h = torch.zeros(in_dim, dtype=torch.float64)
        self._sum_t = torch.zeros(out_dim, dtype=torch.float64)
        self._hh = torch.zeros(in_dim, in_dim, dtype=torch.float64)
        self._th = torch.zeros(out_dim, in_dim, dtype=torch.float64)
        self._tt = 0.0

    @torch.no_grad()
    def add_batch(self, h: torch.Tensor, t: torch.Tensor) -> None:
        """Add rows h (..., m) and their targets t (..., D) (same leading shape).

        Raises:
            ValueError: the leading shapes differ or a last dim is wrong.
        """
        if h.shape[:-1] != t.shape[:-1] or h.shape[-1] != self.in_dim or t.shape[-1] != self.out_dim:
            raise ValueError(f"expected (..., {self.in_dim}) and (..., {self.out_dim}) with one leading "
                             f"shape, got {tuple(h.shape)} and {tuple(t.shape)}")
        h2, t2 = h.reshape(-1, self.in_dim).cpu(), t.reshape(-1, self.out_dim).cpu()
        if h2.shape[0] == 0:
            return
        if self._shift_h is None:
            self._shift_h = h2.double().mean(0).to(self.gram_dtype).double()
            self._shift_t = t2.double().mean(0).to(self.gram_dtype).double()
        ch = h2.to(self.gram_dtype) - self._shift_h.to(self.gram_dtype)
        ct = t2.to(self.gram_dtype) - self._shift_t.to(self.gram_dtype)
        self._sum_h += ch.sum(0).double()
        self._sum_t += ct.sum(0).double()
        symmetric_gram(ch, out=self._hh)  # upper block triangle only, mirrored (62% of the GEMM for m = 1536)
        self._th += (ct.T @ ch).double()
        self._tt += float(torch.linalg.vector_norm(ct, dtype=torch.float64)) ** 2  # summed in float64, no copy
        self.count += h2.shape[0]

    def unshift(self) -> None:
        """Re-express the sums about a zero shift (in place): sums of several processes, each
        shifted by its own first batch, can then be added (``edgeprune.distributed``)."""
        if self._shift_h is None:
            self._shift_h = torch.zeros(self.in_dim, dtype=torch.float64)
            self._shift_t = torch.zeros(self.out_dim, dtype=torch.float64)
            return
        n, sh, st = self.count, self._shift_h, self._shift_t
        self._tt += float(2.0 * st @ self._sum_t + n * st @ st)
        self._hh += torch.outer(sh, self._sum_h) + torch.outer(self._sum_h, sh) + n * torch.outer(sh, sh)
        self._th += torch.outer(st, self._sum_h) + torch.outer(self._sum_t, sh) + n * torch.outer(st, sh)
        self._sum_h += n * sh
        self._sum_t += n * st
        self._shift_h, self._shift_t = torch.zeros_like(sh), torch.zeros_like(st)

    def all_reduce(self, reduce_sum) -> None:
        """Sum the statistics over processes (in place) with ``reduce_sum(tensor) -> tensor``
        (``edgeprune.distributed.all_reduce_sum``)."""
        self.unshift()
        self._sum_h, self._sum_t = reduce_sum(self._sum_h), reduce_sum(self._sum_t)
        self._hh, self._th = reduce_sum(self._hh), reduce_sum(self._th)
        rest = reduce_sum(torch.tensor([self._tt, float(self.count)], dtype=torch.float64))
        self._tt, self.count = float(rest[0]), int(rest[1])

    def _check(self) -> None:
        if self.count == 0:
            raise RuntimeError("OutputFitStatistics: no rows were added")

    @property
    def mean_in(self) -> torch.Tensor:
        """mu_h (m,) float64."""
        self._check()
        return self._shift_h + self._sum_h / self.count

    @property
    def mean_out(self) -> torch.Tensor:
        """mu_t (D,) float64."""
        self._check()
        return self._shift_t + self._sum_t / self.count

    @property
    def cov_in(self) -> torch.Tensor:
        """Sigma_hh (m, m) float64, centred."""
        self._check()
        m = self._sum_h / self.count
        return self._hh / self.count - torch.outer(m, m)

    @property
    def cross(self) -> torch.Tensor:
        """C_th = Cov(t, h) (D, m) float64."""
        self._check()
        return self._th / self.count - torch.outer(self._sum_t / self.count, self._sum_h / self.count)

    def residual(self, weight: torch.Tensor, bias: torch.Tensor | None) -> float:
        """E ||t - W h - b||^2 per row (float64) for a candidate ``weight`` (D, m) and ``bias`` (D,)."""
        self._check()
        w = weight.double()
        b = torch.zeros(self.out_dim, dtype=torch.float64) if bias is None else bias.double()
        n = self.count
        mh, mt = self._sum_h / n, self._sum_t / n           # shifted means
        e = mt - w @ mh - (b - self._shift_t + w @ self._shift_h)  # mean of the residual
        # E||(t - mt) - W (h - mh)||^2 + ||e||^2 from the shifted second moments
        tt = self._tt / n - float(mt @ mt)
        th = self.cross
        hh = self.cov_in
        quad = tt - 2.0 * float((w * th).sum()) + float(((w @ hh) * w).sum())
        return quad + float(e @ e)


def refit_linear(stats: OutputFitStatistics, weight: torch.Tensor, alpha: float
                 ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The ridge refit toward ``weight`` (module doc): ``W' = W0 + (C_th - W0 Sigma_hh)(Sigma_hh +
    lam I)^-1``, ``b' = mu_t - W' mu_h``.

    Args:
        stats: the (h~_S, t) statistics of the layer to refit.
        weight: W0 (D, m), the layer's current weight (the prior). Its bias b0 is not needed: it
            enters only through the targets t, and the intercept is refit.
        alpha: scale-free ridge strength (>= 0).

    Returns:
        W' (D, m) and b' (D,) in ``weight``'s dtype, and lam.

    Raises:
        ValueError: alpha < 0; torch.linalg.LinAlgError: Sigma_hh + lam I not positive definite
            (alpha = 0 with dependent channels).
    """
    w0 = weight.double()
    cov = stats.cov_in
    lam = ridge_lambda(cov, alpha)
    a = cov + lam * torch.eye(cov.shape[0], dtype=torch.float64)
    chol = torch.linalg.cholesky(a)
    r = stats.cross - w0 @ cov                                   # (D, m)
    w = w0 + torch.cholesky_solve(r.T.contiguous(), chol).T      # R A^-1 (A symmetric)
    b = stats.mean_out - w @ stats.mean_in
    return w.to(weight.dtype), b.to(weight.dtype), lam
