"""Budgeted allocation (--flops / --params, issue 14; METHODS.md §5 "Budgeted allocation")."""

from __future__ import annotations

import json

import pytest
import torch

from edgeprune.allocation import curves as E
from edgeprune.allocation import greedy
from edgeprune.budget import Budget, make_budget, parse_budget_value
from edgeprune.anatomy import find_anatomy
from edgeprune.api import prune
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp import CorpConfig
from edgeprune.errors import UserError
from edgeprune.plan import kept_dim
from edgeprune.solve import mlp_ridge
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli, tiny_vit


@pytest.fixture(scope="module")
def tiny():
    """A 2-block timm ViT (width 32, 2 heads of 16, MLP 128, 17 tokens) and 24 random images."""
    model = tiny_vit()
    x = torch.randn(24, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return model, x


# --- parsing -------------------------------------------------------------------------------

def test_budget_values_parse():
    assert parse_budget_value("0.5") == 0.5
    assert parse_budget_value("2.3G") == pytest.approx(2.3e9)
    assert parse_budget_value("20M") == pytest.approx(2e7)
    assert parse_budget_value("750k") == pytest.approx(7.5e5)
    assert parse_budget_value(0.25) == 0.25
    assert make_budget(params="1") == {"kind": "params", "value": 1.0}
    for bad in ("0", "-0.5", "1.5x", "G", "", "nan"):
        with pytest.raises(UserError):
            parse_budget_value(bad)
    with pytest.raises(UserError, match="not both"):
        make_budget(flops=0.5, params=0.5)


# --- known answers of the error curves --------------------------------------------------------

def _random_cov(d, n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)
    h = h + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)
    mu = h.mean(0)
    return mu, (h - mu).T @ (h - mu) / n


def test_prefix_errors_try_the_largest_jitter_whatever_the_rounding():
    """The last jitter try (1e-4 x mean diag) is made even where 1e-12 m 100^4 rounds above
    1e-4 m (this mean diagonal, from a covariance of 4 calibration images that raised
    LinAlgError before): a symmetric matrix with eigenvalue -1e-3 x its jitter step is factored."""
    m = 0.0001990007272647266
    jitter = 1e-12 * m
    for _ in range(4):
        jitter *= 100
    assert jitter > 1e-4 * m  # the rounding that skipped the last try
    b = m + 5e-9  # eigenvalues 2m + 5e-9 and -5e-9: the 1e-6 m jitter (2e-10) is too small
    a = torch.tensor([[m, b], [b, m]], dtype=torch.float64)
    assert float(torch.diagonal(a).abs().mean()) == m
    got = E.prefix_errors(a, torch.eye(2, dtype=torch.float64), torch.arange(2), [0], 0.0)
    assert got[0] == pytest.approx(2 * m + 2 * jitter, rel=1e-9)  # tr(A + jitter I)


def test_prefix_errors_equal_the_fold_error_computed_directly():
    """E(k) from one Cholesky = the output error left after the ridge fold (alpha = 0: exact)."""
    mu, cov = _random_cov(12)
    w = torch.randn(5, 12, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(4))
    ks = [0, 3, 5, 8, 11, 12]
    got = E.prefix_errors(cov, w, order, ks, 0.0)
    for k, e in zip(ks, got):
        s, p = order[:k].sort().values, order[k:].sort().values
        if len(p) == 0:
            assert e == 0.0
            continue
        if k == 0:
            want = float((w @ cov * w).sum())
        else:
            b, c, _ = mlp_ridge.ridge_affine_map(mu, cov, s, p, 0.0)
            want = mlp_ridge.removal_error(mu, cov, w, s, p, b, c)
        assert e == pytest.approx(want, rel=1e-9, abs=1e-9)
    # with a ridge lambda: E(k) is the minimised ridge objective, calibration error after the fold
    # plus the penalty lam ||W_P B||_F^2 (so it bounds the calibration error from above)
    lam = 1e-3 * float(torch.diagonal(cov).mean())
    for k, e in zip(ks[1:-1], E.prefix_errors(cov, w, order, ks[1:-1], lam)):
        s, p = order[:k].sort().values, order[k:].sort().values
        a = cov[s][:, s] + lam * torch.eye(k, dtype=torch.float64)
        b = torch.linalg.solve(a, cov[s][:, p]).T
        fit = mlp_ridge.removal_error(mu, cov, w, s, p, b, mu[p] - b @ mu[s])
        assert e == pytest.approx(fit + lam * float((w[:, p] @ b).pow(2).sum()), rel=1e-9)
        assert fit < e


