"""One streamed calibration pass: forward hooks feed the statistics accumulators.

Hooks sit at the input of every block's ``mlp.fc2`` (hidden activations, for
:class:`MLPStatistics`), at the output of every ``attn.qkv`` (queries and keys, for
:class:`QKStatistics`) and at the input of every ``attn.proj`` (the heads' outputs z, dim H*d_v,
for V/O and head pruning: the same :class:`MLPStatistics` class, METHODS.md §5). Activations are reduced to statistics batch by batch and dropped.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import torch

from edgeprune.anatomy import ViTAnatomy
from edgeprune.calibration.mlp_stats import MLPStatistics
from edgeprune.calibration.qk_stats import QKStatistics, QKSystemStatistics
from edgeprune.errors import UserError
from edgeprune.progress import progress as show_progress


@dataclasses.dataclass
class CalibrationStatistics:
    """Statistics of one pass. ``mlp[i]`` / ``qk[i]`` / ``vo[i]`` are ``None`` for blocks not collected.

    Attributes:
        num_images: images seen; num_tokens: tokens per image; seconds: wall time of the pass.
        vo: per block, :class:`MLPStatistics` of proj's input z (H*d_v channels), or None.
    """

    mlp: list[MLPStatistics | None]
    qk: list  # QKStatistics | QKSystemStatistics | None per block
    num_images: int
    num_tokens: int
    seconds: float
    vo: list = dataclasses.field(default_factory=list)


def split_qk(qkv_out: torch.Tensor, num_heads: int, qk_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys from a fused qkv output (B, n, H*(2*qk_dim + v_dim)) -> 2 x (B, H, n, qk_dim)."""
    B, n, _ = qkv_out.shape
    hq = num_heads * qk_dim
    q = qkv_out[..., :hq].reshape(B, n, num_heads, qk_dim).transpose(1, 2)
    k = qkv_out[..., hq:2 * hq].reshape(B, n, num_heads, qk_dim).transpose(1, 2)
    return q, k


@torch.no_grad()
def collect_statistics(anatomy: ViTAnatomy, batches: Iterable[torch.Tensor], *,
                       mlp: bool = True, qk: bool = True, qk_grams: bool = True,
                       mlp_second_order: bool = True,
                       gram_dtype: torch.dtype = torch.float32, progress: bool = True,
                       total: int | None = None,
                       qk_keep: list[torch.Tensor | None] | None = None,
                       vo: bool = False) -> CalibrationStatistics:
    """Run the model once over the calibration batches and accumulate statistics.

    Args:
        anatomy: from :func:`edgeprune.anatomy.find_anatomy`; the model is put in eval mode.
        batches: iterable of image tensors (B, C, H, W), already preprocessed.
        mlp: collect MLP hidden statistics (for MLP pruning).
        qk: collect Q/K statistics (for attention pruning).
        qk_grams: keep per-image Q/K Grams (needed for Q/K compensation).
        mlp_second_order: accumulate MLP covariances (needed for MLP compensation).
        gram_dtype: dtype of the per-batch MLP Gram product (see :class:`MLPStatistics`).
        progress: show progress (a bar on a terminal, plain log lines otherwise); total: number of batches, for the bar.
        qk_keep: second-pass mode: per block the (H, d') kept Q/K dims (or None); the pass then
            accumulates :class:`QKSystemStatistics` into ``qk`` instead of per-image Grams.
        vo: collect mean and covariance of every ``attn.proj`` input (for V/O and head pruning).

    Returns:
        :class:`CalibrationStatistics`.

    Raises:
        UserError: no images, or images of the wrong shape.
    """
    model = anatomy.model
    model.eval()
    mlp_stats: list[MLPStatistics | None] = [
        MLPStatistics(b.mlp_hidden, gram_dtype, mlp_second_order) if mlp else None for b in anatomy.blocks]
    qk_stats: list = [
        QKStatistics(b.num_heads, b.qk_dim, keep_grams=qk_grams, gram_dtype=gram_dtype) if qk else None for b in anatomy.blocks]
    if qk_keep is not None:
        qk = True
        qk_stats = [None if keep is None else QKSystemStatistics(keep, b.qk_dim)
                    for b, keep in zip(anatomy.blocks, qk_keep)]
    vo_stats: list[MLPStatistics | None] = [
        MLPStatistics(b.proj.in_features, gram_dtype, True) if vo else None for b in anatomy.blocks]
    handles = []
    for b in anatomy.blocks:
        if vo:
            st_vo = vo_stats[b.index]
            handles.append(b.proj.register_forward_pre_hook(
                lambda _m, args, st=st_vo: st.add_batch(args[0])))
        if mlp:
            st = mlp_stats[b.index]
            handles.append(b.fc2.register_forward_pre_hook(
                lambda _m, args, st=st: st.add_batch(args[0])))
        if qk and qk_stats[b.index] is not None:
            st_qk = qk_stats[b.index]
            handles.append(b.qkv.register_forward_hook(
                lambda _m, _args, out, st=st_qk, b=b: st.add_batch(*split_qk(out, b.num_heads, b.qk_dim))))
    expected = (anatomy.in_chans, *anatomy.img_size)
    num_images = 0
    t0 = time.perf_counter()
    try:
        for x in show_progress(batches, "calibration", enabled=progress, total=total, unit="batch"):
            if x.dim() != 4 or tuple(x.shape[1:]) != expected:
                raise UserError(f"calibration images have shape {tuple(x.shape[1:])}, "
                                f"the model takes {expected}")
            model(x)
            num_images += x.shape[0]
    finally:
        for h in handles:
            h.remove()
    if num_images == 0:
        raise UserError("the calibration set is empty")
    stats = CalibrationStatistics(mlp=mlp_stats, qk=qk_stats, num_images=num_images,
                                  num_tokens=anatomy.num_tokens, seconds=time.perf_counter() - t0,
                                  vo=vo_stats)
    from edgeprune.distributed import reduce_statistics

    return reduce_statistics(stats)  # identity unless under torchrun (edgeprune.distributed)
