"""Pruning plan: how many dims each module keeps, and which.

"Sparsity s in a module" is the fraction of that module's prunable dims removed (corp-v1
Table 1): an MLP of hidden D keeps ``D (1 - s)`` channels; an attention layer of head_dim d_h keeps
``d_h (1 - s)`` Q/K dims per head (the same for every head of a layer), ``d_h (1 - s_v)`` V dims
per head, and ``H (1 - s_heads)`` whole heads (METHODS.md §5). Kept dims are rounded to the nearest
multiple of ``round_to`` (8 by default, for tensor cores) and never exceed the dense dim; kept heads
are rounded to the nearest integer (at least 1).

Targets (``--target``): ``mlp``; ``attn`` (Q/K head dims); ``both`` (mlp + attn); ``v`` (V/O head
dims); ``heads`` (whole heads); ``all`` (mlp + attn + v).
"""

from __future__ import annotations

import dataclasses

import torch

from edgeprune.errors import UserError

TARGETS = ("mlp", "attn", "both", "v", "heads", "all")
#: module keys of :func:`resolve_sparsities` and the targets that select each
SPARSITY_KEYS = ("mlp", "attn", "v", "heads")
_SELECTS = {"mlp": ("mlp",), "attn": ("attn",), "both": ("mlp", "attn"), "v": ("v",),
            "heads": ("heads",), "all": ("mlp", "attn", "v")}


@dataclasses.dataclass
class BlockPlan:
    """Kept indices of one block. ``None`` = that module is not pruned.

    Attributes:
        index: block index.
        mlp_keep: (D_mlp',) int64 sorted kept hidden channels.
        qk_keep: (H, d') int64 sorted kept Q/K dims per head, one row per head of the block as
            it was before pruning (rows of removed heads are ignored).
        head_keep: (H',) int64 sorted kept heads (``None`` = all heads kept).
        v_keep: (H, d_v') int64 sorted kept V dims per head, one row per head as for ``qk_keep``.
    """

    index: int
    mlp_keep: torch.Tensor | None = None
    qk_keep: torch.Tensor | None = None
    head_keep: torch.Tensor | None = None
    v_keep: torch.Tensor | None = None

    @property
    def prunes_attention(self) -> bool:
        """Whether the block's attention is rebuilt (Q/K, V or heads pruned)."""
        return self.qk_keep is not None or self.head_keep is not None or self.v_keep is not None


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


def kept_heads(num_heads: int, sparsity: float) -> int:
    """Number of whole heads kept out of ``num_heads`` at ``sparsity``: ``round(H (1 - s))`` (Python's
    round, ties to even), at least 1 and at most H; sparsity 0 keeps all.

    Raises:
        UserError: sparsity outside [0, 1).
    """
    check_sparsity(sparsity)
    if sparsity == 0:
        return num_heads
    k = int(round(num_heads * (1.0 - sparsity)))
    return max(1, min(num_heads, k))


def check_sparsity(sparsity: float) -> None:
    """Raises UserError unless 0 <= sparsity < 1."""
    if not (0.0 <= float(sparsity) < 1.0):
        raise UserError(f"sparsity must be in [0, 1), got {sparsity}")


def resolve_sparsities(target: str, sparsity: float | None, mlp_sparsity: float | None = None,
                       attn_sparsity: float | None = None, v_sparsity: float | None = None,
                       head_sparsity: float | None = None) -> dict[str, float]:
    """Per-module sparsities ``{"mlp", "attn", "v", "heads"}`` (0 for modules not pruned).

    ``sparsity`` applies to every module ``target`` selects (``all`` = mlp + attn + v; see the
    module doc); ``mlp_sparsity`` / ``attn_sparsity`` / ``v_sparsity`` / ``head_sparsity``
    override it for one module (and select it).

    Raises:
        UserError: unknown target, sparsity outside [0, 1).
    """
    if target not in TARGETS:
        raise UserError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")
    out = {key: 0.0 for key in SPARSITY_KEYS}
    if sparsity is not None:
        for key in _SELECTS[target]:
            out[key] = float(sparsity)
    for key, value in (("mlp", mlp_sparsity), ("attn", attn_sparsity), ("v", v_sparsity),
                       ("heads", head_sparsity)):
        if value is not None:
            out[key] = float(value)
    for v in out.values():
        check_sparsity(v)
    return out


