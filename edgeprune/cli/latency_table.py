"""``edgeprune latency-table``: time a model's block structures on a device profile (issue 30).

Writes a :class:`~edgeprune.latency.table.LatencyTable` JSON (docs/latency.md). Every input is
checked before any timing: the profile, batch / threads, the backend being present here (a
TensorRT profile off its device: one line naming the command to run there), the output folder,
an existing output of another key (``--force`` replaces it; the same key resumes it).
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from devices import load_profile
from edgeprune.anatomy import find_anatomy
from edgeprune.artifact import check_writable
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import FiniteFloat, load_model, model_options, quiet_option
from edgeprune.cli.recipe import output_recipe_path, write_recipe
from edgeprune.errors import UserError
from edgeprune.zoo.registry import MissingWeightsError
from edgeprune.latency.grid import parse_token_counts
from edgeprune.latency.build import PRECISIONS, WHOLE, BuildOptions, build_table, settings_for
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
def latency_table_cmd(model_name, checkpoint, random_init, num_classes, img_size, model_kwargs, device, batch,
                      threads, precision, backend, warmup, iterations, max_seconds, statistic, interleave, repeats,
                      spread, retries, clock, tokens, out, force, quiet) -> None:
    """Time one block of the model's shape for each kept structure on a grid (MLP widths, kept
    heads, Q/K and V head dims) on the profile's backend, plus the dense model whole; write the
    latency table for `prune --latency`.

    \b
    The output is saved after every entry: rerunning the same command resumes an interrupted build.
    Then a few pruned-shape models (x0.7, x0.5, x0.3 of the dense one) are predicted and timed whole: when a
    prediction misses by more than 5% the command fails (exit 1) naming the part that is off, and the table
    is left incomplete, unless --force keeps it (marked unverified).
    """
    if model_name is None:
        raise UserError("--model is required (the dense model whose blocks are timed)")
    if repeats == 1 and (spread is not None or retries is not None):
        given = "--spread" if spread is not None else "--retries"
        raise UserError(f"{given} goes with the spread check, which --repeats 1 turns off (drop one of them)")
    check = {k: v for k, v in (("repeats", repeats), ("spread", spread), ("retries", retries)) if v is not None}
    counts = parse_token_counts(tokens)  # non-integers: one line; the model's limits: build_table, before timing
    profile = load_profile(device)
    opts = BuildOptions(**check, batch=batch, threads=threads, precision=precision, backend=backend, warmup=warmup,
                        iterations=iterations, max_seconds=max_seconds, statistic=statistic,
                        interleave=interleave, clock=clock, force=force,
                        grid={"tokens": counts} if counts else {})
    settings_for(profile, opts, model_name)  # bad batch / threads / backend, or the backend absent: before any work
    out_path = Path(out)
    if out_path.is_dir():
        raise UserError(f"-o {out} is a folder; give the table's file name (e.g. {out_path / 'table.json'})")
    check_writable(out_path.parent)
    try:
        model, _rec, _spec = load_model(None, model_name, checkpoint, random_init, num_classes, img_size, model_kwargs)
    except MissingWeightsError:  # issue 41: not "--checkpoint": the timings do not depend on the weights
        raise UserError(f"{model_name} has no weights here; a latency table times the model's shapes, not its "
                        "weights: add --random-init (or --checkpoint PATH)") from None
    anatomy = find_anatomy(model.eval())
    t0 = time.perf_counter()
    table = build_table(anatomy, profile, opts, out_path, show_progress=not quiet)
    write_recipe(click.get_current_context(), output_recipe_path(out_path))
    k = table.key
    n = (len(table.measured["mlp"]) + len(table.measured["attn"]) + sum(bool(table.measured.get(w)) for w in WHOLE)
         + sum(len(table.measured.get(w, [])) for w in ("tokens_mlp", "tokens_attn")))
    click.echo(f"{out}: {n} entries on {k['device_name']} ({k['backend']} {k['backend_version']}, "
               f"batch {k['batch']}, {k['precision']}, threads {k['threads'] or 'default'}) in "
               f"{time.perf_counter() - t0:.0f} s; dense model {table.dense_model_ms:.2f} ms, "
               f"blocks {k['depth']} x ({table.block_scale:.3f} x {table.block_ms(table.dense_dims()):.2f} + "
               f"{table.block_overhead_ms:.2f}) ms, outside the blocks {table.fixed_ms:.2f} ms")
    chk = table.meta.get("self_check") or {}
    click.echo("self-check (predicted / measured whole): " + ", ".join(
        f"{m['name']} {m['predicted_ms']:.2f}/{m['measured_ms']:.2f} ms ({100 * m['error']:+.1f}%)"
        for m in chk.get("models", [])))
    if table.unverified:
        click.echo(f"warning: the self-check missed ({table.unverified}); kept unverified (--force): "
                   "prune --latency will say its prediction is unverified", err=True)
