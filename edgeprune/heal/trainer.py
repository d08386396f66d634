"""STARFISH healing loop (starfish §3.2, App. B; METHODS.md §2).

Settings: :class:`edgeprune.heal.config.HealConfig`; layers trained:
:mod:`edgeprune.heal.reduced`; schedule: :mod:`edgeprune.heal.schedule`; checkpoints:
:mod:`edgeprune.heal.checkpoint`.

:func:`heal` trains the *reduced* layers of a pruned model -- those whose shapes differ from the
dense model's: ``mlp.fc1``/``mlp.fc2`` of blocks with fewer MLP hidden channels, ``attn.qkv`` /
``attn.proj`` of blocks with fewer Q/K or V head dims -- so that every block's output matches the
dense model's (eq. 1, :mod:`edgeprune.heal.alignment`). edgeprune's pruned models are physically
smaller, so "the surviving weights of the pruned tensors" (App. B) are exactly the weights of these
layers; every other parameter (embeddings, norms, LayerScales, untouched layers, heads, the
``dinov2-s14`` decoder) is frozen and stays bit-identical. The model is kept in eval mode
throughout (no dropout / drop-path, BatchNorm statistics untouched).

Optimisation (App. B): AdamW, learning rate ``lr`` decayed per step with a cosine schedule
to ``min_lr`` (1e-6) over ``epochs * ceil(N / batch_size)`` steps
(``lr_t = min_lr + (lr - min_lr) * (1 + cos(pi t / T)) / 2``), batch 32, reshuffled every epoch
by a generator seeded with ``seed``. Not in the paper: the default lr is 1e-4 (paper: 6e-4), and
by default the first ``default_warmup_steps(T)`` steps warm the learning rate up linearly (the
cosine then spans the remaining steps); ``warmup_steps=0`` gives the paper's schedule. Runs are
deterministic for a given seed, machine and thread count
(``torch.use_deterministic_algorithms(True)`` while healing).

Keeping the best epoch (``keep_best``, default on; not in the paper): after every epoch the
alignment loss is measured in an eval pass -- over the whole calibration set, or over the
``holdout`` images kept out of training -- and the result is the weights of the epoch with the
lowest value, the input weights ("epoch 0") included, so healing never returns a model that is
further from the dense one on that measure than its input. With few optimisation steps AdamW's
first updates at the paper's learning rate can overshoot, and a heal can overfit a tiny
calibration set (measured on dinov2-s14 with 64 calibration crops: see the README); keep-best
guards against the first, ``holdout`` against the second.

Checkpoints (``checkpoint_dir``): after every epoch one ``checkpoint.safetensors`` (trainable
weights, the best epoch's weights, AdamW moments, the shuffling generator's and torch's RNG
states; a JSON header in its metadata with epoch, step, history and the settings) is written
atomically. A later call with the same directory resumes after the last completed epoch --
exactly: the result is bit-identical to an uninterrupted run -- after checking that the settings,
the input model and the calibration set are the same. No pickle is involved.

Devices (``HealConfig.device``: cpu, cuda, cuda:N; ``auto`` resolves to cuda when available):
both models are moved to the device for the heal and back to their own devices afterwards (the
healed model is returned where ``pruned_model`` was, normally the CPU, ready to save); calibration
images are moved there batch by batch; the dense targets are computed there
(:class:`~edgeprune.heal.targets.DenseTargets`) or read from the host-side disk cache and moved per
batch. The AdamW state and the best epoch's weights stay on the device; checkpoints are written
from host copies, so a checkpoint made on one device resumes on another (bit-identical only on the
same device). Healing has no closed-form solve. On CUDA, TF32 is switched off for the heal (float32
matmuls and convolutions, as on the CPU), ``CUBLAS_WORKSPACE_CONFIG`` defaults to ``:4096:8`` and
deterministic algorithms are requested with ``warn_only`` (an op without a deterministic CUDA
kernel warns instead of stopping the heal); CUDA runs are repeatable, but not bit-identical to CPU
runs (float32 reduction order differs; measured agreement is in ``tests/test_device_heal.py``).

Multiple processes (torchrun, an initialised process group with more than one rank): every rank
calls :func:`heal` with the same arguments; each takes a slice of every batch and the gradients
are summed over the ranks before the same AdamW step everywhere
(:mod:`edgeprune.heal.data_parallel`); rank 0 writes the checkpoints.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from edgeprune.anatomy import find_anatomy
from edgeprune.calibration.collect import exact_fp32
from edgeprune.errors import RuntimeFault, UserError
from edgeprune.heal.alignment import BlockCapture, alignment_loss, per_image_alignment
from edgeprune.heal.checkpoint import (CHECKPOINT, STATE_KEY, STATE_VERSION, load_checkpoint,  # noqa: F401
                                       restore_optimizer, save_checkpoint, settings_diff)
from edgeprune.heal.config import HealConfig
from edgeprune.heal import data_parallel as dp
from edgeprune.heal.reduced import reduced_modules, reduced_modules_from_record, resolve_trainable  # noqa: F401
from edgeprune.heal.schedule import cosine_lr, default_warmup_steps  # noqa: F401
from edgeprune.heal.targets import CalibrationSet, DenseTargets, iter_batches, make_targets, model_device, state_fingerprint
from edgeprune.progress import on_terminal, progress as progress_bar
from edgeprune.torch_device import resolve_device


@dataclasses.dataclass
class HealResult:
    """Outcome of :func:`heal`.

    Attributes:
        model: the healed model (eval mode).
        history: one dict per epoch: ``epoch`` (1-based), ``loss`` (mean training loss over the
            epoch's images), ``lr`` (at the epoch's last step), ``seconds``, and with
            ``keep_best`` ``eval_loss`` (alignment over the calibration set after the epoch).
        info: settings and summary for the run record: loss, epochs, lr, min_lr, batch_size,
            weight_decay, seed, calibration (source, num_images), initial_loss / final_loss (the
            alignment loss over the calibration set before / after, eval pass), wall_time_s,
            trained_modules, trainable_params, frozen_params, targets, resumed_from_epoch,
            keep_best and best_epoch (0 = the input weights were kept), device (where it ran),
            config (asdict).
        config: the :class:`HealConfig` used.
    """

    model: nn.Module
    history: list[dict[str, Any]]
    info: dict[str, Any]
    config: HealConfig | None = None


# ---- loss over a data set -------------------------------------------------------------------------
def _to(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Move a list of target tensors to ``device`` (no copy when they are already there)."""
    return [t.to(device, non_blocking=True) for t in tensors]


