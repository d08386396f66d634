"""Known-answer tests for the latency / allocation code that its mutation check (issue 43,
``tools/mutation_check.py``: latency_table, latency_cost, rules, greedy_heads, derive_latency,
latency_loop) showed missing. Tables are hand-made (``tests/conftest.py::write_latency_table``)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.budget import make_budget
from edgeprune.budget.latency import LatencyCost
from edgeprune.errors import UserError
from edgeprune.latency.build import BuildOptions, empty_table, start_or_resume
from edgeprune.latency.grid import Grid
from edgeprune.latency.measure import TimingSettings
from edgeprune.latency.table import LatencyTable
from tests.conftest import write_latency_table

# timm at import time (after edgeprune: in this environment a bare `import timm` first fails on torchvision's ops),
# so that the mutation run's fork server loads it once instead of once per mutant
VisionTransformer = importlib.import_module("timm.models.vision_transformer").VisionTransformer

# the small ViT of tests/test_latency_budget.py: width 64, 4 heads of 16, MLP 128, 17 tokens, 2 blocks
D, H, HD, MLP, N, DEPTH = 64, 4, 16, 128, 17, 2
KEY = {"embed_dim": D, "depth": DEPTH, "num_heads": H, "head_dim": HD, "mlp_hidden": MLP, "tokens": N,
       "batch": 8, "precision": "fp32", "backend": "onnxruntime", "backend_version": "1.0",
       "device_name": "hand-made", "profile": "cpu", "threads": 1}
RULES = {"mlp_round_to": 8, "head_dim_round_to": 8, "qk_equals_v": False}


def small_vit():
    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=D, depth=DEPTH,
                             num_heads=H, mlp_ratio=MLP / D).eval()


def attn_ms(h, q, v):
    return 0.1 + h * (0.05 + 0.01 * (q + v))


def mlp_ms(w):
    return 0.1 + 0.002 * w


@pytest.fixture
def table(tmp_path):
    return write_latency_table(tmp_path / "t.json", KEY, RULES, [1, 2, 3, 4], [8, 16], [0, 32, 64, 96, 128],
                               attn_ms, mlp_ms, fixed_ms=1.0)


# -- latency_cost: the class-token last block -------------------------------------------------------

def _hand_flops(heads, qk, v, mlp, t):
    """FLOPs of one block of the small ViT computing t query tokens (keys / values for all N), by hand:
    2 x multiply-accumulates of q (t), k and v (N) projections, t x N scores and weighted values,
    the output projection and the two MLP layers for t tokens."""
    macs = (t * D * heads * qk + N * D * heads * (qk + v) + t * N * heads * (qk + v) + t * heads * v * D
            + 2 * t * D * mlp)
    return 2 * macs


@pytest.mark.parametrize("dims", [dict(mlp=128, qk=16, v=16, heads=4), dict(mlp=64, qk=8, v=16, heads=2)])
def test_class_token_last_block_is_priced_at_its_flops_share(table, dims):
    an = find_anatomy(small_vit())
    budget = make_budget(latency=0.5, table=table)
    full = LatencyCost(an, budget=budget)
    cls = LatencyCost(an, {1: 1}, budget=budget)
    ms = mlp_ms(dims["mlp"]) + attn_ms(dims["heads"], dims["qk"], dims["v"])  # a measured point: no interpolation
    ratio = _hand_flops(dims["heads"], dims["qk"], dims["v"], dims["mlp"], 1) / _hand_flops(
        dims["heads"], dims["qk"], dims["v"], dims["mlp"], N)
    assert 0.05 < ratio < 0.9
    assert full.block_cost(an.blocks[1], dims) == pytest.approx(ms, rel=1e-12)
    assert cls.block_cost(an.blocks[0], dims) == pytest.approx(ms, rel=1e-12)  # only block 1 is a class-token one
    assert cls.block_cost(an.blocks[1], dims) == pytest.approx(ms * ratio, rel=1e-12)
    assert cls.fixed_cost() == 1.0
    assert cls.record()["class_token_blocks"].startswith("estimated") and full.record()["class_token_blocks"] is None


# -- latency_table: a partial table of another key is never resumed ---------------------------------

GRID = Grid(mlp=[64, 128], heads=[2, 4], qk=[8, 16], v=[8, 16], qk_equals_v=False)


def _partial(path, key, failed=False):
    """A partial table of ``key`` on :data:`GRID` with one MLP entry measured; saved at ``path``."""
    t = empty_table(dict(key), dict(RULES), GRID, TimingSettings(threads=1))
    t.mlp["ms"][0] = 0.7
    t.measured["mlp"].append(64)
    if failed:
        t.meta["self_check"] = {"passed": False, "forced": False, "tolerance": 0.1, "models": []}
    t.save(path)
    return t


def _resume(out, key, rules=RULES, grid=GRID, s=None, **opts):
    return start_or_resume(out, dict(key), dict(rules), grid, s or TimingSettings(threads=1),
                           BuildOptions(interleave=False, **opts))


OTHER = [("precision", "fp16"), ("backend_version", "1.1"), ("device_name", "another cpu"), ("profile", "gpu"),
         ("threads", 2), ("backend", "torch"), ("batch", 4), ("tokens", 5), ("embed_dim", 32), ("depth", 3),
         ("num_heads", 2), ("head_dim", 8), ("mlp_hidden", 64)]


@pytest.mark.parametrize("field,value", OTHER)
def test_a_partial_table_of_another_key_is_neither_resumed_nor_mixed(tmp_path, field, value):
    out = tmp_path / "t.json"
    _partial(out, KEY)
    before = out.read_bytes()
    now = {**KEY, field: value}
    with pytest.raises(UserError, match=f"another key \\({field}: ") as err:
        _resume(out, now)
    assert "\n" not in str(err.value) and out.read_bytes() == before
    # --force replaces it (fresh entries, the new key), even when its self-check failed (that keeps only its own key)
    for failed in (False, True):
        _partial(out, KEY, failed=failed)
        t = _resume(out, now, force=True)
        assert t.key == now and t.measured["mlp"] == [] and math.isnan(t.mlp["ms"][0])


def test_a_partial_table_of_the_same_key_is_resumed(tmp_path):
    out = tmp_path / "t.json"
    _partial(out, KEY)
    t = _resume(out, KEY)
    assert t.measured["mlp"] == [64] and t.mlp["ms"][0] == 0.7 and t.key == KEY
    # --force with a failed self-check keeps a table of the same key and grid; a passed / unchecked one is replaced
    _partial(out, KEY, failed=True)
    t = _resume(out, KEY, force=True)
    assert t.measured["mlp"] == [64]
    _partial(out, KEY)
    t = _resume(out, KEY, force=True)
    assert t.measured["mlp"] == []
    # another way of timing or another grid is refused too
    _partial(out, KEY)
    with pytest.raises(UserError, match="another iterations"):
        _resume(out, KEY, s=TimingSettings(threads=1, iterations=3))
    other = Grid(mlp=[64, 128], heads=[2, 4], qk=[8, 16], v=[16], qk_equals_v=False)
    with pytest.raises(UserError, match="another grid"):
        _resume(out, KEY, grid=other)
    with pytest.raises(UserError, match="another grid"):
        _resume(out, KEY, rules={**RULES, "qk_equals_v": True})


# -- latency_cost: the rest of the cost model -------------------------------------------------------

def test_latency_cost_bounds_rules_record_and_fixed_cost(table):
    an = find_anatomy(small_vit())
    c = LatencyCost(an, budget=make_budget(latency=0.5, table=table))
    assert c.bounds() == {"mlp": 0, "qk": 8, "v": 8, "heads": 1}
    assert c.rules == RULES and c.rules is not c.table.rules  # a copy
    dense = DEPTH * (mlp_ms(MLP) + attn_ms(H, HD, HD)) + 1.0
    r = c.record()
    assert r["table"] == table and r["key"] == KEY and r["rules"] == RULES
    assert r["dense_predicted_ms"] == pytest.approx(dense) and r["dense_measured_ms"] == pytest.approx(dense)
    assert r["block_overhead_ms"] == 0.0 and r["block_scale"] == 1.0 and r["self_check"] is None
    assert r["unverified"] is None and r["unit"] == "ms per batch of key.batch images"
    assert c.fixed_cost() == 1.0 and isinstance(c.fixed_cost(), float)
    assert LatencyCost.config_defaults(make_budget(latency=0.5, table=table)) == {}


def test_latency_cost_self_check_summary_and_fused_default(tmp_path):
    path = write_latency_table(tmp_path / "f.json", KEY, {**RULES, "qk_equals_v": True}, [1, 2, 3, 4], [8, 16],
                               [0, 64, 128], attn_ms, mlp_ms, fixed_ms=0.5)
    t = LatencyTable.load(path)
    blocks = [{"mlp": 128, "qk": 16, "v": 16, "heads": 4}] * 2
    pred = t.model_ms(blocks)
    models = [{"name": "dense", "predicted_ms": pred, "measured_ms": pred * 1.02, "extra": 1, "blocks": blocks}]
    t.meta["self_check"] = {"passed": True, "tolerance": 0.1, "models": models}
    t.save(path)
    budget = make_budget(latency=0.5, table=path)
    assert LatencyCost.config_defaults(budget) == {"layout": "fused"}
    LatencyCost.check_inputs(budget)
    r = LatencyCost(find_anatomy(small_vit()), budget=budget).record()
    assert r["self_check"] == {"passed": True, "forced": False, "tolerance": 0.1,
                               "models": [{"name": "dense", "predicted_ms": pred, "measured_ms": pred * 1.02}]}


def test_load_table_is_cached_per_file_version_and_a_missing_one_is_one_line(tmp_path):
    from edgeprune.budget.latency import load_table

    path = tmp_path / "t.json"
    write_latency_table(path, KEY, RULES, [1, 4], [8, 16], [0, 128], attn_ms, mlp_ms, fixed_ms=1.0)
    a = load_table(str(path))
    assert load_table(str(path)) is a and load_table(str(tmp_path / "." / "t.json")) is a
    write_latency_table(path, KEY, RULES, [1, 4], [8, 16], [0, 128], attn_ms, mlp_ms, fixed_ms=2.0)
    import os

    os.utime(path, ns=(1, 10**18))  # a new version of the file
    b = load_table(str(path))
    assert b is not a and b.fixed_ms == 2.0
    with pytest.raises(UserError, match=r"^latency table .*nope\.json not found \(a latency table of this model"):
        load_table(str(tmp_path / "nope.json"))
    with pytest.raises(UserError, match="needs a latency table"):
        LatencyCost(find_anatomy(small_vit()), budget=None)


# -- rules: the allocator's candidate grid and the kernels' head-dim rule -----------------------------

def _cfg(budget, target="all", allocate_heads=None, layout="default", round_to=8):
    from types import SimpleNamespace

    return SimpleNamespace(budget=budget, target=target, allocate_heads=allocate_heads, layout=layout,
                           round_to=round_to, last_block="full")


def test_heads_allocated_follows_the_budget_kind_target_and_setting(table):
    from edgeprune.allocation.rules import heads_allocated

    lat, flops = make_budget(latency=0.5, table=table), make_budget(flops=0.5)
    assert heads_allocated(_cfg(lat)) and heads_allocated(_cfg(lat, target="v"))
    assert not heads_allocated(_cfg(lat, target="mlp")) and not heads_allocated(_cfg(lat, target="heads"))
    assert not heads_allocated(_cfg(flops)) and not heads_allocated(_cfg(None))
    assert heads_allocated(_cfg(flops, allocate_heads=True)) is True
    assert heads_allocated(_cfg(lat, allocate_heads=False)) is False
    assert not heads_allocated(_cfg(lat, target="heads", allocate_heads=True))
    assert not heads_allocated(_cfg(None, allocate_heads=True))


def test_rules_grid_sizes_restrict_where_and_describe():
    from edgeprune.allocation.curves import Curve
    from edgeprune.allocation.rules import Grid as RGrid

    g = RGrid({"mlp": 8, "qk": 8, "v": 8, "heads": 1}, {"mlp": 16, "qk": 16}, None)
    assert g.sizes("mlp", 20) == [16, 20] and g.sizes("mlp", 32) == [16, 24, 32] and g.sizes("v", 16) == [8, 16]
    assert g.sizes("qk", 12) == [12] and g.sizes("heads", 3) == [1, 2, 3] and g.sizes("mlp", 4) == [4]
    assert g.head_dims is None and g.where() == "on the latency table's grid {'mlp': 8, 'qk': 8, 'v': 8, 'heads': 1}"
    ruled = RGrid({"mlp": 8, "qk": 8, "v": 8, "heads": 1}, {}, {"head_dims": [32, 16, 64]})
    assert ruled.head_dims == (16, 32, 64) and ruled.sizes("qk", 40) == [16, 32, 40] and ruled.sizes("v", 8) == [8]
    assert ruled.sizes("mlp", 24) == [8, 16, 24] and ruled.sizes("v", 40) == [16, 32, 40]
    assert ruled.sizes("heads", 3) == [1, 2, 3]
    assert ruled.where().endswith(" with head dims in {16, 32, 64} (fused attention)")
    c = Curve(0, ("qk", "v"), [8, 16, 24, 32], [3.0, 2.0, 1.0, 0.0], 1.0, "c")
    assert g.restrict(c).ks == [16, 24, 32] and g.restrict(c).raw == [2.0, 1.0, 0.0]
    assert ruled.restrict(c) is c
    zero = Curve(0, ("mlp",), [0, 8, 16], [2.0, 1.0, 0.0], 1.0, "c")  # no bound on the MLP: 0 stays a candidate
    assert RGrid({"mlp": 8, "qk": 8, "v": 8, "heads": 1}, {"qk": 8}, None).restrict(zero) is zero
    high = RGrid({"mlp": 8, "qk": 8, "v": 8, "heads": 1}, {"v": 40}, None)
    assert high.restrict(c).ks == [32] and high.restrict(c).raw == [0.0]
    assert g.describe() == {"rules": None, "round_to": {"mlp": 8, "qk": 8, "v": 8, "heads": 1},
                            "smallest": {"mlp": 16, "qk": 16}}


def test_unit_grid_from_the_config_or_the_table_and_check_rules(table, tmp_path):
    from edgeprune.allocation.rules import check_rules, unit_grid

    an = find_anatomy(small_vit())
    g = unit_grid(_cfg(None, round_to=4), an)
    assert (g.round_to, g.lower, g.rules) == ({"mlp": 4, "qk": 4, "v": 4, "heads": 1}, {}, None)
    g = unit_grid(_cfg(make_budget(flops=0.5), round_to=4), an)
    assert (g.round_to, g.lower, g.rules) == ({"mlp": 4, "qk": 4, "v": 4, "heads": 1}, {}, None)
    rules = {"mlp_round_to": 32, "head_dim_round_to": 8, "qk_equals_v": True}
    path = write_latency_table(tmp_path / "q.json", KEY, rules, [2, 4], [8, 16], [32, 128], attn_ms, mlp_ms)
    g = unit_grid(_cfg(make_budget(latency=0.5, table=path), round_to=4), an)
    assert g.round_to == {"mlp": 32, "qk": 8, "v": 8, "heads": 1} and g.rules == rules
    assert g.lower == {"mlp": 32, "qk": 8, "v": 8, "heads": 2}
    from types import SimpleNamespace

    half = SimpleNamespace(rules={"qk_equals_v": False}, bounds=lambda: {})  # a cost model without roundings
    g = unit_grid(_cfg(None, round_to=4), an, half)
    assert g.round_to == {"mlp": 4, "qk": 4, "v": 4, "heads": 1}
    with pytest.raises(UserError, match="^this latency table's device needs Q/K dims = V dims .*--layout fused$"):
        check_rules(_cfg(None, target="all"), unit_grid(_cfg(make_budget(latency=0.5, table=path)), an))
    grid = unit_grid(_cfg(make_budget(latency=0.5, table=path)), an)
    check_rules(_cfg(None, target="mlp"), grid)
    check_rules(_cfg(None, target="all", layout="fused"), grid)
    check_rules(_cfg(None, target="all"), unit_grid(_cfg(make_budget(latency=0.5, table=table)), an))


def test_kernel_rules_parse_allow_keep_and_describe():
    from devices.kernels import (ProfileError, _int, _one_rule, allowed_head_dims, describe_allowed,
                                 keep_allowed, parse_head_dims)

    assert _int(1) and _int(5, 5) and not _int(4, 5) and not _int(0) and not _int(True) and not _int(2.0)
    assert _one_rule("p", "f", [64, 16, 32]) == (16, 32, 64)
    assert _one_rule("p", "f", {"min": 16, "max": 32, "step": 8}) == (16, 24, 32)
    assert _one_rule("p", "f", {"min": 16, "max": 16, "step": 8}) == (16,)
    assert parse_head_dims("p", {"int8": [16, 32], "fp16": {"min": 8, "max": 24, "step": 8}}, 16) == (
        ("fp16", (8, 16, 24)), ("int8", (16, 32)))
    assert parse_head_dims("p", {}, 8) == ()
    assert parse_head_dims("p", {"int8": [24, 40]}, 8) == (("int8", (24, 40)),)
    with pytest.raises(ProfileError, match="allows no multiple"):
        parse_head_dims("p", {"int8": [24, 40]}, 16)
    assert allowed_head_dims(None) is None and allowed_head_dims({}) is None
    assert allowed_head_dims({"head_dims": None, "mlp_round_to": 8}) is None
    assert allowed_head_dims({"head_dims": [64, 16, 16, 32]}) == (16, 32, 64)
    assert allowed_head_dims({"head_dims": (8,)}) == (8,)
    for bad in ([], [0], [True], "16", [16.0]):
        with pytest.raises(UserError, match="rules.head_dims must be a non-empty list"):
            allowed_head_dims({"head_dims": bad})
    sizes = [8, 16, 24, 32, 40]
    assert keep_allowed(sizes, 40, None) == sizes and keep_allowed(sizes, 40, None) is not sizes
    assert keep_allowed(sizes, 40, (16, 32)) == [16, 32, 40] and keep_allowed(sizes, 24, (16,)) == [16, 24]
    assert describe_allowed(None) == "any"
    assert describe_allowed((16, 24, 32, 40, 48)) == "16..48 step 8"
    assert describe_allowed((16, 24, 32, 40)) == "16, 24, 32, 40"
    assert describe_allowed((16, 24, 32, 40, 56)) == "16, 24, 32, 40, 56"


# -- greedy_heads: the allocator under latency prices --------------------------------------------------

def _lat_curves():
    """Block 0: whole heads (1..4), block 1: MLP width (32..128), errors by hand. Under :func:`attn_ms` /
    :func:`mlp_ms` a head saves 0.37 ms (error +0.1 for the first, +0.4 for the second), 32 MLP channels
    0.064 ms (+0.2 for the first 32): the heads are the cheaper error per ms saved."""
    from edgeprune.allocation.curves import Curve

    return [Curve(0, ("heads",), [1, 2, 3, 4], [2.0, 0.5, 0.1, 0.0], 1.0, "c"),
            Curve(1, ("mlp",), [32, 64, 96, 128], [3.0, 1.0, 0.2, 0.0], 1.0, "c")]


def _dense_blocks():
    return [{"mlp": MLP, "qk": HD, "v": HD, "heads": H} for _ in range(DEPTH)]


def test_greedy_under_latency_prices_removes_the_least_error_per_ms(table):
    from edgeprune.allocation import greedy as G

    an = find_anatomy(small_vit())
    cost = LatencyCost(an, budget=make_budget(latency=0.5, table=table))
    curves = _lat_curves()
    st = G._State(an, curves, _dense_blocks(), cost, [3, 3])
    dense = 1.0 + DEPTH * (mlp_ms(MLP) + attn_ms(H, HD, HD))
    assert st.total == pytest.approx(dense, rel=1e-12)
    assert st.delta(0, 2) == pytest.approx(-0.37, rel=1e-9) and st.delta(1, 2) == pytest.approx(-0.064, rel=1e-9)
    target = dense - 0.74 + 1e-9  # two heads' worth
    G._descend(st, target)
    # heads 4 -> 3 (0.1 / 0.37 ms) then 3 -> 2 (0.4 / 0.37 ms) beat any MLP step (0.2 / 0.064 ms at best)
    assert st.pos == [1, 3] and st.error == pytest.approx(0.5)
    assert st.dims[0]["heads"] == 2 and st.dims[1]["mlp"] == MLP
    assert st.total == pytest.approx(cost.table.model_ms(st.dims), rel=1e-12) and st.total <= target
    G._fill(st, target)
    assert st.pos == [1, 3]
    # a looser budget: one head, then the fill-back grows nothing more than fits
    st = G._State(an, curves, _dense_blocks(), cost, [3, 3])
    G._descend(st, dense - 0.3)
    assert st.pos == [2, 3] and st.total == pytest.approx(dense - 0.37)
    # a budget the MLP must pay too: after two heads (0.74 ms) the first 32 channels (0.064 ms)
    st = G._State(an, curves, _dense_blocks(), cost, [3, 3])
    G._descend(st, dense - 0.78)
    assert st.pos == [1, 2] and st.total == pytest.approx(cost.table.model_ms(st.dims), rel=1e-12)
    G._fill(st, dense - 0.78)
    assert st.pos == [1, 2]


def test_uniform_candidate_under_a_latency_budget_keeps_whole_heads_dense(table):
    from edgeprune.allocation import greedy as G

    an = find_anatomy(small_vit())
    budget = make_budget(latency=0.5, table=table)
    cost = LatencyCost(an, budget=budget)
    curves = _lat_curves()
    cfg = _cfg(budget, round_to=32)
    mlp96 = cost.table.model_ms([_dense_blocks()[0], {"mlp": 96, "qk": HD, "v": HD, "heads": H}])
    dense = cost.table.dense_ms()
    # without heads allocated the uniform sparsity would cut heads too (round(4 x 0.874) = 3 at 0.126)
    assert G._uniform_positions(an, curves, cfg, _dense_blocks(), cost, dense) == ([3, 3], 0.0)
    # kept_dim(128, s, 32) = 32 round(4 (1 - s)): 96 from s = 0.126 on (round(3.5) = 4); heads stay 4
    assert G._uniform_positions(an, curves, cfg, _dense_blocks(), cost, dense - 0.01) == ([3, 2], 0.126)
    assert G._uniform_positions(an, curves, cfg, _dense_blocks(), cost, mlp96) == ([3, 2], 0.126)
    # 64 from 0.375 (round(2.5) = 2), 32 from 0.626; below 32 channels no uniform candidate (heads stay 4)
    assert G._uniform_positions(an, curves, cfg, _dense_blocks(), cost, dense - 0.1) == ([3, 1], 0.375)
    assert G._uniform_positions(an, curves, cfg, _dense_blocks(), cost, dense - 0.13) == ([3, 0], 0.626)
    assert G._uniform_positions(an, curves, cfg, _dense_blocks(), cost, dense - 0.2) is None
    plain = _cfg(budget, target="heads", round_to=32)  # heads the only attention unit: they follow the sparsity
    assert G._uniform_positions(an, curves, plain, _dense_blocks(), cost, dense - 0.2) == ([2, 2], 0.126)


# -- latency_loop: measure and correct on a synthetic device --------------------------------------------

DENSE_MS = 10.0


class _Device:
    """A synthetic machine: a model the table prices at the fraction p of dense runs at the ratio ``factor x p +
    offset`` to the dense model (DENSE_MS ms); for an absolute budget a model priced at ``pred`` ms runs in
    ``factor x pred + offset`` ms. ``run_round(value)`` is an allocator that meets its budget exactly (predicted =
    value, a fraction of dense or ms); ``asked`` keeps the values asked of it."""

    def __init__(self, factor=1.0, offset=0.0, absolute=False, fail_at=None):
        self.factor, self.offset, self.absolute, self.fail_at, self.asked = factor, offset, absolute, fail_at, []

    def rec(self, value, seconds=1.5):
        pred = value if self.absolute else value * DENSE_MS
        return {"allocation": {"latency": {"predicted": pred, "target": pred, "dense": DENSE_MS}},
                "timing": {"total_s": seconds}}

    def run_round(self, value):
        self.asked.append(value)
        if self.fail_at is not None and len(self.asked) >= self.fail_at:
            raise UserError("below the cheapest allocation")
        return ("model", value), self.rec(value, seconds=2.0 + len(self.asked))

    def measure(self, dense, model):
        assert dense == "dense"
        ms = self.factor * model[1] + self.offset
        if not self.absolute:
            ms *= DENSE_MS
        return {"dense_ms": DENSE_MS, "pruned_ms": ms, "ratio": ms / DENSE_MS}


def _correct(dev, value, tolerance=0.03, rounds=3, unit=None, view=None):
    from edgeprune.budget.budget import Budget
    from edgeprune.budget.correction_loop import correct

    budget = Budget("latency", value, unit, "t.json")
    return correct(dev.run_round, "dense", (("model", value), dev.rec(value)), budget, dev.measure, tolerance,
                   rounds, view)


def test_a_fixed_factor_is_corrected_in_one_round_and_the_budget_asked_stays_the_target():
    dev = _Device(factor=0.8)  # the table overestimates by 1 / 0.8
    model, rec = _correct(dev, 0.5)
    chk = rec["latency_check"]
    r0, r1 = chk["rounds"]
    assert (r0["round"], r0["budget_value"], r0["predicted"], r0["target"]) == (0, 0.5, 0.5, 0.5)
    assert r0["measured"] == pytest.approx(0.4) and r0["miss"] == pytest.approx(-0.2)
    assert r0["seconds"] == 1.5 and r0["measured_ms"]["pruned_ms"] == pytest.approx(4.0)
    assert r0["measure_seconds"] >= 0
    assert dev.asked == [pytest.approx(0.5 * 0.5 / 0.4)]  # p* = p T / m
    assert r1["target"] == 0.5 and r1["budget_value"] == pytest.approx(0.625) and r1["seconds"] == 3.0
    assert r1["measured"] == pytest.approx(0.5) and abs(r1["miss"]) < 1e-12
    assert chk["chosen_round"] == 1 and chk["stopped"] == "within tolerance" and model == ("model", dev.asked[0])
    assert chk["tolerance"] == 0.03 and chk["max_rounds"] == 3 and chk["budget_ms"] == 5.0  # the budget asked
    assert chk["predicted_ms"] == pytest.approx(6.25) and chk["miss"] == pytest.approx(0.0, abs=1e-12)
    assert chk["measured"]["ratio"] == pytest.approx(0.5)


def test_an_offset_is_corrected_by_the_secant():
    dev = _Device(offset=0.1)  # ratio = p + 0.1
    _, rec = _correct(dev, 0.5, tolerance=0.001, rounds=5)
    chk = rec["latency_check"]
    # round 0: p 0.5, m 0.6; round 1: p* = 0.5 x 0.5 / 0.6 (the factor), m 0.5167; then the secant (slope 1): 0.4
    assert dev.asked[0] == pytest.approx(0.5 * 0.5 / 0.6)
    assert dev.asked[1] == pytest.approx(0.4)
    assert len(chk["rounds"]) == 3 and chk["chosen_round"] == 2 and chk["stopped"] == "within tolerance"


def test_the_round_limit_keeps_the_closest_round_and_an_impossible_round_stops_the_loop():
    dev = _Device()
    dev.measure = lambda dense, model: {"dense_ms": 10.0, "pruned_ms": 4.0 + len(dev.asked),
                                        "ratio": [0.3, 0.45, 0.6, 0.58][len(dev.asked)]}
    _, rec = _correct(dev, 0.5, rounds=2)
    chk = rec["latency_check"]
    assert [r["round"] for r in chk["rounds"]] == [0, 1, 2] and chk["stopped"] == "round limit"
    assert chk["chosen_round"] == 1 and len(dev.asked) == 2  # |0.45 / 0.5 - 1| = 0.1 is the closest
    assert chk["measured"]["ratio"] == 0.45
    # a fraction is never asked above 1 (the dense model): measured 0.3 for 0.5 -> p* = 0.83; 0.2 -> 1.25 -> 1
    dev = _Device()
    dev.measure = lambda dense, model: {"dense_ms": 10.0, "pruned_ms": 2.0, "ratio": 0.2}
    _correct(dev, 0.5, rounds=1)
    assert dev.asked == [1.0]
    dev = _Device(factor=1.2, fail_at=1)
    _, rec = _correct(dev, 0.5)
    chk = rec["latency_check"]
    assert chk["stopped"] == "correction stopped: below the cheapest allocation" and len(chk["rounds"]) == 1
    assert chk["chosen_round"] == 0


def test_an_absolute_budget_is_corrected_in_ms_and_not_capped():
    dev = _Device(factor=2.0, absolute=True)  # pruned ms = 2 x predicted ms
    _, rec = _correct(dev, 12.0, unit="ms", rounds=2)
    chk = rec["latency_check"]
    r0 = chk["rounds"][0]
    assert (r0["predicted"], r0["measured"], r0["target"]) == (12.0, 24.0, 12.0) and r0["miss"] == 1.0
    assert dev.asked == [6.0] and chk["chosen_round"] == 1 and chk["compared"] == "ms"
    # a table that underestimates: the absolute value asked may exceed the dense model's (no cap at 1)
    dev = _Device(factor=0.5, absolute=True)
    _correct(dev, 12.0, unit="ms", rounds=1)
    assert dev.asked == [24.0]


def test_next_value_factor_secant_and_fallbacks():
    from edgeprune.budget.correction_loop import next_value

    assert next_value([(0.5, 0.4)], 0.5) == pytest.approx(0.625)
    assert next_value([(0.6, 0.3), (0.5, 0.4)], 0.5) == pytest.approx(0.5 * 0.5 / 0.4)  # falling m(p): the factor
    assert next_value([(0.6, 0.4), (0.5, 0.4)], 0.5) == pytest.approx(0.625)  # equal m: the factor
    assert next_value([(0.4, 0.3), (0.5, 0.4)], 0.5) == pytest.approx(0.6)  # the secant
    assert next_value([(0.1, 0.3), (0.5, 0.8)], 0.05) == pytest.approx(0.5 * 0.05 / 0.8)  # secant guess <= 0
    assert next_value([(0.1, 0.3), (0.5, 0.8), (0.7, 0.9)], 0.85) == pytest.approx(0.6)  # the last two points
    for bad in ([], [(0.5, 0.0)], [(0.5, -1.0)]):
        with pytest.raises(ValueError, match="need a positive measured value"):
            next_value(bad, 0.5)


def test_check_correction_bounds():
    from edgeprune.budget.correction import check_correction

    check_correction(True, 0.5, 0)
    check_correction(False, 0.999, 10)
    check_correction(True, 1e-6, 5)
    for args, msg in [((1, 0.5, 1), "verify_budget"), ((True, 0, 1), "tolerance"), ((True, 1, 1), "tolerance"),
                      ((True, 1.0, 1), "tolerance"), ((True, True, 1), "tolerance"), ((True, "0.1", 1), "tolerance"),
                      ((True, 0.1, -1), "rounds"), ((True, 0.1, 11), "rounds"), ((True, 0.1, True), "rounds"),
                      ((True, 0.1, 1.0), "rounds")]:
        with pytest.raises(UserError, match=msg):
            check_correction(*args)


def test_not_measured_views_and_with_value(table):
    from edgeprune.budget.budget import Budget
    from edgeprune.budget.correction_loop import allocation_view, not_measured, table_measurer, with_value

    b = Budget("latency", 0.5, None, table)
    rec = _Device().rec(0.5)
    assert allocation_view("latency")(rec) == (rec["allocation"]["latency"], 1.5)
    not_measured(rec, b, "no backend here")
    chk = rec["latency_check"]
    assert chk["not_measured"] == "no backend here" and chk["measured"] is None and chk["budget_ratio"] == 0.5
    empty = {"allocation": {}}
    not_measured(empty, b, "x")
    assert "latency_check" not in empty
    other = {"mine": {"predicted": 3.0, "target": 4.0, "dense": 8.0}}
    not_measured(other, Budget("latency", 4.0, "ms", table), "y", view=lambda r: (r["mine"], 0.0))
    assert other["latency_check"]["budget_ms"] == 4.0 and other["latency_check"]["predicted_ratio"] == 3.0 / 8.0
    w = with_value(Budget("latency", 12.0, "ms", table), 7)
    assert w == Budget("latency", 7.0, "ms", table) and isinstance(w.value, float)
    measurer, reason = table_measurer(b, find_anatomy(small_vit()))
    assert measurer is None and "hand-made" in reason


# -- derive_latency: NuWa's plan search under a latency table ------------------------------------------

def test_dim_grid_allowed_up_and_describe():
    from edgeprune.nuwa import budget as nb

    assert (nb._up(17, 8), nb._up(16, 8), nb._up(0, 8), nb._up(1, 4)) == (24, 16, 0, 4)
    free = nb.DimGrid(8, 8, False, 8, 8, 8)
    assert free.allowed(10, 64) == 10 and free.allowed(70, 64) == 64
    g = nb.DimGrid(16, 8, False, 16, 8, 8, {"head_dims": [16, 32, 64]}, (16, 32, 64))
    assert [g.allowed(k, 64) for k in (8, 10, 16, 17, 33, 64, 70)] == [16, 16, 16, 32, 64, 64, 64]
    assert g.allowed(20, 48) == 32 and g.allowed(40, 48) == 48
    assert nb.DimGrid(16, 32, False, 16, 32, 32, {}, (16, 32, 64)).allowed(10, 64) == 32  # 16 is off the x32 grid
    assert g.describe() == {"rules": {"head_dims": [16, 32, 64]}, "round_to": {"mlp": 16, "qk": 8, "v": 8},
                            "smallest": {"mlp": 16, "qk": 8, "v": 8}, "qk_equals_v": False,
                            "heads": "every block keeps all its heads (not a unit of derive)"}
    assert nb.DimGrid(16, 8, True, 16, 8, 8, {}).describe()["qk_equals_v"] == "both the larger of the two OFP dims"


def test_dim_grid_from_the_table_rules_and_bounds():
    from types import SimpleNamespace

    from edgeprune.nuwa import budget as nb

    def cost(rules, lower=None):
        return SimpleNamespace(rules=rules, lower=lower or {})

    assert nb.dim_grid(cost(None), 4) == nb.DimGrid(4, 4, False, 4, 4, 4)
    r = {"mlp_round_to": 16, "head_dim_round_to": 4, "qk_equals_v": False}
    assert nb.dim_grid(cost(r, {"mlp": 20, "qk": 6, "v": 3})) == nb.DimGrid(16, 4, False, 32, 8, 4, r, None)
    assert nb.dim_grid(cost(r, {"mlp": 0})) == nb.DimGrid(16, 4, False, 16, 4, 4, r, None)
    tied = {**r, "qk_equals_v": True}
    assert nb.dim_grid(cost(tied, {"qk": 6, "v": 3})) == nb.DimGrid(16, 4, True, 16, 8, 8, tied, None)
    assert nb.dim_grid(cost(tied, {"qk": 3, "v": 9})).qk_min == 12
    ruled = {"mlp_round_to": 8, "head_dim_round_to": 8, "qk_equals_v": False, "head_dims": [24, 12, 16, 40]}
    g = nb.dim_grid(cost(ruled, {"qk": 8, "v": 17}))
    assert (g.qk_min, g.v_min, g.head_dims) == (16, 24, (12, 16, 24, 40))  # allowed multiples of 8 >= 8 / 24
    g = nb.dim_grid(cost({"qk_equals_v": False, "head_dims": [7]}, {"qk": 30}), 4)  # none allowed: the bound stays
    assert (g.mlp, g.head_dim, g.qk_min, g.v_min, g.mlp_min) == (4, 4, 32, 4, 4)


def test_attention_dims_on_the_table_grid(monkeypatch):
    from types import SimpleNamespace

    from edgeprune.nuwa import budget as nb

    monkeypatch.setattr(nb, "layer_dims", lambda factors, rho, r: ([4, 12, 20], [8, 4, 16]))
    f = [SimpleNamespace(qk_dim=16, v_dim=16), SimpleNamespace(qk_dim=16, v_dim=16), SimpleNamespace(qk_dim=16,
                                                                                                      v_dim=12)]
    assert nb.attention_dims(f, 0.9, nb.DimGrid(4, 4, False, 4, 4, 4)) == ([4, 12, 20], [8, 4, 16])
    g = nb.DimGrid(16, 4, False, 16, 8, 4, {})
    assert nb.attention_dims(f, 0.9, g) == ([8, 12, 16], [8, 4, 12])
    tied = nb.DimGrid(16, 4, True, 16, 8, 8, {})
    assert nb.attention_dims(f, 0.9, tied) == ([8, 12, 16], [8, 12, 16])
    ruled = nb.DimGrid(16, 4, False, 16, 4, 4, {}, (8, 12))
    assert nb.attention_dims(f, 0.9, ruled) == ([8, 12, 16], [8, 8, 12])


def test_search_fill_takes_the_largest_feasible_level_of_a_bumpy_cost():
    from types import SimpleNamespace

    from edgeprune.nuwa import budget as nb

    price = {8: 1.0, 16: 5.0, 24: 2.0, 32: 3.0}  # not monotone in the width
    calls = []

    def block(i, q, v, m):
        calls.append((i, m))
        assert (q, v) == ([8, 12][i], [4, 16][i])
        return price[m] + i * 0.0

    cost = SimpleNamespace(fixed=0.5, block=block)
    # levels: [8, 8] 2, [16, 8] 6, [16, 16] 10, [24, 16] 7, [24, 24] 4, [32, 24] 5, [32, 32] 6 (+ 0.5 fixed)
    mlp, total = nb.search_mlp_dims(cost, [8, 12], [4, 16], [32, 32], 6.5)
    assert mlp == [32, 32] and total == 6.5
    assert len(calls) == len(set(calls)) == 8  # every (block, width) priced once
    mlp, total = nb.search_mlp_dims(cost, [8, 12], [4, 16], [32, 32], 6.0)
    assert sorted(mlp) == [24, 32] and total == 5.5
    assert nb.search_mlp_dims(cost, [8, 12], [4, 16], [32, 32], 2.5) == ([8, 8], 2.5)
    assert nb.search_mlp_dims(cost, [8, 12], [4, 16], [32, 32], 2.5, lowest=16) is None
    assert nb.search_mlp_dims(cost, [8, 12], [4, 16], [32, 32], 2.4) is None
    mlp, total = nb.search_mlp_dims(cost, [8, 12], [4, 16], [32, 32], 4.5, lowest=24)
    assert mlp == [24, 24] and total == 4.5
    mlp, _ = nb.search_mlp_dims(cost, [8, 12], [4, 16], [16, 32], 100.0)  # the caps bound the levels
    assert mlp == [16, 32]


def test_latency_plan_cost_target_smallest_dims_record_and_feasibility(table, monkeypatch):
    from types import SimpleNamespace

    from edgeprune.budget.budget import Budget
    from edgeprune.nuwa import budget as nb

    model = small_vit()
    an = find_anatomy(model)
    b = Budget("latency", 0.5, None, table)
    pc = nb.PlanCost(an, b)
    assert pc.linear is False and pc.kind == "latency" and pc.fixed == 1  # a whole number: _exact
    assert pc.rules == RULES and pc.lower == {"mlp": 0, "qk": 8, "v": 8, "heads": 1}
    assert pc.block(1, 8, 16, 64) == pytest.approx(mlp_ms(64) + attn_ms(H, 8, 16), rel=1e-12)
    dense = 1.0 + DEPTH * (mlp_ms(MLP) + attn_ms(H, HD, HD))
    assert nb.measure(model, b) == pytest.approx(dense, rel=1e-12) and isinstance(nb.measure(model, b), float)
    assert nb.budget_target(b, 3.3) == pytest.approx(1.65) and nb.budget_target(Budget("flops", 0.5), 3.3) == 1
    assert nb.budget_target(Budget("latency", 2.5, "ms", table), 3.3) == 2.5
    assert nb.smallest_dims(pc) == ([8, 8], [8, 8], [8, 8])  # the table's smallest: MLP 0 -> one x8 step
    assert nb.minimum_cost(pc) == pytest.approx(1.0 + DEPTH * (mlp_ms(8) + attn_ms(H, 8, 8)))
    small = SimpleNamespace(anatomy=SimpleNamespace(blocks=[SimpleNamespace(qk_dim=4, v_dim=12)] * 2),
                            rules={"mlp_round_to": 16, "head_dim_round_to": 4, "qk_equals_v": True},
                            lower={"qk": 8, "v": 8})
    assert nb.smallest_dims(small) == ([8, 8], [8, 8], [16, 16])  # qk min(4, 8) = 4 tied to v 8
    small.rules = {**small.rules, "qk_equals_v": False}
    assert nb.smallest_dims(small) == ([4, 4], [8, 8], [16, 16])
    g = nb.dim_grid(pc)
    rec = nb.measured_record(pc, g, 2.0, 2.5, dense)
    assert rec["table"] == table and rec["heads_allocated"] is False and rec["smallest"] == g.describe()["smallest"]
    assert (rec["predicted"], rec["target"], rec["dense"]) == (2.0, 2.5, dense)
    assert rec["mlp_fill"].startswith("search")
    low = nb.minimum_cost(pc)
    nb.check_feasible(pc, low, dense)
    with pytest.raises(UserError) as err:
        nb.check_feasible(pc, low - 1e-6, 2 * low)
    assert str(err.value) == ("the latency budget 0.5 of the base model cannot be met with the latency table's grid "
                              "(MLP widths x8, head dims x8, every head kept): the smallest derivable model keeps "
                              "0.500; raise --latency")


def test_derive_measure_and_correct_returns_the_chosen_rounds_result(table):
    from types import SimpleNamespace

    from edgeprune.budget.budget import Budget
    from edgeprune.nuwa.config import DeriveConfig
    from edgeprune.nuwa.measured import derivation_view, measure_and_correct

    def result(value, seconds=0.25):
        pred = value * DENSE_MS
        rec = {"derivation": {"budget": {"latency": {"predicted": pred, "target": pred, "dense": DENSE_MS}}},
               "timing": {"search_s": seconds}}
        return SimpleNamespace(model=("model", value), record=rec)

    asked = []

    def plan(budget):
        asked.append((budget.kind, budget.value, budget.unit, budget.table))
        return result(budget.value, seconds=1.0)

    def measure(base, model):  # the table overestimates by 1 / 0.8
        assert base == "dense"
        return {"dense_ms": DENSE_MS, "pruned_ms": 0.8 * model[1] * DENSE_MS, "ratio": 0.8 * model[1]}

    b = Budget("latency", 0.5, None, table)
    first = result(0.5)
    assert derivation_view("latency")(first.record) == (first.record["derivation"]["budget"]["latency"], 0.25)
    out = measure_and_correct(plan, "dense", first, b, DeriveConfig(), measure)
    assert asked == [("latency", pytest.approx(0.625), None, table)] and out is not first
    assert out.model == ("model", pytest.approx(0.625))
    chk = out.record["latency_check"]
    assert chk["chosen_round"] == 1 and chk["rounds"][0]["seconds"] == 0.25 and chk["rounds"][1]["seconds"] == 1.0
    assert chk["max_rounds"] == 3 and chk["tolerance"] == 0.03
    # rounds 0: measured only; the closest round is round 0 itself
    asked.clear()
    first = result(0.5)
    assert measure_and_correct(plan, "dense", first, b, DeriveConfig(correction_rounds=0), measure) is first
    assert asked == [] and first.record["latency_check"]["rounds"][0]["measured"] == pytest.approx(0.4)
    # not asked: predicted only, with the reason; a budget nothing measures: untouched
    first = result(0.5)
    assert measure_and_correct(plan, "dense", first, b, DeriveConfig(verify_budget=False), measure) is first
    assert first.record["latency_check"]["not_measured"] == "not asked (--no-verify-latency)"
    assert first.record["latency_check"]["measured"] is None
    flops = result(0.5)
    assert measure_and_correct(plan, "dense", flops, Budget("flops", 0.5), DeriveConfig(), measure) is flops
    assert "latency_check" not in flops.record and asked == []
    # no measurer given: the table's backend, not on this machine (a hand-made device)
    first = result(0.5)
    assert measure_and_correct(plan, small_vit(), first, b, DeriveConfig()) is first
    assert "hand-made" in first.record["latency_check"]["not_measured"]


# -- latency_table: interpolation, grid, self-check arithmetic --------------------------------------------

def test_bracket_and_multilinear_known_answers():
    from edgeprune.latency.table import _bracket, _multilinear

    g = [0, 32, 64]
    assert _bracket(g, 16, "w") == (0, 1, 0.5) and _bracket(g, 32, "w") == (1, 1, 0.0)
    assert _bracket(g, 0, "w") == (0, 0, 0.0) and _bracket(g, 64, "w") == (2, 2, 0.0)
    assert _bracket(g, 56, "w") == (1, 2, 0.75)
    for x in (-1, 65):
        with pytest.raises(UserError, match=rf"^latency table: w = {x} is outside the table's measured range \(0\.\.64\)"):
            _bracket(g, x, "w")
    with pytest.raises(UserError, match=r"\(empty\)"):
        _bracket([], 1, "w")
    vals = [1.0, float("nan"), 5.0]
    assert _multilinear([(0, 0, 0.0)], lambda i: vals[i]) == 1.0  # the NaN corner has weight 0: never read
    assert _multilinear([(1, 2, 0.25)], lambda i: [0.0, 4.0, 8.0][i]) == 5.0
    assert _multilinear([(0, 1, 0.5), (0, 1, 0.25)], lambda i, j: [[0.0, 4.0], [8.0, 12.0]][i][j]) == 5.0
    for bad in (float("nan"), None):
        with pytest.raises(UserError, match=r"needs an entry that was not measured \(grid index \(1,\)\)"):
            _multilinear([(0, 1, 0.5)], lambda i: [1.0, bad][i])


def test_attention_interpolation_is_trilinear_and_bilinear_on_the_diagonal(tmp_path):
    key = {**KEY, "num_heads": 3}
    prod = write_latency_table(tmp_path / "p.json", key, RULES, [1, 3], [8, 16], [0, 128],
                               lambda h, q, v: float(h * q * v), mlp_ms)
    t = LatencyTable.load(prod)
    # h q v is linear in each axis: trilinear interpolation is exact
    assert t.attn_ms(2, 12, 12) == pytest.approx(288.0) and t.attn_ms(3, 8, 14) == pytest.approx(336.0)
    assert t.attn_ms(1, 16, 8) == 128.0
    diag = write_latency_table(tmp_path / "d.json", key, {**RULES, "qk_equals_v": True}, [1, 3], [8, 16], [0, 128],
                               lambda h, q, v: float(h * q * v), mlp_ms)
    t = LatencyTable.load(diag)
    # only ms[h][d][d] = h d^2 is read: linear in d^2 between 64 and 256 -> 160 at d = 12
    assert t.attn_ms(2, 12, 12) == pytest.approx(320.0)
    with pytest.raises(UserError, match="qk dim 8 != v dim 16"):
        t.attn_ms(2, 8, 16)
    assert t.mlp_ms(32) == pytest.approx(mlp_ms(32)) and t.mlp_ms(64) == pytest.approx(mlp_ms(64))


def test_block_total_dense_and_model_ms_with_the_block_terms(table):
    t = LatencyTable.load(table)
    dims = {"mlp": 64, "qk": 8, "v": 16, "heads": 2}
    ms = mlp_ms(64) + attn_ms(2, 8, 16)
    assert t.block_ms(dims) == pytest.approx(ms) and t.block_total(dims) == t.block_ms(dims)
    assert t.block_ms({}) == pytest.approx(mlp_ms(MLP) + attn_ms(H, HD, HD))  # missing keys: dense
    assert t.block_ms({"heads": 2}) == pytest.approx(mlp_ms(MLP) + attn_ms(2, HD, HD))
    assert t.block_ms({"qk": 8}) == pytest.approx(mlp_ms(MLP) + attn_ms(H, 8, HD))
    assert t.block_ms({"v": 8}) == pytest.approx(mlp_ms(MLP) + attn_ms(H, HD, 8))
    t.block_scale, t.block_overhead_ms = 1.5, 0.25
    assert t.block_total(dims) == pytest.approx(1.5 * ms + 0.25)
    t.block_scale, t.block_overhead_ms = 1.0, 0.25
    assert t.block_total(dims) == pytest.approx(ms + 0.25)
    t.block_scale, t.block_overhead_ms = 2.0, 0.0
    assert t.block_total(dims) == pytest.approx(2 * ms)
    dense = t.block_total(t.dense_dims())
    assert t.dense_dims() == {"mlp": MLP, "qk": HD, "v": HD, "heads": H}
    assert t.dense_ms() == pytest.approx(1.0 + DEPTH * dense)
    assert t.model_ms([dims, t.dense_dims()]) == pytest.approx(1.0 + 2 * ms + dense)


def test_unverified_complete_and_json_numbers(table):
    from edgeprune.latency.table import _num_in, _num_out

    t = LatencyTable.load(table)
    assert t.unverified is None and t.complete
    t.meta["self_check"] = {"passed": True}
    assert t.unverified is None
    t.meta["self_check"] = {"passed": False, "failure": "x0.5 off"}
    assert t.unverified == "x0.5 off"
    t.meta["self_check"] = {"passed": False}
    assert t.unverified == "its self-check missed"
    t.meta["complete"] = False
    assert t.complete is False
    assert _num_out(float("nan")) is None and _num_out(None) is None and _num_out(2) == 2.0
    assert isinstance(_num_out(2), float) and math.isnan(_num_in(None)) and _num_in(3) == 3.0
    d = LatencyTable.load(table).to_dict()
    assert d["format"] == "edgeprune-latency-table/1" and d["block_scale"] == 1.0 and d["block_overhead_ms"] == 0.0


def test_grid_thin_on_grid_shape_and_make_grid():
    from edgeprune.latency.grid import make_grid, on_grid, shape_of, thin

    assert thin(list(range(1, 11)), 4) == [1, 4, 7, 10] and thin([1, 2, 3, 4, 5, 6], 4) == [1, 3, 4, 6]
    assert thin([1, 2, 3], 3) == [1, 2, 3] and thin([1, 2, 3], 2) == [1, 3]
    assert on_grid(20, 8) == [8, 16, 20] and on_grid(16, 8) == [8, 16] and on_grid(4, 8) == [4]
    shape = shape_of(find_anatomy(small_vit()))
    assert shape == {"embed_dim": D, "depth": DEPTH, "num_heads": H, "head_dim": HD, "mlp_hidden": MLP, "tokens": N}
    g = make_grid(shape, {"mlp_round_to": 16, "head_dim_round_to": 4, "qk_equals_v": False}, max_mlp=3, max_heads=2,
                  max_dims=3, max_diag=4)
    # 8 MLP points -> indices round(i 7 / 2) = 0, 4 (round(3.5)), 7; 4 head dims -> 0, 2 (round(1.5)), 3
    assert (g.mlp, g.heads, g.qk, g.v, g.qk_equals_v) == ([16, 80, 128], [1, 4], [4, 12, 16], [4, 12, 16], False)
    assert g.count() == 3 + 2 * 3 * 3 and g.attn_points()[:2] == [(1, 4, 4), (1, 4, 12)]
    g = make_grid(shape, {"mlp_round_to": 16, "head_dim_round_to": 4, "qk_equals_v": True}, max_mlp=2, max_heads=2,
                  max_dims=2, max_diag=3)
    assert g.qk == [4, 12, 16] and g.qk_equals_v and g.attn_points() == [(h, d, d) for h in (1, 4) for d in (4, 12, 16)]
    assert g.count() == 2 + 6
    g = make_grid(shape, {"mlp_round_to": 64, "head_dim_round_to": 4, "qk_equals_v": False, "head_dims": [8, 12]})
    assert g.qk == [8, 12, 16] and g.mlp == [64, 128] and g.heads == [1, 2, 3, 4]
    with pytest.raises(UserError, match="at least 2 points"):
        make_grid(shape, {"mlp_round_to": 16, "head_dim_round_to": 4, "qk_equals_v": False}, max_diag=1)
    with pytest.raises(UserError, match="round_to rules must be >= 1"):
        make_grid(shape, {"mlp_round_to": 16, "head_dim_round_to": 0, "qk_equals_v": False})
    make_grid(shape, {"mlp_round_to": 1, "head_dim_round_to": 1, "qk_equals_v": False}, max_mlp=2, max_heads=2,
              max_dims=2, max_diag=2)


def test_self_check_allocations_span_and_verdict(table):
    from edgeprune.latency import selfcheck as sc

    t = LatencyTable.load(table)
    assert sc.chain_length(1) == 2 and sc.chain_length(2) == 2 and sc.chain_length(12) == 12
    assert sc._snap(10.0, 8, 8, 16) == 8 and sc._snap(13.0, 8, 8, 16) == 16 and sc._snap(30.0, 8, 8, 16) == 16
    assert sc._snap(2.0, 8, 8, 16) == 8 and sc._snap(4.0, 8, 0, 16) == 0
    assert sc.half_dims(t) == {"heads": 2, "qk": 8, "v": 8, "mlp": 64}
    allocs = dict(sc.allocations(t))
    assert list(allocs) == ["dense", "x0.7", "x0.5", "x0.3"] and allocs["dense"] == [t.dense_dims()] * 2
    assert allocs["x0.7"] == [{"heads": 3, "qk": 16, "v": 16, "mlp": 88}, {"heads": 4, "qk": 8, "v": 16, "mlp": 88}]
    assert allocs["x0.5"] == [{"heads": 2, "qk": 16, "v": 16, "mlp": 64}, {"heads": 4, "qk": 8, "v": 8, "mlp": 64}]
    assert allocs["x0.3"] == [{"heads": 1, "qk": 16, "v": 16, "mlp": 40}, {"heads": 4, "qk": 8, "v": 8, "mlp": 40}]
    assert sc._span(allocs["x0.7"]) == "heads 3-4, qk 8-16, v 16, mlp 88"
    models = [{"name": "dense", "predicted_ms": 2.0, "measured_ms": 2.0, "error": 0.0, "blocks": allocs["dense"]},
              {"name": "x0.5", "predicted_ms": 1.0, "measured_ms": 1.0, "error": 0.1, "blocks": allocs["x0.5"]}]
    v = sc.verdict(t, models, tolerance=0.1)
    assert v == {"passed": True, "tolerance": 0.1, "failure": None, "cause": None, "models": models}
    models[1]["error"] = -0.15
    v = sc.verdict(t, models, tolerance=0.1)
    assert not v["passed"] and v["failure"] == (
        "the sub-block entries (mlp.ms / attn.ms) are off at the pruned dims of allocation x0.5 (heads 2-4, qk 8-16, "
        "v 8-16, mlp 64): predicted 1 ms, measured 1 ms whole (-15.0%, more than 10%)")
    models[0]["error"], models[0]["predicted_ms"] = 0.2, 2.5
    v = sc.verdict(t, models, tolerance=0.1)
    block = mlp_ms(MLP) + attn_ms(H, HD, HD)
    table_failure = (f"the parts do not add up to the dense model: outside the blocks 1 ms + 2 x block "
                     f"{block:.4g} ms predicted 2.5 ms, measured 2 ms whole (+20.0%, more than 10%)")
    assert v["failure"] == table_failure and v["cause"] == "table"
    # issue 52: the load figures name the load when the dense model moved by more than half the tolerance during the
    # build, or the machine was loaded; a quiet build blames the table
    quiet = {"load_1m": 0.5, "load_5m": 0.4, "cores": 2, "clock": "wall"}
    busy = {**quiet, "load_1m": 5.25}
    v = sc.verdict(t, models, 0.1, {"start": quiet, "end": busy, "dense_ms_again": 2.4, "dense_drift": 0.2})
    assert v["cause"] == "load" and v["failure"] == (
        "the machine's load changed the timings by +20.0% during the build (load average 5.2 on 2 cores), so the "
        f"check cannot tell a table error from the load; what it saw: {table_failure}")
    v = sc.verdict(t, models, 0.1, {"start": quiet, "end": busy, "dense_ms_again": 2.0, "dense_drift": 0.0})
    assert v["cause"] == "load" and v["failure"].startswith("the machine was loaded during the build (load average "
                                                           "5.2 on 2 cores)")
    for drift in (0.0, 0.049, -0.049):  # within half the tolerance and a quiet machine: the table is off
        v = sc.verdict(t, models, 0.1, {"start": quiet, "end": quiet, "dense_ms_again": 2.0, "dense_drift": drift})
        assert v["cause"] == "table" and v["failure"] == table_failure
    v = sc.verdict(t, models, 0.1, {"start": quiet, "end": quiet, "dense_ms_again": 1.8, "dense_drift": -0.1})
    assert v["cause"] == "load" and "by -10.0%" in v["failure"]


def test_finish_recovers_the_block_scale_and_overhead(table):
    from edgeprune.errors import RuntimeFault
    from edgeprune.latency import selfcheck as sc

    t = LatencyTable.load(table)
    sub, half = mlp_ms(MLP) + attn_ms(H, HD, HD), mlp_ms(64) + attn_ms(2, 8, 8)
    quarter = t.block_ms(sc.fraction_dims(t, 0.25))
    per, per_half, call = 1.2 * sub + 0.1, 1.2 * half + 0.1, 0.5  # the machine: 1.2 x sub-blocks + 0.1 ms per block
    per_quarter = 1.2 * quarter + 0.1
    parts = {"block_ms": per + call, "chain_ms": per + call + per, "chain_half_ms": call + 2 * per_half,
             "chain_quarter_ms": call + 2 * per_quarter, "outside_ms": 0.7}
    t.meta["parts"] = dict(parts)
    t.dense_model_ms = 5.0
    sc.finish(t)
    assert t.block_scale == pytest.approx(1.2) and t.block_overhead_ms == pytest.approx(0.1) and t.fixed_ms == 0.7
    p = t.meta["parts"]
    assert p["per_block_ms"] == pytest.approx(per) and p["per_block_half_ms"] == pytest.approx(per_half)
    assert p["sub_blocks_ms"] == pytest.approx(sub) and p["sub_blocks_half_ms"] == pytest.approx(half)
    assert p["chain_blocks"] == 2 and p["half_dims"] == {"heads": 2, "qk": 8, "v": 8, "mlp": 64}
    pts = sorted({(round(x, 9), round(y, 9)) for x, y in [(quarter, per_quarter), (half, per_half), (sub, per)]})
    assert [(round(x, 9), round(y, 9)) for x, y in t.block_points] == pts
    for x, y in t.block_points:  # on the machine's line, so the map is that line
        assert y == pytest.approx(1.2 * x + 0.1)
    assert t.meta["fixed_by_subtraction_ms"] == pytest.approx(5.0 - 2 * sub)
    for bad in ({"chain_half_ms": call + 2 * per}, {"chain_ms": per + call}, {"chain_half_ms": call}):
        t = LatencyTable.load(table)
        t.meta["parts"] = {**parts, **bad}
        t.measured.update(block=True, chain=True, chain_half=True, chain_quarter=True)
        with pytest.raises(RuntimeFault, match="load changed too much"):
            sc.finish(t)
        assert not (t.measured["block"] or t.measured["chain"] or t.measured["chain_half"]
                    or t.measured["chain_quarter"])


def test_finish_keeps_disordered_chains_out_when_forced(table):
    """--force after the last re-timing: a half chain that timed no faster is left out (named), a dense chain
    whose n blocks timed no slower than one falls back to the sub-blocks' sum; the table then adds up."""
    from edgeprune.latency import selfcheck as sc
    from edgeprune.latency.schema import check_adds_up

    t = LatencyTable.load(table)
    sub = mlp_ms(MLP) + attn_ms(H, HD, HD)
    quarter = t.block_ms(sc.fraction_dims(t, 0.25))
    per, call = 1.2 * sub + 0.1, 0.5
    parts = {"block_ms": per + call, "chain_ms": per + call + per, "chain_half_ms": call + 2 * per,
             "chain_quarter_ms": call + 2 * (1.2 * quarter + 0.1), "outside_ms": 0.7}
    t.meta["parts"] = dict(parts)
    sc.finish(t, keep_disordered=True)
    p = t.meta["parts"]
    assert p["left_out"] == [f"chain_half (2 half blocks {call + 2 * per:.4g} ms)"]
    assert "per_block_half_ms" not in p
    assert [round(x, 9) for x, _ in t.block_points] == [round(quarter, 9), round(sub, 9)]  # the quarter still fits
    assert t.block_total(t.dense_dims()) == pytest.approx(per)
    t.dense_model_ms = t.dense_ms()
    t.meta["complete"] = True
    check_adds_up(t)
    t = LatencyTable.load(table)
    t.meta["parts"] = {**parts, "chain_ms": per + call, "chain_half_ms": call + 2 * 1.2 * quarter}
    sc.finish(t, keep_disordered=True)
    p = t.meta["parts"]
    assert p["left_out"][0] == f"chain (2 blocks {per + call:.4g} ms, one {per + call:.4g} ms)"
    assert p["per_block_ms"] == pytest.approx(sub) and t.block_total(t.dense_dims()) == pytest.approx(sub)
    call = per + call - sub  # one call's cost beyond the sub-blocks: what a chain of n blocks pays once
    assert p["per_block_half_ms"] == pytest.approx((2 * 1.2 * quarter + 0.5 - call) / 2)


