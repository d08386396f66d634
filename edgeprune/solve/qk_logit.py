"""CORP's closed-form Q/K compensation: pruned logit contributions from the kept dims.

corp-v1 §3.3, eq. 12-16 and App. B.2 eq. 25-29; corp-v2 eq. 14-15. For one head, image i, queries
Q and keys K (n x d_h), kept dims S (d' of them) and pruned dims P, the logits are
``Q_S K_S^T + Q_P K_P^T``. Find M (d' x d') minimising

    sum_i || Q_P,i K_P,i^T - Q_S,i M K_S,i^T ||_F^2 + lam ||M||_F^2.

With ``Gq_i = Q_S^T Q_S``, ``Gk_i = K_S^T K_S``, ``Cq_i = Q_S^T Q_P``, ``Ck_i = K_P^T K_S`` the normal
equation is ``sum_i Gq_i M Gk_i + lam M = sum_i Cq_i Ck_i``. Row-major vectorised
(``vec(A M B) = (A (x) B^T) vec(M)``; Gk is symmetric):

    (sum_i Gq_i (x) Gk_i + lam I) vec(M) = vec(sum_i Cq_i Ck_i)          (d'^2 x d'^2)

solved exactly (float64 Cholesky) -- not the pooled-Gram Sylvester approximation, which mixes tokens
of different images. ``sum_i Gq_i (x) Gk_i`` is one GEMM of the packed upper triangles of the
per-image Grams (they are symmetric), unpacked by a gather; all heads of a layer at once
(:func:`kronecker_systems`, batch dim = heads).
Ridge lambda is scale-free: ``lam = alpha * tr(K) / d'^2`` (alpha times the system's mean diagonal).

Fold (METHODS.md §1): SVD ``I + M = R Sigma T^T``; ``W_Q,S <- (R Sigma^1/2)^T W_Q,S``,
``W_K,S <- (T Sigma^1/2)^T W_K,S`` (rows are output dims; biases likewise), so that
``Q_S' K_S'^T = Q_S (I + M) K_S^T``. Finally the dense scale 1/sqrt(d_h) is kept by multiplying the
query weights and bias by ``sqrt(d'/d_h)`` (attention then uses its default 1/sqrt(d')).
"""

from __future__ import annotations

import functools
import math

import torch

DEFAULT_ALPHA = 1e-3


