"""``edgeprune heal RUN_DIR -o HEALED_DIR``: STARFISH healing of a pruned run (METHODS.md §2).

Loads any pruned run directory (CORP, uncompensated, ...), rebuilds its dense base model from the
record, draws unlabeled calibration images (Fashion-MNIST *train* images for ``fmnist-vit``, the
scikit-image photos for ``dinov2-s14``, an ImageFolder directory for timm models -- never the
evaluation images), trains the reduced layers to align every block output with the dense model's
(:func:`edgeprune.heal.heal`) and saves a normal run directory whose record is the input record
plus a ``healing`` entry. A checkpoint is written to ``HEALED_DIR.partial/`` after every epoch;
rerunning the same command after an interruption resumes from the last completed epoch.

``--torch-device`` (default ``auto``: cuda when available, else cpu; ``cpu`` with a CPU deployment
profile ``--device cpu``) is where both models, the images and the training run; the evaluation
runs there too; the healed model is saved from the CPU. The device is printed and recorded
(``healing.device``, ``healing.config.device``).

Under ``torchrun --nproc-per-node W --no-python edgeprune heal ...`` the W processes heal data
parallel (:mod:`edgeprune.heal.data_parallel`; gloo on the CPU, nccl with ``--torch-device cuda``);
rank 0 evaluates, writes the run and reports (docs/distributed.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import click
import torch
from click.core import ParameterSource

from edgeprune.artifact import check_new_dir, check_writable, load_run, save_run
from edgeprune.cli.calib_reuse import calibration_fields, recorded_eval_folder, recorded_folder
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import (FINITE, calibration_options, check_readable_dir, device_option, eval_options,
                                   fmt_metric, out_option, quiet_option, torch_device_of)
from edgeprune.cli.recipe import write_recipe
from edgeprune.distributed import is_main_process, process_group, world_size
from edgeprune.errors import UserError
from edgeprune.evaluate import evaluate
from edgeprune.heal import HealConfig, heal
from edgeprune.heal.checkpoint import partial_dir
from edgeprune.heal.reduced import reduced_modules
from edgeprune.heal.runs import check_healable, default_calib_size, healed_record
from edgeprune.loading import load_base_model
from edgeprune.zoo.registry import spec_from_record


@click.command("heal", cls=RecipeCommand)
@click.argument("run_dir", type=click.Path())
@calibration_options("Calibration images [the run's own calibration set size].")
@eval_options
@click.option("--epochs", type=int, default=10, show_default=True,
              help="Passes over the calibration set (paper: 5-10).")
@click.option("--lr", type=FINITE, default=1e-4, show_default=True,
              help="AdamW learning rate (cosine schedule start). The paper's 6e-4 suits uncompensated "
                   "models with hundreds of steps; 1e-4 keeps CORP's compensation (README).")
@click.option("--min-lr", type=FINITE, default=1e-6, show_default=True, help="Cosine schedule end.")
@click.option("--warmup-steps", type=int, default=None,
              help="Linear learning-rate warm-up steps before the cosine decay (not in the paper; "
                   "0 = the paper's schedule) [10% of the steps, at least 5, at most half].")
@click.option("--weight-decay", type=FINITE, default=0.01, show_default=True, help="AdamW weight decay.")
@click.option("--loss", type=click.Choice(["cosine", "mse"]), default="cosine", show_default=True,
              help="Block-output alignment: cosine (STARFISH eq. 1) or mse (ablation).")
@click.option("--cache-targets", type=click.Path(), default=None, metavar="DIR",
              help="Cache the dense block outputs in DIR (safetensors shards; reusable across runs of the "
                   "same dense model and calibration set) [recompute per batch].")
@click.option("--memory-budget-mb", type=FINITE, default=1024, show_default=True,
              help="Most memory held for cached targets; beyond it shards are streamed from disk.")
@click.option("--keep-best/--keep-last", default=True, show_default=True,
              help="Return the epoch with the lowest alignment loss on the calibration set (the input "
                   "included), or the last epoch (the paper).")
@click.option("--holdout", type=FINITE, default=0.0, show_default=True,
              help="Fraction of the calibration images held out of training; the kept epoch is the one "
                   "with the lowest alignment loss on them (early stopping).")
@click.option("--no-eval", is_flag=True, help="Skip the before/after evaluation.")
@device_option(default="auto")
@out_option("RUN_DIR-healed")
@quiet_option
def heal_cmd(run_dir, calib_dir, calib_size, seed, batch_size, eval_data, eval_size, epochs, lr, min_lr,
             warmup_steps, weight_decay, loss, cache_targets, memory_budget_mb, keep_best, holdout, no_eval,
             device, torch_device, out, quiet):
    """Heal a pruned run with STARFISH.

    Trains the reduced layers of RUN_DIR so that every block output aligns with the dense
    model's, and saves a new run directory (resumable after an interruption).
    """
    # 1. everything that can be checked without work
    device = torch_device_of(device, torch_device, default="auto")  # --device is the deployment profile
    config = HealConfig(epochs=epochs, batch_size=batch_size, lr=lr, min_lr=min_lr, weight_decay=weight_decay,
                        loss=loss, seed=seed, warmup_steps=warmup_steps, holdout=holdout, keep_best=keep_best,
                        memory_budget_mb=memory_budget_mb, device=device)
    if calib_size is not None and calib_size < 1:
        raise UserError(f"--calib-size must be >= 1, got {calib_size}")
    run_path = Path(run_dir)
    out_path = Path(out) if out else run_path.with_name(run_path.name + "-healed")
    rec = check_healable(run_path)
    out_path = check_new_dir(out_path)
    ckpt = partial_dir(out_path)
    # under torchrun: one process group for the command; every rank trains on its slice of each
    # batch (edgeprune.heal.data_parallel), rank 0 evaluates, writes and reports
    click.get_current_context().with_resource(process_group(config.device))
    main = is_main_process()
    quiet = quiet or not main
    if cache_targets is not None:
        check_writable(cache_targets)
    check_readable_dir(calib_dir, "calibration data")
    check_readable_dir(eval_data, "evaluation data")
    spec = spec_from_record(rec["base_model"])
    n = calib_size if calib_size is not None else default_calib_size(rec, spec)
    recorded_seed = (rec.get("calibration") or {}).get("seed")
    if _default(click.get_current_context(), "seed") and isinstance(recorded_seed, int):
        seed = config.seed = recorded_seed  # the run's own calibration set: its seed too (issue 42)
    if calib_dir is None:  # the run's own folder, when it is still there (issue 42)
        calib_dir = recorded_folder(rec.get("calibration"), spec, say=_say if main else _silent)
    if eval_data is None and not no_eval:  # the run's own --eval-data, when it is still there (issue 52)
        eval_data = recorded_eval_folder(rec.get("calibration"), say=_say if main else _silent)
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

    # 2. the work (3. the report: _report)
    if main:
        procs = f" x {world_size()} processes" if world_size() > 1 else ""
        click.echo(f"heal {run_path} ({rec.get('method')}, {spec.name}) on {config.device}{procs}: "
                   f"calibration {calib.description}")
        if ckpt.is_dir() and (ckpt / "checkpoint.safetensors").is_file():
            click.echo(f"resuming from the checkpoint in {ckpt}")
    try:
        result = heal(pruned, dense, calib, config, progress=not quiet, checkpoint_dir=ckpt,
                      target_cache=cache_targets, inplace=True)
    except KeyboardInterrupt:
        if main and (ckpt / "checkpoint.safetensors").is_file():
            click.echo(f"checkpoint kept in {ckpt}; rerun the same command to resume", err=True)
        raise
    if not main:
        return  # another rank of a torchrun job: rank 0 evaluates, writes and reports
    evaluation = _evaluate(ev, rec, run_path, spec, result.model, dense, quiet, config.device)
    new = healed_record(rec, result, run_path, calibration={"seed": seed, "size_requested": n,
                                                            **calibration_fields(calib_dir, calib)},
                        evaluation=evaluation)
    save_run(out_path, result.model.cpu(), new)
    write_recipe(click.get_current_context(), out_path / "recipe.toml",  # the values used, reused ones included
                 {"out": str(out_path), "seed": seed, "calib": calib_dir, "eval-data": eval_data})
    shutil.rmtree(ckpt, ignore_errors=True)
    _report(result.info, evaluation, spec, loss=loss, lr=lr, epochs=epochs, keep_best=keep_best)
    click.echo(f"saved {out_path}")


def _default(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) in (None, ParameterSource.DEFAULT)


def _say(line: str) -> None:
    click.echo(line, err=line.startswith("warning"))


def _silent(line: str) -> None:
    """Another rank of a torchrun job: rank 0 says it."""


def _evaluate(ev, rec: dict, run_path: Path, spec, healed, dense, quiet: bool, device: str) -> dict | None:
    """The healed run's ``evaluation`` entry (None without evaluation data): the healed model's
    quality and the unhealed one's (taken from the input record when it was measured on the same
    data, else measured), both against the dense model."""
    if ev is None:
        return None
    click.echo(f"evaluation: {ev.description}")
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


def _report(info: dict, evaluation: dict | None, spec, *, loss: str, lr: float, epochs: int, keep_best: bool) -> None:
    """Print the heal's summary: alignment loss before -> after, the kept epoch or a warning when
    healing did not help, and the quality table (with evaluation)."""
    def fmt(v):
        return "n/a" if v is None else f"{v:.5f}"

    click.echo("")
    where = (f"{info['holdout']['num_images']} held-out calibration images" if info["holdout"]["num_images"]
             else "the calibration set")
    click.echo(f"alignment loss ({loss}) on {where}: {fmt(info['initial_loss'])} -> "
               f"{fmt(info['final_loss'])}; {len(info['trained_modules'])} layers trained "
               f"({info['trainable_params']:,} params), {epochs} epochs in {info['wall_time_s']:.1f} s")
    advice = (f"with few steps ({info['steps']} here) AdamW at --lr {lr:g} can overshoot or overfit the "
              "calibration images: try a lower --lr, a larger --calib-size, or --holdout 0.25 to stop early")
    if keep_best and info["best_epoch"] == 0 and info["steps"]:
        click.echo(f"warning: no epoch lowered the alignment loss, so the output keeps the input weights; {advice}",
                   err=True)
    elif keep_best and info["best_epoch"] is not None and info["best_epoch"] < epochs:
        click.echo(f"kept epoch {info['best_epoch']} of {epochs} (lowest alignment loss on {where})")
    elif (info["final_loss"] is not None and info["initial_loss"] is not None
          and info["final_loss"] > info["initial_loss"]):
        click.echo(f"warning: healing increased the alignment loss; {advice}", err=True)
    if evaluation is not None:
        click.echo(f"| {'':8} | quality |")
        click.echo(f"|{'-' * 10}|---------|")
        click.echo(f"| {'pruned':8} | {fmt_metric(evaluation['before_healing'], spec.output_kind)} |")
        click.echo(f"| {'healed':8} | {fmt_metric(evaluation['pruned'], spec.output_kind)} |")
