"""``edgeprune latency-table``: time a model's block structures on a device profile (issue 30).

Writes a :class:`~edgeprune.latency.table.LatencyTable` JSON (docs/latency.md). Every input is
checked before any timing: the profile, batch / threads, the backend being present here (a
TensorRT profile off its device: one line naming the command to run there), the output folder,
an existing output of another key (``--force`` replaces it; the same key resumes it).

The command is a face over :func:`edgeprune.jobs.latency_table_run.latency_table_run` (the checks, the build, the
report): its setting options are generated from the declared section ``[timing]`` of ``edgeprune.latency.settings``
(``edgeprune.cli.generate``), the job's own options (model, profile, table, ``--force``, ``--quiet``) are the shared
ones of ``edgeprune.cli.options``.
"""

from __future__ import annotations

from typing import Any

import click

from edgeprune.cli import generate
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import file_out_option, force_option, model_options, profile_option, quiet_option
from edgeprune.cli.recipe import output_recipe_path, write_recipe
from edgeprune import latency_table_run
from edgeprune.latency.settings import LATENCY_TABLE_SECTIONS


@click.command("latency-table", cls=RecipeCommand, settings_sections=LATENCY_TABLE_SECTIONS)
@model_options()
@profile_option("Device profile (shipped name or .toml path): backend, batch, precision, threads, pruning rules.",
                default="cpu")
@generate.options(LATENCY_TABLE_SECTIONS)
@file_out_option("out", "TABLE.json", "The table to write.")
@force_option("Replace an existing table of another key (the same key resumes); keep a table whose self-check misses "
              "(marked unverified), and one whose block chains still disagree after 3 timings (left out), instead of "
              "failing.")
@quiet_option
def latency_table_cmd(out: str, **opts: Any) -> None:
    """Time one block of the model's shape for each kept structure on a grid (MLP widths, kept
    heads, Q/K and V head dims) on the profile's backend, plus the dense model whole; write the
    latency table for `prune --latency`.

    \b
    The output is saved after every entry: rerunning the same command resumes an interrupted build.
    Then a few pruned-shape models (x0.7, x0.5, x0.3 of the dense one) are predicted and timed whole: when a
    prediction misses by more than 5% the command fails (exit 1) naming the part that is off, and the table
    is left incomplete, unless --force keeps it (marked unverified).
    """
    ctx = click.get_current_context()
    latency_table_run(out, echo=click.echo, write_recipe=lambda table: write_recipe(ctx, output_recipe_path(table)),
                      **opts)


__all__ = ["latency_table_cmd"]
