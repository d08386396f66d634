"""The dense stream of a calibration pass, kept for a later pass that needs it (issue 40 item 4).

The heads' refit (``edgeprune.head_compensation``) runs each pruned block on the *dense* model's input to that
block. Without a kept stream it runs the dense model over every calibration image again; with one, the
statistics pass (which runs the same dense model over the same batches) leaves every block's input and output
behind and no second dense forward is needed -- the same tensors, so bitwise the same refit.

:class:`StreamRecorder` hooks every block of a model; per batch it keeps each block's ``(input, output)`` on the
CPU (a block's output is the next block's input: held once), up to a memory bound, beyond which it keeps nothing
(the caller then runs the dense model again).
"""

from __future__ import annotations

from typing import Sequence

import torch

#: the most bytes of dense activations kept for a later pass; above it nothing is kept (deit_small, 256 images at
#: 224 px: 13 stream points x 77.5 MB = 0.94 GiB)
STREAM_BYTES = 2 * 2 ** 30

#: one batch's stream: per block (0..depth-1), its (input, output), each (B, n, D) on the CPU
BatchStream = list[tuple[torch.Tensor, torch.Tensor]]


def stream_bytes(num_images: int | None, num_tokens: int, width: int, depth: int) -> int | None:
    """Bytes of a float32 stream of ``num_images`` images (``depth + 1`` points of (n, D) each); None when the
    number of images is not known."""
    return None if num_images is None else num_images * num_tokens * width * 4 * (depth + 1)


class StreamRecorder:
    """Forward hooks keeping every block's input and output, batch by batch, up to ``limit_bytes``.

    Use: :meth:`attach` before the pass (returns the hook handles, removed by the caller), one model forward per
    batch, :meth:`result` after it. A batch counts as ended when block 0 runs again (or at :meth:`result`).

    Args:
        blocks: the model's blocks in forward order.
        limit_bytes: the bound on the bytes kept (:data:`STREAM_BYTES`).
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], limit_bytes: int = STREAM_BYTES) -> None:
        self.blocks, self.limit_bytes = list(blocks), int(limit_bytes)
        self.batches: list[BatchStream] | None = []
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this batch's id -> (tensor, CPU copy)
        self._bytes = 0

    @property
    def too_big(self) -> bool:
        """The stream went over ``limit_bytes`` and was dropped."""
        return self.batches is None

    def attach(self) -> list:
        """Register the hooks; returns their handles."""
        return [b.register_forward_hook(self._hook(i)) for i, b in enumerate(self.blocks)]

    def _hook(self, i: int):
        def hook(_m, args, out):
            if self.batches is None:
                return
            if i == 0 and self._current:
                self._end_batch()
            self._current[i] = (self._host(args[0]), self._host(out))
        return hook

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t)  # ``_held`` keeps ``t`` alive for the batch: its id is not reused by another tensor
        if key not in self._held:
            copy = t.detach().cpu()
            self._held[key] = (t, copy)
            self._bytes += copy.numel() * copy.element_size()
        return self._held[key][1]

    def _end_batch(self) -> None:
        if self.batches is None:
            return
        if self._bytes > self.limit_bytes or len(self._current) != len(self.blocks):
            self.batches = None  # over the bound, or a forward that stopped early: keep nothing
        else:
            self.batches.append([self._current[i] for i in range(len(self.blocks))])
        self._current, self._held = {}, {}

    def result(self) -> list[BatchStream] | None:
        """Per batch, every block's (input, output); None when over the bound (or nothing was recorded)."""
        if self._current:
            self._end_batch()
        return self.batches or None