def test_qk_curve_is_the_diagonal_m_least_squares_residual():
    """The Schur/Cholesky Q/K error = min over diagonal M of sum_i ||Q_P K_P^T - Q_S diag(m) K_S^T||^2,
    solved here by plain least squares on the logits, and it lies between the full-M residual and
    the uncompensated one."""
    from edgeprune.solve import qk_logit

    g = torch.Generator().manual_seed(5)
    n_img, n, d = 6, 10, 8
    q = torch.randn(n_img, n, d, generator=g, dtype=torch.float64) * torch.linspace(2, 0.3, d, dtype=torch.float64)
    k = torch.randn(n_img, n, d, generator=g, dtype=torch.float64) + 0.5 * q
    gq, gk = q.transpose(1, 2) @ q, k.transpose(1, 2) @ k
    t = (gq * gk).sum(0)
    order = torch.tensor([2, 0, 5, 1, 7, 3, 6, 4])
    for kk, e in zip([2, 4, 6], E.qk_head_errors(t, order, [2, 4, 6], 0.0)):
        s, p = order[:kk], order[kk:]
        target = (q[:, :, p] @ k[:, :, p].transpose(1, 2)).reshape(-1)
        cols = torch.stack([(q[:, :, j:j + 1] @ k[:, :, j:j + 1].transpose(1, 2)).reshape(-1) for j in s], 1)
        m = torch.linalg.lstsq(cols, target[:, None]).solution
        want = float((target[:, None] - cols @ m).pow(2).sum())
        assert e == pytest.approx(want, rel=1e-8)
        plain = float(target.pow(2).sum())
        ks, ps = s.sort().values, p.sort().values
        k_sys, rhs = qk_logit.kronecker_system(gq, gk, ks, ps)
        mf, _ = qk_logit.solve_logit_compensation(k_sys, rhs, 0.0)
        full = float((q[:, :, ps] @ k[:, :, ps].transpose(1, 2)
                      - q[:, :, ks] @ mf @ k[:, :, ks].transpose(1, 2)).pow(2).sum())
        assert full <= e * (1 + 1e-9) and e <= plain


def test_v_curve_prefix_is_the_top_k_of_every_head(tiny):
    model, x = tiny
    an = find_anatomy(model)
    cfg = CorpConfig.from_target("v", None, budget={"kind": "flops", "value": 0.9}, ridge_alpha=0.0, round_to=4)
    stats = collect_statistics(an, [x], mlp=False, qk=False, vo=True, progress=False)
    b, st = an.blocks[1], stats.vo[1]
    curve = E.v_curve(b, st, cfg)
    from edgeprune.ranking import top_k_indices, vo_scores
    from edgeprune.vo import head_channels

    scores = vo_scores(st, b.proj.weight.detach(), b.num_heads)
    for kk, raw in zip(curve.ks, curve.raw):
        if kk == b.v_dim:
            continue
        keep = head_channels(torch.arange(b.num_heads), top_k_indices(scores, kk), b.v_dim)
        prune_ = torch.tensor([j for j in range(b.num_heads * b.v_dim) if j not in set(keep.tolist())])
        bm, c, _ = mlp_ridge.ridge_affine_map(st.mean, st.cov, keep, prune_, 0.0)
        want = mlp_ridge.removal_error(st.mean, st.cov, b.proj.weight.detach(), keep, prune_, bm, c)
        assert raw == pytest.approx(want, rel=1e-7)


# --- the budget is met -----------------------------------------------------------------------

