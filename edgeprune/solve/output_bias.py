"""Output bias correction: fold the mean output shift of the pruned model into the classifier bias.

After CORP every block is compensated for its own removal, but the errors of all blocks add up,
and the model's output moves by a systematic shift as well as by noise. For a model whose output
is an affine classifier ``y = W f + b`` (timm's ``head``), the constant ``c`` that minimises the
squared output error against the dense model on the calibration images,

    c* = argmin_c  sum_i || y_dense(x_i) - (y_pruned(x_i) + c) ||^2  =  mean_i (y_dense(x_i) - y_pruned(x_i)),

is folded as ``b' = b + c*``: after the fold the pruned model's mean output over those images equals
the dense model's exactly, and their summed squared error drops by ``k ||c*||^2`` (k images).
This is the empirical bias correction of Nagel et al. 2019 (data-free quantization, sec. 4.2),
applied to the model's output after pruning (our addition; docs/methods.md, "Output bias correction").

Cost: the dense model's outputs are summed during CORP's calibration pass (a hook feeding
:class:`OutputSums`; a separate pass only for sequential calibration), the pruned model's in one
forward pass over the first ``k`` calibration images. Under torchrun each rank sums the outputs of its share's
images whose index in the whole
calibration set is below ``k`` and the sums are all-reduced, so every rank folds the same ``c*``
as one process would.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from edgeprune.backbone import is_vit

from edgeprune.distributed import all_reduce_total

__all__ = ["classifier_head", "OutputSums", "output_sums", "fold_output_bias"]


def classifier_head(model: nn.Module) -> nn.Linear | None:
    """The affine classifier that produces ``model``'s output, or None.

    timm models expose it as ``get_classifier()`` (``head``); it must be an ``nn.Linear`` with a
    bias whose output is the model's output (not ``Identity``: a headless backbone has no
    classifier to correct). A network with a ViT inside (not a ViT itself, no ``get_classifier``) has none: its
    ``head`` attribute is its own module, a token-wise linear head of a dense output as likely as a classifier
    (issue 55: nothing classifier-specific runs on a network).
    """
    get = getattr(model, "get_classifier", None)
    if not callable(get) and not is_vit(model):
        return None
    head = get() if callable(get) else getattr(model, "head", None)
    if isinstance(head, nn.Linear) and head.bias is not None:
        return head
    return None


class OutputSums:
    """Running float64 sum of a model's outputs over the calibration images with index < ``k``.

    Fed batch by batch in calibration-set order (under torchrun: this rank's share, starting at
    image ``first_image`` of the whole set); ``total`` starts as zeros of the output width, so a
    rank that holds none of the first ``k`` images still takes part in the reduction
    (:func:`edgeprune.distributed.all_reduce_total`). Used by the calibration pass (a hook on
    the dense model's output) and by :func:`output_sums` (the pruned model).
    """

    def __init__(self, width: int, k: int, first_image: int = 0) -> None:
        self.k, self.index, self.count = int(k), int(first_image), 0
        self.total = torch.zeros(int(width), dtype=torch.float64)
        self._rows: list[torch.Tensor] = []

    @property
    def rows(self) -> torch.Tensor:
        """(count, width) float32 CPU: the summed outputs themselves, in order (the classifier
        refit's targets, ``edgeprune.solve.head_refit``)."""
        if not self._rows:
            return torch.zeros(0, self.total.shape[0])
        return torch.cat(self._rows)

    def wanted(self, batch_size: int) -> int:
        """How many of the next ``batch_size`` images have an index < k."""
        return min(int(batch_size), max(0, self.k - self.index))

    def add(self, out: torch.Tensor, batch_size: int | None = None) -> None:
        """Add the outputs (B', width) of the next batch of ``batch_size`` images (default B');
        only its first :meth:`wanted` rows count."""
        n = out.shape[0] if batch_size is None else int(batch_size)
        take = min(out.shape[0], self.wanted(n))
        if take > 0:
            rows = out[:take].detach()
            self.total += rows.double().sum(0).cpu()
            self._rows.append(rows.float().cpu())
            self.count += take
        self.index += n


@torch.no_grad()
def output_sums(model: nn.Module, batches: Iterable[torch.Tensor], num_images: int,
                first_image: int = 0, rows: list | None = None) -> tuple[torch.Tensor, int]:
    """Sum of the model's outputs over the calibration images with index < ``num_images``.

    Args:
        model: evaluated as it is (eval mode, its own device); must have an affine classifier.
        batches: (B, C, H, W) calibration batches in calibration-set order (under torchrun this
            rank's share, starting at image ``first_image`` of the whole set).
        num_images: k, the images whose outputs are summed (only those are run).
        rows: a list to append this process's (k_local, num_outputs) outputs to (the refit's
            targets), or None.

    Returns:
        ``(sums, count)``: float64 (num_outputs,) on the CPU and the number of images summed
        (all-reduced over the ranks under torchrun).

    Raises:
        ValueError: the model has no affine classifier head.
    """
    head = classifier_head(model)
    if head is None:
        raise ValueError("output sums need a model with an affine classifier head")
    model.eval()
    dev = next(model.parameters()).device
    acc = OutputSums(head.out_features, num_images, first_image)
    for x in batches:
        take = acc.wanted(len(x))
        if take == 0:
            break
        acc.add(model(x[:take].to(dev)), len(x))
    if rows is not None:
        rows.append(acc.rows)
    return all_reduce_total(acc.total, acc.count)


@torch.no_grad()
def fold_output_bias(head: nn.Linear, dense_sums: torch.Tensor, pruned_sums: torch.Tensor,
                     count: int) -> torch.Tensor:
    """Add the mean output shift ``c* = (dense_sums - pruned_sums) / count`` to ``head.bias``.

    Args:
        head: the classifier (modified in place); dense_sums, pruned_sums: float64
            (out_features,) output sums over the same ``count`` images.

    Returns:
        ``c*`` (float64, (out_features,)).

    Raises:
        ValueError: no images, or sums whose length is not ``head.out_features``.
    """
    if count < 1:
        raise ValueError("output bias correction needs at least one image")
    if dense_sums.shape != (head.out_features,) or pruned_sums.shape != (head.out_features,):
        raise ValueError(f"output sums {tuple(dense_sums.shape)} / {tuple(pruned_sums.shape)} do not match "
                         f"the classifier's {head.out_features} outputs")
    shift = (dense_sums - pruned_sums) / count
    head.bias.add_(shift.to(head.bias.dtype))
    return shift
