"""Two-stream (sequential) compensation of a Linear whose input channels are pruned.

METHODS.md §5, "Sequential calibration". The Linear ``y = W h + b`` (``fc2`` with h the MLP
hidden, or ``proj`` with h = z the heads' outputs) sees, in the pruned model, the *pruned stream's*
input ``h~`` (computed from the output of the already pruned blocks), of which only the kept
channels S survive. Its target is the *dense stream's* output ``W h + b``. We look for a linear map
predicting the whole dense input from the kept pruned channels,

    h ~ T h~_S + t        (T: D x |S|, t: D),

and fold it: ``W' = W T``, ``b' = b + W t`` (one Linear, no extra op at inference).

Derivation. With ``A = Sigma~_SS + lam I`` (Sigma~ the pruned stream's centred covariance),
``C = Cov(h, h~_S)`` (D x |S|, dense rows, pruned columns) and ridge priors that keep each kept
channel itself and drop each pruned one (``T_S -> I``, ``T_P -> 0``), the objective

    E || h - T h~_S - t ||^2 + lam ( ||T_S - I||_F^2 + ||T_P||_F^2 )

is minimised by ``t = mu - T mu~_S`` and ``T (Sigma~_SS + lam I) = C + lam [I; 0]``, i.e.

    T_S = I + (C_SS - Sigma~_SS) A^-1,        T_P = C_PS A^-1,

which is METHODS.md's ``W2' = W2 C (Sigma~_SS + lam I)^-1`` with the ridge prior at the CORP
fold (``C`` shifted by ``lam`` on the kept rows). When the two streams are equal
(``h = h~``: ``C = Sigma_:S``, ``mu = mu~``), ``T_S = I`` and ``t_S = 0`` exactly and
``T_P = Sigma_PS A^-1 = B``, ``t_P = mu_P - B mu_S = c``: exactly CORP's
``W_S + W_P B``, ``b + W_P c`` (corp-v1 eq. 11; ``edgeprune.solve.mlp_ridge``). The ridge lambda
is CORP's scale-free rule on the pruned stream, ``lam = alpha * tr(Sigma~_SS) / |S|``.
All solves are float64 Cholesky.
"""

from __future__ import annotations

import torch

from edgeprune.solve.mlp_ridge import ridge_lambda


def cross_affine_map(mean_dense: torch.Tensor, mean_pruned: torch.Tensor, cross_cov: torch.Tensor,
                     cov_pruned: torch.Tensor, keep: torch.Tensor, alpha: float
                     ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Solve for ``h ~ T h~_S + t`` (module doc; METHODS.md §5 "Sequential calibration").

    Args:
        mean_dense: mu (D,), the dense stream's mean input.
        mean_pruned: mu~ (D,), the pruned stream's mean input.
        cross_cov: Cov(h, h~) (D, D) float64, rows dense channels, columns pruned channels.
        cov_pruned: Sigma~ (D, D) float64, the pruned stream's centred covariance.
        keep: S (|S|,) int64 sorted kept channels.
        alpha: scale-free ridge strength (>= 0).

    Returns:
        T (D, |S|) float64, t (D,) float64, lam (float).

    Raises:
        ValueError: alpha < 0.
        torch.linalg.LinAlgError: Sigma~_SS + lam I not positive definite (alpha = 0 and linearly
            dependent kept channels).
    """
    mean_dense, mean_pruned = mean_dense.double(), mean_pruned.double()
    cross_cov, cov_pruned = cross_cov.double(), cov_pruned.double()
    s_ss = cov_pruned[keep][:, keep]
    lam = ridge_lambda(s_ss, alpha)
    a = s_ss + lam * torch.eye(len(keep), dtype=torch.float64)
    chol = torch.linalg.cholesky(a)
    r = cross_cov[:, keep].clone()
    r[keep] -= s_ss                                   # C + lam [I; 0] - A [I; 0]
    t_mat = torch.cholesky_solve(r.T.contiguous(), chol).T.contiguous()   # R A^-1 (A symmetric)
    t_mat[keep] += torch.eye(len(keep), dtype=torch.float64)
    t_vec = mean_dense - t_mat @ mean_pruned[keep]
    return t_mat, t_vec, lam


def fold_cross_map(weight: torch.Tensor, bias: torch.Tensor | None, t_mat: torch.Tensor, t_vec: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``W' = W T``, ``b' = b + W t`` (module doc), computed in float64.

    Args:
        weight: W (D_out, D); bias: (D_out,) or None; T (D, |S|), t (D,) from
            :func:`cross_affine_map`.

    Returns:
        W' (D_out, |S|), b' (D_out,) in weight's dtype.
    """
    w = weight.double()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    return (w @ t_mat).to(weight.dtype), (b + w @ t_vec).to(weight.dtype)
