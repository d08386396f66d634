"""Sequential calibration: block-by-block statistics on the pruned model's own inputs.

METHODS.md §5 "Sequential calibration" (issue 14). One-shot CORP takes every statistic on the
dense model; block i of the pruned model, however, sees the output of the already pruned blocks
0..i-1. Here two token streams advance through the model one block at a time over the whole
calibration set:

* the dense stream ``x_i`` (the dense model's input of block i) and
* the pruned stream ``x~_i`` (the finished pruned model's input of block i).

For block i: (1) both streams go through the still dense block i; hooks at ``qkv``'s output,
``proj``'s input and ``fc2``'s input give the pruned stream's statistics (ranking, Grams,
covariances) and the cross statistics with the dense stream; the dense output becomes
``x_{i+1}``. (2) Kept dims are ranked on the pruned stream's statistics (the usual criteria:
``edgeprune.ranking``, ``vo.plan_attention``). (3) The compensation fits the dense block's
signals from the pruned stream's kept channels: ``fc2`` and ``proj`` with the two-stream ridge map
of ``edgeprune.solve.cross_fit``, Q/K with the two-stream logit system of
``edgeprune.solve.qk_logit_cross``; the fold and surgery are CORP's (``surgery.shrink_mlp``,
``vo.prune_attention``). (4) The pruned block runs on ``x~_i`` to give ``x~_{i+1}``.

Until the first pruned block the streams are equal and share storage (one pass per block), and
there every fit is exactly CORP's; blocks after the last pruned one are not run at all. Within a
block the MLP statistics of the pruned stream are taken behind the block's *dense* attention (one
statistics pass per block; the next block's statistics see the pruned attention).

Cost, in block evaluations over the calibration set: per pruned block 2 (dense block on both
streams, batched together) + 1 (pruned block on the pruned stream, cheaper by its sparsity); per
block before the first pruned one 1; i.e. about 2 + (1 - s) dense passes in total, reported in the
info dict (``sequential.dense_pass_equivalents``). Memory: the two streams (``N * n * D * 4``
bytes each) in memory up to ``CorpConfig.sequential_memory_gb``, beyond that in temporary numpy
memmaps (deleted at the end); plus one block's statistics at a time. Not distributed (torchrun):
each rank would need the other ranks' streams.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

import torch

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy
from edgeprune.calibration.collect import collect_statistics, split_qk
from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.calibration.qk_stats import QKStatistics
from edgeprune.errors import UserError
from edgeprune.plan import BlockPlan, pruned_indices
from edgeprune.progress import progress as show_progress
from edgeprune.ranking import mlp_scores, top_k_indices
from edgeprune.sequential.streams import Stream, StreamStore
from edgeprune.solve import cross_fit, mlp_ridge
from edgeprune.solve.qk_logit_cross import QKCrossGrams, cross_rhs
from edgeprune.surgery import shrink_mlp

__all__ = ["sequential_prune", "CrossStatistics", "embed_stream", "block_modules"]


class CrossStatistics:
    """Streaming cross covariance ``Cov(h, h~)`` of two paired activation streams.

    Sums in float64 over shifted data (each stream shifted by its first batch's mean, as in
    :class:`~edgeprune.calibration.mlp_stats.MLPStatistics`); per-batch products in ``gram_dtype``.
    Memory: D^2 float64.

    Args:
        dim: D (channels of both streams); gram_dtype: dtype of the per-batch product.
    """

    def __init__(self, dim: int, gram_dtype: torch.dtype = torch.float32) -> None:
        self.dim, self.gram_dtype = dim, gram_dtype
        self.count = 0
        self._shift_d: torch.Tensor | None = None
        self._shift_p: torch.Tensor | None = None
        self._sum_d = torch.zeros(dim, dtype=torch.float64)
        self._sum_p = torch.zeros(dim, dtype=torch.float64)
        self._gram = torch.zeros(dim, dim, dtype=torch.float64)

    @torch.no_grad()
    def add_batch(self, dense: torch.Tensor, pruned: torch.Tensor) -> None:
        """Add paired activations (..., D) of the dense and the pruned stream (same tokens).

        Raises:
            ValueError: shapes differ or the last dim is not D.
        """
        if dense.shape != pruned.shape or dense.shape[-1] != self.dim:
            raise ValueError(f"expected two (..., {self.dim}) tensors of one shape, got "
                             f"{tuple(dense.shape)} and {tuple(pruned.shape)}")
        xd, xp = dense.reshape(-1, self.dim), pruned.reshape(-1, self.dim)
        if xd.shape[0] == 0:
            return
        if self._shift_d is None:
            # stored as subtracted below (rounded to gram_dtype), so the means add back exactly it
            self._shift_d = xd.double().mean(0).to(self.gram_dtype).double()
            self._shift_p = xp.double().mean(0).to(self.gram_dtype).double()
        cd = xd.to(self.gram_dtype) - self._shift_d.to(self.gram_dtype)
        cp = xp.to(self.gram_dtype) - self._shift_p.to(self.gram_dtype)
        self._sum_d += cd.sum(0)
        self._sum_p += cp.sum(0)
        self._gram += cd.T @ cp
        self.count += xd.shape[0]

    def _check(self) -> None:
        if self.count == 0:
            raise RuntimeError("CrossStatistics: no activations were added")

    @property
    def mean_dense(self) -> torch.Tensor:
        """mu (D,) float64 of the dense stream."""
        self._check()
        return self._shift_d + self._sum_d / self.count

    @property
    def mean_pruned(self) -> torch.Tensor:
        """mu~ (D,) float64 of the pruned stream."""
        self._check()
        return self._shift_p + self._sum_p / self.count

    @property
    def cov(self) -> torch.Tensor:
        """Cov(h, h~) (D, D) float64 (1/N), rows dense channels, columns pruned channels."""
        self._check()
        md, mp = self._sum_d / self.count, self._sum_p / self.count
        return self._gram / self.count - torch.outer(md, mp)


class _Stop(Exception):
    pass


@torch.no_grad()
def embed_stream(anatomy: ViTAnatomy, batches: Iterable[torch.Tensor], store: StreamStore,
                 progress: bool = False) -> Stream:
    """The token stream entering block 0 (patch embedding, class/distillation/register tokens,
    position embedding, ``patch_drop``, ``norm_pre``) for every calibration batch.

    Taken by running the model itself up to block 0 (a pre-hook on block 0 stops the forward), so
    it is exactly what the model computes, wrappers (``.backbone``) included.

    Args:
        anatomy: the model's anatomy (put in eval mode).
        batches: image batches (B, C, H, W).
        store: where the chunks go.

    Returns:
        a :class:`Stream` of (B, n, D) float32 chunks.

    Raises:
        UserError: images of the wrong shape, or no images.
    """
    model = anatomy.model
    model.eval()
    captured: list[torch.Tensor] = []

    def hook(_m, args):
        captured.append(args[0])
        raise _Stop

    handle = anatomy.blocks[0].block.register_forward_pre_hook(hook)
    expected = (anatomy.in_chans, *anatomy.img_size)
    stream = Stream(store)
    try:
        for x in show_progress(batches, "sequential: embedding", enabled=progress, unit="batch"):
            if x.dim() != 4 or tuple(x.shape[1:]) != expected:
                raise UserError(f"calibration images have shape {tuple(x.shape[1:])}, "
                                f"the model takes {expected}")
            try:
                model(x)
            except _Stop:
                pass
            else:
                raise RuntimeError("the model did not call its first block")
            stream.append(captured.pop())
    finally:
        handle.remove()
    if len(stream) == 0:
        raise UserError("the calibration set is empty")
    return stream


def block_modules(b: BlockAnatomy, cfg) -> dict:
    """What block ``b`` prunes under ``cfg``: ``{"mlp": kept channels, "heads", "qk", "v",
    "prune_mlp", "prune_qk", "prune_vo"}``.

    Raises:
        UserError: as ``corp.mlp_kept`` / ``vo.attention_dims``.
    """
    from edgeprune.corp import mlp_kept
    from edgeprune.vo import attention_dims

    heads, qk, v = attention_dims(b, cfg)
    k = mlp_kept(b, cfg)
    return {"mlp": k, "heads": heads, "qk": qk, "v": v, "prune_mlp": k < b.mlp_hidden,
            "prune_qk": qk < b.qk_dim, "prune_vo": heads < b.num_heads or v < b.v_dim}


class _Capture:
    """Forward hooks on one block: ``qkv`` output, ``proj`` input, ``fc2`` input."""

    def __init__(self, b: BlockAnatomy, qk: bool, vo: bool, mlp: bool) -> None:
        self.out: dict[str, torch.Tensor] = {}
        self.handles = []
        if qk:
            self.handles.append(b.qkv.register_forward_hook(lambda _m, _a, o: self.out.__setitem__("qkv", o)))
        if vo:
            self.handles.append(b.proj.register_forward_pre_hook(lambda _m, a: self.out.__setitem__("z", a[0])))
        if mlp:
            self.handles.append(b.fc2.register_forward_pre_hook(lambda _m, a: self.out.__setitem__("h", a[0])))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _two_stream_fit(weight, bias, keep, own: MLPStatistics, cross: CrossStatistics | None, alpha: float):
    """Fold of a Linear whose input channels ``keep`` survive (cross_fit; equal streams: CORP)."""
    if cross is None:  # streams equal: Cov(h, h~) = Sigma~, mu = mu~
        cov_x, mean_d = own.cov, own.mean
    else:
        cov_x, mean_d = cross.cov, cross.mean_dense
    t_mat, t_vec, lam = cross_fit.cross_affine_map(mean_d, own.mean, cov_x, own.cov, keep, alpha)
    w, b = cross_fit.fold_cross_map(weight, bias, t_mat, t_vec)
    return w, b, lam


@torch.no_grad()
def _prune_block(b: BlockAnatomy, what: dict, cfg, dense: Stream, pruned: Stream, shared: bool,
                 gram_dtype: torch.dtype) -> dict:
    """Statistics pass on both streams (advancing the dense one), ranking, fit, fold and surgery
    of one block (in place). Returns the block's solve info."""
    from edgeprune.corp import qk_solver_from_grams
    from edgeprune.vo import plan_attention, prune_attention

    comp = cfg.compensation
    two = comp and not shared
    H, dq = b.num_heads, b.qk_dim
    mlp_st = MLPStatistics(b.mlp_hidden, gram_dtype, comp) if what["prune_mlp"] else None
    mlp_x = CrossStatistics(b.mlp_hidden, gram_dtype) if what["prune_mlp"] and two else None
    qk_st = QKStatistics(H, dq, keep_grams=comp, gram_dtype=gram_dtype) if what["prune_qk"] else None
    qk_x = QKCrossGrams(H, dq) if what["prune_qk"] and two else None
    vo_st = MLPStatistics(b.proj.in_features, gram_dtype, True) if what["prune_vo"] else None
    vo_x = CrossStatistics(b.proj.in_features, gram_dtype) if what["prune_vo"] and two else None
    cap = _Capture(b, qk_st is not None, vo_st is not None, mlp_st is not None)
    try:
        for j in range(len(dense)):
            xd = dense.get(j)
            n = xd.shape[0]
            inp = xd if shared else torch.cat([xd, pruned.get(j)])
            cap.out.clear()
            out = b.block(inp)
            dense.set(j, out[:n])
            both = lambda t: (t, t) if shared else (t[:n], t[n:])  # noqa: E731
            if mlp_st is not None:
                hd, hp = both(cap.out["h"])
                mlp_st.add_batch(hp)
                if mlp_x is not None:
                    mlp_x.add_batch(hd, hp)
            if vo_st is not None:
                zd, zp = both(cap.out["z"])
                vo_st.add_batch(zp)
                if vo_x is not None:
                    vo_x.add_batch(zd, zp)
            if qk_st is not None:
                q, k = split_qk(cap.out["qkv"], H, dq)
                (qd, qp), (kd, kp) = both(q), both(k)
                qk_st.add_batch(qp, kp)
                if qk_x is not None:
                    qk_x.add_batch(qd, kd, qp, kp)
    finally:
        cap.remove()
    t_solve = time.perf_counter()
    plan = BlockPlan(index=b.index)
    if what["prune_mlp"]:
        plan.mlp_keep = top_k_indices(mlp_scores(mlp_st, b.fc2.weight.detach(), cfg.mlp_criterion), what["mlp"])
    if what["prune_qk"] or what["prune_vo"]:
        plan_attention(b, plan, cfg, qk_st, vo_st)
    rec: dict = {"index": b.index}
    if plan.mlp_keep is not None:
        keep = plan.mlp_keep
        w2 = b.fc2.weight.detach()
        b2 = None if b.fc2.bias is None else b.fc2.bias.detach()
        if comp:
            w2, b2, rec["mlp_lambda"] = _two_stream_fit(w2, b2, keep, mlp_st, mlp_x, cfg.ridge_alpha)
        else:
            w2, b2 = mlp_ridge.fold_into_linear(w2, b2, keep, pruned_indices(keep, b.mlp_hidden), None, None)
        shrink_mlp(b, keep, w2, b2)
    if plan.prunes_attention:
        qk_solve = proj_fit = None
        if comp and qk_st is not None:
            rhs_fn = None
            if qk_x is not None:
                gq, gk = qk_st.grams()
                xq, xk = qk_x.grams()
                rhs_fn = lambda _i, h, keep, _p: cross_rhs(gq[:, h], gk[:, h], xq[:, h], xk[:, h], keep)  # noqa: E731
            qk_solve = qk_solver_from_grams({b.index: qk_st}, {b.index: plan}, cfg, rhs_fn)
        if comp and vo_st is not None:
            def proj_fit(keep, _prune, w, bias):
                return _two_stream_fit(w, bias, keep, vo_st, vo_x, cfg.ridge_alpha)
        rec.update(prune_attention(b, plan, cfg, vo_st, qk_solve, proj_fit))
    rec["solve_seconds"] = time.perf_counter() - t_solve
    return rec


