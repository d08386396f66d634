"""A/B latency comparison with interleaved runs.

Running A's iterations and then B's lets anything that drifts over time -- thermal throttling,
a neighbour's load on a shared CPU, frequency scaling -- bias the comparison. :func:`bench_pair`
instead alternates A and B on the same input (A B A B ...), both during warm-up and timing, and
reports, besides both latency distributions, the distribution of the *per-pair* ratio
``latency_A_i / latency_B_i`` (its median and p10-p90): each pair ran under nearly the same
conditions, so the ratio is far more stable than the ratio of two separately measured medians.

Blocks (issue 56 item 3): with ``min_block_ms > 0`` each turn runs one model ``k`` times back to back (``k`` chosen
per model in warm-up so that a block lasts at least ``min_block_ms``; :func:`runners.clock.block_runs`), timed by
one clock read around the block (:func:`runners.clock.time_block`); a turn's latency is block time / ``k`` and the
ratio is per pair of blocks. Single ~2 ms runs of a small model at batch 1 are about one scheduler slice long and
their ratio spreads widely; ~25 ms blocks average that out.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from edgeprune.errors import UserError
from runners.base import BenchResult, Runner, choose_block_runs, make_batch, with_blocks
from runners.clock import block_runs, time_block


@dataclasses.dataclass
class PairResult:
    """A vs B at one batch size.

    Attributes:
        batch_size: images per inference.
        a, b: the two runners' results (same input, interleaved).
        latency_ratio: per-pair ``latency_A / latency_B``: ``median``, ``p10``, ``p90``, ``mean``
            (> 1: B is faster; with A = dense and B = pruned it is the pruned model's speedup).
        throughput_ratio: ``throughput_B / throughput_A`` (> 1: B is faster; the same direction as
            ``latency_ratio``).
        latencies_a, latencies_b: the raw per-iteration latencies (ms), pair i = (a[i], b[i]); each is a block's
            time / its runs (``a.block_runs``, ``b.block_runs``).
        min_block_ms: the minimum block time asked for (ms; 0: one run per turn).
        no_measurable_difference: the ratio's p10-p90 interval straddles 1 (``p10 < 1 < p90``).
    """

    batch_size: int
    a: BenchResult
    b: BenchResult
    latency_ratio: dict[str, float]
    throughput_ratio: float
    latencies_a: list[float] = dataclasses.field(default_factory=list)
    latencies_b: list[float] = dataclasses.field(default_factory=list)
    min_block_ms: float = 0.0
    no_measurable_difference: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def ratio_stats(latencies_a: Sequence[float], latencies_b: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90 and mean of the per-pair ratios ``a[i] / b[i]``."""
    a = np.asarray(latencies_a, dtype=np.float64)
    b = np.asarray(latencies_b, dtype=np.float64)
    if a.shape != b.shape or a.size == 0:
        raise ValueError(f"need equally many latencies for A and B, got {a.size} and {b.size}")
    r = a / np.maximum(b, 1e-12)
    return {
        "median": float(np.median(r)),
        "p10": float(np.percentile(r, 10)),
        "p90": float(np.percentile(r, 90)),
        "mean": float(r.mean()),
    }


def straddles_one(latency_ratio: dict[str, float]) -> bool:
    """The ratio's p10-p90 interval contains 1 strictly inside it (``p10 < 1 < p90``): no measurable difference."""
    return bool(latency_ratio["p10"] < 1.0 < latency_ratio["p90"])


def block_note(p: PairResult) -> str:
    """One line for a report on pair ``p``: how its turns were timed (``blocks of k runs``, block ms) and, when
    the ratio's p10-p90 straddles 1, that there is no measurable difference."""
    def side(r: BenchResult) -> str:
        if r.block_runs <= 1:
            return "single runs"
        return f"blocks of {r.block_runs} runs" + (f" (~{r.block_ms:.1f} ms)" if r.block_ms is not None else "")

    lr = p.latency_ratio
    text = f"batch {p.batch_size}: A timed in {side(p.a)}, B in {side(p.b)}"
    text += f" (min block {p.min_block_ms:g} ms)" if p.min_block_ms > 0 else " (min block 0: one run per turn)"
    if straddles_one(lr):
        text += (f"; latency A/B p10-p90 {lr['p10']:.3f}-{lr['p90']:.3f} straddles 1: "
                 "no measurable difference")
    return text


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free confidence interval of the median: the order statistics ``(x_(k), x_(n+1-k))``
    with the largest ``k`` such that ``P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2`` (the sign-test
    interval; Hollander & Wolfe, Nonparametric Statistical Methods, sec. 3.6). With fewer than 6
    values no k qualifies at 95% and the whole range ``(min, max)`` is returned.

    Raises:
        ValueError: no values, or ``confidence`` not in (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    x = sorted(float(v) for v in values)
    n = len(x)
    if n == 0:
        raise ValueError("need at least one value")
    alpha, k, below = (1 - confidence) / 2, 0, 0.0
    while k < n // 2:
        below += math.comb(n, k) / 2.0 ** n  # P(B <= k)
        if below > alpha:
            break
        k += 1
    k = max(k, 1)
    return x[k - 1], x[n - k]


def ratio_settled(rel_width: float = 0.02, min_pairs: int = 6,
                  confidence: float = 0.95) -> Callable[[Sequence[float], Sequence[float]], bool]:
    """A ``stop`` rule for :func:`bench_pair`: true once at least ``min_pairs`` pairs were timed and the
    :func:`median_interval` of the per-pair ratios ``a[i] / b[i]`` is narrower than ``rel_width`` times
    their median (0.02: the median ratio known to about +-1%).

    Raises:
        ValueError: ``rel_width <= 0`` or ``min_pairs < 2``.
    """
    if not rel_width > 0 or min_pairs < 2:
        raise ValueError(f"need rel_width > 0 and min_pairs >= 2, got {rel_width}, {min_pairs}")

    def stop(lat_a: Sequence[float], lat_b: Sequence[float]) -> bool:
        if len(lat_a) < min_pairs:
            return False
        r = [a / max(b, 1e-12) for a, b in zip(lat_a, lat_b)]
        lo, hi = median_interval(r, confidence)
        return hi - lo <= rel_width * float(np.median(r))

    return stop


#: the confidence at which :func:`ratio_decided` stops: higher than the 95% of a reported interval, since a stop rule
#: looks after every pair (up to ``iterations`` looks)
DECIDED_CONFIDENCE = 0.99


def ratio_decided(band: tuple[float, float], confidence: float = DECIDED_CONFIDENCE,
                  min_pairs: int = 6) -> Callable[[Sequence[float], Sequence[float]], bool]:
    """A ``stop`` rule for :func:`bench_pair`: true once at least ``min_pairs`` pairs were timed and the
    ``confidence`` interval of the median per-pair ratio ``b[i] / a[i]`` (:func:`median_interval`) lies wholly inside
    ``band`` or wholly outside it -- more pairs would not change which side it is on. With A the dense model and B
    the pruned one, ``band = budget * (1 -+ tolerance)``: met or missed (issue 40 item 4,
    ``edgeprune.budget.latency_check.measure_pair``).

    Raises:
        ValueError: ``band`` not increasing and positive, or ``min_pairs < 2``.
    """
    lo_b, hi_b = (float(v) for v in band)
    if not 0 < lo_b < hi_b or min_pairs < 2:
        raise ValueError(f"need 0 < low < high and min_pairs >= 2, got {band!r}, {min_pairs}")

    def stop(lat_a: Sequence[float], lat_b: Sequence[float]) -> bool:
        if len(lat_a) < min_pairs:
            return False
        lo, hi = median_interval([b / max(a, 1e-12) for a, b in zip(lat_a, lat_b)], confidence)
        return (lo_b <= lo and hi <= hi_b) or hi < lo_b or lo > hi_b

    return stop


def bench_pair(runner_a: Runner, runner_b: Runner, batch_sizes: Sequence[int],
               iterations: int = 50, warmup: int = 10, *, inputs: Any = None,
               seed: int = 0, stop: Callable[[Sequence[float], Sequence[float]], bool] | None = None,
               min_block_ms: float = 0.0) -> list[PairResult]:
    """Benchmark A and B interleaved (A B A B ...) on the same input, per batch size.

    Args:
        runner_a, runner_b: the two models; they must take the same input shape.
        batch_sizes: e.g. ``[1, 8]``.
        iterations: timed pairs per batch size.
        warmup: untimed pairs per batch size, run first (also interleaved).
        inputs: optional (N, C, H, W) real inputs; default seeded noise.
        stop: optional rule called after each timed pair with the latencies so far (A's, B's; ms);
            true ends the batch size's timing early (``iterations`` is then the most pairs timed;
            e.g. :func:`ratio_settled`).
        min_block_ms: time blocks (module doc): each turn runs a model ``k`` times back to back, ``k`` chosen per
            model from its warm-up runs so a block lasts at least this long (ms); 0 (default): one run per turn.

    Returns:
        One :class:`PairResult` per batch size. The peak memory of both is the process peak over
        the batch size (both models live in the same process); compare memory from separate runs.

    Raises:
        UserError: the runners take different input shapes, or neither knows its input shape.
        ValueError: ``iterations < 1``, ``warmup < 0`` or ``min_block_ms < 0``.
    """
    if iterations < 1 or warmup < 0:
        raise ValueError(f"need iterations >= 1 and warmup >= 0, got {iterations}, {warmup}")
    block_runs(1.0, min_block_ms)  # validates
    sa, sb = runner_a.input_shape, runner_b.input_shape
    if sa is not None and sb is not None and tuple(sa) != tuple(sb):
        raise UserError(f"A and B take different inputs: {runner_a.label} {tuple(sa)} vs "
                        f"{runner_b.label} {tuple(sb)}")
    shape = sa if sa is not None else sb
    if shape is None and inputs is None:
        raise UserError("input shape of A and B unknown; pass inputs")
    results = []
    for bs in batch_sizes:
        x = make_batch(shape or (), int(bs), inputs, seed)
        runner_a.prepare(x)
        runner_b.prepare(x)
        runner_a.reset_peak_memory()
        runner_b.reset_peak_memory()
        warm_a: list[float] = []
        warm_b: list[float] = []
        for _ in range(warmup):
            warm_a.append(float(runner_a.time_once(x)))
            warm_b.append(float(runner_b.time_once(x)))
        ka = choose_block_runs(runner_a, x, warm_a, min_block_ms)
        kb = choose_block_runs(runner_b, x, warm_b, min_block_ms)
        lat_a: list[float] = []
        lat_b: list[float] = []
        for _ in range(iterations):
            lat_a.append(time_block(runner_a, x, ka) / ka)
            lat_b.append(time_block(runner_b, x, kb) / kb)
            if stop is not None and stop(lat_a, lat_b):
                break
        ra = with_blocks(runner_a.result(int(bs), lat_a, warmup), ka)
        rb = with_blocks(runner_b.result(int(bs), lat_b, warmup), kb)
        for r in (ra, rb):
            r.settings["interleaved"] = True
            r.settings["min_block_ms"] = float(min_block_ms)
        ratio = ratio_stats(lat_a, lat_b)
        results.append(PairResult(
            batch_size=int(bs), a=ra, b=rb, latency_ratio=ratio,
            throughput_ratio=rb.throughput / ra.throughput if ra.throughput > 0 else float("nan"),
            latencies_a=lat_a, latencies_b=lat_b, min_block_ms=float(min_block_ms),
            no_measurable_difference=straddles_one(ratio),
        ))
    return results
