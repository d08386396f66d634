"""The steps of a heal's optimisation loop (:func:`edgeprune.heal.heal` runs them in order).

* :class:`Plan` -- what a heal works on, fixed before the loop (settings, model, trainable
  parameter names, index split, schedule lengths, checkpoint);
* :class:`LoopState` -- what changes: epoch, step, history, losses, the best epoch's weights;
* :func:`holdout_split`, :func:`check_ranks_agree`, :func:`start` (resume from a checkpoint or
  measure the input), :func:`train_epoch`, :func:`end_epoch` (keep-best, checkpoint, callback),
  :func:`finish` (restore the best epoch, final loss).

Optimisation as in starfish App. B (METHODS.md §2): AdamW, per-step learning rate from
:func:`~edgeprune.heal.schedule.cosine_lr`, batches reshuffled every epoch by a seeded generator.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from edgeprune.errors import RuntimeFault, UserError
from edgeprune.heal import data_parallel as dp
from edgeprune.heal.alignment import BlockCapture, alignment_loss, per_image_alignment
from edgeprune.heal.checkpoint import STATE_VERSION, restore_optimizer, save_checkpoint
from edgeprune.heal.config import HealConfig
from edgeprune.heal.measure import mean_alignment, to_device
from edgeprune.heal.schedule import cosine_lr
from edgeprune.heal.targets import CalibrationSet, iter_batches
from edgeprune.progress import on_terminal, progress as progress_bar


@dataclasses.dataclass
class Plan:
    """What a heal works on, fixed before the loop.

    Attributes:
        cfg: the validated settings; dev: the torch device of the heal.
        calib: the calibration images; model: the model being healed (a copy unless inplace).
        homes: (module, device) to move the models back to afterwards.
        given: the trainable names as given (modules or parameters); param_names: the trained
            parameters; flags: every parameter's ``requires_grad`` before the heal.
        train_idx / val_idx: calibration indices trained on / measured on (all, without holdout).
        steps_per_epoch, total_steps, warmup_steps: the schedule.
        settings: what a checkpoint must match to be resumed; ckpt_dir: the checkpoint directory
            or None; loaded: the checkpoint found there (tensors, header) or None.
        main / distributed: rank 0 (progress, checkpoints) / more than one process.
        progress: show progress; t_start: ``time.perf_counter()`` when the heal started.
    """

    cfg: HealConfig
    dev: torch.device
    calib: CalibrationSet
    model: nn.Module
    homes: list[tuple[nn.Module, torch.device]]
    given: list[str]
    param_names: list[str]
    flags: dict[str, bool]
    train_idx: torch.Tensor
    val_idx: torch.Tensor
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    settings: dict[str, Any]
    ckpt_dir: Path | None
    loaded: tuple[dict[str, torch.Tensor], dict[str, Any]] | None
    main: bool
    distributed: bool
    progress: bool
    t_start: float


@dataclasses.dataclass
class LoopState:
    """The loop's progress: next epoch and step, per-epoch history, alignment losses, the best
    epoch (0 = the input weights) and its trainable weights, time spent before a resume, and the
    epoch resumed from (None without a resume)."""

    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    start_epoch: int = 0
    step: int = 0
    initial_loss: float | None = None
    final_loss: float | None = None
    best_loss: float | None = None
    best_epoch: int = 0
    best: dict[str, torch.Tensor] | None = None
    elapsed_before: float = 0.0
    resumed_from: int | None = None


def holdout_split(n: int, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train indices, measure indices): a seeded split, or all images for both when holdout = 0.

    Raises:
        UserError: the split leaves no image to train on.
    """
    if holdout <= 0:
        return torch.arange(n), torch.arange(n)
    n_val = max(1, round(holdout * n))
    if n_val >= n:
        raise UserError(f"holdout {holdout:g} of {n} calibration images leaves none to train on")
    split = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
    return split[n_val:].sort().values, split[:n_val].sort().values


