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

The command is a face over :func:`edgeprune.jobs.heal_run.heal_run` (the checks, the work, the report): its
setting options are generated from the declared section ``[heal]`` of ``edgeprune.heal.settings``
(``edgeprune.cli.generate``), the job's own options (run, data, devices, output) are the shared ones of
``edgeprune.cli.options``.
"""


from __future__ import annotations

from typing import Any

import click
from click.core import ParameterSource

from edgeprune.cli import generate
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import (calibration_options, device_option, eval_options, no_eval_option, out_option,
                                   quiet_option)
from edgeprune.cli.recipe import write_recipe
from edgeprune.heal.settings import HEAL_SECTIONS
from edgeprune import heal_run


@click.command("heal", cls=RecipeCommand, settings_sections=HEAL_SECTIONS)
@click.argument("run_dir", type=click.Path())
@calibration_options("Calibration images [the run's own calibration set size].")
@eval_options
@generate.options(HEAL_SECTIONS)
@no_eval_option("Skip the before/after evaluation.")
@device_option(default="auto")
@out_option("RUN_DIR-healed")
@quiet_option
def heal_cmd(**opts: Any) -> None:
    """Heal a pruned run with STARFISH.

    Trains the reduced layers of RUN_DIR so that every block output aligns with the dense
    model's, and saves a new run directory (resumable after an interruption).
    """
    ctx = click.get_current_context()
    seed_given = ctx.get_parameter_source("seed") not in (None, ParameterSource.DEFAULT)  # else: the run's seed
    seed = opts.pop("seed")
    heal_run(opts.pop("run_dir"), opts.pop("out"), seed=seed if seed_given else None, device=opts.pop("device"),
             torch_device=opts.pop("torch_device", None), echo=click.echo,
             write_recipe=lambda path, values: write_recipe(ctx, path, values), **opts)


__all__ = ["heal_cmd"]
