"""Recipe files: ``--config FILE.toml`` of the commands that make something (issue 42).

A recipe holds the same options as the command line, in sections::

    [model]                      [budget]                 [output]
    model = "fmnist-vit"         flops = "0.5"            out = "runs/fm-flops"
    [data]                       [corp]                   [runtime]
    calib-size = 256             criterion = "combined"   torch-device = "cpu"

A key is an option's long name without the dashes (``--calib-size`` -> ``calib-size``; a flag pair
``--verify-latency/--no-verify-latency`` -> ``verify-latency = true|false``; a positional
argument by its name, ``run-dir``). :data:`SECTIONS` maps a command's own options to its tables; a
command whose settings are declared (``RecipeCommand(settings_sections=...)``, ``edgeprune.settings``: prune,
derive's correction) has one table per section, named as the section (``[corp]``, ``[allocation]``,
``[correction]`` ...; :func:`command_tables`). Recipes of 9c01182 put those keys in ``[budget]`` /
``[method]``: still read there (:data:`LEGACY_SECTIONS`); a recipe is written in the sections.
The command line overrides the file (the file's values are click's ``default_map``;
click's ``ParameterSource`` tells the two apart); a budget typed on the command line replaces the
file's budget. A key at its option's default is the same as no key.

Refused, in one line naming the key and the file (before any work): a file that is not TOML, an
unknown section or key, a key in another section than its own, a value of the wrong type, out of
range or not finite (``nan``, ``inf`` for any key), two budgets (``flops`` + ``params``, or a
sparsity beside a budget), and ``force = true`` (issue 52: a recipe never overwrites; ``--force`` is
typed).

:func:`write_recipe` writes the resolved recipe of a run (every option with its value, the
defaults marked, the unset ones as comments, never ``force``), atomically: ``RUN/recipe.toml`` for
prune, heal and derive, ``<output>.recipe.toml`` for quantize and latency-table.

A replay is exact (issue 52): a measured run's ``[replay]`` section and a report that follows ``-o``
are :mod:`edgeprune.cli.recipe_replay`'s; TOML values are :mod:`edgeprune.cli.recipe_toml`'s.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from edgeprune.cli.generate import section_table
from edgeprune.cli.recipe_replay import (REPLAY, REPLAYS, ReplayMeasurer, follow_output, read_replay, replay_lines,
                                         replay_measurer, replay_rounds, tokens_choice)
from edgeprune.cli.recipe_toml import META_FILE, META_KEYS, META_REPLAY, convert_value, negated, shown, toml_value
from edgeprune.errors import UserError
from edgeprune.settings import write_recipe_text

#: the order of a command's own tables; its declared settings' sections go after ``data``, in their order
ORDER = ("model", "data", "budget", "method", "heal", "output", "runtime")

_MODEL = ["model", "model-file", "backbone", "checkpoint", "random-init", "num-classes", "img-size", "model-kwargs"]
_CALIB = ["calib", "calib-size", "seed", "batch-size"]
_EVAL = ["eval-data", "eval-size", "no-eval"]
_DEVICE = ["device", "torch-device", "quiet"]

#: command -> section -> option keys (every option of the command, in one section)
SECTIONS: dict[str, dict[str, list[str]]] = {
    "prune": {  # the job's own options; the settings' tables are their sections (edgeprune.pruning.settings)
        "model": _MODEL,
        "data": _CALIB + _EVAL,
        "output": ["out"],
        "runtime": _DEVICE,
    },
    "heal": {  # the job's own options; the settings' table is their section (edgeprune.heal.settings)
        "model": ["run-dir"],
        "data": _CALIB + _EVAL,
        "output": ["out"],
        "runtime": _DEVICE,
    },
    "derive": {  # the job's own options; the settings' tables are their sections (edgeprune.nuwa.settings)
        "model": _MODEL + ["classes"],
        "data": ["data", "train-data", "train-per-class", "calib", "calib-size", "val-size", "seed"] + _EVAL,
        "output": ["out"],
        "runtime": ["threads"] + _DEVICE,
    },
    "quantize": {  # the job's own options; the settings' tables are their sections (edgeprune.jobs.quantize_settings)
        "model": ["model"],
        "data": ["calib", "calib-size", "seed", "eval-data", "eval-size"],
        "output": ["output", "force", "json"],
    },
    "deploy": {
        "model": _MODEL,
        "data": _CALIB + ["eval-data", "eval-size"],
        "budget": ["sparsity", "flops", "params", "latency", "latency-table"],
        "method": ["precision", "tokens-merge"],
        "heal": ["heal", "heal-epochs", "heal-lr"],
        "output": ["out"],
        "runtime": ["device", "torch-device", "bench", "bench-iterations", "quiet"],
    },
    "latency-table": {  # the job's own options; the settings' table is their section (edgeprune.latency.settings)
        "model": _MODEL,
        "output": ["out", "force"],
        "runtime": ["device", "quiet"],
    },
}

#: where a key stood in the recipes of 9c01182 (before the settings had their sections, issue 53): still read there
LEGACY_SECTIONS: dict[str, dict[str, list[str]]] = {
    "prune": {
        "budget": ["target", "sparsity", "mlp-sparsity", "attn-sparsity", "v-sparsity", "head-sparsity", "flops",
                   "params", "latency", "latency-table", "latency-tolerance", "latency-rounds", "verify-latency"],
        "method": ["layout", "criterion", "no-compensation", "ridge-alpha", "qk-ridge-alpha", "qk-solver", "round-to",
                   "gram-tokens", "check-images", "sensitivity-images", "bias-correction", "head-refit", "last-block",
                   "embed-sparsity", "embed-order", "embed-refit", "sequential", "tokens-merge"],
    },
    "heal": {"data": ["holdout"], "runtime": ["cache-targets", "memory-budget-mb"],
             "method": ["epochs", "lr", "min-lr", "warmup-steps", "weight-decay", "loss", "keep-best"]},
    "derive": {
        "budget": ["latency-tolerance", "latency-rounds", "verify-latency"],
        "method": ["slice-head", "skp-steps", "skp-batch-size", "skp-eval-every", "lr-beta", "lr-mask",
                   "weight-decay", "rho", "key-bias", "ridge-alpha"],
        "runtime": ["no-cache"],
    },
    "deploy": {"method": ["precision"], "runtime": ["bench", "bench-iterations"]},  # edgeprune.deploy.settings
    "quantize": {"method": ["precision", "mode", "recipe", "weight-rounding", "calib-method", "per-tensor",
                            "asymmetric-activations", "exclude", "quantize-attention", "smooth-alpha", "auto-exclude",
                            "max-drop"], "runtime": ["threads"]},  # edgeprune.jobs.quantize_settings
    "latency-table": {"method": ["batch", "precision", "backend", "warmup", "iterations", "max-seconds", "statistic",
                                 "interleave", "clock", "repeats", "spread", "retries", "tokens"],
                      "runtime": ["threads"]},  # edgeprune.latency.settings
}

#: the budget keys: at most one per recipe (a sparsity key is the fourth kind, "sparsity")
BUDGET_KEYS = ("flops", "params", "latency")
SPARSITY_KEYS = ("sparsity", "mlp-sparsity", "attn-sparsity", "v-sparsity", "head-sparsity")

#: options that are never recipe keys (help, the recipe itself)
NOT_RECIPE = ("help", "help_all", "config")

#: keys a recipe never records and never reads as true (issue 52): a replay overwrites nothing a user has unless the
#: command line asks (``--force``); a deploy's quantize recipe recorded ``force = true``, and its replay rewrote the
#: deploy's files in place
NEVER_RECORDED = ("force",)


def param_key(param: click.Parameter) -> str:
    """The recipe key of a click parameter: its first long option name without ``--`` (the name of
    a positional argument, with dashes)."""
    if isinstance(param, click.Option):
        longs = [o for o in param.opts if o.startswith("--")]
        if longs:
            return longs[0][2:]
    return str(param.name).replace("_", "-")


def recipe_params(command: click.Command) -> dict[str, click.Parameter]:
    """``{key: parameter}`` of the command's recipe keys (help and --config left out)."""
    return {param_key(p): p for p in command.params if p.name not in NOT_RECIPE}


