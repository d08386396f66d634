"""``edgeprune derive --latency`` (issue 30, Build item 2 "on prune (and derive)"): NuWa's MLP fill by
search under a measured latency table, the table's rules in derive, the record, CLI and API errors.

Every table is hand-made through the ``LatencyTable`` constructor (no timing) for the shape of
``tests.test_nuwa._tiny`` (width 32, 2 blocks, 2 heads of 16, MLP 128, 17 tokens).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import load_run
from edgeprune.budget import Budget
from edgeprune.errors import UserError
from edgeprune.latency.table import LatencyTable
from edgeprune.nuwa import budget as budget_mod
from edgeprune.nuwa.derive import DeriveConfig, derive, derive_from, prepare
from edgeprune.nuwa.ofp_mha import layer_dims, model_factors
from edgeprune.nuwa.ofp_mlp import uniform_mlp_dims
from edgeprune.nuwa.skp import SKPConfig
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli
from tests.test_nuwa import _data, _tiny

RULES = {"mlp_round_to": 16, "head_dim_round_to": 4, "qk_equals_v": False}


def bumpy(w: int) -> float:
    """Not linear, not monotone: cheap at multiples of 64, and 96 costs more than 112."""
    return 0.05 + 0.004 * (math.ceil(w / 64) * 64) + (0.08 if w == 96 else 0.0)


def tiny_table(path, *, mlp=bumpy, dim_ms=0.002, rules=None, shape=None):
    """A table of ``_tiny``'s shape (or ``shape``'s): MLP sub-block ``mlp(width)`` ms at 9 widths
    (0 .. mlp_hidden), attention ``0.05 + heads x dim_ms x (qk + v)`` ms at head dims d/4 .. d,
    fixed 0.2 ms (batch 8). Saved at ``path``; returns it."""
    key = {"embed_dim": 32, "depth": 2, "num_heads": 2, "head_dim": 16, "mlp_hidden": 128, "tokens": 17,
           "batch": 8, "precision": "fp32", "backend": "onnxruntime", "backend_version": "0",
           "device_name": "hand-made", "profile": "cpu", "threads": 1, **(shape or {})}
    widths = list(range(0, key["mlp_hidden"] + 1, key["mlp_hidden"] // 8))
    dims = [key["head_dim"] * i // 4 for i in range(1, 5)]
    heads = list(range(1, key["num_heads"] + 1))
    ms = [[[0.05 + h * dim_ms * (q + v) for v in dims] for q in dims] for h in heads]
    t = LatencyTable(key=key, rules=rules or dict(RULES), mlp={"widths": widths, "ms": [mlp(w) for w in widths]},
                     attn={"heads": heads, "qk": dims, "v": dims, "ms": ms}, fixed_ms=0.2, dense_model_ms=0.0,
                     measured={"mlp": widths, "attn": [[h, q, v] for h in heads for q in dims for v in dims]})
    t.dense_model_ms = t.dense_ms()
    t.save(path)
    return str(path)


def predicted_ms(table_path: str, model) -> float:
    """The table's prediction for ``model`` at its own dims, computed here (not by the code under test)."""
    t = LatencyTable.load(table_path)
    return t.fixed_ms + sum(t.block_ms({"heads": b.num_heads, "qk": b.qk_dim, "v": b.v_dim, "mlp": b.mlp_hidden})
                            for b in find_anatomy(model).blocks)


@pytest.fixture(scope="module")
def prep():
    torch.set_num_threads(1)
    model = _tiny(21)
    x, y = _data(60, classes=(0, 2, 4), seed=22)
    cfg = DeriveConfig(skp=SKPConfig(steps=0), val_size=12, calib_size=24, cache=False)
    return prepare(model, [0, 2, 4], x, y, config=cfg)


