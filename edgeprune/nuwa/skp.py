"""SKP: self-knowledge purification with learnable MLP channel masks (nuwa §3.2 eq. 3-6).

Every MLP of the frozen base model gets a score vector m (D_mlp,), initialised to 1, and a
keep-ratio logit beta, initialised to 5.0 (keep ratio sigmoid(beta) = 0.993). The forward pass keeps
the top ``k = ceil(sigmoid(beta) * D_mlp)`` channels of m: a hard 0/1 mask multiplies the input of
``fc2`` (a forward pre-hook, eq. 3-4). The mask is not differentiable; the straight-through
estimator of the paper is used:

    dL/dm = dL/dmask,        dL/dbeta = sum_j dL/dmask_j * mask_j

so channels whose removal would lower the loss get lower scores (and drop out of the top-k), and
beta follows the total gradient of the kept channels. The loss is the task's cross-entropy on
labeled images of the target classes; AdamW (lr(beta) 1e-1, lr(m) 1e-3, weight decay 0.05,
constant schedule, batch 1 by default -- suppl. Tab. 9). Periodically the masked model is evaluated
on held-out target-class images (a slice of the *train* split), and the best (accuracy, then pruning
rate) mask set is kept: the anchor (eq. 5-6), returned as kept channel indices per block.

Devices: :func:`run_skp` trains on ``device`` (the model and the masks are moved there, images
and labels batch by batch; the model goes back afterwards); the anchor's indices are CPU tensors.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from edgeprune.progress import progress as show_progress

from edgeprune.anatomy import ViTAnatomy


class _MaskSTE(torch.autograd.Function):
    """Hard top-k mask of m with straight-through gradients (nuwa §3.2)."""

    @staticmethod
    def forward(ctx, m: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:  # noqa: D102
        mask = hard_mask(m.detach(), beta.detach())
        ctx.save_for_backward(mask)
        return mask

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        (mask,) = ctx.saved_tensors
        return grad, (grad * mask).sum().reshape(1)


def kept_count(beta: torch.Tensor | float, dim: int) -> int:
    """k = ceil(sigmoid(beta) * D), clamped to [1, D] (eq. 3)."""
    b = float(beta) if not isinstance(beta, torch.Tensor) else float(beta.detach().reshape(-1)[0])
    k = math.ceil(1.0 / (1.0 + math.exp(-b)) * dim - 1e-9)
    return max(1, min(dim, k))


def hard_mask(m: torch.Tensor, beta: torch.Tensor | float) -> torch.Tensor:
    """0/1 mask keeping the top-k entries of m (ties broken by lower index)."""
    dim = m.numel()
    k = kept_count(beta, dim)
    # stable ordering: sort by -m, ties by index, so the result does not depend on topk internals
    order = torch.sort(-m.detach(), stable=True).indices
    mask = torch.zeros(dim, dtype=m.dtype, device=m.device)
    mask[order[:k]] = 1
    return mask


class MLPMasks(nn.Module):
    """Learnable SKP masks for every MLP of a model.

    Args:
        dims: D_mlp of every block.
        beta_init: initial keep-ratio logit (5.0 in the paper).
        m_init: initial score (1.0).
    """

    def __init__(self, dims: list[int], beta_init: float = 5.0, m_init: float = 1.0) -> None:
        super().__init__()
        self.m = nn.ParameterList([nn.Parameter(torch.full((d,), float(m_init))) for d in dims])
        self.beta = nn.ParameterList([nn.Parameter(torch.full((1,), float(beta_init))) for _ in dims])

    def mask(self, i: int) -> torch.Tensor:
        """Block i's hard mask, differentiable w.r.t. m and beta through the STE."""
        return _MaskSTE.apply(self.m[i], self.beta[i])

    @torch.no_grad()
    def keep_indices(self) -> list[torch.Tensor]:
        """Sorted kept channel indices per block (the anchor's structure, eq. 5-6)."""
        return [hard_mask(m, b).nonzero().flatten().sort().values.cpu() for m, b in zip(self.m, self.beta)]

    def install(self, anatomy: ViTAnatomy) -> list:
        """Multiply every fc2 input by its mask (forward pre-hooks); returns the hook handles."""
        handles = []
        for i, b in enumerate(anatomy.blocks):
            handles.append(b.fc2.register_forward_pre_hook(
                lambda _mod, args, i=i: (args[0] * self.mask(i).to(args[0].device, args[0].dtype),)
                + tuple(args[1:])))
        return handles


