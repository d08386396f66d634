"""The one-shot prune end to end: the config checked, the model copied, the stages run, the record written.

:func:`run_prune` runs one fixed config; ``embed_sparsity="auto"`` runs it once per candidate
(``edgeprune.pruning.embed_auto``); :func:`edgeprune.pruning.dispatch.prune_model` chooses between the two.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.anatomy import find_anatomy
from edgeprune.corp.config import CorpConfig
from edgeprune.data.sources import TensorSource
from edgeprune.distributed import shard_calibration
from edgeprune.embed.settings import is_auto
from edgeprune.errors import UserError
from edgeprune.pruning import stages as _stages  # noqa: F401  (registers the built-in stages)
from edgeprune.pruning import tokens_stage as _tokens_stage  # noqa: F401  (token merging, issue 44)
from edgeprune.pruning.config import check_config
from edgeprune.budget import correction_loop
from edgeprune.budget.correction import Correction
from edgeprune.budget.correction_loop import Measurer, not_measured
from edgeprune.pruning.record import base_model_record, prune_record, structure_summary
from edgeprune.pruning.stage import PruneState, run_stages
from edgeprune.torch_device import resolve_device


def calibration_batches(calibration: Any, batch_size: int) -> tuple[Callable[[], Iterable[torch.Tensor]], str,
                                                                   int | None]:
    """(callable returning fresh (B, C, H, W) batches, description, number of images or None).

    Under torch.distributed (torchrun) the callable yields this rank's share of the batches
    (:func:`edgeprune.distributed.shard_calibration`); the number of images is the whole set's.

    Raises:
        UserError: an empty set, or something that is not a tensor / data source / callable.
    """
    if isinstance(calibration, torch.Tensor):
        calibration = TensorSource(calibration, None, f"tensor {tuple(calibration.shape)}")
    if hasattr(calibration, "batches"):
        source = calibration
        num_images = len(source)
        if num_images == 0:
            raise UserError("the calibration set is empty")
        return (shard_calibration(lambda: (x for x, _ in source.batches(batch_size)), num_images, batch_size,
                                  source), getattr(source, "description", type(source).__name__), num_images)
    if callable(calibration):
        return shard_calibration(calibration, None, batch_size), "custom iterable", None
    raise UserError("calibration must be a tensor, a data source or a callable returning batches")


def work_device(config: CorpConfig, device: str) -> str:
    """The device a prune with ``config`` runs on, given the resolved ``device``: "cpu" for
    ``sequential`` calibration (it keeps its token streams in host memory and runs every pass on
    the CPU; the record says where the work ran), ``device`` otherwise."""
    return "cpu" if config.sequential else device


def run_prune(model: nn.Module, calibration: Any, config: CorpConfig, *, spec: Any = None, progress: bool = False,
              inplace: bool = False, batch_size: int = 32, device: str = "cpu", calibration_info: dict | None = None,
              measurer: Measurer | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Prune ``model`` with ``config``, a fixed embed sparsity (arguments as :func:`edgeprune.prune`).

    A budget whose cost model is ``verifiable`` (a latency table) is measured after the prune and corrected
    (``edgeprune.budget.correction_loop``): ``measurer(dense, pruned)`` measures, by default the table's backend where
    it runs here on the table's device; ``config.verify_budget=False`` skips the measurement.

    Returns:
        (the pruned model in eval mode, its run record).

    Raises:
        UserError: bad settings (``embed_sparsity="auto"`` included), unsupported model, empty or mis-shaped
            calibration data, an unknown device.
    """
    config = check_config(config)
    if is_auto(config):
        raise UserError("embed_sparsity='auto' runs one prune per candidate: use edgeprune.prune "
                        "(edgeprune.pruning.embed_auto.choose_embed)")
    device = work_device(config, resolve_device(device))
    dense = None if inplace else model.eval()  # the caller's model, not modified: the reference of a measurement
    one_round = round_runner(model, calibration, spec=spec, progress=progress, batch_size=batch_size, device=device,
                             calibration_info=calibration_info, copy_model=dense is not None)
    first, pruned, record = one_round(config)
    if dense is None and config.budget is not None and config.budget.model_class.verifiable:
        not_measured(record, config.budget, Correction.of(config).not_asked()
                     or "inplace=True: no dense model left to measure against")
        return pruned, record
    stats = first.extra.get("statistics")
    return measure_and_correct(lambda cfg: one_round(cfg, stats)[1:], model, (pruned, record), config, measurer)


