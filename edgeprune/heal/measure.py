"""Alignment loss (eq. 1) over a data set: the eval passes of a heal (initial loss, per-epoch
keep-best / holdout loss, final loss) and :func:`measure_alignment` for held-out images."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from edgeprune.anatomy import find_anatomy
from edgeprune.heal import data_parallel as dp
from edgeprune.heal.alignment import BlockCapture, per_image_alignment
from edgeprune.heal.targets import CalibrationSet, DenseTargets, iter_batches, model_device
from edgeprune.torch_device import resolve_device


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Move a list of target tensors to ``device`` (no copy when they are already there)."""
    return [t.to(device, non_blocking=True) for t in tensors]


@torch.no_grad()
def mean_alignment(capture: BlockCapture, targets, calib: CalibrationSet, batch_size: int, kind: str,
                   indices: torch.Tensor | None = None, device: torch.device | str = "cpu") -> float:
    """Mean per-image alignment loss of the captured model to ``targets`` over ``calib`` (the images
    ``indices``, default all), summed in float64; under torchrun each rank takes a slice and the
    sums are all-reduced, so every rank returns the same value."""
    dev = torch.device(device)
    order = torch.arange(len(calib)) if indices is None else indices
    order = dp.share(order)  # under torchrun: this rank's slice, the sums all-reduced below
    total, n = 0.0, 0
    for idx in iter_batches(len(order), batch_size, order):
        x = calib.get(idx).to(dev)
        per = per_image_alignment(capture.run(x), to_device(targets.get(idx, x), dev), kind)
        total += float(per.double().sum())
        n += len(idx)
    total, n = dp.all_reduce_sums([total, n])
    return total / max(n, 1)


@torch.no_grad()
def measure_alignment(model: nn.Module, dense: nn.Module, images: Any, *, batch_size: int = 64,
                      loss: str = "cosine", device: str | None = None) -> float:
    """Mean alignment loss (eq. 1) of ``model`` to ``dense`` over ``images`` (tensor or source).

    Use it on held-out images to check that healing generalises.

    Args:
        device: run both models there ("cpu", "cuda", "cuda:N", "auto"; moved there and back);
            None = ``model``'s own device (``dense`` is moved there for the pass).

    Raises:
        UserError: unknown device or CUDA not available, empty calibration set.
    """
    dev = model_device(model) if device is None else torch.device(resolve_device(device))
    calib = CalibrationSet(images)
    homes = [(m, model_device(m)) for m in (model, dense)]
    targets = DenseTargets(dense)
    try:
        model.to(dev)
        dense.to(dev)
        with BlockCapture(find_anatomy(model)) as cap:
            return mean_alignment(cap, targets, calib, batch_size, loss, device=dev)
    finally:
        targets.close()
        for m, home in homes:
            m.to(home)
