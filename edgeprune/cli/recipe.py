"""Recipe files: ``--config FILE.toml`` of the commands that make something (issue 42).

A recipe holds the same options as the command line, in sections::

    [model]                      [budget]                 [runtime]
    model = "fmnist-vit"         flops = "0.5"            torch-device = "cpu"
    [data]                       [method]                 [output]
    calib-size = 256             criterion = "combined"   out = "runs/fm-flops"

A key is an option's long name without the dashes (``--calib-size`` -> ``calib-size``; a flag pair
``--verify-latency/--no-verify-latency`` -> ``verify-latency = true|false``; a positional
argument by its name, ``run-dir``). :data:`SECTIONS` maps every option of every command to one
section. The command line overrides the file (the file's values are click's ``default_map``;
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

A replay is exact (issue 52). A ``--latency`` run of prune or derive is decided by measurements
(the correction round closest to the budget is kept), so its recipe has a ``[replay]`` section with
what each round measured (:func:`replay_rounds`); a replay of the file's budget hands those out
instead of measuring (:class:`ReplayMeasurer`), makes the run's rounds (checked: else refused) and
gives the run's model; ``--verify-latency`` or a budget typed on the command line measures again,
said in one line (:func:`replay_measurer`). A report the recipe wrote beside its output follows a
``-o`` typed on the command line (:func:`follow_output`).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any, Callable

import click
from click.core import ParameterSource

from edgeprune.atomic import atomic_write_text
from edgeprune.errors import UserError

#: ``ctx.meta`` keys: the recipe file given with --config, the keys it set, and its ``[replay]`` measurements
META_FILE = "edgeprune.recipe_file"
META_KEYS = "edgeprune.recipe_keys"
META_REPLAY = "edgeprune.recipe_replay"

#: the section of a measured run's recipe that holds what it measured (issue 52; not options: :func:`replay_measurer`),
#: and the commands that write and read it (their ``--latency`` runs are measured and corrected)
REPLAY = "replay"
REPLAYS = ("prune", "derive")

ORDER = ("model", "data", "budget", "method", "heal", "output", "runtime")

_MODEL = ["model", "checkpoint", "random-init", "num-classes", "img-size", "model-kwargs"]
_CALIB = ["calib", "calib-size", "seed", "batch-size"]
_EVAL = ["eval-data", "eval-size", "no-eval"]
_DEVICE = ["device", "torch-device", "quiet"]

#: command -> section -> option keys (every option of the command, in one section)
SECTIONS: dict[str, dict[str, list[str]]] = {
    "prune": {
        "model": _MODEL,
        "data": _CALIB + _EVAL,
        "budget": ["target", "sparsity", "mlp-sparsity", "attn-sparsity", "v-sparsity", "head-sparsity", "flops",
                   "params", "latency", "latency-table", "latency-tolerance", "latency-rounds", "verify-latency"],
        "method": ["layout", "criterion", "no-compensation", "ridge-alpha", "qk-ridge-alpha", "qk-solver", "round-to",
                   "gram-tokens", "check-images", "sensitivity-images", "bias-correction", "head-refit", "last-block",
                   "embed-sparsity", "embed-order", "embed-refit", "sequential", "tokens-merge"],
        "output": ["out"],
        "runtime": _DEVICE,
    },
    "heal": {
        "model": ["run-dir"],
        "data": _CALIB + _EVAL + ["holdout"],
        "method": ["epochs", "lr", "min-lr", "warmup-steps", "weight-decay", "loss", "keep-best"],
        "output": ["out"],
        "runtime": ["cache-targets", "memory-budget-mb"] + _DEVICE,
    },
    "derive": {
        "model": _MODEL + ["classes"],
        "data": ["data", "train-data", "train-per-class", "calib", "calib-size", "val-size", "seed"] + _EVAL,
        "budget": ["flops", "params", "latency", "latency-table", "latency-tolerance", "latency-rounds",
                   "verify-latency"],
        "method": ["slice-head", "skp-steps", "skp-batch-size", "skp-eval-every", "lr-beta", "lr-mask",
                   "weight-decay", "rho", "key-bias", "ridge-alpha"],
        "output": ["out"],
        "runtime": ["no-cache", "threads"] + _DEVICE,
    },
    "quantize": {
        "model": ["model"],
        "data": ["calib", "calib-size", "seed", "eval-data", "eval-size"],
        "method": ["precision", "mode", "recipe", "weight-rounding", "calib-method", "per-tensor",
                   "asymmetric-activations", "exclude", "quantize-attention", "smooth-alpha", "auto-exclude",
                   "max-drop"],
        "output": ["output", "force", "json"],
        "runtime": ["threads"],
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
    "latency-table": {
        "model": _MODEL,
        "method": ["batch", "precision", "backend", "warmup", "iterations", "max-seconds", "statistic",
                   "interleave", "clock", "repeats", "spread", "retries", "tokens"],
        "output": ["out", "force"],
        "runtime": ["device", "threads", "quiet"],
    },
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


def section_of(command: click.Command) -> dict[str, str]:
    """``{key: section}`` of a command's options (:data:`SECTIONS`); an option the table does not
    name yet goes to ``method`` (tests/test_recipes.py asks for every option in the table)."""
    table = {k: s for s, keys in SECTIONS.get(str(command.name), {}).items() for k in keys}
    return {k: table.get(k, "method") for k in recipe_params(command)}


# ---- reading ------------------------------------------------------------------------------------
def _kind_error(param: click.Parameter, value: Any) -> str | None:
    """Why ``value`` (a TOML value) has the wrong type for ``param``, or None."""
    t = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return None if isinstance(value, bool) else "wants true or false"
    if isinstance(value, bool):
        number = isinstance(t, (click.types.IntParamType, click.types.FloatParamType))
        return f"wants {'a number' if number else 'a string'}, not true/false"
    if isinstance(t, click.types.IntParamType):
        return None if isinstance(value, int) else "wants an integer"
    if isinstance(t, click.types.FloatParamType):
        return None if isinstance(value, (int, float)) else "wants a number"
    if param.name == "model_kwargs":
        return None if isinstance(value, (dict, str)) else "wants a table (inline: {depth = 6}) or a string"
    if isinstance(t, click.types.StringParamType):  # budgets: "0.5" or 0.5, "2.3G", "12ms"
        return None if isinstance(value, (str, int, float)) else "wants a string"
    return None if isinstance(value, str) else "wants a string"


def _non_finite(value: Any) -> bool:
    """Whether a TOML value is, or holds (in a list or inline table), a float that is not finite."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(_non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    return False


