"""Measure and correct (issue 40 item 3): a ``--latency`` prune re-allocates until the *measured* latency meets the
budget. The device here is synthetic: its real cost is the table's prediction of the pruned model's dims, off by a
fixed factor or by an offset (what a table that does not add up looks like), so the loop's arithmetic is tested
without timing anything."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import edgeprune
from edgeprune.anatomy import find_anatomy
from edgeprune.budget.latency import load_table
from edgeprune.errors import UserError
from edgeprune.pruning.corp import corp_prune
from edgeprune.pruning.config import corp_config
from edgeprune.budget.latency_check import latency_report
from edgeprune.budget.correction_loop import next_value
from edgeprune.surgery import block_dims
from tests.test_latency_budget import make_table, small_vit


def _images(n=48, seed=3):
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def _device(table_path, factor=1.0, offset=0.0, block_factor=None):
    """A synthetic device: real ms = factor x (the table's fixed ms + block_factor x its block ms at the model's
    dims) + offset. Counts its calls."""
    t = load_table(table_path)
    calls = []

    def real(model):
        blocks = sum(t.block_ms({"mlp": d["mlp_hidden"], "qk": d["qk_dim"], "v": d["v_dim"], "heads": d["num_heads"]})
                     for d in block_dims(find_anatomy(model)))
        return factor * (t.fixed_ms + (block_factor or 1.0) * blocks) + offset

    def measure(dense, pruned):
        calls.append(1)
        d, p = real(dense), real(pruned)
        return {"dense_ms": d, "pruned_ms": p, "ratio": p / d}

    measure.calls = calls
    return measure


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    return make_table(tmp_path_factory.mktemp("t") / "t.json", head_ms=0.05, dim_ms=0.01, mlp_ms=0.004)


def _prune(table, measure, value=0.6, **kw):
    return edgeprune.prune(small_vit(), _images(), target="all", sparsity=None, latency=value, latency_table=table,
                           allocation_check_images=0, last_block="full", measurer=measure, **kw)


def test_an_offset_the_table_does_not_see_is_corrected(table):
    """Per-call overhead (a constant the table misses) makes every pruned model slower than predicted, as a
    ratio to dense: round 0 misses by more than the tolerance, the correction lands within it."""
    dense_ms = load_table(table).dense_ms()
    measure = _device(table, offset=0.5 * dense_ms)
    res = _prune(table, measure)
    chk = res.record["latency_check"]
    first, chosen = chk["rounds"][0], chk["rounds"][chk["chosen_round"]]
    assert first["miss"] > 0.03 and chk["chosen_round"] >= 1
    assert abs(chosen["miss"]) <= 0.03 and chk["stopped"] == "within tolerance"
    assert chk["measured"]["ratio"] == pytest.approx(chosen["measured"])
    # the verdict is against the budget asked, not the corrected value the table was asked for
    assert chk["miss"] == pytest.approx(chosen["miss"]) and chk["budget_ratio"] == pytest.approx(0.6)
    assert chk["meets_budget"] and latency_report(chk)[-1].startswith("latency: measured")
    chk["measured"].update(pairs=8, ratio_interval=[0.59, 0.61])  # a real measurement's interval is printed
    assert ", 95% x0.590-0.610 over 8 pairs, interleaved" in latency_report(chk)[-1]
    assert len(measure.calls) == len(chk["rounds"])
    assert chosen["budget_value"] < first["budget_value"]  # it asked the table for less than the budget
    assert res.record["allocation"]["budget"]["value"] == pytest.approx(chosen["budget_value"])


def test_a_fixed_factor_on_an_absolute_budget_is_corrected_in_one_round(table):
    """Absolute ms budgets compare ms: a device 25% slower than its table everywhere is corrected by the first
    round (the ratio step), up to the allocation grid's granularity."""
    dense = load_table(table).dense_ms()
    measure = _device(table, factor=1.25)
    res = _prune(table, measure, value=f"{0.6 * dense:.4f}ms", correction_tolerance=0.05)
    chk = res.record["latency_check"]
    assert chk["rounds"][0]["measured"] == pytest.approx(1.25 * chk["rounds"][0]["predicted"])
    assert chk["chosen_round"] == 1 and abs(chk["rounds"][1]["miss"]) <= 0.05 and chk["compared"] == "ms"


