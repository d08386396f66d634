"""Sequential calibration, the driver: optional dense allocation pass, then block by block
(module doc of ``edgeprune.sequential``)."""

from __future__ import annotations

import time
from typing import Callable, Iterable

import torch

from edgeprune.allocation import select as allocation_select
from edgeprune.anatomy import ViTAnatomy
from edgeprune.calibration.collect import collect_statistics
from edgeprune.distributed import is_distributed
from edgeprune.errors import UserError
from edgeprune.plan import pruned_modules
from edgeprune.progress import progress as show_progress
from edgeprune.sequential.block import advance, block_modules, prune_block
from edgeprune.sequential.embed import embed_stream
from edgeprune.sequential.streams import Stream, StreamStore


def _allocate(anatomy: ViTAnatomy, batches, cfg, gram_dtype: torch.dtype, progress: bool):
    """The budget's dense statistics pass and the allocation.

    Returns:
        (cfg with the allocated dims, allocation report, seconds of the pass, seconds of the allocation).
    """
    modules = pruned_modules(cfg)
    stats = collect_statistics(anatomy, batches(), mlp="mlp" in modules, qk="qk" in modules,
                               qk_grams="qk" in modules and cfg.compensation, gram_dtype=gram_dtype,
                               mlp_second_order=cfg.compensation, vo=bool(modules & {"v", "heads"}),
                               progress=progress)
    t0 = time.perf_counter()
    dims, allocation = allocation_select.select_allocation(anatomy, stats, cfg, batches)
    return cfg.with_dims(dims), allocation, stats.seconds, time.perf_counter() - t0


def _run_blocks(anatomy: ViTAnatomy, whats: list[dict], cfg, dense: Stream, gram_dtype: torch.dtype,
                progress: bool, on_block) -> tuple[list[dict], int, float, float]:
    """Blocks 0..last pruned one, in order, advancing both streams.

    Returns:
        (per-block solve info, block evaluations, calibration seconds, solve seconds).
    """
    pruned_blocks = [i for i, w in enumerate(whats) if w["prune_mlp"] or w["prune_qk"] or w["prune_vo"]]
    last = pruned_blocks[-1] if pruned_blocks else -1
    pruned = dense  # shared storage while the streams are equal
    evals = 0
    calib_seconds = solve_seconds = 0.0
    info: list[dict] = []
    blocks = anatomy.blocks[:last + 1]
    for b in show_progress(blocks, "sequential calibration", enabled=progress, total=len(blocks), unit="block"):
        what = whats[b.index]
        shared = pruned is dense
        if on_block is not None:
            on_block(b.index, dense, pruned)
        t0 = time.perf_counter()
        if what["prune_mlp"] or what["prune_qk"] or what["prune_vo"]:
            if shared and b.index < last:
                pruned = dense.copy()
            evals += 1 if shared else 2
            rec = prune_block(b, what, cfg, dense, pruned, shared, gram_dtype)
            solve_seconds += rec["solve_seconds"]
            calib_seconds -= rec.pop("solve_seconds")
            info.append(rec)
            if b.index < last:
                advance(b, pruned)
                evals += 1
        else:
            info.append({"index": b.index})
            advance(b, dense)
            evals += 1
            if not shared:
                advance(b, pruned)
                evals += 1
        calib_seconds += time.perf_counter() - t0
    info += [{"index": b.index} for b in anatomy.blocks[last + 1:]]
    return info, evals, calib_seconds, solve_seconds


def sequential_prune(anatomy: ViTAnatomy, batches: Callable[[], Iterable[torch.Tensor]], cfg,
                     num_images: int | None = None, progress: bool = True,
                     on_block: Callable[[int, Stream, Stream], None] | None = None, *, checked: bool = False) -> dict:
    """Prune the model of ``anatomy`` in place with sequential calibration (module doc).

    Args:
        anatomy: anatomy of the model to prune (modified in place).
        batches: callable returning a fresh iterable of calibration batches (B, C, H, W); called
            once (twice with ``cfg.budget``: a dense statistics pass for the allocator first).
        cfg: :class:`~edgeprune.corp.CorpConfig` (``sequential`` need not be set here).
        num_images: calibration size if known (unused but for symmetry with ``corp_prune``).
        progress: show progress.
        on_block: called as ``f(i, dense, pruned)`` with the two streams entering block i, before
            block i is processed (for inspection; e.g. tests check them against forward passes).
        checked: ``cfg`` was validated and its ``dims`` checked against the model by the caller
            (``corp_prune``).

    Returns:
        the info dict of ``corp_prune`` (``calibration_seconds``, ``solve_seconds``, ``passes`` =
        reads of the calibration set, ``num_images``, ``blocks``, ``allocation``) plus
        ``sequential``: ``block_evaluations`` (blocks run over the calibration set, either stream),
        ``dense_pass_equivalents`` (that / depth), ``spilled_bytes`` (streams written to disk).

    Raises:
        UserError: invalid settings, empty or mis-shaped calibration data, torchrun.
    """
    if not checked:
        cfg = cfg.ensure_valid()
    if is_distributed():
        raise UserError("sequential calibration does not run under torchrun (each rank would need the "
                        "other ranks' token streams); run it in one process")
    if not checked and cfg.dims is not None and len(cfg.dims) != len(anatomy.blocks):
        raise UserError(f"dims has {len(cfg.dims)} entries, the model has {len(anatomy.blocks)} blocks")
    gram_dtype = torch.float64 if cfg.gram_dtype == "float64" else torch.float32
    whats = [block_modules(b, cfg) for b in anatomy.blocks]  # user errors before any pass
    calib_seconds = solve_seconds = 0.0
    passes = 0
    allocation = None
    if cfg.budget is not None:
        cfg, allocation, calib_seconds, solve_seconds = _allocate(anatomy, batches, cfg, gram_dtype, progress)
        passes += 1
        whats = [block_modules(b, cfg) for b in anatomy.blocks]
    store = StreamStore(cfg.sequential_memory_gb * 2 ** 30)
    try:
        t0 = time.perf_counter()
        dense = embed_stream(anatomy, batches(), store, progress)
        passes += 1
        count = dense.num_images
        calib_seconds += time.perf_counter() - t0
        info, evals, calib_s, solve_s = _run_blocks(anatomy, whats, cfg, dense, gram_dtype, progress, on_block)
        calib_seconds += calib_s
        solve_seconds += solve_s
    finally:
        store.close()
    return {"calibration_seconds": calib_seconds, "solve_seconds": solve_seconds, "passes": passes,
            "num_images": count, "blocks": info, "allocation": allocation,
            "sequential": {"block_evaluations": evals,
                           "dense_pass_equivalents": evals / len(anatomy.blocks),
                           "spilled_bytes": store.spilled_bytes}}
