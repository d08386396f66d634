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

The command is a face over :func:`edgeprune.jobs.derive_run.derive_run` (the checks, the work, the report).
"""

from __future__ import annotations

from typing import Any

import click

from edgeprune.budget.correction import Correction
from edgeprune.budget.settings import BudgetSection
from edgeprune.cli import generate
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import (FINITE, device_option, eval_options, latency_table_option,
                                   model_options, out_option, quiet_option, torch_device_of)
from edgeprune.cli.recipe import replay_measurer, replay_rounds, write_recipe
from edgeprune.jobs.derive_run import derive_run


#: the verbs of the correction options' help (``edgeprune.budget.correction``)
CORRECTION_WORDS = {"redo": "re-plan", "made": "derived", "reference": "base"}


@click.command("derive", cls=RecipeCommand, settings_sections=(Correction,),
                spelled_by=(Correction, BudgetSection))
@model_options(default="fmnist-vit", help="fmnist-vit or a timm ViT/DeiT classifier name (with --checkpoint).")
@click.option("--classes", required=True,
              help="Target classes: indices or names, comma-separated (e.g. 0,3,7 or 'T-shirt/top,Bag').")
@click.option("--flops", default=None, metavar="F",
              help="FLOPs budget: a fraction of the base model to keep (0.6) or a count (2.3G), as for prune.")
@click.option("--params", default=None, metavar="P",
              help="Parameter budget: a fraction of the base model to keep (0.7) or a count (20M).")
@click.option("--latency", default=None, metavar="F",
              help="Latency budget: a fraction of the dense model's latency on the --latency-table (0.5) or "
                   "milliseconds per batch of the table's batch size (12ms); head dims and MLP widths on the "
                   "table's grid, every head kept.")
@latency_table_option
@generate.options((Correction,), CORRECTION_WORDS)
@click.option("--slice-head", is_flag=True,
              help="Slice the head to the target classes (default: suppress the others with a -100 bias).")
@click.option("--data", type=click.Path(), default=None, metavar="DIR", help="Fashion-MNIST directory (fmnist-vit).")
@click.option("--train-data", type=click.Path(), default=None, metavar="DIR",
              help="Labeled training images, ImageFolder (timm models).")
@click.option("--train-per-class", type=int, default=None,
              help="At most this many labeled images per class [fmnist-vit: all; folders: 300].")
@click.option("--calib", "calib_dir", type=click.Path(), default=None, metavar="DIR",
              help="Unlabeled calibration images (ImageFolder dir) [target-class training images].")
@click.option("--calib-size", type=int, default=128, show_default=True, help="Calibration images for OFP-MLP.")
@click.option("--val-size", type=int, default=300, show_default=True,
              help="Held-out target-class training images scoring SKP checkpoints and rho.")
@click.option("--skp-steps", type=int, default=400, show_default=True,
              help="SKP optimiser steps (0 = no SKP; the paper uses 10000).")
@click.option("--skp-batch-size", type=int, default=1, show_default=True, help="Images per SKP step.")
@click.option("--skp-eval-every", type=int, default=50, show_default=True, help="Evaluate SKP masks every N steps.")
@click.option("--lr-beta", type=FINITE, default=0.1, show_default=True, help="SKP learning rate of the mask scales.")
@click.option("--lr-mask", type=FINITE, default=1e-3, show_default=True, help="SKP learning rate of the mask logits.")
@click.option("--weight-decay", type=FINITE, default=0.05, show_default=True, help="SKP weight decay.")
@click.option("--rho", type=FINITE, default=None, help="Fix the retained singular-value energy ratio [search].")
@click.option("--key-bias", type=click.Choice(["drop", "augment"]), default="drop", show_default=True,
              help="Leave the softmax-invariant key bias out of the QK SVD, or augment with it.")
@click.option("--ridge-alpha", type=FINITE, default=1e-4, show_default=True,
              help="Ridge of the fc2 least-squares re-fit.")
@eval_options
@click.option("--no-eval", is_flag=True, help="Skip the final evaluation.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the on-disk SVD cache.")
@click.option("--seed", type=int, default=0, show_default=True, help="Data split, sampling and SKP seed.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads [torch's default].")
@device_option(default="auto")
@out_option("runs/<model>-nuwa-<classes>-<budget>")
@quiet_option
def derive_cmd(**opts: Any) -> None:
    """Derive a class-specific model with NuWa.

    SKP masks, SVD attention truncation and least-squares MLP pruning, under a FLOPs, params or
    latency budget (--flops / --params / --latency with --latency-table).
    """
    ctx = click.get_current_context()
    # --device is the deployment profile; resolved before the options' own check, as it always was
    torch_device = torch_device_of(opts.pop("device"), opts.pop("torch_device", None), default="auto")

    def recipe(path: Any, values: dict[str, Any], rec: dict[str, Any]) -> None:
        write_recipe(ctx, path, values, replay=replay_rounds(rec))  # issue 52: what the run measured, for a replay

    derive_run(opts.pop("out"), torch_device=torch_device, echo=click.echo, replay=lambda: replay_measurer(ctx),
               write_recipe=recipe, **opts)


__all__ = ["CORRECTION_WORDS", "derive_cmd"]