def test_conclude_marks_complete_forced_or_refuses(table, tmp_path):
    from edgeprune.latency import selfcheck as sc

    out = tmp_path / "c.json"
    t = LatencyTable.load(table)
    t.meta["complete"] = False
    sc.conclude(t, {"passed": True, "tolerance": 0.1, "failure": None, "models": []}, False, out)
    assert t.meta["complete"] is True and t.meta["self_check"]["forced"] is False and "finished" in t.meta
    t = LatencyTable.load(table)
    sc.conclude(t, {"passed": False, "tolerance": 0.1, "failure": "off", "models": []}, True, out)
    assert t.meta["complete"] is True and t.meta["self_check"]["forced"] is True
    t = LatencyTable.load(table)
    t.meta.pop("finished", None)
    with pytest.raises(sc.SelfCheckFailed, match=r"^latency table self-check failed: off \("):
        sc.conclude(t, {"passed": False, "tolerance": 0.1, "failure": "off", "models": []}, False, out)
    assert t.meta["complete"] is False and "finished" not in t.meta and t.meta["self_check"]["forced"] is False


def test_timing_checks_bounds_and_the_unavailable_message():
    from types import SimpleNamespace

    from edgeprune.latency.timing_checks import _check_backend, _check_way, unavailable_message

    ok = dict(repeats=1, retries=0, spread=1.0, statistic="p50", clock="wall", device="cpu", threads=4)
    _check_way(TimingSettings(**ok))
    _check_way(TimingSettings(**{**ok, "repeats": 3, "retries": 10, "spread": 0.05, "statistic": "min"}))
    _check_way(TimingSettings(**{**ok, "clock": "cpu", "threads": 1}))
    for bad, msg in [({"repeats": 0}, "--repeats"), ({"repeats": True}, "--repeats"), ({"repeats": 1.0}, "--repeats"),
                     ({"retries": -1}, "--retries"), ({"retries": 11}, "--retries"), ({"retries": False}, "--retries"),
                     ({"spread": 0}, "--spread"), ({"spread": 1.01}, "--spread"), ({"spread": float("inf")}, "--spread"),
                     ({"spread": "0.1"}, "--spread"), ({"statistic": "p90"}, "--statistic"), ({"clock": "gpu"}, "--clock"),
                     ({"clock": "cpu", "threads": 2}, "one CPU thread"),
                     ({"clock": "cpu", "threads": 1, "device": "cuda"}, "one CPU thread")]:
        with pytest.raises(UserError, match=msg):
            _check_way(TimingSettings(**{**ok, **bad}))
    timer = SimpleNamespace(refuses=lambda s: None)
    cpu = SimpleNamespace(uses_tensorrt=False, name="cpu", backend="onnxruntime")
    for p in ("fp32", "fp16", "int8"):
        _check_backend(cpu, "onnxruntime", timer, TimingSettings(precision=p))
    with pytest.raises(UserError, match="--precision must be one of fp32, fp16, int8, got 'bf16'"):
        _check_backend(cpu, "onnxruntime", timer, TimingSettings(precision="bf16"))
    with pytest.raises(UserError, match="profile cpu times on onnxruntime"):
        _check_backend(cpu, "tensorrt", timer, TimingSettings())
    _check_backend(SimpleNamespace(uses_tensorrt=True, name="gpu", backend="tensorrt"), "tensorrt", timer,
                   TimingSettings())
    with pytest.raises(UserError, match="^no fp16 here$"):
        _check_backend(cpu, "onnxruntime", SimpleNamespace(refuses=lambda s: "no fp16 here"), TimingSettings())
    gpu = SimpleNamespace(name="orin")
    assert unavailable_message(gpu, "tensorrt", "tensorrt: missing\nmore", "deit") == (
        "profile orin times with TensorRT on its GPU, which is not here (tensorrt); run `edgeprune latency-table "
        "--model deit --device orin -o orin.json` on the device and copy the file (prune --latency-table FILE)")
    assert unavailable_message(gpu, "onnxruntime", "") == "backend onnxruntime cannot time here: not available"
    assert unavailable_message(gpu, "torch", "no cuda: at all\nx") == "backend torch cannot time here: no cuda"


