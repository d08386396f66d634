"""``tokens_merge="auto"`` (issue 44 item 3): the latency budget chooses the merge schedule by the measured output
error (edgeprune.pruning.tokens_auto). The small 2-block ViT (17 tokens, 1 class token) and hand-made latency
tables with a token axis of tests/test_latency_tokens.py."""

from __future__ import annotations

import json

import pytest
import torch

import edgeprune
from edgeprune.allocation.select import output_error
from edgeprune.anatomy import find_anatomy
from edgeprune.api import corp_config
from edgeprune.jobs.prune_report import report_tokens_auto as _report_tokens_auto
from edgeprune.errors import UserError
from edgeprune.record_schema import check_record
from edgeprune.pruning.tokens_auto import candidate_schedules, default_candidates
from tests.conftest import assert_one_line_error, run_cli
from tests.test_latency_budget import make_table, small_vit
from tests.test_latency_tokens import with_axis

#: no sensitivity curves, no head refit (its cross-validation is slow): seconds per candidate
FAST = dict(target="all", sparsity=None, last_block="full", verify_budget=False, allocation_sensitivity=False,
            head_refit=False, allocation_check_images=16, batch_size=16)


def _table(tmp_path, **kw) -> str:
    return with_axis(tmp_path / "t.json", head_ms=0.1, dim_ms=0.01, mlp_ms=0.01, **kw)


def _x(n: int = 32) -> torch.Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(2))


def _check_error(model, dense, x) -> float:
    with torch.no_grad():
        return output_error(model(x[:16]), dense(x[:16]))


def test_auto_keeps_the_candidate_of_lowest_measured_error(tmp_path, capsys):
    table, x, dense = _table(tmp_path), _x(), small_vit()
    res = edgeprune.prune(dense, x, latency=0.6, latency_table=table, tokens_merge="auto",
                          tokens_candidates=(4, "decreasing:2", 2), **FAST)
    auto = res.record["tokens_auto"]
    rows = auto["candidates"]
    assert [c["schedule"] for c in rows] == [0, 2, "decreasing:2", 4]  # 0 added first, then by tokens merged
    assert [c["r"] for c in rows] == [[0, 0], [2, 2], [4, 0], [4, 4]]
    errors = [c["check_error"] for c in rows]
    assert len(set(errors)) == len(errors)  # distinct: the choice means something
    chosen = rows[errors.index(min(errors))]
    assert auto["chosen"] == chosen["schedule"] and auto["r"] == chosen["r"]
    assert res.record["config"]["tokens_merge"] == auto["chosen"] and res.record["tokens_merge"]["r"] == auto["r"]
    assert auto["images"] == 16 and auto["skipped"] == [] and auto["statistics_reused"] == 3
    assert auto["check_error"] == chosen["check_error"] == pytest.approx(_check_error(res.model, dense, x), rel=1e-9)
    for c in rows:  # every candidate met the budget at its merged token counts; nothing measured (verify off)
        assert c["predicted_fraction"] <= 0.6 + 1e-9 and c["seconds"] > 0 and c["measured"] is None
    # each candidate by hand (its own calibration pass): the same model, so the same error
    for c in (rows[0], chosen):
        hand = edgeprune.prune(small_vit(), x, latency=0.6, latency_table=table, tokens_merge=c["schedule"], **FAST)
        assert _check_error(hand.model, dense, x) == pytest.approx(c["check_error"], rel=1e-6)
        assert hand.record["allocation"]["latency"]["predicted"] == pytest.approx(c["predicted"], rel=1e-12)
    assert auto["check_error"] <= rows[0]["check_error"]  # never worse than the widths alone
    check_record(json.loads(json.dumps(res.record)), "run.json")  # JSON, and a valid run record
    _report_tokens_auto(auto)  # what `edgeprune prune` prints: one line
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"tokens auto: chose {auto['chosen']} (r per block {auto['r']}")


def test_every_candidate_is_measured_and_corrected(tmp_path):
    """A fake machine on which a merging model runs 20% slower than its widths say (the merge step is not in the
    table): the merging candidate is corrected (a second round), the widths-only one is within tolerance."""
    seen = []

    def measurer(dense, pruned):
        merged = any(b.merge_r for b in find_anatomy(pruned).blocks)
        seen.append(merged)
        ratio = 0.6 * (1.2 if merged else 1.0)
        return {"dense_ms": 10.0, "pruned_ms": 10.0 * ratio, "ratio": ratio}

    kw = {**FAST, "verify_budget": True}
    res = edgeprune.prune(small_vit(), _x(), latency=0.6, latency_table=_table(tmp_path), tokens_merge="auto",
                          tokens_candidates=(2,), correction_rounds=1, measurer=measurer, **kw)
    rows = res.record["tokens_auto"]["candidates"]
    assert [(c["schedule"], c["rounds"], c["measured"]) for c in rows] == [(0, 1, 0.6), (2, 2, pytest.approx(0.72))]
    assert seen == [False, True, True]
    assert res.record["latency_check"]["measured"]["ratio"] == pytest.approx(rows[0 if not any(
        res.record["tokens_auto"]["r"]) else 1]["measured"])


