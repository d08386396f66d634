"""Let the budget choose D' (issue 33): ``CorpConfig.embed_sparsity = "auto"``.

With a budget (``--flops`` / ``--params``; a latency table cannot price a sliced model) and
``embed_order="first"`` the slice and the width pruning share the budget: a smaller D' leaves less
to take from the widths. Which split is best depends on the model (docs/embed.md: on fmnist-vit a
quarter of the stream is nearly free, on DINOv2 it costs 4.6-7 points alone), so it is measured: for
every candidate embed sparsity of ``CorpConfig.embed_candidates`` (default :data:`EMBED_CANDIDATES`; 0 is always
one) mapped to its D' on
the ``round_to`` grid (:func:`~edgeprune.embed.slice.embed_kept_dim`; candidates with the D' of an
earlier one dropped), the whole prune -- slice, budgeted widths, output correction -- runs on a copy of
the model, and the relative squared error of its final output against the dense model's on the first
``CorpConfig.allocation_check_images`` calibration images (the images and the measure of
``edgeprune.allocation.select``; the dense outputs computed once) decides. The candidate with the
smallest error is the result (ties: the smaller sparsity), so auto is never worse than widths alone (S = 0) on
that measured error. The search is :func:`edgeprune.pruning.search.search`; this module is its axis
(:data:`EMBED_AXIS`).

Cost: K candidates = K whole prunes, each with its own calibration pass (a sliced model needs its own
statistics), plus one dense forward pass over the check images.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.allocation.greedy import cheapest
from edgeprune.anatomy import find_anatomy
from edgeprune.embed.settings import is_auto
from edgeprune.embed.slice import apply_embed_structure, embed_kept_dim
from edgeprune.embed.step import embed_budget, refuse_distributed
from edgeprune.errors import UserError
from edgeprune.pruning import search
from edgeprune.pruning.corp import check_prunable
from edgeprune.pruning.run import run_prune
from edgeprune.pruning.search import Axis, Found

__all__ = ["EMBED_AXIS", "EMBED_CANDIDATES", "candidate_sparsities", "choose_embed", "is_auto"]

#: embed sparsities tried by ``embed_sparsity="auto"`` (``CorpConfig.embed_candidates`` overrides them)
EMBED_CANDIDATES = (0.0, 0.125, 0.25)


def _fixed(config, sparsity: float):
    """``config`` as the fixed-sparsity prune of one candidate (what ``--embed-sparsity S`` builds)."""
    return dataclasses.replace(config, embed_sparsity=sparsity, embed_candidates=None)


def _floor_check(model: nn.Module, anatomy, config, sparsity: float, dim: int) -> None:
    """Raises UserError when the slice cannot be applied to ``model`` (``anatomy`` its anatomy;
    :func:`~edgeprune.embed.step.embed_budget`'s checks) or the budget is below the cheapest allocation
    of the model sliced to ``dim`` (its shapes only: :func:`apply_embed_structure` on a copy; no pass)."""
    cfg = embed_budget(_fixed(config, sparsity), anatomy)
    probe = copy.deepcopy(model)
    apply_embed_structure(probe, {"embed_dim": dim})
    floor, _dense, target = cheapest(find_anatomy(probe), cfg)
    if floor > target:
        raise UserError(f"the budget is below the cheapest allocation of the model sliced to D' = {dim}")


def candidate_sparsities(model: nn.Module, config) -> tuple[list[tuple[float, int]], list[dict]]:
    """The candidates of ``embed_sparsity="auto"`` for ``model`` under ``config`` (before any pass).

    Returns:
        (kept: ``[(embed sparsity, D')]``, 0 first then ascending, one per D'; skipped: ``[{embed_sparsity,
        embed_dim, reason}]`` -- the same D' as a smaller sparsity, a slice the model or the rounding
        refuses, or a budget below the sliced model's cheapest allocation).
    """
    anatomy = find_anatomy(model)
    asked = config.embed_candidates if config.embed_candidates is not None else EMBED_CANDIDATES
    kept: list[tuple[float, int]] = []
    skipped: list[dict] = []
    for s in [0.0] + sorted({float(v) for v in asked if float(v) > 0}):
        dim = None
        try:
            dim = embed_kept_dim(anatomy.embed_dim, s, config.round_to)
            same = next((k for k, d in kept if d == dim), None)
            if same is not None:
                skipped.append({"embed_sparsity": s, "embed_dim": dim, "reason": f"same D' as {same:g}"})
                continue
            if s > 0:
                _floor_check(model, anatomy, config, s, dim)
        except UserError as err:
            skipped.append({"embed_sparsity": s, "embed_dim": dim, "reason": str(err)})
            continue
        kept.append((s, dim))
    return kept, skipped


def _achieved(rec: dict, kind: str) -> float:
    """The pruned model's cost as a fraction of the unsliced dense model's (``kind``: "flops" or
    "params", the budgets auto takes)."""
    return rec[kind] / rec[f"dense_{kind}"]


def _check(model: nn.Module, config) -> None:
    """The refusals before any pass: torch.distributed, the budget against the dense model (as a fixed sparsity)."""
    refuse_distributed()
    check_prunable(find_anatomy(model), config)


def _runner(model: nn.Module, calibration: Any, config, **kwargs: Any) -> Callable[[tuple[float, int]], Any]:
    """``run((sparsity, D'))``: the whole prune of one candidate (its own calibration pass: a sliced model needs its
    own statistics), :func:`~edgeprune.pruning.run.run_prune` with the other keywords of ``prune``."""
    return lambda candidate: run_prune(model, calibration, _fixed(config, candidate[0]), **kwargs)


def _row(candidate: tuple[float, int], rec: dict, config, err: float, seconds: float) -> dict:
    """One candidate's record entry (``budget_fraction``: the cost achieved, of the unsliced dense model's)."""
    s, dim = candidate
    return {"embed_sparsity": s, "embed_dim": dim, "budget_fraction": _achieved(rec, config.budget.kind),
            "check_error": err, "seconds": seconds}


def _section(found: Found) -> dict:
    """The record's ``embed_auto``."""
    s, dim = found.chosen
    return {"asked": "auto", "chosen": s, "embed_dim": dim, "images": found.images, "candidates": found.rows,
            "skipped": found.skipped, "seconds": found.seconds,
            "rule": "lowest relative squared error of the final output vs the dense model on the check images "
                    "(edgeprune.pruning.embed_auto, measure of edgeprune.allocation.select)"}


#: ``embed_sparsity="auto"`` as an axis of :func:`edgeprune.pruning.search.search`
EMBED_AXIS = Axis(name="embed", flag="--embed-sparsity", setting="embed_sparsity", is_asked=is_auto, check=_check,
                  candidates=candidate_sparsities, skip_label=lambda s: f"{s['embed_sparsity']:g}", runner=_runner,
                  row=_row, section=_section)


def choose_embed(model: nn.Module, calibration: Any, config, batches: Callable[[], Iterable[torch.Tensor]], *,
                 inplace: bool = False, **kwargs: Any) -> tuple[nn.Module, dict]:
    """``edgeprune.prune`` with ``embed_sparsity="auto"``: one whole prune (:func:`~edgeprune.pruning.run.run_prune`)
    per candidate (module doc), the one with the smallest check error returned (:func:`edgeprune.pruning.search.search`
    on :data:`EMBED_AXIS`).

    Args: as :func:`~edgeprune.pruning.search.search` (``config`` with ``embed_sparsity="auto"``; ``**kwargs``: the
        other keywords of ``prune``: spec, progress, batch_size, device, calibration_info, measurer).

    Returns:
        the chosen candidate's ``PruneResult``; its record has ``embed_auto``: ``candidates`` (per
        candidate ``embed_sparsity``, ``embed_dim``, ``budget_fraction`` achieved, ``check_error``,
        ``seconds``), ``skipped``, ``chosen``, ``embed_dim``, ``images``, ``seconds``, ``rule``; its
        ``config`` holds the chosen sparsity (rerunning it gives the same model).

    Raises:
        UserError: ``inplace``, torch.distributed, no candidate left, or as ``prune`` (before any pass:
            the model, rounding and budget checks of a fixed sparsity).
    """
    if not is_auto(config):
        raise UserError(f"choose_embed needs embed_sparsity='auto', got {config.embed_sparsity!r}")
    return search.search(EMBED_AXIS, model, calibration, config, batches, inplace=inplace, **kwargs)