def test_default_batch_settings_and_key():
    from types import SimpleNamespace

    import devices
    from edgeprune.latency.build import default_batch, make_key, settings_for

    def prof(sizes):
        return SimpleNamespace(bench=SimpleNamespace(batch_sizes=sizes))

    assert default_batch(prof([1, 8, 32])) == 8 and default_batch(prof([32, 16])) == 16
    assert default_batch(prof([4, 2, 64])) == 4
    cpu = devices.load_profile("cpu")
    timer, s, batch = settings_for(cpu, BuildOptions(threads=1, batch=3, warmup=0, iterations=2, repeats=1))
    assert batch == 3 and (s.device, s.threads, s.clock, s.warmup, s.iterations) == ("cpu", 1, "cpu", 0, 2)
    assert s.precision == cpu.precision and s.cuda_graphs is False
    _, s, batch = settings_for(cpu, BuildOptions(threads=2, repeats=1))
    assert s.clock == "wall" and batch == default_batch(cpu) and s.iterations == cpu.bench.iterations
    assert s.warmup == cpu.bench.warmup
    for opts, msg in [(BuildOptions(batch=0), "--batch must be >= 1"), (BuildOptions(threads=0), "--threads"),
                      (BuildOptions(iterations=0, repeats=1), "--iterations >= 1"),
                      (BuildOptions(warmup=-1, repeats=1), "--warmup >= 0")]:
        with pytest.raises(UserError, match=msg):
            settings_for(cpu, opts)
    key = make_key({"embed_dim": 8}, cpu, timer, s, 5)
    assert key["embed_dim"] == 8 and key["batch"] == 5 and key["threads"] == 2 and key["profile"] == cpu.name
    assert key["precision"] == s.precision and key["backend"] == timer.name
    assert key["backend_version"] == timer.version() and key["device_name"] == timer.device_name(s)


