"""STARFISH healing loop (starfish §3.2, App. B; METHODS.md §2).

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
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from edgeprune.anatomy import find_anatomy
from edgeprune.atomic import atomic_save_safetensors
from edgeprune.errors import UserError
from edgeprune.heal.alignment import LOSSES, BlockCapture, alignment_loss, per_image_alignment
from edgeprune.heal.targets import (DEFAULT_MEMORY_BUDGET_MB, CalibrationSet,
                                    iter_batches, make_targets, state_fingerprint)

CHECKPOINT = "checkpoint.safetensors"
STATE_KEY = "edgeprune_heal_state"
STATE_VERSION = 2  # 2: keep-best state (best.* tensors, best_loss / best_epoch)


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
            keep_best and best_epoch (0 = the input weights were kept).
    """

    model: nn.Module
    history: list[dict[str, Any]]
    info: dict[str, Any]


# ---- which layers train ---------------------------------------------------------------------------
def reduced_modules(pruned: nn.Module, dense: nn.Module) -> list[str]:
    """Names (in ``pruned.named_modules()``) of the layers whose shapes differ from the dense model.

    For a block with fewer MLP hidden channels than the dense block: its ``mlp.fc1`` and
    ``mlp.fc2``; with a smaller ``qk_dim`` or ``v_dim``: its ``attn.qkv`` and ``attn.proj``.
    Empty for a model pruned at sparsity 0.

    Raises:
        UserError: the two models do not have the same blocks (count, width, heads).
    """
    pa, da = find_anatomy(pruned), find_anatomy(dense)
    if len(pa.blocks) != len(da.blocks) or pa.embed_dim != da.embed_dim:
        raise UserError(f"the pruned model ({len(pa.blocks)} blocks, width {pa.embed_dim}) is not a pruned "
                        f"version of the dense model ({len(da.blocks)} blocks, width {da.embed_dim})")
    names = {id(m): n for n, m in pruned.named_modules()}
    out: list[str] = []
    for p, d in zip(pa.blocks, da.blocks):
        if p.num_heads != d.num_heads:
            raise UserError(f"block {p.index}: pruned model has {p.num_heads} heads, dense {d.num_heads}")
        if (p.qk_dim, p.v_dim) != (d.qk_dim, d.v_dim):
            out += [names[id(p.qkv)], names[id(p.proj)]]
        if p.mlp_hidden != d.mlp_hidden:
            out += [names[id(p.fc1)], names[id(p.fc2)]]
    return out


def reduced_modules_from_record(record: dict[str, Any]) -> list[str]:
    """Like :func:`reduced_modules` but from a run record's ``blocks`` vs ``dense_blocks``; names
    relative to the ViT (``blocks.<i>.attn.qkv`` ...). Empty when nothing is pruned.

    Raises:
        UserError: the record lacks ``blocks`` / ``dense_blocks`` or they disagree in length.
    """
    blocks, dense = record.get("blocks"), record.get("dense_blocks")
    if not isinstance(blocks, list) or not isinstance(dense, list) or len(blocks) != len(dense):
        raise UserError("run record has no matching 'blocks' / 'dense_blocks' entries")
    out = []
    for b, d in zip(blocks, dense):
        i = b.get("index")
        if (b["qk_dim"], b["v_dim"]) != (d["qk_dim"], d["v_dim"]):
            out += [f"blocks.{i}.attn.qkv", f"blocks.{i}.attn.proj"]
        if b["mlp_hidden"] != d["mlp_hidden"]:
            out += [f"blocks.{i}.mlp.fc1", f"blocks.{i}.mlp.fc2"]
    return out