@pytest.mark.parametrize("kind,value", [("flops", 0.6), ("params", 0.45), ("flops", "abs"), ("params", "abs")])
def test_budget_is_met_within_one_percent_never_above(tiny, kind, value):
    model, x = tiny
    dense_rec = prune(model, x, target="both", sparsity=0.0).record
    dense = dense_rec[f"dense_{kind}"]
    target = 0.55 * dense if value == "abs" else value * dense
    budget = f"{target / 1e3:.6f}k" if value == "abs" else value
    res = prune(model, x, target="both", round_to=2, **{kind: budget})
    rec = res.record
    got = rec[kind]  # counted on the pruned model itself
    assert got <= target + 1e-6
    assert got >= 0.99 * target, (got, target)
    alloc = rec["allocation"]
    assert alloc["achieved_cost"] == pytest.approx(got)  # the cost model is exact
    assert alloc["flops"] == rec["flops"] and alloc["params"] == rec["params"]
    for blk, dims in zip(rec["blocks"], alloc["blocks"]):
        assert blk["mlp_hidden"] == dims["dims"]["mlp"] and blk["qk_dim"] == dims["dims"]["qk"]
    json.dumps(alloc)


@pytest.mark.parametrize("settings", [{"target": "all"}, {"target": "heads"},
                                      {"target": "all", "layout": "fused"}, {"target": "both", "compensation": False}])
def test_other_targets_never_exceed_the_budget_and_the_cost_model_is_exact(tiny, settings):
    model, x = tiny
    res = prune(model, x, round_to=2, params=0.9, **settings)
    rec, alloc = res.record, res.record["allocation"]
    assert rec["params"] <= 0.9 * rec["dense_params"]
    assert alloc["achieved_cost"] == rec["params"] and alloc["flops"] == rec["flops"]
    for blk, d in zip(rec["blocks"], alloc["blocks"]):
        names = {"mlp": "mlp_hidden", "qk": "qk_dim", "v": "v_dim", "heads": "num_heads"}
        assert all(blk[names[k]] == v for k, v in d["dims"].items())
    if settings.get("layout") == "fused":
        assert all(b["qk_dim"] == b["v_dim"] for b in rec["blocks"])


@pytest.mark.parametrize("which", ["tiny", "fmnist"])
def test_allocation_is_never_worse_than_uniform_on_its_proxy(tiny, which, request):
    """At a budget uniform pruning meets exactly (uniform sparsity 0.5), the chosen allocation's
    proxy (recomputed here from the curves) is <= the uniform allocation's."""
    model, x = tiny
    if which == "fmnist":
        model = request.getfixturevalue("fmnist_model")
        x = request.getfixturevalue("fmnist_calib")[0][:64]
    an = find_anatomy(model)
    stats = collect_statistics(an, [x], progress=False)
    # the full last block: the cost model here prices every block as it is (the class-token last
    # block's pricing is tested in tests/test_class_token_block.py)
    cfg = CorpConfig.from_target("both", None, round_to=4, budget={"kind": "flops", "value": 1.0},
                                 last_block="full")
    curves = greedy.build_curves(an, stats, cfg)
    uni_dims = [{"mlp": kept_dim(b.mlp_hidden, 0.5, 4), "qk": kept_dim(b.qk_dim, 0.5, 4),
                 "v": b.v_dim, "heads": b.num_heads} for b in an.blocks]
    from edgeprune.budget import total_cost

    target = total_cost(Budget("flops", 0.5).cost_model(an), an, uni_dims)
    cfg.budget = Budget("flops", target)

    def proxy(dims):
        return sum(c.errors[c.ks.index(dims[c.block][c.keys[0]])] for c in curves)

    dims, report = greedy.allocate(an, stats, cfg)
    assert proxy(dims) <= proxy(uni_dims) + 1e-12
    assert total_cost(Budget("flops", 0.5).cost_model(an), an, [{**u, **d} for u, d in zip(uni_dims, dims)]) <= target


@needs_fmnist
def test_greedy_beats_uniform_on_fmnist_vit(fmnist_model, fmnist_calib):
    """On the trained model the greedy allocation itself (not the uniform fallback) has a lower
    proxy than the uniform one at the same FLOPs budget, and meets it within 1%."""
    calib, _, _ = fmnist_calib
    an = find_anatomy(fmnist_model)
    stats = collect_statistics(an, [calib[:64]], qk_grams=True, progress=False)
    cfg = CorpConfig.from_target("both", None, budget={"kind": "flops", "value": 0.5})
    dims, report = greedy.allocate(an, stats, cfg)
    assert report["proxy_error"]["greedy"] < 0.8 * report["proxy_error"]["uniform"]
    assert report["chosen"] == "greedy" and report["within_tolerance"]
    assert 0.495 <= report["flops_fraction"] <= 0.5


