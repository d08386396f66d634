"""Quality of a (pruned) model on held-out data.

* Classifiers: top-1 accuracy on labeled images, and top-1 agreement with the dense model.
* ``dinov2-s14``: fidelity of the saliency maps to the dense model's (MAE, Pearson correlation,
  IoU at 0.5; ``edgeprune.metrics.saliency``) and cosine similarity of the pooled features.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from tqdm.auto import tqdm


@torch.no_grad()
def evaluate_classifier(model: nn.Module, source, batch_size: int = 256,
                        dense: nn.Module | None = None, progress: bool = False) -> dict[str, float]:
    """Top-1 (needs labels) and, with ``dense``, top-1 agreement and mean |logit diff|.

    Args:
        model: classifier returning logits (B, K).
        source: a data source yielding (images, labels) batches.
        dense: the reference model, or None.

    Returns:
        dict with ``top1`` (fraction, if labeled), ``agreement``, ``logit_mae`` (with dense),
        ``num_images``.
    """
    model.eval()
    correct = agree = n = 0
    labeled = True
    abs_err = 0.0
    for x, y in tqdm(source.batches(batch_size), desc="eval", disable=not progress, leave=False,
                     total=-(-len(source) // batch_size)):
        logits = model(x)
        pred = logits.argmax(-1)
        if y is None:
            labeled = False
        else:
            correct += (pred == y).sum().item()
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
                      progress: bool = False) -> dict[str, float]:
    """Saliency and feature fidelity of ``model`` to ``dense`` (both :class:`SaliencyViT`).

    Returns:
        dict with ``mae``, ``pearson``, ``iou@0.5`` (image means, maps in [0, 1]),
        ``feature_cosine`` and ``num_images``.
    """
    from edgeprune.metrics.saliency import feature_cosine, saliency_fidelity

    model.eval()
    dense.eval()
    maps, refs, feats, ref_feats = [], [], [], []
    for x, _ in tqdm(source.batches(batch_size), desc="eval", disable=not progress, leave=False):
        s, f = model.forward_with_features(x)
        rs, rf = dense.forward_with_features(x)
        maps.append(s); refs.append(rs); feats.append(f); ref_feats.append(rf)
    out = saliency_fidelity(torch.cat(maps), torch.cat(refs))
    out["feature_cosine"] = feature_cosine(torch.cat(feats), torch.cat(ref_feats))
    out["num_images"] = sum(len(m) for m in maps)
    return out


def evaluate(spec, model: nn.Module, source, dense: nn.Module | None = None,
             batch_size: int | None = None, progress: bool = False) -> dict[str, float]:
    """Dispatch on ``spec.output_kind`` ("logits" or "saliency")."""
    if spec.output_kind == "saliency":
        if dense is None:
            raise ValueError("saliency fidelity needs the dense model")
        return evaluate_saliency(model, dense, source, batch_size or 8, progress)
    return evaluate_classifier(model, source, batch_size or 256, dense, progress)
