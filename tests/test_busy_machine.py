"""The load figures themselves (issue 52, ``edgeprune/latency/load.py``): every other test reads a quiet machine's
(``conftest._quiet_machine_figures``); here the real functions, on properties that hold at any load."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def load(monkeypatch):
    monkeypatch.undo()  # the real figures, not conftest's quiet ones
    from edgeprune.latency import load

    return load


def test_a_snapshot_has_the_kernels_figures_and_the_clock(load):
    s = load.snapshot()
    assert set(s) == {"load_1m", "load_5m", "cores", "clock"} and s["clock"] == load.CLOCK == "wall"
    assert s["cores"] == load.usable_cores() == len(os.sched_getaffinity(0)) >= 1
    assert s["load_1m"] is None or (isinstance(s["load_1m"], float) and s["load_1m"] >= 0)
    assert load.snapshot("cpu")["clock"] == "cpu"


def test_spread_drift_and_the_loaded_wording(load):
    assert load.spread_of([2.0, 2.0, 2.0]) == 0.0 and load.spread_of([1.0, 2.0]) is None
    assert load.spread_of([1.0] * 9 + [3.0]) == pytest.approx(0.0)  # one outlier of 10: p90 is the 9th
    assert load.spread_of(list(range(1, 12))) == pytest.approx(10 / 2 - 1)  # p10 = 2, p90 = 10
    assert load.drift(100.0, 169.0) == pytest.approx(0.69)
    assert load.loaded({"load_1m": 2.0, "cores": 2}) is None  # at the cores: not loaded
    assert load.loaded({"load_1m": 2.1, "cores": 2}) == "load average 2.1 on 2 cores"
    assert load.loaded({"load_1m": None, "cores": 2}, 0.25) is None
    assert load.loaded({"load_1m": 4.0, "cores": 2}, 0.3) == ("load average 4.0 on 2 cores; the dense model's own "
                                                              "timings spread 30%")
