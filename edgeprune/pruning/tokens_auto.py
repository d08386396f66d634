"""Let the budget choose the token-merge schedule (issue 44 item 3): ``CorpConfig.tokens_merge = "auto"``.

With a ``--latency`` budget whose table has a token axis, a merge schedule is priced (``edgeprune.budget.latency``:
the merged blocks at their token counts) and the widths get what the merges leave of the budget: more merging,
wider layers. Which split is best depends on the model and the device, so it is measured, as
``embed_sparsity="auto"`` measures D' (``edgeprune.pruning.embed_auto``): for every candidate schedule of
``CorpConfig.tokens_candidates`` (default: :func:`default_candidates`; 0 -- the widths alone -- is always one;
candidates with the per-block r of an earlier one, ones the model cannot merge and ones the budget cannot reach
are skipped and recorded, before any pass) the prune -- budgeted widths at the merged token counts, the merge,
the output correction, and, where the table's backend runs here, the measure-and-correct loop of the latency
budget (``edgeprune.budget.correction_loop``) -- runs on a copy of the model, and the relative squared error of its
final output against
the dense model's on the first ``CorpConfig.allocation_check_images`` calibration images (the images and the
measure of ``edgeprune.allocation.select``; the dense outputs computed once) decides. The candidate with the
smallest error is the result (ties: the lighter schedule), so auto is never worse than widths alone on that
measured error. The search is :func:`edgeprune.pruning.search.search`; this module is its axis (:data:`TOKENS_AXIS`).

Why every candidate is measured and corrected, not only the chosen one: a table built before its token axis timed
the merge step (``tokens.merge``) prices the merged blocks but not the merge itself, and any table's prediction of a
merged model is only as good as its self-check, so a merging candidate can run slower than predicted; compared at
their predicted cost, the merging candidates would be favoured unfairly (on fmnist-vit at x0.35, with such a table,
the choice measured +49% over the budget before its correction, docs/tokens.md). After each candidate's correction
they are compared at the latency measured. Where nothing is measured (no backend here, ``verify_budget=False``)
they are compared at the predicted cost, the record says so per candidate (``measured`` None).

Cost: one calibration pass (the first candidate's statistics are reused by the others and by the correction
rounds: a merge comes after the width stages, so every candidate calibrates the same dense model), plus per
candidate and correction round the allocation, solve, output correction and a latency measurement, plus per
candidate a forward pass over the check images, plus one dense forward pass over the check images.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.anatomy import find_anatomy
from edgeprune.distributed import is_distributed
from edgeprune.errors import UserError
from edgeprune.settings import SettingError
from edgeprune.layers.class_token_block import class_token_plan
from edgeprune.pruning import search
from edgeprune.pruning.config import check_config
from edgeprune.pruning.corp import check_prunable
from edgeprune.pruning.run import measure_and_correct, round_runner
from edgeprune.pruning.search import Axis, Found
from edgeprune.tokens.apply import check_mergeable, num_tokens, unmerges
from edgeprune.tokens.schedule import DECREASING, is_tokens_auto, plan_merges
from edgeprune.torch_device import resolve_device

__all__ = ["CONSTANT_FRACTIONS", "DECREASING_FRACTIONS", "default_candidates", "candidate_schedules",
           "choose_tokens", "is_tokens_auto", "TOKENS_AXIS"]

#: the default candidates (:func:`default_candidates`): constant schedules that merge away about these fractions of
#: the mergeable tokens by the last block, light to heavy ...
CONSTANT_FRACTIONS = (0.125, 0.25, 0.5)
#: ... and ToMe's decreasing schedules (more merging early) of about these fractions
DECREASING_FRACTIONS = (0.25, 0.5)


def default_candidates(num_blocks: int, tokens: int, prefix: int, class_token_last: bool) -> list:
    """The default candidate schedules of a model of ``num_blocks`` blocks and ``tokens`` tokens (``prefix`` of them
    never merged; ``class_token_last``: its last block merges nothing): 0, then for each fraction f of
    :data:`CONSTANT_FRACTIONS` the constant ``R = max(1, round(f (tokens - prefix) / merging blocks))``, and for each
    of :data:`DECREASING_FRACTIONS` ``"decreasing:R"`` with ``R = max(1, round(f (tokens - prefix) / num_blocks))``
    (its r averages R over the blocks). Heavy ones the tokens do not allow are skipped by
    :func:`candidate_schedules`."""
    m = tokens - prefix
    merging = max(1, num_blocks - (1 if class_token_last else 0))
    return ([0] + [max(1, round(f * m / merging)) for f in CONSTANT_FRACTIONS]
            + [f"{DECREASING}:{max(1, round(f * m / num_blocks))}" for f in DECREASING_FRACTIONS])


#: fractions of the most a block can merge ((N - prefix) // 2) of the default candidates of a network that unmerges
UNMERGE_FRACTIONS = (0.25, 0.5, 0.75)


def unmerge_candidates(tokens: int, prefix: int) -> list:
    """The default candidates of a network that merges inside each block and unmerges (every block sees all
    ``tokens``): 0 and the constant ``R = max(1, round(f (tokens - prefix) // 2))`` for f in
    :data:`UNMERGE_FRACTIONS`."""
    most = (tokens - prefix) // 2
    return [0] + sorted({max(1, round(f * most)) for f in UNMERGE_FRACTIONS})


def _fixed(config, schedule: Any):
    """``config`` as the fixed-schedule prune of one candidate (what ``--tokens-merge SCHEDULE`` builds), checked."""
    return check_config(dataclasses.replace(config, tokens_merge=schedule, tokens_candidates=None))


def _plain(schedule: Any) -> Any:
    """A schedule in its record (JSON) form: an int, a list of ints or ``"decreasing:R"``."""
    return list(schedule) if isinstance(schedule, tuple) else schedule


def candidate_schedules(model: nn.Module, config) -> tuple[list[tuple[Any, list[int]]], list[dict]]:
    """The candidates of ``tokens_merge="auto"`` for ``model`` under ``config`` (before any pass).

    Returns:
        (kept: ``[(schedule, r per block)]``, 0 first, then light to heavy: by tokens merged, then by the tokens
        the MLPs see, descending; skipped: ``[{schedule,
        reason}]`` -- the same r per block as an earlier candidate, a schedule the model's token counts do not
        allow, a table whose token axis does not reach its counts, or a budget below the cheapest allocation at
        its merged counts).

    Raises:
        UserError: a model the merge does not fit (``edgeprune.tokens.apply.check_mergeable``).
    """
    vit, _ = check_mergeable(model)
    anatomy = find_anatomy(model)
    n, prefix, depth = num_tokens(vit), int(getattr(vit, "num_prefix_tokens", 0)), len(vit.blocks)
    unmerge = unmerges(model)  # a network: merged inside each block and unmerged (edgeprune.tokens.unmerge)
    cls_last = bool(class_token_plan(config, anatomy)) and not unmerge
    asked = config.tokens_candidates
    if asked is None:
        asked = unmerge_candidates(n, prefix) if unmerge else default_candidates(depth, n, prefix, cls_last)
    planned, skipped = [], []
    for s in [0] + [s for s in asked if s != 0]:
        try:
            r, tokens = plan_merges(s, depth, n, prefix, cls_last, unmerge)
            planned.append((s, r, sum(r), -sum(t - ri for t, ri in zip(tokens, r))))
        except UserError as err:
            skipped.append({"schedule": _plain(s), "reason": str(err)})
    planned.sort(key=lambda p: p[2:])  # 0 first, then light to heavy: tokens merged, then the later the lighter
    kept: list[tuple[Any, list[int]]] = []
    for s, r, *_ in planned:
        same = next((k for k, kr in kept if kr == r), None)
        if same is not None:
            skipped.append({"schedule": _plain(s), "reason": f"same r per block as {_plain(same)}"})
            continue
        try:
            check_prunable(anatomy, _fixed(config, s))  # the budget at its merged token counts, the table's axis
        except UserError as err:
            skipped.append({"schedule": _plain(s), "reason": str(err)})
            continue
        kept.append((s, r))
    return kept, skipped


def _pruner(model: nn.Module, calibration: Any, spec: Any, progress: bool, batch_size: int, device: str,
            calibration_info: dict | None) -> Callable[..., tuple[nn.Module, dict]]:
    """``prune_one(cfg, asked=None) -> (pruned model, run record)``: the stages of ``run_prune`` on a copy of
    ``model`` with ``cfg`` (:func:`~edgeprune.pruning.run.round_runner`; the record's ``config``: ``asked``, default
    ``cfg``); the first call's calibration statistics are kept and handed to every later call (``run_prune``'s own
    rounds do the same); ``prune_one.reused`` lists, per call, whether it reused them."""
    kept: dict[str, Any] = {}
    reused: list[bool] = []
    one_round = round_runner(model, calibration, spec=spec, progress=progress, batch_size=batch_size, device=device,
                             calibration_info=calibration_info)

    def prune_one(cfg, asked=None) -> tuple[nn.Module, dict]:
        reused.append(kept.get("stats") is not None)
        state, pruned, record = one_round(cfg, kept.get("stats"), asked)
        kept.setdefault("stats", state.extra.get("statistics"))
        return pruned, record

    prune_one.reused = reused  # type: ignore[attr-defined]
    return prune_one


def _check(model: nn.Module, config) -> None:
    """The refusals before any pass: torch.distributed, the config (a model the merge does not fit: the candidates)."""
    if is_distributed():
        raise SettingError("{tokens_merge} auto runs in one process for now (each rank would judge its candidates "
                           "on its own images); run without torchrun")
    check_config(config)


def _runner(model: nn.Module, calibration: Any, config, *, spec: Any = None, progress: bool = False,
            batch_size: int = 32, device: str = "cpu", calibration_info: dict | None = None,
            measurer: Any = None) -> Callable[[tuple[Any, list[int]]], tuple[nn.Module, dict]]:
    """``run((schedule, r))``: one candidate's prune (:func:`_pruner`: the first candidate's calibration statistics
    reused), then the measure-and-correct loop of ``run_prune`` (:func:`~edgeprune.pruning.run.measure_and_correct`)
    on it, its rounds re-allocating from the same statistics; ``run.reused`` as ``prune_one.reused``."""
    model.eval()  # the dense model: the reference of every candidate's measurement
    prune_one = _pruner(model, calibration, spec, progress, batch_size, resolve_device(device), calibration_info)

    def run(candidate: tuple[Any, list[int]]) -> tuple[nn.Module, dict]:
        cfg = _fixed(config, candidate[0])
        return measure_and_correct(lambda c: prune_one(c, cfg), model, prune_one(cfg), cfg, measurer)

    run.reused = prune_one.reused  # type: ignore[attr-defined]
    return run


def _row(candidate: tuple[Any, list[int]], rec: dict, config, err: float, seconds: float) -> dict:
    """One candidate's record entry (``predicted``: the allocation's predicted cost in the budget's unit -- ms per
    batch for a latency table -- and ``predicted_fraction`` of the dense model's; ``measured``: the pruned / dense
    latency ratio its measured correction kept, None where not measured; ``rounds``: its correction's rounds)."""
    schedule, r = candidate
    lat = rec["allocation"][config.budget.kind]
    check = rec.get("latency_check") or {}
    measured = (check.get("measured") or {}).get("ratio")
    return {"schedule": _plain(schedule), "r": list(r), "predicted": float(lat["predicted"]),
            "predicted_fraction": float(lat["predicted"]) / float(lat["dense"]),
            "measured": None if measured is None else float(measured), "rounds": len(check.get("rounds", [])),
            "check_error": err, "seconds": seconds}


