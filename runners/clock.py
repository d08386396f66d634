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
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

#: the two clocks, as records name them
WALL, CPU = "wall", "cpu"


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
        t0 = time.thread_time()
        self._runner.time_once(x)
        return (time.thread_time() - t0) * 1000.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


__all__ = ["CPU", "WALL", "ThreadClock", "clock_for"]
