"""The matrix-free CG solver of the Q/K system agrees with the Cholesky route."""

from __future__ import annotations

import copy

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.corp import CorpConfig
from edgeprune.pruning.corp import corp_prune
from edgeprune.errors import UserError
from edgeprune.solve import qk_logit
from edgeprune.solve.qk_logit_cg import solve_logit_compensation_cg


def _heterogeneous_grams(n_img=12, n_tok=40, d_h=24, seed=0):
    """Per-image Q/K Grams whose images differ in scale and correlation (a pooled Gram is a poor
    model of them, so the preconditioner alone does not solve the system)."""
    g = torch.Generator().manual_seed(seed)
    qs, ks = [], []
    for i in range(n_img):
        mix_q = torch.randn(d_h, d_h, generator=g, dtype=torch.float64) * (0.2 + i / n_img)
        mix_k = torch.randn(d_h, d_h, generator=g, dtype=torch.float64) + torch.eye(d_h, dtype=torch.float64) * i
        x = torch.randn(n_tok, d_h, generator=g, dtype=torch.float64)
        qs.append(x @ mix_q)
        ks.append((x + 0.3 * torch.randn(n_tok, d_h, generator=g, dtype=torch.float64)) @ mix_k)
    q, k = torch.stack(qs), torch.stack(ks)
    return q.transpose(1, 2) @ q, k.transpose(1, 2) @ k


@pytest.mark.parametrize("alpha", [1e-3, 1e-6])
def test_cg_matches_cholesky(alpha):
    gq, gk = _heterogeneous_grams()
    keep = torch.arange(0, 20, 2)  # interleaved kept / pruned dims
    prune = torch.tensor([i for i in range(24) if i not in set(keep.tolist())])
    k_sys, rhs = qk_logit.kronecker_system(gq, gk, keep, prune)
    m_direct, lam_direct = qk_logit.solve_logit_compensation(k_sys, rhs, alpha)
    res = solve_logit_compensation_cg(*qk_logit.kept_blocks(gq, gk, keep, prune), alpha)
    assert res.converged and res.iterations > 1  # the preconditioner alone is not the answer
    assert res.lam == pytest.approx(lam_direct, rel=1e-12)
    err = (res.m - m_direct).norm() / m_direct.norm()
    assert err < 1e-7, float(err)


def test_cg_reports_non_convergence_and_rejects_bad_input():
    gq, gk = _heterogeneous_grams(seed=1)
    keep, prune = torch.arange(12), torch.arange(12, 24)
    blocks = qk_logit.kept_blocks(gq, gk, keep, prune)
    res = solve_logit_compensation_cg(*blocks, 1e-6, max_iter=1)
    assert not res.converged and res.iterations == 1 and res.rel_residual > 1e-10
    with pytest.raises(ValueError, match="alpha > 0"):
        solve_logit_compensation_cg(*blocks, 0.0)
    with pytest.raises(ValueError, match="Gram blocks"):
        solve_logit_compensation_cg(blocks[0], blocks[1][:, :5, :5], blocks[2], 1e-3)


def test_cg_zero_rhs_gives_zero_compensation():
    gq, gk = _heterogeneous_grams(seed=2)
    blocks = qk_logit.kept_blocks(gq, gk, torch.arange(8), torch.arange(8, 24))
    res = solve_logit_compensation_cg(blocks[0], blocks[1], torch.zeros(8, 8, dtype=torch.float64), 1e-3)
    assert res.converged and res.iterations == 0 and res.m.abs().max() == 0


def test_ridge_lambda_without_forming_the_system_equals_mean_diagonal():
    gq, gk = _heterogeneous_grams(seed=3)
    keep, prune = torch.arange(10), torch.arange(10, 24)
    k_sys, _ = qk_logit.kronecker_system(gq, gk, keep, prune)
    gq_ss, gk_ss, _ = qk_logit.kept_blocks(gq, gk, keep, prune)
    assert qk_logit.ridge_lambda(gq_ss, gk_ss, 1e-3) == pytest.approx(1e-3 * float(torch.diagonal(k_sys).mean()),
                                                                     rel=1e-12)


def test_pruning_with_cg_equals_pruning_with_cholesky(fmnist_model):
    x = torch.randn(24, 1, 28, 28, generator=torch.Generator().manual_seed(5))
    outs, infos = {}, {}
    for solver in ("direct", "cg"):
        m = copy.deepcopy(fmnist_model)
        infos[solver] = corp_prune(find_anatomy(m), lambda: [x[:12], x[12:]],
                                   CorpConfig(attn_sparsity=0.3, qk_solver=solver), num_images=24, progress=False)
        with torch.no_grad():
            outs[solver] = m(x)
    assert all(s == "direct" for b in infos["direct"]["blocks"] for s in b["qk_solver"])
    assert all(s.startswith("cg:") for b in infos["cg"]["blocks"] for s in b["qk_solver"])
    torch.testing.assert_close(outs["cg"], outs["direct"], atol=1e-5, rtol=1e-5)


def test_cg_that_does_not_converge_falls_back_to_cholesky(fmnist_model, monkeypatch):
    from edgeprune.solve import qk_logit_cg

    real = qk_logit_cg.solve_logit_compensation_cg
    monkeypatch.setattr(qk_logit_cg, "solve_logit_compensation_cg",
                        lambda *a, **kw: real(*a, **{**kw, "max_iter": 1}))
    x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(6))
    outs = []
    for solver in ("cg", "direct"):
        m = copy.deepcopy(fmnist_model)
        info = corp_prune(find_anatomy(m), lambda: [x], CorpConfig(attn_sparsity=0.3, qk_solver=solver),
                          num_images=16, progress=False)
        assert all(s == "direct" for b in info["blocks"] for s in b["qk_solver"])
        with torch.no_grad():
            outs.append(m(x))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_solver_setting_is_validated():
    with pytest.raises(UserError, match="unknown Q/K solver"):
        CorpConfig(attn_sparsity=0.5, qk_solver="lu").validate()
    with pytest.raises(UserError, match="ridge alpha > 0"):
        CorpConfig(attn_sparsity=0.5, qk_solver="cg", qk_ridge_alpha=0.0).validate()


def test_auto_solver_choice_follows_the_measured_crossover():
    from edgeprune.corp import cg_is_cheaper

    # 1 thread (where the model was fitted)
    assert cg_is_cheaper(64, 48, threads=1) and cg_is_cheaper(64, 32, threads=1)  # dinov2-s14: CG 5.0x / 1.4x faster
    assert not cg_is_cheaper(512, 32, threads=1) and not cg_is_cheaper(64, 16, threads=1)  # Cholesky faster
    # 2 threads: Cholesky's kernels scale, CG's do not (issue 13: deit_small d'=32, 64 images,
    # CG 380 s vs direct 62 s) -> direct there; CG only for few images
    assert not cg_is_cheaper(64, 32, threads=2) and cg_is_cheaper(16, 32, threads=2)
    assert all(cg_is_cheaper(n, 120, threads=t) for n in (1, 10_000) for t in (1, 2, 64))  # never a 14400^2 system