def install_fixed_masks(anatomy: ViTAnatomy, keep: list[torch.Tensor]) -> list:
    """Zero every fc2 input channel outside ``keep`` (the anchor, without changing shapes)."""
    handles = []
    for b, k in zip(anatomy.blocks, keep):
        mask = torch.zeros(b.mlp_hidden)
        mask[k] = 1
        handles.append(b.fc2.register_forward_pre_hook(
            lambda _mod, args, mask=mask: (args[0] * mask.to(args[0].device, args[0].dtype),) + tuple(args[1:])))
    return handles


@dataclasses.dataclass
class SKPConfig:
    """SKP settings (nuwa suppl. Tab. 9; steps default to a CPU-sized run).

    Attributes:
        steps: optimiser steps (the paper uses 10k on a GPU).
        batch_size: images per step (1 in the paper: more exploration, Fig. 10).
        lr_beta, lr_mask: AdamW learning rates of beta and m.
        weight_decay: AdamW weight decay.
        beta_init: initial keep-ratio logit.
        eval_every: evaluate on the held-out images every this many steps (and at the end).
        min_keep: never keep fewer channels than this per MLP (1 = no floor).
        seed: sampling seed.
    """

    steps: int = 400
    batch_size: int = 1
    lr_beta: float = 1e-1
    lr_mask: float = 1e-3
    weight_decay: float = 0.05
    beta_init: float = 5.0
    eval_every: int = 50
    min_keep: int = 8
    seed: int = 0


@dataclasses.dataclass
class Anchor:
    """SKP result.

    Attributes:
        keep: per block, the sorted kept MLP channel indices.
        dims: D_mlp of the base model per block.
        val_accuracy: held-out target-class accuracy of the anchor (None without SKP evaluation).
        step: the step whose masks were kept (0 = initial masks).
        history: [{step, val_accuracy, val_loss, pruning_rate, keep}] of every evaluation.
        seconds: SKP wall time.
    """

    keep: list[torch.Tensor]
    dims: list[int]
    val_accuracy: float | None = None
    step: int = 0
    history: list = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def pruning_rate(self) -> float:
        """Fraction of MLP channels removed over the model."""
        return 1.0 - sum(len(k) for k in self.keep) / sum(self.dims)

    @classmethod
    def full(cls, dims: list[int]) -> "Anchor":
        """The trivial anchor: every channel kept (SKP skipped)."""
        return cls(keep=[torch.arange(d) for d in dims], dims=list(dims))

    def to_record(self) -> dict:
        return {"step": self.step, "val_accuracy": self.val_accuracy,
                "mlp_pruning_rate": self.pruning_rate, "kept": [len(k) for k in self.keep],
                "seconds": self.seconds, "history": self.history}