@torch.no_grad()
def _advance(b: BlockAnatomy, stream: Stream) -> None:
    for j in range(len(stream)):
        stream.set(j, b.block(stream.get(j)))


def sequential_prune(anatomy: ViTAnatomy, batches: Callable[[], Iterable[torch.Tensor]], cfg,
                     num_images: int | None = None, progress: bool = True,
                     on_block: Callable[[int, Stream, Stream], None] | None = None) -> dict:
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

    Returns:
        the info dict of ``corp_prune`` (``calibration_seconds``, ``solve_seconds``, ``passes`` =
        reads of the calibration set, ``num_images``, ``blocks``, ``allocation``) plus
        ``sequential``: ``block_evaluations`` (blocks run over the calibration set, either stream),
        ``dense_pass_equivalents`` (that / depth), ``spilled_bytes`` (streams written to disk).

    Raises:
        UserError: invalid settings, empty or mis-shaped calibration data, torchrun.
    """
    cfg.validate()
    from edgeprune.distributed import is_distributed

    if is_distributed():
        raise UserError("sequential calibration does not run under torchrun (each rank would need the "
                        "other ranks' token streams); run it in one process")
    if cfg.dims is not None and len(cfg.dims) != len(anatomy.blocks):
        raise UserError(f"dims has {len(cfg.dims)} entries, the model has {len(anatomy.blocks)} blocks")
    gram_dtype = torch.float64 if cfg.gram_dtype == "float64" else torch.float32
    whats = [block_modules(b, cfg) for b in anatomy.blocks]  # user errors before any pass
    calib_seconds = solve_seconds = 0.0
    passes = 0
    allocation = None
    if cfg.budget is not None:
        from edgeprune.allocation.select import select_allocation
        from edgeprune.plan import pruned_modules

        modules = pruned_modules(cfg)
        stats = collect_statistics(anatomy, batches(), mlp="mlp" in modules, qk="qk" in modules,
                                   qk_grams="qk" in modules and cfg.compensation, gram_dtype=gram_dtype,
                                   mlp_second_order=cfg.compensation, vo=bool(modules & {"v", "heads"}),
                                   progress=progress)
        calib_seconds += stats.seconds
        passes += 1
        t0 = time.perf_counter()
        dims, allocation = select_allocation(anatomy, stats, cfg, batches)
        del stats
        cfg = dataclasses.replace(cfg, dims=dims)
        cfg.validate()
        whats = [block_modules(b, cfg) for b in anatomy.blocks]
        solve_seconds += time.perf_counter() - t0
    pruned_blocks = [i for i, w in enumerate(whats) if w["prune_mlp"] or w["prune_qk"] or w["prune_vo"]]
    last = pruned_blocks[-1] if pruned_blocks else -1
    store = StreamStore(cfg.sequential_memory_gb * 2 ** 30)
    evals = 0
    info: list[dict] = []
    try:
        t0 = time.perf_counter()
        dense = embed_stream(anatomy, batches(), store, progress)
        passes += 1
        count = dense.num_images
        pruned = dense  # shared storage while the streams are equal
        calib_seconds += time.perf_counter() - t0
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
                rec = _prune_block(b, what, cfg, dense, pruned, shared, gram_dtype)
                solve_seconds += rec["solve_seconds"]
                calib_seconds -= rec.pop("solve_seconds")
                info.append(rec)
                if b.index < last:
                    _advance(b, pruned)
                    evals += 1
            else:
                info.append({"index": b.index})
                _advance(b, dense)
                evals += 1
                if not shared:
                    _advance(b, pruned)
                    evals += 1
            calib_seconds += time.perf_counter() - t0
        info += [{"index": b.index} for b in anatomy.blocks[last + 1:]]
    finally:
        store.close()
    return {"calibration_seconds": calib_seconds, "solve_seconds": solve_seconds, "passes": passes,
            "num_images": count, "blocks": info, "allocation": allocation,
            "sequential": {"block_evaluations": evals,
                           "dense_pass_equivalents": evals / len(anatomy.blocks),
                           "spilled_bytes": store.spilled_bytes}}