def test_the_round_limit_stops_and_reports_the_miss(table):
    """A device whose overhead dwarfs the model cannot reach the budget: the loop stops after the round limit
    (or when the corrected budget falls below the cheapest allocation) and says how much it missed."""
    dense_ms = load_table(table).dense_ms()
    measure = _device(table, offset=50 * dense_ms)
    res = _prune(table, measure, correction_rounds=2)
    chk = res.record["latency_check"]
    assert len(chk["rounds"]) <= 3 and chk["stopped"] != "within tolerance"
    assert chk["miss"] > 0.03 and not chk["meets_budget"]
    assert chk["max_rounds"] == 2


def test_rounds_zero_measures_only_and_no_measurer_means_predicted(table):
    measure = _device(table, offset=0.5 * load_table(table).dense_ms())
    res = _prune(table, measure, correction_rounds=0)
    assert len(res.record["latency_check"]["rounds"]) == 1 and len(measure.calls) == 1
    res = edgeprune.prune(small_vit(), _images(), target="all", sparsity=None, latency=0.6, latency_table=table,
                          allocation_check_images=0)  # a hand-made table: its device is not this machine
    chk = res.record["latency_check"]
    assert chk["measured"] is None and "hand-made" in chk["not_measured"]
    res = _prune(table, measure, verify_budget=False)
    assert res.record["latency_check"]["not_measured"].startswith("not asked")


def test_flops_budgets_are_never_measured(table):
    measure = _device(table)
    res = edgeprune.prune(small_vit(), _images(), target="all", sparsity=None, flops=0.6, measurer=measure)
    assert measure.calls == [] and "latency_check" not in res.record


def test_reused_statistics_give_the_same_prune():
    """A correction round reuses the first round's statistics: the same config on a fresh copy then gives the
    same weights as a prune with its own calibration pass."""
    model, x = small_vit(), _images()
    cfg = corp_config("all", None, flops=0.6, last_block="full", allocation_check_images=8)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    info = corp_prune(find_anatomy(a), lambda: iter([x[:24], x[24:]]), cfg, progress=False)
    again = corp_prune(find_anatomy(b), lambda: iter([x[:24], x[24:]]), cfg, progress=False,
                       statistics=info["statistics"])
    assert again["statistics_reused"] and again["passes"] == 0 and not info["statistics_reused"]
    for (k, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), k


def test_a_correction_round_reuses_the_measured_sensitivities():
    """Issue 40's repeated work: a round on the same statistics for another budget value reads the per-unit
    measurements of the first round instead of pruning every unit again; a fresh pass measures them anew."""
    model, x = small_vit(), _images()

    def run(value, statistics=None):
        cfg = corp_config("all", None, flops=value, last_block="full", allocation_check_images=8)
        return corp_prune(find_anatomy(copy.deepcopy(model)), lambda: iter([x[:24], x[24:]]), cfg, progress=False,
                          statistics=statistics)

    first = run(0.6)
    again = run(0.5, first["statistics"])
    fresh = run(0.5)
    s1, s2, s3 = (i["allocation"]["selection"]["sensitivity"] for i in (first, again, fresh))
    assert "reused" not in s1 and "reused" not in s3 and s2["reused"]
    assert s2["units"] == s1["units"] and s3["units"] != s1["units"]  # measured where round 0's uniform put them
    assert again["allocation"]["achieved_cost"] <= again["allocation"]["target_cost"]


