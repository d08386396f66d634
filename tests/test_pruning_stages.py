"""The one-shot prune's seams (issue 39): stages registered in order, config sections each checked by its
package, the budget owning its cost model (built once per model shape)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import edgeprune
from edgeprune.budget import Budget, flops as flops_kind, params as params_kind
from edgeprune.corp.config import CorpConfig
from edgeprune.errors import UserError
from edgeprune.pruning import SECTIONS, Stage, check_config, register_stage, stage_names, unregister_stage
from edgeprune.pruning.stage import PruneState
from tests.conftest import tiny_vit

BUILT_IN = ["embed_first", "corp", "embed_last", "class_token_block", "tokens_merge", "output_correction"]


def _images(n=32, seed=3):
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def test_built_in_stages_run_in_the_documented_order():
    assert stage_names() == BUILT_IN


def test_every_config_field_is_in_exactly_one_section():
    names = [f.name for f in dataclasses.fields(CorpConfig)]
    placed = [f for fields in SECTIONS.values() for f in fields]
    assert sorted(placed) == sorted(names) and len(placed) == len(set(placed))


def test_a_registered_toy_stage_runs_after_corp_and_adds_to_the_record():
    """One file + one registration: the toy stage sees the pruned model (after CORP, before the output
    correction), adds an entry to the record and, being a no-op on the weights, leaves them as they were."""
    seen = {}

    @register_stage("toy_widths", after="corp")
    class ToyWidths(Stage):
        def check(self, state: PruneState) -> None:
            seen["checked_before_any_pass"] = not state.info

        def run(self, state: PruneState) -> None:
            seen["order"] = "bias_correction" not in state.info and "blocks" in state.info
            state.record["toy_widths"] = [b.mlp_hidden for b in state.anatomy.blocks]

    model, x = tiny_vit(), _images()
    try:
        assert stage_names() == BUILT_IN[:2] + ["toy_widths"] + BUILT_IN[2:]
        res = edgeprune.prune(model, x, target="both", sparsity=0.5, batch_size=16)
    finally:
        unregister_stage("toy_widths")
    assert stage_names() == BUILT_IN
    plain = edgeprune.prune(model, x, target="both", sparsity=0.5, batch_size=16)
    assert seen == {"checked_before_any_pass": True, "order": True}
    half = [blk.mlp.fc1.out_features // 2 for blk in model.blocks]  # sparsity 0.5 of the dense widths
    assert res.record["toy_widths"] == [blk.mlp.fc1.out_features for blk in res.model.blocks] == half
    for (k, a), (_, b) in zip(res.model.state_dict().items(), plain.model.state_dict().items()):
        assert torch.equal(a, b), k


def test_a_stage_check_fails_before_any_calibration_pass():
    calls = []

    def batches():
        calls.append(1)
        return iter([_images()])

    @register_stage("toy_refuses", before="corp")
    class Refuses(Stage):
        def check(self, state: PruneState) -> None:
            raise UserError("toy stage refuses this model")

    try:
        with pytest.raises(UserError, match="toy stage refuses"):
            edgeprune.prune(tiny_vit(), batches, target="both", sparsity=0.5)
    finally:
        unregister_stage("toy_refuses")
    assert calls == []


def test_stage_registration_errors():
    with pytest.raises(UserError, match="unknown stage 'nope'"):
        register_stage("x", after="nope")(type("X", (Stage,), {}))
    with pytest.raises(UserError, match="either after or before"):
        register_stage("x", after="corp", before="corp")(type("X", (Stage,), {}))
    assert stage_names() == BUILT_IN


def test_each_section_is_checked_by_its_package():
    """The embed and allocation sections are checked with the config, by their own packages, in one call."""
    with pytest.raises(UserError, match="embed order"):
        check_config(CorpConfig.from_target("both", 0.5, embed_sparsity=0.25, embed_order="middle"))
    with pytest.raises(UserError, match="allocating whole heads needs a budget"):
        check_config(CorpConfig.from_target("both", 0.5, allocate_heads=True))
    cfg = CorpConfig.from_target("both", None, budget={"kind": "flops", "value": 0.5})
    assert isinstance(cfg.budget, Budget) and cfg.budget == {"kind": "flops", "value": 0.5}
    assert check_config(cfg) is cfg


def test_the_budget_builds_each_cost_model_once_per_prune(monkeypatch):
    """A budgeted prune builds one FLOPs cost model per model shape it prices (the dense model and its
    class-token variant) and one params model for the report -- not one per candidate allocation."""
    made = []
    for cls in (flops_kind.FlopsCost, params_kind.ParamsCost):
        orig = cls.__init__

        def init(self, *a, _orig=orig, _cls=cls, **k):
            made.append(_cls.__name__)
            _orig(self, *a, **k)

        monkeypatch.setattr(cls, "__init__", init)
    res = edgeprune.prune(tiny_vit(), _images(), flops=0.5, batch_size=16)
    assert res.record["allocation"]["within_tolerance"] is not None
    assert sorted(made) == ["FlopsCost", "FlopsCost", "ParamsCost"]
    # the record's cost split (issue 40 item 4) adds up to the statistics pass plus the solve
    t = res.record["timing"]
    assert set(t["split"]) == {"statistics", "curves", "sensitivity", "check", "allocation", "solve", "output"}
    assert all(v >= 0 for v in t["split"].values()) and t["split"]["sensitivity"] > 0 and t["split"]["check"] > 0
    assert t["split"]["output"] > 0 and res.record["bias_correction"]  # the budget's output correction ran
    assert sum(t["split"].values()) - t["split"]["output"] == pytest.approx(t["calibration_s"] + t["solve_s"], rel=1e-9)
    assert sum(t["split"].values()) <= t["total_s"]


def test_budget_record_form_and_refusals():
    b = Budget("flops", 0.5)
    assert b.to_dict() == {"kind": "flops", "value": 0.5} and Budget.from_dict(b.to_dict()) == b
    assert b.absolute(1000.0) == Budget("flops", 500.0) and b.option() == "flops0.5"
    with pytest.raises(UserError, match="unknown budget kind 'areal'"):
        Budget("areal", 0.5)
    with pytest.raises(UserError, match="needs a latency table"):
        Budget("latency", 0.5)
    with pytest.raises(UserError, match="table goes with"):
        Budget("flops", 0.5, table="t.json")
    with pytest.raises(UserError, match="budget must be"):
        Budget.from_dict({"kind": "flops", "value": 0.5, "colour": "red"})


def test_sensitivity_on_fewer_images_than_the_check():
    """``allocation_sensitivity_images`` (issue 40 item 4): the per-unit measurements use the first N check images,
    the candidates are still compared on all of them; the split says the sensitivity cost less."""
    model, x = tiny_vit(), _images(32)
    full = edgeprune.prune(model, x, flops=0.5, batch_size=16, allocation_check_images=16,
                           allocation_sensitivity_images=16)  # every check image
    few = edgeprune.prune(model, x, flops=0.5, batch_size=16, allocation_check_images=16,
                          allocation_sensitivity_images=4)
    default = edgeprune.prune(model, x, flops=0.5, batch_size=16, allocation_check_images=16)
    sf, s4 = full.record["allocation"]["selection"], few.record["allocation"]["selection"]
    assert sf["sensitivity"]["images"] == 16 and s4["sensitivity"]["images"] == 4
    assert default.record["allocation"]["selection"]["sensitivity"]["images"] == 8  # the default (issue 40 item 4)
    assert sf["images"] == s4["images"] == 16
    units_f = [u["measured_output_error"] for u in sf["sensitivity"]["units"]]
    units_4 = [u["measured_output_error"] for u in s4["sensitivity"]["units"]]
    assert units_f != units_4  # measured on other images


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4"])
def test_bad_sensitivity_images_are_refused(value):
    with pytest.raises(UserError, match="allocation sensitivity images"):
        edgeprune.prune(tiny_vit(), _images(8), flops=0.5, allocation_sensitivity_images=value)
