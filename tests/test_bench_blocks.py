"""Issue 56 item 3: a batch-1 bench times blocks of back-to-back runs (``runners.clock.time_block``).

Fake runners advance a fake clock by a per-run time the test sets; nothing here reads a real clock or depends on
the machine's speed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from click.testing import CliRunner

import edgeprune  # noqa: F401  (timm patches, before anything imports timm)
import edgeprune.jobs.bench as jobs_bench
from edgeprune.cli.main import cli, main
from edgeprune.latency import measure
from runners import clock
from runners.base import BenchResult, Runner
from runners.bench import DEFAULT_MIN_BLOCK_MS, BenchReport, resolve_config
from runners.compare import PairResult, bench_pair, block_note, straddles_one


class FakeClock:
    """Seconds that only advance when a fake runner runs; counts its reads. Starts at 0 and the runners' times
    are multiples of TICK (2**-10 s in ms), so all clock arithmetic is exact in binary floating point."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


@pytest.fixture
def clocks(monkeypatch):
    wall, thread = FakeClock(), FakeClock()
    monkeypatch.setattr(clock, "wall_seconds", wall)
    monkeypatch.setattr(clock, "thread_seconds", thread)
    return wall, thread


#: 2**-10 s in ms (0.9765625 ms): times of fake runs are multiples of it
TICK = 1000.0 / 1024


class FakeRunner(Runner):
    """A runner whose every run takes ``ms`` (ms) on both fake clocks and reports ``ms``."""

    backend = "fake"

    def __init__(self, ms: float, clocks: tuple[FakeClock, FakeClock], label: str = "m") -> None:
        self.ms, self.clocks, self.label, self.runs = float(ms), clocks, label, 0
        self.input_shape = (1, 4, 4)

    def infer(self, x: np.ndarray) -> np.ndarray:
        return x

    def time_once(self, x: np.ndarray) -> float:
        self.runs += 1
        for c in self.clocks:
            c.now += self.ms / 1000.0
        return self.ms

    def reset_peak_memory(self) -> None:
        pass


@pytest.mark.parametrize("per_run", [0.3, 1.0, 2.0, 2.5, 7.0, 24.9, 25.0, 40.0])
@pytest.mark.parametrize("min_block", [1.0, 25.0, 50.0])
def test_block_runs_is_the_least_k_reaching_the_block(per_run, min_block):
    k = clock.block_runs(per_run, min_block)
    assert k >= 1 and k * per_run >= min_block or (k == 1 and per_run >= min_block)
    assert k == 1 or (k - 1) * per_run < min_block


def test_block_runs_zero_means_one_run_and_negative_is_refused():
    assert clock.block_runs(0.01, 0.0) == 1
    assert clock.block_runs(100.0, 25.0) == 1  # slower than the block
    with pytest.raises(ValueError, match=">= 0"):
        clock.block_runs(1.0, -1.0)


def test_bench_pair_times_blocks_with_one_clock_read_each(clocks):
    wall, _ = clocks
    a, b = FakeRunner(2 * TICK, clocks, "dense"), FakeRunner(TICK, clocks, "pruned")  # 1.95 ms, 0.98 ms
    (p,) = bench_pair(a, b, [1], iterations=5, warmup=3, min_block_ms=25.0)
    assert (p.a.block_runs, p.b.block_runs) == (13, 26)
    assert p.a.block_runs * 2 * TICK >= 25.0 and p.b.block_runs * TICK >= 25.0
    assert p.latencies_a == pytest.approx([2 * TICK] * 5) and p.latencies_b == pytest.approx([TICK] * 5)
    assert p.latency_ratio["median"] == pytest.approx(2.0)
    assert p.a.block_ms == pytest.approx(26 * TICK) and p.b.block_ms == pytest.approx(26 * TICK)
    assert wall.reads == 2 * 5 * 2  # one read before and one after each of 5 blocks per model, not per run
    assert a.runs == 3 + 5 * 13 and b.runs == 3 + 5 * 26
    assert p.min_block_ms == 25.0 and not p.no_measurable_difference
    d = p.to_dict()
    assert d["a"]["block_runs"] == 13 and d["b"]["block_ms"] == pytest.approx(26 * TICK)


def test_thread_clock_reads_once_around_a_block(clocks):
    wall, thread = clocks
    a, b = FakeRunner(5 * TICK, clocks), FakeRunner(2 * TICK, clocks)
    (p,) = bench_pair(clock.ThreadClock(a), clock.ThreadClock(b), [1], iterations=4, warmup=2, min_block_ms=20.0)
    assert (p.a.block_runs, p.b.block_runs) == (5, 11)  # 20 / 4.88 -> 5, 20 / 1.95 -> 11
    assert p.latencies_a == pytest.approx([5 * TICK] * 4) and p.latencies_b == pytest.approx([2 * TICK] * 4)
    assert thread.reads == 2 * 2 * 2 + 2 * 4 * 2  # warm-up: 2 per run; timed: 2 per block
    assert wall.reads == 0


def test_min_block_zero_is_one_run_per_turn(clocks):
    wall, _ = clocks
    a, b = FakeRunner(2.0, clocks), FakeRunner(1.0, clocks)
    (p,) = bench_pair(a, b, [1], iterations=6, warmup=2, min_block_ms=0.0)
    assert (p.a.block_runs, p.b.block_runs) == (1, 1)
    assert a.runs == b.runs == 2 + 6
    assert wall.reads == 0  # the runner's own timing, as before blocks
    (p,) = bench_pair(a, b, [1], iterations=6, warmup=2)  # the default of the function: no blocks
    assert p.a.block_runs == 1


