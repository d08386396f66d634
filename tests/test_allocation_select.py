"""Budgeted allocation picks among candidates by measured output error (edgeprune.allocation.select)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from edgeprune.allocation.select import candidates, output_error, select_allocation
from edgeprune.anatomy import find_anatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp import CorpConfig
from edgeprune.pruning.corp import corp_prune
from edgeprune.errors import UserError
from tests.conftest import needs_fmnist


@pytest.fixture(scope="module")
def setup(fmnist_model, fmnist_calib):
    x = fmnist_calib[0][:96]
    an = find_anatomy(fmnist_model)
    cfg = CorpConfig.from_target("both", None, budget={"kind": "flops", "value": 0.45}, allocation_check_images=48)
    stats = collect_statistics(an, x.split(32), progress=False)
    return fmnist_model, an, x, cfg, stats


@pytest.fixture(scope="module")
def selection(setup):
    """``select_allocation`` with the module's config, computed once: (dims, report); tests only read it."""
    _model, an, x, cfg, stats = setup
    return select_allocation(an, stats, cfg, lambda: x.split(32))


def _measured(model, x, cfg, dims):
    """Output error of a real prune with the given dims, computed independently of select.py."""
    m = copy.deepcopy(model)
    corp_prune(find_anatomy(m), lambda: x.split(32), dataclasses.replace(cfg, budget=None, dims=dims), progress=False)
    with torch.no_grad():
        return output_error(m(x[:48]), model(x[:48]))


@needs_fmnist
def test_selection_keeps_the_candidate_with_the_lowest_measured_error(setup, selection):
    model, an, x, cfg, stats = setup
    with torch.no_grad():
        cands = candidates(an, stats, cfg, x[:48], model(x[:48]))
    assert "uniform" in cands and len(cands) >= 2
    dims, report = selection
    sel = report["selection"]
    assert set(sel["measured_output_error"]) == set(cands) and sel["images"] == 48
    # the reported errors are those of real prunes with those dims
    errs = {k: _measured(model, x, cfg, d) for k, (d, _r) in cands.items()}
    for k, e in errs.items():
        assert sel["measured_output_error"][k] == pytest.approx(e, rel=1e-6, abs=1e-12)
    assert dims == cands[sel["chosen"]][0]
    assert errs[sel["chosen"]] == min(errs.values())
    assert errs[sel["chosen"]] <= errs["uniform"]  # never worse than uniform on what it measures
    # every candidate meets the budget
    for _k, (_d, r) in cands.items():
        assert r["achieved_cost"] <= r["target_cost"]


@needs_fmnist
def test_check_off_falls_back_to_the_proxy(setup):
    _model, an, x, cfg, stats = setup
    dims, report = select_allocation(an, stats, dataclasses.replace(cfg, allocation_check_images=0), lambda: x.split(32))
    assert "selection" not in report and report["chosen"] in ("greedy", "uniform")


def test_check_images_setting_is_validated():
    with pytest.raises(UserError, match="allocation check images"):
        CorpConfig.from_target("both", None, budget={"kind": "flops", "value": 0.5}, allocation_check_images=-1)


@needs_fmnist
def test_measured_curves_equal_single_unit_prunes_and_keep_the_proxy_shape(setup):
    """Each rescaled curve's error at its reference size is the output error of a real prune of
    that unit alone (computed here through ``corp_prune`` with every other module dense), and the
    curve keeps the proxy's ratios between sizes."""
    from edgeprune.allocation.greedy import build_curves
    from edgeprune.allocation.select import measured_curves

    model, an, x, cfg, stats = setup
    with torch.no_grad():
        dense_out = model(x[:48])
    ref = candidates(an, stats, cfg)["uniform"][0]
    curves, units = measured_curves(an, stats, cfg, ref, x[:48], dense_out)
    plain = build_curves(an, stats, cfg)
    assert [(u["block"], u["unit"]) for u in units] == [(c.block, "+".join(c.keys)) for c in curves]
    dense_dims = [{"mlp": b.mlp_hidden, "qk": b.qk_dim} for b in an.blocks]
    for i in (0, 1, len(curves) - 1):  # an MLP unit, a Q/K unit, the last block's last unit
        c, u = curves[i], units[i]
        p = c.ks.index(u["kept"])
        assert p < len(c.ks) - 1  # measured below dense
        dims = [dict(d) for d in dense_dims]
        dims[c.block][c.keys[0]] = u["kept"]
        assert c.errors[p] == pytest.approx(_measured(model, x, cfg, dims), rel=1e-6)
        assert u["measured_output_error"] == pytest.approx(c.errors[p], rel=1e-12)
        # same shape as the proxy: ratios between sizes unchanged
        q = 0 if p > 0 else 1
        assert c.errors[q] / c.errors[p] == pytest.approx(plain[i].errors[q] / plain[i].errors[p], rel=1e-9)


