"""Classifier refit (edgeprune/solve/head_refit.py, ``CorpConfig.head_refit``, ``--head-refit``).

Properties:
* the closed form is the ridge regression it claims: it equals a least-squares solve of the
  explicitly augmented problem, recovers an exactly affine map with a vanishing ridge, and at
  alpha = inf is exactly the output bias correction;
* the held-out error computed from fold sums equals the direct computation;
* the cross-validation picks the bias correction for a pure output shift and a finite ridge for a
  real linear distortion, whose held-out error is then lower than the bias alone;
* after a real prune the refit leaves a calibration error no larger than the bias correction's,
  changes nothing but the head, and pruning nothing leaves the head as it was;
* bad values are one-line errors.
"""

from __future__ import annotations

import math

import pytest
import torch

import edgeprune
from edgeprune.errors import UserError
from edgeprune.solve.head_refit import RefitStatistics, _error, _solve, fit_head

from tests.conftest import needs_fmnist, run_cli, tiny_vit


def _stats(f: torch.Tensor, y: torch.Tensor, folds: int = 8) -> RefitStatistics:
    st = RefitStatistics(f.shape[1], y.shape[1], folds)
    st.add(f, y, torch.arange(len(f)))
    return st


def _sums(st: RefitStatistics):
    return [t.sum(0) for t in st.tensors]


def _data(n=64, d=6, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64) + 2.0
    w0 = torch.randn(c, d, generator=g, dtype=torch.float64)
    return g, f, w0


def test_closed_form_is_the_ridge_regression_toward_the_dense_head():
    g, f, w0 = _data()
    w_true = w0 + 0.3 * torch.randn(*w0.shape, generator=g, dtype=torch.float64)
    y = f @ w_true.T + torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1 * torch.randn(64, 3, generator=g,
                                                                                                  dtype=torch.float64)
    n, sf, sy, sff, sfy, _ = _sums(_stats(f, y))
    alpha = 0.3
    w, b = _solve(n, sf, sy, sff, sfy, w0, alpha)
    # explicit: centre, then solve [Fc; sqrt(lam) I] dW^T = [Rc; 0] by least squares
    fc = f - f.mean(0)
    lam = alpha * float((fc * fc).sum()) / f.shape[1]
    r = y - f @ w0.T
    rc = r - r.mean(0)
    a = torch.cat([fc, math.sqrt(lam) * torch.eye(6, dtype=torch.float64)])
    rhs = torch.cat([rc, torch.zeros(6, 3, dtype=torch.float64)])
    dw = torch.linalg.lstsq(a, rhs).solution.T
    assert torch.allclose(w, w0 + dw, atol=1e-10)
    assert torch.allclose(b, y.mean(0) - w @ f.mean(0), atol=1e-10)
    # an exactly affine map is recovered with a vanishing ridge
    y_exact = f @ w_true.T + 0.7
    w, b = _solve(*_sums(_stats(f, y_exact))[:5], w0, 1e-12)
    assert torch.allclose(w, w_true, atol=1e-6) and torch.allclose(b, torch.full((3,), 0.7, dtype=torch.float64),
                                                                   atol=1e-5)
    # alpha = inf: the dense head and the output bias correction b0 + mean(y - (W0 f + b0))
    b0 = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    w, b = _solve(*_sums(_stats(f, y))[:5], w0, math.inf)
    assert torch.equal(w, w0)
    assert torch.allclose(b, b0 + (y - (f @ w0.T + b0)).mean(0), atol=1e-12)


def test_error_from_sums_equals_the_direct_error():
    g, f, w0 = _data(seed=1)
    y = torch.randn(64, 3, generator=g, dtype=torch.float64)
    w = torch.randn(3, 6, generator=g, dtype=torch.float64)
    b = torch.randn(3, generator=g, dtype=torch.float64)
    st = _stats(f, y)
    k = 3
    got = _error(st.n[k], st.sf[k], st.sy[k], st.sff[k], st.sfy[k], st.syy[k], w, b)
    m = torch.arange(64) % 8 == k
    assert got == pytest.approx(float((y[m] - f[m] @ w.T - b).pow(2).sum()), rel=1e-10)


