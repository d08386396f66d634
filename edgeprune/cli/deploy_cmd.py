"""``edgeprune deploy``: from a checkpoint to a deployable model in one command (issue 42).

Stages, each the callback of the separate command, run in-process with the same settings (so the
numbers are those of the separate commands): prune (``OUT/run``) -> heal (``OUT/healed``; only with
``--heal``, :mod:`.deploy_heal`) -> export (``OUT/model.onnx``,
and the dense model's ``OUT/dense.onnx`` for the benchmark) -> verify (``OUT/verify.json``) ->
quantize to the profile's precision (``OUT/model-int8.onnx`` / ``model-fp16.onnx``; none for fp32)
-> build the TensorRT engine (``OUT/model.engine``; TensorRT profiles only, where TensorRT is
installed: else the deploy stops there, exit 0, with the ``edgeprune build`` line to run on the
device) -> bench the deployed model vs the dense one on the profile's backend (``OUT/bench.json``).
``OUT/report.md`` / ``report.json`` (:mod:`.deploy_report`) sum it up, with the ``edgeprune build`` /
``bench`` lines left to run on the device; ``OUT/stages.json`` (:mod:`.deploy_state`) lets a rerun
skip the stages whose settings and inputs are unchanged (a redone stage says why, in one line).

Settings refused before any stage finished (by deploy's own checks or by the first stage's command,
e.g. ``--sparsity 1``) leave no folder behind: a folder this run made is removed again, and an
earlier deploy's outputs that the refused stage would have replaced are put back.
"""

from __future__ import annotations

import functools
import os
import shlex
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
from click.core import ParameterSource

from devices import load_profile
from edgeprune.cli.deploy import export_cmd, verify_cmd
from edgeprune.cli.deploy_heal import check_heal, heal_step
from edgeprune.cli.deploy_report import write_report
from edgeprune.cli.deploy_state import (STAGES, DeployState, hash_paths, hash_settings, is_deploy_folder,
                                        setting_values)
from edgeprune.cli.device import bench_cmd, build_cmd
from edgeprune.cli.device_options import torch_device_of
from edgeprune.cli.help import RecipeCommand
from edgeprune.cli.options import (FINITE, calibration_options, eval_options, latency_table_option, model_options,
                                   quiet_option)
from edgeprune.cli.prune import prune_cmd
from edgeprune.cli.quantize import quantize_cmd
from edgeprune.budget.latency import LatencyCost
from edgeprune.errors import UserError
from edgeprune.tokens.schedule import AUTO, parse_tokens_merge
from runners.registry import backend_available

_BUDGETS = ("sparsity", "flops", "params", "latency")


def call_command(ctx: click.Context, cmd: click.Command, **given: Any) -> Any:
    """Run ``cmd``'s callback in-process as if ``given`` were typed on its command line: the other
    options take their defaults, and click's parameter sources say which is which (the commands'
    checks of "given vs default" and their resolved recipes see what a user's command line gives)."""
    sub = click.Context(cmd, info_name=cmd.name, parent=ctx)
    kwargs: dict[str, Any] = {}
    for p in cmd.params:
        if not p.expose_value:
            continue
        if p.name in given:
            kwargs[str(p.name)] = given[str(p.name)]
            sub.set_parameter_source(str(p.name), ParameterSource.COMMANDLINE)
        else:
            d = p.get_default(sub)
            kwargs[str(p.name)] = p.type_cast_value(sub, None if type(d).__name__ == "Sentinel" else d)
            sub.set_parameter_source(str(p.name), ParameterSource.DEFAULT)
    sub.params.update(kwargs)
    with sub:
        return cmd.callback(**kwargs)  # type: ignore[misc]


@click.command("deploy", cls=RecipeCommand)
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
    ctx = click.get_current_context()
    o = _check(opts)
    state = DeployState(o["out"])
    made, had_state = _missing_folders(o["out"]), state.path.is_file()
    if o.get("adopted") and not o["quiet"]:
        click.echo(f"{o['out']}: no {state.path.name}, but its files are a deploy's: every stage is redone", err=True)
    o["out"].mkdir(parents=True, exist_ok=True)
    state.save()  # OUT is a deploy's from now on: a rerun after Ctrl-C in the first stage is accepted
    try:
        _deploy(ctx, o, state)
    except UserError:
        if not had_state and not state.stages:
            _remove_unused(state, made)  # refused before any stage finished: leave no folder behind
        raise


def _missing_folders(out: Path) -> list[Path]:
    """The folders ``mkdir(parents=True)`` of ``out`` would create, deepest first."""
    made, p = [], out.absolute()
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    return made