@needs_fmnist
def test_measured_candidate_is_offered_and_judged_like_the_others(setup, selection):
    model, an, x, cfg, stats = setup
    dims, report = selection
    sel = report["selection"]
    units = sel["sensitivity"]["units"]
    assert len(units) == 2 * len(an.blocks)  # target both: MLP and Q/K of every block
    off = dataclasses.replace(cfg, allocation_sensitivity=False)
    _dims, rep_off = select_allocation(an, stats, off, lambda: x.split(32))
    assert rep_off["selection"]["sensitivity"] is None
    assert "greedy(measured)" not in rep_off["selection"]["measured_output_error"]
    from edgeprune.allocation.report import allocation_lines

    line = next(ln for ln in allocation_lines(report) if "lowest output error" in ln)
    assert line.strip().startswith(f"kept {sel['chosen']}:") and all(k in line for k in sel["measured_output_error"])
    # with more candidates the chosen measured error can only go down
    assert min(sel["measured_output_error"].values()) <= min(rep_off["selection"]["measured_output_error"].values())


def test_two_anchor_rescaling_goes_through_both_measurements():
    from edgeprune.allocation.curves import Curve
    from edgeprune.allocation.select import _anchor

    raw = [8.0, 4.0, 2.0, 1.0, 0.5, 0.0]
    c = Curve(block=0, keys=("mlp",), ks=[8, 16, 24, 32, 40, 48], raw=list(raw), scale=1.0, kind="compensated")
    _anchor(c, [(1, 2.0), (4, 1.0)])    # factor 0.5 at index 1, 2 at index 4
    e = c.errors
    assert e[1] == pytest.approx(2.0) and e[4] == pytest.approx(1.0)
    assert e[0] == pytest.approx(8.0 * 0.5) and e[5] == 0.0       # constant factor beyond the anchors
    assert e[2] == pytest.approx(2.0 * 0.5 * 4 ** (1 / 3))           # log-linear in the size index
    assert e[3] == pytest.approx(1.0 * 0.5 * 4 ** (2 / 3))
    lifted = Curve(block=0, keys=("mlp",), ks=c.ks, raw=list(raw), scale=1.0, kind="compensated")
    _anchor(lifted, [(1, 2.0), (3, 4.0)])
    assert lifted.errors[2] == pytest.approx(4.0)                    # 2 sqrt(2) lifted to e[3] = 4
    assert all(a >= b for a, b in zip(lifted.errors, lifted.errors[1:]))   # more kept dims never cost more
    one = Curve(block=0, keys=("mlp",), ks=c.ks, raw=list(raw), scale=1.0, kind="compensated")
    _anchor(one, [(2, 3.0), (None, None)])        # one anchor: a plain rescale
    assert one.errors[2] == pytest.approx(3.0) and one.errors[0] / one.errors[1] == pytest.approx(2.0)


