"""Measure and correct for ``derive --latency`` (issue 40 item 5): NuWa re-plans its dims from the prepared anchor,
statistics and factors until the *measured* latency meets the budget (``edgeprune.nuwa.measured``).

The device is synthetic, as in tests/test_latency_loop.py: its real cost is the table's prediction of the derived
model's dims, off by a fixed factor or an offset, so the loop's arithmetic is tested without timing anything.
Tables are hand-made for the shape of ``tests.test_nuwa._tiny`` (tests/test_derive_latency.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest
import torch

import edgeprune.budget.correction_loop as correction_loop
from edgeprune.artifact import load_run
from edgeprune.errors import UserError
from edgeprune.latency.table import LatencyTable
from edgeprune.nuwa.derive import DeriveConfig, derive, derive_from, prepare
from edgeprune.nuwa.skp import SKPConfig
from tests.conftest import assert_one_line_error, needs_fmnist, run_cli
from tests.test_derive_latency import predicted_ms, tiny_table
from tests.test_nuwa import _data, _tiny

derive_mod = importlib.import_module("edgeprune.nuwa.derive")  # the package hands on the function of that name


def _device(table_path, factor=1.0, offset=0.0):
    """A synthetic device: real ms = factor x (the table's prediction at the model's dims) + offset. Counts its
    calls."""
    calls = []

    def measure(base, derived):
        calls.append(1)
        b, d = (factor * predicted_ms(table_path, m) + offset for m in (base, derived))
        return {"dense_ms": b, "pruned_ms": d, "ratio": d / b}

    measure.calls = calls
    return measure


def _config(**kw):
    return DeriveConfig(skp=SKPConfig(steps=0), val_size=12, calib_size=24, cache=False, **kw)


@pytest.fixture(scope="module")
def data():
    return _tiny(21), *_data(60, classes=(0, 2, 4), seed=22)


@pytest.fixture(scope="module")
def prep(data):
    torch.set_num_threads(1)
    model, x, y = data
    return prepare(model, [0, 2, 4], x, y, config=_config())


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """MLP cost linear in the width (a fine enough grid for a 3% tolerance on a 2-block model)."""
    return tiny_table(tmp_path_factory.mktemp("t") / "t.json", mlp=lambda w: 0.05 + 0.004 * w)


def _with(prep, **kw):
    return dataclasses.replace(prep, config=dataclasses.replace(prep.config, **kw))


def test_an_offset_the_table_does_not_see_is_corrected_without_a_second_skp_or_calibration(data, table, monkeypatch):
    """Per-call overhead makes every derived model slower than predicted, as a ratio to the base model: round 0
    misses, the re-plans land within 3%, and SKP, the statistics pass and the SVD run once for all rounds."""
    counts = {"skp": 0, "stats": 0, "svd": 0}
    for name, key in (("run_skp", "skp"), ("collect_statistics", "stats"), ("get_factors", "svd")):
        real = getattr(derive_mod, name)

        def counted(*a, _real=real, _key=key, **k):
            counts[_key] += 1
            return _real(*a, **k)

        monkeypatch.setattr(derive_mod, name, counted)
    model, x, y = data
    measure = _device(table, offset=0.5 * LatencyTable.load(table).dense_ms())
    cfg = DeriveConfig(skp=SKPConfig(steps=2, eval_every=1), val_size=12, calib_size=24, cache=False)
    res = derive(model, [0, 2, 4], x, y, latency=0.6, latency_table=table, config=cfg, measurer=measure)
    chk = res.record["latency_check"]
    first, chosen = chk["rounds"][0], chk["rounds"][chk["chosen_round"]]
    assert first["miss"] > 0.03 and chk["chosen_round"] >= 1
    assert abs(chosen["miss"]) <= 0.03 and chk["stopped"] == "within tolerance"
    assert counts == {"skp": 1, "stats": 1, "svd": 1}
    assert len(measure.calls) == len(chk["rounds"])
    assert chosen["budget_value"] < first["budget_value"] == 0.6  # it asked the table for less than the budget
    budget = res.record["derivation"]["budget"]
    assert budget["value"] == pytest.approx(chosen["budget_value"])
    # the returned model is the chosen round's: its own prediction and measurement
    assert predicted_ms(table, res.model) == pytest.approx(budget["latency"]["predicted"])
    assert chosen["predicted"] == pytest.approx(budget["latency"]["predicted"] / budget["latency"]["dense"])
    assert chk["measured"]["ratio"] == pytest.approx(chosen["measured"])
    assert chosen["seconds"] == pytest.approx(res.record["timing"]["search_s"])


def test_a_fixed_factor_on_an_absolute_budget_is_corrected_in_one_round(prep, table):
    """A device 25% slower than its table everywhere: the ratio step corrects an ms budget in one round."""
    dense = LatencyTable.load(table).dense_ms()
    measure = _device(table, factor=1.25)
    res = derive_from(prep, latency=f"{0.6 * dense!r}ms", latency_table=table, measurer=measure)
    chk = res.record["latency_check"]
    assert chk["rounds"][0]["measured"] == pytest.approx(1.25 * chk["rounds"][0]["predicted"])
    assert chk["chosen_round"] == 1 and abs(chk["rounds"][1]["miss"]) <= 0.03 and chk["compared"] == "ms"


def test_the_round_limit_stops_and_reports_the_miss(prep, table):
    """An offset one correction does not absorb: with 1 round allowed the loop stops there, keeps the closer round
    and reports its miss."""
    measure = _device(table, offset=0.5 * LatencyTable.load(table).dense_ms())
    res = derive_from(_with(prep, correction_rounds=1), latency=0.6, latency_table=table, measurer=measure)
    chk = res.record["latency_check"]
    assert len(chk["rounds"]) == 2 == len(measure.calls) and chk["stopped"] == "round limit"
    misses = [abs(r["miss"]) for r in chk["rounds"]]
    assert chk["chosen_round"] == misses.index(min(misses)) and chk["max_rounds"] == 1
    assert chk["miss"] == pytest.approx(chk["rounds"][chk["chosen_round"]]["miss"]) and chk["miss"] > 0.03


def test_a_budget_below_the_smallest_plan_stops_the_loop(prep, table):
    """Overhead that dwarfs the model: the corrected budget falls below the smallest derivable model; the loop
    stops there (no error) with round 0 and says why."""
    measure = _device(table, offset=50 * LatencyTable.load(table).dense_ms())
    res = derive_from(prep, latency=0.6, latency_table=table, measurer=measure)
    chk = res.record["latency_check"]
    assert len(chk["rounds"]) == 1 and chk["stopped"].startswith("correction stopped: the latency budget")
    assert chk["miss"] > 0.03 and not chk["meets_budget"]


def test_rounds_zero_no_verify_and_no_backend(prep, table):
    """0 rounds: measured once, never re-planned; verify_budget=False: never measured; a hand-made table with no
    measurer: predicted only, with the reason."""
    measure = _device(table, offset=0.5 * LatencyTable.load(table).dense_ms())
    res = derive_from(_with(prep, correction_rounds=0), latency=0.6, latency_table=table, measurer=measure)
    assert len(res.record["latency_check"]["rounds"]) == 1 and len(measure.calls) == 1
    measure.calls.clear()
    res = derive_from(_with(prep, verify_budget=False), latency=0.6, latency_table=table, measurer=measure)
    assert measure.calls == [] and res.record["latency_check"]["not_measured"].startswith("not asked")
    assert res.record["latency_check"]["measured"] is None
    chk = derive_from(prep, latency=0.6, latency_table=table).record["latency_check"]
    assert chk["measured"] is None and "hand-made" in chk["not_measured"]


def test_flops_and_params_derivations_are_never_measured(prep, table):
    measure = _device(table)
    for kw in ({"flops": 0.6}, {"params": 0.7}):
        res = derive_from(prep, measurer=measure, **kw)
        assert "latency_check" not in res.record
        again = derive_mod._plan(prep, derive_mod.resolve_budget(**kw))  # the plan alone: the same weights
        for (k, p), (_, q) in zip(res.model.state_dict().items(), again.model.state_dict().items()):
            assert torch.equal(p, q), k
    assert measure.calls == []


# a Python caller is told the setting by its keyword (issue 53), the command line by its option (below)
@pytest.mark.parametrize("kw, msg", [({"correction_tolerance": 0.0}, "^correction_tolerance must"),
                                     ({"correction_tolerance": float("nan")}, "^correction_tolerance must"),
                                     ({"correction_tolerance": 1.0}, "^correction_tolerance must"),
                                     ({"correction_rounds": -1}, "^correction_rounds must"),
                                     ({"correction_rounds": 11}, "^correction_rounds must"),
                                     ({"correction_rounds": 2.5}, "^correction_rounds must"),
                                     ({"correction_rounds": True}, "^correction_rounds must"),
                                     ({"verify_budget": "yes"}, "^verify_budget must")])
def test_bad_correction_settings_are_refused_before_skp(data, table, monkeypatch, kw, msg):
    def no_skp(*a, **k):
        raise AssertionError("SKP ran before the settings were checked")

    monkeypatch.setattr(derive_mod, "run_skp", no_skp)
    model, x, y = data
    cfg = DeriveConfig(skp=SKPConfig(steps=2), val_size=12, calib_size=24, cache=False, **kw)
    with pytest.raises(UserError, match=msg) as err:
        derive(model, [0, 2], x, y, latency=0.6, latency_table=table, config=cfg)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, pattern", [
    (["--latency-rounds", "11"], "--latency-rounds must be an integer in [0, 10]"),
    (["--latency-rounds", "-1"], "--latency-rounds must be an integer in [0, 10]"),
    (["--latency-tolerance", "0"], "--latency-tolerance must be a fraction in (0, 1)"),
    (["--latency-tolerance", "1.5"], "--latency-tolerance must be a fraction in (0, 1)"),
    (["--latency-tolerance", "nan"], "--latency-tolerance"),
    (["--latency-tolerance", "0.05", "--no-verify-latency"], "needs the measurement that --no-verify-latency"),
    (["--latency-rounds", "2", "--no-verify-latency"], "needs the measurement that --no-verify-latency"),
])
def test_cli_correction_options_bad_values_and_conflicts(tmp_path, table, args, pattern):
    """One line, exit 2, before any work (no run directory)."""
    r = run_cli(["derive", "--classes", "0,1", "--latency", "0.5", "--latency-table", table, *args,
                 "-o", tmp_path / "r"])
    assert_one_line_error(r, pattern)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("args, pattern", [
    (["--latency-tolerance", "0.05"], "--latency-tolerance goes with --latency"),
    (["--latency-rounds", "2"], "--latency-rounds goes with --latency"),
    (["--verify-latency"], "--verify-latency goes with --latency"),
    (["--no-verify-latency"], "--no-verify-latency goes with --latency"),
])
def test_cli_correction_options_without_latency_are_refused(tmp_path, args, pattern):
    r = run_cli(["derive", "--classes", "0,1", "--flops", "0.6", *args, "-o", tmp_path / "r"])
    assert_one_line_error(r, pattern)
    assert not (tmp_path / "r").exists()


@needs_fmnist
def test_cli_prints_the_rounds_and_records_them(tmp_path, monkeypatch):
    """``edgeprune derive --latency`` on fmnist-vit with the table's backend replaced by the synthetic device
    (offset): the rounds are printed as prune prints them and kept in the record."""
    shape = {"embed_dim": 128, "depth": 6, "num_heads": 2, "head_dim": 64, "mlp_hidden": 512, "tokens": 49}
    rules = {"mlp_round_to": 16, "head_dim_round_to": 16, "qk_equals_v": False}
    table = tiny_table(tmp_path / "f.json", shape=shape, rules=rules, mlp=lambda w: 0.05 + 0.004 * w)
    measure = _device(table, offset=0.4 * LatencyTable.load(table).dense_ms())
    asked = []  # the one loop of prune and derive (issue 53) hands the tolerance to the measurer as prune's does

    def table_measurer(budget, anatomy, **kw):
        asked.append(kw.get("tolerance"))
        return measure, None

    monkeypatch.setattr(correction_loop, "table_measurer", table_measurer)
    out = tmp_path / "run"
    res = run_cli(["derive", "--classes", "0,Bag", "--latency", "0.7", "--latency-table", table, "--skp-steps", "0",
                   "--train-per-class", "30", "--val-size", "12", "--calib-size", "16", "--no-eval",
                   "--latency-tolerance", "0.05", "--latency-rounds", "4", "-o", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    chk = json.loads((out / "run.json").read_text())["latency_check"]
    assert len(chk["rounds"]) >= 2 and chk["tolerance"] == 0.05 and chk["max_rounds"] == 4 and asked == [0.05]
    for r in chk["rounds"]:
        assert f"latency round {r['round']}: asked the table for {r['budget_value']:.4g}" in res.stdout
    assert f"round {chk['chosen_round']} kept" in res.stdout
    model, _ = load_run(out)  # the saved model is the chosen round's
    dense = LatencyTable.load(table).dense_ms()
    assert predicted_ms(table, model) / dense == pytest.approx(chk["rounds"][chk["chosen_round"]]["predicted"])
