"""Budgets, one parser for ``edgeprune prune`` and ``edgeprune derive``: ``--flops 0.5`` (a fraction
of the dense model) or ``--flops 2.3G`` (absolute).

A budget is ``{"kind": K, "value": v}`` where K is a registered budget kind
(:func:`edgeprune.allocation.cost.list_cost_models`: ``flops``, ``params``; a new kind is a new
registered cost model, nothing here changes): ``0 < v <= 1`` is a fraction of the dense (unpruned
input) model, ``v > 1`` an absolute count (FLOPs per image, = 2 x MACs, or parameters).
Suffixes k / M / G / T multiply by 1e3 / 1e6 / 1e9 / 1e12 (case-insensitive; an optional trailing
"FLOPs" / "params" word is not accepted -- numbers only).

A kind whose cost model declares a ``unit`` (``latency``: ``"ms"``) reads its absolute budgets
with that unit and only with it: ``--latency 12ms`` is ``{"value": 12.0, "unit": "ms"}`` (absolute,
even below 1 ms), ``--latency 0.5`` a fraction of the dense model, and a bare number > 1 is refused
as ambiguous. A kind whose cost model declares ``needs_table`` (``latency``) carries the path of its
table in the budget (``{"table": path}``; ``make_budget(table=...)``); without one the message is
the cost model's ``missing_table`` line (the command that makes a table).
"""

from __future__ import annotations

import math
import os
import re

from edgeprune.allocation.cost import COST_MODELS, list_cost_models
from edgeprune.errors import UserError

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)\s*$")


def budget_kinds() -> list[str]:
    """The budget kinds a budget may name: the registered cost models (``flops``, ``params``, ...)."""
    return list_cost_models()


def kind_unit(kind: str) -> str | None:
    """The unit of a kind's absolute budgets when its cost model declares one (``latency``: "ms")."""
    return getattr(COST_MODELS.get(kind), "unit", None)


def parse_with_unit(text, kind: str, unit: str) -> tuple[float, bool]:
    """``"12ms"`` -> (12.0, True) (absolute), ``"0.5"`` / 0.5 -> (0.5, False) (a fraction).

    Raises:
        UserError: not a number with an optional ``unit`` suffix, <= 0, not finite, or a bare
            number > 1 (a fraction must be <= 1; an absolute budget names its unit).
    """
    raw = text.strip() if isinstance(text, str) else text
    absolute = isinstance(raw, str) and raw.lower().endswith(unit.lower())
    if absolute:
        raw = raw[: -len(unit)]
    m = _NUMBER.match(raw) if isinstance(raw, str) else None
    if isinstance(raw, str) and (m is None or m.group(2)):  # no k/M/G suffix: the unit says it
        raise UserError(f"--{kind} must be a fraction of the dense model (e.g. 0.5) or a value in {unit} "
                        f"(e.g. 12{unit}), got {text!r}")
    value = parse_budget_value(raw, kind)
    if not absolute and value > 1:
        raise UserError(f"--{kind} {text!r} is ambiguous: give a fraction of the dense model in (0, 1] "
                        f"(e.g. 0.5) or a value with its unit (e.g. {value:g}{unit})")
    return value, absolute


