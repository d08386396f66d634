"""Quality of a (pruned) model on held-out data.

* Classifiers: top-1 accuracy on labeled images, and top-1 agreement with the dense model.
* ``dinov2-s14``: fidelity of the saliency maps to the dense model's (MAE, Pearson correlation,
  IoU at 0.5; ``edgeprune.metrics.saliency``) and cosine similarity of the pooled features.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from edgeprune.errors import UserError
from edgeprune.metrics.dense import dense_fidelity
from edgeprune.metrics.saliency import feature_cosine, saliency_fidelity
from edgeprune.nuwa.inputs import evaluate_targets
from edgeprune.progress import progress as progress_bar


@torch.no_grad()
def evaluate_classifier(model: nn.Module, source, batch_size: int = 256,
                        dense: nn.Module | None = None, progress: bool = False,
                        device: str = "cpu") -> dict[str, float]:
    """Top-1 (needs labels) and, with ``dense``, top-1 agreement and mean |logit diff|.

    Args:
        model: classifier returning logits (B, K).
        source: a data source yielding (images, labels) batches.
        dense: the reference model, or None.
        progress: progress display (:mod:`edgeprune.progress`).
        device: torch device the models and batches are moved to.

    Returns:
        dict with ``top1`` (fraction, if labeled), ``agreement``, ``logit_mae`` (with dense),
        ``num_images``.
    """
    model.eval().to(device)
    if dense is not None:
        dense.eval().to(device)
    correct = agree = n = 0
    labeled = True
    abs_err = 0.0
    for x, y in progress_bar(source.batches(batch_size), "eval", enabled=progress,
                             total=-(-len(source) // batch_size), unit="batch"):
        x = x.to(device)
        logits = model(x)
        pred = logits.argmax(-1)
        if y is None:
            labeled = False
        else:
            correct += (pred == y.to(device)).sum().item()
        if dense is not None:
            ref = dense(x)
            agree += (ref.argmax(-1) == pred).sum().item()
            abs_err += (ref - logits).abs().mean(-1).sum().item()
        n += x.shape[0]
    out: dict[str, float] = {"num_images": n}
    if labeled:
        out["top1"] = correct / n
    if dense is not None:
        out["agreement"] = agree / n
        out["logit_mae"] = abs_err / n
    return out


@torch.no_grad()
def evaluate_saliency(model: nn.Module, dense: nn.Module, source, batch_size: int = 8,
                      progress: bool = False, device: str = "cpu") -> dict[str, float]:
    """Saliency and feature fidelity of ``model`` to ``dense`` (both :class:`SaliencyViT`).

    Returns:
        dict with ``mae``, ``pearson``, ``iou@0.5`` (image means, maps in [0, 1]),
        ``feature_cosine`` and ``num_images``.
    """
    model.eval().to(device)
    dense.eval().to(device)
    maps, refs, feats, ref_feats = [], [], [], []
    for x, _ in progress_bar(source.batches(batch_size), "eval", enabled=progress,
                             total=-(-len(source) // batch_size), unit="batch"):
        x = x.to(device)
        s, f = model.forward_with_features(x)
        rs, rf = dense.forward_with_features(x)
        maps.append(s.cpu()); refs.append(rs.cpu()); feats.append(f.cpu()); ref_feats.append(rf.cpu())
    out = saliency_fidelity(torch.cat(maps), torch.cat(refs))
    out["feature_cosine"] = feature_cosine(torch.cat(feats), torch.cat(ref_feats))
    out["num_images"] = sum(len(m) for m in maps)
    return out


def _outputs(y) -> tuple[list[str], list[torch.Tensor]]:
    if isinstance(y, torch.Tensor):
        return ["output"], [y]
    if isinstance(y, dict):
        return [str(k) for k in y], list(y.values())
    return [f"output_{i}" for i in range(len(y))], list(y)


@torch.no_grad()
def evaluate_dense(model: nn.Module, dense: nn.Module, source, batch_size: int = 8, progress: bool = False,
                   device: str = "cpu", metric: Callable[[Any, Any], dict] | None = None) -> dict:
    """Fidelity of a dense-prediction network ``model`` to ``dense`` on held-out images
    (:func:`edgeprune.metrics.dense.dense_fidelity`: relative squared error, PSNR, and IoU@0.5 / Pearson / MAE for
    maps in [0, 1]).

    Args:
        model, dense: the pruned and the dense network (outputs: a tensor or a tuple/dict of tensors).
        source: images (labels unused). batch_size: images per forward. device: torch device.
        metric: your own ``metric(outputs, references) -> {name: number}`` over all images (each argument as the
            network returns it, its tensors concatenated over the batches); its entries are added as
            ``"metric.NAME"``.

    Returns:
        ``dense_fidelity``'s flat dict of numbers plus ``num_images`` (and the ``metric.*`` entries).

    Raises:
        UserError: ``metric`` returns something that is not a dict of finite numbers.
    """
    model.eval().to(device)
    dense.eval().to(device)
    outs: list[list[torch.Tensor]] = []
    refs: list[list[torch.Tensor]] = []
    names: list[str] = []
    for x, _ in progress_bar(source.batches(batch_size), "eval", enabled=progress,
                             total=-(-len(source) // batch_size), unit="batch"):
        x = x.to(device)
        names, o = _outputs(model(x))
        _, r = _outputs(dense(x))
        outs.append([t.cpu() for t in o])
        refs.append([t.cpu() for t in r])
    cat_o = [torch.cat([b[i] for b in outs]) for i in range(len(names))]
    cat_r = [torch.cat([b[i] for b in refs]) for i in range(len(names))]
    res = dense_fidelity(cat_o, cat_r, names)
    res["num_images"] = int(cat_r[0].shape[0])
    if metric is not None:
        got = metric(_regroup(cat_o, names), _regroup(cat_r, names))
        try:
            extra = {f"metric.{k}": float(v) for k, v in dict(got).items()}
        except (TypeError, ValueError):
            raise UserError(f"the metric function returned {type(got).__name__}; it must return a dict of "
                            "numbers") from None
        if not all(math.isfinite(v) for v in extra.values()):
            raise UserError(f"the metric function returned a non-finite number: {extra}")
        res.update(extra)
    return res


def _regroup(tensors: list[torch.Tensor], names: list[str]):
    return tensors[0] if names == ["output"] else (
        dict(zip(names, tensors)) if not names[0].startswith("output_") else tuple(tensors))


def evaluate(spec, model: nn.Module, source, dense: nn.Module | None = None,
             batch_size: int | None = None, progress: bool = False, device: str = "cpu",
             metric: Callable[[Any, Any], dict] | None = None) -> dict[str, float]:
    """Dispatch on ``spec.output_kind`` ("logits", "saliency" or "dense": a network of your own with a ViT
    inside, :func:`evaluate_dense`, where ``metric`` is passed on), on ``device`` ("cpu", "cuda", "cuda:N"); the
    models are moved there for the evaluation and back to where they were.

    Raises:
        UserError: saliency or dense fidelity without the dense model.
    """
    if spec.output_kind in ("saliency", "dense") and dense is None:
        raise UserError(f"{spec.name} quality is fidelity to the dense model: evaluate a run directory")
    with _on_device(model, dense):
        if spec.output_kind == "dense":
            return evaluate_dense(model, dense, source, batch_size or 8, progress, device, metric)
        if spec.output_kind == "saliency":
            return evaluate_saliency(model, dense, source, batch_size or 8, progress, device)
        return evaluate_classifier(model, source, batch_size or 256, dense, progress, device)


@contextlib.contextmanager
def _on_device(*models: nn.Module | None) -> Iterator[None]:
    """Put every model back on the device of its first parameter afterwards (an evaluation on
    cuda must not leave the model there: it is saved or pruned on the CPU next)."""
    homes = [(m, next(m.parameters()).device) for m in models
             if m is not None and next(m.parameters(), None) is not None]
    try:
        yield
    finally:
        for m, dev in homes:
            m.to(dev)


@torch.no_grad()
def evaluate_target_classes(model: nn.Module, head: dict, source, device: str = "cpu") -> dict[str, float]:
    """Top-1 of a NuWa run over its target classes (argmax over them), on the labeled images of
    ``source`` that belong to them.

    Args:
        model: the derived model; head: the record's ``head`` entry (``classes``, ``mode``).
        source: labeled evaluation images.

    Returns:
        ``{"top1": fraction, "num_images": N}``.

    Raises:
        UserError: no labeled image of the target classes.
    """
    classes = [int(c) for c in head["classes"]]
    keep = torch.tensor(classes)
    pairs = [(x[torch.isin(y, keep)], y[torch.isin(y, keep)]) for x, y in source.batches(1024) if y is not None]
    pairs = [(x, y) for x, y in pairs if len(y)]
    if not pairs:
        raise UserError("evaluating a NuWa run needs labeled evaluation images of its target classes")
    xs, ys = zip(*pairs)
    x, y = torch.cat(xs), torch.cat(ys)
    with _on_device(model):
        model.to(device)
        top1, _ = evaluate_targets(model, x.to(device), y.to(device), classes, sliced=head.get("mode") == "slice")
    return {"top1": top1, "num_images": len(y)}