#: ``one_round(cfg, statistics=None, asked=None) -> (state, pruned model, run record)`` (:func:`round_runner`)
RoundFn = Callable[..., "tuple[PruneState, nn.Module, dict[str, Any]]"]


def round_runner(model: nn.Module, calibration: Any, *, spec: Any = None, progress: bool = False,
                 batch_size: int = 32, device: str = "cpu", calibration_info: dict | None = None,
                 copy_model: bool = True) -> RoundFn:
    """``one_round(cfg, statistics=None, asked=None)``: the stages of the one-shot prune with ``cfg`` on a copy of
    ``model`` (``copy_model=False``: on ``model`` itself), reusing ``statistics`` of an earlier round on the same
    dense model when given (no calibration pass: the latency correction, ``tokens_merge="auto"``); the record's
    ``config`` is ``asked`` (default ``cfg``). Returns ``(state, pruned model, record)``; the state's
    ``extra["statistics"]`` holds the round's statistics. ``device``: resolved (:func:`work_device` is applied)."""

    def one_round(cfg: CorpConfig, statistics: Any = None, asked: CorpConfig | None = None
                  ) -> tuple[PruneState, nn.Module, dict[str, Any]]:
        work = copy.deepcopy(model) if copy_model else model
        work.eval()
        state = PruneState(model=work, anatomy=find_anatomy(work), config=cfg, asked=asked or cfg,
                           batches=None, num_images=None, progress=progress,  # type: ignore[arg-type]
                           device=work_device(cfg, device),
                           extra={"statistics": statistics} if statistics is not None else {})
        return (state, *_run(state, spec, calibration, batch_size, calibration_info))

    return one_round


def measure_and_correct(run_config: Callable[[CorpConfig], "tuple[nn.Module, dict[str, Any]]"], dense: nn.Module,
                        first: tuple[nn.Module, dict[str, Any]], config: CorpConfig,
                        measurer: Measurer | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """The measure-and-correct loop (``edgeprune.budget.correction_loop.measure_and_correct``) of a prune ``first``
    made with ``config``: ``run_config(cfg)`` prunes again with the budget's value corrected (the same
    statistics); ``measurer(dense, pruned)`` measures, by default the table's backend where it runs here.

    Returns:
        (pruned model, run record) of the round closest to the budget, ``first`` without a measured budget.
    """
    def replan(budget: Any) -> tuple[nn.Module, dict[str, Any]]:
        return run_config(check_config(dataclasses.replace(config, budget=budget)))

    return correction_loop.measure_and_correct(replan, dense, first, config.budget, Correction.of(config),
                                               measurer=measurer)


def _run(state: PruneState, spec: Any, calibration: Any, batch_size: int,
         calibration_info: dict | None) -> tuple[nn.Module, dict[str, Any]]:
    """The stages and the record of :func:`run_prune` on a prepared state."""
    before: dict[str, Any] = {}

    def after_checks(st: PruneState) -> None:  # the dense model as it is, the data; then the clock starts
        before["base"], before["dense"] = base_model_record(st.model, spec), structure_summary(st.model)
        st.batches, before["description"], st.num_images = calibration_batches(calibration, batch_size)
        before["t0"] = time.perf_counter()

    run_stages(state, after_checks)
    info = state.info
    record = prune_record(state.asked, before["base"], before["dense"], structure_summary(state.model), info,
                          state.extra.get("last_block") or {}, info.get("bias_correction"),
                          source=before["description"], batch_size=batch_size, calibration_info=calibration_info,
                          seconds=time.perf_counter() - before["t0"], device=state.device)
    clash = sorted(set(state.record) & set(record))
    if clash:
        raise RuntimeError(f"a stage's record entries {clash} clash with the run record's own")
    record.update(state.record)
    return state.model.eval(), record
