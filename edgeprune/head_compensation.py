"""Whole heads compensated through the MLP that follows: after CORP's folds, one more calibration
pass refits ``fc2`` of every block that lost heads to the dense block's output
(``edgeprune.solve.attn_heads``; METHODS.md §5; docs/heads.md).

One-shot, like the rest of CORP: every block sees the *dense* stream's input (the dense model's
activations before that block), its pruned attention and MLP run on it, and ``fc2`` is refit so
that the pruned block's output matches the dense block's output on it. Only blocks whose heads
were removed are touched (with compensation on); every other block, and every model pruned
without removing heads, is bitwise what it was.

A latency correction prunes the same dense model again for another budget value (issue 40 item 4):
:class:`RefitCache` lets its refit pass reuse the first round's dense stream (no dense forward) and the
fit statistics of every block pruned exactly as before (same weights, same dense input: the same
statistics), so a round pays only for the blocks its allocation changed -- bitwise the same refits.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from typing import Callable, Iterable

import torch

from edgeprune.anatomy import BlockAnatomy, ViTAnatomy, find_anatomy
from edgeprune.calibration.stream import STREAM_BYTES, BatchStream, StreamRecorder
from edgeprune.distributed import all_reduce_sum, is_distributed
from edgeprune.plan import BlockPlan
from edgeprune.solve.attn_heads import OutputFitStatistics, refit_linear
from edgeprune.surgery import shrink_mlp


@dataclasses.dataclass
class RefitCache:
    """What a later round's refit pass reuses from an earlier one on the same dense model and calibration
    batches (a latency correction's rounds, issue 40 item 4; kept in ``CalibrationStatistics.derived``).

    Attributes:
        stream: per calibration batch, per block (0..depth-1), the dense block's input and output
            (:class:`~edgeprune.calibration.stream.StreamRecorder`: from the statistics pass, or kept by the
            first refit pass); None until one kept it, or for good once it would exceed ``limit_bytes``
            (``too_big``).
        fits: the refit blocks' fit statistics of the latest round, keyed by (block index,
            :func:`block_digest` of the block as pruned): a block pruned to the same weights sees the same
            dense input, so its statistics are the same.
        limit_bytes: the bound on the stream's memory.
        dense_digest: :func:`block_digest` of the dense model it was kept for (:meth:`check_dense`).
    """

    stream: list[BatchStream] | None = None
    fits: dict[tuple[int, str], OutputFitStatistics] = dataclasses.field(default_factory=dict)
    limit_bytes: int = STREAM_BYTES
    too_big: bool = False
    dense_digest: str | None = None

    def check_dense(self, model: torch.nn.Module) -> None:
        """Forget everything kept unless ``model`` (dense, before this round's surgery) is the model it was kept
        for (:func:`block_digest`)."""
        d = block_digest(model)
        if self.dense_digest not in (None, d):
            self.stream, self.fits, self.too_big = None, {}, False
        self.dense_digest = d


def block_digest(module: torch.nn.Module) -> str:
    """A digest of everything a block's forward depends on: every parameter and buffer (name, dtype, shape,
    bytes) and every scalar attribute of its submodules (``num_heads``, ``head_dim``, ``scale``, ...)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    for name, m in module.named_modules():
        scalars = sorted((k, v) for k, v in vars(m).items()
                         if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None))))
        h.update(f"{name}|{type(m).__name__}|{scalars!r}".encode())
    return h.hexdigest()


class _Stop(Exception):
    """Raised by the hook of the last block to refit: the rest of the dense forward is not needed."""


def refit_blocks(anatomy: ViTAnatomy, plans: list[BlockPlan], cfg) -> list[int]:
    """Indices of the blocks whose MLP is refit: whole heads removed, compensation on, full blocks."""
    if not cfg.compensation:
        return []
    return [b.index for b, p in zip(anatomy.blocks, plans)
            if p.head_keep is not None and len(p.head_keep) < b.num_heads and b.query_tokens is None]


@dataclasses.dataclass
class MLPRefit:
    """What the refit pass needs from before the surgery: a dense copy and the blocks to refit."""

    dense: torch.nn.Module | None
    indices: list[int]


