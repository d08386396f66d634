"""STARFISH healing loop (starfish §3.2, App. B; METHODS.md §2).

Settings: :class:`edgeprune.heal.config.HealConfig`; layers trained:
:mod:`edgeprune.heal.reduced`; schedule: :mod:`edgeprune.heal.schedule`; checkpoints:
:mod:`edgeprune.heal.checkpoint`; the loop's steps: :mod:`edgeprune.heal.loop`; eval passes:
:mod:`edgeprune.heal.measure`; determinism: :mod:`edgeprune.heal.determinism`.

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
same device). Healing has no closed-form solve. On CUDA the whole heal runs deterministically
(:mod:`edgeprune.heal.determinism`): TF32 off (float32 matmuls and convolutions, as on the CPU),
``CUBLAS_WORKSPACE_CONFIG`` ``:4096:8`` unless set to ``:16:8``, deterministic algorithms without
``warn_only`` (an op without a deterministic CUDA kernel stops the heal rather than break the
resume promise), cuDNN deterministic, and the math backend of ``scaled_dot_product_attention``
(the memory-efficient backend's backward is not deterministic); every setting is restored
afterwards. CUDA runs are repeatable and resume bit-identically, but are not bit-identical to CPU
runs (float32 reduction order differs; measured agreement is in ``tests/test_device_heal.py``).

Multiple processes (torchrun, an initialised process group with more than one rank): every rank
calls :func:`heal` with the same arguments; each takes a slice of every batch and the gradients
are summed over the ranks before the same AdamW step everywhere
(:mod:`edgeprune.heal.data_parallel`); rank 0 writes the checkpoints.
"""

from __future__ import annotations

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
from edgeprune.errors import UserError
from edgeprune.heal import data_parallel as dp
from edgeprune.heal.alignment import BlockCapture
from edgeprune.heal.checkpoint import (CHECKPOINT, STATE_KEY, STATE_VERSION, load_checkpoint,  # noqa: F401
                                       restore_optimizer, save_checkpoint, settings_diff)
from edgeprune.heal.config import HealConfig
from edgeprune.heal.determinism import cuda_deterministic, seeded
from edgeprune.heal.loop import (LoopState, Plan, check_ranks_agree, end_epoch, finish, holdout_split, start,
                                 train_epoch)
from edgeprune.heal.measure import measure_alignment  # noqa: F401 (re-exported)
from edgeprune.heal.reduced import reduced_modules, reduced_modules_from_record, resolve_trainable  # noqa: F401
from edgeprune.heal.schedule import cosine_lr, default_warmup_steps  # noqa: F401
from edgeprune.heal.targets import CalibrationSet, make_targets, model_device, state_fingerprint


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



def _resolve_config(config: HealConfig | None, settings: dict[str, Any]) -> HealConfig:
    """The config of the call: built from keyword ``settings``, or ``config`` with them applied;
    validated (the device resolved: "auto" -> cuda / cpu).

    Raises:
        UserError: an unknown setting name or a bad value.
    """
    if config is None:
        config = HealConfig.from_settings(**settings)
    elif settings:
        HealConfig.from_settings(**settings)  # unknown names -> UserError
        config = dataclasses.replace(config, **settings)
    config.validate()  # also resolves config.device ("auto" -> cuda / cpu)
    return config


def _plan(pruned_model: nn.Module, dense_model: nn.Module, calibration: Any, cfg: HealConfig,
          trainable: Iterable[str] | None, checkpoint_dir: str | os.PathLike | None, inplace: bool,
          progress: bool, t_start: float) -> Plan:
    """Everything fixed before the loop, checked before any work: the models match, the trainable
    names exist, the holdout leaves images to train on, a checkpoint found matches the settings.

    Raises:
        UserError: models that do not match, unknown trainable names, empty calibration set, a
            checkpoint made with other settings or inputs.
    """
    calib = CalibrationSet(calibration)
    model = pruned_model if inplace else copy.deepcopy(pruned_model)
    homes = [(model, model_device(model)), (dense_model, model_device(dense_model))]
    model.eval()
    dense_model.eval()
    reduced = reduced_modules(model, dense_model)  # also checks that the models match
    given, param_names = resolve_trainable(model, reduced if trainable is None else trainable)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    n = len(calib)
    train_idx, val_idx = holdout_split(n, cfg.holdout, cfg.seed)
    steps_per_epoch = math.ceil(len(train_idx) / cfg.batch_size)
    total_steps = cfg.epochs * steps_per_epoch
    warmup_steps = default_warmup_steps(total_steps) if cfg.warmup_steps is None else cfg.warmup_steps
    settings = {"epochs": cfg.epochs, "batch_size": cfg.batch_size, "lr": cfg.lr, "min_lr": cfg.min_lr,
                "weight_decay": cfg.weight_decay, "loss": cfg.loss, "seed": cfg.seed, "trainable": param_names,
                "num_images": n, "keep_best": cfg.keep_best, "warmup_steps": warmup_steps, "holdout": cfg.holdout}
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    loaded = None
    if ckpt_dir is not None:
        settings.update(model_fingerprint=state_fingerprint(model), dense_fingerprint=state_fingerprint(dense_model),
                        calibration_fingerprint=calib.fingerprint())
        loaded = load_checkpoint(ckpt_dir)
    if loaded is not None:
        assert ckpt_dir is not None
        diff = settings_diff(loaded[1]["settings"], settings)
        if diff:
            raise UserError(f"healing checkpoint {ckpt_dir / CHECKPOINT} was made with other settings or "
                            f"inputs ({'; '.join(diff[:3])}); use the same settings or delete {ckpt_dir}")
    return Plan(cfg=cfg, dev=torch.device(cfg.device), calib=calib, model=model, homes=homes, given=given,
                param_names=param_names, flags=flags, train_idx=train_idx, val_idx=val_idx,
                steps_per_epoch=steps_per_epoch, total_steps=total_steps, warmup_steps=warmup_steps,
                settings=settings, ckpt_dir=ckpt_dir, loaded=loaded, main=dp.dist.is_main_process(),
                distributed=dp.dist.is_distributed(), progress=progress, t_start=t_start)


