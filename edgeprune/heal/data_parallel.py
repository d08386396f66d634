"""Data-parallel healing over torch.distributed (torchrun): each rank takes a slice of every batch.

Under ``torchrun`` (a process group initialised, e.g. by
:func:`edgeprune.distributed.process_group`) every rank runs :func:`edgeprune.heal.heal` with the
same model, calibration set and settings. The shuffling generator is seeded identically, so every
rank draws the same global batch of ``batch_size`` image indices; rank r of W takes the contiguous
slice ``[r*B/W, (r+1)*B/W)`` of it (:func:`share`). The step is the single-process step:

* each rank backpropagates ``sum(per-image loss over its slice) / B`` (B = the *global* batch
  size), so the sum of the ranks' gradients is the gradient of the batch mean (STARFISH eq. 2);
* :func:`all_reduce_gradients` sums the gradients of the trained parameters over the ranks (one
  flat float32 buffer, one ``all_reduce``; a parameter that received no gradient on any rank
  keeps ``grad = None``, as in one process, so AdamW skips it there too);
* every rank then takes the same AdamW step on the same gradient, so the weights stay identical
  on all ranks (checked by the two-process test) without a broadcast.

Eval passes (the alignment loss before / after / per epoch, for ``keep_best``) split the measured
images the same way and all-reduce (loss sum, image count) in float64 (:func:`all_reduce_sums`).
A disk target cache (``--cache-targets``) is built by rank 0 alone while the others wait, then
opened by every rank (:func:`prepare_targets`); without a cache each rank recomputes the dense
targets of its own slice. Rank 0 writes the checkpoints; every rank resumes from the same file.

Compared with one process the result differs only by float32 summation order (the gradient of a
batch is summed in two parts): measured in ``tests/test_heal_distributed.py``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from edgeprune import distributed as dist


def share(idx: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of a batch of indices (the whole batch when not distributed).

    Args:
        idx: (B,) int64 image indices of the global batch.

    Returns:
        (B_r,) the slice ``[r*B/W, (r+1)*B/W)``; may be empty when B < W.
    """
    world = dist.world_size()
    if world == 1:
        return idx
    r = dist.rank()
    return idx[r * len(idx) // world:(r + 1) * len(idx) // world]


def all_reduce_sums(values: Sequence[float]) -> list[float]:
    """Sum of ``values`` over the ranks (float64; the values themselves when not distributed)."""
    if not dist.is_distributed():
        return [float(v) for v in values]
    t = dist.all_reduce_sum(torch.tensor([float(v) for v in values], dtype=torch.float64))
    return [float(v) for v in t.cpu()]


def all_reduce_gradients(params: Sequence[torch.nn.Parameter], extra: Sequence[float] = ()) -> list[float]:
    """Sum the gradients of ``params`` over the ranks, in place; also sum ``extra`` scalars.

    One flat buffer per call: every parameter's gradient (zeros where ``grad is None``), one
    has-gradient flag per parameter and the ``extra`` scalars, all-reduced with SUM. A parameter
    without a gradient on every rank keeps ``grad = None``.

    Args:
        params: the trained parameters, in the same order on every rank.
        extra: scalars to sum alongside (e.g. the rank's share of the batch loss).

    Returns:
        the summed ``extra`` values.
    """
    if not dist.is_distributed():
        return [float(v) for v in extra]
    if not params:
        return all_reduce_sums(extra)
    ref = params[0]
    parts = [(p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=ref.dtype,
                                                                         device=ref.device)).to(ref.dtype)
             for p in params]
    flags = torch.tensor([0.0 if p.grad is None else 1.0 for p in params], dtype=ref.dtype, device=ref.device)
    flat = dist.all_reduce_sum(torch.cat(parts + [flags]))  # on ref's device
    offset = 0
    for i, p in enumerate(params):
        n = p.numel()
        if float(flat[-len(params) + i]) > 0:
            g = flat[offset:offset + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        else:
            p.grad = None
        offset += n
    return all_reduce_sums(extra)


def prepare_targets(make: Callable[[], Any]) -> Any:
    """Build a target provider with ``make()``: rank 0 first, the others after it finished.

    A disk target cache is then computed once (by rank 0) and reused by the other ranks, which
    find it complete; a failure on rank 0 stops torchrun's job before the barrier is reached by
    it, and the others time out or are ended by torchrun.
    """
    if not dist.is_distributed():
        return make()
    targets = make() if dist.is_main_process() else None
    torch.distributed.barrier()
    return targets if targets is not None else make()


def info() -> dict[str, Any]:
    """``{"world_size": W, "backend": ...}`` for the heal record, ``{}`` when not distributed."""
    return dist.distributed_info()