def command_tables(command: click.Command) -> dict[str, list[str]]:
    """``{section: keys}`` of a command: its job options (:data:`SECTIONS`), then the tables of its declared
    settings (``settings_sections``: one table per section, ``edgeprune.cli.generate.section_table``)."""
    table = dict(SECTIONS.get(str(command.name), {}))
    table.update(section_table(getattr(command, "settings_sections", ())))
    return table


def section_order(command: click.Command) -> list[str]:
    """The command's tables in file / help order: ``model``, ``data``, its declared settings' sections (in their
    order), then the rest of :data:`ORDER`."""
    declared = [s.name for s in getattr(command, "settings_sections", ())]
    order = [s for s in ORDER[:2] if s not in declared] + declared + [s for s in ORDER[2:] if s not in declared]
    tables = set(command_tables(command))
    return [s for s in order if s in tables] + sorted(tables - set(order))


def section_of(command: click.Command) -> dict[str, str]:
    """``{key: section}`` of a command's options (:func:`command_tables`); an option the table does not
    name yet goes to ``method`` (tests/test_recipes.py asks for every option in the table)."""
    table = {k: s for s, keys in command_tables(command).items() for k in keys}
    return {k: table.get(k, "method") for k in recipe_params(command)}


def legacy_section_of(command: click.Command) -> dict[str, str]:
    """``{key: section}`` of the keys a recipe of 9c01182 placed elsewhere (:data:`LEGACY_SECTIONS`)."""
    return {k: s for s, keys in LEGACY_SECTIONS.get(str(command.name), {}).items() for k in keys}


