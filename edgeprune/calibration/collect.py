"""One streamed calibration pass: forward hooks feed the statistics accumulators.

Hooks sit at the input of every block's ``mlp.fc2`` (hidden activations, for
:class:`MLPStatistics`), at the output of every ``attn.qkv`` (queries and keys, for
:class:`QKStatistics`) and at the input of every ``attn.proj`` (the heads' outputs z, dim H*d_v,
for V/O and head pruning: the same :class:`MLPStatistics` class, METHODS.md §5). Activations are reduced to
statistics batch by batch and dropped.
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
from edgeprune.calibration.rope_stats import RopeSystemStatistics
from edgeprune.calibration.stream import StreamRecorder
from edgeprune.distributed import common_shift_fn, is_distributed, reduce_statistics
from edgeprune.errors import UserError
from edgeprune.layers.rotary_attention import is_rotary
from edgeprune.progress import progress as show_progress
from edgeprune.solve.output_bias import OutputSums, classifier_head
from edgeprune.torch_device import CUDA_MISSING


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
    #: what is computed from these statistics once and read many times (the allocator's error curves,
    #: ``edgeprune.allocation.greedy.build_curves``), by the computing module's key
    derived: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    #: per batch, every block's dense input and output when the request asked for it (``stream_bytes``) and it
    #: fitted (:mod:`edgeprune.calibration.stream`); the heads' refit reads it instead of a dense forward
    stream: list | None = dataclasses.field(default=None, repr=False, compare=False)


def split_qk(qkv_out: torch.Tensor, num_heads: int, qk_dim: int, attn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys from a fused qkv output (B, n, H*(2*qk_dim + v_dim)) -> 2 x (B, H, n, qk_dim).

    With ``attn`` a rotary attention (:class:`~edgeprune.layers.rotary_attention.RotaryAttention`) they come out
    rotated by its RoPE tables, as its softmax sees them (METHODS.md §6: CORP's statistics of a rotary head are
    those of the rotated queries and keys)."""
    B, n, _ = qkv_out.shape
    hq = num_heads * qk_dim
    q = qkv_out[..., :hq].reshape(B, n, num_heads, qk_dim).transpose(1, 2)
    k = qkv_out[..., hq:2 * hq].reshape(B, n, num_heads, qk_dim).transpose(1, 2)
    if is_rotary(attn):
        q, k = attn.rotate(q), attn.rotate(k)
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


@dataclasses.dataclass
class StatisticsRequest:
    """What one calibration pass collects (built by the caller from what its criteria and fits
    need: ``edgeprune.pruning.corp.statistics_request`` for CORP).

    Attributes:
        mlp: collect MLP hidden statistics (input of every ``mlp.fc2``).
        mlp_second_order: accumulate MLP covariances (needed for MLP compensation).
        mlp_active: count positive MLP activations (criteria needing "positive", e.g. ``active``).
        mlp_tokens: MLP statistics from this many random tokens per image (0 = all;
            :func:`~edgeprune.calibration.mlp_stats.token_positions`). Q/K and V/O statistics
            always use every token.
        qk: collect Q/K statistics (output of every ``attn.qkv``).
        qk_grams: keep per-image Q/K Grams (needed for Q/K compensation).
        qk_keep: second-pass mode: per block the (H, d') kept Q/K dims (or None); the pass then
            accumulates :class:`QKSystemStatistics` into ``qk`` instead of per-image Grams.
        rope_general: in the second-pass mode, rotary blocks accumulate the general-form RoPE system
            (:class:`~edgeprune.calibration.rope_stats.RopeSystemStatistics`, METHODS.md §6) instead.
        vo: collect mean and covariance of every ``attn.proj`` input (V/O and head pruning).
        gram_dtype: dtype of the per-batch Gram products (see :class:`MLPStatistics`).
        first_image: index in the calibration set of the first image of the batches (under
            torchrun: of this rank's share), for the per-image token subsets of ``mlp_tokens``
            and for ``output_images``.
        output_images: also sum the model's outputs over the calibration images with index <
            this (``output_sum`` / ``output_count``; the dense side of the output bias
            correction, ``edgeprune.solve.output_bias``, at no extra cost). Needs a model with
            an affine classifier head.
        stream_bytes: also keep every block's input and output, batch by batch, up to this many bytes
            (``CalibrationStatistics.stream``; 0: none; only for a pass on the CPU of a model on the CPU,
            not under torchrun; :mod:`edgeprune.calibration.stream`).
    """

    mlp: bool = True
    qk: bool = True
    qk_grams: bool = True
    mlp_second_order: bool = True
    gram_dtype: torch.dtype = torch.float32
    qk_keep: list | None = None
    rope_general: bool = False
    vo: bool = False
    mlp_active: bool = True
    mlp_tokens: int = 0
    first_image: int = 0
    output_images: int = 0
    stream_bytes: int = 0


@dataclasses.dataclass
class _Accumulators:
    mlp: list
    qk: list
    vo: list
    outputs: object = None

    def all(self) -> list:
        return [*self.mlp, *self.qk, *self.vo]


