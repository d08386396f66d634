"""Fidelity of a pruned dense-prediction network to its dense reference (issue 55, item 3).

A network's output is one tensor or several (a tuple or dict: a depth map and features, a mask and scores); each is
compared with the dense network's on the same held-out images, in float64:

* ``rel_error``: ``||out - ref||^2 / ||ref||^2`` over all images, the relative squared error that the allocation
  and the checks minimise (METHODS.md §6, "Dense outputs"); the network's value is the mean over its outputs;
* ``psnr_db``: ``10 log10(peak^2 / MSE)`` with ``peak`` the reference's range (max - min) over all images, at
  most :data:`PSNR_CAP` (identical outputs; a run record holds finite numbers only); the network's value is the
  lowest over its outputs (the least faithful one);
* for an output that is a (B, 1, H, W) map in [0, 1] (saliency, a mask): ``mae``, ``pearson``, ``iou@0.5`` of
  :func:`edgeprune.metrics.saliency.saliency_fidelity`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from edgeprune.metrics.saliency import saliency_fidelity

__all__ = ["PSNR_CAP", "dense_fidelity", "output_fidelity"]

#: the PSNR of identical outputs (dB): higher than any float32 difference gives, and finite
PSNR_CAP = 200.0


def output_fidelity(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """The metrics of one output (module doc).

    Args:
        out, ref: (B, ...) the pruned and the dense network's output on the same B images.

    Returns:
        ``{"rel_error", "psnr_db"}`` plus ``{"mae", "pearson", "iou@0.5"}`` for a (B, 1, H, W) map in [0, 1].
        ``psnr_db`` is :data:`PSNR_CAP` for identical outputs (``-PSNR_CAP`` for a constant reference that differs).

    Raises:
        ValueError: shapes differ or B == 0.
    """
    if out.shape != ref.shape or out.dim() == 0 or out.shape[0] == 0:
        raise ValueError(f"outputs differ in shape or are empty: {tuple(out.shape)} vs {tuple(ref.shape)}")
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    sq = (o - r).pow(2)
    rel = float(sq.sum() / r.pow(2).sum().clamp_min(1e-300))
    mse, peak = float(sq.mean()), float(r.max() - r.min())
    psnr = PSNR_CAP if mse == 0 else (min(PSNR_CAP, 10 * math.log10(peak ** 2 / mse)) if peak > 0 else -PSNR_CAP)
    res = {"rel_error": rel, "psnr_db": psnr}
    if r.dim() == 4 and r.shape[1] == 1 and float(r.min()) >= 0 and float(r.max()) <= 1:
        res.update(saliency_fidelity(o, r))
    return res


def dense_fidelity(outs: Sequence[torch.Tensor], refs: Sequence[torch.Tensor],
                   names: Sequence[str] | None = None) -> dict:
    """The network's fidelity over its outputs (module doc).

    Args:
        outs, refs: one tensor per output, (N, ...) each, pruned and dense, same images.
        names: the outputs' names (a dict's keys), default ``output_0``, ...

    Returns:
        a flat dict of numbers (a run record's ``evaluation`` form): ``rel_error`` (mean over outputs),
        ``psnr_db`` (min), the map metrics of the first map output (``mae``, ``pearson``, ``iou@0.5``) when there is
        one, and with several outputs each output's metrics as ``"NAME.metric"``.

    Raises:
        ValueError: different numbers of outputs, or as :func:`output_fidelity`.
    """
    if len(outs) != len(refs) or not refs:
        raise ValueError(f"{len(outs)} outputs against {len(refs)} reference outputs")
    names = list(names) if names is not None else [f"output_{i}" for i in range(len(refs))]
    per = {n: output_fidelity(o, r) for n, o, r in zip(names, outs, refs)}
    res: dict = {"rel_error": sum(p["rel_error"] for p in per.values()) / len(per),
                 "psnr_db": min(p["psnr_db"] for p in per.values())}
    first_map = next((p for p in per.values() if "iou@0.5" in p), None)
    if first_map is not None:
        res.update({k: first_map[k] for k in ("mae", "pearson", "iou@0.5")})
    if len(per) > 1:
        res.update({f"{n}.{k}": v for n, p in per.items() for k, v in p.items()})
    return res
