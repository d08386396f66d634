"""Convergence-behaviour tests for the CG Q/K solver (issue 17: kill the mutants of
``edgeprune.solve.qk_logit_cg`` that still converge to the right answer, only differently).

* The pooled-Gram preconditioner is *exact* when every image's Grams are the same up to a scale
  (``Gq_i = c_i Gq0``, ``Gk_i = Gk0``: ``sum_i Gq_i M Gk_i = (1/N) (sum_i Gq_i) M (sum_i Gk_i)``,
  module docstring / corp-v1 eq. 14), so CG must stop after 0 iterations with the closed-form
  answer; any change to the preconditioner (``/ N``, ``+ lam``, the eigenvalue clamps, ...) makes
  it iterate.
* The iteration cap defaults to ``min(d'^2, 1000)``; ``tol`` is the stopping rule ``rel <= tol``,
  ``converged`` means "within 10 x tol" (inclusive); the residual is relative to ``||R||_F``
  (checked with right-hand sides scaled by 2^14 and 2^-24). A tol below float64 precision is
  confirmed on the true residual and reported as not converged.
* Each shape condition alone raises; a zero right-hand side reports lambda and a zero residual.
"""

from __future__ import annotations

import pytest
import torch

from edgeprune.solve import qk_logit
from edgeprune.solve.qk_logit_cg import solve_logit_compensation_cg as cg

F64 = torch.float64


def _gram(n_tok, d, scale, g):
    x = torch.randn(n_tok, d, generator=g, dtype=F64) * scale
    return x.T @ x


def _apply_a(gq, gk, m, lam):
    """The system operator from its definition: sum_i Gq_i M Gk_i + lam M."""
    return sum(gq[i] @ m @ gk[i] for i in range(gq.shape[0])) + lam * m


def _hetero(n=4, d=6, seed=5):
    """Per-image Grams that differ in more than scale (the preconditioner is not exact)."""
    g = torch.Generator().manual_seed(seed)
    gq = torch.stack([_gram(20, d, 0.3 + i, g) for i in range(n)])
    gk = torch.stack([_gram(20, d, 1.0, g) + i * torch.eye(d, dtype=F64) for i in range(n)])
    rhs = torch.randn(d, d, generator=g, dtype=F64)
    return gq, gk, rhs


@pytest.mark.parametrize("n_tok", [40, 4])  # full-rank Grams, and rank-deficient ones (d = 6 > 4 tokens)
def test_exact_preconditioner_needs_no_iteration(n_tok):
    g = torch.Generator().manual_seed(0)
    d, scales = 6, [0.5, 1.0, 2.0]
    gq0, gk0 = _gram(n_tok, d, 0.1, g), _gram(n_tok, d, 0.1, g)  # eigenvalues well below 1
    gq = torch.stack([c * gq0 for c in scales])
    gk = torch.stack([gk0] * len(scales))
    rhs = torch.randn(d, d, generator=g, dtype=F64)
    alpha = 1e-2
    res = cg(gq, gk, rhs, alpha)
    lam = qk_logit.ridge_lambda(gq, gk, alpha)
    # closed form of sum(c) Gq0 M Gk0 + lam M = R in the eigenbases of Gq0, Gk0
    a, u = torch.linalg.eigh(gq0)
    b, v = torch.linalg.eigh(gk0)
    m_ref = u @ ((u.T @ rhs @ v) / (sum(scales) * a[:, None] * b[None, :] + lam)) @ v.T
    assert res.iterations == 0 and res.converged
    assert res.lam == lam
    torch.testing.assert_close(res.m, m_ref, rtol=1e-9, atol=1e-9 * float(m_ref.abs().max()))
    true_rel = float((rhs - _apply_a(gq, gk, res.m, lam)).norm() / rhs.norm())
    assert res.rel_residual == pytest.approx(true_rel, rel=1e-3, abs=1e-14) and res.rel_residual < 1e-12