def test_a_correction_round_keeps_the_first_rounds_candidate_rule():
    """Issue 40 item 4: a round on the same statistics for another budget value allocates with the candidate rule
    the first round kept (uniform, greedy at a Q/K weight, or greedy on the measured curves) instead of building and
    checking every candidate again; its dims are that rule's candidate at the new value, as the full candidate set
    would have built it."""
    from edgeprune.allocation.select import candidates, check_images, output_tensor

    model, x = small_vit(), _images()
    batches = lambda: iter([x[:24], x[24:]])  # noqa: E731

    def cfg(value, **kw):
        return corp_config("all", None, flops=value, last_block="full", allocation_check_images=8, **kw)

    for kw in ({}, {"allocation_sensitivity": False}):
        first = corp_prune(find_anatomy(copy.deepcopy(model)), batches, cfg(0.6, **kw), progress=False)
        stats = first["statistics"]
        again = corp_prune(find_anatomy(copy.deepcopy(model)), batches, cfg(0.5, **kw), progress=False,
                           statistics=stats)
        sel0, sel = first["allocation"]["selection"], again["allocation"]["selection"]
        assert len(sel0["measured_output_error"]) >= 2 and "rule_reused" not in sel0
        assert sel["chosen"] == sel0["chosen"] and list(sel["measured_output_error"]) == [sel0["chosen"]]
        assert "rule_reused" in sel
        anatomy = find_anatomy(copy.deepcopy(model))
        xc = check_images(batches, 8)
        every = candidates(anatomy, stats, cfg(0.5, **kw), xc, output_tensor(anatomy.model(xc)))
        assert [b["dims"] for b in again["allocation"]["blocks"]] == every[sel0["chosen"]][0]
        assert again["allocation"]["achieved_cost"] <= again["allocation"]["target_cost"]
    # each greedy Q/K weight is rebuilt at its own weight; curves that are gone: every candidate again (None)
    from edgeprune.allocation.greedy import allocate
    from edgeprune.allocation.select import _same_rule

    c5 = cfg(0.5)
    for w in ("0.2", "1", "5"):
        got = _same_rule(anatomy, stats, c5, (f"greedy(qk_weight={w})", None), {})
        assert got[f"greedy(qk_weight={w})"][0] == allocate(anatomy, stats, c5, qk_weight=float(w), only="greedy")[0]
    assert _same_rule(anatomy, stats, c5, ("greedy(measured)", None), {}) is None


def _spy_fit_passes(monkeypatch) -> list[tuple[bool, tuple[int, ...]]]:
    """Record each heads-refit pass (``head_compensation.collect_fit_statistics``): (no dense model given, the blocks
    it collects)."""
    import edgeprune.head_compensation as hc

    calls = []
    real = hc.collect_fit_statistics

    def spy(dense, anatomy, indices, batches, gram_dtype=torch.float32, cache=None):
        calls.append((dense is None, tuple(indices)))
        return real(dense, anatomy, indices, batches, gram_dtype, cache)

    monkeypatch.setattr(hc, "collect_fit_statistics", spy)
    return calls


@pytest.mark.parametrize("limit", [None, 1])
def test_the_refit_cache_changes_no_weight(table, monkeypatch, limit):
    """Issue 40 item 4: the heads refit reads the statistics pass's dense stream in round 0 and the same stream in
    each correction round (no dense copy, no dense forward), and reuses the statistics of every block pruned exactly
    as before: the prune is bitwise the one that runs the dense model every time. Over the memory bound (``limit``
    1 byte) nothing is kept and every round runs the dense model."""
    import edgeprune.head_compensation as hc
    import edgeprune.pruning.corp as pc

    calls = _spy_fit_passes(monkeypatch)
    if limit is not None:
        monkeypatch.setattr(pc, "STREAM_BYTES", limit)
        monkeypatch.setattr(pc, "refit_cache", lambda stats, cfg: stats.derived.setdefault(
            "head_refit", hc.RefitCache(limit_bytes=limit)))
    offset = 0.5 * load_table(table).dense_ms()
    cached = _prune(table, _device(table, offset=offset))
    with_cache = list(calls)
    calls.clear()
    monkeypatch.setattr(pc, "refit_cache", lambda stats, cfg: None)
    monkeypatch.setattr(pc, "_stream_request", lambda cfg, anatomy, num_images: 0)
    plain = _prune(table, _device(table, offset=offset))
    assert len(cached.record["latency_check"]["rounds"]) >= 2 and len(with_cache) >= 2
    assert cached.record["latency_check"]["chosen_round"] == plain.record["latency_check"]["chosen_round"]
    a, b = cached.model.state_dict(), plain.model.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(dense_none for dense_none, _ in calls)  # without the stream: a dense forward every round
    # with it: none (round 0 reads the statistics pass's stream, the later rounds the same one)
    assert all(dense_none for dense_none, _ in with_cache) == (limit is None)
    assert not any(dense_none for dense_none, _ in with_cache) == (limit is not None)


