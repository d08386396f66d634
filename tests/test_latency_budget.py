"""Latency budgets (issue 30): ``--latency F`` / ``12ms`` with ``--latency-table``, allocated by
measured error under a latency table's prices. Every table here is hand-made through the
``LatencyTable`` constructor (no timing)."""

from __future__ import annotations

import json

import pytest
import torch

import edgeprune
from edgeprune.allocation import greedy
from edgeprune.budget import make_budget, validate_budget
from edgeprune.budget.latency import LatencyCost, MISSING_TABLE
from edgeprune.anatomy import find_anatomy
from edgeprune.api import corp_config
from edgeprune.calibration.collect import collect_statistics
from edgeprune.errors import UserError
from edgeprune.latency.table import LatencyTable
from edgeprune.budget.latency_check import latency_check
from edgeprune.pruning.corp import check_prunable, statistics_request
from tests.conftest import assert_one_line_error, run_cli, write_latency_table


def small_vit():
    """A seeded 2-block timm ViT: width 64, 4 heads of 16, MLP 128, 16 px / patch 4 (17 tokens)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=4, in_chans=3, num_classes=5, embed_dim=64, depth=2,
                             num_heads=4, mlp_ratio=2.0).eval()


def make_table(path, *, head_ms=0.0, dim_ms=0.0, mlp_ms=0.0, base=0.1, rules=None, shape=None, batch=8):
    """A table of :func:`small_vit`'s shape: attention = base + heads x (head_ms + dim_ms (qk + v))
    (or, with ``head_ms`` = None, base + dim_ms x (qk + v): removing heads saves nothing),
    MLP = base + mlp_ms x width; fixed 1 ms. Saved as JSON at ``path``; returns the path."""
    key = {"embed_dim": 64, "depth": 2, "num_heads": 4, "head_dim": 16, "mlp_hidden": 128, "tokens": 17,
           "batch": batch, "precision": "fp32", "backend": "onnxruntime", "backend_version": "0",
           "device_name": "hand-made", "profile": "cpu", "threads": 1, **(shape or {})}
    heads, dims, widths = [1, 2, 3, 4], [8, 16], [0, 32, 64, 96, 128]

    def attn(h, q, v):
        return base + (dim_ms * (q + v) if head_ms is None else h * (head_ms + dim_ms * (q + v)))

    return write_latency_table(path, key, rules or {"mlp_round_to": 8, "head_dim_round_to": 8, "qk_equals_v": False},
                               heads, dims, widths, attn, lambda w: base + mlp_ms * w)


@pytest.fixture(scope="module")
def model_and_stats():
    model = small_vit()
    x = torch.randn(48, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    an = find_anatomy(model)
    cfg = corp_config("all", flops=0.5, last_block="full")
    stats = collect_statistics(an, [x[:24], x[24:]], statistics_request(cfg, an, 48, qk_grams=True),
                               progress=False)
    return model, an, stats


def _allocate(an, stats, table, value, target="all", **kw):
    cfg = corp_config(target, latency=value, latency_table=table, last_block="full", **kw)
    check_prunable(an, cfg)
    return greedy.allocate(an, stats, cfg)


def test_heads_cheap_to_remove_dims_not_removes_heads(model_and_stats, tmp_path):
    """Time is per head (dims free): the allocator removes whole heads and keeps head dims."""
    _, an, stats = model_and_stats
    table = make_table(tmp_path / "t.json", head_ms=1.0, dim_ms=0.0)
    dims, rep = _allocate(an, stats, table, 0.6)
    assert sum(d["heads"] for d in dims) < 8
    assert all(d["qk"] == 16 and d["v"] == 16 for d in dims), dims
    assert rep["latency"]["heads_allocated"] and rep["latency"]["predicted"] <= rep["latency"]["target"]


def test_dims_expensive_heads_free_shrinks_dims(model_and_stats, tmp_path):
    """Time depends on the head dims only (removing a head saves nothing): dims shrink, heads stay."""
    _, an, stats = model_and_stats
    table = make_table(tmp_path / "t.json", head_ms=None, dim_ms=0.1)
    dims, rep = _allocate(an, stats, table, 0.6)
    assert all(d["heads"] == 4 for d in dims), dims
    assert sum(d["qk"] + d["v"] for d in dims) < 4 * 16


@pytest.mark.parametrize("budgets", [(0.9, 0.75, 0.6, 0.5, 0.4)])
def test_predicted_latency_within_budget_and_monotone(model_and_stats, tmp_path, budgets):
    _, an, stats = model_and_stats
    table = make_table(tmp_path / "t.json", head_ms=0.05, dim_ms=0.01, mlp_ms=0.004)
    prev = None
    for f in budgets:
        dims, rep = _allocate(an, stats, table, f)
        lat = rep["latency"]
        t = LatencyTable.load(table)
        predicted = t.fixed_ms + sum(t.block_ms(d) for d in dims)
        assert predicted == pytest.approx(lat["predicted"]) and predicted <= f * t.dense_ms() + 1e-9
        assert lat["target"] == pytest.approx(f * t.dense_ms())
        if prev is not None:
            assert predicted <= prev + 1e-9, (f, predicted, prev)
        prev = predicted


def test_absolute_ms_equals_the_same_fraction(model_and_stats, tmp_path):
    _, an, stats = model_and_stats
    table = make_table(tmp_path / "t.json", head_ms=0.05, dim_ms=0.01, mlp_ms=0.004)
    dense = LatencyTable.load(table).dense_ms()
    ms = round(0.6 * dense, 6)
    d_frac, r_frac = _allocate(an, stats, table, ms / dense)
    d_abs, r_abs = _allocate(an, stats, table, f"{ms}ms")
    assert d_abs == d_frac and r_abs["latency"]["target"] == pytest.approx(ms)
    # below 1 ms is still absolute with the unit; a bare number > 1 is ambiguous
    assert make_budget(latency="0.8ms", table=table) == {"kind": "latency", "value": 0.8, "unit": "ms",
                                                          "table": table}
    assert validate_budget({"kind": "latency", "value": 0.8, "unit": "ms", "table": table}).target(10.0) == 0.8
    assert validate_budget({"kind": "latency", "value": 0.8, "table": table}).target(10.0) == 8.0
    with pytest.raises(UserError, match="ambiguous"):
        make_budget(latency="12", table=table)
    with pytest.raises(UserError, match="fraction"):
        validate_budget({"kind": "latency", "value": 12.0, "table": table})


def test_rules_of_the_table_set_the_grid(model_and_stats, tmp_path):
    """MLP widths on mlp_round_to, head dims on head_dim_round_to, Q/K = V with qk_equals_v (fused)."""
    _, an, stats = model_and_stats
    rules = {"mlp_round_to": 32, "head_dim_round_to": 8, "qk_equals_v": True}
    table = make_table(tmp_path / "t.json", head_ms=0.05, dim_ms=0.01, mlp_ms=0.004, rules=rules)
    cfg = corp_config("all", latency=0.5, latency_table=table, last_block="full")
    assert cfg.layout == "fused"  # set by the table's rule
    dims, rep = greedy.allocate(an, stats, cfg)
    assert all(d["mlp"] % 32 == 0 and d["qk"] == d["v"] and d["qk"] % 8 == 0 for d in dims), dims
    assert rep["latency"]["rules"] == rules and rep["latency"]["round_to"]["mlp"] == 32
    with pytest.raises(UserError, match="--layout fused"):
        check_prunable(an, corp_config("all", latency=0.5, latency_table=table, layout="default", last_block="full"))


def test_bad_inputs_fail_in_one_line_before_calibration(tmp_path):
    model = small_vit()
    table = make_table(tmp_path / "t.json", head_ms=0.05, dim_ms=0.01, mlp_ms=0.004)
    other = make_table(tmp_path / "o.json", head_ms=0.05, shape={"embed_dim": 96})
    calls = []

    def calib():
        calls.append(1)
        yield torch.randn(4, 3, 16, 16)

    cases = [({"latency": 0.5}, "edgeprune latency-table"),
             ({"latency": 0.5, "latency_table": str(tmp_path / "missing.json")}, "not found"),
             ({"latency": 0.5, "latency_table": other}, "embed_dim = 96"),
             ({"latency": 0.01, "latency_table": table}, "below the cheapest"),
             ({"latency": 0.5, "latency_table": table, "flops": 0.5}, "not both"),
             ({"flops": 0.5, "latency_table": table}, "goes with"),
             ({"latency": "12", "latency_table": table}, "ambiguous")]
    for kw, msg in cases:
        with pytest.raises(UserError, match=msg) as err:
            edgeprune.prune(model, calib, target="all", sparsity=None, **kw)
        assert "\n" not in str(err.value)
    assert not calls  # every check ran before the calibration pass
    with pytest.raises(UserError, match="edgeprune latency-table"):
        LatencyCost(find_anatomy(model))
    assert "edgeprune latency-table" in MISSING_TABLE and "--device" in MISSING_TABLE


def test_cli_latency_errors(tmp_path):
    table = make_table(tmp_path / "t.json", head_ms=0.05)
    assert_one_line_error(run_cli(["prune", "--latency", "0.5", "-o", str(tmp_path / "r")]), "edgeprune latency-table")
    assert_one_line_error(run_cli(["prune", "--latency", "0.5", "--flops", "0.5", "--latency-table", table,
                                   "-o", str(tmp_path / "r")]), "not both")
    assert_one_line_error(run_cli(["prune", "--latency", "0.5", "--sparsity", "0.3", "--latency-table", table,
                                   "-o", str(tmp_path / "r")]), "--latency replaces the sparsity")
    # the fmnist-vit model is not the table's shape
    assert_one_line_error(run_cli(["prune", "--latency", "0.5", "--latency-table", table, "--no-eval",
                                   "--calib-size", "8", "-o", str(tmp_path / "r")]), "latency table is for")


def test_latency_check_verdict():
    lat = {"dense": 10.0, "predicted": 4.9, "target": 5.0}
    ok = latency_check(lat, {"dense_ms": 20.0, "pruned_ms": 10.4, "ratio": 0.52})
    assert ok["meets_budget"] and ok["miss"] == pytest.approx(0.04)
    bad = latency_check(lat, {"dense_ms": 20.0, "pruned_ms": 12.0, "ratio": 0.6})
    assert not bad["meets_budget"] and bad["miss"] == pytest.approx(0.2)
    absolute = latency_check({**lat, "absolute": True}, {"dense_ms": 20.0, "pruned_ms": 5.2, "ratio": 0.26})
    assert absolute["meets_budget"] and absolute["compared"] == "ms"
    assert latency_check(lat, None, "no backend")["not_measured"] == "no backend"
    json.dumps(ok)


def test_derive_takes_latency_budgets(tmp_path):
    """derive parses --latency as prune does (tests/test_derive_latency.py covers the derivation):
    here the fmnist-vit default is not the table's shape, refused in one line."""
    table = make_table(tmp_path / "t.json", head_ms=0.05)
    assert_one_line_error(run_cli(["derive", "--classes", "0,1", "--latency", "0.5", "--latency-table", table,
                                   "-o", str(tmp_path / "d")]), "latency table is for")