def _shown(value: Any) -> str:
    """A recipe value as a message shows it: its TOML text, non-finite floats included (``nan``, ``inf``,
    ``-inf``, TOML's own spelling); never raises (:func:`_toml_value` refuses them: a recipe never holds one)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_shown(x) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_shown(x)}" for k, x in value.items()) + "}"
    return _toml_value(value)


def _convert(param: click.Parameter, key: str, value: Any, where: str, ctx: click.Context) -> Any:
    """The value of one recipe key, checked by the option's own type (click's conversion).

    Raises:
        UserError: one line naming the key and the file.
    """
    if value is None:
        return None
    if _non_finite(value):  # nan / inf / -inf anywhere (TOML has them), for any key: before the type check
        raise UserError(f"{where} {key} = {_shown(value)}: not a finite number")
    items = value if param.multiple else None
    if param.multiple and not isinstance(value, list):
        raise UserError(f"{where} {key} = {_shown(value)}: wants a list (--{key} is repeatable)")
    for v in items if items is not None else [value]:
        why = _kind_error(param, v)
        if why:
            raise UserError(f"{where} {key} = {_shown(v)}: {why}")
        if param.name == "model_kwargs" or (isinstance(param, click.Option) and param.is_flag):
            continue
        try:
            param.type.convert(str(v) if isinstance(param.type, click.types.StringParamType) else v, param, ctx)
        except click.BadParameter as err:
            raise UserError(f"{where} {key} = {_shown(v)}: {err.message}") from None
    if isinstance(value, dict):  # model-kwargs: an inline table -> the option's K=V,... text (values as JSON)
        return ",".join(f"{k}={json.dumps(v)}" for k, v in value.items())
    if items is None and isinstance(param.type, click.types.StringParamType):
        return str(value)
    return value


def plain_default(param: click.Parameter, ctx: click.Context) -> Any:
    """The option's own default (not a recipe's; None for click's "unset" sentinel)."""
    saved, ctx.default_map = ctx.default_map, None
    try:
        d = param.get_default(ctx, call=False)
    finally:
        ctx.default_map = saved
    return None if type(d).__name__ == "Sentinel" else d


