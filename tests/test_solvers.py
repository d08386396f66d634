"""The closed-form solvers: exactness where the math promises it (METHODS.md §1, §4)."""

from __future__ import annotations

import math

import pytest
import torch

from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.solve import mlp_ridge, qk_logit


def test_mlp_stats_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 40, 12, generator=g, dtype=torch.float64) * 3 + 50  # large mean
    st = MLPStatistics(12, gram_dtype=torch.float64)
    for chunk in h.split(1):
        st.add_batch(chunk)
    x = h.reshape(-1, 12)
    assert torch.allclose(st.mean, x.mean(0), atol=1e-10)
    assert torch.allclose(st.cov, torch.cov(x.T, correction=0), atol=1e-9)
    assert torch.allclose(st.energy, (x ** 2).mean(0), rtol=1e-10)
    assert st.count == 120


def test_exactly_affine_mlp_case_is_compensated_exactly():
    """h_P = B h_S + c exactly -> the fold reproduces fc2's output exactly (alpha -> 0)."""
    g = torch.Generator().manual_seed(1)
    S, P, T, Dout = 6, 4, 500, 5
    hs = torch.randn(T, S, generator=g, dtype=torch.float64)
    b_true = torch.randn(P, S, generator=g, dtype=torch.float64)
    c_true = torch.randn(P, generator=g, dtype=torch.float64)
    hp = hs @ b_true.T + c_true
    keep, prune = torch.arange(S), torch.arange(S, S + P)
    h = torch.cat([hs, hp], 1)
    st = MLPStatistics(S + P, gram_dtype=torch.float64)
    st.add_batch(h)
    b, c, lam = mlp_ridge.ridge_affine_map(st.mean, st.cov, keep, prune, alpha=1e-12)
    assert torch.allclose(b, b_true, atol=1e-6) and torch.allclose(c, c_true, atol=1e-6)
    w = torch.randn(Dout, S + P, generator=g, dtype=torch.float64)
    bias = torch.randn(Dout, generator=g, dtype=torch.float64)
    w2, b2 = mlp_ridge.fold_into_fc2(w, bias, keep, prune, b, c)
    assert torch.allclose(hs @ w2.T + b2, h @ w.T + bias, atol=1e-6)
    # without compensation the error is large
    w0, b0 = mlp_ridge.fold_into_fc2(w, bias, keep, prune, None, None)
    assert (hs @ w0.T + b0 - (h @ w.T + bias)).abs().max() > 0.1


def test_ridge_lambda_is_scale_free():
    g = torch.Generator().manual_seed(2)
    h = torch.randn(400, 8, generator=g, dtype=torch.float64)
    h[:, 7] = h[:, :3].sum(1) + 0.1 * torch.randn(400, generator=g, dtype=torch.float64)
    keep, prune = torch.arange(6), torch.tensor([6, 7])
    outs = []
    for scale in (1.0, 1000.0):
        st = MLPStatistics(8, gram_dtype=torch.float64)
        st.add_batch(h * scale)
        b, c, lam = mlp_ridge.ridge_affine_map(st.mean, st.cov, keep, prune, alpha=0.1)
        outs.append((b, c / scale, lam / scale ** 2))
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-9)
    assert torch.allclose(outs[0][1], outs[1][1], atol=1e-9)
    assert math.isclose(outs[0][2], outs[1][2], rel_tol=1e-9)


def test_kronecker_system_matches_explicit_kron():
    g = torch.Generator().manual_seed(3)
    n, d = 5, 6
    q = torch.randn(n, 9, d, generator=g, dtype=torch.float64)
    k = torch.randn(n, 9, d, generator=g, dtype=torch.float64)
    gq, gk = q.transpose(1, 2) @ q, k.transpose(1, 2) @ k
    keep, prune = torch.tensor([0, 2, 3, 5]), torch.tensor([1, 4])
    ks, rhs = qk_logit.kronecker_system(gq, gk, keep, prune)
    ref = sum(torch.kron(gq[i][keep][:, keep], gk[i][keep][:, keep]) for i in range(n))
    ref_rhs = sum(gq[i][keep][:, prune] @ gk[i][prune][:, keep] for i in range(n))
    assert torch.allclose(ks, ref) and torch.allclose(rhs, ref_rhs)


def _logits(q, k, d_h):
    return q @ k.transpose(-1, -2) / math.sqrt(d_h)


