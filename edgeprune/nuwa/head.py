"""The classifier head of a derived model: non-target suppression or slicing (nuwa §4.2).

* ``suppress`` (default, the paper): a large negative bias (-100) is added to the logits of the
  non-target classes, so the derived model never predicts them; the head keeps its shape and class
  indices (argmax over the full logits = argmax over the target classes).
* ``slice``: the head keeps only the target rows, in the order the classes were given; output i is
  ``classes[i]``. The head is smaller (params, FLOPs), so the run record carries a ``head`` entry
  with ``num_classes`` that :func:`apply_head_structure` uses to rebuild the shape before loading.

Distilled DeiTs (``head_dist``) get the same treatment on both heads.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from edgeprune.errors import UserError
from edgeprune.surgery import apply_head_structure, backbone_vit, classifier_heads  # noqa: F401 (handed on)

HEAD_MODES = ("suppress", "slice")
SUPPRESS_BIAS = -100.0


def num_classes(model: nn.Module) -> int:
    """Number of classifier outputs."""
    return classifier_heads(model)[0][2].out_features


@torch.no_grad()
def suppress_non_targets(model: nn.Module, classes: Sequence[int], bias: float = SUPPRESS_BIAS) -> None:
    """Add ``bias`` to the logits of every class not in ``classes``, in place."""
    for owner, name, lin in classifier_heads(model):
        if lin.bias is None:
            new = nn.Linear(lin.in_features, lin.out_features, bias=True).to(lin.weight)
            new.weight.copy_(lin.weight)
            new.bias.zero_()
            setattr(owner, name, new)
            lin = new
        mask = torch.ones(lin.out_features, dtype=torch.bool)
        mask[list(classes)] = False
        lin.bias[mask] += bias


@torch.no_grad()
def slice_head(model: nn.Module, classes: Sequence[int]) -> None:
    """Keep only the rows of ``classes`` (in that order) in every classifier head, in place."""
    idx = torch.as_tensor(list(classes), dtype=torch.long)
    for owner, name, lin in classifier_heads(model):
        new = nn.Linear(lin.in_features, len(idx), bias=lin.bias is not None).to(lin.weight)
        new.weight.copy_(lin.weight[idx])
        if lin.bias is not None:
            new.bias.copy_(lin.bias[idx])
        setattr(owner, name, new)
    vit = backbone_vit(model)
    if hasattr(vit, "num_classes"):
        vit.num_classes = len(idx)


def apply_head(model: nn.Module, classes: Sequence[int], mode: str = "suppress") -> None:
    """Suppress non-target classes or slice the head to the targets, in place."""
    if mode not in HEAD_MODES:
        raise UserError(f"head mode must be one of {', '.join(HEAD_MODES)}, got {mode!r}")
    (suppress_non_targets if mode == "suppress" else slice_head)(model, classes)


def head_record(model: nn.Module, classes: Sequence[int], mode: str,
                class_names: Sequence[str] | None = None, base_num_classes: int | None = None) -> dict:
    """The run record's ``head`` entry (how to read the derived model's outputs)."""
    rec = {"mode": mode, "classes": [int(c) for c in classes], "num_classes": num_classes(model),
           "base_num_classes": base_num_classes,
           "outputs": ("output i is class classes[i]" if mode == "slice" else
                       "output j is base class j; non-target logits carry a -100 bias")}
    if class_names is not None:
        rec["class_names"] = list(class_names)
    if mode == "suppress":
        rec["suppress_bias"] = SUPPRESS_BIAS
    return rec


def target_predictions(logits: torch.Tensor, classes: Sequence[int], sliced: bool) -> torch.Tensor:
    """Predicted base-class indices, argmax over the target classes only."""
    idx = torch.as_tensor(list(classes), dtype=torch.long)
    sub = logits if sliced else logits[:, idx]
    return idx[sub.argmax(-1)]


def target_logits(logits: torch.Tensor, classes: Sequence[int], sliced: bool) -> torch.Tensor:
    """Logits of the target classes, in ``classes`` order."""
    return logits if sliced else logits[:, list(classes)]
