"""Python API: load a model, prune it with CORP, evaluate, save.

    import edgeprune
    spec = edgeprune.get_model_spec("fmnist-vit")
    model = spec.create()
    calib = spec.calibration_source(512)
    config = edgeprune.CorpConfig.from_target("both", 0.5)   # or: target="both", sparsity=0.5
    result = edgeprune.prune(model, calib, config, spec=spec)
    edgeprune.save_run("runs/fmnist-50", result.model, result.record)

The pipeline behind :func:`prune` lives in ``edgeprune.pruning`` (config sections, stages, record).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.backbone import set_backbone
from edgeprune.corp.config import CorpConfig
from edgeprune.errors import UserError
from edgeprune.pruning.config import corp_config
from edgeprune.pruning.dispatch import prune_model
from edgeprune.pruning.record import base_model_record, structure_summary
from edgeprune.pruning.run import calibration_batches, work_device
from edgeprune.zoo.canonical import canonical_model

__all__ = ["PruneResult", "prune", "corp_config", "structure_summary", "base_model_record", "calibration_batches",
           "work_device"]


@dataclasses.dataclass
class PruneResult:
    """Outcome of :func:`prune`.

    Attributes:
        model: the pruned model (eval mode).
        record: the run record (see ``edgeprune.artifact``), JSON-serialisable.
    """

    model: nn.Module
    record: dict[str, Any]


_UNSET: Any = object()


def prune(model: nn.Module, calibration: torch.Tensor | Any | Callable[[], Iterable[torch.Tensor]],
          config: CorpConfig | None = None, *, spec=None, progress: bool = False, inplace: bool = False,
          batch_size: int = 32, device: str = "cpu", calibration_info: dict | None = None,
          measurer: Callable[[nn.Module, nn.Module], dict] | None = None, target: str = _UNSET,
          sparsity: float | None = _UNSET, backbone: str | None = None, **settings: Any) -> PruneResult:
    """One-shot structured pruning with CORP (corp-v1 Alg. 1), through the stages of ``edgeprune.pruning``.

    Either pass a :class:`~edgeprune.corp.CorpConfig` (what the CLI builds), or the same settings as keywords
    (``target="both", sparsity=0.5, mlp_sparsity=..., attn_sparsity=..., compensation=, criterion=, ridge_alpha=,
    qk_ridge_alpha=, round_to=, gram_dtype=, qk_solver=`` and any other CorpConfig field, or ``flops=`` /
    ``params=`` / ``latency=`` (with ``latency_table=``) for a budget instead of a sparsity, see
    :func:`~edgeprune.pruning.config.corp_config`); not both.

    Args:
        model: a timm ViT (or ``dinov2-s14``), eval mode. Copied unless ``inplace``. A timm ``Eva`` (DINOv3, EVA-02,
            ``vit_*rope*``) is first converted exactly into a ``VisionTransformer`` with fixed RoPE tables
            (:mod:`edgeprune.zoo.eva`): the result is always a new model then, ``inplace`` or not.
        calibration: unlabeled images -- a tensor (N, C, H, W), a data source with ``batches(batch_size)``, or a
            callable returning an iterable of (B, C, H, W) batches.
        config: the CORP settings (sparsity per module, compensation, ridge alphas, budget, ...).
        spec: the model's :class:`ModelSpec`, recorded in the run record (without it, see
            :func:`~edgeprune.pruning.record.base_model_record`).
        progress: progress display (:mod:`edgeprune.progress`: bars on a terminal).
        inplace: prune ``model`` itself.
        batch_size: calibration batch size (tensor or source input).
        device: torch device of the calibration pass: "cpu", "cuda", "cuda:N" or "auto" (cuda if available, else
            cpu). The statistics are accumulated on it (float32 products summed in float64); the closed-form
            solves run in float64 on the CPU and the model is returned on the CPU
            (``edgeprune.calibration.collect``). Recorded in the run record. ``sequential`` calibration runs on the
            CPU whatever the device (recorded "cpu").
        calibration_info: extra calibration description for the record (seed, size requested).
        measurer: with a latency budget, ``measurer(dense, pruned) -> {"dense_ms", "pruned_ms", "ratio"}`` measures
            a round of the measure-and-correct loop (``edgeprune.budget.correction_loop``); default: the table's
            backend where it runs here on the table's device, else the result is predicted only (said in the
            record's ``latency_check``).
        backbone: the attribute path of the ViT inside a network (``"encoder"``, ``"pretrained.vit"``); default: the
            model itself when it is a ViT, else the only ViT inside it (:mod:`edgeprune.backbone`). The path is
            recorded on ``model`` (attribute ``edgeprune_backbone``). The network's output may be a tensor or a
            tuple/dict of tensors; its checks compare the network's outputs (relative squared error per output,
            averaged).
        target, sparsity, **settings: the keyword form of ``config`` (see above).

    Under an initialised torch.distributed group (torchrun) every rank calls this with the same arguments; each
    streams its share of the calibration batches, the statistics are combined (:mod:`edgeprune.distributed`,
    METHODS.md §5) and every rank returns the same pruned model; the record's ``calibration`` says
    ``world_size`` and ``backend``.

    Returns:
        :class:`PruneResult` with the pruned model and its run record (:func:`edgeprune.artifact.new_record`;
        ``config`` holds every config field, the budget in its record form).

    Raises:
        UserError: bad settings, unsupported model, empty or mis-shaped calibration data, both ``config`` and
            keyword settings given, an unknown device or CUDA not available; no ViT in the network, several and no
            ``backbone``, or a ``backbone`` path that is not a ViT.
    """
    if config is None:
        config = corp_config(None if target is _UNSET else target, None if sparsity is _UNSET else sparsity,
                             **settings)
    elif target is not _UNSET or sparsity is not _UNSET or settings:
        raise UserError("give either a CorpConfig or keyword settings (target=, sparsity=, ...), not both")
    if backbone is not None:
        set_backbone(model, backbone)
    model = canonical_model(model)  # a timm Eva (RoPE) becomes its exact VisionTransformer form (zoo.canonical)
    pruned, record = prune_model(model, calibration, config, spec=spec, progress=progress, inplace=inplace,
                                 batch_size=batch_size, device=device, calibration_info=calibration_info,
                                 measurer=measurer)
    return PruneResult(model=pruned, record=record)