def _remove_unused(state: DeployState, made: list[Path]) -> None:
    """Remove the (empty) ``stages.json`` this run wrote, then the folders this run made that are empty
    (never a folder that was there before): OUT is as it was before the deploy."""
    try:
        state.path.unlink(missing_ok=True)
        for folder in made:
            if os.listdir(folder):
                break  # something else is in it: left as it is
            folder.rmdir()
    except OSError:
        pass  # not ours to remove: left as it is


def _deploy(ctx: click.Context, o: dict[str, Any], state: DeployState) -> None:
    """The stages of the plan, in order (reused, redone, skipped, or left to do on the device), then the report."""
    plan = _plan(o)
    t_all = time.perf_counter()
    stopped = None
    for i, name in enumerate(STAGES):
        step = plan[name]
        if step.get("skip") or step.get("stop"):
            if state.stages.get(name, {}).get("status") == "done":
                state.forget(name)  # e.g. the precision became fp32: the old quantized file goes
        if step.get("skip"):
            state.record(name, {"status": "skipped", "why": step["skip"]})
            continue
        if step.get("stop"):
            commands = []
            for later in STAGES[i:]:
                if state.stages.get(later, {}).get("status") == "done":
                    state.forget(later)  # an earlier deploy's engine / bench: not this model's
                if plan[later].get("skip"):
                    state.record(later, {"status": "skipped", "why": plan[later]["skip"]})
                    continue
                commands.append(plan[later]["command"])
                state.record(later, {"status": "pending", "why": "left to do on the device: run its command there",
                                     "command": plan[later]["command"]})
            stopped = f"{step['stop']}; on the device run: {' && '.join(commands)}"
            break
        _run_stage(ctx, state, name, step, o["quiet"])
    report = write_report(o["out"], state, o)
    click.echo(f"report: {report} ({time.perf_counter() - t_all:.1f} s)")
    if stopped:
        click.echo(stopped)


def _run_stage(ctx: click.Context, state: DeployState, name: str, step: dict[str, Any], quiet: bool = False) -> None:
    """Run one stage unless its settings and inputs are unchanged (then it is reused); a stage that ran
    before and is redone says why on stderr (unless ``quiet``) and in its entry (``redone``).

    A stage that refuses (a UserError before it wrote any output) as the first stage this run redoes
    leaves the earlier deploy's outputs in place (:meth:`DeployState.set_aside`)."""
    labelled = step["inputs"]
    settings, inputs = hash_settings(step["settings"]), hash_paths(list(labelled.values()))
    each = functools.cache(lambda: {label: hash_paths([p]) for label, p in labelled.items()})
    why = state.stale(name, settings, inputs, step["settings"], each)
    if why is None:
        click.echo(f"== {name}: unchanged, reused ({state.stages[name].get('seconds', 0):.1f} s before)")
        return
    redone = state.stages.get(name, {}).get("status") == "done"
    click.echo(f"== {name}: {step['what']}")
    if redone and not quiet:
        click.echo(f"{name}: redone ({why})", err=True)
    aside = state.set_aside(name, step["outputs"])
    t0 = time.perf_counter()
    try:
        step["run"](ctx)
    except UserError:
        aside.restore()
        raise
    finally:
        aside.drop()
    state.record(name, {"status": "done", "settings": settings, "inputs": inputs, "what": step["what"],
                        "values": setting_values(step["settings"]), "input_hashes": each(),
                        "outputs": state.outputs_hash(step["outputs"]), "seconds": round(time.perf_counter() - t0, 3),
                        **({"redone": why} if redone else {})})