def test_candidates_skip_what_the_tokens_the_table_or_the_budget_cannot_take(tmp_path):
    model = small_vit()
    # a token axis from 9 tokens: r = 6 in block 0 leaves its MLP 11 tokens, block 1 merges 6 of 11 > (11 - 1) // 2
    table = _table(tmp_path, counts=[9, 13, 17], mlp=[0.5, 0.75, 1.0], attn=[0.45, 0.7, 1.0])
    cfg = corp_config("all", latency=0.6, latency_table=table, last_block="full", tokens_merge="auto",
                      tokens_candidates=(2, [1, 1], 6, [2, 2], [6, 3]))
    kept, skipped = candidate_schedules(model, cfg)
    assert kept == [(0, [0, 0]), ((1, 1), [1, 1]), (2, [2, 2])]
    why = {json.dumps(s["schedule"]): s["reason"] for s in skipped}
    assert set(why) == {"6", "[2, 2]", "[6, 3]"}
    assert "block 1 would merge 6 tokens but can merge at most 5" in why["6"]
    assert why["[2, 2]"] == "same r per block as 2"
    assert "a token axis from 9 tokens, the merged blocks run at 8..11" in why["[6, 3]"]  # block 1's MLP: 17 - 6 - 3
    # a budget only merging reaches (the cheapest allocations on this table: x0.284 of the dense latency with no
    # merge, x0.276 at r = 1, x0.251 at r = 4): the widths alone (0) and r = 1 skipped, r = 4 kept
    full = with_axis(tmp_path / "full.json", head_ms=0.1, dim_ms=0.01, mlp_ms=0.01)
    cfg = corp_config("all", latency=0.26, latency_table=full, last_block="full", tokens_merge="auto",
                      tokens_candidates=(1, 4), allocation_sensitivity=False, head_refit=False)
    with pytest.raises(UserError, match="cheapest"):
        edgeprune.prune(model, _x(8), latency=0.26, latency_table=full, last_block="full")  # the widths alone
    kept, skipped = candidate_schedules(model, cfg)
    assert [s for s, _ in kept] == [4]
    assert {s["schedule"] for s in skipped} == {0, 1} and all("cheapest" in s["reason"] for s in skipped)
    res = edgeprune.prune(model, _x(), cfg, batch_size=16)  # runs, and records the skipped ones
    auto = res.record["tokens_auto"]
    assert auto["chosen"] == 4 and [c["schedule"] for c in auto["candidates"]] == [4]
    assert [s["schedule"] for s in auto["skipped"]] == [0, 1]
    with pytest.raises(UserError, match=r"no candidate left \(0: .*cheapest"):
        edgeprune.prune(model, _x(8), latency=0.26, latency_table=full, tokens_merge="auto", tokens_candidates=(1,),
                        **FAST)


def test_default_candidates_spread_light_to_heavy(tmp_path):
    assert default_candidates(12, 197, 1, False) == [0, 2, 4, 8, "decreasing:4", "decreasing:8"]  # ViT-S/16
    assert default_candidates(6, 49, 0, False) == [0, 1, 2, 4, "decreasing:2", "decreasing:4"]  # fmnist-vit
    assert default_candidates(2, 17, 1, True) == [0, 2, 4, 8, "decreasing:2", "decreasing:4"]
    cfg = corp_config("all", latency=0.6, latency_table=_table(tmp_path), tokens_merge="auto")
    kept, skipped = candidate_schedules(small_vit(), cfg)  # class-token last block: block 1 merges nothing
    assert [r for _, r in kept] == [[0, 0], [2, 0], [4, 0], [8, 0]]
    assert {json.dumps(s["schedule"]) for s in skipped} == {'"decreasing:2"', '"decreasing:4"'}  # same r as 2, 4