def prepare_refit(anatomy: ViTAnatomy, plans: list[BlockPlan], cfg,
                  cache: RefitCache | None = None) -> MLPRefit | None:
    """A copy of the (still dense) model and the blocks to refit, or None when no block needs it.
    Call before the model is pruned (after it, ``num_heads`` is the kept count). With a ``cache`` that holds
    the dense stream no copy is made (the refit pass reads the stream)."""
    indices = refit_blocks(anatomy, plans, cfg)
    if not indices:
        return None
    if cache is not None:
        cache.check_dense(anatomy.model)
    streamed = cache is not None and cache.stream is not None
    return MLPRefit(None if streamed else copy.deepcopy(anatomy.model).eval(), indices)


def _gamma(ls) -> torch.Tensor | None:
    g = getattr(ls, "gamma", None) if ls is not None else None
    return None if g is None else g.detach()


@torch.no_grad()
def collect_fit_statistics(dense_model: torch.nn.Module | None, anatomy: ViTAnatomy, indices: list[int],
                           batches: Callable[[], Iterable[torch.Tensor]],
                           gram_dtype: torch.dtype = torch.float32,
                           cache: RefitCache | None = None) -> dict[int, OutputFitStatistics]:
    """One pass over the calibration batches: per block i in ``indices``, the pruned block's fc2
    input h~ and fc2 target t (``edgeprune.solve.attn_heads`` module doc) on the dense input.

    Args:
        dense_model: the dense model (same architecture as ``anatomy.model`` before pruning); None only with a
            ``cache`` holding the dense stream.
        anatomy: the pruned model's anatomy.
        indices: blocks to collect (ascending).
        batches: callable returning the calibration batches (B, C, H, W).
        gram_dtype: dtype of the per-batch products.
        cache: with a kept dense stream, the pass reads it instead of running the dense model; without
            one, the pass keeps the dense stream of every block there (up to ``cache.limit_bytes``).
    """
    stats = {i: OutputFitStatistics(anatomy.blocks[i].fc2.in_features, anatomy.blocks[i].fc2.out_features,
                                    gram_dtype) for i in indices}
    cap: dict[str, torch.Tensor] = {}
    handles = []
    for i in indices:
        fc2 = anatomy.blocks[i].fc2
        handles.append(fc2.register_forward_pre_hook(lambda _m, a: cap.__setitem__("h", a[0])))
        handles.append(fc2.register_forward_hook(lambda _m, _a, o: cap.__setitem__("o", o)))
    try:
        if cache is not None and cache.stream is not None:  # a later round: the dense stream as kept
            for ios in cache.stream:
                for i in indices:
                    _add_block(anatomy.blocks[i], ios[i], cap, stats[i])
            return stats
        if dense_model is None:
            raise ValueError("collect_fit_statistics: no dense model and no kept dense stream")
        dense_blocks = find_anatomy(dense_model).blocks
        recorder = None
        if cache is not None and not cache.too_big:  # keep the dense stream for a later round
            recorder = StreamRecorder([b.block for b in dense_blocks], cache.limit_bytes)
            handles += recorder.attach()
        caught: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        last = max(indices)

        def keep_io(i: int):
            def hook(_m, args, out):
                caught[i] = (args[0], out)
                if i == last and (recorder is None or recorder.too_big):
                    raise _Stop
            return hook

        handles += [dense_blocks[i].block.register_forward_hook(keep_io(i)) for i in indices]
        device = next(dense_model.parameters()).device
        for x in batches():
            caught.clear()
            try:
                dense_model(x.to(device))
            except _Stop:
                pass
            for i in indices:
                _add_block(anatomy.blocks[i], caught[i], cap, stats[i])
        if recorder is not None and cache is not None:
            cache.stream, cache.too_big = recorder.result(), recorder.too_big
    finally:
        for h in handles:
            h.remove()
    return stats


def _add_block(b: BlockAnatomy, io: tuple[torch.Tensor, torch.Tensor], cap: dict, st: OutputFitStatistics) -> None:
    """Run the pruned block on the dense input and add its (h~, t) rows."""
    x, y_dense = io
    cap.clear()
    y0 = b.block(x.to(b.fc2.weight.device))
    diff = y_dense.to(y0.device) - y0
    g = _gamma(b.ls2)
    if g is not None:
        diff = diff / g
    st.add_batch(cap["h"], cap["o"] + diff)


