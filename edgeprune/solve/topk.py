"""The one tie-break rule of every ranking: which k channels are kept (issue 29, item 2).

Kept indices must not depend on the device that computed the scores or on the sort kernel. So
the selection is made in one place, on the CPU, in float64, with a stable sort:

* scores are moved to host memory and widened to float64 (exact for float16/bfloat16/float32
  scores, so the order of distinct values is unchanged);
* a stable descending sort: equal scores keep their index order, so an **exact tie** is won by
  the **lower index**, on every device and at every thread count (CUDA's and the CPU's unstable
  top-k/sort kernels may return either of two equal scores);
* NaN ranks above every number (``torch.sort`` order), the same on every device.

**Near ties** (distinct scores closer than their own round-off) are *not* merged: no
deterministic rule applied to perturbed inputs can be stable at every boundary (a tolerance
only moves the boundary). The scores are sums of float32 products (e.g. the Q/K logit energy
``sum_i Gq_i[j,j] Gk_i[j,j]`` from float32 per-image Grams over n tokens, relative error
<~ sqrt(n) * 2^-24 per Gram entry, plus the device's own float32 activations), so scores of two
devices agree to ~1e-6 relative, and two channels whose scores differ by less than that may be
ranked differently on a CPU and a GPU. :func:`selection_margin` measures how far a selection is
from such a flip; ``tests/test_device.py`` checks on a GPU that the kept indices are identical.
"""

from __future__ import annotations

import torch


def stable_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores along the last dim, sorted ascending (int64, on the CPU).

    Args:
        scores: (..., D) real scores on any device, any float (or integer) dtype.
        k: how many to keep per row, 0 <= k <= D.

    Returns:
        (..., k) int64 on the CPU. Exact ties go to the lower index (module doc).

    Raises:
        ValueError: k outside [0, D].
    """
    d = scores.shape[-1]
    if not 0 <= k <= d:
        raise ValueError(f"cannot keep {k} of {d} scores")
    s = scores.detach().to(device="cpu", dtype=torch.float64)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


def selection_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Relative gap between the k-th and (k+1)-th largest score of each row (float64, CPU).

    ``(s_(k) - s_(k+1)) / max(|s_(k)|, tiny)``: a selection made by :func:`stable_top_k` cannot
    change under a relative perturbation of every (non-negative) score by less than half
    this margin. +inf
    where nothing is left out (k = D) or nothing is kept (k = 0).

    Args:
        scores: (..., D); k: 0 <= k <= D.

    Returns:
        (...,) float64.
    """
    s = scores.detach().to(device="cpu", dtype=torch.float64)
    d = s.shape[-1]
    if k <= 0 or k >= d:
        return torch.full(s.shape[:-1], float("inf"), dtype=torch.float64)
    top = torch.sort(s, dim=-1, descending=True, stable=True).values
    kth, nxt = top[..., k - 1], top[..., k]
    return (kth - nxt) / kth.abs().clamp_min(torch.finfo(torch.float64).tiny)
