"""``edgeprune latency-table``: time a model's block structures on a device profile (issue 30).

Writes a :class:`~edgeprune.latency.table.LatencyTable` JSON (docs/latency.md). Every input is
checked before any timing: the profile, batch / threads, the backend being present here (a
TensorRT profile off its device: one line naming the command to run there), the output folder,
an existing output of another key (``--force`` replaces it; the same key resumes it).

The command is a face over :func:`edgeprune.jobs.latency_table_run.latency_table_run` (the checks, the build, the
report).
"""

from __future__ import annotations

from typing import Any

import click

from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import FiniteFloat, model_options, quiet_option
from edgeprune.cli.recipe import output_recipe_path, write_recipe
from edgeprune.jobs.latency_table_run import latency_table_run
from edgeprune.latency.build import PRECISIONS
from edgeprune.latency.measure import list_timers


@click.command("latency-table", cls=RecipeCommand)
@model_options()
@click.option("--device", "device", default="cpu", show_default=True, metavar="PROFILE",
              help="Device profile (shipped name or .toml path): backend, batch, precision, threads, pruning rules.")
@click.option("--batch", type=int, default=None, metavar="N",
              help="Images per timed batch [the profile's largest bench batch size <= 8].")
@click.option("--threads", type=int, default=None, metavar="N", help="Intra-op threads (CPU) [the profile's].")
@click.option("--precision", default=None, type=click.Choice(list(PRECISIONS)),
              help="Backend precision [the profile's].")
@click.option("--backend", default=None, type=click.Choice(list_timers()), help="Timing backend [the profile's].")
@click.option("--warmup", type=int, default=None, metavar="N", help="Untimed runs per entry [the profile's].")
@click.option("--iterations", type=int, default=None, metavar="N",
              help="Timed runs per entry, p50 reported [the profile's].")
@click.option("--max-seconds", type=FiniteFloat(min=0.01), default=1.0, show_default=True, metavar="S",
              help="Stop an entry's timed runs after S seconds (at least 5 runs): bounds the build time.")
@click.option("--statistic", type=click.Choice(["p50", "min"]), default="p50", show_default=True,
              help="What an entry reports of its timed runs (min: steadier on a machine shared with other work).")
@click.option("--interleave/--no-interleave", default=True, show_default=True,
              help="Time each entry side by side with the dense sub-block and keep the ratios: steady "
                   "on a machine whose load drifts (about 2x the time of --no-interleave).")
@click.option("--repeats", type=int, default=None, metavar="N",
              help="Spread check: cut an entry's timed runs into N groups (1: no check) [3].")
@click.option("--spread", type=FiniteFloat(), default=None, metavar="F",
              help="Spread check: time an entry again when its groups disagree by more than F [0.05: 5%%].")
@click.option("--retries", type=int, default=None, metavar="N",
              help="Spread check: at most N more attempts for an entry whose groups disagree, 0-10 [2].")
@click.option("--clock", type=click.Choice(["auto", "wall", "cpu"]), default="auto", show_default=True,
              help="cpu: this thread's CPU time per run (--threads 1 on a CPU profile): steady on a machine "
                   "shared with other jobs; wall: elapsed time; auto: cpu where it applies, else wall.")
@click.option("--tokens", "tokens", default=None, metavar="N1,N2,...",
              help="A token axis (for prune --latency with --tokens-merge): also time the dense MLP and attention "
                   "sub-blocks at these token counts (each above the prefix tokens, at most the model's) [none].")
@click.option("-o", "--out", type=click.Path(), required=True, metavar="TABLE.json", help="The table to write.")
@click.option("--force", is_flag=True,
              help="Replace an existing table of another key (the same key resumes); keep a table whose self-check "
                   "misses (marked unverified), and one whose block chains still disagree after 3 timings (left out), "
                   "instead of failing.")
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
