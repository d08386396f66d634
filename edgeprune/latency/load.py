"""How busy the machine was while something was timed: the load figures a latency table and a ``--latency`` prune
record beside their timings (issue 52).

A 2-core box with other work on it (a shared workstation, a CI runner) moves every time: a table's self-check or a
latency budget's measurement taken there mixes the machine's load into what it reports. Neither can be made immune
to it, but both can say it: :func:`snapshot` takes the figures (the kernel's 1-minute load average, the cores this
process may use, the clock the timings were read from), :func:`loaded` says in words when they mean a loaded
machine -- a load average above the usable cores, or the dense model's own repeated timings spread past
:data:`SPREAD_BOUND` -- and :func:`drift` how much a model's time moved between two timings of it.

A ``--latency`` prune's measurement is wall-clock (``time.perf_counter`` around each run, ``runners/``); a latency
table's is its ``--clock`` (``auto``: the calling thread's CPU time for one CPU thread, else wall); the figures say
which. ``benchmarks/load_clock.py`` measures both clocks on the same runs, quiet and loaded
(docs/latency_budget.md).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

#: the default clock of a timing: wall time (``time.perf_counter`` around one run, ``runners/``)
CLOCK = "wall"

#: a dense model's repeated timings whose p90 / p10 - 1 exceeds this were taken on a loaded machine
SPREAD_BOUND = 0.25


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def snapshot(clock: str = CLOCK) -> dict[str, Any]:
    """``{"load_1m", "load_5m", "cores", "clock"}``: the load averages (runnable processes, averaged by the kernel
    over 1 and 5 minutes; None where the platform has none), the usable cores and the clock the timings beside it
    were read from (default :data:`CLOCK`; a latency table's own: ``wall`` or ``cpu``, its ``--clock``)."""
    try:
        one, five, _ = os.getloadavg()
    except (AttributeError, OSError):
        one = five = None
    return {"load_1m": None if one is None else round(float(one), 2),
            "load_5m": None if five is None else round(float(five), 2), "cores": usable_cores(), "clock": clock}


def busiest(snapshots: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The snapshot with the highest 1-minute load average among ``snapshots`` (None entries skipped; one without a
    load average counts as the lowest), or None when there is none."""
    snaps = [s for s in snapshots if s]
    return max(snaps, key=lambda s: -1.0 if s.get("load_1m") is None else s["load_1m"]) if snaps else None


def spread_of(ms: Sequence[float]) -> float | None:
    """p90 / p10 - 1 of repeated timings of one model (None for fewer than 3): how far its own times scattered."""
    xs = sorted(float(x) for x in ms)
    if len(xs) < 3 or xs[0] <= 0:
        return None
    p10, p90 = xs[int(0.1 * (len(xs) - 1))], xs[int(round(0.9 * (len(xs) - 1)))]
    return p90 / p10 - 1.0 if p10 > 0 else None


def loaded(load: dict[str, Any], dense_spread: float | None = None) -> str | None:
    """Why the machine counts as loaded while it timed, in words, or None: the 1-minute load average above the usable
    cores (``load average 5.8 on 2 cores``), and/or the dense model's own timings spread past :data:`SPREAD_BOUND`
    (``the dense model's own timings spread 41%``)."""
    why = []
    one, cores = load.get("load_1m"), load.get("cores") or 1
    if one is not None and one > cores:
        why.append(f"load average {one:.1f} on {cores} cores")
    if dense_spread is not None and dense_spread > SPREAD_BOUND:
        why.append(f"the dense model's own timings spread {100 * dense_spread:.0f}%")
    return "; ".join(why) or None


def drift(first_ms: float, again_ms: float) -> float:
    """How much a model's time moved between two timings of it: ``again / first - 1`` (0.1: 10% slower later)."""
    return float(again_ms) / float(first_ms) - 1.0


__all__ = ["CLOCK", "SPREAD_BOUND", "busiest", "drift", "loaded", "snapshot", "spread_of", "usable_cores"]
