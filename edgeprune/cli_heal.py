"""``edgeprune heal RUN_DIR -o HEALED_DIR``: STARFISH healing of a pruned run (METHODS.md §2).

Loads any pruned run directory (CORP, uncompensated, ...), rebuilds its dense base model from the
record, draws unlabeled calibration images (Fashion-MNIST *train* images for ``fmnist-vit``, the
scikit-image photos for ``dinov2-s14``, an ImageFolder directory for timm models -- never the
evaluation images), trains the reduced layers to align every block output with the dense model's
(:func:`edgeprune.heal.heal`) and saves a normal run directory whose record is the input record
plus a ``healing`` entry. A checkpoint is written to ``HEALED_DIR.partial/`` after every epoch;
rerunning the same command after an interruption resumes from the last completed epoch.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import click

from edgeprune.errors import UserError

DEFAULT_CALIB_SIZE = {"fmnist-vit": 1024, "dinov2-s14": 64}
"""Calibration images per model (timm models: :data:`DEFAULT_CALIB_SIZE_TIMM`)."""
DEFAULT_CALIB_SIZE_TIMM = 1000  # starfish App. B: 1,000 images for DeiT-T


def partial_dir(out: str | Path) -> Path:
    """The checkpoint directory of an output run directory: ``<out>.partial``."""
    p = Path(out)
    return p.with_name(p.name + ".partial")


@click.command("heal")
@click.argument("run_dir", type=click.Path())
@click.option("--calib", "calib_dir", type=click.Path(), default=None,
              help="Calibration data: Fashion-MNIST dir (fmnist-vit; train images are used) or an "
                   "ImageFolder dir (timm models). dinov2-s14 uses its bundled photos.")
@click.option("--calib-size", type=int, default=None,
              help=f"Calibration images [fmnist-vit {DEFAULT_CALIB_SIZE['fmnist-vit']}, dinov2-s14 "
                   f"{DEFAULT_CALIB_SIZE['dinov2-s14']}, timm {DEFAULT_CALIB_SIZE_TIMM}].")
@click.option("--eval-data", type=click.Path(), default=None,
              help="Evaluation data (ImageFolder; fmnist: its dir); also checked to be disjoint from --calib.")
@click.option("--eval-size", type=int, default=None, help="Evaluate on at most this many images.")
@click.option("--epochs", type=int, default=10, show_default=True, help="Passes over the calibration set (paper: 5-10).")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--lr", type=float, default=1e-4, show_default=True,
              help="AdamW learning rate (cosine schedule start). The paper's 6e-4 suits uncompensated "
                   "models with hundreds of steps; 1e-4 keeps CORP's compensation (README).")
@click.option("--min-lr", type=float, default=1e-6, show_default=True, help="Cosine schedule end.")
@click.option("--warmup-steps", type=int, default=None,
              help="Linear learning-rate warm-up steps before the cosine decay (not in the paper; "
                   "0 = the paper's schedule) [10% of the steps, at least 5, at most half].")
@click.option("--weight-decay", type=float, default=0.01, show_default=True, help="AdamW weight decay.")
@click.option("--loss", type=click.Choice(["cosine", "mse"]), default="cosine", show_default=True,
              help="Block-output alignment: cosine (STARFISH eq. 1) or mse (ablation).")
@click.option("--seed", type=int, default=0, show_default=True, help="Calibration sampling and training seed.")
@click.option("--cache-targets", type=click.Path(), default=None,
              help="Cache the dense block outputs in this directory (safetensors shards; reusable "
                   "across runs of the same dense model and calibration set). Default: recompute per batch.")
@click.option("--memory-budget-mb", type=float, default=1024, show_default=True,
              help="Most memory held for cached targets; beyond it shards are streamed from disk.")
@click.option("--keep-best/--keep-last", default=True, show_default=True,
              help="Return the epoch with the lowest alignment loss on the calibration set (the input "
                   "included), or the last epoch (the paper).")
@click.option("--holdout", type=float, default=0.0, show_default=True,
              help="Fraction of the calibration images held out of training; the kept epoch is the one "
                   "with the lowest alignment loss on them (early stopping).")
@click.option("--no-eval", is_flag=True, help="Skip the before/after evaluation.")
@click.option("-o", "--out", type=click.Path(), default=None, help="New run directory [RUN_DIR-healed].")
@click.option("--quiet", is_flag=True, help="No progress bars.")
def heal_cmd(run_dir, calib_dir, calib_size, eval_data, eval_size, epochs, batch_size, lr, min_lr,
             warmup_steps, weight_decay, loss, seed, cache_targets, memory_budget_mb, keep_best, holdout, no_eval, out, quiet):
    """Heal a pruned run with STARFISH (block-output alignment to the dense model)."""
    import torch

    from edgeprune.artifact import check_new_dir, load_run, read_record, save_run
    from edgeprune.evaluate import evaluate
    from edgeprune.heal import heal
    from edgeprune.heal.trainer import reduced_modules, reduced_modules_from_record
    from edgeprune.zoo.registry import spec_from_record

    if epochs < 1:
        raise UserError(f"--epochs must be >= 1, got {epochs}")
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    if calib_size is not None and calib_size < 1:
        raise UserError(f"--calib-size must be >= 1, got {calib_size}")
    if memory_budget_mb <= 0:
        raise UserError(f"--memory-budget-mb must be > 0, got {memory_budget_mb:g}")
    run_path = Path(run_dir)
    out_path = Path(out) if out else run_path.with_name(run_path.name + "-healed")
    rec = read_record(run_path)  # UserError: not a run directory
    base = rec.get("base_model")
    if not isinstance(base, dict) or "name" not in base:
        raise UserError(f"{run_path}: run record has no valid base_model entry")
    if base.get("random_init"):
        raise UserError(f"{run_path}: the base model {base['name']} has random weights (--random-init); "
                        "healing needs the dense model's real weights")
    if "dense_blocks" in rec and not reduced_modules_from_record(rec):
        raise UserError(f"{run_path}: nothing to heal: the run has the dense model's shapes everywhere (sparsity 0)")
    out_path = check_new_dir(out_path)
    ckpt = partial_dir(out_path)

    spec = spec_from_record(base)
    pruned, rec = load_run(run_path)
    dense = spec.create(pretrained=True)
    if not reduced_modules(pruned, dense):
        raise UserError(f"{run_path}: nothing to heal: the run has the dense model's shapes everywhere (sparsity 0)")
    n = calib_size if calib_size is not None else DEFAULT_CALIB_SIZE.get(spec.name, DEFAULT_CALIB_SIZE_TIMM)
    calib = spec.calibration_source(n, seed=seed, data=calib_dir, eval_data=eval_data)
    if len(calib) == 0:
        raise UserError("the calibration set is empty")
    click.echo(f"heal {run_path} ({rec.get('method')}, {spec.name}): calibration {calib.description}")
    if ckpt.is_dir() and (ckpt / "checkpoint.safetensors").is_file():
        click.echo(f"resuming from the checkpoint in {ckpt}")
    try:
        result = heal(pruned, dense, calib, epochs=epochs, batch_size=batch_size, lr=lr, min_lr=min_lr,
                      weight_decay=weight_decay, loss=loss, seed=seed, progress=not quiet,
                      checkpoint_dir=ckpt, target_cache=cache_targets, memory_budget_mb=memory_budget_mb,
                      inplace=True, keep_best=keep_best, warmup_steps=warmup_steps, holdout=holdout)
    except KeyboardInterrupt:
        if (ckpt / "checkpoint.safetensors").is_file():
            click.echo(f"\ncheckpoint kept in {ckpt}; rerun the same command to resume", err=True)
        raise
    info = result.info

    healed_m = before_m = None
    new = copy.deepcopy(rec)
    if not no_eval:
        ev = spec.eval_source(eval_data or (calib_dir if spec.name == "fmnist-vit" else None), n=eval_size)
        click.echo(f"evaluation: {ev.description}")
        old = rec.get("evaluation") or {}
        with torch.no_grad():
            if old.get("data") == ev.description and old.get("pruned"):
                before_m = old["pruned"]
            else:
                unhealed, _ = load_run(run_path)
                before_m = evaluate(spec, unhealed, ev, dense=dense, progress=not quiet)
            healed_m = evaluate(spec, result.model, ev, dense=dense, progress=not quiet)
        new["evaluation"] = {"data": ev.description, "dense": old.get("dense") if old.get("data") == ev.description else None,
                             "pruned": healed_m, "before_healing": before_m}
    else:
        new.pop("evaluation", None)
    new["healing"] = {
        "method": "starfish",
        "input_run": str(run_path),
        "input_method": rec.get("method"),
        **{k: v for k, v in info.items() if k != "trained_parameters"},
        "calibration": {**info["calibration"], "seed": seed, "size_requested": n},
        "history": result.history,
        "evaluation_before_healing": rec.get("evaluation"),
    }
    save_run(out_path, result.model, new)
    shutil.rmtree(ckpt, ignore_errors=True)

    from edgeprune.cli import _fmt_metric

    click.echo("")
    def fmt(v):
        return "n/a" if v is None else f"{v:.5f}"

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
    elif info["final_loss"] is not None and info["initial_loss"] is not None and info["final_loss"] > info["initial_loss"]:
        click.echo(f"warning: healing increased the alignment loss; {advice}", err=True)
    if not no_eval:
        click.echo(f"| {'':8} | quality |")
        click.echo(f"|{'-' * 10}|---------|")
        click.echo(f"| {'pruned':8} | {_fmt_metric(before_m, spec.output_kind)} |")
        click.echo(f"| {'healed':8} | {_fmt_metric(healed_m, spec.output_kind)} |")
    click.echo(f"saved {out_path}")
