"""Which route solves the exact Q/K system: Cholesky of the Kronecker system or matrix-free CG.

``CorpConfig.qk_solver = "auto"`` asks :func:`cg_is_cheaper` per head (corp.qk_solver_from_grams).
"""

from __future__ import annotations


def cg_is_cheaper(num_images: int, kept_dim: int) -> bool:
    """``qk_solver="auto"``: whether CG beats the Cholesky route for N images and kept dim d'.

    Cost model fitted to ``tools/bench_qk_solver.py`` on this project's CPU (float64, 1 thread):
    Cholesky route ``a N d'^4 + b d'^6`` (assembly + factorisation, b/a ~ 0.23), CG
    ``~60 iterations x c N d'^3`` (c/a ~ 2). CG wins when ``N (120 - d') < 0.23 d'^3``: e.g. for
    64 images from d' = 32 (1.4x faster measured on DINOv2-S) and always from d' = 120, where the
    d'^4 system alone would take 1.6 GB.
    """
    return num_images * (120 - kept_dim) < 0.23 * kept_dim ** 3
