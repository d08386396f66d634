"""The job of ``edgeprune heal``: STARFISH healing of a pruned run into a new run directory (METHODS.md §2),
printed as the command prints it. ``heal_run`` takes the command's settings; the healed run's ``recipe.toml``
is the CLI's (``write_recipe(path, values)`` when given). Under torchrun rank 0 evaluates, writes and reports.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from edgeprune.artifact import check_new_dir, check_writable, load_run, save_run
from edgeprune.distributed import is_main_process, process_group, world_size
from edgeprune.settings import SettingError
from edgeprune.errors import UserError
from edgeprune.evaluate import evaluate
from edgeprune.heal import HealConfig, heal
from edgeprune.heal.checkpoint import partial_dir
from edgeprune.heal.reduced import reduced_modules
from edgeprune.heal.runs import check_healable, default_calib_size, healed_record
from edgeprune.jobs.calib_reuse import calibration_fields, recorded_eval_folder, recorded_folder
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import check_readable_dir, fmt_metric, torch_device_of
from edgeprune.loading import load_base_model
from edgeprune.zoo.registry import spec_from_record


@dataclasses.dataclass
class HealRunResult:
    """Outcome of :func:`heal_run`: the healed run directory and its record (None on another torchrun rank)."""

    out: Path
    record: dict[str, Any] | None


def heal_run(run_dir: str | Path, out: str | Path | None = None, *, calib_dir: str | None = None,
             calib_size: int | None = None, seed: int | None = None, batch_size: int = 32,
             eval_data: str | None = None, eval_size: int | None = None, epochs: int = 10, lr: float = 1e-4,
             min_lr: float = 1e-6, warmup_steps: int | None = None, weight_decay: float = 0.01, loss: str = "cosine",
             cache_targets: str | None = None, memory_budget_mb: float = 1024, keep_best: bool = True,
             holdout: float = 0.0, no_eval: bool = False, device: str | None = None, torch_device: str | None = None,
             quiet: bool = False, echo: Echo = _echo,
             write_recipe: Callable[[Path, dict[str, Any]], Any] | None = None) -> HealRunResult:
    """Heal ``run_dir`` into ``out`` [RUN_DIR-healed] (resumable: a checkpoint per epoch in ``out.partial``).

    ``seed`` None: the run's recorded calibration seed (else 0). ``calib_dir`` / ``eval_data`` None: the
    run's recorded folders while they are there. ``device`` / ``torch_device``: the deployment profile (or the old
    torch-device spelling) and the torch device (:func:`edgeprune.jobs.models.torch_device_of`; default auto).

    Raises:
        UserError: not a healable run, ``out`` exists, unreadable data, an empty calibration set, nothing to heal.
    """
    device = torch_device_of(device, torch_device, default="auto")
    seed_given = seed is not None
    config = HealConfig(epochs=epochs, batch_size=batch_size, lr=lr, min_lr=min_lr, weight_decay=weight_decay,
                        loss=loss, seed=seed if seed_given else 0, warmup_steps=warmup_steps, holdout=holdout,
                        keep_best=keep_best, memory_budget_mb=memory_budget_mb, device=device)
    if calib_size is not None and calib_size < 1:
        raise SettingError(f"{{calib_size}} must be >= 1, got {calib_size}")
    run_path = Path(run_dir)
    out_path = Path(out) if out else run_path.with_name(run_path.name + "-healed")
    rec = check_healable(run_path)
    out_path = check_new_dir(out_path)
    with process_group(config.device):
        return _heal(run_path, out_path, rec, config, seed_given, calib_dir, calib_size, eval_data, eval_size,
                     cache_targets, no_eval, quiet, echo, write_recipe)


def _heal(run_path: Path, out_path: Path, rec: dict, config: HealConfig, seed_given: bool, calib_dir: Any,
          calib_size: Any, eval_data: Any, eval_size: Any, cache_targets: Any, no_eval: bool, quiet: bool,
          echo: Echo, write_recipe: Any) -> HealRunResult:
    ckpt = partial_dir(out_path)
    main = is_main_process()
    quiet = quiet or not main
    say = (lambda line: echo(line, err=line.startswith("warning"))) if main else (lambda line: None)
    if cache_targets is not None:
        check_writable(cache_targets)
    check_readable_dir(calib_dir, "calibration data")
    check_readable_dir(eval_data, "evaluation data")
    spec = spec_from_record(rec["base_model"])
    n = calib_size if calib_size is not None else default_calib_size(rec, spec)
    recorded_seed = (rec.get("calibration") or {}).get("seed")
    seed = config.seed
    if not seed_given and isinstance(recorded_seed, int):
        seed = config.seed = recorded_seed  # the run's own calibration set: its seed too (issue 42)
    if calib_dir is None:  # the run's own folder, when it is still there (issue 42)
        calib_dir = recorded_folder(rec.get("calibration"), spec, say=say)
    if eval_data is None and not no_eval:  # the run's own --eval-data, when it is still there (issue 52)
        eval_data = recorded_eval_folder(rec.get("calibration"), say=say)
    calib = spec.calibration_source(n, seed=seed, data=calib_dir, eval_data=eval_data)
    if len(calib) == 0:
        raise UserError("the calibration set is empty")
    ev = None
    if not no_eval and main:
        ev = spec.eval_source(eval_data or (calib_dir if spec.data_holds_both_splits else None), n=eval_size)
    pruned, rec = load_run(run_path)
    dense = load_base_model(rec)  # recorded seed / checkpoint (sha256-checked)
    if not reduced_modules(pruned, dense):
        raise UserError(f"{run_path}: nothing to heal: the run has the dense model's shapes everywhere (sparsity 0)")
    if main:
        procs = f" x {world_size()} processes" if world_size() > 1 else ""
        echo(f"heal {run_path} ({rec.get('method')}, {spec.name}) on {config.device}{procs}: "
             f"calibration {calib.description}")
        if ckpt.is_dir() and (ckpt / "checkpoint.safetensors").is_file():
            echo(f"resuming from the checkpoint in {ckpt}")
    try:
        result = heal(pruned, dense, calib, config, progress=not quiet, checkpoint_dir=ckpt,
                      target_cache=cache_targets, inplace=True)
    except KeyboardInterrupt:
        if main and (ckpt / "checkpoint.safetensors").is_file():
            echo(f"checkpoint kept in {ckpt}; rerun the same command to resume", err=True)
        raise
    if not main:
        return HealRunResult(out=out_path, record=None)  # another rank of a torchrun job
    evaluation = evaluate_healed(ev, rec, run_path, spec, result.model, dense, quiet, config.device, echo=echo)
    new = healed_record(rec, result, run_path, calibration={"seed": seed, "size_requested": n,
                                                            **calibration_fields(calib_dir, calib)},
                        evaluation=evaluation)
    save_run(out_path, result.model.cpu(), new)
    if write_recipe is not None:  # the values used, reused ones included
        write_recipe(out_path / "recipe.toml", {"out": str(out_path), "seed": seed, "calib": calib_dir,
                                                "eval-data": eval_data})
    shutil.rmtree(ckpt, ignore_errors=True)
    heal_report(result.info, evaluation, spec, loss=config.loss, lr=config.lr, epochs=config.epochs,
                keep_best=config.keep_best, echo=echo)
    echo(f"saved {out_path}")
    return HealRunResult(out=out_path, record=new)


def evaluate_healed(ev, rec: dict, run_path: Path, spec, healed, dense, quiet: bool, device: str,
                    echo: Echo = _echo) -> dict | None:
    """The healed run's ``evaluation`` entry (None without evaluation data): the healed model's
    quality and the unhealed one's (taken from the input record when it was measured on the same
    data, else measured), both against the dense model."""
    if ev is None:
        return None
    echo(f"evaluation: {ev.description}")
    old = rec.get("evaluation") or {}
    with torch.no_grad():
        if old.get("data") == ev.description and old.get("pruned"):
            before_m = old["pruned"]
        else:
            unhealed, _ = load_run(run_path)
            before_m = evaluate(spec, unhealed, ev, dense=dense, progress=not quiet, device=device)
        healed_m = evaluate(spec, healed, ev, dense=dense, progress=not quiet, device=device)
    return {"data": ev.description, "dense": old.get("dense") if old.get("data") == ev.description else None,
            "pruned": healed_m, "before_healing": before_m}


def heal_report(info: dict, evaluation: dict | None, spec, *, loss: str, lr: float, epochs: int, keep_best: bool,
                echo: Echo = _echo) -> None:
    """Print the heal's summary: alignment loss before -> after, the kept epoch or a warning when
    healing did not help, and the quality table (with evaluation)."""
    def fmt(v):
        return "n/a" if v is None else f"{v:.5f}"

    echo("")
    where = (f"{info['holdout']['num_images']} held-out calibration images" if info["holdout"]["num_images"]
             else "the calibration set")
    echo(f"alignment loss ({loss}) on {where}: {fmt(info['initial_loss'])} -> "
               f"{fmt(info['final_loss'])}; {len(info['trained_modules'])} layers trained "
               f"({info['trainable_params']:,} params), {epochs} epochs in {info['wall_time_s']:.1f} s")
    advice = (f"with few steps ({info['steps']} here) AdamW at --lr {lr:g} can overshoot or overfit the "
              "calibration images: try a lower --lr, a larger --calib-size, or --holdout 0.25 to stop early")
    if keep_best and info["best_epoch"] == 0 and info["steps"]:
        echo(f"warning: no epoch lowered the alignment loss, so the output keeps the input weights; {advice}",
                   err=True)
    elif keep_best and info["best_epoch"] is not None and info["best_epoch"] < epochs:
        echo(f"kept epoch {info['best_epoch']} of {epochs} (lowest alignment loss on {where})")
    elif (info["final_loss"] is not None and info["initial_loss"] is not None
          and info["final_loss"] > info["initial_loss"]):
        echo(f"warning: healing increased the alignment loss; {advice}", err=True)
    if evaluation is not None:
        echo(f"| {'':8} | quality |")
        echo(f"|{'-' * 10}|---------|")
        echo(f"| {'pruned':8} | {fmt_metric(evaluation['before_healing'], spec.output_kind)} |")
        echo(f"| {'healed':8} | {fmt_metric(evaluation['pruned'], spec.output_kind)} |")


__all__ = ["HealRunResult", "evaluate_healed", "heal_report", "heal_run"]
