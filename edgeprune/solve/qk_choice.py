"""Which route solves the exact Q/K system: Cholesky of the Kronecker system or matrix-free CG.

``CorpConfig.qk_solver = "auto"`` asks :func:`cg_is_cheaper` per head (corp.qk_solver_from_grams),
at the thread count in use (``torch.get_num_threads()``).
"""

from __future__ import annotations

#: CG iterations the model assumes (median 35-50 measured on DINOv2-S, corp-v1 eq. 29 systems)
CG_ITERATIONS = 60
#: Cholesky-route constants relative to one CG flop unit: ``a N d'^4 + b d'^6`` with b/a = 0.23,
#: one CG iteration ``c N d'^3`` with c/a = 2 (fitted at 1 thread, benchmarks/bench_qk_solver.py, when
#: the Kronecker GEMM was the full (N, d'^2) product; it now runs on the packed upper triangles,
#: ``N p^2`` with ``p = d'(d'+1)/2``, same GEMM kernel, so ``a`` is the same per multiply-add).
_B_OVER_A = 0.23
_C_OVER_A = 2.0
#: above this the d'^2 x d'^2 float64 system itself is too big to form: CG (d' >= 108)
DIRECT_MAX_BYTES = 2 ** 30


def solver_costs(num_images: int, kept_dim: int, threads: int = 1) -> tuple[float, float]:
    """Modelled (direct, cg) solve cost of one head, in units of ``a`` (one Kronecker-GEMM flop
    unit at 1 thread).

    * direct: ``(N p^2 + 0.23 d'^6) / t`` with ``p = d'(d'+1)/2`` -- two large float64 kernels
      (the Kronecker GEMM of the packed Gram triangles, ``qk_logit.kronecker_system``, and the
      Cholesky factorisation), which scale with the t intra-op threads;
    * CG: ``60 x 2 N d'^3`` -- thread-independent: its iterations are chains of small GEMMs on
      (d' x N d') panels, which do not speed up with threads, and under CPU contention lose far
      more to thread synchronisation (measured 10-47x slower than direct at 2 threads), so
      :func:`~edgeprune.solve.qk_logit_cg.solve_logit_compensation_cg` runs them on 1 thread.

    Args:
        num_images: N; kept_dim: d'; threads: t >= 1 (values below 1 count as 1).
    """
    n, d, t = float(num_images), float(kept_dim), float(max(1, threads))
    p = d * (d + 1) / 2
    direct = (n * p ** 2 + _B_OVER_A * d ** 6) / t
    cg = CG_ITERATIONS * _C_OVER_A * n * d ** 3
    return direct, cg


def cg_is_cheaper(num_images: int, kept_dim: int, threads: int | None = None) -> bool:
    """``qk_solver="auto"``: whether CG beats the Cholesky route for N images and kept dim d'
    at ``threads`` intra-op threads (default ``torch.get_num_threads()``).

    Cost model (:func:`solver_costs`, fitted to ``benchmarks/bench_qk_solver.py`` on this project's CPU,
    float64): CG wins when ``N (120 t d'^3 - p^2) < 0.23 d'^6`` (``p = d'(d'+1)/2``). At 1 thread:
    for d' = 32 below 68 images (64 images: 1.4x faster measured on DINOv2-S), for d' = 48 below
    236. At 2 threads the Cholesky route's kernels run twice as fast and CG's do not: for d' = 32
    CG is chosen only below 33 images, for d' = 48 below 112. Whatever the costs, CG when the
    system would take more than :data:`DIRECT_MAX_BYTES` (1 GiB: d' >= 108).
    """
    if kept_dim ** 4 * 8 > DIRECT_MAX_BYTES:
        return True
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    direct, cg = solver_costs(num_images, kept_dim, threads)
    return cg < direct
