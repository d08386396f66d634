"""The job of ``edgeprune eval``: the quality of a run or a dense model on held-out data, printed as the command
prints it.

    import edgeprune
    m = edgeprune.eval_run("runs/fm-50", eval_size=200)      # or model_name="fmnist-vit" (dense)

A run is compared against its dense base model (top-1 and agreement); a NuWa run is scored over its target classes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from edgeprune.artifact import check_writable
from edgeprune.atomic import atomic_write_text
from edgeprune.evaluate import evaluate, evaluate_target_classes
from edgeprune.jobs.calib_reuse import heldout_source, recorded_eval_folder, recorded_folder
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import check_readable_dir, fmt_metric, load_model, torch_device_of
from edgeprune.loading import load_base_model


def eval_run(run_dir: str | Path | None = None, *, model_name: str | None = None, checkpoint: str | Path | None = None,
             random_init: bool = False, num_classes: int | None = None, img_size: int | None = None,
             model_kwargs: dict[str, Any] | None = None, eval_data: str | Path | None = None,
             eval_size: int | None = None, json_out: str | Path | None = None, device: str | None = None,
             torch_device: str | None = None, quiet: bool = False, echo: Echo = _echo) -> dict[str, Any]:
    """Evaluate ``run_dir`` (against its dense base model) or the dense ``model_name`` [fmnist-vit when neither].

    The images: ``eval_data``; else the run's recorded evaluation folder; else its calibration folder's held-out
    images (:func:`_eval_source`); else the model's own. Says one line (``echo``): the model, the images and the
    quality; ``json_out``: also writes the metrics there as JSON. ``quiet``: no progress display. ``device`` /
    ``torch_device``: a deployment profile (or the old torch-device spelling) and the torch device
    (:func:`edgeprune.jobs.models.torch_device_of`; default cpu).

    Returns:
        The metrics (as written to ``json_out``): ``top1`` / ``agreement`` (classifiers; a NuWa run: ``top1`` over
        its target classes and ``num_images``), the fidelity figures of a dense-output or saliency model.

    Raises:
        UserError: both a run and a model, a missing run directory, an unknown model or device, unreadable
            ``eval_data``, an unwritable ``json_out`` folder, a recorded data folder that is gone.
    """
    device = torch_device_of(device, torch_device, default="cpu")
    if run_dir is None and model_name is None:
        model_name = "fmnist-vit"
    check_readable_dir(eval_data, "evaluation data")
    if json_out is not None:
        check_writable(Path(json_out).parent)
    model, rec, spec = load_model(run_dir, model_name, checkpoint, random_init, num_classes, img_size,
                                  model_kwargs)
    ev = _eval_source(spec, rec, eval_data, eval_size)
    if rec is not None and rec.get("head"):  # NuWa run: only its target classes count
        with torch.no_grad():
            m = evaluate_target_classes(model, rec["head"], ev, device=device)
        echo(f"{run_dir}: {ev.description}, target classes {rec['head']['classes']} "
             f"({m['num_images']} images): top-1 {m['top1'] * 100:.2f}% (argmax over the target classes)")
    else:
        dense = None
        if rec is not None:  # the run's dense base model, rebuilt as at prune time
            dense = load_base_model(rec)
        with torch.no_grad():
            m = evaluate(spec, model, ev, dense=dense, progress=not quiet, device=device)
        echo(f"{run_dir or spec.name}: {ev.description}: {fmt_metric(m, spec.output_kind)}")
    if json_out:
        atomic_write_text(json_out, json.dumps(m, indent=2) + "\n")
    return m


def _eval_source(spec: Any, rec: dict | None, eval_data: Any, eval_size: int | None) -> Any:
    """The evaluation images: ``--eval-data``; else the run's recorded evaluation folder (issue 52); else,
    for a run that recorded its calibration folder (issue 42), that folder's test split (Fashion-MNIST)
    or, for a timm model, the folder's images the calibration did not use (unlabeled: agreement with
    the dense model only; a folder that is gone is refused); else the model's own."""
    if eval_data is None and rec is not None and not rec.get("head"):
        cal = rec.get("calibration") or {}
        eval_data = recorded_eval_folder(cal)  # issue 52: the run's own --eval-data first
        if eval_data is None and cal.get("folder") and (spec.data_holds_both_splits or not spec.is_zoo):
            folder = recorded_folder(cal, spec, option="--eval-data DIR")
            if folder is not None and spec.data_holds_both_splits:
                eval_data = folder
            elif folder is not None:
                n = cal.get("num_images") or cal.get("size_requested")
                return heldout_source(spec, folder, n, cal.get("seed") or 0, eval_size)
    return spec.eval_source(eval_data, n=eval_size)


__all__ = ["eval_run"]
