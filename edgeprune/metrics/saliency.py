"""Fidelity of a pruned saliency model to its dense reference.

Maps are (B, 1, H, W) probabilities in [0, 1] (e.g. ``dinov2-s14`` outputs); features are
(B, D) vectors (e.g. its pooled class token). All statistics are computed in float64 per image
and then averaged over the batch, so every image weighs the same.
"""

from __future__ import annotations

import torch

THRESHOLD: float = 0.5
"""Binarisation threshold for ``iou@0.5``: a pixel is salient when its probability is >= 0.5."""


def _check_maps(pred: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if pred.shape != ref.shape:
        raise ValueError(f"saliency maps differ in shape: {tuple(pred.shape)} vs {tuple(ref.shape)}")
    if pred.dim() != 4 or pred.shape[1] != 1 or pred.shape[0] == 0:
        raise ValueError(f"saliency maps must be (B, 1, H, W) with B >= 1, got {tuple(pred.shape)}")
    b = pred.shape[0]
    return (pred.detach().reshape(b, -1).to(torch.float64).cpu(),
            ref.detach().reshape(b, -1).to(torch.float64).cpu())


def saliency_fidelity(pred: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Agreement between predicted and reference saliency maps.

    Definitions, for image i with pixels p (predicted) and r (reference), N = H*W:

    * ``mae``: mean over images and pixels of ``|p - r|`` (probability units, in [0, 1]).
    * ``pearson``: mean over images of ``sum((p - mean p)(r - mean r)) /
      sqrt(sum (p - mean p)^2 * sum (r - mean r)^2)``, in [-1, 1]. When either map of an image
      is constant the correlation is undefined; it is then taken as 1.0 if the two maps are
      identical and 0.0 otherwise.
    * ``iou@0.5``: mean over images of ``|P & R| / |P | R|`` with ``P = p >= 0.5``,
      ``R = r >= 0.5``; the IoU of two empty masks is 1.0.

    Args:
        pred: (B, 1, H, W) predicted probabilities in [0, 1].
        ref: (B, 1, H, W) reference probabilities in [0, 1] (e.g. the dense model's).

    Returns:
        ``{"mae": float, "pearson": float, "iou@0.5": float}``.

    Raises:
        ValueError: shapes differ, are not (B, 1, H, W), or B == 0.
    """
    p, r = _check_maps(pred, ref)
    mae = (p - r).abs().mean().item()

    pc = p - p.mean(dim=1, keepdim=True)
    rc = r - r.mean(dim=1, keepdim=True)
    denom = (pc.square().sum(1) * rc.square().sum(1)).sqrt()
    corr = (pc * rc).sum(1) / denom.clamp_min(torch.finfo(torch.float64).tiny)
    degenerate = denom == 0
    identical = (p == r).all(dim=1)
    corr = torch.where(degenerate, identical.to(torch.float64), corr)

    pm, rm = p >= THRESHOLD, r >= THRESHOLD
    inter = (pm & rm).sum(1).to(torch.float64)
    union = (pm | rm).sum(1).to(torch.float64)
    iou = torch.where(union == 0, torch.ones_like(union), inter / union.clamp_min(1))
    return {"mae": mae, "pearson": corr.mean().item(), "iou@0.5": iou.mean().item()}


def feature_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over the batch of the cosine similarity of paired feature vectors.

    ``cos_i = <a_i, b_i> / (||a_i|| ||b_i||)``; a zero vector gives cosine 0 (norms are clamped
    at 1e-12).

    Args:
        a: (B, D) features (e.g. pruned model's pooled class token).
        b: (B, D) reference features.

    Returns:
        Mean cosine in [-1, 1].

    Raises:
        ValueError: shapes differ, are not 2-D, or B == 0.
    """
    if a.shape != b.shape or a.dim() != 2 or a.shape[0] == 0:
        raise ValueError(f"features must be two (B, D) tensors of equal shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    a64 = a.detach().to(torch.float64).cpu()
    b64 = b.detach().to(torch.float64).cpu()
    num = (a64 * b64).sum(1)
    den = a64.norm(dim=1).clamp_min(1e-12) * b64.norm(dim=1).clamp_min(1e-12)
    return (num / den).mean().item()