def test_budget_below_the_cheapest_allocation_is_refused_before_calibration(tiny):
    model, _ = tiny

    def no_batches():
        raise AssertionError("calibration should not start")

    with pytest.raises(UserError, match="below the cheapest"):
        prune(model, no_batches, target="both", flops=0.05)


# --- CLI ----------------------------------------------------------------------------------------

def _fast(*extra):
    return ["prune", "--quiet", "--model", "fmnist-vit", "--random-init", "--calib-size", "8", "--no-eval", *extra]


@pytest.mark.parametrize("argv,pattern", [
    (["--flops", "0"], "--flops must be > 0"),
    (["--flops", "1.5x"], "--flops must be a fraction"),
    (["--params", "garbage"], "--params must be a fraction"),
    (["--flops", "0.5", "--params", "0.5"], "either --flops or --params"),
    (["--flops", "0.01"], "below the cheapest allocation"),
    (["--flops", "0.5", "--check-images", "-1"], "allocation check images must be an int >= 0"),
])
def test_cli_budget_errors_are_one_line(tmp_path, argv, pattern):
    assert_one_line_error(run_cli(_fast(*argv, "-o", tmp_path / "r")), pattern)


def test_rounding_warning_shows_the_achieved_sparsity(tmp_path):
    r = run_cli(_fast("--target", "attn", "--sparsity", "0.3", "--round-to", "16", "--no-compensation",
                      "-o", tmp_path / "r"))
    assert r.exit_code == 0, r.output
    assert "warning: sparsity 0.3 on 64 Q/K dims keeps 48" in r.stderr and "achieved sparsity 0.25" in r.stderr
    r = run_cli(_fast("--target", "attn", "--sparsity", "0.25", "--round-to", "16", "--no-compensation",
                      "-o", tmp_path / "r2"))
    assert r.exit_code == 0 and "warning" not in r.stderr


def test_cli_flops_budget_and_info_show_the_dims_per_block(tmp_path):
    out = tmp_path / "run"
    r = run_cli(_fast("--flops", "0.7", "-o", out))
    assert r.exit_code == 0, r.output
    rec = json.loads((out / "run.json").read_text())
    alloc = rec["allocation"]
    # no --target with a budget: MLP, Q/K and V dims are allocated (fmnist-vit head_dim 64)
    assert rec["config"]["target"] == "all" and any(b["dims"]["v"] < 64 for b in alloc["blocks"])
    assert 0.693 <= alloc["flops_fraction"] <= 0.7
    assert f"FLOPs (x{alloc['flops_fraction']:.3f})" in r.stdout and "params (x" in r.stdout
    info = run_cli(["info", out])
    assert info.exit_code == 0, info.output
    for blk in alloc["blocks"]:
        assert f"block {blk['index']}: mlp={blk['dims']['mlp']}" in info.stdout
        row = [ln for ln in info.stdout.splitlines() if ln.startswith(f"| {blk['index']} |")][0]
        assert f"| {blk['dims']['mlp']} |" in row  # the model's own mlp_hidden column agrees


def test_cli_check_images_sets_the_images_the_candidates_are_measured_on(tmp_path):
    r = run_cli(_fast("--flops", "0.7", "--check-images", "5", "-o", tmp_path / "a"))
    assert r.exit_code == 0, r.output
    rec = json.loads((tmp_path / "a" / "run.json").read_text())
    assert rec["config"]["allocation_check_images"] == 5 and rec["allocation"]["selection"]["images"] == 5
    r = run_cli(_fast("--flops", "0.7", "--check-images", "0", "-o", tmp_path / "b"))
    assert r.exit_code == 0, r.output
    assert "selection" not in json.loads((tmp_path / "b" / "run.json").read_text())["allocation"]


def test_a_budget_without_target_allocates_v_dims_too():
    """Default target: MLP + Q/K with a sparsity (CORP), MLP + Q/K + V with a budget (issue 14:
    the allocator spends the budget on every prunable dim); an explicit target is kept."""
    from edgeprune.api import corp_config

    assert corp_config(sparsity=0.5).target == "both"
    cfg = corp_config(flops=0.5)
    assert cfg.target == "all" and cfg.budget == {"kind": "flops", "value": 0.5}
    assert corp_config(params="20M").target == "all"
    assert corp_config("both", flops=0.5).target == "both"