def parse_budget_value(text, kind: str = "flops") -> float:
    """``"0.5"`` -> 0.5, ``"2.3G"`` -> 2.3e9, ``"20M"`` -> 2e7, a number -> itself.

    Args:
        text: a str (CLI) or a number (Python API).
        kind: the budget kind (for the message: ``--<kind>``).

    Returns:
        the value, > 0 (<= 1: a fraction; > 1: an absolute count).

    Raises:
        UserError: not a number with an optional k/M/G/T suffix, or <= 0, or not finite.
    """
    if isinstance(text, bool):
        raise UserError(f"--{kind} must be a number, got {text!r}")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _NUMBER.match(str(text))
        if not m:
            raise UserError(f"--{kind} must be a fraction of the dense model (e.g. 0.5) or a count with an "
                            f"optional k/M/G/T suffix (e.g. 2.3G), got {text!r}")
        value = float(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise UserError(f"--{kind} must be > 0 (a fraction in (0, 1] or an absolute count), got {text!r}")
    return value


def make_budget(flops=None, params=None, *, table=None, **kinds) -> dict | None:
    """The budget dict (``CorpConfig.budget``, NuWa's budget) from at most one of ``flops=``,
    ``params=`` or ``<kind>=`` for another registered kind (CLI strings or numbers), or None.
    ``table``: the path of the kind's table (kinds whose cost model ``needs_table``: ``latency``).

    Raises:
        UserError: more than one given, an unregistered kind, a bad value
            (:func:`parse_budget_value`, :func:`parse_with_unit`), a table missing for a kind that
            needs one or given for one that does not.
    """
    given = {k: v for k, v in {"flops": flops, "params": params, **kinds}.items() if v is not None}
    for k in given:
        if k not in budget_kinds():
            raise UserError(f"unknown budget kind {k!r} (choose from {', '.join(budget_kinds())})")
    if len(given) > 1:
        names = [f"--{k}" for k in given]
        if len(names) == 2:
            raise UserError(f"give either {names[0]} or {names[1]}, not both")
        raise UserError(f"give one budget, not several: {', '.join(names)}")
    if not given:
        if table is not None:
            raise UserError("--latency-table goes with --latency (a latency budget); no latency budget was given")
        return None
    ((kind, value),) = given.items()
    unit = kind_unit(kind)
    if unit is None:
        budget = {"kind": kind, "value": parse_budget_value(value, kind)}
    else:
        v, absolute = parse_with_unit(value, kind, unit)
        budget = {"kind": kind, "value": v, **({"unit": unit} if absolute else {})}
    if table is not None:
        budget["table"] = os.fspath(table)
    _check_table(budget)
    return budget


def _check_table(budget: dict) -> None:
    """A kind that needs a table has one (a path); no other kind carries one.

    Raises:
        UserError: the cost model's ``missing_table`` line, or a table given with another kind.
    """
    factory = COST_MODELS.get(budget["kind"])
    needs = bool(getattr(factory, "needs_table", False))
    table = budget.get("table")
    if needs and not table:
        raise UserError(getattr(factory, "missing_table", f"the {budget['kind']} budget needs a table"))
    if table is not None and not needs:
        raise UserError(f"a table goes with a latency budget, not with --{budget['kind']}")
    if table is not None and not isinstance(table, str):
        raise UserError(f"the {budget['kind']} budget's table must be a path, got {table!r}")


def validate_budget(budget: dict) -> None:
    """Checks a budget dict (e.g. ``CorpConfig.budget`` given from Python).

    Raises:
        UserError: not a ``{"kind": K, "value": v}`` dict, K not a registered kind (the message lists
            :func:`budget_kinds`), or v not a finite number > 0.
    """
    kinds = budget_kinds()
    if not isinstance(budget, dict) or "kind" not in budget:
        raise UserError(f"budget must be {{'kind': {' | '.join(repr(k) for k in kinds)}, 'value': v}}, got {budget!r}")
    if budget["kind"] not in kinds:
        raise UserError(f"unknown budget kind {budget['kind']!r} (choose from {', '.join(kinds)})")
    v = budget.get("value")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or not math.isfinite(v):
        raise UserError(f"the {budget['kind']} budget must be > 0, got {v!r}")
    unit = budget.get("unit")
    if unit is not None and unit != kind_unit(budget["kind"]):
        raise UserError(f"the {budget['kind']} budget's unit must be {kind_unit(budget['kind'])!r}, got {unit!r}")
    if unit is None and kind_unit(budget["kind"]) is not None and float(v) > 1:
        raise UserError(f"the {budget['kind']} budget {v!r} is a fraction (<= 1) unless it names its unit "
                        f"({{'unit': {kind_unit(budget['kind'])!r}}})")
    _check_table(budget)


def target_cost(budget: dict, dense_cost: float) -> float:
    """Absolute budget: ``value * dense_cost`` for a fraction (value <= 1, no unit), else ``value``."""
    v = float(budget["value"])
    return v * dense_cost if is_fraction(budget) else v


def is_fraction(budget: dict) -> bool:
    """Whether the budget's value is a fraction of the dense model (<= 1) rather than a count."""
    return budget.get("unit") is None and float(budget["value"]) <= 1.0


def exceeds_dense(budget: dict, dense_cost: float) -> bool:
    """Whether the budget asks for at least the dense model's cost (nothing has to be pruned):
    an absolute value >= ``dense_cost`` or the fraction 1. The caller decides what to say (the
    allocation then keeps the budget's targeted modules dense)."""
    return target_cost(budget, dense_cost) >= dense_cost


def describe(budget: dict) -> str:
    """``"flops 0.5"`` / ``"params 2.3e+07"`` / ``"latency 12ms"`` (for logs and run directory names)."""
    return f"{budget['kind']} {float(budget['value']):g}{budget.get('unit') or ''}"