def test_block_size_comes_from_the_fastest_warm_up_run(clocks):
    """A slow (loaded, cold) warm-up run must not shrink the block below the minimum."""
    a = FakeRunner(TICK, clocks)
    b = FakeRunner(TICK, clocks)
    a.ms = 8 * TICK  # the first warm-up run of A is slow ...
    calls = []

    def once(x, _orig=FakeRunner.time_once.__get__(a)):
        calls.append(1)
        out = _orig(x)
        a.ms = TICK  # ... the rest are not
        return out

    a.time_once = once
    (p,) = bench_pair(a, b, [1], iterations=2, warmup=2, min_block_ms=10.0)
    assert p.a.block_runs == p.b.block_runs == 11  # 10 / 0.98 -> 11, not 10 / (its median or mean)


def test_bench_pair_refuses_a_negative_block(clocks):
    with pytest.raises(ValueError, match=">= 0"):
        bench_pair(FakeRunner(1.0, clocks), FakeRunner(1.0, clocks), [1], 2, 0, min_block_ms=-1.0)


def test_benchmark_alone_times_blocks(clocks):
    wall, _ = clocks
    r = FakeRunner(3 * TICK, clocks)
    (res,) = r.benchmark([1], iterations=4, warmup=0, min_block_ms=10.0)  # no warm-up: one run estimates k
    assert res.block_runs == 4 and res.latency_ms["p50"] == pytest.approx(3 * TICK)
    assert wall.reads == 2 * 4 and r.runs == 1 + 4 * 4


def test_latency_measurer_times_blocks(clocks):
    wall, thread = clocks
    r = FakeRunner(TICK / 2, clocks)
    x = np.zeros((1, 1, 4, 4), np.float32)
    s = measure.TimingSettings(clock="cpu", min_block_ms=4.5)
    k = measure.block_size([9.0, TICK / 2, 9.0, TICK], s)  # the fastest warm-up run
    assert k == 10  # 4.5 / 0.488 -> 9.2
    assert measure.time_once(r, x, s, k) == pytest.approx(TICK / 2)
    assert thread.reads == 2 and r.runs == 10 and wall.reads == 0
    assert measure.block_size([0.5], dataclasses.replace(s, min_block_ms=0.0)) == 1
    lat = measure.timed_runs(lambda: 1.0, dataclasses.replace(s, iterations=100, max_seconds=0.05, repeats=1,
                                                               min_iterations=1), runs_per_call=10)
    assert len(lat) == 5  # 5 blocks x 10 runs x 1 ms = 50 ms


def _pair(p10: float, median: float, p90: float, k: int = 12) -> PairResult:
    def res(label: str) -> BenchResult:
        return BenchResult(model=label, backend="onnxruntime", device="cpu", batch_size=1, iterations=10, warmup=2,
                           latency_ms={n: 2.0 for n in ("p50", "p90", "p99", "mean", "std", "min", "max")},
                           throughput=500.0, block_runs=k, block_ms=2.0 * k)

    ratio = {"p10": p10, "median": median, "p90": p90, "mean": median}
    return PairResult(batch_size=1, a=res("dense.onnx"), b=res("pruned.onnx"), latency_ratio=ratio,
                      throughput_ratio=median, min_block_ms=25.0, no_measurable_difference=straddles_one(ratio))


def _report(pair: PairResult) -> str:
    cfg, prof = resolve_config("cpu")
    targets = {k: {"target": f"{k}.onnx", "backend": "onnxruntime"} for k in "ab"}
    return BenchReport(profile=prof.to_dict(), config=dataclasses.asdict(cfg), targets=targets,
                       results=[pair]).markdown()


@pytest.mark.parametrize("p10, p90, straddles", [(0.8, 1.3, True), (0.99, 1.01, True), (1.05, 1.4, False),
                                                  (0.5, 0.97, False), (1.0, 1.2, False)])
def test_report_says_when_the_ratio_straddles_one(p10, p90, straddles):
    text = _report(_pair(p10, (p10 + p90) / 2, p90))
    assert "blocks of 12 runs" in text and "min block ms 25 [default]" in text
    assert ("straddles 1" in text) is straddles
    assert ("no measurable difference" in text) is straddles
    assert straddles_one({"p10": p10, "p90": p90}) is straddles


def test_block_note_single_runs():
    assert "single runs" in block_note(_pair(1.2, 1.5, 1.8, k=1))


def test_cli_has_the_setting_and_passes_it(monkeypatch):
    out = CliRunner().invoke(cli, ["bench", "--help"])
    assert out.exit_code == 0 and "--min-block-ms" in out.output
    seen = []

    def fake_run_bench(a, b, cfg, profile, **kw):
        seen.append(cfg)
        raise SystemExit(0)

    monkeypatch.setattr(jobs_bench, "run_bench", fake_run_bench)
    for argv, want in ((["x.onnx"], DEFAULT_MIN_BLOCK_MS), (["x.onnx", "--min-block-ms", "0"], 0.0),
                       (["x.onnx", "--min-block-ms=40.5"], 40.5)):
        with pytest.raises(SystemExit):
            main(["bench", *argv])
        assert seen[-1].min_block_ms == want
    assert DEFAULT_MIN_BLOCK_MS == 25.0
    assert seen[0].sources["min_block_ms"] == "default" and seen[1].sources["min_block_ms"] == "option"


@pytest.mark.parametrize("value", ["-1", "-0.5", "nan"])
def test_cli_refuses_a_bad_block_in_one_line(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "missing.onnx", f"--min-block-ms={value}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--min-block-ms" in err and (">=0" in err or "not a finite number" in err)
