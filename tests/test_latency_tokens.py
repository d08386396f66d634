"""The latency table's token axis (issue 44 item 3): ``latency-table --tokens``, blocks priced at their merged token
counts, ``prune --latency`` with ``--tokens-merge``. Tables are hand-made (no timing) or built by a fake backend whose
sub-block time is a known function of the token count."""

from __future__ import annotations

import json

import pytest
import torch

import edgeprune
from edgeprune.allocation import greedy
from edgeprune.anatomy import find_anatomy
from edgeprune.api import corp_config
from edgeprune.calibration.collect import collect_statistics
from edgeprune.errors import UserError
from edgeprune.flops import block_tokens
from edgeprune.latency.grid import check_token_counts, parse_token_counts
from edgeprune.latency.table import LatencyTable
from edgeprune.pruning.corp import check_prunable, statistics_request
from tests.conftest import assert_one_line_error, run_cli
from tests.test_latency_budget import make_table, small_vit

#: the token axis of the hand tables: small_vit has 17 tokens (1 class token)
COUNTS, MLP_F, ATTN_F = [5, 9, 13, 17], [0.3, 0.5, 0.75, 1.0], [0.2, 0.45, 0.7, 1.0]


def with_axis(path, counts=COUNTS, mlp=MLP_F, attn=ATTN_F, **kw) -> str:
    """A :func:`make_table` table with a token axis added (ratios ``mlp`` / ``attn`` at ``counts``)."""
    make_table(path, **kw)
    d = json.loads(path.read_text())
    d["tokens"] = {"counts": counts, "mlp": mlp, "attn": attn}
    path.write_text(json.dumps(d))
    return str(path)


def test_a_table_with_an_axis_predicts_a_block_at_its_token_count(tmp_path):
    t = LatencyTable.load(with_axis(tmp_path / "t.json", head_ms=0.1, dim_ms=0.01, mlp_ms=0.01))
    dims = {"heads": 3, "qk": 16, "v": 8, "mlp": 64}
    mlp, attn = t.mlp_ms(64), t.attn_ms(3, 16, 8)
    assert t.block_ms(dims, 13, 9) == pytest.approx(mlp * 0.5 + attn * 0.7)  # counts on the axis
    assert t.block_ms(dims, 11, 11) == pytest.approx(mlp * 0.625 + attn * 0.575)  # halfway between 9 and 13
    assert t.block_ms(dims, 17, 17) == t.block_ms(dims)  # the full count: the grid's own entry
    assert t.block_total(dims, 9, 5) < t.block_total(dims, 13, 13) < t.block_total(dims)
    with pytest.raises(UserError, match=r"tokens = 4 is outside the table's measured range \(5..17\)"):
        t.block_ms(dims, 4, 4)


def test_a_table_without_the_axis_loads_and_prices_as_before(tmp_path):
    path = make_table(tmp_path / "t.json", head_ms=0.1, dim_ms=0.01, mlp_ms=0.01)
    t = LatencyTable.load(path)
    assert t.tokens is None and "tokens" not in t.to_dict()
    t.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == json.loads((tmp_path / "t.json").read_text())
    dims = {"heads": 2, "qk": 8, "v": 16, "mlp": 96}
    assert t.block_total(dims) == t.mlp_ms(96) + t.attn_ms(2, 8, 16)
    with pytest.raises(UserError, match="no token axis"):
        t.block_ms(dims, 13, 13)
    an = find_anatomy(small_vit())
    cfg = corp_config("all", latency=0.5, latency_table=path, last_block="full")
    cost = cfg.budget.cost_model(an)
    assert cost.tokens is None and cost.block_cost(an.blocks[0], dims) == t.block_total(dims)


def test_the_axis_round_trips_and_a_damaged_one_is_refused(tmp_path):
    path = with_axis(tmp_path / "t.json", head_ms=0.1)
    t = LatencyTable.load(path)
    t.save(tmp_path / "b.json")
    assert LatencyTable.load(tmp_path / "b.json").tokens == t.tokens
    for field, value, msg in (("counts", [5, 9, 13, 16], "must end at the model's key.tokens = 17"),
                              ("mlp", [0.3, 0.5, 1.0], "one ratio per count"),
                              ("attn", [0.2, 0.45, 0.7, 0.9], "must be 1"),
                              ("counts", [9, 5, 13, 17], "tokens.counts"),
                              ("merge", [0.5, 0.7, 1.2], "tokens.merge.*one ratio per count"),
                              ("merge", [0.5, 0.7, -1.0, 1.3], r"tokens.merge\[2\]")):
        d = json.loads((tmp_path / "t.json").read_text())
        d["tokens"][field] = value
        (tmp_path / "bad.json").write_text(json.dumps(d))
        with pytest.raises(UserError, match=msg) as err:
            LatencyTable.load(tmp_path / "bad.json")
        assert "\n" not in str(err.value)