def test_check_heads_setting_needs_a_budget_and_a_head_target(table):
    from edgeprune.allocation.rules import check_heads_setting

    lat = make_budget(latency=0.5, table=table)
    for target in ("all", "v", "heads"):
        check_heads_setting(_cfg(lat, target=target, allocate_heads=True))
    check_heads_setting(_cfg(None, target="mlp", allocate_heads=None))
    check_heads_setting(_cfg(None, target="mlp", allocate_heads=False))
    with pytest.raises(UserError, match=r"^allocating whole heads needs a budget .*got target 'mlp'$"):
        check_heads_setting(_cfg(lat, target="mlp", allocate_heads=True))
    with pytest.raises(UserError, match=r"got target 'all' and no budget$"):
        check_heads_setting(_cfg(None, target="all", allocate_heads=True))
    with pytest.raises(UserError, match=r"got target 'qk' and no budget$"):
        check_heads_setting(_cfg(None, target="qk", allocate_heads=True))


def test_a_miss_equal_to_the_tolerance_stops_and_a_tie_keeps_the_earlier_round():
    dev = _Device()
    dev.measure = lambda dense, model: {"dense_ms": 8.0, "pruned_ms": 5.0, "ratio": 0.625}  # miss exactly +0.25
    _, rec = _correct(dev, 0.5, tolerance=0.25)
    assert rec["latency_check"]["stopped"] == "within tolerance" and dev.asked == []
    ratios = iter([0.625, 0.375])  # misses +0.25 and -0.25 (exact in binary): round 0 stays chosen
    dev.measure = lambda dense, model: {"dense_ms": 8.0, "pruned_ms": 4.0, "ratio": next(ratios)}
    _, rec = _correct(dev, 0.5, tolerance=0.1, rounds=1)
    chk = rec["latency_check"]
    assert [r["miss"] for r in chk["rounds"]] == [0.25, -0.25] and chk["chosen_round"] == 0
    assert chk["stopped"] == "round limit"
    assert all(0 <= r["measure_seconds"] < 60 for r in chk["rounds"])  # a duration, not a clock reading