def _resolve_trainable(model: nn.Module, names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Module or parameter names -> (module-ish names as given, parameter names), model order."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    wanted: set[str] = set()
    given = list(dict.fromkeys(names))
    for n in given:
        if n in params:
            wanted.add(n)
        elif n in modules and n != "":
            sub = [f"{n}.{pn}" for pn, _ in modules[n].named_parameters()]
            if not sub:
                raise UserError(f"trainable module {n!r} has no parameters")
            wanted.update(sub)
        else:
            raise UserError(f"trainable: the model has no module or parameter named {n!r}")
    return given, [n for n in params if n in wanted]


# ---- schedule -------------------------------------------------------------------------------------
def cosine_lr(step: int, total: int, lr: float, min_lr: float, warmup: int = 0) -> float:
    """Learning rate of step ``step`` (0-based) of ``total``.

    Optional linear warm-up over the first ``warmup`` steps (``lr * (step + 1) / (warmup + 1)``;
    not in the paper), then a cosine decay from ``lr`` towards ``min_lr`` over the remaining
    ``total - warmup`` steps (starfish App. B).
    """
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    span = total - warmup
    if span <= 0:
        return lr
    t = min(step - warmup, span)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * t / span))


def default_warmup_steps(total_steps: int) -> int:
    """Warm-up used when none is given: 10% of the steps, at least 5, at most half of them.

    Not in the paper. AdamW's first updates are sign-like steps of size ``lr`` per weight; with
    only a few dozen steps in all (dinov2-s14 with 64 calibration crops: 20) the paper's 6e-4
    overshoots and the alignment loss rises for several epochs (README, STARFISH section); a
    short linear warm-up damps that (at dinov2 sparsity 0.7 the rise disappears) and changed
    nothing measurable in a 320-step fmnist-vit heal.
    """
    return min(max(5, total_steps // 10), total_steps // 2)


# ---- loss over a data set -------------------------------------------------------------------------
@torch.no_grad()
def _measure(capture: BlockCapture, targets, calib: CalibrationSet, batch_size: int, kind: str,
             indices: torch.Tensor | None = None) -> float:
    order = torch.arange(len(calib)) if indices is None else indices
    total, n = 0.0, 0
    for idx in iter_batches(len(order), batch_size, order):
        x = calib.get(idx)
        per = per_image_alignment(capture.run(x), targets.get(idx, x), kind)
        total += float(per.double().sum())
        n += len(idx)
    return total / max(n, 1)


@torch.no_grad()
def measure_alignment(model: nn.Module, dense: nn.Module, images: Any, *, batch_size: int = 64,
                      loss: str = "cosine") -> float:
    """Mean alignment loss (eq. 1) of ``model`` to ``dense`` over ``images`` (tensor or source).

    Use it on held-out images to check that healing generalises.
    """
    from edgeprune.heal.targets import DenseTargets

    calib = CalibrationSet(images)
    targets = DenseTargets(dense)
    try:
        with BlockCapture(find_anatomy(model)) as cap:
            return _measure(cap, targets, calib, batch_size, loss)
    finally:
        targets.close()


# ---- checkpoints ----------------------------------------------------------------------------------
def _save_checkpoint(directory: Path, model: nn.Module, param_names: list[str], opt: torch.optim.Optimizer,
                     gen: torch.Generator, header: dict[str, Any],
                     best: dict[str, torch.Tensor] | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    tensors: dict[str, torch.Tensor] = {f"param.{n}": params[n].detach().clone().contiguous() for n in param_names}
    for n, t in (best or {}).items():
        tensors[f"best.{n}"] = t.contiguous()
    sd = opt.state_dict()
    extra: dict[str, dict[str, Any]] = {}
    for i, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim.{i}.{k}"] = v.detach().clone().contiguous()
            else:
                extra.setdefault(str(i), {})[k] = v
    tensors["rng.shuffle"] = gen.get_state().clone()
    tensors["rng.torch"] = torch.get_rng_state().clone()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
    header = dict(header, optimizer={"param_groups": groups, "extra_state": extra})
    atomic_save_safetensors(directory / CHECKPOINT, tensors, {STATE_KEY: json.dumps(header)})


def _load_checkpoint(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    path = directory / CHECKPOINT
    if not path.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        header = json.loads(meta[STATE_KEY])
    except Exception as err:  # noqa: BLE001 - any parse failure is a bad checkpoint
        raise UserError(f"cannot read healing checkpoint {path}: {str(err).splitlines()[0]}; "
                        "delete it to start over") from None
    if header.get("version") != STATE_VERSION:
        raise UserError(f"healing checkpoint {path} has an unsupported version; delete it to start over")
    return tensors, header


def _settings_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    keys = sorted(set(saved) | set(now))
    return [f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]


# ---- the loop -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _deterministic(seed: int):
    """Seed torch and enable deterministic algorithms; restore both afterwards."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def _validate(epochs, batch_size, lr, min_lr, weight_decay, loss, memory_budget_mb) -> None:
    if not isinstance(epochs, int) or epochs < 1:
        raise UserError(f"epochs must be an integer >= 1, got {epochs}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"batch size must be an integer >= 1, got {batch_size}")
    if not (lr > 0 and math.isfinite(lr)):
        raise UserError(f"learning rate must be > 0, got {lr}")
    if not (0 <= min_lr <= lr):
        raise UserError(f"minimum learning rate must be in [0, lr={lr}], got {min_lr}")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise UserError(f"weight decay must be >= 0, got {weight_decay}")
    if loss not in LOSSES:
        raise UserError(f"unknown loss {loss!r} (choose from {', '.join(LOSSES)})")
    if memory_budget_mb is not None and memory_budget_mb <= 0:
        raise UserError(f"memory budget must be > 0 MB, got {memory_budget_mb}")


def heal(pruned_model: nn.Module, dense_model: nn.Module, calibration: Any, *, epochs: int = 10,
         batch_size: int = 32, lr: float = 1e-4, min_lr: float = 1e-6, weight_decay: float = 0.01,
         loss: str = "cosine", seed: int = 0, trainable: Iterable[str] | None = None,
         progress: bool = False, checkpoint_dir: str | os.PathLike | None = None,
         target_cache: Any = None, memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
         callback: Callable[[int, dict[str, Any]], None] | None = None, inplace: bool = False,
         measure: bool = True, keep_best: bool = True, warmup_steps: int | None = None,
         holdout: float = 0.0) -> HealResult:
    """STARFISH healing: align every block output of a pruned model with the dense model's.

    Args:
        pruned_model: any pruned model of ``dense_model`` (CORP, uncompensated, ...); copied
            unless ``inplace``.
        dense_model: the dense model it was pruned from (only read).
        calibration: unlabeled images -- tensor (N, C, H, W), a data source, or a callable
            returning batches (see :class:`~edgeprune.heal.targets.CalibrationSet`). Never the
            evaluation images.
        epochs: passes over the calibration set (>= 1; paper: 5-10).
        batch_size: images per step (paper: 32).
        lr, min_lr: cosine schedule from ``lr`` to ``min_lr``. The paper uses 6e-4 -> 1e-6; the
            default lr is 1e-4: on CORP-compensated models, which start close to the dense one, it
            heals as well (fmnist-vit, 320 steps) or clearly better (dinov2-s14, 20 steps: saliency
            Pearson 0.923 vs 0.799 at sparsity 0.5); 6e-4 heals uncompensated models further when
            there are hundreds of steps (README, STARFISH section).
        weight_decay: AdamW decoupled weight decay (the paper does not state it; 0.01 is
            torch's AdamW default).
        loss: ``"cosine"`` (eq. 1) or ``"mse"`` (ablation, App. B.1).
        seed: seeds torch and the per-epoch shuffling generator.
        trainable: module or parameter names to train; ``None`` = the reduced layers
            (:func:`reduced_modules`). Everything else is frozen.
        progress: tqdm bars with the running loss.
        checkpoint_dir: write a checkpoint after every epoch and resume from one found there.
        target_cache: directory for a :class:`~edgeprune.heal.targets.DiskTargetCache` of the
            dense targets (default: recompute them batch by batch).
        memory_budget_mb: most memory held for cached targets.
        callback: ``callback(epoch, stats)`` after each epoch (after its checkpoint); an exception
            it raises stops healing (the checkpoint stays).
        inplace: heal ``pruned_model`` itself.
        measure: measure the alignment loss over the calibration set before and after (eval
            passes) for ``info["initial_loss"]`` / ``info["final_loss"]``.
        keep_best: measure the alignment loss after every epoch and return the weights of the
            best epoch, the input's included (see the module docstring); implies ``measure``.
        warmup_steps: linear learning-rate warm-up steps before the cosine decay; 0 is the
            paper's schedule; ``None`` (default) is :func:`default_warmup_steps` (10% of the
            steps, at least 5, at most half).
        holdout: fraction of the calibration images held out of training (seeded split, at least
            one image); the alignment loss that ``measure`` / ``keep_best`` report and select by
            is then measured on them only, so the kept epoch is the one that generalises best
            (early stopping). 0 (default): train on all images and measure on all of them.

    Returns:
        :class:`HealResult`.

    Raises:
        UserError: bad settings, empty calibration set, models that do not match, a checkpoint
            made with other settings.
    """
    t_start = time.perf_counter()
    _validate(epochs, batch_size, lr, min_lr, weight_decay, loss, memory_budget_mb)
    if warmup_steps is not None and (not isinstance(warmup_steps, int) or warmup_steps < 0):
        raise UserError(f"warm-up steps must be an integer >= 0, got {warmup_steps}")
    calib = CalibrationSet(calibration)
    model = pruned_model if inplace else copy.deepcopy(pruned_model)
    model.eval()
    dense_model.eval()
    reduced = reduced_modules(model, dense_model)  # also checks that the models match
    given, param_names = _resolve_trainable(model, reduced if trainable is None else trainable)
    params = dict(model.named_parameters())
    flags = {n: p.requires_grad for n, p in params.items()}
    train_set = set(param_names)
    n = len(calib)
    if not (0.0 <= holdout < 1.0):
        raise UserError(f"holdout must be a fraction in [0, 1), got {holdout}")
    if holdout > 0:
        n_val = max(1, round(holdout * n))
        if n_val >= n:
            raise UserError(f"holdout {holdout:g} of {n} calibration images leaves none to train on")
        split = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))
        val_idx, train_idx = split[:n_val].sort().values, split[n_val:].sort().values
    else:
        train_idx = val_idx = torch.arange(n)
    n_train = len(train_idx)
    steps_per_epoch = math.ceil(n_train / batch_size)
    total_steps = epochs * steps_per_epoch
    if warmup_steps is None:
        warmup_steps = default_warmup_steps(total_steps)
    settings = {"epochs": epochs, "batch_size": batch_size, "lr": lr, "min_lr": min_lr,
                "weight_decay": weight_decay, "loss": loss, "seed": seed, "trainable": param_names,
                "num_images": n, "keep_best": keep_best, "warmup_steps": warmup_steps, "holdout": holdout}
    ckpt_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt_dir is not None:
        settings.update(model_fingerprint=state_fingerprint(model), dense_fingerprint=state_fingerprint(dense_model),
                        calibration_fingerprint=calib.fingerprint())
    loaded = _load_checkpoint(ckpt_dir) if ckpt_dir is not None else None
    if loaded is not None:
        diff = _settings_diff(loaded[1]["settings"], settings)
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
        for name, p in params.items():
            p.requires_grad_(name in train_set)
        targets = make_targets(dense_model, calib, target_cache, memory_budget_mb, batch_size, progress)
        with BlockCapture(find_anatomy(model)) as cap, _deterministic(seed):
            gen = torch.Generator().manual_seed(seed)
            opt = None
            if param_names:
                opt = torch.optim.AdamW([params[n] for n in param_names], lr=lr, weight_decay=weight_decay)
            start_epoch, step = 0, 0
            if loaded is not None:
                tensors, header = loaded
                with torch.no_grad():
                    for pn in param_names:
                        params[pn].copy_(tensors[f"param.{pn}"])
                if opt is not None:
                    state: dict[int, dict[str, Any]] = {}
                    for key, t in tensors.items():
                        if key.startswith("optim."):
                            _, i, k = key.split(".", 2)
                            state.setdefault(int(i), {})[k] = t
                    for i, ex in header["optimizer"]["extra_state"].items():
                        state.setdefault(int(i), {}).update(ex)
                    groups = [dict(g, params=list(range(len(param_names)))) for g in header["optimizer"]["param_groups"]]
                    opt.load_state_dict({"state": state, "param_groups": groups})
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
                initial_loss = _measure(cap, targets, calib, batch_size, loss, val_idx)
                if keep_best:
                    best_loss = initial_loss
                    best = {pn: params[pn].detach().clone() for pn in param_names}

            for epoch in range(start_epoch, epochs if opt is not None else 0):
                assert opt is not None
                t0 = time.perf_counter()
                order = train_idx[torch.randperm(n_train, generator=gen)]
                bar = tqdm(iter_batches(n_train, batch_size, order), total=steps_per_epoch, disable=not progress,
                           desc=f"heal epoch {epoch + 1}/{epochs}", leave=False)
                loss_sum, seen, cur_lr = 0.0, 0, lr
                for idx in bar:
                    x = calib.get(idx)
                    ref = targets.get(idx, x)
                    cur_lr = cosine_lr(step, total_steps, lr, min_lr, warmup_steps)
                    for g in opt.param_groups:
                        g["lr"] = cur_lr
                    value = alignment_loss(cap.run(x), ref, loss)
                    opt.zero_grad(set_to_none=True)
                    value.backward()
                    opt.step()
                    step += 1
                    loss_sum += float(value.detach()) * len(idx)
                    seen += len(idx)
                    bar.set_postfix(loss=f"{loss_sum / seen:.5f}", lr=f"{cur_lr:.2e}")
                bar.close()
                stats = {"epoch": epoch + 1, "loss": loss_sum / seen, "lr": cur_lr,
                         "seconds": time.perf_counter() - t0}
                if keep_best:
                    assert best_loss is not None
                    stats["eval_loss"] = _measure(cap, targets, calib, batch_size, loss, val_idx)
                    if stats["eval_loss"] < best_loss:
                        best_loss, best_epoch = stats["eval_loss"], epoch + 1
                        best = {pn: params[pn].detach().clone() for pn in param_names}
                history.append(stats)
                if progress:
                    tqdm.write(f"heal epoch {epoch + 1}/{epochs}: loss {stats['loss']:.5f} "
                               f"({stats['seconds']:.1f} s)")
                if ckpt_dir is not None:
                    _save_checkpoint(ckpt_dir, model, param_names, opt, gen, {
                        "version": STATE_VERSION, "epochs_done": epoch + 1, "step": step,
                        "settings": settings, "history": history, "initial_loss": initial_loss,
                        "best_loss": best_loss, "best_epoch": best_epoch,
                        "elapsed_s": elapsed_before + time.perf_counter() - t_start}, best)
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
                final_loss = (_measure(cap, targets, calib, batch_size, loss, val_idx) if opt is not None
                              else initial_loss)
    finally:
        for name, p in params.items():
            p.requires_grad_(flags[name])
        if targets is not None:
            targets.close()
    model.eval()
    n_train = sum(params[pn].numel() for pn in param_names)
    info = {
        "loss": loss, "epochs": epochs, "lr": lr, "min_lr": min_lr, "warmup_steps": warmup_steps,
        "schedule": "linear warm-up, then cosine, per step" if warmup_steps else "cosine, per step",
        "optimizer": "AdamW", "batch_size": batch_size, "weight_decay": weight_decay, "seed": seed,
        "steps": total_steps if param_names else 0,
        "calibration": {"source": calib.description, "num_images": n},
        "holdout": {"fraction": holdout, "num_images": len(val_idx) if holdout > 0 else 0,
                    "loss_measured_on": "held-out calibration images" if holdout > 0 else "all calibration images"},
        "initial_loss": initial_loss, "final_loss": final_loss,
        "wall_time_s": elapsed_before + time.perf_counter() - t_start,
        "trained_modules": given,
        "trained_parameters": param_names,
        "trainable_params": n_train,
        "frozen_params": sum(p.numel() for p in params.values()) - n_train,
        "targets": targets.describe() if targets is not None else None,
        "resumed_from_epoch": resumed_from,
        "keep_best": keep_best,
        "best_epoch": best_epoch if keep_best else None,
    }
    if not param_names:
        info["note"] = "nothing to train: no reduced layers (the model has the dense shapes)"
    return HealResult(model=model, history=history, info=info)