@pytest.mark.parametrize("scale", [2.0 ** 14, 2.0 ** -24])
def test_residual_is_relative_to_the_rhs(scale):
    # a power-of-two scale is exact in floating point: the scaled system runs the same iteration
    # (2^-24: ||R|| ~ 4e-7, so a residual multiplied by ||R|| instead of divided would pass tol at once)
    gq, gk, rhs = _hetero()
    ref = cg(gq, gk, rhs, 1e-3)
    res = cg(gq, gk, rhs * scale, 1e-3)
    assert ref.converged and res.converged and res.iterations == ref.iterations > 1
    torch.testing.assert_close(res.m, ref.m * scale, rtol=1e-12, atol=0)
    true_rel = float((rhs * scale - _apply_a(gq, gk, res.m, res.lam)).norm() / (rhs * scale).norm())
    assert res.rel_residual == pytest.approx(true_rel, rel=1e-3) and res.rel_residual <= 1e-9


def test_tol_is_the_stopping_rule_and_converged_means_within_ten_tol():
    gq, gk, rhs = _hetero()
    rels = [cg(gq, gk, rhs, 1e-3, tol=1e-300, max_iter=k).rel_residual for k in range(6)]
    assert all(a > b for a, b in zip(rels, rels[1:]))  # decreasing on this system
    # stop exactly when the residual reaches tol (rel <= tol), not one iteration later
    res = cg(gq, gk, rhs, 1e-3, tol=rels[4])
    assert res.iterations == 4 and res.converged
    # capped at 4 iterations: converged iff the residual is within 10 x tol
    res = cg(gq, gk, rhs, 1e-3, tol=rels[4] / 10.5, max_iter=4)
    assert res.iterations == 4 and not res.converged and res.rel_residual == rels[4]
    res = cg(gq, gk, rhs, 1e-3, tol=rels[4] / 9.5, max_iter=4)
    assert res.iterations == 4 and res.converged and res.rel_residual == rels[4]
    # the iterates are one sequence: k iterations give the k-th residual
    assert cg(gq, gk, rhs, 1e-3, tol=1e-300, max_iter=3).rel_residual == rels[3]


def test_default_iteration_cap_is_min_of_d_squared_and_1000():
    # d' = 3: cap 9 (tol 1e-300 is never reached in 9 iterations)
    g = torch.Generator().manual_seed(1)
    gq = torch.stack([_gram(40, 3, 1.0, g) for _ in range(2)])
    gk = torch.stack([_gram(40, 3, 1.0, g) for _ in range(2)])
    res = cg(gq, gk, torch.randn(3, 3, generator=g, dtype=F64), 1e-3, tol=1e-300)
    assert res.iterations == 9 and not res.converged
    # d' = 32: cap 1000 < 1024, on a system the pooled-Gram preconditioner models badly (image i's
    # Q Gram grows as 10^(i/2), its K Gram shrinks as 10^(-i/2)) so CG is still far off at 1000
    g = torch.Generator().manual_seed(0)
    xq = [torch.randn(6, 32, generator=g, dtype=F64) * 10 ** (i / 4) for i in range(8)]
    xk = [torch.randn(6, 32, generator=g, dtype=F64) * 10 ** (-i / 4) for i in range(8)]
    gq, gk = torch.stack([x.T @ x for x in xq]), torch.stack([x.T @ x for x in xk])
    res = cg(gq, gk, torch.randn(32, 32, generator=g, dtype=F64), 1e-4)
    assert res.iterations == 1000 and not res.converged and res.rel_residual > 1e-3


def test_each_shape_mismatch_alone_is_rejected_and_zero_rhs_reports_lambda():
    gq, gk, rhs = _hetero()
    for args in [(gq, gk[:, :5, :5], rhs),           # Gq and Gk disagree
                 (gq[0], gk[0], rhs[0]),              # not (N, d', d'): gq.shape[1:] == rhs.shape
                 (gq, gk, rhs[:5, :5])]:              # rhs is not (d', d')
        with pytest.raises(ValueError, match="expected \\(N, d', d'\\) Gram blocks"):
            cg(*args, 1e-3)
    res = cg(gq, gk, torch.zeros_like(rhs), 1e-3)
    assert res.lam == qk_logit.ridge_lambda(gq, gk, 1e-3) > 0
    assert (res.iterations, res.converged, res.rel_residual) == (0, True, 0.0)
    assert res.m.dtype == F64 and res.m.shape == rhs.shape and not res.m.any()