def test_check_budget_under_a_latency_table_speaks_ms_and_names_the_grid(table):
    from edgeprune.allocation import greedy as G
    from edgeprune.api import corp_config

    an = find_anatomy(small_vit())
    dense = 1.0 + DEPTH * (mlp_ms(MLP) + attn_ms(H, HD, HD))  # 4.872 ms
    G.check_budget(an, corp_config("all", latency=1.0, latency_table=table, last_block="full"))  # exactly dense
    G.check_budget(an, corp_config("all", latency=f"{dense}ms", latency_table=table, last_block="full"))
    with pytest.raises(UserError) as err:
        G.check_budget(an, corp_config("all", latency="5ms", latency_table=table, last_block="full"))
    assert str(err.value) == ("the latency budget 5ms (5.000 ms) is above the dense model (4.872 ms latency): nothing "
                              "to prune (give a fraction < 1 or a smaller count)")
    floor = 1.0 + DEPTH * (mlp_ms(8) + attn_ms(1, 8, 8))  # MLP 8, one head of 8 / 8 dims per block
    with pytest.raises(UserError) as err:
        G.check_budget(an, corp_config("all", latency="1.5ms", latency_table=table, last_block="full"))
    assert str(err.value) == (
        "the latency budget 1.5ms (1.500 ms) is below the cheapest allocation for target all on the latency table's "
        f"grid {{'mlp': 8, 'qk': 8, 'v': 8, 'heads': 1}} ({floor:.3f} ms = {floor / dense:.3f} of the dense model)")
    with pytest.raises(UserError, match=r"^the flops budget 0.001 \([\d,]+\) is below the cheapest allocation for "
                                        r"target mlp with --round-to 8 \([\d,]+ = "):
        G.check_budget(an, corp_config("mlp", flops=0.001, round_to=8, last_block="full"))


