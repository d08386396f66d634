"""Embed slicing end to end: folds -> stream moment -> rotation -> slice (issue 33).

:func:`slice_embed` prunes the residual width D of a timm ViT classifier to D' one-shot, in place:
``edgeprune.embed.fold`` (mean and affine folds, exact), ``edgeprune.embed.covariance`` (one
calibration pass), ``edgeprune.embed.rotate`` (one rotation for the whole depth, sliced), and
optionally ``edgeprune.embed.refit`` (ridge re-fit of the writers to the dense stream).
:func:`~edgeprune.residual.apply_embed_structure` (model surgery, below this package) gives a freshly
built model the sliced shapes for ``load_run``; it is handed on here.
"""

from __future__ import annotations

import copy
import time
from typing import Callable, Iterable

import torch

from edgeprune.anatomy import ViTAnatomy, find_anatomy
from edgeprune.embed.covariance import stream_moment
from edgeprune.embed.fold import fold_centring_and_affine
from edgeprune.embed.refit import refit_writers
from edgeprune.embed.rotate import principal_basis, rotate_and_slice
from edgeprune.errors import UserError
from edgeprune.plan import kept_dim
from edgeprune.residual import apply_embed_structure  # noqa: F401 (handed on; load_run's rebuild lives there)


def embed_kept_dim(dim: int, sparsity: float, round_to: int = 8) -> int:
    """D' for ``sparsity`` of a D-wide stream: ``edgeprune.plan.kept_dim`` (a multiple of ``round_to``,
    D itself at sparsity 0), at least 2.

    Raises:
        UserError: sparsity outside [0, 1), or a rounding that leaves fewer than 2 channels.
    """
    k = kept_dim(dim, sparsity, round_to, "the embedding (residual stream)")
    if k < 2:
        raise UserError(f"--embed-sparsity {sparsity:g} leaves {k} channel(s) of the residual stream; need >= 2")
    return k


def slice_embed(anatomy: ViTAnatomy, batches: Callable[[], Iterable[torch.Tensor]], sparsity: float,
                round_to: int = 8, refit: bool = False, refit_alpha: float = 1e-3) -> tuple[ViTAnatomy, dict]:
    """Prune the residual stream of ``anatomy``'s model to D' channels, in place.

    Args:
        anatomy: a timm ViT classifier (possibly width-pruned already).
        batches: callable returning fresh (B, C, H, W) calibration batches (called once, twice with
            ``refit``).
        sparsity: fraction of the D channels removed, [0, 1); D' from :func:`embed_kept_dim`.
        round_to: D' is a multiple of it.
        refit: re-fit the writers (``proj``, ``fc2``) by ridge to the dense stream on the sliced
            basis (``edgeprune.embed.refit``).
        refit_alpha: its scale-free ridge strength.

    Returns:
        (the model's new anatomy, record dict: ``embed_dim``, ``dense_embed_dim``, ``eps``,
        ``sparsity``, ``rotation``, ``kept_energy`` (fraction of the readers' moment in span V),
        ``images``, ``seconds``, and ``refit`` when run).

    Raises:
        UserError: a model whose stream cannot be folded (``stream_parts``), bad sparsity.
    """
    dense = anatomy.embed_dim
    dim = embed_kept_dim(dense, sparsity, round_to)
    t0 = time.perf_counter()
    parts = fold_centring_and_affine(anatomy)
    moment, info = stream_moment(anatomy, parts, batches())
    v, evals = principal_basis(moment, dim - 1)
    kept = float(evals[: dim - 1].clamp_min(0).sum() / evals.clamp_min(0).sum().clamp_min(1e-300))
    reference = None
    if refit:
        reference = copy.deepcopy(anatomy.model)
    rotate_and_slice(anatomy, parts, v, dim)
    new = find_anatomy(anatomy.model)
    record = {"embed_dim": dim, "dense_embed_dim": dense, "eps": float(parts.final_norm.eps),
              "sparsity": float(sparsity), "rotation": "single", "kept_energy": kept,
              "images": info["images"]}
    if refit and reference is not None:
        record["refit"] = refit_writers(find_anatomy(reference), new, v, batches, refit_alpha)
    record["seconds"] = time.perf_counter() - t0
    return new, record
