"""The general-form RoPE Q/K system of one rotary layer, accumulated batch by batch for known kept dims
(METHODS.md §6; the math in :func:`edgeprune.solve.qk_rope.general_system`).

The counterpart of :class:`~edgeprune.calibration.qk_stats.QKSystemStatistics` for a rotary layer: a second
calibration pass, once the kept pairs are known, reduces each batch of rotated queries and keys to its share of
every head's ``d'^2 x d'^2`` normal equation. Memory: H d'^4 float64, independent of the number of images.
"""

from __future__ import annotations

import torch

from edgeprune.plan import pruned_indices
from edgeprune.solve import qk_rope


class RopeSystemStatistics:
    """Accumulates the general-form system of one rotary layer.

    Args:
        keep: (H, d') kept Q/K dims per head (pair-closed); qk_dim: the current per-head dim d.
        cos, sin: (H, n, d) the layer's RoPE tables (:class:`~edgeprune.layers.rotary_attention.RotaryAttention`).
        device: where the float64 system accumulates.
    """

    def __init__(self, keep: torch.Tensor, qk_dim: int, cos: torch.Tensor, sin: torch.Tensor,
                 device: torch.device | str = "cpu") -> None:
        self.keep = keep.to(device)
        self.prune = torch.stack([pruned_indices(k, qk_dim) for k in keep]).to(device)
        self.cos, self.sin = cos.detach().to(device), sin.detach().to(device)
        h, d = keep.shape
        self.k_sys = torch.zeros(h, d * d, d * d, dtype=torch.float64, device=device)
        self.rhs = torch.zeros(h, d * d, dtype=torch.float64, device=device)
        self.num_images = 0

    @torch.no_grad()
    def add_batch(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Add rotated queries and keys (B, H, n, d) (as ``calibration.collect.split_qk`` gives them)."""
        n = q.shape[2]
        ks, rhs = qk_rope.general_system(q, k, self.cos[:, :n], self.sin[:, :n], self.keep, self.prune)
        self.k_sys += ks
        self.rhs += rhs
        self.num_images += q.shape[0]

    def to(self, device: torch.device | str) -> "RopeSystemStatistics":
        """Move everything to ``device`` (in place); returns self."""
        for name in ("k_sys", "rhs", "keep", "prune", "cos", "sin"):
            setattr(self, name, getattr(self, name).to(device))
        return self