def test_check_model_reads_block_0_and_a_missing_key_field_is_a_mismatch(table):
    from types import SimpleNamespace

    from devices import load_profile
    from edgeprune.latency.build import default_batch
    from edgeprune.latency.timing_checks import unavailable_message

    t = LatencyTable.load(table)

    def blk(mlp):
        return SimpleNamespace(num_heads=H, head_dim=HD, mlp_hidden=mlp)

    t.check_model(SimpleNamespace(embed_dim=D, num_tokens=N, blocks=[blk(MLP), blk(64)]))  # block 0 is the shape
    with pytest.raises(UserError, match="^latency table is for mlp_hidden = 128, the model has 64 "):
        t.check_model(SimpleNamespace(embed_dim=D, num_tokens=N, blocks=[blk(64), blk(MLP)]))
    del t.key["num_heads"]
    one = SimpleNamespace(embed_dim=D, num_tokens=N, blocks=[SimpleNamespace(num_heads=1, head_dim=HD,
                                                                             mlp_hidden=MLP)] * DEPTH)
    with pytest.raises(UserError, match="^latency table is for num_heads = None, the model has 1 "):
        t.check_model(one)
    # the table batch: the largest bench size <= 8, else the smallest
    assert default_batch(SimpleNamespace(bench=SimpleNamespace(batch_sizes=[1, 2, 4, 64]))) == 4
    assert default_batch(SimpleNamespace(bench=SimpleNamespace(batch_sizes=[4, 9]))) == 4
    assert default_batch(SimpleNamespace(bench=SimpleNamespace(batch_sizes=[9, 16]))) == 9
    assert "--model M --device" in unavailable_message(load_profile("cpu"), "tensorrt", "no tensorrt")


