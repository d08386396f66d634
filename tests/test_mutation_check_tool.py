"""tools/mutation_check.py's sampling (issue 43): the seeded uniform sample, the Wilson interval, the counts of a
results list and the two mutmut passes of ``--sample``. Fast: mutmut is never started (its calls are faked)."""

import importlib.util
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "tools" / "mutation_check.py")
mc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mc)

NAMES = [f"edgeprune.x.x_f__mutmut_{i}" for i in range(1, 31)]


def test_the_sample_is_seeded_sorted_a_subset_and_independent_of_the_order():
    a = mc.sample_names(NAMES, 7, seed=3)
    assert a == mc.sample_names(list(reversed(NAMES)), 7, seed=3)
    assert a == sorted(a) and len(set(a)) == 7 and set(a) <= set(NAMES)
    assert any(mc.sample_names(NAMES, 7, seed=s) != a for s in range(4, 8))
    assert mc.sample_names(NAMES, 99, seed=0) == sorted(NAMES)


def test_the_sample_is_uniform():
    # 3000 samples of 6 of 30: each name is drawn 3000 * 6 / 30 = 600 times on average (binomial sd ~22)
    hits = dict.fromkeys(NAMES, 0)
    for seed in range(3000):
        for m in mc.sample_names(NAMES, 6, seed):
            hits[m] += 1
    assert min(hits.values()) > 500 and max(hits.values()) < 700


@pytest.mark.parametrize("k,n", [(0, 5), (3, 10), (38, 40), (40, 40), (1, 1)])
def test_wilson_bounds_solve_the_score_equation(k, n):
    # the Wilson bounds are the p with (k/n - p)^2 = z^2 p (1 - p) / n, the one inside [0, 1] at k = 0 or n
    z = 1.96
    lo, hi = mc.wilson(k, n)
    for p in (lo, hi):
        assert (k / n - p) ** 2 == pytest.approx(z * z * p * (1 - p) / n, abs=1e-12)
    assert 0 <= lo <= k / n <= hi <= 1
    assert (lo == 0) == (k == 0) and (hi == 1) == (k == n)


def test_wilson_of_all_killed_and_bad_counts():
    lo, hi = mc.wilson(10, 10)
    assert hi == 1 and lo == pytest.approx(10 / (10 + 1.96 ** 2))
    assert mc.wilson(0, 0) is None
    for k, n in ((3, 2), (-1, 4)):
        with pytest.raises(ValueError):
            mc.wilson(k, n)


def test_summary_of_a_fake_results_list():
    equivalent_line = next(iter(mc.EQUIVALENT))
    res = {"m__mutmut_1": "killed", "m__mutmut_2": "killed", "m__mutmut_3": "timeout", "m__mutmut_4": "survived",
           "m__mutmut_5": "survived", "m__mutmut_6": "no tests", "m__mutmut_7": "not checked",
           "m__mutmut_8": "suspicious"}
    diffs = {"m__mutmut_4": f"-old\n+{equivalent_line}", "m__mutmut_5": "-a = 1\n+a = 2",
             "m__mutmut_8": "-b\n+c"}
    s = mc.summarize(res, diffs.__getitem__)
    assert (s["killed"], s["ran"], s["equivalent"], s["no_tests"]) == (3, 6, 1, 1)
    assert s["score"] == 3 / 5 and s["strict_score"] == 3 / 6
    assert s["interval"] == mc.wilson(3, 5) and s["strict_interval"] == mc.wilson(3, 6)
    assert [v["mutant"] for v in s["survivors"] if not v["equivalent"]] == ["m__mutmut_5", "m__mutmut_8"]
    assert s["not_run"] == ["m__mutmut_6", "m__mutmut_7"]


def test_sample_mode_generates_then_runs_exactly_the_sample(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(mc, "_prepare", lambda name, workdir: (tmp_path / "mutants").mkdir() or tmp_path)

    def fake_mutmut(d, args, timeout, log):
        calls.append(args)
        return 1 if mc.NO_MUTANT in args else 0  # the listing pass ends on mutmut's "nothing matches"

    ran = {}

    def fake_results(d):
        if len(calls) == 1:
            return dict.fromkeys(NAMES, "not checked")
        return {m: ran.setdefault(m, "killed" if i % 4 else "survived") if m in calls[1] else "not checked"
                for i, m in enumerate(NAMES)}

    monkeypatch.setattr(mc, "_mutmut", fake_mutmut)
    monkeypatch.setattr(mc, "_results", fake_results)
    monkeypatch.setattr(mc, "_diff", lambda d, m: "-x\n+y")
    s = mc.check_module("rules", tmp_path, budget=100.0, max_children=1, sample=8, seed=5)
    assert calls[0][-1] == mc.NO_MUTANT
    assert calls[1][3:] == mc.sample_names(NAMES, 8, 5) == s["sampled"]
    assert (s["population"], s["sample"], s["finished"]) == (30, 8, True)
    survived = sum(st == "survived" for st in ran.values())
    assert sum(s["counts"].values()) == 8 and s["not_run"] == []  # only the sample is counted
    assert s["ran"] == 8 and s["killed"] == 8 - survived and len(s["survivors"]) == survived
    assert s["interval"] == mc.wilson(8 - survived, 8)
    assert math.isclose(s["score"], (8 - survived) / 8)


def test_sample_below_one_is_bad_usage(capsys):
    assert mc.main(["--sample", "0", "rules"]) == 2
    assert "--sample must be at least 1" in capsys.readouterr().err