def run_skp(anatomy: ViTAnatomy, images: torch.Tensor, labels: torch.Tensor,
            evaluate: Callable[[], tuple[float, float]], config: SKPConfig,
            progress: bool = False, device: str | torch.device | None = None) -> Anchor:
    """Learn the SKP masks on labeled target-class images and return the best anchor.

    Args:
        anatomy: the base model's anatomy; its weights are frozen (requires_grad restored after).
        images, labels: training images (N, C, H, W) and labels (N,) in the model's class indices.
        evaluate: ``() -> (accuracy, loss)`` on the held-out target-class images, called with the
            masks installed (under no_grad).
        config: :class:`SKPConfig`.
        device: train there ("cpu", "cuda", "cuda:N"; None = the model's own device): the model
            and the masks are moved there, images and labels batch by batch; the model is moved
            back afterwards. ``evaluate`` is called while the model is there.

    Returns:
        :class:`Anchor` -- the evaluated mask set with the highest held-out accuracy, ties broken
        by the higher pruning rate (then the earlier step).
    """
    model = anatomy.model
    dims = [b.mlp_hidden for b in anatomy.blocks]
    t0 = time.perf_counter()
    p0 = next(model.parameters(), None)
    home = torch.device("cpu") if p0 is None else p0.device
    dev = home if device is None else torch.device(device)
    masks = MLPMasks(dims, beta_init=config.beta_init).to(dev)
    flags = [p.requires_grad for p in model.parameters()]
    for p in model.parameters():
        p.requires_grad_(False)
    model.eval()
    opt = torch.optim.AdamW([{"params": list(masks.m), "lr": config.lr_mask},
                             {"params": list(masks.beta), "lr": config.lr_beta}],
                            weight_decay=config.weight_decay)
    beta_floor = _beta_floors(dims, config.min_keep)
    gen = torch.Generator().manual_seed(config.seed)
    history: list[dict] = []
    best: tuple | None = None
    best_keep: list[torch.Tensor] | None = None
    if dev != home:
        model.to(dev)
    handles = masks.install(anatomy)

    def checkpoint(step: int) -> None:
        nonlocal best, best_keep
        keep = masks.keep_indices()
        with torch.no_grad():
            acc, loss = evaluate()
        rate = 1.0 - sum(len(k) for k in keep) / sum(dims)
        history.append({"step": step, "val_accuracy": acc, "val_loss": loss, "pruning_rate": rate,
                        "kept": [len(k) for k in keep]})
        score = (acc, rate, -step)
        if best is None or score > best:
            best, best_keep = score, keep

    try:
        checkpoint(0)
        _train(model, masks, opt, beta_floor, images, labels, config, gen, dev, checkpoint, progress)
    finally:
        for h in handles:
            h.remove()
        for p, fl in zip(model.parameters(), flags):
            p.requires_grad_(fl)
        if dev != home:
            model.to(home)
    assert best is not None and best_keep is not None
    return Anchor(keep=best_keep, dims=dims, val_accuracy=best[0], step=-best[2], history=history,
                  seconds=time.perf_counter() - t0)


def _beta_floors(dims: list[int], min_keep: int) -> list[float]:
    """Per block, the lowest threshold logit beta: the logit of ``min_keep / D`` (``inf`` where
    ``min_keep`` >= D), so that at least ``min_keep`` channels stay."""
    return [math.log(max(min_keep, 1) / d / (1 - max(min_keep, 1) / d))
            if max(min_keep, 1) < d else float("inf") for d in dims]


def _train(model: nn.Module, masks: MLPMasks, opt: torch.optim.Optimizer, beta_floor: list[float],
           images: torch.Tensor, labels: torch.Tensor, config: SKPConfig, gen: torch.Generator,
           dev: torch.device, checkpoint: Callable[[int], None], progress: bool) -> None:
    """:func:`run_skp`'s ``config.steps`` optimiser steps on the masks (cross-entropy on batches of a
    reshuffled-per-epoch permutation drawn from ``gen``), betas clamped to ``beta_floor`` after each
    step, ``checkpoint(step)`` every ``config.eval_every`` steps and after the last."""
    n = len(images)
    perm = torch.randperm(n, generator=gen)
    pos = 0
    bs = max(1, min(config.batch_size, n))
    for step in show_progress(range(1, config.steps + 1), "SKP", enabled=progress, unit="step"):
        if pos + bs > n:
            perm, pos = torch.randperm(n, generator=gen), 0
        idx = perm[pos:pos + bs]
        pos += bs
        loss = F.cross_entropy(model(images[idx].to(dev)), labels[idx].to(dev))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for b, fl in zip(masks.beta, beta_floor):
                if math.isfinite(fl):
                    b.clamp_(min=fl)
        if step % max(1, config.eval_every) == 0 or step == config.steps:
            checkpoint(step)
