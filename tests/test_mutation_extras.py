"""Small known-answer tests that kill mutants the rest of the suite let survive (issue 17;
``tools/mutation_check.py``, docs/mutation.md). Fast: no model, no data."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from edgeprune.errors import UserError


def _mlp_stats(h: torch.Tensor):
    from edgeprune.calibration.mlp_stats import MLPStatistics

    st = MLPStatistics(h.shape[-1], gram_dtype=torch.float64)
    st.add_batch(h)
    return st


# ---- ranking ---------------------------------------------------------------------------------
def test_mlp_scores_known_answers_for_every_criterion():
    from edgeprune.ranking import mlp_scores

    # 2 tokens, 3 channels: h = [[1, -2, 0], [3, 0, 0]]
    h = torch.tensor([[[1.0, -2.0, 0.0], [3.0, 0.0, 0.0]]], dtype=torch.float64)
    st = _mlp_stats(h)
    w2 = torch.tensor([[3.0, 0.0, 1.0], [4.0, 2.0, 0.0]])   # column norms 5, 2, 1
    energy = torch.tensor([5.0, 2.0, 0.0], dtype=torch.float64)   # E[h^2]
    torch.testing.assert_close(mlp_scores(st, w2, "energy"), energy)
    torch.testing.assert_close(mlp_scores(st, w2, "magnitude"), torch.tensor([5.0, 2.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(mlp_scores(st, w2, "combined"),
                               torch.tensor([5 * 5 ** 0.5, 2 * 2 ** 0.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(mlp_scores(st, w2), mlp_scores(st, w2, "combined"))   # the default
    torch.testing.assert_close(mlp_scores(st, w2, "active"), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    with pytest.raises(UserError, match=r"^unknown MLP criterion 'x', known: combined, energy, magnitude, active$"):
        mlp_scores(st, w2, "x")


def test_qk_and_vo_scores_known_answers_and_errors():
    from edgeprune.calibration.qk_stats import QKStatistics
    from edgeprune.ranking import qk_scores, vo_scores

    st = QKStatistics(1, 2, gram_dtype=torch.float64)
    q = torch.tensor([[[[1.0, 2.0], [0.0, 1.0]]]])       # ||q_0||^2 = 1, ||q_1||^2 = 5
    k = torch.tensor([[[[3.0, 0.0], [0.0, 1.0]]]])       # ||k_0||^2 = 9, ||k_1||^2 = 1
    st.add_batch(q, k)
    torch.testing.assert_close(qk_scores(st), torch.tensor([[9.0, 5.0]], dtype=torch.float64))
    torch.testing.assert_close(qk_scores(st, "logit"), qk_scores(st))
    with pytest.raises(UserError, match=r"unknown Q/K criterion 'x' \(choose from logit"):
        qk_scores(st, "x")
    # V/O: the MLP criteria on proj's input, one row per head
    z = torch.tensor([[[1.0, 2.0, 0.0, 3.0]]], dtype=torch.float64)
    w = torch.eye(4)
    zs = _mlp_stats(z)
    torch.testing.assert_close(vo_scores(zs, w, 2, "energy"), torch.tensor([[1.0, 4.0], [0.0, 9.0]], dtype=torch.float64))
    torch.testing.assert_close(vo_scores(zs, w, 2), torch.tensor([[1.0, 2.0], [0.0, 3.0]], dtype=torch.float64))
    with pytest.raises(UserError, match=r"unknown V/O criterion 'x', known: "):
        vo_scores(zs, w, 2, "x")


# ---- plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim,sparsity,round_to,expected", [
    (512, 0.5, 8, 256), (64, 0.5, 8, 32), (64, 0.7, 8, 16), (64, 0.75, 8, 16), (64, 0.8, 8, 16),
    (64, 0.85, 8, 8), (100, 0.0, 8, 100), (14, 0.01, 8, 14), (64, 0.5, 1, 32), (10, 0.25, 1, 8),
    (10, 0.35, 1, 6), (3, 0.5, 1, 2), (64, 0.9, 8, 8),
])
def test_kept_dim_known_answers(dim, sparsity, round_to, expected):
    from edgeprune.plan import kept_dim

    assert kept_dim(dim, sparsity, round_to) == expected


def test_kept_dim_and_sparsity_errors():
    from edgeprune.plan import check_sparsity, kept_dim

    check_sparsity(0.0)
    check_sparsity(0.999)
    for bad in (1.0, -0.01, 1.5):
        with pytest.raises(UserError, match=f"sparsity must be in \\[0, 1\\), got {bad}"):
            check_sparsity(bad)
    with pytest.raises(UserError, match=r"--round-to must be >= 1, got 0"):
        kept_dim(64, 0.5, 0)
    kept_dim(64, 0.5, 1)
    with pytest.raises(UserError, match=r"sparsity 0.95 with --round-to 8 leaves no dims in block 3 MLP \(dim 64\)"):
        kept_dim(64, 0.95, 8, "block 3 MLP")
    assert kept_dim(1, 0.4, 1) == 1   # round(0.6) = 1: still one dim


def test_resolve_sparsities_known_answers():
    from edgeprune.plan import resolve_sparsities

    def mlp_attn(*args, **kw):
        out = resolve_sparsities(*args, **kw)
        assert all(isinstance(v, float) for v in out.values())
        assert all(v == 0.0 for k, v in out.items() if k not in ("mlp", "attn"))   # v / heads off
        return {"mlp": out["mlp"], "attn": out["attn"]}

    assert mlp_attn("mlp", 0.5) == {"mlp": 0.5, "attn": 0.0}
    assert mlp_attn("attn", 0.25) == {"mlp": 0.0, "attn": 0.25}
    assert mlp_attn("both", 0.5) == {"mlp": 0.5, "attn": 0.5}
    assert mlp_attn("both", 0.5, mlp_sparsity=0.3) == {"mlp": 0.3, "attn": 0.5}
    assert mlp_attn("mlp", None, attn_sparsity=0.2) == {"mlp": 0.0, "attn": 0.2}
    assert mlp_attn("both", None, 0.1, 0.2) == {"mlp": 0.1, "attn": 0.2}
    assert mlp_attn("mlp", 1 / 2)["mlp"] == 0.5
    with pytest.raises(UserError, match=r"unknown target 'x' \(choose from mlp, attn, both"):
        resolve_sparsities("x", 0.5)
    with pytest.raises(UserError, match="sparsity must be in"):
        resolve_sparsities("both", 0.5, attn_sparsity=1.0)


def test_pruned_indices_is_the_sorted_complement():
    from edgeprune.plan import pruned_indices

    assert pruned_indices(torch.tensor([1, 3]), 5).tolist() == [0, 2, 4]
    assert pruned_indices(torch.tensor([3, 1]), 5).tolist() == [0, 2, 4]
    assert pruned_indices(torch.arange(4), 4).tolist() == []
    assert pruned_indices(torch.tensor([], dtype=torch.int64), 3).tolist() == [0, 1, 2]


# ---- MLP solver: the fold keeps the mean output exactly; ridge lambda -------------------------
def test_mlp_fold_preserves_the_mean_output_exactly_and_lambda_is_known():
    from edgeprune.solve.mlp_ridge import fold_into_fc2, ridge_affine_map, ridge_lambda

    g = torch.Generator().manual_seed(0)
    h = (torch.randn(1, 400, 10, generator=g, dtype=torch.float64) + 2.0).relu()
    st = _mlp_stats(h)
    w = torch.randn(4, 10, generator=g, dtype=torch.float64)
    bias = torch.randn(4, generator=g, dtype=torch.float64)
    keep, prune = torch.tensor([0, 2, 5, 7, 9]), torch.tensor([1, 3, 4, 6, 8])
    b, c, lam = ridge_affine_map(st.mean, st.cov, keep, prune, alpha=0.1)
    cov_ss = st.cov[keep][:, keep]
    assert lam == pytest.approx(0.1 * float(torch.diagonal(cov_ss).mean()), rel=1e-12)
    assert ridge_lambda(cov_ss, 0.1) == pytest.approx(lam)
    # B = Sigma_PS (Sigma_SS + lam I)^-1, c = mu_P - B mu_S
    exp_b = st.cov[prune][:, keep] @ torch.linalg.inv(cov_ss + lam * torch.eye(5, dtype=torch.float64))
    torch.testing.assert_close(b, exp_b, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(c, st.mean[prune] - exp_b @ st.mean[keep], rtol=1e-9, atol=1e-10)
    w2, b2 = fold_into_fc2(w, bias, keep, prune, b, c)
    # whatever B is, c makes the mean output exact: W' mu_S + b' = W mu + b
    torch.testing.assert_close(w2 @ st.mean[keep] + b2, w @ st.mean + bias, rtol=1e-10, atol=1e-10)
    # without compensation: plain column removal, bias unchanged
    w0, b0 = fold_into_fc2(w, bias, keep, prune, None, None)
    torch.testing.assert_close(w0, w[:, keep])
    torch.testing.assert_close(b0, bias)
    # no bias: treated as zero
    _, bz = fold_into_fc2(w, None, keep, prune, b, c)
    torch.testing.assert_close(bz, w[:, prune] @ c)
    with pytest.raises(ValueError):
        ridge_lambda(cov_ss, -1.0)


# ---- Q/K solver: lambda, solution of the normal equation ---------------------------------------
def test_qk_solver_solves_the_normal_equation_with_the_documented_lambda():
    from edgeprune.solve.qk_logit import kronecker_system, ridge_lambda, solve_logit_compensation, kept_blocks

    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 12, 6, generator=g, dtype=torch.float64)
    k = torch.randn(4, 12, 6, generator=g, dtype=torch.float64)
    gq, gk = q.transpose(1, 2) @ q, k.transpose(1, 2) @ k
    keep, prune = torch.tensor([0, 1, 4]), torch.tensor([2, 3, 5])
    k_sys, rhs = kronecker_system(gq, gk, keep, prune)
    m, lam = solve_logit_compensation(k_sys, rhs, alpha=0.05)
    assert lam == pytest.approx(0.05 * float(torch.diagonal(k_sys).mean()), rel=1e-12)
    gq_ss, gk_ss, rhs2 = kept_blocks(gq, gk, keep, prune)
    assert ridge_lambda(gq_ss, gk_ss, 0.05) == pytest.approx(lam, rel=1e-10)
    torch.testing.assert_close(rhs2, rhs)
    # sum_i Gq_i M Gk_i + lam M = rhs
    lhs = sum(gq_ss[i] @ m @ gk_ss[i] for i in range(4)) + lam * m
    torch.testing.assert_close(lhs, rhs, rtol=1e-8, atol=1e-8)
    m0, lam0 = solve_logit_compensation(k_sys, rhs, alpha=0.0)
    assert lam0 == 0.0
    lhs0 = sum(gq_ss[i] @ m0 @ gk_ss[i] for i in range(4))
    torch.testing.assert_close(lhs0, rhs, rtol=1e-7, atol=1e-7)
    with pytest.raises(ValueError):
        solve_logit_compensation(k_sys, rhs, alpha=-1.0)
    with pytest.raises(ValueError):
        ridge_lambda(gq_ss, gk_ss, -1.0)


def test_qk_fold_gives_the_compensated_logits_at_the_dense_scale():
    from edgeprune.solve.qk_logit import fold_logit_compensation

    g = torch.Generator().manual_seed(3)
    d, D, head_dim = 4, 7, 16
    wq, wk = torch.randn(d, D, generator=g), torch.randn(d, D, generator=g)
    bq, bk = torch.randn(d, generator=g), torch.randn(d, generator=g)
    m = 0.1 * torch.randn(d, d, generator=g, dtype=torch.float64)
    x = torch.randn(9, D, generator=g)
    wq2, bq2, wk2, bk2 = fold_logit_compensation(wq, bq, wk, bk, m, head_dim)
    assert wq2.dtype == wq.dtype and bk2.dtype == bk.dtype
    got = ((x @ wq2.T + bq2) @ (x @ wk2.T + bk2).T) / d ** 0.5
    qs, ks = (x @ wq.T + bq).double(), (x @ wk.T + bk).double()
    expected = qs @ (torch.eye(d, dtype=torch.float64) + m) @ ks.T / head_dim ** 0.5
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)
    wq3, bq3, wk3, bk3 = fold_logit_compensation(wq, None, wk, None, None, head_dim)
    assert bq3 is None and bk3 is None
    torch.testing.assert_close(wq3, wq * (d / head_dim) ** 0.5)
    torch.testing.assert_close(wk3, wk)


# ---- FLOPs / params --------------------------------------------------------------------------
def test_model_flops_parts_and_params_known_answers():
    from edgeprune.anatomy import find_anatomy
    from edgeprune.flops import block_flops, count_params, model_flops
    from edgeprune.zoo.fmnist_vit import create_fmnist_vit

    model = create_fmnist_vit(pretrained=False)
    an = find_anatomy(model)
    f = model_flops(an)
    assert f["patch_embed"] == 2 * 49 * 1 * 4 * 4 * 128
    assert f["head"] == 2 * 128 * 10
    n, D = 49, 128
    b = block_flops(an.blocks[0], n)
    assert b == {"qkv": 2 * n * D * 2 * (3 * 64), "attn": 2 * n * n * 2 * (64 + 64),
                 "proj": 2 * n * 2 * 64 * D, "mlp": 4 * n * D * 512,
                 "total": b["qkv"] + b["attn"] + b["proj"] + b["mlp"]}
    assert f["blocks"][0] == b and len(f["blocks"]) == 6
    assert f["total"] == f["patch_embed"] + f["head"] + 6 * b["total"]
    assert count_params(torch.nn.Linear(3, 2)) == 8
    assert count_params(model) == sum(p.numel() for p in model.parameters())


# ---- runner statistics -----------------------------------------------------------------------
def test_latency_summary_mean_std_and_errors():
    try:
        from runners.report import summarize_latencies
    except ImportError:
        from runners.base import summarize_latencies

    vals = [1.0, 2.0, 4.0, 9.0]
    out = summarize_latencies(vals)
    assert out["mean"] == pytest.approx(4.0)
    assert out["std"] == pytest.approx(statistics.pstdev(vals))
    assert out["min"] == 1.0 and out["max"] == 9.0
    assert out["p50"] == pytest.approx(3.0)
    assert summarize_latencies([5.0])["std"] == 0.0
    with pytest.raises(ValueError, match="no latencies"):
        summarize_latencies([])


def test_ratio_stats_errors_and_zero_guard():
    from runners.compare import ratio_stats

    out = ratio_stats([2.0, 4.0, 6.0], [1.0, 2.0, 1.0])
    assert out["median"] == pytest.approx(2.0) and out["mean"] == pytest.approx(10 / 3)
    with pytest.raises(ValueError, match="equally many"):
        ratio_stats([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="equally many"):
        ratio_stats([], [])
    assert np.isfinite(ratio_stats([1.0], [0.0])["mean"])


# ---- verify ----------------------------------------------------------------------------------
def test_compare_outputs_saliency_shape_and_nonfinite():
    from exporters.verify import compare_outputs, infer_output_kind

    assert infer_output_kind(np.zeros((2, 3))) == "logits"
    assert infer_output_kind(np.zeros((2, 1, 4, 4))) == "saliency"
    assert infer_output_kind(np.zeros((2, 3)), "saliency") == "saliency"
    a = np.array([[[0.9, 0.1], [0.6, 0.2]]], dtype=np.float32)
    b = np.array([[[0.8, 0.1], [0.4, 0.2]]], dtype=np.float32)
    rep = compare_outputs(a, b, atol=0.25)
    assert rep["output_kind"] == "saliency" and rep["agreement"] == pytest.approx(0.75)
    assert rep["passed"] and rep["max_abs_diff"] == pytest.approx(0.2, abs=1e-6)
    assert rep["mean_abs_diff"] == pytest.approx(0.075, abs=1e-6)
    assert rep["max_abs_reference"] == pytest.approx(0.8, abs=1e-6)
    assert rep["n"] == 1 and rep["output_shape"] == [2, 2]
    assert not compare_outputs(a, b, atol=0.15)["passed"]
    bad = a.copy()
    bad[0, 0, 0] = np.nan
    assert not compare_outputs(bad, b, atol=10.0)["passed"]
    assert not compare_outputs(b, bad, atol=10.0)["passed"]
    with pytest.raises(UserError, match="output shape mismatch"):
        compare_outputs(a, b[:, :1])


def test_mlp_fold_edge_cases_dtype_single_channel_and_alpha_zero():
    from edgeprune.solve.mlp_ridge import fold_into_fc2, ridge_affine_map, ridge_lambda

    g = torch.Generator().manual_seed(5)
    h = torch.randn(1, 300, 4, generator=g, dtype=torch.float64)
    h[..., 3] = 2 * h[..., 0] - h[..., 1] + 0.5          # channel 3 exactly affine in 0, 1
    st = _mlp_stats(h)
    w = torch.randn(3, 4, generator=g)                    # float32 weights
    bias = torch.randn(3, generator=g)
    keep, prune = torch.tensor([0, 1, 2]), torch.tensor([3])   # ONE pruned channel
    b, c, lam = ridge_affine_map(st.mean, st.cov, keep, prune, alpha=0.0)
    assert lam == 0.0 and ridge_lambda(st.cov[keep][:, keep], 0.0) == 0.0
    w2, b2 = fold_into_fc2(w, bias, keep, prune, b, c)
    assert w2.dtype == torch.float32 and b2.dtype == torch.float32
    x = h.reshape(-1, 4)
    torch.testing.assert_close((x[:, keep].float() @ w2.T + b2).double(), (x.float() @ w.T + bias).double(),
                               rtol=1e-4, atol=1e-4)   # exact compensation of the affine channel
    # only one of b, c given: treated as no compensation (plain removal)
    w3, b3 = fold_into_fc2(w, bias, keep, prune, b, None)
    torch.testing.assert_close(w3, w[:, keep])
    torch.testing.assert_close(b3, bias)


def test_removal_error_equals_the_empirical_output_error():
    from edgeprune.solve import mlp_ridge

    if not hasattr(mlp_ridge, "removal_error"):
        pytest.skip("no removal_error in this version")
    g = torch.Generator().manual_seed(6)
    h = (torch.randn(1, 500, 8, generator=g, dtype=torch.float64) + 1.0).relu()
    st = _mlp_stats(h)
    w = torch.randn(5, 8, generator=g, dtype=torch.float64)
    keep, prune = torch.tensor([0, 3, 4, 6]), torch.tensor([1, 2, 5, 7])
    x = h.reshape(-1, 8)
    plain = mlp_ridge.removal_error(st.mean, st.cov, w, keep, prune)
    assert plain == pytest.approx(float(((x[:, prune] @ w[:, prune].T) ** 2).sum(1).mean()), rel=1e-9)
    b, c, _ = mlp_ridge.ridge_affine_map(st.mean, st.cov, keep, prune, alpha=0.01)
    comp = mlp_ridge.removal_error(st.mean, st.cov, w, keep, prune, b, c)
    resid = x[:, prune] - x[:, keep] @ b.T - c
    assert comp == pytest.approx(float(((resid @ w[:, prune].T) ** 2).sum(1).mean()), rel=1e-8)
    assert comp < plain
    # only one of b, c given: plain removal, as in the fold
    assert mlp_ridge.removal_error(st.mean, st.cov, w, keep, prune, b, None) == pytest.approx(plain)
    # a biased c adds its squared output
    comp_shift = mlp_ridge.removal_error(st.mean, st.cov, w, keep, prune, b, c + 1.0)
    resid2 = resid - 1.0
    assert comp_shift == pytest.approx(float(((resid2 @ w[:, prune].T) ** 2).sum(1).mean()), rel=1e-8)


def test_plan_defaults_heads_and_v_targets():
    from edgeprune import plan

    assert plan.kept_dim(64, 0.7) == 16                    # default round_to = 8 (9 would give 18)
    with pytest.raises(UserError, match=r"leaves no dims in module \(dim 8\)"):
        plan.kept_dim(8, 0.9)
    if hasattr(plan, "kept_heads"):
        for (h, s), k in {(6, 0.5): 3, (6, 0.0): 6, (2, 0.9): 1, (12, 0.3): 8, (3, 0.5): 2,
                          (12, 0.99): 1, (4, 0.1): 4}.items():
            assert plan.kept_heads(h, s) == k, (h, s)
        with pytest.raises(UserError):
            plan.kept_heads(6, 1.0)
    keys = getattr(plan, "SPARSITY_KEYS", ("mlp", "attn"))
    if "v" in keys:
        out = plan.resolve_sparsities("v", 0.5)
        assert out == {"mlp": 0.0, "attn": 0.0, "v": 0.5, "heads": 0.0}
        assert plan.resolve_sparsities("heads", 0.25)["heads"] == 0.25
        assert plan.resolve_sparsities("all", 0.5) == {"mlp": 0.5, "attn": 0.5, "v": 0.5, "heads": 0.0}
        assert plan.resolve_sparsities("mlp", 0.5, v_sparsity=0.3)["v"] == 0.3
        assert plan.resolve_sparsities("mlp", 0.5, head_sparsity=0.3)["heads"] == 0.3
        with pytest.raises(UserError):
            plan.resolve_sparsities("mlp", 0.5, head_sparsity=1.0)


def test_achieved_sparsity_known_answers():
    from edgeprune import plan

    if not hasattr(plan, "achieved_sparsity"):
        pytest.skip("no achieved_sparsity in this version")
    dense = [dict(num_heads=4, qk_dim=64, v_dim=64, mlp_hidden=512)] * 2
    pruned = [dict(num_heads=4, qk_dim=32, v_dim=64, mlp_hidden=256),
              dict(num_heads=2, qk_dim=64, v_dim=16, mlp_hidden=512)]
    got = plan.achieved_sparsity(dense, pruned)
    assert got["mlp"] == pytest.approx(1 - 768 / 1024)
    assert got["attn"] == pytest.approx(1 - (4 * 32 + 2 * 64) / (8 * 64))
    if "v" in getattr(plan, "SPARSITY_KEYS", ()):
        assert set(got) == {"mlp", "attn", "v", "heads"}
        assert got["v"] == pytest.approx(1 - (4 * 64 + 2 * 16) / (8 * 64))
        assert got["heads"] == pytest.approx(1 - 6 / 8)
    assert plan.achieved_sparsity(dense, dense)["mlp"] == 0.0
    # no blocks (nothing to prune): 0.0, not a division by zero
    assert all(v == 0.0 for v in plan.achieved_sparsity([], []).values())


def test_latency_std_of_two_and_sub_millisecond_ratios():
    try:
        from runners.report import summarize_latencies
    except ImportError:
        from runners.base import summarize_latencies
    from runners.compare import ratio_stats

    assert summarize_latencies([1.0, 3.0])["std"] == pytest.approx(1.0)
    out = ratio_stats([0.5, 0.3], [0.25, 0.1])      # sub-millisecond latencies are real ratios
    assert out["mean"] == pytest.approx(2.5) and out["median"] == pytest.approx(2.5)


def test_qk_solver_small_scale_zero_alpha_and_exact_ridge():
    """Small activations (traces < 1), alpha = 0 and a large ridge: lambda and M exactly as
    documented, in float64."""
    from edgeprune.solve.qk_logit import kept_blocks, kronecker_system, ridge_lambda, solve_logit_compensation

    g = torch.Generator().manual_seed(7)
    q = 1e-3 * torch.randn(3, 10, 5, generator=g, dtype=torch.float64)
    k = 1e-3 * torch.randn(3, 10, 5, generator=g, dtype=torch.float64)
    gq, gk = q.transpose(1, 2) @ q, k.transpose(1, 2) @ k
    keep, prune = torch.tensor([0, 2, 3]), torch.tensor([1, 4])
    k_sys, rhs = kronecker_system(gq, gk, keep, prune)
    gq_ss, gk_ss, _ = kept_blocks(gq, gk, keep, prune)
    tr = sum(float(torch.trace(gq_ss[i]) * torch.trace(gk_ss[i])) for i in range(3))
    assert ridge_lambda(gq_ss, gk_ss, 0.3) == pytest.approx(0.3 * tr / 9, rel=1e-12)
    assert ridge_lambda(gq_ss, gk_ss, 0.0) == 0.0
    m, lam = solve_logit_compensation(k_sys, rhs, alpha=0.3)
    assert lam == pytest.approx(0.3 * float(torch.diagonal(k_sys).mean()), rel=1e-12)
    assert lam == pytest.approx(0.3 * tr / 9, rel=1e-10)     # tr(K) = sum_i tr(Gq_i) tr(Gk_i)
    # a large ridge: the float64 normal equation holds to round-off (lambda not rounded)
    m, lam = solve_logit_compensation(k_sys, rhs, alpha=10.0)
    lhs = sum(gq_ss[i] @ m @ gk_ss[i] for i in range(3)) + lam * m
    torch.testing.assert_close(lhs, rhs, rtol=1e-11, atol=0)


def test_qk_fold_with_compensation_and_no_biases():
    from edgeprune.solve.qk_logit import fold_logit_compensation

    g = torch.Generator().manual_seed(8)
    d, D = 3, 5
    wq, wk = torch.randn(d, D, generator=g), torch.randn(d, D, generator=g)
    m = 0.2 * torch.randn(d, d, generator=g, dtype=torch.float64)
    wq2, bq2, wk2, bk2 = fold_logit_compensation(wq, None, wk, None, m, d)
    assert bq2 is None and bk2 is None
    torch.testing.assert_close((wq2.T @ wk2).double(),
                               wq.T.double() @ (torch.eye(d, dtype=torch.float64) + m) @ wk.double(),
                               rtol=1e-4, atol=1e-5)


def test_compare_outputs_defaults_boundaries_and_infinite_tolerance():
    import warnings

    from exporters.verify import compare_outputs, infer_output_kind

    assert infer_output_kind(np.zeros((2, 1, 4, 4)), "logits") == "logits"
    assert infer_output_kind(np.zeros((2, 3)), "bogus") == "logits"
    ref = np.zeros((2, 3), dtype=np.float32)
    # default atol is 1e-4, default rtol 0
    rep = compare_outputs(ref + np.float32(5e-5), ref)
    assert rep["passed"] and rep["atol"] == 1e-4 and rep["rtol"] == 0.0
    assert not compare_outputs(ref + np.float32(5e-4), ref)["passed"]
    rep = compare_outputs(ref, ref, atol=0.5, rtol=0.25)
    assert rep["atol"] == 0.5 and rep["rtol"] == 0.25
    # the tolerance is inclusive: |diff| == atol passes
    assert compare_outputs(ref + np.float32(0.25), ref, atol=0.25)["passed"]
    # a declared kind wins over the shape
    rep = compare_outputs(np.array([[0.6, 0.2]]), np.array([[0.6, 0.7]]), output_kind="saliency", atol=1.0)
    assert rep["output_kind"] == "saliency" and rep["agreement_metric"] == "mask_agreement@0.5"
    assert rep["agreement"] == pytest.approx(0.5)
    # the mask threshold is strict: 0.5 is background on both sides
    rep = compare_outputs(np.array([[[0.5, 0.9]]]), np.array([[[0.4, 0.9]]]), atol=1.0)
    assert rep["agreement"] == 1.0
    rep = compare_outputs(np.array([[[0.4, 0.9]]]), np.array([[[0.5, 0.9]]]), atol=1.0)
    assert rep["agreement"] == 1.0
    # infinite values fail even with an infinite tolerance, on either side
    inf = np.array([[np.inf, 0.0]])
    fin = np.array([[1.0, 0.0]])
    with np.errstate(invalid="ignore"):
        assert not compare_outputs(inf, fin, atol=np.inf)["passed"]
        assert not compare_outputs(fin, inf, atol=np.inf)["passed"]
        assert compare_outputs(fin, fin, atol=np.inf)["passed"]
    # an empty batch: zero differences, no crash
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = compare_outputs(np.zeros((0, 3)), np.zeros((0, 3)), output_kind="saliency")
    assert rep["n"] == 0 and rep["max_abs_diff"] == 0.0 and rep["mean_abs_diff"] == 0.0
    assert rep["max_abs_reference"] == 0.0


# ---- NuWa energy ratios / rank ---------------------------------------------------------------
def test_nuwa_energy_ratios_small_and_zero_spectra_and_rank_edges():
    from edgeprune.nuwa.ofp_mha import energy_ratios, rank_for_energy

    # total energy < 1: still a ratio (0.36 / 0.45), not divided by 1
    torch.testing.assert_close(energy_ratios(torch.tensor([[0.6, 0.3]])),
                               torch.tensor([0.8, 1.0], dtype=torch.float64))
    # an all-zero head retains "everything" (ratio 1), averaged with a normal head
    torch.testing.assert_close(energy_ratios(torch.tensor([[2.0, 1.0], [0.0, 0.0]])),
                               torch.tensor([0.9, 1.0], dtype=torch.float64))
    s8 = torch.tensor([[3.0, 1.0, 1.0, 1.0]])             # 0.75 at rank 1, exactly
    assert rank_for_energy(s8, 0.75, round_to=1) == 1
    assert rank_for_energy(s8, 1.5, round_to=1) == 4        # unreachable rho: the full dim
    s12 = torch.ones(2, 12)
    assert rank_for_energy(s12, 1.0) == 12                  # full dim, not floored to 8
    assert rank_for_energy(s12, 0.7) == 8                   # r = 9 floored to 8
    assert rank_for_energy(s12, 0.1) == 8                   # at least round_to


def test_model_flops_counts_a_wrapper_head_and_no_linear_head():
    from edgeprune.anatomy import find_anatomy
    from edgeprune.flops import model_flops
    from edgeprune.zoo.fmnist_vit import create_fmnist_vit

    vit = create_fmnist_vit(pretrained=False)
    base = model_flops(find_anatomy(vit))

    class Wrapper(torch.nn.Module):
        def __init__(self, backbone):
            super().__init__()
            self.backbone = backbone

        def head_flops(self, img_size):
            assert tuple(img_size) == (28, 28)
            return 1000

    wrapped = model_flops(find_anatomy(Wrapper(vit)))
    assert wrapped["head"] == base["head"] + 1000 == 2 * 128 * 10 + 1000
    assert wrapped["total"] == base["total"] + 1000
    # a ViT that defines head_flops itself (not a wrapper) is not counted twice
    vit.head_flops = lambda img_size: 10 ** 9
    assert model_flops(find_anatomy(vit))["head"] == base["head"]
    # no linear head: 0
    vit.head = torch.nn.Identity()
    nohead = model_flops(find_anatomy(vit))
    assert nohead["head"] == 0 and nohead["total"] == base["total"] - base["head"]
    del vit.head                       # no head attribute at all: also 0
    assert model_flops(find_anatomy(vit))["head"] == 0
