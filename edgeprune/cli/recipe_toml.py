"""TOML values of recipe files (:mod:`edgeprune.cli.recipe`): how a value is written, how a message shows one, which
values a recipe cannot hold; and the ``ctx.meta`` keys under which ``--config``'s file travels through a command."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import click

from edgeprune.errors import UserError

#: ``ctx.meta`` keys: the recipe file given with --config, the keys it set, and its ``[replay]`` measurements
META_FILE = "edgeprune.recipe_file"
META_KEYS = "edgeprune.recipe_keys"
META_REPLAY = "edgeprune.recipe_replay"

_BARE = re.compile(r"[A-Za-z0-9_-]+")


def toml_value(v: Any) -> str:
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
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{toml_key(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v), ensure_ascii=False)  # a TOML basic string (JSON's escapes are TOML's)


def toml_key(k: str) -> str:
    return k if _BARE.fullmatch(k) else json.dumps(k, ensure_ascii=False)


def toml_plain(v: Any) -> bool:
    """Whether ``v`` can be written as a TOML value (no None, no non-finite float)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return False
    if isinstance(v, (list, tuple)):
        return all(toml_plain(x) for x in v)
    if isinstance(v, dict):
        return all(toml_plain(x) for x in v.values())
    return isinstance(v, (bool, int, float, str))


def non_finite(value: Any) -> bool:
    """Whether a TOML value is, or holds (in a list or inline table), a float that is not finite."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return any(non_finite(v) for v in value)
    if isinstance(value, dict):
        return any(non_finite(v) for v in value.values())
    return False


def shown(value: Any) -> str:
    """A recipe value as a message shows it: its TOML text, non-finite floats included (``nan``, ``inf``,
    ``-inf``, TOML's own spelling); never raises (:func:`toml_value` refuses them: a recipe never holds one)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(shown(x) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(str(k))} = {shown(x)}" for k, x in value.items()) + "}"
    return toml_value(value)


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


def negated(param: click.Parameter) -> bool:
    """A flag that sets its setting False (``--no-compensation`` of ``compensation``): its recipe key says whether
    the flag is on (``no-compensation = true`` = compensation off), so the value is the setting's, inverted."""
    return isinstance(param, click.Option) and bool(param.is_flag) and param.flag_value is False


def convert_value(param: click.Parameter, key: str, value: Any, where: str, ctx: click.Context) -> Any:
    """The value of one recipe key (a TOML value), checked by the option's own type (click's conversion).

    Raises:
        UserError: one line naming the key and the file.
    """
    if value is None:
        return None
    if non_finite(value):  # nan / inf / -inf anywhere (TOML has them), for any key: before the type check
        raise UserError(f"{where} {key} = {shown(value)}: not a finite number")
    items = value if param.multiple else None
    if param.multiple and not isinstance(value, list):
        raise UserError(f"{where} {key} = {shown(value)}: wants a list (--{key} is repeatable)")
    for v in items if items is not None else [value]:
        why = _kind_error(param, v)
        if why:
            raise UserError(f"{where} {key} = {shown(v)}: {why}")
        if param.name == "model_kwargs" or (isinstance(param, click.Option) and param.is_flag):
            continue
        try:
            param.type.convert(str(v) if isinstance(param.type, click.types.StringParamType) else v, param, ctx)
        except click.BadParameter as err:
            raise UserError(f"{where} {key} = {shown(v)}: {err.message}") from None
    if isinstance(value, dict):  # model-kwargs: an inline table -> the option's K=V,... text (values as JSON)
        return ",".join(f"{k}={json.dumps(v)}" for k, v in value.items())
    if items is None and isinstance(param.type, click.types.StringParamType):
        return str(value)
    if negated(param):
        return not value
    return value



__all__ = ["META_FILE", "META_KEYS", "META_REPLAY", "convert_value", "negated", "non_finite", "shown", "toml_key",
           "toml_plain", "toml_value"]
