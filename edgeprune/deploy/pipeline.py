"""``edgeprune.deploy(...)``: from a checkpoint to a deployable model (issue 42; its Python face: issue 53).

Stages, each a library job (:mod:`edgeprune.jobs`) with the settings of the separate command: prune
(``OUT/run``) -> heal (``OUT/healed``; only with ``heal=True``, :mod:`.heal`) -> export (``OUT/model.onnx``,
and the dense model's ``OUT/dense.onnx`` for the benchmark) -> verify (``OUT/verify.json``) -> quantize to the
profile's precision (``OUT/model-int8.onnx`` / ``model-fp16.onnx``; none for fp32) -> build the TensorRT engine
(``OUT/model.engine``; TensorRT profiles only, where TensorRT is installed: else the deploy stops there with
the ``edgeprune build`` line to run on the device) -> bench the deployed model vs the dense one on the
profile's backend (``OUT/bench.json``). ``OUT/report.md`` / ``report.json`` (:mod:`.report`) sum it up;
``OUT/stages.json`` (:mod:`.state`) lets a rerun skip the stages whose settings and inputs are unchanged (a
redone stage says why, in one line).

Settings refused before any stage finished leave no folder behind: a folder this run made is removed
again, and an earlier deploy's outputs that the refused stage would have replaced are put back.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from devices import load_profile
from edgeprune.budget.latency import LatencyCost
from edgeprune.deploy.plan import Recipe, plan
from edgeprune.deploy.report import write_report
from edgeprune.deploy.settings import deploy_sections
from edgeprune.deploy.state import STAGES, DeployState, hash_paths, hash_settings, is_deploy_folder, setting_values
from edgeprune.errors import UserError
from edgeprune.jobs.echo import Echo, echo as _echo
from edgeprune.jobs.models import torch_device_of
from edgeprune.tokens.schedule import AUTO, parse_tokens_merge

_BUDGETS = ("sparsity", "flops", "params", "latency")


@dataclasses.dataclass
class DeployResult:
    """Outcome of :func:`deploy`: the deploy folder, ``report.md`` / ``report.json``, each stage's status
    (done / skipped / pending), the report's content, and the line saying where the deploy stopped (or None)."""

    out: Path
    report_md: Path
    report_json: Path
    stages: dict[str, str]
    report: dict[str, Any]
    stopped: str | None


def deploy(out: str | Path, *, device: str, model_name: str = "fmnist-vit", checkpoint: str | Path | None = None,
           random_init: bool = False, num_classes: int | None = None, img_size: int | None = None,
           model_kwargs: dict | None = None, calib_dir: str | Path | None = None, calib_size: int | None = None,
           seed: int = 0, batch_size: int = 32, eval_data: str | Path | None = None, eval_size: int | None = None,
           sparsity: float | None = None, flops: str | None = None, params: str | None = None,
           latency: str | None = None, latency_table: str | Path | None = None, tokens_merge: str | None = None,
           precision: str | None = None, torch_device: str | None = None, heal: bool = False,
           heal_epochs: int | None = None, heal_lr: float | None = None, bench: bool = True,
           bench_iterations: int | None = None, quiet: bool = False, echo: Echo = _echo,
           recipe: Recipe | None = None) -> DeployResult:
    """Prune, (heal,) export, verify, quantize, build and bench into the deploy folder ``out``.

    Give one budget (``sparsity``, ``flops``, ``params``, or ``latency`` with ``latency_table``) and a device
    profile (``device``: cpu, rtx3090, orin-nx or a .toml file). The settings are those of ``edgeprune
    deploy``'s options (``calib_dir`` is ``--calib``). A rerun with the same settings reuses every finished
    stage. ``echo(line, err=False)`` says what happens; ``recipe`` writes the stages' recipe files (the CLI's:
    without it a Python deploy writes none).

    Raises:
        UserError: bad settings (one line), before any stage when they can be checked first.
        edgeprune.jobs.verify.VerifyFailed: the ONNX file does not compute what the PyTorch model computes.
    """
    o = dict(out=Path(out), profile_name=device, model_name=model_name, checkpoint=checkpoint,
             random_init=random_init, num_classes=num_classes, img_size=img_size, model_kwargs=model_kwargs,
             calib_dir=calib_dir, calib_size=calib_size, seed=seed, batch_size=batch_size, eval_data=eval_data,
             eval_size=eval_size, sparsity=sparsity, flops=flops, params=params, latency=latency,
             latency_table=latency_table, tokens_merge=tokens_merge, precision=precision, torch_device=torch_device,
             heal=heal, heal_epochs=heal_epochs, heal_lr=heal_lr, bench=bench, bench_iterations=bench_iterations,
             quiet=quiet)
    o = check(o)
    o["echo"] = echo
    state = DeployState(o["out"])
    made, had_state = _missing_folders(o["out"]), state.path.is_file()
    if o.get("adopted") and not o["quiet"]:
        echo(f"{o['out']}: no {state.path.name}, but its files are a deploy's: every stage is redone", err=True)
    o["out"].mkdir(parents=True, exist_ok=True)
    state.save()  # OUT is a deploy's from now on: a rerun after Ctrl-C in the first stage is accepted
    try:
        return _deploy(o, state, recipe)
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


