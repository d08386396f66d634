"""``edgeprune derive``: NuWa class-specific derivation under a FLOPs / params / latency budget.

    edgeprune derive --model fmnist-vit --classes 0,3,7 --flops 0.6 -o runs/nuwa-037
    edgeprune derive --model fmnist-vit --classes 0,3,7 --latency 0.5 --latency-table t.json

``--latency`` (a fraction of the dense latency on ``--latency-table``, or ``12ms``) is parsed and
refused exactly as ``edgeprune prune`` does (docs/latency_budget.md, "derive --latency"); where the
table's backend runs here the derived model is measured and the dims re-planned until it lands within
``--latency-tolerance`` (``--latency-rounds``, ``--no-verify-latency``: as prune; ``edgeprune.nuwa.measured``).

Labeled images of the target classes come from the train split (fmnist-vit) or ``--train-data``
(an ImageFolder, timm models); the final evaluation uses the test split / ``--eval-data``, with the
argmax taken over the target classes. See ``edgeprune.nuwa``.

``--torch-device`` (default ``auto``: cuda when available, else cpu; cpu with ``--device cpu``, a
CPU deployment profile) runs SKP, the calibration pass and
the evaluations; the SVD and the least-squares re-fits run in float64 on the CPU, and the derived
model is saved from the CPU. The device is printed and recorded (``device``, ``config.device``).

The command is a face over :func:`edgeprune.jobs.derive_run.derive_run` (the checks, the work, the report): its
setting options are generated from the declared sections of ``edgeprune.nuwa.settings`` (``edgeprune.cli.generate``),
the job's own options (model, classes, data, devices, output) are the shared ones of ``edgeprune.cli.options``.
"""

from __future__ import annotations

from typing import Any

import click

from edgeprune.cli import generate
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import (device_option, labeled_data_options, model_options, out_option, quiet_option,
                                   threads_option)
from edgeprune.cli.recipe import replay_measurer, replay_rounds, write_recipe
from edgeprune import derive_run
from edgeprune.nuwa.settings import DERIVE_SECTIONS

#: the words of the generated help (the correction's verbs, ``edgeprune.budget.correction``; the budget's)
HELP_WORDS = {"redo": "re-plan", "made": "derived", "reference": "base", "instead": ""}


@click.command("derive", cls=RecipeCommand, settings_sections=DERIVE_SECTIONS)
@model_options(default="fmnist-vit", help="fmnist-vit or a timm ViT/DeiT classifier name (with --checkpoint).")
@generate.options(DERIVE_SECTIONS, HELP_WORDS)
@labeled_data_options
@threads_option("torch CPU threads [torch's default].")
@device_option(default="auto")
@out_option("runs/<model>-nuwa-<classes>-<budget>")
@quiet_option
def derive_cmd(**opts: Any) -> None:
    """Derive a class-specific model with NuWa.

    SKP masks, SVD attention truncation and least-squares MLP pruning, under a FLOPs, params or
    latency budget (--flops / --params / --latency with --latency-table).
    """
    ctx = click.get_current_context()

    def recipe(path: Any, values: dict[str, Any], rec: dict[str, Any]) -> None:
        write_recipe(ctx, path, values, replay=replay_rounds(rec))  # issue 52: what the run measured, for a replay

    derive_run(opts.pop("out"), device=opts.pop("device"), torch_device=opts.pop("torch_device", None),
               echo=click.echo, replay=lambda: replay_measurer(ctx), write_recipe=recipe, **opts)


__all__ = ["HELP_WORDS", "derive_cmd"]
