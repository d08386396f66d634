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
from edgeprune.pruning.latency_loop import Measurer, correct, not_measured, table_measurer, with_value
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
    (``edgeprune.pruning.latency_loop``): ``measurer(dense, pruned)`` measures, by default the table's backend where
    it runs here on the table's device; ``config.verify_budget=False`` skips the measurement.

    Returns:
        (the pruned model in eval mode, its run record).

    Raises:
        UserError: bad settings (``embed_sparsity="auto"`` included), unsupported model, empty or mis-shaped
            calibration data, an unknown device.
    """
    check_config(config)
    if is_auto(config):
        raise UserError("embed_sparsity='auto' runs one prune per candidate: use edgeprune.prune "
                        "(edgeprune.pruning.embed_auto.choose_embed)")
    device = work_device(config, resolve_device(device))
    dense = None if inplace else model.eval()  # the caller's model, not modified: the reference of a measurement

    def one_round(cfg: CorpConfig, statistics: Any = None) -> tuple[PruneState, nn.Module, dict[str, Any]]:
        work = model if dense is None else copy.deepcopy(dense)
        work.eval()
        state = PruneState(model=work, anatomy=find_anatomy(work), config=cfg, asked=config,
                           batches=None, num_images=None, progress=progress, device=device,  # type: ignore[arg-type]
                           extra={"statistics": statistics} if statistics is not None else {})
        return (state, *_run(state, spec, calibration, batch_size, calibration_info))

    first, pruned, record = one_round(config)
    budget = config.budget
    if budget is None or not budget.model_class.verifiable:
        return pruned, record
    measure, reason = measurer, None
    if not config.verify_budget:
        reason = "not asked (--no-verify-latency)"
    elif dense is None:
        reason = "inplace=True: no dense model left to measure against"
    elif measure is None:
        measure, reason = table_measurer(budget, find_anatomy(dense))
    if reason is not None or measure is None or dense is None:
        not_measured(record, budget, reason or "no measurer")
        return pruned, record
    stats = first.extra.get("statistics")

    def run_round(value: float) -> tuple[nn.Module, dict[str, Any]]:
        cfg = check_config(dataclasses.replace(config, budget=with_value(budget, value)))
        return one_round(cfg, stats)[1:]

    return correct(run_round, dense, (pruned, record), budget, measure, config.correction_tolerance,
                   config.correction_rounds)


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
