"""CORP's closed-form compensation: pruned input channels of a Linear as an affine map of kept ones.

Written for the MLP (``fc2``'s input h, below) and reused unchanged for attention's output
projection (``proj``'s input z = the heads' outputs, METHODS.md §5: V/O dims and whole heads):
one solver and one fold for every Linear whose input channels are pruned.

corp-v1 §3.2, eq. 7-11 and App. B eq. 18-24. With hidden statistics mu (D,) and centred covariance
Sigma (D, D) at the input of fc2, kept set S and pruned set P:

    B = Sigma_PS (Sigma_SS + lam I)^-1        (|P| x |S|)
    c = mu_P - B mu_S                         (|P|,)

so that h_P ~ B h_S + c, and fc2 ``y = W_S h_S + W_P h_P + b`` becomes

    W' = W_S + W_P B,    b' = b + W_P c       (eq. 11; no extra op at inference).

Ridge lambda is scale-free: ``lam = alpha * tr(Sigma_SS) / |S|`` (alpha times the mean variance of
the kept channels), so the same alpha works for every layer and model whatever the activation
scale. All solves are float64 Cholesky.
"""

from __future__ import annotations

import torch

DEFAULT_ALPHA = 1e-3


def ridge_lambda(cov_ss: torch.Tensor, alpha: float) -> float:
    """lam = alpha * tr(Sigma_SS) / |S| (scale-free ridge; see module doc)."""
    if alpha < 0:
        raise ValueError(f"ridge alpha must be >= 0, got {alpha}")
    return float(alpha * torch.diagonal(cov_ss).mean().clamp_min(0))


def ridge_affine_map(mean: torch.Tensor, cov: torch.Tensor, keep: torch.Tensor, prune: torch.Tensor,
                     alpha: float = DEFAULT_ALPHA) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Solve for the affine map h_P ~ B h_S + c (corp-v1 eq. 10 / 24).

    Args:
        mean: mu (D,) float64.
        cov: Sigma (D, D) float64, centred.
        keep: S, (|S|,) int64; prune: P, (|P|,) int64.
        alpha: scale-free ridge strength (see :func:`ridge_lambda`).

    Returns:
        B (|P|, |S|) float64, c (|P|,) float64, lam (float).

    Raises:
        torch.linalg.LinAlgError: Sigma_SS + lam I is not positive definite (alpha = 0 with
            linearly dependent kept channels); use alpha > 0.
    """
    mean, cov = mean.double(), cov.double()
    s_ss = cov[keep][:, keep]
    s_ps = cov[prune][:, keep]
    lam = ridge_lambda(s_ss, alpha)
    a = s_ss + lam * torch.eye(len(keep), dtype=torch.float64)
    chol = torch.linalg.cholesky(a)
    # B^T = A^-1 Sigma_SP  (A symmetric)
    b = torch.cholesky_solve(s_ps.T.contiguous(), chol).T
    c = mean[prune] - b @ mean[keep]
    return b, c, lam


def fold_into_linear(weight: torch.Tensor, bias: torch.Tensor | None, keep: torch.Tensor,
                     prune: torch.Tensor, b: torch.Tensor | None, c: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold the compensation into the Linear that consumes h: ``fc2`` (corp-v1 eq. 11) or
    attention's ``proj`` (METHODS.md §5). Also available as :func:`fold_into_fc2`.

    Args:
        weight: W (D_out, D_in) (fc2: D_in = D_mlp; proj: D_in = H*d_v); bias: (D_out,) or None.
        keep, prune: S, P index tensors.
        b, c: from :func:`ridge_affine_map`; ``None`` = no compensation (plain removal).

    Returns:
        W' (D_out, |S|) and b' (D_out,), in weight's dtype; computed in float64.
    """
    w = weight.double()
    bias64 = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    w_new = w[:, keep]
    b_new = bias64
    if b is not None and c is not None and len(prune) > 0:
        w_p = w[:, prune]
        w_new = w_new + w_p @ b
        b_new = bias64 + w_p @ c
    return w_new.to(weight.dtype), b_new.to(weight.dtype)


fold_into_fc2 = fold_into_linear  # the original name (MLP)


def removal_error(mean: torch.Tensor, cov: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor,
                  prune: torch.Tensor, b: torch.Tensor | None = None, c: torch.Tensor | None = None) -> float:
    """Mean squared output error per token of removing channels P, with or without the fold.

    ``E || W_P (h_P - B h_S - c) ||^2`` in the consuming Linear's output space (METHODS.md §5,
    "Budgeted allocation": with the ridge B and c = mu_P - B mu_S it is
    ``tr(W_P (Sigma_PP - B Sigma_SP - Sigma_PS B^T + B Sigma_SS B^T) W_P^T)``). Without
    compensation (``b`` = ``c`` = None) it is ``E ||W_P h_P||^2 = tr(W_P (Sigma_PP + mu_P mu_P^T) W_P^T)``.

    Args:
        mean: mu (D_in,); cov: Sigma (D_in, D_in) centred.
        weight: W (D_out, D_in) of the consuming Linear.
        keep, prune: S, P index tensors.
        b, c: from :func:`ridge_affine_map`, or None (plain removal).

    Returns:
        the error (float, float64 arithmetic; units: squared output units per token).
    """
    mean, cov = mean.double(), cov.double()
    w_p = weight.double()[:, prune]
    if b is None or c is None:
        g = cov[prune][:, prune] + torch.outer(mean[prune], mean[prune])
        return float(((w_p @ g) * w_p).sum())
    idx = torch.cat([prune, keep])
    sig = cov[idx][:, idx]
    wg = torch.cat([w_p, -(w_p @ b)], dim=1)          # W_P [I, -B]  (D_out, |P| + |S|)
    bias_err = w_p @ (mean[prune] - b @ mean[keep] - c)
    return float(((wg @ sig) * wg).sum() + bias_err.pow(2).sum())
