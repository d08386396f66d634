"""Budget kinds (issue 28): one parser and one cost-model registry for prune and derive.

A new budget kind is one cost-model class plus one registration; the toy kind below (it charges
only MLP width) is defined and registered here and drives the allocator. ``derive`` parses budgets
as ``prune`` does (``--flops 2.3G``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from edgeprune.allocation import greedy
from edgeprune.budget import (Budget, CostModel, budget_kinds, make_budget, register_cost_model, total_cost,
                              unregister_cost_model, validate_budget)
from edgeprune.anatomy import find_anatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.corp import CorpConfig
from edgeprune.errors import UserError
from edgeprune.flops import count_params, model_flops
from edgeprune.nuwa import budget as nuwa_budget
from edgeprune.nuwa.inputs import resolve_budget
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli, tiny_vit


class MlpWidthCost(CostModel):
    """Toy budget kind: the cost is the kept MLP width, summed over blocks (attention is free)."""

    def block_cost(self, b, dims):
        return float(dims["mlp"])

    def fixed_cost(self):
        return 0.0


@pytest.fixture
def mlp_width_kind():
    register_cost_model("mlp_width", MlpWidthCost)
    yield "mlp_width"
    unregister_cost_model("mlp_width")


def test_toy_kind_is_a_budget_kind_only_while_registered(mlp_width_kind):
    assert "mlp_width" in budget_kinds() and budget_kinds()[:2] == ["flops", "params"]
    validate_budget({"kind": "mlp_width", "value": 0.5})
    assert make_budget(mlp_width="100").to_dict() == {"kind": "mlp_width", "value": 100.0}
    assert resolve_budget(mlp_width=0.5) == Budget("mlp_width", 0.5)
    unregister_cost_model("mlp_width")
    with pytest.raises(UserError, match=r"unknown budget kind 'mlp_width' \(choose from flops, params, latency\)"):
        validate_budget({"kind": "mlp_width", "value": 0.5})
    with pytest.raises(UserError, match="unknown budget kind 'mlp_width'"):
        make_budget(mlp_width=0.5)


def test_toy_kind_drives_the_allocator(mlp_width_kind):
    """Only MLP width is charged: the allocation keeps at most half of it and leaves Q/K dense
    (pruning Q/K buys nothing under this budget)."""
    model = tiny_vit()
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    an = find_anatomy(model)
    stats = collect_statistics(an, [x], progress=False)
    cfg = CorpConfig.from_target("both", None, round_to=8, budget={"kind": "flops", "value": 0.5},
                                 last_block="full")
    cfg.budget = validate_budget({"kind": "mlp_width", "value": 0.5})
    dims, report = greedy.allocate(an, stats, cfg)
    dense_mlp = sum(b.mlp_hidden for b in an.blocks)
    assert report["cost_model"] == "mlp_width" and report["dense_cost"] == dense_mlp
    assert sum(d["mlp"] for d in dims) <= 0.5 * dense_mlp == report["target_cost"]
    assert report["achieved_cost"] == sum(d["mlp"] for d in dims)
    assert all(d["qk"] == b.qk_dim for d, b in zip(dims, an.blocks))
    # the same budget as an absolute count gives the same allocation
    cfg.budget = Budget("mlp_width", 0.5 * dense_mlp)
    assert greedy.allocate(an, stats, cfg)[0] == dims


def test_toy_kind_is_a_keyword_of_the_python_prune(mlp_width_kind):
    """The registered kind reaches ``edgeprune.prune`` as a keyword like ``flops=`` (no list of kinds
    in the API): the pruned model's MLP width meets it, and the record names the kind."""
    from edgeprune.api import prune

    model = tiny_vit()
    x = torch.randn(16, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    dense_mlp = sum(b.mlp_hidden for b in find_anatomy(model).blocks)
    res = prune(model, x, mlp_width=0.5, target="both", round_to=8, last_block="full", batch_size=8)
    assert res.record["allocation"]["budget"] == {"kind": "mlp_width", "value": 0.5}
    pruned = find_anatomy(res.model).blocks
    assert sum(b.mlp_hidden for b in pruned) <= 0.5 * dense_mlp
    assert res.record["allocation"]["achieved_cost"] == sum(b.mlp_hidden for b in pruned)


def test_validate_budget_refuses_bad_budgets():
    for ok in ({"kind": "flops", "value": 0.5}, {"kind": "params", "value": 2e7}):
        validate_budget(ok)
    for bad, msg in (({"kind": "latency", "value": 0.5}, "--latency needs a latency table"),  # issue 30: a registered kind
                     ({"kind": "areal", "value": 0.5}, r"unknown budget kind 'areal' \(choose from flops, params, latency"),
                     ({"kind": "flops", "value": 0}, "the flops budget must be > 0"),
                     ({"kind": "params", "value": -1.0}, "the params budget must be > 0"),
                     ({"kind": "flops", "value": True}, "must be > 0"),
                     ({"kind": "flops", "value": "0.5"}, "must be > 0"),
                     ({"kind": "flops", "value": float("nan")}, "must be > 0"),
                     ({"kind": "flops", "value": float("inf")}, "must be > 0"),
                     ({"value": 0.5}, "budget must be {'kind': 'flops' | 'params'"),
                     ("flops", "budget must be")):
        with pytest.raises(UserError, match=msg):
            validate_budget(bad)


def test_budget_above_the_dense_model_is_recognised():
    dense = 1.2e9
    assert Budget("flops", 2.3e9).exceeds(dense)
    assert Budget("flops", 1.0).exceeds(dense)  # the whole model: nothing to prune
    assert not Budget("flops", 0.99).exceeds(dense)
    assert not Budget("flops", 1.1e9).exceeds(dense)


def test_cost_models_count_what_flops_py_counts():
    """dense_cost of each kind is the model's own count, and NuWa's view of the registered cost
    model (the one prune allocates with) prices a plan as the flops/params cost model does."""
    model = tiny_vit()
    an = find_anatomy(model)
    assert Budget("flops", 0.5).dense_cost(an) == model_flops(an)["total"]
    assert Budget("params", 0.5).dense_cost(an) == count_params(model)
    dims = [{"heads": b.num_heads, "qk": 8, "v": 16, "mlp": 40} for b in an.blocks]
    for kind in ("flops", "params"):
        b = Budget(kind, 0.5)
        plan = nuwa_budget.PlanCost(an, b)
        want = total_cost(b.cost_model(an), an, dims)
        got = plan.total([8] * len(dims), [16] * len(dims), [40] * len(dims))
        assert isinstance(got, int) and got == want
        assert nuwa_budget.measure(model, b) == b.dense_cost(an)


def test_derive_and_prune_parse_budgets_alike():
    for text in ("0.5", "2.3G", "20M", "750k", 0.25):
        assert resolve_budget(flops=text) == make_budget(flops=text)
        assert resolve_budget(params=text) == make_budget(params=text)
    for bad in ("0", "x", "-1", "nan"):
        with pytest.raises(UserError) as a:
            resolve_budget(flops=bad)
        with pytest.raises(UserError) as b:
            make_budget(flops=bad)
        assert str(a.value) == str(b.value)
    with pytest.raises(UserError, match="not both"):
        resolve_budget(flops="1G", params="1M")
    with pytest.raises(UserError, match="exactly one budget"):
        resolve_budget()
    assert nuwa_budget.budget_target(Budget("flops", 0.6), 1000) == 600
    assert nuwa_budget.budget_target(Budget("flops", 2.3e9), 1000) == 2_300_000_000
    assert Budget("flops", 0.6).target(1001) == 0.6 * 1001


@needs_fmnist
def test_cli_derive_takes_an_absolute_flops_budget(tmp_path):
    """``derive --flops 74M`` (an absolute count, as ``prune --flops 74M``): the derived model fits
    74e6 FLOPs, and the record says which budget was asked."""
    out = tmp_path / "run"
    res = run_cli(["derive", "--model", "fmnist-vit", "--classes", "0,Bag", "--flops", "74M", "--skp-steps", "0",
                   "--train-per-class", "20", "--val-size", "8", "--calib-size", "16", "--rho", "0.95",
                   "--no-eval", "--no-cache", "--device", "cpu", "-o", out, "--quiet"])
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "run.json").read_text())
    b = rec["derivation"]["budget"]
    assert b["metric"] == "flops" and b["value"] == 74e6 and b["target"] == 74_000_000
    assert rec["flops"] <= 74e6 and rec["flops"] == b["achieved"]
    assert math.isclose(b["keep_fraction"], 74e6 / rec["dense_flops"])
    assert "flops budget 7.4e+07" in res.stdout


