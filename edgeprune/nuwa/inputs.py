"""Inputs of a NuWa derivation: target classes, the budget, the labeled train/val split, the
calibration batches, and the target-class metric (argmax over the target classes only)."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from edgeprune.budget import Budget, make_budget, validate_budget
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.nuwa.head import target_logits, target_predictions


def resolve_classes(classes: str | Sequence[int | str], num_outputs: int,
                    class_names: Sequence[str] | None = None) -> list[int]:
    """Target classes as base-model indices, in the given order.

    Args:
        classes: "0,3,7", "T-shirt/top,Bag", or a sequence of ints / names.
        num_outputs: the base classifier's number of classes.
        class_names: names of the base classes (for names; case-insensitive).

    Raises:
        UserError: empty, unknown name, index out of range, duplicates.
    """
    items = [c.strip() for c in classes.split(",")] if isinstance(classes, str) else list(classes)
    if not items or any(isinstance(c, str) and not c for c in items):
        raise SettingError("{classes} needs a comma-separated list of class indices or names, e.g. 0,3,7")
    lower = {n.lower(): i for i, n in enumerate(class_names or [])}
    out: list[int] = []
    for c in items:
        if isinstance(c, str) and not c.lstrip("-").isdigit():
            if c.lower() not in lower:
                known = f" (known: {', '.join(class_names)})" if class_names and len(class_names) <= 20 else ""
                raise UserError(f"unknown class name {c!r}{known}")
            idx = lower[c.lower()]
        else:
            idx = int(c)
        if not 0 <= idx < num_outputs:
            raise UserError(f"class index {idx} out of range: the model has {num_outputs} classes "
                            f"(0..{num_outputs - 1})")
        if idx in out:
            raise SettingError(f"class {idx} is listed twice in {{classes}}")
        out.append(idx)
    return out


def resolve_budget(flops=None, params=None, budget: Budget | dict | None = None, table=None, **kinds) -> Budget:
    """The derivation's :class:`~edgeprune.budget.Budget` from exactly one of ``flops=``,
    ``params=``, ``<kind>=`` (another registered budget kind, e.g. ``latency=`` with ``table=``, the
    latency table's path), parsed as ``edgeprune prune`` parses them
    (:func:`edgeprune.budget.make_budget`): a fraction of the base model in (0, 1] or an
    absolute count with an optional k/M/G/T suffix (``"2.3G"``; latency: ``"12ms"``); or a ready
    budget ``budget=`` (a Budget or its dict form, checked with :func:`edgeprune.budget.validate_budget`; its
    ``unit`` and ``table`` are kept).

    Raises:
        UserError: none or several given, an unknown kind, a bad value, a latency budget without a
            table (one line naming ``edgeprune latency-table``) or a table without one.
    """
    if budget is not None:
        given = [k for k, v in {"flops": flops, "params": params, **kinds}.items() if v is not None]
        if given:
            raise UserError(f"give exactly one budget: budget= or --{given[0]}, not both")
        if isinstance(budget, Budget):
            budget = budget.to_dict()
        if table is not None and isinstance(budget, dict) and "table" not in budget:
            budget = {**budget, "table": table}
        return validate_budget(budget)
    budget = make_budget(flops, params, table=table, **kinds)
    if budget is None:
        raise UserError("give exactly one budget: --flops or --params (a fraction of the base model to keep, "
                        "e.g. 0.6, or a count, e.g. 2.3G), or --latency with --latency-table")
    return budget


def split_labeled(images: torch.Tensor, labels: torch.Tensor, classes: Sequence[int], val_size: int,
                  seed: int, class_names: Sequence[str] | None = None):
    """Target-class images split into (train, val); val is a seeded random held-out slice.

    Raises:
        UserError: a target class without labeled images, or too few images to hold some out.
    """
    labels = torch.as_tensor(labels)
    if len(images) != len(labels):
        raise UserError(f"{len(images)} images but {len(labels)} labels")
    for c in classes:
        if not bool((labels == c).any()):
            name = f" ({class_names[c]})" if class_names and c < len(class_names) else ""
            raise UserError(f"no labeled images for class {c}{name}")
    sel = torch.isin(labels, torch.as_tensor(list(classes))).nonzero().flatten()
    if len(sel) < 2:
        raise UserError(f"need at least 2 labeled target-class images, got {len(sel)}")
    perm = sel[torch.randperm(len(sel), generator=torch.Generator().manual_seed(seed))]
    n_val = max(1, min(val_size, len(perm) // 5))
    v, t = perm[:n_val], perm[n_val:]
    return (images[t], labels[t]), (images[v], labels[v])


def _batches(images: torch.Tensor, batch_size: int) -> Iterable[torch.Tensor]:
    for i in range(0, len(images), batch_size):
        yield images[i:i + batch_size]


def _calibration_batches(calibration, batch_size: int):
    """(callable returning an iterable of image batches, description, count)."""
    if isinstance(calibration, torch.Tensor):
        return (lambda: _batches(calibration, batch_size)), f"tensor {tuple(calibration.shape)}", len(calibration)
    if hasattr(calibration, "batches"):
        desc = getattr(calibration, "description", type(calibration).__name__)
        return (lambda: (x for x, _ in calibration.batches(batch_size))), desc, len(calibration)
    raise UserError("calibration must be an image tensor or a data source with batches()")


@torch.no_grad()
def evaluate_targets(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, classes: Sequence[int],
                     sliced: bool = False, batch_size: int = 256,
                     device: str | torch.device | None = None) -> tuple[float, float]:
    """(top-1, mean cross-entropy) with the argmax / softmax over the target classes only.

    Args:
        images: (N, C, H, W) on any device; moved to ``device`` batch by batch.
        labels: (N,) base-class indices (all in ``classes``).
        sliced: the model's outputs are the target classes in ``classes`` order.
        device: run the model there (moved there for the pass and back afterwards); None = the
            model's own device. Logits (B, K) come back to the CPU for scoring.
    """
    model.eval()
    p = next(model.parameters(), None)
    home = torch.device("cpu") if p is None else p.device
    dev = home if device is None else torch.device(device)
    pos = {c: i for i, c in enumerate(classes)}
    tgt = torch.as_tensor([pos[int(y)] for y in labels], dtype=torch.long)
    labels = torch.as_tensor(labels).cpu()
    correct, loss, n = 0, 0.0, 0
    if dev != home:
        model.to(dev)
    try:
        for i in range(0, len(images), batch_size):
            logits = model(images[i:i + batch_size].to(dev)).cpu()
            correct += int((target_predictions(logits, classes, sliced) == labels[i:i + batch_size]).sum())
            loss += F.cross_entropy(target_logits(logits, classes, sliced).float(), tgt[i:i + batch_size],
                                    reduction="sum").item()
            n += len(logits)
    finally:
        if dev != home:
            model.to(home)
    return correct / max(n, 1), loss / max(n, 1)