def _measured_latency_prune(tmp_path):
    """(dense, ``--latency 0.6`` prune result, report lines) of a small ViT on a table of this CPU (ONNX Runtime,
    batch 2), its latency measured (3 pairs)."""
    from edgeprune.budget.latency_check import cpu_name, record_latency_check

    model = small_vit()
    x = torch.randn(32, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    table = make_table(tmp_path / "t.json", head_ms=0.05, dim_ms=0.01, mlp_ms=0.004,
                       shape={"device_name": cpu_name()}, batch=2)
    res = edgeprune.prune(model, x, target="all", sparsity=None, latency=0.6, latency_table=table,
                          allocation_check_images=0)
    return model, res, record_latency_check(res.record, model, res.model, (3, 16, 16), iterations=3, warmup=1)


def test_prune_latency_records_predicted_and_measured(tmp_path):
    """A table of this CPU on onnxruntime: the pruned model is benched against the dense one
    (interleaved) and the record holds predicted and measured latency; another device: not measured."""
    pytest.importorskip("onnxruntime")
    from edgeprune.budget.latency_check import record_latency_check

    model, res, lines = _measured_latency_prune(tmp_path)
    chk = res.record["latency_check"]
    assert chk["measured"]["dense_ms"] > 0 and chk["measured"]["pruned_ms"] > 0 and chk["interleaved"]
    assert chk["predicted_ms"] <= chk["budget_ms"] and chk["backend"] == "onnxruntime"
    assert any("measured" in ln for ln in lines)
    other = make_table(tmp_path / "o.json", head_ms=0.05, dim_ms=0.01, mlp_ms=0.004)  # "hand-made" device
    res.record["allocation"]["latency"]["table"] = other
    lines = record_latency_check(res.record, model, res.model, (3, 16, 16))
    assert res.record["latency_check"]["measured"] is None and "not measured" in lines[-1]


@pytest.mark.parametrize("load_1m,cores,loaded", [(5.0, 2, True), (1.5, 2, False)])
def test_a_verdict_taken_on_a_loaded_machine_says_so(tmp_path, monkeypatch, load_1m, cores, loaded):
    """issue 52: the measurement records the machine's load figures before and after, and the dense model's own
    spread; above the usable cores the record's ``loaded`` and the prune's output say the verdict was taken on a
    loaded machine, with the figures (the figures are planted: no verdict here depends on this machine's load)."""
    pytest.importorskip("onnxruntime")
    from edgeprune.latency import load
    from edgeprune.budget.latency_check import latency_report

    monkeypatch.setattr(load, "snapshot", lambda clock="wall": {"load_1m": load_1m, "load_5m": 1.0, "cores": cores,
                                                   "clock": clock})
    monkeypatch.setattr(load, "spread_of", lambda ms: 0.05)  # the dense model's own spread: quiet
    model, res, lines = _measured_latency_prune(tmp_path)
    chk = res.record["latency_check"]
    got = chk["measured"]["load"]
    assert chk["measured"]["clock"] == "cpu" and got["before"]["clock"] == "cpu"  # one CPU thread: runners.clock
    assert got["before"]["load_1m"] == load_1m and got["after"]["cores"] == cores and got["dense_spread"] == 0.05
    warned = [ln for ln in lines + latency_report(chk) if "loaded machine" in ln]
    if loaded:
        assert chk["loaded"] == f"load average {load_1m:.1f} on {cores} cores" and len(warned) == 2, lines
        assert warned[0].startswith("warning: the verdict was taken on a loaded machine (load average 5.0 on 2 cores)")
    else:
        assert chk["loaded"] is None and not warned, lines
    assert load.loaded({"load_1m": 0.5, "cores": 2}, 0.4) == "the dense model's own timings spread 40%"


def test_one_cpu_thread_is_timed_by_its_cpu_time():
    """issue 52: the measurement's clock is the calling thread's CPU time for one CPU thread (what load disturbs
    least, benchmarks/load_clock.py), wall time otherwise; the CPU clock does not count time the thread waited."""
    import time

    from runners.clock import ThreadClock, clock_for

    assert clock_for("cpu", 1) == "cpu" and clock_for("cpu", 2) == "wall" and clock_for("cpu", None) == "wall"
    assert clock_for("cuda", 1) == "wall"

    class Sleeper:  # a run that waits 50 ms without computing: wall time sees it, CPU time does not
        label = "sleeper"

        def time_once(self, x):
            t0 = time.perf_counter()
            time.sleep(0.05)
            return (time.perf_counter() - t0) * 1e3

    r = ThreadClock(Sleeper())
    assert r.label == "sleeper" and Sleeper().time_once(None) >= 50.0 and r.time_once(None) < 25.0


def test_qk_solutions_are_reused_across_candidates(model_and_stats):
    """A budgeted prune solves the same (block, head, kept dims) again for another candidate and
    for the chosen one: the solution is kept on the statistics and returned equal (a copy)."""
    from edgeprune.corp import CorpConfig, plan_corp, qk_solver_from_grams, register_qk_solver, unregister_qk_solver
    from edgeprune.corp.qk_solvers import solve_direct

    _, an, stats = model_and_stats
    calls = []

    @register_qk_solver("counting-memo")
    def counting(system, alpha):
        calls.append(1)
        return solve_direct(system, alpha)

    try:
        cfg = CorpConfig.from_target("attn", 0.5, qk_solver="counting-memo")
        plans = plan_corp(an, stats, cfg)
        first = qk_solver_from_grams(stats.qk, plans, cfg)(1, 2)
        again = qk_solver_from_grams(stats.qk, plans, cfg)(1, 2)
        assert len(calls) == 1 and torch.equal(first[0], again[0]) and first[0] is not again[0]
        other = CorpConfig.from_target("attn", 0.25, qk_solver="counting-memo", round_to=4)  # 12 kept: solved
        qk_solver_from_grams(stats.qk, plan_corp(an, stats, other), other)(1, 2)
        assert len(calls) == 2
    finally:
        unregister_qk_solver("counting-memo")