def _is_default(param: click.Parameter, value: Any, ctx: click.Context) -> bool:
    """Whether a recipe value equals the option's default (then the key counts as not given)."""
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
    params, sections = recipe_params(command), section_of(command)
    out: dict[str, Any] = {}
    keys: dict[str, str] = {}  # key -> "[section]"
    for section, table in data.items():
        if section == REPLAY and name in REPLAYS:
            ctx.meta[META_REPLAY] = _read_replay(p, table)
            continue
        if section not in set(sections.values()):
            if not isinstance(table, dict):
                raise UserError(f"{p}: {section} = ...: keys go into a section "
                                f"([{sections.get(section, 'model')}] ...), not at the top")
            raise UserError(f"{p}: unknown section [{section}] for {name} (sections: "
                            f"{', '.join(s for s in ORDER if s in sections.values())})")
        if not isinstance(table, dict):
            raise UserError(f"{p}: {section} must be a section ([{section}]), not a value")
        for key, value in table.items():
            where = f"{p}: [{section}]"
            if key not in params:
                near = difflib.get_close_matches(key.replace("_", "-"), list(params), n=1)
                hint = f" (did you mean {near[0]}?)" if near else ""
                raise UserError(f"{where} {key}: unknown key for edgeprune {name}{hint}")
            if sections.get(key) != section:
                raise UserError(f"{where} {key}: belongs in [{sections.get(key)}]")
            param = params[key]
            value = _convert(param, key, value, where, ctx)
            if key in NEVER_RECORDED and value:
                raise UserError(f"{where} {key} = {_shown(value)}: a recipe never overwrites (type --{key} on the "
                                "command line to overwrite)")
            if not _is_default(param, value, ctx):
                out[str(param.name)] = value
                keys[key] = f"[{section}]"
    _check_budgets(p, keys)
    return out


def _read_replay(path: Path, table: Any) -> list[dict[str, Any]]:
    """The ``[replay]`` section of a recipe: ``latency = [{budget-value, predicted, measured = {dense_ms,
    pruned_ms, ratio, ...}}, ...]``, one entry per round of the run's measured latency correction.

    Raises:
        UserError: another shape (one line naming the file and the field).
    """
    where = f"{path}: [{REPLAY}]"
    if not isinstance(table, dict):
        raise UserError(f"{where} must be a section, not a value")
    unknown = sorted(set(table) - {"latency"})
    if unknown:
        raise UserError(f"{where} {unknown[0]}: unknown key (the section holds latency = [...], what the run measured)")
    rounds = table.get("latency")
    if not isinstance(rounds, list) or not rounds:
        raise UserError(f"{where} latency: wants a list of the run's rounds ({{budget-value, predicted, measured}})")
    if _non_finite(rounds):
        raise UserError(f"{where} latency: not a finite number in {_shown(rounds)}")
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0

    for i, r in enumerate(rounds):
        m = r.get("measured") if isinstance(r, dict) else None
        if (not isinstance(r, dict) or not number(r.get("budget-value")) or not number(r.get("predicted"))
                or not isinstance(m, dict) or not all(number(m.get(k)) for k in ("dense_ms", "pruned_ms", "ratio"))):
            raise UserError(f"{where} latency[{i}] = {_shown(r)}: wants {{budget-value = V, predicted = P, measured = "
                            "{dense_ms = D, pruned_ms = M, ratio = R}} (numbers > 0)")
    return rounds


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
             if re.search(rf"--(no-)?{re.escape(k)}\b|^{re.escape(k)} ", str(err))]
    if named and ctx.meta.get(META_FILE) and ctx.meta[META_FILE] not in str(err):
        err.args = (f"{err} ({', '.join(named)} from {ctx.meta[META_FILE]})", *err.args[1:])
    return err


# ---- writing ------------------------------------------------------------------------------------
_BARE = re.compile(r"[A-Za-z0-9_-]+")