def test_fewer_tokens_cost_less_and_the_known_answer(tmp_path):
    path = with_axis(tmp_path / "t.json", head_ms=0.1, dim_ms=0.01, mlp_ms=0.01)
    an = find_anatomy(small_vit())
    t = LatencyTable.load(path)
    dims = {"heads": 4, "qk": 16, "v": 16, "mlp": 128}
    costs = []
    for r in (0, 2, 4):
        cfg = corp_config("all", latency=0.5, latency_table=path, last_block="full", tokens_merge=r)
        costs.append([cfg.budget.cost_model(an).block_cost(b, dims) for b in an.blocks])
    assert costs[0] == [t.block_total(dims)] * 2
    # r = 4: block 0 receives 17 tokens, its MLP 13; block 1 receives 13, its MLP 9
    assert costs[2][0] == pytest.approx(t.mlp_ms(128) * 0.75 + t.attn_ms(4, 16, 16))
    assert costs[2][1] == pytest.approx(t.mlp_ms(128) * 0.5 + t.attn_ms(4, 16, 16) * 0.7)
    for i in range(2):
        assert costs[2][i] < costs[1][i] < costs[0][i]


@pytest.fixture(scope="module")
def stats():
    model = small_vit()
    x = torch.randn(48, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    an = find_anatomy(model)
    cfg = corp_config("all", flops=0.5, last_block="full")
    return an, collect_statistics(an, [x[:24], x[24:]], statistics_request(cfg, an, 48, qk_grams=True),
                                  progress=False)


def test_the_allocator_keeps_more_width_with_the_merge_at_the_same_budget(stats, tmp_path):
    an, st = stats
    path = with_axis(tmp_path / "t.json", head_ms=0.1, dim_ms=0.01, mlp_ms=0.01)
    kept = {}
    for r in (0, 4):
        cfg = corp_config("all", latency=0.6, latency_table=path, last_block="full", tokens_merge=r)
        check_prunable(an, cfg)
        dims, rep = greedy.allocate(an, st, cfg)
        lat = rep["latency"]
        assert lat["predicted"] <= lat["target"] * (1 + 1e-9)  # the budget met, at the merged token counts
        kept[r] = sum(d["mlp"] + d["heads"] * (d["qk"] + d["v"]) for d in dims)
    assert kept[4] > kept[0], kept


def test_prune_latency_with_tokens_merge_meets_the_predicted_budget(tmp_path):
    path = with_axis(tmp_path / "t.json", head_ms=0.1, dim_ms=0.01, mlp_ms=0.01)
    x = torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    runs = {}
    for r in (0, 4):
        res = edgeprune.prune(small_vit(), x, target="all", sparsity=None, latency=0.6, latency_table=path,
                              last_block="full", verify_budget=False, tokens_merge=r)
        model, rec = res.model, res.record
        lat = rec["allocation"]["latency"]
        assert lat["predicted"] <= lat["target"] * (1 + 1e-9)
        runs[r] = (find_anatomy(model), rec)
    an4, rec4 = runs[4]
    assert rec4["tokens_merge"]["tokens"] == [17, 13]
    # the merged model's blocks at the token counts its anatomy says (merge_r), priced by the table: the prediction
    t = LatencyTable.load(path)
    assert [(n, n - b.merge_r) for n, b in zip(block_tokens(an4), an4.blocks)] == [(17, 13), (13, 9)]
    blocks = [t.block_total({"heads": b.num_heads, "qk": b.qk_dim, "v": b.v_dim, "mlp": b.mlp_hidden}, n, n - b.merge_r)
              for n, b in zip(block_tokens(an4), an4.blocks)]
    assert t.fixed_ms + sum(blocks) == pytest.approx(rec4["allocation"]["latency"]["predicted"])
    widths = {r: sum(b.mlp_hidden + b.num_heads * (b.qk_dim + b.v_dim) for b in a.blocks) for r, (a, _) in runs.items()}
    assert widths[4] > widths[0], widths


def test_refusals_in_one_line(tmp_path):
    bare = make_table(tmp_path / "bare.json", head_ms=0.1)
    short = with_axis(tmp_path / "short.json", counts=[13, 17], mlp=[0.7, 1.0], attn=[0.6, 1.0], head_ms=0.1)
    calls = []

    def calib():
        calls.append(1)
        yield torch.randn(4, 3, 16, 16)

    for table, msg in ((bare, "has no token axis"), (short, "a token axis from 13 tokens, the merged blocks run at 9..13")):
        with pytest.raises(UserError, match=msg) as err:
            edgeprune.prune(small_vit(), calib, target="all", sparsity=None, latency=0.6, latency_table=table,
                            last_block="full", tokens_merge=4)
        assert "\n" not in str(err.value) and table in str(err.value)
    assert not calls  # before the calibration pass
    r = run_cli(["prune", "--latency", "0.5", "--latency-table", bare, "--tokens-merge", "2", "--no-eval",
                 "-o", str(tmp_path / "run")])
    assert_one_line_error(r, "has no token axis")
    r = run_cli(["deploy", "--device", "cpu", "--latency", "0.5", "--latency-table", bare, "--tokens-merge", "2",
                 "-o", str(tmp_path / "dep")])
    assert_one_line_error(r, "has no token axis")
    assert not (tmp_path / "dep").exists()


@pytest.mark.parametrize("value, msg, cli", [("9,x", "'x' is not an integer", "9,x"),
                                             ("1,9", "1 is outside 2..17", "0,9"), ("18", "18 is outside 2..17", "50"),
                                             ("9,5,9", "9 is given twice", "9,5,9"), ("0", "0 is outside", "0")])
def test_bad_tokens_values(value, msg, cli, tmp_path):
    """In one line, before any timing (fmnist-vit: 49 tokens, no prefix token)."""
    with pytest.raises(UserError, match=msg):
        check_token_counts(parse_token_counts(value), 17, 1)
    r = run_cli(["latency-table", "--model", "fmnist-vit", "--random-init", "--tokens", cli, "-o",
                 str(tmp_path / "t.json")])
    assert_one_line_error(r, "--tokens")
    assert not (tmp_path / "t.json").exists()
    assert check_token_counts([5, 17, 9], 17, 1) == [5, 9]


#: what the fake backend's merge step costs beyond the attention (ms, any count)
MERGE_MS = 0.5


def _token_timer():
    """A fake backend (tests/test_latency_table.py's machine) whose sub-blocks cost ``n / 5`` of their full-count
    time at n tokens (the models there have 5 tokens), and a merging attention sub-block that plus
    :data:`MERGE_MS`."""
    from edgeprune.latency.measure import AttnSubBlock, MlpSubBlock, Timer, list_timers, register_timer
    from edgeprune.latency.token_axis import MergeAttnSubBlock
    from edgeprune.tokens.model import TokenMergeBlock
    from tests.test_latency_table import _Counting, _Fixed, _attn_cost, _cost, _mlp_cost

    if "fake-tokens" in list_timers():
        return

    @register_timer("fake-tokens")
    class TokenTimer(Timer):
        def version(self) -> str:
            return "1"

        def device_name(self, s) -> str:
            return "fake-device"

        def open(self, module, x, s, workdir):
            merging = [b for b in getattr(getattr(module, "blocks", None), "__iter__", lambda: [])()
                       if isinstance(b, TokenMergeBlock)]
            if merging:  # the self-check's merged model: each block at its tokens, a merge costs MERGE_MS more
                ms = _Counting.outside + _Counting.call
                for b in module.blocks:
                    n = getattr(b, "tokens", 5)
                    nm = n - getattr(b, "r", 0)
                    a = b.attn
                    ms += (_attn_cost(a.num_heads, getattr(a, "qk_dim", a.head_dim), getattr(a, "v_dim", a.head_dim))
                           * n / 5
                           + _mlp_cost(b.mlp.fc1.out_features) * nm / 5 + (MERGE_MS if nm < n else 0.0))
                return _Fixed(ms), x
            if isinstance(module, MergeAttnSubBlock):
                sub = AttnSubBlock(module.norm, module.attn, module.ls)
                return _Fixed(_cost(sub)[1] * x.shape[1] / 5 + MERGE_MS), x
            ms = _cost(module)[1]
            if isinstance(module, (MlpSubBlock, AttnSubBlock)):
                ms *= x.shape[1] / 5
            return _Fixed(ms), x


@pytest.mark.parametrize("interleave", [False, True])
def test_a_build_times_the_token_axis(interleave, tmp_path):
    import devices
    import timm

    from edgeprune.latency.build import build_table
    from edgeprune.latency.measure import unregister_timer
    from tests.test_latency_table import _Counting, _opts

    _token_timer()
    _Counting.reset()
    try:
        an = find_anatomy(timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2).eval())
        prof = devices.load_profile("cpu")
        plain = build_table(an, prof, _opts(backend="fake-tokens", interleave=interleave), tmp_path / "a.json",
                            show_progress=False)
        assert plain.tokens is None and "tokens" not in json.loads((tmp_path / "a.json").read_text())
        t = build_table(an, prof, _opts(backend="fake-tokens", interleave=interleave, grid={
            "max_mlp": 3, "max_dims": 2, "max_heads": 2, "tokens": [4, 2]}), tmp_path / "t.json", show_progress=False)
        assert t.tokens["counts"] == [2, 4, 5] and sorted(t.measured["tokens_mlp"]) == [2, 4]
        for part in ("mlp", "attn"):
            assert t.tokens[part] == pytest.approx([0.4, 0.8, 1.0])
        back = LatencyTable.load(tmp_path / "t.json")
        assert back.tokens == t.tokens and back.mlp == plain.mlp
        assert back.block_ms(back.dense_dims(), 3, 3) == pytest.approx(0.6 * back.block_ms(back.dense_dims()))
        # the merge step: timed at every count and at the model's own, against the dense attention at 5 tokens
        d = back.dense_dims()
        attn = back.attn_ms(d["heads"], d["qk"], d["v"])
        assert sorted(t.measured["tokens_merge"]) == [2, 4, 5]
        (merged,) = [m for m in t.meta["self_check"]["models"] if "tokens" in m]  # the self-check's merged model
        assert merged["name"] == "merged r=1" and merged["tokens"] == [[5, 4], [4, 3]]
        assert merged["error"] == pytest.approx(0.0, abs=1e-9)  # this machine's merges are what the table prices
        assert back.tokens["merge"] == pytest.approx([(attn * n / 5 + MERGE_MS) / attn for n in (2, 4, 5)])
        assert back.merge_extra_ms(3) == pytest.approx(MERGE_MS)
        assert back.block_ms(d, 3, 2) == pytest.approx(0.4 * back.mlp_ms(d["mlp"]) + 0.6 * attn + MERGE_MS)
        del back.tokens["merge"]  # a table built before the merge step was timed: the merge is free, as before
        assert back.block_ms(d, 3, 2) == pytest.approx(0.4 * back.mlp_ms(d["mlp"]) + 0.6 * attn)
    finally:
        unregister_timer("fake-tokens")


def test_the_grid_prices_a_merging_budget_with_the_class_token_last_block(tmp_path):
    """The allocation's grid (``unit_grid`` without a cost model) builds the budget's cost model with the config's
    class-token plan, as the allocation does: a class-token last block merges nothing, so its axis need not reach the
    count a merging last block would see (found by benchmarks/tokens_table.py: a candidate the planner kept then
    failed the run)."""
    from edgeprune.allocation.rules import unit_grid

    path = with_axis(tmp_path / "t.json", counts=[13, 17], mlp=[0.75, 1.0], attn=[0.7, 1.0], head_ms=0.1)
    an = find_anatomy(small_vit())
    cls = corp_config("all", latency=0.5, latency_table=path, tokens_merge=4, last_block="cls")
    assert unit_grid(cls, an).round_to  # block 0: 17 -> 13 tokens; the class-token block 1 merges nothing
    full = corp_config("all", latency=0.5, latency_table=path, tokens_merge=4, last_block="full")
    with pytest.raises(UserError, match=r"the merged blocks run at 9\.\.13 tokens"):
        unit_grid(full, an)  # block 1 would merge 13 -> 9: below the axis
