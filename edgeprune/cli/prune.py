"""``edgeprune prune``: CORP one-shot structured pruning of a model into a new run directory.

The command is a face over :func:`edgeprune.jobs.prune_run.prune_run`: its setting options are generated from
the declared sections of ``edgeprune.pruning.settings`` (``edgeprune.cli.generate``), the job's own options
(model, data, devices, output) are the shared ones of ``edgeprune.cli.options``.
"""

from __future__ import annotations

from typing import Any, Sequence

import click

from edgeprune.cli import generate
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import (calibration_options, device_option, eval_options, model_options, no_eval_option,
                                   out_option, quiet_option)
from edgeprune.cli.recipe import replay_measurer, replay_rounds, tokens_choice, write_recipe
from edgeprune import is_main_process, prune_run
from edgeprune.pruning.settings import PruneSettings, prune_sections
from edgeprune.settings import Section

#: the words of the generated help (the correction's verbs, ``edgeprune.budget.correction``; the budget's)
HELP_WORDS = {"redo": "re-allocate", "made": "pruned", "reference": "dense", "instead": " instead of --sparsity"}


def make_prune_command(sections: Sequence[type[Section]] | None = None) -> click.Command:
    """The ``prune`` command with one option per command-line setting of ``sections`` (default: the registered
    prune sections, ``edgeprune.pruning.settings.PRUNE_SECTIONS``)."""
    sections = tuple(sections or prune_sections())
    names = generate.setting_names(sections)

    @click.command("prune", cls=RecipeCommand, settings_sections=sections)
    @model_options(default="fmnist-vit")
    @generate.options(sections, HELP_WORDS)
    @calibration_options("Calibration images [fmnist-vit 512, dinov2-s14 64, timm 256].")
    @eval_options
    @no_eval_option("Skip the dense/pruned evaluation.")
    @device_option(default="auto")
    @out_option("runs/<model>-<target>-<sparsity>")
    @quiet_option
    def prune_cmd(**opts: Any) -> None:
        """Prune a model with CORP into a new run directory.

        Evaluates the dense and the pruned model on held-out data (unless --no-eval) and prints
        params, FLOPs and quality of both.
        """
        ctx = click.get_current_context()
        settings = PruneSettings.from_keywords(**{k: opts.pop(k) for k in names})
        replay = replay_measurer(ctx, click.echo if is_main_process() else (lambda _line: None))

        def recipe(path: Any, values: dict[str, Any], rec: dict[str, Any]) -> None:
            pinned, notes = tokens_choice(ctx, rec)  # issue 52: what the measurements decided, for an exact replay
            write_recipe(ctx, path, {**values, **pinned}, notes, replay_rounds(rec))

        prune_run(opts.pop("out"), settings, model_name=opts.pop("model_name"), replay=replay, write_recipe=recipe,
                  echo=click.echo, **opts)

    return prune_cmd


prune_cmd = make_prune_command()

__all__ = ["HELP_WORDS", "make_prune_command", "prune_cmd"]