@needs_fmnist
def test_second_anchor_measures_each_unit_where_the_first_allocation_put_it(setup):
    from edgeprune.allocation.select import measured_curves

    model, an, x, cfg, stats = setup
    with torch.no_grad():
        dense_out = model(x[:48])
    cands = candidates(an, stats, cfg)
    ref = cands["uniform"][0]
    _c1, units1 = measured_curves(an, stats, cfg, ref, x[:48], dense_out)
    other = next(d for k, (d, _r) in cands.items() if k != "uniform")
    curves, units = measured_curves(an, stats, cfg, ref, x[:48], dense_out, also_at=other, known=units1)
    assert [u["measured_output_error"] for u in units] == [u["measured_output_error"] for u in units1]
    second = [(c, u) for c, u in zip(curves, units) if "kept_2" in u]
    assert second, "the other allocation differs from uniform somewhere"
    dense_dims = [{"mlp": b.mlp_hidden, "qk": b.qk_dim} for b in an.blocks]
    for c, u in second[:2]:
        assert u["kept_2"] == other[c.block][c.keys[0]] and u["kept_2"] < c.ks[-1]
        dims = [dict(d) for d in dense_dims]
        dims[c.block][c.keys[0]] = u["kept_2"]
        assert u["measured_output_error_2"] == pytest.approx(_measured(model, x, cfg, dims), rel=1e-6)
        for k, m in ((u["kept"], u["measured_output_error"]), (u["kept_2"], u["measured_output_error_2"])):
            i = c.ks.index(k)
            if i == len(c.ks) - 1 or c.errors[i] > c.errors[i + 1] * (1 + 1e-9):  # not lifted by monotonicity
                assert c.errors[i] == pytest.approx(m, rel=1e-9)


@needs_fmnist
def test_two_anchors_offer_one_more_candidate_and_never_choose_worse(setup, selection):
    _model, an, x, cfg, stats = setup
    _d1, rep1 = selection
    _d2, rep2 = select_allocation(an, stats, dataclasses.replace(cfg, allocation_anchors=2), lambda: x.split(32))
    e1, e2 = rep1["selection"]["measured_output_error"], rep2["selection"]["measured_output_error"]
    assert set(e1) <= set(e2)
    assert min(e2.values()) <= min(e1.values())
    with pytest.raises(UserError, match="allocation anchors must be 1 or 2"):
        CorpConfig.from_target("both", None, budget={"kind": "flops", "value": 0.5}, allocation_anchors=3)


@needs_fmnist
def test_a_one_block_trial_shares_the_rest_and_folds_like_a_deep_copy(setup):
    """``trial_copy`` (issue 40 item 4): a plan that prunes one block deep-copies that block only; folding into it
    gives bitwise the output of folding into a deep copy of the whole model, and the dense model is unchanged."""
    from edgeprune.allocation.select import _fold_and_measure
    from edgeprune.allocation.trial import trial_copy
    from edgeprune.corp.steps import plan_corp
    from edgeprune.plan import BlockPlan

    model, an, x, cfg, stats = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dims = [{} for _ in an.blocks]
    dims[2] = {"mlp": 64, "qk": 8}
    plain = dataclasses.replace(cfg, dims=dims, budget=None)
    ref = plan_corp(an, stats, plain)[2]
    plans = [BlockPlan(index=b.index) for b in an.blocks]
    plans[2] = BlockPlan(index=2, mlp_keep=ref.mlp_keep, qk_keep=ref.qk_keep)
    trial = trial_copy(model, plans)
    blocks, trial_blocks = find_anatomy(model).blocks, find_anatomy(trial).blocks
    assert trial_blocks[2].block is not blocks[2].block
    assert all(t.block is d.block for i, (t, d) in enumerate(zip(trial_blocks, blocks)) if i != 2)
    with torch.no_grad():
        dense_out = model(x[:16])
        got = _fold_and_measure(model, plans, plain, stats, x[:16], dense_out)
        full = copy.deepcopy(model).eval()
        from edgeprune.corp.qk_solvers import qk_solver_from_grams
        from edgeprune.corp.steps import apply_corp
        apply_corp(find_anatomy(full), plans, plain, stats.mlp, qk_solver_from_grams(stats.qk, plans, plain), stats.vo)
        want = output_error(full(x[:16]), dense_out)
    assert got == want and got > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert find_anatomy(model).blocks[2].fc1.out_features == before["blocks.2.mlp.fc1.weight"].shape[0]
    # two blocks, or a model in training mode: a whole deep copy
    plans[3] = BlockPlan(index=3, mlp_keep=ref.mlp_keep)
    assert all(a.block is not b.block for a, b in zip(find_anatomy(trial_copy(model, plans)).blocks, blocks))
    model.train()
    try:
        one = [BlockPlan(index=b.index) for b in an.blocks]
        one[2] = plans[2]
        assert all(a.block is not b.block for a, b in zip(find_anatomy(trial_copy(model, one)).blocks, blocks))
    finally:
        model.eval()
