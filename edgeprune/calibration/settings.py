"""The statistics section of a prune's settings (issue 53): how the calibration pass gathers its statistics
(``edgeprune.calibration``; sequential calibration, METHODS.md §5)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from edgeprune.settings import Section, setting


@dataclasses.dataclass(frozen=True)
class StatisticsSection(Section):
    """Calibration statistics: the MLP token sample, sequential calibration, Gram precision and memory limits."""

    name: ClassVar[str] = "statistics"
    title: ClassVar[str] = "Calibration statistics"

    gram_tokens: int | None = setting(
        None, "MLP statistics from K random tokens per image (the MLP covariance is the largest cost of the "
        "calibration pass; an estimator, docs/prune_cost.md); 0 = all tokens (exact).", metavar="K",
        shown_default="auto: a sample on large calibration sets")
    sequential: bool = setting(False, "Sequential calibration: statistics of each block on the output of the "
                               "already pruned blocks.", switch="flag")
    gram_dtype: str = setting("float32", "dtype of the per-batch Gram products (float32 or float64).", cli=False)
    qk_memory_limit_gb: float = setting(4.0, "Above this, per-image Q/K Grams are not stored (a second pass).",
                                        unit="GiB", cli=False)
    sequential_memory_gb: float = setting(4.0, "Sequential calibration's token streams in memory up to this.",
                                          unit="GiB", cli=False)


__all__ = ["StatisticsSection"]
