"""The clock a CPU measurement reads: this thread's CPU time around each run, for a backend that computes on the
calling thread (issue 52).

On a machine shared with other work, the wall time of a run includes the time other processes held the core; the
calling thread's CPU time (``time.thread_time``) does not. With one intra-op thread, ONNX Runtime and torch compute
on the caller, so its CPU time is the run's compute time. Measured on this project's 2-core box
(``benchmarks/load_clock.py``, deit_small batch 1, ONNX Runtime, 1 thread, the same runs read by both clocks): with
four CPU-bound processes beside it the dense model's wall p50 rose 1102 -> 1634 ms and its CPU-time p50 stayed at
95.5 -> 96.2 ms; the per-pair ratio's p10-p90 spread was 0.43-0.70 by wall time and 0.49-0.62 by CPU time
(docs/latency_budget.md). With several threads the work runs on threads the caller does not own and only the wall
clock sees it: :func:`clock_for` picks.

Blocks (issue 56 item 3): a batch-1 run of a small model takes ~2 ms, about a scheduler slice, so single runs are noisy
in either clock. :func:`time_block` times ``k`` back-to-back runs with one clock read before and one after the whole
block (not ``k`` reads); :func:`block_runs` picks ``k`` so that a block lasts at least a minimum block time.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

#: the two clocks, as records name them
WALL, CPU = "wall", "cpu"

#: the clocks' readings in seconds, looked up at call time (tests replace them with fakes)
wall_seconds = time.perf_counter
thread_seconds = time.thread_time

#: the most runs one block may hold (a model that reports ~0 ms would otherwise ask for millions)
MAX_BLOCK_RUNS = 10000


def block_runs(per_run_ms: float, min_block_ms: float) -> int:
    """Runs per block: the least ``k >= 1`` with ``k * per_run_ms >= min_block_ms`` (ms both), at most
    :data:`MAX_BLOCK_RUNS`; 1 when ``min_block_ms <= 0`` (one run per turn) or the model is slower than the block.

    Raises:
        ValueError: ``min_block_ms`` negative or not finite.
    """
    if not math.isfinite(min_block_ms) or min_block_ms < 0:
        raise ValueError(f"min block time must be >= 0 ms, got {min_block_ms}")
    if min_block_ms == 0 or per_run_ms >= min_block_ms:
        return 1
    if not per_run_ms > 0:
        return MAX_BLOCK_RUNS
    k = math.ceil(min_block_ms / per_run_ms)
    while k * per_run_ms < min_block_ms:  # float rounding of the quotient
        k += 1
    return int(min(max(k, 1), MAX_BLOCK_RUNS))


def time_block(runner: Any, x: np.ndarray, k: int) -> float:
    """Time ``k`` back-to-back runs of ``runner`` on ``x`` as one block and return the block's time in ms (divide
    by ``k`` for the latency of one run). ``k == 1``: the runner's ``time_once``; else the runner's own
    ``time_block`` when it has one (:class:`ThreadClock`, :meth:`runners.base.Runner.time_block`), else a wall
    clock around ``k`` ``time_once``.

    Raises:
        ValueError: ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"a block needs k >= 1 runs, got {k}")
    if k == 1:  # one run: the runner's (or clock's) own timing of it, as without blocks
        return float(runner.time_once(x))
    own = getattr(runner, "time_block", None)
    if own is not None:
        return float(own(x, k))
    t0 = wall_seconds()
    for _ in range(k):
        runner.time_once(x)
    return (wall_seconds() - t0) * 1000.0


def clock_for(device: str, threads: int | None) -> str:
    """``"cpu"`` (the calling thread's CPU time) for a CPU backend with exactly one thread, else ``"wall"``."""
    return CPU if device == "cpu" and threads == 1 else WALL


class ThreadClock:
    """``runner`` with :meth:`time_once` read from the calling thread's CPU time (ms) instead of the runner's own
    wall-clock timing; every other attribute is the runner's.

    Args:
        runner: a :class:`runners.base.Runner` whose backend computes on the calling thread (one CPU thread).
    """

    clock = CPU

    def __init__(self, runner: Any) -> None:
        self._runner = runner

    def time_once(self, x: np.ndarray) -> float:
        """One run's CPU time on this thread, ms."""
        t0 = thread_seconds()
        self._runner.time_once(x)
        return (thread_seconds() - t0) * 1000.0

    def time_block(self, x: np.ndarray, k: int) -> float:
        """``k`` back-to-back runs' CPU time on this thread, ms: one clock read before the block, one after."""
        t0 = thread_seconds()
        for _ in range(k):
            self._runner.time_once(x)
        return (thread_seconds() - t0) * 1000.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


__all__ = ["CPU", "MAX_BLOCK_RUNS", "WALL", "ThreadClock", "block_runs", "clock_for", "time_block"]