def test_exactly_representable_qk_case_is_compensated_exactly():
    """Q_P = Q_S A, K_P = K_S C -> Q_P K_P^T = Q_S (A C^T) K_S^T: M = A C^T exactly, and the
    folded weights reproduce the dense logits (with the dense 1/sqrt(d_h) scale)."""
    g = torch.Generator().manual_seed(4)
    D, d_h, dk, n_img, n_tok = 16, 8, 5, 6, 12
    wq_s = torch.randn(dk, D, generator=g, dtype=torch.float64)
    wk_s = torch.randn(dk, D, generator=g, dtype=torch.float64)
    bq_s = torch.randn(dk, generator=g, dtype=torch.float64)
    bk_s = torch.randn(dk, generator=g, dtype=torch.float64)
    a = torch.randn(dk, d_h - dk, generator=g, dtype=torch.float64)
    c = torch.randn(dk, d_h - dk, generator=g, dtype=torch.float64)
    wq = torch.cat([wq_s, a.T @ wq_s]); bq = torch.cat([bq_s, a.T @ bq_s])
    wk = torch.cat([wk_s, c.T @ wk_s]); bk = torch.cat([bk_s, c.T @ bk_s])
    x = torch.randn(n_img, n_tok, D, generator=g, dtype=torch.float64)
    q, k = x @ wq.T + bq, x @ wk.T + bk
    keep, prune = torch.arange(dk), torch.arange(dk, d_h)
    ks, rhs = qk_logit.kronecker_system(q.transpose(1, 2) @ q, k.transpose(1, 2) @ k, keep, prune)
    m, _ = qk_logit.solve_logit_compensation(ks, rhs, alpha=1e-14)
    assert torch.allclose(m, a @ c.T, atol=1e-6)
    wq2, bq2, wk2, bk2 = qk_logit.fold_logit_compensation(wq_s, bq_s, wk_s, bk_s, m, d_h)
    q2, k2 = x @ wq2.T + bq2, x @ wk2.T + bk2
    pruned_logits = q2 @ k2.transpose(-1, -2) / math.sqrt(dk)  # what SDPA computes at qk_dim=dk
    assert torch.allclose(pruned_logits, _logits(q, k, d_h), atol=1e-6)


def test_fold_without_compensation_keeps_dense_scale():
    g = torch.Generator().manual_seed(5)
    wq, wk = torch.randn(4, 10, generator=g), torch.randn(4, 10, generator=g)
    wq2, _, wk2, _ = qk_logit.fold_logit_compensation(wq, None, wk, None, None, head_dim=16)
    x = torch.randn(7, 10, generator=g)
    got = (x @ wq2.T) @ (x @ wk2.T).T / math.sqrt(4)
    want = (x @ wq.T) @ (x @ wk.T).T / math.sqrt(16)
    assert torch.allclose(got, want, atol=1e-5)


def test_negative_alpha_rejected():
    with pytest.raises(ValueError):
        mlp_ridge.ridge_lambda(torch.eye(3, dtype=torch.float64), -1.0)


def test_first_order_only_statistics_give_the_same_ranking_inputs():
    g = torch.Generator().manual_seed(6)
    h = torch.randn(4, 30, 16, generator=g) * 2 + 1
    full, light = MLPStatistics(16), MLPStatistics(16, second_order=False)
    for chunk in h.split(1):
        full.add_batch(chunk)
        light.add_batch(chunk)
    assert torch.allclose(full.energy, light.energy, atol=1e-9)
    assert torch.allclose(full.active_prob, light.active_prob)
    with pytest.raises(RuntimeError):
        light.cov


def test_float32_batch_grams_match_float64():
    """The default float32 per-batch products (shifted, summed in float64) match float64 ones."""
    g = torch.Generator().manual_seed(7)
    h = torch.randn(8, 257, 96, generator=g) * torch.linspace(0.1, 5, 96) + 3
    f32, f64 = MLPStatistics(96), MLPStatistics(96, gram_dtype=torch.float64)
    for chunk in h.split(2):
        f32.add_batch(chunk)
        f64.add_batch(chunk)
    rel = (f32.cov - f64.cov).abs().max() / f64.cov.abs().max()
    assert rel < 1e-5, rel
    assert (f32.mean - f64.mean).abs().max() < 1e-5 * f64.mean.abs().max()
    assert torch.equal(f32.active_prob, f64.active_prob)
    light = MLPStatistics(96, second_order=False)
    for chunk in h.split(2):
        light.add_batch(chunk)
    assert (light.variance - f64.variance).abs().max() < 1e-5 * f64.variance.abs().max()