def _check(opts: dict[str, Any]) -> dict[str, Any]:
    """The options, checked before any work; adds ``profile``, ``precision``, ``torch_device``.

    Raises:
        UserError: no budget or two, a latency budget without a table, a bad profile, -o an existing file
            or a folder that is not a deploy's, a missing data folder, a bad --tokens-merge (or one with a latency
            table without a token axis).
    """
    o = dict(opts)
    budgets = [b for b in _BUDGETS if o.get(b) is not None]
    if len(budgets) > 1:
        raise UserError(f"--{budgets[0]} and --{budgets[1]}: two budgets (give one)")
    if not budgets:
        raise UserError("no budget: give one of --sparsity S, --flops F, --params P, --latency F --latency-table T")
    if o.get("latency_table") is not None and o.get("latency") is None:
        raise UserError("--latency-table goes with --latency (the table a latency budget is priced on)")
    o["budget"] = budgets[0]
    check_heal(o)
    out: Path = o["out"]
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: is a file (the deploy folder: a new folder or an earlier deploy's)")
    o["adopted"] = out.is_dir() and any(out.iterdir()) and not (out / "stages.json").is_file()
    if o["adopted"] and not is_deploy_folder(out):
        raise UserError(f"-o {out}: exists and is not a deploy folder (no stages.json): choose a new folder")
    for option, path in (("--calib", o["calib_dir"]), ("--eval-data", o["eval_data"]),
                         ("--checkpoint", o["checkpoint"]), ("--latency-table", o["latency_table"])):
        if path is not None and not Path(path).exists():
            raise UserError(f"{option} {path}: no such file or folder")
    if parse_tokens_merge(o.get("tokens_merge")) == AUTO and o["budget"] != "latency":
        raise UserError("--tokens-merge auto needs a --latency budget (a table with a token axis prices the merges); "
                        "give a schedule (R, r0,r1,... or decreasing:R) with --sparsity/--flops/--params")
    if parse_tokens_merge(o.get("tokens_merge")) is not None and o["budget"] == "latency" and o.get("latency_table"):
        LatencyCost.check_tokens_merge(SimpleNamespace(table=o["latency_table"]))  # a table without a token axis
    profile = load_profile(o["profile_name"])  # a missing profile: one line
    o["profile"] = profile
    o["precision"] = o["precision"] or profile.precision
    o["torch_device"] = torch_device_of(o["profile_name"], o["torch_device"])
    return o


def _plan(o: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per stage: ``settings`` (hashed), ``inputs`` (``{label: path}``, hashed in order), ``outputs`` (under
    OUT), ``run`` (ctx -> summary dict), ``what``, ``command`` (the line to run it on the device: build, bench);
    or ``skip`` (why) / ``stop`` (why it stops there)."""
    out, profile, prec = o["out"], o["profile"], o["precision"]
    run, onnx, dense = out / "run", out / "model.onnx", out / "dense.onnx"
    final_run = out / "healed" if o["heal"] else run
    model_keys = ("model_name", "checkpoint", "random_init", "num_classes", "img_size", "model_kwargs")
    model = {k: o[k] for k in model_keys}
    data = {k: o[k] for k in ("calib_dir", "calib_size", "seed", "eval_data", "eval_size")}
    plan: dict[str, dict[str, Any]] = {}
    prune = {**model, **data, "batch_size": o["batch_size"], o["budget"]: o[o["budget"]],
             "latency_table": o["latency_table"], "torch_device": o["torch_device"],
             **({"tokens_merge": o["tokens_merge"]} if o["tokens_merge"] is not None else {})}  # older hashes kept
    inputs = {"--checkpoint": o["checkpoint"], "--latency-table": o["latency_table"], **_data_listings(o)}
    plan["prune"] = {"settings": prune, "inputs": inputs, "outputs": ["run"],
                     "what": f"prune {o['model_name']} with a {o['budget']} budget of {o[o['budget']]}",
                     "run": lambda ctx: call_command(ctx, prune_cmd, out=str(run), quiet=o["quiet"],
                                                     **{k: v for k, v in prune.items() if v is not None})}
    plan["heal"] = heal_step(o, run, out / "healed", _listing, call_command)
    plan["export"] = {"settings": {**model, "opset": 17}, "inputs": {f"{final_run.name}/": final_run},
                      "outputs": ["model.onnx", "dense.onnx"],
                      "what": "export the pruned and the dense model to ONNX (opset 17, dynamic batch)",
                      "run": lambda ctx: _export(ctx, final_run, onnx, dense, model)}
    n = o["eval_size"] or 64
    plan["verify"] = {"settings": {"n": n, "eval_data": o["eval_data"]},
                      "inputs": {f"{final_run.name}/": final_run, onnx.name: onnx},
                      "outputs": ["verify.json"], "what": f"ONNX Runtime vs PyTorch on {n} evaluation images",
                      "run": lambda ctx: call_command(ctx, verify_cmd, onnx_file=onnx, run_dir=final_run, n=n,
                                                      data=o["eval_data"], json_out=out / "verify.json")}
    final = onnx if prec == "fp32" else out / f"model-{prec}.onnx"
    plan["quantize"] = _quantize_step(o, onnx, final)
    engine = out / "model.engine"
    plan["build"] = _build_step(o, final, engine)
    target = engine if profile.uses_tensorrt else final
    plan["bench"] = _bench_step(o, target, dense)
    return plan


def _listing(path: Any) -> str | None:
    """A data folder as a cheap hash of its listing (paths, sizes, times), or None."""
    return None if path is None else f"listing:{hash_paths([path], content=False)}"


def _data_listings(o: dict[str, Any]) -> dict[str, str | None]:
    """The inputs ``--calib`` and ``--eval-data`` of a stage, as :func:`_listing` hashes them."""
    return {"--calib": _listing(o["calib_dir"]), "--eval-data": _listing(o["eval_data"])}


def _export(ctx: click.Context, run: Path, onnx: Path, dense: Path, model: dict[str, Any]) -> None:
    """The pruned run to ``onnx`` and the dense model (the model options) to ``dense`` (for the bench)."""
    call_command(ctx, export_cmd, run_dir=run, output=onnx, force=True)
    call_command(ctx, export_cmd, output=dense, force=True, **{k: v for k, v in model.items() if v})


def _quantize_step(o: dict[str, Any], onnx: Path, final: Path) -> dict[str, Any]:
    prec, profile = o["precision"], o["profile"]
    if prec == "fp32":
        return {"skip": f"the {profile.name} profile runs fp32: the exported model.onnx is deployed as it is"}
    mode = "dynamic" if prec == "int8" and not profile.uses_tensorrt else "static"
    recipe = "tensorrt" if prec == "int8" and mode == "static" else "auto"
    given = {"model": onnx, "precision": prec, "output": final, "mode": mode, "recipe": recipe, "force": True,
             "json_out": o["out"] / "quantize.json", "calib_dir": o["calib_dir"], "calib_size": o["calib_size"],
             "seed": o["seed"], "eval_data": o["eval_data"], "eval_size": o["eval_size"]}
    given = {k: v for k, v in given.items() if v is not None}
    settings = {k: str(v) for k, v in given.items() if k not in ("model", "output", "json_out", "force")}
    outputs = [final.name, "quantize.json", final.name + ".recipe.toml"]
    how = f" ({mode}, {recipe} recipe)" if mode == "static" and prec == "int8" else f" ({mode})" * (prec == "int8")
    return {"settings": settings, "inputs": {onnx.name: onnx, **_data_listings(o)},
            "outputs": outputs, "what": f"quantize to {prec}" + how,
            "run": lambda ctx: call_command(ctx, quantize_cmd, **given)}


def _build_step(o: dict[str, Any], final: Path, engine: Path) -> dict[str, Any]:
    profile = o["profile"]
    if not profile.uses_tensorrt:
        return {"skip": f"the {profile.name} profile runs {profile.backend}: no engine to build"}
    missing = backend_available("tensorrt")
    if missing is not None:
        cmd = shlex.join(["edgeprune", "build", str(final), "--device", o["profile_name"], "-o", str(engine)])
        return {"stop": f"stopped before build: TensorRT is not usable here ({missing})", "command": cmd}
    return {"settings": {"profile": profile.to_dict()}, "inputs": {final.name: final},
            "outputs": [engine.name, engine.name + ".json"],
            "what": f"build a TensorRT engine for {profile.name} ({o['precision']})",
            "run": lambda ctx: call_command(ctx, build_cmd, onnx_path=final, profile_name=o["profile_name"],
                                            output=engine)}


def _bench_step(o: dict[str, Any], target: Path, dense: Path) -> dict[str, Any]:
    if not o["bench"]:
        return {"skip": "--no-bench"}
    profile, out = o["profile"], o["out"]
    given = {"a": str(target), "b": str(dense), "profile_name": o["profile_name"], "json_out": out / "bench.json",
             "md_out": out / "bench.md"}
    if o["bench_iterations"] is not None:
        given["iterations"] = o["bench_iterations"]
    settings = {"profile": profile.to_dict(), "iterations": o["bench_iterations"], "memory": "per model"}
    cmd = ["edgeprune", "bench", str(target), "--vs", str(dense), "--device", o["profile_name"],
           *(["--iterations", str(o["bench_iterations"])] if o["bench_iterations"] is not None else []),
           "--json", str(out / "bench.json"), "--markdown", str(out / "bench.md")]
    return {"settings": settings, "inputs": {target.name: target, dense.name: dense},
            "outputs": ["bench.json", "bench.md"], "command": shlex.join(cmd),
            "what": f"bench {target.name} vs dense.onnx on {profile.name} ({profile.backend}, interleaved)",
            "run": lambda ctx: call_command(ctx, bench_cmd, **given)}


__all__ = ["STAGES", "call_command", "deploy_cmd"]
