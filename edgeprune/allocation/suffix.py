"""Re-run only the blocks a change can reach: the dense residual stream, cached at every block.

Measuring one allocation unit (``select.measured_curves``) prunes a single block ``b`` of a copy of
the model; blocks ``0 .. b-1`` are still the dense ones, so their output on the check images is
the dense model's, already computed once. :class:`BlockInputs` keeps the dense input of every
block on the check images and runs a modified model from block ``b`` on: blocks ``0 .. b-1`` are
skipped (the last of them returns the cached tensor), the embedding before them still runs (it is
cheap and keeps the model's own ``forward``). Averaged over the blocks this is ~half of a full
forward pass per unit; the result is bitwise the full forward's, which the constructor checks on
the dense model (:attr:`BlockInputs.exact`); where it does not hold (a model whose blocks are not
applied as one chain of ``x -> block(x)``), every call falls back to the full forward.

Memory: ``depth x n x tokens x dim`` float32 (DINOv2-S, 32 check images: 12 x 32 x 257 x 384 x 4
bytes = 152 MB).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import nn

from edgeprune.allocation.outputs import outputs_equal


@contextlib.contextmanager
def _start_at(blocks: list[nn.Module], b: int, cached: torch.Tensor):
    """Within the context, blocks ``0 .. b-2`` pass their input through and block ``b-1``
    returns ``cached``, so a forward pass computes only blocks ``b ..`` on the cached stream."""
    def through(x, *args, **kwargs):
        return x

    def inject(x, *args, **kwargs):
        return cached.clone()  # the cache stays intact whatever the later blocks do in place

    patched = blocks[:b]
    try:
        for j, blk in enumerate(patched):
            blk.forward = inject if j == b - 1 else through
        yield
    finally:
        for blk in patched:
            if "forward" in vars(blk):
                del blk.forward


class BlockInputs:
    """The dense model's block inputs on fixed images, and forward passes that start at a block.

    Args:
        model: the dense model (eval mode; not modified).
        blocks: its transformer blocks in order (``[a.block for a in anatomy.blocks]``).
        x: (n, C, H, W) images.
        as_tensor: maps the model's output to one tensor (e.g. ``select.output_tensor``).

    Attributes:
        out: the dense output on ``x`` (``as_tensor(model(x))``).
        exact: True when starting at the last block reproduces ``out`` bitwise on the dense
            model; otherwise :meth:`forward_from` runs the full forward.
    """

    @torch.no_grad()
    def __init__(self, model: nn.Module, blocks: list[nn.Module], x: torch.Tensor,
                 as_tensor: Callable = lambda y: y) -> None:
        self.x, self._as_tensor = x, as_tensor
        seen: dict[int, list[torch.Tensor]] = {j: [] for j in range(len(blocks))}

        def keep_input(j):
            return lambda _m, args: seen[j].append(args[0].detach().clone())

        hooks = [blk.register_forward_pre_hook(keep_input(j)) for j, blk in enumerate(blocks)]
        try:
            self.out = as_tensor(model(x))
        finally:
            for h in hooks:
                h.remove()
        # every block called exactly once, else no cache (full forward passes)
        once = all(len(v) == 1 for v in seen.values())
        self.inputs = [seen[j][0] for j in range(len(blocks))] if once else None
        self.exact = False
        if self.inputs is not None and len(blocks) > 1 and self.out is not None:
            self.exact = outputs_equal(self.forward_from(model, blocks, len(blocks) - 1, force=True), self.out)

    @torch.no_grad()
    def forward_from(self, model: nn.Module, blocks: list[nn.Module], b: int, force: bool = False):
        """``as_tensor(model(x))`` for a model equal to the dense one before block ``b``.

        Args:
            model: the (modified) model; blocks: its blocks (same order and count as the dense ones).
            b: first block that differs from the dense model (0 = full forward).
            force: use the cached stream even before :attr:`exact` is known (the constructor's check).

        Raises:
            ValueError: ``b`` outside ``[0, len(blocks))``.
        """
        if not 0 <= b < len(blocks):
            raise ValueError(f"block index {b} outside [0, {len(blocks)})")
        if b == 0 or self.inputs is None or not (self.exact or force):
            return self._as_tensor(model(self.x))
        with _start_at(blocks, b, self.inputs[b]):
            return self._as_tensor(model(self.x))
