"""Pruning plan: how many dims each module keeps, and which.

"Sparsity s in a module" is the fraction of that module's prunable dims removed (corp-v1
Table 1): an MLP of hidden D keeps ``D (1 - s)`` channels; an attention layer of head_dim d_h keeps
``d_h (1 - s)`` Q/K dims per head (the same for every head of a layer). Kept dims are rounded to
the nearest multiple of ``round_to`` (8 by default, for tensor cores) and never exceed the dense dim.
"""

from __future__ import annotations

import dataclasses

import torch

from edgeprune.errors import UserError

TARGETS = ("mlp", "attn", "both")


@dataclasses.dataclass
class BlockPlan:
    """Kept indices of one block. ``None`` = that module is not pruned.

    Attributes:
        index: block index.
        mlp_keep: (D_mlp',) int64 sorted kept hidden channels.
        qk_keep: (H, d') int64 sorted kept Q/K dims per head.
    """

    index: int
    mlp_keep: torch.Tensor | None = None
    qk_keep: torch.Tensor | None = None


def kept_dim(dim: int, sparsity: float, round_to: int = 8, what: str = "module") -> int:
    """Number of dims kept out of ``dim`` at ``sparsity``, rounded to a multiple of ``round_to``.

    ``round_to * round(dim * (1 - sparsity) / round_to)``, capped at ``dim`` (so sparsity 0 keeps
    everything even if ``round_to`` does not divide ``dim``).

    Raises:
        UserError: sparsity outside [0, 1), round_to < 1, or rounding leaves no dims.
    """
    check_sparsity(sparsity)
    if round_to < 1:
        raise UserError(f"--round-to must be >= 1, got {round_to}")
    if sparsity == 0:
        return dim
    k = round_to * int(round(dim * (1.0 - sparsity) / round_to))
    k = min(k, dim)
    if k < 1:
        raise UserError(f"sparsity {sparsity:g} with --round-to {round_to} leaves no dims in {what} "
                        f"(dim {dim}); lower the sparsity or the rounding")
    return k


def check_sparsity(sparsity: float) -> None:
    """Raises UserError unless 0 <= sparsity < 1."""
    if not (0.0 <= float(sparsity) < 1.0):
        raise UserError(f"sparsity must be in [0, 1), got {sparsity}")


def resolve_sparsities(target: str, sparsity: float | None, mlp_sparsity: float | None = None,
                       attn_sparsity: float | None = None) -> dict[str, float]:
    """Per-target sparsities ``{"mlp": s_mlp, "attn": s_attn}`` (0 for targets not pruned).

    ``sparsity`` applies to every selected target; ``mlp_sparsity`` / ``attn_sparsity`` override
    it for one target (and select it).

    Raises:
        UserError: unknown target, sparsity outside [0, 1), or nothing to prune.
    """
    if target not in TARGETS:
        raise UserError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")
    out = {"mlp": 0.0, "attn": 0.0}
    for key in ("mlp", "attn"):
        if target in (key, "both") and sparsity is not None:
            out[key] = float(sparsity)
    if mlp_sparsity is not None:
        out["mlp"] = float(mlp_sparsity)
    if attn_sparsity is not None:
        out["attn"] = float(attn_sparsity)
    for v in out.values():
        check_sparsity(v)
    return out


def pruned_indices(keep: torch.Tensor, dim: int) -> torch.Tensor:
    """The complement P of kept indices S in ``range(dim)``, ascending (int64).

    Args:
        keep: S, (k,) int64 kept indices; dim: the dense dim.
    """
    all_dims = torch.arange(dim)
    return all_dims[~torch.isin(all_dims, keep)]