def check_ranks_agree(plan: Plan) -> None:
    """Under torchrun every rank must resume from the same epoch (rank 0 wrote the file).

    Raises:
        RuntimeFault: the ranks found different checkpoints (the directory is not shared).
    """
    done = int(plan.loaded[1]["epochs_done"]) if plan.loaded is not None else 0
    total, squares = dp.all_reduce_sums([done, done ** 2])
    if total ** 2 != squares * dp.dist.world_size():  # equality in Cauchy-Schwarz: all equal
        raise RuntimeFault(f"the ranks found different healing checkpoints in {plan.ckpt_dir} "
                           f"(rank {dp.dist.rank()}: epoch {done}); is the directory shared?")


def start(plan: Plan, params: dict[str, nn.Parameter], opt: torch.optim.Optimizer | None, gen: torch.Generator,
          cap: BlockCapture, targets, measure: bool) -> LoopState:
    """The loop's first state: restored from the checkpoint (weights, AdamW moments, RNG states,
    history, best epoch), or, for a fresh heal, the input's alignment loss (with ``measure`` or
    keep-best) and the input weights as the best so far (keep-best)."""
    cfg, names, state = plan.cfg, plan.param_names, LoopState()
    if plan.loaded is not None:
        tensors, header = plan.loaded
        with torch.no_grad():
            for pn in names:
                params[pn].copy_(tensors[f"param.{pn}"])
        if opt is not None:
            restore_optimizer(opt, tensors, header, len(names))
        gen.set_state(tensors["rng.shuffle"])
        torch.set_rng_state(tensors["rng.torch"])
        state.start_epoch, state.step = int(header["epochs_done"]), int(header["step"])
        state.history = list(header["history"])
        state.initial_loss = header.get("initial_loss")
        state.best_loss, state.best_epoch = header.get("best_loss"), int(header.get("best_epoch", 0))
        if cfg.keep_best:
            state.best = {pn: tensors[f"best.{pn}"] for pn in names}
        state.elapsed_before = float(header.get("elapsed_s", 0.0))
        state.resumed_from = state.start_epoch
    elif measure or cfg.keep_best:
        state.initial_loss = mean_alignment(cap, targets, plan.calib, cfg.batch_size, cfg.loss, plan.val_idx, plan.dev)
        if cfg.keep_best:
            state.best_loss = state.initial_loss
            state.best = {pn: params[pn].detach().clone() for pn in names}
    return state


def data_parallel_backward(cap: BlockCapture, calib: CalibrationSet, targets, idx: torch.Tensor, kind: str,
                           dev: torch.device, trained: list[torch.nn.Parameter]) -> float:
    """One data-parallel backward pass (:mod:`edgeprune.heal.data_parallel`): this rank's slice of
    the global batch ``idx`` contributes ``sum(per-image loss) / len(idx)``; the gradients of
    ``trained`` are then summed over the ranks, so they equal the gradient of the batch mean.

    Returns:
        the batch-mean alignment loss (all ranks' slices).
    """
    sub = dp.share(idx)
    local = 0.0
    if len(sub):
        x = calib.get(sub).to(dev, non_blocking=True)
        per = per_image_alignment(cap.run(x), to_device(targets.get(sub, x), dev), kind)
        value = per.sum() / len(idx)
        value.backward()
        local = float(value.detach())
    (total,) = dp.all_reduce_gradients(trained, [local])
    return total


def _backward(plan: Plan, cap: BlockCapture, targets, idx: torch.Tensor, trained: list[nn.Parameter]) -> float:
    """Forward and backward of one batch (the images ``idx``); returns its mean alignment loss."""
    if plan.distributed:  # this rank's slice; the gradients summed over the ranks
        return data_parallel_backward(cap, plan.calib, targets, idx, plan.cfg.loss, plan.dev, trained)
    x = plan.calib.get(idx).to(plan.dev, non_blocking=True)
    ref = to_device(targets.get(idx, x), plan.dev)
    value = alignment_loss(cap.run(x), ref, plan.cfg.loss)
    value.backward()
    return float(value.detach())


