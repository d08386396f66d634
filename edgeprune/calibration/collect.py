"""One streamed calibration pass: forward hooks feed the statistics accumulators.

Hooks sit at the input of every block's ``mlp.fc2`` (hidden activations, for
:class:`MLPStatistics`), at the output of every ``attn.qkv`` (queries and keys, for
:class:`QKStatistics`) and at the input of every ``attn.proj`` (the heads' outputs z, dim H*d_v,
for V/O and head pruning: the same :class:`MLPStatistics` class, METHODS.md §5). Activations are reduced to statistics batch by batch and dropped.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import time
from typing import Iterable, Iterator

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
    #: float64 (num_outputs,) sum of the model's outputs over the calibration images with index
    #: < ``output_images`` (the output bias correction's dense side), and how many were summed
    output_sum: torch.Tensor | None = None
    output_count: int = 0
    #: (k_local, num_outputs) float32: those outputs themselves, this process's images in order
    output_rows: torch.Tensor | None = None


def split_qk(qkv_out: torch.Tensor, num_heads: int, qk_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys from a fused qkv output (B, n, H*(2*qk_dim + v_dim)) -> 2 x (B, H, n, qk_dim)."""
    B, n, _ = qkv_out.shape
    hq = num_heads * qk_dim
    q = qkv_out[..., :hq].reshape(B, n, num_heads, qk_dim).transpose(1, 2)
    k = qkv_out[..., hq:2 * hq].reshape(B, n, num_heads, qk_dim).transpose(1, 2)
    return q, k


_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("edgeprune_calibration_device", default=None)


@contextlib.contextmanager
def calibration_device(device: str | torch.device | None) -> Iterator[None]:
    """Run every :func:`collect_statistics` inside the block on ``device`` ("cpu", "cuda",
    "cuda:N"; None: the model's own device). How ``edgeprune.prune(device=...)`` reaches the
    calibration passes of CORP and NuWa without threading a device through every call
    (sequential calibration runs on the CPU: ``edgeprune.prune`` sets "cpu" for it)."""
    token = _DEVICE.set(None if device is None else str(device))
    try:
        yield
    finally:
        _DEVICE.reset(token)


def _stats_to_cpu(st) -> None:
    """Move one statistics object's tensors to host memory (in place)."""
    if st is None:
        return
    for name in ("_shift", "_sum", "_gram", "_sq", "_positive", "_score", "k_sys", "rhs", "keep", "prune"):
        t = getattr(st, name, None)
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            setattr(st, name, t.cpu())
    for name in ("_gq", "_gk"):
        if getattr(st, name, None):
            setattr(st, name, [t.cpu() for t in getattr(st, name)])


@contextlib.contextmanager
def exact_fp32(device: torch.device) -> Iterator[None]:
    """No TF32 in CUDA matmuls/convolutions inside the context (a statistics pass, ``verify``): the
    float32 products must be float32-exact (TF32 keeps 10 mantissa bits, ~1e-3 relative). A no-op
    on other devices."""
    if device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _model_device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else p.device