def test_a_round_whose_blocks_are_pruned_as_before_refits_from_the_kept_statistics(table, monkeypatch):
    """Issue 40 item 4: the heads refit of a round that prunes every block as the round before collects nothing
    (each block's fit statistics are reused, keyed by its pruned weights), and gives the same weights."""
    calls = _spy_fit_passes(monkeypatch)
    cfg = corp_config("all", None, latency=0.6, latency_table=table, last_block="full", allocation_check_images=0)
    x = _images()
    runs = []
    for _ in range(2):
        info = corp_prune(find_anatomy(m := small_vit()), lambda: iter([x[:24], x[24:]]), cfg, progress=False,
                          statistics=runs[0][1] if runs else None)
        runs.append((m, info["statistics"]))
    assert len(calls) == 1 and calls[0][1]  # round 0 only, with its refit blocks
    a, b = runs[0][0].state_dict(), runs[1][0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_measurer_exports_the_dense_model_once(monkeypatch):
    """The measure-and-correct loop benches every round against the same dense model: its ONNX export is made
    once (issue 40), the pruned model's every time; the measurements are real ONNX Runtime runs."""
    from types import SimpleNamespace

    import edgeprune.budget.latency_check as lc
    import edgeprune.budget.correction_loop as ll
    from edgeprune.latency.measure import cpu_name

    pytest.importorskip("onnxruntime")
    key = {"backend": "onnxruntime", "device_name": cpu_name(), "batch": 2, "threads": 1, "precision": "fp32"}
    monkeypatch.setattr(ll, "load_table", lambda path: SimpleNamespace(key=key))
    exported = []
    for mod in (ll, lc):
        real = mod.export_onnx
        monkeypatch.setattr(mod, "export_onnx", lambda m, path, *a, _real=real, **k: exported.append(
            Path(path).stem) or _real(m, path, *a, **k))
    dense = small_vit()
    measure, reason = ll.table_measurer(SimpleNamespace(table="t.json"), find_anatomy(dense), iterations=7, warmup=1)
    assert reason is None
    for value in (0.6, 0.5):
        pruned = edgeprune.prune(dense, _images(), flops=value, last_block="full", allocation_check_images=0).model
        got = measure(dense, pruned)
        assert got["dense_ms"] > 0 and got["pruned_ms"] > 0 and got["ratio"] > 0
        # issue 40: timed until settled (at least 6 pairs, at most the 7 asked); the ratio inside its interval
        lo, hi = got["ratio_interval"]
        assert 6 <= got["pairs"] <= 7 and lo <= got["ratio"] <= hi
        assert got["stopped"] in ("settled", "pair limit")
    assert exported == ["dense", "pruned", "pruned"]
    # a budget far from what the pruned model measures: the verdict (missed) is known after 6 of 20 pairs
    measure, _ = ll.table_measurer(SimpleNamespace(table="t.json", value=0.01, unit=None), find_anatomy(dense),
                                   iterations=20, warmup=1, tolerance=0.03)
    got = measure(dense, pruned)
    assert got["pairs"] == 6 and got["stopped"] == "verdict known" and got["ratio_interval"][0] > 0.0103
    from edgeprune.errors import UserError
    from edgeprune.record_schema import RECORD_SCHEMA
    from edgeprune.schema import check

    schema = RECORD_SCHEMA.fields["latency_check"]  # what a run record keeps of it
    check(schema, {"measured": got}, "run.json", "")
    with pytest.raises(UserError, match="stopped"):
        check(schema, {"measured": {**got, "stopped": "bored"}}, "run.json", "")


def test_the_measurement_stops_once_its_verdict_is_known(monkeypatch):
    """issue 40 item 4: pairs are timed until the 99% interval of the median pruned / dense ratio is wholly inside
    the budget's tolerance band or wholly outside it (at least 6 pairs); straddling an edge, to the pair limit."""
    from runners.compare import ratio_decided

    noise = [1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.0, 1.02, 0.98, 1.01, 0.99, 1.0, 1.02, 0.98, 1.01, 0.99, 1.0,
             1.02, 0.98]

    def stops_at(true_ratio, band, n=20, spread=1.0):
        rule = ratio_decided(band)
        a, b = [], []
        for i in range(n):
            a.append(10.0)
            b.append(10.0 * true_ratio * (1 + spread * (noise[i] - 1)))
            if rule(a, b):
                return i + 1
        return None

    assert stops_at(0.40, (0.485, 0.515)) == 6  # far below: missed at once
    assert stops_at(0.60, (0.485, 0.515)) == 6  # far above
    assert stops_at(0.50, (0.45, 0.55)) == 6  # well inside a wide band
    assert stops_at(0.50, (0.485, 0.515)) == 6  # every pair inside the band: met
    assert stops_at(0.50, (0.485, 0.515), spread=2.5) is None  # 7.5% noise against a 3% band: never decided
    assert stops_at(0.515, (0.485, 0.515)) is None  # on the edge: never decided
    assert ratio_decided((0.4, 0.6))([1.0] * 5, [0.1] * 5) is False  # fewer than 6 pairs: never
    for bad in [(0.5, 0.5), (0.6, 0.4), (0.0, 0.5)]:
        with pytest.raises(ValueError):
            ratio_decided(bad)


def test_a_latency_prune_hands_its_tolerance_to_the_measurer(table, monkeypatch):
    import edgeprune.budget.correction_loop as run_mod  # the one loop of prune and derive (issue 53)

    seen = []

    def fake(budget, anatomy, **kw):
        seen.append((budget.value, kw.get("tolerance")))
        return None, "captured"

    monkeypatch.setattr(run_mod, "table_measurer", fake)
    res = edgeprune.prune(small_vit(), _images(), target="all", sparsity=None, latency=0.6, latency_table=table,
                          allocation_check_images=0, correction_tolerance=0.05)
    assert seen == [(0.6, 0.05)] and res.record["latency_check"]["not_measured"] == "captured"
    # the band is in the unit correct() compares: round 0's target as a ratio to dense is the budget's value
    lat = res.record["allocation"]["latency"]
    assert lat["target"] / lat["dense"] == pytest.approx(0.6)


def test_next_value_steps():
    assert next_value([(0.5, 0.6)], 0.5) == pytest.approx(0.5 * 0.5 / 0.6)  # one point: the ratio
    # two points on m = p + 0.1: the secant lands exactly
    assert next_value([(0.5, 0.6), (0.45, 0.55)], 0.5) == pytest.approx(0.4)
    # a falling m(p) (noise): back to the ratio step
    assert next_value([(0.5, 0.6), (0.45, 0.65)], 0.5) == pytest.approx(0.45 * 0.5 / 0.65)
    with pytest.raises(ValueError):
        next_value([], 0.5)


# a Python caller is told the setting by its keyword (issue 53; the command line: tests/test_bad_input_41.py)
@pytest.mark.parametrize("kw, msg", [({"correction_tolerance": 0.0}, "^correction_tolerance must"),
                                     ({"correction_tolerance": float("nan")}, "^correction_tolerance must"),
                                     ({"correction_tolerance": 1.5}, "^correction_tolerance must"),
                                     ({"correction_rounds": -1}, "^correction_rounds must"),
                                     ({"correction_rounds": 2.5}, "^correction_rounds must"),
                                     ({"correction_rounds": True}, "^correction_rounds must"),
                                     ({"verify_budget": "yes"}, "^verify_budget must")])
def test_bad_correction_settings_are_refused_before_any_pass(table, kw, msg):
    calls = []

    def batches():
        calls.append(1)
        return iter([_images()])

    with pytest.raises(UserError, match=msg):
        edgeprune.prune(small_vit(), batches, target="all", sparsity=None, latency=0.6, latency_table=table, **kw)
    assert calls == []