def train_epoch(plan: Plan, state: LoopState, epoch: int, params: dict[str, nn.Parameter],
                opt: torch.optim.Optimizer, gen: torch.Generator, cap: BlockCapture, targets) -> tuple[dict, Any]:
    """One pass over the shuffled training images, one AdamW step per batch (``state.step``
    advances). Returns (stats: epoch, mean loss, last lr, seconds; the progress bar)."""
    cfg, t0 = plan.cfg, time.perf_counter()
    n_train = len(plan.train_idx)
    order = plan.train_idx[torch.randperm(n_train, generator=gen)]
    bar = progress_bar(iter_batches(n_train, cfg.batch_size, order), f"heal epoch {epoch + 1}/{cfg.epochs}",
                       enabled=plan.progress and plan.main, total=plan.steps_per_epoch, unit="step")
    trained = [params[pn] for pn in plan.param_names]
    loss_sum, seen, cur_lr = 0.0, 0, cfg.lr
    for idx in bar:
        cur_lr = cosine_lr(state.step, plan.total_steps, cfg.lr, cfg.min_lr, plan.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        opt.zero_grad(set_to_none=True)
        batch_loss = _backward(plan, cap, targets, idx, trained)
        opt.step()
        state.step += 1
        loss_sum += batch_loss * len(idx)
        seen += len(idx)
        bar.set_postfix(loss=f"{loss_sum / seen:.5f}", lr=f"{cur_lr:.2e}")
    bar.close()
    return {"epoch": epoch + 1, "loss": loss_sum / seen, "lr": cur_lr, "seconds": time.perf_counter() - t0}, bar


def end_epoch(plan: Plan, state: LoopState, stats: dict[str, Any], bar: Any, params: dict[str, nn.Parameter],
              opt: torch.optim.Optimizer, gen: torch.Generator, cap: BlockCapture, targets,
              callback: Callable[[int, dict[str, Any]], None] | None) -> None:
    """After an epoch: keep-best's eval pass (``stats["eval_loss"]``, the best weights kept), the
    history, one line on a terminal, the checkpoint (rank 0; all ranks wait for it), the callback."""
    cfg, epoch = plan.cfg, stats["epoch"]
    if cfg.keep_best:
        assert state.best_loss is not None
        stats["eval_loss"] = mean_alignment(cap, targets, plan.calib, cfg.batch_size, cfg.loss, plan.val_idx, plan.dev)
        if stats["eval_loss"] < state.best_loss:
            state.best_loss, state.best_epoch = stats["eval_loss"], epoch
            state.best = {pn: params[pn].detach().clone() for pn in plan.param_names}
    state.history.append(stats)
    if plan.progress and plan.main and on_terminal():  # the bar vanishes: keep one line per epoch
        bar.write(f"heal epoch {epoch}/{cfg.epochs}: loss {stats['loss']:.5f} ({stats['seconds']:.1f} s)")
    if plan.ckpt_dir is not None and plan.main:
        save_checkpoint(plan.ckpt_dir, plan.model, plan.param_names, opt, gen, {
            "version": STATE_VERSION, "epochs_done": epoch, "step": state.step,
            "settings": plan.settings, "history": state.history, "initial_loss": state.initial_loss,
            "best_loss": state.best_loss, "best_epoch": state.best_epoch,
            "elapsed_s": state.elapsed_before + time.perf_counter() - plan.t_start}, state.best)
    if plan.ckpt_dir is not None and plan.distributed:
        torch.distributed.barrier()  # the checkpoint is on disk before any rank goes on
    if callback is not None:
        callback(epoch, stats)


def finish(plan: Plan, state: LoopState, params: dict[str, nn.Parameter], trained: bool, cap: BlockCapture,
           targets, measure: bool) -> None:
    """After the last epoch: keep-best restores the best epoch's weights (unless it is the last)
    and its loss is the final one; otherwise the final alignment is measured (with ``measure``).
    ``trained``: an optimiser ran (there were parameters to train)."""
    cfg = plan.cfg
    if cfg.keep_best and trained:
        assert state.best is not None
        if state.best_epoch != cfg.epochs:  # a later epoch drifted away: restore the best one
            with torch.no_grad():
                for pn in plan.param_names:
                    params[pn].copy_(state.best[pn])
        state.final_loss = state.best_loss
    elif measure:
        state.final_loss = (mean_alignment(cap, targets, plan.calib, cfg.batch_size, cfg.loss, plan.val_idx, plan.dev)
                            if trained else state.initial_loss)
