"""Budgeted allocation picks among candidates by measured output error (edgeprune.allocation.select)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from edgeprune.allocation.select import candidates, output_error, select_allocation
from edgeprune.anatomy import find_anatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp import CorpConfig, corp_prune
from edgeprune.errors import UserError
from tests.conftest import needs_fmnist


@pytest.fixture(scope="module")
def setup(fmnist_model, fmnist_calib):
    x = fmnist_calib[0][:96]
    an = find_anatomy(fmnist_model)
    cfg = CorpConfig.from_target("both", None, budget={"kind": "flops", "value": 0.45}, allocation_check_images=48)
    stats = collect_statistics(an, x.split(32), progress=False)
    return fmnist_model, an, x, cfg, stats


def _measured(model, x, cfg, dims):
    """Output error of a real prune with the given dims, computed independently of select.py."""
    m = copy.deepcopy(model)
    corp_prune(find_anatomy(m), lambda: x.split(32), dataclasses.replace(cfg, budget=None, dims=dims), progress=False)
    with torch.no_grad():
        return output_error(m(x[:48]), model(x[:48]))


@needs_fmnist
def test_selection_keeps_the_candidate_with_the_lowest_measured_error(setup):
    model, an, x, cfg, stats = setup
    cands = candidates(an, stats, cfg)
    assert "uniform" in cands and len(cands) >= 2
    dims, report = select_allocation(an, stats, cfg, lambda: x.split(32))
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
