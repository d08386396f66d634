"""Measure and correct a measured budget (issue 40 item 3; issue 53 item 4: one loop for prune and derive): a
``--latency`` prune or derivation that lands where asked.

A latency table predicts; the machine decides. After the prune (round 0) the pruned model is benched against the
dense one, interleaved, on the table's backend (:func:`table_measurer`, where that backend runs here on the table's
device). When the measured value misses the budget by more than ``CorpConfig.correction_tolerance`` (default 3%),
the allocation is redone with the budget corrected -- from the statistics and the dense model already at hand (no
second calibration pass: ``corp_prune(statistics=...)``) -- at most ``CorpConfig.correction_rounds`` times.

The correction works on the predicted value p (what the table says the allocation costs, as a fraction of the
dense model's predicted cost, or in ms for an absolute budget) and the measured value m (the same unit: the pruned
/ dense ratio of one interleaved run, or the pruned model's ms). With the target T, the next allocation aims at

    p* = p_k * T / m_k                                         (one point: the table's error taken as a factor)
    p* = p_k + (T - m_k) (p_k - p_{k-1}) / (m_k - m_{k-1})      (two points or more: the secant of m(p))

so a table off by a fixed factor is corrected in one round and one off by an offset (per-call overheads the table
does not see) in a few (tests/test_latency_loop.py drives both on a synthetic device). The round whose measured
value is closest to the budget is returned; the record's ``latency_check`` keeps every round (budget asked of the
allocator, predicted, measured, miss, seconds). Where the backend is absent the result is predicted, not measured,
and the record says why.

:func:`measure_and_correct` is the loop's one entry, taking the :class:`~edgeprune.budget.correction.Correction`
settings: the prune (``edgeprune.pruning.run``) re-allocates from its statistics, NuWa's ``derive --latency``
(``edgeprune.nuwa.measured``) re-plans the dims from the prepared SKP anchor, statistics and SVD factors and reads
its record through a :data:`RecordView`.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from edgeprune.anatomy import ViTAnatomy, find_anatomy
from edgeprune.budget.budget import Budget
from edgeprune.budget.correction import Correction
from edgeprune.budget.latency import load_table
from edgeprune.budget.latency_check import latency_check, measure_pair, why_not_measured
from edgeprune.errors import UserError
from exporters.onnx import export_onnx

#: (dense model, pruned model) -> {"dense_ms", "pruned_ms", "ratio"} (ratio = pruned / dense of one run)
Measurer = Callable[[nn.Module, nn.Module], dict]
#: budget value asked of the allocator -> (pruned model, run record) of one round
RoundRunner = Callable[[float], "tuple[nn.Module, dict[str, Any]]"]
#: budget asked of the planner -> (model, run record) of one round (the prune's re-allocation, NuWa's re-plan)
Replan = Callable[[Budget], "tuple[nn.Module, dict[str, Any]]"]
#: a round's run record -> (its latency entry: {"predicted", "target", "dense", ...}, the seconds the round took)
RecordView = Callable[[dict], "tuple[dict, float]"]


def allocation_view(kind: str) -> RecordView:
    """The :data:`RecordView` of a prune's record: the allocation report's entry of the budget's kind (its measured
    cost model) and the run's ``timing.total_s``."""
    return lambda rec: (rec["allocation"][kind], float(rec["timing"]["total_s"]))


#: the measure-and-correct loop times pairs until the median ratio's 95% interval is this narrow (a fraction
#: of it; +-1%: a third of the default 3% tolerance), at most ``iterations`` pairs (issue 40 item 4)
SETTLE = 0.02