def test_keep_fraction_of_a_latency_budget(table):
    from edgeprune.budget.budget import Budget
    from edgeprune.nuwa.budget import keep_fraction

    assert keep_fraction(Budget("latency", 0.4, None, table), 5.0) == 0.4
    assert keep_fraction(Budget("latency", 2.0, "ms", table), 5.0) == pytest.approx(0.4)


# -- latency_table, the sampled run (docs/mutation.md, "sampled"): build's entries, its finish loop, the token axis --

def test_the_entries_of_a_one_block_model_are_block_0s_sub_blocks(table):
    from edgeprune.latency import build

    torch.manual_seed(0)
    one = find_anatomy(VisionTransformer(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=D, depth=1,
                                         num_heads=H, mlp_ratio=MLP / D).eval())
    t = LatencyTable.load(table)
    # parameters by hand: Q, K, V rows of 2 heads x (8 + 8 + 16) and the output projection from 2 x 16, with biases
    # and the norm's weight and bias; the MLP's two layers of width 32
    for kind, dims, params in (("attn", (2, 8, 16), D * 64 + 64 + 32 * D + D + 2 * D),
                               ("mlp", (32,), D * 32 + 32 + 32 * D + D + 2 * D)):
        mod, shape = build._entry_module(t, kind, dims, one, 3)
        assert shape == (3, N, D) and sum(p.numel() for p in mod.parameters()) == params
        with torch.no_grad():
            assert mod(torch.randn(shape)).shape == shape


def test_is_measured_per_kind_and_token_count():
    from edgeprune.latency import build
    from edgeprune.latency.token_axis import add_axis

    t = empty_table(dict(KEY), dict(RULES), GRID, TimingSettings(threads=1))
    add_axis(t, [9, 13])
    t.measured["mlp"].append(64)
    t.measured["attn"].append([2, 8, 16])
    t.measured["tokens_attn"].append(9)
    assert build._is_measured(t, "mlp", (64,)) and not build._is_measured(t, "mlp", (128,))
    assert build._is_measured(t, "attn", (2, 8, 16)) and not build._is_measured(t, "attn", (2, 16, 8))
    assert build._is_measured(t, "tokens_attn", (9,)) and not build._is_measured(t, "tokens_attn", (13,))
    assert not build._is_measured(t, "tokens_mlp", (9,)) and not build._is_measured(t, "model", ())


def test_an_interleaved_entry_is_timed_against_the_references_of_its_kind():
    from edgeprune.latency import build

    class Stop(Exception):
        pass

    class Refs:
        seen: list = []

        def measure(self, kind, module, shape):
            self.seen.append((kind, shape))
            raise Stop

    t = empty_table(dict(KEY), dict(RULES), GRID, TimingSettings(threads=1))
    an = find_anatomy(small_vit())
    for kind, dims in (("mlp", (64,)), ("attn", (2, 8, 16))):
        with pytest.raises(Stop):
            build._time_entry(t, kind, dims, an, None, TimingSettings(threads=1), 3, Refs())
    assert Refs.seen == [("mlp", (3, N, D)), ("attn", (3, N, D))]


@pytest.mark.parametrize("force", [False, True])
def test_finish_retimed_times_the_unmeasured_entries_again_and_keeps_out_only_when_forced_at_the_end(
        tmp_path, monkeypatch, force):
    from edgeprune.errors import RuntimeFault
    from edgeprune.latency import build

    t = empty_table(dict(KEY), dict(RULES), GRID, TimingSettings(threads=1))
    calls, timed = [], []

    def finish(t_, keep_disordered=False):
        calls.append(keep_disordered)
        if keep_disordered:
            return "kept out"
        raise RuntimeFault("the chain disagrees")

    monkeypatch.setattr(build, "finish", finish)
    monkeypatch.setattr(build, "_time_entry", lambda *a: timed.append(a))
    s = TimingSettings(threads=1)
    if force:
        assert build._finish_retimed(t, GRID, "AN", "TIMER", s, 3, "REFS", tmp_path / "t.json", True) == "kept out"
    else:
        with pytest.raises(RuntimeFault):
            build._finish_retimed(t, GRID, "AN", "TIMER", s, 3, "REFS", tmp_path / "t.json")
    assert calls == [False, False, force]
    every = build._entries(GRID)  # none measured: both retries time every entry again, with the build's settings
    assert timed == [(t, kind, dims, "AN", "TIMER", s, 3, "REFS") for kind, dims in every + every]


def test_build_table_hands_the_references_to_finish_and_prices_the_self_check_in_them(tmp_path, monkeypatch):
    import devices
    from edgeprune.latency import build
    from edgeprune.latency.measure import Sample

    seen = {}

    class Refs:
        def __init__(self, timer, anatomy, key, s, batch):
            seen["refs"] = self

        def measure(self, kind, model, image):
            seen["measured"] = (kind, image)
            return Sample(2.0, 0.0, 1)

        def close(self):
            seen["closed"] = True

    def finish_retimed(t, grid, anatomy, timer, s, batch, refs, out, force=False):
        seen["finish"] = (refs, out, force)
        t.meta["reference_ms"] = {"attn": 0.25, "mlp": 0.5}
        return t

    monkeypatch.setattr(build, "References", Refs)
    monkeypatch.setattr(build, "_time_entry", lambda *a: None)
    monkeypatch.setattr(build, "_finish_retimed", finish_retimed)
    monkeypatch.setattr(build.selfcheck, "run_check", lambda t, an, measure: measure("M"))
    monkeypatch.setattr(build, "conclude", lambda t, check, force, out: check)
    out = tmp_path / "t.json"
    opts = BuildOptions(threads=1, batch=3, warmup=0, iterations=1, repeats=1, interleave=True, force=True)
    got = build.build_table(find_anatomy(small_vit()), devices.load_profile("cpu"), opts, out, show_progress=False)
    assert seen["finish"] == (seen["refs"], out, True) and seen["closed"]
    assert seen["measured"] == ("model", (3, 3, 16, 16)) and got == pytest.approx(2.0 * 0.75)


def test_a_token_axis_round_trips_and_prices_a_merged_block(table):
    import json

    from edgeprune.latency.token_axis import add_axis

    t = LatencyTable.load(table)
    add_axis(t, [9, 13])
    del t.tokens["merge"]  # an axis without the merge step (tables before it): the merge priced at 0
    t.tokens["mlp"][:2], t.tokens["attn"][:2] = [0.5, 0.75], [0.4, 0.7]
    t.measured["tokens_mlp"], t.measured["tokens_attn"] = [9, 13], [9, 13]
    u = LatencyTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert u.tokens == {"counts": [9, 13, N], "mlp": [0.5, 0.75, 1.0], "attn": [0.4, 0.7, 1.0]}
    dims = {"mlp": 64, "heads": 2, "qk": 8, "v": 16}
    assert u.block_ms(dims, tokens=13) == pytest.approx(mlp_ms(64) * 0.75 + attn_ms(2, 8, 16) * 0.7, rel=1e-12)
    # the MLP of a merging block sees fewer tokens: 11 is halfway between 9 and 13
    assert u.block_ms(dims, tokens=13, mlp_tokens=11) == pytest.approx(
        mlp_ms(64) * 0.625 + attn_ms(2, 8, 16) * 0.7, rel=1e-12)
    assert u.block_ms(dims, tokens=N) == u.block_ms(dims)


# -- greedy_heads, the sampled run: the allocation's grid and record, the curve cache ---------------------------

def _mlp_latency_cfg(budget, round_to=32):
    from edgeprune.corp import CorpConfig

    return CorpConfig.from_target("mlp", None, last_block="full", budget=budget, round_to=round_to)


def test_allocate_builds_its_curves_on_the_tables_grid_and_records_the_dense_ms(table, monkeypatch):
    from edgeprune.allocation import greedy as G
    from edgeprune.allocation.curves import Curve
    from edgeprune.allocation.rules import unit_grid

    an = find_anatomy(small_vit())
    cfg = _mlp_latency_cfg(make_budget(latency=0.95, table=table))
    grids = []

    def curves_on(anatomy, stats, cfg_, qk_weight, grid):
        grids.append(grid)
        return [Curve(b, ("mlp",), [32, 64, 96, 128], [3.0, 1.0, 0.2, 0.0], 1.0, "c") for b in range(DEPTH)]

    monkeypatch.setattr(G, "build_curves", curves_on)
    dims, rep = G.allocate(an, None, cfg)
    table_grid = unit_grid(cfg, an, cfg.budget.cost_model(an))
    assert grids[0] is not None and grids[0].describe() == table_grid.describe()
    dense = 1.0 + DEPTH * (mlp_ms(MLP) + attn_ms(H, HD, HD))
    (name,) = [k for k, v in rep.items() if isinstance(v, dict) and "predicted" in v]
    assert rep[name]["dense"] == pytest.approx(dense, rel=1e-12)
    assert rep[name]["target"] == pytest.approx(0.95 * dense, rel=1e-12) and rep[name]["predicted"] <= rep[name]["target"]