def _toml_value(v: Any) -> str:
    """One TOML value: a boolean, integer, finite float, string, list or inline table."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"not a finite number: {v}")
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v), ensure_ascii=False)  # a TOML basic string (JSON's escapes are TOML's)


def _toml_key(k: str) -> str:
    return k if _BARE.fullmatch(k) else json.dumps(k, ensure_ascii=False)


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
    for section in ORDER:
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
            mark = "  # default" if src in (ParameterSource.DEFAULT, None) and key not in values else ""
            lines.append(f"{key} = {_toml_value(list(v) if isinstance(v, tuple) else v)}{mark}")
    if replay:
        kept = next((i for i, r in enumerate(replay) if r.get("kept")), len(replay) - 1)
        lines += ["", "# What the run measured (issue 52): each round of its latency correction (the budget value the",
                  "# table was asked for, its prediction, the measurement). A replay with this latency budget uses",
                  "# these measurements instead of measuring again: the same rounds, the same model (the run kept "
                  f"round {kept}).", "# To measure again: delete this section, or type --verify-latency.",
                  f"[{REPLAY}]", "latency = ["]
        lines += [f"  {_toml_value({k: v for k, v in r.items() if k != 'kept'})}," for r in replay]
        lines.append("]")
    return "\n".join(lines) + "\n"


def write_recipe(ctx: click.Context, path: str | Path, values: dict[str, Any] | None = None,
                 notes: dict[str, str] | None = None, replay: list[dict[str, Any]] | None = None) -> Path:
    """Write :func:`recipe_text` to ``path`` atomically; returns the path.

    Raises:
        RuntimeFault / OSError: the write failed (the CLI's handler: one line).
    """
    p = Path(path)
    atomic_write_text(p, recipe_text(ctx, values, notes, replay))
    return p


# ---- a measured run's exact replay (issue 52) ---------------------------------------------------
def _toml_plain(v: Any) -> bool:
    """Whether ``v`` can be written as a TOML value (no None, no non-finite float)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return False
    if isinstance(v, (list, tuple)):
        return all(_toml_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_toml_plain(x) for x in v.values())
    return isinstance(v, (bool, int, float, str))


def replay_rounds(rec: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The ``[replay]`` entries of a run whose latency was measured (``latency_check.rounds``): per round the
    budget value asked of the table, the prediction and the measurement (its plain fields); ``kept`` marks the
    round the run kept. None when nothing was measured (a replay then measures nothing either, or measures as
    the run would have: the model is the same unless the table's backend appeared)."""
    chk = rec.get("latency_check")
    rounds = chk.get("rounds") if isinstance(chk, dict) else None
    if not rounds:
        return None
    kept = int(chk.get("chosen_round") or 0)
    return [{"budget-value": float(r["budget_value"]), "predicted": float(r["predicted"]),
             "measured": {k: v for k, v in (r.get("measured_ms") or {}).items() if _toml_plain(v)},
             "kept": r.get("round", i) == kept} for i, r in enumerate(rounds)]


def tokens_choice(ctx: click.Context, rec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``(values, notes)`` of a ``--tokens-merge auto`` run whose candidates were measured: its recipe replays the
    chosen schedule (the ``[replay]`` section holds that candidate's measurements only); else ``({}, {})``."""
    auto = rec.get("tokens_auto")
    if ctx.params.get("tokens_merge") != "auto" or not isinstance(auto, dict) or replay_rounds(rec) is None:
        return {}, {}
    chosen = auto.get("chosen")
    text = ",".join(str(r) for r in chosen) if isinstance(chosen, list) else str(chosen)
    return {"tokens-merge": text}, {"tokens-merge": f'the run asked "auto", which chose {text} after each candidate\'s '
                                                   "measured correction: its replay prunes with that schedule"}


class ReplayMeasurer:
    """The measurer of a replay (``edgeprune.pruning.latency_loop.Measurer``): hands out the recorded measurement
    of each round in turn, measures nothing; :meth:`check` then confirms that the replay made the run's rounds."""

    def __init__(self, rounds: list[dict[str, Any]], where: str) -> None:
        self.rounds, self.where, self.calls = rounds, where, 0

    def __call__(self, dense: Any, pruned: Any) -> dict[str, Any]:
        if self.calls >= len(self.rounds):
            raise UserError(f"{self.where}: the replay asks for round {self.calls} of the latency correction, the run "
                            f"made {len(self.rounds)}: {self._why}")
        self.calls += 1
        return dict(self.rounds[self.calls - 1]["measured"])

    _why = ("the recorded measurements do not fit this prune (an option typed on the command line, the data or the "
            "latency table changed); type --verify-latency to measure again")

    def check(self, rec: dict[str, Any]) -> str:
        """The line that says the replay used the recorded measurements, after confirming each round asked the
        table for the run's value and got the run's prediction.

        Raises:
            UserError: another round than the run's (nothing is written yet).
        """
        chk = rec.get("latency_check") or {}
        got = [(float(r["budget_value"]), float(r["predicted"])) for r in chk.get("rounds") or []]
        want = [(float(r["budget-value"]), float(r["predicted"])) for r in self.rounds]
        for i, (g, w) in enumerate(zip(got, want)):
            if not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(g, w)):
                raise UserError(f"{self.where}: round {i} of the replay asked the table for {g[0]:.6g} (predicted "
                                f"{g[1]:.6g}), the run for {w[0]:.6g} (predicted {w[1]:.6g}): {self._why}")
        if len(got) != len(want):
            raise UserError(f"{self.where}: the replay made {len(got)} rounds of the latency correction, the run "
                            f"{len(want)}: {self._why}")
        chk["replayed"] = f"the measurements recorded in {self.where} (nothing measured again)"
        return (f"latency: the {len(want)} measurement(s) recorded in {self.where} replayed, nothing measured again: "
                f"the run's rounds, round {chk.get('chosen_round', 0)} kept (--verify-latency: measure again)")


def replay_measurer(ctx: click.Context, say: Callable[[str], None] = click.echo) -> ReplayMeasurer | None:
    """The measurer of a recipe's ``[replay]`` section (:class:`ReplayMeasurer`) when the replay is of the file's
    own latency budget, else None. Not used (said in one line): a budget typed on the command line (a new budget
    is measured), or ``--verify-latency`` / ``--no-verify-latency`` typed (measure again / do not measure)."""
    rounds = ctx.meta.get(META_REPLAY)
    if not rounds:
        return None
    where = f"{ctx.meta.get(META_FILE)} [{REPLAY}]"
    typed = [f"--{n}" for n in ("latency", "flops", "params") if n in ctx.params
             and ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]
    if ctx.get_parameter_source("verify_latency") == ParameterSource.COMMANDLINE:
        typed.append("--verify-latency" if ctx.params.get("verify_latency") else "--no-verify-latency")
    if typed or ctx.get_parameter_source("latency") != ParameterSource.DEFAULT_MAP:
        say(f"the recorded measurements of {where} are not used ({', '.join(typed) or 'no latency budget'} "
            "on the command line)")
        return None
    return ReplayMeasurer(rounds, where)


def _same_path(a: Path, b: Path) -> bool:
    return a.resolve(strict=False) == b.resolve(strict=False)


def follow_output(ctx: click.Context, name: str, output_name: str, suffix: str) -> Path | None:
    """The new value of an output-derived path option (issue 52: a report the recipe wrote beside its
    output) when ``-o`` moved the output of a replay: parameter ``name`` came from the recipe, the output
    (parameter ``output_name``) was typed on the command line and differs from the recipe's, and the
    recipe's value lies in the folder of the recipe's output. Then ``<new output's stem><suffix>`` beside
    the new output (never the old report: a replay elsewhere leaves the first run's files as they are);
    else None (the value stays: an existing file is then refused without ``--force``)."""
    if (ctx.get_parameter_source(name) != ParameterSource.DEFAULT_MAP
            or ctx.get_parameter_source(output_name) != ParameterSource.COMMANDLINE):
        return None
    old_out = (ctx.default_map or {}).get(output_name)
    new_out, value = ctx.params.get(output_name), ctx.params.get(name)
    if old_out is None or new_out is None or value is None:
        return None
    old_out, new_out, value = Path(old_out), Path(new_out), Path(value)
    if _same_path(old_out, new_out) or not _same_path(value.parent, old_out.parent):
        return None
    return new_out.with_name(new_out.stem + suffix)


def output_recipe_path(output: str | Path) -> Path:
    """``<output>.recipe.toml`` beside a file output (quantize, latency-table)."""
    o = Path(output)
    return o.with_name(o.name + ".recipe.toml")


__all__ = ["SECTIONS", "BUDGET_KEYS", "NEVER_RECORDED", "REPLAY", "ReplayMeasurer", "budget_from_command_line",
           "config_option", "follow_output", "load_recipe", "name_recipe_keys", "output_recipe_path", "param_key",
           "recipe_params", "recipe_text", "replay_measurer", "replay_rounds", "section_of", "tokens_choice",
           "write_recipe"]