@torch.no_grad()
def collect_statistics(anatomy: ViTAnatomy, batches: Iterable[torch.Tensor], *,
                       mlp: bool = True, qk: bool = True, qk_grams: bool = True,
                       mlp_second_order: bool = True,
                       gram_dtype: torch.dtype = torch.float32, progress: bool = True,
                       total: int | None = None,
                       qk_keep: list[torch.Tensor | None] | None = None,
                       vo: bool = False, mlp_active: bool = True,
                       device: str | torch.device | None = None, mlp_tokens: int = 0,
                       first_image: int = 0, output_images: int = 0) -> CalibrationStatistics:
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
        mlp_active: count positive MLP activations (only the ``active`` ranking criterion reads it).
        mlp_tokens: MLP statistics from this many evenly spaced tokens per image (0 = all;
            :func:`~edgeprune.calibration.mlp_stats.token_positions`). Q/K and V/O statistics
            always use every token.
        first_image: index in the calibration set of the first image of ``batches`` (under
            torchrun: of this rank's share), for the per-image token subsets of ``mlp_tokens``
            and for ``output_images``.
        output_images: also sum the model's outputs over the calibration images with index <
            this (``output_sum`` / ``output_count``; the dense side of the output bias
            correction, ``edgeprune.solve.output_bias``, taken from this pass at no extra cost).
            Needs a model with an affine classifier head.
        device: run the pass on this torch device ("cpu", "cuda", "cuda:N"); default: the one
            set by :func:`calibration_device`, else the model's. The model is moved there for
            the pass and back afterwards; images are moved batch by batch. Every statistic is
            accumulated on the device (float32 products summed into float64 sums; TF32 off),
            except the per-image Q/K Grams, which go to host memory as they are made (they grow
            with N; GPU memory stays bounded by the model, one batch and the O(D^2) sums).
            The finished statistics are returned in host memory: the closed-form solves run in
            float64 on the CPU (small matrices; consumer GPUs run float64 at 1/32-1/64 rate).

    Returns:
        :class:`CalibrationStatistics`, tensors on the CPU.

    Raises:
        UserError: no images, or images of the wrong shape.
    """
    model = anatomy.model
    model.eval()
    home = _model_device(model)
    dev = torch.device(device if device is not None else (_DEVICE.get() or home))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError("CUDA is not available (use --device cpu)")
    on_cpu = dev.type == "cpu"
    grams_dev = None if on_cpu else torch.device("cpu")
    from edgeprune.distributed import common_shift_fn, is_distributed, reduce_statistics

    batches = iter(batches)
    first = next(batches, None)
    if first is not None:
        batches = itertools.chain([first], batches)
    # under torchrun: every rank centres on rank 0's first batch, as one process would (collective)
    shift_fn = common_shift_fn(first is not None) if is_distributed() and (mlp or vo) else None
    mlp_stats: list[MLPStatistics | None] = [
        MLPStatistics(b.mlp_hidden, gram_dtype, mlp_second_order, count_positive=mlp_active, device=dev,
                      shift_fn=shift_fn, tokens=mlp_tokens, first_image=first_image)
        if mlp else None for b in anatomy.blocks]
    qk_stats: list = [
        QKStatistics(b.num_heads, b.qk_dim, keep_grams=qk_grams, gram_dtype=gram_dtype, device=dev,
                     grams_device=grams_dev) if qk else None for b in anatomy.blocks]
    if qk_keep is not None:
        qk = True
        qk_stats = [None if keep is None else QKSystemStatistics(keep, b.qk_dim, device=dev)
                    for b, keep in zip(anatomy.blocks, qk_keep)]
    vo_stats: list[MLPStatistics | None] = [
        MLPStatistics(b.proj.in_features, gram_dtype, True, count_positive=False, device=dev, shift_fn=shift_fn)
        if vo else None
        for b in anatomy.blocks]
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
    outputs = None
    if output_images > 0:
        from edgeprune.solve.output_bias import OutputSums, classifier_head

        head = classifier_head(model)
        if head is None:
            raise UserError("output bias correction needs a model with a linear classifier head")
        outputs = OutputSums(head.out_features, output_images, first_image)
        handles.append(model.register_forward_hook(lambda _m, _args, out, acc=outputs: acc.add(out)))
    expected = (anatomy.in_chans, *anatomy.img_size)
    num_images = 0
    t0 = time.perf_counter()
    try:
        if dev != home:
            model.to(dev)
        with exact_fp32(dev):
            for x in show_progress(batches, "calibration", enabled=progress, total=total, unit="batch"):
                if x.dim() != 4 or tuple(x.shape[1:]) != expected:
                    raise UserError(f"calibration images have shape {tuple(x.shape[1:])}, "
                                    f"the model takes {expected}")
                model(x.to(dev, non_blocking=True))
                num_images += x.shape[0]
    finally:
        for h in handles:
            h.remove()
        if dev != home:
            model.to(home)
    if not on_cpu:
        for st in [*mlp_stats, *qk_stats, *vo_stats]:
            _stats_to_cpu(st)
    if num_images == 0 and not is_distributed():  # a rank's empty share is fine: reduce_statistics checks the total
        raise UserError("the calibration set is empty")
    stats = CalibrationStatistics(mlp=mlp_stats, qk=qk_stats, num_images=num_images,
                                  num_tokens=anatomy.num_tokens, seconds=time.perf_counter() - t0,
                                  vo=vo_stats,
                                  output_sum=None if outputs is None else outputs.total,
                                  output_count=0 if outputs is None else outputs.count,
                                  output_rows=None if outputs is None else outputs.rows)
    return reduce_statistics(stats)  # identity unless under torchrun (edgeprune.distributed)
