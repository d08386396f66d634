"""Labeled images of chosen classes, as tensors: the training and evaluation data of NuWa.

* :func:`load_labeled` -- target-class images (N, C, H, W) and labels from the *training* split
  (Fashion-MNIST train for ``fmnist-vit``; an ImageFolder ``train_data`` for timm models).
* :func:`load_labeled_eval` -- target-class images from the evaluation split (Fashion-MNIST test;
  an ImageFolder ``eval_data``), or None when a timm model has no evaluation data.

It lives in the zoo because a zoo model's labeled split comes from its entry (``ZooEntry.labeled_split``);
``edgeprune.data`` below it knows only image folders and datasets.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from edgeprune.data.sources import FolderSource, list_image_folder, subset
from edgeprune.errors import UserError
from edgeprune.zoo.entries import zoo_entry


def _zoo_split(spec: Any, split: str, data: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A zoo model's labeled split in memory (Fashion-MNIST for ``fmnist-vit``), else None."""
    entry = zoo_entry(spec.name)
    return entry.labeled_split(split, data) if entry is not None else None


def _dataset(spec: Any) -> str:
    entry = zoo_entry(spec.name)
    return (entry.dataset if entry is not None else None) or spec.name

def load_labeled(spec: Any, data: str | None, train_data: str | None, classes: Sequence[int],
                 per_class: int | None, seed: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Labeled target-class training images.

    Args:
        spec: the base model's ModelSpec (name, input size, transform).
        data: the Fashion-MNIST directory (``fmnist-vit``; None = the installed one).
        train_data: an ImageFolder directory (timm models), class sub-folders in label order.
        classes: base-class indices to keep.
        per_class: at most this many images per class (None: all for fmnist-vit, 300 for folders),
            a seeded random choice.
        seed: selection seed.

    Returns:
        ``(images (N, C, H, W) float32, labels (N,) int64, description)``.

    Raises:
        UserError: not a classifier, no ``train_data`` for a timm model, unreadable data.
    """
    split = _zoo_split(spec, "train", data)
    if split is not None:
        x, y = split
        keep = torch.isin(y, torch.as_tensor(list(classes)))
        x, y = x[keep], y[keep]
        if per_class is not None:
            idx = []
            g = torch.Generator().manual_seed(seed)
            for c in classes:
                ic = (y == c).nonzero().flatten()
                idx.append(ic[torch.randperm(len(ic), generator=g)[:per_class]])
            sel = torch.cat(idx).sort().values
            x, y = x[sel], y[sel]
        return x, y, f"{_dataset(spec)} train split"
    if spec.output_kind != "logits":
        raise UserError(f"{spec.name} is not a classifier; NuWa derives classifiers")
    if train_data is None:
        raise UserError(f"{spec.name}: pass --train-data DIR (an ImageFolder with one sub-folder per class)")
    files, labels, _ = list_image_folder(train_data)
    chosen_f: list = []
    chosen_l: list = []
    for c in classes:
        fc = [f for f, lbl in zip(files, labels) if lbl == c]
        fc, lc = subset(fc, [c] * len(fc), per_class if per_class is not None else 300, seed)
        chosen_f += fc
        chosen_l += lc
    if not chosen_f:
        return torch.empty(0, *spec.input_size), torch.empty(0, dtype=torch.long), str(train_data)
    src = FolderSource(chosen_f, chosen_l, spec.transform(), str(train_data))
    xs, ys = zip(*src.batches(64))
    return torch.cat(xs), torch.cat(ys), f"{train_data} (ImageFolder)"


def load_labeled_eval(spec: Any, data: str | None, eval_data: str | None, classes: Sequence[int],
                      n: int | None) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """Labeled target-class evaluation images (the test split), at most ``n``.

    Returns:
        ``(images, labels, description)``, or None for a timm model without ``eval_data``.

    Raises:
        UserError: no evaluation image of the target classes, unreadable data.
    """
    split = _zoo_split(spec, "test", eval_data or data)
    if split is not None:
        x, y = split
        keep = torch.isin(y, torch.as_tensor(list(classes)))
        x, y = x[keep][:n], y[keep][:n]
        return x, y, f"{_dataset(spec)} test split, {len(x)} images of the target classes"
    if eval_data is None:
        return None
    files, labels, _ = list_image_folder(eval_data)
    pairs = [(f, lbl) for f, lbl in zip(files, labels) if lbl in classes][:n]
    if not pairs:
        raise UserError(f"no evaluation images of the target classes in {eval_data}")
    src = FolderSource([p[0] for p in pairs], [p[1] for p in pairs], spec.transform(), str(eval_data))
    xs, ys = zip(*src.batches(64))
    return torch.cat(xs), torch.cat(ys), f"{eval_data}, {len(pairs)} images of the target classes"


def class_names(spec: Any, train_data: str | None = None) -> list[str] | None:
    """Names of the base model's classes where known: Fashion-MNIST's for ``fmnist-vit``, the
    sub-folder names of ``train_data`` for timm models, else None."""
    entry = zoo_entry(spec.name)
    if entry is not None and entry.class_names:
        return list(entry.class_names)
    if train_data is not None:
        return list_image_folder(train_data)[2] or None
    return None
