"""A/B latency comparison with interleaved runs.

Running A's iterations and then B's lets anything that drifts over time -- thermal throttling,
a neighbour's load on a shared CPU, frequency scaling -- bias the comparison. :func:`bench_pair`
instead alternates A and B on the same input (A B A B ...), both during warm-up and timing, and
reports, besides both latency distributions, the distribution of the *per-pair* ratio
``latency_A_i / latency_B_i`` (its median and p10-p90): each pair ran under nearly the same
conditions, so the ratio is far more stable than the ratio of two separately measured medians.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import numpy as np

from edgeprune.errors import UserError
from runners.base import BenchResult, Runner, make_batch


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
        latencies_a, latencies_b: the raw per-iteration latencies (ms), pair i = (a[i], b[i]).
    """

    batch_size: int
    a: BenchResult
    b: BenchResult
    latency_ratio: dict[str, float]
    throughput_ratio: float
    latencies_a: list[float] = dataclasses.field(default_factory=list)
    latencies_b: list[float] = dataclasses.field(default_factory=list)

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
    ``edgeprune.pruning.latency_check.measure_pair``).

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
               seed: int = 0, stop: Callable[[Sequence[float], Sequence[float]], bool] | None = None
               ) -> list[PairResult]:
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

    Returns:
        One :class:`PairResult` per batch size. The peak memory of both is the process peak over
        the batch size (both models live in the same process); compare memory from separate runs.

    Raises:
        UserError: the runners take different input shapes, or neither knows its input shape.
        ValueError: ``iterations < 1`` or ``warmup < 0``.
    """
    if iterations < 1 or warmup < 0:
        raise ValueError(f"need iterations >= 1 and warmup >= 0, got {iterations}, {warmup}")
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
        for _ in range(warmup):
            runner_a.time_once(x)
            runner_b.time_once(x)
        lat_a: list[float] = []
        lat_b: list[float] = []
        for _ in range(iterations):
            lat_a.append(float(runner_a.time_once(x)))
            lat_b.append(float(runner_b.time_once(x)))
            if stop is not None and stop(lat_a, lat_b):
                break
        ra = runner_a.result(int(bs), lat_a, warmup)
        rb = runner_b.result(int(bs), lat_b, warmup)
        for r in (ra, rb):
            r.settings["interleaved"] = True
        results.append(PairResult(
            batch_size=int(bs), a=ra, b=rb, latency_ratio=ratio_stats(lat_a, lat_b),
            throughput_ratio=rb.throughput / ra.throughput if ra.throughput > 0 else float("nan"),
            latencies_a=lat_a, latencies_b=lat_b,
        ))
    return results
