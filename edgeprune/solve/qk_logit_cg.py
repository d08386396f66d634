"""CORP's exact Q/K compensation system solved matrix-free by preconditioned conjugate gradients.

Same problem as :mod:`edgeprune.solve.qk_logit` (corp-v1 eq. 15/29, METHODS.md §1): find M
(d' x d') with

    A(M) := sum_i Gq_i M Gk_i + lam M = R := sum_i Gq_i[S,P] Gk_i[P,S]

where ``Gq_i = Gq_i[S,S]``, ``Gk_i = Gk_i[S,S]`` are image i's kept Gram blocks. The direct solver
forms the d'^2 x d'^2 matrix ``sum_i Gq_i (x) Gk_i`` and factors it: O(N d'^4 + d'^6 / 3) flops, 4 GFLOP
per head at d' = 48. A is symmetric positive definite in the Frobenius inner product
(``<M, A(M)> = sum_i ||Q_S,i M K_S,i^T||_F^2 + lam ||M||_F^2``), so conjugate gradients apply
without forming it; one product costs two GEMMs, 4 N d'^3 flops.

Preconditioner: the pooled-Gram (Sylvester) approximation that the exact system replaces,
``P(M) = (1/N) Gq M Gk + lam M`` with ``Gq = sum_i Gq_i``, ``Gk = sum_i Gk_i`` (exact when all
images share their Gram up to scale; corp-v1 eq. 14). With the eigendecompositions
``Gq = U a U^T``, ``Gk = V b V^T`` it inverts in closed form:
``P^-1(R) = U [(U^T R V) / (a_j b_l / N + lam)] V^T``. Iteration counts and timings against the
Cholesky route: ``benchmarks/bench_qk_solver.py``.

The ridge lambda is the direct solver's (``qk_logit.ridge_lambda``), so both solve the same system;
the result agrees with the Cholesky solution to ~1e-9 relative (tested).
"""

from __future__ import annotations

import dataclasses

import torch

from edgeprune.solve.qk_logit import ridge_lambda

DEFAULT_TOL = 1e-10


@dataclasses.dataclass
class CGResult:
    """Outcome of :func:`solve_logit_compensation_cg`.

    Attributes:
        m: M (d', d') float64 (the last iterate if not converged).
        lam: ridge lambda used.
        iterations: CG iterations run.
        converged: the true relative residual ``||R - A(M)||_F / ||R||_F`` is within 10 x ``tol``
            (CG stops on its recursively updated residual, which drifts slightly from the true one).
        rel_residual: the true relative residual when the iteration stopped on ``tol``, else
            the recursive one.
    """

    m: torch.Tensor
    lam: float
    iterations: int
    converged: bool
    rel_residual: float


def solve_logit_compensation_cg(gq_ss: torch.Tensor, gk_ss: torch.Tensor, rhs: torch.Tensor,
                                alpha: float, tol: float = DEFAULT_TOL,
                                max_iter: int | None = None) -> CGResult:
    """Solve ``sum_i Gq_i M Gk_i + lam M = rhs`` by pooled-Gram-preconditioned CG.

    Args:
        gq_ss, gk_ss: (N, d', d') kept Gram blocks per image (symmetric PSD), any float dtype;
            from :func:`edgeprune.solve.qk_logit.kept_blocks`.
        rhs: (d', d') right-hand side.
        alpha: scale-free ridge strength, > 0 (``lam = alpha * tr(K) / d'^2``).
        tol: stop when the relative residual (Frobenius) is at most this.
        max_iter: iteration cap (default ``min(d'^2, 1000)``; exact arithmetic needs <= d'^2).

    Returns:
        :class:`CGResult`; callers fall back to the direct solver when ``converged`` is False.

    On the CPU the iteration runs on one intra-op thread (restored afterwards): its small GEMMs
    do not speed up with threads and lose badly to thread synchronisation on a busy machine
    (``edgeprune.solve.qk_choice`` models CG as thread-independent).

    Raises:
        ValueError: alpha <= 0 (without a ridge the system can be singular; use the direct solver)
            or shapes that disagree.
    """
    if alpha <= 0:
        raise ValueError(f"the CG Q/K solver needs ridge alpha > 0, got {alpha}")
    if gq_ss.shape != gk_ss.shape or gq_ss.dim() != 3 or gq_ss.shape[1:] != rhs.shape:
        raise ValueError(f"expected (N, d', d') Gram blocks and a (d', d') rhs, got "
                         f"{tuple(gq_ss.shape)}, {tuple(gk_ss.shape)}, {tuple(rhs.shape)}")
    threads = torch.get_num_threads()
    pin = gq_ss.device.type == "cpu" and threads > 1
    if pin:
        torch.set_num_threads(1)
    try:
        return _solve_cg(gq_ss, gk_ss, rhs, alpha, tol, max_iter)
    finally:
        if pin:
            torch.set_num_threads(threads)


def _solve_cg(gq_ss: torch.Tensor, gk_ss: torch.Tensor, rhs: torch.Tensor, alpha: float, tol: float,
              max_iter: int | None) -> CGResult:
    """The body of :func:`solve_logit_compensation_cg` (checked arguments)."""
    gq, gk, b = gq_ss.double(), gk_ss.double(), rhs.double()
    n, d, _ = gq.shape
    lam = ridge_lambda(gq, gk, alpha)
    max_iter = min(d * d, 1000) if max_iter is None else max_iter

    # A(X) as two GEMMs: [Gq_1 X; ...; Gq_N X] laid out (d, N*d), times [Gk_1; ...; Gk_N].
    gq_rows = gq.permute(1, 0, 2).reshape(d * n, d)  # row (a, i) holds Gq_i[a, :]
    gk_stack = gk.reshape(n * d, d)                  # row (i, e) holds Gk_i[e, :]

    def apply_a(x: torch.Tensor) -> torch.Tensor:
        return (gq_rows @ x).reshape(d, n * d) @ gk_stack + lam * x

    evq, uq = torch.linalg.eigh(gq.sum(0))
    evk, uk = torch.linalg.eigh(gk.sum(0))
    denom = (evq.clamp_min(0)[:, None] * evk.clamp_min(0)[None, :]) / n + lam

    def apply_pinv(r: torch.Tensor) -> torch.Tensor:
        return uq @ ((uq.T @ r @ uk) / denom) @ uk.T

    b_norm = float(b.norm())
    if b_norm == 0.0:
        return CGResult(torch.zeros_like(b), lam, 0, True, 0.0)
    x = apply_pinv(b)
    r = b - apply_a(x)
    z = apply_pinv(r)
    p = z.clone()
    rz = float((r * z).sum())
    rel = float(r.norm()) / b_norm
    it = 0
    while rel > tol and it < max_iter:
        ap = apply_a(p)
        pap = float((p * ap).sum())
        if pap <= 0.0 or rz == 0.0:  # residual exactly zero (tol below float64 precision): done
            break
        step = rz / pap
        x = x + step * p
        r = r - step * ap
        z = apply_pinv(r)
        rz_new = float((r * z).sum())
        p = z + (rz_new / rz) * p
        rz = rz_new
        rel = float(r.norm()) / b_norm
        it += 1
    if rel <= tol:  # confirm on the true residual (the recursive one drifts)
        rel = float((b - apply_a(x)).norm()) / b_norm
    return CGResult(x, lam, it, rel <= tol * 10, rel)
