"""Q/K head-dim pruning under rotary position embedding: whole pairs, and a compensation that
passes through the rotation (METHODS.md §6, "Q/K pruning under RoPE"; ours).

RoPE rotates each *pair* (j, j + d/2) of a head's query and key dims (``rotate_half`` layout,
:mod:`edgeprune.layers.rotary_attention`) by a position-dependent angle, so a pair is the unit that is
kept or pruned. Written as complex numbers ``z_j = q_j + i q_{j+d/2}``, the logit is
``L(m, n) = sum_j Re[z_q,j(m) conj(z_k,j(n)) e^{i(phi_j(m) - phi_j(n))}]``.

* **Ranking**: pair energy ``s_j = E_i[ (||q_j||^2 + ||q_{j+d/2}||^2) (||k_j||^2 + ||k_{j+d/2}||^2) ]``
  (sums over one image's tokens; rotation-invariant, CORP's logit energy per pair, corp-v1 eq. 13).
  Kept pairs: the same count in every head of a layer (reshape), ``2 x pairs`` on the dim grid.
* **Compensation, the pair form**: CORP's system (corp-v1 eq. 29) on the *rotated* queries and keys,
  with M restricted to the matrices that commute with every rotation: one complex scalar per kept pair,
  a 2x2 block ``[[a, -b], [b, a]]`` on the pair's two dims (no cross terms: in DINOv3 / EVA-02 no two
  pairs share an angle function). Such an M commutes with the rotation, so ``q' = (I + M)^T q`` before
  the rotation gives the compensated logits ``Q_rot,S (I + M) K_rot,S^T``: the fold goes into ``W_Q``
  (and ``b_Q``) only; ``W_K`` keeps its kept rows. The restricted normal equation is the projection of
  CORP's: with ``P`` (d'^2 x d') the basis of allowed M (row-major vec),
  ``(P^T K P + lam P^T P) x = P^T vec(rhs)``, ``vec(M) = P x``, ``lam = alpha * mean diag(K)``
  (as :func:`edgeprune.solve.qk_logit.solve_logit_compensation`). 2|S| unknowns, always well posed.

Invariants (tests): pruning nothing is exact (M = 0); a removed pair whose keys are zero changes
nothing; a removed pair whose logit term equals a kept pair's times a complex constant (same angle
function) is compensated exactly.
"""

from __future__ import annotations

import functools
import math

import torch

from edgeprune.settings import SettingError
from edgeprune.solve.topk import stable_top_k


def check_pairs(kept_dims: int) -> None:
    """Refuse a kept Q/K dim per head that splits a RoPE pair.

    Raises:
        SettingError: an odd ``kept_dims``.
    """
    if kept_dims % 2:
        raise SettingError(f"a rotary attention keeps whole RoPE pairs: {kept_dims} Q/K dims per head is odd "
                           "(give an even {round_to})")


