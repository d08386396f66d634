"""The token stream entering block 0, for sequential calibration."""

from __future__ import annotations

from typing import Iterable

import torch

from edgeprune.anatomy import ViTAnatomy
from edgeprune.errors import UserError
from edgeprune.progress import progress as show_progress
from edgeprune.sequential.streams import Stream, StreamStore


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
