"""``edgeprune deploy``: from a checkpoint to a deployable model in one command (issue 42).

A thin face over :func:`edgeprune.deploy` (:mod:`edgeprune.deploy`: the stages, their resume record
``OUT/stages.json``, the report): its setting options are generated from the deploy's declared sections
(``edgeprune.deploy.settings``: ``[deploy]``, ``[heal]``) and from the prune's declarations of the settings it hands
on (the budget, ``--tokens-merge``: ``edgeprune.pruning.settings``); the job's own options (model, data, profile,
folder) are the shared ones of ``edgeprune.cli.options``. It writes the stages' recipe files (``OUT/run/recipe.toml``,
``OUT/healed/recipe.toml``, ``OUT/model-<precision>.onnx.recipe.toml``) as the separate commands would with the same
options (:func:`stage_recipe`). A failed verify exits 1.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from edgeprune.cli import generate
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.heal import heal_cmd
from edgeprune.cli.options import (calibration_options, eval_options, folder_option, model_options, profile_options,
                                   quiet_option)
from edgeprune.cli.prune import prune_cmd
from edgeprune.cli.quantize import quantize_cmd
from edgeprune.cli.recipe import replay_rounds, tokens_choice, write_recipe
from edgeprune import VerifyFailed
from edgeprune.deploy import STAGES, deploy
from edgeprune.deploy.settings import DEPLOY_SECTIONS, PRUNE_SETTINGS
from edgeprune.pruning.settings import prune_sections

_COMMANDS = {"prune": prune_cmd, "heal": heal_cmd, "quantize": quantize_cmd}
#: the words of the prune's generated help as deploy shows it (one budget of four, none replaces another)
HELP_WORDS = {"instead": ""}


def command_context(parent: click.Context, cmd: click.Command, given: dict[str, Any]) -> click.Context:
    """The context ``cmd`` would have with ``given`` as its recipe (click's ``default_map``: parsed and checked as
    the command parses them, the other options at their defaults): what its recipe file records."""
    return cmd.make_context(str(cmd.name), [], parent=parent, default_map=given)


def stage_recipe(command: str, given: dict[str, Any], path: Any, values: dict[str, Any],
                 record: dict[str, Any] | None = None) -> None:
    """Write the recipe of deploy's stage ``command`` (prune, heal, quantize) run with ``given``."""
    ctx = command_context(click.get_current_context(), _COMMANDS[command], given)
    notes: dict[str, str] = {}
    replay = None
    if record is not None:  # the prune's: what the measurements decided, for an exact replay (issue 52)
        pinned, notes = tokens_choice(ctx, record)
        values, replay = {**values, **pinned}, replay_rounds(record)
    write_recipe(ctx, path, values, notes, replay)


@click.command("deploy", cls=RecipeCommand, settings_sections=DEPLOY_SECTIONS,
               spelled_by=prune_sections() + DEPLOY_SECTIONS)
@model_options(default="fmnist-vit")
@calibration_options("Calibration images [fmnist-vit 512, dinov2-s14 64, timm 256].")
@eval_options
@generate.handed_on(prune_sections(), PRUNE_SETTINGS, HELP_WORDS, shown_default={"sparsity": None})
@generate.options(DEPLOY_SECTIONS)
@profile_options("Where the prune's torch passes run: cpu, cuda, cuda:N, auto [cpu with a CPU profile, else auto].")
@folder_option("Deploy folder: new, or an earlier deploy's (its unchanged stages are reused).")
@quiet_option
def deploy_cmd(**opts: Any) -> None:
    """Prune, (heal,) export, verify, quantize, build and bench in one command.

    Give one budget (--sparsity, --flops, --params or --latency with --latency-table) and a device
    profile. OUT holds every stage's output, report.md and report.json; a rerun with the same
    settings reuses every finished stage (an interrupted deploy resumes).
    """
    try:
        deploy(opts.pop("out"), echo=click.echo, recipe=stage_recipe, **opts)
    except VerifyFailed:
        sys.exit(1)  # the verify stage printed its report


__all__ = ["HELP_WORDS", "STAGES", "command_context", "deploy_cmd", "stage_recipe"]