def kept_pairs_dims(pair_scores: torch.Tensor, kept_dims: int) -> torch.Tensor:
    """Kept Q/K dims per head that hold whole RoPE pairs: the ``kept_dims / 2`` pairs of highest energy.

    Args:
        pair_scores: (H, p) pair energies (p = d/2 pairs of a head of d dims).
        kept_dims: d', the kept dims per head (even).

    Returns:
        (H, d') int64, sorted ascending: the kept pairs' first dims, then their partners (+p), i.e.
        the kept head in the ``rotate_half`` layout again.

    Raises:
        SettingError: an odd ``kept_dims`` (a pair cannot be split).
    """
    check_pairs(kept_dims)
    p = pair_scores.shape[-1]
    pairs = stable_top_k(pair_scores, kept_dims // 2)  # (H, d'/2) sorted ascending, ties to the lower index
    return torch.cat([pairs, pairs + p], dim=-1)


@functools.lru_cache(maxsize=8)
def pair_basis(d: int) -> torch.Tensor:
    """The basis of the rotation-commuting M on a kept head of ``d`` dims (rotate_half layout).

    Returns:
        P (d*d, d) float64: column 2t = vec(E^a_t), column 2t+1 = vec(E^b_t) for pair t = (t, t + d/2),
        with ``E^a_t = e_t e_t^T + e_u e_u^T`` and ``E^b_t = e_u e_t^T - e_t e_u^T`` (u = t + d/2); row-major
        vec (``vec(M)[a * d + b] = M[a, b]``), as the Kronecker system of ``qk_logit``.

    Raises:
        ValueError: an odd d.
    """
    if d % 2:
        raise ValueError(f"a rotary head has an even number of dims, got {d}")
    m = d // 2
    basis = torch.zeros(d * d, d, dtype=torch.float64)
    for t in range(m):
        u = t + m
        basis[t * d + t, 2 * t] = basis[u * d + u, 2 * t] = 1.0
        basis[u * d + t, 2 * t + 1] = 1.0
        basis[t * d + u, 2 * t + 1] = -1.0
    return basis


def solve_rope_pairs(k_sys: torch.Tensor, rhs: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
    """The pair-form compensation M of one rotary head (see the module docstring).

    Args:
        k_sys: CORP's system ``sum_i Gq_i[S,S] (x) Gk_i[S,S]`` (d'^2, d'^2) of the *rotated* Grams.
        rhs: its right side (d', d') (``sum_i Gq_i[S,P] Gk_i[P,S]``, rotated), or a two-stream one.
        alpha: scale-free ridge strength (>= 0).

    Returns:
        (M (d', d') float64, commuting with every rotation, ridge lambda).

    Raises:
        ValueError: alpha < 0 or an odd d'.
        torch.linalg.LinAlgError: a singular restricted system (alpha = 0 on degenerate data).
    """
    if alpha < 0:
        raise ValueError(f"ridge alpha must be >= 0, got {alpha}")
    d = rhs.shape[0]
    basis = pair_basis(d).to(k_sys.device)
    lam = float(alpha * torch.diagonal(k_sys).double().mean().clamp_min(0))
    a = basis.T @ k_sys.double() @ basis
    a = 0.5 * (a + a.T) + lam * (basis.T @ basis)
    b = basis.T @ rhs.double().reshape(-1)
    chol, info = torch.linalg.cholesky_ex(a)
    x = torch.cholesky_solve(b[:, None], chol)[:, 0] if int(info) == 0 else torch.linalg.solve(a, b)
    return (basis @ x).reshape(d, d), lam


def fold_rope_compensation(wq: torch.Tensor, bq: torch.Tensor | None, m: torch.Tensor | None,
                           scale_dim: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold ``(I + M)^T`` into one rotary head's kept query rows; keep the dense logit scale.

    Args:
        wq: kept query rows (d', D); bq: (d',) or None.
        m: the pair-form M (d', d') (commutes with the rotation), or None (only the scale is folded).
        scale_dim: ``scale ** -2`` of the current attention (the dense d_h for a dense timm head).

    Returns:
        (wq', bq') in wq's dtype, such that with attention scale 1/sqrt(d') and the same rotation the
        logits equal ``Q_rot,S (I + M) K_rot,S^T / sqrt(scale_dim)``. The key rows are not changed.
    """
    d = wq.shape[0]
    w64 = wq.double()
    b64 = None if bq is None else bq.double()
    if m is not None:
        left = (torch.eye(d, dtype=torch.float64) + m.double()).T
        w64 = left @ w64
        b64 = None if b64 is None else left @ b64
    s = math.sqrt(d / scale_dim)
    w64 = w64 * s
    b64 = None if b64 is None else b64 * s
    return w64.to(wq.dtype), None if b64 is None else b64.to(bq.dtype)


# -- the general form: a full d' x d' M applied to q before the rotation (METHODS.md §6) -------------------


def unrotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation ``R^T t`` of rotated queries or keys (rotate_half layout).

    Args:
        t: (B, H, n, d) rotated; cos, sin: (H, n, d) tables of the same dims.

    Returns:
        (B, H, n, d), in t's dtype.
    """
    half = t.shape[-1] // 2
    rot = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos.to(t.dtype) - rot * sin.to(t.dtype)


def general_system(q_rot: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   keep: torch.Tensor, prune: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's contribution to every head's general-form normal equation (METHODS.md §6).

    With q_m the *unrotated* kept query of token m, R_m its rotation (kept pairs), k~_n the rotated kept key
    and ``L_P(m, n) = q~_P(m) . k~_P(n)`` the removed pairs' logit, the correction of the logit is
    ``(R_m M q_m) . k~_n = vec(M) . vec(g_mn q_m^T)`` with ``g_mn = R_m^T k~_n`` (row-major vec), so

        K   = sum_images sum_m (R_m^T Gk~ R_m) (x) (q_m q_m^T)          (d'^2 x d'^2, Gk~ = K~_S^T K~_S)
        rhs = sum_images sum_m vec( R_m^T (sum_n L_P(m, n) k~_n) q_m^T )

    formed with one GEMM over the (image, token) index per head: O(B n d'^4).

    Args:
        q_rot, k_rot: (B, H, n, d) rotated queries and keys (all dims of the head).
        cos, sin: (H, n, d) the head's tables.
        keep: (H, d') kept dims (pair-closed, sorted); prune: (H, p) the removed dims.

    Returns:
        (K (H, d'^2, d'^2), rhs (H, d'^2)), float64.
    """
    qd, kd = q_rot.double(), k_rot.double()
    take = lambda t, idx: torch.take_along_dim(t, idx[None, :, None, :], dim=3)  # noqa: E731
    q_s, k_s = take(qd, keep), take(kd, keep)                         # (B, H, n, d')
    cos_s = torch.take_along_dim(cos.double(), keep[:, None, :], dim=2)
    sin_s = torch.take_along_dim(sin.double(), keep[:, None, :], dim=2)
    q_plain = unrotate(q_s, cos_s, sin_s)                            # q_m, unrotated
    l_p = take(qd, prune) @ take(kd, prune).transpose(-1, -2)       # (B, H, n, n) removed logits
    v = unrotate(l_p @ k_s, cos_s, sin_s)                            # R_m^T sum_n L_P(m, n) k~_n
    gk = k_s.transpose(-1, -2) @ k_s                                  # (B, H, d', d')
    B, H, n, d = q_s.shape
    # R_m^T Gk R_m for every token: rotate Gk's rows and columns by token m's angles
    rows = unrotate(gk[:, :, None].expand(B, H, n, d, d).transpose(-1, -2).reshape(B, H, n * d, d),
                    cos_s.repeat_interleave(d, dim=1), sin_s.repeat_interleave(d, dim=1))
    a = rows.reshape(B, H, n, d, d).transpose(-1, -2)                 # R_m^T-side on the columns...
    a = unrotate(a.reshape(B, H, n * d, d), cos_s.repeat_interleave(d, dim=1),
                 sin_s.repeat_interleave(d, dim=1)).reshape(B, H, n, d, d)
    qq = q_plain[..., :, None] * q_plain[..., None, :]                # (B, H, n, d', d')
    x = a.permute(1, 0, 2, 3, 4).reshape(H, B * n, d * d)             # vec(R^T G R) per token
    y = qq.permute(1, 0, 2, 3, 4).reshape(H, B * n, d * d)            # vec(q q^T) per token
    # entry ((a, b), (a', b')) = sum A[a, a'] Q[b, b']: reorder the outer product of the two vecs
    k4 = (x.transpose(1, 2) @ y).reshape(H, d, d, d, d).permute(0, 1, 3, 2, 4).reshape(H, d * d, d * d)
    rhs = (v[..., :, None] * q_plain[..., None, :]).sum(dim=(0, 2)).reshape(H, d * d)
    return k4, rhs


def solve_rope_general(k_sys: torch.Tensor, rhs: torch.Tensor, alpha: float) -> tuple[torch.Tensor, float]:
    """The general-form M (d', d') of one rotary head: ``(K + lam I) vec(M) = rhs``, lam = alpha mean diag(K).

    Raises:
        ValueError: alpha < 0.
    """
    if alpha < 0:
        raise ValueError(f"ridge alpha must be >= 0, got {alpha}")
    d = int(round(rhs.numel() ** 0.5))
    lam = float(alpha * torch.diagonal(k_sys).double().mean().clamp_min(0))
    a = 0.5 * (k_sys + k_sys.T).double()
    a.diagonal().add_(lam)
    chol, info = torch.linalg.cholesky_ex(a)
    b = rhs.double().reshape(-1, 1)
    x = torch.cholesky_solve(b, chol) if int(info) == 0 else torch.linalg.lstsq(a, b).solution
    return x.reshape(d, d), lam


def fold_rope_general(wq: torch.Tensor, bq: torch.Tensor | None, m: torch.Tensor,
                      scale_dim: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fold the general-form ``q' = (I + M) q`` (before the rotation) into the kept query rows, with the dense
    logit scale (as :func:`fold_rope_compensation`, which folds ``(I + M)^T`` for the pair form's CORP-side M)."""
    return fold_rope_compensation(wq, bq, m.double().T, scale_dim)