def test_cross_validation_picks_the_bias_for_a_shift_and_a_ridge_for_a_distortion():
    g, f, w0 = _data(n=256, seed=2)
    shift = f @ w0.T + torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    res = fit_head(_stats(f, shift), w0.float())
    assert res["alpha"] == math.inf and torch.equal(res["weight"], w0.float().double())
    w_true = w0 + 0.5 * torch.randn(*w0.shape, generator=g, dtype=torch.float64)
    y = f @ w_true.T + 0.2 * torch.randn(256, 3, generator=g, dtype=torch.float64)
    res = fit_head(_stats(f[:128], y[:128]), w0)
    assert math.isfinite(res["alpha"]) and res["cv_error"][res["alpha"]] < res["cv_error"][math.inf]
    bias_only = fit_head(_stats(f[:128], y[:128]), w0, alphas=())
    held_out = lambda r: float((y[128:] - f[128:] @ r["weight"].T - r["bias"]).pow(2).sum())  # noqa: E731
    assert held_out(res) < 0.5 * held_out(bias_only)
    with pytest.raises(ValueError, match="2 folds"):
        fit_head(_stats(f[:1], y[:1]), w0)
    with pytest.raises(ValueError, match="do not match the head"):
        fit_head(_stats(f, y), w0[:, :5])


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def test_refit_after_a_real_prune_lowers_the_calibration_error_and_touches_only_the_head():
    dense = tiny_vit()
    x = _images(48)
    common = dict(flops=0.6, allocation_check_images=8, last_block="full")
    bias = edgeprune.prune(dense, x, head_refit=False, **common)
    refit = edgeprune.prune(dense, x, **common)
    rec = refit.record["bias_correction"]
    assert refit.record["settings"]["head_refit"] == "auto" and rec["images"] == 48
    assert set(rec["cv_error"]) == {"0.01", "0.03", "0.1", "0.3", "1", "3", "10", "30", "100", "bias only"}
    with torch.no_grad():
        ref = dense(x)
        e_bias = float((bias.model(x) - ref).pow(2).sum())
        e_refit = float((refit.model(x) - ref).pow(2).sum())
    assert e_refit <= e_bias * (1 + 1e-6)
    a, b = bias.model.state_dict(), refit.model.state_dict()
    differ = {k for k in a if not torch.equal(a[k], b[k])}
    assert differ <= {"head.weight", "head.bias"}
    if rec["kind"] == "head refit":
        assert differ == {"head.weight", "head.bias"} and rec["weight_change"] > 0


def test_pruning_nothing_leaves_the_head_as_it_was():
    dense = tiny_vit()
    x = _images(32)
    res = edgeprune.prune(dense, x, sparsity=0.0, bias_correction_images=32, spec=None)
    assert res.record["bias_correction"]["kind"] != "bias"  # the refit ran
    assert torch.allclose(res.model.head.weight, dense.head.weight, atol=1e-6)
    assert torch.allclose(res.model.head.bias, dense.head.bias, atol=1e-6)


def test_bad_head_refit_values():
    with pytest.raises(UserError, match="head refit must be True, False or None"):
        edgeprune.CorpConfig.from_target("both", 0.5, head_refit="yes")


@needs_fmnist
def test_cli_records_and_prints_the_refit(tmp_path):
    r = run_cli(["prune", "--sparsity", "0.5", "--calib-size", "64", "--bias-correction", "64", "--head-refit",
                 "--no-eval", "--quiet", "-o", str(tmp_path / "run")])
    assert r.exit_code == 0, r.output
    _, record = edgeprune.load_run(tmp_path / "run")
    bc = record["bias_correction"]
    assert record["settings"]["head_refit"] is True and bc["images"] == 64 and "bias only" in bc["cv_error"]
    if bc["kind"] == "head refit":
        assert f"classifier refit to the dense outputs of 64 calibration images (ridge alpha {bc['alpha']:g}" in r.stdout
    else:
        assert "cross-validation preferred it to a classifier refit" in r.stdout
