"""A latency table build's settings, declared once (issue 53): the section ``[timing]`` (docs/latency.md).

``edgeprune latency-table``'s setting options, its ``--help-all`` "Method" group and its recipe table ``[timing]`` are
generated from :class:`LatencyTableSection` (``edgeprune.cli.generate``); the field names are
:func:`edgeprune.jobs.latency_table_run.latency_table_run`'s keywords, which become the build's
:class:`~edgeprune.latency.build.BuildOptions` (None: the profile's, or the spread check's defaults; a bad batch,
thread count or backend is refused by the build, one line naming the option, before any timing). The job's own
inputs (the model, the device profile, the table file, ``--force``, ``--quiet``) are not settings. Recipes of a9f53a4
had these keys in ``[method]`` and ``[runtime]`` (``threads``): still read there
(``edgeprune.cli.recipe.LEGACY_SECTIONS``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from edgeprune.latency.build import PRECISIONS
from edgeprune.latency.measure import list_timers
from edgeprune.settings import Declared, Section, declared_of, setting

STATISTICS = ("p50", "min")
CLOCKS = ("auto", "wall", "cpu")


@dataclasses.dataclass(frozen=True)
class LatencyTableSection(Section):
    """How each entry of a latency table is timed: batch, threads, precision, backend, the runs and their check."""

    name: ClassVar[str] = "timing"
    title: ClassVar[str] = "Method"  # the --help-all group of latency-table's timing options, as before

    batch: int | None = setting(None, "Images per timed batch [the profile's largest bench batch size <= 8].",
                                metavar="N", essential=True)
    threads: int | None = setting(None, "Intra-op threads (CPU) [the profile's].", metavar="N")
    precision: str | None = setting(None, "Backend precision [the profile's].", choices=PRECISIONS)
    backend: str | None = setting(None, "Timing backend [the profile's].", choices=list_timers)
    warmup: int | None = setting(None, "Untimed runs per entry [the profile's].", metavar="N")
    iterations: int | None = setting(None, "Timed runs per entry, p50 reported [the profile's].", metavar="N")
    max_seconds: float | None = setting(1.0, "Stop an entry's timed runs after S seconds (at least 5 runs): bounds "
                                        "the build time.", metavar="S", minimum=0.01)
    statistic: str = setting("p50", "What an entry reports of its timed runs (min: steadier on a machine shared with "
                             "other work).", choices=STATISTICS)
    interleave: bool = setting(True, "Time each entry side by side with the dense sub-block and keep the ratios: "
                               "steady on a machine whose load drifts (about 2x the time of --no-interleave).",
                               switch="pair")
    repeats: int | None = setting(None, "Spread check: cut an entry's timed runs into N groups (1: no check) [3].",
                                  metavar="N")
    spread: float | None = setting(None, "Spread check: time an entry again when its groups disagree by more than F "
                                   "[0.05: 5%%].", metavar="F")
    retries: int | None = setting(None, "Spread check: at most N more attempts for an entry whose groups disagree, "
                                  "0-10 [2].", metavar="N")
    clock: str = setting("auto", "cpu: this thread's CPU time per run (--threads 1 on a CPU profile): steady on a "
                         "machine shared with other jobs; wall: elapsed time; auto: cpu where it applies, else wall.",
                         choices=CLOCKS)
    tokens: str | None = setting(None, "A token axis (for prune --latency with --tokens-merge): also time the dense "
                                 "MLP and attention sub-blocks at these token counts (each above the prefix tokens, "
                                 "at most the model's) [none].", metavar="N1,N2,...")
    grid: Any = setting(None, "Further limits of the grid (edgeprune.latency.grid.make_grid: max_mlp, ...).",
                        cli=False)


#: the sections of a latency table build, in help / recipe order
LATENCY_TABLE_SECTIONS: tuple[type[Section], ...] = (LatencyTableSection,)


def latency_table_declared() -> dict[str, Declared]:
    """``{field name: Declared}`` of every latency-table setting (``edgeprune.settings.declared_of``)."""
    return declared_of(LATENCY_TABLE_SECTIONS)


__all__ = ["CLOCKS", "LATENCY_TABLE_SECTIONS", "LatencyTableSection", "STATISTICS", "latency_table_declared"]