def test_cli_derive_refuses_a_bad_budget_like_prune():
    for cmd in (["derive", "--classes", "0,1"], ["prune", "--target", "both"]):
        res = run_cli([*cmd, "--flops", "2.3X", "--quiet"])
        assert_one_line_error(res, "--flops must be a fraction of the dense model (e.g. 0.5) or a count")


def test_the_flops_price_of_a_block_is_remembered_per_block_widths_and_dims():
    """``FlopsCost.block_cost`` keeps its prices (issue 40 item 4): each equals ``block_flops`` computed afresh, for
    every dims asked (in any order of the keys), and a block of other widths at the same index is priced anew."""
    from edgeprune.budget.flops import FlopsCost
    from edgeprune.flops import block_flops, with_dims

    an = find_anatomy(tiny_vit())
    cost = FlopsCost(an)
    b = an.blocks[0]
    asks = [{"heads": b.num_heads, "qk": b.qk_dim, "v": b.v_dim, "mlp": m} for m in (8, 16, b.mlp_hidden)]
    asks += [{"mlp": 8, "v": 8, "qk": 8, "heads": 1}, {"heads": 1, "qk": 8, "v": 8, "mlp": 8}]
    for _ in range(2):
        for d in asks:
            assert cost.block_cost(b, d) == float(block_flops(with_dims(b, d), an.num_tokens)["total"])
    assert len(cost._memo) == 4
    from timm.models.vision_transformer import VisionTransformer  # tiny_vit() imported timm with its shim

    wide = VisionTransformer(img_size=16, patch_size=4, num_classes=5, embed_dim=48, depth=2, num_heads=2,
                             mlp_ratio=4.0)
    other = find_anatomy(wide).blocks[0]
    assert other.index == b.index and other.qkv.in_features != b.qkv.in_features
    want = float(block_flops(with_dims(other, asks[0]), an.num_tokens)["total"])
    assert cost.block_cost(other, asks[0]) == want != cost.block_cost(b, asks[0])
