"""Measure and correct a derivation's latency budget (issue 40 item 5): ``derive --latency`` lands where asked.

The prune's loop (:func:`edgeprune.budget.correction_loop.measure_and_correct`, issue 53: one loop) on NuWa's
plans. Round 0 is the derivation as planned
from the table; where the table's backend runs here (``table_measurer``, or a ``measurer`` given by the caller), the
derived model is benched against the base model, interleaved. When the measured value (the derived / base ratio of
one run, or the derived model's ms for an absolute budget) misses the budget by more than
``DeriveConfig.correction_tolerance``, the dims are re-planned (:func:`edgeprune.nuwa.derive.derive_from`'s
stage 6 only: rho candidates, MLP fill, build and score) for the budget value the loop's step gives
(``latency_loop.next_value``: the measured / predicted ratio, then the secant), from the same prepared state:
the SKP anchor, the calibration statistics and the SVD factors are not redone. At most
``DeriveConfig.correction_rounds`` corrections; the round whose measured value is closest to the budget is
returned, and its record's ``latency_check`` keeps every round (budget value asked of the planner, predicted,
measured, miss, seconds of the re-plan). ``verify_budget=False``, or a backend absent here, records the
prediction only, with the reason.
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

import torch.nn as nn

from edgeprune.budget import Budget
from edgeprune.nuwa.config import DeriveConfig
from edgeprune.budget import correction_loop
from edgeprune.budget.correction import Correction
from edgeprune.budget.correction_loop import Measurer, RecordView


class _Result(Protocol):
    model: nn.Module
    record: dict


R = TypeVar("R", bound=_Result)


def derivation_view(kind: str) -> RecordView:
    """The :data:`~edgeprune.budget.correction_loop.RecordView` of a derivation's record: the budget record's entry of
    the cost model (``derivation.budget.<kind>``: predicted, target and dense ms) and the round's own seconds (the
    plan search: ``timing.search_s``; the prepared stages are shared by every round)."""
    return lambda rec: (rec["derivation"]["budget"][kind], float(rec["timing"]["search_s"]))


def measure_and_correct(plan: Callable[[Budget], R], base: nn.Module, first: R, budget: Budget, config: DeriveConfig,
                        measurer: Measurer | None = None) -> R:
    """Measure ``first`` (the derivation for ``budget``) and re-plan with a corrected budget (module doc).

    Args:
        plan: budget -> a derivation result (``.model``, ``.record``) from the prepared state.
        base: the base model the budget is a fraction of (CPU, eval mode; not modified): the reference of a
            measurement.
        first: ``plan(budget)``, already made.
        budget: the budget asked; nothing is measured unless its cost model is ``verifiable`` (a latency table).
        config: the derivation's settings (``verify_budget``, ``correction_tolerance``, ``correction_rounds``).
        measurer: ``(base, derived) -> {"dense_ms", "pruned_ms", "ratio"}``; default: the table's backend where it
            runs here on the table's device.

    Returns:
        the round closest to the budget (``first`` itself when nothing is measured); its record has
        ``latency_check`` for a latency budget (measured with ``rounds``, or predicted with ``not_measured``).

    Raises:
        UserError: from ``plan`` on round 0 only (later rounds that fail end the loop, recorded in ``stopped``).
    """
    results = {id(first.record): first}

    def replan(b: Budget) -> tuple[nn.Module, dict]:
        res = plan(b)
        results[id(res.record)] = res
        return res.model, res.record

    _model, rec = correction_loop.measure_and_correct(replan, base, (first.model, first.record), budget,
                                                      Correction.of(config), view=derivation_view(budget.kind),
                                                      measurer=measurer)
    return results[id(rec)]