def test_refusals_in_one_line_before_any_pass(tmp_path):
    table, bare = _table(tmp_path), make_table(tmp_path / "bare.json", head_ms=0.1)
    calls = []

    def calib():
        calls.append(1)
        yield _x(8)

    for kw, pattern in ((dict(sparsity=0.5), "needs a budget"),
                        (dict(flops=0.5), "^tokens_merge auto with a flops budget: its cost model does not price"),
                        (dict(flops=0.5, embed_sparsity="auto"), "cannot be combined"),
                        (dict(latency=0.6, latency_table=bare), "has no token axis"),
                        (dict(latency=0.6, latency_table=table, allocation_check_images=0), "give allocation_check_images >= 1"),
                        (dict(latency=0.6, latency_table=table, tokens_candidates="2,4"), "non-empty list"),
                        (dict(latency=0.6, latency_table=table, tokens_candidates=()), "non-empty list"),
                        (dict(latency=0.6, latency_table=table, tokens_candidates=(2, "auto")), "not a schedule"),
                        (dict(latency=0.6, latency_table=table, tokens_candidates=(2, -1)), ">= 0"),
                        (dict(latency=0.6, latency_table=table, inplace=True), "inplace")):
        with pytest.raises(UserError, match=pattern) as err:
            edgeprune.prune(small_vit(), calib, tokens_merge="auto", **kw)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="go with tokens_merge='auto'"):
        edgeprune.prune(small_vit(), calib, latency=0.6, latency_table=table, tokens_merge=2, tokens_candidates=(2,))
    assert not calls
    base = ["prune", "--model", "fmnist-vit", "--no-eval", "--calib-size", "8", "--tokens-merge", "auto"]
    for extra, pattern in (([], "needs a budget"),
                           (["--flops", "0.5"], "--tokens-merge auto with a --flops budget: its cost model does not price"),
                           (["--flops", "0.5", "--embed-sparsity", "auto"], "cannot be combined")):
        r = run_cli(base + extra + ["-o", tmp_path / "bad"])
        assert_one_line_error(r, pattern)
        assert not (tmp_path / "bad").exists()
    r = run_cli(["deploy", "--device", "cpu", "--flops", "0.5", "--tokens-merge", "auto", "-o", tmp_path / "dep"])
    assert_one_line_error(r, "--tokens-merge auto needs a --latency budget")
    assert not (tmp_path / "dep").exists()
    recipe = tmp_path / "r.toml"  # the recipe key takes "auto" too
    recipe.write_text('[model]\nmodel = "fmnist-vit"\n[method]\ntokens-merge = "auto"\n')
    r = run_cli(["prune", "--config", str(recipe), "--no-eval", "-o", tmp_path / "bad"])
    assert_one_line_error(r, "--tokens-merge auto needs a budget")


class _DenseHeadNet(torch.nn.Module):
    """small_vit inside a network whose head reads every patch token (a dense output: the merge unmerges)."""

    def __init__(self):
        super().__init__()
        self.vit = small_vit()
        self.head = torch.nn.Linear(64, 2)

    def forward(self, x):
        return self.head(self.vit.forward_features(x)[:, 1:])  # (B, 16, 2): one value pair per patch


def test_auto_on_a_network_with_a_dense_head_merges_inside_the_blocks_and_keeps_the_lowest_error(tmp_path):
    """Issue 55 item 2: ``tokens_merge="auto"`` on a network with a ViT inside: the candidates are priced at the
    merged token counts, judged by the network's output error, and the chosen one unmerges (every output kept)."""
    table, x = _table(tmp_path), _x()
    net = _DenseHeadNet().eval()
    res = edgeprune.prune(net, x, latency=0.6, latency_table=table, tokens_merge="auto", tokens_candidates=(2, 4),
                          **{**FAST, "last_block": None})
    auto = res.record["tokens_auto"]
    rows = auto["candidates"]
    assert [c["schedule"] for c in rows] == [0, 2, 4] and auto["skipped"] == []
    errors = [c["check_error"] for c in rows]
    assert len(set(errors)) == 3 and auto["check_error"] == min(errors)
    assert auto["chosen"] == rows[errors.index(min(errors))]["schedule"]
    with torch.no_grad():
        assert res.model(x[:2]).shape == net(x[:2]).shape == (2, 16, 2)
    for c in rows:
        assert c["predicted_fraction"] <= 0.6 + 1e-9
    # the heaviest candidate by hand: priced at its merged token counts as the search priced it, unmerged
    hand = edgeprune.prune(_DenseHeadNet().eval(), x, latency=0.6, latency_table=table, tokens_merge=4,
                           **{**FAST, "last_block": None})
    assert hand.record["tokens_merge"]["unmerge"] is True and hand.record["tokens_merge"]["r"] == [4, 4]
    assert hand.record["allocation"]["latency"]["predicted"] == pytest.approx(rows[2]["predicted"], rel=1e-12)
    with torch.no_grad():
        assert hand.model(x[:2]).shape == (2, 16, 2)
        assert _check_error(hand.model, net, x) == pytest.approx(rows[2]["check_error"], rel=1e-6)
