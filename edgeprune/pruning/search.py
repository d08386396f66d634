"""The candidate search of the ``"auto"`` settings (issue 53 item 4), written once: ``embed_sparsity="auto"``
(:data:`edgeprune.pruning.embed_auto.EMBED_AXIS`) and ``tokens_merge="auto"``
(:data:`edgeprune.pruning.tokens_auto.TOKENS_AXIS`) are each an :class:`Axis`, :func:`search` the search.

The search: the axis's refusals and its candidates (with the skipped ones and why, all before any pass); the dense
model's output on the first ``CorpConfig.allocation_check_images`` calibration images, computed once; one prune per
candidate (the axis says how: a whole prune, or a reuse of the first candidate's statistics); the relative squared
error of each pruned model's final output against the dense one on those images (the images and the measure of
``edgeprune.allocation.select``); the smallest error wins, ties going to the earlier candidate (the axes list the
lightest change first, so a tie keeps the lighter one); the axis's record section (``<name>_auto``) is written into
the chosen candidate's run record.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.allocation.outputs import detached_cpu, output_error, output_tensor
from edgeprune.allocation.select import check_images
from edgeprune.errors import UserError

__all__ = ["Axis", "Found", "search"]

#: ``run(candidate) -> (pruned model, its run record)``: one candidate's prune (:attr:`Axis.runner` builds it)
RunFn = Callable[[Any], "tuple[nn.Module, dict]"]


@dataclasses.dataclass(frozen=True)
class Found:
    """What a search found, handed to :attr:`Axis.section`: the chosen candidate, its check error, the number of
    check images, every candidate's row (:attr:`Axis.row`), the skipped ones, the search's seconds, and the
    ``run`` callable the axis built (its own state, e.g. the statistics it reused)."""

    chosen: Any
    check_error: float
    images: int
    rows: list
    skipped: list
    seconds: float
    run: RunFn


@dataclasses.dataclass(frozen=True)
class Axis:
    """One setting whose ``"auto"`` the search chooses.

    Attributes:
        name: ``"embed"`` / ``"tokens"``: the record section is ``<name>_auto``.
        flag: the command-line option, for the messages (``"--embed-sparsity"``).
        setting: the ``CorpConfig`` field that is ``"auto"`` (``"embed_sparsity"``).
        is_asked: ``is_asked(config)``: whether that field is ``"auto"`` (``edgeprune.embed.settings.is_auto``).
        check: ``check(model, config)``: the axis's refusals before any pass (UserError).
        candidates: ``candidates(model, config) -> (kept, skipped)``: the candidates, lightest first (ties go to the
            earlier), and ``[{..., reason}]`` of the ones skipped before any pass.
        skip_label: ``skip_label(skipped entry) -> str``: the candidate named in the "no candidate left" message.
        runner: ``runner(model, calibration, config, **prune keywords) -> run``: ``run(candidate)`` prunes a copy
            of ``model`` with the candidate's fixed config and returns ``(pruned model, run record)``.
        row: ``row(candidate, record, config, check_error, seconds) -> dict``: the candidate's record entry.
        section: ``section(found: Found) -> dict``: the record section.
    """

    name: str
    flag: str
    setting: str
    is_asked: Callable[[Any], bool]
    check: Callable[[nn.Module, Any], None]
    candidates: Callable[[nn.Module, Any], "tuple[list, list[dict]]"]
    skip_label: Callable[[dict], str]
    runner: Callable[..., RunFn]
    row: Callable[[Any, dict, Any, float, float], dict]
    section: Callable[[Found], dict]


@torch.no_grad()
def _dense_reference(axis: Axis, model: nn.Module, batches: Callable[[], Iterable[torch.Tensor]], n: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first ``n`` calibration images (n', C, H, W) on the CPU, the dense model's output on them, in eval mode;
    the model's mode is restored)."""
    x = check_images(batches, n)
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        out = output_tensor(model(x.to(device))) if x is not None else None
    finally:
        model.train(was_training)
    if out is None:
        raise UserError(f"{axis.flag} auto needs calibration images and a model whose output is a tensor "
                        "or a tuple/dict of tensors")
    return x, detached_cpu(out)


def search(axis: Axis, model: nn.Module, calibration: Any, config: Any, batches: Callable[[], Iterable[torch.Tensor]],
           *, inplace: bool = False, **kwargs: Any) -> tuple[nn.Module, dict]:
    """``edgeprune.prune`` with ``axis``'s setting ``"auto"``: one prune per candidate, the one of the smallest check
    error returned (module doc).

    Args:
        axis: the setting searched.
        model: the dense model (not modified).
        calibration: as for ``prune``.
        config: a valid :class:`~edgeprune.corp.CorpConfig` with ``axis``'s setting ``"auto"``.
        batches: callable returning fresh (B, C, H, W) calibration batches (the check images are its first
            ``config.allocation_check_images``).
        inplace: refused (every candidate prunes a copy).
        **kwargs: the other keywords of ``prune``, for ``axis.runner``.

    Returns:
        (the chosen candidate's pruned model, its run record with the ``<axis.name>_auto`` section).

    Raises:
        UserError: ``inplace``, the axis's refusals, no candidate left (the reasons listed), all before any pass;
            or as ``prune``.
    """
    if inplace:
        raise UserError(f"{axis.flag} auto prunes one copy per candidate; inplace=True is not supported")
    axis.check(model, config)
    kept, skipped = axis.candidates(model, config)
    if not kept:
        raise UserError(f"{axis.flag} auto: no candidate left (" + "; ".join(
            f"{axis.skip_label(s)}: {s['reason']}" for s in skipped) + ")")
    t0 = time.perf_counter()
    x, dense_out = _dense_reference(axis, model, batches, config.allocation_check_images)
    run = axis.runner(model, calibration, config, **kwargs)
    rows: list[dict] = []
    best = None
    for candidate in kept:
        t = time.perf_counter()
        pruned, rec = run(candidate)
        with torch.no_grad():
            err = output_error(output_tensor(pruned(x)), dense_out)
        rows.append(axis.row(candidate, rec, config, err, time.perf_counter() - t))
        if best is None or err < best[0]:  # ties: the earlier, lighter candidate
            best = (err, candidate, pruned, rec)
    err, chosen, pruned, rec = best
    rec[f"{axis.name}_auto"] = axis.section(Found(chosen=chosen, check_error=err, images=int(x.shape[0]), rows=rows,
                                                  skipped=skipped, seconds=time.perf_counter() - t0, run=run))
    return pruned, rec
