"""STARFISH's alignment objective (starfish §3.2, eq. 1; METHODS.md §2).

For an image x, let ``f^l(x)`` be the pruned model's output of block ``l`` and ``r^l_x`` the dense
model's, both *post-residual* (the block's full output, a (N, D) token matrix), vectorised::

    L_align(x) = 1/L * sum_l ( 1 - <f^l(x), r^l_x> / (||f^l(x)|| ||r^l_x||) )        (eq. 1)

and the healing objective is its mean over the calibration images (eq. 2). ``kind="mse"`` is the
ablation of starfish App. B.1 (Table 3): the per-image mean squared difference of the same
representations, averaged over blocks.

Block outputs are captured with forward hooks on ``anatomy.vit.blocks[i]`` (:class:`BlockCapture`),
so this works for any model :func:`edgeprune.anatomy.find_anatomy` understands, pruned or dense.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from edgeprune.anatomy import ViTAnatomy

LOSSES = ("cosine", "mse")
"""Supported alignment objectives: ``cosine`` (STARFISH eq. 1, default) and ``mse`` (App. B.1)."""

COS_EPS = 1e-8
"""``eps`` of :func:`torch.nn.functional.cosine_similarity` (guards all-zero representations)."""


class _StopForward(Exception):
    """Raised from the last block's hook: nothing after the last block is needed."""


class BlockCapture:
    """Forward hooks that record every block's output (post-residual) during a forward pass.

    Usage::

        cap = BlockCapture(anatomy)
        outs = cap.run(images)          # list of L tensors (B, N, D), graph attached if grad on
        cap.remove()

    or as a context manager (``with BlockCapture(anatomy) as cap: ...``).

    :meth:`run` stops the forward pass right after the last block (the final norm, head or the
    ``dinov2-s14`` saliency decoder are not evaluated): the hook on the last block raises an
    internal exception that :meth:`run` catches.

    Args:
        anatomy: the model's :class:`~edgeprune.anatomy.ViTAnatomy`; hooks go on
            ``anatomy.vit.blocks[i]``.
    """

    def __init__(self, anatomy: ViTAnatomy) -> None:
        self.anatomy = anatomy
        self.outputs: list[torch.Tensor | None] = [None] * len(anatomy.blocks)
        self._stop = False
        self._handles = []
        blocks = [b.block for b in anatomy.blocks]  # the modules of anatomy.vit.blocks, in order
        for i, blk in enumerate(blocks):
            self._handles.append(blk.register_forward_hook(self._hook(i, last=i == len(blocks) - 1)))

    def _hook(self, i: int, last: bool):
        def hook(_module: nn.Module, _inputs, output):
            if isinstance(output, (tuple, list)):  # defensive: some blocks return extras
                output = output[0]
            self.outputs[i] = output
            if last and self._stop:
                raise _StopForward

        return hook

    def run(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Forward ``images`` up to the last block; return the L block outputs (B, N, D).

        Runs ``anatomy.vit.forward_features`` when the ViT has it (timm models, the ``dinov2-s14``
        backbone), else the whole model.
        """
        self.outputs = [None] * len(self.outputs)
        vit = self.anatomy.vit
        fwd = getattr(vit, "forward_features", None) or self.anatomy.model
        self._stop = True
        try:
            fwd(images)
        except _StopForward:
            pass
        finally:
            self._stop = False
        missing = [i for i, o in enumerate(self.outputs) if o is None]
        if missing:
            raise RuntimeError(f"blocks {missing} produced no output during the forward pass")
        outs = [o for o in self.outputs if o is not None]
        self.outputs = [None] * len(self.outputs)
        return outs

    def remove(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "BlockCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def per_image_alignment(outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                        kind: str = "cosine") -> torch.Tensor:
    """Alignment loss of each image, averaged over blocks.

    Args:
        outputs: L pruned block outputs, each (B, N, D) (any trailing shape).
        targets: L dense block outputs, same shapes -- except that a block of the pruned model that
            computes only its first T tokens (the class-token last block, (B, T, D)) is compared
            with the first T tokens of its target (the only ones the model's output reads).
        kind: ``"cosine"``: ``1 - cos`` of the flattened (N*D) token matrices (eq. 1);
            ``"mse"``: mean squared difference over the N*D entries.

    Returns:
        (B,) float32 per-image losses (mean over the L blocks).

    Raises:
        ValueError: unknown ``kind``, or mismatched block counts / shapes.
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown alignment loss {kind!r} (choose from {', '.join(LOSSES)})")
    if len(outputs) != len(targets) or not outputs:
        raise ValueError(f"{len(outputs)} block outputs vs {len(targets)} targets")
    total: torch.Tensor | None = None
    for out, ref in zip(outputs, targets):
        if out.dim() == 3 and ref.dim() == 3 and out.shape[1] < ref.shape[1] and out.shape[::2] == ref.shape[::2]:
            ref = ref[:, :out.shape[1]]  # a class-token block: only its T tokens exist and are read
        if out.shape != ref.shape:
            raise ValueError(f"block output {tuple(out.shape)} vs target {tuple(ref.shape)}")
        a = out.reshape(out.shape[0], -1)
        b = ref.reshape(ref.shape[0], -1).to(a.dtype)
        if kind == "cosine":
            per = 1.0 - F.cosine_similarity(a, b, dim=1, eps=COS_EPS)
        else:
            per = (a - b).pow(2).mean(dim=1)
        total = per if total is None else total + per
    assert total is not None
    return total / len(outputs)


def alignment_loss(outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                   kind: str = "cosine") -> torch.Tensor:
    """STARFISH batch loss: mean over images of :func:`per_image_alignment` (eq. 1-2).

    Returns:
        scalar tensor (differentiable w.r.t. ``outputs``).
    """
    return per_image_alignment(outputs, targets, kind).mean()


def per_block_alignment(outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                        kind: str = "cosine") -> list[float]:
    """Batch-mean loss of each block separately (diagnostics)."""
    return [float(per_image_alignment([o], [t], kind).mean()) for o, t in zip(outputs, targets)]