def refit_mlps(anatomy: ViTAnatomy, stats: dict[int, OutputFitStatistics], alpha: float) -> dict[int, dict]:
    """Replace fc2 of every block in ``stats`` by its refit (in place).

    Returns:
        per block: ``mlp_refit_lambda`` and the fc2-target residual per token before and after
        (``mlp_refit_error``: [before, after]; squared fc2-output units).
    """
    out = {}
    for i, st in stats.items():
        b = anatomy.blocks[i]
        w0 = b.fc2.weight.detach()
        b0 = None if b.fc2.bias is None else b.fc2.bias.detach()
        before = st.residual(w0, b0)
        w, bias, lam = refit_linear(st, w0, alpha)
        shrink_mlp(b, torch.arange(b.mlp_hidden), w, bias)
        out[i] = {"mlp_refit_lambda": lam, "mlp_refit_error": [before, st.residual(w, bias)]}
    return out


def compensate_heads_through_mlp(refit: MLPRefit | None, anatomy: ViTAnatomy, cfg,
                                 batches: Callable[[], Iterable[torch.Tensor]],
                                 cache: RefitCache | None = None) -> dict[int, dict]:
    """The refit pass and the refits (module doc); nothing when ``refit`` is None.

    Args:
        refit: from :func:`prepare_refit` (taken before the model was pruned).
        anatomy: the pruned model's anatomy (updated in place).
        cfg: :class:`CorpConfig` (``ridge_alpha``, ``gram_dtype``).
        batches: the calibration batches.
        cache: kept between the rounds of one prune (:class:`RefitCache`): blocks pruned as in the previous
            round reuse their statistics, the others read its dense stream; None: a plain pass.

    Returns:
        per refit block index, its solve info (:func:`refit_mlps`).
    """
    if refit is None:
        return {}
    gram_dtype = torch.float64 if cfg.gram_dtype == "float64" else torch.float32
    digests = {i: block_digest(anatomy.blocks[i].block) for i in refit.indices} if cache is not None else {}
    known = {i: cache.fits[(i, d)] for i, d in digests.items() if cache is not None and (i, d) in cache.fits}
    todo = [i for i in refit.indices if i not in known]
    stats = collect_fit_statistics(refit.dense, anatomy, todo, batches, gram_dtype, cache) if todo else {}
    if is_distributed():  # each rank streamed its share of the batches (the reused ones are reduced already)
        for st in stats.values():
            st.all_reduce(all_reduce_sum)
    stats = {i: stats[i] if i in stats else known[i] for i in refit.indices}
    if cache is not None:
        cache.fits = {(i, digests[i]): st for i, st in stats.items()}
    return refit_mlps(anatomy, stats, cfg.ridge_alpha)


@torch.no_grad()
def refit_from_streams(b: BlockAnatomy, dense_out, pruned_in, cfg) -> dict:
    """Sequential calibration's form of the refit (METHODS.md §5 "Sequential calibration"): fc2 of
    the pruned block ``b`` is refit so that, on the *pruned* stream's input ``x~``, the block
    reproduces the *dense* stream's output (which also compensates the earlier blocks' errors).

    Args:
        b: the block, already pruned and folded (updated in place).
        dense_out: the dense stream after block ``b`` (chunks ``get(j)``: (B, n, D)).
        pruned_in: the pruned stream before block ``b`` (same chunks and images).
        cfg: :class:`CorpConfig` (``ridge_alpha``, ``gram_dtype``).

    Returns:
        the block's solve info (:func:`refit_mlps`).
    """
    gram_dtype = torch.float64 if cfg.gram_dtype == "float64" else torch.float32
    st = OutputFitStatistics(b.fc2.in_features, b.fc2.out_features, gram_dtype)
    cap: dict[str, torch.Tensor] = {}
    handles = [b.fc2.register_forward_pre_hook(lambda _m, a: cap.__setitem__("h", a[0])),
               b.fc2.register_forward_hook(lambda _m, _a, o: cap.__setitem__("o", o))]
    try:
        for j in range(len(dense_out)):
            _add_block(b, (pruned_in.get(j), dense_out.get(j)), cap, st)
    finally:
        for h in handles:
            h.remove()
    return refit_mlps(_One(b), {b.index: st}, cfg.ridge_alpha)[b.index]


class _One:
    """The ``blocks`` lookup :func:`refit_mlps` needs, for one block."""

    def __init__(self, b: BlockAnatomy) -> None:
        self.blocks = {b.index: b}
