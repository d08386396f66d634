"""``edgeprune deploy``: from a checkpoint to a deployable model in one command (issue 42).

A thin face over :func:`edgeprune.deploy` (:mod:`edgeprune.deploy`: the stages, their resume record
``OUT/stages.json``, the report): it parses the options, passes them on, and writes the stages' recipe
files (``OUT/run/recipe.toml``, ``OUT/healed/recipe.toml``, ``OUT/model-<precision>.onnx.recipe.toml``) as
the separate commands would with the same options (:func:`stage_recipe`). A failed verify exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.heal import heal_cmd
from edgeprune.cli.options import (FINITE, calibration_options, eval_options, latency_table_option, model_options,
                                   quiet_option)
from edgeprune.cli.prune import prune_cmd
from edgeprune.cli.quantize import quantize_cmd
from edgeprune.cli.recipe import replay_rounds, tokens_choice, write_recipe
from edgeprune.deploy.pipeline import deploy
from edgeprune.deploy.state import STAGES
from edgeprune.jobs.verify import VerifyFailed
from edgeprune.pruning.settings import prune_sections

_COMMANDS = {"prune": prune_cmd, "heal": heal_cmd, "quantize": quantize_cmd}


def command_context(parent: click.Context, cmd: click.Command, given: dict[str, Any]) -> click.Context:
    """The context ``cmd`` would have with ``given`` typed on its command line (the other options at their
    defaults, click's parameter sources saying which is which): what its recipe file records."""
    sub = click.Context(cmd, info_name=cmd.name, parent=parent)
    for p in cmd.params:
        if not p.expose_value:
            continue
        name = str(p.name)
        if name in given:
            sub.params[name] = given[name]
            sub.set_parameter_source(name, ParameterSource.COMMANDLINE)
        else:
            d = p.get_default(sub)
            sub.params[name] = p.type_cast_value(sub, None if type(d).__name__ == "Sentinel" else d)
            sub.set_parameter_source(name, ParameterSource.DEFAULT)
    return sub


def stage_recipe(command: str, given: dict[str, Any], path: Path, values: dict[str, Any],
                 record: dict[str, Any] | None = None) -> None:
    """Write the recipe of deploy's stage ``command`` (prune, heal, quantize) run with ``given``."""
    ctx = command_context(click.get_current_context(), _COMMANDS[command], given)
    notes: dict[str, str] = {}
    replay = None
    if record is not None:  # the prune's: what the measurements decided, for an exact replay (issue 52)
        pinned, notes = tokens_choice(ctx, record)
        values, replay = {**values, **pinned}, replay_rounds(record)
    write_recipe(ctx, path, values, notes, replay)


@click.command("deploy", cls=RecipeCommand, spelled_by=prune_sections())
@model_options(default="fmnist-vit")
@calibration_options("Calibration images [fmnist-vit 512, dinov2-s14 64, timm 256].")
@eval_options
@click.option("--sparsity", type=FINITE, default=None, metavar="S",
              help="Budget: fraction of each MLP and Q/K module's dims removed, in [0, 1).")
@click.option("--flops", default=None, metavar="F", help="Budget: FLOPs, a fraction (0.5) or a count (2.3G).")
@click.option("--params", default=None, metavar="P", help="Budget: parameters, a fraction (0.5) or a count (20M).")
@click.option("--latency", default=None, metavar="F",
              help="Budget: latency on --latency-table, a fraction of the dense model's (0.5) or ms (12ms).")
@latency_table_option
@click.option("--tokens-merge", "tokens_merge", default=None, metavar="R",
              help="Token merging in the pruned model (prune's --tokens-merge: R per block, r0,r1,... or "
                   "decreasing:R, or auto with --latency; docs/tokens.md) [off].")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8"]), default=None,
              help="Deployed precision (int8: TensorRT recipe on a TensorRT profile, dynamic on ONNX Runtime) "
                   "[the profile's: build.precision or onnxruntime.precision].")
@click.option("--device", "profile_name", required=True, metavar="PROFILE",
              help="Deployment profile: cpu, rtx3090, orin-nx or a .toml file (`edgeprune devices`).")
@click.option("--torch-device", "torch_device", default=None, metavar="DEVICE",
              help="Where the prune's torch passes run: cpu, cuda, cuda:N, auto [cpu with a CPU profile, else auto].")
@click.option("--heal/--no-heal", "heal", default=False,
              help="Heal the pruned run with STARFISH (`edgeprune heal`) before the export.")
@click.option("--heal-epochs", type=click.IntRange(min=1), default=None, metavar="N",
              help="Heal: passes over the calibration set [heal's: 10].")
@click.option("--heal-lr", type=FINITE, default=None, metavar="LR",
              help="Heal: AdamW learning rate, > 0 [heal's: 1e-4].")
@click.option("--bench/--no-bench", "bench", default=True, help="Bench the deployed model vs the dense one.")
@click.option("--bench-iterations", type=click.IntRange(min=1), default=None, metavar="N",
              help="Timed runs per batch size in the bench stage [the profile's].")
@click.option("-o", "--out", required=True, type=click.Path(path_type=Path), metavar="DIR",
              help="Deploy folder: new, or an earlier deploy's (its unchanged stages are reused).")
@quiet_option
def deploy_cmd(**opts: Any) -> None:
    """Prune, (heal,) export, verify, quantize, build and bench in one command.

    Give one budget (--sparsity, --flops, --params or --latency with --latency-table) and a device
    profile. OUT holds every stage's output, report.md and report.json; a rerun with the same
    settings reuses every finished stage (an interrupted deploy resumes).
    """
    o = dict(opts)
    device = o.pop("profile_name")
    try:
        deploy(o.pop("out"), device=device, echo=click.echo, recipe=stage_recipe, **o)
    except VerifyFailed:
        sys.exit(1)  # the verify stage printed its report


__all__ = ["STAGES", "command_context", "deploy_cmd", "stage_recipe"]