def test_a_units_curve_is_computed_once_for_settings_that_differ_only_in_the_budget(table, monkeypatch):
    from types import SimpleNamespace

    from edgeprune.allocation import unit_curves as U
    from edgeprune.allocation.curves import Curve

    calls = []

    def compute(b, unit, stats, cfg, grid):
        calls.append(cfg)
        return Curve(b.index, (unit,), [32, 64], [1.0, 0.0], 1.0, "c")

    monkeypatch.setattr(U, "compute_curve", compute)
    stats, b, grid = SimpleNamespace(derived={}), SimpleNamespace(index=0), SimpleNamespace(describe=lambda: {"g": 1})
    for budget in ({"kind": "flops", "value": 0.5}, make_budget(latency=0.9, table=table), None):
        c = U.raw_curve(b, "mlp", stats, _mlp_latency_cfg(budget), grid)
        assert c.ks == [32, 64] and c.raw == [1.0, 0.0]
    assert len(calls) == 1
    U.raw_curve(b, "mlp", stats, _mlp_latency_cfg(None, round_to=8), grid)  # other settings: computed again
    assert len(calls) == 2


# -- latency_cost, the sampled run: merged token counts, the price memo, the self-check summary ------------------

def _axis_table(path, counts):
    """The :func:`table` fixture's table with a token axis at ``counts`` (of 9 and 13 tokens): the MLP's ratio
    0.5 / 0.75, the attention's 0.4 / 0.7."""
    from edgeprune.latency.token_axis import add_axis

    t = LatencyTable.load(write_latency_table(path, KEY, RULES, [1, 2, 3, 4], [8, 16], [0, 32, 64, 96, 128], attn_ms,
                                              mlp_ms, fixed_ms=1.0))
    add_axis(t, counts)
    del t.tokens["merge"]  # an axis without the merge step (tables before it): the merge priced at 0
    ratio = {9: (0.5, 0.4), 13: (0.75, 0.7)}
    for i, n in enumerate(counts):
        t.tokens["mlp"][i], t.tokens["attn"][i] = ratio[n]
    t.measured["tokens_mlp"], t.measured["tokens_attn"] = list(counts), list(counts)
    t.save(path)
    return str(path)


def _merging(path, r=4):
    import dataclasses

    return dataclasses.replace(make_budget(latency=0.5, table=path), tokens_merge=r)


def test_a_merging_budget_prices_each_block_at_its_token_counts(tmp_path, table):
    an = find_anatomy(small_vit())
    path = _axis_table(tmp_path / "axis.json", [9, 13])
    cost = LatencyCost(an, budget=_merging(path))
    # r = 4 per block: block 0's attention sees 17 tokens and its MLP 13, block 1's 13 and 9
    assert cost.tokens == [(N, 13), (13, 9)]
    dense = {"mlp": MLP, "heads": H, "qk": HD, "v": HD}
    assert cost.block_cost(an.blocks[0], dense) == pytest.approx(mlp_ms(MLP) * 0.75 + attn_ms(H, HD, HD), rel=1e-12)
    assert cost.block_cost(an.blocks[1], dense) == pytest.approx(mlp_ms(MLP) * 0.5 + attn_ms(H, HD, HD) * 0.7,
                                                                 rel=1e-12)
    assert LatencyCost(an, budget=make_budget(latency=0.5, table=path)).tokens is None  # no schedule: no merging
    assert LatencyCost(an, budget=_merging(path, r=0)).tokens is None
    short = _axis_table(tmp_path / "short.json", [13])
    with pytest.raises(UserError, match=r"has a token axis from 13 tokens, the merged blocks run at 9\.\.13 tokens"):
        LatencyCost(an, budget=_merging(short))
    with pytest.raises(UserError, match=r"has no token axis, the merged blocks run at 9\.\.13 tokens"):
        LatencyCost(an, budget=_merging(table))


def test_a_model_without_num_prefix_tokens_is_priced_under_a_merging_budget(tmp_path):
    vit = small_vit()
    del vit.num_prefix_tokens
    an = find_anatomy(vit)
    cost = LatencyCost(an, budget=_merging(_axis_table(tmp_path / "axis.json", [9, 13])))
    assert cost.tokens == [(N, 13), (13, 9)]


def test_block_prices_are_remembered_per_block_and_dims(table, monkeypatch):
    an = find_anatomy(small_vit())
    cost = LatencyCost(an, budget=make_budget(latency=0.5, table=table))
    calls, real = [], cost._block_cost
    monkeypatch.setattr(cost, "_block_cost", lambda b, dims: calls.append(b.index) or real(b, dims))
    d = {"mlp": 64, "heads": 2, "qk": 8, "v": 16}
    a = cost.block_cost(an.blocks[0], d)
    assert cost.block_cost(an.blocks[0], dict(reversed(d.items()))) == a == mlp_ms(64) + attn_ms(2, 8, 16)
    assert cost.block_cost(an.blocks[1], d) == a and calls == [0, 1]


def test_the_self_check_summary_says_whether_the_table_was_forced(table):
    from edgeprune.budget.latency import _check_summary

    t = LatencyTable.load(table)
    assert _check_summary(t) is None
    models = [{"name": "a", "predicted_ms": 1.0, "measured_ms": 1.2, "spread": 3}]
    t.meta["self_check"] = {"passed": False, "forced": True, "tolerance": 0.1, "models": models}
    assert _check_summary(t) == {"passed": False, "forced": True, "tolerance": 0.1,
                                 "models": [{"name": "a", "predicted_ms": 1.0, "measured_ms": 1.2}]}
    del t.meta["self_check"]["forced"]
    assert _check_summary(t)["forced"] is False


# -- derive_latency, the sampled run: the rho grid's ends -----------------------------------------------------------

def test_the_rho_grid_is_one_then_the_levels_then_zero():
    from types import SimpleNamespace

    from edgeprune.nuwa.budget import rho_candidates

    # equal singular values: rank k of d keeps k / d of the energy; the levels are the multiples of 8 below full rank
    f = SimpleNamespace(qk_s=torch.ones(2, 16), vo_s=torch.ones(2, 24))
    assert rho_candidates([f]) == [1.0, round(2 / 3, 12), 0.5, round(1 / 3, 12), 0.0]
    assert rho_candidates([f], n=2) == [1.0, round(2 / 3, 12), round(1 / 3, 12), 0.0]


# -- latency_loop, the sampled run: the measurer's one dense export, a flat secant, a record without allocation ----

def test_table_measurer_exports_each_dense_model_once_and_times_at_the_tables_batch(table, monkeypatch):
    import edgeprune.budget.correction_loop as L

    exports, pairs = [], []

    def export(model, path, shape, dynamic_batch, batch_size):
        exports.append((model, shape, dynamic_batch, batch_size))
        return f"dense{len(exports)}.onnx"

    def pair(dense, pruned, key, shape, iterations, warmup, dense_onnx, settle, band=None):
        pairs.append((dense, pruned, key["backend"], shape, iterations, warmup, dense_onnx, settle))
        return {"ratio": 0.5}

    monkeypatch.setattr(L, "why_not_measured", lambda key: None)  # as if the hand-made table were from here
    monkeypatch.setattr(L, "export_onnx", export)
    monkeypatch.setattr(L, "measure_pair", pair)
    measure, reason = L.table_measurer(make_budget(latency=0.5, table=table), find_anatomy(small_vit()))
    assert reason is None
    d1, d2, p = torch.nn.Identity(), torch.nn.Identity(), torch.nn.Identity()
    assert measure(d1, p) == measure(d1, p) == measure(d2, p) == {"ratio": 0.5}
    shape = (3, 16, 16)
    assert exports == [(d1, shape, False, 8), (d2, shape, False, 8)]  # the table's batch (KEY["batch"])
    assert L.SETTLE == 0.02
    # (at most 20 pairs, settled at 2%, and 3 warm-up runs; round 0's export reused until the dense model changes)
    assert pairs == [(d, p, "onnxruntime", shape, 20, 3, f, L.SETTLE) for d, f in
                     ((d1, "dense1.onnx"), (d1, "dense1.onnx"), (d2, "dense2.onnx"))]


def test_a_flat_secant_falls_back_to_the_ratio():
    from edgeprune.budget.correction_loop import next_value

    # the same predicted value measured twice differently: no slope, so p * target / m
    assert next_value([(0.5, 0.6), (0.5, 0.55)], 0.5) == 0.5 * 0.5 / 0.55


def test_not_measured_leaves_a_record_without_an_allocation_alone(table):
    from edgeprune.budget.budget import Budget
    from edgeprune.budget.correction_loop import not_measured

    bare = {"model": "x"}
    not_measured(bare, Budget("latency", 0.5, None, table), "no backend here")
    assert bare == {"model": "x"}


def test_a_merging_schedule_needs_a_token_axis_and_the_refusal_suggests_counts(tmp_path, table):
    an = find_anatomy(small_vit())
    path = _axis_table(tmp_path / "short.json", [13])
    LatencyCost.check_tokens_merge(_merging(path))  # an axis: the counts are checked with the model
    with pytest.raises(UserError, match=r"latency table .* has no token axis \(it timed blocks at 17 tokens only\)"):
        LatencyCost.check_tokens_merge(_merging(table))
    # merged blocks at 9..13 tokens of 17: four counts evenly spaced from 9, 9 + 8 i // 4
    with pytest.raises(UserError, match=r"--tokens 9,11,13,15\)$"):
        LatencyCost(an, budget=_merging(path))


def test_token_counts_of_the_option_text():
    from edgeprune.latency.grid import parse_token_counts

    assert parse_token_counts(None) == parse_token_counts("") == parse_token_counts("  ") == []
    assert parse_token_counts(" 150, 100,50") == [150, 100, 50]
    with pytest.raises(UserError, match=r"^--tokens: 'x' is not an integer"):
        parse_token_counts("9,x")


def test_a_document_of_another_format_is_refused_as_a_latency_table():
    for doc in ({"format": "something else"}, [1, 2]):
        with pytest.raises(UserError, match=r'^latency table is not an edgeprune latency table \(expected "format": '):
            LatencyTable.from_dict(doc)


# -- greedy_heads, the seed-2 sample: each unit's candidate sizes -------------------------------------------------

def test_compute_curve_gives_each_unit_its_candidate_sizes(monkeypatch):
    from types import SimpleNamespace

    from edgeprune.allocation import unit_curves as U
    from edgeprune.allocation.rules import Grid

    got = []
    monkeypatch.setattr(U, "qk_curve", lambda b, st, cfg, ks: got.append(("qk", st, ks)))
    monkeypatch.setattr(U, "v_curve", lambda b, st, cfg, ks: got.append(("v", st, ks)))
    stats, b = SimpleNamespace(qk=["QK"], vo=["VO"]), SimpleNamespace(index=0, qk_dim=16, v_dim=24)
    rounding = {"mlp": 8, "qk": 8, "v": 8, "heads": 1}
    grid = Grid(rounding, {"v": 16}, None)
    for unit in ("v", "qk", "qk+v:qk", "qk+v:v"):
        U.compute_curve(b, unit, stats, None, grid)
    # V: multiples of 8 up to its 24, none below its bound 16; Q/K: up to 16, no bound; fused: up to min(16, 24),
    # none below V's bound
    assert got == [("v", "VO", [16, 24]), ("qk", "QK", [8, 16]), ("qk", "QK", [16]), ("v", "VO", [16])]
    got.clear()
    U.compute_curve(b, "qk+v:v", stats, None, Grid(rounding, {"v": 32}, None))  # a bound above all: all kept
    assert got == [("v", "VO", [8, 16])]


def test_the_record_of_a_merging_cost_model_lists_each_blocks_token_counts(tmp_path):
    an = find_anatomy(small_vit())
    path = _axis_table(tmp_path / "axis.json", [9, 13])
    assert LatencyCost(an, budget=_merging(path)).record()["tokens"] == [[N, 13], [13, 9]]
    assert "tokens" not in LatencyCost(an, budget=make_budget(latency=0.5, table=path)).record()


def test_the_correction_record_states_its_rule():
    _, rec = _correct(_Device(factor=0.8), 0.5)
    assert rec["latency_check"]["rule"] == ("the round whose measured value is closest to the budget "
                                            "(edgeprune.budget.correction_loop)")