# ---- reading ------------------------------------------------------------------------------------
def plain_default(param: click.Parameter, ctx: click.Context) -> Any:
    """The option's own default (not a recipe's; None for click's "unset" sentinel)."""
    saved, ctx.default_map = ctx.default_map, None
    try:
        d = param.get_default(ctx, call=False)
    finally:
        ctx.default_map = saved
    return None if type(d).__name__ == "Sentinel" else d


#: option defaults of 9c01182 that its recipes wrote as ``# default`` lines and that are "not given" (None) now (issue
#: 53: a setting not given is None, so that a setting given where nothing reads it is refused): a key at that value
#: counts as no key, as it did
LEGACY_DEFAULTS: dict[str, dict[str, Any]] = {"prune": {"sparsity": 0.5, "verify_budget": True},
                                              "derive": {"verify_budget": True}}


def _is_default(param: click.Parameter, value: Any, ctx: click.Context) -> bool:
    """Whether a recipe value equals the option's default or its 9c01182 default (:data:`LEGACY_DEFAULTS`; then
    the key counts as not given)."""
    legacy = LEGACY_DEFAULTS.get(str(ctx.command.name), {})
    if param.name in legacy and value == legacy[str(param.name)] \
            and isinstance(value, bool) is isinstance(legacy[str(param.name)], bool):
        return True
    d = plain_default(param, ctx)
    if callable(d):
        return False
    if param.multiple:
        return list(value or []) == list(d or [])
    if isinstance(value, bool) or isinstance(d, bool) or d is None:
        return value is d
    return bool(value == d)