def test_cpu_solve_runs_on_one_thread_and_restores_the_count(monkeypatch):
    from edgeprune.solve import qk_logit_cg

    seen = []

    def body(*args):
        seen.append((args[0].device.type, torch.get_num_threads()))
        if len(seen) == 3:
            raise RuntimeError("boom")
        return "result"

    gq, gk, rhs = _hetero()
    prev = torch.get_num_threads()
    monkeypatch.setattr(qk_logit_cg, "_solve_cg", body)
    try:
        torch.set_num_threads(3)
        assert cg(gq, gk, rhs, 1e-3) == "result" and torch.get_num_threads() == 3
        # not on the CPU: the thread count is left alone
        meta = [t.to("meta") for t in (gq, gk, rhs)]
        assert cg(*meta, 1e-3) == "result" and torch.get_num_threads() == 3
        with pytest.raises(RuntimeError, match="boom"):  # restored on an error too
            cg(gq, gk, rhs, 1e-3)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(prev)
    assert seen == [("cpu", 1), ("meta", 3), ("cpu", 1)]


def _tol_times_ten_is(target):
    """A float tol with ``tol * 10 == target`` exactly (None if no neighbour of target / 10 hits it)."""
    import math
    t = target / 10
    for c in (t, math.nextafter(t, math.inf), math.nextafter(t, -math.inf)):
        if c * 10 == target:
            return c
    return None


def test_converged_is_inclusive_at_exactly_ten_tol():
    # capped at k iterations with a residual of exactly 10 x tol: "within 10 x tol" includes it
    gq, gk, rhs = _hetero()
    rels = [cg(gq, gk, rhs, 1e-3, tol=1e-300, max_iter=k).rel_residual for k in range(2, 8)]
    hits = [(k, t) for k, (r, t) in enumerate(((r, _tol_times_ten_is(r)) for r in rels), 2) if t]
    assert hits  # some residual is 10 x a float
    for k, tol in hits:
        res = cg(gq, gk, rhs, 1e-3, tol=tol, max_iter=k)
        assert res.iterations == k and res.rel_residual == 10 * tol and res.converged


def test_tol_below_attainable_precision_reports_the_true_residual_and_no_convergence():
    # Past machine precision CG's recursively updated residual keeps shrinking (to 1e-20 and
    # below) while the true residual ||R - A(M)|| / ||R|| stays at round-off (~1e-16). Stopping
    # exactly on tol (rel == tol) must still confirm on the true residual, so a tol no float64
    # solve can reach is reported as not converged instead of as a residual of tol.
    gq, gk, rhs = _hetero()
    rels = [cg(gq, gk, rhs, 1e-3, tol=1e-300, max_iter=k).rel_residual for k in range(40)]
    k = next(i for i, r in enumerate(rels) if r < 1e-20)
    assert all(a > b for a, b in zip(rels[:k + 1], rels[1:k + 1]))  # first reaches rels[k] at k
    res = cg(gq, gk, rhs, 1e-3, tol=rels[k])
    true_rel = float((rhs - _apply_a(gq, gk, res.m, res.lam)).norm() / rhs.norm())
    assert res.iterations == k and true_rel > 1e3 * rels[k]
    assert res.rel_residual == pytest.approx(true_rel, rel=0.5) and not res.converged


def test_cpu_solve_pins_one_thread_from_two(monkeypatch):
    # the smallest count that is pinned: 2 threads -> 1 during the solve, 2 afterwards
    from edgeprune.solve import qk_logit_cg

    seen = []
    monkeypatch.setattr(qk_logit_cg, "_solve_cg", lambda *a: seen.append(torch.get_num_threads()))
    gq, gk, rhs = _hetero()
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cg(gq, gk, rhs, 1e-3)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(prev)


def test_tol_far_below_float64_precision_does_not_divide_by_zero():
    """A residual that reaches exactly zero ends the iteration (no ZeroDivisionError)."""
    from edgeprune.solve.qk_logit_cg import solve_logit_compensation_cg

    g = torch.Generator().manual_seed(3)
    a = torch.randn(6, 4, 4, generator=g, dtype=torch.float64)
    gq = a @ a.transpose(-1, -2) + torch.eye(4, dtype=torch.float64)
    b = torch.randn(6, 4, 4, generator=g, dtype=torch.float64)
    gk = b @ b.transpose(-1, -2) + torch.eye(4, dtype=torch.float64)
    rhs = torch.randn(4, 4, generator=g, dtype=torch.float64)
    res = solve_logit_compensation_cg(gq, gk, rhs, 1e-3, tol=1e-300, max_iter=400)
    assert torch.isfinite(res.m).all()