def _accumulators(anatomy: ViTAnatomy, req: StatisticsRequest, dev: torch.device, shift_fn) -> _Accumulators:
    """The per-block statistics objects ``req`` asks for, accumulating on ``dev``."""
    grams_dev = None if dev.type == "cpu" else torch.device("cpu")
    mlp = [MLPStatistics(b.mlp_hidden, req.gram_dtype, req.mlp_second_order, count_positive=req.mlp_active,
                         device=dev, shift_fn=shift_fn, tokens=req.mlp_tokens, first_image=req.first_image)
           if req.mlp else None for b in anatomy.blocks]
    qk: list = [QKStatistics(b.num_heads, b.qk_dim, keep_grams=req.qk_grams, gram_dtype=req.gram_dtype, device=dev,
                             grams_device=grams_dev, rotary=is_rotary(b.attn)) if req.qk else None
                for b in anatomy.blocks]
    if req.qk_keep is not None:
        qk = [None if keep is None else
              RopeSystemStatistics(keep, b.qk_dim, b.attn.rope_cos, b.attn.rope_sin, device=dev)
              if req.rope_general and is_rotary(b.attn) else QKSystemStatistics(keep, b.qk_dim, device=dev)
              for b, keep in zip(anatomy.blocks, req.qk_keep)]
    vo = [MLPStatistics(b.proj.in_features, req.gram_dtype, True, count_positive=False, device=dev, shift_fn=shift_fn)
          if req.vo else None for b in anatomy.blocks]
    return _Accumulators(mlp, qk, vo)


def _hooks(anatomy: ViTAnatomy, acc: _Accumulators, req: StatisticsRequest) -> list:
    """Forward hooks feeding ``acc`` (removed by the caller); sets ``acc.outputs`` when asked.

    Raises:
        UserError: ``output_images`` for a model without a linear classifier head.
    """
    handles = []
    for b in anatomy.blocks:
        if acc.vo[b.index] is not None:
            handles.append(b.proj.register_forward_pre_hook(lambda _m, args, st=acc.vo[b.index]: st.add_batch(args[0])))
        if acc.mlp[b.index] is not None:
            handles.append(b.fc2.register_forward_pre_hook(lambda _m, args, st=acc.mlp[b.index]: st.add_batch(args[0])))
        if acc.qk[b.index] is not None:
            handles.append(b.qkv.register_forward_hook(
                lambda _m, _args, out, st=acc.qk[b.index], b=b: st.add_batch(
                    *split_qk(out, b.num_heads, b.qk_dim, b.attn))))
    if req.output_images > 0:
        head = classifier_head(anatomy.model)
        if head is None:
            for h in handles:
                h.remove()
            raise UserError("output bias correction needs a model with a linear classifier head")
        acc.outputs = OutputSums(head.out_features, req.output_images, req.first_image)
        handles.append(anatomy.model.register_forward_hook(lambda _m, _args, out, o=acc.outputs: o.add(out)))
    return handles


def _run_pass(anatomy: ViTAnatomy, batches: Iterable[torch.Tensor], dev: torch.device, home: torch.device,
              progress: bool, total: int | None) -> int:
    """Forward every batch on ``dev`` (TF32 off); returns the number of images.

    Raises:
        UserError: images of the wrong shape.
    """
    model = anatomy.model
    expected = (anatomy.in_chans, *anatomy.img_size)
    num_images = 0
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
        if dev != home:
            model.to(home)
    return num_images


@torch.no_grad()
def collect_statistics(anatomy: ViTAnatomy, batches: Iterable[torch.Tensor], request: StatisticsRequest | None = None,
                       *, progress: bool = True, total: int | None = None, device: str | torch.device | None = None,
                       **fields) -> CalibrationStatistics:
    """Run the model once over the calibration batches and accumulate statistics.

    Args:
        anatomy: from :func:`edgeprune.anatomy.find_anatomy`; the model is put in eval mode.
        batches: iterable of image tensors (B, C, H, W), already preprocessed.
        request: what to collect (:class:`StatisticsRequest`); or its fields as keywords
            (``mlp=``, ``qk=``, ``qk_grams=``, ``vo=``, ``mlp_active=``, ``gram_dtype=`` ...).
        progress: show progress (a bar on a terminal, plain log lines otherwise); total: number of batches, for the bar.
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
        TypeError: both ``request`` and keywords, or an unknown keyword.
    """
    if request is not None and fields:
        raise TypeError("give a StatisticsRequest or its fields as keywords, not both")
    req = request if request is not None else StatisticsRequest(**fields)
    model = anatomy.model
    model.eval()
    home = _model_device(model)
    dev = torch.device(device if device is not None else (_DEVICE.get() or home))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(CUDA_MISSING)
    batches = iter(batches)
    first = next(batches, None)
    if first is not None:
        batches = itertools.chain([first], batches)
    # under torchrun: every rank centres on rank 0's first batch, as one process would (collective)
    shift_fn = common_shift_fn(first is not None) if is_distributed() and (req.mlp or req.vo) else None
    acc = _accumulators(anatomy, req, dev, shift_fn)
    handles = _hooks(anatomy, acc, req)
    recorder = None
    if req.stream_bytes > 0 and dev.type == "cpu" and home.type == "cpu" and not is_distributed():
        recorder = StreamRecorder([b.block for b in anatomy.blocks], req.stream_bytes)
        handles += recorder.attach()
    t0 = time.perf_counter()
    try:
        num_images = _run_pass(anatomy, batches, dev, home, progress, total)
    finally:
        for h in handles:
            h.remove()
    if dev.type != "cpu":
        for st in acc.all():
            if st is not None:
                st.to("cpu")
    if num_images == 0 and not is_distributed():  # a rank's empty share is fine: reduce_statistics checks the total
        raise UserError("the calibration set is empty")
    out = acc.outputs
    stats = CalibrationStatistics(mlp=acc.mlp, qk=acc.qk, num_images=num_images,
                                  num_tokens=anatomy.num_tokens, seconds=time.perf_counter() - t0,
                                  vo=acc.vo,
                                  output_sum=None if out is None else out.total,
                                  output_count=0 if out is None else out.count,
                                  output_rows=None if out is None else out.rows)
    stats.stream = None if recorder is None else recorder.result()
    return reduce_statistics(stats)  # identity unless under torchrun (edgeprune.distributed)