def kept_blocks_heads(gq: torch.Tensor, gk: torch.Tensor, keep: torch.Tensor, prune: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-image blocks of every head's system at once (batch dim = heads), in float64.

    Args:
        gq, gk: per-image Grams (N, H, d_h, d_h) of Q and K (any float dtype, any device).
        keep: S per head (H, d') int64; prune: P per head (H, p) int64 (on gq's device).

    Returns:
        ``Gq_i[S,S]`` (N, H, d', d'), ``Gk_i[S,S]`` (N, H, d', d') and
        rhs (H, d', d') = sum_i Gq_i[S,P] Gk_i[P,S] per head (corp-v1 eq. 29), all float64, on
        gq's device. Head h's entries are those of :func:`kept_blocks` on ``gq[:, h]``.
    """
    n, h = gq.shape[:2]
    d, p = keep.shape[-1], prune.shape[-1]
    # index first, then widen: only the S rows / S columns are converted to float64 (exact)
    gq_s = torch.take_along_dim(gq, keep[None, :, :, None], dim=2).double()  # rows S of Gq
    gk_s = torch.take_along_dim(gk, keep[None, :, None, :], dim=3).double()  # columns S of Gk
    gq_sp = torch.take_along_dim(gq_s, prune[None, :, None, :], dim=3)       # (N, H, d', p)
    gk_ps = torch.take_along_dim(gk_s, prune[None, :, :, None], dim=2)       # (N, H, p, d')
    # sum_i Gq_i[S,P] Gk_i[P,S] as one batched GEMM over the stacked (image, pruned dim) index
    rhs = (gq_sp.permute(1, 2, 0, 3).reshape(h, d, n * p)
           @ gk_ps.permute(1, 0, 2, 3).reshape(h, n * p, d))
    gq_ss = torch.take_along_dim(gq_s, keep[None, :, None, :], dim=3)
    gk_ss = torch.take_along_dim(gk_s, keep[None, :, :, None], dim=2)
    return gq_ss, gk_ss, rhs


def kept_blocks(gq: torch.Tensor, gk: torch.Tensor, keep: torch.Tensor, prune: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-image blocks of one head's system, in float64 (:func:`kept_blocks_heads`, H = 1).

    Args:
        gq, gk: per-image Grams (N, d_h, d_h) of Q and K (any float dtype).
        keep: S (d',) int64; prune: P (p,) int64.

    Returns:
        ``Gq_i[S,S]`` (N, d', d'), ``Gk_i[S,S]`` (N, d', d') and
        rhs (d', d') = sum_i Gq_i[S,P] Gk_i[P,S] (corp-v1 eq. 29), all float64.
    """
    keep, prune = keep.to(gq.device), prune.to(gq.device)
    gq_ss, gk_ss, rhs = kept_blocks_heads(gq[:, None], gk[:, None], keep[None], prune[None])
    return gq_ss[:, 0], gk_ss[:, 0], rhs[0]


def ridge_lambda(gq_ss: torch.Tensor, gk_ss: torch.Tensor, alpha: float) -> float:
    """``lam = alpha * tr(K) / d'^2`` without forming K: ``tr(A (x) B) = tr(A) tr(B)``, so
    ``tr(K) = sum_i tr(Gq_i[S,S]) tr(Gk_i[S,S])``.

    Args:
        gq_ss, gk_ss: (N, d', d') kept blocks; alpha: scale-free ridge strength (>= 0).

    Raises:
        ValueError: alpha < 0.
    """
    if alpha < 0:
        raise ValueError(f"ridge alpha must be >= 0, got {alpha}")
    d = gq_ss.shape[-1]
    tr = (torch.diagonal(gq_ss, dim1=-2, dim2=-1).sum(-1).double()
          * torch.diagonal(gk_ss, dim1=-2, dim2=-1).sum(-1).double()).sum()
    return float(alpha * tr.clamp_min(0) / (d * d))


@functools.lru_cache(maxsize=8)
def _packed_layout(d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upper-triangle pairs of a d x d symmetric matrix and the gather that unpacks the system.

    Returns (rows, cols, flat): ``rows, cols`` (p,) with p = d(d+1)/2 the pairs a <= b;
    ``flat`` (d^2 * d^2,) int64 such that ``K.flatten() = P.flatten()[flat]`` for the packed
    ``P[u, v] = sum_i Gq_i[pair u] Gk_i[pair v]``: entry ((a,c),(b,e)) of K reads
    ``P[pos(a,b), pos(c,e)]`` with ``pos`` the pair index of an unordered pair.
    """
    rows, cols = torch.triu_indices(d, d)
    p = rows.numel()
    pos = torch.empty(d, d, dtype=torch.int64)
    pos[rows, cols] = torch.arange(p)
    pos[cols, rows] = torch.arange(p)
    # axes (a, c, b, e) of K4 -> row index pos(a,b), column index pos(c,e)
    flat = pos[:, None, :, None] * p + pos[None, :, None, :]
    return rows, cols, flat.reshape(-1)


@functools.lru_cache(maxsize=16)
def _layout_on(d: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_packed_layout` on ``device``, moved there once per (d, device), not per call."""
    return tuple(t.to(device) for t in _packed_layout(d))


def _packed(g: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(..., d, d) -> (..., p): the upper triangle of each symmetrised matrix ``(G + G^T) / 2``."""
    return 0.5 * (g[..., rows, cols] + g[..., cols, rows])


def kronecker_systems(gq: torch.Tensor, gk: torch.Tensor, keep: torch.Tensor, prune: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Assemble the exact normal equations of every head at once (batch dim = heads).

    ``sum_i Gq_i (x) Gk_i`` has d'^4 entries but, the Grams being symmetric, only
    ``p^2 = (d'(d'+1)/2)^2`` distinct ones: they are formed by one batched GEMM of the packed
    upper triangles ((H, p, N) x (H, N, p): ~4x fewer multiply-adds than the full
    (N, d'^2)^T (N, d'^2)) and unpacked by a gather, so K is exactly symmetric. Each Gram is
    symmetrised first (``(G + G^T) / 2``: float32 GEMMs need not return a bitwise symmetric
    ``X^T X``). Everything stays on gq's device (a handful of kernels per call, whatever H; the
    index layout is cached per device), so a CUDA calibration pass accumulates the system on the
    GPU without host transfers.

    Args:
        gq, gk: per-image Grams (N, H, d_h, d_h) of Q and K (any float dtype).
        keep: S per head (H, d') int64; prune: P per head (H, p) int64 (on gq's device).

    Returns:
        K (H, d'^2, d'^2) float64 = sum_i Gq_i[S,S] (x) Gk_i[S,S] per head;
        rhs (H, d', d') float64 = sum_i Gq_i[S,P] Gk_i[P,S] per head.
    """
    gq_ss, gk_ss, rhs = kept_blocks_heads(gq, gk, keep, prune)
    h, d = keep.shape
    rows, cols, flat = _layout_on(d, str(gq_ss.device))
    pq = _packed(gq_ss, rows, cols).permute(1, 2, 0)  # (H, p, N)
    pk = _packed(gk_ss, rows, cols).permute(1, 0, 2)  # (H, N, p)
    packed = (pq @ pk).reshape(h, -1)                 # (H, p * p)
    k_sys = packed[:, flat].reshape(h, d * d, d * d)
    return k_sys, rhs


def kronecker_system(gq: torch.Tensor, gk: torch.Tensor, keep: torch.Tensor, prune: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact normal equations of one head (:func:`kronecker_systems` with H = 1).

    Args:
        gq, gk: per-image Grams (N, d_h, d_h) of Q and K (any float dtype).
        keep: S (d',) int64; prune: P (p,) int64.

    Returns:
        K (d'^2, d'^2) float64 = sum_i Gq_i[S,S] (x) Gk_i[S,S];
        rhs (d', d') float64 = sum_i Gq_i[S,P] Gk_i[P,S].
    """
    keep, prune = keep.to(gq.device), prune.to(gq.device)
    k_sys, rhs = kronecker_systems(gq[:, None], gk[:, None], keep[None], prune[None])
    return k_sys[0], rhs[0]


def solve_logit_compensation(k_sys: torch.Tensor, rhs: torch.Tensor, alpha: float = DEFAULT_ALPHA
                             ) -> tuple[torch.Tensor, float]:
    """Solve ``(K + lam I) vec(M) = vec(rhs)`` for M (d', d') float64; returns (M, lam).

    Raises:
        ValueError: alpha < 0.
        torch.linalg.LinAlgError: K + lam I not positive definite (alpha = 0, degenerate data).
    """
    if alpha < 0:
        raise ValueError(f"ridge alpha must be >= 0, got {alpha}")
    d = rhs.shape[0]
    lam = float(alpha * torch.diagonal(k_sys).mean().clamp_min(0))
    a = k_sys.clone()
    a.diagonal().add_(lam)
    chol = torch.linalg.cholesky(a)
    m = torch.cholesky_solve(rhs.reshape(d * d, 1).double(), chol).reshape(d, d)
    return m, lam


def fold_logit_compensation(wq: torch.Tensor, bq: torch.Tensor | None, wk: torch.Tensor,
                            bk: torch.Tensor | None, m: torch.Tensor | None, head_dim: int
                            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Fold ``I + M`` into one head's kept query/key rows and keep the dense logit scale.

    Args:
        wq, wk: kept rows (d', D); bq, bk: kept biases (d',) or None.
        m: M (d', d') or ``None`` (no compensation: only the scale is folded).
        head_dim: the dense d_h.

    Returns:
        (wq', bq', wk', bk') in the inputs' dtype, such that with attention scale 1/sqrt(d')
        the logits equal ``Q_S (I + M) K_S^T / sqrt(d_h)``.
    """
    d = wq.shape[0]
    wq64, wk64 = wq.double(), wk.double()
    bq64 = None if bq is None else bq.double()
    bk64 = None if bk is None else bk.double()
    if m is not None:
        r, sig, th = torch.linalg.svd(torch.eye(d, dtype=torch.float64) + m.double())
        left = (r * sig.sqrt()).T          # (R Sigma^1/2)^T
        right = (th.T * sig.sqrt()).T      # (T Sigma^1/2)^T, th = T^T
        wq64, wk64 = left @ wq64, right @ wk64
        bq64 = None if bq64 is None else left @ bq64
        bk64 = None if bk64 is None else right @ bk64
    scale = math.sqrt(d / head_dim)
    wq64 = wq64 * scale
    bq64 = None if bq64 is None else bq64 * scale
    cast = lambda t, ref: None if t is None else t.to(ref.dtype)  # noqa: E731
    return wq64.to(wq.dtype), cast(bq64, wq), wk64.to(wk.dtype), cast(bk64, wk)


def first_order_change(k_sys: torch.Tensor, lam: float, m: torch.Tensor, dk: torch.Tensor,
                       drhs: torch.Tensor) -> torch.Tensor:
    """The change of M, to first order, when K and the right side change by dK, dr (issue 29).

    From ``(K + lam I) vec(M) = vec(r)``: ``vec(dM) = (K + lam I)^-1 (vec(dr) - dK vec(M))`` up to
    terms of order ``||(K + lam I)^-1 dK||^2``; in norm

        ||dM||_F <= (||dr||_F + ||dK||_2 ||M||_F) / (lambda_min(K) + lam),

    i.e. ``||dM|| / ||M|| <= kappa (eps_r + eps_K)`` with ``kappa = (lambda_max + lam) /
    (lambda_min + lam) <= 1 + d'^2 / alpha`` (the ridge rule): 1e6 for d' = 32 at alpha = 1e-3, so
    the a-priori norm bound is vacuous; the linearised change from measured dK, dr is not
    (docs/prune_cost.md, "CUDA and CPU prunes").

    Args:
        k_sys: K (d'^2, d'^2); lam: the ridge used; m: the solution M (d', d');
        dk: dK (d'^2, d'^2); drhs: dr (d', d').

    Returns:
        dM (d', d') float64.
    """
    d = m.shape[0]
    a = k_sys.double().clone()
    a.diagonal().add_(lam)
    v = drhs.double().reshape(-1, 1) - dk.double() @ m.double().reshape(-1, 1)
    return torch.linalg.solve(a, v).reshape(d, d)
