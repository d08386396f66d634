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


import click
from click.core import ParameterSource

from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import (FINITE, calibration_options, device_option, eval_options,
                                   out_option, quiet_option, torch_device_of)
from edgeprune.cli.recipe import write_recipe
from edgeprune.jobs.heal_run import heal_run


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
    seed_given = not _default(click.get_current_context(), "seed")
    ctx = click.get_current_context()
    heal_run(run_dir, out, calib_dir=calib_dir, calib_size=calib_size, seed=seed if seed_given else None,
             batch_size=batch_size, eval_data=eval_data, eval_size=eval_size, epochs=epochs, lr=lr, min_lr=min_lr,
             warmup_steps=warmup_steps, weight_decay=weight_decay, loss=loss, cache_targets=cache_targets,
             memory_budget_mb=memory_budget_mb, keep_best=keep_best, holdout=holdout, no_eval=no_eval,
             torch_device=torch_device_of(device, torch_device, default="auto"), quiet=quiet, echo=click.echo,
             write_recipe=lambda path, values: write_recipe(ctx, path, values))


def _default(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) in (None, ParameterSource.DEFAULT)