def _deploy(o: dict[str, Any], state: DeployState, recipe: Recipe | None) -> DeployResult:
    """The stages of the plan, in order (reused, redone, skipped, or left to do on the device), then the report."""
    steps = plan(o, recipe)
    t_all = time.perf_counter()
    stopped = None
    for i, name in enumerate(STAGES):
        step = steps[name]
        if step.get("skip") or step.get("stop"):
            if state.stages.get(name, {}).get("status") == "done":
                state.forget(name)  # e.g. the precision became fp32: the old quantized file goes
        if step.get("skip"):
            state.record(name, {"status": "skipped", "why": step["skip"]})
            continue
        if step.get("stop"):
            stopped = _stop(state, steps, i)
            break
        run_stage(state, name, step, o["quiet"], o["echo"])
    report = write_report(o["out"], state, o)
    o["echo"](f"report: {report} ({time.perf_counter() - t_all:.1f} s)")
    if stopped:
        o["echo"](stopped)
    return DeployResult(out=o["out"], report_md=report, report_json=o["out"] / "report.json",
                        stages={n: str(e.get("status")) for n, e in state.stages.items()},
                        report=_read_json(o["out"] / "report.json"), stopped=stopped)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _stop(state: DeployState, steps: dict[str, dict[str, Any]], i: int) -> str:
    """Record the stages from ``STAGES[i]`` on as left to do on the device; the line saying so."""
    commands = []
    for later in STAGES[i:]:
        if state.stages.get(later, {}).get("status") == "done":
            state.forget(later)  # an earlier deploy's engine / bench: not this model's
        if steps[later].get("skip"):
            state.record(later, {"status": "skipped", "why": steps[later]["skip"]})
            continue
        commands.append(steps[later]["command"])
        state.record(later, {"status": "pending", "why": "left to do on the device: run its command there",
                             "command": steps[later]["command"]})
    return f"{steps[STAGES[i]]['stop']}; on the device run: {' && '.join(commands)}"


def run_stage(state: DeployState, name: str, step: dict[str, Any], quiet: bool = False, echo: Echo = _echo) -> None:
    """Run one stage unless its settings and inputs are unchanged (then it is reused); a stage that ran
    before and is redone says why on stderr (unless ``quiet``) and in its entry (``redone``).

    A stage that refuses (a UserError before it wrote any output) as the first stage this run redoes
    leaves the earlier deploy's outputs in place (:meth:`DeployState.set_aside`)."""
    labelled = step["inputs"]
    settings, inputs = hash_settings(step["settings"]), hash_paths(list(labelled.values()))
    each = functools.cache(lambda: {label: hash_paths([p]) for label, p in labelled.items()})
    why = state.stale(name, settings, inputs, step["settings"], each)
    if why is None:
        echo(f"== {name}: unchanged, reused ({state.stages[name].get('seconds', 0):.1f} s before)")
        return
    redone = state.stages.get(name, {}).get("status") == "done"
    echo(f"== {name}: {step['what']}")
    if redone and not quiet:
        echo(f"{name}: redone ({why})", err=True)
    aside = state.set_aside(name, step["outputs"])
    t0 = time.perf_counter()
    try:
        step["run"]()
    except UserError:
        aside.restore()
        raise
    finally:
        aside.drop()
    state.record(name, {"status": "done", "settings": settings, "inputs": inputs, "what": step["what"],
                        "values": setting_values(step["settings"]), "input_hashes": each(),
                        "outputs": state.outputs_hash(step["outputs"]), "seconds": round(time.perf_counter() - t0, 3),
                        **({"redone": why} if redone else {})})


def check(opts: dict[str, Any]) -> dict[str, Any]:
    """The settings, checked before any work; adds ``budget``, ``adopted``, ``profile``, and resolves
    ``precision`` and ``torch_device``.

    Raises:
        UserError: no budget or two, a latency budget without a table, a bad deploy setting (``SettingError``:
            ``heal_epochs`` without ``heal`` ...), a bad profile, ``out`` an existing file
            or a folder that is not a deploy's, a missing data folder, a bad ``tokens_merge`` (or one with a
            latency table without a token axis).
    """
    o = dict(opts)
    o["out"] = Path(o["out"])
    budgets = [b for b in _BUDGETS if o.get(b) is not None]
    if len(budgets) > 1:
        raise UserError(f"--{budgets[0]} and --{budgets[1]}: two budgets (give one)")
    if not budgets:
        raise UserError("no budget: give one of --sparsity S, --flops F, --params P, --latency F --latency-table T")
    if o.get("latency_table") is not None and o.get("latency") is None:
        raise UserError("--latency-table goes with --latency (the table a latency budget is priced on)")
    o["budget"] = budgets[0]
    deploy_sections(o)  # the deploy's own settings (edgeprune.deploy.settings): one line naming the first bad one
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
        LatencyCost.check_table_tokens_merge(o["latency_table"])  # a table without a token axis
    profile = load_profile(o["profile_name"])  # a missing profile: one line
    o["profile"] = profile
    o["precision"] = o["precision"] or profile.precision
    o["torch_device"] = torch_device_of(o["profile_name"], o["torch_device"])
    return o


__all__ = ["DeployResult", "check", "deploy", "run_stage"]
