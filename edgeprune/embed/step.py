"""The embed slice inside ``edgeprune.prune`` (issue 33): when it runs and what it does to a budget.

``CorpConfig.embed_order`` "first" slices the residual stream before the width pruning (CORP then
prunes the sliced model; a budget given as a fraction of the dense model is turned into the absolute
count of the *unsliced* model first, so "FLOPs x0.5" means the same thing with or without a slice);
"last" slices the width-pruned model (no budget: the slice's saving would come on top of it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import torch

from edgeprune.anatomy import ViTAnatomy
from edgeprune.distributed import is_distributed
from edgeprune.embed.fold import stream_parts
from edgeprune.embed.slice import embed_kept_dim, slice_embed
from edgeprune.settings import SettingError


def slices_first(config) -> bool:
    """Whether ``config`` slices the stream before the width pruning."""
    return bool(config.embed_sparsity) and config.embed_order == "first"


def refuse_distributed() -> None:
    """Raises UserError under torch.distributed: the slice's statistics are not all-reduced."""
    if is_distributed():
        raise SettingError("{embed_sparsity} runs in one process for now (its statistics are not all-reduced); "
                           "run without torchrun")


def embed_budget(config, anatomy: ViTAnatomy):
    """``config`` with a fractional budget turned into the absolute count of ``anatomy``'s model when
    the stream is sliced first; ``config`` itself otherwise.

    Also checks, before any pass, that the model's stream can be sliced at all.

    Raises:
        UserError: a budget with ``embed_order="last"``, a model or a D' the slice cannot handle, or a
            torch.distributed run.
    """
    if not config.embed_sparsity:
        return config
    refuse_distributed()
    stream_parts(anatomy)
    embed_kept_dim(anatomy.embed_dim, config.embed_sparsity, config.round_to)
    if config.budget is None:
        return config
    if config.embed_order != "first":
        raise SettingError("{embed_order} last cannot be combined with {flops}/{params} (the slice would come on "
                           "top of the budget); use the default order (first)")
    if not config.budget.is_fraction:
        return config
    return dataclasses.replace(config, budget=config.budget.absolute(config.budget.dense_cost(anatomy))).validate()


def embed_stage(anatomy: ViTAnatomy, batches: Callable[[], Iterable[torch.Tensor]], config, when: str,
                previous: dict | None = None) -> tuple[ViTAnatomy, object, dict | None]:
    """Slice the stream if ``config`` asks for it at this stage (``when``: "first" / "last").

    Returns:
        (the model's anatomy, the config for what follows -- the budget dropped when the sliced
        model already meets it -- and the slice's record, or ``previous`` when nothing ran).
    """
    if not config.embed_sparsity or config.embed_order != when:
        return anatomy, config, previous
    anatomy, record = slice_embed(anatomy, batches, config.embed_sparsity, config.round_to, config.embed_refit)
    if config.budget is not None and config.budget.dense_cost(anatomy) <= config.budget.target(0.0):
        config = dataclasses.replace(config, budget=None).validate()  # the slice alone meets it
        record["budget_met_by_slice"] = True
    return anatomy, config, record
