"""Output correction around a prune (the last stage): the classifier re-fit to the dense outputs
(``edgeprune.solve.head_refit``, default with a budget) or the bias correction alone (``edgeprune.solve.output_bias``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.distributed import all_reduce_sum, is_distributed
from edgeprune.solve.head_refit import fit_head, refit_note, refit_statistics
from edgeprune.solve.output_bias import classifier_head, fold_output_bias, output_sums


class BiasCorrection:
    """Output correction around a prune: the classifier refit (``edgeprune.solve.head_refit``,
    default) or the bias correction alone (``edgeprune.solve.output_bias``). The dense model's
    outputs over the first ``k`` calibration images come from CORP's calibration pass
    (``corp_prune``'s ``output_sums`` / ``output_rows``, no extra cost) or, for sequential
    calibration, from a pass made here before the model is pruned in place; :meth:`fold` runs the
    pruned model over the same images and folds the fit into the classifier. A no-op for
    ``k = 0``; recorded as skipped for a model without an affine classifier."""

    def __init__(self, model: nn.Module, batches: Callable[[], Iterable[torch.Tensor]], k: int,
                 separate_pass: bool, refit: bool = True) -> None:
        self.batches, self.k, self.refit = batches, int(k), bool(refit)
        self.head = classifier_head(model) if self.k > 0 else None
        self.skipped = self.k > 0 and self.head is None
        self.dense: tuple[torch.Tensor, int] | None = None
        self.rows: torch.Tensor | None = None
        if self.head is not None and separate_pass:
            rows: list[torch.Tensor] = []
            self.dense = output_sums(model, batches(), self.k, getattr(batches, "first_image", 0), rows=rows)
            self.rows = rows[0]

    def fold(self, model: nn.Module, from_pass: tuple[torch.Tensor, int] | None,
             rows: torch.Tensor | None = None) -> dict[str, Any] | None:
        """Fold the correction into ``model``'s classifier (in place); returns the record's ``bias_correction``
        entry (None when off).

        Raises:
            RuntimeError: the dense outputs are missing or the pruned pass saw other images (a bug).
        """
        if self.skipped:
            return {"images": 0, "skipped": "the model has no affine classifier head"}
        if self.head is None:
            return None
        dense = self.dense or from_pass
        rows = self.rows if self.rows is not None else rows
        if dense is None or (self.refit and rows is None):
            raise RuntimeError("output correction: the calibration pass returned no dense outputs")
        t0 = time.perf_counter()
        head = classifier_head(model)
        if head is None:
            raise RuntimeError("output correction: the pruned model lost its classifier")
        first = getattr(self.batches, "first_image", 0)
        note = refit_note(dense[1]) if self.refit else None  # too few images: the bias alone, said
        refit = self.refit and note is None
        inputs: list[torch.Tensor] = []  # the head's inputs of the pruned pass
        hook = head.register_forward_hook(lambda _m, args, _out: inputs.append(args[0].detach())) if refit else None
        try:
            pruned, count = output_sums(model, self.batches(), self.k, first)
        finally:
            if hook is not None:
                hook.remove()
        fit = None
        if refit:
            feats = torch.cat(inputs).flatten(1) if inputs else torch.zeros(0, head.in_features)
            stats = refit_statistics(feats, rows, first)
            if is_distributed():
                for t in stats.tensors:
                    t.copy_(all_reduce_sum(t))
            fit = fit_head(stats, head.weight)
        if count != dense[1]:
            raise RuntimeError("output correction: the pruned pass saw another number of images than the dense one")
        shift = fold_output_bias(head, dense[0], pruned, count) if fit is None else (dense[0] - pruned) / count
        record: dict[str, Any] = {"images": count, "kind": "bias", "shift_norm": float(shift.norm()),
                                  "shift": [float(v) for v in shift]}
        if fit is not None:
            w0 = head.weight.detach().double().cpu()
            with torch.no_grad():
                head.weight.copy_(fit["weight"].to(head.weight.dtype))
                head.bias.copy_(fit["bias"].to(head.bias.dtype))
            alpha = fit["alpha"]
            finite = alpha != float("inf")
            record.update(kind="head refit" if finite else "bias (chosen by the refit's cross-validation)",
                          alpha=alpha if finite else None,
                          cv_error={(f"{a:g}" if a != float("inf") else "bias only"): e
                                    for a, e in fit["cv_error"].items()},
                          weight_change=float((fit["weight"] - w0).norm() / w0.norm().clamp_min(1e-300)))
        if note:
            record["note"] = note
        record["seconds"] = time.perf_counter() - t0
        return record