def _to_device(plan: Plan) -> dict[str, nn.Parameter]:
    """Move both models to the heal's device; only the trained parameters require gradients.
    Returns the model's parameters by name (the same objects unless torch swapped them)."""
    for m, _home in plan.homes:
        m.to(plan.dev)
    params = dict(plan.model.named_parameters())
    train_set = set(plan.param_names)
    for name, p in params.items():
        p.requires_grad_(name in train_set)
    return params


def _optimise(plan: Plan, params: dict[str, nn.Parameter], targets, callback, measure: bool) -> LoopState:
    """The AdamW loop: seeded and deterministic, resumed from the checkpoint when there is one."""
    cfg = plan.cfg
    with BlockCapture(find_anatomy(plan.model)) as cap, seeded(cfg.seed, plan.dev):
        gen = torch.Generator().manual_seed(cfg.seed)
        opt = None
        if plan.param_names:
            opt = torch.optim.AdamW([params[n] for n in plan.param_names], lr=cfg.lr, weight_decay=cfg.weight_decay)
        if plan.distributed:
            check_ranks_agree(plan)
        state = start(plan, params, opt, gen, cap, targets, measure)
        for epoch in range(state.start_epoch, cfg.epochs if opt is not None else 0):
            assert opt is not None
            stats, bar = train_epoch(plan, state, epoch, params, opt, gen, cap, targets)
            end_epoch(plan, state, stats, bar, params, opt, gen, cap, targets, callback)
        finish(plan, state, params, opt is not None, cap, targets, measure)
    return state


def _info(plan: Plan, state: LoopState, params: dict[str, nn.Parameter], targets) -> dict[str, Any]:
    """``HealResult.info``: the settings and summary of the run (see :class:`HealResult`)."""
    cfg, names = plan.cfg, plan.param_names
    n_trained = sum(params[pn].numel() for pn in names)
    info = {
        "loss": cfg.loss, "epochs": cfg.epochs, "lr": cfg.lr, "min_lr": cfg.min_lr, "warmup_steps": plan.warmup_steps,
        "schedule": "linear warm-up, then cosine, per step" if plan.warmup_steps else "cosine, per step",
        "optimizer": "AdamW", "batch_size": cfg.batch_size, "weight_decay": cfg.weight_decay, "seed": cfg.seed,
        "steps": plan.total_steps if names else 0,
        "calibration": {"source": plan.calib.description, "num_images": len(plan.calib)},
        "holdout": {"fraction": cfg.holdout, "num_images": len(plan.val_idx) if cfg.holdout > 0 else 0,
                    "loss_measured_on": "held-out calibration images" if cfg.holdout > 0 else "all calibration images"},
        "initial_loss": state.initial_loss, "final_loss": state.final_loss,
        "wall_time_s": state.elapsed_before + time.perf_counter() - plan.t_start,
        "trained_modules": plan.given,
        "trained_parameters": names,
        "trainable_params": n_trained,
        "frozen_params": sum(p.numel() for p in params.values()) - n_trained,
        "targets": targets.describe() if targets is not None else None,
        "resumed_from_epoch": state.resumed_from,
        "keep_best": cfg.keep_best,
        "best_epoch": state.best_epoch if cfg.keep_best else None,
        "device": str(plan.dev),
        **dp.info(),
        "config": dataclasses.asdict(cfg),
    }
    if not names:
        info["note"] = "nothing to train: no reduced layers (the model has the dense shapes)"
    return info


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
    cfg = _resolve_config(config, settings)
    plan = _plan(pruned_model, dense_model, calibration, cfg, trainable, checkpoint_dir, inplace, progress, t_start)
    params = dict(plan.model.named_parameters())
    targets = None
    try:
        with cuda_deterministic(plan.dev):  # from before the first cuBLAS call; a no-op on the CPU
            params = _to_device(plan)
            with exact_fp32(plan.dev):  # cached targets: float32 like the ones computed in the TF32-off loop
                targets = dp.prepare_targets(lambda: make_targets(dense_model, plan.calib, target_cache,
                                                                  cfg.memory_budget_mb, cfg.batch_size,
                                                                  progress and plan.main))
            state = _optimise(plan, params, targets, callback, measure)
    finally:
        for name, p in params.items():
            p.requires_grad_(plan.flags[name])
        if targets is not None:
            targets.close()
        for m, home in plan.homes:
            m.to(home)
    plan.model.eval()
    return HealResult(model=plan.model, history=state.history, info=_info(plan, state, params, targets), config=cfg)
