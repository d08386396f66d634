"""Learning-rate schedule of STARFISH healing (starfish App. B): optional linear warm-up, then a
per-step cosine decay from ``lr`` to ``min_lr``."""

from __future__ import annotations

import math


def cosine_lr(step: int, total: int, lr: float, min_lr: float, warmup: int = 0) -> float:
    """Learning rate of step ``step`` (0-based) of ``total``.

    Optional linear warm-up over the first ``warmup`` steps (``lr * (step + 1) / (warmup + 1)``;
    not in the paper), then a cosine decay from ``lr`` towards ``min_lr`` over the remaining
    ``total - warmup`` steps (starfish App. B).
    """
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    span = total - warmup
    if span <= 0:
        return lr
    t = min(step - warmup, span)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t / span))


def default_warmup_steps(total_steps: int) -> int:
    """Warm-up used when none is given: 10% of the steps, at least 5, at most half of them.

    Not in the paper. AdamW's first updates are sign-like steps of size ``lr`` per weight; with
    only a few dozen steps in all (dinov2-s14 with 64 calibration crops: 20) the paper's 6e-4
    overshoots and the alignment loss rises for several epochs (README, STARFISH section); a
    short linear warm-up damps that (at dinov2 sparsity 0.7 the rise disappears) and changed
    nothing measurable in a 320-step fmnist-vit heal.
    """
    return min(max(5, total_steps // 10), total_steps // 2)