def table_measurer(budget: Budget, anatomy: ViTAnatomy, iterations: int = 20,
                   warmup: int = 3, tolerance: float | None = None) -> tuple[Measurer | None, str | None]:
    """(a measurer on the table's backend, None) where its measurements can be repeated here, else
    (None, the reason). It times dense and pruned interleaved until the ratio is settled
    (:data:`SETTLE`) or, with ``tolerance`` and a budget relative to dense, until the measurement says whether
    the ratio is within ``tolerance`` of the budget or not (``runners.compare.ratio_decided``), at most
    ``iterations`` pairs."""
    band = None
    if tolerance is not None and budget.unit is None:  # a fraction of dense: the band the loop's verdict uses
        band = (budget.value * (1 - tolerance), budget.value * (1 + tolerance))
    key = load_table(budget.table).key
    reason = why_not_measured(key)
    if reason is not None:
        return None, reason
    shape = (anatomy.in_chans, *anatomy.img_size)
    kept: dict[int, Any] = {}  # the dense model's ONNX export, made once for every round (issue 40)

    def measure(dense: nn.Module, pruned: nn.Module) -> dict:
        onnx = None
        if key.get("backend") == "onnxruntime":
            if id(dense) not in kept:
                kept.clear()
                folder = tempfile.TemporaryDirectory(prefix="edgeprune-latency-dense-")
                path = export_onnx(dense.eval(), Path(folder.name) / "dense.onnx", shape, dynamic_batch=False,
                                   batch_size=int(key["batch"]))
                kept[id(dense)] = (folder, path)  # the folder is removed with the measurer
            onnx = kept[id(dense)][1]
        with torch.no_grad():
            return measure_pair(dense.eval(), pruned.eval(), key, shape, iterations, warmup, dense_onnx=onnx,
                                settle=SETTLE, band=band)

    return measure, None


def _point(lat: dict, measured: dict, absolute: bool) -> tuple[float, float, float]:
    """(predicted, measured, target) of one round in the budget's unit (ratio to dense, or ms); ``lat``: the
    round's latency entry (predicted, target and dense cost of the table, :data:`RecordView`)."""
    if absolute:
        return float(lat["predicted"]), float(measured["pruned_ms"]), float(lat["target"])
    dense = float(lat["dense"])
    return float(lat["predicted"]) / dense, float(measured["ratio"]), float(lat["target"]) / dense


def next_value(points: list[tuple[float, float]], target: float) -> float:
    """The predicted value to aim at next (module doc): from ``points`` [(predicted, measured)], oldest first.

    Raises:
        ValueError: no points, or a non-positive measured value.
    """
    if not points or points[-1][1] <= 0:
        raise ValueError(f"need a positive measured value, got {points!r}")
    p, m = points[-1]
    if len(points) >= 2:
        p0, m0 = points[-2]
        if m != m0 and (p - p0) / (m - m0) > 0:  # a rising m(p): the secant
            guess = p + (target - m) * (p - p0) / (m - m0)
            if guess > 0:
                return guess
    return p * target / m


def correct(run_round: RoundRunner, dense: nn.Module, first: tuple[nn.Module, dict], budget: Budget,
            measure: Measurer, tolerance: float, max_rounds: int,
            view: RecordView | None = None) -> tuple[nn.Module, dict]:
    """Measure round 0 (``first``) and re-allocate until the measured value is within ``tolerance`` of the
    budget or ``max_rounds`` corrections were made (module doc).

    ``run_round(value)`` redoes the allocation for the budget value ``value`` (a fraction of dense or ms, as
    ``budget.value``); ``view`` reads a round's record (default: a prune's, :func:`allocation_view`; NuWa's derive
    passes its own, ``edgeprune.nuwa.measured``). A :class:`UserError` from ``run_round`` (the corrected budget
    below the cheapest allocation) ends the loop with the rounds so far.

    Returns:
        the round closest to the budget: (pruned model, its record with ``latency_check``: the verdict of that
        round plus ``rounds``, ``chosen_round``, ``tolerance``, ``max_rounds``, ``stopped``).
    """
    absolute = budget.unit is not None
    view = view or allocation_view(budget.kind)
    rounds: list[dict] = []
    points: list[tuple[float, float]] = []
    best: tuple[float, int, nn.Module, dict, dict] | None = None
    model, rec, value, stopped = first[0], first[1], budget.value, "round limit"
    target = 0.0
    for k in range(max_rounds + 1):
        t0 = time.perf_counter()
        measured = measure(dense, model)
        lat, seconds = view(rec)
        pred, meas, target_k = _point(lat, measured, absolute)
        target = target_k if k == 0 else target  # the budget asked (later rounds ask the table for another value)
        miss = meas / target - 1.0
        rounds.append({"round": k, "budget_value": value, "predicted": pred, "measured": meas, "target": target,
                       "miss": miss, "measured_ms": dict(measured), "seconds": seconds,
                       "measure_seconds": time.perf_counter() - t0})
        if best is None or abs(miss) < best[0]:
            best = (abs(miss), k, model, rec, measured)
        if abs(miss) <= tolerance:
            stopped = "within tolerance"
            break
        if k == max_rounds:
            break
        points.append((pred, meas))
        value = next_value(points, target)
        if not absolute:
            value = min(value, 1.0)
        try:
            model, rec = run_round(value)
        except UserError as err:  # e.g. the corrected budget is below the cheapest allocation
            stopped = f"correction stopped: {err}"
            break
    assert best is not None
    _miss, k, model, rec, measured = best
    # the verdict against the budget asked (round 0's target), not the corrected value the table was asked for
    asked = view(first[1])[0]["target"]
    chk = latency_check({**view(rec)[0], "target": asked, "absolute": absolute}, measured, None)
    chk.update(rounds=rounds, chosen_round=k, tolerance=tolerance, max_rounds=max_rounds, stopped=stopped,
               rule="the round whose measured value is closest to the budget (edgeprune.budget.correction_loop)")
    rec["latency_check"] = chk
    return model, rec