def test_plan_within_budget_maximal_and_monotone(prep, tmp_path):
    """Every candidate's MLPs are the largest water-filling level whose predicted latency fits (the
    next level does not, unless at the caps; the table is bumpy so a closed form would miss); the
    chosen plan's predicted latency is <= the budget, and a lower budget never predicts higher."""
    table = tiny_table(tmp_path / "t.json")
    dense = LatencyTable.load(table).dense_ms()
    caps = budget_mod.mlp_caps([len(k) for k in prep.anchor.keep], 16)
    last = math.inf
    for frac in (0.95, 0.85, 0.75, 0.65, 0.6):
        res = derive_from(prep, latency=frac, latency_table=table)
        got = predicted_ms(table, res.model)
        rec = res.record["derivation"]["budget"]
        assert got <= frac * dense + 1e-12 and got == pytest.approx(rec["latency"]["predicted"], abs=1e-12)
        assert got <= last + 1e-12
        last = got
        t = LatencyTable.load(table)
        for c in res.record["derivation"]["candidates"]:
            def cost(mlp, c=c):
                return t.fixed_ms + sum(t.block_ms({"heads": 2, "qk": q, "v": v, "mlp": m})
                                        for q, v, m in zip(c["qk"], c["vo"], mlp))
            assert cost(c["mlp"]) <= frac * dense + 1e-12
            # no larger level fits (linear scan in the test too: the table is not monotone)
            units = sum(c["mlp"]) // 16
            for u in range(units + 1, sum(caps) // 16 + 1):
                assert cost(uniform_mlp_dims(caps, u * 16, 16)) > frac * dense, (frac, c["mlp"], u)


def test_table_rules_and_record(prep, tmp_path):
    """MLP widths on mlp_round_to, head dims on head_dim_round_to, Q/K = V under qk_equals_v; the
    record says kind, table key, rules, predicted / target / dense ms; ``12ms``-style absolute
    budgets equal the same fraction."""
    rules = {"mlp_round_to": 32, "head_dim_round_to": 8, "qk_equals_v": True}
    table = tiny_table(tmp_path / "t.json", rules=rules)
    t = LatencyTable.load(table)
    res = derive_from(prep, latency=0.7, latency_table=table)
    for b in res.record["blocks"]:
        assert b["mlp_hidden"] % 32 == 0 and b["qk_dim"] % 8 == 0 and b["qk_dim"] == b["v_dim"]
    for c in res.record["derivation"]["candidates"]:
        assert c["qk"] == c["vo"] and all(m % 32 == 0 for m in c["mlp"])
    b = res.record["derivation"]["budget"]
    lat = b["latency"]
    assert b["metric"] == "latency" and b["table"] == table and lat["key"] == t.key and lat["rules"] == rules
    assert lat["round_to"] == {"mlp": 32, "qk": 8, "v": 8} and lat["dense"] == pytest.approx(t.dense_ms())
    assert lat["target"] == pytest.approx(0.7 * t.dense_ms()) and lat["predicted"] <= lat["target"]
    assert b["achieved_fraction"] == pytest.approx(lat["predicted"] / t.dense_ms())
    absolute = derive_from(prep, latency=f"{0.7 * t.dense_ms()!r}ms", latency_table=table)
    assert absolute.record["blocks"] == res.record["blocks"]
    assert absolute.record["derivation"]["budget"]["unit"] == "ms"


def test_expensive_mlp_keeps_fewer_neurons(prep, tmp_path):
    """Two tables with the same attention prices, MLP width expensive in one and cheap in the other.

    * Same fraction (0.6), rho 0 (the attention cut to its smallest dims, which frees more than the
      rest of the 40% cut costs at these prices): the expensive-MLP table keeps fewer neurons.
      (Not a law at a fraction: with the attention kept dense the whole cut falls on the MLPs, and
      an expensive MLP, being most of the dense latency, then loses a smaller share of its width.
      Derive picks attention dims by retained energy and accuracy, not by price.)
    * Same absolute budget (1.7ms): every pair of searched candidates with the same attention dims
      keeps fewer neurons under the expensive table.
    """
    expensive = tiny_table(tmp_path / "e.json", mlp=lambda w: 0.05 + 0.01 * w, dim_ms=0.01)
    cheap = tiny_table(tmp_path / "c.json", mlp=lambda w: 0.05 + 0.0005 * w, dim_ms=0.01)
    tables = (("expensive", expensive), ("cheap", cheap))
    fixed = dataclasses.replace(prep, config=dataclasses.replace(prep.config, rho=0.0))
    kept = {name: sum(b["mlp_hidden"] for b in derive_from(fixed, latency=0.6, latency_table=t).record["blocks"])
            for name, t in tables}
    assert kept["expensive"] < kept["cheap"], kept
    cands = {name: {(tuple(c["qk"]), tuple(c["vo"])): sum(c["mlp"])
                    for c in derive_from(prep, latency="1.7ms", latency_table=t).record["derivation"]["candidates"]}
             for name, t in tables}
    common = set(cands["expensive"]) & set(cands["cheap"])
    assert common
    assert all(cands["expensive"][k] < cands["cheap"][k] for k in common), cands


def test_qk_equals_v_takes_the_larger_dim(tmp_path):
    """Under qk_equals_v a layer's Q/K and V dims are both the larger of its two OFP dims (on a model
    whose Q/K spectrum is steeper than its V/O spectrum, so the two differ without the rule)."""
    model = _tiny(26)
    with torch.no_grad():
        for blk in model.blocks:  # Q rows 8..15 of each head nearly zero: Q/K energy in 8 dims
            for h in range(2):
                blk.attn.qkv.weight[h * 16 + 8:h * 16 + 16] *= 0.01
    factors = model_factors(find_anatomy(model))
    rules = {"mlp_round_to": 16, "head_dim_round_to": 4, "qk_equals_v": True}
    table = tiny_table(tmp_path / "t.json", rules=rules)
    cost = budget_mod.PlanCost(find_anatomy(model), Budget("latency", 0.8, table=table))
    grid = budget_mod.dim_grid(cost)
    assert grid.qk_equals_v and grid.head_dim == 4 and grid.mlp == 16
    differ = 0
    for rho in budget_mod.rho_candidates(factors, round_to=4):
        qk, vo = layer_dims(factors, rho, 4)
        differ += qk != vo
        assert budget_mod.attention_dims(factors, rho, grid) == ([max(q, v) for q, v in zip(qk, vo)],) * 2
    assert differ  # the rule had something to do
    x, y = _data(40, classes=(0, 1), seed=27)
    res = derive(model, [0, 1], x, y, latency=0.8, latency_table=table,
                 config=DeriveConfig(skp=SKPConfig(steps=0), val_size=8, calib_size=16, cache=False))
    assert all(b["qk_dim"] == b["v_dim"] for b in res.record["blocks"])
    assert res.record["derivation"]["budget"]["latency"]["predicted"] <= 0.8 * LatencyTable.load(table).dense_ms()


def test_search_equals_closed_form_on_flops():
    """On a cost affine in the MLP width (FLOPs, params) the search fill finds exactly the closed
    form's plans: the two code paths agree, and FLOPs / params keep the closed form."""
    model = _tiny(23)
    an = find_anatomy(model)
    factors = model_factors(an)
    for kind in ("flops", "params"):
        dense = budget_mod.measure(model, Budget(kind, 0.5))
        assert budget_mod.PlanCost(an, Budget(kind, 0.5)).linear
        for frac in (0.9, 0.6, 0.45):
            target = budget_mod.budget_target(Budget(kind, frac), dense)
            caps = budget_mod.mlp_caps([128, 104])
            closed = budget_mod.plan_candidates(budget_mod.PlanCost(an, Budget(kind, frac)), factors, caps, target)
            search = budget_mod.PlanCost(an, Budget(kind, frac))
            search.linear = False
            assert [p.to_record() for p in budget_mod.plan_candidates(search, factors, caps, target)] == \
                [p.to_record() for p in closed]


def test_impossible_budget_and_api_errors(tmp_path):
    """One-line UserErrors from the Python API, before any SKP step."""
    model = _tiny(24)
    x, y = _data(30, classes=(0, 1), seed=25)
    cfg = DeriveConfig(skp=SKPConfig(steps=5), val_size=5, calib_size=8, cache=False)
    table = tiny_table(tmp_path / "t.json")
    other = tiny_table(tmp_path / "o.json", shape={"embed_dim": 64})
    cases = [({"latency": 0.1, "latency_table": table}, "cannot be met with the latency table's grid"),
             ({"latency": 0.5}, "edgeprune latency-table"),
             ({"latency": "12", "latency_table": table}, "ambiguous"),
             ({"latency": 0.5, "latency_table": table, "flops": 0.5}, "not both"),
             ({"flops": 0.5, "latency_table": table}, "goes with"),
             ({"latency": 0.5, "latency_table": str(tmp_path / "missing.json")}, "not found"),
             ({"latency": 0.5, "latency_table": other}, "embed_dim = 64")]
    for kw, msg in cases:
        with pytest.raises(UserError, match=msg) as err:
            derive(model, [0, 1], x, y, config=cfg, **kw)
        assert "\n" not in str(err.value)


def test_cli_latency_errors(tmp_path):
    """The prune CLI's parsing and one-line errors, exit 2."""
    table = tiny_table(tmp_path / "t.json")
    out = ["-o", str(tmp_path / "d"), "--quiet"]
    cases = [(["--latency", "0.5"], "edgeprune latency-table"),
             (["--latency", "12", "--latency-table", table], "ambiguous"),
             (["--latency", "0.5", "--flops", "0.5", "--latency-table", table], "not both"),
             (["--flops", "0.5", "--latency-table", table], "goes with"),
             (["--latency", "0.5", "--latency-table", str(tmp_path / "missing.json")], "not found"),
             (["--latency", "fast", "--latency-table", table], "must be a fraction"),
             (["--latency", "0.5", "--latency-table", table], "latency table is for")]  # fmnist-vit's shape
    for args, msg in cases:
        assert_one_line_error(run_cli(["derive", "--classes", "0,1", *args, *out]), msg)
    help_text = run_cli(["derive", "--help"]).stdout
    assert "--latency-table" in help_text and "--latency " in help_text


@needs_fmnist
def test_cli_derive_latency_end_to_end(tmp_path):
    """``edgeprune derive --latency 0.7 --latency-table`` on fmnist-vit with a GPU-like table (wide
    MLP grid, Q/K = V): saved run, the record's latency entry, the printed prediction."""
    shape = {"embed_dim": 128, "depth": 6, "num_heads": 2, "head_dim": 64, "mlp_hidden": 512, "tokens": 49}
    rules = {"mlp_round_to": 64, "head_dim_round_to": 16, "qk_equals_v": True}
    table = tiny_table(tmp_path / "f.json", shape=shape, rules=rules)
    out = tmp_path / "run"
    res = run_cli(["derive", "--classes", "0,Bag", "--latency", "0.7", "--latency-table", table, "--skp-steps", "0",
                   "--train-per-class", "30", "--val-size", "12", "--calib-size", "16", "--no-eval", "-o", str(out),
                   "--quiet"])
    assert res.exit_code == 0, res.output
    assert "latency: predicted" in res.stdout and "saved" in res.stdout
    rec = json.loads((out / "run.json").read_text())
    lat = rec["derivation"]["budget"]["latency"]
    assert lat["target"] == pytest.approx(0.7 * LatencyTable.load(table).dense_ms())
    assert lat["predicted"] <= lat["target"] and lat["rules"] == rules
    for b in rec["blocks"]:
        assert b["mlp_hidden"] % 64 == 0 and b["qk_dim"] == b["v_dim"] and b["qk_dim"] % 16 == 0
    model, _ = load_run(out)
    assert predicted_ms(table, model) == pytest.approx(lat["predicted"])