def achieved_sparsity(dense_blocks: list[dict], pruned_blocks: list[dict]) -> dict[str, float]:
    """Fraction of each kind of dim removed over the whole model, from :func:`block_dims` records.

    Keys: ``mlp`` (MLP hidden channels), ``attn`` (Q/K dims, sum over heads of qk_dim),
    ``v`` (V dims, sum over heads of v_dim) and ``heads`` (whole heads). Removed heads count
    towards ``attn`` and ``v`` too (their dims are gone).

    Args:
        dense_blocks, pruned_blocks: per-block dicts with ``num_heads``, ``qk_dim``, ``v_dim``,
            ``mlp_hidden`` (``edgeprune.surgery.block_dims``), same length.
    """
    def frac(key: str, weight: str | None) -> float:
        d = sum(b[key] * (b[weight] if weight else 1) for b in dense_blocks)
        p = sum(b[key] * (b[weight] if weight else 1) for b in pruned_blocks)
        return 1.0 - p / d if d else 0.0

    return {"mlp": frac("mlp_hidden", None), "attn": frac("qk_dim", "num_heads"),
            "v": frac("v_dim", "num_heads"), "heads": frac("num_heads", None)}


#: module keys of ``CorpConfig.dims`` / the allocator (the sparsity each follows: ``CorpConfig.sparsity_of``)
MODULES = ("mlp", "qk", "v", "heads")
_TARGET_MODULES = {"mlp": ("mlp",), "attn": ("qk",), "both": ("mlp", "qk"), "v": ("v",),
                   "heads": ("heads",), "all": ("mlp", "qk", "v")}


def target_modules(target: str) -> tuple[str, ...]:
    """The ``MODULES`` a target selects (``both`` -> ("mlp", "qk"))."""
    if target not in _TARGET_MODULES:
        raise UserError(f"unknown target {target!r} (choose from {', '.join(TARGETS)})")
    return _TARGET_MODULES[target]


def dims_override(cfg, block: int, key: str) -> int | None:
    """The kept count of module ``key`` ("mlp", "qk", "v", "heads") in ``block`` set by
    ``cfg.dims`` (per-block kept dims), or None when the sparsity decides."""
    dims = getattr(cfg, "dims", None)
    if not dims or block >= len(dims) or dims[block] is None:
        return None
    v = dims[block].get(key)
    return None if v is None else int(v)


def pruned_modules(cfg) -> set[str]:
    """Which modules ("mlp", "qk", "v", "heads") a :class:`~edgeprune.corp.CorpConfig` may prune:
    those with a sparsity > 0, those named in ``cfg.dims``, and, with a budget, those the target
    selects (the allocator decides how much)."""
    out = {key for key in MODULES if cfg.sparsity_of(key) > 0}
    for d in getattr(cfg, "dims", None) or []:
        out |= {k for k in (d or {}) if k in MODULES}
    if getattr(cfg, "budget", None) is not None:
        out |= set(target_modules(cfg.target))
    if getattr(cfg, "layout", "default") == "fused" and ("qk" in out or "v" in out):
        out |= {"qk", "v"}
    return out


def check_dims(dims: list | None) -> None:
    """Raises UserError unless ``dims`` is None or a list of per-block dicts of positive ints with
    keys from ``MODULES``."""
    if dims is None:
        return
    if not isinstance(dims, (list, tuple)):
        raise UserError(f"dims must be a list of per-block dicts, got {type(dims).__name__}")
    for i, d in enumerate(dims):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise UserError(f"dims[{i}] must be a dict, got {type(d).__name__}")
        for k, v in d.items():
            if k not in MODULES:
                raise UserError(f"dims[{i}]: unknown module {k!r} (choose from {', '.join(MODULES)})")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"dims[{i}][{k!r}] must be a positive int, got {v!r}")


def pruned_indices(keep: torch.Tensor, dim: int) -> torch.Tensor:
    """The complement P of kept indices S in ``range(dim)``, ascending (int64).

    Args:
        keep: S, (k,) int64 kept indices; dim: the dense dim.
    """
    all_dims = torch.arange(dim)
    return all_dims[~torch.isin(all_dims, keep)]