def not_measured(rec: dict, budget: Budget, reason: str, view: RecordView | None = None) -> None:
    """Put the predicted-only ``latency_check`` (with the reason it was not measured) in ``rec`` (``view``: as
    :func:`correct`'s; without one, a prune's record, where a record without the entry gets nothing)."""
    if view is None:
        lat = rec.get("allocation", {}).get(budget.kind)
    else:
        lat = view(rec)[0]
    if lat is not None:
        rec["latency_check"] = latency_check({**lat, "absolute": budget.unit is not None}, None, reason)


def with_value(budget: Budget, value: float) -> Budget:
    """``budget`` asking the allocator for ``value`` instead (same kind, unit and table)."""
    return dataclasses.replace(budget, value=float(value))


def measure_and_correct(replan: Replan, reference: nn.Module, first: tuple[nn.Module, dict[str, Any]],
                        budget: Budget | None, correction: Correction, *, view: RecordView | None = None,
                        measurer: Measurer | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The measure-and-correct loop of a model ``first`` made for ``budget`` (module doc): the one entry of the
    prune and of NuWa's derivation.

    Args:
        replan: ``replan(budget)`` makes the model again for the budget with its value corrected, from the state
            the caller prepared (the prune's statistics; NuWa's anchor, statistics and factors).
        reference: the model the budget is a fraction of (the dense / base model; eval mode, not modified).
        first: (model, run record) made for ``budget`` (round 0).
        budget: the budget asked; nothing is measured unless its cost model is ``verifiable`` (a latency table).
        correction: the loop's settings (``verify_budget``, ``correction_tolerance``, ``correction_rounds``; None
            = :data:`~edgeprune.budget.correction.DEFAULTS`).
        view: reads a round's record (:data:`RecordView`; default a prune's, :func:`allocation_view`).
        measurer: ``(reference, model) -> {"dense_ms", "pruned_ms", "ratio"}``; default the table's backend where
            it runs here on the table's device (:func:`table_measurer`).

    Returns:
        ``first`` itself without a measured budget (its record's ``latency_check`` says why nothing was measured
        where the budget is a latency one), else the round closest to the budget (:func:`correct`).
    """
    if budget is None or not budget.model_class.verifiable:
        return first
    c = correction.resolved()
    measure, reason = measurer, c.not_asked()
    if reason is None and measure is None:
        measure, reason = table_measurer(budget, find_anatomy(reference), tolerance=c.correction_tolerance)
    if reason is not None or measure is None:
        not_measured(first[1], budget, reason or "no measurer", view)
        return first
    return correct(lambda value: replan(with_value(budget, value)), reference, first, budget, measure,
                   c.correction_tolerance, c.correction_rounds, view)