def load_recipe(path: str | Path, command: click.Command, ctx: click.Context) -> dict[str, Any]:
    """The ``default_map`` of a recipe file for ``command``: ``{parameter name: value}`` of every key
    that is not at its option's default.

    Raises:
        UserError: a missing or non-TOML file, an unknown section or key, a key in the wrong section,
            a bad value, two budgets (one line naming the key and the file).
    """
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {p}: no such file (a recipe .toml, e.g. RUN/recipe.toml)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"--config {p}: cannot read it: {err}") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{p}: not valid TOML: {err}") from None
    name = str(command.name)
    params, sections, legacy = recipe_params(command), section_of(command), legacy_section_of(command)
    out: dict[str, Any] = {}
    keys: dict[str, str] = {}  # key -> "[section]"
    for section, table in data.items():
        if section == REPLAY and name in REPLAYS:
            ctx.meta[META_REPLAY] = read_replay(p, table)
            continue
        if section not in set(sections.values()) | set(legacy.values()):
            if not isinstance(table, dict):
                raise UserError(f"{p}: {section} = ...: keys go into a section "
                                f"([{sections.get(section, 'model')}] ...), not at the top")
            raise UserError(f"{p}: unknown section [{section}] for {name} (sections: "
                            f"{', '.join(section_order(command))})")
        if not isinstance(table, dict):
            raise UserError(f"{p}: {section} must be a section ([{section}]), not a value")
        for key, value in table.items():
            where = f"{p}: [{section}]"
            if key not in params:
                near = difflib.get_close_matches(key.replace("_", "-"), list(params), n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise UserError(f"{where} {key}: unknown key for edgeprune {name}{hint}")
            if sections.get(key) != section and legacy.get(key) != section:
                raise UserError(f"{where} {key}: belongs in [{sections.get(key)}]")
            param = params[key]
            value = convert_value(param, key, value, where, ctx)
            if key in NEVER_RECORDED and value:
                raise UserError(f"{where} {key} = {shown(value)}: a recipe never overwrites (type --{key} on the "
                                "command line to overwrite)")
            if not _is_default(param, value, ctx):
                out[str(param.name)] = value
                keys[key] = f"[{section}]"
    _check_budgets(p, keys)
    return out


def _check_budgets(path: Path, keys: dict[str, str]) -> None:
    """At most one budget in a recipe: one of flops / params / latency, or sparsities.

    Raises:
        UserError: naming both keys and the file.
    """
    budgets = [k for k in BUDGET_KEYS if k in keys]
    if len(budgets) > 1:
        raise UserError(f"{path}: [budget] {budgets[0]} and {budgets[1]}: two budgets (keep one)")
    sparsities = [k for k in SPARSITY_KEYS if k in keys]
    if budgets and sparsities:
        raise UserError(f"{path}: [budget] {budgets[0]} and {sparsities[0]}: two budgets (a {budgets[0]} budget "
                        "allocates the sparsities itself; keep one)")


def _config_callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    if value is None or ctx.resilient_parsing:
        return value
    default_map = load_recipe(value, ctx.command, ctx)
    ctx.default_map = {**(ctx.default_map or {}), **default_map}
    ctx.meta[META_FILE] = str(value)
    ctx.meta[META_KEYS] = {str(p.name): k for k, p in recipe_params(ctx.command).items() if p.name in default_map}
    return value


def config_option() -> click.Option:
    """The ``--config FILE.toml`` option (eager: read before the other options take their values)."""
    return click.Option(["--config"], metavar="FILE.toml", default=None, is_eager=True, expose_value=False,
                        callback=_config_callback,
                        help="Read the options from a recipe file (sections model, data, budget, method, output, "
                             "runtime; e.g. RUN/recipe.toml); the command line overrides it.")


def budget_from_command_line(ctx: click.Context) -> None:
    """A budget typed on the command line replaces the recipe's budget: the file's other budget keys
    (flops / params / latency / the sparsities) go back to their defaults (and the file's ``[replay]``
    measurements, which were its budget's, are not used: :func:`replay_measurer`)."""
    names = {"flops", "params", "latency", "sparsity", "mlp_sparsity", "attn_sparsity", "v_sparsity",
             "head_sparsity"}
    present = {n for n in names if n in ctx.params}
    typed = {n for n in present if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE}
    if not typed:
        return
    by_name = {p.name: p for p in ctx.command.params}
    for n in present - typed:
        if ctx.get_parameter_source(n) == ParameterSource.DEFAULT_MAP:
            d = plain_default(by_name[n], ctx)
            ctx.params[n] = d() if callable(d) else d
            ctx.set_parameter_source(n, ParameterSource.DEFAULT)
            ctx.meta.get(META_KEYS, {}).pop(n, None)


def name_recipe_keys(ctx: click.Context, err: UserError) -> UserError:
    """``err`` with `` (KEY from FILE)`` added when its message names an option that the recipe
    set (so a conflict found by a command's own checks still names the file)."""
    keys = ctx.meta.get(META_KEYS) or {}
    named = [k for k in keys.values()
             if re.search(rf"--(no-)?{re.escape(k)}(?![\w-])|^{re.escape(k)} ", str(err))]
    if named and ctx.meta.get(META_FILE) and ctx.meta[META_FILE] not in str(err):
        err.args = (f"{err} ({', '.join(named)} from {ctx.meta[META_FILE]})", *err.args[1:])
    return err


# ---- writing ------------------------------------------------------------------------------------
def recipe_text(ctx: click.Context, values: dict[str, Any] | None = None, notes: dict[str, str] | None = None,
                replay: list[dict[str, Any]] | None = None) -> str:
    """The resolved recipe of the running command: every option with its value (``values`` replaces
    some, e.g. the output folder chosen by default, or a choice a measurement made), by section;
    ``# default`` marks an option at its default, an unset option is a comment, ``notes`` (key ->
    text) are comment lines above their keys, :data:`NEVER_RECORDED` keys are comments, and ``replay``
    (:func:`replay_rounds`) is the ``[replay]`` section of a measured run."""
    name = str(ctx.command.name)
    params, sections = recipe_params(ctx.command), section_of(ctx.command)
    values, notes = values or {}, notes or {}
    lines = [f"# edgeprune {name} recipe (resolved: every option with its value).",
             f"# Replay: edgeprune {name} --config THIS_FILE [-o NEW]; options typed on the command line win."]
    for section in section_order(ctx.command):
        keys = [k for k in params if sections[k] == section]
        if not keys:
            continue
        lines += ["", f"[{section}]"]
        for key in keys:
            p = params[key]
            if key in notes:
                lines += [f"# {line}" for line in notes[key].splitlines()]
            if key in NEVER_RECORDED:
                lines.append(f"# {key} = (never recorded: a replay overwrites nothing unless --{key} is typed)")
                continue
            v = values.get(key, ctx.params.get(str(p.name)))
            src = ctx.get_parameter_source(str(p.name))
            if isinstance(v, Path):
                v = str(v)
            if v is None or (p.multiple and not v):
                lines.append(f"# {key} = (not set)")
                continue
            if negated(p) and isinstance(v, bool) and key not in values:
                v = not v  # the key says whether the flag is on (--no-compensation), the setting is its opposite
            mark = "  # default" if src in (ParameterSource.DEFAULT, None) and key not in values else ""
            lines.append(f"{key} = {toml_value(list(v) if isinstance(v, tuple) else v)}{mark}")
    if replay:
        lines += replay_lines(replay)
    return "\n".join(lines) + "\n"


def write_recipe(ctx: click.Context, path: str | Path, values: dict[str, Any] | None = None,
                 notes: dict[str, str] | None = None, replay: list[dict[str, Any]] | None = None) -> Path:
    """Write :func:`recipe_text` to ``path`` atomically; returns the path.

    Raises:
        RuntimeFault / OSError: the write failed (the CLI's handler: one line).
    """
    p = Path(path)
    write_recipe_text(p, recipe_text(ctx, values, notes, replay))
    return p


# ---- a measured run's exact replay (issue 52) ---------------------------------------------------
def output_recipe_path(output: str | Path) -> Path:
    """``<output>.recipe.toml`` beside a file output (quantize, latency-table)."""
    o = Path(output)
    return o.with_name(o.name + ".recipe.toml")


__all__ = ["SECTIONS", "LEGACY_SECTIONS", "BUDGET_KEYS", "NEVER_RECORDED", "REPLAY", "ReplayMeasurer",
           "budget_from_command_line", "command_tables", "config_option", "follow_output", "legacy_section_of",
           "load_recipe", "name_recipe_keys", "output_recipe_path", "param_key", "recipe_params", "recipe_text",
           "replay_measurer", "replay_rounds", "section_of", "section_order", "tokens_choice", "write_recipe"]