def _section(found: Found) -> dict:
    """The record's ``tokens_auto``."""
    s, r = found.chosen
    return {"asked": "auto", "chosen": _plain(s), "r": list(r), "images": found.images, "candidates": found.rows,
            "skipped": found.skipped, "check_error": found.check_error, "seconds": found.seconds,
            "statistics_reused": sum(found.run.reused),  # type: ignore[attr-defined]
            "latency_loop": "every candidate",
            "rule": "lowest relative squared error of the final output vs the dense model on the check images, "
                    "each candidate after its measured correction (edgeprune.pruning.tokens_auto, measure of "
                    "edgeprune.allocation.select)"}


#: ``tokens_merge="auto"`` as an axis of :func:`edgeprune.pruning.search.search`
TOKENS_AXIS = Axis(name="tokens", flag="--tokens-merge", setting="tokens_merge", is_asked=is_tokens_auto,
                   check=_check, candidates=candidate_schedules, skip_label=lambda s: f"{s['schedule']}",
                   runner=_runner, row=_row, section=_section)


def choose_tokens(model: nn.Module, calibration: Any, config, batches: Callable[[], Iterable[torch.Tensor]], *,
                  inplace: bool = False, spec: Any = None, progress: bool = False, batch_size: int = 32,
                  device: str = "cpu", calibration_info: dict | None = None,
                  measurer: Any = None) -> tuple[nn.Module, dict]:
    """``edgeprune.prune`` with ``tokens_merge="auto"``: one prune per candidate schedule, each measured and corrected
    (module doc), the one with the smallest check error returned (:func:`edgeprune.pruning.search.search` on
    :data:`TOKENS_AXIS`).

    Args: as :func:`~edgeprune.pruning.search.search` (``config`` with ``tokens_merge="auto"``, a latency budget;
        spec, progress, batch_size, device, calibration_info, measurer: as for ``prune``).

    Returns:
        (the chosen candidate's pruned model, its run record). The record has ``tokens_auto``: ``candidates`` (per
        candidate ``schedule``, ``r``, ``predicted`` cost, ``predicted_fraction``, ``measured`` ratio, ``rounds``,
        ``check_error``, ``seconds``), ``skipped`` (``schedule``, ``reason``), ``chosen`` (the schedule), ``r``,
        ``check_error`` (the returned model's), ``images``, ``seconds``, ``statistics_reused`` (the
        prunes that reused the first one's calibration statistics), ``latency_loop``, ``rule``; its
        ``config`` holds the chosen schedule (rerunning it gives the same model).

    Raises:
        UserError: ``inplace``, torch.distributed, a model the merge does not fit, no candidate left (the reasons
            listed), or as ``prune``; all before any calibration pass.
    """
    if not is_tokens_auto(config):
        raise UserError(f"choose_tokens needs tokens_merge='auto', got {config.tokens_merge!r}")
    return search.search(TOKENS_AXIS, model, calibration, config, batches, inplace=inplace, spec=spec,
                         progress=progress, batch_size=batch_size, device=device, calibration_info=calibration_info,
                         measurer=measurer)