def _data_parallel_backward(cap: BlockCapture, calib: CalibrationSet, targets, idx: torch.Tensor, kind: str,
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
        per = per_image_alignment(cap.run(x), _to(targets.get(sub, x), dev), kind)
        value = per.sum() / len(idx)
        value.backward()
        local = float(value.detach())
    (total,) = dp.all_reduce_gradients(trained, [local])
    return total


@torch.no_grad()
def _measure(capture: BlockCapture, targets, calib: CalibrationSet, batch_size: int, kind: str,
             indices: torch.Tensor | None = None, device: torch.device | str = "cpu") -> float:
    dev = torch.device(device)
    order = torch.arange(len(calib)) if indices is None else indices
    order = dp.share(order)  # under torchrun: this rank's slice, the sums all-reduced below
    total, n = 0.0, 0
    for idx in iter_batches(len(order), batch_size, order):
        x = calib.get(idx).to(dev)
        per = per_image_alignment(capture.run(x), _to(targets.get(idx, x), dev), kind)
        total += float(per.double().sum())
        n += len(idx)
    total, n = dp.all_reduce_sums([total, n])
    return total / max(n, 1)


@torch.no_grad()
def measure_alignment(model: nn.Module, dense: nn.Module, images: Any, *, batch_size: int = 64,
                      loss: str = "cosine", device: str | None = None) -> float:
    """Mean alignment loss (eq. 1) of ``model`` to ``dense`` over ``images`` (tensor or source).

    Use it on held-out images to check that healing generalises.

    Args:
        device: run both models there ("cpu", "cuda", "cuda:N", "auto"; moved there and back);
            None = ``model``'s own device (``dense`` is moved there for the pass).

    Raises:
        UserError: unknown device or CUDA not available, empty calibration set.
    """
    dev = model_device(model) if device is None else torch.device(resolve_device(device))
    calib = CalibrationSet(images)
    homes = [(m, model_device(m)) for m in (model, dense)]
    targets = DenseTargets(dense)
    try:
        model.to(dev)
        dense.to(dev)
        with BlockCapture(find_anatomy(model)) as cap:
            return _measure(cap, targets, calib, batch_size, loss, device=dev)
    finally:
        targets.close()
        for m, home in homes:
            m.to(home)


@contextlib.contextmanager
def _deterministic(seed: int, device: torch.device | str = "cpu"):
    """Seed torch and enable deterministic algorithms; restore both afterwards.

    On CUDA also: ``CUBLAS_WORKSPACE_CONFIG`` set to ``:4096:8`` unless the user set it (cuBLAS
    needs it for deterministic results), deterministic algorithms with ``warn_only=True``, and TF32
    off for matmuls and cuDNN convolutions (restored afterwards), so that the float32 arithmetic is
    the CPU's.
    """
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if cuda else []
    if cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    with torch.random.fork_rng(devices=devices), exact_fp32(dev):  # TF32 off on CUDA, restored after
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True, warn_only=cuda)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def _holdout_split(n: int, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def heal(pruned_model: nn.Module, dense_model: nn.Module, calibration: Any, config: HealConfig | None = None, *,
         trainable: Iterable[str] | None = None, progress: bool = False,
         checkpoint_dir: str | os.PathLike | None = None, target_cache: Any = None,
         callback: Callable[[int, dict[str, Any]], None] | None = None, inplace: bool = False,
         measure: bool = True, **settings: Any) -> HealResult:
    """STARFISH healing: align every block output of a pruned model with the dense model's.

    Args:
        pruned_model: any pruned model of ``dense_model`` (CORP, uncompensated, ...); copied
            unless ``inplace``.
        dense_model: the dense model it was pruned from (only read).
        calibration: unlabeled images -- tensor (N, C, H, W), a data source, or a callable
            returning batches (see :class:`~edgeprune.heal.targets.CalibrationSet`). Never the
            evaluation images.
        config: :class:`~edgeprune.heal.config.HealConfig` (epochs, batch size, lr, min_lr,
            weight decay, loss, seed, warm-up, holdout, keep_best, memory budget). Instead of a
            config, its fields may be given as keywords (``epochs=2, batch_size=8, ...``); with
            a config, keywords override its fields. On CORP-compensated models lr 1e-4 heals as
            well as the paper's 6e-4 (fmnist-vit, 320 steps) or clearly better (dinov2-s14, 20
            steps: saliency Pearson 0.923 vs 0.799 at sparsity 0.5; README, STARFISH section).
        trainable: module or parameter names to train; ``None`` = the reduced layers
            (:func:`~edgeprune.heal.reduced.reduced_modules`). Everything else is frozen.
        progress: progress display with the running loss (:mod:`edgeprune.progress`).
        checkpoint_dir: write a checkpoint after every epoch and resume from one found there.
        target_cache: directory for a :class:`~edgeprune.heal.targets.DiskTargetCache` of the
            dense targets (default: recompute them batch by batch).
        callback: ``callback(epoch, stats)`` after each epoch (after its checkpoint); an exception
            it raises stops healing (the checkpoint stays).
        inplace: heal ``pruned_model`` itself.
        measure: measure the alignment loss over the calibration set before and after (eval
            passes) for ``info["initial_loss"]`` / ``info["final_loss"]``.

    Device: ``config.device`` (or ``device=``): both models are moved there for the heal and
    back afterwards; the result is on ``pruned_model``'s device (see the module doc, "Devices").

    Returns:
        :class:`HealResult`.

    Raises:
        UserError: bad settings, an unknown device or CUDA not available, empty calibration set,
            models that do not match, a checkpoint made with other settings.
    """
    t_start = time.perf_counter()
    main = dp.dist.is_main_process()  # under torchrun: rank 0 shows progress and writes checkpoints
    distributed = dp.dist.is_distributed()
    if config is None:
        config = HealConfig.from_settings(**settings)
    elif settings:
        HealConfig.from_settings(**settings)  # unknown names -> UserError
        config = dataclasses.replace(config, **settings)
    config.validate()  # also resolves config.device ("auto" -> cuda / cpu)
    cfg = config
    dev = torch.device(cfg.device)
    calib = CalibrationSet(calibration)
    model = pruned_model if inplace else copy.deepcopy(pruned_model)
    homes = [(model, model_device(model)), (dense_model, model_device(dense_model))]
    model.eval()
    dense_model.eval()
    reduced = reduced_modules(model, dense_model)  # also checks that the models match
    given, param_names = resolve_trainable(model, reduced if trainable is None else trainable)
    params = dict(model.named_parameters())
    flags = {n: p.requires_grad for n, p in params.items()}
    train_set = set(param_names)
    n = len(calib)
    train_idx, val_idx = _holdout_split(n, cfg.holdout, cfg.seed)
    n_train = len(train_idx)
    steps_per_epoch = math.ceil(n_train / cfg.batch_size)
    total_steps = cfg.epochs * steps_per_epoch
    warmup_steps = default_warmup_steps(total_steps) if cfg.warmup_steps is None else cfg.warmup_steps
    epochs, batch_size, lr, min_lr, loss, seed, keep_best = (cfg.epochs, cfg.batch_size, cfg.lr, cfg.min_lr,
                                                              cfg.loss, cfg.seed, cfg.keep_best)
    settings = {"epochs": epochs, "batch_size": batch_size, "lr": lr, "min_lr": min_lr,
                "weight_decay": cfg.weight_decay, "loss": loss, "seed": seed, "trainable": param_names,
                "num_images": n, "keep_best": keep_best, "warmup_steps": warmup_steps, "holdout": cfg.holdout}
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt_dir is not None:
        settings.update(model_fingerprint=state_fingerprint(model), dense_fingerprint=state_fingerprint(dense_model),
                        calibration_fingerprint=calib.fingerprint())
    loaded = load_checkpoint(ckpt_dir) if ckpt_dir is not None else None
    if loaded is not None:
        diff = settings_diff(loaded[1]["settings"], settings)
        assert ckpt_dir is not None
        if diff:
            raise UserError(f"healing checkpoint {ckpt_dir / CHECKPOINT} was made with other settings or "
                            f"inputs ({'; '.join(diff[:3])}); use the same settings or delete {ckpt_dir}")

    history: list[dict[str, Any]] = []
    targets = None
    resumed_from = None
    initial_loss = final_loss = None
    best_loss: float | None = None
    best_epoch = 0
    best: dict[str, torch.Tensor] | None = None
    elapsed_before = 0.0
    try:
        for m, _home in homes:
            m.to(dev)
        params = dict(model.named_parameters())  # the same objects unless torch swapped them
        for name, p in params.items():
            p.requires_grad_(name in train_set)
        with exact_fp32(dev):  # cached targets: float32 like the ones computed in the TF32-off loop
            targets = dp.prepare_targets(lambda: make_targets(dense_model, calib, target_cache, cfg.memory_budget_mb,
                                                              batch_size, progress and main))
        with BlockCapture(find_anatomy(model)) as cap, _deterministic(seed, dev):
            gen = torch.Generator().manual_seed(seed)
            opt = None
            if param_names:
                opt = torch.optim.AdamW([params[n] for n in param_names], lr=lr, weight_decay=cfg.weight_decay)
            start_epoch, step = 0, 0
            if distributed:  # every rank must resume from the same epoch (rank 0 wrote the file)
                done = int(loaded[1]["epochs_done"]) if loaded is not None else 0
                total, squares = dp.all_reduce_sums([done, done ** 2])
                if total ** 2 != squares * dp.dist.world_size():  # equality in Cauchy-Schwarz: all equal
                    raise RuntimeFault(f"the ranks found different healing checkpoints in {ckpt_dir} "
                                       f"(rank {dp.dist.rank()}: epoch {done}); is the directory shared?")
            if loaded is not None:
                tensors, header = loaded
                with torch.no_grad():
                    for pn in param_names:
                        params[pn].copy_(tensors[f"param.{pn}"])
                if opt is not None:
                    restore_optimizer(opt, tensors, header, len(param_names))
                gen.set_state(tensors["rng.shuffle"])
                torch.set_rng_state(tensors["rng.torch"])
                start_epoch, step = int(header["epochs_done"]), int(header["step"])
                history = list(header["history"])
                initial_loss = header.get("initial_loss")
                best_loss, best_epoch = header.get("best_loss"), int(header.get("best_epoch", 0))
                if keep_best:
                    best = {pn: tensors[f"best.{pn}"] for pn in param_names}
                elapsed_before = float(header.get("elapsed_s", 0.0))
                resumed_from = start_epoch
            elif measure or keep_best:
                initial_loss = _measure(cap, targets, calib, batch_size, loss, val_idx, dev)
                if keep_best:
                    best_loss = initial_loss
                    best = {pn: params[pn].detach().clone() for pn in param_names}

            for epoch in range(start_epoch, epochs if opt is not None else 0):
                assert opt is not None
                t0 = time.perf_counter()
                order = train_idx[torch.randperm(n_train, generator=gen)]
                bar = progress_bar(iter_batches(n_train, batch_size, order), f"heal epoch {epoch + 1}/{epochs}",
                                   enabled=progress and main, total=steps_per_epoch, unit="step")
                loss_sum, seen, cur_lr = 0.0, 0, lr
                for idx in bar:
                    cur_lr = cosine_lr(step, total_steps, lr, min_lr, warmup_steps)
                    for g in opt.param_groups:
                        g["lr"] = cur_lr
                    opt.zero_grad(set_to_none=True)
                    if distributed:  # this rank's slice; the gradients summed over the ranks
                        batch_loss = _data_parallel_backward(cap, calib, targets, idx, loss, dev,
                                                             [params[pn] for pn in param_names])
                    else:
                        x = calib.get(idx).to(dev, non_blocking=True)
                        ref = _to(targets.get(idx, x), dev)
                        value = alignment_loss(cap.run(x), ref, loss)
                        value.backward()
                        batch_loss = float(value.detach())
                    opt.step()
                    step += 1
                    loss_sum += batch_loss * len(idx)
                    seen += len(idx)
                    bar.set_postfix(loss=f"{loss_sum / seen:.5f}", lr=f"{cur_lr:.2e}")
                bar.close()
                stats = {"epoch": epoch + 1, "loss": loss_sum / seen, "lr": cur_lr,
                         "seconds": time.perf_counter() - t0}
                if keep_best:
                    assert best_loss is not None
                    stats["eval_loss"] = _measure(cap, targets, calib, batch_size, loss, val_idx, dev)
                    if stats["eval_loss"] < best_loss:
                        best_loss, best_epoch = stats["eval_loss"], epoch + 1
                        best = {pn: params[pn].detach().clone() for pn in param_names}
                history.append(stats)
                if progress and main and on_terminal():  # the bar vanishes: keep one line per epoch
                    bar.write(f"heal epoch {epoch + 1}/{epochs}: loss {stats['loss']:.5f} "
                              f"({stats['seconds']:.1f} s)")
                if ckpt_dir is not None and main:
                    save_checkpoint(ckpt_dir, model, param_names, opt, gen, {
                        "version": STATE_VERSION, "epochs_done": epoch + 1, "step": step,
                        "settings": settings, "history": history, "initial_loss": initial_loss,
                        "best_loss": best_loss, "best_epoch": best_epoch,
                        "elapsed_s": elapsed_before + time.perf_counter() - t_start}, best)
                if ckpt_dir is not None and distributed:
                    torch.distributed.barrier()  # the checkpoint is on disk before any rank goes on
                if callback is not None:
                    callback(epoch + 1, stats)
            if keep_best and opt is not None:
                assert best is not None
                if best_epoch != epochs:  # a later epoch drifted away: restore the best one
                    with torch.no_grad():
                        for pn in param_names:
                            params[pn].copy_(best[pn])
                final_loss = best_loss
            elif measure:
                final_loss = (_measure(cap, targets, calib, batch_size, loss, val_idx, dev) if opt is not None
                              else initial_loss)
    finally:
        for name, p in params.items():
            p.requires_grad_(flags[name])
        if targets is not None:
            targets.close()
        for m, home in homes:
            m.to(home)
    model.eval()
    n_trained = sum(params[pn].numel() for pn in param_names)
    info = {
        "loss": loss, "epochs": epochs, "lr": lr, "min_lr": min_lr, "warmup_steps": warmup_steps,
        "schedule": "linear warm-up, then cosine, per step" if warmup_steps else "cosine, per step",
        "optimizer": "AdamW", "batch_size": batch_size, "weight_decay": cfg.weight_decay, "seed": seed,
        "steps": total_steps if param_names else 0,
        "calibration": {"source": calib.description, "num_images": n},
        "holdout": {"fraction": cfg.holdout, "num_images": len(val_idx) if cfg.holdout > 0 else 0,
                    "loss_measured_on": "held-out calibration images" if cfg.holdout > 0 else "all calibration images"},
        "initial_loss": initial_loss, "final_loss": final_loss,
        "wall_time_s": elapsed_before + time.perf_counter() - t_start,
        "trained_modules": given,
        "trained_parameters": param_names,
        "trainable_params": n_trained,
        "frozen_params": sum(p.numel() for p in params.values()) - n_trained,
        "targets": targets.describe() if targets is not None else None,
        "resumed_from_epoch": resumed_from,
        "keep_best": keep_best,
        "best_epoch": best_epoch if keep_best else None,
        "device": str(dev),
        **dp.info(),
        "config": dataclasses.asdict(cfg),
    }
    if not param_names:
        info["note"] = "nothing to train: no reduced layers (the model has the dense shapes)"
    return HealResult(model=model, history=history, info=info, config=cfg)
